"""The transformers engine: a model directory computed by its own Hugging Face modules, sharing KV caches with the
reference engine block for block.

    model = HfModel.load("models/qwen-tiny", device="cpu")          # AutoModelForCausalLM + AutoTokenizer
    engine = Engine(model, PagedKVCache.for_descriptor(model.descriptor(16)), model.descriptor(16))
    # or: Engine.load("models/qwen-tiny", engine="transformers"); kvsp-quic instance --engine transformers

:class:`HfModel` is a :class:`gpu.model.StepModel`: the prefill (:mod:`gpu.prefill`), the decode step and the
instance's :class:`gpu.engine.Engine` drive it exactly as they drive the reference model, so the transformers
engine has the same paged cache and tiers, the same layer-streamed prefill (layer l of the computed tokens starts
as soon as layer l of every loaded block has arrived), the same sessions, checkpoints and exact resume. What
differs is what computes a layer step: ``model.model.layers[l]`` (transformers' ``LlamaDecoderLayer``,
``MistralDecoderLayer``, ``Qwen2DecoderLayer``: its norms, projections with their biases, its rotary embedding
with the config's scaling, its attention through ``sdpa``, its MLP), ``model.model.embed_tokens``,
``model.model.norm`` and ``model.lm_head``.

The decoder layer reads and extends its cache through ``cache.update(k, v, layer_idx)`` (the ``Cache`` API of
``DynamicCache``): :class:`_ContextCache` answers that call from the step's context buffer, whose rows are the
layer's K and V after RoPE, token-major ``(tokens, kv_heads, head_dim)`` -- the kvsp-layout-1 section order (spec,
"KV Block Container": "token index slowest ... dimension fastest"). transformers' own ``DynamicCache`` holds the
same numbers as ``(batch, kv_heads, seq, head_dim)``; :func:`dynamic_cache_from_blocks` and
:func:`blocks_from_dynamic_cache` convert between the two, for code that runs ``model.generate`` or
``model(...)`` itself.

Exactness: a prefill that loads a prefix and computes the rest runs the very same layer steps on the same operands
as one that computes everything (chunks at block boundaries, context buffers of one size), so within one engine
they are bit-identical; across engines K and V differ by float rounding only (fp32: about 1e-6), which is what
tests/test_hf_engine_cross.py measures.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpu.kvcache import KV_DTYPES, as_octets, kv_torch_dtype, resolve_device
from gpu.model import COMPUTE_DTYPES, StoreKV
from gpu.modelfiles import DESCRIBED_FAMILIES, DTYPE_TO_KV, ModelConfig, ModelError, derive_descriptor
from kvsp_quic import __version__ as _VERSION
from kvsp_quic.compat import CompatDescriptor


class _ContextCache:
    """The ``Cache`` a decoder layer sees during one layer step: ``update`` writes the chunk's K and V (after
    RoPE, rounded through the KV element type) into rows [start, end) of the context buffers, hands them to
    *store* (the sequence's pages), and returns rows [0, end) as ``(1, kv_heads, end, head_dim)``."""

    def __init__(self, layer: int, start: int, k_ctx: torch.Tensor, v_ctx: torch.Tensor, store: StoreKV | None,
                 kv_dtype: torch.dtype) -> None:
        self.layer = layer
        self.start = start
        self.k_ctx = k_ctx
        self.v_ctx = v_ctx
        self.store = store
        self.kv_dtype = kv_dtype
        self.calls = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx != self.layer or key_states.shape[0] != 1:
            raise RuntimeError(f"cache update for layer {layer_idx} (batch {key_states.shape[0]}) during the step "
                               f"of layer {self.layer}")
        self.calls += 1
        n = key_states.shape[2]
        end = self.start + n
        k = key_states[0].transpose(0, 1)  # (n, kv_heads, head_dim)
        v = value_states[0].transpose(0, 1)
        if self.kv_dtype != k.dtype:  # the cache keeps the rounded values: attention uses what is cached
            k = k.to(self.kv_dtype).to(k.dtype)
            v = v.to(self.kv_dtype).to(v.dtype)
        self.k_ctx[self.start:end].copy_(k)
        self.v_ctx[self.start:end].copy_(v)
        if self.store is not None:
            self.store(self.k_ctx[self.start:end], self.v_ctx[self.start:end])
        return (self.k_ctx[:end].permute(1, 0, 2).unsqueeze(0), self.v_ctx[:end].permute(1, 0, 2).unsqueeze(0))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start


class HfModel:
    """A Hugging Face causal LM of the descriptor's registry (:data:`gpu.modelfiles.DESCRIBED_FAMILIES`), run one
    decoder layer at a time (a :class:`gpu.model.StepModel`)."""

    engine_name = "transformers"

    def __init__(self, hf: Any, config: ModelConfig, *, directory: str | os.PathLike[str],
                 kv_dtype: str | None = None, tokenizer: Any = None) -> None:
        self.hf = hf.eval()
        self.config = config
        self.directory = Path(directory)
        inner = getattr(hf, "model", None)
        parts = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or any(not hasattr(inner, p) for p in parts) or not hasattr(hf, "lm_head"):
            raise ModelError(f"{type(hf).__name__} is not a decoder of the Llama family (model.embed_tokens, "
                             f"model.layers, model.norm, model.rotary_emb, lm_head)")
        self.inner = inner
        self.layers = list(inner.layers)
        param = next(hf.parameters())
        self.device = param.device
        self.dtype = param.dtype
        if self.dtype not in COMPUTE_DTYPES.values():
            raise ModelError(f"compute dtype {self.dtype} is not one of float32, bfloat16, float16")
        self.kv_dtype_name = kv_dtype or next(k for k, v in COMPUTE_DTYPES.items() if v == self.dtype)
        self.kv_dtype = kv_torch_dtype(self.kv_dtype_name)
        self.tokenizer = tokenizer
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        attn = self.layers[0].self_attn
        if len(self.layers) != config.num_hidden_layers or attn.k_proj.out_features != self.kv_heads * self.head_dim:
            raise ModelError(f"the loaded modules have {len(self.layers)} layers and K width "
                             f"{attn.k_proj.out_features}; config.json says {config.num_hidden_layers} layers of "
                             f"{self.kv_heads} x {self.head_dim}")
        if getattr(attn, "head_dim", self.head_dim) != self.head_dim:
            raise ModelError(f"head_dim {attn.head_dim} of the modules differs from config.json's {self.head_dim}")
        self._cache_kw = "cache" if "cache" in inspect.signature(self.layers[0].forward).parameters \
            else "past_key_values"
        hf_config = hf.config
        types = getattr(hf_config, "layer_types", None)
        window = config.sliding_window
        self.windows = [window if window is not None and (types is None or types[i] == "sliding_attention") else None
                        for i in range(len(self.layers))]
        self._rope: tuple[int, int, tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, device: str | torch.device = "cpu",
             dtype: str | torch.dtype | None = None, kv_dtype: str | None = None) -> HfModel:
        """``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` of a local *directory*
        (never a hub name), after config.json passed the descriptor's registry (one line naming what it lacks)."""
        try:
            import transformers
        except ImportError:
            raise ModelError("the transformers engine needs transformers: pip install transformers") from None
        root = Path(directory)
        if not root.is_dir():
            raise ModelError(f"model directory {os.fspath(directory)!r} does not exist")
        config = ModelConfig.load(root, families=DESCRIBED_FAMILIES)
        if isinstance(dtype, str):
            try:
                dtype = COMPUTE_DTYPES[dtype]
            except KeyError:
                raise ModelError(f"compute dtype {dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}") from None
        torch_dtype = dtype or COMPUTE_DTYPES[DTYPE_TO_KV[config.dtype]]
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise ModelError(f"kv_dtype {kv_dtype!r}: this torch has no such element type")
        target = resolve_device(device)
        transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
        transformers.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        try:
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                os.fspath(root), dtype=torch_dtype, attn_implementation="sdpa", local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"transformers cannot load {os.fspath(root)!r}: {str(exc).splitlines()[0]}") from None
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(os.fspath(root), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"transformers cannot load the tokenizer of {os.fspath(root)!r}: "
                             f"{str(exc).splitlines()[0]}") from None
        hf = hf.to(target)  # type: ignore[arg-type]
        return cls(hf, config, directory=root, kv_dtype=kv_dtype, tokenizer=tokenizer)

    # -- what the engine reports -----------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def build(self) -> str:
        import transformers

        return (f"transformers/{transformers.__version__} kvsp-quic/{_VERSION} torch/{torch.__version__} "
                f"{self.device.type} {self.kv_dtype_name}")

    def descriptor(self, block_tokens: int, *, name: str | None = None) -> CompatDescriptor:
        """The directory's Compatibility Descriptor: :func:`gpu.modelfiles.derive_descriptor`, as the reference
        engine derives it (same files, same element type: same Compatibility ID)."""
        return derive_descriptor(self.directory, block_tokens, name=name, kv_dtype=self.kv_dtype_name)

    # -- computation (gpu.model.StepModel) -------------------------------------------------------------------

    def embed(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in 0..{self.config.vocab_size - 1}")
        with torch.inference_mode():
            out: torch.Tensor = self.inner.embed_tokens(ids.to(self.device))
        return out

    def _rotary(self, h: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[:2] != (start, end):
            positions = torch.arange(start, end, device=self.device).unsqueeze(0)
            self._rope = (start, end, self.inner.rotary_emb(h, position_ids=positions))
        return self._rope[2]

    def _mask(self, layer: int, start: int, end: int) -> torch.Tensor:
        """(1, 1, n, end) True where query position q (start..end-1) attends key position j: j <= q, and
        q - j < window for a sliding-window layer (transformers' masks)."""
        q = torch.arange(start, end, device=self.device)[:, None]
        j = torch.arange(end, device=self.device)[None, :]
        allowed = j <= q
        window = self.windows[layer]
        if window is not None:
            allowed &= (q - j) < window
        return allowed[None, None]

    def layer_step(self, layer: int, x: torch.Tensor, start: int, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   store: StoreKV | None = None) -> torch.Tensor:
        """transformers' decoder layer *layer* for tokens [start, start + n) (hidden states *x*, (n, hidden)),
        over the context buffers of :meth:`gpu.model.LlamaModel.layer_step`."""
        n = x.shape[0]
        end = start + n
        h = x.unsqueeze(0)
        cache = _ContextCache(layer, start, k_ctx, v_ctx, store, self.kv_dtype)
        with torch.inference_mode():
            out = self.layers[layer](h, attention_mask=self._mask(layer, start, end),
                                     position_ids=torch.arange(start, end, device=self.device).unsqueeze(0),
                                     position_embeddings=self._rotary(h, start, end), use_cache=True,
                                     **{self._cache_kw: cache})
        if cache.calls != 1:
            raise RuntimeError(f"decoder layer {layer} updated its cache {cache.calls} times (expected once)")
        if isinstance(out, tuple):
            out = out[0]
        hidden: torch.Tensor = out[0]
        return hidden

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = self.hf.lm_head(self.inner.norm(x)).to(torch.float32)
        return out

    def new_context(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (tokens, self.kv_heads, self.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))


# -- DynamicCache <-> kvsp-layout-1 ------------------------------------------------------------------------------


def _section_tensor(data: Any, block_tokens: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype
                    ) -> torch.Tensor:
    octets = as_octets(data)
    t = octets.view(kv_dtype)
    if t.numel() != block_tokens * kv_heads * head_dim:
        raise ValueError(f"a section of {octets.numel()} octets is not {block_tokens} x {kv_heads} x {head_dim} "
                         f"elements")
    return t.view(block_tokens, kv_heads, head_dim)


def dynamic_cache_from_blocks(blocks: Sequence[Sequence[tuple[Any, Any]]], descriptor: CompatDescriptor, *,
                              dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                              config: Any = None) -> Any:
    """A ``DynamicCache`` holding the prefix of *blocks* (each the ``(K, V)`` kvsp-layout-1 sections of every
    layer of one complete block, in prefix order): per layer ``(1, kv_heads, tokens, head_dim)`` of *dtype*
    (default: the descriptor's element type). ``model(suffix_ids, past_key_values=cache)`` then continues it."""
    from transformers import DynamicCache

    kv = kv_torch_dtype(descriptor.kv_dtype)
    b, heads, dim = descriptor.block_tokens, descriptor.kv_heads, descriptor.head_dim
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for layer in range(descriptor.layers):
        ks, vs = [], []
        for i, block in enumerate(blocks):
            if len(block) != descriptor.layers:
                raise ValueError(f"block {i} has {len(block)} layers; the descriptor has {descriptor.layers}")
            k, v = block[layer]
            ks.append(_section_tensor(k, b, heads, dim, kv))
            vs.append(_section_tensor(v, b, heads, dim, kv))
        k_all = torch.cat(ks).to(device=device, dtype=dtype or kv).permute(1, 0, 2).unsqueeze(0).contiguous()
        v_all = torch.cat(vs).to(device=device, dtype=dtype or kv).permute(1, 0, 2).unsqueeze(0).contiguous()
        cache.update(k_all, v_all, layer)
    return cache


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers < 4.56


def blocks_from_dynamic_cache(cache: Any, descriptor: CompatDescriptor) -> list[list[tuple[bytes, bytes]]]:
    """The complete blocks of a ``DynamicCache`` (batch 1) as kvsp-layout-1 ``(K, V)`` sections per layer, in the
    descriptor's element type: what a KVSP container of each block carries."""
    kv = kv_torch_dtype(descriptor.kv_dtype)
    b = descriptor.block_tokens
    keys0, _ = _layer_kv(cache, 0)
    if keys0.shape[0] != 1:
        raise ValueError("one sequence at a time (batch 1)")
    count = keys0.shape[2] // b
    out: list[list[tuple[bytes, bytes]]] = [[] for _ in range(count)]
    for layer in range(descriptor.layers):
        k, v = _layer_kv(cache, layer)
        if tuple(k.shape[1::2]) != (descriptor.kv_heads, descriptor.head_dim):
            raise ValueError(f"layer {layer}: K of shape {tuple(k.shape)} is not (1, {descriptor.kv_heads}, seq, "
                             f"{descriptor.head_dim})")
        rows_k = k[0].transpose(0, 1).to(device="cpu", dtype=kv).contiguous()  # (seq, kv_heads, head_dim)
        rows_v = v[0].transpose(0, 1).to(device="cpu", dtype=kv).contiguous()
        for i in range(count):
            out[i].append((rows_k[i * b:(i + 1) * b].view(torch.uint8).numpy().tobytes(),
                           rows_v[i * b:(i + 1) * b].view(torch.uint8).numpy().tobytes()))
    return out


__all__ = ["HfModel", "blocks_from_dynamic_cache", "dynamic_cache_from_blocks"]
