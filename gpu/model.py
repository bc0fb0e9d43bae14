"""The reference decoder: a Llama-family transformer in plain torch, loaded from a local directory.

RMSNorm, rotary position embeddings (theta and the scaling of config.json: none, linear, llama3, yarn),
grouped-query attention, a SwiGLU MLP, tied or untied embeddings. Weights come from ``*.safetensors`` in the
Hugging Face Llama layout (``model.layers.N.self_attn.q_proj.weight``, ...); nothing is downloaded.

The model computes one *layer step* at a time for a *chunk* of consecutive tokens (:meth:`LlamaModel.layer_step`)
against a context buffer holding the K and V of every earlier token of that layer. The prefill
(:mod:`gpu.prefill`) schedules those steps layer by layer; a full recompute and a prefill with a loaded prefix
run the very same steps on the same shapes, which is what makes their results bit-identical (docs/gpu.md).

    model = LlamaModel.load("models/tiny", device="cpu")
    descriptor = model.descriptor(block_tokens=16)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from gpu.kvcache import KV_DTYPES, kv_torch_dtype, resolve_device
from gpu.modelfiles import DTYPE_TO_KV, ModelConfig, ModelError, TextTokenizer, derive_descriptor, load_tokenizer
from gpu.rope import RotaryTable, apply_rope
from kvsp_quic import __version__ as _VERSION
from kvsp_quic.compat import CompatDescriptor

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # (q_out + 2 * kv_out, hidden): q_proj, k_proj, v_proj stacked
    o: torch.Tensor  # (hidden, q_out)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (2 * intermediate, hidden): gate_proj, up_proj stacked
    down: torch.Tensor  # (hidden, intermediate)


StoreKV = Callable[[torch.Tensor, torch.Tensor], None]


class StepModel(Protocol):
    """What the prefill (:mod:`gpu.prefill`), the decode step and :class:`gpu.engine.Engine` need of a model: the
    layer step over a context buffer. :class:`LlamaModel` (the reference engine) and
    :class:`gpu.hf_engine.HfModel` (transformers' modules) are two."""

    engine_name: str  # "reference" | "transformers": the engine it makes
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    kv_dtype_name: str

    @property
    def num_layers(self) -> int: ...

    @property
    def build(self) -> str:
        """The engine's build fingerprint: what computes (library versions, compute dtype, device type)."""
        ...

    def descriptor(self, block_tokens: int, *, name: str | None = None) -> CompatDescriptor: ...

    def embed(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor: ...

    def layer_step(self, layer: int, x: torch.Tensor, start: int, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   store: StoreKV | None = None) -> torch.Tensor: ...

    def logits(self, x: torch.Tensor) -> torch.Tensor: ...

    def new_context(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class LlamaModel:
    """Weights on one device in one compute dtype, and the per-chunk layer step (a :class:`StepModel`)."""

    engine_name = "reference"

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], *,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 kv_dtype: str | None = None, directory: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        self.device = resolve_device(device)
        self.dtype = dtype or COMPUTE_DTYPES[DTYPE_TO_KV[config.dtype]]
        if self.dtype not in COMPUTE_DTYPES.values():
            raise ModelError(f"compute dtype {self.dtype} is not one of float32, bfloat16, float16")
        self.kv_dtype_name = kv_dtype or next(k for k, v in COMPUTE_DTYPES.items() if v == self.dtype)
        self.kv_dtype = kv_torch_dtype(self.kv_dtype_name)
        self.directory = Path(directory) if directory is not None else None
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.n_rep = config.kv_groups
        self.eps = config.rms_norm_eps
        self._q_out = self.heads * self.head_dim
        self._kv_out = self.kv_heads * self.head_dim

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            try:
                t = weights[name]
            except KeyError:
                raise ModelError(f"weight {name!r} is missing") from None
            if tuple(t.shape) != shape:
                raise ModelError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
            return t.to(device=self.device, dtype=self.dtype)

        h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
        self.embed_tokens = take("model.embed_tokens.weight", (v, h))
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight", (h,)),
                qkv=torch.cat([take(p + "self_attn.q_proj.weight", (self._q_out, h)),
                               take(p + "self_attn.k_proj.weight", (self._kv_out, h)),
                               take(p + "self_attn.v_proj.weight", (self._kv_out, h))]),
                o=take(p + "self_attn.o_proj.weight", (h, self._q_out)),
                post_norm=take(p + "post_attention_layernorm.weight", (h,)),
                gate_up=torch.cat([take(p + "mlp.gate_proj.weight", (inter, h)),
                                   take(p + "mlp.up_proj.weight", (inter, h))]),
                down=take(p + "mlp.down_proj.weight", (h, inter)),
            ))
        self.norm = take("model.norm.weight", (h,))
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            if not config.tie_word_embeddings:
                raise ModelError("weight 'lm_head.weight' is missing (and tie_word_embeddings is false)")
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = take("lm_head.weight", (v, h))
        self.rope = RotaryTable(config, self.device, self.dtype)
        self._tokenizer: TextTokenizer | None = None

    # -- loading ---------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, device: str | torch.device = "cpu",
             dtype: str | torch.dtype | None = None, kv_dtype: str | None = None) -> LlamaModel:
        """Load config.json and every ``*.safetensors`` of *directory* (a local path; never a hub name).

        *dtype*: the compute dtype ("fp32", "bf16", "fp16" or a torch dtype; default: config.json's).
        *kv_dtype*: the KVSP element type of the cache (default: the compute dtype; fp8 types store the cache in
        8 bits and compute in *dtype*).
        """
        from safetensors import safe_open

        root = Path(directory)
        if not root.is_dir():
            raise ModelError(f"model directory {os.fspath(directory)!r} does not exist")
        config = ModelConfig.load(root)
        files = sorted(root.glob("*.safetensors"), key=lambda p: os.fsencode(p.name))
        if not files:
            raise ModelError(f"no *.safetensors in {os.fspath(root)!r}")
        target = resolve_device(device)
        weights: dict[str, torch.Tensor] = {}
        for path in files:
            with safe_open(os.fspath(path), framework="pt", device="cpu") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    weights[name] = fh.get_tensor(name)
        if isinstance(dtype, str):
            try:
                dtype = COMPUTE_DTYPES[dtype]
            except KeyError:
                raise ModelError(f"compute dtype {dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}") from None
        return cls(config, weights, device=target, dtype=dtype, kv_dtype=kv_dtype, directory=root)

    @property
    def tokenizer(self) -> TextTokenizer:
        if self._tokenizer is None:
            if self.directory is None:
                raise ModelError("this model was not loaded from a directory: it has no tokenizer")
            self._tokenizer = load_tokenizer(self.directory)
        return self._tokenizer

    def descriptor(self, block_tokens: int, *, name: str | None = None) -> CompatDescriptor:
        """The Compatibility Descriptor of this model's directory with this model's KV element type."""
        if self.directory is None:
            raise ModelError("this model was not loaded from a directory")
        return derive_descriptor(self.directory, block_tokens, name=name, kv_dtype=self.kv_dtype_name)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def build(self) -> str:
        return f"reference/{_VERSION} torch/{torch.__version__} {self.device.type} {self.kv_dtype_name}"

    # -- computation -----------------------------------------------------------------------------------------

    def embed(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """(tokens, hidden) embeddings."""
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in 0..{self.config.vocab_size - 1}")
        return self.embed_tokens[ids.to(self.device)]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Llama RMSNorm: normalised in float32, scaled in the compute dtype (as transformers does)."""
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(self.dtype)

    def layer_step(self, layer: int, x: torch.Tensor, start: int, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   store: StoreKV | None = None) -> torch.Tensor:
        """Layer *layer* for the chunk of tokens [start, start + n) with hidden states *x* (n, hidden).

        *k_ctx* / *v_ctx* are (>= start + n, kv_heads, head_dim) context buffers of the compute dtype whose rows
        [0, start) hold the layer's K and V of the earlier tokens. The chunk's K and V (after rotary embedding,
        rounded through the KV element type) are written to rows [start, start + n) and passed to *store*.
        Returns the hidden states after the layer.
        """
        w = self.layers[layer]
        n = x.shape[0]
        end = start + n
        h = self.rms_norm(x, w.input_norm)
        qkv = F.linear(h, w.qkv)
        q = qkv[:, :self._q_out].view(n, self.heads, self.head_dim)
        k = qkv[:, self._q_out:self._q_out + self._kv_out].view(n, self.kv_heads, self.head_dim)
        v = qkv[:, self._q_out + self._kv_out:].view(n, self.kv_heads, self.head_dim)
        cos, sin = self.rope.get(start, end)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if self.kv_dtype != self.dtype:  # the cache keeps the rounded values: attention uses what is cached
            k = k.to(self.kv_dtype).to(self.dtype)
            v = v.to(self.kv_dtype).to(self.dtype)
        k_ctx[start:end].copy_(k)
        v_ctx[start:end].copy_(v)
        if store is not None:
            store(k_ctx[start:end], v_ctx[start:end])
        attn = self.attention(q, k_ctx[:end], v_ctx[:end], start)
        x = x + F.linear(attn, w.o)
        h = self.rms_norm(x, w.post_norm)
        gate_up = F.linear(h, w.gate_up)
        inter = gate_up.shape[-1] // 2
        mlp = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w.down)
        return x + mlp

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """Causal grouped-query attention of queries at positions [start, start + n) over keys [0, end).

        q: (n, heads, head_dim); keys, values: (end, kv_heads, head_dim). The query heads that share a KV head
        are folded into the query length, so K and V are never repeated. Returns (n, heads * head_dim).
        """
        n = q.shape[0]
        end = keys.shape[0]
        # (n, kv_heads, n_rep, d) -> (kv_heads, n * n_rep, d); row i * n_rep + r is token i, query head r
        qh = q.view(n, self.kv_heads, self.n_rep, self.head_dim).permute(1, 0, 2, 3)
        qh = qh.reshape(1, self.kv_heads, n * self.n_rep, self.head_dim)
        kh = keys.permute(1, 0, 2).unsqueeze(0)
        vh = values.permute(1, 0, 2).unsqueeze(0)
        positions = torch.arange(start, start + n, device=q.device)
        mask = torch.arange(end, device=q.device)[None, :] <= positions[:, None]
        if self.n_rep > 1:
            mask = mask.repeat_interleave(self.n_rep, dim=0)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        # (1, kv_heads, n * n_rep, d) -> (n, kv_heads, n_rep, d) -> (n, heads * d)
        out = out.view(self.kv_heads, n, self.n_rep, self.head_dim).permute(1, 0, 2, 3)
        return out.reshape(n, self.heads * self.head_dim)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits (n, vocab) of final hidden states (n, hidden)."""
        return F.linear(self.rms_norm(x, self.norm), self.lm_head).to(torch.float32)

    def new_context(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Context buffers for *tokens* tokens (K, V), in the compute dtype."""
        shape = (tokens, self.kv_heads, self.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))


def chunk_bounds(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) split at the absolute multiples of *chunk_tokens*."""
    out = []
    pos = start
    while pos < end:
        stop = min(end, (pos // chunk_tokens + 1) * chunk_tokens)
        out.append((pos, stop))
        pos = stop
    return out


__all__ = ["COMPUTE_DTYPES", "KV_DTYPES", "LayerWeights", "LlamaModel", "StepModel", "chunk_bounds"]
