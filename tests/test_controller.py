"""The Placement Controller: its role (kvsp_quic.roles.controller, the rules) driven by its asyncio adapter
(kvsp_runtime.controller_service.ControllerService, on its default MemoryControlStore) with an injected clock, the
Index Service in the same process, and a fake InstanceLink that records what would be sent to instances
(tests/support/controller.py). Also the placement policy registry (kvsp_quic.roles.placement).

Covers: the cost ranking, assignment to the cheapest active instance only, prefetch directives, status epochs and
expiry, the lifecycle policy (sleep accepted / refused, draining -> sleeping, woken only by the PC), checkpoints
(highest offset, stale epoch, wrong instance, contradictions), failover with epoch + 1 and the latest checkpoint,
failed starts, restarts, waking and the start hook, and metrics."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any

import pytest

from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import (
    BadRequest,
    Forbidden,
    InvalidState,
    NotFound,
    Problem,
    ScopeDenied,
    StaleEpoch,
    Unavailable,
)
from kvsp_quic.records import (
    InstanceStatusRecord,
    LookupMatch,
    LookupResponse,
    TargetEstimate,
)
from kvsp_quic.roles.controller import ControllerConfig
from kvsp_quic.roles.controller_records import SessionState
from kvsp_quic.roles.controller_sessions import Admitted, PlacementQuery, PrefetchOutcome, StartOutcome
from kvsp_quic.roles.placement import (
    PLACEMENT_POLICIES,
    Choice,
    CostPolicy,
    PlacementInput,
    placement_policy,
    rank,
    register_placement_policy,
)
from kvsp_quic.roles.status import InstanceStatus, SleepMode, SleepPolicy
from tests.support.controller import (
    BLOCK,
    FRONT,
    H1,
    IA,
    IB,
    IC,
    OTHER,
    Env,
    checkpoint,
    request,
    who,
)
from tests.support.index import S2, bk, replica


class FakeStarter:
    def __init__(self, env: Env | None = None, instance: str | None = None) -> None:
        self.env, self.instance, self.reasons = env, instance, list[str]()

    async def start(self, reason: str) -> None:
        self.reasons.append(reason)
        if self.env is not None and self.instance is not None:
            env, instance = self.env, self.instance
            asyncio.get_running_loop().call_later(0.01, lambda: asyncio.ensure_future(env.report(instance)))


# -- ranking ------------------------------------------------------------------------------------------------------


def _entry(instance: str, **changes: Any) -> InstanceStatus:
    fields: dict[str, Any] = dict(prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0, batch_size=8)
    fields.update(changes)
    record = InstanceStatusRecord(instance, 1, InstanceState.ACTIVE, 3000, **fields)
    return InstanceStatus(record, InstanceState.ACTIVE, 0.0, 10.0)


def test_rank_by_spec_cost() -> None:
    found = LookupResponse(2, tuple(LookupMatch(bk(i), (replica(i),)) for i in range(2)),
                           (TargetEstimate(IA, 500, 32_000), TargetEstimate(IB, 40_000, 32_000)))
    choices = rank([_entry(IA), _entry(IB), _entry(IC, prefill_tokens_per_s=None)], found, tokens=40,
                   max_tokens=10, block_tokens=BLOCK)
    assert [c.instance for c in choices] == [IA, IB, IC]
    a, b, c = choices
    # IA: min(500 + recompute(8 tokens) = 8500, recompute(40) = 40000), no queue
    assert a.cost_us == pytest.approx(8500) and a.use_cache
    # IB: fetching costs more than recomputing everything: cost = recompute_all, no prefetch
    assert b.cost_us == pytest.approx(40_000) and not b.use_cache
    assert c.cost_us is None
    # a queue adds queued * (prefill + decode of this request): 2 * (40000 + 100000) us
    queued = rank([_entry(IA, queued=2), _entry(IB)], found, 40, 10, BLOCK)
    assert [c.instance for c in queued] == [IB, IA]
    assert queued[1].cost_us == pytest.approx(8500 + 2 * 140_000)
    # sessions assigned since the last report count as queued
    pending = rank([_entry(IA), _entry(IB)], found, 40, 10, BLOCK, pending={IA: 1})
    assert [c.instance for c in pending] == [IB, IA]
    assert not rank([_entry(IA, running=8)], found, 40, 10, BLOCK)[0].has_capacity
    # unknown geometry: no estimate is usable, cost = recompute of everything
    blind = rank([_entry(IA)], found, 40, 10, None)[0]
    assert blind.cost_us == pytest.approx(40_000) and blind.use_cache


# -- placement ----------------------------------------------------------------------------------------------------


async def test_assigns_to_cheapest_active_with_prefetch() -> None:
    env = Env()
    await env.publish(4)
    await env.publish(4, holder=IB)  # IB holds the prompt's blocks itself: nothing to fetch
    await env.report(IA)
    await env.report(IB)
    info, created = await env.svc.create_session(who(FRONT), request())
    assert created and info.instance == IB and info.epoch == 1 and info.state is SessionState.RUNNING
    assert env.link.of("prefetch") == []  # resident at IB
    (instance, start), = env.link.of("start")
    assert instance == IB and start.epoch == 1 and len(start.blocks) == 4
    assert {*start.blocks[0].sources} == {H1, IB}

    # IB busy: IA is cheaper now, and gets a directive for the blocks (sources: H1, IB) before the start
    await env.report(IB, queued=5)
    env.link.calls.clear()
    info, _ = await env.svc.create_session(who(FRONT), request(session=2))
    assert info.instance == IA
    assert [c[0] for c in env.link.calls] == ["prefetch", "start"]
    directive = env.link.of("prefetch")[0][1]
    assert directive.request_ref == str(request(session=2).session)
    assert [b.block_key for b in directive.blocks] == [bk(i) for i in range(4)]
    assert directive.deadline_ms == 1000 and directive.lease_ms == 5000
    tokens = env.samples("kvsp_placement_tokens_total")
    assert tokens[(("source", "cache"),)] == 128 and tokens[(("source", "recompute"),)] == 6
    assert env.samples("kvsp_lookup_matched_keys_total")[(("component", "controller"),)] == 8


async def test_never_assigns_to_inactive_instances() -> None:
    env = Env(sleep=SleepPolicy(SleepMode.ALWAYS))
    await env.publish(4, holder=IA)  # IA would be the cheapest
    await env.report(IA)
    await env.report(IB)
    await env.report(IC, state=InstanceState.DRAINING)
    assert (await env.report(IA, requested=InstanceState.SLEEPING)).state is InstanceState.DRAINING
    info, _ = await env.svc.create_session(who(FRONT), request())
    assert info.instance == IB
    await env.report(IB, state=InstanceState.FAILED)
    env.advance(4)  # IA's and IC's records expire: failed
    assert env.pc.status.state(IA) is InstanceState.FAILED
    with pytest.raises(Unavailable):
        await env.svc.create_session(who(FRONT), request(session=2))
    assert {i for _, i, _ in env.link.calls} == {IB}  # nothing was ever sent to IA or IC
    assert request(session=2).session not in env.pc.sessions


async def test_session_request_rules() -> None:
    env = Env()
    await env.report(IA)
    req = request()
    with pytest.raises(ScopeDenied):
        await env.svc.create_session(who(FRONT), replace(req, scope_id=S2))
    info, created = await env.svc.create_session(who(FRONT), req)
    again, created_again = await env.svc.create_session(who(FRONT), req)  # a retry: same answer, no new start
    assert created and not created_again and again == info and len(env.link.of("start")) == 1
    with pytest.raises(Problem) as conflict:
        await env.svc.create_session(who(OTHER), req)
    assert conflict.value.status == 409
    assert await env.svc.session_info(who(FRONT), req.session) == info
    with pytest.raises(NotFound):
        await env.svc.session_info(who(OTHER), req.session)  # only its creator reads it


async def test_refused_and_failed_starts() -> None:
    env = Env()
    await env.report(IA, queued=0)
    await env.report(IB, queued=1)
    await env.report(IC, queued=2)
    env.link.fail[IA] = InvalidState("not active")  # a definite refusal: the same epoch goes on
    env.link.fail[IB] = ConnectionError("reset")  # maybe started: the epoch is fenced
    info, _ = await env.svc.create_session(who(FRONT), request(keys=0))
    assert info.instance == IC and info.epoch == 2
    assert [(i, s.epoch) for i, s in env.link.of("start")] == [(IA, 1), (IB, 1), (IC, 2)]
    outcomes = env.samples("kvsp_session_starts_total")
    assert outcomes[(("kind", "start"), ("outcome", "refused"))] == 1
    assert outcomes[(("kind", "start"), ("outcome", "failed"))] == 1


async def test_prefetch_refused_moves_on() -> None:
    env = Env()
    await env.publish(4)
    await env.report(IA)
    await env.report(IB, queued=1)
    env.link.prefetch_fail[IA] = InvalidState("draining")
    info, _ = await env.svc.create_session(who(FRONT), request())
    assert info.instance == IB
    assert [(c[0], c[1]) for c in env.link.calls] == [("prefetch", IA), ("prefetch", IB), ("start", IB)]


# -- status and lifecycle -----------------------------------------------------------------------------------------


async def test_status_epochs_and_expiry() -> None:
    env = Env()
    await env.report(IA, epoch=5)
    with pytest.raises(StaleEpoch):
        await env.report(IA, epoch=4)
    assert (await env.report(IA, epoch=5)).state is InstanceState.ACTIVE  # the same run
    env.advance(3.5)
    assert env.pc.status.state(IA) is InstanceState.FAILED
    assert env.pc.active() == []
    assert (await env.report(IA, epoch=6)).state is InstanceState.ACTIVE  # restarted
    status = env.samples("kvsp_status_reports_total")
    assert status[(("outcome", "stale"),)] == 1 and status[(("outcome", "accepted"),)] == 3
    assert [i["state"] for i in env.pc.instances()] == ["active"]


async def test_sleep_policy_by_load() -> None:
    env = Env(sleep=SleepPolicy(min_active=1, min_spare=1))
    await env.report(IA, running=1)
    await env.report(IB, running=6, batch_size=8)
    # IB has 2 spare slots: enough for IA's 1 session + 1
    assert (await env.report(IA, running=1, requested=InstanceState.SLEEPING)).state is InstanceState.DRAINING
    # IA is draining: IB has no other active instance to take its load
    assert (await env.report(IB, running=0, requested=InstanceState.SLEEPING)).state is InstanceState.ACTIVE
    # IA keeps reporting active (it has not seen the answer yet): still draining; then it finishes
    assert (await env.report(IA, running=1)).state is InstanceState.DRAINING
    assert (await env.report(IA, state=InstanceState.DRAINING, running=0)).state is InstanceState.DRAINING
    assert (await env.report(IA, state=InstanceState.SLEEPING)).state is InstanceState.SLEEPING
    # a sleeping instance becomes active only on a state change from the PC
    assert (await env.report(IA)).state is InstanceState.SLEEPING
    sleeps = env.samples("kvsp_sleep_requests_total")
    assert sleeps[(("answer", "draining"),)] == 1 and sleeps[(("answer", "active"),)] == 1
    # a restart starts afresh
    assert (await env.report(IA, epoch=2)).state is InstanceState.ACTIVE


async def test_sleep_policy_variants() -> None:
    busy = Env(sleep=SleepPolicy(max_kv_utilization=0.5))
    await busy.report(IA)
    await busy.report(IB, kv_utilization=0.8)  # spare slots, but its memory is full
    assert (await busy.report(IA, requested=InstanceState.SLEEPING)).state is InstanceState.ACTIVE
    never = Env(sleep=SleepPolicy(SleepMode.NEVER))
    await never.report(IB)
    assert (await never.report(IA, requested=InstanceState.SLEEPING)).state is InstanceState.ACTIVE
    always = Env(sleep=SleepPolicy(SleepMode.ALWAYS, min_active=2))
    await always.report(IB, running=8)
    assert (await always.report(IA, requested=InstanceState.SLEEPING)).state is InstanceState.ACTIVE  # one other only
    await always.report(IC, running=8)
    assert (await always.report(IA, requested=InstanceState.SLEEPING)).state is InstanceState.DRAINING


async def test_put_state_wakes_and_holds() -> None:
    env = Env(sleep=SleepPolicy(SleepMode.ALWAYS))
    await env.report(IA)
    await env.report(IB)
    await env.report(IA, requested=InstanceState.SLEEPING)
    await env.report(IA, state=InstanceState.SLEEPING)
    assert await env.svc.set_instance_state(IA, InstanceState.ACTIVE) is InstanceState.ACTIVE
    assert env.link.of("state") == [(IA, InstanceState.ACTIVE)]
    assert env.pc.status.state(IA) is InstanceState.ACTIVE
    assert (await env.report(IA)).state is InstanceState.ACTIVE
    assert await env.svc.set_instance_state(IB, InstanceState.DRAINING) is InstanceState.DRAINING
    assert (await env.report(IB)).state is InstanceState.DRAINING  # the PC's decision holds over its report
    with pytest.raises(NotFound):
        await env.svc.set_instance_state(IC, InstanceState.ACTIVE)
    with pytest.raises(BadRequest):
        await env.svc.set_instance_state(IA, InstanceState.FAILED)


async def test_wakes_a_sleeping_instance_when_nothing_is_active() -> None:
    env = Env(sleep=SleepPolicy(SleepMode.ALWAYS, min_active=0))
    await env.report(IA, requested=InstanceState.SLEEPING)
    await env.report(IA, state=InstanceState.SLEEPING)
    info, _ = await env.svc.create_session(who(FRONT), request(keys=0))
    assert info.instance == IA
    assert [c[0] for c in env.link.calls] == ["state", "start"]
    assert env.samples("kvsp_instance_starts_total")[(("kind", "wake"),)] == 1


async def test_start_hook_then_prefetch_and_start() -> None:
    env = Env(config=ControllerConfig(start_timeout_ms=2000))
    starter = FakeStarter(env, IC)
    env.svc.starter = starter
    await env.publish(4)
    info, _ = await env.svc.create_session(who(FRONT), request())
    assert starter.reasons and info.instance == IC
    assert [(c[0], c[1]) for c in env.link.calls] == [("prefetch", IC), ("start", IC)]
    # capacity: every active instance is full and the cost limit is exceeded -> another start, which times out
    # after start_timeout_ms, and the session goes to the best existing instance
    env2 = Env(config=ControllerConfig(start_timeout_ms=50, max_cost_us=1.0))
    env2.svc.starter = FakeStarter()
    await env2.report(IA, running=8)
    info, _ = await env2.svc.create_session(who(FRONT), request(keys=0))
    assert info.instance == IA
    assert env2.samples("kvsp_instance_starts_total")[(("kind", "hook"),)] == 1


# -- checkpoints ----------------------------------------------------------------------------------------------------


async def test_checkpoint_rules() -> None:
    env = Env()
    await env.report(IA)
    await env.report(IB, queued=3)
    req = request()
    await env.svc.create_session(who(FRONT), req)
    ack = await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 1, [5, 6, 7]))
    assert (ack.epoch, ack.output_offset) == (1, 3)
    # a lower offset is acknowledged with the highest one recorded
    assert (await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 1, [5, 6]))).output_offset == 3
    assert (await env.svc.session_info(who(FRONT), req.session)).output_offset == 3
    with pytest.raises(Forbidden):
        await env.svc.checkpoint(who(IB), req.session, checkpoint(req, 1, [5, 6, 7, 8]))
    with pytest.raises(StaleEpoch):
        await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 0, [5, 6, 7, 8]))
    with pytest.raises(BadRequest):
        await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 2, [5, 6, 7, 8]))  # never assigned
    with pytest.raises(Problem) as contradiction:
        await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 1, [5, 9, 7, 8]))
    assert contradiction.value.status == 409
    with pytest.raises(NotFound):
        await env.svc.checkpoint(who(IA), uuid.UUID(int=7), checkpoint(req, 1, [5]))
    with pytest.raises(BadRequest):  # the body names another session than the path
        await env.svc.checkpoint(who(IA), req.session, replace(checkpoint(req, 1, [5]), session=uuid.UUID(int=8)))
    done = await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 1, [5, 6, 7, 8]), done=True)
    assert done.output_offset == 4
    assert (await env.svc.session_info(who(FRONT), req.session)).state is SessionState.DONE
    assert (await env.svc.session_info(who(FRONT), req.session)).to_json()["done"] is True
    checkpoints = env.samples("kvsp_checkpoints_total")
    assert checkpoints[(("outcome", "stale"),)] == 1 and checkpoints[(("outcome", "forbidden"),)] == 1


# -- failover -------------------------------------------------------------------------------------------------------


async def test_failure_resumes_elsewhere_with_next_epoch() -> None:
    env = Env()
    await env.publish(4)
    await env.report(IA)
    await env.report(IB, queued=2)
    req = request()
    await env.svc.create_session(who(FRONT), req)
    await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 1, [5, 6, 7]))
    await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 1, [5, 6, 7, 8, 9]))
    env.advance(2)
    await env.report(IB, queued=2)  # IB stays alive, IA falls silent
    assert (await env.svc.tick()) == []  # not yet expired
    env.link.calls.clear()
    env.advance(1.5)
    tasks = await env.svc.tick()
    assert len(tasks) == 1 and await tasks[0]
    (instance, resume), = env.link.of("resume")
    assert instance == IB and resume.epoch == 2
    assert resume.checkpoint.output_offset == 5 and resume.checkpoint.generated == (5, 6, 7, 8, 9)
    assert resume.max_tokens == req.max_tokens and resume.prompt == req.prompt
    assert env.link.of("prefetch")[0][0] == IB  # the checkpoint's blocks, before the resume
    info = await env.svc.session_info(who(FRONT), req.session)
    assert (info.instance, info.epoch, info.output_offset, info.state) == (IB, 2, 5, SessionState.RUNNING)
    # the old instance is fenced everywhere: its checkpoints carry the old epoch
    with pytest.raises(StaleEpoch):
        await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 1, [5, 6, 7, 8, 9, 10]))
    ack = await env.svc.checkpoint(who(IB), req.session, checkpoint(req, 2, [5, 6, 7, 8, 9, 10]))
    assert (ack.epoch, ack.output_offset) == (2, 6)
    assert env.samples("kvsp_migrations_total")[(("component", "controller"),)] == 1
    assert (await env.svc.tick()) == []


async def test_failure_before_any_checkpoint_restarts_at_next_epoch() -> None:
    env = Env()
    await env.report(IA)
    await env.report(IB, queued=1)
    req = request(keys=0)
    await env.svc.create_session(who(FRONT), req)
    await env.report(IA, state=InstanceState.FAILED)  # reported, not waited for
    env.link.calls.clear()
    await asyncio.gather(*(await env.svc.tick()))
    (instance, start), = env.link.of("start")
    assert instance == IB and start.epoch == 2 and start.session == req.session


async def test_restart_with_higher_epoch_fails_its_sessions_over() -> None:
    env = Env()
    await env.report(IA, epoch=10)
    req = request(keys=0)
    await env.svc.create_session(who(FRONT), req)
    await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 1, [1, 2]))
    await env.report(IA, epoch=11)  # restarted: the session's state there is gone, but the new run may take it
    assert env.svc.kick.is_set()
    env.link.calls.clear()
    await asyncio.gather(*(await env.svc.tick()))
    (instance, resume), = env.link.of("resume")
    assert instance == IA and resume.epoch == 2
    assert env.pc.sessions[req.session].instance_epoch == 11


async def test_migration_waits_for_an_instance() -> None:
    env = Env()
    await env.report(IA)
    req = request(keys=0)
    await env.svc.create_session(who(FRONT), req)
    env.advance(4)
    assert not await (await env.svc.tick())[0]
    waiting = await env.svc.session_info(who(FRONT), req.session)
    # the front end waits for the epoch to grow: it is shown only with the instance that serves it
    assert (waiting.state, waiting.instance, waiting.epoch) == (SessionState.MIGRATING, None, 1)
    assert "instance" not in waiting.to_json()
    with pytest.raises(Forbidden):  # nobody serves epoch 2 yet
        await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 2, [1]))
    await env.report(IB)
    assert await (await env.svc.tick())[0]
    info = await env.svc.session_info(who(FRONT), req.session)
    assert (info.instance, info.epoch) == (IB, 2)  # one failure, one increment


async def test_sessions_are_forgotten() -> None:
    env = Env(config=ControllerConfig(session_ttl_ms=10_000, done_ttl_ms=1000))
    await env.report(IA, ttl_ms=60_000)
    a, b = request(session=1, keys=0), request(session=2, keys=0)
    await env.svc.create_session(who(FRONT), a)
    await env.svc.create_session(who(FRONT), b)
    await env.svc.checkpoint(who(IA), b.session, checkpoint(b, 1, [1]), done=True)
    env.advance(2)
    (await env.svc.tick())
    assert a.session in env.pc.sessions and b.session not in env.pc.sessions
    env.advance(9)
    (await env.svc.tick())
    assert a.session not in env.pc.sessions


# -- the role's decisions and the placement policy ------------------------------------------------------------------


def test_outcomes_are_types() -> None:
    env = Env()
    assert env.pc.prefetch_outcome(IA, None) is PrefetchOutcome.ACCEPTED
    assert env.pc.prefetch_outcome(IA, InvalidState("draining")) is PrefetchOutcome.REFUSED
    assert env.pc.prefetch_outcome(IA, Problem("busy", status=500)) is PrefetchOutcome.FAILED
    assert env.pc.prefetch_outcome(IA, ConnectionError("reset")) is PrefetchOutcome.UNREACHABLE
    assert [o.next_instance for o in PrefetchOutcome] == [False, True, False, True]
    prefetches = env.samples("kvsp_prefetch_directives_total")
    assert all(prefetches[(("outcome", o.value),)] == 1 for o in PrefetchOutcome)
    assert {o.value for o in StartOutcome} == {"ok", "refused", "failed"}


class LeastLoaded:
    """A policy for the registry test: the least loaded instance first, whatever the cost."""

    def rank(self, placement: PlacementInput) -> list[Choice]:
        choices = CostPolicy().rank(placement)
        return sorted(choices, key=lambda c: (c.load, c.instance))


async def test_placement_policy_by_name() -> None:
    assert isinstance(placement_policy("cost"), CostPolicy)
    with pytest.raises(ValueError, match="unknown placement policy 'nearest'"):
        placement_policy("nearest")
    with pytest.raises(ValueError, match="unknown placement policy"):
        ControllerConfig(placement_policy="nearest")
    with pytest.raises(ValueError):
        register_placement_policy("Least Loaded", LeastLoaded)
    register_placement_policy("least-loaded", LeastLoaded)
    try:
        env = Env(config=ControllerConfig(placement_policy="least-loaded"))
        await env.publish(4, holder=IA)  # IA is by far the cheapest by cost, but the busier one
        await env.report(IA, running=2)
        await env.report(IB, running=1)
        admitted = env.pc.admit(who(FRONT), request())
        assert isinstance(admitted, Admitted)
        query = env.pc.placement_query(admitted.session, ())
        assert isinstance(query, PlacementQuery) and query.lookup is not None
        assert {e.instance for e in query.candidates} == {IA, IB}
        info, _ = await env.svc.create_session(who(FRONT), request(session=2))
        assert info.instance == IB
        cost = Env()
        await cost.publish(4, holder=IA)
        await cost.report(IA, running=2)
        await cost.report(IB, running=1)
        assert (await cost.svc.create_session(who(FRONT), request(session=2)))[0].instance == IA
    finally:
        del PLACEMENT_POLICIES["least-loaded"]
