"""Draft 18 session ("moqt-18"): each endpoint opens a unidirectional control stream starting with SETUP (its
stream type is the SETUP message type, 0x2F00) that later carries only GOAWAY; every request opens its own
bidirectional stream, whose first message is the request and whose replies carry no Request ID; a request is
cancelled by resetting / stopping its stream. No version negotiation (ALPN) and no request-id flow control."""

from __future__ import annotations

from moqt.control import ControlParser, encode_message
from moqt.data import SETUP_STREAM
from moqt.errors import (
    MoqtError,
    MoqtUsageError,
    PublishDoneCode18,
    RequestErrorCode18,
    SessionErrorCode,
    StreamResetCode,
    protocol_violation,
)
from moqt.events import (
    FetchAccepted,
    FetchCancelled,
    FetchRequested,
    GoawayReceived,
    NamespaceReceived,
    PublishDone,
    PublishNamespaceAccepted,
    PublishNamespaceCancelled,
    PublishNamespaceDone,
    PublishNamespaceRequested,
    RequestCancelled,
    RequestRejected,
    SetupCompleted,
    SubscribeAccepted,
    SubscribeNamespaceAccepted,
    SubscribeNamespaceEnded,
    SubscribeNamespaceRequested,
    SubscribeRequested,
    TrackStatusReceived,
    TrackStatusRequested,
    Unsubscribed,
    UpdateAccepted,
    UpdateRequested,
)
from moqt.message import Message
from moqt.messages18 import (
    FIRST_ON_REQUEST_STREAM,
    Fetch,
    FetchOk,
    Goaway,
    NamespaceDone,
    NamespaceMsg,
    Params18,
    Publish,
    PublishNamespace,
    Redirect,
    RequestError,
    RequestOk,
    RequestUpdate,
    Setup,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeTracks,
    TrackStatus,
)
from moqt.messages18 import PublishDone as PublishDoneMsg
from moqt.requests import Kind, Request, Role, RState, SessionConfig, check_authority, check_path
from moqt.session import MoqtSession
from moqt.types import (
    Draft,
    FetchTarget,
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
from moqt.varint import NeedMore, Reader

DEFAULT_PUBLISHER_GROUP_ORDER = 0x22  # the track property


class Session18(MoqtSession):
    draft = Draft.D18

    def __init__(self, role: Role, config: SessionConfig | None = None) -> None:
        super().__init__(role, config)
        self._control_out: int | None = None
        self._control_in: int | None = None
        self._control_parser = ControlParser(Draft.D18)
        self._untyped: dict[int, bytes] = {}  # the peer's unidirectional streams whose type is not known yet
        self._stream_request: dict[int, int] = {}  # request stream -> request id
        self._stream_parsers: dict[int, ControlParser] = {}
        self._fin_sent: set[int] = set()
        self._goaway_streams: set[int] = set()
        self._peer_ids = _IdSet(self._peer_parity())
        self._max_peer_bidi = -1  # the highest bidirectional stream the peer opened so far

    # -- Setup ----------------------------------------------------------------------------------------------

    def _start(self) -> None:
        self._control_out = self._open_stream(True, priority=0)
        options: list[KeyValuePair] = []
        if self.role is Role.CLIENT:
            if self.config.path is not None:
                options.append((SetupParam.PATH, self.config.path))
            if self.config.authority is not None:
                options.append((SetupParam.AUTHORITY, self.config.authority))
        if self.config.implementation is not None:
            options.append((SetupParam.MOQT_IMPLEMENTATION, self.config.implementation))
        self._send(self._control_out, encode_message(Setup((*options, *self.config.setup_params)), Draft.D18))

    def _on_setup(self, msg: Setup) -> None:
        if self.setup is not None:
            raise protocol_violation("a second SETUP")
        opts = msg.options
        path, authority = kvp_value(opts, SetupParam.PATH), kvp_value(opts, SetupParam.AUTHORITY)
        if self.role is Role.CLIENT:
            if path is not None:
                raise MoqtError(SessionErrorCode.INVALID_PATH, "a server sent PATH")
            if authority is not None:
                raise MoqtError(SessionErrorCode.INVALID_AUTHORITY, "a server sent AUTHORITY")
        if isinstance(path, bytes):
            check_path(path)
        if isinstance(authority, bytes):
            check_authority(authority)
        impl = kvp_value(opts, SetupParam.MOQT_IMPLEMENTATION)
        self.setup = SetupCompleted(self.draft, None, path if isinstance(path, bytes) else None,
                                    authority if isinstance(authority, bytes) else None,
                                    impl if isinstance(impl, bytes) else None, None, opts)
        self._events.append(self.setup)
        self._replay_held()

    # -- Stream routing -------------------------------------------------------------------------------------

    def _on_stream_data(self, stream_id: int, data: bytes | bytearray | memoryview, fin: bool) -> None:
        if stream_id in self._buffered:
            self._hold(stream_id, data, fin)
        elif self._is_uni(stream_id):
            if self._is_local(stream_id):
                raise protocol_violation(f"data on our own unidirectional stream {stream_id}")
            self._on_uni(stream_id, data, fin)
        elif self._is_local(stream_id):
            self._on_response_data(stream_id, data, fin)
        elif self.setup is None:
            self._hold(stream_id, data, fin)
        else:
            self._on_request_data(stream_id, data, fin)

    def _on_uni(self, stream_id: int, data: bytes | bytearray | memoryview, fin: bool) -> None:
        if stream_id == self._control_in:
            self._on_control(data, fin)
            return
        if stream_id in self._parsers or stream_id in self._ignored:
            self._on_data_stream(stream_id, data, fin)
            return
        buf = self._untyped.pop(stream_id, b"") + bytes(data)
        try:
            stype = Reader(buf, True).varint()
        except NeedMore:
            if not fin:
                self._untyped[stream_id] = buf
            return
        if stype == SETUP_STREAM:
            if self._control_in is not None:
                raise protocol_violation("a second control stream")
            self._control_in = stream_id
            self._on_control(buf, fin)
        elif self.setup is None:
            self._hold(stream_id, buf, fin)
        else:
            self._on_data_stream(stream_id, buf, fin)

    def _on_control(self, data: bytes | bytearray | memoryview, fin: bool) -> None:
        for msg in self._control_parser.feed(data):
            if isinstance(msg, Setup):
                self._on_setup(msg)
            elif isinstance(msg, Goaway):
                self._on_control_goaway(msg)
            else:
                raise protocol_violation(f"{msg.NAME} on the control stream")
        if fin:
            raise protocol_violation("the control stream was closed")

    def _on_control_goaway(self, msg: Goaway) -> None:
        if self.goaway_received:
            raise protocol_violation("a second GOAWAY")
        if msg.new_session_uri and self.role is Role.SERVER:
            raise protocol_violation("a client's GOAWAY carried a URI")
        if msg.request_id is not None and msg.request_id % 2 != self._next_request_id % 2:
            raise MoqtError(SessionErrorCode.INVALID_REQUEST_ID, "GOAWAY names a request id of the wrong parity")
        self.goaway_received = True
        self._events.append(GoawayReceived(msg.new_session_uri, msg.timeout, msg.request_id))

    def _on_stream_reset(self, stream_id: int, error_code: int) -> None:
        if stream_id == self._control_in:
            raise protocol_violation("the control stream was reset")
        if self._is_uni(stream_id):
            self._untyped.pop(stream_id, None)
            if not self._is_local(stream_id):
                self._on_data_stream_reset(stream_id, error_code)
            return
        self._buffered.pop(stream_id, None)
        self._request_stream_cancelled(stream_id, error_code)

    def _on_request_stream_stopped(self, stream_id: int, error_code: int) -> None:
        if stream_id == self._control_out:
            raise protocol_violation("the peer stopped our control stream")
        if not self._is_uni(stream_id):
            self._request_stream_cancelled(stream_id, error_code)

    # -- Request ids ----------------------------------------------------------------------------------------

    def _accept_request_id(self, rid: int) -> None:
        if rid % 2 != self._peer_parity():
            raise MoqtError(SessionErrorCode.INVALID_REQUEST_ID, f"request id {rid} has the wrong parity")
        if not self._peer_ids.add(rid):
            raise MoqtError(SessionErrorCode.INVALID_REQUEST_ID, f"request id {rid} was used before")

    # -- The peer's request streams --------------------------------------------------------------------------

    def _on_request_data(self, stream_id: int, data: bytes | bytearray | memoryview, fin: bool) -> None:
        parser = self._stream_parsers.get(stream_id)
        if parser is None:
            if stream_id in self._stream_request or stream_id <= self._max_peer_bidi:
                return  # a request we finished with (its state is forgotten): ignore what trails it
            self._max_peer_bidi = stream_id
            parser = self._stream_parsers[stream_id] = ControlParser(Draft.D18)
        for msg in parser.feed(data):
            if self._stream_parsers.get(stream_id) is not parser:
                return  # the request ended (and was forgotten) with an earlier message
            self._on_requester_message(stream_id, msg)
        if fin and self._stream_parsers.get(stream_id) is parser:
            self._stream_parsers.pop(stream_id, None)
            if parser.pending:
                raise protocol_violation("a request stream ended inside a message")
            self._requester_finished(stream_id)

    def _on_requester_message(self, sid: int, msg: Message) -> None:
        rid = self._stream_request.get(sid)
        if rid is None:
            if not isinstance(msg, FIRST_ON_REQUEST_STREAM):
                raise protocol_violation(f"a request stream begins with {msg.NAME}")
            self._accept_request_id(msg.request_id)
            self._stream_request[sid] = msg.request_id
            self._on_new_request(sid, msg)
            return
        req = self.requests[rid]
        if isinstance(msg, Goaway):
            self._stream_goaway(sid, req, msg)
        elif isinstance(msg, RequestUpdate):
            self._accept_request_id(msg.request_id)
            if req.kind not in (Kind.SUBSCRIBE, Kind.FETCH, Kind.PUBLISH_NAMESPACE, Kind.SUBSCRIBE_NAMESPACE):
                raise protocol_violation(f"REQUEST_UPDATE of a {req.kind.value} request")
            if req.state is RState.DONE:
                return
            self.requests[msg.request_id] = Request(msg.request_id, Kind.UPDATE, False, stream_id=sid, target=rid)
            p = msg.params
            if p.subscription_filter is not None:
                req.filter = p.subscription_filter
            if p.forward is not None:
                req.forward = p.forward
            self._events.append(UpdateRequested(msg.request_id, rid, p.subscription_filter, p.subscriber_priority,
                                                p.forward, True, p))
        elif req.state is not RState.DONE or req.kind not in (Kind.PUBLISH, Kind.SUBSCRIBE_TRACKS):
            raise protocol_violation(f"{msg.NAME} from the requester on a request stream")

    def _on_new_request(self, sid: int, msg: Message) -> None:
        match msg:
            case Subscribe():
                p = msg.params
                tokens = self._check_tokens(p.auth_tokens)
                order = p.group_order or GroupOrder.PUBLISHER
                forward = True if p.forward is None else p.forward
                priority = 128 if p.subscriber_priority is None else p.subscriber_priority
                self._register(sid, msg.request_id, Kind.SUBSCRIBE, msg.namespace, msg.track_name,
                               filter=p.subscription_filter, forward=forward, group_order=order, priority=priority)
                self._events.append(SubscribeRequested(msg.request_id, msg.namespace, msg.track_name, priority, order,
                                                       forward, p.subscription_filter, tokens, p))
            case Fetch():
                self._on_fetch(sid, msg)
            case TrackStatus():
                tokens = self._check_tokens(msg.params.auth_tokens)
                self._register(sid, msg.request_id, Kind.TRACK_STATUS, msg.namespace, msg.track_name)
                self._events.append(TrackStatusRequested(msg.request_id, msg.namespace, msg.track_name, tokens,
                                                         msg.params))
            case PublishNamespace():
                tokens = self._check_tokens(msg.params.auth_tokens)
                self._register(sid, msg.request_id, Kind.PUBLISH_NAMESPACE, msg.namespace)
                self._events.append(PublishNamespaceRequested(msg.request_id, msg.namespace, tokens, msg.params))
            case SubscribeNamespace():
                tokens = self._check_tokens(msg.params.auth_tokens)
                self._register(sid, msg.request_id, Kind.SUBSCRIBE_NAMESPACE, msg.namespace)
                self._events.append(SubscribeNamespaceRequested(msg.request_id, msg.namespace, tokens, msg.params))
            case Publish() | SubscribeTracks():  # not implemented: refused
                kind = Kind.PUBLISH if isinstance(msg, Publish) else Kind.SUBSCRIBE_TRACKS
                req = self._register(sid, msg.request_id, kind, msg.namespace)
                self._reply(req, RequestError(RequestErrorCode18.NOT_SUPPORTED, 0, msg.NAME.encode()), fin=True)
                self._forget(req)

    def _on_fetch(self, sid: int, msg: Fetch) -> None:
        p = msg.params
        tokens = self._check_tokens(p.auth_tokens)
        order = p.group_order or GroupOrder.ASCENDING
        priority = 128 if p.subscriber_priority is None else p.subscriber_priority
        target = msg.target
        if isinstance(target, StandaloneFetch):
            self._register(sid, msg.request_id, Kind.FETCH, target.namespace, target.track_name, start=target.start,
                           group_order=order, priority=priority)
            self._events.append(FetchRequested(msg.request_id, target.namespace, target.track_name, target, priority,
                                               order, tokens, p))
            return
        req = self._register(sid, msg.request_id, Kind.FETCH, group_order=order, target=target.request_id,
                             priority=priority)
        sub = self.requests.get(target.request_id)
        code = None
        if sub is None or sub.local or sub.kind is not Kind.SUBSCRIBE or sub.state is RState.DONE:
            code = RequestErrorCode18.INVALID_JOINING_REQUEST_ID
        elif not sub.forward:
            code = RequestErrorCode18.INVALID_RANGE
        if code is not None:
            self._reply(req, RequestError(code, 0, b"cannot join that subscription"), fin=True)
            self._forget(req)
            return
        assert sub is not None
        req.namespace, req.track_name = sub.namespace, sub.track_name
        self._events.append(FetchRequested(msg.request_id, sub.namespace, sub.track_name, target, priority, order,
                                           tokens, p))

    def _register(self, sid: int, rid: int, kind: Kind, namespace: Namespace = (), name: bytes = b"",
                  **kw: object) -> Request:
        req = Request(rid, kind, False, namespace=namespace, track_name=name, stream_id=sid,
                      **kw)  # type: ignore[arg-type]
        self.requests[rid] = req
        return req

    def _requester_finished(self, sid: int) -> None:
        """The requester closed its side (FIN): for namespace requests that withdraws them."""
        rid = self._stream_request.get(sid)
        req = self.requests.get(rid) if rid is not None else None
        if req is None or req.state is RState.DONE:
            return
        if req.kind is Kind.PUBLISH_NAMESPACE:
            self._events.append(PublishNamespaceDone(req.request_id, req.namespace))
            self._finish_stream(sid)
            self._forget(req)
        elif req.kind is Kind.SUBSCRIBE_NAMESPACE:
            self._events.append(SubscribeNamespaceEnded(req.request_id, req.namespace))
            self._finish_stream(sid)
            self._forget(req)

    # -- Our request streams --------------------------------------------------------------------------------

    def _open_request(self, req: Request, msg: Message, priority: int = 128) -> None:
        sid = self._open_stream(False, priority)
        req.stream_id = sid
        self._stream_request[sid] = req.request_id
        self._stream_parsers[sid] = ControlParser(Draft.D18)
        self._send(sid, encode_message(msg, Draft.D18))

    def _on_response_data(self, stream_id: int, data: bytes | bytearray | memoryview, fin: bool) -> None:
        parser = self._stream_parsers.get(stream_id)
        if parser is None:
            if stream_id < self._next_bidi:
                return  # a request we cancelled or finished with: ignore what trails it
            raise protocol_violation(f"data on bidirectional stream {stream_id}, which we did not open")
        for msg in parser.feed(data):
            if self._stream_parsers.get(stream_id) is not parser:
                return  # the request ended (and was forgotten) with an earlier message
            self._on_response(stream_id, msg)
        if fin and self._stream_parsers.get(stream_id) is parser:
            self._stream_parsers.pop(stream_id, None)
            if parser.pending:
                raise protocol_violation("a request stream ended inside a message")
            self._responder_finished(stream_id)

    def _on_response(self, sid: int, msg: Message) -> None:
        req = self.requests[self._stream_request[sid]]
        rid = req.request_id
        if isinstance(msg, Goaway):
            self._stream_goaway(sid, req, msg)
            return
        if not req.replied:
            req.replied = True
            self._first_reply(req, msg)
            return
        if req.state is RState.DONE and req.kind is not Kind.SUBSCRIBE:
            return  # we cancelled it; late messages
        match msg:
            case RequestOk() | RequestError():
                if not req.pending_updates:
                    raise protocol_violation(f"{msg.NAME} on request {rid}'s stream, but no update awaits a reply")
                uid = req.pending_updates.popleft()
                self.requests.pop(uid, None)
                if isinstance(msg, RequestOk):
                    self._events.append(UpdateAccepted(uid, msg.params))
                else:
                    self._events.append(RequestRejected(uid, msg.error_code, msg.reason, msg.retry_interval,
                                                        msg.redirect))
            case PublishDoneMsg() if req.kind is Kind.SUBSCRIBE:
                if req.state is not RState.DONE:
                    req.state = RState.DONE
                    self._events.append(PublishDone(rid, msg.status_code, msg.stream_count, msg.reason))
            case NamespaceMsg() | NamespaceDone() if req.kind is Kind.SUBSCRIBE_NAMESPACE:
                full = req.namespace + msg.suffix
                if isinstance(msg, NamespaceMsg):
                    req.namespaces.add(full)
                    self._events.append(NamespaceReceived(rid, full, True))
                else:
                    if full not in req.namespaces:
                        raise protocol_violation("NAMESPACE_DONE before its NAMESPACE")
                    req.namespaces.discard(full)
                    self._events.append(NamespaceReceived(rid, full, False))
            case _:
                raise protocol_violation(f"{msg.NAME} on the stream of a {req.kind.value} request")

    def _first_reply(self, req: Request, msg: Message) -> None:
        rid = req.request_id
        if isinstance(msg, RequestError):
            self._events.append(RequestRejected(rid, msg.error_code, msg.reason, msg.retry_interval, msg.redirect))
            self._forget(req)
            return
        ok = {Kind.SUBSCRIBE: SubscribeOk, Kind.FETCH: FetchOk}.get(req.kind, RequestOk)
        if not isinstance(msg, ok):
            raise protocol_violation(f"{msg.NAME} is not a reply to a {req.kind.value} request")
        if req.state is RState.DONE:
            return  # cancelled meanwhile
        match msg:
            case SubscribeOk():
                self._bind_alias(msg.track_alias, rid)
                req.state, req.track_alias = RState.ACTIVE, msg.track_alias
                self._events.append(SubscribeAccepted(rid, msg.track_alias, msg.params.expires or 0,
                                                      _property_order(msg.properties), msg.params.largest_object,
                                                      msg.params, msg.properties))
            case FetchOk():
                if req.start is not None and msg.end_location.group < req.start.group:
                    raise protocol_violation("FETCH_OK end location precedes the fetch's start")
                req.state = RState.ACTIVE
                self._events.append(FetchAccepted(rid, msg.end_location, msg.end_of_track, req.group_order,
                                                  msg.params, msg.properties))
                if req.data_ended:
                    self._forget(req)
            case RequestOk():
                if req.kind is Kind.TRACK_STATUS:
                    self._events.append(TrackStatusReceived(rid, msg.params.largest_object, msg.params.expires or 0,
                                                            _property_order(msg.properties), msg.params,
                                                            msg.properties))
                    self._forget(req)
                elif msg.properties:
                    raise protocol_violation(f"track properties in the REQUEST_OK of a {req.kind.value} request")
                elif req.kind is Kind.PUBLISH_NAMESPACE:
                    req.state = RState.ACTIVE
                    self._events.append(PublishNamespaceAccepted(rid))
                else:
                    req.state = RState.ACTIVE
                    self._events.append(SubscribeNamespaceAccepted(rid))

    def _responder_finished(self, sid: int) -> None:
        req = self.requests[self._stream_request[sid]]
        if req.state is RState.DONE or req.kind in (Kind.FETCH, Kind.TRACK_STATUS):
            return
        req.state = RState.DONE
        if req.kind is Kind.SUBSCRIBE_NAMESPACE:
            for ns in sorted(req.namespaces):
                self._events.append(NamespaceReceived(req.request_id, ns, False))
            req.namespaces.clear()
        elif req.kind is Kind.PUBLISH_NAMESPACE:
            self._events.append(PublishNamespaceCancelled(req.request_id, req.namespace))
        else:
            self._events.append(RequestCancelled(req.request_id, 0))
        if req.kind is not Kind.SUBSCRIBE:  # our subscription stays until unsubscribe(): objects may trail
            self._forget(req)

    def _stream_goaway(self, sid: int, req: Request, msg: Goaway) -> None:
        if sid in self._goaway_streams:
            raise protocol_violation("a second GOAWAY on one request stream")
        self._goaway_streams.add(sid)
        self._events.append(GoawayReceived(msg.new_session_uri, msg.timeout, None, req.request_id))

    # -- Cancellation ---------------------------------------------------------------------------------------

    def _request_stream_cancelled(self, sid: int, code: int) -> None:
        """The peer reset or stopped request stream *sid*: the request is over."""
        rid = self._stream_request.get(sid)
        req = self.requests.get(rid) if rid is not None else None
        if req is None or req.state is RState.DONE:
            return
        req.state = RState.DONE
        for writer in list(self._writers.values()):
            if writer.request_id == req.request_id:
                writer.reset(StreamResetCode.CANCELLED)
        if sid not in self._fin_sent:
            self._fin_sent.add(sid)
            self._reset_stream(sid, StreamResetCode.CANCELLED)
        self._stream_parsers.pop(sid, None)
        if req.kind is not Kind.SUBSCRIBE or not req.local:
            self._forget(req)
        if req.local:
            if req.kind is Kind.PUBLISH_NAMESPACE:
                self._events.append(PublishNamespaceCancelled(req.request_id, req.namespace, code))
                return
            for ns in sorted(req.namespaces):
                self._events.append(NamespaceReceived(req.request_id, ns, False))
            self._events.append(RequestCancelled(req.request_id, code))
            return
        match req.kind:
            case Kind.SUBSCRIBE:
                self._events.append(Unsubscribed(req.request_id))
            case Kind.FETCH:
                self._events.append(FetchCancelled(req.request_id))
            case Kind.PUBLISH_NAMESPACE:
                self._events.append(PublishNamespaceDone(req.request_id, req.namespace))
            case Kind.SUBSCRIBE_NAMESPACE:
                self._events.append(SubscribeNamespaceEnded(req.request_id, req.namespace))
            case _:
                self._events.append(RequestCancelled(req.request_id, code))

    def _send_cancel(self, req: Request) -> None:
        sid = req.stream_id
        assert sid is not None
        if sid not in self._fin_sent:
            self._fin_sent.add(sid)
            self._reset_stream(sid, StreamResetCode.CANCELLED)
        self._stop_sending(sid, StreamResetCode.CANCELLED)
        self._stream_parsers.pop(sid, None)

    def _send_publish_namespace_cancel(self, req: Request, code: int, reason: bytes) -> None:
        sid = req.stream_id
        assert sid is not None
        if sid not in self._fin_sent:
            self._fin_sent.add(sid)
            self._reset_stream(sid, code)
        self._stop_sending(sid, code)
        self._stream_parsers.pop(sid, None)

    def _finish_stream(self, sid: int) -> None:
        if sid not in self._fin_sent and not self.closed:
            self._fin_sent.add(sid)
            self._send(sid, b"", True)

    # -- Sending requests --------------------------------------------------------------------------------------

    def _send_subscribe(self, req: Request, priority: int) -> None:
        params = Params18(
            subscriber_priority=None if priority == 128 else priority,
            group_order=None if req.group_order is GroupOrder.PUBLISHER else req.group_order,
            forward=None if req.forward else False, subscription_filter=req.filter)
        self._open_request(req, Subscribe(req.request_id, req.namespace, req.track_name, params), priority)

    def _send_fetch(self, req: Request, target: FetchTarget, priority: int, order: GroupOrder) -> None:
        params = Params18(subscriber_priority=None if priority == 128 else priority,
                          group_order=GroupOrder.DESCENDING if order is GroupOrder.DESCENDING else None)
        self._open_request(req, Fetch(req.request_id, target, params), priority)

    def _send_track_status(self, req: Request) -> None:
        self._open_request(req, TrackStatus(req.request_id, req.namespace, req.track_name))

    def _send_publish_namespace(self, req: Request) -> None:
        self._open_request(req, PublishNamespace(req.request_id, req.namespace))

    def _send_subscribe_namespace(self, req: Request) -> None:
        self._open_request(req, SubscribeNamespace(req.request_id, req.namespace))

    def _send_update(self, req: Request, sub: Request, flt: SubscriptionFilter | None, priority: int | None,
                     forward: bool | None) -> None:
        assert sub.stream_id is not None
        req.stream_id = sub.stream_id
        sub.pending_updates.append(req.request_id)
        params = Params18(subscriber_priority=priority, forward=forward, subscription_filter=flt)
        self._send(sub.stream_id, encode_message(RequestUpdate(req.request_id, params), Draft.D18))

    def _send_goaway(self, uri: bytes, timeout_ms: int) -> None:
        assert self._control_out is not None
        first = self._peer_parity()
        smallest = self._peer_ids.highest + 2 if self._peer_ids.highest >= 0 else first
        self._send(self._control_out, encode_message(Goaway(uri, timeout_ms, smallest), Draft.D18))

    # -- Sending replies ----------------------------------------------------------------------------------------

    def _reply(self, req: Request, msg: Message, *, fin: bool = False) -> None:
        sid = req.stream_id
        assert sid is not None
        if sid in self._fin_sent:
            return  # the request stream is already closed on our side
        if fin:
            self._fin_sent.add(sid)
        self._send(sid, encode_message(msg, Draft.D18), fin)

    def _send_publish_namespace_ok(self, req: Request) -> None:
        self._reply(req, RequestOk())

    def _send_subscribe_namespace_ok(self, req: Request) -> None:
        self._reply(req, RequestOk())

    def _send_subscribe_ok(self, req: Request, expires: int, largest: Location | None) -> None:
        assert req.track_alias is not None
        props: KeyValuePairs = ((DEFAULT_PUBLISHER_GROUP_ORDER, int(req.group_order)),) \
            if req.group_order is GroupOrder.DESCENDING else ()
        self._reply(req, SubscribeOk(req.track_alias, Params18(expires=expires or None, largest_object=largest),
                                     props))

    def _send_fetch_ok(self, req: Request, end: Location, end_of_track: bool) -> None:
        self._reply(req, FetchOk(end, end_of_track))

    def _send_track_status_ok(self, req: Request, largest: Location | None, expires: int, order: GroupOrder) -> None:
        props: KeyValuePairs = ((DEFAULT_PUBLISHER_GROUP_ORDER, int(order)),) \
            if order is GroupOrder.DESCENDING else ()
        self._reply(req, RequestOk(Params18(expires=expires or None, largest_object=largest), props), fin=True)

    def _send_error(self, req: Request, code: int, reason: bytes, retry_interval: int,
                    redirect: Redirect | None) -> None:
        try:
            msg = RequestError(code, retry_interval, reason, redirect)
        except ValueError as exc:
            raise MoqtUsageError(str(exc)) from None
        if req.kind is not Kind.UPDATE:
            self._reply(req, msg, fin=True)
            return
        # A failed update ends what it updated.
        assert req.target is not None
        target = self.requests[req.target]
        self._reply(target, msg)
        if target.state is RState.DONE:
            return
        if target.kind is Kind.SUBSCRIBE:
            self._reply(target, PublishDoneMsg(PublishDoneCode18.UPDATE_FAILED, target.data_streams), fin=True)
        else:
            if target.writer is not None:
                target.writer.reset(StreamResetCode.CANCELLED)
            if target.stream_id is not None:
                self._finish_stream(target.stream_id)
        self._forget(target)

    def _send_publish_done(self, req: Request, code: int, reason: bytes, stream_count: int) -> None:
        self._reply(req, PublishDoneMsg(code, stream_count, reason), fin=True)

    def _fetch_stream_closed(self, req: Request) -> None:
        if req.stream_id is not None and not req.local:
            self._finish_stream(req.stream_id)

    # -- Draft 18 API -----------------------------------------------------------------------------------------

    def accept_update(self, request_id: int) -> None:
        req = self._theirs(request_id, Kind.UPDATE, pending=True)
        req.replied = True
        assert req.target is not None
        target = self.requests.get(req.target)
        if target is not None:
            self._reply(target, RequestOk())
        self._forget(req)

    def _forget_streams(self, req: Request) -> None:
        sid = req.stream_id
        if sid is None or req.kind is Kind.UPDATE:
            return  # an update shares its request's stream
        if req.local:
            self._finish_stream(sid)  # close our side gracefully (a no-op if it is closed already)
        self._stream_request.pop(sid, None)
        self._stream_parsers.pop(sid, None)
        self._fin_sent.discard(sid)
        self._goaway_streams.discard(sid)
        for uid in req.pending_updates:
            self.requests.pop(uid, None)

    def send_namespace(self, request_id: int, namespace: Namespace, *, active: bool = True) -> None:
        req = self._theirs(request_id, Kind.SUBSCRIBE_NAMESPACE, pending=False)
        prefix = req.namespace
        if namespace[:len(prefix)] != prefix:
            raise MoqtUsageError(f"namespace {namespace!r} does not start with the prefix {prefix!r}")
        if active:
            req.namespaces.add(namespace)
        elif namespace not in req.namespaces:
            raise MoqtUsageError("NAMESPACE_DONE for a namespace never sent with NAMESPACE")
        else:
            req.namespaces.discard(namespace)
        suffix = namespace[len(prefix):]
        self._reply(req, NamespaceMsg(suffix) if active else NamespaceDone(suffix))


class _IdSet:
    """The peer's request ids seen so far (draft 18 forbids duplicates): everything below a watermark, and the
    ids above it, so that memory stays flat while the peer numbers its requests in order."""

    def __init__(self, parity: int) -> None:
        self._low = parity  # every id of this parity below it has been seen
        self._above: set[int] = set()
        self.highest = -1

    def add(self, rid: int) -> bool:
        """Record *rid*; False if it was seen before."""
        if rid < self._low or rid in self._above:
            return False
        self._above.add(rid)
        self.highest = max(self.highest, rid)
        while self._low in self._above:
            self._above.remove(self._low)
            self._low += 2
        return True


def _property_order(properties: KeyValuePairs) -> GroupOrder | None:
    value = kvp_value(properties, DEFAULT_PUBLISHER_GROUP_ORDER)
    if value is None:
        return None
    if value not in (1, 2):
        raise protocol_violation(f"DEFAULT_PUBLISHER_GROUP_ORDER is {value!r}")
    return GroupOrder(value)
