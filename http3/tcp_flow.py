"""What our TCP connections (HTTP/1.1 and HTTP/2) share: their state from accept to loss, one timer per
connection, and send-side flow control (asyncio's ``pause_writing`` / ``resume_writing`` and the coroutines that
wait for the transport to drain)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from http3.asgi_bridge import AsgiContext, ClientDisconnected

log = logging.getLogger("http3.tcp")

WRITE_HIGH_WATER = 1 << 20  # the transport pauses our writing above this many buffered octets


class WriteFlow:
    """The base of :class:`~http3.tcp_h1.H1Connection` and :class:`~http3.tcp_h2.H2Connection`, which provide
    ``abort()`` and ``_on_timer()`` and arm the timer once they are set up."""

    protocol_name = "HTTP"

    def __init__(self, ctx: AsgiContext, transport: asyncio.Transport, conn_info: dict[str, Any]) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.transport = transport
        self.info = conn_info  # client, server, tls
        self.loop = asyncio.get_running_loop()
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False  # the transport is gone
        self.closing = False  # graceful shutdown: no new requests or streams
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._last_rx = self.loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self.done: asyncio.Future[None] = self.loop.create_future()  # the transport is gone
        self.quiet: asyncio.Future[None] = self.loop.create_future()  # all written, close() called (or gone)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def _lost(self) -> None:
        """The end of ``connection_lost`` (after the protocol has told its requests): drain waiters fail, and
        ``quiet`` and ``done`` resolve."""
        self._fail_drain_waiters()
        for future in (self.quiet, self.done):
            if not future.done():
                future.set_result(None)

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

    @property
    def write_paused(self) -> bool:
        """The transport holds more than its high-water mark: writers wait (:meth:`writable`, :meth:`drain`)."""
        return self._write_paused

    async def writable(self) -> None:
        """Return once the transport is not paused. Unlike :meth:`drain` it waits again when another writer woken
        by the same resume filled the transport first: with many streams waiting (HTTP/2), each writes only while
        the buffer is below its high-water mark, so a peer that reads nothing holds about one batch beyond it."""
        while self._write_paused:
            await self.drain()

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
