"""Deadlines of the lean HTTP/1.1 client (:mod:`http3.h1_client`): the deadlines of a pool's exchanges run on one
timer (:class:`Deadlines`) rather than two ``asyncio.timeout`` per request; a passed one is
:class:`http3.errors.RequestTimeout`."""

from __future__ import annotations

import asyncio
import math
from typing import Protocol

from http3.errors import RequestTimeout


class _Waiting(Protocol):
    """A connection with a deadline: :meth:`fail` wakes its waiters with the error and aborts its transport."""

    def fail(self, exc: BaseException) -> None: ...


class Deadlines:
    """The deadlines of one pool's exchanges, kept by one timer rather than one per request (an
    ``asyncio.timeout`` costs ~16 us to enter and leave, twice per request, against ~1 ms of CPU for a whole
    256 KiB block GET: issue 16). A connection waiting under a deadline is listed; the timer is set for the
    earliest deadline and moved only when an earlier one comes, so back-to-back requests with the same timeout
    set it about once per timeout. When it fires, every listed connection whose deadline passed fails with
    :class:`~http3.errors.RequestTimeout` (its waiters wake with it and its transport is aborted) and the timer is
    set for the next."""

    SLACK = 0.001  # s: a timer that fires this early counts as on time (event loop timers round)

    def __init__(self) -> None:
        self._waiting: dict[_Waiting, tuple[float, str]] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._at = math.inf

    def watch(self, conn: _Waiting, deadline: float, what: str) -> None:
        """*conn* fails with ``RequestTimeout(what)`` unless :meth:`clear` comes before *deadline* (``loop.time()``)."""
        self._waiting[conn] = (deadline, what)
        loop = asyncio.get_running_loop()
        if deadline < self._at or loop is not self._loop:
            self._arm(loop, deadline)

    def clear(self, conn: _Waiting) -> None:
        self._waiting.pop(conn, None)

    def close(self) -> None:
        """Forget every deadline and stop the timer (the pool is closing)."""
        self._waiting.clear()
        if self._handle is not None:
            self._handle.cancel()
        self._handle, self._loop, self._at = None, None, math.inf

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._loop, self._at = loop, at
        self._handle = loop.call_at(at, self._fire)

    def _fire(self) -> None:
        loop = self._loop
        self._handle, self._at = None, math.inf
        if loop is None:
            return
        now = loop.time() + self.SLACK
        expired = [(conn, what) for conn, (at, what) in self._waiting.items() if at <= now]
        for conn, what in expired:
            del self._waiting[conn]
            conn.fail(RequestTimeout(what))
        if self._waiting:
            self._arm(loop, min(at for at, _ in self._waiting.values()))


__all__ = ["Deadlines"]
