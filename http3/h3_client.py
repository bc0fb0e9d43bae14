"""HTTP/3 client connections: mutual TLS, many concurrent streams, streamed bodies with backpressure.

:class:`H3ClientConnection` is one QUIC connection to one origin; :class:`H3Pool` keeps connections per origin and
opens another when every stream of the existing ones is taken. The facade that adds fallback to HTTP/2 and
HTTP/1.1, retries and timeouts is :mod:`http3.client`. The QUIC side (batched receiving, transmits, send
backpressure, HANDSHAKE_DONE, connecting) is :mod:`quic.protocol`'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic import events

from http3.h3_frames import send_data
from quic.connection import KvspQuicConnection
from quic.protocol import KvspQuicProtocol, QuicConnectError, connect_quic
from quic.tls import TlsFiles, TransportSettings

H3_NO_ERROR = 0x100
H3_REQUEST_CANCELLED = 0x10C
_COALESCE = 1 << 20


class H3ConnectError(QuicConnectError):
    """The QUIC handshake failed or timed out (UDP blocked, h3 refused, certificate rejected)."""


class H3StreamError(ConnectionError):
    """The stream or connection broke during an exchange."""


class H3Response:
    """An HTTP/3 response whose body streams in as the caller reads it."""

    def __init__(self, conn: H3ClientConnection, stream_id: int) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.http_version = "HTTP/3"
        self._headers_ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._ended = False
        self._error: Exception | None = None
        self._wakeup = asyncio.Event()
        self._closed = False
        self.stop_sending = False  # the server asked us to stop sending the request body

    # events from the connection

    def _on_headers(self, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        if self._headers_ready.done():
            return  # trailers
        fields = []
        for name, value in headers:
            if name == b":status":
                self.status = int(value)
            elif not name.startswith(b":"):
                fields.append((name, value))
        self.headers = fields
        self._ended = ended
        self._headers_ready.set_result(None)
        self._wakeup.set()

    def _on_data(self, data: bytes, ended: bool) -> None:
        if data:
            self._chunks.append(data)
            self._conn.quic.hold(self.stream_id, len(data))
        self._ended = self._ended or ended
        self._wakeup.set()

    def _on_error(self, exc: Exception) -> None:
        if self._error is None and not (self._ended and not self._chunks):
            self._error = exc
        if not self._headers_ready.done():
            self._headers_ready.set_exception(exc)
        self._wakeup.set()

    # API

    async def wait_headers(self) -> None:
        await self._headers_ready

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        while True:
            while not self._chunks and not self._ended and self._error is None:
                self._wakeup.clear()
                await self._wakeup.wait()
            if self._chunks:
                chunk = self._chunks.popleft()
                if self._chunks and len(chunk) < _COALESCE:
                    parts, size = [chunk], len(chunk)
                    while self._chunks and size + len(self._chunks[0]) <= _COALESCE:
                        part = self._chunks.popleft()
                        parts.append(part)
                        size += len(part)
                    chunk = b"".join(parts)
                if self._conn.quic.release(self.stream_id, len(chunk)):
                    self._conn.transmit_soon()
                yield chunk
                continue
            if self._error is not None:
                raise self._error
            return

    async def aclose(self) -> None:
        """Stop reading: an unfinished body is cancelled (STOP_SENDING) and its credit returned."""
        if self._closed:
            return
        self._closed = True
        if not self._ended and self._error is None:
            with contextlib.suppress(Exception):
                self._conn.quic.stop_stream(self.stream_id, H3_REQUEST_CANCELLED)
                self._conn.quic.reset_stream(self.stream_id, H3_REQUEST_CANCELLED)
        self._chunks.clear()
        self._conn.quic.forget(self.stream_id)
        self._conn.stream_done(self.stream_id)
        self._conn.transmit_soon()


class _ClientH3(H3Connection):
    """aioquic's HTTP/3 connection, minus one check that is wrong for responses to HEAD (RFC 9110 9.3.2: they
    carry the Content-Length the GET would have, and no content)."""

    def __init__(self, quic: KvspQuicConnection) -> None:
        super().__init__(quic)
        self.head_streams: set[int] = set()

    def _check_content_length(self, stream: Any) -> None:
        if stream.stream_id not in self.head_streams:
            super()._check_content_length(stream)


class H3ClientConnection(KvspQuicProtocol):
    """One HTTP/3 connection to an origin."""

    closed_error = H3StreamError
    no_error_code = H3_NO_ERROR
    close_reason_format = "QUIC error {code}: {reason}"

    def __init__(self, quic: KvspQuicConnection, *, settings: TransportSettings, **kwargs: Any) -> None:
        super().__init__(quic, settings=settings, **kwargs)
        self.h3 = _ClientH3(quic)
        self._responses: dict[int, H3Response] = {}
        self.active = 0
        self.opened = 0
        self.origin: tuple[str, int] = ("", 0)  # (host, port) in its pool
        self.retired = False  # dropped from its pool: takes no new requests, closes after its last stream
        self._closing: asyncio.Task[None] | None = None

    def quic_event_received(self, event: events.QuicEvent) -> None:
        super().quic_event_received(event)
        if isinstance(event, events.ConnectionTerminated):
            err = self.connection_closed_error()
            for response in list(self._responses.values()):
                response._on_error(err)
            return
        if isinstance(event, events.StreamReset):
            reset = self._responses.get(event.stream_id)
            if reset is not None:
                reset._on_error(H3StreamError(f"stream reset by the server (code 0x{event.error_code:x})"))
        elif isinstance(event, events.StopSendingReceived):
            stopped = self._responses.get(event.stream_id)
            if stopped is not None:
                stopped.stop_sending = True
        for h3_event in self.h3.handle_event(event):
            target = self._responses.get(getattr(h3_event, "stream_id", -1))
            if target is None:
                continue
            if isinstance(h3_event, HeadersReceived):
                target._on_headers(h3_event.headers, h3_event.stream_ended)
            elif isinstance(h3_event, DataReceived):
                target._on_data(h3_event.data, h3_event.stream_ended)

    @property
    def available(self) -> bool:
        return not self.closed and not self.retired and self.active < self.settings.max_streams

    def stream_done(self, stream_id: int) -> None:
        self.h3.head_streams.discard(stream_id)
        if self._responses.pop(stream_id, None) is not None:
            self.active -= 1
        if self.retired and self.active == 0:
            self._close_soon()

    def retire(self) -> None:
        """Take no new requests; close once the streams in flight are done (at once when there are none)."""
        self.retired = True
        if self.active == 0:
            self._close_soon()

    def _close_soon(self) -> None:
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self.aclose())

    async def request(self, method: str, authority: str, path: str, headers: list[tuple[bytes, bytes]],
                      body: bytes | bytearray | memoryview | AsyncIterable[bytes] | None) -> H3Response:
        """Send a request and return once the response headers are in; the body streams afterwards."""
        if self.closed:
            raise self.connection_closed_error()
        stream_id = self.quic.get_next_available_stream_id()
        if method == "HEAD":
            self.h3.head_streams.add(stream_id)
        response = H3Response(self, stream_id)
        self._responses[stream_id] = response
        self.active += 1
        self.opened += 1
        try:
            fields = [(b":method", method.encode()), (b":scheme", b"https"), (b":authority", authority.encode()),
                      (b":path", path.encode()), *headers]
            self.h3.send_headers(stream_id, fields, end_stream=body is None)
            self.transmit()
            if body is not None:
                try:
                    await self._send_body(stream_id, body, response)
                except _EarlyResponse:  # the server answered (or asked us to stop) before taking the whole body
                    with contextlib.suppress(Exception):
                        self.quic.reset_stream(stream_id, H3_REQUEST_CANCELLED)
                    self.transmit()
            await response.wait_headers()
        except BaseException:
            await response.aclose()
            raise
        if response._ended and not response._chunks:
            self.stream_done(stream_id)
        return response

    async def _send_body(self, stream_id: int, body: bytes | bytearray | memoryview | AsyncIterable[bytes],
                         response: H3Response) -> None:
        step = max(self.settings.send_buffer // 2, 16384)
        if isinstance(body, bytes | bytearray | memoryview):
            view = memoryview(body)
            if not view:
                self.h3.send_data(stream_id, b"", end_stream=True)
                self.transmit()
                return
            for offset in range(0, len(view), step):
                await self._check(stream_id, response)
                send_data(self.h3, stream_id, view[offset:offset + step], end_stream=offset + step >= len(view))
                self.transmit()
            return
        async for chunk in body:
            for offset in range(0, len(chunk), step):
                await self._check(stream_id, response)
                send_data(self.h3, stream_id, memoryview(chunk)[offset:offset + step], end_stream=False)
                self.transmit()
        self.h3.send_data(stream_id, b"", end_stream=True)
        self.transmit()

    async def _check(self, stream_id: int, response: H3Response) -> None:
        await self.wait_writable(stream_id)
        if response.stop_sending or (response._headers_ready.done() and response.status >= 400):
            raise _EarlyResponse()
        if response._error is not None:
            raise response._error


class _EarlyResponse(Exception):
    """The server answered with an error before the request body was sent; the response is what matters."""


async def connect_h3(host: str, port: int, files: TlsFiles, *, settings: TransportSettings,
                     server_name: str | None = None, timeout: float = 10.0) -> H3ClientConnection:
    return await connect_quic(host, port, files, alpn=["h3"], settings=settings, server_name=server_name,
                              timeout=timeout, protocol_factory=H3ClientConnection,
                              error=lambda reason: H3ConnectError(f"HTTP/3 to {host}:{port} failed: {reason}"))


class H3Pool:
    """HTTP/3 connections per origin, shared by concurrent requests."""

    def __init__(self, files: TlsFiles, settings: TransportSettings, connect_timeout: float) -> None:
        self.files = files
        self.settings = settings
        self.connect_timeout = connect_timeout
        self._conns: dict[tuple[str, int], list[H3ClientConnection]] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._retired: set[H3ClientConnection] = set()  # dropped, closing after their last stream

    async def get(self, host: str, port: int) -> H3ClientConnection:
        key = (host, port)
        async with self._locks.setdefault(key, asyncio.Lock()):
            conns = [c for c in self._conns.get(key, []) if not c.closed and not c.retired]
            self._conns[key] = conns
            for conn in conns:
                if conn.available and conn.opened < _STREAM_ID_BUDGET:
                    return conn
            conn = await connect_h3(host, port, self.files, settings=self.settings, timeout=self.connect_timeout)
            conn.origin = key
            conns.append(conn)
            return conn

    def discard(self, conn: H3ClientConnection) -> None:
        """Drop *conn* from the pool after a timeout or a connection error on it: the next request to its origin
        opens a fresh connection (and fails fast when the peer is gone) instead of waiting on a dead one."""
        group = self._conns.get(conn.origin)
        if group is not None and conn in group:
            group.remove(conn)
        if not conn.retired:
            conn.retire()
        self._retired = {c for c in self._retired if not c.closed}
        self._retired.add(conn)

    def pooled(self, host: str, port: int) -> int:
        """The connections to (*host*, *port*) that may take new requests."""
        return sum(1 for c in self._conns.get((host, port), []) if not c.closed and not c.retired)

    async def aclose(self) -> None:
        conns = [c for group in self._conns.values() for c in group] + list(self._retired)
        self._conns.clear()
        self._retired.clear()
        await asyncio.gather(*(c.aclose() for c in conns), return_exceptions=True)


_STREAM_ID_BUDGET = 1 << 20  # requests per connection before a fresh one is opened (stream ids are finite)
