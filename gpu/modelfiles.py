"""The files of a model directory, without torch: config.json, safetensors, tokenizer.json, the descriptor.

A model directory is the Hugging Face Llama layout::

    config.json                 LlamaForCausalLM configuration (hidden_size, num_key_value_heads, rope_*, ...)
    *.safetensors               weights (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ...)
    tokenizer.json              a ``tokenizers`` definition (optional for the model, required for a descriptor)

Nothing here imports torch, so ``kvsp-quic model init`` and ``model descriptor`` work without it.
:func:`write_random_model` writes a small random-weights model (numpy, seeded) with a byte-level tokenizer.
:func:`derive_descriptor` builds the Compatibility Descriptor of a directory (spec, "Compatibility Descriptor").
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvsp_quic.compat import (
    ELEMENT_TYPES,
    LAYOUT_1,
    CompatDescriptor,
    DescriptorError,
    model_digest,
    parse_positional,
    tokenizer_digest,
)
from kvsp_quic.samples import float32_to_bf16_bits

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_FILE = "model.safetensors"

# config.json dtype names <-> KVSP element types
DTYPE_TO_KV = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
KV_TO_DTYPE = {v: k for k, v in DTYPE_TO_KV.items()}
SUPPORTED_SCALING = ("linear", "llama3", "yarn")
# The architectures whose K and V a descriptor describes exactly: decoder-only, one K and one V per layer of
# (kv_heads, head_dim) per token, full-width RoPE on K (theta and a registered scaling), nothing else position-
# dependent in the cache. The reference model computes the first; the transformers engine (gpu/hf_engine.py) all.
DESCRIBED_FAMILIES = ("llama", "mistral", "qwen2")
REFERENCE_FAMILIES = ("llama",)
_SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class ModelError(DescriptorError):
    """A model directory (config.json, weights, tokenizer) is unusable; one line for the user."""


# -- config.json ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The members of a Hugging Face Llama ``config.json`` that the reference model uses."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None  # {"rope_type": "llama3" | "linear" | "yarn", "factor": ...}
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # float32 | bfloat16 | float16
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    name: str | None = None  # "_name_or_path", when the file has one
    model_type: str = "llama"  # one of DESCRIBED_FAMILIES
    attention_bias: bool = False  # biases on the q/k/v projections (qwen2 always; not in the reference model)
    sliding_window: int | None = None  # mistral/qwen2 sliding-window attention (None: full attention)
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ModelError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                                 f"{self.num_attention_heads}; set head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ModelError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.dtype not in DTYPE_TO_KV:
            raise ModelError(f"config.json: dtype {self.dtype!r} is not one of {', '.join(DTYPE_TO_KV)}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ModelError(f"config.json: rope_theta must be positive, got {self.rope_theta!r}")
        if not (self.rms_norm_eps > 0):
            raise ModelError(f"config.json: rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        _ = self.scaling_type  # validates rope_scaling

    @property
    def kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def scaling_type(self) -> str | None:
        """The RoPE scaling method: None (plain RoPE), "linear", "llama3" or "yarn"."""
        if self.rope_scaling is None:
            return None
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        if kind in (None, "default"):
            return None
        if kind not in SUPPORTED_SCALING:
            raise ModelError(f"rope_scaling type {kind!r} is not supported (supported: none, "
                             f"{', '.join(SUPPORTED_SCALING)}); 'dynamic' changes the cache with the sequence "
                             f"length and cannot be shared")
        factor = self.rope_scaling.get("factor")
        if not isinstance(factor, int | float) or isinstance(factor, bool) or not factor > 0:
            raise ModelError(f"rope_scaling: {kind} needs a positive 'factor', got {factor!r}")
        if kind == "llama3":
            for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if not isinstance(self.rope_scaling.get(name), int | float):
                    raise ModelError(f"rope_scaling: llama3 needs {name!r}")
            if self.rope_scaling["high_freq_factor"] <= self.rope_scaling["low_freq_factor"]:
                raise ModelError("rope_scaling: high_freq_factor must exceed low_freq_factor")
        return str(kind)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, families: tuple[str, ...] = REFERENCE_FAMILIES) -> ModelConfig:
        """Parse config.json. *families*: the architectures accepted -- the reference model's by default;
        :data:`DESCRIBED_FAMILIES` for a descriptor (:func:`derive_descriptor`) or the transformers engine, which
        then computes what the reference model refuses (biases, sliding windows, other activations)."""
        if not isinstance(obj, Mapping):
            raise ModelError("config.json must hold a JSON object")
        model_type = obj.get("model_type", "llama")
        reference = families == REFERENCE_FAMILIES
        if model_type not in families:
            if model_type in DESCRIBED_FAMILIES:
                raise ModelError(f"config.json: model_type {model_type!r} is not supported by the reference engine "
                                 f"(only {', '.join(map(repr, families))}; --engine transformers serves it)")
            raise ModelError(f"config.json: model_type {model_type!r} is not in the descriptor's registry of "
                             f"architectures ({', '.join(DESCRIBED_FAMILIES)})")
        if reference:
            for flag in ("attention_bias", "mlp_bias"):
                if obj.get(flag):
                    raise ModelError(f"config.json: {flag} is not supported by the reference model")
            act = obj.get("hidden_act", "silu")
            if act != "silu":
                raise ModelError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        if obj.get("quantization_config"):
            raise ModelError("config.json: quantization_config: quantized weights are not in the descriptor's "
                             "registry (the KV element type and the model digest would not say what computes)")
        window = obj.get("sliding_window")
        if model_type == "qwen2" and not obj.get("use_sliding_window", False):
            window = None
        if model_type == "llama" or (isinstance(window, int) and window >= int(obj.get("max_position_embeddings",
                                                                                          8192))):
            window = None  # never narrower than the context: full attention
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ModelError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
        if reference and window is not None:
            raise ModelError("config.json: sliding_window is not supported by the reference model")
        if obj.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelError("config.json: partial_rotary_factor is not supported")
        # transformers >= 5 keeps theta and scaling under "rope_parameters"; older files at the top level.
        rope = obj.get("rope_parameters")
        if isinstance(rope, Mapping):
            theta = rope.get("rope_theta", obj.get("rope_theta", 10000.0))
            scaling: Mapping[str, Any] | None = {k: v for k, v in rope.items() if k != "rope_theta"}
            if scaling is not None and scaling.get("rope_type", "default") == "default":
                scaling = None
        else:
            theta = obj.get("rope_theta", 10000.0)
            scaling = obj.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, Mapping):
            raise ModelError("config.json: rope_scaling must be an object or null")
        dtype = obj.get("dtype") or obj.get("torch_dtype") or "float32"
        eos = obj.get("eos_token_id")
        known = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "dtype", "torch_dtype",
                 "bos_token_id", "eos_token_id", "_name_or_path", "model_type", "attention_bias",
                 "sliding_window"}
        try:
            heads = _int(obj, "num_attention_heads")
            return cls(
                hidden_size=_int(obj, "hidden_size"),
                intermediate_size=_int(obj, "intermediate_size"),
                num_hidden_layers=_int(obj, "num_hidden_layers"),
                num_attention_heads=heads,
                num_key_value_heads=int(obj.get("num_key_value_heads") or heads),
                vocab_size=_int(obj, "vocab_size"),
                head_dim=int(obj.get("head_dim") or 0),
                rms_norm_eps=float(obj.get("rms_norm_eps", 1e-5)),
                rope_theta=float(theta),
                rope_scaling=dict(scaling) if scaling is not None else None,
                max_position_embeddings=int(obj.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(obj.get("tie_word_embeddings", False)),
                dtype=str(dtype),
                bos_token_id=obj.get("bos_token_id"),
                eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
                name=obj.get("_name_or_path") or None,
                model_type=str(model_type),
                attention_bias=model_type == "qwen2" or bool(obj.get("attention_bias", False)),
                sliding_window=window,
                extra={k: v for k, v in obj.items() if k not in known},
            )
        except (TypeError, ValueError) as exc:
            raise ModelError(f"config.json: {exc}") from None

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, families: tuple[str, ...] = REFERENCE_FAMILIES
             ) -> ModelConfig:
        path = Path(directory) / CONFIG_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ModelError(f"cannot read {os.fspath(path)!r}: {exc.strerror}") from None
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ModelError(f"{os.fspath(path)!r} is not JSON: {exc}") from None
        return cls.from_json(obj, families=families)

    def to_json(self) -> dict[str, Any]:
        """config.json in the Hugging Face Llama layout."""
        out: dict[str, Any] = dict(self.extra)
        out.update({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling is not None else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        })
        if self.name is not None:
            out["_name_or_path"] = self.name
        return out

    def positional(self) -> str:
        """The descriptor's ``positional``: ``rope;theta=<int>[,scaling=<method>]`` (KVSP Positional Encodings).

        theta is always written (a descriptor names the value it was computed with); the scaling method is
        written when the model scales RoPE. The scaling parameters (factor, ...) have no registered syntax: they
        are the model's defaults from config.json (see docs/gpu.md, "Compatibility Descriptor").
        """
        theta = self.rope_theta
        if theta != int(theta):
            raise ModelError(f"rope_theta {theta!r} is not an integer: the 'rope' registry entry takes a decimal "
                             f"integer theta")
        text = f"rope;theta={int(theta)}"
        if self.scaling_type is not None:
            text += f",scaling={self.scaling_type}"
        parse_positional(text)
        return text


def _int(obj: Mapping[str, Any], name: str) -> int:
    if name not in obj:
        raise ModelError(f"config.json: {name} is missing")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"config.json: {name} must be an integer, got {value!r}")
    return value


# -- the descriptor ------------------------------------------------------------------------------------------


def derive_descriptor(directory: str | os.PathLike[str], block_tokens: int, *, name: str | None = None,
                      kv_dtype: str | None = None) -> CompatDescriptor:
    """The Compatibility Descriptor of the model in *directory* with blocks of *block_tokens* tokens: the same
    whichever engine serves the directory (both call this), for any architecture of :data:`DESCRIBED_FAMILIES`.

    * model: *name*, else config.json's ``_name_or_path``, else the directory's name;
    * model_digest: SHA-256 over ``*.safetensors`` in ascending byte order of their names;
    * tokenizer_digest: SHA-256 of tokenizer.json (required);
    * layers, kv_heads, head_dim from config.json; kv_dtype: *kv_dtype*, else the model's dtype;
    * positional: :meth:`ModelConfig.positional`; layout kvsp-layout-1.
    """
    root = Path(directory)
    config = ModelConfig.load(root, families=DESCRIBED_FAMILIES)
    tokenizer = root / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise ModelError(f"{os.fspath(root)!r} has no {TOKENIZER_FILE}: the descriptor needs its digest")
    kv = kv_dtype or DTYPE_TO_KV[config.dtype]
    if kv not in ELEMENT_TYPES:
        raise ModelError(f"kv_dtype {kv!r} is not in the KVSP Element Types registry ({', '.join(ELEMENT_TYPES)})")
    model = name or config.name or root.resolve().name
    return CompatDescriptor(model=model, model_digest=model_digest(root), tokenizer_digest=tokenizer_digest(tokenizer),
                            layers=config.num_hidden_layers, kv_heads=config.num_key_value_heads,
                            head_dim=config.head_dim, kv_dtype=kv, positional=config.positional(),
                            block_tokens=block_tokens, layout=LAYOUT_1)


# -- safetensors writer (numpy) ------------------------------------------------------------------------------


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, tuple[str, tuple[int, ...], Any]],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file: name -> (dtype "float32" | "bfloat16" | "float16", shape, C-contiguous array of
    that many elements; bfloat16 as uint16 bit patterns). Names in sorted order, data in the same order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    arrays = []
    for name in sorted(tensors):
        dtype, shape, arr = tensors[name]
        data = np.ascontiguousarray(arr)
        nbytes = data.nbytes
        if nbytes != math.prod(shape) * (4 if dtype == "float32" else 2):
            raise ValueError(f"{name}: {nbytes} octets for shape {shape} of {dtype}")
        header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        arrays.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for data in arrays:
            fh.write(data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes())


def _random_weights(config: ModelConfig, seed: int) -> dict[str, tuple[str, tuple[int, ...], Any]]:
    """Seeded random weights scaled so activations stay O(1): embeddings N(0, 1), linear maps N(0, 1/fan_in),
    norms 1 + N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    out: dict[str, tuple[str, tuple[int, ...], Any]] = {}

    def put(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        values = rng.standard_normal(size=shape, dtype=np.float32) * np.float32(std) + np.float32(mean)
        out[name] = (config.dtype, shape, _to_dtype(values, config.dtype))

    put("model.embed_tokens.weight", (config.vocab_size, h), 1.0)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", (h,), 0.1, 1.0)
        put(p + "self_attn.q_proj.weight", (q_out, h), h ** -0.5)
        put(p + "self_attn.k_proj.weight", (kv_out, h), h ** -0.5)
        put(p + "self_attn.v_proj.weight", (kv_out, h), h ** -0.5)
        put(p + "self_attn.o_proj.weight", (h, q_out), q_out ** -0.5)
        put(p + "post_attention_layernorm.weight", (h,), 0.1, 1.0)
        put(p + "mlp.gate_proj.weight", (inter, h), h ** -0.5)
        put(p + "mlp.up_proj.weight", (inter, h), h ** -0.5)
        put(p + "mlp.down_proj.weight", (h, inter), inter ** -0.5)
    put("model.norm.weight", (h,), 0.1, 1.0)
    if not config.tie_word_embeddings:
        put("lm_head.weight", (config.vocab_size, h), h ** -0.5)
    return out


def _to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype("<f2")
    return float32_to_bf16_bits(values)


def write_random_model(directory: str | os.PathLike[str], config: ModelConfig, *, seed: int = 0) -> Path:
    """Write config.json, model.safetensors (seeded random weights) and a byte-level tokenizer.json.

    The output is a function of (*config*, *seed*) only: the same arguments give the same octets, hence the same
    model_digest and Compatibility ID, on any machine (numpy's PCG64 stream).
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if config.vocab_size < 256:
        raise ModelError(f"the byte-level tokenizer needs vocab_size >= 256, got {config.vocab_size}")
    write_safetensors(root / WEIGHTS_FILE, _random_weights(config, seed), {"format": "pt"})
    (root / CONFIG_FILE).write_text(json.dumps(config.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (root / TOKENIZER_FILE).write_text(byte_level_tokenizer_json(), encoding="utf-8")
    return root


# -- tokenizers ----------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ``ByteLevel`` pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


BYTE_ALPHABET = _bytes_to_unicode()


def byte_level_tokenizer_json() -> str:
    """A ``tokenizers`` definition whose token ids are the UTF-8 octets of the text (id = octet value): a BPE
    model without merges over the 256 ``ByteLevel`` characters. :class:`ByteTokenizer` gives the same ids."""
    vocab = {BYTE_ALPHABET[b]: b for b in range(256)}
    definition: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    return json.dumps(definition, indent=2, ensure_ascii=False) + "\n"


class ByteTokenizer:
    """Token id = UTF-8 octet. The fallback when ``tokenizers`` is not installed (for the byte-level
    tokenizer.json that :func:`write_random_model` writes) and when a directory has no tokenizer.json."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HfTokenizer:
    """A tokenizer.json through the ``tokenizers`` package."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(os.fspath(path))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False))


TextTokenizer = ByteTokenizer | HfTokenizer


def load_tokenizer(directory: str | os.PathLike[str]) -> TextTokenizer:
    """tokenizer.json through ``tokenizers`` when installed; our own byte-level definition also without it;
    :class:`ByteTokenizer` when the directory has no tokenizer.json."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        return ByteTokenizer()
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        if path.read_text(encoding="utf-8") == byte_level_tokenizer_json():
            return ByteTokenizer()
        raise ModelError(f"{os.fspath(path)!r} needs the 'tokenizers' package: pip install 'kvsp-quic[gpu]'") \
            from None
    return HfTokenizer(path)
