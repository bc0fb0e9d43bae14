"""Draft 14 session ("moq-00"): one client-initiated bidirectional control stream carries every control message;
SETUP negotiates the version (0xff00000e); requests are numbered in order (client even, server odd, +2 each) and
flow-controlled by MAX_REQUEST_ID; replies echo the Request ID; cancellation is a message (UNSUBSCRIBE,
FETCH_CANCEL, PUBLISH_NAMESPACE_DONE / _CANCEL, UNSUBSCRIBE_NAMESPACE)."""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from moqt.control import ControlParser, encode_message
from moqt.errors import (
    FetchErrorCode14,
    MoqtError,
    MoqtUsageError,
    RequestErrorCode14,
    SessionErrorCode,
    StreamResetCode,
    protocol_violation,
)
from moqt.events import (
    FetchAccepted,
    FetchCancelled,
    FetchRequested,
    GoawayReceived,
    PublishDone,
    PublishNamespaceAccepted,
    PublishNamespaceCancelled,
    PublishNamespaceDone,
    PublishNamespaceRequested,
    RequestRejected,
    RequestsBlockedReceived,
    SetupCompleted,
    SubscribeAccepted,
    SubscribeNamespaceAccepted,
    SubscribeNamespaceEnded,
    SubscribeNamespaceRequested,
    SubscribeRequested,
    TrackStatusReceived,
    TrackStatusRequested,
    Unsubscribed,
    UpdateRequested,
)
from moqt.message import Message
from moqt.messages14 import (
    REQUESTS,
    ClientSetup,
    ErrorReply,
    Fetch,
    FetchCancel,
    FetchError,
    FetchOk,
    Goaway,
    MaxRequestId,
    Param14,
    Publish,
    PublishError,
    PublishNamespace,
    PublishNamespaceCancel,
    PublishNamespaceError,
    PublishNamespaceOk,
    PublishOk,
    RequestsBlocked,
    ServerSetup,
    Subscribe,
    SubscribeError,
    SubscribeNamespace,
    SubscribeNamespaceError,
    SubscribeNamespaceOk,
    SubscribeOk,
    SubscribeUpdate,
    TrackStatus,
    TrackStatusError,
    TrackStatusOk,
    Unsubscribe,
    UnsubscribeNamespace,
)
from moqt.messages14 import PublishDone as PublishDoneMsg
from moqt.messages14 import PublishNamespaceDone as PublishNamespaceDoneMsg
from moqt.messages18 import Redirect
from moqt.requests import Kind, Request, Role, RState, SessionConfig, absolute_filter, check_authority, check_path
from moqt.session import MoqtSession
from moqt.types import (
    LARGEST_OBJECT_FILTER,
    AuthToken,
    Draft,
    FetchTarget,
    FilterType,
    GroupOrder,
    KeyValuePair,
    KeyValuePairs,
    Location,
    Namespace,
    SetupParam,
    StandaloneFetch,
    SubscriptionFilter,
    kvp_value,
)


