"""The memory store's recent table and the deferred collections of a lookup (issue 16 goal 7).

A lookup rebuilds its matches from packed entries; what a packed body holds (the layer digests, the record's JSON
around its ``ttl_ms``) is decoded once and kept, bounded, for the next lookups of the same entries. These tests
check that repeated lookups share what was decoded, keep each record's remaining TTL right and every answer
byte-identical, that the table stays within its bound, and that building a large answer defers the collector's
passes and always restores the collector's state.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest

from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.records import LookupMatch, LookupRequest, LookupResponse, ReplicaRecord, lookup_answer
from kvsp_quic.roles.index import IndexService
from kvsp_quic.storage import index_store
from kvsp_quic.storage.index_store import collections_deferred, remaining_ms
from kvsp_quic.storage.memory_index import MemoryIndexStore
from tests.support.index import C1, H2, PC, S1, SHAPES, bk, replica, who


async def _fill(store: MemoryIndexStore) -> tuple[list[BlockKey], list[ReplicaRecord]]:
    """Every shape of record (MOQT, unknown tiers, no layer digests, 32 of them), every other key with a second
    holder: the keys and what was published."""
    keys, published = [], []
    for i, record in enumerate([*SHAPES, replica(7, layers=32), replica(8, layers=32)]):
        key = bk(200 + i)
        keys.append(key)
        record = replace(record, block_key=key, scope_id=ScopeId(S1), compat_id=CompatId(C1))
        published.append(record)
        await store.put(record, 0.0)
        if i % 2:
            second = replace(replica(i, holder=H2, layers=32), block_key=key, ttl_ms=30_000 + i)
            published.append(second)
            await store.put(second, 0.0)
    return keys, published


def _expected(keys: list[BlockKey], published: list[ReplicaRecord], now: float) -> LookupResponse:
    """The answer at *now*, from the published records (remaining TTL: rounded up, in milliseconds)."""
    blocks = []
    for key in keys:
        replicas = tuple(replace(r, ttl_ms=remaining_ms(r.ttl_ms / 1000.0, now)) for r in published
                         if r.block_key == key)
        blocks.append(LookupMatch(key, replicas))
    return LookupResponse(len(blocks), tuple(blocks))


@pytest.mark.parametrize("recent", [0, 1, 3, 8192])
async def test_repeated_lookups_keep_ttl_and_bytes(recent: int) -> None:
    """Lookups at several times, with a table too small for the answer (entries evicted and decoded again), none,
    or one that holds it all: every record equals the published one with its remaining TTL, every JSON answer is
    byte-identical to the records' own JSON."""
    store = MemoryIndexStore(recent=recent)
    keys, published = await _fill(store)
    for now in (1.0, 2.5, 1.0, 17.125, 30.0):
        expected = _expected(keys, published, now)
        records = await store.lookup(S1, C1, keys, now)
        assert [list(r) for r in records] == [list(m.replicas) for m in expected.blocks], now
        matched, blocks = store.lookup_rendered(S1, C1, keys, now)
        assert matched == len(keys)
        assert lookup_answer(matched, blocks, None) == expected.to_json_bytes(), now
    assert len(store._recent) <= 2 * recent and len(store._recent_json) <= 2 * recent


async def test_repeated_lookups_share_what_was_decoded() -> None:
    """The second lookup of an entry does not decode its layer digests again (the tuples are shared), yet each
    lookup returns records of its own with their own remaining TTL."""
    store = MemoryIndexStore()
    record = replica(1, layers=32)
    await store.put(record, 0.0)
    ((first,),) = await store.lookup(S1, C1, [record.block_key], 1.0)
    ((second,),) = await store.lookup(S1, C1, [record.block_key], 2.0005)
    assert first is not second
    assert first.layer_digests is second.layer_digests and first.layer_digests == record.layer_digests
    assert (first.ttl_ms, second.ttl_ms) == (record.ttl_ms - 1000, record.ttl_ms - 2000)
    assert first == replace(record, ttl_ms=first.ttl_ms) and second == replace(record, ttl_ms=second.ttl_ms)


async def test_the_recent_table_is_bounded() -> None:
    """Two generations of at most *recent* bodies: a lookup of more keys than that evicts, and answers stay
    right."""
    store = MemoryIndexStore(recent=4)
    records = [replica(i, layers=32) for i in range(20)]
    for record in records:
        await store.put(record, 0.0)
    keys = [r.block_key for r in records]
    for now in (1.0, 3.0):
        found = await store.lookup(S1, C1, keys, now)
        assert [r for (r,) in found] == [replace(r, ttl_ms=r.ttl_ms - int(now * 1000)) for r in records]
        assert len(store._recent) <= 8
        store.lookup_rendered(S1, C1, keys, now)
        assert len(store._recent_json) <= 8


def test_collections_are_deferred_and_the_collector_restored() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        with collections_deferred():
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(RuntimeError), collections_deferred():
            raise RuntimeError("boom")
        assert gc.isenabled()
        gc.disable()  # an application that disabled the collector keeps it disabled
        with collections_deferred():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


async def test_a_large_lookup_does_not_run_collections_while_building() -> None:
    """8192 records, their dicts and the match tuples: about 25k containers that all survive. Without the deferral
    the collector would run dozens of young passes (and middle and full ones) while they are built; with it, at
    most the one pass after."""
    store = MemoryIndexStore()
    records = [replica(i, layers=4) for i in range(8192)]
    for record in records:
        store.put_sync(record, 0.0)
    keys = [r.block_key for r in records]
    chain = store.chain(S1, C1, keys, 1.0)
    passes = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    assert index_store.DEFER_COLLECTIONS
    was = gc.isenabled()
    gc.enable()
    gc.callbacks.append(count)
    try:
        found = store.materialize(chain, keys, S1, C1, 1.0)
    finally:
        gc.callbacks.remove(count)
        (gc.enable if was else gc.disable)()
    assert len(found) == 8192 and found[5] == (replace(records[5], ttl_ms=records[5].ttl_ms - 1000),)
    assert len(passes) <= 1, passes


async def test_the_role_has_the_store_build_its_matches() -> None:
    """With nothing to leave out or reorder, the role's lookup is the memory store's matches (built in its loop):
    the same answer as the records the store returns, estimates included."""
    store = MemoryIndexStore()
    keys, published = await _fill(store)
    service = IndexService(store, clock=lambda: 2.5)
    response = await service.lookup(who(PC), LookupRequest(ScopeId(S1), CompatId(C1), tuple(keys)))
    assert response == _expected(keys, published, 2.5)
    matches = await store.lookup_matches(S1, C1, keys, 2.5)
    assert [m.replicas for m in matches] == list(await store.lookup(S1, C1, keys, 2.5))
    assert matches == list(response.blocks)


def test_the_config_sizes_the_recent_table() -> None:
    from kvsp_app.config import IndexSection
    from kvsp_app.serve import _index_store

    assert _index_store(IndexSection())._recent.limit == 8192
    assert _index_store(IndexSection(lookup_cache_records=0))._recent.limit == 0
