"""HTTP/3 for ASGI apps: the ``h3`` handler of :class:`quic.listener.QuicListener`.

Each request stream becomes one :class:`http3.asgi_bridge.Exchange`, the same request/response machinery the
TCP transports use. What is HTTP/3-specific lives here: request bodies are credited back to the peer only once
the app has taken them (:meth:`KvspQuicConnection.hold` / ``release``), so the stream window bounds what waits
in memory; response bodies are written in slices no larger than half the send buffer, each waiting for QUIC to
drain, so a 256 MiB response is never queued whole.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.h3.exceptions import H3Error
from aioquic.quic import events

from http3.asgi_bridge import AsgiContext, Buffer, ClientDisconnected, Exchange, Headers, RequestBody, http_scope
from http3.asgi_types import ASGIApp
from http3.h3_frames import send_data
from quic.listener import HandlerFactory, QuicConnectionContext

log = logging.getLogger("kvsp.h3")

H3_INTERNAL_ERROR = 0x102
H3_REQUEST_REJECTED = 0x10B


class H3AsgiHandler:
    """Serves one QUIC connection's HTTP/3 requests with an ASGI app."""

    def __init__(self, ctx: QuicConnectionContext, asgi: AsgiContext) -> None:
        self.ctx = ctx
        self.asgi = asgi
        self.h3 = H3Connection(ctx.quic)
        self.streams: dict[int, H3Stream] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamReset | events.StopSendingReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.abort()
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                if h3_event.stream_id not in self.streams:  # otherwise trailers: not used by KVSP, ignored
                    self._start(h3_event)
            elif isinstance(h3_event, DataReceived):
                stream = self.streams.get(h3_event.stream_id)
                if stream is not None:
                    stream.data_received(h3_event.data, h3_event.stream_ended)

    def connection_terminated(self) -> None:
        for stream in list(self.streams.values()):
            stream.abort()

    async def drain(self) -> None:
        await self._idle.wait()

    def _start(self, event: HeadersReceived) -> None:
        stream = H3Stream(self, event.stream_id)
        self.streams[event.stream_id] = stream
        self._idle.clear()
        stream.start(event.headers, event.stream_ended)

    def finished(self, stream: H3Stream) -> None:
        self.streams.pop(stream.stream_id, None)
        self.ctx.quic.forget(stream.stream_id)
        if not self.streams:
            self._idle.set()


class H3Stream:
    """One request stream: the HTTP/3 side of an Exchange (its RequestBody feeder and its ResponseSink)."""

    def __init__(self, handler: H3AsgiHandler, stream_id: int) -> None:
        self.handler = handler
        self.stream_id = stream_id
        self.quic = handler.ctx.quic
        self.body = RequestBody(handler.asgi, on_consumed=self._consumed)
        self.exchange: Exchange | None = None
        self._closed = False
        self._tasks = 0

    def start(self, raw_headers: Headers, ended: bool) -> None:
        settings = self.handler.asgi.settings
        pseudo: dict[bytes, bytes] = {}
        headers: Headers = []
        size = 0
        for name, value in raw_headers:
            size += len(name) + len(value)
            if name.startswith(b":"):
                pseudo[name] = value
            else:
                headers.append((name, value))
        if b":authority" in pseudo:
            headers.insert(0, (b"host", pseudo[b":authority"]))
        target = pseudo.get(b":path", b"")
        scope = http_scope(self.handler.asgi, http_version="3",
                           method=pseudo.get(b":method", b"GET").decode("ascii", "replace"), target=target,
                           headers=headers, client=self.handler.ctx.client, server=self.handler.ctx.server,
                           tls=self.handler.ctx.tls)
        self.exchange = Exchange(self.handler.asgi, scope, self.body, self)
        length = dict(headers).get(b"content-length")
        rejection: int | None = None
        if size > settings.max_header_bytes:
            rejection = 431
        elif b":method" not in pseudo or b":scheme" not in pseudo or not target.startswith(b"/"):
            rejection = 400
        elif length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
            rejection = 413 if length.isdigit() else 400
        if ended:
            self.body.finish()
        if rejection is not None:
            self._reject(rejection)
        else:
            self._watch(asyncio.ensure_future(self.exchange.run()))

    def data_received(self, data: bytes, ended: bool) -> None:
        if data and not self.body.disconnected:
            self.quic.hold(self.stream_id, len(data))
            self.body.feed(data)
            if self.body.received > self.handler.asgi.settings.max_body_bytes:
                self._reject(413)
                return
        if ended:
            self.body.finish()

    def _reject(self, status: int) -> None:
        assert self.exchange is not None
        if not self.body.complete:
            self.quic.stop_stream(self.stream_id, H3_REQUEST_REJECTED)  # we will not read the rest
            self.handler.ctx.transmit()
        task = self.exchange.reject(status)
        if task is not None:
            self._watch(task)

    def _watch(self, task: asyncio.Future[None]) -> None:
        """The stream is over when every task working on it (the app, a rejection) is done."""
        self._tasks += 1

        def done(_: Any) -> None:
            self._tasks -= 1
            if not self._tasks:
                self.handler.finished(self)
        task.add_done_callback(done)

    def _consumed(self, n: int) -> None:
        if self.quic.release(self.stream_id, n):
            self.handler.ctx.transmit()  # a window update is due: grant the credit now

    def abort(self) -> None:
        """The peer reset the stream or the connection is gone."""
        if not self._closed:
            self._closed = True
            self.body.disconnect()
            self.quic.forget(self.stream_id)

    # -- ResponseSink -----------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    async def send_head(self, status: int, headers: Headers, body: Buffer, end: bool) -> None:
        self._check()
        self.handler.h3.send_headers(self.stream_id, [(b":status", b"%d" % status), *headers],
                                     end_stream=end and not body)
        self.handler.ctx.transmit()
        if body:
            await self.send_data(body, end)

    async def send_data(self, data: Buffer, end: bool) -> None:
        ctx = self.handler.ctx
        step = max(ctx.settings.send_buffer // 2, 16384)
        view = memoryview(data)
        if not view:
            self._check()
            send_data(self.handler.h3, self.stream_id, b"", end_stream=end)
            ctx.transmit()
            return
        for offset in range(0, len(view), step):
            await ctx.wait_writable(self.stream_id)
            self._check()
            last = offset + step >= len(view)
            send_data(self.handler.h3, self.stream_id, view[offset:offset + step], end_stream=end and last)
            ctx.transmit()

    def _check(self) -> None:
        if self._closed:
            raise ClientDisconnected("the client reset the stream or went away")

    def reset(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.quic.reset_stream(self.stream_id, H3_INTERNAL_ERROR)
            self.handler.ctx.transmit()
        except (H3Error, AssertionError, ValueError):  # the stream may already be gone
            log.debug("reset of stream %d failed", self.stream_id, exc_info=True)


def h3_handler(app: ASGIApp | None = None, *, asgi: AsgiContext | None = None) -> HandlerFactory:
    """A handler factory for :class:`~quic.listener.QuicListener`: ``{"h3": h3_handler(app)}``.

    Pass *asgi* to share an :class:`AsgiContext` (and its lifespan state) with the TCP server of the same app.
    """
    def factory(ctx: QuicConnectionContext) -> H3AsgiHandler:
        nonlocal asgi
        if asgi is None:
            assert app is not None, "h3_handler needs an app or an AsgiContext"
            asgi = AsgiContext(app, ctx.settings, alt_svc=None)
        return H3AsgiHandler(ctx, asgi)
    return factory
