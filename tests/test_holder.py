"""The Holder role without HTTP: store/fetch rules, eviction vs leases, faults, the publish outbox, restart."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvsp_quic import container as c
from kvsp_quic.auth import Principal
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.problems import (
    BadRequest,
    DigestMismatch,
    Incompatible,
    InsufficientStorage,
    LayersUnavailable,
    LeaseQuota,
    NotAcceptable,
    NotFound,
    PreconditionFailed,
    PreconditionRequired,
    ScopeDenied,
)
from kvsp_quic.records import LeaseRenewal, LeaseRequest, ReplicaRecord
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.holder_outbox import IntentKind
from kvsp_quic.roles.holder_requests import parse_codec, parse_layers
from kvsp_quic.roles.leases import LeaseLimits
from kvsp_quic.samples import random_sections
from kvsp_quic.storage.tiers import BlockId, LocalStorageConfig
from tests.helpers import Clock
from tests.support.descriptors import small_descriptor
from tests.support.holder import ALICE, BASE, BOB, SCOPE, body, key, principal

OTHER_SCOPE = bytes(16)
TTL_MS = 30_000


@pytest.fixture
def d() -> CompatDescriptor:
    return small_descriptor()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make(d: CompatDescriptor, clock: Clock):  # type: ignore[no-untyped-def]
    def build(**kw: Any) -> Holder:
        kw.setdefault("replica_ttl_ms", TTL_MS)
        return Holder(HolderSettings(BASE, (d,), **kw), clock=clock)
    return build


def put(h: Holder, d: CompatDescriptor, n: int, who: Principal = ALICE) -> ReplicaRecord:
    return h.store(who, d.compat_id, SCOPE, key(n), body(d, n), "*")


def bid(d: CompatDescriptor, n: int) -> BlockId:
    return BlockId(d.compat_id, SCOPE, key(n))


def lease(h: Holder, d: CompatDescriptor, *numbers: int, ttl_ms: int = 10_000, who: Principal = ALICE) -> uuid.UUID:
    request = LeaseRequest(compat_id=CompatId(d.compat_id), scope_id=ScopeId(SCOPE),
                           block_keys=tuple(BlockKey(key(n)) for n in numbers), ttl_ms=ttl_ms)
    return h.create_lease(who, request).lease


def drain(h: Holder, ok: bool = True) -> list[Any]:
    intents = h.take_intents()
    for intent in intents:
        h.intent_done(intent, ok)
    return intents


# -- store ---------------------------------------------------------------------------------------------------------


def test_store_publishes_a_complete_record(make, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    h = make(host_read_mbit_per_s=400_000)
    record = put(h, d, 1)
    enc = c.decode(body(d, 1), d)[1]
    assert record.holder == BASE and record.size == len(body(d, 1)) and record.codec == 1
    assert record.layer_digests == tuple(layer.digest for layer in enc)
    assert record.digest == hashlib.sha256(b"".join(record.layer_digests)).digest()
    assert [(r.tier, r.layers, r.read_mbit_per_s) for r in record.residency] == [("host", (0, 3), 400_000)]
    assert record.ttl_ms == TTL_MS and h.blocks() == [bid(d, 1)]
    assert [(i.kind, i.record) for i in h.take_intents()] == [(IntentKind.PUBLISH, record)]


@pytest.mark.parametrize("value", [None, "", "W/\"x\"", "\"etag\""])
def test_store_requires_if_none_match_star(make, d: CompatDescriptor, value: str | None) -> None:  # type: ignore[no-untyped-def]
    h = make()
    with pytest.raises(PreconditionRequired) as info:
        h.store(ALICE, d.compat_id, SCOPE, key(1), body(d, 1), value)
    assert info.value.status == 428 and not h.blocks()


def test_an_existing_replica_gives_412_and_is_kept(make, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    h = make()
    put(h, d, 1)
    with pytest.raises(PreconditionFailed):
        h.store(BOB, d.compat_id, SCOPE, key(1), body(d, 2), "*")
    assert h.fetch(ALICE, d.compat_id, SCOPE, key(1)).container.tobytes() == body(d, 1)
    # A concurrent PUT of the same key: the one that finishes second gets 412.
    first = h.begin_store(ALICE, d.compat_id, SCOPE, key(2), "*")
    second = h.begin_store(BOB, d.compat_id, SCOPE, key(2), "*")
    first.feed(body(d, 2))
    second.feed(body(d, 3))
    first.finish()
    with pytest.raises(PreconditionFailed):
        second.finish()
    assert h.fetch(ALICE, d.compat_id, SCOPE, key(2)).container.tobytes() == body(d, 2)


def test_scope_is_checked_before_anything_is_revealed(make, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    h = make()
    put(h, d, 1)
    outsider = principal("eve", frozenset({ScopeId(OTHER_SCOPE)}))
    for op in (lambda: h.store(outsider, d.compat_id, SCOPE, key(1), body(d, 1), "*"),
               lambda: h.fetch(outsider, d.compat_id, SCOPE, key(1)),
               lambda: h.fetch(outsider, d.compat_id, SCOPE, key(9)),
               lambda: lease(h, d, 1, who=outsider)):
        with pytest.raises(ScopeDenied):
            op()
    with pytest.raises(Incompatible):
        h.fetch(ALICE, bytes(32), SCOPE, key(1))
    with pytest.raises(Incompatible):
        h.store(ALICE, bytes(32), SCOPE, key(1), body(d, 1), "*")


@pytest.mark.parametrize("case", ["truncated", "trailing", "layer range", "tokens", "magic", "empty"])
def test_malformed_bodies_store_nothing(make, d: CompatDescriptor, case: str) -> None:  # type: ignore[no-untyped-def]
    h = make()
    good = body(d, 1)
    bad = {
        "truncated": good[:-1],
        "trailing": good + b"x",
        # a layer range is stored (tests/test_layer_range_replicas.py); one past the descriptor's layers is not
        "layer range": c.encode(random_sections(d, 4, 2, 4, 1), first_layer=2, token_count=4).tobytes(),
        "tokens": c.encode(random_sections(d, 3, 0, 3, 1), first_layer=0, token_count=3, codec=0xFF01).tobytes(),
        "magic": b"KVB2" + good[4:],
        "empty": b"",
    }[case]
    with pytest.raises(c.ContainerError) as info:
        h.store(ALICE, d.compat_id, SCOPE, key(1), bad, "*")
    assert info.value.status == 400
    if case == "layer range":
        assert "outside the descriptor's 4 layers" in info.value.detail
    assert not h.blocks() and len(h.outbox) == 0 and h.storage.tiers[0].used == 0


# -- fetch --------------------------------------------------------------------------------------------------------


def test_fetch_whole_and_layer_ranges(make, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    h = make()
    record = put(h, d, 1)
    whole = h.fetch(ALICE, d.compat_id, SCOPE, key(1))
    data = body(d, 1)
    assert whole.container.tobytes() == data and whole.repr_digest == hashlib.sha256(data).digest()
    assert whole.repr_digest_field.startswith("sha-256=:") and whole.tier == "host"
    part = h.fetch(ALICE, d.compat_id, SCOPE, key(1), layers=(1, 2), codec=1)
    blob = part.container.tobytes()
    assert part.repr_digest == hashlib.sha256(blob).digest() and part.size == len(blob)
    header, _layers = c.decode(blob, d, expected_layer_digests=record.layer_digests)
    assert (header.first_layer, header.layer_count) == (1, 2)
    assert h.fetch(ALICE, d.compat_id, SCOPE, key(1), layers=(3, 3)).container.header.first_layer == 3
    with pytest.raises(LayersUnavailable):
        h.fetch(ALICE, d.compat_id, SCOPE, key(1), layers=(2, 4))
    with pytest.raises(BadRequest):
        h.fetch(ALICE, d.compat_id, SCOPE, key(1), layers=(2, 1))
    with pytest.raises(NotAcceptable) as info:
        h.fetch(ALICE, d.compat_id, SCOPE, key(1), codec=0xFF01)
    assert info.value.status == 406
    with pytest.raises(NotFound):
        h.fetch(ALICE, d.compat_id, SCOPE, key(2))


def test_max_age_is_the_remaining_ttl_of_the_advertised_record(make, d: CompatDescriptor,  # type: ignore[no-untyped-def]
                                                               clock: Clock) -> None:
    h = make()
    put(h, d, 1)
    assert h.fetch(ALICE, d.compat_id, SCOPE, key(1)).max_age_s == 30
    clock.now += 12.5
    assert h.fetch(ALICE, d.compat_id, SCOPE, key(1)).max_age_s == 17
    drain(h)  # published now: advertised for another 30 s
    assert h.fetch(ALICE, d.compat_id, SCOPE, key(1)).max_age_s == 30
    h2 = make(retention_ms=20_000)
    put(h2, d, 1)
    clock.now += 5
    assert h2.fetch(ALICE, d.compat_id, SCOPE, key(1)).max_age_s == 15
    assert h2.take_intents()[0].record.ttl_ms == 15_000  # records never outlive the retention limit


def test_query_parameter_parsing() -> None:
    assert parse_layers("0-31") == (0, 31) and parse_layers("7-7") == (7, 7)
    for bad in ("3", "3-", "-3", "01-2", "+1-2", "2-1", "a-b", "1-2-3", "1 -2", "99999999999-1"):
        with pytest.raises(BadRequest):
            parse_layers(bad)
    assert parse_codec("1") == 1 and parse_codec("65280") == 0xFF00
    for bad in ("0", "65536", "01", "x", ""):
        with pytest.raises(BadRequest):
            parse_codec(bad)


# -- eviction and leases ------------------------------------------------------------------------------------------


def test_eviction_never_touches_leased_replicas(make, d: CompatDescriptor, clock: Clock) -> None:  # type: ignore[no-untyped-def]
    size = len(body(d, 1))
    h = make(host_capacity=2 * size)
    put(h, d, 1)
    put(h, d, 2)
    drain(h)
    lease(h, d, 1, ttl_ms=5000)  # 1 is the LRU victim, but leased
    put(h, d, 3)
    assert sorted(h.blocks()) == sorted([bid(d, 1), bid(d, 3)])
    assert h.outbox.state(bid(d, 2))[0] is IntentKind.WITHDRAW  # withdrawn right after the eviction
    lease(h, d, 3, ttl_ms=5000)
    with pytest.raises(InsufficientStorage) as info:
        put(h, d, 4)
    assert info.value.status == 507 and sorted(h.blocks()) == sorted([bid(d, 1), bid(d, 3)])
    clock.now += 5
    put(h, d, 4)  # the leases have expired
    assert bid(d, 4) in h.blocks() and len(h.blocks()) == 2
    assert h.metrics["evicted"] == 2


def test_leases_need_every_key_and_respect_quotas(make, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    size = len(body(d, 1))
    h = make(leases=LeaseLimits(max_ttl_ms=10_000, max_octets_per_client=2 * size))
    put(h, d, 1)
    put(h, d, 2)
    with pytest.raises(NotFound, match="no lease was created"):
        lease(h, d, 1, 7)
    assert len(h.leases) == 0
    first = lease(h, d, 1, 1, 2)  # duplicates count once
    assert h.leases.usage(ALICE.identity) == (2 * size, 1)
    with pytest.raises(LeaseQuota):
        lease(h, d, 1)
    with pytest.raises(LeaseQuota):
        lease(h, d, 1, ttl_ms=10_001, who=BOB)
    assert h.metrics["lease_rejections"] == 2
    renewed = h.renew_lease(ALICE, first, LeaseRenewal(ttl_ms=5000))
    assert renewed.ttl_ms == 5000 and renewed.block_keys == (key(1), key(2))
    with pytest.raises(NotFound):
        h.renew_lease(BOB, first, LeaseRenewal(ttl_ms=5000))
    with pytest.raises(NotFound):
        h.release_lease(BOB, first)
    h.release_lease(ALICE, first)
    assert len(h.leases) == 0


def test_stored_octets_per_owner_follow_every_change(make, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    """The per-principal totals the storage quota reads (kept as running sums, not summed per upload: that was
    O(replicas) per PUT) match the replicas each principal holds after stores, evictions and withdrawals."""
    size = len(body(d, 1))
    h = make(host_capacity=3 * size)

    def held(who: Principal) -> int:
        return sum(size for n in range(1, 9)
                   if h.replica(bid(d, n)) is not None and h._owner.get(bid(d, n)) == who.identity)

    for n, who in ((1, ALICE), (2, BOB), (3, ALICE)):
        put(h, d, n, who)
    assert h.stored_by(ALICE.identity) == (2 * size, 0) and h.stored_by(BOB.identity) == (size, 0)
    put(h, d, 4, BOB)  # the tier is full: its coldest replica is evicted
    put(h, d, 5, ALICE)
    for who in (ALICE, BOB):
        assert h.stored_by(who.identity)[0] == held(who)
    assert h.stored_by(ALICE.identity)[0] + h.stored_by(BOB.identity)[0] == 3 * size
    for n in range(1, 6):
        h._drop(bid(d, n))
    assert h.stored_by(ALICE.identity) == h.stored_by(BOB.identity) == (0, 0)
    assert not h._owned and not h._owned_octets

# -- faults ---------------------------------------------------------------------------------------------------------


def corrupt(h: Holder, block: BlockId) -> Path:
    disk = h.storage.tiers[1]
    path = disk.path_of(block)  # type: ignore[attr-defined]
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(raw)
    return Path(path)


def test_a_fault_withdraws_first_then_drops(make, d: CompatDescriptor, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    size = len(body(d, 1))
    h = make(host_capacity=size, local_storage=LocalStorageConfig(tmp_path, 1 << 20, read_mbit_per_s=8000, fsync=False))
    put(h, d, 1)
    put(h, d, 2)  # 1 goes down to local storage
    intents = drain(h)
    assert [i.record.residency[0].tier for i in intents] == ["local-storage", "host"]
    assert intents[0].record.residency[0].read_mbit_per_s == 8000
    lease_id = lease(h, d, 1, 2)
    path = corrupt(h, bid(d, 1))
    with pytest.raises(DigestMismatch, match="does not match its digest"):  # 422, not 404 (issue 13)
        h.fetch(ALICE, d.compat_id, SCOPE, key(1))
    # Not served any more, lease broken, withdrawal queued -- and the octets still there until it is done.
    assert bid(d, 1) not in h.blocks() and h.metrics["faults"] == 1
    with pytest.raises(NotFound):
        h.fetch(ALICE, d.compat_id, SCOPE, key(1))
    with pytest.raises(NotFound, match="broken"):
        h.renew_lease(ALICE, lease_id, LeaseRenewal(ttl_ms=1000))
    assert h.leases.protects(bid(d, 2))  # the lease's other replica stays protected until it expires
    assert path.exists() and bid(d, 1) in h.storage
    withdraw = h.take_intents()
    assert [(i.kind, i.block) for i in withdraw] == [(IntentKind.WITHDRAW, bid(d, 1))]
    assert path.exists()
    h.intent_done(withdraw[0], ok=True)
    assert not path.exists() and bid(d, 1) not in h.storage and h.storage.tiers[1].used == 0
    put(h, d, 1)  # the key can be stored again
    assert bid(d, 1) in h.blocks()


def test_a_fault_whose_withdrawal_fails_drops_once_the_record_expired(make, d: CompatDescriptor,  # type: ignore[no-untyped-def]
                                                                      tmp_path: Path, clock: Clock) -> None:
    size = len(body(d, 1))
    h = make(host_capacity=size, local_storage=LocalStorageConfig(tmp_path, 1 << 20, fsync=False))
    put(h, d, 1)
    put(h, d, 2)
    drain(h)
    path = corrupt(h, bid(d, 1))
    with pytest.raises(DigestMismatch):
        h.fetch(ALICE, d.compat_id, SCOPE, key(1))
    drain(h, ok=False)  # the Index Service is unreachable
    clock.now += TTL_MS / 1000 - 1
    h.tick()
    assert path.exists()
    assert h.next_due() is not None
    clock.now += 1
    h.tick()
    assert not path.exists() and bid(d, 1) not in h.storage


def test_a_fault_before_any_publication_drops_at_once(make, d: CompatDescriptor, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    size = len(body(d, 1))
    h = make(host_capacity=size, local_storage=LocalStorageConfig(tmp_path, 1 << 20, fsync=False))
    put(h, d, 1)
    put(h, d, 2)
    path = corrupt(h, bid(d, 1))
    with pytest.raises(DigestMismatch):
        h.fetch(ALICE, d.compat_id, SCOPE, key(1))
    assert not path.exists() and h.outbox.state(bid(d, 1)) is None  # nothing was ever sent to withdraw


# -- the outbox -----------------------------------------------------------------------------------------------------


def test_publish_refreshes_every_third_of_the_ttl(make, d: CompatDescriptor, clock: Clock) -> None:  # type: ignore[no-untyped-def]
    h = make()
    put(h, d, 1)
    assert h.next_due() == clock.now
    first = h.take_intents()
    assert len(first) == 1 and h.take_intents() == []  # in flight: not taken twice
    clock.now += 0.2
    h.intent_done(first[0], ok=True)
    assert h.next_due() == pytest.approx(first[0].taken_at + 10.0)  # ttl 30 s / 3, from when it was sent
    clock.now = first[0].taken_at + 9.999
    assert h.take_intents() == []
    clock.now = first[0].taken_at + 10.0
    refresh = h.take_intents()
    assert [i.kind for i in refresh] == [IntentKind.PUBLISH] and refresh[0].record.ttl_ms == TTL_MS


def test_failed_requests_back_off_exponentially(make, d: CompatDescriptor, clock: Clock) -> None:  # type: ignore[no-untyped-def]
    h = make(publish_backoff_ms=(500, 2000))
    put(h, d, 1)
    delays = []
    for _ in range(4):
        start = clock.now
        drain(h, ok=False)
        due = h.next_due()
        assert due is not None
        delays.append(due - start)
        clock.now = due
    assert delays == [0.5, 1.0, 2.0, 2.0]
    drain(h, ok=True)
    assert h.next_due() == pytest.approx(clock.now + 10.0)


def test_newer_intents_supersede_older_ones(make, d: CompatDescriptor, clock: Clock) -> None:  # type: ignore[no-untyped-def]
    size = len(body(d, 1))
    h = make(host_capacity=size)
    put(h, d, 1)
    put(h, d, 2)  # evicts 1 before its publication was ever sent: nothing to withdraw
    assert h.outbox.state(bid(d, 1)) is None
    [publish2] = h.take_intents()
    put(h, d, 3)  # evicts 2 while its publication is in flight
    h.intent_done(publish2, ok=True)
    intents = h.take_intents()
    assert sorted((i.kind.value, i.block.block_key) for i in intents) == sorted(
        [("withdraw", key(2)), ("publish", key(3))])
    for intent in intents:
        h.intent_done(intent, ok=True)
    assert h.outbox.state(bid(d, 2)) is None and len(h.outbox) == 1


def test_retention_limit_evicts_unless_leased(make, d: CompatDescriptor, clock: Clock) -> None:  # type: ignore[no-untyped-def]
    h = make(retention_ms=60_000)
    put(h, d, 1)
    put(h, d, 2)
    drain(h)
    lease(h, d, 2, ttl_ms=10_000)
    clock.now += 55
    lease(h, d, 2, ttl_ms=10_000)
    clock.now += 5
    h.tick()
    assert h.blocks() == [bid(d, 2)] and h.outbox.state(bid(d, 1))[0] is IntentKind.WITHDRAW
    clock.now += 10
    h.tick()
    assert h.blocks() == [] and h.metrics["expired"] == 2


# -- restart -------------------------------------------------------------------------------------------------------


def test_restart_republishes_the_blocks_on_local_storage(d: CompatDescriptor, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                         clock: Clock) -> None:
    size = len(body(d, 1))
    config = LocalStorageConfig(tmp_path, 1 << 20, encryption_key=bytes(range(32)), fsync=False)
    other = small_descriptor(layers=2)
    h = Holder(HolderSettings(BASE, (d, other), host_capacity=size, local_storage=config, write_through=False),
               clock=clock)
    h.store(ALICE, other.compat_id, SCOPE, key(9), body(other, 9), "*")
    for n in range(1, 4):
        put(h, d, n)  # each pushes the previous block down to local storage; 3 stays in memory
    records = {r.block_key: r for r in (h.record(b) for b in h.blocks())}
    # Restart, serving only the first descriptor: blocks 1-2 come back from disk (3 was in memory only), the
    # other cache's file is left alone.
    again = Holder(HolderSettings(BASE, (d,), host_capacity=size, local_storage=config), clock=clock)
    assert again.recover() == 2
    intents = [i for i in again.take_intents() if i.kind is IntentKind.PUBLISH]  # (withdrawals: test_holder_restart)
    assert sorted(i.block.block_key for i in intents) == sorted([key(1), key(2)])
    for intent in intents:
        assert intent.record.digest == records[intent.block.block_key].digest
        assert intent.record.residency[0].tier == "local-storage"
    assert again.fetch(ALICE, d.compat_id, SCOPE, key(2)).container.tobytes() == body(d, 2)
    assert len(list(tmp_path.glob("*.kvb"))) == 3
