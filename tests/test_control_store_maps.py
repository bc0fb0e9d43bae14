"""Shard maps and their contexts in the Placement Controller's shared state (issue 12, point 1): the
:class:`~kvsp_quic.storage.redis_control.RedisControlStore` on a real redis-server and on a 3-node Redis Cluster,
and :class:`kvsp_runtime.controller_maps.ShardMaps` with two replicas on one Redis and with none (one process), on the
recording link of tests/support/controller.py.

The context (extension member ``"context"`` of ``PUT maps/{map}``, docs/wire.md "Resharding") is stored with the map:
registered atomically with it, kept by a commit, replaced by a reshard that gives one (whether it commits or aborts,
as in one process), untouched by a refused PUT (409). End to end with real processes:
tests/test_reshard_replicated.py.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.problems import PlanConflict
from kvsp_quic.records import ReshardPlan, Shard, ShardMap
from kvsp_quic.roles.controller_reshard import ContextPlan, ReshardContext, context_bytes, context_of
from kvsp_quic.storage.redis_control import RedisControlStore
from kvsp_runtime.controller_maps import ShardMaps
from tests.redis_server import RedisClusterServers, command, needs_redis
from tests.support.controller import Env

I1, I2, I3 = "https://ii1.example/kvsp/", "https://ii2.example/kvsp/", "https://ii3.example/kvsp/"
KEYS = tuple(BlockKey(bytes([i]) * 32) for i in range(1, 9))
CTX = ReshardContext(CompatId(b"\x11" * 32), ScopeId(b"\x22" * 16), KEYS[:4])
GROWN = ReshardContext(CTX.compat_id, CTX.scope_id, KEYS[:6])
OTHER = ReshardContext(CTX.compat_id, CTX.scope_id, KEYS[4:])


def smap(version: int, *shards: tuple[int, int, str], name: str = "m") -> ShardMap:
    return ShardMap(name, version, tuple(Shard((a, b), i) for a, b, i in shards))


def test_a_context_round_trips_as_stored() -> None:
    assert context_of(context_bytes(CTX)) == CTX
    assert context_of(context_bytes(GROWN)) != CTX


# -- the store ---------------------------------------------------------------------------------------------------


async def _maps_with_contexts(one: RedisControlStore, two: RedisControlStore) -> None:
    """What *one* writes, *two* (another replica's connection) reads."""
    v0 = smap(0, (0, 16, I1))
    assert await one.add_map(v0, context_bytes(CTX)) is None
    assert await two.get_map("m") == v0
    assert context_of(await two.map_context("m") or b"") == CTX
    # a second registration (a race between replicas) writes nothing: neither the map nor the context
    assert await two.add_map(smap(0, (0, 16, I2)), context_bytes(OTHER)) == v0
    assert await one.get_map("m") == v0 and context_of(await one.map_context("m") or b"") == CTX
    # a commit keeps the context; a stale commit changes nothing
    v1 = smap(1, (0, 8, I1), (8, 16, I2))
    assert await two.commit_map(0, v1)
    assert not await one.commit_map(0, smap(1, (0, 16, I3)))
    assert await one.get_map("m") == v1 and context_of(await one.map_context("m") or b"") == CTX
    # replaced (a reshard that gives one), only for a map that exists
    assert await one.set_map_context("m", context_bytes(GROWN))
    assert context_of(await two.map_context("m") or b"") == GROWN
    assert not await one.set_map_context("none", context_bytes(CTX))
    assert await two.map_context("none") is None and await two.get_map("none") is None
    # a map registered without a context has none
    assert await two.add_map(smap(3, (0, 4, I3), name="bare")) is None
    bare = await one.get_map("bare")
    assert await one.map_context("bare") is None and bare is not None and bare.version == 3


@needs_redis
async def test_redis_keeps_a_map_with_its_context(redis_url: str) -> None:
    one, two = RedisControlStore.from_url(redis_url), RedisControlStore.from_url(redis_url)
    try:
        await _maps_with_contexts(one, two)
    finally:
        await one.aclose()
        await two.aclose()


@needs_redis
async def test_redis_cluster_keeps_a_map_with_its_context(tmp_path: Path) -> None:
    """The scripts that write a map and its context touch two keys: on a cluster they must share a slot."""
    with RedisClusterServers.start(tmp_path / "cluster", nodes=3) as cluster:
        prefix = f"t{uuid.uuid4().hex[:6]}:"
        one, two = (RedisControlStore.from_url(f"redis://127.0.0.1:{port}", cluster=True, prefix=prefix)
                    for port in cluster.ports[:2])
        try:
            assert one.cluster and two.key("maps") == one.key("maps")
            await _maps_with_contexts(one, two)
            for node in cluster.ports:  # scripts gone from every node: loaded again
                command(node, "SCRIPT", "FLUSH")
            assert await one.set_map_context("m", context_bytes(CTX))
            assert context_of(await two.map_context("m") or b"") == CTX
        finally:
            await one.aclose()
            await two.aclose()


# -- ShardMaps: two replicas on one Redis, or one process ---------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[ShardMaps, ShardMaps]]:
    """(replica A, replica B): two PC replicas on one redis-server, or the same ShardMaps twice (one process)."""
    if request.param == "memory":
        svc = Env().svc
        yield svc.maps, svc.maps
        return
    redis_url = request.getfixturevalue("redis_url")
    stores = [RedisControlStore.from_url(redis_url) for _ in range(2)]
    try:
        yield tuple(ShardMaps(env.pc, env.link, store, name)  # type: ignore[misc]
                    for env, store, name in zip((Env(), Env()), stores, "ab", strict=True))
    finally:
        for store in stores:
            await store.aclose()


def plans_sent(maps: ShardMaps, to_version: int) -> dict[str, ReshardPlan]:
    link = maps.link
    return {i: m for i, m in link.of("reshard")  # type: ignore[attr-defined]
            if isinstance(m, ReshardPlan) and m.to_version == to_version}


def contexts(plans: dict[str, ReshardPlan]) -> set[ReshardContext | None]:
    return {p.context if isinstance(p, ContextPlan) else None for p in plans.values()}


async def test_plans_at_any_replica_carry_the_context_given_to_another(replicas: tuple[ShardMaps, ShardMaps]) -> None:
    a, b = replicas
    assert (await a.put_map(smap(0, (0, 16, I1)), CTX)).version == 0
    outcome = await b.reshard(smap(1, (0, 8, I1), (8, 16, I2)), 500)  # asked of B, given to A
    assert outcome.committed and outcome.version == 1
    plans = plans_sent(b, 1)
    assert list(plans) == [I1, I2] and contexts(plans) == {CTX}
    assert plans[I2].to_json()["context"]["block_keys"] == [k.hex() for k in KEYS[:4]]

    # a reshard that gives a context replaces the map's, even when it aborts (as the instances keep it too)
    a.link.reshard_delay[I3] = 5.0  # type: ignore[attr-defined]
    aborted = await a.reshard(smap(2, (0, 8, I1), (8, 16, I3)), 100, GROWN)
    assert not aborted.committed and aborted.version == 1 and contexts(plans_sent(a, 2)) == {GROWN}
    assert aborted.failed == {I3: "no acknowledgement within 100 ms"}
    a.link.reshard_delay.clear()  # type: ignore[attr-defined]
    outcome = await b.reshard(smap(2, (0, 8, I2), (8, 24, I1)), 500)
    assert outcome.committed and contexts(plans_sent(b, 2)) == {GROWN}
    assert (await a.get_map("m")).version == 2


async def test_a_refused_put_leaves_the_context(replicas: tuple[ShardMaps, ShardMaps]) -> None:
    a, b = replicas
    await a.put_map(smap(0, (0, 16, I1)), CTX)
    with pytest.raises(PlanConflict):  # registered already (a race between replicas: both saw no map)
        await b.put_map(smap(0, (0, 16, I2)), OTHER)
    with pytest.raises(PlanConflict):  # 0 -> 2: refused before any plan
        await b.reshard(smap(2, (0, 16, I2)), 500, OTHER)
    assert (await b.reshard(smap(1, (0, 8, I1), (8, 16, I2)), 500)).committed
    assert contexts(plans_sent(b, 1)) == {CTX}


async def test_a_map_registered_without_a_context_sends_none(replicas: tuple[ShardMaps, ShardMaps]) -> None:
    a, b = replicas
    await a.put_map(smap(0, (0, 16, I1), name="bare"))
    assert (await b.reshard(smap(1, (0, 8, I1), (8, 16, I2), name="bare"), 500)).committed
    assert contexts(plans_sent(b, 1)) == {None}
    assert all(type(p) is ReshardPlan for p in plans_sent(b, 1).values())
