"""HTTP/1.1 over TLS: an asyncio protocol around the sans-I/O h11 state machine, one request at a time.

h11 parses every request head and writes every response. A request body framed by Content-Length, the usual
case and the bulk of the traffic, is counted off the connection directly and handed to the app in the chunks the
TLS layer delivers, without passing through h11's receive buffer (three copies of every octet); the next request on
the connection then starts with a fresh h11 state machine. Chunked bodies go through h11.

Backpressure: reading from the transport pauses while the app holds more than :data:`BODY_HIGH_WATER` octets of
unread request body (and while a pipelined request waits), and every response write waits for the transport to
drain below its high-water mark. Malformed requests get a 400 problem response and the connection is closed. A
response finished before its request body was read makes the server read and discard the rest (keeping the
connection when the rest is small, closing it otherwise), so that the client sees the response, not a reset.

Deadlines (one timer): an idle connection is closed after ``settings.idle_timeout``; a request head, once its
first octet is in, must be complete within ``settings.header_timeout`` (a slowloris peer sending a header octet
every few seconds is closed then); a stalled request body is cut after ``idle_timeout`` without an octet.
Memory: between requests and while a head is read, reads go into a :data:`HEAD_READ_SIZE` buffer; the
:data:`READ_SIZE` one is allocated when a connection first receives a request body (an idle or slow connection
holds 16 KiB, not 256 KiB). An app that takes a Content-Length body with ``kvsp.receive_into``
(:meth:`http3.asgi_bridge.RequestBody.receive_into`) gets it decrypted straight into its own buffer: TLS writes
into the sink's view and no octet is copied on the way (the holder's block uploads).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import unquote

import h11

from http3.asgi_bridge import (
    AsgiContext,
    Buffer,
    ClientDisconnected,
    Exchange,
    Headers,
    RequestBody,
    http_date,
    http_scope,
    reason_phrase,
    split_target,
)
from http3.immediate import Immediate, h1_head
from http3.tcp_flow import WriteFlow

log = logging.getLogger("http3.tcp")

BODY_HIGH_WATER = 1 << 20  # pause reading while the app has this much unread request body
PIPELINE_HIGH_WATER = 64 << 10  # pause reading while this much of a next (pipelined) request waits
DISCARD_LIMIT = 8 << 20  # an unread request body rest larger than this closes the connection instead
LINGER = 1.0  # seconds to keep reading (and discarding) before closing after an early response
FLUSH_AT = 1 << 20  # corked response octets are written once this many are waiting
READ_SIZE = 256 << 10  # the most one read takes off the connection (while a request body comes in)
HEAD_READ_SIZE = 16 << 10  # the most one read takes otherwise: one TLS record
_CONTINUE = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
_NOT_IMMEDIATE = frozenset((b"content-length", b"transfer-encoding", b"expect", b"upgrade"))  # go the ASGI way


class H1Connection(WriteFlow, asyncio.BufferedProtocol):
    """One HTTP/1.1 connection; installed by :class:`http3.tcp_server.TcpServer` once ALPN chose it."""

    protocol_name = "HTTP/1.1"

    def __init__(self, ctx: AsgiContext, transport: asyncio.Transport, conn_info: dict[str, Any]) -> None:
        super().__init__(ctx, transport, conn_info)
        self.h11 = self._new_h11()
        self.exchange: Exchange | None = None
        self._must_close = False  # close once the current response is out (413, 400)
        self._body_left: int | None = None  # octets of a Content-Length body still to come (counted here)
        self._pending = bytearray()  # what came after such a body: the next request
        self._continue_wanted = False  # the client waits for 100 Continue before it sends the body
        self._discarding = False  # the response is out, the rest of the request body is read and dropped
        self._discarded = 0
        self._reading_paused = False
        self._head_view = memoryview(bytearray(HEAD_READ_SIZE))
        self._body_view: memoryview | None = None  # READ_SIZE octets, allocated for the first request body
        self._rx_view = self._head_view  # the buffer get_buffer() handed out last
        self._rx_direct = False  # ... or it handed out a view of the body sink's buffer (RequestBody.sink_buffer)
        self._head_begun = False  # octets of a request head are in: the header deadline runs
        self._out: list[Buffer] = []  # response octets corked until the response ends, FLUSH_AT, or the next turn
        self._out_size = 0
        self._flush_handle: asyncio.Handle | None = None
        self._scope_base: dict[str, Any] | None = None  # the connection's part of a scope, for respond_now
        self._arm_timer(self.settings.idle_timeout)

    def _new_h11(self) -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=self.settings.max_header_bytes)

    # -- asyncio.BufferedProtocol ---------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        """TLS decrypts into a reused buffer, up to :data:`READ_SIZE` octets per read while a request body comes
        in and :data:`HEAD_READ_SIZE` otherwise (asyncio's copying path allocates a 256 KiB object per 16 KiB TLS
        record instead); each read becomes one ``bytes`` object."""
        exchange = self.exchange
        if self._body_left is None and (exchange is None or exchange.body.complete):
            self._rx_view = self._head_view
        elif self._body_left and exchange is not None and exchange.body.sink is not None:
            direct = exchange.body.sink_buffer(self._body_left)  # the app takes the body into its own buffer
            if direct is not None and len(direct):
                self._rx_direct = True
                return direct
            return self.get_buffer(sizehint)  # the sink just failed: read as usual
        else:
            if self._body_view is None:
                self._body_view = memoryview(bytearray(READ_SIZE))
            self._rx_view = self._body_view
        return self._rx_view

    def buffer_updated(self, nbytes: int) -> None:
        if self._rx_direct:
            self._rx_direct = False
            self._direct_received(nbytes)
        else:
            self.data_received(bytes(self._rx_view[:nbytes]))

    def data_received(self, data: bytes) -> None:
        self._last_rx = self.loop.time()
        if self._body_left is not None:
            self._body_received(data)
        elif self._counted_body_done():
            self._pending += data  # a pipelined request waits for the response to the counted one
            self._update_reading()
        else:
            if self.exchange is None and data and not self._head_begun:
                self._head_begun = True  # the first octet of a request head: it has header_timeout to finish
                self._arm_timer(self.settings.header_timeout)
            try:
                self.h11.receive_data(data)
            except RuntimeError:  # data after the peer closed: ignore
                return
            self._process()

    def eof_received(self) -> bool | None:
        if self._body_left is not None or self._counted_body_done():
            if self.exchange is not None and not self.exchange.body.complete:
                self.exchange.body.disconnect()
            return None
        try:
            self.h11.receive_data(b"")
        except RuntimeError:
            pass
        else:
            self._process()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self.exchange is not None:
            self.exchange.body.disconnect()
        self._lost()

    # -- server API ------------------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return self.exchange is None

    def shutdown(self) -> None:
        """Graceful: finish the request in flight (its response says Connection: close), then close."""
        self.closing = True
        if self.exchange is None:
            self._close()

    def abort(self) -> None:
        if not self.closed:
            self.transport.abort()

    # -- requests --------------------------------------------------------------------------------------------

    def _process(self) -> None:
        while not self.closed and self._body_left is None:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._protocol_error(exc)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                break
            if isinstance(event, h11.Data):
                self._chunk_received(event.data)
            elif isinstance(event, h11.Request):
                if self._on_request(event):
                    break  # the body is counted here: this h11 state machine is done with the request
            elif isinstance(event, h11.EndOfMessage):
                self._body_complete()
            elif isinstance(event, h11.ConnectionClosed):
                if self.exchange is not None:
                    self.exchange.body.disconnect()
                self._close()
                break
        self._update_reading()

    def _on_request(self, event: h11.Request) -> bool:
        """Start the exchange; True when the body is counted off the connection rather than parsed by h11."""
        self._cancel_timer()
        self._head_begun = False
        self._discarding = False
        self._discarded = 0
        headers: Headers = list(event.headers)  # h11 lowercases names
        # h11 bounds only a head that arrives in pieces (max_incomplete_event_size), not one read whole
        head_too_big = (len(event.target) + sum(len(k) + len(v) + 4 for k, v in headers)
                        > self.settings.max_header_bytes)
        if self.ctx.respond_now is not None and not head_too_big and self._respond_now(event, headers):
            return False  # answered; the next request, if one is in, is parsed by a fresh h11
        body = RequestBody(self.ctx, self._on_consumed, self._on_body_wait)
        scope = http_scope(self.ctx, http_version=event.http_version.decode("ascii"),
                           method=event.method.decode("ascii"), target=bytes(event.target), headers=headers,
                           client=self.info["client"], server=self.info["server"], tls=self.info["tls"])
        exchange = Exchange(self.ctx, scope, body, _H1Sink(self))
        self.exchange = exchange
        declared: int | None = None
        if not any(name == b"transfer-encoding" for name, _ in headers):
            length = next((value for name, value in headers if name == b"content-length"), None)
            declared = int(length) if length is not None else None  # h11 checked the digits
        if head_too_big:
            self._must_close = True
            self._track(exchange.reject(431))
        elif declared is not None and declared > self.settings.max_body_bytes:
            self._must_close = True
            self._track(exchange.reject(413, "Content Too Large"))
        else:
            self._arm_timer(self.settings.idle_timeout)  # watches for a stalled request body
            self._track(self.loop.create_task(exchange.run()))
        self._continue_wanted = self.h11.they_are_waiting_for_100_continue
        if declared is None:
            return False
        self._body_left = declared  # count the body off the connection; h11 is done with this request
        rest, _ = self.h11.trailing_data
        self._body_received(rest)
        return True

    def _respond_now(self, event: h11.Request, headers: Headers) -> bool:
        """Answer a keep-alive GET without a body through the app's ``respond_now`` hook (:mod:`http3.immediate`),
        if it has the answer at hand: the response is written at once, and h11 starts afresh after it."""
        if (event.method != b"GET" or event.http_version != b"1.1" or self.closing or self._must_close
                or self._write_paused
                or any(name in _NOT_IMMEDIATE or (name == b"connection" and b"close" in value.lower())
                       for name, value in headers)):
            return False
        raw_path, query = split_target(bytes(event.target))
        scope = self._scope_base
        if scope is None:
            scope = self._scope_base = {"type": "http", "http_version": "1.1", "client": self.info["client"],
                                        "server": self.info["server"], "extensions": {"tls": self.info["tls"]}}
        assert self.ctx.respond_now is not None
        answer: Immediate | None = self.ctx.respond_now("GET", unquote(raw_path.decode("ascii", "replace")), query,
                                                       scope)
        if answer is None:
            return False
        names = {name for name, _ in answer.headers}
        extra: Headers = [] if b"date" in names else [(b"date", http_date())]
        if self.ctx.alt_svc is not None and b"alt-svc" not in names:
            extra.append((b"alt-svc", self.ctx.alt_svc))
        self.write([h1_head(answer.status, answer.headers + extra), *answer.body], flush=True)
        rest, closed = self.h11.trailing_data  # what came after the head: a pipelined request
        self.h11 = self._new_h11()
        if rest:
            self.h11.receive_data(rest)
        if closed:
            self.h11.receive_data(b"")
        self._head_begun = bool(rest)
        self._arm_timer(self.settings.header_timeout if rest else self.settings.idle_timeout)
        return True

    def _body_received(self, data: Buffer) -> None:
        """Octets of a Content-Length body, and maybe what follows it."""
        left = self._body_left
        assert left is not None
        if len(data) > left:
            self._pending += memoryview(data)[left:]
            data = memoryview(data)[:left]
        if data:
            self._body_left = left = left - len(data)
            self._chunk_received(data)
        if left == 0:
            self._body_left = None
            self._body_complete()
        self._update_reading()

    def _direct_received(self, nbytes: int) -> None:
        """*nbytes* octets of a Content-Length body were decrypted straight into the app's sink (never more than
        the body's rest: :meth:`get_buffer` bounds the view)."""
        self._last_rx = self.loop.time()
        left = self._body_left
        exchange = self.exchange
        assert left is not None and nbytes <= left and exchange is not None
        self._continue_wanted = False
        self._body_left = left = left - nbytes
        exchange.body.sink_updated(nbytes)
        if exchange.body.received > self.settings.max_body_bytes and not exchange.rejected:
            self._must_close = True
            self._track(exchange.reject(413, "Content Too Large"))
        if left == 0:
            self._body_left = None
            self._body_complete()
        self._update_reading()

    def _chunk_received(self, data: Buffer) -> None:
        self._continue_wanted = False  # the client did not wait for 100 Continue
        exchange = self.exchange
        if exchange is None or exchange.finished or exchange.rejected:
            self._discarded += len(data)
            if self._discarding and self._discarded > DISCARD_LIMIT:
                self._close()  # too much left to read: closing is cheaper
            return
        body = exchange.body
        body.feed(data)
        if body.received > self.settings.max_body_bytes:
            self._must_close = True
            self._track(exchange.reject(413, "Content Too Large"))

    def _body_complete(self) -> None:
        exchange = self.exchange
        if exchange is None:
            return
        exchange.body.finish()
        if self._discarding or (exchange.finished and self.h11.our_state in (h11.DONE, h11.MUST_CLOSE)):
            self._cycle_done()

    def _counted_body_done(self) -> bool:
        """A counted (Content-Length) body is in and its response is not yet out."""
        return self.exchange is not None and self.h11.their_state is not h11.DONE and self.exchange.body.complete

    def _protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        log.debug("malformed HTTP/1.1 request from %s: %s", self.info["client"], exc)
        self._must_close = True
        status = exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400
        exchange = self.exchange
        if exchange is not None and not exchange.finished:
            self._track(exchange.reject(status))
            if exchange.head_sent:
                self._close()
            return
        if exchange is None and self.h11.our_state is h11.IDLE:
            scope = http_scope(self.ctx, http_version="1.1", method="GET", target=b"/", headers=[],
                               client=self.info["client"], server=self.info["server"], tls=None)
            self.exchange = Exchange(self.ctx, scope, RequestBody(self.ctx), _H1Sink(self))
            self._track(self.exchange.reject(status))
            return
        self._close()

    # -- after a response ------------------------------------------------------------------------------------

    def response_done(self) -> None:
        """The whole response is out (called by the sink)."""
        if self.closed:
            return
        exchange = self.exchange
        if exchange is not None and exchange.body.complete:
            self._cycle_done()
        else:  # the request body is not all read: read the rest and drop it, then go on or close
            self._discarding = True
            self._discarded = 0
            self._arm_timer(LINGER)
            self._update_reading()

    def _cycle_done(self) -> None:
        self.exchange = None
        self._discarding = False
        if self._must_close or self.closing or self.h11.our_state is not h11.DONE:
            self._close()
            return
        if self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
        else:  # the body was counted here, not by h11: the next request gets a fresh state machine
            self.h11 = self._new_h11()
        pipelined = bool(self._pending) or bool(self.h11.trailing_data[0])
        if self._pending:
            self.h11.receive_data(bytes(self._pending))
            self._pending.clear()
        self._head_begun = pipelined  # the next request's head, begun already, has header_timeout to finish
        self._arm_timer(self.settings.header_timeout if pipelined else self.settings.idle_timeout)
        self._update_reading()
        if self.h11.trailing_data[0]:
            self.loop.call_soon(self._process)

    def _close(self) -> None:
        self.flush()
        if not self.closed and not self.transport.is_closing():
            self.transport.close()
        if not self.quiet.done():
            self.quiet.set_result(None)

    # -- flow control ----------------------------------------------------------------------------------------

    def _on_consumed(self, n: int) -> None:
        if self._reading_paused:
            self._update_reading()

    def _on_body_wait(self) -> None:
        if self._continue_wanted and self.h11.our_state is h11.SEND_RESPONSE:
            self._continue_wanted = False
            self.write(self.h11.send_with_data_passthrough(_CONTINUE) or [], flush=True)

    def _update_reading(self) -> None:
        if self.closed:
            return
        exchange = self.exchange
        pause = False
        if exchange is not None and not self._discarding:
            waiting = len(self._pending) + (len(self.h11.trailing_data[0]) if self.h11.their_state is h11.DONE else 0)
            pause = exchange.body.buffered > BODY_HIGH_WATER or waiting > PIPELINE_HIGH_WATER
        if pause != self._reading_paused:
            self._reading_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self._last_rx = self.loop.time()
                self.transport.resume_reading()

    def write(self, chunks: Sequence[Buffer], *, flush: bool = False) -> None:
        """Cork *chunks*: they go to the transport together (one TLS write, one send) when the response ends,
        when :data:`FLUSH_AT` octets wait, or at the loop's next turn, whichever comes first. A block response
        whose head and sections are sent without the app yielding thus leaves in one write."""
        if self.closed or self.transport.is_closing():
            return
        self._out += chunks
        self._out_size += sum(len(c) for c in chunks)
        if flush or self._out_size >= FLUSH_AT:
            self.flush()
        elif self._flush_handle is None and self._out:
            self._flush_handle = self.loop.call_soon(self.flush)

    def flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        out, self._out, self._out_size = self._out, [], 0
        if out and not self.closed and not self.transport.is_closing():
            self.transport.writelines(out)

    # -- timers ----------------------------------------------------------------------------------------------

    def _on_timer(self) -> None:
        self._timer = None
        exchange = self.exchange
        if exchange is None or self._discarding:
            if exchange is None and self._head_begun:
                log.debug("HTTP/1.1 peer %s did not finish a request head in %gs: closing", self.info["client"],
                          self.settings.header_timeout)
            self._close()  # idle keep-alive connection, a head too slow, or the linger after an early response
            return
        body = exchange.body
        if body.complete or body.disconnected:
            return  # the app is at work; stalled writes have their own timeout
        if self._reading_paused:  # the app is slow, not the peer
            self._arm_timer(self.settings.idle_timeout)
            return
        idle_for = self.loop.time() - self._last_rx
        if idle_for >= self.settings.idle_timeout:
            log.debug("HTTP/1.1 peer %s stalled sending a request body: closing", self.info["client"])
            body.disconnect()
            self.abort()
        else:
            self._arm_timer(self.settings.idle_timeout - idle_for)

    def _track(self, task: asyncio.Task[None] | None) -> None:
        if task is not None:
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


