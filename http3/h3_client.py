"""HTTP/3 client connections: mutual TLS, many concurrent streams, streamed bodies with backpressure.

:class:`H3ClientConnection` is one QUIC connection to one origin; :class:`H3Pool` keeps connections per origin,
spreads concurrent requests over up to ``connections_per_origin`` of them (least-loaded first) and opens another
when every stream of the existing ones is taken; with a :class:`KeepAlive` (for every origin, or per origin) each
connection PINGs its peer and ends itself when the peer stops answering. The facade that adds fallback to HTTP/2 and
HTTP/1.1, retries and timeouts is :mod:`http3.client`. The QUIC side (batched receiving, transmits, send
backpressure, HANDSHAKE_DONE, connecting) is :mod:`quic.protocol`'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic import events
from cryptography.hazmat.primitives.serialization import Encoding

from http3.h3_frames import send_data
from quic.connection import KvspQuicConnection
from quic.pool import SpreadPool
from quic.protocol import KvspQuicProtocol, QuicConnectError, connect_quic
from quic.rtt import RttSample, RttTable
from quic.tls import TlsFiles, TransportSettings, identity_of_der, serves

H3_NO_ERROR = 0x100
H3_REQUEST_CANCELLED = 0x10C
_COALESCE = 1 << 20


class H3ConnectError(QuicConnectError):
    """The QUIC handshake failed or timed out (UDP blocked, h3 refused, certificate rejected)."""


class H3StreamError(ConnectionError):
    """The stream or connection broke during an exchange."""


class H3IdentityError(H3StreamError):
    """The server's certificate is valid but not for the role called (quic.tls.serves): nothing was sent."""



@dataclass(frozen=True)
class KeepAlive:
    """QUIC PINGs on a pooled connection (RFC 9000 19.2) so that a dead or frozen peer is noticed in about
    ``interval`` x ``missed`` seconds rather than at QUIC's idle timeout (60 s): every *interval* seconds the
    connection sends a PING unless it is over; after *missed* intervals in a row in which nothing at all arrived
    from the peer (a PING's acknowledgement, or anything else) the connection ends itself (RFC 9000 10.1: "silently
    closed", after a best-effort CONNECTION_CLOSE), its requests in flight fail with :class:`H3StreamError`, and
    the pool no longer hands it out. Ticks are counted, not wall time, so a client whose own event loop was busy
    does not take its backlog for a silent peer. For connections to the control plane (Index Service, Placement
    Controller), whose answers are small and prompt."""

    interval: float = 0.4
    missed: int = 3

    def __post_init__(self) -> None:
        if not self.interval > 0 or isinstance(self.missed, bool) or self.missed < 1:
            raise ValueError("a keep-alive has a positive interval and misses at least 1 PING")

    @property
    def dead_after(self) -> float:
        """About how long a silent peer keeps its connection (seconds)."""
        return self.interval * self.missed


CONTROL_KEEPALIVE = KeepAlive()  # the control plane's (Index Service, Placement Controller): ~1.2-1.6 s to notice


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
        self.keepalive: KeepAlive | None = None
        self._heard = 0  # datagrams received from the peer (the keep-alive's evidence of life)
        self._pinger: asyncio.Task[None] | None = None
        self.peer_identity: str | None = None  # the server's SAN URI, read once after the handshake
        self._identity_read = False

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._heard += 1
        super().datagram_received(data, addr)

    def keep_alive(self, keepalive: KeepAlive) -> None:
        """PING the peer from now on, and end the connection when it stops answering (:class:`KeepAlive`)."""
        self.keepalive = keepalive
        if (self._pinger is None or self._pinger.done()) and not self.closed:
            self._pinger = self._loop.create_task(self._ping_loop(), name="h3-keepalive")

    async def _ping_loop(self) -> None:
        missed, heard, uid = 0, self._heard, 1 << 62  # uids far from aioquic's own ping() waiters (ids of futures)
        while (keepalive := self.keepalive) is not None and not self.closed:
            await asyncio.sleep(keepalive.interval)
            if self._over():
                return
            missed = missed + 1 if self._heard == heard else 0
            heard = self._heard
            if missed >= keepalive.missed:
                self.abandon(f"the peer answered no PING for {missed * keepalive.interval:.1f} s")
                return
            uid += 1
            self.quic.send_ping(uid)
            self.transmit()

    def _over(self) -> bool:
        return self.closed

    def abandon(self, reason: str) -> None:
        """End the connection now, the peer being silent: a CONNECTION_CLOSE is sent (best effort), no closing
        period is waited out, and every request in flight fails at once."""
        if self.closed:
            return
        self.quic.close(error_code=H3_NO_ERROR, reason_phrase=reason)
        self.transmit()
        self.quic.end_now()
        self._process_events()  # ConnectionTerminated: every response fails, the socket is let go
        self.transmit()

    async def aclose(self) -> None:
        if self._pinger is not None and self._pinger is not asyncio.current_task():
            self._pinger.cancel()
        await super().aclose()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        super().quic_event_received(event)
        if isinstance(event, events.ConnectionTerminated):
            if self._pinger is not None and self._pinger is not asyncio.current_task():
                self._pinger.cancel()
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
        self._check_identity(authority, path)
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

    def _check_identity(self, authority: str, path: str) -> None:
        """The server must be the role called: its certificate's SAN URI covers ``https://authority/path``
        (:func:`quic.tls.serves`); else :class:`H3IdentityError` and nothing is sent."""
        if not self._identity_read:
            cert = self.quic.peer_certificate
            self.peer_identity = identity_of_der(cert.public_bytes(Encoding.DER)) if cert is not None else None
            self._identity_read = True
        host, _, port = authority.rpartition(":")
        if not host or not port.isdigit():
            host, port = authority, "443"
        problem = serves(self.peer_identity, "https", host.strip("[]"), int(port), path.split("?", 1)[0])
        if problem is not None:
            raise H3IdentityError(f"https://{authority}{path}: {problem}")

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


