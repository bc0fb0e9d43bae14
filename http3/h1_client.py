"""A lean HTTP/1.1-over-TLS client: keep-alive connections pooled per origin, mutual TLS, streamed bodies.

This is :class:`http3.client.KvspClient`'s TCP path. It exists because a general client costs more CPU per
request and per octet than the TLS it runs over (httpx burned ~130 ms of CPU per 16 MiB GET here); this one
parses the response head by hand and lets TLS decrypt the body straight into the caller's buffer:

* each connection is an :class:`asyncio.BufferedProtocol`: asyncio's TLS layer decrypts into the buffer that
  :meth:`get_buffer` hands out -- the destination of :meth:`H1Response.readinto` (no copy at all), or one reused
  scratch buffer whose octets become the ``bytes`` chunks of :meth:`H1Response.aiter_bytes` (one copy);
  after the head of a ``Content-Length`` body the connection stops reading until the caller takes the body, so
  that a caller who asks for the head first and then ``receive_into`` still gets no copy (issue 16);
* bodies framed by ``Content-Length`` (never read past: the next response on the connection stays intact),
  ``Transfer-Encoding: chunked`` (decoded incrementally) or the end of the connection;
* request bodies are bytes-like (sent with ``Content-Length`` in 1 MiB slices, each waiting for the transport to
  drain) or async iterables of bytes (sent chunked); when the server answers before the body is all out (a 4xx
  or 5xx), sending stops and the connection is not reused;
* a connection goes back to its origin's pool only after its response was read to the end with nothing left
  over and neither side said ``Connection: close``; one that is closed while idle is never handed out.

Every request checks that the server is the role called: its certificate's SAN URI must cover the URL
(:func:`quic.tls.serves`: host, port when the identity states one, base path), else :class:`TransportError`
before anything is sent (issue 13: a co-located role's valid certificate must not answer for another role).
``serves`` compares the host and port only, and a connection serves one origin with one certificate, so its
answer is kept per connection once it is "yes" (it cost ~30 us a request).

Failures (refused, reset, TLS, a malformed or truncated response) raise :class:`TransportError`; a connect
that times out raises :class:`ConnectTimeout`; a request, body or chunk past its deadline raises
:class:`RequestTimeout` (deadlines of a pool's exchanges run on one timer, :class:`Deadlines`). Cancelling a request
(e.g. a caller's timeout) closes its connection. Backpressure: a streamed body that the caller does not take
pauses reading at :data:`RX_HIGH_WATER`.

    pool = H1Pool(ssl_client_context(files, alpn=("http/1.1",)))
    response = await pool.request("127.0.0.1", 8443, "GET", "/kvsp/blocks/...", [(b"accept", b"*/*")])
    n = await response.readinto(buffer)          # or: async for chunk in response.aiter_bytes(): ...
    await pool.aclose()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import re
import socket
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import cast

from http3.body_sink import BufferSink, copy_into
from http3.errors import ConnectTimeout, RequestTimeout, TransportError
from http3.h1_deadlines import Deadlines
from quic.rtt import TCP_INFO_SIZE, RttTable, tcp_info_rtt
from quic.tls import serves, ssl_peer_identity

Buffer = bytes | bytearray | memoryview
Fields = Sequence[tuple[bytes, bytes]]

SCRATCH = 256 << 10  # the receive buffer of streamed bodies (and heads)
RX_HIGH_WATER = 1 << 20  # pause reading while this many streamed body octets wait for the caller
WRITE_SLICE = 1 << 20  # request bodies go to the transport in slices of this size
WRITE_HIGH_WATER = 4 << 20  # a request body waits for the transport to drain below this
MAX_HEAD = 64 << 10  # a response head larger than this is refused
HEAD_READ = 16 << 10  # what one read takes while a head is awaited (one TLS record)
_NO_BODY_STATUS = frozenset({204, 304})

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a field name (RFC 9110 token)
_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE, _DONE = range(5)
# chunked decoder states
_C_SIZE, _C_DATA, _C_DATA_END, _C_TRAILER = range(4)


class H1Connection(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, origin: tuple[str, int], deadlines: Deadlines | None = None) -> None:
        self.origin = origin
        self.deadlines = deadlines or Deadlines()
        self.authority = (f"{origin[0]}:{origin[1]}" if ":" not in origin[0] else f"[{origin[0]}]:{origin[1]}").encode()
        self.transport: asyncio.Transport | None = None
        self.peer_identity: str | None = None
        self.serves_origin = False  # peer_identity was checked against origin (quic.tls.serves) and covers it
        self.closed = False  # connection lost, or closed by us
        self.reusable = True  # false once either side said close, or an exchange ended abnormally
        self.busy = False
        self._scratch = bytearray(SCRATCH)
        self._scratch_view = memoryview(self._scratch)
        self._head = bytearray()  # the response head as it arrives
        self._phase = _DONE
        self._left = 0  # Content-Length octets still to come, or of the current chunk
        self._chunk_state = _C_SIZE
        self._line = bytearray()  # chunk-size line or trailer line being assembled
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._sink: BufferSink | None = None  # receive_into(): decrypt straight into the sink's buffers
        self._sink_pos = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head_ready: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False
        self._reading_paused = False
        self._expect_body = True
        self.lost = False  # the transport reported connection_lost (its socket is closed)

    # -- asyncio.BufferedProtocol ---------------------------------------------------------------------------

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        # a stream transport: asyncio's, or uvloop's (which does not register with asyncio's ABCs)
        transport = cast(asyncio.Transport, base)
        self.transport = transport
        self.peer_identity = ssl_peer_identity(transport)  # the server's role (SAN URI), checked per request
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._phase == _LENGTH:
            if self._sink is not None:
                try:
                    view = self._sink.get_buffer(self._left)
                except Exception as exc:  # the sink refuses (e.g. its decoder failed): end the exchange
                    self._fail(exc)
                    return self._scratch_view
                return view[:self._left] if len(view) > self._left else view
            return self._scratch_view[:min(self._left, SCRATCH)]
        if self._phase == _HEAD:  # a head is small: read little, so that the body can go straight to a sink
            return self._scratch_view[:HEAD_READ]
        return self._scratch_view

    def buffer_updated(self, nbytes: int) -> None:
        phase = self._phase
        if phase == _LENGTH:
            if self.closed:
                return
            self._left -= nbytes
            if self._sink is not None:
                self._sink_pos += nbytes
                try:
                    self._sink.buffer_updated(nbytes)
                except Exception as exc:  # e.g. a digest mismatch: the caller gets this exception
                    self._fail(exc)
                    return
            else:
                self._push(bytes(self._scratch_view[:nbytes]))
            if self._left == 0:
                self._phase = _DONE
            self._wake()
        elif phase == _HEAD:
            self._head += self._scratch_view[:nbytes]
            self._parse_head()
        elif phase == _CHUNKED:
            self._chunked(self._scratch_view[:nbytes])
            self._wake()
        elif phase == _UNTIL_CLOSE:
            self._push(bytes(self._scratch_view[:nbytes]))
            self._wake()
        else:  # octets nobody asked for: the connection is out of step
            self._fail(TransportError("unexpected data from the server"))

    def eof_received(self) -> bool | None:
        self.reusable = False
        if self._phase == _UNTIL_CLOSE:
            self._phase = _DONE
            self._wake()
        elif self._phase != _DONE:
            self._fail(TransportError("the server closed the connection mid-response"))
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lost = True
        self.reusable = False
        if self._phase == _UNTIL_CLOSE and exc is None:
            self._phase = _DONE
            self._wake()
        elif self._phase != _DONE:
            self._fail(TransportError(f"connection lost: {exc}" if exc else "connection closed by the server"))
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- receive side -----------------------------------------------------------------------------------------

    def _push(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._queued += len(chunk)
        if self._queued > RX_HIGH_WATER and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _hold_body(self) -> None:
        """The head is in and the rest of a ``Content-Length`` body is still to come: stop reading until the
        caller says how it takes the body, so that :meth:`receive_into` has TLS decrypt the body into the
        caller's sink rather than into the scratch buffer, a ``bytes`` copy and then the sink (a second copy and
        ~0.15 ms per 256 KiB block). Reading resumes in :meth:`receive_into` or :meth:`next_chunk`."""
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """End the exchange in progress with *exc* (its waiters raise it) and abort the connection."""
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.reusable = False
        if self._error is None:
            self._error = exc
        if self._head_ready is not None and not self._head_ready.done():
            self._head_ready.set_exception(exc)
            self._head_ready.exception()  # retrieved here: whoever awaits it sees it anyway
        self._wake()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    def _parse_head(self) -> None:
        while True:
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > MAX_HEAD:
                    self._fail(TransportError("response head too large"))
                return
            head, rest = bytes(self._head[:end]), memoryview(self._head)[end + 4:]
            try:
                status, fields, framing = _parse(head)
            except ValueError as exc:
                self._fail(TransportError(f"malformed response head: {exc}"))
                return
            if 100 <= status < 200:  # 100 Continue and friends: skip, a final response follows
                self._head = bytearray(rest)
                continue
            self._head = bytearray()
            if not self._expect_body or status in _NO_BODY_STATUS:
                framing = 0
            if framing == "close":
                self.reusable = False
                self._phase = _UNTIL_CLOSE
                if rest:
                    self._push(bytes(rest))
            elif framing == "chunked":
                self._phase = _CHUNKED
                self._chunk_state = _C_SIZE
                self._line = bytearray()
                if rest:
                    self._chunked(rest)
            else:
                length = int(framing)
                self._left = length
                self._phase = _LENGTH if length else _DONE
                if rest:
                    take = rest[:length]
                    if len(rest) > length:  # more than the body: the connection is out of step
                        self.reusable = False
                    if take:
                        self._left -= len(take)
                        self._push(bytes(take))
                        if self._left == 0:
                            self._phase = _DONE
                if self._phase == _LENGTH and self._sink is None:
                    self._hold_body()
            if any(k == b"connection" and b"close" in v.lower() for k, v in fields):
                self.reusable = False
            if self._head_ready is not None and not self._head_ready.done():
                self._head_ready.set_result((status, fields))
            self._wake()
            return

    def _chunked(self, data: memoryview) -> None:
        pos, n = 0, len(data)
        while pos < n and self._phase == _CHUNKED:
            state = self._chunk_state
            if state == _C_DATA:
                take = min(self._left, n - pos)
                self._push(bytes(data[pos:pos + take]))
                pos += take
                self._left -= take
                if self._left == 0:
                    self._chunk_state = _C_DATA_END
                continue
            # line-oriented states: size line, the CRLF after data, trailer lines
            nl = bytes(data[pos:]).find(b"\n")
            if nl < 0:
                self._line += data[pos:]
                if len(self._line) > MAX_HEAD:
                    self._fail(TransportError("chunk line too long"))
                return
            self._line += data[pos:pos + nl + 1]
            pos += nl + 1
            line = bytes(self._line).rstrip(b"\r\n")
            self._line = bytearray()
            if state == _C_SIZE:
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    self._fail(TransportError(f"bad chunk size line {line[:40]!r}"))
                    return
                if size < 0:
                    self._fail(TransportError("negative chunk size"))
                    return
                self._left = size
                self._chunk_state = _C_DATA if size else _C_TRAILER
            elif state == _C_DATA_END:
                if line:
                    self._fail(TransportError("chunk data longer than its size"))
                    return
                self._chunk_state = _C_SIZE
            elif not line:  # _C_TRAILER: an empty line ends the message
                self._phase = _DONE
        if pos < n:  # octets after the end of the message
            self.reusable = False

    # -- the exchange -----------------------------------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def _drained(self) -> None:
        if self._write_paused and not self.closed:
            self._drain = asyncio.get_running_loop().create_future()
            try:
                await self._drain
            finally:
                self._drain = None

    async def exchange(self, method: str, target: str, fields: Fields, body: Buffer | AsyncIterable[bytes] | None,
                       deadline: float = math.inf) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Send one request and wait for the response head; the body is read through :class:`H1Response`.
        Past *deadline* (``loop.time()``) it fails with :class:`RequestTimeout` (:class:`Deadlines`)."""
        transport = self.transport
        if transport is None or self.closed:
            raise TransportError("connection closed")
        self.busy = True
        self._error = None
        self._resume()
        self._phase = _HEAD
        self._head = bytearray()
        self._chunks.clear()
        self._queued = 0
        self._expect_body = method != "HEAD"
        self._head_ready = asyncio.get_running_loop().create_future()
        head = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode("ascii"), target.encode("ascii"), self.authority)]
        has_length = False
        for name, value in fields:
            if name == b"content-length":
                has_length = True
            elif name == b"host":
                continue
            if not _TOKEN.fullmatch(name) or b"\r" in value or b"\n" in value or b"\0" in value:
                raise ValueError(f"invalid header field {name[:40]!r}")
            head.append(b"%s: %s\r\n" % (name, value))
        streamed = body is not None and not isinstance(body, bytes | bytearray | memoryview)
        if streamed:
            head.append(b"transfer-encoding: chunked\r\n")
        elif body is not None and not has_length:
            head.append(b"content-length: %d\r\n" % len(body))  # type: ignore[arg-type]
        elif body is None and not has_length and method in ("POST", "PUT", "PATCH"):
            head.append(b"content-length: 0\r\n")
        head.append(b"\r\n")
        if deadline < math.inf:
            self.deadlines.watch(self, deadline, f"{method} {target}: no response head in time")
        try:
            if body is None or streamed:
                transport.write(b"".join(head))
                if streamed:
                    await self._send_streamed(body)  # type: ignore[arg-type]
            else:
                await self._send_body(b"".join(head), body)  # type: ignore[arg-type]
            if self._error is not None:
                raise self._error
            return await self._head_ready
        except BaseException:
            self.reusable = False
            self.close()
            raise
        finally:
            if deadline < math.inf:
                self.deadlines.clear(self)

    async def _send_body(self, head: bytes, body: Buffer) -> None:
        view = memoryview(body).cast("B") if not isinstance(body, bytes) else memoryview(body)
        transport = self.transport
        assert transport is not None
        if len(view) <= WRITE_SLICE:
            transport.writelines((head, view))
            return
        transport.write(head)
        for start in range(0, len(view), WRITE_SLICE):
            if self._answered_early():
                return
            transport.write(view[start:start + WRITE_SLICE])
            await self._drained()

    async def _send_streamed(self, body: AsyncIterable[bytes]) -> None:
        transport = self.transport
        assert transport is not None
        async for chunk in body:
            if self._answered_early():
                return
            if chunk:
                transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
                await self._drained()
        if not self._answered_early():
            transport.write(b"0\r\n\r\n")

    def _answered_early(self) -> bool:
        """The server answered (or failed) before the request body was all sent: stop sending it."""
        if self._error is not None or self.closed:
            return True
        ready = self._head_ready
        if ready is not None and ready.done():
            self.reusable = False  # the server will close or discard; do not reuse
            return True
        return False

    def close(self) -> None:
        """Close at once (an exchange in progress is cut: abort, no TLS close_notify to wait for)."""
        self.reusable = False
        if not self.closed and self.transport is not None:
            self.closed = True
            if self._phase == _DONE:
                self.transport.close()
            else:
                self.transport.abort()

    @property
    def body_done(self) -> bool:
        return self._phase == _DONE and not self._chunks

    @property
    def buffered(self) -> int:
        """Body octets received and waiting for the caller (a ``Content-Length`` body waits after the head in
        the connection, not here: at most what came with the head, :data:`HEAD_READ`)."""
        return self._queued

    async def next_chunk(self, timeout: float | None = None) -> bytes | None:
        """The next streamed body chunk, or None at the end of the body; :class:`RequestTimeout` when none comes
        within *timeout* seconds."""
        deadline = math.inf
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._queued -= len(chunk)
                if self._queued <= RX_HIGH_WATER // 2:
                    self._resume()
                return chunk
            if self._error is not None:
                raise self._error
            if self._phase == _DONE:
                return None
            self._resume()  # nothing queued: the body held after the head (_hold_body) is wanted now
            if timeout is None:
                await self._wait()
                continue
            if deadline == math.inf:
                deadline = asyncio.get_running_loop().time() + timeout
            self.deadlines.watch(self, deadline, f"no response data for {timeout} s")
            try:
                await self._wait()
            finally:
                self.deadlines.clear(self)

    async def receive_into(self, sink: BufferSink, deadline: float = math.inf) -> int:
        """Deliver the rest of the body to *sink* (``get_buffer`` / ``buffer_updated``); the octets delivered.
        Past *deadline* (``loop.time()``) it fails with :class:`RequestTimeout`."""
        if deadline == math.inf:
            return await self._receive_into(sink)
        self.deadlines.watch(self, deadline, "the response body did not arrive in time")
        try:
            return await self._receive_into(sink)
        finally:
            self.deadlines.clear(self)

    async def _receive_into(self, sink: BufferSink) -> int:
        pos = 0
        while self._chunks:  # what arrived with the head
            chunk = self._chunks.popleft()
            self._queued -= len(chunk)
            pos += copy_into(sink, chunk)
        if self._phase == _LENGTH and self._error is None:
            self._sink, self._sink_pos = sink, 0  # before reading resumes: the rest goes straight to the sink
            self._resume()
            try:
                while self._phase == _LENGTH and self._error is None:
                    await self._wait()
            finally:
                pos += self._sink_pos
                self._sink = None
        self._resume()
        while True:  # chunked or until close: chunk by chunk
            more = await self.next_chunk()
            if more is None:
                return pos
            pos += copy_into(sink, more)