class _H1Sink:
    """Writes one response through h11; every write waits for the transport to drain."""

    def __init__(self, conn: H1Connection) -> None:
        self.conn = conn

    @property
    def closed(self) -> bool:
        return self.conn.closed or self.conn.transport.is_closing()

    async def send_head(self, status: int, headers: Headers, body: Buffer, end: bool) -> None:
        conn = self.conn
        if self.closed:
            raise ClientDisconnected("connection closed")
        if conn.closing or conn._must_close:
            headers = [*headers, (b"connection", b"close")]
        try:
            response = h11.Response(status_code=status, headers=headers, reason=reason_phrase(status))
        except h11.LocalProtocolError as exc:
            raise RuntimeError(f"ASGI app sent an invalid response head: {exc}") from None
        chunks = conn.h11.send_with_data_passthrough(response) or []
        await self._send(chunks, body, end)

    async def send_data(self, data: Buffer, end: bool) -> None:
        if self.closed:
            raise ClientDisconnected("connection closed")
        await self._send([], data, end)

    async def _send(self, head: Sequence[Buffer], data: Buffer, end: bool) -> None:
        conn = self.conn
        chunks = list(head)
        try:
            if data:  # passed through to the transport as it is: h11 only counts it (and frames it if chunked)
                chunks += conn.h11.send_with_data_passthrough(h11.Data(data=cast(bytes, data))) or []
            if end:
                chunks += conn.h11.send_with_data_passthrough(h11.EndOfMessage()) or []
        except h11.LocalProtocolError as exc:  # e.g. more body than the app's content-length said
            conn.abort()
            raise RuntimeError(f"ASGI app sent an invalid response: {exc}") from None
        conn.write(chunks, flush=end)
        await conn.drain()  # before the next pipelined request is taken: a peer that does not read stops them
        if end:
            conn.response_done()

    def reset(self) -> None:
        self.conn.flush()  # what the app sent goes out before the reset, as it did before corking
        self.conn.abort()
