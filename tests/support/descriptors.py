"""Compatibility Descriptors for the tests."""

from __future__ import annotations

from kvsp_quic.compat import CompatDescriptor
from tests import vectors


def small_descriptor(**changes: object) -> CompatDescriptor:
    """A small geometry for fast container tests: 4 layers, 2 heads, 8 dims, 4-token blocks."""
    base = dict(vectors.DESCRIPTOR, layers=4, kv_heads=2, head_dim=8)
    base.update(changes)
    return CompatDescriptor.from_json(base)
