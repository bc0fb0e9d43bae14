"""The Index Service role (kvsp_quic.roles.index) over both stores, and the status table.

Every role test runs against the memory store and against a real redis-server (skipped with the reason when it
is not installed). The memory store expires on the injected clock; Redis expires on its own, so :meth:`Env.advance`
also sleeps for real when the store is Redis, and the expiry tests use TTLs of a few hundred milliseconds.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest

from kvsp_quic.auth import Principal
from kvsp_quic.compat import InstanceState
from kvsp_quic.fields import BlockKey
from kvsp_quic.problems import BadRequest, ContentTooLarge, Forbidden, NotFound, ScopeDenied, StaleEpoch
from kvsp_quic.records import (
    InstanceStatusRecord,
    Link,
    LookupRequest,
    ReplicaRecord,
    TargetEstimate,
    encode_moqt_namespace,
    kvsp_track_namespace,
)
from kvsp_quic.roles.index import Geometry, IndexConfig, IndexService
from kvsp_quic.roles.status import InstanceStatus, StatusTable
from kvsp_quic.storage.index_store import IndexStore, pack_body, unpack_body
from kvsp_quic.storage.memory_index import MemoryIndexStore
from tests.helpers import Clock
from tests.support.index import (
    C1,
    C2,
    H1,
    H2,
    H3,
    II7,
    II9,
    MAX_TTL,
    PC,
    RELAY,
    S1,
    S2,
    SHAPES,
    Env,
    bk,
    hid,
    make_config,
    replica,
    who,
)

# -- publish ------------------------------------------------------------------------------------------------------


async def test_publish_creates_then_refreshes(env: Env) -> None:
    assert await env.publish(replica(0)) is True
    assert await env.publish(replica(0)) is False
    assert await env.store.count() == 1
    [[got]] = await env.lookup(1)
    assert replace(got, ttl_ms=60_000) == replica(0)
    assert 59_000 <= got.ttl_ms <= 60_000  # the remaining TTL


async def test_ttl_is_capped(env: Env) -> None:
    result = await env.service.publish(who(H1), hid(H1), bk(0), replica(0, ttl_ms=10 * MAX_TTL))
    assert result.created and result.record.ttl_ms == MAX_TTL
    assert replace(result.record, ttl_ms=1) == replica(0, ttl_ms=1)
    [[got]] = await env.lookup(1)
    assert MAX_TTL - 1000 <= got.ttl_ms <= MAX_TTL


async def test_records_expire_and_come_back(env: Env) -> None:
    await env.publish(replica(0, ttl_ms=300))
    await env.publish(replica(1, ttl_ms=60_000))
    assert len(await env.lookup(2)) == 2
    await env.advance(450)
    assert await env.lookup(2) == []  # block 0 expired: the chain stops at once
    assert await env.publish(replica(0, ttl_ms=300)) is True  # an expired entry is created anew
    assert len(await env.lookup(2)) == 2


async def test_publish_path_must_name_the_record(env: Env) -> None:
    with pytest.raises(BadRequest, match="holder-id"):
        await env.service.publish(who(H1), hid(H2), bk(0), replica(0))
    with pytest.raises(BadRequest, match="block_key"):
        await env.service.publish(who(H1), hid(H1), bk(1), replica(0))


async def test_publish_authorization(env: Env) -> None:
    with pytest.raises(Forbidden, match="may not publish replicas for holder"):
        await env.publish(replica(0, holder=H2), principal=H1)  # another holder's record
    with pytest.raises(Forbidden, match="not a holder"):
        await env.publish(replica(0), principal=PC)  # a controller is no holder
    with pytest.raises(ScopeDenied):
        await env.publish(replica(0, scope=S2), principal=H1)  # its own record, a scope it lacks
    assert await env.publish(replica(0), principal=H2)  # publish_for H1
    ns = encode_moqt_namespace(kvsp_track_namespace(C1, S1, hid(H2), 1))
    moqt = replica(1, holder=RELAY, moqt_namespace=ns)
    assert await env.publish(moqt, principal=H2)  # publish_for a relay
    with pytest.raises(Forbidden):
        await env.publish(moqt, principal=H1)
    [[a], [b]] = await env.lookup(2)
    assert a.holder == H1 and b.holder == RELAY and b.moqt_namespace == ns


async def test_publish_for_includes_the_instance_holder(env: Env) -> None:
    assert await env.publish(replica(0, holder=II7))  # an instance with the holder role
    with pytest.raises(Forbidden, match="not a holder"):
        await env.publish(replica(0, holder=II9))  # instance only


# -- withdraw -----------------------------------------------------------------------------------------------------


async def test_withdraw(env: Env) -> None:
    await env.publish(replica(0))
    await env.publish(replica(0, holder=H2))
    await env.service.withdraw(who(H1), hid(H1), bk(0))
    [[left]] = await env.lookup(1)
    assert left.holder == H2
    with pytest.raises(NotFound):
        await env.service.withdraw(who(H1), hid(H1), bk(0))  # already gone
    with pytest.raises(NotFound):
        await env.service.withdraw(who(H2), hid(H1), bk(0))  # on H1's behalf: gone too
    await env.service.withdraw(who(H2), hid(H2), bk(0))
    assert await env.lookup(1) == []


async def test_withdraw_on_behalf_and_authorization(env: Env) -> None:
    await env.publish(replica(0))
    await env.publish(replica(1))
    with pytest.raises(Forbidden, match="may not withdraw"):
        await env.service.withdraw(who(H3), hid(H1), bk(0))
    with pytest.raises(Forbidden, match="may not withdraw"):
        await env.service.withdraw(who(H3), hid(H1), bk(7))  # the same answer whether the key exists or not
    with pytest.raises(Forbidden, match="not a holder"):
        await env.service.withdraw(who(PC), hid(H1), bk(0))
    await env.service.withdraw(who(H2), hid(H1), bk(0))  # publish_for H1
    assert await env.lookup(2) == []


async def test_withdraw_checks_the_stored_scope(env: Env) -> None:
    await env.publish(replica(0, holder=H1, scope=S2), principal=H2)  # H2 may publish for H1 in S2
    with pytest.raises(ScopeDenied):
        await env.service.withdraw(who(H1), hid(H1), bk(0))  # H1 itself lacks S2
    await env.service.withdraw(who(H2), hid(H1), bk(0))


async def test_withdraw_unknown_or_expired_is_not_found(env: Env) -> None:
    with pytest.raises(NotFound):
        await env.service.withdraw(who(H1), hid(H1), bk(0))
    await env.publish(replica(0, ttl_ms=300))
    await env.advance(450)
    with pytest.raises(NotFound):
        await env.service.withdraw(who(H1), hid(H1), bk(0))


# -- lookup -------------------------------------------------------------------------------------------------------


async def test_lookup_stops_at_the_first_missing_key(env: Env) -> None:
    for i in (0, 1, 3, 4):
        await env.publish(replica(i))
    found = await env.lookup(5)
    assert [[r.block_key for r in rs] for rs in found] == [[bk(0)], [bk(1)]]
    for i in range(5, 20):  # longer than the Redis store's first chunk (4): several rounds
        await env.publish(replica(i))
    await env.publish(replica(2))
    assert len(await env.lookup(20)) == 20
    assert len(await env.lookup(30)) == 20


async def test_lookup_returns_every_holder(env: Env) -> None:
    await env.publish(replica(0))
    await env.publish(replica(0, holder=H2))
    await env.publish(replica(0, holder=II7))
    [replicas] = await env.lookup(1)
    assert sorted(r.holder for r in replicas) == sorted([H1, H2, II7])


async def test_lookup_is_confined_to_scope_and_compat(env: Env) -> None:
    await env.publish(replica(0))
    await env.publish(replica(0, holder=H3, scope=S2))  # the same key in another scope
    await env.publish(replica(1, compat=C2))
    with pytest.raises(ScopeDenied):
        await env.lookup(1, principal=H1, scope=S2)
    with pytest.raises(ScopeDenied):
        await env.lookup(1, principal="urn:kvsp:client:bob", scope=S1)
    [[mine]] = await env.lookup(1)
    assert mine.holder == H1 and mine.scope_id == S1
    [[theirs]] = await env.lookup(1, principal="urn:kvsp:client:bob", scope=S2)
    assert theirs.holder == H3
    assert len(await env.lookup(2)) == 1  # block 1 only under compat C2
    assert await env.lookup(2, compat=C2) == []  # block 0 has no C2 replica: stop at once


async def test_lookup_quota(env: Env) -> None:
    assert await env.lookup(64) == []
    with pytest.raises(ContentTooLarge, match="at most 64 block keys"):
        await env.lookup(65)
    with pytest.raises(ContentTooLarge, match="at most 4 targets"):
        await env.lookup(1, targets=tuple(f"https://ii{i}.example/kvsp/" for i in range(5)))


async def test_lookup_of_nothing(env: Env) -> None:
    assert await env.lookup(0) == []
    response = await env.service.lookup(who(PC), LookupRequest(S1, C1, (), ()))  # type: ignore[arg-type]
    assert response.matched == 0 and response.targets == ()


# -- estimates ----------------------------------------------------------------------------------------------------


def status(instance: str = II7, *, epoch: int = 1, ttl_ms: int = 3000, state: InstanceState = InstanceState.ACTIVE,
           **changes: Any) -> InstanceStatusRecord:
    fields: dict[str, Any] = dict(instance=instance, epoch=epoch, state=state, ttl_ms=ttl_ms, queued=2,
                                  prefill_tokens_per_s=40_000, links=(Link(H1, 8_000, 10), Link(H2, 4_000, 2)))
    fields.update(changes)
    return InstanceStatusRecord(**fields)


async def test_lookup_with_targets(env: Env) -> None:
    for i in range(3):
        await env.publish(replica(i))  # 4 layers, 4000 octets, at H1
    await env.publish(replica(0, holder=H2))
    env.service.report_status(who(II7), hid(II7), status())
    env.service.report_status(who(II9), hid(II9), status(II9, prefill_tokens_per_s=None))
    response = await env.service.lookup(who(PC), LookupRequest(
        S1, C1, tuple(bk(i) for i in range(3)), (II7, II9, H3)))  # type: ignore[arg-type]
    assert response.matched == 3
    # II7: block 0 -> H1 (10 + 4 us = 14) vs H2 (2 + 8 = 10): H2; blocks 1, 2 -> H1: 10 + 4 + 4 = 18.
    # recompute: 48 tokens at 40000 tokens/s = 1200 us. II9 has no prefill rate, H3 no status: left out.
    assert response.targets == (TargetEstimate(II7, 18, 1200),)


async def test_estimates_need_the_geometry_and_a_live_status(env: Env) -> None:
    await env.publish(replica(0, compat=C2))
    env.service.report_status(who(II7), hid(II7), status())
    response = await env.service.lookup(who(PC), LookupRequest(S1, C2, (bk(0),), (II7,)))  # type: ignore[arg-type]
    assert response.matched == 1 and response.targets == ()  # no geometry configured for C2
    await env.publish(replica(0))
    one = LookupRequest(S1, C1, (bk(0),), (II7,))  # type: ignore[arg-type]
    assert (await env.service.lookup(who(PC), one)).targets == (TargetEstimate(II7, 14, 400),)  # 10 + 2 + 2
    env.clock.now += 3.5  # the status expired: the instance counts as failed
    assert env.service.status.state(II7) is InstanceState.FAILED
    assert (await env.service.lookup(who(PC), one)).targets == ()


# -- status -------------------------------------------------------------------------------------------------------


def test_status_reports_and_epochs() -> None:
    clock = Clock()
    service = IndexService(MemoryIndexStore(), clock=clock, config=make_config(max_status_ttl_ms=2000))
    report = service.report_status
    assert report(who(II7), hid(II7), status(epoch=5)).state is InstanceState.ACTIVE
    assert report(who(II7), hid(II7), status(epoch=5, queued=9)).state is InstanceState.ACTIVE  # same epoch
    with pytest.raises(StaleEpoch):
        report(who(II7), hid(II7), status(epoch=4))
    sleepy = status(epoch=6, requested_state=InstanceState.SLEEPING)
    assert report(who(II7), hid(II7), sleepy).state is InstanceState.ACTIVE  # sleep requests are refused for now
    entry = service.status.get(II7)
    assert entry is not None and entry.record.epoch == 6 and entry.expires_at == clock.now + 2.0  # TTL capped
    clock.now += 2.0
    assert service.status.get(II7) is None and service.status.state(II7) is InstanceState.FAILED
    assert service.status.expire() == 1 and len(service.status) == 0
    assert service.status.state(II7) is InstanceState.FAILED  # still known by its epoch
    with pytest.raises(StaleEpoch):  # the highest epoch outlives the record
        report(who(II7), hid(II7), status(epoch=5))
    assert service.status.state(II9) is None
    draining = report(who(II7), hid(II7), status(epoch=7, state=InstanceState.DRAINING))
    assert draining.state is InstanceState.DRAINING and draining.to_json() == {"state": "draining"}


def test_status_authorization() -> None:
    service = IndexService(MemoryIndexStore(), clock=Clock(), config=make_config())
    with pytest.raises(Forbidden, match="its own status"):
        service.report_status(who(II7), hid(II9), status(II9))
    with pytest.raises(BadRequest, match="not the reporting instance"):
        service.report_status(who(II7), hid(II7), status(II9))
    with pytest.raises(Forbidden, match="the role instance"):
        service.report_status(who(H1), hid(H1), status(H1))


def test_status_policy_hook() -> None:
    class AcceptSleep:
        def decide(self, record: InstanceStatusRecord, previous: InstanceStatus | None,
                   now: float) -> InstanceState:
            return InstanceState.DRAINING if record.requested_state is InstanceState.SLEEPING else record.state

    table = StatusTable(Clock(), policy=AcceptSleep())
    assert table.report(status(requested_state=InstanceState.SLEEPING)).state is InstanceState.DRAINING
    assert table.state(II7) is InstanceState.DRAINING
    assert [e.instance for e in table.live()] == [II7]


# -- the stores ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("record", SHAPES, ids=lambda r: r.block_key.hex()[:6])
def test_body_encoding_round_trips(record: ReplicaRecord) -> None:
    body = pack_body(record)
    again = unpack_body(b"xx" + body, record.block_key, record.scope_id, record.compat_id, record.holder, 77, 2)
    assert again == replace(record, ttl_ms=77)
    assert again.to_json() == replace(record, ttl_ms=77).to_json()
    if record.layer_digests is not None and record.moqt_namespace is None:
        assert len(body) < 32 * len(record.layer_digests) + 64  # the digest is not stored twice


async def test_store_round_trips_every_shape(env: Env) -> None:
    for i, record in enumerate(SHAPES):
        await env.service.publish(who(H2), hid(record.holder), record.block_key,
                                  record if record.holder in (H1, RELAY) else replace(record, holder=H1))
        got = await env.store.get(hid(record.holder), record.block_key, env.clock())
        assert got is not None and replace(got, ttl_ms=record.ttl_ms) == record, i


async def test_memory_sweep() -> None:
    clock = Clock()
    store = MemoryIndexStore()
    service = IndexService(store, clock=clock, config=make_config())
    for i in range(10):
        await service.publish(who(H1), hid(H1), bk(i), replica(i, ttl_ms=1000 if i % 2 else 5000))
    await service.publish(who(H2), hid(H2), bk(0), replica(0, holder=H2, ttl_ms=1000))
    assert await store.count() == 11
    clock.now += 2
    assert await store.expire(clock(), limit=4) == 3  # keys 0-3 examined: H2's replica of 0, and 1 and 3
    assert await service.sweep() == 3  # the rest: 5, 7, 9
    assert await store.count() == 5 and len(store) == 5
    assert await store.expire(clock()) == 0
    clock.now += 10
    assert await service.sweep() == 5 and await store.count() == 0


async def test_memory_put_replaces_expired_neighbours() -> None:
    store = MemoryIndexStore()
    await store.put(replica(0, ttl_ms=1000), 0.0)
    await store.put(replica(0, holder=H2, ttl_ms=1000), 0.0)
    assert await store.count() == 2
    assert await store.put(replica(0, holder=H3, scope=S2), 5.0) is True  # the two expired ones go
    assert await store.count() == 1
    assert await store.delete(hid(H1), bk(0)) is False
    assert await store.delete(hid(H3), bk(0)) is True and await store.count() == 0
    assert await store.lookup(S1, C1, [bk(0)], 5.0) == []


def test_stores_satisfy_the_protocol() -> None:
    assert isinstance(MemoryIndexStore(), IndexStore)


def test_random_keys_do_not_collide_in_the_memory_store() -> None:
    store = MemoryIndexStore()
    keys = [os.urandom(32) for _ in range(100)]
    for key in keys:
        store.put_sync(replace(replica(0), block_key=BlockKey(key)), 0.0)
    assert len(store.chain(S1, C1, keys, 1.0)) == 100
    assert store.chain(S2, C1, keys, 1.0) == []


def test_geometry_from_descriptors(spec_descriptor: Any) -> None:
    config = IndexConfig.with_descriptors([spec_descriptor], max_lookup_keys=10)
    assert config.geometry[bytes(spec_descriptor.compat_id)] == Geometry(block_tokens=4, layers=32)
    assert config.max_lookup_keys == 10
    with pytest.raises(ValueError):
        IndexConfig(max_ttl_ms=0)
    with pytest.raises(ValueError):
        Geometry(block_tokens=0)


async def test_lookup_skips_replicas_at_failed_instances() -> None:
    from kvsp_quic.auth import ALL, Role
    from kvsp_quic.records import InstanceStatusRecord, LookupRequest

    now = [100.0]
    service = IndexService(MemoryIndexStore(), clock=lambda: now[0])
    inst = "https://127.0.0.1:7001/"
    boss = Principal("urn:kvsp:client:x", frozenset(Role), ALL, ALL)
    for i in range(2):
        for holder in (inst, H1):
            await service.publish(boss, hid(holder), bk(i), replica(i, holder))
    from kvsp_quic.records import encode_moqt_namespace, kvsp_track_namespace

    namespace = encode_moqt_namespace(kvsp_track_namespace(C1, S1, hid(inst), 1))
    await service.publish(boss, hid("moqt://127.0.0.1:7001/"), bk(1),
                          replica(1, "moqt://127.0.0.1:7001/", moqt_namespace=namespace))
    me = Principal(inst, frozenset({Role.INSTANCE}), ALL, frozenset())
    service.report_status(me, hid(inst), InstanceStatusRecord(inst, 1, InstanceState.ACTIVE, 1000))
    request = LookupRequest(S1, C1, (bk(0), bk(1)))  # type: ignore[arg-type]
    assert inst in {r.holder for m in (await service.lookup(boss, request)).blocks for r in m.replicas}
    now[0] += 2.0  # the status record (1 s) expired: the instance failed, its replicas are unreachable
    got = await service.lookup(boss, request)
    assert got.matched == 2 and {r.holder for m in got.blocks for r in m.replicas} == {H1}
