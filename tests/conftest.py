from __future__ import annotations

import os
from typing import Any

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


if os.environ.get("KVSP_TEST_LOOP") == "uvloop":  # the in-process tests on uvloop, as the servers run by default
    def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
        import uvloop
        return {"uvloop": uvloop.new_event_loop}
