"""Waiting for an event in a test: one bounded poll, never a sleep followed by an assertion.

``until(check)`` polls *check* -- a plain predicate or one returning an awaitable -- until it holds, and returns the
seconds that took, so that a test can also bound how long the event took. It fails with *what* after *timeout*.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

Check = Callable[[], "bool | Awaitable[bool]"]


async def holds(check: Check) -> bool:
    result = check()
    if inspect.isawaitable(result):
        result = await result
    return bool(result)


async def until(check: Check, timeout: float = 10.0, what: str = "the condition", every: float = 0.02) -> float:
    """Seconds until *check* holds (polled every *every* seconds); an AssertionError after *timeout*."""
    start = time.monotonic()
    while not await holds(check):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(every)
    return time.monotonic() - start
