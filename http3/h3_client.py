"""HTTP/3 client connections: mutual TLS, many concurrent streams, streamed bodies with backpressure.

:class:`H3ClientConnection` is one QUIC connection to one origin; :class:`H3Pool` keeps connections per origin,
spreads concurrent requests over up to ``connections_per_origin`` of them (least-loaded first) and opens another
when every stream of the existing ones is taken. The facade that adds fallback to HTTP/2 and
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


class _Connecting:
    """A connection being opened to one origin; the requests waiting for it are its load meanwhile (and stay
    counted on the connection until each has resumed and opened its stream)."""

    __slots__ = ("task", "waiters")

    def __init__(self) -> None:
        self.task: asyncio.Task[H3ClientConnection] | None = None
        self.waiters = 0


class H3Pool:
    """HTTP/3 connections per origin, shared by concurrent requests.

    *connections_per_origin* (K, default 1): concurrent requests to one origin are spread over up to K
    connections. A request takes the least-loaded connection (fewest open request streams, requests waiting for
    a connection being opened included) when that one is idle or K are open or opening already; otherwise it opens
    another one. Sequential requests therefore reuse one connection, and K concurrent ones get K connections
    (each on its own UDP socket: a holder whose workers share one port with ``SO_REUSEPORT`` sees K 4-tuples,
    which the kernel spreads over its workers). K counts the connections that can take another stream: a
    connection with every stream taken (``max_streams``) or past its stream-id budget does not count, so a burst
    beyond K x ``max_streams`` still opens more, as with K = 1.

    Connects run in tasks of their own: a slow handshake never holds up requests that can use a connection that
    is open already, a request that gives up waiting (its timeout) does not abort the connect for the others, and
    a failed connect fails every request waiting for it at once."""

    def __init__(self, files: TlsFiles, settings: TransportSettings, connect_timeout: float, *,
                 connections_per_origin: int = 1) -> None:
        if isinstance(connections_per_origin, bool) or connections_per_origin < 1:
            raise ValueError(f"connections_per_origin must be at least 1, not {connections_per_origin!r}")
        self.files = files
        self.settings = settings
        self.connect_timeout = connect_timeout
        self.connections_per_origin = connections_per_origin
        self.connects = 0  # connections opened (tests, metrics)
        self._conns: dict[tuple[str, int], list[H3ClientConnection]] = {}
        self._connecting: dict[tuple[str, int], list[_Connecting]] = {}
        self._joining: dict[H3ClientConnection, _Connecting] = {}  # requests that waited for its connect
        self._retired: set[H3ClientConnection] = set()  # dropped, closing after their last stream
        self._closed = False

    async def get(self, host: str, port: int) -> H3ClientConnection:
        """A connection to (*host*, *port*) for one more request. The caller opens its stream on it before it
        awaits anything else (that is what makes the stream count the connection's load)."""
        key = (host, port)
        while True:
            if self._closed:
                raise H3ConnectError(f"HTTP/3 to {host}:{port}: the client is closed")
            choice = self._choose(key)
            if isinstance(choice, H3ClientConnection):
                return choice
            choice.waiters += 1
            try:
                assert choice.task is not None
                conn = await asyncio.shield(choice.task)
            finally:
                choice.waiters -= 1
            if self._has_room(conn):
                return conn
            # closed, discarded or filled up while this request waited: choose again

    def _load(self, conn: H3ClientConnection) -> int:
        joining = self._joining.get(conn)
        if joining is not None and joining.waiters == 0:
            del self._joining[conn]
            joining = None
        return conn.active + (joining.waiters if joining is not None else 0)

    def _has_room(self, conn: H3ClientConnection) -> bool:
        return (not conn.closed and not conn.retired and conn.opened < _STREAM_ID_BUDGET
                and self._load(conn) < self.settings.max_streams)

    def _live(self, key: tuple[str, int]) -> list[H3ClientConnection]:
        """The connections to *key* that may take new requests; one past its stream-id budget is retired."""
        conns = []
        for conn in self._conns.get(key, []):
            if conn.closed or conn.retired:
                self._joining.pop(conn, None)
                continue
            if conn.opened >= _STREAM_ID_BUDGET:
                self._retire(conn)
                continue
            conns.append(conn)
        self._conns[key] = conns
        return conns

    def _choose(self, key: tuple[str, int]) -> H3ClientConnection | _Connecting:
        """The connection (or connect in progress) the next request to *key* goes to: synchronous, so no other
        request chooses in between."""
        open_ = [(self._load(c), i, c) for i, c in enumerate(self._live(key)) if self._has_room(c)]
        opening = [(p.waiters, i, p) for i, p in enumerate(self._connecting.get(key, []))
                   if p.waiters < self.settings.max_streams]
        best_open = min(open_, key=lambda x: x[:2], default=None)
        best_opening = min(opening, key=lambda x: x[:2], default=None)
        if best_open is not None and best_open[0] == 0:
            return best_open[2]
        if best_opening is not None and best_opening[0] == 0:
            return best_opening[2]
        if len(open_) + len(opening) < self.connections_per_origin:
            return self._open(key)
        if best_open is not None and (best_opening is None or best_open[0] <= best_opening[0]):
            return best_open[2]
        if best_opening is not None:
            return best_opening[2]
        return self._open(key)  # every connection is at max_streams: one more, beyond K

    def _open(self, key: tuple[str, int]) -> _Connecting:
        pending = _Connecting()
        self._connecting.setdefault(key, []).append(pending)
        pending.task = asyncio.get_running_loop().create_task(self._connect(key, pending),
                                                              name=f"h3-connect-{key[0]}:{key[1]}")
        pending.task.add_done_callback(_consume)
        return pending

    async def _connect(self, key: tuple[str, int], pending: _Connecting) -> H3ClientConnection:
        try:
            conn = await connect_h3(key[0], key[1], self.files, settings=self.settings, timeout=self.connect_timeout)
        except asyncio.CancelledError:  # only aclose cancels a connect
            raise H3ConnectError(f"HTTP/3 to {key[0]}:{key[1]}: the client is closed") from None
        finally:
            group = self._connecting.get(key)
            if group is not None and pending in group:
                group.remove(pending)
        if self._closed:
            await conn.aclose()
            raise H3ConnectError(f"HTTP/3 to {key[0]}:{key[1]}: the client is closed")
        self.connects += 1
        conn.origin = key
        self._conns.setdefault(key, []).append(conn)
        if pending.waiters:
            self._joining[conn] = pending
        return conn

    def _retire(self, conn: H3ClientConnection) -> None:
        self._joining.pop(conn, None)
        if not conn.retired:
            conn.retire()
        self._retired = {c for c in self._retired if not c.closed}
        self._retired.add(conn)

    def discard(self, conn: H3ClientConnection) -> None:
        """Drop *conn* from the pool after a timeout or a connection error on it: the next request to its origin
        opens a fresh connection (and fails fast when the peer is gone) instead of waiting on a dead one."""
        group = self._conns.get(conn.origin)
        if group is not None and conn in group:
            group.remove(conn)
        self._retire(conn)

    def pooled(self, host: str, port: int) -> int:
        """The connections to (*host*, *port*) that may take new requests."""
        return sum(1 for c in self._conns.get((host, port), []) if not c.closed and not c.retired)

    def connections(self, host: str, port: int) -> list[H3ClientConnection]:
        """The pooled connections to (*host*, *port*) that may take new requests (tests, metrics)."""
        return [c for c in self._conns.get((host, port), []) if not c.closed and not c.retired]

    async def aclose(self) -> None:
        self._closed = True
        connecting = [p.task for group in self._connecting.values() for p in group if p.task is not None]
        for task in connecting:
            task.cancel()
        conns = [c for group in self._conns.values() for c in group] + list(self._retired)
        self._conns.clear()
        self._retired.clear()
        self._joining.clear()
        await asyncio.gather(*connecting, return_exceptions=True)
        await asyncio.gather(*(c.aclose() for c in conns), return_exceptions=True)


def _consume(task: asyncio.Task[H3ClientConnection]) -> None:
    """A connect nobody waits for any more still has its outcome retrieved (no 'never retrieved' warning)."""
    if not task.cancelled():
        task.exception()


_STREAM_ID_BUDGET = 1 << 20  # requests per connection before a fresh one is opened (stream ids are finite)