class Session14(MoqtSession):
    draft = Draft.D14

    def __init__(self, role: Role, config: SessionConfig | None = None) -> None:
        super().__init__(role, config)
        self._control_id: int | None = None
        self._control = ControlParser(Draft.D14)
        self._peer_max = 0  # our request ids below this may be sent (the peer's MAX_REQUEST_ID; default 0)
        self._blocked_at: int | None = None  # the maximum we last sent REQUESTS_BLOCKED for
        self._queue: deque[tuple[Message, int | None]] = deque()  # (message, request id it consumes) in order
        self._peer_next = 1 if role is Role.CLIENT else 0  # the request id the peer must use next
        self._granted = self._peer_next + 2 * self.config.request_credit  # our MAX_REQUEST_ID (exclusive)

    # -- Setup ----------------------------------------------------------------------------------------------------

    def _start(self) -> None:
        if self.role is Role.CLIENT:
            self._control_id = self._open_stream(False, priority=0)
            self._send_control(ClientSetup((self.draft.version,), self._setup_params()))

    def _setup_params(self) -> KeyValuePairs:
        params: list[KeyValuePair] = []
        if self.role is Role.CLIENT:
            if self.config.path is not None:
                params.append((SetupParam.PATH, self.config.path))
            if self.config.authority is not None:
                params.append((SetupParam.AUTHORITY, self.config.authority))
        params.append((SetupParam.MAX_REQUEST_ID, self._granted))
        if self.config.implementation is not None:
            params.append((SetupParam.MOQT_IMPLEMENTATION, self.config.implementation))
        return (*params, *self.config.setup_params)

    def _on_client_setup(self, msg: ClientSetup) -> None:
        if self.draft.version not in msg.versions:
            offered = ", ".join(f"0x{v:x}" for v in msg.versions)
            raise MoqtError(SessionErrorCode.VERSION_NEGOTIATION_FAILED, f"no supported version in {offered}")
        path = kvp_value(msg.params, SetupParam.PATH)
        authority = kvp_value(msg.params, SetupParam.AUTHORITY)
        if isinstance(path, bytes):
            check_path(path)
        if isinstance(authority, bytes):
            check_authority(authority)
        self._send_control(ServerSetup(self.draft.version, self._setup_params()))
        self._complete_setup(msg.params, self.draft.version)

    def _on_server_setup(self, msg: ServerSetup) -> None:
        if msg.version != self.draft.version:
            raise MoqtError(SessionErrorCode.VERSION_NEGOTIATION_FAILED, f"server chose 0x{msg.version:x}, not offered")
        if kvp_value(msg.params, SetupParam.PATH) is not None:
            raise MoqtError(SessionErrorCode.INVALID_PATH, "a server sent PATH")
        if kvp_value(msg.params, SetupParam.AUTHORITY) is not None:
            raise MoqtError(SessionErrorCode.INVALID_AUTHORITY, "a server sent AUTHORITY")
        self._complete_setup(msg.params, msg.version)

    def _complete_setup(self, params: KeyValuePairs, version: int) -> None:
        peer_max = kvp_value(params, SetupParam.MAX_REQUEST_ID)
        self._peer_max = peer_max if isinstance(peer_max, int) else 0
        path, authority = kvp_value(params, SetupParam.PATH), kvp_value(params, SetupParam.AUTHORITY)
        impl = kvp_value(params, SetupParam.MOQT_IMPLEMENTATION)
        self.setup = SetupCompleted(
            self.draft, version, path if isinstance(path, bytes) else None,
            authority if isinstance(authority, bytes) else None, impl if isinstance(impl, bytes) else None,
            self._peer_max, params)
        self._events.append(self.setup)
        self._flush()
        self._replay_held()

    # -- Streams ----------------------------------------------------------------------------------------------

    def _send_control(self, msg: Message) -> None:
        assert self._control_id is not None
        self._send(self._control_id, encode_message(msg, Draft.D14))

    def _on_stream_data(self, stream_id: int, data: bytes | bytearray | memoryview, fin: bool) -> None:
        if self._is_uni(stream_id):
            if self._is_local(stream_id):
                raise protocol_violation(f"data on our own unidirectional stream {stream_id}")
            if self.setup is None:
                self._hold(stream_id, data, fin)
            else:
                self._on_data_stream(stream_id, data, fin)
            return
        if self._control_id is None and not self._is_local(stream_id):
            self._control_id = stream_id  # the server's view: the client's first bidirectional stream
        if stream_id != self._control_id:
            raise protocol_violation(f"bidirectional stream {stream_id} besides the control stream")
        for msg in self._control.feed(data):
            self._on_message(msg)
        if fin:
            raise protocol_violation("the control stream was closed")

    def _on_stream_reset(self, stream_id: int, error_code: int) -> None:
        if stream_id == self._control_id:
            raise protocol_violation("the control stream was reset")
        if self._is_uni(stream_id) and not self._is_local(stream_id):
            self._on_data_stream_reset(stream_id, error_code)

    def _on_request_stream_stopped(self, stream_id: int, error_code: int) -> None:
        if stream_id == self._control_id:
            raise protocol_violation("the peer stopped the control stream")

    # -- Control messages -----------------------------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        if self.setup is None:
            if self.role is Role.SERVER and isinstance(msg, ClientSetup):
                self._on_client_setup(msg)
            elif self.role is Role.CLIENT and isinstance(msg, ServerSetup):
                self._on_server_setup(msg)
            else:
                raise protocol_violation(f"{msg.NAME} before the setup exchange completed")
            return
        if isinstance(msg, REQUESTS):
            self._accept_request_id(msg.request_id)
        match msg:
            case Subscribe():
                self._on_subscribe(msg)
            case SubscribeUpdate():
                self._on_subscribe_update(msg)
            case Fetch():
                self._on_fetch(msg)
            case TrackStatus():
                self._register(msg.request_id, Kind.TRACK_STATUS, msg.namespace, msg.track_name)
                self._events.append(TrackStatusRequested(msg.request_id, msg.namespace, msg.track_name,
                                                         self._tokens(msg.params), msg.params))
            case PublishNamespace():
                self._register(msg.request_id, Kind.PUBLISH_NAMESPACE, msg.namespace)
                self._events.append(PublishNamespaceRequested(msg.request_id, msg.namespace,
                                                              self._tokens(msg.params), msg.params))
            case SubscribeNamespace():
                self._register(msg.request_id, Kind.SUBSCRIBE_NAMESPACE, msg.namespace)
                self._events.append(SubscribeNamespaceRequested(msg.request_id, msg.namespace,
                                                                self._tokens(msg.params), msg.params))
            case Publish():  # not implemented: refused (the request is not kept)
                self._send_control(PublishError(msg.request_id, RequestErrorCode14.NOT_SUPPORTED, b"PUBLISH"))
            case _:
                self._on_other(msg)

    def _on_other(self, msg: Message) -> None:
        match msg:
            case SubscribeOk() | SubscribeError() | FetchOk() | FetchError() | TrackStatusOk() | TrackStatusError() \
                    | PublishNamespaceOk() | PublishNamespaceError() | SubscribeNamespaceOk() \
                    | SubscribeNamespaceError() | PublishOk() | PublishError():
                self._on_reply(msg)
            case Unsubscribe():
                req = self._peer_req(msg.request_id, Kind.SUBSCRIBE, msg.NAME)
                if req is not None:
                    self._end_served(req, StreamResetCode.CANCELLED)
                    self._events.append(Unsubscribed(req.request_id))
                    self._forget(req)
            case FetchCancel():
                req = self._peer_req(msg.request_id, Kind.FETCH, msg.NAME)
                if req is not None:
                    self._end_served(req, StreamResetCode.CANCELLED)
                    self._events.append(FetchCancelled(req.request_id))
                    self._forget(req)
            case PublishDoneMsg():
                req = self._our_req(msg.request_id, Kind.SUBSCRIBE, msg.NAME)
                if req is not None:
                    req.state = RState.DONE
                    self._events.append(PublishDone(req.request_id, msg.status_code, msg.stream_count, msg.reason))
            case PublishNamespaceDoneMsg():
                req = self._by_namespace(msg.namespace, Kind.PUBLISH_NAMESPACE, local=False)
                if req is not None:
                    self._forget(req)
                    self._events.append(PublishNamespaceDone(req.request_id, msg.namespace))
            case PublishNamespaceCancel():
                req = self._by_namespace(msg.namespace, Kind.PUBLISH_NAMESPACE, local=True)
                if req is not None:
                    self._forget(req)
                    self._events.append(PublishNamespaceCancelled(req.request_id, msg.namespace, msg.error_code,
                                                                  msg.reason))
            case UnsubscribeNamespace():
                req = self._by_namespace(msg.namespace, Kind.SUBSCRIBE_NAMESPACE, local=False)
                if req is not None:
                    self._forget(req)
                    self._events.append(SubscribeNamespaceEnded(req.request_id, msg.namespace))
            case Goaway():
                if self.goaway_received:
                    raise protocol_violation("a second GOAWAY")
                if msg.new_session_uri and self.role is Role.SERVER:
                    raise protocol_violation("a client's GOAWAY carried a URI")
                self.goaway_received = True
                self._events.append(GoawayReceived(msg.new_session_uri))
            case MaxRequestId():
                if msg.request_id <= self._peer_max:
                    raise protocol_violation(f"MAX_REQUEST_ID {msg.request_id} does not increase {self._peer_max}")
                self._peer_max = msg.request_id
                self._flush()
            case RequestsBlocked():
                self._events.append(RequestsBlockedReceived(msg.maximum_request_id))
                if self.config.auto_grant:
                    self._grant(self._peer_next + 2 * self.config.request_credit)
            case _:
                raise protocol_violation(f"unexpected {msg.NAME}")

    # -- Request ids ----------------------------------------------------------------------------------------

    def _accept_request_id(self, rid: int) -> None:
        if rid % 2 != self._peer_parity():
            raise MoqtError(SessionErrorCode.INVALID_REQUEST_ID, f"request id {rid} has the wrong parity")
        if rid >= self._granted:
            raise MoqtError(SessionErrorCode.TOO_MANY_REQUESTS, f"request id {rid} >= MAX_REQUEST_ID {self._granted}")
        if rid != self._peer_next:
            raise MoqtError(SessionErrorCode.INVALID_REQUEST_ID, f"request id {rid}, expected {self._peer_next}")
        self._peer_next += 2
        credit = self.config.request_credit
        if self.config.auto_grant and (self._granted - self._peer_next) // 2 < max(1, credit // 2):
            self._grant(self._peer_next + 2 * credit)

    def _grant(self, maximum: int) -> None:
        if maximum > self._granted:
            self._granted = maximum
            self._send_control(MaxRequestId(maximum))

    def grant_requests(self, max_request_id: int) -> None:
        if self.closed:
            raise MoqtUsageError("the session is closed")
        if max_request_id <= self._granted:
            raise MoqtUsageError(f"MAX_REQUEST_ID must increase beyond {self._granted}")
        self._grant(max_request_id)

    @property
    def blocked_requests(self) -> int:
        """Our requests waiting for the peer's MAX_REQUEST_ID."""
        return sum(1 for _, rid in self._queue if rid is not None)

    def _send_request(self, msg: Message, rid: int | None) -> None:
        """Queue a message behind any request waiting for credit (ids must reach the peer in order)."""
        self._queue.append((msg, rid))
        self._flush()

    def _flush(self) -> None:
        if self._control_id is None or (self.setup is None and self.role is Role.SERVER):
            return
        while self._queue:
            msg, rid = self._queue[0]
            if rid is not None and (rid >= self._peer_max or self.setup is None):
                break
            self._queue.popleft()
            self._send_control(msg)
        if self._queue and self.setup is not None and self._blocked_at != self._peer_max:
            self._blocked_at = self._peer_max
            self._send_control(RequestsBlocked(self._peer_max))

    # -- Incoming requests ----------------------------------------------------------------------------------

    def _register(self, rid: int, kind: Kind, namespace: Namespace = (), name: bytes = b"", **kw: object) -> Request:
        req = Request(rid, kind, False, namespace=namespace, track_name=name, **kw)  # type: ignore[arg-type]
        self.requests[rid] = req
        return req

    def _tokens(self, params: KeyValuePairs) -> tuple[AuthToken, ...]:
        return self._check_tokens(tuple(v for t, v in params if t == Param14.AUTHORIZATION_TOKEN
                                        and isinstance(v, bytes)))

    def _on_subscribe(self, msg: Subscribe) -> None:
        tokens = self._tokens(msg.params)
        self._register(msg.request_id, Kind.SUBSCRIBE, msg.namespace, msg.track_name, filter=msg.filter,
                       forward=msg.forward, group_order=msg.group_order, priority=msg.subscriber_priority)
        self._events.append(SubscribeRequested(msg.request_id, msg.namespace, msg.track_name, msg.subscriber_priority,
                                               msg.group_order, msg.forward, msg.filter, tokens, msg.params))

    def _on_subscribe_update(self, msg: SubscribeUpdate) -> None:
        sub = self.requests.get(msg.subscription_request_id)
        if sub is None and self._was_peers(msg.subscription_request_id):
            return  # it ended meanwhile (the update has no reply and is not kept)
        if sub is None or sub.local or sub.kind is not Kind.SUBSCRIBE:
            raise protocol_violation(f"SUBSCRIBE_UPDATE of {msg.subscription_request_id}, not a subscription")
        if sub.state is RState.DONE:
            return
        flt = absolute_filter(msg.start, msg.end_group)
        old = sub.filter
        if old is not None and old.start is not None and flt.start is not None and flt.start < old.start:
            raise protocol_violation("SUBSCRIBE_UPDATE moved the start location back")
        if old is not None and old.end_group is not None and (flt.end_group is None or flt.end_group > old.end_group):
            raise protocol_violation("SUBSCRIBE_UPDATE moved the end group forward")
        sub.filter, sub.forward, sub.priority = flt, msg.forward, msg.subscriber_priority
        self._events.append(UpdateRequested(msg.request_id, sub.request_id, flt, msg.subscriber_priority,
                                            msg.forward, False, msg.params))

    def _on_fetch(self, msg: Fetch) -> None:
        tokens = self._tokens(msg.params)
        target = msg.target
        if isinstance(target, StandaloneFetch):
            self._register(msg.request_id, Kind.FETCH, target.namespace, target.track_name, start=target.start,
                           group_order=msg.group_order, priority=msg.subscriber_priority)
            self._events.append(FetchRequested(msg.request_id, target.namespace, target.track_name, target,
                                               msg.subscriber_priority, msg.group_order, tokens, msg.params))
            return
        sub = self.requests.get(target.request_id)
        if sub is None or sub.local or sub.kind is not Kind.SUBSCRIBE or sub.state is RState.DONE:
            self._send_control(FetchError(msg.request_id, FetchErrorCode14.INVALID_JOINING_REQUEST_ID,
                                          b"no such subscription"))
            return
        if sub.filter is None or sub.filter.type is not FilterType.LARGEST_OBJECT:
            raise protocol_violation("a joining FETCH of a subscription without a Largest Object filter")
        self._register(msg.request_id, Kind.FETCH, sub.namespace, sub.track_name, group_order=msg.group_order,
                       target=target.request_id, priority=msg.subscriber_priority)
        self._events.append(FetchRequested(msg.request_id, sub.namespace, sub.track_name, target,
                                           msg.subscriber_priority, msg.group_order, tokens, msg.params))

    def _was_peers(self, rid: int) -> bool:
        return rid % 2 == self._peer_parity() and rid < self._peer_next

    def _peer_req(self, rid: int, kind: Kind, what: str) -> Request | None:
        """The peer's live request *rid* of *kind* a cancel message names; None if it already ended."""
        req = self.requests.get(rid)
        if req is None and self._was_peers(rid):
            return None  # ended and forgotten
        if req is None or req.local or req.kind is not kind:
            raise protocol_violation(f"{what} for request {rid}, which is no {kind.value} of the peer")
        return None if req.state is RState.DONE else req

    def _our_req(self, rid: int, kind: Kind, what: str) -> Request | None:
        req = self.requests.get(rid)
        if req is None and self._was_ours(rid):
            return None
        if req is None or not req.local or req.kind is not kind:
            raise protocol_violation(f"{what} for request {rid}, which is not one of our {kind.value}s")
        return None if req.state is RState.DONE else req

    def _by_namespace(self, ns: Namespace, kind: Kind, *, local: bool) -> Request | None:
        for req in self.requests.values():
            if req.kind is kind and req.local == local and req.namespace == ns and req.state is not RState.DONE:
                return req
        return None

    def _end_served(self, req: Request, code: int) -> None:
        """A request we serve ended: reset the data streams still open for it."""
        req.state = RState.DONE
        for writer in list(self._writers.values()):
            if writer.request_id == req.request_id:
                writer.reset(code)

    # -- Replies to our requests ----------------------------------------------------------------------------

    _REPLY_KIND: ClassVar[dict[type[Message], Kind]] = {
        SubscribeOk: Kind.SUBSCRIBE, SubscribeError: Kind.SUBSCRIBE, FetchOk: Kind.FETCH, FetchError: Kind.FETCH,
        TrackStatusOk: Kind.TRACK_STATUS, TrackStatusError: Kind.TRACK_STATUS,
        PublishNamespaceOk: Kind.PUBLISH_NAMESPACE, PublishNamespaceError: Kind.PUBLISH_NAMESPACE,
        SubscribeNamespaceOk: Kind.SUBSCRIBE_NAMESPACE, SubscribeNamespaceError: Kind.SUBSCRIBE_NAMESPACE,
        PublishOk: Kind.PUBLISH, PublishError: Kind.PUBLISH,
    }

    def _on_reply(self, msg: Message) -> None:
        kind = self._REPLY_KIND[type(msg)]
        rid: int = msg.request_id  # type: ignore[attr-defined]
        req = self.requests.get(rid)
        if req is None and self._was_ours(rid) and kind is not Kind.PUBLISH:
            return  # we cancelled (and forgot) it: this is the reply that crossed the cancel
        if req is None or not req.local or req.kind is not kind:
            raise protocol_violation(f"{msg.NAME} for request {rid}, which is not one of our {kind.value}s")
        if req.replied:
            raise protocol_violation(f"a second reply ({msg.NAME}) to request {rid}")
        req.replied = True
        if req.state is RState.DONE:
            return  # we cancelled it meanwhile
        match msg:
            case SubscribeError() | FetchError() | TrackStatusError() | PublishNamespaceError() \
                    | SubscribeNamespaceError():
                self._forget(req)
                self._events.append(RequestRejected(rid, msg.error_code, msg.reason))
            case SubscribeOk():
                self._bind_alias(msg.track_alias, rid)
                req.state, req.track_alias = RState.ACTIVE, msg.track_alias
                self._events.append(SubscribeAccepted(rid, msg.track_alias, msg.expires, msg.group_order,
                                                      msg.largest, msg.params))
            case FetchOk():
                if req.start is not None and msg.end_location.group < req.start.group:
                    raise protocol_violation("FETCH_OK end location precedes the fetch's start")
                req.state, req.group_order = RState.ACTIVE, msg.group_order
                self._events.append(FetchAccepted(rid, msg.end_location, msg.end_of_track, msg.group_order,
                                                  msg.params))
                if req.data_ended:
                    self._forget(req)
            case TrackStatusOk():
                self._forget(req)
                self._events.append(TrackStatusReceived(rid, msg.largest, msg.expires, msg.group_order, msg.params))
            case PublishNamespaceOk():
                req.state = RState.ACTIVE
                self._events.append(PublishNamespaceAccepted(rid))
            case SubscribeNamespaceOk():
                req.state = RState.ACTIVE
                self._events.append(SubscribeNamespaceAccepted(rid))

    # -- Sending ----------------------------------------------------------------------------------------------

    def _send_subscribe(self, req: Request, priority: int) -> None:
        if req.filter is None:
            req.filter = LARGEST_OBJECT_FILTER
        self._send_request(Subscribe(req.request_id, req.namespace, req.track_name, priority, req.group_order,
                                     req.forward, req.filter), req.request_id)

    def _send_fetch(self, req: Request, target: FetchTarget, priority: int, order: GroupOrder) -> None:
        self._send_request(Fetch(req.request_id, target, priority, order), req.request_id)

    def _send_track_status(self, req: Request) -> None:
        self._send_request(TrackStatus(req.request_id, req.namespace, req.track_name), req.request_id)

    def _send_publish_namespace(self, req: Request) -> None:
        self._send_request(PublishNamespace(req.request_id, req.namespace), req.request_id)

    def _send_subscribe_namespace(self, req: Request) -> None:
        self._send_request(SubscribeNamespace(req.request_id, req.namespace), req.request_id)

    def _check_update(self, sub: Request, flt: SubscriptionFilter | None) -> None:
        use = flt if flt is not None else sub.filter
        if use is None or use.start is None:
            raise MoqtUsageError("a draft 14 SUBSCRIBE_UPDATE needs an absolute start location: pass a filter")

    def _send_update(self, req: Request, sub: Request, flt: SubscriptionFilter | None, priority: int | None,
                     forward: bool | None) -> None:
        use = flt if flt is not None else sub.filter
        assert use is not None and use.start is not None
        end = 0 if use.end_group is None else use.end_group + 1
        self._send_request(SubscribeUpdate(
            req.request_id, sub.request_id, use.start, end, sub.priority if priority is None else priority,
            sub.forward if forward is None else forward), req.request_id)
        self._forget(req)  # no reply in draft 14

    def _send_cancel(self, req: Request) -> None:
        match req.kind:
            case Kind.SUBSCRIBE:
                msg: Message = Unsubscribe(req.request_id)
            case Kind.FETCH:
                msg = FetchCancel(req.request_id)
            case Kind.PUBLISH_NAMESPACE:
                msg = PublishNamespaceDoneMsg(req.namespace)
            case _:
                msg = UnsubscribeNamespace(req.namespace)
        self._send_request(msg, None)

    def _send_publish_namespace_cancel(self, req: Request, code: int, reason: bytes) -> None:
        self._send_control(PublishNamespaceCancel(req.namespace, code, reason))

    def _send_goaway(self, uri: bytes, timeout_ms: int) -> None:
        self._send_control(Goaway(uri))

    def _send_publish_namespace_ok(self, req: Request) -> None:
        self._send_control(PublishNamespaceOk(req.request_id))

    def _send_subscribe_namespace_ok(self, req: Request) -> None:
        self._send_control(SubscribeNamespaceOk(req.request_id))

    def _send_subscribe_ok(self, req: Request, expires: int, largest: Location | None) -> None:
        assert req.track_alias is not None
        self._send_control(SubscribeOk(req.request_id, req.track_alias, expires, req.group_order, largest))

    def _send_fetch_ok(self, req: Request, end: Location, end_of_track: bool) -> None:
        self._send_control(FetchOk(req.request_id, end, end_of_track, req.group_order))

    def _send_track_status_ok(self, req: Request, largest: Location | None, expires: int, order: GroupOrder) -> None:
        self._send_control(TrackStatusOk(req.request_id, 0, expires, order, largest))

    _ERRORS: ClassVar[dict[Kind, type[ErrorReply]]] = {
        Kind.SUBSCRIBE: SubscribeError, Kind.FETCH: FetchError, Kind.TRACK_STATUS: TrackStatusError,
        Kind.PUBLISH_NAMESPACE: PublishNamespaceError, Kind.SUBSCRIBE_NAMESPACE: SubscribeNamespaceError,
        Kind.PUBLISH: PublishError}

    def _send_error(self, req: Request, code: int, reason: bytes, retry_interval: int,
                    redirect: Redirect | None) -> None:
        cls = self._ERRORS.get(req.kind)
        if cls is None:
            raise MoqtUsageError(f"a draft 14 {req.kind.value} has no error reply")
        self._send_control(cls(req.request_id, code, reason))

    def _send_publish_done(self, req: Request, code: int, reason: bytes, stream_count: int) -> None:
        self._send_control(PublishDoneMsg(req.request_id, code, stream_count, reason))
