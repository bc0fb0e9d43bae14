"""The asyncio adapter: a sans-I/O :class:`~moqt.session.MoqtSession` on an aioquic connection.

Server side: :func:`moqt_handlers` gives :class:`quic.listener.QuicListener` (and so
:class:`http3.server.RoleServer`) a handler per MOQT ALPN (``moq-00``: draft 14, ``moqt-18``: draft 18), so a
role's one UDP port serves HTTP/3 and MOQT with the same mutual TLS; each connection's session knows the peer's
verified identity (:attr:`MoqtConnection.peer_identity`, the certificate's SAN URI) for authorization::

    server = RoleServer(app, files, quic_handlers=moqt_handlers(MyApp()))

Client side: :func:`connect_moqt` (:func:`quic.protocol.connect_quic`, like
:func:`http3.h3_client.connect_h3`: batched UDP, mutual TLS, waits for HANDSHAKE_DONE, then for the peer's SETUP)
returns the :class:`MoqtConnection`::

    conn = await connect_moqt("127.0.0.1", port, files)                  # offers both drafts
    async with conn.fetch(namespace, track, Location(0, 0), Location(0, 32)) as fetch:
        await fetch.wait_accepted()
        async for piece in fetch.pieces():                                # or fetch.objects()
            ...
    await conn.aclose()

What the adapter does, and nothing more (the session holds every protocol rule):

* executes the session's actions on the aioquic connection; stream ids pass through unchanged (the session
  numbers its streams as QUIC does);
* feeds stream data, resets, STOP_SENDING, datagrams and the connection's end into the session and routes the
  events: replies and objects to the :class:`FetchStream` of our request, the peer's requests to the
  :class:`MoqtApp`;
* flow control: object payload octets handed to a :class:`FetchStream` are held (``KvspQuicConnection.hold``) and
  credited back to the peer only as the consumer takes them (``release``); everything else (control and request
  streams, object headers) is credited at once, so control streams are never blocked by their own windows. On
  the client, peer unidirectional streams (MOQT data streams) are admitted with MAX_STREAMS only while fewer than
  ``data_streams`` + 1 are open or unread, and the connection window exceeds what they can hold unread by
  :data:`CONTROL_RESERVE`: however slowly the consumer reads, credit for control messages remains;
* send backpressure: :class:`ServedFetch` writes object payloads in slices of half the send buffer, each after
  ``wait_writable`` (QUIC's unsent + unacknowledged octets of the stream below the send buffer; both sides'
  connections are :class:`quic.protocol.KvspQuicProtocol`).

Priorities (``OpenStream.priority``) are not applied: aioquic has no stream priorities.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

from aioquic import tls
from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from aioquic._buffer
from aioquic.quic import events as qe
from aioquic.quic.packet import pull_quic_transport_parameters

from moqt import events as ev
from moqt.actions import CloseSession, ResetStream, SendDatagram, SendStreamData, StopSending
from moqt.errors import MoqtUsageError, RequestErrorCode14, RequestErrorCode18, SessionErrorCode, StreamResetCode
from moqt.requests import Role, SessionConfig
from moqt.session import MoqtSession
from moqt.types import ALPNS, Draft, GroupOrder, KeyValuePairs, Location, Namespace, ObjectStatus
from moqt.writers import FetchStreamWriter
from quic.connection import KvspQuicConnection
from quic.listener import HandlerFactory, QuicConnectionContext
from quic.protocol import KvspQuicProtocol, QuicConnectError, connect_quic
from quic.tls import TLS_1_3, TlsFiles, TransportSettings, identity_of_pem, tls_extension

log = logging.getLogger("kvsp.moqt")

CONTROL_RESERVE = 1 << 20  # connection credit kept free of data-stream octets, for control messages
DEFAULT_DATA_STREAMS = 4  # client: peer data streams open (or unread) at once


# -- errors ---------------------------------------------------------------------------------------------------


class MoqtConnectError(QuicConnectError):
    """The QUIC handshake or the MOQT setup failed (no MOQT ALPN at the peer, certificate refused, timeout)."""


class MoqtSessionClosed(ConnectionError):
    """The session (or its QUIC connection) is over."""

    def __init__(self, error_code: int, reason: str) -> None:
        super().__init__(f"MOQT session closed (code 0x{error_code:x}{': ' + reason if reason else ''})")
        self.error_code = error_code
        self.reason = reason


class MoqtRequestError(Exception):
    """The peer refused one of our requests (FETCH_ERROR / REQUEST_ERROR ...) or cancelled it."""

    def __init__(self, request_id: int, error_code: int, reason: bytes = b"", *, cancelled: bool = False) -> None:
        what = "cancelled" if cancelled else "refused"
        text = reason.decode("utf-8", "replace")
        super().__init__(f"request {request_id} {what} (code 0x{error_code:x}{': ' + text if text else ''})")
        self.request_id = request_id
        self.error_code = error_code
        self.reason = reason
        self.cancelled = cancelled


class MoqtStreamError(ConnectionError):
    """The peer reset a data stream of ours."""


class MoqtStalled(TimeoutError):
    """Nothing arrived for a fetch within its deadline."""


class FetchCancelled(Exception):
    """The peer cancelled (or stopped the data stream of) a fetch we serve: stop writing."""


class FetchSink(Protocol):
    """Takes a fetch's replies and pieces synchronously, as they are dispatched (``MoqtConnection.fetch(...,
    sink=)``): nothing is queued or held for flow control, so the sink owns the pieces' memory (a relay's cache)."""

    def fetch_accepted(self, event: ev.FetchAccepted) -> None: ...

    def fetch_piece(self, piece: ev.ObjectReceived) -> bool:
        """Take a piece; True to hold its octets against flow control until :meth:`FetchStream.release`."""
        ...

    def fetch_ended(self) -> None:
        """The data stream ended with FIN after a whole number of objects."""

    def fetch_failed(self, error: BaseException) -> None: ...


# -- what the adapter needs from the QUIC side -----------------------------------------------------------------


class QuicTransport(Protocol):
    @property
    def quic(self) -> KvspQuicConnection: ...

    def transmit_soon(self) -> None: ...

    async def wait_writable(self, stream_id: int) -> None: ...


class MoqtQuicConnection(KvspQuicConnection):
    """A client connection that admits peer unidirectional streams (MOQT data streams) only while fewer than
    *uni_streams* are open or hold octets the application has not read (see the module docstring)."""

    _moqt_uni_budget: int | None = None
    _moqt_uni_done = 0

    def __init__(self, *args: Any, uni_streams: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if uni_streams is not None:
            self._moqt_uni_budget = uni_streams
            self._local_max_streams_uni.value = self._local_max_streams_uni.sent = uni_streams

    @classmethod
    def budget(cls, quic: KvspQuicConnection, uni_streams: int) -> MoqtQuicConnection:
        """Give an accepted (server) connection the same data-stream budget. Its handshake has already granted
        the listener's initial MAX_STREAMS (aioquic: 128), so the budget bounds what is granted beyond that."""
        quic.__class__ = cls
        conn = cast(MoqtQuicConnection, quic)
        conn._moqt_uni_budget = uni_streams
        conn._moqt_uni_done = 0
        return conn

    def moqt_stream_done(self) -> None:
        """A peer unidirectional stream has ended and every octet of it was read: let the peer open another."""
        self._moqt_uni_done += 1

    def _write_connection_limits(self, builder: Any, space: Any) -> None:
        budget = self._moqt_uni_budget
        if budget is not None:  # not aioquic's one more per finished stream: one more per stream ended and read
            limit = self._local_max_streams_uni
            limit.value = max(limit.sent, self._moqt_uni_done + budget)
        super()._write_connection_limits(builder, space)


