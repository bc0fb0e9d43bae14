"""Fuzzing the moqt parsers and sessions: arbitrary or mutated octets may only raise MoqtError (parsers) or close
the session (sessions); never another exception. And what parses round-trips: valid messages, objects and
datagrams, however the octets are split, decode to exactly what was encoded, and whatever a mutated input decodes
to encodes to octets that decode to the same thing again (so a silent mis-parse fails, not only a crash).

The default runs are bounded (CI); the ``slow`` variants run longer, and KVSP_SLOW=1 runs them in full.
"""

from __future__ import annotations

import contextlib
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moqt.actions import CloseSession
from moqt.control import ControlParser, encode_message
from moqt.data import ObjectDatagram, decode_datagram
from moqt.dataparser import DataStreamParser
from moqt.errors import MoqtError
from moqt.events import Event, ObjectReceived, SessionClosed
from moqt.message import Message
from moqt.messages14 import ClientSetup, ServerSetup
from moqt.messages18 import Setup
from moqt.session import MoqtSession, Role, SessionConfig
from moqt.sessions import new_session
from moqt.types import Draft, GroupOrder, KeyValuePairs, Location, ObjectStatus
from moqt.varint import NeedMore
from tests.support.moqt_examples import DATAGRAMS, FETCH_OBJECTS, MESSAGES_14, MESSAGES_18, fetch_stream

FULL = os.environ.get("KVSP_SLOW") == "1"
drafts = st.sampled_from(list(Draft))
chunks = st.lists(st.binary(max_size=64), max_size=8)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=20_000 if FULL else 1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_control(draft: Draft) -> bytes:
    return b"".join(encode_message(m, draft) for m in (MESSAGES_14 if draft is Draft.D14 else MESSAGES_18))


def _valid_data(draft: Draft) -> bytes:
    return fetch_stream(draft, GroupOrder.ASCENDING, FETCH_OBJECTS)


@st.composite
def mutated(draw: st.DrawFn, kind: str) -> tuple[Draft, bytes]:
    draft = draw(drafts)
    data = bytearray(_valid_control(draft) if kind == "control" else _valid_data(draft))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif data:
            del data[i:i + draw(st.integers(1, 8))]
    return draft, bytes(data)


def _feed_control(draft: Draft, parts: list[bytes]) -> list[Message]:
    """The messages parsed before the end or the first error; each of them round-trips."""
    parser = ControlParser(draft)
    messages: list[Message] = []
    try:
        for part in parts:
            messages += parser.feed(part)
    except MoqtError:
        pass
    for message in messages:
        assert ControlParser(draft).feed(encode_message(message, draft)) == [message]
    return messages


FetchItem = tuple[int, int, int | None, int | None, bytes, ObjectStatus, KeyValuePairs]


def _fetch_items(events: list[Event]) -> list[FetchItem]:
    """(group, object, subgroup, priority, payload, status, extensions) of each complete object, pieces joined."""
    out: list[FetchItem] = []
    buf = bytearray()
    for e in events:
        if isinstance(e, ObjectReceived):
            assert e.offset == len(buf)
            buf += e.data
            if e.complete:
                out.append((e.group, e.object_id, e.subgroup, e.priority, bytes(buf), e.status, e.extensions))
                buf = bytearray()
    return out


def _feed_data(draft: Draft, parts: list[bytes], fin: bool) -> list[FetchItem] | None:
    """The objects of a data stream that parsed whole (None after an error); they round-trip."""
    parser = DataStreamParser(draft, 3)
    events: list[Event] = []
    try:
        for part in parts:
            events += parser.feed(part)
        events += parser.feed(b"", fin=fin)
    except MoqtError:
        return None
    items = _fetch_items(events)
    keys = [(group, obj) for group, obj, *_ in items]
    # in the order a FETCH is written in (the encoder checks it); our encoder always writes a priority, so an object
    # that a draft-18 peer sent without one (accepted by the parser) has no re-encoding to compare with
    if fin and items and keys == sorted(set(keys)) and all(item[3] is not None for item in items):
        again = _fetch_items(DataStreamParser(draft, 3).feed(fetch_stream(draft, GroupOrder.ASCENDING, items),
                                                             fin=True))
        assert again == items
    return items


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


# -- Parsers ------------------------------------------------------------------------------------------------


@FAST
@given(drafts, chunks)
def test_control_parser_arbitrary_bytes(draft: Draft, parts: list[bytes]) -> None:
    _feed_control(draft, parts)


@FAST
@given(drafts, st.lists(st.integers(0, 10_000), max_size=6))
def test_control_messages_round_trip_however_split(draft: Draft, cuts: list[int]) -> None:
    messages = MESSAGES_14 if draft is Draft.D14 else MESSAGES_18
    assert _feed_control(draft, _split(_valid_control(draft), cuts)) == list(messages)


@FAST
@given(mutated("control"), st.lists(st.integers(0, 10_000), max_size=4))
def test_control_parser_mutated_messages(case: tuple[Draft, bytes], cuts: list[int]) -> None:
    draft, data = case
    _feed_control(draft, _split(data, cuts))


