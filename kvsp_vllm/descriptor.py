"""The Compatibility Descriptor of a model served by vLLM: the one the reference and transformers engines derive.

vLLM's configuration names the model directory, the block size and the element types; the descriptor is
:func:`gpu.modelfiles.derive_descriptor` of those, the function both of our engines call (``kvsp-quic vllm
descriptor`` too), so that a block vLLM stores is a block they load, and back (spec, "Compatibility Descriptor").
Containers stay in kvsp-layout-1 whatever vLLM's paged layout (:mod:`kvsp_vllm.layouts`).
"""

from __future__ import annotations

import os
from typing import Any

from gpu.kvcache import TORCH_TO_KV
from gpu.modelfiles import derive_descriptor
from kvsp_quic.compat import CompatDescriptor

QUANTIZED = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")  # vLLM's scaled KV caches: not (yet) shared


class UnsupportedConfig(ValueError):
    """A vLLM configuration whose KV cache this connector cannot share; one line saying why."""


def kv_dtype_of(model_dtype: Any, cache_dtype: str = "auto") -> str:
    """The KVSP element type of vLLM's KV cache: the model's dtype (a torch dtype) when *cache_dtype* is
    ``"auto"``; vLLM's fp8 caches carry per-layer scales, which kvsp-layout-1 has no room for."""
    if cache_dtype != "auto":
        if cache_dtype in QUANTIZED:
            raise UnsupportedConfig(f"kv_cache_dtype {cache_dtype!r}: vLLM's scaled fp8 KV caches are not shared "
                                    f"through KVSP yet (use kv_cache_dtype='auto')")
        raise UnsupportedConfig(f"kv_cache_dtype {cache_dtype!r} is not one this connector knows")
    try:
        return TORCH_TO_KV[model_dtype]
    except KeyError:
        raise UnsupportedConfig(f"model dtype {model_dtype}: the KV element type must be one of "
                                f"{', '.join(map(str, TORCH_TO_KV))}") from None


def descriptor_of(model: str | os.PathLike[str], block_size: int, kv_dtype: str) -> CompatDescriptor:
    """The descriptor of the model directory *model* (a local directory: vLLM's ``model``) with blocks of
    *block_size* tokens of *kv_dtype*."""
    if not os.path.isdir(model):
        raise UnsupportedConfig(f"model {os.fspath(model)!r} is not a local directory: the descriptor digests "
                                f"its files (download it first, e.g. huggingface-cli download)")
    return derive_descriptor(model, block_size, kv_dtype=kv_dtype)


__all__ = ["UnsupportedConfig", "descriptor_of", "kv_dtype_of"]
