"""The event loop every server process runs on: uvloop where it is installed, else asyncio's own.

``[server] event_loop`` (``--event-loop``) chooses: ``"auto"`` (the default) takes uvloop when it can be imported,
``"uvloop"`` requires it (a configuration error otherwise), ``"asyncio"`` keeps the standard library's loop.
uvloop runs the same asyncio programs with its transports, TLS layer and scheduler written in Cython (libuv):
on the block data path it takes about a third of the client's CPU off a 16 MiB GET over the TCP path and
a quarter of the holder's off a 256 KiB one (benchmarks/RESULTS.md, docs/performance.md "Event loop").
Nothing in the product depends on which loop runs; the test suite runs the in-process tests on asyncio's loop
(``KVSP_TEST_LOOP=uvloop`` runs them on uvloop) and every server it starts as a process on the default.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHOICES = ("auto", "uvloop", "asyncio")


class EventLoopError(Exception):
    """A loop that cannot be had; the message is one line for the user."""


def loop_factory(choice: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the loop *choice* names (``None``: asyncio's default)."""
    if choice not in CHOICES:
        raise EventLoopError(f"event_loop {choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise EventLoopError("event_loop 'uvloop' needs the uvloop package: pip install uvloop") from None
        return None
    return uvloop.new_event_loop


def name(choice: str = "auto") -> str:
    """What *choice* runs on: ``"uvloop"`` or ``"asyncio"``."""
    return "asyncio" if loop_factory(choice) is None else "uvloop"


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop *choice* names."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
