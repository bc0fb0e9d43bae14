"""moqt codecs: varints, shared structures and every control message of drafts 14 and 18."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moqt import messages14 as m14
from moqt import messages18 as m18
from moqt.control import ControlParser, decode_message, encode_message
from moqt.errors import MoqtError, RequestErrorCode18, SessionErrorCode
from moqt.message import Message
from moqt.types import (
    AliasType,
    AuthToken,
    Draft,
    FilterType,
    GroupOrder,
    JoiningFetch,
    Location,
    StandaloneFetch,
    SubscriptionFilter,
    decode_kvp_block,
    decode_namespace,
    encode_kvp_block,
    encode_namespace,
)
from moqt.varint import NeedMore, Reader, Writer, encode_quic, encode_vi64
from tests.support.moqt_examples import MESSAGES_14, MESSAGES_18, P18

PV = SessionErrorCode.PROTOCOL_VIOLATION

# -- Varints ---------------------------------------------------------------------------------------------------

# draft-ietf-moq-transport-18, "Example Integer Encodings" (vi64).
VI64_EXAMPLES = [
    ("25", 37), ("8025", 37), ("bbbd", 15293), ("ed7f3e7d", 226442877), ("faa1a0e403d8", 2893212287960),
    ("fc8998abc66bc0", 151288809941952), ("fefa318fa8e3ca11", 70423237261249041),
    ("ffffffffffffffffff", 18446744073709551615),
]
# RFC 9000 appendix A.1 (draft 14 uses the QUIC varint, RFC 9000 section 16).
QUIC_EXAMPLES = [("c2197c5eff14e88c", 151288809941952652), ("9d7f3e7d", 494878333), ("7bbd", 15293),
                 ("25", 37), ("4025", 37)]


@pytest.mark.parametrize(("hexa", "value"), VI64_EXAMPLES)
def test_vi64_examples_of_draft_18(hexa: str, value: int) -> None:
    data = bytes.fromhex(hexa)
    r = Reader(data, vi64=True)
    assert r.varint() == value and r.at_end()


def test_vi64_encodes_minimally() -> None:
    for hexa, value in VI64_EXAMPLES:
        if hexa != "8025":  # the one non-minimal example
            assert encode_vi64(value).hex() == hexa


@pytest.mark.parametrize(("hexa", "value"), QUIC_EXAMPLES)
def test_quic_varint_examples(hexa: str, value: int) -> None:
    r = Reader(bytes.fromhex(hexa), vi64=False)
    assert r.varint() == value and r.at_end()
    if hexa != "4025":
        assert encode_quic(value).hex() == hexa


@given(st.integers(0, 2**64 - 1))
def test_vi64_round_trip(value: int) -> None:
    data = encode_vi64(value)
    assert Reader(data, True).varint() == value
    with pytest.raises(NeedMore):
        Reader(data[:-1], True).varint()


@given(st.integers(0, 2**62 - 1))
def test_quic_round_trip(value: int) -> None:
    data = encode_quic(value)
    assert Reader(data, False).varint() == value
    with pytest.raises(NeedMore):
        Reader(data[:-1], False).varint()


def test_varint_ranges() -> None:
    with pytest.raises(ValueError):
        encode_quic(2**62)
    with pytest.raises(ValueError):
        encode_vi64(2**64)
    with pytest.raises(ValueError):
        encode_vi64(-1)
    assert len(encode_vi64(2**56 - 1)) == 8 and len(encode_vi64(2**56)) == 9


# -- Shared structures --------------------------------------------------------------------------------------


def test_kvp_block_draft14_absolute_and_draft18_delta() -> None:
    pairs = ((6, 1000), (2, 7), (13, b"ab"))
    w = Writer(False)
    encode_kvp_block(w, pairs, delta=False)
    assert w.getvalue() == bytes([9, 0x06, 0x43, 0xE8, 0x02, 0x07, 0x0D, 0x02]) + b"ab"
    assert decode_kvp_block(Reader(w.getvalue(), False), delta=False) == pairs
    w = Writer(True)
    encode_kvp_block(w, pairs, delta=True)  # sorted: 2, 6, 13 -> deltas 2, 4, 7; 1000 in vi64 is 0x83e8
    assert w.getvalue() == bytes([9, 0x02, 0x07, 0x04, 0x83, 0xE8, 0x07, 0x02]) + b"ab"
    assert decode_kvp_block(Reader(w.getvalue(), True), delta=True) == ((2, 7), (6, 1000), (13, b"ab"))


def test_kvp_overrunning_its_block_is_a_formatting_error() -> None:
    data = bytes([2, 0x03, 0x05]) + b"abcde"  # an odd pair of 5 octets in a block of 2
    with pytest.raises(MoqtError) as err:
        decode_kvp_block(Reader(data, False), delta=False)
    assert err.value.code == SessionErrorCode.KEY_VALUE_FORMATTING_ERROR


def test_kvp_value_longer_than_64k_is_a_protocol_violation() -> None:
    w = Writer(False)
    w.varint(1)
    w.varint(0x10000)
    with pytest.raises(MoqtError) as err:
        from moqt.types import decode_kvp
        decode_kvp(Reader(w.getvalue() + bytes(0x10000), False), 0, delta=False)
    assert err.value.code == PV


@pytest.mark.parametrize(("draft", "ns", "ok"), [
    (Draft.D14, (), False), (Draft.D18, (), True), (Draft.D14, (b"",), True), (Draft.D18, (b"",), False),
    (Draft.D14, (b"x",) * 32, True), (Draft.D14, (b"x",) * 33, False), (Draft.D18, (b"x" * 4097,), False),
])
def test_namespace_bounds(draft: Draft, ns: tuple[bytes, ...], ok: bool) -> None:
    w = Writer(draft.vi64)
    encode_namespace(w, ns)
    if ok:
        assert decode_namespace(Reader(w.getvalue(), draft.vi64)) == ns
    else:
        with pytest.raises(MoqtError) as err:
            decode_namespace(Reader(w.getvalue(), draft.vi64))
        assert err.value.code == PV


def test_location_order() -> None:
    assert Location(1, 9) < Location(2, 0) < Location(2, 1)


def test_filter_end_group_is_a_delta_in_draft_18() -> None:
    flt = SubscriptionFilter(FilterType.ABSOLUTE_RANGE, Location(100, 0), 110)
    w14, w18 = Writer(False), Writer(True)
    flt.encode(w14, end_delta=False)
    flt.encode(w18, end_delta=True)
    assert w14.getvalue() == bytes([0x04, 0x40, 0x64, 0x00, 0x40, 0x6E])
    assert w18.getvalue() == bytes([0x04, 0x64, 0x00, 0x0A])
    assert SubscriptionFilter.decode(Reader(w18.getvalue(), True), end_delta=True) == flt


def test_auth_token_structure() -> None:
    token = AuthToken(AliasType.USE_VALUE, None, 0, b"secret")
    assert token.encode(False) == b"\x03\x00secret"
    assert AuthToken.decode(b"\x03\x00secret", False) == token
    assert AuthToken.decode(b"\x01\x05\x00v", True) == AuthToken(AliasType.REGISTER, 5, 0, b"v")
    with pytest.raises(MoqtError) as err:
        AuthToken.decode(b"\x09", False)
    assert err.value.code == SessionErrorCode.KEY_VALUE_FORMATTING_ERROR


# -- Every message -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("msg", MESSAGES_14, ids=lambda m: type(m).__name__)
def test_draft14_round_trip(msg: Message) -> None:
    data = encode_message(msg, Draft.D14)
    assert decode_message(Draft.D14, data) == (msg, len(data))


@pytest.mark.parametrize("msg", MESSAGES_18, ids=lambda m: type(m).__name__)
def test_draft18_round_trip(msg: Message) -> None:
    data = encode_message(msg, Draft.D18)
    assert decode_message(Draft.D18, data) == (msg, len(data))


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in MESSAGES_14} == set(m14.MESSAGES.values())
    assert {type(m) for m in MESSAGES_18} == set(m18.MESSAGES.values())


def test_exact_bytes_of_draft14_setup_and_fetch() -> None:
    data = encode_message(m14.ClientSetup((0xFF00000E,), ((2, 64),)), Draft.D14)
    assert data.hex() == "20000d" + "01" + "c0000000ff00000e" + "01" + "02" + "4040"
    fetch = encode_message(m14.Fetch(0, StandaloneFetch((b"a",), b"b", Location(0, 0), Location(1, 0))),
                           Draft.D14)
    # type 0x16, length, request 0, priority 128, order 0, type 1, ns (1, "a"), name "b", 0/0, 1/0, no params
    assert fetch.hex() == "16000e" + "00" + "80" + "00" + "01" + "01" + "0161" + "0162" + "0000" + "0100" + "00"


def test_exact_bytes_of_draft18_setup_and_subscribe() -> None:
    data = encode_message(m18.Setup(((1, b"/"), (7, b"x"))), Draft.D18)
    # SETUP type 0x2F00 as vi64 (two octets, 10 prefix), length, options: delta 1 "/", delta 6 "x"
    assert data.hex() == "af00" + "0006" + "01012f" + "060178"
    sub = encode_message(m18.Subscribe(0, (b"n",), b"t", P18(subscriber_priority=200, forward=True)), Draft.D18)
    # params: count 2; FORWARD 0x10 uint8 1; SUBSCRIBER_PRIORITY delta 0x10 uint8 200
    assert sub.hex() == "03000b" + "00" + "01016e" + "0174" + "02" + "1001" + "10c8"


def test_publish_ok_code_point_decodes_as_request_ok() -> None:
    body = encode_message(m18.RequestOk(), Draft.D18)[3:]
    assert decode_message(Draft.D18, b"\x1e" + len(body).to_bytes(2, "big") + body)[0] == m18.RequestOk()


def test_control_parser_reassembles_across_any_split() -> None:
    blob = b"".join(encode_message(m, Draft.D14) for m in MESSAGES_14)
    for step in (1, 2, 7, 100):
        parser = ControlParser(Draft.D14)
        got: list[Message] = []
        for i in range(0, len(blob), step):
            got += parser.feed(blob[i:i + step])
        assert got == MESSAGES_14 and parser.pending == 0


# -- Hypothesis round trips ------------------------------------------------------------------------------------

u8 = st.integers(0, 255)
v14 = st.integers(0, 2**62 - 1)
v18 = st.integers(0, 2**64 - 1)
small = st.integers(0, 2**20)
blob = st.binary(max_size=12)
ns14 = st.lists(st.binary(max_size=6), min_size=1, max_size=4).map(tuple)
ns18 = st.lists(st.binary(min_size=1, max_size=6), max_size=4).map(tuple)
loc = st.builds(Location, small, small)
order_any = st.sampled_from(GroupOrder)
order_set = st.sampled_from([GroupOrder.ASCENDING, GroupOrder.DESCENDING])
reason = st.binary(max_size=40)


@st.composite
def filters(draw: st.DrawFn) -> SubscriptionFilter:
    ftype = draw(st.sampled_from(FilterType))
    start = draw(loc) if ftype in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE) else None
    end = start.group + draw(small) if start is not None and ftype is FilterType.ABSOLUTE_RANGE else None
    return SubscriptionFilter(ftype, start, end)


def kvps(vint: st.SearchStrategy[int], *, exclude: frozenset[int] = frozenset()) -> st.SearchStrategy[tuple]:  # type: ignore[type-arg]
    even = st.tuples(st.integers(0, 200).map(lambda t: t * 2).filter(lambda t: t not in exclude), vint)
    odd = st.tuples(st.integers(0, 200).map(lambda t: t * 2 + 1).filter(lambda t: t not in exclude), blob)
    return st.lists(st.one_of(even, odd), max_size=4).map(tuple)


p14 = kvps(v14, exclude=frozenset({2, 4}))
setup14 = kvps(v14, exclude=frozenset({1, 2, 4, 5, 7}))
targets14 = st.one_of(st.builds(StandaloneFetch, ns14, blob, loc, loc),
                      st.builds(JoiningFetch, v14, v14, st.booleans()))
targets18 = st.one_of(st.builds(StandaloneFetch, ns18, blob, loc, loc),
                      st.builds(JoiningFetch, v18, v18, st.booleans()))

STRATEGIES_14 = [
    st.builds(m14.ClientSetup, st.lists(v14, max_size=3).map(tuple), setup14),
    st.builds(m14.ServerSetup, v14, setup14),
    st.builds(m14.Goaway, blob), st.builds(m14.MaxRequestId, v14), st.builds(m14.RequestsBlocked, v14),
    st.builds(m14.Subscribe, v14, ns14, blob, u8, order_any, st.booleans(), filters(), p14),
    st.builds(m14.SubscribeOk, v14, v14, v14, order_set, st.none() | loc, p14),
    st.builds(m14.SubscribeError, v14, v14, reason),
    st.builds(m14.SubscribeUpdate, v14, v14, loc, v14, u8, st.booleans(), p14),
    st.builds(m14.Unsubscribe, v14), st.builds(m14.PublishDone, v14, v14, v14, reason),
    st.builds(m14.Publish, v14, ns14, blob, v14, order_set, st.none() | loc, st.booleans(), p14),
    st.builds(m14.PublishOk, v14, st.booleans(), u8, order_set, filters(), p14),
    st.builds(m14.PublishError, v14, v14, reason),
    st.builds(m14.Fetch, v14, targets14, u8, order_any, p14),
    st.builds(m14.FetchOk, v14, loc, st.booleans(), order_set, p14), st.builds(m14.FetchError, v14, v14, reason),
    st.builds(m14.FetchCancel, v14),
    st.builds(m14.TrackStatus, v14, ns14, blob, u8, order_any, st.booleans(), filters(), p14),
    st.builds(m14.TrackStatusOk, v14, v14, v14, order_set, st.none() | loc, p14),
    st.builds(m14.TrackStatusError, v14, v14, reason),
    st.builds(m14.PublishNamespace, v14, ns14, p14), st.builds(m14.PublishNamespaceOk, v14),
    st.builds(m14.PublishNamespaceError, v14, v14, reason), st.builds(m14.PublishNamespaceDone, ns14),
    st.builds(m14.PublishNamespaceCancel, ns14, v14, reason),
    st.builds(m14.SubscribeNamespace, v14, ns14, p14), st.builds(m14.SubscribeNamespaceOk, v14),
    st.builds(m14.SubscribeNamespaceError, v14, v14, reason), st.builds(m14.UnsubscribeNamespace, ns14),
]


def params18(allowed: frozenset[int]) -> st.SearchStrategy[m18.Params18]:
    P = m18.Param18
    fields = {
        "object_delivery_timeout": (P.OBJECT_DELIVERY_TIMEOUT, v18), "rendezvous_timeout": (P.RENDEZVOUS_TIMEOUT, v18),
        "subgroup_delivery_timeout": (P.SUBGROUP_DELIVERY_TIMEOUT, v18), "expires": (P.EXPIRES, v18),
        "largest_object": (P.LARGEST_OBJECT, loc), "fill_timeout": (P.FILL_TIMEOUT, v18),
        "forward": (P.FORWARD, st.booleans()), "subscriber_priority": (P.SUBSCRIBER_PRIORITY, u8),
        "subscription_filter": (P.SUBSCRIPTION_FILTER, filters()), "group_order": (P.GROUP_ORDER, order_set),
        "new_group_request": (P.NEW_GROUP_REQUEST, v18), "track_namespace_prefix": (P.TRACK_NAMESPACE_PREFIX, ns18),
        "auth_tokens": (P.AUTHORIZATION_TOKEN, st.lists(blob, max_size=2).map(tuple)),
    }
    return st.fixed_dictionaries({}, optional={k: s for k, (t, s) in fields.items() if t in allowed}).map(
        lambda kw: m18.Params18(**kw))


props = kvps(v18)
STRATEGIES_18 = [
    st.builds(m18.Setup, kvps(v18, exclude=frozenset({1, 4, 5, 7}))),
    st.builds(m18.Goaway, blob, v18, st.none() | v18),
    st.builds(m18.Subscribe, v18, ns18, blob, params18(m18._SUBSCRIBE)),
    st.builds(m18.SubscribeOk, v18, params18(m18._SUBSCRIBE_OK), props),
    st.builds(m18.RequestUpdate, v18, params18(m18._UPDATE)),
    st.builds(m18.Publish, v18, ns18, blob, v18, params18(m18._PUBLISH), props),
    st.builds(m18.PublishDone, v18, v18, reason),
    st.builds(m18.Fetch, v18, targets18, params18(m18._FETCH)),
    st.builds(m18.FetchOk, loc, st.booleans(), st.just(m18.Params18()), props),
    st.builds(m18.TrackStatus, v18, ns18, blob, params18(m18._AUTH)),
    st.builds(m18.PublishNamespace, v18, ns18, params18(m18._AUTH)),
    st.builds(m18.SubscribeNamespace, v18, ns18, params18(m18._AUTH)),
    st.builds(m18.SubscribeTracks, v18, ns18, params18(m18._SUBSCRIBE_TRACKS)),
    st.builds(m18.NamespaceMsg, ns18), st.builds(m18.NamespaceDone, ns18),
    st.builds(m18.PublishBlocked, ns18, blob), st.builds(m18.RequestOk, params18(m18._REQUEST_OK), props),
    st.builds(m18.RequestError, st.integers(0, 0x33), v18, reason),
]


def _canonical18(msg: Message) -> Message:
    """Draft 18 properties are written sorted by type (delta coding); compare in that order."""
    if hasattr(msg, "properties"):
        from dataclasses import replace
        return replace(msg, properties=tuple(sorted(msg.properties, key=lambda p: p[0])))  # type: ignore[type-var]
    if isinstance(msg, m18.Setup):
        return m18.Setup(tuple(sorted(msg.options, key=lambda p: p[0])))
    return msg


@settings(max_examples=40, deadline=None)
@given(st.one_of(STRATEGIES_14))
def test_draft14_generated_round_trip(msg: Message) -> None:
    data = encode_message(msg, Draft.D14)
    assert decode_message(Draft.D14, data) == (msg, len(data))


@settings(max_examples=40, deadline=None)
@given(st.one_of(STRATEGIES_18))
def test_draft18_generated_round_trip(msg: Message) -> None:
    data = encode_message(msg, Draft.D18)
    assert decode_message(Draft.D18, data) == (_canonical18(msg), len(data))


# -- Malformed control messages, one per kind ----------------------------------------------------------------


def _frame(draft: Draft, mtype: int, body: bytes) -> bytes:
    w = Writer(draft.vi64)
    w.varint(mtype)
    return w.getvalue() + len(body).to_bytes(2, "big") + body


def _code(draft: Draft, data: bytes) -> int:
    with pytest.raises(MoqtError) as err:
        ControlParser(draft).feed(data)
    return err.value.code


@pytest.mark.parametrize("draft", Draft)
def test_unknown_message_type(draft: Draft) -> None:
    assert _code(draft, _frame(draft, 0x3F, b"")) == PV
    assert _code(draft, _frame(draft, 0x40, b"")) == PV  # CLIENT_SETUP of drafts <= 10


def test_draft14_messages_unknown_in_draft18() -> None:
    assert _code(Draft.D18, encode_message(m14.Unsubscribe(0), Draft.D14)) == PV  # 0xA was removed
    assert _code(Draft.D14, encode_message(m18.SubscribeNamespace(0, (b"a",)), Draft.D18)) == PV  # 0x50


@pytest.mark.parametrize("draft", Draft)
def test_length_mismatch(draft: Draft) -> None:
    msg = m14.Unsubscribe(5) if draft is Draft.D14 else m18.PublishDone(1, 2, b"x")
    data = encode_message(msg, draft)
    longer = data[:-len(data) + 1] + (int.from_bytes(data[1:3], "big") + 1).to_bytes(2, "big") + data[3:] + b"\0"
    shorter = data[:1] + (int.from_bytes(data[1:3], "big") - 1).to_bytes(2, "big") + data[3:-1]
    assert _code(draft, longer) == PV
    assert _code(draft, shorter) == PV


def test_draft14_field_ranges() -> None:
    ok = encode_message(m14.Subscribe(0, (b"a",), b"t"), Draft.D14)
    body = bytearray(ok[3:])
    i = 1 + 1 + 2 + 2  # request id, ns count, field, name -> priority at i
    for offset, value in ((1, 3), (2, 2)):  # group order 3, forward 2
        bad = bytearray(body)
        bad[i + offset] = value
        assert _code(Draft.D14, _frame(Draft.D14, 0x3, bytes(bad))) == PV
    bad = bytearray(body)
    bad[i + 3] = 5  # filter type 5
    assert _code(Draft.D14, _frame(Draft.D14, 0x3, bytes(bad))) == PV
    ok_reply = encode_message(m14.SubscribeOk(0, 1), Draft.D14)
    bad = bytearray(ok_reply[3:])
    bad[3] = 0  # SUBSCRIBE_OK with group order 0
    assert _code(Draft.D14, _frame(Draft.D14, 0x4, bytes(bad))) == PV
    bad[3], bad[4] = 1, 2  # content exists 2
    assert _code(Draft.D14, _frame(Draft.D14, 0x4, bytes(bad))) == PV


def test_fetch_type_unknown() -> None:
    body = bytes([0, 128, 0, 4]) + b"\x00\x00"
    assert _code(Draft.D14, _frame(Draft.D14, 0x16, body)) == PV


def test_reason_phrase_too_long() -> None:
    w = Writer(False)
    w.varint(0)
    w.varint(0)
    w.length_prefixed(b"x" * 1025)
    assert _code(Draft.D14, _frame(Draft.D14, 0x5, w.getvalue())) == PV


def test_draft14_duplicate_known_parameter() -> None:
    msg = m14.Subscribe(0, (b"a",), b"t", params=((2, 1), (2, 2)))
    assert _code(Draft.D14, encode_message(msg, Draft.D14)) == PV
    repeated_unknown = m14.Subscribe(0, (b"a",), b"t", params=((8, 1), (8, 2), (3, b"a"), (3, b"b")))
    assert ControlParser(Draft.D14).feed(encode_message(repeated_unknown, Draft.D14)) == [repeated_unknown]


def _params18_body(*pairs: bytes) -> bytes:
    return bytes([len(pairs)]) + b"".join(pairs)


@pytest.mark.parametrize(("params", "why"), [
    (_params18_body(b"\x0c\x00"), "unknown parameter 0x0c"),
    (_params18_body(b"\x09\x00\x00"), "LARGEST_OBJECT is not allowed in SUBSCRIBE"),
    (_params18_body(b"\x10\x01", b"\x00\x01"), "FORWARD repeated"),
    (_params18_body(b"\x10\x02"), "FORWARD 2"),
    (_params18_body(b"\x22\x03"), "GROUP_ORDER 3"),
    (_params18_body(b"\x21\x03\x04\x00\x00"), "SUBSCRIPTION_FILTER shorter than its filter"),
    (_params18_body(b"\x02" + b"\xff" * 9, b"\xff" + b"\xff" * 8), "type delta past 2^64-1"),
])
def test_draft18_bad_parameters(params: bytes, why: str) -> None:
    body = b"\x00" + b"\x01\x01n" + b"\x01t" + params
    assert _code(Draft.D18, _frame(Draft.D18, 0x3, body)) == PV, why


def test_draft18_namespace_field_must_not_be_empty() -> None:
    body = b"\x00" + b"\x01\x00" + b"\x01t" + b"\x00"
    assert _code(Draft.D18, _frame(Draft.D18, 0x3, body)) == PV


def test_draft18_full_track_name_bound() -> None:
    w = Writer(True)
    w.varint(0)
    encode_namespace(w, (b"a" * 4000,))
    w.length_prefixed(b"b" * 97)
    w.varint(0)
    assert _code(Draft.D18, _frame(Draft.D18, 0x3, w.getvalue())) == PV


def test_constructors_refuse_what_the_wire_cannot_carry() -> None:
    with pytest.raises(ValueError):
        m14.SubscribeOk(0, 1, group_order=GroupOrder.PUBLISHER)
    with pytest.raises(ValueError):
        m18.SubscribeOk(1, P18(subscriber_priority=1))  # not a SUBSCRIBE_OK parameter
    with pytest.raises(ValueError):
        m18.RequestError(RequestErrorCode18.REDIRECT)  # needs a Redirect
    with pytest.raises(ValueError):
        SubscriptionFilter(FilterType.ABSOLUTE_RANGE, Location(5, 0), 4)
    with pytest.raises(ValueError):
        encode_message(m14.Unsubscribe(0), Draft.D18)


# -- Textual names (draft 18 example) ------------------------------------------------------------------------------


def test_rendered_name_example_of_draft_18() -> None:
    from moqt.types import parse_name, render_name
    text = "example.2enet-team2-project_x--report"
    assert parse_name(text) == ((b"example.net", b"team2", b"project_x"), b"report")
    assert render_name((b"example.net", b"team2", b"project_x"), b"report") == text
    assert render_name((b"kvsp-1", b"\x00\xff")) == "kvsp.2d1-.00.ff"


@pytest.mark.parametrize("bad", ["a.2Ed", "a.61", "a.2", "a.", "a b", "a--b--c", "-a"])
def test_rendered_names_are_canonical(bad: str) -> None:
    from moqt.types import parse_name
    with pytest.raises(ValueError):
        parse_name(bad)
    assert parse_name("a--") == ((b"a",), b"")  # an empty track name is fine


@given(st.lists(st.binary(min_size=1, max_size=5), max_size=4).map(tuple), st.binary(max_size=5))
def test_rendered_names_round_trip(ns: tuple[bytes, ...], name: bytes) -> None:
    from moqt.types import parse_name, render_name
    assert parse_name(render_name(ns, name)) == (ns, name)
