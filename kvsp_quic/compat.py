"""The Compatibility Descriptor, the Compatibility ID, and the KVSP registries.

Spec, "Compatibility Descriptor and Compatibility ID":
    compat_id = SHA-256( "KVSP-COMPAT-1" || 0x00 || JCS(descriptor) )
Spec, "KVSP Registries": element types, positional encodings, codecs, storage tiers, instance states.

Members the spec does not define are kept (not dropped) and take part in the Compatibility ID, because the ID
is computed over the descriptor as a peer wrote it; docs/wire.md records this decision.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import rfc8785

from kvsp_quic import fields as f
from kvsp_quic.fields import CompatId, RecordError

COMPAT_LABEL = b"KVSP-COMPAT-1\x00"
LAYOUT_1 = "kvsp-layout-1"
_HASH_CHUNK = 1 << 20


class DescriptorError(RecordError):
    """A Compatibility Descriptor, or a file it is derived from, is not valid."""


# -- Registries ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElementType:
    name: str
    size: int  # octets per element
    description: str


ELEMENT_TYPES: dict[str, ElementType] = {
    e.name: e
    for e in (
        ElementType("bf16", 2, "bfloat16"),
        ElementType("fp16", 2, "IEEE 754 binary16"),
        ElementType("fp32", 4, "IEEE 754 binary32"),
        ElementType("fp8-e4m3", 1, "8-bit floating point with 4-bit exponent"),
        ElementType("fp8-e5m2", 1, "8-bit floating point with 5-bit exponent"),
    )
}


class Codec(enum.IntEnum):
    """The "KVSP Codecs" registry (16-bit values; 0xFF00-0xFFFF are Private Use)."""

    RAW = 0x0001


PRIVATE_CODECS = range(0xFF00, 0x10000)


def codec_known(value: int) -> bool:
    """Whether this implementation can decode codec *value*: a registered codec it implements, or Private Use."""
    return value in Codec._value2member_map_ or value in PRIVATE_CODECS


def codec_value(value: int) -> bool:
    """Whether *value* may appear as a codec in a peer's record: any 16-bit value but 0x0000 (Reserved: never a
    codec, so a malformed value, as for the holder's ``codec=`` parameter).

    Spec, "KVSP Registries": the registries are extensible (Specification Required), so a peer running a newer
    registry may name a codec this implementation does not know (issue 13): such a record is kept, never refused;
    whether its blocks can be used is :func:`codec_known`'s question, asked by whoever decodes them."""
    return 0 < value <= 0xFFFF


STORAGE_TIERS = ("device", "host", "local-storage", "remote-memory", "remote-storage")
STORAGE_TIER_SET = frozenset(STORAGE_TIERS)

# A name a registry may hold (spec, "KVSP Registries": "names are lowercase ASCII"; the Codecs registry spells the
# syntax out: lowercase ASCII letters, digits and "-", at most 32 characters). Tiers and codecs names share it;
# docs/wire.md records that a tier name outside it is refused as malformed, one inside it kept even if unknown.
REGISTRY_NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,31}")


def registry_name(text: str) -> bool:
    """Whether *text* has the syntax of a KVSP registry name (:data:`REGISTRY_NAME_RE`), known or not."""
    return REGISTRY_NAME_RE.fullmatch(text) is not None


class InstanceState(enum.Enum):
    """The "KVSP Instance States" registry, kept a closed set on purpose (issue 13): unlike a tier or a codec, a
    state is acted on (placement, drain, sleep, resume), and guessing what an unknown one means could place
    sessions on an instance that refuses them, so a record carrying one is refused (400), never half-read."""

    ACTIVE = "active"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    FAILED = "failed"


_DECIMAL_RE = re.compile(r"[1-9][0-9]*")
_METHOD_RE = re.compile(r"[a-z][a-z0-9._-]*")


@dataclass(frozen=True)
class PositionalEncoding:
    """An entry of "KVSP Positional Encodings": its parameters in their registered order."""

    name: str
    params: tuple[tuple[str, re.Pattern[str]], ...]
    description: str


POSITIONAL_ENCODINGS: dict[str, PositionalEncoding] = {
    p.name: p
    for p in (
        PositionalEncoding("rope", (("theta", _DECIMAL_RE), ("scaling", _METHOD_RE)),
                           "rotary position embedding"),
        PositionalEncoding("none", (), "no positional encoding in the cache"),
    )
}


