"""K and V sections for tools and tests: seeded random data, and sections read from .npy files.

Random sections hold finite values of the element type (normally distributed, scaled like attention keys), so
a consumer that interprets them as numbers never meets NaN or infinity.
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Any

import numpy as np

from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.problems import BadRequest


def example_descriptor() -> CompatDescriptor:
    """The Compatibility Descriptor of the spec's test vectors (package data), the default of ``--dev`` roles."""
    text = resources.files("kvsp_quic").joinpath("data/example-descriptor.json").read_text()
    return CompatDescriptor.loads(text)


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even (finite inputs)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def random_sections(descriptor: CompatDescriptor, tokens: int, first_layer: int, last_layer: int,
                    seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(K, V) arrays of shape (tokens, kv_heads, head_dim) per layer, reproducible from *seed*."""
    rng = np.random.default_rng(seed)
    shape = (tokens, descriptor.kv_heads, descriptor.head_dim)
    return [(_random_section(rng, descriptor.kv_dtype, shape), _random_section(rng, descriptor.kv_dtype, shape))
            for _ in range(first_layer, last_layer + 1)]


def _random_section(rng: np.random.Generator, kv_dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if kv_dtype in ("fp8-e4m3", "fp8-e5m2"):
        octets = rng.integers(0, 256, size=shape, dtype=np.uint8)
        if kv_dtype == "fp8-e4m3":  # NaN is S.1111.111 only
            octets[(octets & 0x7F) == 0x7F] &= 0xFE
        else:  # exponent 11111 is infinity or NaN
            octets[(octets & 0x7C) == 0x7C] &= 0xFB
        return octets
    values = rng.standard_normal(size=shape, dtype=np.float32)
    if kv_dtype == "fp32":
        return values
    if kv_dtype == "fp16":
        return values.astype("<f2")
    return float32_to_bf16_bits(values)


_NPY_ACCEPTS = {
    "fp32": ("float32",),
    "fp16": ("float16", "float32"),
    "bf16": ("uint16", "float32"),
    "fp8-e4m3": ("uint8",),
    "fp8-e5m2": ("uint8",),
}


def sections_from_npy(path: str | os.PathLike[str], descriptor: CompatDescriptor,
                      tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Sections from an array of shape (layers, 2, tokens, kv_heads, head_dim), memory-mapped.

    Accepted element types: the dtype itself (float32, float16), uint16 / uint8 bit patterns for bf16 and fp8,
    and float32 converted to fp16 or bf16 (round to nearest even).
    """
    try:
        arr: Any = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise BadRequest(f"cannot read {os.fspath(path)!r} as .npy: {exc}") from None
    want = (2, tokens, descriptor.kv_heads, descriptor.head_dim)
    if arr.ndim != 5 or tuple(arr.shape[1:]) != want:
        expected = ", ".join(map(str, want))
        raise BadRequest(f"{os.fspath(path)!r} has shape {tuple(arr.shape)}; expected (layers, {expected})")
    name = arr.dtype.newbyteorder("=").name
    if name not in _NPY_ACCEPTS[descriptor.kv_dtype]:
        raise BadRequest(f"{os.fspath(path)!r} holds {arr.dtype}; a {descriptor.kv_dtype} section accepts "
                         f"{' or '.join(_NPY_ACCEPTS[descriptor.kv_dtype])}")
    out = []
    for layer in arr:
        out.append((_convert(layer[0], descriptor.kv_dtype), _convert(layer[1], descriptor.kv_dtype)))
    return out


def _convert(section: np.ndarray, kv_dtype: str) -> np.ndarray:
    if kv_dtype == "bf16" and section.dtype.kind == "f":
        return float32_to_bf16_bits(section)
    if kv_dtype == "fp16" and section.dtype.itemsize == 4:
        return section.astype("<f2")
    return np.ascontiguousarray(section)
