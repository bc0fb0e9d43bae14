"""The MOQT session state machine, sans I/O: what both drafts share.

One session object plays every role a connection needs: client or server (who opened the QUIC connection), and
publisher and subscriber at once (a relay needs both). It consumes stream octets, stream resets and datagrams and
returns :mod:`~moqt.events`; what it wants sent accumulates as :mod:`~moqt.actions`, drained with ``take_actions()``.
A protocol error never escapes as an exception: the session queues ``CloseSession`` with the draft's termination
code and returns ``SessionClosed``. API misuse raises :class:`~moqt.errors.MoqtUsageError`.

Draft specifics live in :mod:`moqt.session14` (one bidirectional control stream, request-id flow control, one
message per request kind) and :mod:`moqt.session18` (a pair of unidirectional control streams, one bidirectional
stream per request, cancellation by stream reset). Create a session with ``MoqtSession.create(draft, role)`` or
``MoqtSession.for_alpn(alpn, role)``.
"""

from __future__ import annotations

from moqt.actions import Action, CloseSession, OpenStream, ResetStream, SendDatagram, SendStreamData, StopSending
from moqt.data import (
    FetchObjectEncoder,
    ObjectDatagram,
    SubgroupHeader,
    SubgroupObjectEncoder,
    decode_datagram,
    encode_fetch_header,
)
from moqt.dataparser import DataStreamParser
from moqt.errors import MoqtError, MoqtUsageError, SessionErrorCode, StreamResetCode, protocol_violation
from moqt.events import (
    DataStreamOpened,
    Event,
    ObjectReceived,
    SessionClosed,
    SetupCompleted,
    StreamReset,
    StreamStopped,
)
from moqt.messages18 import Redirect
from moqt.publish_api import PublishingApi
from moqt.requests import Kind, Request, Role, RState, SessionConfig
from moqt.types import (
    AliasType,
    AuthToken,
    Draft,
    FetchTarget,
    FilterType,
    GroupOrder,
    JoiningFetch,
    KeyValuePairs,
    Location,
    Namespace,
    ObjectStatus,
    StandaloneFetch,
    SubscriptionFilter,
    check_namespace,
)
from moqt.varint import NeedMore
from moqt.writers import FetchStreamWriter, StreamWriter, SubgroupWriter

__all__ = ["Kind", "MoqtSession", "RState", "Request", "Role", "SessionConfig"]