def parse_positional(text: str, path: str = "positional") -> tuple[str, dict[str, str]]:
    """Split ``rope;theta=500000,scaling=yarn`` into its registered name and parameters.

    Parameters follow the registered syntax: each at most once, in the registered order (so one configuration
    has one spelling, and therefore one Compatibility ID); theta is a decimal integer without leading zeros.
    """
    name, sep, rest = text.partition(";")
    encoding = POSITIONAL_ENCODINGS.get(name)
    if encoding is None:
        raise DescriptorError(f"{path}: {name!r} is not in the KVSP Positional Encodings registry "
                              f"({', '.join(POSITIONAL_ENCODINGS)})")
    params: dict[str, str] = {}
    if not sep:
        return name, params
    if not encoding.params:
        raise DescriptorError(f"{path}: {name!r} takes no parameters")
    if not rest:
        raise DescriptorError(f"{path}: ';' must be followed by parameters")
    order = [p for p, _ in encoding.params]
    syntax = dict(encoding.params)
    last = -1
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if key not in syntax:
            raise DescriptorError(f"{path}: unknown parameter {key!r} for {name!r} (known: {', '.join(order)})")
        if not eq or not syntax[key].fullmatch(value):
            raise DescriptorError(f"{path}: parameter {key!r} has an invalid value {value!r}")
        position = order.index(key)
        if position <= last:
            raise DescriptorError(f"{path}: parameters must appear once each, in the order {', '.join(order)}")
        last = position
        params[key] = value
    return name, params


# -- The descriptor ------------------------------------------------------------------------------------------

_KNOWN = ("model", "model_digest", "tokenizer_digest", "adapters", "layers", "kv_heads", "head_dim",
          "kv_dtype", "positional", "block_tokens", "layout")


@dataclass(frozen=True)
class CompatDescriptor:
    model: str
    model_digest: str
    tokenizer_digest: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    positional: str
    block_tokens: int
    layout: str = LAYOUT_1
    adapters: tuple[str, ...] | None = None
    extensions: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # Re-validate through the JSON reader so constructing in code and parsing share one set of rules.
        _validate(self.to_json())

    @classmethod
    def from_json(cls, obj: Any) -> CompatDescriptor:
        return cls(**_validate(obj))

    @classmethod
    def loads(cls, text: bytes | str) -> CompatDescriptor:
        try:
            return cls.from_json(f.loads_object(text))
        except DescriptorError:
            raise
        except RecordError as exc:
            raise DescriptorError(exc.detail) from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CompatDescriptor:
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise DescriptorError(f"cannot read descriptor {os.fspath(path)!r}: {exc.strerror}") from None
        try:
            return cls.loads(text)
        except DescriptorError as exc:
            raise DescriptorError(f"descriptor {os.fspath(path)!r}: {exc.detail}") from None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extensions)
        out.update(model=self.model, model_digest=self.model_digest, tokenizer_digest=self.tokenizer_digest,
                   layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim, kv_dtype=self.kv_dtype,
                   positional=self.positional, block_tokens=self.block_tokens, layout=self.layout)
        if self.adapters is not None:
            out["adapters"] = list(self.adapters)
        return out

    def canonical_json(self) -> bytes:
        """JCS (RFC 8785) of the descriptor."""
        return bytes(rfc8785.dumps(self.to_json()))

    @cached_property
    def compat_id(self) -> CompatId:
        return CompatId(hashlib.sha256(COMPAT_LABEL + self.canonical_json()).digest())

    @property
    def element(self) -> ElementType:
        return ELEMENT_TYPES[self.kv_dtype]

    def section_length(self, tokens: int) -> int:
        """Octets of one K (or V) section of *tokens* tokens in kvsp-layout-1."""
        return tokens * self.kv_heads * self.head_dim * self.element.size

    def block_layer_length(self) -> int:
        """Octets of K plus V of one layer of a complete block."""
        return 2 * self.section_length(self.block_tokens)