class IntoBuffer:
    """A :class:`BufferSink` that fills one caller's buffer; more octets than it holds is an error."""

    def __init__(self, buffer: Buffer) -> None:
        self.view = memoryview(buffer).cast("B")
        self.filled = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.filled >= len(self.view):
            raise TransportError(f"the response body is larger than the buffer ({len(self.view)} octets)")
        return self.view[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes


def _parse(head: bytes) -> tuple[int, list[tuple[bytes, bytes]], str | int]:
    """Status, fields (names lowercased) and framing ("close", "chunked" or the Content-Length) of a head."""
    lines = head.split(b"\r\n")
    status_line = lines[0].split(b" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1.") or len(status_line[1]) != 3:
        raise ValueError(f"bad status line {lines[0][:60]!r}")
    status = int(status_line[1])
    fields: list[tuple[bytes, bytes]] = []
    framing: str | int = "close"
    chunked = False
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"bad header line {line[:60]!r}")
        name = name.lower()
        value = value.strip()
        fields.append((name, value))
        if name == b"content-length":
            if not value.isdigit() or (framing != "close" and framing != int(value)):
                raise ValueError(f"bad content-length {value[:30]!r}")
            framing = int(value)
        elif name == b"transfer-encoding":
            chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
            if not chunked:
                raise ValueError(f"unsupported transfer-encoding {value[:30]!r}")
    if chunked:
        framing = "chunked"
    return status, fields, framing


