"""Resharding: the planner (kvsp_quic.roles.controller_reshard) and the PC's commit / abort coordination with a
fake link. Over real sockets: tests/test_controller_app.py."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp_quic.problems import NotFound, PlanConflict
from kvsp_quic.records import ReshardAbort, ReshardCommit, ReshardFetch, ReshardPlan, Shard, ShardMap
from kvsp_quic.roles.controller_reshard import merge, owners, plan_reshard, subtract
from tests.support.controller import Env

I1, I2, I3 = "https://ii1.example/kvsp/", "https://ii2.example/kvsp/", "https://ii3.example/kvsp/"


def smap(version: int, *shards: tuple[int, int, str], name: str = "c3f8e1") -> ShardMap:
    return ShardMap(name, version, tuple(Shard((a, b), i) for a, b, i in shards))


def test_split_moves_only_what_changes_hands() -> None:
    old = smap(4, (0, 32768, I1), (32768, 65536, I2))
    new = smap(5, (0, 16384, I1), (16384, 32768, I3), (32768, 65536, I2))
    plans = plan_reshard(old, new, 200)
    assert list(plans) == [I1, I2, I3]
    assert plans[I1] == ReshardPlan("c3f8e1", 4, 5, 200, ((0, 16384),), (), ((16384, 32768),))
    assert plans[I2] == ReshardPlan("c3f8e1", 4, 5, 200, ((32768, 65536),), (), ())
    assert plans[I3] == ReshardPlan("c3f8e1", 4, 5, 200, (), (ReshardFetch((16384, 32768), I1),), ())
    assert plans[I3].to_json()["fetch"] == [{"tokens": [16384, 32768], "from": I1}]


def test_merge_to_one_instance_and_growth() -> None:
    old = smap(1, (0, 100, I1), (100, 200, I2), (200, 300, I3), (300, 400, I2))
    new = smap(2, (0, 500, I2))  # the context grew to 500: [400, 500) is computed, not fetched
    plans = plan_reshard(old, new, 50)
    assert plans[I2].retain == ((100, 200), (300, 400))
    assert plans[I2].fetch == (ReshardFetch((0, 100), I1), ReshardFetch((200, 300), I3))
    assert plans[I1].release == ((0, 100),) and plans[I1].retain == () and plans[I1].fetch == ()
    assert plans[I3].release == ((200, 300),)


def test_plan_conflicts() -> None:
    old = smap(4, (0, 10, I1))
    with pytest.raises(PlanConflict):
        plan_reshard(old, smap(6, (0, 10, I2)), 10)
    with pytest.raises(PlanConflict):
        plan_reshard(old, smap(5, (0, 10, I2), name="other"), 10)


def test_range_helpers() -> None:
    m = smap(1, (10, 20, I1), (20, 30, I2))
    assert owners(m, (0, 40)) == [((0, 10), None), ((10, 20), I1), ((20, 30), I2), ((30, 40), None)]
    assert owners(m, (15, 25)) == [((15, 20), I1), ((20, 25), I2)]
    assert subtract([(0, 100)], [(10, 20), (50, 60)]) == [(0, 10), (20, 50), (60, 100)]
    assert subtract([(0, 10), (10, 20)], [(5, 15)]) == [(0, 5), (15, 20)]
    assert merge([(5, 9), (0, 5), (10, 12)]) == [(0, 9), (10, 12)]


@st.composite
def shard_maps(draw: st.DrawFn) -> tuple[ShardMap, ShardMap]:
    instances = [I1, I2, I3, "https://ii4.example/kvsp/"]

    def one(version: int) -> ShardMap:
        cuts = sorted(draw(st.sets(st.integers(1, 199), max_size=5)))
        end = draw(st.integers(200, 260))
        bounds = [0, *cuts, end]
        return ShardMap("m", version, tuple(Shard((a, b), draw(st.sampled_from(instances)))
                                            for a, b in itertools.pairwise(bounds)))
    return one(1), one(2)


def _covered(ranges: object) -> set[int]:
    return {t for a, b in ranges for t in range(a, b)}  # type: ignore[attr-defined]


@settings(max_examples=150, deadline=None)
@given(shard_maps())
def test_plans_retain_in_place_and_cover_the_new_map(maps: tuple[ShardMap, ShardMap]) -> None:
    old, new = maps
    plans = plan_reshard(old, new, 100)
    old_owner = {t: s.instance for s in old.shards for t in range(*s.tokens)}
    new_owner = {t: s.instance for s in new.shards for t in range(*s.tokens)}
    for instance, plan in plans.items():
        retained = _covered(plan.retain)
        fetched = _covered([f.tokens for f in plan.fetch])
        # a token held by the same instance in both versions is retained and never fetched
        same = {t for t, i in new_owner.items() if i == instance and old_owner.get(t) == instance}
        assert retained == same
        assert not fetched & _covered(old.instance_ranges(instance))
        for f in plan.fetch:
            assert all(old_owner[t] == f.source for t in range(*f.tokens))
        mine_new = {t for t, i in new_owner.items() if i == instance}
        assert fetched == {t for t in mine_new if t in old_owner and old_owner[t] != instance}
        assert _covered(plan.release) == {t for t, i in old_owner.items() if i == instance} - mine_new


async def test_commit_after_every_acknowledgement() -> None:
    env = Env()
    old = smap(4, (0, 100, I1), (100, 200, I2))
    new = smap(5, (0, 150, I1), (150, 200, I3))
    with pytest.raises(NotFound):
        await env.svc.reshard(new)
    await env.svc.put_map(old)
    with pytest.raises(PlanConflict):
        await env.svc.put_map(old)
    outcome = await env.svc.reshard(new, 500)
    assert outcome.committed and outcome.version == 5 and outcome.acknowledged == (I1, I2, I3)
    sent = env.link.of("reshard")
    assert [i for i, m in sent if isinstance(m, ReshardPlan)] == [I1, I2, I3]
    assert [(i, m) for i, m in sent if isinstance(m, ReshardCommit)] == [
        (i, ReshardCommit("c3f8e1", 5)) for i in (I1, I2, I3)]
    assert env.pc.shard_map("c3f8e1") == new
    with pytest.raises(PlanConflict):
        await env.svc.reshard(new)  # version 5 -> 5
    assert env.samples("kvsp_reshards_total")[(("outcome", "committed"),)] == 1


async def test_abort_after_deadline_keeps_version_v() -> None:
    env = Env()
    old = smap(4, (0, 100, I1), (100, 200, I2))
    new = smap(5, (0, 100, I2), (100, 200, I1))
    await env.svc.put_map(old)
    env.link.reshard_delay[I2] = 5.0  # never acknowledges in time
    outcome = await env.svc.reshard(new, 100)
    assert not outcome.committed and outcome.version == 4
    assert list(outcome.failed) == [I2] and outcome.acknowledged == (I1,)
    aborts = [(i, m) for i, m in env.link.of("reshard") if isinstance(m, ReshardAbort)]
    assert aborts == [(I1, ReshardAbort("c3f8e1", 5)), (I2, ReshardAbort("c3f8e1", 5))]
    assert not any(isinstance(m, ReshardCommit) for _, m in env.link.of("reshard"))
    assert env.pc.shard_map("c3f8e1") == old
    assert env.samples("kvsp_reshards_total")[(("outcome", "aborted"),)] == 1