class H3Pool(SpreadPool[H3ClientConnection]):
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
    a failed connect fails every request waiting for it at once.

    With an RTT table *rtts* (:class:`quic.rtt.RttTable`; the instance passes the process's
    :data:`quic.rtt.PEER_RTTS`, shared with its MOQT and HTTP/1.1 pools) connect timeouts scale with the RTT (issue
    12, point 5): *connect_timeout* is the most a connect waits, and all it waits for a host whose RTT is unknown;
    to a host the table has an estimate for, a dial waits :func:`quic.rtt.connect_timeout` (a few RTTs, at least
    1 s). The pool feeds the table with its connections' RTT when they join, when they are dropped, and before each
    dial from those still open to the host. Without a table every connect waits *connect_timeout*."""

    kind = "h3"

    def __init__(self, files: TlsFiles, settings: TransportSettings, connect_timeout: float, *,
                 connections_per_origin: int = 1, keepalive: KeepAlive | None = None,
                 rtts: RttTable | None = None) -> None:
        super().__init__(connections_per_origin, connect_timeout=connect_timeout, rtts=rtts)
        self.files = files
        self.settings = settings
        self.opening_cap = settings.max_streams
        self.keepalive = keepalive  # for every origin (None: none) ...
        self._keepalive: dict[tuple[str, int], KeepAlive | None] = {}  # ... unless set for the origin
        self._retired: set[H3ClientConnection] = set()  # dropped, closing after their last stream

    async def get(self, host: str, port: int) -> H3ClientConnection:
        """A connection to (*host*, *port*) for one more request. The caller opens its stream on it before it
        awaits anything else (that is what makes the stream count the connection's load)."""
        return await self.get_for((host, port))

    # -- SpreadPool's hooks

    async def dial(self, key: tuple[str, int]) -> H3ClientConnection:
        return await connect_h3(key[0], key[1], self.files, settings=self.settings, timeout=self.dial_timeout(key[0]))

    def rtt_of(self, conn: H3ClientConnection) -> RttSample | None:
        return None if conn.closed else conn.quic.rtt_sample()

    def load_of(self, conn: H3ClientConnection) -> int:
        return conn.active

    def takes_more(self, conn: H3ClientConnection) -> bool:
        return (not conn.closed and not conn.retired and conn.opened < _STREAM_ID_BUDGET
                and self.load(conn) < self.settings.max_streams)

    def live(self, key: tuple[str, int]) -> list[H3ClientConnection]:
        """The connections to *key* that may take new requests; one past its stream-id budget is retired."""
        conns = []
        for conn in self._conns.get(key, []):
            if conn.closed or conn.retired:
                self.forget_joining(conn)
                continue
            if conn.opened >= _STREAM_ID_BUDGET:
                self._retire(conn)
                continue
            conns.append(conn)
        self._conns[key] = conns
        return conns

    def closed_error(self, key: tuple[str, int]) -> Exception:
        return H3ConnectError(f"HTTP/3 to {key[0]}:{key[1]}: the client is closed")

    def adopted(self, key: tuple[str, int], conn: H3ClientConnection) -> None:
        conn.origin = key
        if self.rtts is not None:
            self.rtts.observe(key[0], (conn.quic.rtt_sample(),))  # the handshake's samples
        keepalive = self._keepalive.get(key, self.keepalive)
        if keepalive is not None:
            conn.keep_alive(keepalive)

    async def close_connection(self, conn: H3ClientConnection) -> None:
        await conn.aclose()

    # --

    def _retire(self, conn: H3ClientConnection) -> None:
        self.forget_joining(conn)
        if self.rtts is not None and conn.origin[0]:
            self.rtts.observe(conn.origin[0], (conn.quic.rtt_sample(),))
        if not conn.retired:
            conn.retire()
        self._retired = {c for c in self._retired if not c.closed}
        self._retired.add(conn)

    def set_keepalive(self, host: str, port: int, keepalive: KeepAlive | None) -> None:
        """Keep the connections to (*host*, *port*) alive with *keepalive* (None: no PINGs), those open included."""
        key = (host, port)
        if key in self._keepalive and self._keepalive[key] == keepalive:
            return
        self._keepalive[key] = keepalive
        for conn in self._conns.get(key, []):
            if keepalive is None:
                conn.keepalive = None
            elif not conn.closed:
                conn.keep_alive(keepalive)

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
        conns = await self.cancel_connects() + list(self._retired)
        self._retired.clear()
        await asyncio.gather(*(c.aclose() for c in conns), return_exceptions=True)


_STREAM_ID_BUDGET = 1 << 20  # requests per connection before a fresh one is opened (stream ids are finite)
