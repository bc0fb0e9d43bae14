"""The control plane's fast paths (issue 16, goal 7) give exactly what the plain paths give: the one-pass hex array
reader (values and errors), the records' JSON bytes (orjson) against the standard library's compact JSON, the
lookup body against the JSON values of the lookup, the memory store's kept digests, and the index app's answers
over a real HTTP/3 connection."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from typing import Any

import pytest

from kvsp_http.app_kit import dumps
from kvsp_http.index_app import lookup_body, lookup_json
from kvsp_quic import fields as f
from kvsp_quic.fields import BlockKey, RecordError
from kvsp_quic.records import (
    LeaseRequest,
    LookupMatch,
    LookupRequest,
    LookupResponse,
    ReplicaRecord,
    ReshardPlan,
    ResidencyEntry,
    TargetEstimate,
)
from kvsp_quic.storage.memory_index import MemoryIndexStore
from tests.support.index import C1, H1, H2, S1, SHAPES, bk, replica


def stdlib(obj: Any) -> bytes:
    """What the apps sent before orjson."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def slow_hex_array(value: Any, path: str, size: int, nonempty: bool = False) -> tuple[bytes, ...]:
    return f.array(value, path, lambda v, p: f.hex_octets(v, p, size), nonempty=nonempty)


def outcome(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except RecordError as exc:
        return ("error", exc.detail)


HEX_CASES: list[Any] = [
    [os.urandom(32).hex() for _ in range(5)],
    [os.urandom(32).hex() for _ in range(200)],  # more than one struct run of 64
    [os.urandom(32).hex()],
    [],
    [os.urandom(32).hex(), os.urandom(32).hex().upper()],
    [os.urandom(32).hex(), "0" * 63],
    ["a" * 62, "b" * 66],  # the right total length, the wrong item lengths
    [os.urandom(32).hex(), 7],
    [os.urandom(32).hex(), None],
    [" " + os.urandom(32).hex()[1:]],  # whitespace, which bytes.fromhex would skip
    [os.urandom(31).hex() + "g0"],
    "not an array",
    (os.urandom(32).hex(),),  # a tuple: Python callers
]


@pytest.mark.parametrize("value", HEX_CASES, ids=range(len(HEX_CASES)))
@pytest.mark.parametrize("nonempty", [False, True])
def test_hex_array_matches_the_item_by_item_reader(value: Any, nonempty: bool) -> None:
    fast = outcome(f.hex_array, value, "block_keys", 32, nonempty=nonempty)
    slow = outcome(slow_hex_array, value, "block_keys", 32, nonempty)
    assert fast == slow
    if isinstance(value, list) and value and all(isinstance(v, str) and v == v.lower() and len(v) == 64
                                                    and " " not in v and "g" not in v for v in value):
        assert fast == tuple(bytes.fromhex(v) for v in value)


@pytest.mark.parametrize("count", [0, 1, 63, 64, 65, 128, 129, 8192])
def test_split_octets(count: int) -> None:
    raw = os.urandom(32 * count)
    assert f.split_octets(raw, 32) == tuple(raw[i:i + 32] for i in range(0, len(raw), 32))


def test_hex_octets_fast_path_is_strict() -> None:
    good = os.urandom(32).hex()
    assert f.hex32(good, "x") == bytes.fromhex(good)
    for bad in (good.upper(), good[:-2] + " a", good[:-1], good + "00", 5, "ab" * 31 + "\n0"):
        with pytest.raises(RecordError, match="x: must be"):
            f.hex32(bad, "x")


def test_base_uri_cache_keeps_failing() -> None:
    for _ in range(2):  # the second answer comes from the cache
        with pytest.raises(RecordError, match="holder: a base URI must end with '/'"):
            f.base_uri("https://h.example/kvsp", "holder")
        assert f.base_uri("https://h.example/kvsp/", "holder") == "https://h.example/kvsp/"
    with pytest.raises(RecordError, match="scheme must be https, got 'moqt'"):
        f.base_uri("moqt://relay.example/", "x")  # cached per scheme set: moqt is allowed elsewhere
    assert f.base_uri("moqt://relay.example/", "x", schemes=("https", "moqt")) == "moqt://relay.example/"


UNICODE_HOLDER = "https://h\u00e9.example/kvsp/\u2603/"


@pytest.mark.parametrize("record", [*SHAPES, replica(9, holder=UNICODE_HOLDER)], ids=range(len(SHAPES) + 1))
def test_record_json_bytes_are_the_stdlib_compact_json(record: ReplicaRecord) -> None:
    assert record.to_json_bytes() == stdlib(record.to_json())
    assert ReplicaRecord.loads(record.to_json_bytes()) == record


def test_record_parsing_keeps_its_errors() -> None:
    good = replica(1).to_json()
    for change, detail in (
            ({"layer_digests": [*good["layer_digests"][:-1], "AB" * 32]}, "layer_digests[3]: must be 64 lowercase"),
            ({"layer_digests": []}, "layer_digests: must not be empty"),
            ({"block_key": None}, "block_key: must not be null"),
            ({"residency": [{"tier": "device", "layers": [0, 2]}, {"tier": "host", "layers": [2, 3]}]},
             "residency: residency[0] [0, 2] and residency[1] [2, 3] overlap"),
            ({"digest": "sha-256:" + "00" * 32}, "digest: is not the SHA-256")):
        with pytest.raises(RecordError) as info:
            ReplicaRecord.from_json({**good, **change})
        assert detail in info.value.detail
    missing = dict(good)
    del missing["holder"]
    with pytest.raises(RecordError) as info:
        ReplicaRecord.from_json(missing)
    assert info.value.detail == "holder: required member is missing"
    with pytest.raises(RecordError, match=r"retain/fetch: retain \[0, 10\] and retain \[5, 20\] overlap"):
        ReshardPlan.from_json({"map": "m", "from": 1, "to": 2, "deadline_ms": 5, "retain": [[0, 10], [5, 20]]})
    with pytest.raises(RecordError, match=r"release: release \[0, 10\] and release \[5, 20\] overlap"):
        ReshardPlan.from_json({"map": "m", "from": 1, "to": 2, "deadline_ms": 5, "release": [[0, 10], [5, 20]]})
    with pytest.raises(RecordError, match="block_keys: must not be empty"):
        LeaseRequest.from_json({"compat_id": C1.hex(), "scope_id": S1.hex(), "block_keys": [], "ttl_ms": 5})


def test_lookup_request_reads_many_keys() -> None:
    keys = tuple(BlockKey(hashlib.sha256(b"%d" % i).digest()) for i in range(8192))
    request = LookupRequest(S1, C1, keys)
    again = LookupRequest.loads(dumps(request.to_json()))
    assert again == request and again.block_keys == keys


def lookup(n: int, targets: tuple[TargetEstimate, ...] | None) -> LookupResponse:
    blocks = []
    for i in range(n):
        replicas = (replica(i), replica(i, holder=H2, digests=False)) if i % 3 == 0 else (SHAPES[i % len(SHAPES)],)
        key = replicas[0].block_key
        blocks.append(LookupMatch(key, tuple(replace(r, block_key=key) for r in replicas)))
    return LookupResponse(n, tuple(blocks), targets)


@pytest.mark.parametrize("n", [0, 1, 7])
@pytest.mark.parametrize("targets", [None, (), (TargetEstimate(H1, 10, 20), TargetEstimate(H2, 0, 5))])
def test_lookup_body_is_the_json_of_the_lookup(n: int, targets: tuple[TargetEstimate, ...] | None) -> None:
    response = lookup(n, targets)
    body = lookup_body(response)
    assert body == stdlib(lookup_json(response)) == dumps(lookup_json(response))
    assert LookupResponse.loads(body) == response


def test_dumps_falls_back_for_what_orjson_refuses() -> None:
    for value in ({"n": 1 << 70}, {1: "a"}, {"a": [1.5, "\u2603", None, True]}):
        assert dumps(value) == stdlib(value)


def test_match_of_store_is_a_match() -> None:
    record = replica(3)
    assert LookupMatch.of_store(record.block_key, (record,)) == LookupMatch(record.block_key, (record,))


async def test_memory_store_keeps_digests_and_returns_equal_records() -> None:
    store = MemoryIndexStore()
    shapes = [*SHAPES, replica(7, layers=32), replica(8, digests=False, residency=(ResidencyEntry("host", (0, 3)),))]
    for record in shapes:
        await store.put(record, 0.0)
    await store.put(replace(shapes[0], holder=H2), 0.0)  # a second holder: a slot of two entries
    for record in shapes:
        (found,) = await store.lookup(record.scope_id, record.compat_id, [record.block_key], 1.0)
        mine = next(r for r in found if r.holder == record.holder)
        assert mine == replace(record, ttl_ms=record.ttl_ms - 1000)
        assert mine.digest == record.digest
        assert mine.to_json_bytes() == replace(record, ttl_ms=mine.ttl_ms).to_json_bytes()
    assert len((await store.lookup(S1, C1, [bk(0)], 1.0))[0]) == 2


async def test_rendered_lookup_is_the_json_of_the_records() -> None:
    """The memory store writes its matches as JSON itself (IndexService.lookup_json): the same bytes as the
    records it would return, for every shape, several holders per key, and a lookup that stops at a miss."""
    from kvsp_quic.records import lookup_answer
    from tests.support.index import POLICY

    store = MemoryIndexStore()
    shapes = [*SHAPES, replica(7, layers=32), replica(8, holder=UNICODE_HOLDER)]
    keys = []
    for i, record in enumerate(shapes):
        key = bk(100 + i)
        keys.append(key)
        await store.put(replace(record, block_key=key, scope_id=S1, compat_id=C1), 0.0)
        if i % 2:
            await store.put(replace(replica(i, holder=H2, digests=False), block_key=key), 0.0)
    keys.append(bk(999))  # a miss ends the chain
    keys.append(keys[0])
    matched, blocks = store.lookup_rendered(S1, C1, keys, 2.5)
    records = await store.lookup(S1, C1, keys, 2.5)
    expected = LookupResponse(len(records), tuple(LookupMatch(k, r) for k, r in zip(keys, records, strict=False)))
    assert matched == len(shapes)
    assert lookup_answer(matched, blocks, None) == expected.to_json_bytes() == stdlib(lookup_json(expected))
    assert store.lookup_rendered(S1, C1, [bk(999)], 2.5) == (0, [])
    assert lookup_answer(0, [], None) == stdlib(lookup_json(LookupResponse(0, ())))

    from kvsp_quic.roles.index import IndexService
    principal = POLICY.principal(H1)
    assert principal is not None
    service = IndexService(store, clock=lambda: 2.5)
    request = LookupRequest(S1, C1, tuple(keys))
    assert await service.lookup_json(principal, request) == (len(shapes), expected.to_json_bytes())
    assert (await service.lookup(principal, request)).to_json_bytes() == expected.to_json_bytes()
