"""moqt data plane: subgroup / fetch streams, object headers, datagrams, the incremental parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moqt.data import (
    FetchObjectEncoder,
    ObjectDatagram,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupObjectEncoder,
    decode_datagram,
    encode_fetch_header,
    is_subgroup_type,
)
from moqt.dataparser import DataStreamParser
from moqt.errors import MoqtError, SessionErrorCode
from moqt.events import DataStreamOpened, Event, FetchRangeEnded, ObjectReceived, StreamEnded
from moqt.types import Draft, GroupOrder, KeyValuePairs, Location, ObjectStatus
from moqt.varint import encode_quic, encode_vi64
from tests.support.moqt_examples import DATAGRAMS, FETCH_OBJECTS, fetch_stream

PV = SessionErrorCode.PROTOCOL_VIOLATION


def objects(events: list[Event]) -> list[tuple[int, int, int | None, bytes, ObjectStatus, KeyValuePairs]]:
    """(group, object, subgroup, payload, status, extensions) of each complete object, pieces joined."""
    out = []
    parts: dict[tuple[int, int], bytearray] = {}
    for e in events:
        if isinstance(e, ObjectReceived):
            buf = parts.setdefault((e.group, e.object_id), bytearray())
            assert e.offset == len(buf)
            buf += e.data
            if e.complete:
                out.append((e.group, e.object_id, e.subgroup, bytes(buf), e.status, e.extensions))
    return out


def parse(draft: Draft, data: bytes, *, step: int | None = None, **kw: object) -> list[Event]:
    parser = DataStreamParser(draft, 3, **kw)  # type: ignore[arg-type]
    events: list[Event] = []
    if step is None:
        return parser.feed(data, fin=True)
    for i in range(0, len(data), step):
        events += parser.feed(data[i:i + step])
    return events + parser.feed(b"", fin=True)


# -- The drafts' examples ("Examples" in Data Streams) --------------------------------------------------------------


def test_draft14_example_subgroup_stream() -> None:
    # SUBGROUP_HEADER type 0x14, alias 2, group 0, subgroup 0, priority 0; objects 0 "abcd" and 1 "efgh"
    # (object ids are delta-coded: both deltas 0).
    wire = bytes.fromhex("1402000000" + "0004") + b"abcd" + bytes.fromhex("0004") + b"efgh"
    header = SubgroupHeader(2, 0, 0, 0, mode=SubgroupIdMode.EXPLICIT)
    enc = SubgroupObjectEncoder(Draft.D14, False)
    assert header.encode(Draft.D14) + enc.encode(0, 4) + b"abcd" + enc.encode(1, 4) + b"efgh" == wire
    events = parse(Draft.D14, wire)
    assert isinstance(events[0], DataStreamOpened) and events[0].track_alias == 2
    assert [o[:4] for o in objects(events)] == [(0, 0, 0, b"abcd"), (0, 1, 0, b"efgh")]
    assert isinstance(events[-1], StreamEnded)


def test_draft14_example_with_extensions() -> None:
    # Type 0x15 (extensions), first object: Extension Headers Length 33 = {Type 4, Value 2186796243 (8-octet varint)}
    # + {Type 77, Length 21, Value ...}. The draft shows the value as "traceID:123456" but declares 21 octets (and
    # 33 = 1 + 8 + 2 + 1 + 21): the declared lengths are what we transcribe.
    value = b"traceID:123456".ljust(21, b".")
    ext = bytes([4]) + encode_quic(2186796243) + encode_quic(77) + bytes([21]) + value
    assert len(ext) == 33
    wire = (bytes.fromhex("1502000000") + b"\x00" + bytes([33]) + ext + b"\x04abcd" + b"\x00\x00\x04efgh")
    events = parse(Draft.D14, wire)
    got = objects(events)
    assert got[0][:4] == (0, 0, 0, b"abcd") and got[0][5] == ((4, 2186796243), (77, value))
    assert got[1][:4] == (0, 1, 0, b"efgh") and got[1][5] == ()
    enc = SubgroupObjectEncoder(Draft.D14, True)
    assert enc.encode(0, 4, extensions=((4, 2186796243), (77, value))) == b"\x00" + bytes([33]) + ext + b"\x04"


def test_draft18_example_subgroup_streams() -> None:
    wire = bytes.fromhex("1402000000" + "0004") + b"abcd" + bytes.fromhex("0004") + b"efgh"
    assert [o[:4] for o in objects(parse(Draft.D18, wire))] == [(0, 0, 0, b"abcd"), (0, 1, 0, b"efgh")]
    # Type 0x35: DEFAULT_PRIORITY (no priority octet), explicit subgroup id, properties. vi64 and delta-coded
    # types make this block 29 octets (the draft repeats draft 14's 33, computed with QUIC varints).
    value = b"traceID:123456".ljust(21, b".")
    props = bytes([4]) + encode_vi64(2186796243) + bytes([73, 21]) + value
    wire = bytes.fromhex("35020000") + b"\x00" + bytes([len(props)]) + props + b"\x04abcd" + b"\x00\x00\x04efgh"
    assert len(props) == 29
    events = parse(Draft.D18, wire)
    opened = events[0]
    assert isinstance(opened, DataStreamOpened) and opened.priority is None and opened.subgroup == 0
    got = objects(events)
    assert got[0][5] == ((4, 2186796243), (77, value)) and got[1][:4] == (0, 1, 0, b"efgh")
    header = SubgroupHeader(2, 0, 0, None, extensions=True, mode=SubgroupIdMode.EXPLICIT)
    assert header.encode(Draft.D18) == bytes.fromhex("35020000")


# -- Subgroup headers ------------------------------------------------------------------------------------------


def test_subgroup_type_ranges() -> None:
    d14 = [t for t in range(0x80) if is_subgroup_type(Draft.D14, t)]
    assert d14 == [*range(0x10, 0x16), *range(0x18, 0x1E)]
    d18 = [t for t in range(0x100) if is_subgroup_type(Draft.D18, t)]
    assert len(d18) == 48 and all(t & 0x90 == 0x10 and (t >> 1) & 3 != 3 for t in d18)


@pytest.mark.parametrize("draft", Draft)
@pytest.mark.parametrize("mode", SubgroupIdMode)
@pytest.mark.parametrize("eog", [False, True])
@pytest.mark.parametrize("ext", [False, True])
def test_subgroup_header_variants(draft: Draft, mode: SubgroupIdMode, eog: bool, ext: bool) -> None:
    sub = {SubgroupIdMode.ZERO: 0, SubgroupIdMode.FIRST_OBJECT: 5, SubgroupIdMode.EXPLICIT: 9}[mode]
    header = SubgroupHeader(7, 3, sub, 200, ext, eog, mode)
    enc = SubgroupObjectEncoder(draft, ext)
    wire = header.encode(draft) + enc.encode(5, 2) + b"hi" + enc.encode(8, 0, status=ObjectStatus.END_OF_GROUP)
    events = parse(draft, wire)
    opened = events[0]
    assert isinstance(opened, DataStreamOpened)
    assert (opened.track_alias, opened.group, opened.priority, opened.end_of_group) == (7, 3, 200, eog)
    assert objects(events) == [(3, 5, sub, b"hi", ObjectStatus.NORMAL, ()),
                               (3, 8, sub, b"", ObjectStatus.END_OF_GROUP, ())]


def test_draft18_header_bits() -> None:
    header = SubgroupHeader(1, 2, 0, None, first_object=True)
    assert header.type_code(Draft.D18) == 0x70
    events = parse(Draft.D18, header.encode(Draft.D18))
    assert isinstance(events[0], DataStreamOpened) and events[0].priority is None
    with pytest.raises(ValueError):
        header.encode(Draft.D14)


def test_subgroup_object_ids_must_ascend() -> None:
    enc = SubgroupObjectEncoder(Draft.D14, False)
    enc.encode(4, 1)
    with pytest.raises(ValueError):
        enc.encode(4, 1)


# -- Fetch streams -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft", Draft)
@pytest.mark.parametrize("order", [GroupOrder.ASCENDING, GroupOrder.DESCENDING])
def test_fetch_stream_round_trip(draft: Draft, order: GroupOrder) -> None:
    items = FETCH_OBJECTS
    if order is GroupOrder.DESCENDING:
        by_group: dict[int, list] = {}  # type: ignore[type-arg]
        for item in items:
            by_group.setdefault(item[0], []).append(item)
        items = [i for g in sorted(by_group, reverse=True) for i in by_group[g]]
    wire = fetch_stream(draft, order, items)
    for step in (None, 1, 5):
        events = parse(draft, wire, step=step, fetch_group_order=lambda _rid: order)
        opened = events[0]
        assert isinstance(opened, DataStreamOpened) and opened.fetch and opened.request_id == 4
        got = objects(events)
        want = [(g, o, (o if draft is Draft.D14 else None) if s is None else s, p, st_, e)
                for g, o, s, _prio, p, st_, e in items]
        assert got == want
        assert all(e.priority == i[3] for e, i in zip([e for e in events if isinstance(e, ObjectReceived)
                                                       and e.offset == 0], items, strict=True))


def test_draft18_fetch_encoding_is_relative() -> None:
    enc = FetchObjectEncoder(Draft.D18)
    # first object: group, object delta, priority, properties present (flags 0x3C); absolute ids
    assert enc.encode(2, 0, 2, extensions=((8, 1000),)) == bytes.fromhex("3c 02 00 80 03 08 83e8 02".replace(" ", ""))
    assert enc.encode(2, 1, 1) == bytes.fromhex("0001")  # everything inherited
    assert enc.encode(3, 0, 1) == bytes.fromhex("0c000001")  # next group (delta 0), object absolute
    assert enc.end_of_range(Location(7, 9)) == bytes.fromhex("808c0709")
    assert enc.encode(7, 12, 1) == bytes.fromhex("040301")  # object delta 3 from the range end


def test_draft18_fetch_end_of_range_events() -> None:
    enc = FetchObjectEncoder(Draft.D18)
    wire = encode_fetch_header(Draft.D18, 4) + enc.encode(0, 0, 1) + b"a" + enc.end_of_range(Location(0, 5))
    wire += enc.end_of_range(Location(0, 9), unknown=True) + enc.encode(0, 10, 1) + b"b"
    events = parse(Draft.D18, wire)
    ranges = [e for e in events if isinstance(e, FetchRangeEnded)]
    assert [(r.location, r.unknown) for r in ranges] == [(Location(0, 5), False), (Location(0, 9), True)]
    assert [o[:2] for o in objects(events)] == [(0, 0), (0, 10)]


def test_fetch_encoder_refuses_out_of_order() -> None:
    enc = FetchObjectEncoder(Draft.D18, GroupOrder.ASCENDING)
    enc.encode(3, 3, 0)
    with pytest.raises(ValueError):
        enc.encode(3, 2, 0)
    with pytest.raises(ValueError):
        enc.encode(2, 0, 0)


def test_draft18_empty_fetch_object_status_setting() -> None:
    strict = FetchObjectEncoder(Draft.D18, empty_status=False)
    assert strict.encode(0, 0, 0) == bytes.fromhex("1c000080" + "00")  # no status after the zero length
    strict = FetchObjectEncoder(Draft.D18, empty_status=False)
    wire = encode_fetch_header(Draft.D18, 4) + strict.encode(0, 0, 0) + strict.encode(0, 1, 1) + b"z"
    events = parse(Draft.D18, wire, empty_fetch_status=False)
    assert [o[:4] for o in objects(events)] == [(0, 0, 0, b""), (0, 1, 0, b"z")]
    with pytest.raises(ValueError):
        strict.encode(0, 2, 0, status=ObjectStatus.END_OF_GROUP)


# -- Incremental parsing and zero copy ------------------------------------------------------------------------


def test_every_split_point() -> None:
    for draft in Draft:
        wire = fetch_stream(draft, GroupOrder.ASCENDING, FETCH_OBJECTS)
        want = objects(parse(draft, wire))
        for cut in range(1, len(wire)):
            parser = DataStreamParser(draft, 3)
            events = parser.feed(wire[:cut]) + parser.feed(wire[cut:], fin=True)
            assert objects(events) == want, cut


def test_payload_pieces_are_views_of_the_fed_buffers() -> None:
    """A 512 KiB object fed in 64 KiB reads: each piece is a view of the read it came in (no copy)."""
    payload = bytes(range(256)) * 2048
    enc = FetchObjectEncoder(Draft.D18)
    wire = encode_fetch_header(Draft.D18, 4) + enc.encode(0, 0, len(payload)) + payload
    parser = DataStreamParser(Draft.D18, 3)
    reads = [bytearray(wire[i:i + 65536]) for i in range(0, len(wire), 65536)]
    pieces = []
    for read in reads:
        for e in parser.feed(read):
            if isinstance(e, ObjectReceived):
                assert isinstance(e.data, memoryview) and e.data.obj is read
                pieces.append(e)
    assert [p.offset for p in pieces] == [sum(len(p.data) for p in pieces[:i]) for i in range(len(pieces))]
    assert pieces[-1].complete and not pieces[0].complete and pieces[0].length == len(payload)
    assert b"".join(bytes(p.data) for p in pieces) == payload


def test_header_cut_by_a_read_boundary_copies_only_a_slice() -> None:
    payload = b"\xab" * 200_000
    enc = FetchObjectEncoder(Draft.D14)
    header = enc.encode(0, 0, len(payload), extensions=((1, b"e" * 50),))
    wire = encode_fetch_header(Draft.D14, 4) + header + payload
    parser = DataStreamParser(Draft.D14, 3)
    first = parser.feed(wire[:10])
    rest = bytearray(wire[10:])
    events = parser.feed(rest, fin=True)
    views = [e for e in events if isinstance(e, ObjectReceived)]
    assert isinstance(first[0], DataStreamOpened)
    # the header's tail came from `rest`: the first piece is copied out of a small slice, the rest are views
    assert sum(len(v.data) for v in views) == len(payload)
    assert any(isinstance(v.data, memoryview) and v.data.obj is rest and len(v.data) > 100_000 for v in views)


# -- Datagrams --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft", Draft)
@pytest.mark.parametrize("dg", DATAGRAMS, ids=repr)
def test_datagram_round_trip(draft: Draft, dg: ObjectDatagram) -> None:
    got = decode_datagram(draft, dg.encode(draft))
    assert got is not None
    assert (got.track_alias, got.group, got.object_id, bytes(got.payload), got.status, got.extensions,
            got.end_of_group) == (dg.track_alias, dg.group, dg.object_id, dg.payload, dg.status, dg.extensions,
                                  dg.end_of_group)


def test_datagram_type_codes() -> None:
    assert ObjectDatagram(1, 2, 3, b"p").encode(Draft.D14)[0] == 0x00
    assert ObjectDatagram(1, 2, 0, b"p", end_of_group=True).encode(Draft.D14)[0] == 0x06
    assert ObjectDatagram(1, 2, 0, b"", status=ObjectStatus.DOES_NOT_EXIST).encode(Draft.D14)[0] == 0x20
    assert ObjectDatagram(1, 2, 0, b"", status=ObjectStatus.END_OF_GROUP).encode(Draft.D18)[0] == 0x24
    assert ObjectDatagram(1, 2, 3, b"p", priority=None).encode(Draft.D18)[0] == 0x08
    assert decode_datagram(Draft.D18, encode_vi64(0x132B3E29) + bytes(10)) is None  # padding


@pytest.mark.parametrize(("draft", "data"), [
    (Draft.D14, b"\x08\x01\x02\x03\x80"),  # type 0x08 is not a draft 14 datagram
    (Draft.D18, b"\x22\x01\x02\x03\x80\x00"),  # STATUS with END_OF_GROUP
    (Draft.D18, b"\x10\x01\x02\x03\x80"),  # outside 0b00X0XXXX
    (Draft.D14, b"\x01\x01\x02\x03\x80\x00pay"),  # extensions bit, empty block
    (Draft.D14, b"\x21\x01\x02\x03\x80\x02\x02\x01\x01"),  # DOES_NOT_EXIST with extensions
    (Draft.D18, b"\x21\x01\x02\x03\x80\x02\x02\x01\x03"),  # END_OF_GROUP status with properties
    (Draft.D18, b"\x20\x01\x02\x03\x80\x01"),  # status 1 does not exist in draft 18
    (Draft.D14, b"\x20\x01\x02\x03\x80\x02"),  # status 2 does not exist
])
def test_malformed_datagrams(draft: Draft, data: bytes) -> None:
    with pytest.raises(MoqtError) as err:
        decode_datagram(draft, data)
    assert err.value.code == PV


# -- Malformed data streams, one per kind -------------------------------------------------------------------------


@pytest.mark.parametrize(("draft", "wire", "why"), [
    (Draft.D14, b"\x04", "unknown stream type"),
    (Draft.D18, encode_vi64(0x2F00), "a control stream type on the data path"),
    (Draft.D14, b"\x16\x01\x00\x00\x80", "subgroup id mode 0b11"),
    (Draft.D18, b"\x1e\x01\x00\x80", "subgroup id mode 0b11"),
    (Draft.D14, b"\x14\x01\x00\x00\x80\x00\x05ab", "FIN in the middle of an object"),
    (Draft.D14, b"\x14\x01\x00\x00\x80\x00", "FIN in the middle of an object header"),
    (Draft.D14, b"\x14\x01\x00\x00\x80\x00\x00\x02", "object status 2"),
    (Draft.D18, b"\x14\x01\x00\x00\x80\x00\x00\x01", "draft 18 has no DOES_NOT_EXIST"),
    (Draft.D14, b"\x15\x01\x00\x00\x80\x00\x02\x02\x01\x00\x01", "extensions on DOES_NOT_EXIST"),
    (Draft.D18, b"\x15\x01\x00\x00\x80\x00\x02\x02\x01\x00\x03", "properties on END_OF_GROUP"),
    (Draft.D18, b"\x05\x04\x80\x81", "fetch serialization flags 0x81"),
    (Draft.D18, b"\x05\x04\x00\x01a", "the first fetch object refers to a previous one"),
    (Draft.D18, b"\x05\x04\x1d\x00\x00\x80\x01a", "the first fetch object refers to a previous subgroup"),
    (Draft.D18, b"\x05\x04\x1c\x00\x00\x80\x01a" + b"\x0c\x00\x00\x01b", "fine, then no FIN problem"),
])
def test_malformed_data_streams(draft: Draft, wire: bytes, why: str) -> None:
    if why.startswith("fine"):
        assert len(objects(parse(draft, wire))) == 2
        return
    with pytest.raises(MoqtError) as err:
        parse(draft, wire)
    assert err.value.code == PV, why


def test_descending_group_delta_cannot_go_below_zero() -> None:
    wire = b"\x05\x04" + b"\x1c\x01\x00\x80\x01a" + b"\x08\x05\x01b"  # group 1, then 1 - (5 + 1)
    with pytest.raises(MoqtError):
        parse(Draft.D18, wire, fetch_group_order=lambda _rid: GroupOrder.DESCENDING)


def test_object_id_delta_overflow() -> None:
    wire = b"\x14\x01\x00\x00\x80" + encode_vi64(2**64 - 1) + b"\x01a" + b"\x00\x01b"
    with pytest.raises(MoqtError):
        parse(Draft.D18, wire)


def test_data_after_fin_and_empty_stream() -> None:
    parser = DataStreamParser(Draft.D14, 3)
    assert parser.feed(b"", fin=True) == []
    with pytest.raises(MoqtError):
        parser.feed(b"\x14")


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(list(Draft)), st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=300)), max_size=6),
       st.integers(1, 64))
def test_generated_fetch_streams_survive_any_chunking(draft: Draft, items: list[tuple[int, bytes]], step: int) -> None:
    enc = FetchObjectEncoder(draft)
    wire = encode_fetch_header(draft, 2)
    want = []
    for i, (_step, payload) in enumerate(items):
        group = sum(g for g, _ in items[:i + 1])
        obj = i
        wire += enc.encode(group, obj, len(payload)) + payload
        want.append((group, obj, payload))
    got = objects(parse(draft, wire, step=step))
    assert [(g, o, p) for g, o, _s, p, _st, _e in got] == want
