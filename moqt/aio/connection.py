"""One MOQT session on one aioquic connection: :class:`MoqtConnection`, either side.

It executes the session's actions on the QUIC connection (stream ids pass through unchanged: the session numbers
its streams as QUIC does), feeds stream data, resets, STOP_SENDING, datagrams and the connection's end into the
session, and routes the events through a table (:data:`_HANDLERS`, one handler per event type): replies and
objects to the :class:`~moqt.aio.fetches.FetchStream` of our request, the peer's requests to the
:class:`MoqtApp`, everything else to ``MoqtApp.event``. Flow control: see :mod:`moqt.aio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

from aioquic.quic import events as qe

from moqt import events as ev
from moqt.actions import CloseSession, ResetStream, SendDatagram, SendStreamData, StopSending
from moqt.aio.audit import AUDIT
from moqt.aio.errors import FetchCancelled, MoqtRequestError, MoqtSessionClosed, MoqtStalled, MoqtStreamError
from moqt.aio.fetches import FetchSink, FetchStream, ServedFetch
from moqt.aio.revocation import track
from moqt.errors import MoqtUsageError, RequestErrorCode14, RequestErrorCode18, SessionErrorCode
from moqt.requests import Role, SessionConfig
from moqt.sessions import session_for_alpn
from moqt.types import Draft, GroupOrder, Location, Namespace
from quic.connection import KvspQuicConnection
from quic.tls import TransportSettings, identity_of_pem

log = logging.getLogger("kvsp.moqt")


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

    def recheck(self, conn: MoqtConnection) -> str | None:
        """After a reload of the policy (:mod:`moqt.aio.revocation`): why *conn*'s peer may no longer be served
        (the session is then closed with UNAUTHORIZED), or None. The default keeps every session."""
        return None

    def session_revoked(self, conn: MoqtConnection, reason: str) -> None:
        """*conn* was closed after a reload (a revoked certificate, or :meth:`recheck`'s *reason*)."""


def not_supported_code(draft: Draft) -> int:
    return int(RequestErrorCode14.NOT_SUPPORTED if draft is Draft.D14 else RequestErrorCode18.NOT_SUPPORTED)


def internal_error_code(draft: Draft) -> int:
    return int(RequestErrorCode14.INTERNAL_ERROR if draft is Draft.D14 else RequestErrorCode18.INTERNAL_ERROR)


class QuicTransport(Protocol):
    """What the connection needs from the QUIC side (:class:`quic.protocol.KvspQuicProtocol`)."""

    peer_unreachable: bool  # ICMP port unreachable ended the QUIC connection: nothing listens at the peer's port

    @property
    def quic(self) -> KvspQuicConnection: ...

    def transmit_soon(self) -> None: ...

    async def wait_writable(self, stream_id: int) -> None: ...



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
        self.session = session_for_alpn(alpn, role, config)
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
        track(self)  # re-checked after a reload (moqt.aio.revocation)

    def __repr__(self) -> str:
        return f"<MoqtConnection {self.role.value} {self.alpn} peer={self.peer_identity or self.peer}>"

    @property
    def open_fetches(self) -> int:
        """Our fetches on this connection still under way: sent and neither closed, failed nor fully read (what
        :class:`~moqt.aio.MoqtPool` balances its connections by)."""
        return sum(1 for fetch in self._fetches.values() if not fetch.done)

    @property
    def usable(self) -> bool:
        """Takes new requests: the session is open and the peer has not sent GOAWAY."""
        return self.closed is None and self.goaway is None

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

    def recheck(self) -> str | None:
        """Why the peer may no longer be served after a reload of the policy (the app's :meth:`MoqtApp.recheck`;
        server side only: the policy judges the peers that connect to us, not those we connect to)."""
        return self.app.recheck(self) if self.closed is None and self.role is Role.SERVER else None

    def revoke(self, reason: str) -> None:
        """Close the session and its QUIC connection with UNAUTHORIZED (the peer's rights are gone: *reason*), and
        tell the app (:mod:`moqt.aio.revocation`)."""
        if self.closed is not None:
            return
        self.close(SessionErrorCode.UNAUTHORIZED, reason)
        try:
            self.app.session_revoked(self, reason)
        except Exception:
            log.exception("%r: session_revoked failed", self)

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

    def reject(self, request_id: int, error_code: int, reason: bytes = b"", *, retry_interval: int = 0) -> bool:
        """Refuse a request of the peer with the draft's code (draft 18: with *retry_interval*, milliseconds plus
        one; draft 14 has no such field); False when it is no longer pending (cancelled, session closed)."""
        try:
            self.session.reject(request_id, error_code, reason,
                                retry_interval=retry_interval if self.draft is Draft.D18 else 0)
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

    async def publish(self, namespace: Namespace, track_name: bytes, *, forward: bool = True,
                      timeout: float | None = 10.0) -> ev.PublishAccepted:
        """Draft 18 PUBLISH; returns PUBLISH_OK (``request_id``, ``forward``) once the peer accepted. Write the
        objects with ``session.open_subgroup(request_id, ...)``, end with ``session.publish_done``. MoqtRequestError
        when refused, MoqtStalled without an answer. (Objects may also be sent before the answer: use
        ``session.publish`` directly.)"""
        if self.closed is not None:
            raise MoqtSessionClosed(self.closed.error_code, self.closed.reason)
        rid = self.session.publish(namespace, track_name, forward=forward)  # MoqtUsageError on draft 14
        reply = await self._await_reply(rid, timeout)
        assert isinstance(reply, ev.PublishAccepted)
        return reply

    async def subscribe_tracks(self, prefix: Namespace, *, forward: bool = True, timeout: float | None = 10.0) -> int:
        """Draft 18 SUBSCRIBE_TRACKS; returns its request id once accepted (the peer's PUBLISHes then reach
        ``MoqtApp.request`` as ``PublishRequested``)."""
        if self.closed is not None:
            raise MoqtSessionClosed(self.closed.error_code, self.closed.reason)
        rid = self.session.subscribe_tracks(prefix, forward=forward)  # MoqtUsageError on draft 14
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
            raise MoqtRequestError(rid, reply.error_code, reply.reason, retry_interval=reply.retry_interval)
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
        if self.quic.unread(stream_id) == 0:
            self._ended_uni.discard(stream_id)
            if self.quic.uni_stream_done():
                self.transport.transmit_soon()  # MAX_STREAMS may be due

    # -- events ---------------------------------------------------------------------------------------------------

    def _dispatch(self, events: list[ev.Event]) -> None:
        for event in events:
            try:
                self._dispatch_one(event)
            except Exception:  # an application callback failed: the session goes on
                log.exception("%r: handling %s failed", self, type(event).__name__)

    def _dispatch_one(self, event: ev.Event) -> None:
        handler = _HANDLERS.get(type(event))
        if handler is None:
            self.app.event(self, event)
        else:
            handler(self, event)

    # One handler per event type (the table :data:`_HANDLERS` below); what none takes goes to ``MoqtApp.event``.

    def _on_object(self, event: ev.ObjectReceived) -> None:
        fetch = self._fetches.get(event.request_id) if event.request_id is not None else None
        if fetch is not None and event.stream_id is not None:
            if fetch._on_piece(event) and event.data:
                self.quic.hold(event.stream_id, len(event.data))
        else:
            self.app.event(self, event)

    def _on_data_stream(self, event: ev.DataStreamOpened) -> None:
        fetch = self._fetches.get(event.request_id) if event.fetch and event.request_id is not None else None
        if fetch is not None:
            fetch.stream_id = event.stream_id
            self._fetch_streams[event.stream_id] = fetch
        else:
            self.app.event(self, event)

    def _on_stream_ended(self, event: ev.StreamEnded) -> None:
        fetch = self._fetch_streams.pop(event.stream_id, None)
        if fetch is not None:
            fetch._on_end()
        else:
            self.app.event(self, event)

    def _on_stream_reset(self, event: ev.StreamReset) -> None:
        fetch = self._fetch_streams.pop(event.stream_id, None)
        if fetch is not None:
            fetch._fail(MoqtStreamError(f"fetch {fetch.request_id}: the peer reset its data stream "
                                        f"(code 0x{event.error_code:x})"))
        else:
            self.app.event(self, event)

    def _on_range_ended(self, event: ev.FetchRangeEnded) -> None:
        fetch = self._fetches.get(event.request_id)
        if fetch is not None:
            fetch.range_ends.append(event)

    def _on_fetch_accepted(self, event: ev.FetchAccepted) -> None:
        fetch = self._fetches.get(event.request_id)
        if fetch is not None:
            fetch._on_accepted(event)

    def _on_namespace_reply(self, event: ev.PublishNamespaceAccepted | ev.SubscribeNamespaceAccepted
                            | ev.PublishAccepted | ev.SubscribeTracksAccepted) -> None:
        if event.request_id in self._replies:
            self._reply(event.request_id, event)
        else:
            self.app.event(self, event)

    def _on_refusal(self, event: ev.RequestRejected | ev.RequestCancelled) -> None:
        if event.request_id in self._replies:
            self._reply(event.request_id, event)
            return
        fetch = self._fetches.get(event.request_id)
        if fetch is None:
            self.app.event(self, event)
        elif isinstance(event, ev.RequestRejected):
            fetch._fail(MoqtRequestError(event.request_id, event.error_code, event.reason,
                                         retry_interval=event.retry_interval))
        else:
            fetch._fail(MoqtRequestError(event.request_id, event.error_code, cancelled=True))

    def _on_fetch_requested(self, event: ev.FetchRequested) -> None:
        self._spawn(self.app.fetch(self, event))

    def _on_fetch_cancelled(self, event: ev.FetchCancelled) -> None:
        served = self._served.get(event.request_id)
        if served is not None:
            served._on_cancel()
            self._forget_served(served)

    def _on_stream_stopped(self, event: ev.StreamStopped) -> None:
        served = self._served_streams.get(event.stream_id)
        if served is not None:
            served._on_cancel()
            self._forget_served(served)
        else:
            self.app.event(self, event)

    def _on_peer_request(self, event: ev.Event) -> None:
        self.app.request(self, event)

    def _on_update(self, event: ev.UpdateRequested) -> None:
        if event.reply_required:
            self.app.request(self, event)
        else:
            self.app.event(self, event)

    def _on_setup(self, event: ev.SetupCompleted) -> None:
        self.setup = event
        self._changed.set()
        self.app.session_ready(self)

    def _on_goaway(self, event: ev.GoawayReceived) -> None:
        self.goaway = event
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
        AUDIT.session_closed(local=event.local, error_code=event.error_code, reason=event.reason, alpn=self.alpn,
                             peer=self.peer, identity=self.peer_identity, role=self.role.value)
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


_HANDLERS: dict[type, Callable[[MoqtConnection, Any], None]] = {
    ev.ObjectReceived: MoqtConnection._on_object,
    ev.DataStreamOpened: MoqtConnection._on_data_stream,
    ev.StreamEnded: MoqtConnection._on_stream_ended,
    ev.StreamReset: MoqtConnection._on_stream_reset,
    ev.FetchRangeEnded: MoqtConnection._on_range_ended,
    ev.FetchAccepted: MoqtConnection._on_fetch_accepted,
    ev.PublishNamespaceAccepted: MoqtConnection._on_namespace_reply,
    ev.SubscribeNamespaceAccepted: MoqtConnection._on_namespace_reply,
    ev.PublishAccepted: MoqtConnection._on_namespace_reply,
    ev.SubscribeTracksAccepted: MoqtConnection._on_namespace_reply,
    ev.RequestRejected: MoqtConnection._on_refusal,
    ev.RequestCancelled: MoqtConnection._on_refusal,
    ev.FetchRequested: MoqtConnection._on_fetch_requested,
    ev.FetchCancelled: MoqtConnection._on_fetch_cancelled,
    ev.StreamStopped: MoqtConnection._on_stream_stopped,
    ev.PublishNamespaceRequested: MoqtConnection._on_peer_request,
    ev.SubscribeNamespaceRequested: MoqtConnection._on_peer_request,
    ev.SubscribeRequested: MoqtConnection._on_peer_request,
    ev.TrackStatusRequested: MoqtConnection._on_peer_request,
    ev.PublishRequested: MoqtConnection._on_peer_request,
    ev.SubscribeTracksRequested: MoqtConnection._on_peer_request,
    ev.UpdateRequested: MoqtConnection._on_update,
    ev.SetupCompleted: MoqtConnection._on_setup,
    ev.SessionClosed: MoqtConnection._on_closed,
    ev.GoawayReceived: MoqtConnection._on_goaway,
}
"""How :meth:`MoqtConnection._dispatch_one` routes each event type; others go to ``MoqtApp.event``."""


__all__ = ["MoqtApp", "MoqtConnection", "QuicTransport", "internal_error_code", "not_supported_code"]