def respect_peer_udp_payload(quic: KvspQuicConnection) -> int | None:
    """Send no datagram larger than the peer's ``max_udp_payload_size`` transport parameter (RFC 9000, 18.2).

    aioquic 1.7.2 (pinned) parses the parameter but then ignores it, sending datagrams of the configured size (16
    KiB on loopback, FACTS.md): peers that take the parameter at its word (picoquic, so aiomoqt, advertises 1500 or
    so) drop them all and the connection stalls once packets grow past it. Call once the handshake is complete;
    returns the peer's limit (None when it stated none)."""
    extensions = getattr(quic.tls, "received_extensions", None) or []
    for ext_type, data in extensions:
        if ext_type != tls.ExtensionType.QUIC_TRANSPORT_PARAMETERS:
            continue
        try:
            params = pull_quic_transport_parameters(Buffer(data=data))
        except Exception:  # aioquic already accepted these; be lenient here
            return None
        limit = params.max_udp_payload_size
        if limit is not None and limit < quic._max_datagram_size:
            quic._max_datagram_size = limit
            loss = quic._loss
            loss._pacer._max_datagram_size = limit
            if hasattr(loss._cc, "_max_datagram_size"):
                loss._cc._max_datagram_size = limit
            log.debug("peer limits UDP payloads to %d octets", limit)
        return limit
    return None


# -- objects, our fetches and the fetches we serve ---------------------------------------------------------------


@dataclass(frozen=True)
class MoqtObject:
    """A complete object of a fetch; ``parts`` are views of the received octets (joined only by ``payload``)."""

    group: int
    object_id: int
    subgroup: int | None
    status: ObjectStatus
    extensions: KeyValuePairs
    length: int
    parts: tuple[memoryview | bytes, ...]

    @property
    def payload(self) -> bytes:
        return b"".join(self.parts)