class H1Response:
    """A response whose head is in; read the body with :meth:`aiter_bytes`, :meth:`readinto` or :meth:`aread`,
    then :meth:`aclose` (which hands the connection back to the pool when the body was read to the end)."""

    http_version = "HTTP/1.1"

    def __init__(self, pool: H1Pool, conn: H1Connection, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._pool = pool
        self._conn: H1Connection | None = conn
        self.status = status
        self.headers = headers
        self.content_length: int | None = next((int(v) for k, v in headers if k == b"content-length"), None)
        if conn.body_done:
            self._release()

    @property
    def buffered(self) -> int:
        """Body octets this client holds for the caller now (:attr:`H1Connection.buffered`)."""
        return self._conn.buffered if self._conn is not None else 0

    async def aiter_bytes(self, timeout: float | None = None) -> AsyncIterator[bytes]:
        """The body chunk by chunk; :class:`RequestTimeout` when the next one does not come within *timeout* s."""
        conn = self._conn
        if conn is None:
            return
        while True:
            chunk = await conn.next_chunk(timeout)
            if chunk is None:
                self._release()
                return
            yield chunk

    async def readinto(self, buffer: Buffer, timeout: float | None = None) -> int:
        """Read the whole (rest of the) body into *buffer*; the number of octets. The octets go where TLS
        decrypts them: no copy for a ``Content-Length`` body. *timeout*: as :meth:`receive_into`'s."""
        return await self.receive_into(IntoBuffer(buffer), timeout)

    async def receive_into(self, sink: BufferSink, timeout: float | None = None) -> int:
        """Deliver the whole (rest of the) body to *sink* as TLS decrypts it (e.g. a
        :class:`~kvsp_quic.container.ContainerDecoder`, which verifies each layer as it completes); the octets
        delivered. An exception from the sink ends the exchange (and the connection) and is raised here; so does
        :class:`RequestTimeout` when the body is not all in within *timeout* seconds."""
        conn = self._conn
        if conn is None:
            return 0
        deadline = math.inf if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            n = await conn.receive_into(sink, deadline)
        finally:
            self._release()
        return n

    async def aread(self) -> bytes:
        if self.content_length is not None:
            buffer = bytearray(self.content_length)
            n = await self.readinto(buffer)
            return bytes(buffer) if n == len(buffer) else bytes(buffer[:n])
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn)

    async def aclose(self) -> None:
        """Done with the response: a body not read to the end closes the connection."""
        self._release()


