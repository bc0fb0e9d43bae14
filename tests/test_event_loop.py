"""The servers' event loop choice (kvsp_app/event_loop.py): ``[server] event_loop`` / ``--event-loop``."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from kvsp_app import event_loop
from kvsp_app.config import ConfigError, ServerSection
from tests.helpers import run_cli


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_auto_and_uvloop_run_on_uvloop_asyncio_on_the_standard_loop() -> None:
    assert event_loop.run(_loop_type()) is uvloop.Loop
    assert event_loop.run(_loop_type(), "uvloop") is uvloop.Loop
    standard = event_loop.run(_loop_type(), "asyncio")
    assert standard is not uvloop.Loop and issubclass(standard, asyncio.BaseEventLoop)
    assert event_loop.name("auto") == "uvloop" and event_loop.name("asyncio") == "asyncio"


def test_an_unknown_loop_is_a_one_line_error() -> None:
    with pytest.raises(event_loop.EventLoopError, match="expected one of auto, uvloop, asyncio"):
        event_loop.loop_factory("trio")
    with pytest.raises(ConfigError, match=r"server.event_loop 'trio': expected one of auto, uvloop, asyncio"):
        ServerSection(event_loop="trio")


def test_uvloop_required_but_missing_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    with pytest.raises(event_loop.EventLoopError, match="needs the uvloop package"):
        event_loop.loop_factory("uvloop")
    assert event_loop.loop_factory("auto") is None  # auto falls back to asyncio's loop


def test_the_cli_refuses_an_unknown_loop(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    code, _, err = run_cli(capsys, "holder", "--dev", str(tmp_path), "--event-loop", "trio")
    assert code == 2 and "invalid choice: 'trio'" in err and "Traceback" not in err
