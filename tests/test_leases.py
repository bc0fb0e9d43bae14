"""The lease table: quotas on octets, TTL and count; expiry; renewal; owner checks; broken leases."""

from __future__ import annotations

import uuid

import pytest

from kvsp_quic.problems import LeaseQuota, NotFound
from kvsp_quic.roles.leases import LeaseLimits, LeaseTable
from kvsp_quic.storage.tiers import BlockId
from tests.helpers import Clock

A, B = "urn:kvsp:client:alice", "urn:kvsp:client:bob"


def bid(n: int) -> BlockId:
    return BlockId(bytes(32), bytes(16), n.to_bytes(32, "big"))


@pytest.fixture
def clock() -> Clock:
    return Clock(100.0)


@pytest.fixture
def table(clock: Clock) -> LeaseTable:
    ids = iter(uuid.UUID(int=i) for i in range(1, 1000))
    return LeaseTable(LeaseLimits(max_ttl_ms=10_000, max_octets_per_client=1000, max_leases_per_client=3,
                                  max_keys_per_lease=4), clock=clock, new_id=lambda: next(ids))


def test_a_lease_protects_until_it_expires(table: LeaseTable, clock: Clock) -> None:
    lease = table.create(A, [bid(1), bid(2)], [100, 200], 2000)
    assert lease.id == uuid.UUID(int=1) and lease.octets == 300 and lease.ttl_ms == 2000
    assert table.protects(bid(1)) and table.protects(bid(2)) and not table.protects(bid(3))
    assert table.usage(A) == (300, 1) and table.usage(B) == (0, 0)
    clock.now += 1.999
    assert table.protects(bid(1))
    clock.now += 0.001
    assert not table.protects(bid(1)) and table.get(lease.id) is None
    assert table.usage(A) == (0, 0) and len(table) == 0  # expired leases are forgotten and free the quota
    with pytest.raises(NotFound):
        table.renew(A, lease.id, 1000)


def test_ttl_above_the_maximum_is_refused_not_clamped(table: LeaseTable) -> None:
    with pytest.raises(LeaseQuota, match="exceeds this holder's maximum lease TTL of 10000 ms"):
        table.create(A, [bid(1)], [1], 10_001)
    lease = table.create(A, [bid(1)], [1], 10_000)
    with pytest.raises(LeaseQuota):
        table.renew(A, lease.id, 10_001)
    assert len(table) == 1


def test_octet_count_and_key_quotas_are_per_client(table: LeaseTable) -> None:
    table.create(A, [bid(1)], [600], 1000)
    with pytest.raises(LeaseQuota, match="holds 600 of its quota of 1000"):
        table.create(A, [bid(2)], [401], 1000)
    table.create(B, [bid(2)], [1000], 1000)  # bob has his own quota
    table.create(A, [bid(2)], [400], 1000)
    table.create(A, [bid(3)], [0], 1000)
    with pytest.raises(LeaseQuota, match="already holds 3 leases"):
        table.create(A, [bid(4)], [0], 1000)
    with pytest.raises(LeaseQuota, match="5 block keys exceed the maximum of 4"):
        table.create(B, [bid(i) for i in range(5)], [0] * 5, 1000)
    assert table.usage(A) == (1000, 3)


def test_renewal_extends_from_now_and_may_shorten(table: LeaseTable, clock: Clock) -> None:
    lease = table.create(A, [bid(1)], [10], 1000)
    clock.now += 0.9
    assert table.renew(A, lease.id, 5000).expires_at == clock.now + 5
    clock.now += 4.9
    assert table.protects(bid(1))
    table.renew(A, lease.id, 100)
    clock.now += 0.1
    assert not table.protects(bid(1))


def test_only_the_owner_renews_or_releases(table: LeaseTable) -> None:
    lease = table.create(A, [bid(1)], [10], 1000)
    for op in (lambda: table.renew(B, lease.id, 1000), lambda: table.release(B, lease.id)):
        with pytest.raises(NotFound, match="unknown or has expired"):  # as if it did not exist
            op()
    assert table.protects(bid(1))
    table.release(A, lease.id)
    assert not table.protects(bid(1)) and table.usage(A) == (0, 0)
    with pytest.raises(NotFound):
        table.release(A, lease.id)


def test_overlapping_leases_protect_until_the_last_ends(table: LeaseTable, clock: Clock) -> None:
    first = table.create(A, [bid(1)], [10], 1000)
    table.create(B, [bid(1), bid(2)], [10, 10], 3000)
    table.release(A, first.id)
    assert table.protects(bid(1))
    clock.now += 3
    assert not table.protects(bid(1)) and not table.protects(bid(2))
    assert table.next_expiry() is not None and table.expire() and table.next_expiry() is None


def test_broken_leases_keep_protecting_but_cannot_be_renewed(table: LeaseTable) -> None:
    lease = table.create(A, [bid(1), bid(2)], [10, 10], 1000)
    assert [x.id for x in table.break_block(bid(1), "layer 3 failed verification")] == [lease.id]
    assert table.protects(bid(2))
    with pytest.raises(NotFound, match="broken: layer 3 failed verification"):
        table.renew(A, lease.id, 1000)
    table.release(A, lease.id)
    assert len(table) == 0


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        LeaseLimits(max_ttl_ms=0)
    with pytest.raises(ValueError):
        LeaseTable().create(A, [bid(1)], [], 10)
