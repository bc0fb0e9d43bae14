"""Send-side flow control of our TCP connections (HTTP/1.1 and HTTP/2): asyncio's ``pause_writing`` /
``resume_writing`` and the coroutines that wait for the transport to drain."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from http3.asgi_bridge import ClientDisconnected

log = logging.getLogger("http3.tcp")


class WriteFlow:
    """Mixed into :class:`~http3.tcp_h1.H1Connection` and :class:`~http3.tcp_h2.H2Connection`, which provide
    ``loop``, ``closed``, ``settings``, ``info``, ``abort()`` and ``_on_timer()``, and set ``_write_paused =
    False``, ``_drain_waiters = []`` and ``_timer = None`` in their constructors."""

    protocol_name = "HTTP"
    loop: asyncio.AbstractEventLoop
    closed: bool
    settings: Any
    info: dict[str, Any]
    _write_paused: bool
    _drain_waiters: list[asyncio.Future[None]]
    _timer: asyncio.TimerHandle | None

    def abort(self) -> None:
        raise NotImplementedError

    def _on_timer(self) -> None:
        raise NotImplementedError

    def _arm_timer(self, delay: float) -> None:
        """One timer per connection (idle, header and body deadlines): *delay* seconds from now."""
        self._cancel_timer()
        if not self.closed:
            self._timer = self.loop.call_later(delay, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    def _fail_drain_waiters(self) -> None:
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ClientDisconnected("connection lost"))
        self._drain_waiters.clear()

    async def drain(self) -> None:
        """Return once the transport takes more data; a peer that stops reading for the idle timeout is cut."""
        if not self._write_paused:
            return
        if self.closed:
            raise ClientDisconnected("connection lost")
        waiter = self.loop.create_future()
        self._drain_waiters.append(waiter)
        try:
            async with asyncio.timeout(self.settings.idle_timeout):
                await waiter
        except TimeoutError:
            log.debug("%s peer %s stopped reading: closing", self.protocol_name, self.info["client"])
            self.abort()
            raise ClientDisconnected("the peer stopped reading") from None