def _validate(obj: Any) -> dict[str, Any]:
    try:
        d = f.as_object(obj, "descriptor")
        out: dict[str, Any] = {
            "model": f.member(d, "model", f.string),
            "model_digest": _digest_text(f.member(d, "model_digest", f.string), "model_digest"),
            "tokenizer_digest": _digest_text(f.member(d, "tokenizer_digest", f.string), "tokenizer_digest"),
            "layers": f.member(d, "layers", f.positive),
            "kv_heads": f.member(d, "kv_heads", f.positive),
            "head_dim": f.member(d, "head_dim", f.positive),
            "kv_dtype": f.member(d, "kv_dtype", f.string),
            "positional": f.member(d, "positional", f.string),
            "block_tokens": f.member(d, "block_tokens", f.positive),
            "layout": f.member(d, "layout", f.string),
        }
        for name in ("layers", "kv_heads", "head_dim", "block_tokens"):
            f.uint32(out[name], name)
        if "adapters" in d:
            adapters = f.array(d["adapters"], "adapters", f.string)
            if not adapters:
                raise DescriptorError("adapters: must be absent when no adapter is applied, never empty")
            out["adapters"] = tuple(_digest_text(a, f"adapters[{i}]") for i, a in enumerate(adapters))
        else:
            out["adapters"] = None
    except DescriptorError:
        raise
    except RecordError as exc:
        raise DescriptorError(exc.detail) from None
    if out["kv_dtype"] not in ELEMENT_TYPES:
        raise DescriptorError(f"kv_dtype: {out['kv_dtype']!r} is not in the KVSP Element Types registry "
                              f"({', '.join(ELEMENT_TYPES)})")
    parse_positional(out["positional"])
    if out["layout"] != LAYOUT_1:
        raise DescriptorError(f"layout: must be {LAYOUT_1!r}, got {out['layout']!r}")
    extensions = {k: v for k, v in d.items() if k not in _KNOWN}
    if extensions:
        try:
            rfc8785.dumps(extensions)
        except Exception as exc:  # rfc8785 raises its own error types for non-I-JSON values
            raise DescriptorError(f"extension members are not valid I-JSON: {exc}") from None
    out["extensions"] = extensions
    return out


def _digest_text(text: str, path: str) -> str:
    f.sha256_digest(text, path)
    return text


# -- Digests of model files ----------------------------------------------------------------------------------

DEFAULT_WEIGHT_PATTERNS = ("*.safetensors",)


def weight_files(directory: str | os.PathLike[str],
                 patterns: Iterable[str] = DEFAULT_WEIGHT_PATTERNS) -> list[Path]:
    """The weight files of *directory* in ascending byte order of their names (spec: model_digest)."""
    root = Path(directory)
    if not root.is_dir():
        raise DescriptorError(f"model directory {os.fspath(directory)!r} does not exist")
    found = {p for pattern in patterns for p in root.glob(pattern) if p.is_file()}
    if not found:
        raise DescriptorError(f"no weight files matching {', '.join(patterns)} in {os.fspath(directory)!r}")
    return sorted(found, key=lambda p: os.fsencode(p.name))


def model_digest(directory: str | os.PathLike[str], patterns: Iterable[str] = DEFAULT_WEIGHT_PATTERNS) -> str:
    """``sha-256:<hex>`` over the weight files concatenated in ascending byte order of their file names.

    The files are streamed through one reused 1 MiB buffer; the model is never held in memory.
    """
    h = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    for path in weight_files(directory, patterns):
        _hash_file_into(h, path, view)
    return f.format_digest(h.digest())


def tokenizer_digest(path: str | os.PathLike[str]) -> str:
    """``sha-256:<hex>`` of the tokenizer definition file (for example tokenizer.json)."""
    h = hashlib.sha256()
    _hash_file_into(h, Path(path), memoryview(bytearray(_HASH_CHUNK)))
    return f.format_digest(h.digest())


def _hash_file_into(h: Any, path: Path, view: memoryview) -> None:
    try:
        with path.open("rb", buffering=0) as fh:
            while n := fh.readinto(view):
                h.update(view[:n])
    except OSError as exc:
        raise DescriptorError(f"cannot read {os.fspath(path)!r}: {exc.strerror}") from None


def dumps_descriptor(descriptor: CompatDescriptor) -> str:
    """Pretty JSON of a descriptor, for files people read."""
    return json.dumps(descriptor.to_json(), indent=2, sort_keys=True) + "\n"
