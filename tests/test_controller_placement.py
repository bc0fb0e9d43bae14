"""The placement sequence as the role's steps (kvsp_quic.roles.controller_placement, issue 25 point 4): the
PlacementPlan of a real PlacementController driven by hand, without any I/O -- which steps come in which order,
given what each lookup, wake-up, hook run, prefetch and start answered."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from kvsp_quic import keys as k
from kvsp_quic.auth import ALL, Principal, Role
from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import BadRequest, InvalidState
from kvsp_quic.records import InstanceStatusRecord, LookupMatch, LookupResponse, Sampler
from kvsp_quic.roles.controller import ControllerConfig, PlacementController
from kvsp_quic.roles.controller_placement import (
    AwaitInstanceStep,
    LookupStep,
    PlacementPlan,
    PlacementStep,
    PrefetchStep,
    StartHookStep,
    StartStep,
    WakeStep,
)
from kvsp_quic.roles.controller_records import SessionRequest
from kvsp_quic.roles.controller_sessions import Admitted, PlacedSession
from kvsp_quic.roles.index import Geometry, IndexConfig, IndexService
from kvsp_quic.roles.status import LifecyclePolicy, SleepMode, SleepPolicy, StatusTable
from kvsp_quic.storage.memory_index import MemoryIndexStore
from tests.helpers import Clock
from tests.support.index import C1 as COMPAT
from tests.support.index import H1, bk, replica
from tests.support.index import S1 as SCOPE

IA, IB = "https://ia.example/kvsp/", "https://ib.example/kvsp/"
BLOCK = 16


class World:
    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.clock = Clock()
        status = StatusTable(self.clock, policy=LifecyclePolicy(SleepPolicy(SleepMode.ALWAYS, min_active=0)),
                             max_ttl_ms=60_000)
        index = IndexService(MemoryIndexStore(), clock=self.clock, status=status,
                             config=IndexConfig(geometry={COMPAT: Geometry(BLOCK, 4)}))
        self.role = PlacementController(index, clock=self.clock, config=config)

    def report(self, instance: str, state: InstanceState = InstanceState.ACTIVE, **changes: Any) -> None:
        record = InstanceStatusRecord(instance, 1, state, 3000, batch_size=8, prefill_tokens_per_s=1000.0,
                                      **changes)
        self.role.report_status(Principal(instance, frozenset({Role.INSTANCE}), ALL), k.uri_id(instance), record)

    def session(self, blocks: int = 2) -> PlacedSession:
        keys = tuple(bk(i) for i in range(blocks))
        request = SessionRequest(uuid.UUID(int=1), SCOPE, COMPAT, tuple(range(blocks * BLOCK + 3)), 8,
                                 Sampler("greedy", 0, 0, True), keys)
        admitted = self.role.admit(Principal("urn:kvsp:client:front", frozenset({Role.CLIENT}), ALL), request)
        assert isinstance(admitted, Admitted)
        return admitted.session


def found_at(session: PlacedSession, holder: str = H1) -> LookupResponse:
    n = len(session.request.block_keys)
    return LookupResponse(n, tuple(LookupMatch(bk(i), (replica(i, holder=holder),)) for i in range(n)))


def drive(plan: PlacementPlan, answer: Callable[[PlacementStep], None]) -> list[str]:
    """Iterate *plan*, answering each step with *answer*; the steps' names, in order."""
    names = []
    for step in plan:
        names.append(type(step).__name__.removesuffix("Step"))
        answer(step)
    return names


def test_a_lookup_a_prefetch_and_the_start_stored_on_both_sides() -> None:
    world = World()
    world.report(IA)
    session = world.session()

    def answer(step: PlacementStep) -> None:
        if isinstance(step, LookupStep):
            assert step.request.targets == (IA,) and len(step.request.block_keys) == 2
            step.found = found_at(session)
        if isinstance(step, PrefetchStep):
            assert step.instance == IA and [b.sources for b in step.directive.blocks] == [(H1,), (H1,)]
        if isinstance(step, StartStep):
            assert step.assignment.instance == IA == session.instance  # assigned (and stored) before it is sent

    plan = PlacementPlan(world.role, session, can_start=False)
    assert drive(plan, answer) == ["Lookup", "Prefetch", "Store", "Start", "Store"]
    assert plan.placed and session.served == 1


