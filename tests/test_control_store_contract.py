"""The ControlStore contract, kept the same by both backends (issue 25 point 4): MemoryControlStore (the
single-replica PC's, kvsp_quic/storage/memory_control.py) and RedisControlStore on a real redis-server. The
compare-and-set of sessions and its indexes, leases, statuses with their epochs, shard maps with their contexts and
locks; and, for the memory store on a manual clock, its expiries. Also: a session's payload stays a snapshot in the
memory store (never encoded), and is encoded for Redis."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from kvsp_quic.compat import InstanceState
from kvsp_quic.records import InstanceStatusRecord, Sampler, Shard, ShardMap
from kvsp_quic.roles.controller_records import SessionRequest, SessionState
from kvsp_quic.roles.controller_sessions import PlacedSession
from kvsp_quic.roles.controller_store import SessionSnapshot, placed_session, stored_session
from kvsp_quic.storage.control_store import (
    ControlStore,
    EncodedSession,
    StatusSnapshot,
    StatusWrite,
    StoredSession,
    StoredStatus,
    run_key,
)
from kvsp_quic.storage.memory_control import MemoryControlStore
from tests.helpers import Clock
from tests.support.index import C1, S1

IA, IB = "https://ia.example/kvsp/", "https://ib.example/kvsp/"
SID = uuid.UUID(int=42)


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ControlStore]:
    if request.param == "memory":
        yield MemoryControlStore(Clock())
        return
    from kvsp_quic.storage.redis_control import RedisControlStore

    redis = RedisControlStore.from_url(request.getfixturevalue("redis_url"))
    try:
        yield redis
    finally:
        await redis.aclose()


def session(**changes: object) -> PlacedSession:
    request = SessionRequest(SID, S1, C1, (1, 2, 3), 8, Sampler("greedy", 0, 0, True))
    placed = PlacedSession(request, "urn:kvsp:client:front", 5.0, 5.0)
    for name, value in changes.items():
        setattr(placed, name, value)
    return placed


async def test_sessions_are_a_compare_and_set_with_their_indexes(store: ControlStore) -> None:
    assert await store.load(SID) is None
    first = session()
    assert await store.save(SID, stored_session(first), 60_000) == 1
    assert await store.save(SID, stored_session(first), 60_000) is None  # version 0: only a new session
    loaded = await store.load(SID)
    assert loaded is not None and loaded.version == 1 and loaded.run == "" and not loaded.migrating
    running = placed_session(loaded, 9.0)
    running.instance, running.instance_epoch, running.state = IA, 3, SessionState.RUNNING
    assert await store.save(SID, stored_session(running), 60_000) == 2
    assert await store.candidates(lambda i, e: False) == []
    assert await store.candidates(lambda i, e: (i, e) == (IA, 3)) == [SID]
    migrating = placed_session(await store.load(SID) or StoredSession(EncodedSession(b"")), 9.0)
    migrating.instance = migrating.instance_epoch = None
    migrating.state, migrating.epoch = SessionState.MIGRATING, 2
    stale = stored_session(running)  # written at version 1: refused
    assert await store.save(SID, StoredSession(stale.payload, 1, stale.run, stale.migrating), 60_000) is None
    assert await store.save(SID, stored_session(migrating), 60_000) == 3
    assert await store.candidates(lambda i, e: True) == [SID]  # waiting for a migration, off every run
    back = await store.load(SID)
    assert back is not None and placed_session(back, 9.0).epoch == 2
    await store.delete(SID)
    assert await store.load(SID) is None and await store.candidates(lambda i, e: True) == []
    await store.forget(SID)  # nothing left to forget


async def test_leases_have_one_owner(store: ControlStore) -> None:
    assert await store.lease(SID, "a", 60_000)
    assert await store.lease(SID, "a", 60_000)  # renewed by its owner
    assert not await store.lease(SID, "b", 60_000)
    await store.release(SID, "b")  # not b's: kept
    assert not await store.lease(SID, "b", 60_000)
    await store.release(SID, "a")
    assert await store.lease(SID, "b", 60_000)


async def test_statuses_keep_the_highest_epoch(store: ControlStore) -> None:
    for instance, epoch in ((IA, 3), (IB, 1)):
        record = InstanceStatusRecord(instance, epoch, InstanceState.ACTIVE, 60_000)
        assert (await store.put_status(StoredStatus(record, InstanceState.ACTIVE, 60_000))).higher is None
    old = InstanceStatusRecord(IA, 2, InstanceState.ACTIVE, 60_000)
    assert (await store.put_status(StoredStatus(old, InstanceState.ACTIVE, 60_000))).higher == 3  # stale
    snapshot = await store.statuses()
    assert snapshot is not None
    assert sorted(s.record.instance for s in snapshot.entries) == [IA, IB] and snapshot.epochs == {IA: 3, IB: 1}
    assert all(59_000 < s.remaining_ms <= 60_000 for s in snapshot.entries)
    assert not await store.fail_status(IA, 2) and await store.fail_status(IA, 3)
    snapshot = await store.statuses(snapshot.revision)  # a change since: a snapshot (always one, from Redis)
    assert snapshot is not None
    assert [s.record.instance for s in snapshot.entries] == [IB] and snapshot.epochs == {IA: 3, IB: 1}


async def test_maps_their_contexts_and_locks(store: ControlStore) -> None:
    v0 = ShardMap("m", 0, (Shard((0, 16), IA),))
    v1 = ShardMap("m", 1, (Shard((0, 8), IA), Shard((8, 16), IB)))
    assert await store.get_map("m") is None and not await store.set_map_context("m", b"{}")
    assert await store.add_map(v0, b'{"a": 1}') is None
    assert await store.add_map(v1, b"other") == v0  # exists: nothing written
    assert await store.map_context("m") == b'{"a": 1}'
    assert not await store.commit_map(1, v1) and await store.commit_map(0, v1)
    assert await store.get_map("m") == v1 and await store.map_context("m") == b'{"a": 1}'
    assert await store.set_map_context("m", b"new") and await store.map_context("m") == b"new"
    assert await store.lock_map("m", "a", 60_000)
    assert not await store.lock_map("m", "a", 60_000) and not await store.lock_map("m", "b", 60_000)
    await store.unlock_map("m", "b")
    assert not await store.lock_map("m", "b", 60_000)
    await store.unlock_map("m", "a")
    assert await store.lock_map("m", "b", 60_000)


async def test_the_memory_store_keeps_snapshots_and_expires_on_its_clock() -> None:
    clock = Clock()
    store = MemoryControlStore(clock)
    original = session(checkpoint=None)
    assert await store.save(SID, stored_session(original), 1000) == 1
    original.epoch = 9  # the role's object changes after the write: the stored snapshot does not
    kept = await store.load(SID)
    assert kept is not None and isinstance(kept.payload, SessionSnapshot)
    copy = placed_session(kept, 123.0)
    assert copy.epoch == 1 and copy.touched == 5.0 and copy.version == 1 and copy is not kept.payload.session
    assert await store.lease(SID, "a", 500) and not await store.lease(SID, "b", 500)
    record = InstanceStatusRecord(IA, 1, InstanceState.ACTIVE, 700)
    await store.put_status(StoredStatus(record, InstanceState.ACTIVE, 700))
    clock.now += 0.6
    assert await store.lease(SID, "b", 500)  # a's lapsed
    assert [s.remaining_ms for s in (await statuses(store)).entries] == [100]
    clock.now += 0.5
    assert await store.load(SID) is None and (await statuses(store)).entries == ()
    assert (await statuses(store)).epochs == {IA: 1}  # kept after the status expired
    running = session(instance=IA, instance_epoch=1, state=SessionState.RUNNING)
    assert await store.save(SID, stored_session(running), 1000) == 1  # an expired session is created anew
    clock.now += 2
    assert await store.candidates(lambda i, e: True) == []  # expired: off the indexes


async def statuses(store: ControlStore, since: int | None = None) -> StatusSnapshot:
    snapshot = await store.statuses(since)
    assert snapshot is not None
    return snapshot


async def test_the_memory_store_counts_status_revisions() -> None:
    """A reader that holds the latest revision reads nothing; a write tells its writer the revision it made, so a
    writer whose view was current stays current without reading (the single-replica PC's refresh is free)."""
    store = MemoryControlStore(Clock())
    first = await statuses(store)
    assert first.revision == 0 and await store.statuses(0) is None
    written = await store.put_status(StoredStatus(InstanceStatusRecord(IA, 1, InstanceState.ACTIVE, 700),
                                                  InstanceState.ACTIVE, 700))
    assert written == StatusWrite(None, (0, 1)) and await store.statuses(1) is None
    assert [s.record.instance for s in (await statuses(store, 0)).entries] == [IA]
    assert await store.fail_status(IA, 1) and (await statuses(store, 1)).revision == 2


def test_a_snapshot_encodes_as_redis_stores_it() -> None:
    placed = session(epoch=3, served=2, state=SessionState.RUNNING, instance=IA, instance_epoch=9, migrations=2)
    stored = stored_session(placed)
    assert stored.run == run_key(IA, 9)
    decoded = placed_session(StoredSession(EncodedSession(stored.payload.encoded()), 4), 7.0)
    assert (decoded.request, decoded.epoch, decoded.served, decoded.state, decoded.instance, decoded.instance_epoch,
            decoded.migrations, decoded.version, decoded.touched) == (
        placed.request, 3, 2, SessionState.RUNNING, IA, 9, 2, 4, 7.0)  # clock values: the reader's