@FAST
@given(drafts, chunks, st.booleans())
def test_data_parser_arbitrary_bytes(draft: Draft, parts: list[bytes], fin: bool) -> None:
    _feed_data(draft, parts, fin)


@FAST
@given(drafts, st.lists(st.integers(0, 10_000), max_size=6))
def test_fetch_objects_round_trip_however_split(draft: Draft, cuts: list[int]) -> None:
    items = _feed_data(draft, _split(_valid_data(draft), cuts), True)
    assert items is not None
    assert [(g, o, p, payload, status, ext) for g, o, _sub, p, payload, status, ext in items] == \
        [(g, o, p, payload, status, ext) for g, o, _sub, p, payload, status, ext in FETCH_OBJECTS]


@FAST
@given(mutated("data"), st.lists(st.integers(0, 10_000), max_size=4), st.booleans())
def test_data_parser_mutated_streams(case: tuple[Draft, bytes], cuts: list[int], fin: bool) -> None:
    draft, data = case
    _feed_data(draft, _split(data, cuts), fin)


@FAST
@given(drafts, st.one_of(st.binary(max_size=40), st.sampled_from(DATAGRAMS).map(lambda d: d.encode(Draft.D14))))
def test_datagram_decoder(draft: Draft, data: bytes) -> None:
    with contextlib.suppress(MoqtError, NeedMore):
        datagram = decode_datagram(draft, data)
        if datagram is not None:  # what decodes, re-encodes to what decodes the same
            assert decode_datagram(draft, datagram.encode(draft)) == datagram


@FAST
@given(drafts, st.sampled_from(DATAGRAMS))
def test_datagrams_round_trip(draft: Draft, datagram: ObjectDatagram) -> None:
    assert decode_datagram(draft, datagram.encode(draft)) == datagram


# -- Sessions -----------------------------------------------------------------------------------------------------


def _session(draft: Draft, role: Role) -> MoqtSession:
    s = new_session(draft, role, SessionConfig(datagrams=True))
    s.start()
    if role is Role.SERVER:
        setup = ClientSetup((draft.version,), ((2, 1000),)) if draft is Draft.D14 else Setup()
        s.receive_stream_data(0 if draft is Draft.D14 else 2, encode_message(setup, draft))
    else:
        setup2 = ServerSetup(draft.version, ((2, 1000),)) if draft is Draft.D14 else Setup()
        s.receive_stream_data(0 if draft is Draft.D14 else 3, encode_message(setup2, draft))
        s.fetch((b"n",), b"t", Location(0, 0), Location(1, 0))
        s.subscribe((b"n",), b"u")
    s.take_actions()
    return s


inputs = st.lists(st.tuples(st.sampled_from(["data", "reset", "stop", "datagram"]), st.integers(0, 12),
                            st.binary(max_size=48), st.booleans()), max_size=12)


def _drive(session: MoqtSession, steps: list[tuple[str, int, bytes, bool]]) -> None:
    for kind, stream, data, fin in steps:
        if kind == "data":
            events = session.receive_stream_data(stream, data, fin)
        elif kind == "reset":
            events = session.receive_stream_reset(stream, len(data))
        elif kind == "stop":
            events = session.receive_stop_sending(stream, len(data))
        else:
            events = session.receive_datagram(data)
        actions = session.take_actions()
        closes = [e for e in events if isinstance(e, SessionClosed)]
        if closes:
            assert isinstance(actions[-1], CloseSession) and session.closed


@FAST
@given(drafts, st.sampled_from(list(Role)), inputs)
def test_session_arbitrary_inputs(draft: Draft, role: Role, steps: list[tuple[str, int, bytes, bool]]) -> None:
    _drive(_session(draft, role), steps)


@FAST
@given(mutated("control"), st.sampled_from(list(Role)))
def test_session_mutated_control_stream(case: tuple[Draft, bytes], role: Role) -> None:
    draft, data = case
    session = _session(draft, role)
    stream = 0 if draft is Draft.D14 else 4
    _drive(session, [("data", stream, data[i:i + 50], False) for i in range(0, len(data), 50)])


@FAST
@given(mutated("data"), st.booleans())
def test_session_mutated_data_stream(case: tuple[Draft, bytes], fin: bool) -> None:
    draft, data = case
    session = _session(draft, Role.CLIENT)
    _drive(session, [("data", 7, data, fin)])


# -- Long runs ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@SLOW
@given(mutated("control"), st.lists(st.integers(0, 10_000), max_size=6))
def test_slow_control_parser_mutations(case: tuple[Draft, bytes], cuts: list[int]) -> None:
    draft, data = case
    _feed_control(draft, _split(data, cuts))


@pytest.mark.slow
@SLOW
@given(mutated("data"), st.lists(st.integers(0, 10_000), max_size=6), st.booleans())
def test_slow_data_parser_mutations(case: tuple[Draft, bytes], cuts: list[int], fin: bool) -> None:
    draft, data = case
    _feed_data(draft, _split(data, cuts), fin)


@pytest.mark.slow
@SLOW
@given(drafts, st.sampled_from(list(Role)), inputs)
def test_slow_session_inputs(draft: Draft, role: Role, steps: list[tuple[str, int, bytes, bool]]) -> None:
    _drive(_session(draft, role), steps)
