"""moqt session state machine: a client and a server session wired back to back (moqt.testing.SessionPair), both
drafts, and one test per kind of malformed input with the termination code the draft prescribes."""

from __future__ import annotations

import pytest

from moqt import messages14 as m14
from moqt import messages18 as m18
from moqt.actions import CloseSession, ResetStream, SendDatagram, SendStreamData, StopSending
from moqt.control import encode_message
from moqt.errors import (
    FetchErrorCode14,
    MoqtUsageError,
    PublishDoneCode14,
    PublishDoneCode18,
    RequestErrorCode14,
    RequestErrorCode18,
    SessionErrorCode,
    StreamResetCode,
)
from moqt.events import (
    DataStreamOpened,
    Event,
    FetchAccepted,
    FetchCancelled,
    FetchRequested,
    GoawayReceived,
    NamespaceReceived,
    ObjectReceived,
    PublishDone,
    PublishNamespaceAccepted,
    PublishNamespaceCancelled,
    PublishNamespaceDone,
    PublishNamespaceRequested,
    RequestCancelled,
    RequestRejected,
    RequestsBlockedReceived,
    SessionClosed,
    SetupCompleted,
    StreamEnded,
    StreamStopped,
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
from moqt.session import MoqtSession, Role, SessionConfig
from moqt.sessions import new_session, session_for_alpn
from moqt.testing import SessionPair
from moqt.types import (
    AliasType,
    AuthToken,
    Draft,
    FilterType,
    GroupOrder,
    JoiningFetch,
    Location,
    ObjectStatus,
    StandaloneFetch,
    SubscriptionFilter,
)
from moqt.varint import encode_vi64

E = SessionErrorCode
NS = (b"kvsp-1", b"0123abcd", b"scope", b"holder", b"0")
TRACK = b"block-key"
DRAFTS = pytest.mark.parametrize("draft", list(Draft), ids=lambda d: f"d{d.value}")


def ready(draft: Draft, **kw: object) -> SessionPair:
    pair = SessionPair(draft, **kw)  # type: ignore[arg-type]
    pair.handshake()
    return pair


# -- Setup ---------------------------------------------------------------------------------------------------------


@DRAFTS
def test_setup(draft: Draft) -> None:
    pair = ready(draft, client_config=SessionConfig(path=b"/moq?x=1", authority=b"holder.example:4443"))
    s = pair.server_events.last(SetupCompleted)
    c = pair.client_events.last(SetupCompleted)
    assert s.path == b"/moq?x=1" and s.authority == b"holder.example:4443" and s.implementation == b"kvsp-quic"
    assert c.path is None and c.draft is draft
    assert (s.version, c.version) == ((0xFF00000E, 0xFF00000E) if draft is Draft.D14 else (None, None))
    assert pair.client.setup_done and pair.server.setup_done
    opened = [a for a in pair.client.take_actions()]
    assert opened == []


def test_alpn_selects_the_draft() -> None:
    assert session_for_alpn("moq-00", Role.CLIENT).draft is Draft.D14
    assert session_for_alpn("moqt-18", Role.SERVER).draft is Draft.D18
    with pytest.raises(ValueError):
        session_for_alpn("h3", Role.SERVER)


def test_draft18_control_streams_are_unidirectional() -> None:
    pair = SessionPair(Draft.D18)
    pair.client.start()
    pair.server.start()
    client_actions = pair.client.take_actions()
    assert client_actions[0].stream_id == 2 and client_actions[0].unidirectional  # type: ignore[union-attr]
    assert isinstance(client_actions[1], SendStreamData) and client_actions[1].data[:2] == b"\xaf\x00"
    server_actions = pair.server.take_actions()
    assert server_actions[0].stream_id == 3  # type: ignore[union-attr]


# -- PUBLISH_NAMESPACE -------------------------------------------------------------------------------------------


@DRAFTS
def test_publish_namespace_accept_and_done(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.publish_namespace(NS)
    pair.pump()
    req = pair.server_events.last(PublishNamespaceRequested)
    assert (req.request_id, req.namespace) == (rid, NS)
    pair.server.accept_publish_namespace(rid)
    pair.pump()
    assert pair.client_events.last(PublishNamespaceAccepted).request_id == rid
    pair.client.publish_namespace_done(rid)
    pair.pump()
    assert pair.server_events.last(PublishNamespaceDone) == PublishNamespaceDone(rid, NS)


@DRAFTS
def test_publish_namespace_cancel_and_reject(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.publish_namespace(NS)
    pair.pump()
    pair.server.accept_publish_namespace(rid)
    pair.server.cancel_publish_namespace(rid, 1, b"token expired")
    pair.pump()
    cancelled = pair.client_events.last(PublishNamespaceCancelled)
    assert (cancelled.request_id, cancelled.namespace, cancelled.error_code) == (rid, NS, 1)
    rid2 = pair.client.publish_namespace((b"other",))
    pair.pump()
    code = RequestErrorCode14.UNAUTHORIZED if draft is Draft.D14 else RequestErrorCode18.UNAUTHORIZED
    pair.server.reject(rid2, code, b"no")
    pair.pump()
    assert pair.client_events.last(RequestRejected) == RequestRejected(rid2, code, b"no")
    assert not pair.client.closed and not pair.server.closed


# -- SUBSCRIBE_NAMESPACE -----------------------------------------------------------------------------------------


@DRAFTS
def test_subscribe_namespace(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.subscribe_namespace(NS[:1])
    pair.pump()
    assert pair.server_events.last(SubscribeNamespaceRequested).prefix == NS[:1]
    pair.server.accept_subscribe_namespace(rid)
    pair.pump()
    assert pair.client_events.last(SubscribeNamespaceAccepted).request_id == rid
    if draft is Draft.D18:
        pair.server.send_namespace(rid, NS)
        pair.server.send_namespace(rid, NS, active=False)
        pair.pump()
        assert pair.client_events.of(NamespaceReceived) == [NamespaceReceived(rid, NS, True),
                                                            NamespaceReceived(rid, NS, False)]
    else:
        with pytest.raises(MoqtUsageError):
            pair.server.send_namespace(rid, NS)
        announced = pair.server.publish_namespace(NS)
        pair.pump()
        assert pair.client_events.last(PublishNamespaceRequested).request_id == announced
    pair.client.unsubscribe_namespace(rid)
    pair.pump()
    assert pair.server_events.last(SubscribeNamespaceEnded) == SubscribeNamespaceEnded(rid, NS[:1])


# -- SUBSCRIBE -----------------------------------------------------------------------------------------------------


@DRAFTS
def test_subscribe_objects_and_publish_done(draft: Draft) -> None:
    pair = ready(draft, chunk=7)
    rid = pair.client.subscribe(NS, TRACK, subscriber_priority=10, group_order=GroupOrder.ASCENDING)
    pair.pump()
    req = pair.server_events.last(SubscribeRequested)
    assert (req.namespace, req.track_name, req.subscriber_priority, req.forward) == (NS, TRACK, 10, True)
    assert req.filter == (SubscriptionFilter(FilterType.LARGEST_OBJECT) if draft is Draft.D14 else None)
    alias = pair.server.accept_subscribe(rid, expires=30000, largest=Location(4, 1))
    pair.pump()
    ok = pair.client_events.last(SubscribeAccepted)
    assert (ok.track_alias, ok.expires, ok.largest) == (alias, 30000, Location(4, 1))
    for group in (5, 6):
        w = pair.server.open_subgroup(rid, group, extensions=True, end_of_group=True)
        w.write_object(0, b"first", extensions=((2, 9),))
        w.begin_object(1, 10)
        w.write(b"01234")
        w.write(memoryview(b"56789"))
        w.begin_object(2, 0, status=ObjectStatus.END_OF_GROUP)
        w.finish()
    pair.pump()
    opened = pair.client_events.of(DataStreamOpened)
    assert [(o.request_id, o.track_alias, o.group, o.end_of_group) for o in opened] == [
        (rid, alias, 5, True), (rid, alias, 6, True)]
    assert pair.payloads[(rid, 5, 0)] == b"first" and pair.payloads[(rid, 6, 1)] == b"0123456789"
    eog = [e for e in pair.client_events.of(ObjectReceived) if e.status is ObjectStatus.END_OF_GROUP]
    assert len(eog) == 2
    assert len(pair.client_events.of(StreamEnded)) == 2
    code = PublishDoneCode14.TRACK_ENDED if draft is Draft.D14 else PublishDoneCode18.TRACK_ENDED
    pair.server.publish_done(rid, code, b"end")
    pair.pump()
    assert pair.client_events.last(PublishDone) == PublishDone(rid, code, 2, b"end")


@DRAFTS
def test_unsubscribe_resets_open_streams(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.subscribe(NS, TRACK)
    pair.pump()
    pair.server.accept_subscribe(rid)
    w = pair.server.open_subgroup(rid, 0)
    w.write_object(0, b"x")
    pair.pump()
    pair.client.unsubscribe(rid)
    pair.pump()
    assert pair.server_events.last(Unsubscribed).request_id == rid
    assert w.closed
    assert any(isinstance(a, ResetStream) and a.stream_id == w.stream_id for a in pair.sent("server"))
    with pytest.raises(MoqtUsageError):
        w.write_object(1, b"y")


@DRAFTS
def test_subscription_update(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.subscribe(NS, TRACK, filter=SubscriptionFilter(FilterType.ABSOLUTE_START, Location(2, 0)))
    pair.pump()
    pair.server.accept_subscribe(rid)
    pair.pump()
    new = SubscriptionFilter(FilterType.ABSOLUTE_RANGE, Location(3, 0), 9)
    uid = pair.client.update_subscription(rid, filter=new, subscriber_priority=3, forward=False)
    pair.pump()
    upd = pair.server_events.last(UpdateRequested)
    assert (upd.request_id, upd.target_request_id, upd.filter, upd.subscriber_priority, upd.forward) == (
        uid, rid, new, 3, False)
    assert upd.reply_required == (draft is Draft.D18)
    if draft is Draft.D18:
        pair.server.accept_update(uid)
        pair.pump()
        assert pair.client_events.last(UpdateAccepted).request_id == uid
        uid2 = pair.client.update_subscription(rid, forward=True)
        pair.pump()
        pair.server.reject(uid2, RequestErrorCode18.INVALID_RANGE)
        pair.pump()
        assert pair.client_events.last(RequestRejected).request_id == uid2
        assert pair.client_events.last(PublishDone).status_code == PublishDoneCode18.UPDATE_FAILED
    else:
        with pytest.raises(MoqtUsageError):
            pair.server.accept_update(uid)


# -- FETCH ---------------------------------------------------------------------------------------------------------


@DRAFTS
@pytest.mark.parametrize("chunk", [None, 16384, 1000])
def test_standalone_fetch_of_a_32_object_group(draft: Draft, chunk: int | None) -> None:
    """The KVSP shape: FETCH group 0 of a block track; object id = layer index; payloads sent in pieces."""
    pair = ready(draft, chunk=chunk)
    rid = pair.client.fetch(NS, TRACK, Location(0, 0), Location(1, 0), subscriber_priority=1)
    pair.pump()
    req = pair.server_events.last(FetchRequested)
    assert req.target == StandaloneFetch(NS, TRACK, Location(0, 0), Location(1, 0))
    assert req.subscriber_priority == 1
    layers = [bytes([i]) * 40_000 + i.to_bytes(2, "big") for i in range(32)]
    writer = pair.server.accept_fetch(rid, Location(0, 32), end_of_track=True)
    for i, payload in enumerate(layers):
        view = memoryview(payload)
        writer.begin_object(0, i, len(payload))
        for off in range(0, len(payload), 12_000):
            writer.write(view[off:off + 12_000])
    writer.finish()
    pair.pump()
    accepted = pair.client_events.last(FetchAccepted)
    assert (accepted.end_location, accepted.end_of_track) == (Location(0, 32), True)
    assert [bytes(pair.payloads[(rid, 0, i)]) for i in range(32)] == layers
    pieces = pair.client_events.of(ObjectReceived)
    assert len(pieces) > 32 and all(p.length == 40_002 for p in pieces)
    assert pair.client_events.last(StreamEnded).request_id == rid
    assert not pair.client.closed and not pair.server.closed


@DRAFTS
def test_joining_fetch(draft: Draft) -> None:
    pair = ready(draft)
    sub = pair.client.subscribe(NS, TRACK)
    pair.pump()
    pair.server.accept_subscribe(sub, largest=Location(7, 3))
    pair.pump()
    rid = pair.client.joining_fetch(sub, 2)
    abs_rid = pair.client.joining_fetch(sub, 5, absolute=True)
    pair.pump()
    reqs = pair.server_events.of(FetchRequested)
    assert [(r.request_id, r.namespace, r.track_name, r.target) for r in reqs] == [
        (rid, NS, TRACK, JoiningFetch(sub, 2)), (abs_rid, NS, TRACK, JoiningFetch(sub, 5, absolute=True))]
    w = pair.server.accept_fetch(rid, Location(7, 4))
    w.write_object(5, 0, b"g5")
    w.write_object(7, 3, b"g7")
    w.finish()
    pair.pump()
    assert pair.payloads[(rid, 5, 0)] == b"g5" and pair.payloads[(rid, 7, 3)] == b"g7"


@DRAFTS
def test_joining_fetch_of_an_unknown_subscription_is_refused(draft: Draft) -> None:
    server = _server(draft)
    msg: Message = m14.Fetch(0, JoiningFetch(8, 1)) if draft is Draft.D14 else m18.Fetch(0, JoiningFetch(8, 1))
    events = server.receive_stream_data(0, encode_message(msg, draft))
    assert events == []
    reply = [a for a in server.take_actions() if isinstance(a, SendStreamData)][-1]
    from moqt.control import decode_message
    decoded, _ = decode_message(draft, reply.data)
    if draft is Draft.D14:
        assert decoded == m14.FetchError(0, FetchErrorCode14.INVALID_JOINING_REQUEST_ID, b"no such subscription")
    else:
        assert isinstance(decoded, m18.RequestError) and reply.fin
        assert decoded.error_code == RequestErrorCode18.INVALID_JOINING_REQUEST_ID
    assert 0 not in server.requests and not server.closed


@DRAFTS
def test_fetch_cancel_midway(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
    pair.pump()
    w = pair.server.accept_fetch(rid, Location(0, 4))
    w.begin_object(0, 0, 100)
    w.write(b"a" * 50)
    pair.pump()
    before = len(pair.client_events.of(ObjectReceived))
    assert before == 1
    pair.client.cancel_fetch(rid)
    pair.pump()
    assert pair.server_events.last(FetchCancelled).request_id == rid
    assert w.closed or w.stopped is not None
    assert any(isinstance(a, StopSending) and a.stream_id == w.stream_id for a in pair.sent("client"))
    with pytest.raises(MoqtUsageError):
        w.write(b"b" * 50)
    assert len(pair.client_events.of(ObjectReceived)) == before
    assert not pair.client.closed and not pair.server.closed


@DRAFTS
def test_fetch_reply_after_cancel_is_ignored(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
    pair.pump()
    pair.client.cancel_fetch(rid)
    if draft is Draft.D14:  # the FETCH_OK crosses the FETCH_CANCEL
        pair.server.accept_fetch(rid, Location(0, 1)).finish()
    pair.pump()
    assert not pair.client.closed and not pair.client_events.of(FetchAccepted)


@DRAFTS
def test_track_status(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.track_status(NS, TRACK)
    pair.pump()
    assert pair.server_events.last(TrackStatusRequested).track_name == TRACK
    pair.server.accept_track_status(rid, largest=Location(3, 9), group_order=GroupOrder.DESCENDING)
    pair.pump()
    got = pair.client_events.last(TrackStatusReceived)
    assert (got.request_id, got.largest, got.group_order) == (rid, Location(3, 9), GroupOrder.DESCENDING)


# -- GOAWAY, close, datagrams --------------------------------------------------------------------------------------


@DRAFTS
def test_goaway(draft: Draft) -> None:
    pair = ready(draft)
    pair.server.goaway(b"moqt://next.example/", timeout_ms=2000)
    pair.pump()
    got = pair.client_events.last(GoawayReceived)
    assert got.new_session_uri == b"moqt://next.example/"
    if draft is Draft.D18:
        assert (got.timeout_ms, got.request_id) == (2000, 0)
    with pytest.raises(MoqtUsageError):
        pair.client.subscribe(NS, TRACK)
    with pytest.raises(MoqtUsageError):
        pair.server.goaway()
    with pytest.raises(MoqtUsageError):
        pair.client.goaway(b"moqt://x/")
    pair.client.close()
    pair.pump()
    assert pair.server_events.last(SessionClosed) == SessionClosed(0, "", local=False)


@DRAFTS
def test_datagrams(draft: Draft) -> None:
    config = SessionConfig(datagrams=True)
    pair = ready(draft, client_config=config, server_config=config)
    rid = pair.client.subscribe(NS, TRACK)
    pair.pump()
    alias = pair.server.accept_subscribe(rid)
    pair.server.send_datagram(rid, 3, 0, b"dgram", end_of_group=True)
    pair.server.send_datagram(rid, 3, 1, status=ObjectStatus.END_OF_TRACK)
    pair.pump()
    got = pair.client_events.of(ObjectReceived)
    assert [(g.stream_id, g.request_id, g.track_alias, g.group, g.object_id, bytes(g.data), g.end_of_group)
            for g in got] == [(None, rid, alias, 3, 0, b"dgram", True), (None, rid, alias, 3, 1, b"", False)]
    assert got[1].status is ObjectStatus.END_OF_TRACK


def test_datagrams_need_the_extension() -> None:
    pair = ready(Draft.D14)
    rid = pair.client.subscribe(NS, TRACK)
    pair.pump()
    pair.server.accept_subscribe(rid)
    with pytest.raises(MoqtUsageError):
        pair.server.send_datagram(rid, 0, 0, b"x")


# -- Request-id flow control (draft 14) ----------------------------------------------------------------------------


def test_requests_wait_for_max_request_id() -> None:
    pair = ready(Draft.D14, server_config=SessionConfig(request_credit=2, auto_grant=False))
    ids = [pair.client.subscribe(NS, bytes([i])) for i in range(4)]
    assert ids == [0, 2, 4, 6]
    pair.pump()
    assert [e.request_id for e in pair.server_events.of(SubscribeRequested)] == [0, 2]
    assert pair.server_events.last(RequestsBlockedReceived).maximum_request_id == 4
    assert pair.client.blocked_requests == 2  # type: ignore[attr-defined]
    pair.server.grant_requests(8)
    pair.pump()
    assert [e.request_id for e in pair.server_events.of(SubscribeRequested)] == [0, 2, 4, 6]
    with pytest.raises(MoqtUsageError):
        pair.server.grant_requests(8)


def test_auto_grant_keeps_requests_flowing() -> None:
    pair = ready(Draft.D14, server_config=SessionConfig(request_credit=4))
    for i in range(50):
        pair.client.track_status(NS, bytes([i]))
        pair.pump()
    assert len(pair.server_events.of(TrackStatusRequested)) == 50
    assert not pair.server_events.of(RequestsBlockedReceived)


def test_cancel_of_a_queued_request_follows_it() -> None:
    pair = ready(Draft.D14, server_config=SessionConfig(request_credit=1, auto_grant=False))
    pair.client.subscribe(NS, b"a")
    blocked = pair.client.subscribe(NS, b"b")
    pair.client.unsubscribe(blocked)
    pair.pump()
    pair.server.grant_requests(10)
    pair.pump()
    assert [e.request_id for e in pair.server_events.of(SubscribeRequested)] == [0, 2]
    assert pair.server_events.last(Unsubscribed).request_id == 2
    assert not pair.server.closed


# -- Draft 18 specifics ------------------------------------------------------------------------------------------


def test_draft18_request_before_setup_is_held() -> None:
    pair = SessionPair(Draft.D18)
    pair.client.start()
    pair.server.start()
    rid = pair.client.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
    actions = pair.client.take_actions()
    request = [a for a in actions if isinstance(a, SendStreamData) and a.stream_id == 0]
    control = [a for a in actions if isinstance(a, SendStreamData) and a.stream_id == 2]
    assert pair.server.receive_stream_data(0, request[0].data) == []
    events = pair.server.receive_stream_data(2, control[0].data)
    assert [type(e) for e in events] == [SetupCompleted, FetchRequested]
    assert events[1].request_id == rid  # type: ignore[union-attr]


def test_draft18_publish_is_a_request() -> None:  # tests/test_moqt_publish.py has the rest
    server = _server(Draft.D18)
    msg = m18.Publish(0, NS, TRACK, 1)
    events = server.receive_stream_data(0, encode_message(msg, Draft.D18))
    assert [(type(e).__name__, getattr(e, "track_alias", None)) for e in events] == [("PublishRequested", 1)]


def test_draft14_publish_is_a_request() -> None:  # tests/test_moqt_publish.py has the rest
    server = _server(Draft.D14)
    events = server.receive_stream_data(0, encode_message(m14.Publish(0, NS, TRACK, 1), Draft.D14))
    assert [(type(e).__name__, getattr(e, "track_alias", None)) for e in events] == [("PublishRequested", 1)]


def test_draft18_peer_cancels_our_subscription() -> None:
    pair = ready(Draft.D18)
    rid = pair.client.subscribe(NS, TRACK)
    pair.pump()
    pair.server.accept_subscribe(rid)
    pair.pump()
    sid = pair.server.requests[rid].stream_id
    assert sid is not None
    events = pair.client.receive_stream_reset(sid, StreamResetCode.EXCESSIVE_LOAD)
    assert events == [RequestCancelled(rid, StreamResetCode.EXCESSIVE_LOAD)]


# -- Malformed input: the session closes with the draft's code -------------------------------------------------


def _server(draft: Draft, config: SessionConfig | None = None) -> MoqtSession:
    """A server that has received the client's SETUP (control: stream 0 in draft 14, stream 2 in draft 18)."""
    server = new_session(draft, Role.SERVER, config)
    server.start()
    if draft is Draft.D14:
        setup = encode_message(m14.ClientSetup((draft.version,), ((2, 100),)), draft)
        events = server.receive_stream_data(0, setup)
    else:
        events = server.receive_stream_data(2, encode_message(m18.Setup(), draft))
    assert isinstance(events[-1], SetupCompleted)
    server.take_actions()
    return server


def _client(draft: Draft) -> MoqtSession:
    client = new_session(draft, Role.CLIENT)
    client.start()
    if draft is Draft.D14:
        client.receive_stream_data(0, encode_message(m14.ServerSetup(draft.version, ((2, 100),)), draft))
    else:
        client.receive_stream_data(3, encode_message(m18.Setup(), draft))
    assert client.setup_done
    client.take_actions()
    return client


def _closed(session: MoqtSession, events: list[Event]) -> int:
    assert events and isinstance(events[-1], SessionClosed) and events[-1].local, events
    actions = session.take_actions()
    assert isinstance(actions[-1], CloseSession) and actions[-1].error_code == events[-1].error_code
    assert session.closed
    assert session.receive_stream_data(0, b"\x00") == []  # inert after closing
    return events[-1].error_code


def _control(draft: Draft, session: MoqtSession, msg: Message) -> list[Event]:
    stream = 0 if draft is Draft.D14 else (2 if session.role is Role.SERVER else 3)
    return session.receive_stream_data(stream, encode_message(msg, draft))


def _request(session: MoqtSession, stream_id: int, msg: Message) -> list[Event]:
    return session.receive_stream_data(stream_id, encode_message(msg, Draft.D18))


def test_message_before_setup() -> None:
    server = new_session(Draft.D14, Role.SERVER)
    server.start()
    assert _closed(server, _control(Draft.D14, server, m14.Subscribe(0, NS, TRACK))) == E.PROTOCOL_VIOLATION


def test_version_negotiation_fails_without_a_common_version() -> None:
    server = new_session(Draft.D14, Role.SERVER)
    server.start()
    events = _control(Draft.D14, server, m14.ClientSetup((0xFF00000D, 0xFF000010)))
    assert _closed(server, events) == E.VERSION_NEGOTIATION_FAILED


def test_version_negotiation_fails_on_a_version_not_offered() -> None:
    client = new_session(Draft.D14, Role.CLIENT)
    client.start()
    events = _control(Draft.D14, client, m14.ServerSetup(0xFF00000D))
    assert _closed(client, events) == E.VERSION_NEGOTIATION_FAILED


@DRAFTS
@pytest.mark.parametrize(("param", "code"), [(1, E.INVALID_PATH), (5, E.INVALID_AUTHORITY)])
def test_server_sends_path_or_authority(draft: Draft, param: int, code: int) -> None:
    client = new_session(draft, Role.CLIENT)
    client.start()
    msg: Message = m14.ServerSetup(draft.version, ((param, b"/x"),)) if draft is Draft.D14 \
        else m18.Setup(((param, b"/x"),))
    assert _closed(client, _control(draft, client, msg)) == code


@DRAFTS
@pytest.mark.parametrize(("param", "value", "code"), [
    (1, b"no-slash", E.MALFORMED_PATH), (1, b"/with space", E.MALFORMED_PATH),
    (5, b"", E.MALFORMED_AUTHORITY), (5, b":443", E.MALFORMED_AUTHORITY), (5, b"a/b", E.MALFORMED_AUTHORITY),
])
def test_malformed_path_or_authority(draft: Draft, param: int, value: bytes, code: int) -> None:
    server = new_session(draft, Role.SERVER)
    server.start()
    msg: Message = m14.ClientSetup((draft.version,), ((param, value),)) if draft is Draft.D14 \
        else m18.Setup(((param, value),))
    assert _closed(server, _control(draft, server, msg)) == code


@DRAFTS
def test_unknown_control_message(draft: Draft) -> None:
    server = _server(draft)
    bogus = b"\x3f\x00\x00"
    stream = 0 if draft is Draft.D14 else 2
    assert _closed(server, server.receive_stream_data(stream, bogus)) == E.PROTOCOL_VIOLATION


@DRAFTS
def test_varint_running_past_the_message(draft: Draft) -> None:
    server = _server(draft)
    stream = 0 if draft is Draft.D14 else 4
    # UNSUBSCRIBE / SUBSCRIBE whose body ends inside a varint
    frame = (b"\x0a\x00\x01\x40" if draft is Draft.D14 else b"\x03\x00\x01\x80")
    assert _closed(server, server.receive_stream_data(stream, frame)) == E.PROTOCOL_VIOLATION


@DRAFTS
def test_request_id_of_the_wrong_parity(draft: Draft) -> None:
    server = _server(draft)
    msg: Message = m14.Subscribe(1, NS, TRACK) if draft is Draft.D14 else m18.Subscribe(1, NS, TRACK)
    events = _control(draft, server, msg) if draft is Draft.D14 else _request(server, 0, msg)
    assert _closed(server, events) == E.INVALID_REQUEST_ID


def test_draft14_request_id_out_of_sequence() -> None:
    server = _server(Draft.D14)
    _control(Draft.D14, server, m14.Subscribe(0, NS, TRACK))
    assert _closed(server, _control(Draft.D14, server, m14.Subscribe(0, NS, b"again"))) == E.INVALID_REQUEST_ID


def test_draft18_duplicate_request_id() -> None:
    server = _server(Draft.D18)
    _request(server, 0, m18.Subscribe(0, NS, TRACK))
    assert _closed(server, _request(server, 4, m18.Fetch(0, StandaloneFetch(NS, TRACK, Location(0, 0),
                                                                           Location(1, 0))))) == E.INVALID_REQUEST_ID


def test_request_id_above_the_maximum() -> None:
    server = _server(Draft.D14, SessionConfig(request_credit=1, auto_grant=False))  # ids below 2
    _control(Draft.D14, server, m14.Subscribe(0, NS, TRACK))
    assert _closed(server, _control(Draft.D14, server, m14.Subscribe(2, NS, b"b"))) == E.TOO_MANY_REQUESTS


def test_max_request_id_must_increase() -> None:
    client = _client(Draft.D14)
    assert _closed(client, _control(Draft.D14, client, m14.MaxRequestId(100))) == E.PROTOCOL_VIOLATION


@DRAFTS
def test_second_goaway(draft: Draft) -> None:
    client = _client(draft)
    msg: Message = m14.Goaway() if draft is Draft.D14 else m18.Goaway(b"", 0, 0)
    _control(draft, client, msg)
    assert _closed(client, _control(draft, client, msg)) == E.PROTOCOL_VIOLATION


@DRAFTS
def test_client_goaway_with_a_uri(draft: Draft) -> None:
    server = _server(draft)
    msg: Message = m14.Goaway(b"moqt://x/") if draft is Draft.D14 else m18.Goaway(b"moqt://x/")
    assert _closed(server, _control(draft, server, msg)) == E.PROTOCOL_VIOLATION


def test_draft18_goaway_request_id_parity() -> None:
    client = _client(Draft.D18)
    assert _closed(client, _control(Draft.D18, client, m18.Goaway(b"", 0, 1))) == E.INVALID_REQUEST_ID


@DRAFTS
def test_duplicate_track_alias(draft: Draft) -> None:
    client = _client(draft)
    a, b = client.subscribe(NS, b"a"), client.subscribe(NS, b"b")
    client.take_actions()
    if draft is Draft.D14:
        _control(draft, client, m14.SubscribeOk(a, 5))
        events = _control(draft, client, m14.SubscribeOk(b, 5))
    else:
        sa, sb = client.requests[a].stream_id, client.requests[b].stream_id
        assert sa is not None and sb is not None
        _request(client, sa, m18.SubscribeOk(5))
        events = _request(client, sb, m18.SubscribeOk(5))
    assert _closed(client, events) == E.DUPLICATE_TRACK_ALIAS


@DRAFTS
def test_second_reply(draft: Draft) -> None:
    client = _client(draft)
    rid = client.publish_namespace(NS)
    client.take_actions()
    if draft is Draft.D14:
        _control(draft, client, m14.PublishNamespaceOk(rid))
        events = _control(draft, client, m14.PublishNamespaceOk(rid))
    else:
        sid = client.requests[rid].stream_id
        assert sid is not None
        _request(client, sid, m18.RequestOk())
        events = _request(client, sid, m18.RequestOk())
    assert _closed(client, events) == E.PROTOCOL_VIOLATION


def test_reply_to_a_request_never_made() -> None:
    client = _client(Draft.D14)
    assert _closed(client, _control(Draft.D14, client, m14.FetchOk(8, Location(0, 0)))) == E.PROTOCOL_VIOLATION


def test_draft18_wrong_first_reply() -> None:
    client = _client(Draft.D18)
    rid = client.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
    client.take_actions()
    sid = client.requests[rid].stream_id
    assert sid is not None
    assert _closed(client, _request(client, sid, m18.SubscribeOk(1))) == E.PROTOCOL_VIOLATION


def test_draft14_second_bidirectional_stream() -> None:
    server = _server(Draft.D14)
    assert _closed(server, server.receive_stream_data(4, b"\x00")) == E.PROTOCOL_VIOLATION


@DRAFTS
def test_control_stream_closed_or_reset(draft: Draft) -> None:
    server = _server(draft)
    stream = 0 if draft is Draft.D14 else 2
    assert _closed(server, server.receive_stream_data(stream, b"", fin=True)) == E.PROTOCOL_VIOLATION
    server = _server(draft)
    assert _closed(server, server.receive_stream_reset(stream, 0)) == E.PROTOCOL_VIOLATION


def test_draft18_request_stream_must_begin_with_a_request() -> None:
    server = _server(Draft.D18)
    assert _closed(server, _request(server, 0, m18.RequestOk())) == E.PROTOCOL_VIOLATION


def test_draft18_only_goaway_after_setup_on_the_control_stream() -> None:
    server = _server(Draft.D18)
    assert _closed(server, _control(Draft.D18, server, m18.Subscribe(0, NS, TRACK))) == E.PROTOCOL_VIOLATION


def test_draft18_second_control_stream() -> None:
    server = _server(Draft.D18)
    events = server.receive_stream_data(6, encode_message(m18.Setup(), Draft.D18))
    assert _closed(server, events) == E.PROTOCOL_VIOLATION


@DRAFTS
@pytest.mark.parametrize(("token", "code"), [
    (AuthToken(AliasType.REGISTER, 1, 0, b"t"), E.AUTH_TOKEN_CACHE_OVERFLOW),
    (AuthToken(AliasType.USE_ALIAS, 1), E.UNKNOWN_AUTH_TOKEN_ALIAS),
    (b"\x07", E.KEY_VALUE_FORMATTING_ERROR),
])
def test_authorization_tokens(draft: Draft, token: AuthToken | bytes, code: int) -> None:
    server = _server(draft)
    raw = token if isinstance(token, bytes) else token.encode(draft.vi64)
    if draft is Draft.D14:
        events = _control(draft, server, m14.Subscribe(0, NS, TRACK, params=((3, raw),)))
    else:
        events = _request(server, 0, m18.Subscribe(0, NS, TRACK, m18.Params18(auth_tokens=(raw,))))
    assert _closed(server, events) == code


@DRAFTS
def test_use_value_token_reaches_the_application(draft: Draft) -> None:
    server = _server(draft)
    token = AuthToken(AliasType.USE_VALUE, None, 0, b"secret")
    if draft is Draft.D14:
        events = _control(draft, server, m14.PublishNamespace(0, NS, ((3, token.encode(False)),)))
    else:
        events = _request(server, 0, m18.PublishNamespace(0, NS, m18.Params18(auth_tokens=(token.encode(True),))))
    assert isinstance(events[0], PublishNamespaceRequested) and events[0].auth_tokens == (token,)


def test_datagram_without_the_extension() -> None:
    server = _server(Draft.D14)
    assert _closed(server, server.receive_datagram(b"\x00\x01\x02\x03\x80x")) == E.PROTOCOL_VIOLATION


def test_malformed_datagram_closes_the_session() -> None:
    server = _server(Draft.D18, SessionConfig(datagrams=True))
    assert _closed(server, server.receive_datagram(b"\x22\x01\x02\x03\x80\x00")) == E.PROTOCOL_VIOLATION


def test_subscribe_update_of_no_subscription() -> None:
    server = _server(Draft.D14)
    events = _control(Draft.D14, server, m14.SubscribeUpdate(0, 8, Location(0, 0), 0))
    assert _closed(server, events) == E.PROTOCOL_VIOLATION


def test_subscribe_update_may_not_widen() -> None:
    server = _server(Draft.D14)
    flt = SubscriptionFilter(FilterType.ABSOLUTE_RANGE, Location(2, 0), 5)
    _control(Draft.D14, server, m14.Subscribe(0, NS, TRACK, filter=flt))
    server.accept_subscribe(0)
    events = _control(Draft.D14, server, m14.SubscribeUpdate(2, 0, Location(2, 0), 8))  # end group 7 > 5
    assert _closed(server, events) == E.PROTOCOL_VIOLATION


def test_draft14_joining_fetch_needs_a_largest_object_subscription() -> None:
    server = _server(Draft.D14)
    flt = SubscriptionFilter(FilterType.ABSOLUTE_START, Location(2, 0))
    _control(Draft.D14, server, m14.Subscribe(0, NS, TRACK, filter=flt))
    events = _control(Draft.D14, server, m14.Fetch(2, JoiningFetch(0, 1)))
    assert _closed(server, events) == E.PROTOCOL_VIOLATION


def test_draft18_namespace_done_before_namespace() -> None:
    client = _client(Draft.D18)
    rid = client.subscribe_namespace(NS[:1])
    client.take_actions()
    sid = client.requests[rid].stream_id
    assert sid is not None
    _request(client, sid, m18.RequestOk())
    assert _closed(client, _request(client, sid, m18.NamespaceDone(NS[1:]))) == E.PROTOCOL_VIOLATION


@DRAFTS
def test_fetch_stream_for_a_fetch_never_made(draft: Draft) -> None:
    client = _client(draft)
    header = b"\x05\x09"
    assert _closed(client, client.receive_stream_data(3 if draft is Draft.D14 else 7, header)) == \
        E.PROTOCOL_VIOLATION


@DRAFTS
def test_fin_inside_an_object(draft: Draft) -> None:
    client = _client(draft)
    stream = b"\x14\x01\x00\x00\x80" + b"\x00\x05ab"
    assert _closed(client, client.receive_stream_data(7, stream, fin=True)) == E.PROTOCOL_VIOLATION


def test_data_stream_of_unknown_type() -> None:
    client = _client(Draft.D18)
    assert _closed(client, client.receive_stream_data(7, encode_vi64(0x99))) == E.PROTOCOL_VIOLATION


@DRAFTS
def test_peer_data_on_our_own_unidirectional_stream(draft: Draft) -> None:
    client = _client(draft)
    assert _closed(client, client.receive_stream_data(6, b"\x14")) == E.PROTOCOL_VIOLATION


# -- API misuse -----------------------------------------------------------------------------------------------------


@DRAFTS
def test_usage_errors(draft: Draft) -> None:
    pair = ready(draft)
    with pytest.raises(MoqtUsageError):
        pair.server.accept_fetch(99, Location(0, 0))
    rid = pair.client.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
    pair.pump()
    w = pair.server.accept_fetch(rid, Location(0, 2))
    with pytest.raises(MoqtUsageError):
        pair.server.accept_fetch(rid, Location(0, 2))  # answered already
    w.begin_object(0, 0, 3)
    with pytest.raises(MoqtUsageError):
        w.write(b"four")
    with pytest.raises(MoqtUsageError):
        w.begin_object(0, 1, 1)  # the previous object is incomplete
    with pytest.raises(MoqtUsageError):
        w.finish()
    w.write(b"abc")
    with pytest.raises(MoqtUsageError):
        w.begin_object(0, 0, 1)  # object ids ascend
    w.finish()
    with pytest.raises(MoqtUsageError):
        pair.client.unsubscribe(rid)  # not a subscription
    with pytest.raises(MoqtUsageError):
        pair.client.subscribe((), TRACK) if draft is Draft.D14 else pair.client.subscribe((b"",), TRACK)
    started = new_session(draft, Role.CLIENT)
    with pytest.raises(MoqtUsageError):
        started.subscribe(NS, TRACK)
    started.start()
    with pytest.raises(MoqtUsageError):
        started.start()


def test_actions_are_ordered_open_then_data() -> None:
    pair = ready(Draft.D14)
    rid = pair.client.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
    pair.pump()
    pair.server.accept_fetch(rid, Location(0, 1)).finish()
    actions = pair.server.take_actions()
    kinds = [type(a).__name__ for a in actions]
    assert kinds == ["SendStreamData", "OpenStream", "SendStreamData", "SendStreamData"]
    assert isinstance(actions[-1], SendStreamData) and actions[-1].fin and actions[-1].stream_id == 3
    assert not any(isinstance(a, SendDatagram) for a in actions)


# -- Draft 18 request-stream lifecycle -------------------------------------------------------------------------


def test_draft18_requester_fin_withdraws_a_namespace() -> None:
    server = _server(Draft.D18)
    _request(server, 0, m18.PublishNamespace(0, NS))
    server.accept_publish_namespace(0)
    server.take_actions()
    assert server.receive_stream_data(0, b"", fin=True) == [PublishNamespaceDone(0, NS)]
    assert any(isinstance(a, SendStreamData) and a.stream_id == 0 and a.fin for a in server.take_actions())
    _request(server, 4, m18.SubscribeNamespace(2, NS[:1]))
    assert server.receive_stream_data(4, b"", fin=True) == [SubscribeNamespaceEnded(2, NS[:1])]


def test_draft18_responder_fin_ends_subscribe_namespace() -> None:
    client = _client(Draft.D18)
    rid = client.subscribe_namespace(NS[:1])
    client.take_actions()
    sid = client.requests[rid].stream_id
    assert sid is not None
    _request(client, sid, m18.RequestOk())
    _request(client, sid, m18.NamespaceMsg(NS[1:2]))
    events = client.receive_stream_data(sid, b"", fin=True)
    assert events == [NamespaceReceived(rid, NS[:2], False)]


def test_draft18_goaway_on_a_request_stream() -> None:
    client = _client(Draft.D18)
    rid = client.subscribe(NS, TRACK)
    client.take_actions()
    sid = client.requests[rid].stream_id
    assert sid is not None
    events = _request(client, sid, m18.Goaway(b"moqt://elsewhere/", 100))
    assert events == [GoawayReceived(b"moqt://elsewhere/", 100, None, rid)]
    assert not client.goaway_received  # only this request migrates
    assert _closed(client, _request(client, sid, m18.Goaway())) == E.PROTOCOL_VIOLATION


def test_draft18_joining_a_subscription_with_forward_0_is_an_invalid_range() -> None:
    pair = ready(Draft.D18)
    sub = pair.client.subscribe(NS, TRACK, forward=False)
    pair.pump()
    assert pair.server_events.last(SubscribeRequested).forward is False
    pair.server.accept_subscribe(sub)
    pair.client.joining_fetch(sub, 0)
    pair.pump()
    assert pair.client_events.last(RequestRejected).error_code == RequestErrorCode18.INVALID_RANGE


def test_draft18_rejected_fetch_update_ends_the_fetch() -> None:
    server = _server(Draft.D18)
    _request(server, 0, m18.Fetch(0, StandaloneFetch(NS, TRACK, Location(0, 0), Location(1, 0))))
    writer = server.accept_fetch(0, Location(0, 1))
    server.receive_stream_data(0, encode_message(m18.RequestUpdate(2, m18.Params18(subscriber_priority=1)),
                                                 Draft.D18))
    server.take_actions()
    server.reject(2, RequestErrorCode18.INTERNAL_ERROR)
    actions = server.take_actions()
    assert writer.closed
    assert any(isinstance(a, ResetStream) and a.stream_id == writer.stream_id for a in actions)
    assert any(isinstance(a, SendStreamData) and a.stream_id == 0 and a.fin for a in actions)


def test_draft18_update_of_a_track_status_is_a_violation() -> None:
    server = _server(Draft.D18)
    _request(server, 0, m18.TrackStatus(0, NS, TRACK))
    events = server.receive_stream_data(0, encode_message(m18.RequestUpdate(2), Draft.D18))
    assert _closed(server, events) == E.PROTOCOL_VIOLATION


def test_draft18_stop_sending_on_a_fetch_data_stream() -> None:
    pair = ready(Draft.D18)
    rid = pair.client.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
    pair.pump()
    w = pair.server.accept_fetch(rid, Location(0, 1))
    events = pair.server.receive_stop_sending(w.stream_id, StreamResetCode.CANCELLED)
    assert events == [StreamStopped(w.stream_id, rid, StreamResetCode.CANCELLED)]
    assert w.stopped == StreamResetCode.CANCELLED
    with pytest.raises(MoqtUsageError):
        w.write_object(0, 0, b"x")
    w.reset()
    pair.pump()
    assert not pair.client.closed


# -- State does not accumulate ------------------------------------------------------------------------------------


@DRAFTS
def test_finished_requests_are_forgotten(draft: Draft) -> None:
    """A relay makes and serves requests all day: finished ones must not pile up (late messages naming them are
    recognized by their ids and ignored)."""
    pair = ready(draft)
    for i in range(40):
        rid = pair.client.fetch(NS, TRACK, Location(i, 0), Location(i + 1, 0))
        pair.pump()
        w = pair.server.accept_fetch(rid, Location(i, 1))
        w.write_object(i, 0, b"x")
        w.finish()
        ts = pair.client.track_status(NS, TRACK)
        pair.pump()
        pair.server.accept_track_status(ts)
        bad = pair.client.fetch(NS, b"missing", Location(0, 0), Location(1, 0))
        pair.pump()
        pair.server.reject(bad, 4)
        cancelled = pair.client.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
        pair.pump()
        pair.client.cancel_fetch(cancelled)
        pair.server.accept_fetch(cancelled, Location(0, 1)).write_object(0, 0, b"late")  # crosses the cancel
        pair.pump()
        sub = pair.client.subscribe(NS, bytes([i]))
        pair.pump()
        pair.server.accept_subscribe(sub)
        pair.pump()
        pair.client.unsubscribe(sub)
        ns = pair.client.publish_namespace((b"ns", bytes([i])))
        pair.pump()
        pair.server.accept_publish_namespace(ns)
        pair.pump()
        pair.client.publish_namespace_done(ns)
        pair.pump()
    assert not pair.client.closed and not pair.server.closed
    assert pair.client.requests == {} and pair.server.requests == {}
    assert len(pair.client_events.of(FetchAccepted)) == 40 and len(pair.client_events.of(RequestRejected)) == 40
    if draft is Draft.D18:
        for side in (pair.client, pair.server):
            assert side._stream_request == {} and side._stream_parsers == {}  # type: ignore[attr-defined]


@DRAFTS
def test_deferred_fetch_ok(draft: Draft) -> None:
    """A relay forwards objects before it knows the end of the range, then sends FETCH_OK."""
    pair = ready(draft)
    rid = pair.client.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
    pair.pump()
    w = pair.server.accept_fetch(rid, None)
    w.write_object(0, 0, b"early")
    w.finish()
    pair.pump()
    assert pair.payloads[(rid, 0, 0)] == b"early" and not pair.client_events.of(FetchAccepted)
    assert rid in pair.server.requests
    pair.server.send_fetch_ok(rid, Location(0, 1), end_of_track=True)
    pair.pump()
    assert pair.client_events.last(FetchAccepted).end_of_track
    assert pair.server.requests == {} and pair.client.requests == {}
    with pytest.raises(MoqtUsageError):
        pair.server.send_fetch_ok(rid, Location(0, 1))


@DRAFTS
def test_fetch_failing_after_objects(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
    pair.pump()
    w = pair.server.accept_fetch(rid, None)
    w.write_object(0, 0, b"cached")
    pair.server.reject(rid, 2, b"upstream timed out")
    pair.pump()
    assert w.closed and pair.client_events.last(RequestRejected).reason == b"upstream timed out"
    assert not pair.client.closed and pair.server.requests == {}


def test_draft18_fetch_is_sent_in_the_requested_order() -> None:
    pair = ready(Draft.D18)
    rid = pair.client.fetch(NS, TRACK, Location(0, 0), Location(9, 0), group_order=GroupOrder.DESCENDING)
    pair.pump()
    assert pair.server_events.last(FetchRequested).group_order is GroupOrder.DESCENDING
    with pytest.raises(MoqtUsageError):
        pair.server.accept_fetch(rid, Location(9, 0), group_order=GroupOrder.ASCENDING)
    w = pair.server.accept_fetch(rid, Location(9, 0))
    w.write_object(5, 0, b"5")
    w.write_object(2, 1, b"2")
    with pytest.raises(MoqtUsageError):
        w.write_object(3, 0, b"3")  # ascending again: out of the fetch's order
    w.finish()
    pair.pump()
    assert [(e.group, e.object_id) for e in pair.client_events.of(ObjectReceived)] == [(5, 0), (2, 1)]


@DRAFTS
def test_both_roles_in_one_session(draft: Draft) -> None:
    """The server fetches from the client while the client subscribes to the server (a relay's situation)."""
    pair = ready(draft)
    sub = pair.client.subscribe(NS, b"live")
    fetch = pair.server.fetch(NS, TRACK, Location(0, 0), Location(1, 0))
    assert sub % 2 == 0 and fetch % 2 == 1
    pair.pump()
    pair.server.accept_subscribe(sub)
    w = pair.client.accept_fetch(pair.client_events.last(FetchRequested).request_id, Location(0, 2))
    w.write_object(0, 0, b"L0")
    w.write_object(0, 1, b"L1")
    w.finish()
    sw = pair.server.open_subgroup(sub, 1)
    sw.write_object(0, b"live-0")
    sw.finish()
    pair.pump()
    assert pair.payloads[(fetch, 0, 0)] == b"L0" and pair.payloads[(fetch, 0, 1)] == b"L1"
    assert pair.payloads[(sub, 1, 0)] == b"live-0"
    assert pair.server_events.last(FetchAccepted).request_id == fetch
    assert not pair.client.closed and not pair.server.closed
