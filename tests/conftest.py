from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsp_quic.compat import CompatDescriptor
from tests import vectors
from tests.helpers import Process
from tests.peers import missing_peer
from tests.redis_server import REDIS_SERVER, SKIP_REASON, RedisServer
from tests.support.descriptors import small_descriptor  # noqa: F401  (still imported from here by two modules)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs_peer"):  # tests/peers.py
        if mark.args and mark.args[0] is not None:
            missing_peer(mark.args[0])


@pytest.fixture
def spec_descriptor() -> CompatDescriptor:
    return CompatDescriptor.from_json(vectors.DESCRIPTOR)


if os.environ.get("KVSP_TEST_LOOP") == "uvloop":  # the in-process tests on uvloop, as the servers run by default
    def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
        import uvloop
        return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A redis-server of the test's own (skipped where it is not installed)."""
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
    with RedisServer.start(tmp_path / "redis") as server:
        yield server.url


@pytest.fixture
def procs() -> Iterator[list[Process]]:
    """The ``kvsp-quic`` processes a test started: stopped at its end (a frozen one woken first), none with a
    traceback on stderr."""
    started: list[Process] = []
    yield started
    for proc in reversed(started):
        if proc.proc.stderr is not None and proc.proc.stderr.closed:
            continue  # the test stopped it itself
        if proc.proc.poll() is None:
            os.kill(proc.proc.pid, signal.SIGCONT)
        err = proc.stop()
        assert "Traceback" not in err, err