class MoqtSession(PublishingApi):
    """The draft-independent part of a session. Use :meth:`create` / :meth:`for_alpn`."""

    draft: Draft

    def __init__(self, role: Role, config: SessionConfig | None = None) -> None:
        self.role = role
        self.config = config or SessionConfig()
        self._actions: list[Action] = []
        self._events: list[Event] = []
        self.closed = False
        self.close_code: int | None = None
        self.setup: SetupCompleted | None = None
        self._started = False
        client = role is Role.CLIENT
        self._next_request_id = 0 if client else 1
        self._next_bidi = 0 if client else 1
        self._next_uni = 2 if client else 3
        self.requests: dict[int, Request] = {}  # both sides' (their parities differ)
        self._parsers: dict[int, DataStreamParser] = {}  # the peer's data streams
        self._ignored: set[int] = set()  # data streams we stopped reading
        self._buffered: dict[int, list[tuple[bytes, bool]]] = {}  # streams held until setup completes
        self._buffered_bytes = 0
        self._aliases_in: dict[int, int] = {}  # track alias -> our subscription's request id
        self._aliases_out: dict[int, int] = {}  # track alias we chose -> the peer's subscription's request id
        self._next_alias = 0
        self._writers: dict[int, StreamWriter] = {}  # our data streams
        self.goaway_received = False
        self.goaway_sent = False

    # -- Construction ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Queue the opening actions (control stream(s) and SETUP). Call once, after the handshake."""
        if self._started:
            raise MoqtUsageError("the session is already started")
        self._started = True
        self._start()

    def take_actions(self) -> list[Action]:
        out, self._actions = self._actions, []
        return out

    @property
    def setup_done(self) -> bool:
        return self.setup is not None

    # -- Inputs ----------------------------------------------------------------------------------------------

    def receive_stream_data(self, stream_id: int, data: bytes | bytearray | memoryview,
                            fin: bool = False) -> list[Event]:
        if not self.closed:
            try:
                self._on_stream_data(stream_id, data, fin)
            except MoqtError as exc:
                self._fail(exc)
        return self._take_events()

    def receive_stream_reset(self, stream_id: int, error_code: int) -> list[Event]:
        """The peer reset (RESET_STREAM) its sending side of *stream_id*."""
        if not self.closed:
            try:
                self._on_stream_reset(stream_id, error_code)
            except MoqtError as exc:
                self._fail(exc)
        return self._take_events()

    def receive_stop_sending(self, stream_id: int, error_code: int) -> list[Event]:
        """The peer asked us (STOP_SENDING) to stop sending on *stream_id*."""
        if not self.closed:
            try:
                self._on_stop_sending(stream_id, error_code)
            except MoqtError as exc:
                self._fail(exc)
        return self._take_events()

    def receive_datagram(self, data: bytes | memoryview) -> list[Event]:
        if not self.closed:
            try:
                self._on_datagram(data)
            except MoqtError as exc:
                self._fail(exc)
        return self._take_events()

    def connection_lost(self, error_code: int = 0, reason: str = "") -> list[Event]:
        """The transport closed (the peer's CONNECTION_CLOSE, idle timeout, ...)."""
        if not self.closed:
            self.closed = True
            self.close_code = error_code
            self._events.append(SessionClosed(error_code, reason, local=False))
        return self._take_events()

    def close(self, error_code: int = SessionErrorCode.NO_ERROR, reason: str = "") -> None:
        if not self.closed:
            self.closed = True
            self.close_code = int(error_code)
            self._actions.append(CloseSession(int(error_code), reason))

    def _take_events(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def _fail(self, exc: MoqtError) -> None:
        self.close(exc.code, exc.reason)
        self._events.append(SessionClosed(exc.code, exc.reason, local=True))

    # -- Stream bookkeeping ------------------------------------------------------------------------------------

    def _is_local(self, stream_id: int) -> bool:
        return bool(stream_id & 1) == (self.role is Role.SERVER)

    @staticmethod
    def _is_uni(stream_id: int) -> bool:
        return bool(stream_id & 2)

    def _open_stream(self, unidirectional: bool, priority: int = 128) -> int:
        if unidirectional:
            sid, self._next_uni = self._next_uni, self._next_uni + 4
        else:
            sid, self._next_bidi = self._next_bidi, self._next_bidi + 4
        self._actions.append(OpenStream(sid, unidirectional, priority))
        return sid

    def _send(self, stream_id: int, data: bytes | memoryview, fin: bool = False) -> None:
        if self.closed:
            raise MoqtUsageError("the session is closed")
        self._actions.append(SendStreamData(stream_id, data, fin))

    def _reset_stream(self, stream_id: int, error_code: int) -> None:
        if not self.closed:
            self._actions.append(ResetStream(stream_id, error_code))

    def _stop_sending(self, stream_id: int, error_code: int) -> None:
        if not self.closed:
            self._actions.append(StopSending(stream_id, error_code))

    def _hold(self, stream_id: int, data: bytes | bytearray | memoryview, fin: bool) -> None:
        """Keep a stream's octets until setup completes (bounded)."""
        self._buffered_bytes += len(data)
        if self._buffered_bytes > self.config.max_buffered:
            self._buffered.pop(stream_id, None)
            self._ignored.add(stream_id)
            self._stop_sending(stream_id, StreamResetCode.EXCESSIVE_LOAD)
            return
        self._buffered.setdefault(stream_id, []).append((bytes(data), fin))

    def _replay_held(self) -> None:
        held, self._buffered, self._buffered_bytes = self._buffered, {}, 0
        for sid, chunks in held.items():
            for data, fin in chunks:
                if self.closed:
                    return
                self._on_stream_data(sid, data, fin)

    # -- Data streams (both drafts) ----------------------------------------------------------------------------

    def _new_parser(self, stream_id: int) -> DataStreamParser:
        return DataStreamParser(
            self.draft, stream_id,
            resolve_alias=self._aliases_in.get,
            fetch_group_order=lambda rid: self.requests[rid].group_order if rid in self.requests
            else GroupOrder.ASCENDING,
            known_fetch=self._is_our_fetch,
            empty_fetch_status=self.config.fetch_empty_object_status)

    def _is_our_fetch(self, request_id: int) -> bool:
        """A FETCH_HEADER must name a fetch of ours (current, or already forgotten: objects may trail a
        FETCH_ERROR or a cancel)."""
        req = self.requests.get(request_id)
        if req is not None:
            return req.local and req.kind is Kind.FETCH
        return self._was_ours(request_id)

    def _was_ours(self, request_id: int) -> bool:
        """*request_id* is one we allocated (possibly for a request already forgotten)."""
        return request_id % 2 == self._next_request_id % 2 and request_id < self._next_request_id

    def _on_data_stream(self, stream_id: int, data: bytes | bytearray | memoryview, fin: bool) -> None:
        if stream_id in self._ignored:
            return
        parser = self._parsers.get(stream_id)
        if parser is None:
            parser = self._parsers[stream_id] = self._new_parser(stream_id)
        events = parser.feed(data, fin)
        if events and isinstance(events[0], DataStreamOpened) and parser.fetch:
            req = self.requests.get(events[0].request_id) if events[0].request_id is not None else None
            if req is None or req.state is RState.DONE:  # a fetch we cancelled (or that failed): discard
                self._ignored.add(stream_id)
                del self._parsers[stream_id]
                self._stop_sending(stream_id, StreamResetCode.CANCELLED)
                return
        self._events.extend(events)
        if fin:
            self._parsers.pop(stream_id, None)
            if parser.fetch and parser.request_id is not None:
                self._fetch_data_ended(parser.request_id)

    def _on_data_stream_reset(self, stream_id: int, error_code: int) -> None:
        parser = self._parsers.pop(stream_id, None)
        self._buffered.pop(stream_id, None)
        if parser is not None and stream_id not in self._ignored:
            self._events.append(StreamReset(stream_id, parser.request_id, error_code, parser.track_alias))
            if parser.fetch and parser.request_id is not None:
                self._fetch_data_ended(parser.request_id)

    def _fetch_data_ended(self, request_id: int) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            req.data_ended = True
            if req.replied:
                self._forget(req)

    def _forget(self, req: Request) -> None:
        """Drop a finished request's state (late messages naming it are recognized by its id and ignored)."""
        if self.requests.get(req.request_id) is not req:
            return
        del self.requests[req.request_id]
        req.state = RState.DONE
        if req.track_alias is not None:
            # our SUBSCRIBE and the peer's PUBLISH receive objects under the alias; the others send them
            aliases = self._aliases_in if req.local != (req.kind is Kind.PUBLISH) else self._aliases_out
            if aliases.get(req.track_alias) == req.request_id:
                del aliases[req.track_alias]
        self._forget_streams(req)

    def _forget_streams(self, req: Request) -> None:
        """Draft hook: release the request's stream state."""

    def _on_datagram(self, data: bytes | memoryview) -> None:
        if not self.config.datagrams:
            raise protocol_violation("a datagram, but the DATAGRAM extension was not negotiated")
        try:
            dg = decode_datagram(self.draft, data)
        except NeedMore:
            raise protocol_violation("truncated datagram") from None
        if dg is None:
            return  # padding
        status = dg.status if dg.status is not None else ObjectStatus.NORMAL
        self._events.append(ObjectReceived(
            None, self._aliases_in.get(dg.track_alias), dg.track_alias, dg.group, None, dg.object_id, dg.priority,
            status, dg.extensions, len(dg.payload), 0, dg.payload, dg.end_of_group))

    def _on_stop_sending(self, stream_id: int, error_code: int) -> None:
        writer = self._writers.get(stream_id)
        if writer is not None:
            writer.stopped = error_code
            self._events.append(StreamStopped(stream_id, writer.request_id, error_code))
            return
        self._on_request_stream_stopped(stream_id, error_code)

    # -- Request ids --------------------------------------------------------------------------------------------

    def _peer_parity(self) -> int:
        return 1 if self.role is Role.CLIENT else 0

    def _allocate_request_id(self) -> int:
        rid = self._next_request_id
        self._next_request_id += 2
        return rid

    def _new_request(self, kind: Kind, **kw: object) -> Request:
        self._check_can_request()
        req = Request(self._allocate_request_id(), kind, True, **kw)  # type: ignore[arg-type]
        self.requests[req.request_id] = req
        return req

    def _check_can_request(self) -> None:
        if self.closed:
            raise MoqtUsageError("the session is closed")
        if not self._started:
            raise MoqtUsageError("start() the session first")
        if self.goaway_received:
            raise MoqtUsageError("the peer sent GOAWAY: make new requests on a new session")

    def _own(self, request_id: int, *kinds: Kind) -> Request:
        req = self.requests.get(request_id)
        if req is None or not req.local or req.kind not in kinds:
            raise MoqtUsageError(f"request {request_id} is not one of our {'/'.join(k.value for k in kinds)}")
        return req

    def _theirs(self, request_id: int, *kinds: Kind, pending: bool | None = None) -> Request:
        """A request of the peer's, for the API (MoqtUsageError if it does not fit)."""
        if self.closed:
            raise MoqtUsageError("the session is closed")
        req = self.requests.get(request_id)
        if req is None or req.local or req.kind not in kinds:
            raise MoqtUsageError(f"request {request_id} is not a {'/'.join(k.value for k in kinds)} of the peer")
        if pending is True and (req.replied or req.state is RState.DONE):
            raise MoqtUsageError(f"request {request_id} was already answered")
        if pending is False and req.state is not RState.ACTIVE:
            raise MoqtUsageError(f"request {request_id} is not active")
        return req

    def _served(self, request_id: int) -> Request:
        """A subscription we serve objects on: the peer's accepted SUBSCRIBE (publishing sessions: our PUBLISH too)."""
        return self._theirs(request_id, Kind.SUBSCRIBE, pending=False)

    def _check_tokens(self, tokens: tuple[bytes, ...]) -> tuple[AuthToken, ...]:
        """Decode AUTHORIZATION TOKEN values. We advertise no token cache, so registering or using an alias is a
        session error (AUTH_TOKEN_CACHE_OVERFLOW / UNKNOWN_AUTH_TOKEN_ALIAS)."""
        out = []
        for raw in tokens:
            token = AuthToken.decode(raw, self.draft.vi64)
            if token.alias_type is AliasType.REGISTER:
                raise MoqtError(SessionErrorCode.AUTH_TOKEN_CACHE_OVERFLOW, "token alias registered without a cache")
            if token.alias_type in (AliasType.USE_ALIAS, AliasType.DELETE):
                raise MoqtError(SessionErrorCode.UNKNOWN_AUTH_TOKEN_ALIAS, f"token alias {token.alias} unknown")
            out.append(token)
        return tuple(out)

    def _bind_alias(self, alias: int, request_id: int) -> None:
        """SUBSCRIBE_OK gave *alias* to our subscription; another active one with it is DUPLICATE_TRACK_ALIAS."""
        other = self._aliases_in.get(alias)
        if other is not None and other != request_id and self.requests[other].state is not RState.DONE:
            raise MoqtError(SessionErrorCode.DUPLICATE_TRACK_ALIAS, f"track alias {alias} is already in use")
        self._aliases_in[alias] = request_id

    # -- Public API: requests we make ------------------------------------------------------------------------

    def subscribe(self, namespace: Namespace, track_name: bytes, *,
                  filter: SubscriptionFilter | None = None, subscriber_priority: int = 128,
                  group_order: GroupOrder = GroupOrder.PUBLISHER, forward: bool = True) -> int:
        """SUBSCRIBE; returns the request id (events: SubscribeAccepted / RequestRejected, then objects).
        Default filter: draft 14 Largest Object, draft 18 none (all objects)."""
        self._check_track(namespace, track_name)
        req = self._new_request(Kind.SUBSCRIBE, namespace=namespace, track_name=track_name, filter=filter,
                                forward=forward, group_order=group_order, priority=subscriber_priority)
        self._send_subscribe(req, subscriber_priority)
        return req.request_id

    def fetch(self, namespace: Namespace, track_name: bytes, start: Location, end: Location, *,
              subscriber_priority: int = 128, group_order: GroupOrder = GroupOrder.ASCENDING) -> int:
        """Standalone FETCH of *start* .. *end* (End Location: the last object plus one; object 0 = the whole
        group: ``Location(0, 0)`` .. ``Location(0, 0)`` fetches all of group 0). Returns the request id."""
        self._check_track(namespace, track_name)
        if end < start and end.object != 0:
            raise MoqtUsageError("the end location precedes the start")
        req = self._new_request(Kind.FETCH, namespace=namespace, track_name=track_name, start=start,
                                group_order=self._fetch_order(group_order))
        self._send_fetch(req, StandaloneFetch(namespace, track_name, start, end), subscriber_priority, group_order)
        return req.request_id

    def joining_fetch(self, subscription_request_id: int, start: int, *, absolute: bool = False,
                      subscriber_priority: int = 128, group_order: GroupOrder = GroupOrder.ASCENDING) -> int:
        """Joining FETCH for one of our subscriptions: *start* groups before its largest group (relative) or from
        group *start* (absolute)."""
        sub = self._own(subscription_request_id, Kind.SUBSCRIBE)
        if self.draft is Draft.D14 and (sub.filter is None or sub.filter.type is not FilterType.LARGEST_OBJECT):
            raise MoqtUsageError("draft 14 joins only subscriptions with a Largest Object filter")
        req = self._new_request(Kind.FETCH, namespace=sub.namespace, track_name=sub.track_name,
                                target=subscription_request_id, group_order=self._fetch_order(group_order))
        self._send_fetch(req, JoiningFetch(subscription_request_id, start, absolute), subscriber_priority, group_order)
        return req.request_id

    def _fetch_order(self, order: GroupOrder) -> GroupOrder:
        return GroupOrder.DESCENDING if order is GroupOrder.DESCENDING else GroupOrder.ASCENDING

    def track_status(self, namespace: Namespace, track_name: bytes) -> int:
        self._check_track(namespace, track_name)
        req = self._new_request(Kind.TRACK_STATUS, namespace=namespace, track_name=track_name)
        self._send_track_status(req)
        return req.request_id

    def publish_namespace(self, namespace: Namespace) -> int:
        """PUBLISH_NAMESPACE; returns the request id (events: PublishNamespaceAccepted / RequestRejected)."""
        self._check_track(namespace, b"")
        req = self._new_request(Kind.PUBLISH_NAMESPACE, namespace=namespace)
        self._send_publish_namespace(req)
        return req.request_id

    def subscribe_namespace(self, prefix: Namespace) -> int:
        self._check_track(prefix, b"")
        req = self._new_request(Kind.SUBSCRIBE_NAMESPACE, namespace=prefix)
        self._send_subscribe_namespace(req)
        return req.request_id

    def _check_track(self, namespace: Namespace, track_name: bytes) -> None:
        try:
            check_namespace(namespace, self.draft.vi64, name=track_name)
        except MoqtError as exc:
            raise MoqtUsageError(exc.reason) from None

    def update_subscription(self, request_id: int, *, filter: SubscriptionFilter | None = None,
                            subscriber_priority: int | None = None, forward: bool | None = None) -> int:
        """SUBSCRIBE_UPDATE / REQUEST_UPDATE of one of our subscriptions; returns the update's request id. Draft 14
        needs an absolute filter (start, optional end group), and requires every field (defaults: unchanged)."""
        sub = self._own(request_id, Kind.SUBSCRIBE)
        if sub.state is RState.DONE:
            raise MoqtUsageError(f"subscription {request_id} has ended")
        self._check_update(sub, filter)
        req = self._new_request(Kind.UPDATE, target=request_id)
        self._send_update(req, sub, filter, subscriber_priority, forward)
        if filter is not None:
            sub.filter = filter
        if forward is not None:
            sub.forward = forward
        if subscriber_priority is not None:
            sub.priority = subscriber_priority
        return req.request_id

    def unsubscribe(self, request_id: int) -> None:
        """End one of our subscriptions (draft 14 UNSUBSCRIBE; draft 18 cancels its request stream)."""
        req = self._own(request_id, Kind.SUBSCRIBE)
        if req.state is not RState.DONE:
            req.state = RState.DONE
            self._send_cancel(req)
        self._forget(req)

    def cancel_fetch(self, request_id: int) -> None:
        """Cancel one of our fetches (FETCH_CANCEL / request stream cancelled) and stop reading its data stream."""
        req = self._own(request_id, Kind.FETCH)
        if req.state is RState.DONE:
            return
        req.state = RState.DONE
        self._send_cancel(req)
        for sid, parser in list(self._parsers.items()):
            if parser.fetch and parser.request_id == request_id:
                del self._parsers[sid]
                self._ignored.add(sid)
                self._stop_sending(sid, StreamResetCode.CANCELLED)
        self._forget(req)

    def publish_namespace_done(self, request_id: int) -> None:
        """Withdraw a namespace we published (PUBLISH_NAMESPACE_DONE / request stream cancelled)."""
        req = self._own(request_id, Kind.PUBLISH_NAMESPACE)
        if req.state is not RState.DONE:
            req.state = RState.DONE
            self._send_cancel(req)
        self._forget(req)

    def unsubscribe_namespace(self, request_id: int) -> None:
        req = self._own(request_id, Kind.SUBSCRIBE_NAMESPACE)
        if req.state is not RState.DONE:
            req.state = RState.DONE
            self._send_cancel(req)
        self._forget(req)

    def cancel_publish_namespace(self, request_id: int, error_code: int = 0, reason: bytes = b"") -> None:
        """Revoke our acceptance of a namespace the peer published (PUBLISH_NAMESPACE_CANCEL)."""
        req = self._theirs(request_id, Kind.PUBLISH_NAMESPACE, pending=False)
        req.state = RState.DONE
        self._send_publish_namespace_cancel(req, error_code, reason)
        self._forget(req)

    def goaway(self, new_session_uri: bytes = b"", *, timeout_ms: int = 0) -> None:
        """GOAWAY: we will close the session soon (a server may name a URI to reconnect to)."""
        if self.closed:
            raise MoqtUsageError("the session is closed")
        if self.goaway_sent:
            raise MoqtUsageError("GOAWAY was already sent")
        if new_session_uri and self.role is Role.CLIENT:
            raise MoqtUsageError("a client's GOAWAY carries no URI")
        self.goaway_sent = True
        self._send_goaway(new_session_uri, timeout_ms)

    # -- Public API: answering the peer's requests ---------------------------------------------------------

    def accept_publish_namespace(self, request_id: int) -> None:
        req = self._theirs(request_id, Kind.PUBLISH_NAMESPACE, pending=True)
        req.state, req.replied = RState.ACTIVE, True
        self._send_publish_namespace_ok(req)

    def accept_subscribe_namespace(self, request_id: int) -> None:
        req = self._theirs(request_id, Kind.SUBSCRIBE_NAMESPACE, pending=True)
        req.state, req.replied = RState.ACTIVE, True
        self._send_subscribe_namespace_ok(req)

    def accept_subscribe(self, request_id: int, *, track_alias: int | None = None, expires: int = 0,
                         group_order: GroupOrder = GroupOrder.ASCENDING, largest: Location | None = None) -> int:
        """SUBSCRIBE_OK; returns the track alias (chosen here unless given)."""
        req = self._theirs(request_id, Kind.SUBSCRIBE, pending=True)
        if group_order is GroupOrder.PUBLISHER:
            raise MoqtUsageError("SUBSCRIBE_OK states the group order used: ascending or descending")
        if track_alias is None:
            while self._next_alias in self._aliases_out:
                self._next_alias += 1
            track_alias = self._next_alias
            self._next_alias += 1
        elif track_alias in self._aliases_out:
            raise MoqtUsageError(f"track alias {track_alias} is in use")
        req.state, req.replied = RState.ACTIVE, True
        req.track_alias = track_alias
        req.group_order = group_order
        self._aliases_out[track_alias] = request_id
        self._send_subscribe_ok(req, expires, largest)
        return track_alias

    def accept_fetch(self, request_id: int, end_location: Location | None, *, end_of_track: bool = False,
                     group_order: GroupOrder | None = None, priority: int | None = None) -> FetchStreamWriter:
        """FETCH_OK, and the fetch's data stream: write the objects on the returned writer, then ``finish()``.

        *end_location* None defers FETCH_OK (a relay that forwards objects before it knows where the range ends):
        send it with ``send_fetch_ok``, or fail the fetch with ``reject``. *group_order*: draft 14 may choose
        (default: the one requested, else ascending); draft 18 sends in the requested order (its encoding depends
        on it). *priority*: a scheduling hint for the data stream (default: the fetch's subscriber priority)."""
        req = self._theirs(request_id, Kind.FETCH, pending=True)
        if req.writer is not None:
            raise MoqtUsageError(f"fetch {request_id} already has its data stream")
        requested = GroupOrder.ASCENDING if req.group_order is GroupOrder.PUBLISHER else req.group_order
        order = group_order or requested
        if order is GroupOrder.PUBLISHER:
            raise MoqtUsageError("FETCH_OK states the group order used: ascending or descending")
        if self.draft is Draft.D18 and order is not requested:
            raise MoqtUsageError(f"draft 18 fetches are sent in the requested order ({requested.name})")
        req.group_order = order
        req.state = RState.ACTIVE
        if end_location is not None:
            req.replied = True
            self._send_fetch_ok(req, end_location, end_of_track)
        sid = self._open_stream(True, req.priority if priority is None else priority)
        self._send(sid, encode_fetch_header(self.draft, request_id))
        writer = FetchStreamWriter(self, request_id, sid, FetchObjectEncoder(
            self.draft, order, empty_status=self.config.fetch_empty_object_status))
        self._writers[sid] = writer
        req.writer = writer
        return writer

    def send_fetch_ok(self, request_id: int, end_location: Location, *, end_of_track: bool = False) -> None:
        """The deferred FETCH_OK of ``accept_fetch(request_id, None)``."""
        req = self._theirs(request_id, Kind.FETCH, pending=True)
        if req.state is not RState.ACTIVE:
            raise MoqtUsageError(f"fetch {request_id} was not accepted: use accept_fetch")
        req.replied = True
        self._send_fetch_ok(req, end_location, end_of_track)
        if req.writer is None:  # the data stream is already done
            self._fetch_stream_closed(req)
            self._forget(req)

    def accept_track_status(self, request_id: int, *, largest: Location | None = None, expires: int = 0,
                            group_order: GroupOrder = GroupOrder.ASCENDING) -> None:
        req = self._theirs(request_id, Kind.TRACK_STATUS, pending=True)
        req.state, req.replied = RState.DONE, True
        self._send_track_status_ok(req, largest, expires, group_order)
        self._forget(req)

    def reject(self, request_id: int, error_code: int, reason: bytes = b"", *, retry_interval: int = 0,
               redirect: Redirect | None = None) -> None:
        """Refuse a request of the peer (any kind) with the draft's error code for it (draft 18: REQUEST_ERROR,
        with *retry_interval* and, for REDIRECT, *redirect*)."""
        req = self._theirs(request_id, *Kind, pending=True)
        if redirect is not None and self.draft is Draft.D14:
            raise MoqtUsageError("draft 14 has no redirects")
        if req.writer is not None:  # a fetch accepted without FETCH_OK: its data stream ends too
            req.writer.reset(StreamResetCode.INTERNAL_ERROR)
        req.state, req.replied = RState.DONE, True
        self._send_error(req, error_code, reason, retry_interval, redirect)
        self._forget(req)

    def publish_done(self, request_id: int, status_code: int, reason: bytes = b"", *,
                     stream_count: int | None = None) -> None:
        """PUBLISH_DONE for a subscription we serve (after its streams are closed). The stream count defaults to
        the subgroup streams opened for it."""
        req = self._served(request_id)
        req.state = RState.DONE
        self._send_publish_done(req, status_code, reason, req.data_streams if stream_count is None else stream_count)
        self._forget(req)

    def accept_update(self, request_id: int) -> None:
        """Draft 18: REQUEST_OK for the peer's REQUEST_UPDATE *request_id* (draft 14 updates have no reply)."""
        raise MoqtUsageError("draft 14 SUBSCRIBE_UPDATE has no reply")

    def send_namespace(self, request_id: int, namespace: Namespace, *, active: bool = True) -> None:
        """Draft 18: NAMESPACE (or, not ``active``, NAMESPACE_DONE) on an accepted SUBSCRIBE_NAMESPACE's stream.
        Draft 14 announces namespaces with ``publish_namespace``."""
        raise MoqtUsageError("draft 14 has no NAMESPACE message: use publish_namespace")

    def grant_requests(self, max_request_id: int) -> None:
        """Draft 14: MAX_REQUEST_ID (the peer may use request ids below *max_request_id*)."""
        raise MoqtUsageError("draft 18 has no request-id flow control")

    # -- Public API: publishing objects on a subscription -------------------------------------------------

    def open_subgroup(self, request_id: int, group: int, subgroup: int = 0, *, priority: int | None = 128,
                      extensions: bool = False, end_of_group: bool = False) -> SubgroupWriter:
        """A subgroup stream for a subscription we serve. ``priority`` None: draft 18's default priority."""
        req = self._served(request_id)
        assert req.track_alias is not None
        header = SubgroupHeader(req.track_alias, group, subgroup, priority, extensions, end_of_group)
        try:
            encoded = header.encode(self.draft)
        except ValueError as exc:
            raise MoqtUsageError(str(exc)) from None
        sid = self._open_stream(True, 128 if priority is None else priority)
        self._send(sid, encoded)
        req.data_streams += 1
        writer = SubgroupWriter(self, request_id, sid, SubgroupObjectEncoder(self.draft, extensions))
        self._writers[sid] = writer
        return writer

    def send_datagram(self, request_id: int, group: int, object_id: int, payload: bytes = b"", *,
                      priority: int | None = 128, status: ObjectStatus | None = None,
                      extensions: KeyValuePairs = (), end_of_group: bool = False) -> None:
        """OBJECT_DATAGRAM (or a status datagram) for a subscription we serve; needs the DATAGRAM extension."""
        if not self.config.datagrams:
            raise MoqtUsageError("the DATAGRAM extension was not negotiated")
        req = self._served(request_id)
        assert req.track_alias is not None
        try:
            data = ObjectDatagram(req.track_alias, group, object_id, payload, priority, status, extensions,
                                  end_of_group).encode(self.draft)
        except ValueError as exc:
            raise MoqtUsageError(str(exc)) from None
        self._actions.append(SendDatagram(data))

    def _data_stream_closed(self, writer: StreamWriter) -> None:
        self._writers.pop(writer.stream_id, None)
        req = self.requests.get(writer.request_id)
        if req is not None and req.writer is writer:
            req.writer = None
            if req.replied:  # else FETCH_OK (or an error) is still to come
                self._fetch_stream_closed(req)
                self._forget(req)

    # -- Draft hooks ------------------------------------------------------------------------------------------

    def _start(self) -> None:
        raise NotImplementedError

    def _on_stream_data(self, stream_id: int, data: bytes | bytearray | memoryview, fin: bool) -> None:
        raise NotImplementedError

    def _on_stream_reset(self, stream_id: int, error_code: int) -> None:
        raise NotImplementedError

    def _on_request_stream_stopped(self, stream_id: int, error_code: int) -> None:
        raise NotImplementedError

    def _send_subscribe(self, req: Request, priority: int) -> None:
        raise NotImplementedError

    def _send_fetch(self, req: Request, target: FetchTarget, priority: int, order: GroupOrder) -> None:
        raise NotImplementedError

    def _send_track_status(self, req: Request) -> None:
        raise NotImplementedError

    def _send_publish_namespace(self, req: Request) -> None:
        raise NotImplementedError

    def _send_subscribe_namespace(self, req: Request) -> None:
        raise NotImplementedError

    def _send_update(self, req: Request, sub: Request, flt: SubscriptionFilter | None, priority: int | None,
                     forward: bool | None) -> None:
        raise NotImplementedError

    def _send_publish_namespace_ok(self, req: Request) -> None:
        raise NotImplementedError

    def _send_subscribe_namespace_ok(self, req: Request) -> None:
        raise NotImplementedError

    def _send_subscribe_ok(self, req: Request, expires: int, largest: Location | None) -> None:
        raise NotImplementedError

    def _send_fetch_ok(self, req: Request, end: Location, end_of_track: bool) -> None:
        raise NotImplementedError

    def _send_track_status_ok(self, req: Request, largest: Location | None, expires: int, order: GroupOrder) -> None:
        raise NotImplementedError

    def _send_error(self, req: Request, code: int, reason: bytes, retry_interval: int,
                    redirect: Redirect | None) -> None:
        raise NotImplementedError

    def _send_publish_done(self, req: Request, code: int, reason: bytes, stream_count: int) -> None:
        raise NotImplementedError

    def _send_cancel(self, req: Request) -> None:
        raise NotImplementedError

    def _check_update(self, sub: Request, flt: SubscriptionFilter | None) -> None:
        """Raise MoqtUsageError if the draft cannot express this update."""

    def _send_publish_namespace_cancel(self, req: Request, code: int, reason: bytes) -> None:
        raise NotImplementedError

    def _send_goaway(self, uri: bytes, timeout_ms: int) -> None:
        raise NotImplementedError

    def _fetch_stream_closed(self, req: Request) -> None:
        """Our fetch data stream for *req* ended (FIN or reset)."""
