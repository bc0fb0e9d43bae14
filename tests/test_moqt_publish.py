"""PUBLISH and SUBSCRIBE_TRACKS in the sans-I/O session (moqt/publishing.py, moqt/publishing14.py): a client and a
server session back to back (moqt.testing.SessionPair). Both drafts have PUBLISH; draft 14 has no SUBSCRIBE_TRACKS
(type 0x51 is an unknown message there: the session is closed). The codec round trips
of PUBLISH, SUBSCRIBE_TRACKS, PUBLISH_BLOCKED and REQUEST_OK (PUBLISH_OK), fixed and hypothesis-generated, are in
tests/test_moqt_codec.py."""

from __future__ import annotations

import pytest

from moqt import messages14 as m14
from moqt import messages18 as m18
from moqt.actions import CloseSession, ResetStream, SendStreamData, StopSending
from moqt.control import encode_message
from moqt.errors import MoqtUsageError, PublishDoneCode18, RequestErrorCode18, SessionErrorCode
from moqt.events import (
    ObjectReceived,
    PublishAccepted,
    PublishBlocked,
    PublishDone,
    PublishRequested,
    RequestCancelled,
    RequestRejected,
    SessionClosed,
    SetupCompleted,
    StreamStopped,
    SubscribeTracksAccepted,
    SubscribeTracksEnded,
    SubscribeTracksRequested,
    Unsubscribed,
)
from moqt.session import MoqtSession, Role
from moqt.sessions import new_session
from moqt.testing import SessionPair
from moqt.types import LARGEST_OBJECT_FILTER, Draft, GroupOrder, Location

NS = (b"moq-test", b"room", b"alice")
TRACK = b"video"


DRAFTS = pytest.mark.parametrize("draft", list(Draft), ids=lambda d: f"d{d.value}")


def ready(draft: Draft = Draft.D18, chunk: int | None = None) -> SessionPair:
    pair = SessionPair(draft, chunk=chunk)
    pair.handshake()
    return pair


@DRAFTS
@pytest.mark.parametrize("chunk", [None, 3])
def test_publish_objects_before_and_after_publish_ok_then_publish_done(draft: Draft, chunk: int | None) -> None:
    pair = ready(draft, chunk=chunk)
    rid = pair.client.publish(NS, TRACK, largest=Location(2, 4), group_order=GroupOrder.DESCENDING)
    w = pair.client.open_subgroup(rid, 3, extensions=True)  # "MAY start sending Objects ... before PUBLISH_OK"
    w.write_object(0, b"early")
    pair.pump()
    req = pair.server_events.last(PublishRequested)
    assert (req.request_id, req.namespace, req.track_name, req.forward, req.largest, req.group_order) == (
        rid, NS, TRACK, True, Location(2, 4), GroupOrder.DESCENDING)
    assert pair.payloads[(rid, 3, 0)] == b"early"  # the alias was bound on receipt of PUBLISH
    pair.server.accept_publish(rid, subscriber_priority=7)
    pair.pump()
    ok = pair.client_events.last(PublishAccepted)
    assert (ok.request_id, ok.forward, ok.subscriber_priority) == (rid, True, 7)
    w.write_object(1, b"later")
    w.finish()
    pair.pump()
    assert pair.payloads[(rid, 3, 1)] == b"later"
    pair.client.publish_done(rid, PublishDoneCode18.TRACK_ENDED, b"bye")
    pair.pump()
    assert pair.server_events.last(PublishDone) == PublishDone(rid, PublishDoneCode18.TRACK_ENDED, 1, b"bye")
    assert rid not in pair.client.requests and rid not in pair.server.requests  # FIN both ways: forgotten
    assert not pair.client.closed and not pair.server.closed