class FetchStream:
    """One FETCH of ours: its reply, then its objects as they arrive. Use it as an async context manager (or call
    :meth:`aclose`), so that an unfinished fetch is cancelled and its unread octets are credited back."""

    def __init__(self, conn: MoqtConnection, request_id: int, stall_timeout: float | None,
                 sink: FetchSink | None = None) -> None:
        self.conn = conn
        self.request_id = request_id
        self.stall_timeout = stall_timeout
        self.sink = sink
        self.accepted: ev.FetchAccepted | None = None
        self.stream_id: int | None = None
        self.range_ends: list[ev.FetchRangeEnded] = []
        self.received = 0  # payload octets taken by the consumer
        self._pieces: collections.deque[ev.ObjectReceived] = collections.deque()
        self._ended = False  # the data stream ended with FIN
        self._error: BaseException | None = None
        self._changed = asyncio.Event()
        self._closed = False
        self._sink_held = 0  # payload octets the sink holds (not yet credited back to the peer)

    # from the connection

    def _wake(self) -> None:
        self._changed.set()

    def _on_piece(self, piece: ev.ObjectReceived) -> bool:
        """Take a piece; True when it is held for the consumer (its octets count against flow control)."""
        if self._closed or self._error is not None:
            return False
        if self.sink is not None:
            n = len(piece.data)
            self.received += n
            if self.sink.fetch_piece(piece) and n:
                self._sink_held += n
                return True
            return False
        self._pieces.append(piece)
        self._wake()
        return True

    def _on_accepted(self, event: ev.FetchAccepted) -> None:
        self.accepted = event
        if self.sink is not None and not self._closed:
            self.sink.fetch_accepted(event)
        self._wake()

    def _on_end(self) -> None:
        self._ended = True
        if self.sink is not None and not self._closed and self._error is None:
            self.sink.fetch_ended()
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not (self._ended and self.accepted is not None):
            self._error = error
            if self.sink is not None and not self._closed:
                self.sink.fetch_failed(error)
        self._wake()

    # API

    @property
    def done(self) -> bool:
        """Every object arrived (the data stream ended) and was taken, or the fetch failed or was closed."""
        return self._closed or self._error is not None or (self._ended and not self._pieces)

    async def _wait(self, timeout: float | None) -> None:
        self._changed.clear()
        if timeout is None:
            await self._changed.wait()
            return
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            raise MoqtStalled(f"fetch {self.request_id}: nothing arrived for {timeout:.3g} s") from None

    async def wait_accepted(self, timeout: float | None = None) -> ev.FetchAccepted:
        """FETCH_OK; raises MoqtRequestError (refused), MoqtSessionClosed, MoqtStalled (after *timeout*)."""
        while self.accepted is None:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise MoqtUsageError("the fetch is closed")
            await self._wait(timeout)
        return self.accepted

    async def next_piece(self, timeout: float | None = -1.0) -> ev.ObjectReceived | None:
        """The next piece of an object (``ObjectReceived``), or None after the last one. *timeout*: the longest
        wait for the next piece (default: the fetch's ``stall_timeout``; None: no limit)."""
        limit = self.stall_timeout if timeout == -1.0 else timeout
        while True:
            if self._pieces:
                piece = self._pieces.popleft()
                n = len(piece.data)
                if n:
                    self.received += n
                    assert piece.stream_id is not None
                    self.conn._release(piece.stream_id, n)
                return piece
            if self._error is not None:
                raise self._error
            if self._ended or self._closed:
                return None
            await self._wait(limit)

    async def pieces(self) -> AsyncIterator[ev.ObjectReceived]:
        while (piece := await self.next_piece()) is not None:
            yield piece

    async def objects(self) -> AsyncIterator[MoqtObject]:
        """Complete objects, in the order they arrive."""
        parts: list[memoryview | bytes] = []
        while (piece := await self.next_piece()) is not None:
            if piece.data:
                parts.append(piece.data)
            if piece.complete:
                yield MoqtObject(piece.group, piece.object_id, piece.subgroup, piece.status, piece.extensions,
                                 piece.length, tuple(parts))
                parts = []

    def release(self, n: int) -> None:
        """Sink mode: the sink is done with *n* of the octets it held; credit them back to the peer."""
        n = min(n, self._sink_held)
        if n and self.stream_id is not None:
            self._sink_held -= n
            self.conn._release(self.stream_id, n)

    async def aclose(self) -> None:
        """Stop: an unfinished fetch is cancelled (FETCH_CANCEL / stream cancellation); unread octets are
        credited back."""
        if self._closed:
            return
        self.release(self._sink_held)
        self._closed = True
        conn = self.conn
        if not (self._ended or self._error is not None) and not conn.session.closed:
            with contextlib.suppress(MoqtUsageError):  # already over in the session
                conn.session.cancel_fetch(self.request_id)
            conn.flush()
        while self._pieces:
            piece = self._pieces.popleft()
            if piece.data and piece.stream_id is not None:
                conn._release(piece.stream_id, len(piece.data))
        conn._forget_fetch(self)
        self._wake()

    async def __aenter__(self) -> FetchStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class ServedFetch:
    """A fetch we serve, after FETCH_OK: write its objects with backpressure, then :meth:`finish`."""

    def __init__(self, conn: MoqtConnection, request_id: int, writer: FetchStreamWriter) -> None:
        self.conn = conn
        self.request_id = request_id
        self.writer = writer
        self.cancelled = False
        self._step = max(conn.send_buffer // 2, 16384)

    @property
    def stream_id(self) -> int:
        return self.writer.stream_id

    def _check(self) -> None:
        if self.conn.closed is not None:
            raise MoqtSessionClosed(self.conn.closed.error_code, self.conn.closed.reason)
        if self.cancelled or self.writer.stopped is not None or self.writer.closed:
            raise FetchCancelled(f"fetch {self.request_id} was cancelled by the peer")

    async def write_object(self, object_id: int, parts: Sequence[bytes | bytearray | memoryview], *,
                           group: int = 0) -> None:
        """One object whose payload is *parts* in order (views; nothing is joined here): the header, then the
        parts in slices of half the send buffer, each once QUIC has room for it."""
        views = [p if isinstance(p, memoryview) else memoryview(p) for p in parts]
        views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        self._check()
        self.writer.begin_object(group, object_id, sum(len(v) for v in views))
        step = self._step
        for view in views:
            for offset in range(0, len(view), step):
                await self.conn.transport.wait_writable(self.stream_id)
                self._check()
                self.writer.write(view[offset:offset + step])
                self.conn.flush()
        self.conn.flush()

    def begin_object(self, object_id: int, length: int, *, group: int = 0, subgroup: int | None = 0,
                     priority: int = 128, status: ObjectStatus = ObjectStatus.NORMAL,
                     extensions: KeyValuePairs = ()) -> None:
        """Announce an object of *length* payload octets whose payload follows with :meth:`write` (a relay that
        forwards each piece as it arrives)."""
        self._check()
        self.writer.begin_object(group, object_id, length, subgroup=subgroup, priority=priority, status=status,
                                 extensions=extensions)

    async def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Payload octets of the current object (a view is kept, not copied), in slices of half the send buffer,
        each once QUIC has room for it."""
        view = chunk if isinstance(chunk, memoryview) else memoryview(chunk)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        step = self._step
        for offset in range(0, len(view), step):
            await self.conn.transport.wait_writable(self.stream_id)
            self._check()
            self.writer.write(view[offset:offset + step] if len(view) > step else view)
        self.conn.flush()

    def send_ok(self, end_location: Location, *, end_of_track: bool = False) -> None:
        """The FETCH_OK deferred by ``accept_fetch(request_id, None)`` (objects may already be on their way)."""
        if self.conn.closed is not None:
            raise MoqtSessionClosed(self.conn.closed.error_code, self.conn.closed.reason)
        try:
            self.conn.session.send_fetch_ok(self.request_id, end_location, end_of_track=end_of_track)
        except MoqtUsageError as exc:
            raise FetchCancelled(str(exc)) from None
        self.conn.flush()

    def finish(self) -> None:
        self._check()
        self.writer.finish()
        self.conn._forget_served(self)
        self.conn.flush()

    def reset(self, error_code: int = StreamResetCode.INTERNAL_ERROR) -> None:
        if not self.writer.closed:
            self.writer.reset(error_code)
        self.conn._forget_served(self)
        self.conn.flush()

    def _on_cancel(self) -> None:
        self.cancelled = True
        if not self.writer.closed:
            self.writer.reset(StreamResetCode.CANCELLED)


# -- the application -------------------------------------------------------------------------------------------


_REPLIES = (ev.PublishNamespaceAccepted, ev.SubscribeNamespaceAccepted, ev.RequestRejected, ev.RequestCancelled)
_PEER_REQUESTS = (ev.PublishNamespaceRequested, ev.SubscribeNamespaceRequested, ev.SubscribeRequested,
                  ev.TrackStatusRequested)


class MoqtApp:
    """What an endpoint serves; one instance may serve many connections. The defaults refuse every request of the
    peer with NOT_SUPPORTED (the drafts' advice for limited endpoints). Override :meth:`fetch` (it runs as a task
    per request; the connection cancels it when the session ends) and the others as needed."""

    def session_ready(self, conn: MoqtConnection) -> None:
        """SETUP is complete."""

    async def fetch(self, conn: MoqtConnection, request: ev.FetchRequested) -> None:
        conn.reject(request.request_id, not_supported_code(conn.draft), b"FETCH is not served here")

    def request(self, conn: MoqtConnection, request: ev.Event) -> None:
        """A request other than FETCH (SUBSCRIBE, PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, TRACK_STATUS, a draft 18
        REQUEST_UPDATE)."""
        rid = getattr(request, "request_id", None)
        if rid is not None:
            conn.reject(rid, not_supported_code(conn.draft), b"not served here")

    def event(self, conn: MoqtConnection, event: ev.Event) -> None:
        """Every other event (objects of subscriptions, GOAWAY, namespace replies, ...)."""

    def session_closed(self, conn: MoqtConnection) -> None:
        """The session is over."""


def not_supported_code(draft: Draft) -> int:
    return int(RequestErrorCode14.NOT_SUPPORTED if draft is Draft.D14 else RequestErrorCode18.NOT_SUPPORTED)


def internal_error_code(draft: Draft) -> int:
    return int(RequestErrorCode14.INTERNAL_ERROR if draft is Draft.D14 else RequestErrorCode18.INTERNAL_ERROR)


# -- the connection ---------------------------------------------------------------------------------------------


class MoqtConnection:
    """One MOQT session on one QUIC connection, either side. Create it once the handshake has chosen *alpn*."""

    def __init__(self, transport: QuicTransport, alpn: str, role: Role, *, config: SessionConfig | None = None,
                 tls: dict[str, Any] | None = None, app: MoqtApp | None = None, peer: tuple[str, int] | None = None,
                 send_buffer: int = TransportSettings.send_buffer,
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.transport = transport
        self.quic = transport.quic
        self.alpn = alpn
        self.draft = Draft.from_alpn(alpn)
        self.role = role
        self.session = MoqtSession.for_alpn(alpn, role, config)
        self.tls: dict[str, Any] = tls or {}
        chain = self.tls.get("client_cert_chain") or []
        self.peer_identity: str | None = identity_of_pem(chain[0]) if chain else None
        """The peer's verified identity (the single SAN URI of its certificate), or None."""
        self.peer = peer
        self.app = app or MoqtApp()
        self.send_buffer = send_buffer
        self.setup: ev.SetupCompleted | None = None
        self.closed: ev.SessionClosed | None = None
        self.goaway: ev.GoawayReceived | None = None
        self._on_close = on_close
        self._changed = asyncio.Event()
        self._fetches: dict[int, FetchStream] = {}  # our fetches by request id
        self._fetch_streams: dict[int, FetchStream] = {}  # ... by data stream id
        self._served: dict[int, ServedFetch] = {}  # fetches we serve, by request id
        self._served_streams: dict[int, ServedFetch] = {}  # ... by data stream id
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._replies: dict[int, asyncio.Future[ev.Event]] = {}  # awaited replies to our other requests
        self._ended_uni: set[int] = set()  # peer unidirectional streams that ended but still hold unread octets

    def __repr__(self) -> str:
        return f"<MoqtConnection {self.role.value} {self.alpn} peer={self.peer_identity or self.peer}>"

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.session.start()
        self.flush()

    async def ready(self, timeout: float | None = None) -> ev.SetupCompleted:
        """Wait for the SETUP exchange; MoqtSessionClosed if the session ends first."""
        async with asyncio.timeout(timeout):
            while self.setup is None:
                if self.closed is not None:
                    raise MoqtSessionClosed(self.closed.error_code, self.closed.reason)
                self._changed.clear()
                await self._changed.wait()
        return self.setup

    def close(self, error_code: int = SessionErrorCode.NO_ERROR, reason: str = "") -> None:
        """Close the session and its QUIC connection (CONNECTION_CLOSE with *error_code*)."""
        if self.closed is None:
            self.session.close(error_code, reason)
            self.flush()
            self._on_closed(ev.SessionClosed(int(error_code), reason, local=True))

    async def aclose(self) -> None:
        self.close()
        if self._on_close is not None:
            await self._on_close()

    async def drain(self) -> None:
        """Resolve when no request of the peer is being served."""
        await self._idle.wait()

    # -- requests we make -----------------------------------------------------------------------------------------

    def fetch(self, namespace: Namespace, track_name: bytes, start: Location, end: Location, *,
              subscriber_priority: int = 128, group_order: GroupOrder = GroupOrder.ASCENDING,
              stall_timeout: float | None = None, sink: FetchSink | None = None) -> FetchStream:
        """Send a standalone FETCH (End Location: the last object plus one; object 0 = the whole group). The
        returned stream yields its objects; *stall_timeout* bounds each wait for the next piece. With *sink*, the
        reply and the pieces go to it as they are dispatched instead (nothing to read from the stream)."""
        if self.closed is not None:
            raise MoqtSessionClosed(self.closed.error_code, self.closed.reason)
        rid = self.session.fetch(namespace, track_name, start, end, subscriber_priority=subscriber_priority,
                                 group_order=group_order)
        stream = FetchStream(self, rid, stall_timeout, sink)
        self._fetches[rid] = stream
        self.flush()
        return stream

    def joining_fetch(self, subscription_request_id: int, start: int, *, absolute: bool = False,
                      group_order: GroupOrder = GroupOrder.ASCENDING, stall_timeout: float | None = None,
                      sink: FetchSink | None = None) -> FetchStream:
        """A joining FETCH for one of our subscriptions (*start* groups before its largest, or from group *start*
        when *absolute*); like :meth:`fetch` otherwise."""
        if self.closed is not None:
            raise MoqtSessionClosed(self.closed.error_code, self.closed.reason)
        rid = self.session.joining_fetch(subscription_request_id, start, absolute=absolute, group_order=group_order)
        stream = FetchStream(self, rid, stall_timeout, sink)
        self._fetches[rid] = stream
        self.flush()
        return stream

    # -- answering the peer ----------------------------------------------------------------------------------------

    def accept_fetch(self, request_id: int, end_location: Location | None, *,
                     end_of_track: bool = False) -> ServedFetch:
        """FETCH_OK and the fetch's data stream. FetchCancelled if the peer cancelled the fetch meanwhile.
        *end_location* None defers FETCH_OK (objects first; :meth:`ServedFetch.send_ok` or :meth:`reject` later)."""
        try:
            writer = self.session.accept_fetch(request_id, end_location, end_of_track=end_of_track)
        except MoqtUsageError as exc:
            if self.closed is not None:
                raise MoqtSessionClosed(self.closed.error_code, self.closed.reason) from None
            raise FetchCancelled(str(exc)) from None
        served = ServedFetch(self, request_id, writer)
        self._served[request_id] = served
        self._served_streams[writer.stream_id] = served
        self.flush()
        return served

    def reject(self, request_id: int, error_code: int, reason: bytes = b"") -> bool:
        """Refuse a request of the peer with the draft's code; False when it is no longer pending (cancelled,
        session closed)."""
        try:
            self.session.reject(request_id, error_code, reason)
        except MoqtUsageError:
            return False
        served = self._served.get(request_id)  # accepted without FETCH_OK: its data stream was reset
        if served is not None:
            self._forget_served(served)
        self.flush()
        return True

    # -- other requests we make ------------------------------------------------------------------------------------

    async def publish_namespace(self, namespace: Namespace, *, timeout: float | None = 10.0) -> int:
        """PUBLISH_NAMESPACE; returns its request id once the peer accepted it (withdraw it with
        :meth:`publish_namespace_done`). MoqtRequestError when refused, MoqtStalled without an answer."""
        if self.closed is not None:
            raise MoqtSessionClosed(self.closed.error_code, self.closed.reason)
        rid = self.session.publish_namespace(namespace)
        await self._await_reply(rid, timeout)
        return rid

    def publish_namespace_done(self, request_id: int) -> None:
        if self.closed is None:
            with contextlib.suppress(MoqtUsageError):
                self.session.publish_namespace_done(request_id)
            self.flush()

    async def subscribe_namespace(self, prefix: Namespace, *, timeout: float | None = 10.0) -> int:
        """SUBSCRIBE_NAMESPACE; returns its request id once accepted (matches then reach ``MoqtApp.event`` /
        ``request``: draft 14 PUBLISH_NAMESPACE, draft 18 NamespaceReceived)."""
        if self.closed is not None:
            raise MoqtSessionClosed(self.closed.error_code, self.closed.reason)
        rid = self.session.subscribe_namespace(prefix)
        await self._await_reply(rid, timeout)
        return rid

    async def _await_reply(self, rid: int, timeout: float | None) -> ev.Event:
        future: asyncio.Future[ev.Event] = asyncio.get_running_loop().create_future()
        self._replies[rid] = future
        self.flush()
        try:
            async with asyncio.timeout(timeout):
                reply = await future
        except TimeoutError:
            raise MoqtStalled(f"request {rid}: no answer within {timeout} s") from None
        finally:
            self._replies.pop(rid, None)
        if isinstance(reply, ev.RequestRejected):
            raise MoqtRequestError(rid, reply.error_code, reply.reason)
        if isinstance(reply, ev.RequestCancelled):
            raise MoqtRequestError(rid, reply.error_code, cancelled=True)
        return reply

    # -- the transport side -----------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Execute the session's actions on the QUIC connection."""
        actions = self.session.take_actions()
        if not actions:
            return
        quic = self.quic
        for action in actions:
            try:
                if isinstance(action, SendStreamData):
                    quic.send_stream_data(action.stream_id, cast(bytes, action.data), action.fin)
                elif isinstance(action, ResetStream):
                    quic.reset_stream(action.stream_id, action.error_code)
                elif isinstance(action, StopSending):
                    quic.stop_stream(action.stream_id, action.error_code)
                elif isinstance(action, SendDatagram):
                    quic.send_datagram_frame(action.data)
                elif isinstance(action, CloseSession):
                    quic.close(error_code=action.error_code, reason_phrase=action.reason)
                # OpenStream: a QUIC stream opens with its first frame
            except (ValueError, RuntimeError, AssertionError) as exc:  # a stream the peer already ended
                log.debug("%r: %s failed: %s", self, type(action).__name__, exc)
        self.transport.transmit_soon()

    def _peer_uni(self, stream_id: int) -> bool:
        return bool(stream_id & 2) and bool(stream_id & 1) == (self.role is Role.CLIENT)

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        ended: int | None = None  # a peer unidirectional stream that ends here
        if isinstance(event, qe.StreamDataReceived):
            out = self.session.receive_stream_data(event.stream_id, event.data, event.end_stream)
            if event.end_stream and self._peer_uni(event.stream_id):
                ended = event.stream_id
        elif isinstance(event, qe.StreamReset):
            out = self.session.receive_stream_reset(event.stream_id, event.error_code)
            if self._peer_uni(event.stream_id):
                ended = event.stream_id
        elif isinstance(event, qe.StopSendingReceived):
            out = self.session.receive_stop_sending(event.stream_id, event.error_code)
        elif isinstance(event, qe.DatagramFrameReceived):
            out = self.session.receive_datagram(event.data)
        elif isinstance(event, qe.ConnectionTerminated):
            self.connection_terminated(event.error_code, event.reason_phrase)
            return
        else:
            return
        self._dispatch(out)  # holds the payload octets handed to fetches
        if ended is not None:
            self._uni_ended(ended)
        self.flush()

    def connection_terminated(self, error_code: int | None = None, reason: str | None = None) -> None:
        if error_code is None:
            close = getattr(self.quic, "_close_event", None)
            error_code = getattr(close, "error_code", 0) or 0
            reason = getattr(close, "reason_phrase", "") or ""
        self._dispatch(self.session.connection_lost(error_code, reason or ""))
        if self.closed is None:
            self._on_closed(ev.SessionClosed(error_code, reason or "", local=False))

    # -- flow control ---------------------------------------------------------------------------------------------

    def _release(self, stream_id: int, n: int) -> None:
        if self.quic.release(stream_id, n):
            self.transport.transmit_soon()
        if stream_id in self._ended_uni:
            self._uni_check(stream_id)

    def _uni_ended(self, stream_id: int) -> None:
        self._ended_uni.add(stream_id)
        self._uni_check(stream_id)

    def _uni_check(self, stream_id: int) -> None:
        if self.quic._kvsp_unread.get(stream_id, 0) == 0:
            self._ended_uni.discard(stream_id)
            if isinstance(self.quic, MoqtQuicConnection):
                self.quic.moqt_stream_done()
                self.transport.transmit_soon()  # MAX_STREAMS may be due

    # -- events ---------------------------------------------------------------------------------------------------

    def _dispatch(self, events: list[ev.Event]) -> None:
        for event in events:
            try:
                self._dispatch_one(event)
            except Exception:  # an application callback failed: the session goes on
                log.exception("%r: handling %s failed", self, type(event).__name__)

    def _dispatch_one(self, event: ev.Event) -> None:
        fetch: FetchStream | None
        if isinstance(event, ev.ObjectReceived):
            fetch = self._fetches.get(event.request_id) if event.request_id is not None else None
            if fetch is not None and event.stream_id is not None:
                if fetch._on_piece(event) and event.data:
                    self.quic.hold(event.stream_id, len(event.data))
            else:
                self.app.event(self, event)
        elif isinstance(event, ev.DataStreamOpened):
            fetch = self._fetches.get(event.request_id) if event.fetch and event.request_id is not None else None
            if fetch is not None:
                fetch.stream_id = event.stream_id
                self._fetch_streams[event.stream_id] = fetch
            else:
                self.app.event(self, event)
        elif isinstance(event, ev.StreamEnded):
            fetch = self._fetch_streams.pop(event.stream_id, None)
            if fetch is not None:
                fetch._on_end()
            else:
                self.app.event(self, event)
        elif isinstance(event, ev.StreamReset):
            fetch = self._fetch_streams.pop(event.stream_id, None)
            if fetch is not None:
                fetch._fail(MoqtStreamError(f"fetch {fetch.request_id}: the peer reset its data stream "
                                            f"(code 0x{event.error_code:x})"))
            else:
                self.app.event(self, event)
        elif isinstance(event, ev.FetchRangeEnded):
            fetch = self._fetches.get(event.request_id)
            if fetch is not None:
                fetch.range_ends.append(event)
        elif isinstance(event, ev.FetchAccepted):
            fetch = self._fetches.get(event.request_id)
            if fetch is not None:
                fetch._on_accepted(event)
        elif isinstance(event, _REPLIES) and event.request_id in self._replies:
            self._reply(event.request_id, event)
        elif isinstance(event, ev.RequestRejected | ev.RequestCancelled):
            fetch = self._fetches.get(event.request_id)
            if fetch is not None:
                if isinstance(event, ev.RequestRejected):
                    fetch._fail(MoqtRequestError(event.request_id, event.error_code, event.reason))
                else:
                    fetch._fail(MoqtRequestError(event.request_id, event.error_code, cancelled=True))
            else:
                self.app.event(self, event)
        elif isinstance(event, ev.FetchRequested):
            self._spawn(self.app.fetch(self, event))
        elif isinstance(event, ev.FetchCancelled):
            served = self._served.get(event.request_id)
            if served is not None:
                served._on_cancel()
                self._forget_served(served)
        elif isinstance(event, ev.StreamStopped):
            served = self._served_streams.get(event.stream_id)
            if served is not None:
                served._on_cancel()
                self._forget_served(served)
            else:
                self.app.event(self, event)
        elif isinstance(event, _PEER_REQUESTS) or (isinstance(event, ev.UpdateRequested) and event.reply_required):
            self.app.request(self, event)
        elif isinstance(event, ev.SetupCompleted):
            self.setup = event
            self._changed.set()
            self.app.session_ready(self)
        elif isinstance(event, ev.SessionClosed):
            self._on_closed(event)
        elif isinstance(event, ev.GoawayReceived):
            self.goaway = event
            self.app.event(self, event)
        else:
            self.app.event(self, event)

    def _reply(self, request_id: int, event: ev.Event) -> None:
        future = self._replies.pop(request_id)
        if not future.done():
            future.set_result(event)

    def _on_closed(self, event: ev.SessionClosed) -> None:
        if self.closed is not None:
            return
        self.closed = event
        self._changed.set()
        error = MoqtSessionClosed(event.error_code, event.reason)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(error)
        self._replies.clear()
        for fetch in list(self._fetches.values()):
            fetch._fail(error)
        for served in list(self._served.values()):
            served.cancelled = True
        for task in list(self._tasks):
            task.cancel()
        try:
            self.app.session_closed(self)
        except Exception:
            log.exception("%r: session_closed failed", self)

    def _forget_fetch(self, fetch: FetchStream) -> None:
        if self._fetches.get(fetch.request_id) is fetch:
            del self._fetches[fetch.request_id]
        if fetch.stream_id is not None and self._fetch_streams.get(fetch.stream_id) is fetch:
            del self._fetch_streams[fetch.stream_id]

    def _forget_served(self, served: ServedFetch) -> None:
        if self._served.get(served.request_id) is served:
            del self._served[served.request_id]
        if self._served_streams.get(served.stream_id) is served:
            del self._served_streams[served.stream_id]

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(self._guard(work))
        self._tasks.add(task)
        self._idle.clear()
        task.add_done_callback(self._task_done)

    async def _guard(self, work: Awaitable[None]) -> None:
        try:
            await work
        except (FetchCancelled, MoqtSessionClosed, ConnectionError) as exc:
            log.debug("%r: %s", self, exc)
        except Exception:
            log.exception("%r: serving a request failed", self)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not self._tasks:
            self._idle.set()


# -- server side: QuicListener handlers ------------------------------------------------------------------------


class MoqtServerHandler:
    """A :class:`quic.listener.ConnectionHandler` for one MOQT connection."""

    def __init__(self, ctx: QuicConnectionContext, app: MoqtApp, config: SessionConfig | None = None, *,
                 data_streams: int | None = None) -> None:
        respect_peer_udp_payload(ctx.quic)
        if data_streams is not None:  # a relay: the peer's data streams (our upstream fetches) are budgeted
            MoqtQuicConnection.budget(ctx.quic, data_streams + 1)
        self.conn = MoqtConnection(ctx.protocol, ctx.alpn, Role.SERVER, config=config, tls=ctx.tls, app=app,
                                   peer=ctx.client, send_buffer=ctx.settings.send_buffer)
        self.conn.start()

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        self.conn.quic_event_received(event)

    def connection_terminated(self) -> None:
        self.conn.connection_terminated()

    async def drain(self) -> None:
        await self.conn.drain()


def moqt_handlers(app: MoqtApp, *, config: SessionConfig | None = None, alpns: Sequence[str] = ALPNS,
                  data_streams: int | None = None) -> dict[str, HandlerFactory]:
    """Handler factories for :class:`~quic.listener.QuicListener` / ``RoleServer(quic_handlers=...)``: every
    MOQT connection gets a session of its ALPN's draft, served by *app*. *data_streams*: for a server that also
    fetches on accepted connections (a relay), the peer data streams admitted at once beyond the handshake's
    grant (see :meth:`MoqtQuicConnection.budget`)."""
    for alpn in alpns:
        Draft.from_alpn(alpn)
    if data_streams is not None and data_streams < 1:
        raise ValueError("data_streams must be at least 1")

    def factory(ctx: QuicConnectionContext) -> MoqtServerHandler:
        return MoqtServerHandler(ctx, app, config, data_streams=data_streams)

    return {alpn: factory for alpn in alpns}


# -- client side ------------------------------------------------------------------------------------------------


class _ClientProtocol(KvspQuicProtocol):
    def __init__(self, quic: MoqtQuicConnection, *, settings: TransportSettings,
                 make: Callable[[_ClientProtocol, str], MoqtConnection], **kwargs: Any) -> None:
        super().__init__(quic, settings=settings, **kwargs)
        self._make = make
        self.conn: MoqtConnection | None = None

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        super().quic_event_received(event)
        if isinstance(event, qe.HandshakeCompleted):
            respect_peer_udp_payload(self.quic)
            try:
                self.conn = self._make(self, event.alpn_protocol or "")
            except ValueError as exc:  # not a MOQT ALPN: cannot happen with the ALPNs we offer
                self._quic.close(error_code=0x178, reason_phrase=str(exc))
                return
            self.conn.start()
        elif isinstance(event, qe.ConnectionTerminated):
            if self.conn is not None:
                self.conn.connection_terminated(event.error_code, event.reason_phrase)
        elif self.conn is not None:
            self.conn.quic_event_received(event)

    async def application_ready(self) -> None:
        conn = self.conn
        assert conn is not None
        await conn.ready()

    def failure_reason(self, exc: BaseException, timeout: float) -> str:
        return str(exc) if isinstance(exc, MoqtSessionClosed) else super().failure_reason(exc, timeout)


async def connect_moqt(host: str, port: int, files: TlsFiles, *, settings: TransportSettings = TransportSettings(),
                       alpn: str | Sequence[str] = ALPNS, server_name: str | None = None, timeout: float = 10.0,
                       config: SessionConfig | None = None, app: MoqtApp | None = None,
                       data_streams: int = DEFAULT_DATA_STREAMS, path: bytes = b"/") -> MoqtConnection:
    """A client MOQT session to *host*:*port* with mutual TLS, offering *alpn* (both drafts by default; the server
    picks). Returns once HANDSHAKE_DONE has arrived (the server accepted our certificate) and SETUP is complete;
    raises :class:`MoqtConnectError` otherwise (the server offers no MOQT ALPN, refuses the certificate, does not
    answer within *timeout*). *data_streams*: peer data streams admitted at once (see the module docstring)."""
    alpns = [alpn] if isinstance(alpn, str) else list(alpn)
    if not alpns:
        raise ValueError("offer at least one MOQT ALPN")
    for name in alpns:
        Draft.from_alpn(name)
    if data_streams < 1:
        raise ValueError("data_streams must be at least 1")
    window = max(settings.connection_window, (data_streams + 1) * settings.stream_window + CONTROL_RESERVE)
    tuned = dataclasses.replace(settings, connection_window=window)
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    session_config = config or SessionConfig(path=path, authority=authority.encode("ascii"))

    def make(protocol: _ClientProtocol, negotiated: str) -> MoqtConnection:
        tls = tls_extension(protocol.quic.peer_chain_der, server_cert_pem=None, tls_version=TLS_1_3,
                            cipher_suite=None)
        return MoqtConnection(protocol, negotiated, Role.CLIENT, config=session_config, tls=tls, app=app,
                              peer=(host, port), send_buffer=tuned.send_buffer, on_close=protocol.aclose)

    protocol = await connect_quic(
        host, port, files, alpn=alpns, settings=tuned, server_name=server_name, timeout=timeout,
        protocol_factory=functools.partial(_ClientProtocol, make=make),
        quic_factory=functools.partial(MoqtQuicConnection, uni_streams=data_streams + 1),
        error=lambda reason: MoqtConnectError(f"MOQT to {host}:{port} ({', '.join(alpns)}) failed: {reason}"))
    assert protocol.conn is not None
    return protocol.conn


class MoqtPool:
    """Client MOQT connections by ``moqt://host:port/``, shared by concurrent fetches; a closed one is replaced."""

    def __init__(self, files: TlsFiles, *, settings: TransportSettings = TransportSettings(),
                 alpn: str | Sequence[str] = ALPNS, connect_timeout: float = 10.0,
                 data_streams: int = DEFAULT_DATA_STREAMS) -> None:
        self.files = files
        self.settings = settings
        self.alpn = alpn
        self.connect_timeout = connect_timeout
        self.data_streams = data_streams
        self._conns: dict[tuple[str, int], MoqtConnection] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}

    async def get(self, uri: str) -> MoqtConnection:
        parts = urlsplit(uri)
        if parts.scheme != "moqt" or parts.hostname is None or parts.port is None:
            raise ValueError(f"{uri!r} is not a moqt://host:port/ URI")
        key = (parts.hostname, parts.port)
        async with self._locks.setdefault(key, asyncio.Lock()):
            conn = self._conns.get(key)
            if conn is not None and conn.closed is None and conn.goaway is None:
                return conn
            if conn is not None:
                del self._conns[key]
                await conn.aclose()
            conn = await connect_moqt(key[0], key[1], self.files, settings=self.settings, alpn=self.alpn,
                                      timeout=self.connect_timeout, data_streams=self.data_streams)
            self._conns[key] = conn
            return conn

    async def aclose(self) -> None:
        conns = list(self._conns.values())
        self._conns.clear()
        await asyncio.gather(*(c.aclose() for c in conns), return_exceptions=True)

    async def __aenter__(self) -> MoqtPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = [
    "CONTROL_RESERVE", "FetchCancelled", "FetchSink", "FetchStream", "MoqtApp", "MoqtConnectError", "MoqtConnection",
    "MoqtObject", "MoqtPool", "MoqtQuicConnection", "MoqtRequestError", "MoqtServerHandler", "MoqtSessionClosed",
    "MoqtStalled", "MoqtStreamError", "ServedFetch", "connect_moqt", "internal_error_code", "moqt_handlers",
    "not_supported_code", "respect_peer_udp_payload",
]
