"""vLLM's paged KV layouts <-> kvsp-layout-1 sections, exactly (copies, no arithmetic).

A kvsp-layout-1 K (or V) section of a block is ``(block_tokens, kv_heads, head_dim)``, token index slowest,
dimension fastest (spec, "KV Block Container"); gpu/kvcache.py keeps its pages so. vLLM keeps one tensor per
attention layer, whose shape and interior depend on the attention backend (measured on vLLM 0.32's kernels:
tests/test_vllm_layouts.py writes K and V with vLLM's own ``cpu_attn_reshape_and_cache`` and reads them back here):

* CPU, ``vec`` / ``vec16`` / ``neon`` ISAs (fp32 everywhere; bf16 and fp16 without AMX): ``[num_blocks, kv_heads,
  block_size, 2 * head_size]``; inside one (block, head) K is stored transposed (``head_size x block_size``), then V
  (``block_size x head_size``);
* CPU, ``amx`` ISA (bf16 on a CPU with AMX tiles): the same tensor, K packed as ``[bs/16][D/2][16][2]`` (token
  blocks of 16, then pairs of dimensions, 16 tokens, the pair) and V as ``[D/16][bs/2][16][2]`` (dimension blocks of
  16, token pairs, 16 dimensions, the pair);
* CUDA backends (FlashAttention, FlashInfer, Triton): ``[2, num_blocks, block_size, kv_heads, head_size]`` (NHD)
  or ``[2, num_blocks, kv_heads, block_size, head_size]`` (HND) -- written from vLLM's shapes, not yet checked against
  its CUDA kernels (this machine has no CUDA build of vLLM).

Each layout is one mapping, :meth:`PagedLayout.native` (a view of block *b* of a layer tensor in its native order)
and :meth:`PagedLayout.as_native` (a (B, H, D) section viewed in that same order): a block is read by copying the
first into the second, and written by copying the second into the first, so reading and writing can never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu.kvcache import as_octets

CPU_ISAS = ("vec", "vec16", "neon", "vsx", "vxe", "rvv")  # the K-transposed interior (csrc/cpu: cpu_attn_vec*.hpp)


@dataclass(frozen=True)
class PagedLayout:
    """One vLLM KV cache layout of blocks of *block_tokens* tokens, *kv_heads* x *head_dim*."""

    name: str
    block_tokens: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"layout {self.name!r}: expected one of {', '.join(LAYOUTS)}")
        if self.name == "cpu-amx" and (self.block_tokens % 16 or self.head_dim % 16):
            raise ValueError("the AMX layout needs block and head sizes that are multiples of 16")

    @property
    def section_shape(self) -> tuple[int, int, int]:
        return (self.block_tokens, self.kv_heads, self.head_dim)

    def check(self, layer: torch.Tensor) -> None:
        """ValueError unless *layer* is a layer tensor of this layout."""
        b, h, d = self.section_shape
        if self.name.startswith("cpu"):
            ok = layer.dim() == 4 and tuple(layer.shape[1:]) == (h, b, 2 * d)
        elif self.name == "cuda-nhd":
            ok = layer.dim() == 5 and layer.shape[0] == 2 and tuple(layer.shape[2:]) == (b, h, d)
        else:
            ok = layer.dim() == 5 and layer.shape[0] == 2 and tuple(layer.shape[2:]) == (h, b, d)
        if not ok:
            raise ValueError(f"a KV cache tensor of shape {tuple(layer.shape)} is not of layout {self.name} "
                             f"(block {b}, {h} KV heads x {d})")

    def native(self, layer: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of *block* in *layer*: views in the layout's own order (writable)."""
        b, h, d = self.section_shape
        if self.name == "cuda-nhd":
            return layer[0, block], layer[1, block]
        if self.name == "cuda-hnd":
            return layer[0, block], layer[1, block]
        slab = layer[block].view(h, 2 * b * d)
        k, v = slab[:, :b * d], slab[:, b * d:]
        if self.name == "cpu-amx":
            return k.view(h, b // 16, d // 2, 16, 2), v.view(h, d // 16, b // 2, 16, 2)
        return k.view(h, d, b), v.view(h, b, d)

    def as_native(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sections *k*, *v* of shape (B, H, D) viewed in the order of :meth:`native` (same shapes)."""
        b, h, d = self.section_shape
        if self.name == "cuda-nhd":
            return k, v
        if self.name == "cuda-hnd":
            return k.permute(1, 0, 2), v.permute(1, 0, 2)
        if self.name == "cpu-amx":
            # K[t = 16 tb + i, d = 2 p + j] at [h][tb][p][i][j]; V[t = 2 q + j, d = 16 db + i] at [h][db][q][i][j]
            k5 = k.view(b // 16, 16, h, d // 2, 2).permute(2, 0, 3, 1, 4)
            v5 = v.view(b // 2, 2, h, d // 16, 16).permute(2, 3, 0, 4, 1)
            return k5, v5
        return k.permute(1, 2, 0), v.permute(1, 0, 2)

    def read(self, layer: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block *block* of *layer* as two new contiguous (B, H, D) sections (on the layer's device)."""
        k = torch.empty(self.section_shape, dtype=layer.dtype, device=layer.device)
        v = torch.empty_like(k)
        src_k, src_v = self.native(layer, block)
        dst_k, dst_v = self.as_native(k, v)
        dst_k.copy_(src_k)
        dst_v.copy_(src_v)
        return k, v

    def write(self, layer: torch.Tensor, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store sections *k*, *v* ((B, H, D), the layer's dtype) as block *block* of *layer*."""
        if tuple(k.shape) != self.section_shape or tuple(v.shape) != self.section_shape:
            raise ValueError(f"sections of shape {tuple(k.shape)} and {tuple(v.shape)}; the layout takes "
                             f"{self.section_shape}")
        if k.dtype != layer.dtype or v.dtype != layer.dtype:
            raise ValueError(f"sections of {k.dtype} into a cache of {layer.dtype}: convert first, exactly")
        dst_k, dst_v = self.native(layer, block)
        src_k, src_v = self.as_native(k.to(layer.device), v.to(layer.device))
        dst_k.copy_(src_k)
        dst_v.copy_(src_v)

    def write_octets(self, layer: torch.Tensor, block: int, k_parts: Sequence[Any], v_parts: Sequence[Any]) -> None:
        """Store a received layer (its kvsp-layout-1 K and V sections, each in the parts it arrived in) as block
        *block* of *layer*: one copy from the received octets (two when a section arrived in several parts)."""
        self.write(layer, block, self._section(k_parts, layer.dtype), self._section(v_parts, layer.dtype))

    def _section(self, parts: Sequence[Any], dtype: torch.dtype) -> torch.Tensor:
        octets = as_octets(parts[0]) if len(parts) == 1 else torch.cat([as_octets(p) for p in parts])
        want = self.block_tokens * self.kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()
        if octets.numel() != want:
            raise ValueError(f"a section of {octets.numel()} octets; a block of this layout has {want}")
        return octets.view(dtype).view(self.section_shape)


LAYOUTS = ("cpu", "cpu-amx", "cuda-nhd", "cuda-hnd")


def cpu_layout_name(isa: str) -> str:
    """The layout of vLLM's CPU attention for ISA *isa* (``CPUAttentionBackendImpl``'s ``layer.isa``)."""
    if isa == "amx":
        return "cpu-amx"
    if isa in CPU_ISAS:
        return "cpu"
    raise ValueError(f"vLLM's CPU attention ISA {isa!r} has no known KV layout (known: amx, {', '.join(CPU_ISAS)})")


__all__ = ["LAYOUTS", "PagedLayout", "cpu_layout_name"]