@DRAFTS
def test_publish_ok_with_forward_zero(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.publish(NS, TRACK, forward=False)
    pair.pump()
    assert pair.server_events.last(PublishRequested).forward is False
    pair.server.accept_publish(rid, forward=False)
    pair.pump()
    assert pair.client_events.last(PublishAccepted).forward is False


@DRAFTS
def test_publish_refused_uninterested_stops_its_streams(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.publish(NS, TRACK)
    w = pair.client.open_subgroup(rid, 0)
    w.write_object(0, b"x")
    pair.pump()
    uninterested = RequestErrorCode18.UNINTERESTED if draft is Draft.D18 else 0x4  # draft 14: PUBLISH_ERROR 0x4
    pair.server.reject(rid, uninterested, b"no thanks")
    pair.pump()
    rejected = pair.client_events.last(RequestRejected)
    assert (rejected.request_id, rejected.error_code) == (rid, uninterested)
    assert any(isinstance(a, StopSending) and a.stream_id == w.stream_id for a in pair.sent("server"))
    # draft 18: the STOP_SENDING reaches the writer; draft 14: the PUBLISH_ERROR already reset our streams
    assert w.closed or any(isinstance(e, StreamStopped) and e.stream_id == w.stream_id for e in pair.client_events)
    assert rid not in pair.client.requests and rid not in pair.server.requests


@DRAFTS
def test_subscriber_ends_a_publish(draft: Draft) -> None:  # draft 18: STOP_SENDING; draft 14: UNSUBSCRIBE
    pair = ready(draft)
    rid = pair.client.publish(NS, TRACK)
    pair.pump()
    pair.server.accept_publish(rid)
    w = pair.client.open_subgroup(rid, 0)
    w.write_object(0, b"x")
    pair.pump()
    pair.server.unsubscribe(rid)
    pair.pump()
    assert pair.client_events.last(Unsubscribed).request_id == rid
    assert w.closed  # our subgroup stream was reset
    assert any(isinstance(a, ResetStream) and a.stream_id == w.stream_id for a in pair.sent("client"))
    with pytest.raises(MoqtUsageError):
        pair.client.open_subgroup(rid, 1)


def test_publisher_resets_its_publish() -> None:
    pair = ready()
    rid = pair.client.publish(NS, TRACK)
    pair.pump()
    sid = pair.client.requests[rid].stream_id
    assert sid is not None
    events = pair.server.receive_stream_reset(sid, 0x1)
    assert events == [RequestCancelled(rid, 0x1)]
    assert rid not in pair.server.requests


@DRAFTS
def test_publish_api_misuse(draft: Draft) -> None:
    pair = ready(draft)
    rid = pair.client.publish(NS, TRACK, track_alias=9)
    with pytest.raises(MoqtUsageError):
        pair.client.publish(NS, b"other", track_alias=9)  # alias in use
    with pytest.raises(MoqtUsageError):
        pair.client.accept_publish(rid)  # our own request
    pair.pump()
    pair.server.accept_publish(rid)
    with pytest.raises(MoqtUsageError):
        pair.server.accept_publish(rid)  # answered already
    with pytest.raises(MoqtUsageError):
        pair.client.publish((b"x",) * 33, TRACK)  # a namespace has at most 32 fields
    pair.pump()


@DRAFTS
def test_two_publishes_and_a_subscribe_use_distinct_aliases(draft: Draft) -> None:
    pair = ready(draft)
    a = pair.client.publish(NS, b"a")
    b = pair.client.publish(NS, b"b")
    sub = pair.server.subscribe(NS, b"c")
    pair.pump()
    alias_c = pair.client.accept_subscribe(sub)
    pair.pump()
    aliases = {pair.client.requests[a].track_alias, pair.client.requests[b].track_alias, alias_c}
    assert len(aliases) == 3


def test_duplicate_alias_from_a_publish_closes_the_session() -> None:
    pair = ready()
    sub = pair.server.subscribe(NS, b"c")
    pair.pump()
    alias = pair.client.accept_subscribe(sub, track_alias=5)
    pair.pump()
    # a PUBLISH of the client's reusing alias 5 (built by hand: the API would refuse it)
    events = pair.server.receive_stream_data(0, encode_message(m18.Publish(0, NS, b"d", alias), Draft.D18))
    assert isinstance(events[-1], SessionClosed) and events[-1].error_code == SessionErrorCode.DUPLICATE_TRACK_ALIAS


def test_publish_stream_carries_only_publish_done_from_the_publisher() -> None:
    pair = ready()
    rid = pair.client.publish(NS, TRACK)
    pair.pump()
    sid = pair.client.requests[rid].stream_id
    assert sid is not None
    events = pair.server.receive_stream_data(sid, encode_message(m18.Subscribe(2, NS, TRACK), Draft.D18))
    assert isinstance(events[-1], SessionClosed) and events[-1].error_code == SessionErrorCode.PROTOCOL_VIOLATION


def test_first_reply_to_publish_must_be_request_ok_or_error() -> None:
    pair = ready()
    rid = pair.client.publish(NS, TRACK)
    pair.pump()
    sid = pair.client.requests[rid].stream_id
    assert sid is not None
    events = pair.client.receive_stream_data(sid, encode_message(m18.NamespaceMsg(()), Draft.D18))
    assert isinstance(events[-1], SessionClosed) and events[-1].error_code == SessionErrorCode.PROTOCOL_VIOLATION


# -- SUBSCRIBE_TRACKS -----------------------------------------------------------------------------------------------


def test_subscribe_tracks_publish_blocked_and_cancel() -> None:
    pair = ready()
    rid = pair.client.subscribe_tracks(NS[:2], forward=False)
    pair.pump()
    req = pair.server_events.last(SubscribeTracksRequested)
    assert (req.request_id, req.prefix, req.forward) == (rid, NS[:2], False)
    pair.server.accept_subscribe_tracks(rid)
    pair.pump()
    assert pair.client_events.last(SubscribeTracksAccepted).request_id == rid
    pub = pair.server.publish(NS, TRACK, forward=False)  # the relay's PUBLISH for a matching track
    pair.server.publish_blocked(rid, NS, b"blocked-track")
    with pytest.raises(MoqtUsageError):
        pair.server.publish_blocked(rid, (b"elsewhere",), b"t")  # not under the prefix
    pair.pump()
    got = pair.client_events.last(PublishRequested)
    assert (got.request_id, got.namespace, got.track_name, got.forward) == (pub, NS, TRACK, False)
    assert pair.client_events.last(PublishBlocked) == PublishBlocked(rid, NS, b"blocked-track")
    pair.client.accept_publish(pub)
    w = pair.server.open_subgroup(pub, 0)
    w.write_object(0, b"payload")
    w.finish()
    pair.pump()
    assert pair.payloads[(pub, 0, 0)] == b"payload"
    pair.client.unsubscribe_tracks(rid)
    pair.pump()
    assert pair.server_events.last(SubscribeTracksEnded) == SubscribeTracksEnded(rid, NS[:2])
    assert pub in pair.server.requests  # "Subscriptions established via PUBLISH ... are not affected"


def test_subscribe_tracks_fin_withdraws_it() -> None:
    pair = ready()
    rid = pair.client.subscribe_tracks(())
    pair.pump()
    pair.server.accept_subscribe_tracks(rid)
    pair.pump()
    sid = pair.client.requests[rid].stream_id
    assert sid is not None
    assert pair.server.receive_stream_data(sid, b"", True) == [SubscribeTracksEnded(rid, ())]


def test_subscribe_tracks_refused() -> None:
    pair = ready()
    rid = pair.client.subscribe_tracks(NS[:1])
    pair.pump()
    pair.server.reject(rid, RequestErrorCode18.PREFIX_OVERLAP, b"overlap")
    pair.pump()
    assert pair.client_events.last(RequestRejected).error_code == RequestErrorCode18.PREFIX_OVERLAP
    assert rid not in pair.client.requests


def test_publish_blocked_on_other_requests_is_a_protocol_violation() -> None:
    pair = ready()
    rid = pair.client.subscribe_namespace(NS[:1])
    pair.pump()
    pair.server.accept_subscribe_namespace(rid)
    pair.pump()
    sid = pair.client.requests[rid].stream_id
    assert sid is not None
    events = pair.client.receive_stream_data(sid, encode_message(m18.PublishBlocked((), b"t"), Draft.D18))
    assert isinstance(events[-1], SessionClosed) and events[-1].error_code == SessionErrorCode.PROTOCOL_VIOLATION


# -- Draft 14 ---------------------------------------------------------------------------------------------------------


def _server14() -> MoqtSession:
    server = new_session(Draft.D14, Role.SERVER)
    server.start()
    events = server.receive_stream_data(0, encode_message(m14.ClientSetup((Draft.D14.version,), ((2, 100),)),
                                                          Draft.D14))
    assert isinstance(events[-1], SetupCompleted)
    server.take_actions()
    return server


def test_draft14_api_refuses_subscribe_tracks() -> None:
    pair = ready(Draft.D14)
    with pytest.raises(MoqtUsageError):
        pair.client.subscribe_tracks(NS)
    with pytest.raises(MoqtUsageError):
        pair.client.accept_subscribe_tracks(0)


def test_draft14_publish_fields_and_publish_ok_bytes() -> None:
    server = _server14()
    msg = m14.Publish(0, NS, TRACK, 1, GroupOrder.DESCENDING, Location(3, 2), False)
    events = server.receive_stream_data(0, encode_message(msg, Draft.D14))
    req = events[-1]
    assert isinstance(req, PublishRequested)
    assert (req.track_alias, req.group_order, req.largest, req.forward) == (1, GroupOrder.DESCENDING,
                                                                            Location(3, 2), False)
    server.accept_publish(0, forward=True, subscriber_priority=9)
    sent = [a for a in server.take_actions() if isinstance(a, SendStreamData)]
    ok = m14.PublishOk(0, True, 9, GroupOrder.DESCENDING, LARGEST_OBJECT_FILTER)
    assert bytes(sent[-1].data) == encode_message(ok, Draft.D14)  # "This overwrites the GroupOrder specified PUBLISH"
    # the publisher's PUBLISH_DONE names the PUBLISH's Request ID
    events = server.receive_stream_data(0, encode_message(m14.PublishDone(0, 0x2, 0, b""), Draft.D14))
    assert events == [PublishDone(0, 0x2, 0, b"")] and 0 not in server.requests
    assert not server.closed


def test_draft14_subscribe_tracks_type_is_unknown_and_closes_the_session() -> None:
    server = _server14()
    # draft 18's SUBSCRIBE_TRACKS (0x51) framed as draft 14 frames a control message: Type, Length (16), Payload
    events = server.receive_stream_data(0, b"\x40\x51\x00\x03\x00\x00\x00")
    assert isinstance(events[-1], SessionClosed) and events[-1].error_code == SessionErrorCode.PROTOCOL_VIOLATION
    assert isinstance(server.take_actions()[-1], CloseSession)


def test_events_carry_what_the_relay_needs() -> None:
    pair = ready()
    rid = pair.client.publish(NS, TRACK)
    w = pair.client.open_subgroup(rid, 0)
    w.write_object(0, b"abc")
    pair.pump()
    obj = pair.server_events.last(ObjectReceived)
    assert (obj.request_id, obj.track_alias) == (rid, pair.client.requests[rid].track_alias)


def test_draft14_unsubscribe_of_a_publish_we_ended_is_ignored() -> None:
    pair = ready(Draft.D14)
    rid = pair.client.publish(NS, TRACK)
    pair.pump()
    pair.server.accept_publish(rid)
    pair.client.publish_done(rid, 0x2)  # crosses the subscriber's UNSUBSCRIBE
    pair.server.unsubscribe(rid)
    pair.pump()
    assert not pair.client.closed and not pair.server.closed
    assert rid not in pair.client.requests and rid not in pair.server.requests
