"""Blocks for the storage tier tests (kvsp_quic/storage/tiers.py)."""

from __future__ import annotations

from kvsp_quic import container as c
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.samples import random_sections
from kvsp_quic.storage.tiers import BlockId, BlockMeta


def block(descriptor: CompatDescriptor, n: int, scope: bytes = bytes(16)) -> tuple[BlockMeta, memoryview]:
    """Block number *n*: a complete container of the descriptor, with its meta."""
    enc = c.encode(random_sections(descriptor, descriptor.block_tokens, 0, descriptor.layers - 1, n),
                   first_layer=0, token_count=descriptor.block_tokens, descriptor=descriptor)
    data = memoryview(enc.tobytes())
    assert enc.layer_digests is not None
    meta = BlockMeta(BlockId(descriptor.compat_id, scope, n.to_bytes(32, "big")), enc.header, enc.layer_digests,
                     len(data))
    return meta, data


def never(_block: BlockId) -> bool:
    return False
