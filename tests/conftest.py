from __future__ import annotations

import pytest

from kvsp_quic.compat import CompatDescriptor
from tests import vectors


@pytest.fixture
def spec_descriptor() -> CompatDescriptor:
    return CompatDescriptor.from_json(vectors.DESCRIPTOR)


def small_descriptor(**changes: object) -> CompatDescriptor:
    """A small geometry for fast container tests: 4 layers, 2 heads, 8 dims, 4-token blocks."""
    base = dict(vectors.DESCRIPTOR, layers=4, kv_heads=2, head_dim=8)
    base.update(changes)
    return CompatDescriptor.from_json(base)