def test_no_keys_no_lookup_and_a_refusal_moves_on() -> None:
    world = World()
    world.report(IA)
    world.report(IB, queued=1)
    session = world.session(blocks=0)
    tried: list[str] = []

    def answer(step: PlacementStep) -> None:
        if isinstance(step, StartStep):
            tried.append(step.assignment.instance)
            if step.assignment.instance == IA:
                step.error = InvalidState("draining")  # definitely not taken: the same epoch, the next choice

    plan = PlacementPlan(world.role, session, can_start=False)
    assert drive(plan, answer) == ["Store", "Start", "Store", "Store", "Start", "Store"]
    assert plan.placed and tried == [IA, IB] and session.epoch == 1 and plan.exclude == {IA}


def test_nothing_active_wakes_a_sleeping_instance_then_ranks_again() -> None:
    world = World()
    world.report(IA, requested_state=InstanceState.SLEEPING)
    world.report(IA, InstanceState.SLEEPING)
    session = world.session(blocks=0)

    def answer(step: PlacementStep) -> None:
        if isinstance(step, WakeStep):
            assert step.instance == IA
            world.role.state_answered(IA, InstanceState.ACTIVE)  # what the adapter's PUT state does
            step.answered = InstanceState.ACTIVE

    plan = PlacementPlan(world.role, session, can_start=False)
    assert drive(plan, answer) == ["Wake", "Store", "Start", "Store"]
    assert plan.placed


def test_every_candidate_refused_runs_the_start_hook_once_then_tries_the_new_instance() -> None:
    world = World(ControllerConfig(start_timeout_ms=5000))
    world.report(IA)
    session = world.session(blocks=0)

    def answer(step: PlacementStep) -> None:
        if isinstance(step, StartStep) and step.assignment.instance == IA:
            step.error = InvalidState("full")
        if isinstance(step, StartHookStep):
            step.ran = True
        if isinstance(step, AwaitInstanceStep):
            assert step.wait_s == 5.0
            world.report(IB)
            step.activated = True

    plan = PlacementPlan(world.role, session, can_start=True)
    assert drive(plan, answer) == ["Store", "Start", "Store", "StartHook", "AwaitInstance", "Store", "Start", "Store"]
    assert plan.placed and session.instance == IB


def test_no_capacity_anywhere_is_unplaced() -> None:
    world = World()
    session = world.session()
    plan = PlacementPlan(world.role, session, can_start=True)

    def answer(step: PlacementStep) -> None:
        if isinstance(step, StartHookStep):
            step.ran = False  # a broken hook: placed on what exists, i.e. nothing

    assert drive(plan, answer) == ["StartHook"]
    assert not plan.placed
    assert drive(PlacementPlan(world.role, session, can_start=False), answer) == []  # nothing to wake, no hook


def test_a_start_the_instance_finds_malformed_is_the_callers_400() -> None:
    world = World()
    world.report(IA)
    world.report(IB, queued=1)
    session = world.session(blocks=0)

    def answer(step: PlacementStep) -> None:
        if isinstance(step, StartStep):
            step.error = BadRequest("token 99999 is beyond the vocabulary")

    steps: list[str] = []

    def recording(step: PlacementStep) -> None:
        steps.append(type(step).__name__.removesuffix("Step"))
        answer(step)

    with pytest.raises(BadRequest, match="vocabulary"):
        drive(PlacementPlan(world.role, session, can_start=False), recording)
    assert steps == ["Store", "Start"]  # not tried at IB, not stored after
