"""HTTP/3 for ASGI apps: the ``h3`` handler of :class:`quic.listener.QuicListener`.

Each request stream becomes one :class:`http3.asgi_bridge.Exchange`, the same request/response machinery the
TCP transports use. What is HTTP/3-specific lives here: request bodies are credited back to the peer only once
the app has taken them (:meth:`KvspQuicConnection.hold` / ``release``), so the stream window bounds what waits
in memory; response bodies are written in slices no larger than half the send buffer, each waiting for QUIC to
drain, so a 256 MiB response is never queued whole.

Field sections are bounded as they arrive (RFC 9114, 4.2.2 and 10.5.1: "Since there is no hard limit to the size of
a field section, some endpoints could be forced to commit a large amount of available memory for field sections"):
octets aioquic buffers on a request stream -- an unfinished HEADERS frame, or frames that wait behind a blocked
QPACK decoder -- count as unread, so the stream window is not granted again for them; and a HEADERS frame whose
declared length exceeds ``max_header_bytes`` is refused as soon as its frame header is read, long before it is
complete. The refusal answers 431 when no response has begun (RFC 9114, 4.2.2: "A server that receives a larger
header section than it is willing to handle can send an HTTP 431"), asks the peer to stop sending with
``H3_EXCESSIVE_LOAD`` (RFC 9114, 8.1: "The endpoint detected that its peer is exhibiting a behavior that might be
generating excessive load") and drops whatever else arrives on the stream. It is a stream error, not a connection
error: the peer's other requests go on (RFC 9114, 10.5: false positives of a connection error "will result in
disrupting valid connections and requests"). A request stream's buffer beyond ``max_header_bytes`` (plus a frame
header) is refused the same way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aioquic.h3.connection import FrameType, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.h3.exceptions import H3Error
from aioquic.quic import events

from http3.asgi_bridge import AsgiContext, Buffer, ClientDisconnected, Exchange, Headers, RequestBody, http_scope
from http3.asgi_types import ASGIApp
from http3.h3_frames import send_data
from quic.listener import HandlerFactory, QuicConnectionContext

log = logging.getLogger("kvsp.h3")

H3_INTERNAL_ERROR = 0x102
H3_EXCESSIVE_LOAD = 0x107
H3_REQUEST_REJECTED = 0x10B
_FIELD_FRAMES = (FrameType.HEADERS, FrameType.PUSH_PROMISE)
_FRAME_HEADER_MAX = 16  # a frame type and a frame length, two varints of at most 8 octets


class H3AsgiHandler:
    """Serves one QUIC connection's HTTP/3 requests with an ASGI app."""

    def __init__(self, ctx: QuicConnectionContext, asgi: AsgiContext) -> None:
        self.ctx = ctx
        self.asgi = asgi
        self.h3 = H3Connection(ctx.quic)
        self.streams: dict[int, H3Stream] = {}
        self._buffered: dict[int, int] = {}  # octets aioquic buffers per request stream, held as unread
        self._refused: set[int] = set()  # request streams refused for their field section: input is dropped
        self.refusals = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamReset | events.StopSendingReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.abort()
            if isinstance(event, events.StreamReset):
                self._refused.discard(event.stream_id)
                self._unbuffer(event.stream_id)
        if isinstance(event, events.StreamDataReceived) and event.stream_id in self._refused:
            return  # refused: nothing more is buffered for it
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                if h3_event.stream_id not in self.streams:  # otherwise trailers: not used by KVSP, ignored
                    self._start(h3_event)
            elif isinstance(h3_event, DataReceived):
                stream = self.streams.get(h3_event.stream_id)
                if stream is not None:
                    stream.data_received(h3_event.data, h3_event.stream_ended)
        if isinstance(event, events.StreamDataReceived) and event.stream_id % 4 == 0:
            self._bound(event.stream_id)

    # -- field sections: bounded as they arrive ---------------------------------------------------------------

    def _bound(self, stream_id: int) -> None:
        """After aioquic took data of request stream *stream_id*: refuse a field section that is too large,
        hold what aioquic buffers (unread: no credit is granted again for it)."""
        h3_stream = self.h3._stream.get(stream_id)
        if h3_stream is None:
            return
        limit = self.asgi.settings.max_header_bytes
        declared = h3_stream.frame_size if h3_stream.frame_type in _FIELD_FRAMES else None
        if declared is not None and declared > limit:
            self._refuse(stream_id, f"a field section frame of {declared} octets (limit {limit})")
            return
        buffered = len(h3_stream.buffer)
        if buffered > limit + _FRAME_HEADER_MAX:
            self._refuse(stream_id, f"{buffered} octets buffered before a field section completed")
            return
        held = self._buffered.get(stream_id, 0)
        if buffered > held:
            self.ctx.quic.hold(stream_id, buffered - held)
        elif buffered < held and self.ctx.quic.release(stream_id, held - buffered):
            self.ctx.transmit()
        if buffered:
            self._buffered[stream_id] = buffered
        else:
            self._buffered.pop(stream_id, None)

    def _unbuffer(self, stream_id: int) -> None:
        held = self._buffered.pop(stream_id, 0)
        if held and self.ctx.quic.release(stream_id, held):
            self.ctx.transmit()

    def _refuse(self, stream_id: int, why: str) -> None:
        """Refuse request stream *stream_id* for its field section (see the module docstring)."""
        log.info("stream %d refused: %s", stream_id, why)
        self.refusals += 1
        self._refused.add(stream_id)
        h3_stream = self.h3._stream.get(stream_id)
        if h3_stream is not None:
            h3_stream.buffer = b""  # drop what aioquic holds
        self._unbuffer(stream_id)
        quic = self.ctx.quic
        try:
            quic.stop_stream(stream_id, H3_EXCESSIVE_LOAD)
            stream = self.streams.get(stream_id)
            if stream is None:  # no response has begun: answer 431 and close our side
                self.h3.send_headers(stream_id, [(b":status", b"431"), (b"content-length", b"0")], end_stream=True)
            else:  # trailers: the request is being served; it ends here
                stream.abort()
                quic.reset_stream(stream_id, H3_EXCESSIVE_LOAD)
        except (H3Error, AssertionError, ValueError):  # the stream may already be gone
            log.debug("refusing stream %d failed", stream_id, exc_info=True)
        self.ctx.transmit()

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
        self._buffered.pop(stream.stream_id, None)  # forget() below releases every held octet
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
