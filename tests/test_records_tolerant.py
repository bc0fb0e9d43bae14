"""Tolerant parsing of extension values (issue 13; spec, "Records": unknown members MUST be ignored; "KVSP
Registries": the Storage Tiers, Codecs ... registries are extensible, Specification Required).

A peer running a newer registry may send a tier or codec this implementation does not know. The rule: the
registries are extensible -- keep or skip the unknown value, never drop the answer. Here: records with unknown
tiers and codecs parse and round-trip unchanged (the malformed ones are still refused); the retrieval planner ranks
an unknown tier after every known one and never picks a replica whose codec it cannot decode; the Index Service
stores such records (memory and Redis stores, compact encoding with an escape for unknown tiers) and returns them
unchanged; and, against a real ``kvsp-quic index`` and ``kvsp-quic holder``, a lookup whose answer carries a
newer holder's ``cxl-pool`` / codec 0xFE01 record still matches and the blocks come from the normal replicas.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import replace
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic.compat import CompatDescriptor, DescriptorError, codec_known
from kvsp_quic.fields import RecordError
from kvsp_quic.keys import holder_id
from kvsp_quic.problems import BadRequest, problem_from_json
from kvsp_quic.records import (
    InstanceStatusRecord,
    Link,
    LookupResponse,
    ReplicaRecord,
    ResidencyEntry,
    encode_moqt_namespace,
    kvsp_track_namespace,
)
from kvsp_quic.retrieval_plan import TIER_ORDER, DefaultRanking, covers, decodable, estimated_us, tier_rank
from kvsp_quic.storage.index_store import pack_body, unpack_body
from kvsp_quic.storage.memory_index import MemoryIndexStore
from tests import vectors
from tests.support.cluster import DESCRIPTOR, KEYER, block, eventually, put
from tests.support.index import C1, H1, H2, RELAY, S1, Env, bk, hid, replica, who
from tests.support.records import SPEC_EXAMPLES

NEW_CODEC = 0xFE01  # not in today's KVSP Codecs registry, not Private Use: a newer registry's codec
NEW_TIER = "cxl-pool"  # not in today's KVSP Storage Tiers registry


def newer(i: int, holder: str = H1, **changes: Any) -> ReplicaRecord:
    """:func:`tests.support.index.replica` as a newer holder writes it: codec 0xFE01, a ``cxl-pool`` tier."""
    fields: dict[str, Any] = dict(codec=NEW_CODEC, residency=(ResidencyEntry("device", (0, 1)),
                                                             ResidencyEntry(NEW_TIER, (2, 3), 900_000)))
    fields.update(changes)
    return replica(i, holder, **fields)


def replica_json(**changes: Any) -> dict[str, Any]:
    out = replica(0).to_json()
    out.update(changes)
    return out


# -- parsing ------------------------------------------------------------------------------------------------------


def test_a_lookup_answer_with_unknown_tiers_and_codecs_is_read_whole() -> None:
    known, unknown_codec, unknown_tier = replica(0), newer(0, H2), replica(1, residency=(
        ResidencyEntry("host", (0, 1)), ResidencyEntry(NEW_TIER, (2, 3))))
    answer = {"matched": 2, "blocks": [
        {"block_key": bk(0).hex(), "replicas": [known.to_json(), unknown_codec.to_json()]},
        {"block_key": bk(1).hex(), "replicas": [unknown_tier.to_json()]}]}
    parsed = LookupResponse.from_json(copy.deepcopy(answer))
    assert parsed.matched == 2 and [len(m.replicas) for m in parsed.blocks] == [2, 1]
    assert parsed.blocks[0].replicas == (known, unknown_codec)
    assert parsed.to_json() == answer  # kept exactly as the Index Service sent it
    assert json.loads(parsed.to_json_bytes()) == answer
    record = parsed.blocks[0].replicas[1]
    assert record.codec == NEW_CODEC and not codec_known(record.codec)
    assert [e.tier for e in record.residency] == ["device", NEW_TIER]
    assert [e.tier_known for e in record.residency] == [True, False] and record.layers == {0, 1, 2, 3}


@pytest.mark.parametrize(("member", "value", "message"), [
    ("codec", 0, "codec 0 is Reserved"),
    ("codec", 0x10000, "must be <= 65535"),
    ("codec", -1, "must be >= 0"),
    ("codec", "65025", "must be an integer"),
    ("tier", "CXL-Pool", "not a Storage Tiers name"),
    ("tier", "cxl_pool", "not a Storage Tiers name"),
    ("tier", "9tier", "not a Storage Tiers name"),
    ("tier", "x" * 33, "not a Storage Tiers name"),
    ("tier", "cxl\u00e9", "not a Storage Tiers name"),
    ("tier", "", "must not be empty"),
    ("tier", 7, "must be a string"),
])
def test_malformed_extension_values_are_still_refused(member: str, value: Any, message: str) -> None:
    obj = replica_json()
    if member == "tier":
        obj["residency"][0]["tier"] = value
    else:
        obj[member] = value
    with pytest.raises(RecordError) as info:
        ReplicaRecord.from_json(obj)
    assert message in info.value.detail and info.value.status == 400


def test_names_of_registry_syntax_are_kept_up_to_the_limit() -> None:
    for tier in ("x", "a" * 32, "cxl-pool-2", NEW_TIER):
        obj = replica_json()
        obj["residency"][0]["tier"] = tier
        assert ReplicaRecord.from_json(obj).residency[0].tier == tier
    for codec in (2, 0x7FFF, NEW_CODEC, 0xFFFF):
        assert ReplicaRecord.from_json(replica_json(codec=codec)).codec == codec
    with pytest.raises(RecordError, match="not a Storage Tiers name"):  # built in code: the same rule
        ResidencyEntry("Bad Tier", (0, 1))
    with pytest.raises(RecordError, match="codec"):
        replace(replica(0), codec=0)


def test_a_moqt_record_with_an_unknown_codec_keeps_its_namespace() -> None:
    ns = encode_moqt_namespace(kvsp_track_namespace(C1, S1, hid(H2), NEW_CODEC))
    record = newer(4, RELAY, moqt_namespace=ns)
    again = ReplicaRecord.from_json(record.to_json())
    assert again == record and again.namespace is not None and again.namespace[4] == b"65025"


def test_unknown_members_are_ignored_and_instance_states_stay_a_closed_set() -> None:
    """Unknown *members* are ignored everywhere (spec, "Records"). Instance states are a registry too, but one a
    peer acts on (placement, sleep, drain): an unknown state is refused (400), not guessed at -- docs/wire.md."""
    status = copy.deepcopy(SPEC_EXAMPLES[1][1])
    status["future_member"] = {"x": [1, 2]}
    status["links"][0]["jitter_us"] = 3
    parsed = InstanceStatusRecord.from_json(status)
    assert parsed == InstanceStatusRecord.from_json(SPEC_EXAMPLES[1][1]) and "future_member" not in parsed.to_json()
    record = replica_json()
    record["residency"][0]["future"] = True
    record["replica_class"] = "gold"
    assert ReplicaRecord.from_json(record) == replica(0)
    with pytest.raises(RecordError, match="state: 'hibernating' is not one of"):
        InstanceStatusRecord.from_json(dict(status, state="hibernating"))


def test_descriptors_with_unknown_element_types_or_encodings_are_a_typed_refusal() -> None:
    """A descriptor is identity-defining (its JCS is hashed into the Compatibility ID), so an unknown element type
    or positional encoding refuses that descriptor: DescriptorError, a RecordError, so a 400 problem at any edge.
    No peer sends descriptors over the wire today (holders and the Index Service read them from files)."""
    for change, message in (({"kv_dtype": "fp4-e2m1"}, "Element Types registry"),
                            ({"positional": "alibi"}, "Positional Encodings registry")):
        with pytest.raises(DescriptorError, match=message) as info:
            CompatDescriptor.from_json(dict(vectors.DESCRIPTOR, **change))
        assert isinstance(info.value, RecordError) and info.value.status == 400


# -- the retrieval planner ------------------------------------------------------------------------------------------


def test_an_unknown_tier_keeps_its_layers_and_ranks_last() -> None:
    slow = replica(0, H1, residency=(ResidencyEntry("remote-storage", (0, 3)),))
    cxl = replica(0, H2, residency=(ResidencyEntry("device", (0, 1)), ResidencyEntry(NEW_TIER, (2, 3))))
    assert covers(cxl, (0, 3)) and covers(cxl, (2, 3))
    assert tier_rank(cxl, (0, 1)) == TIER_ORDER["device"] and tier_rank(cxl, (0, 3)) == len(TIER_ORDER)
    assert DefaultRanking()([cxl, slow], (0, 3)) == [slow, cxl]  # after every known tier
    assert DefaultRanking()([slow, cxl], (0, 1)) == [cxl, slow]  # its known tier holds the wanted layers
    fast = replica(0, H2, residency=(ResidencyEntry(NEW_TIER, (0, 3), 100),))  # its stated read rate counts
    link = Link(H2, mbit_per_s=1000.0, rtt_us=10.0)
    assert estimated_us(fast, (0, 3), link) == pytest.approx(10.0 + 8 * 4000 / 100)


def test_a_replica_in_an_unknown_codec_is_no_source_unless_a_known_codec_is_asked_for() -> None:
    assert decodable(replica(0)) and decodable(replica(0, codec=0xFF01))  # raw; Private Use
    assert not decodable(newer(0))
    assert decodable(newer(0), 1)  # the holder transcodes to raw, or answers 406 (a miss)
    assert not decodable(replica(0), NEW_CODEC)


# -- the Index Service's stores -------------------------------------------------------------------------------------


EXTENSION_SHAPES = [
    newer(0),
    newer(1, digests=False),
    newer(2, residency=(ResidencyEntry("x" * 32, (0, 0), 1), ResidencyEntry("host", (1, 1)),
                        ResidencyEntry("a", (2, 2)), ResidencyEntry("device", (3, 3), 7))),
    replica(3, residency=(ResidencyEntry(NEW_TIER, (0, 3)),)),
    newer(4, RELAY, moqt_namespace=encode_moqt_namespace(kvsp_track_namespace(C1, S1, hid(H2), NEW_CODEC))),
    replica(5, codec=2),
]


@pytest.mark.parametrize("record", EXTENSION_SHAPES, ids=lambda r: r.block_key.hex()[:6])
def test_the_compact_encoding_keeps_unknown_values(record: ReplicaRecord) -> None:
    body = pack_body(record)
    again = unpack_body(b"xx" + body, record.block_key, record.scope_id, record.compat_id, record.holder, 77, 2)
    assert again == replace(record, ttl_ms=77)
    assert again.to_json() == replace(record, ttl_ms=77).to_json()
    unknown = [e.tier for e in record.residency if not e.tier_known]
    assert bool(body[3] & 4) == bool(unknown)  # the escape flag only when a tier needs it
    if unknown:
        assert body.endswith(bytes((len(unknown[-1]),)) + unknown[-1].encode())


def test_known_tiers_are_packed_as_before() -> None:
    record = replica(0)
    body = pack_body(record)
    assert body[3] == 1 and len(body) == 12 + 2 * 17 + 4 + 32 * 4  # head, 2 entries, layer digests; no names
    again = unpack_body(body, record.block_key, record.scope_id, record.compat_id, record.holder, record.ttl_ms)
    assert again == record


async def test_stores_keep_and_return_unknown_values(env: Env) -> None:
    known = [replica(i) for i in range(3)]
    extended = [newer(0, H2), newer(1, H2, residency=(ResidencyEntry(NEW_TIER, (0, 3)),)), replica(2, H2, codec=2)]
    for record in known + extended:
        assert (await env.service.publish(who(H2), hid(record.holder), record.block_key, record)).created
    for record in extended:
        got = await env.store.get(hid(record.holder), record.block_key, env.clock())
        assert got is not None and replace(got, ttl_ms=record.ttl_ms) == record
    found = await env.lookup(3)
    assert [sorted(r.holder for r in m) for m in found] == [[H1, H2]] * 3  # every record, none dropped
    by_holder = [{r.holder: replace(r, ttl_ms=60_000) for r in m} for m in found]
    assert [m[H2] for m in by_holder] == extended and [m[H1] for m in by_holder] == known


async def test_the_rendered_lookup_writes_unknown_values_as_the_records_do() -> None:
    """The memory store answers the HTTP edge's lookups from the packed entries (``lookup_rendered``): the same
    JSON, byte for byte, as building the records and writing them."""
    store = MemoryIndexStore()
    records = [replica(0), newer(0, H2), newer(1, H2, residency=(ResidencyEntry(NEW_TIER, (0, 3), 5),)),
               newer(1, RELAY, moqt_namespace=encode_moqt_namespace(kvsp_track_namespace(C1, S1, hid(H2),
                                                                                          NEW_CODEC)))]
    for record in records:
        await store.put(record, 100.0)
    keys = [bk(0), bk(1)]
    matched, parts = store.lookup_rendered(S1, C1, keys, 100.0)
    rendered = b"".join(parts)
    built = b",".join(b'{"block_key":"%s","replicas":[%s]}' % (key.hex().encode(), b",".join(
        r.to_json_bytes() for r in replicas)) for key, replicas in zip(keys, await store.lookup(S1, C1, keys, 100.0),
                                                                       strict=True))
    assert matched == 2 and rendered == built
    answer = LookupResponse.loads(b'{"matched":2,"blocks":[' + rendered + b"]}")
    assert {r.holder: r for m in answer.blocks for r in m.replicas}[RELAY] == replace(records[3], ttl_ms=60_000)


# -- against a real kvsp-quic index and holder ----------------------------------------------------------------------


NEWER_HOLDER = "https://127.0.0.1:9/newer/"  # a newer holder (never reached: nothing listens there)
JSON = {"content-type": "application/kvsp+json"}


def _newer_record(i: int, ttl_ms: int = 60_000) -> dict[str, Any]:
    layer_digests = [hashlib.sha256(b"newer %d %d" % (i, n)).digest() for n in range(DESCRIPTOR.layers)]
    return {"block_key": block(i)[0].hex(), "compat_id": DESCRIPTOR.compat_id.hex(),
            "scope_id": KEYER.scope_id.hex(), "holder": NEWER_HOLDER, "codec": NEW_CODEC, "size": 123456,
            "digest": "sha-256:" + hashlib.sha256(b"".join(layer_digests)).hexdigest(),
            "layer_digests": [d.hex() for d in layer_digests],
            "residency": [{"tier": "device", "layers": [0, 15]},
                          {"tier": NEW_TIER, "layers": [16, DESCRIPTOR.layers - 1], "read_mbit_per_s": 800000}],
            "ttl_ms": ttl_ms, "compression_hint": "zstd-dict-7"}  # an unknown member as well


def _replica_url(index: str, holder: str, key: bytes) -> str:
    return f"{index}replicas/{holder_id(holder)}/{key.hex()}"


async def test_a_lookup_with_a_newer_holders_records_still_matches_and_retrieves(
        dev_cluster: dict[str, Any], dev_client: KvspClient) -> None:
    index, holder = dev_cluster["index"]["base_uri"], dev_cluster["holder"]["base_uri"]
    for i in (0, 1):
        assert (await put(dev_client, holder, i)).status == 201
    probe = BlockFetcher(dev_client, index)
    await eventually(probe, 0, True)
    await eventually(probe, 1, True)

    # The newer holder publishes its records of both blocks: an unknown codec, an unknown tier, an unknown member.
    for i in (0, 1):
        published = await dev_client.request("PUT", _replica_url(index, NEWER_HOLDER, block(i)[0]), headers=JSON,
                                         content=json.dumps(_newer_record(i)).encode())
        assert published.status == 201, published.content
    # Malformed values stay a 400 kvsp problem.
    bad = _newer_record(0)
    bad["residency"][1]["tier"] = "CXL Pool"
    refused = await dev_client.request("PUT", _replica_url(index, NEWER_HOLDER, block(0)[0]), headers=JSON,
                                   content=json.dumps(bad).encode())
    problem = problem_from_json(refused.status, refused.content or b"")
    assert refused.status == 400 and refused.headers.get("content-type") == "application/problem+json"
    assert isinstance(problem, BadRequest) and "Storage Tiers" in problem.detail, problem

    # The holder's own record of block 1 as if its block sat in a tier this client does not know: still a source.
    keys = [block(0)[0], block(1)[0]]
    own = next(r for r in (await probe.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, keys)).blocks[1].replicas
               if r.holder == holder)
    moved = dict(own.to_json(), residency=[{"tier": NEW_TIER, "layers": [0, DESCRIPTOR.layers - 1]}])
    assert (await dev_client.request("PUT", _replica_url(index, holder, block(1)[0]), headers=JSON,
                                 content=json.dumps(moved).encode())).status in (200, 201)

    # The client prefers the newer holder (so without the codec rule it would be tried first, and fail).
    fetcher = BlockFetcher(dev_client, index, descriptors=[DESCRIPTOR],
                           ranking=lambda replicas, layers: sorted(replicas, key=lambda r: r.holder != NEWER_HOLDER))
    found = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, keys)
    assert found.matched == 2
    for i, match in enumerate(found.blocks):  # returned unchanged (but the remaining TTL; unknown members dropped)
        theirs = next(r for r in match.replicas if r.holder == NEWER_HOLDER).to_json()
        expected = {k: v for k, v in _newer_record(i).items() if k not in ("ttl_ms", "compression_hint")}
        assert {k: v for k, v in theirs.items() if k != "ttl_ms"} == expected
    tiers = {r.holder: [e.tier for e in r.residency] for r in found.blocks[1].replicas}
    if tiers[holder] != [NEW_TIER]:  # the holder refreshed its record in between (every ttl/3): not this test's point
        pytest.skip("the holder republished its own record of block 1 before the lookup")

    results = await fetcher.load_prefix(DESCRIPTOR.compat_id, KEYER.scope_id, keys)
    assert [r.tobytes() if r is not None else None for r in results] == [block(0)[1], block(1)[1]]
    assert {r.record.holder for r in results if r is not None} == {holder}
    assert results[1] is not None and [e.tier for e in results[1].record.residency] == [NEW_TIER]
    m = fetcher.metrics
    assert m.skipped_unknown_codec == 2 and m.attempts == 2, m.snapshot()  # never tried, never withdrawn
    assert m.transport_errors == m.malformed == m.withdrawals == 0 and m.hits == 2
    still = await probe.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, keys)
    assert all(NEWER_HOLDER in {r.holder for r in b.replicas} for b in still.blocks)
