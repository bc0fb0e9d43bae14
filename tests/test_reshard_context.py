"""The map's context in reshard plans (docs/wire.md, "Resharding", extension ``"context"``): the PC's plans carry
it on the wire as the instance reads it, and an instance accepts the same context again or a grown one, never
another. End to end with real processes: tests/test_reshard_processes.py."""

from __future__ import annotations

import pytest

from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.problems import PlanConflict
from kvsp_quic.records import ReshardCommit, ReshardPlan, Shard, ShardMap, parse_reshard
from kvsp_quic.roles.controller_reshard import ContextPlan, ReshardContext, plan_reshard, with_context
from kvsp_quic.roles.instance_reshard import ReshardBook

I1, I2 = "https://ii1.example/kvsp/", "https://ii2.example/kvsp/"
KEYS = tuple(BlockKey(bytes([i]) * 32) for i in range(1, 7))
CTX = ReshardContext(CompatId(b"\x11" * 32), ScopeId(b"\x22" * 16), KEYS[:4])


def smap(version: int, *shards: tuple[int, int, str]) -> ShardMap:
    return ShardMap("m", version, tuple(Shard((a, b), i) for a, b, i in shards))


def test_plans_carry_the_context_as_the_instance_reads_it() -> None:
    plans = plan_reshard(smap(0, (0, 16, I1)), smap(1, (0, 8, I1), (8, 16, I2)), 500)
    assert with_context(plans, None) == plans
    sent = with_context(plans, CTX)
    assert list(sent) == [I1, I2] and all(isinstance(p, ContextPlan) for p in sent.values())
    for instance, plan in sent.items():
        body = plan.to_json()
        assert body["context"] == {"compat_id": "11" * 32, "scope_id": "22" * 16,
                                   "block_keys": [k.hex() for k in CTX.block_keys]}
        read = parse_reshard(body)  # what the instance's app parses, and its context member
        assert isinstance(read, ReshardPlan) and read == plans[instance]
        assert ReshardContext.from_json(body["context"], "context") == CTX
    assert sent[I2].to_json()["fetch"] == [{"tokens": [8, 16], "from": I1}]


def test_an_instance_accepts_the_same_or_a_grown_context_never_another() -> None:
    book = ReshardBook(block_tokens=4)
    steps = book.plan(ReshardPlan("m", 0, 1, 500, retain=((0, 16),)), CTX)
    book.retained(steps.state, steps.retain)
    book.acknowledge(steps.state)
    book.commit(ReshardCommit("m", 1))
    grown = ReshardContext(CTX.compat_id, CTX.scope_id, KEYS)
    steps = book.plan(ReshardPlan("m", 1, 2, 500, retain=((0, 24),)), grown)  # the context grew: 6 blocks
    assert steps.retain == tuple(range(6)) and steps.state.context == grown
    book.acknowledge(steps.state)
    book.commit(ReshardCommit("m", 2))
    steps = book.plan(ReshardPlan("m", 2, 3, 500, retain=((0, 24),)), CTX)  # an older, shorter one: kept longer
    assert steps.state.context == grown
    book.acknowledge(steps.state)
    book.commit(ReshardCommit("m", 3))
    other = ReshardContext(CTX.compat_id, CTX.scope_id, (KEYS[5], *KEYS[1:4]))
    with pytest.raises(PlanConflict):
        book.plan(ReshardPlan("m", 3, 4, 500, retain=((0, 16),)), other)
