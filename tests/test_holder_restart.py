"""A holder never advertises what it cannot serve (issue 12, point 6), without HTTP: write-through to local storage,
the journal of records that lets a restart withdraw what it did not recover, the TTL the Index Service granted,
and chain positions surviving a restart. The real processes: tests/test_prefix_eviction.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.problems import BadRequest
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.holder_outbox import IntentKind
from kvsp_quic.roles.holder_requests import parse_position
from kvsp_quic.storage.journal import NAME as JOURNAL
from kvsp_quic.storage.journal import ReplicaJournal
from kvsp_quic.storage.tiers import BlockId, ChainPosition, LocalStorageConfig, file_header_size
from tests.helpers import Clock
from tests.support.descriptors import small_descriptor
from tests.support.holder import ALICE, BASE, SCOPE, body, key

CHAIN = key(0)


@pytest.fixture
def d() -> CompatDescriptor:
    return small_descriptor()


def holder(d: CompatDescriptor, tmp_path: Path, clock: Clock, **kw: Any) -> Holder:
    size = len(body(d, 0))
    config = LocalStorageConfig(tmp_path / "blocks", 1 << 20, fsync=False)
    kw.setdefault("host_capacity", 2 * size)
    return Holder(HolderSettings(BASE, (d,), local_storage=config, replica_ttl_ms=30_000, **kw), clock=clock)


def store(h: Holder, d: CompatDescriptor, n: int, position: ChainPosition | None = None) -> None:
    h.store(ALICE, d.compat_id, SCOPE, key(n), body(d, n), "*", position=position)


def publish_all(h: Holder) -> None:
    for intent in h.take_intents():
        h.intent_done(intent, True)


def bid(d: CompatDescriptor, n: int) -> BlockId:
    return BlockId(d.compat_id, SCOPE, key(n))


def test_write_through_loses_nothing_acknowledged(d: CompatDescriptor, tmp_path: Path) -> None:
    clock = Clock()
    h = holder(d, tmp_path, clock)
    for n in range(4):  # two stay in memory, two go to disk
        store(h, d, n)
    publish_all(h)
    assert len(h.storage.tiers[0]) == 2
    again = holder(d, tmp_path, clock)  # a crash: nothing was withdrawn, nothing written at exit
    assert again.recover() == 4
    intents = again.take_intents()
    assert sorted(i.block.block_key for i in intents) == sorted(key(n) for n in range(4))
    assert {i.kind for i in intents} == {IntentKind.PUBLISH}
    for n in range(4):
        assert again.fetch(ALICE, d.compat_id, SCOPE, key(n)).container.tobytes() == body(d, n)


def test_a_restart_withdraws_every_record_it_cannot_serve(d: CompatDescriptor, tmp_path: Path) -> None:
    clock = Clock()
    h = holder(d, tmp_path, clock, write_through=False)
    for n in range(4):
        store(h, d, n)
    publish_all(h)  # four records at the Index Service
    store(h, d, 4)  # a fifth, not yet published when the holder dies: 2 goes to disk, 4 is in memory
    blocks = tmp_path / "blocks"
    on_disk = sorted(p for p in blocks.glob("*.kvb"))
    assert len(on_disk) == 3
    raw = bytearray(on_disk[0].read_bytes())
    raw[-5] ^= 1  # one of the files on disk went bad meanwhile
    on_disk[0].write_bytes(raw)

    again = holder(d, tmp_path, clock, write_through=False)
    assert again.recover() == 2
    intents = again.take_intents()
    published = {i.block for i in intents if i.kind is IntentKind.PUBLISH}
    withdrawn = {i.block for i in intents if i.kind is IntentKind.WITHDRAW}
    assert published == set(again.blocks()) and len(published) == 2
    # the published host block lost with the process and the corrupt file: withdrawn; exactly what was recovered:
    # published; block 4 (lost too) never had a record: nothing to withdraw
    assert published | withdrawn == {bid(d, n) for n in range(4)} and not published & withdrawn
    assert bid(d, 3) in withdrawn and again.metrics["stale_withdrawn"] == 2
    for intent in intents:
        again.intent_done(intent, True)
    again.take_intents()  # (syncs the journal)
    assert set(ReplicaJournal(blocks).live) == published  # withdrawn records are forgotten
    assert (blocks / JOURNAL).stat().st_mode & 0o777 == 0o600


def test_chain_positions_survive_a_restart(d: CompatDescriptor, tmp_path: Path) -> None:
    clock = Clock()
    h = holder(d, tmp_path, clock)
    for n in range(3):
        store(h, d, n, ChainPosition(CHAIN, n))
    publish_all(h)
    again = holder(d, tmp_path, clock)
    again.recover()
    assert [again.storage.position(bid(d, n)) for n in range(3)] == [ChainPosition(CHAIN, n) for n in range(3)]
    # ... and steer eviction: restarted with room for one block in memory and one on disk, the head goes back to
    # memory, the next stays on disk, the deepest is dropped (and withdrawn)
    size = len(body(d, 0))
    small = LocalStorageConfig(tmp_path / "blocks", file_header_size(d.layers) + size, fsync=False)
    third = Holder(HolderSettings(BASE, (d,), local_storage=small, host_capacity=size), clock=clock)
    assert third.recover() == 2
    assert third.storage.tiers[0].blocks() == [bid(d, 0)] and third.storage.tiers[1].blocks() == [bid(d, 1)]
    assert {(i.kind, i.block) for i in third.take_intents()} == {
        (IntentKind.PUBLISH, bid(d, 0)), (IntentKind.PUBLISH, bid(d, 1)), (IntentKind.WITHDRAW, bid(d, 2))}


def test_refreshes_follow_the_ttl_the_index_service_granted(d: CompatDescriptor, tmp_path: Path) -> None:
    clock = Clock()
    h = holder(d, tmp_path, clock)
    store(h, d, 1)
    (intent,) = h.take_intents()
    assert intent.record is not None and intent.record.ttl_ms == 30_000
    clock.now += 1
    h.intent_done(intent, True, granted_ttl_ms=6_000)  # the Index Service caps TTLs at 6 s
    state = h.outbox.state(bid(d, 1))
    assert state is not None and state[1] == pytest.approx(intent.taken_at + 2.0)  # a third of the grant
    fetched = h.fetch(ALICE, d.compat_id, SCOPE, key(1))
    assert fetched.max_age_s <= 5  # never longer than the record lives at the Index Service
    clock.now = intent.taken_at + 2.0
    (again,) = h.take_intents()
    h.intent_done(again, True, granted_ttl_ms=60_000)  # a grant above the request does not lengthen it
    state = h.outbox.state(bid(d, 1))
    assert state is not None and state[1] == pytest.approx(again.taken_at + 10.0)


def test_block_files_and_the_journal_are_private(d: CompatDescriptor, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        h = holder(d, tmp_path, Clock())
        store(h, d, 1)
        h.take_intents()
    finally:
        os.umask(old)
    directory = tmp_path / "blocks"
    assert directory.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in directory.iterdir()} == {0o600}


def test_chain_position_parameters() -> None:
    k = key(5)
    assert parse_position({}, k) is None
    assert parse_position({"chain": CHAIN.hex(), "position": "5"}, k) == ChainPosition(CHAIN, 5)
    assert parse_position({"chain": k.hex(), "position": "0"}, k) == ChainPosition(k, 0)
    for query in ({"chain": CHAIN.hex()}, {"position": "1"}, {"chain": CHAIN.hex().upper(), "position": "1"},
                  {"chain": CHAIN.hex(), "position": "01"}, {"chain": CHAIN.hex(), "position": "-1"},
                  {"chain": CHAIN.hex(), "position": "4294967296"}, {"chain": CHAIN.hex(), "position": "0"}):
        with pytest.raises(BadRequest):
            parse_position(query, k)