class H1Pool:
    """Keep-alive HTTP/1.1 connections per origin (host, port); at most *max_idle* idle ones kept per origin.

    *connect_timeout* (TCP and TLS handshakes) is what a connect waits; with an RTT table *rtts*
    (:class:`quic.rtt.RttTable`, shared with the HTTP/3 and MOQT pools) it is the most a connect waits, and to a
    host the table has an estimate for a connect waits :func:`quic.rtt.connect_timeout` (a few RTTs, at least 1 s:
    issue 12, point 5); each connection opened then records the kernel's RTT estimate of its socket there
    (``TCP_INFO``, Linux)."""

    def __init__(self, context: ssl.SSLContext, *, connect_timeout: float = 5.0, max_idle: int = 16,
                 check_identity: bool = True, rtts: RttTable | None = None) -> None:
        self.context = context
        self.check_identity = check_identity  # the server's SAN URI must cover each URL (quic.tls.serves)
        self.connect_timeout = connect_timeout
        self.rtts = rtts
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], list[H1Connection]] = {}
        self._all: set[H1Connection] = set()
        self._deadlines = Deadlines()  # of every exchange on this pool's connections: one timer
        self.connects = 0  # connections opened (tests, metrics)

    def idle(self, host: str, port: int) -> int:
        return sum(1 for c in self._idle.get((host, port), ()) if not c.closed)

    async def _connect(self, origin: tuple[str, int], deadline: float = math.inf) -> H1Connection:
        loop = asyncio.get_running_loop()
        timeout = self.connect_timeout if self.rtts is None else self.rtts.connect_timeout(origin[0],
                                                                                         self.connect_timeout)
        left = deadline - loop.time()  # the request's own deadline comes first: then it is the request's timeout
        try:
            async with asyncio.timeout(min(timeout, left)):
                _, conn = await loop.create_connection(lambda: H1Connection(origin, self._deadlines), origin[0],
                                                       origin[1], ssl=self.context, server_hostname=origin[0])
        except TimeoutError:
            if left < timeout:
                raise RequestTimeout(f"connecting to {origin[0]}:{origin[1]}: the request's deadline passed") from None
            raise ConnectTimeout(f"connecting to {origin[0]}:{origin[1]} timed out ({timeout:.2g} s)") from None
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(f"connecting to {origin[0]}:{origin[1]}: {exc}") from None
        self._observe(origin[0], conn)
        self.connects += 1
        self._all.add(conn)
        return conn

    def _observe(self, host: str, conn: H1Connection) -> None:
        """Record the kernel's RTT estimate of *conn*'s socket (Linux ``TCP_INFO``; nothing elsewhere)."""
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        if self.rtts is None or sock is None or not hasattr(socket, "TCP_INFO") or \
                sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        try:
            found = tcp_info_rtt(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SIZE))
        except OSError:
            return
        if found is not None:
            self.rtts.record(host, *found)

    async def connection(self, host: str, port: int, deadline: float = math.inf) -> H1Connection:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.reusable:
                conn.busy = True
                return conn
            self._all.discard(conn)
        conn = await self._connect((host, port), deadline)
        conn.busy = True
        return conn

    async def request(self, host: str, port: int, method: str, target: str, fields: Fields = (),
                      body: Buffer | AsyncIterable[bytes] | None = None, *,
                      deadline: float = math.inf) -> H1Response:
        """Send a request and wait for the response head. *deadline* (``loop.time()``; a bytes-like or no *body*:
        a streamed body is the caller's to time): the connect and the head must be done by then, else
        :class:`RequestTimeout` (a connect that times out on its own, before the deadline: :class:`ConnectTimeout`)."""
        conn = await self.connection(host, port, deadline)
        if self.check_identity and not conn.serves_origin:
            # serves() compares the identity with the URL's host and port, never its path: one answer per
            # connection (it serves one origin, with one certificate), kept once it is "yes"
            problem = serves(conn.peer_identity, "https", host, port, target.split("?", 1)[0])
            if problem is not None:  # a valid certificate of another role: nothing is sent to it
                conn.close()
                self._all.discard(conn)
                raise TransportError(f"{method} https://{host}:{port}{target}: {problem}")
            conn.serves_origin = True
        try:
            status, headers = await conn.exchange(method, target, fields, body, deadline)
        except (OSError, ssl.SSLError) as exc:
            conn.close()
            self._all.discard(conn)
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"{method} {target}: {exc}") from None
        except BaseException:
            conn.close()
            self._all.discard(conn)
            raise
        return H1Response(self, conn, status, headers)

    def release(self, conn: H1Connection) -> None:
        """Back to the pool if the exchange ended cleanly; else closed."""
        if conn.busy and conn.reusable and not conn.closed and conn.body_done:
            conn.busy = False
            idle = self._idle.setdefault(conn.origin, [])
            if len(idle) < self.max_idle:
                idle.append(conn)
                return
        conn.busy = False
        conn.close()
        self._all.discard(conn)

    async def aclose(self, grace: float = 1.0) -> None:
        """Close every connection: TLS close_notify, then the socket once the transport lets go of it -- waited
        for (up to *grace* seconds, then aborted), so no socket outlives the pool (nor the event loop)."""
        conns = list(self._all)
        for conn in conns:
            conn.close()
        self._all.clear()
        self._idle.clear()
        self._deadlines.close()
        deadline = asyncio.get_running_loop().time() + grace
        with contextlib.suppress(Exception):
            await asyncio.sleep(0)
            while any(not c.lost for c in conns) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
        for conn in conns:
            if not conn.lost and conn.transport is not None:
                conn.transport.abort()


__all__ = ["H1Connection", "H1Pool", "H1Response", "IntoBuffer"]
