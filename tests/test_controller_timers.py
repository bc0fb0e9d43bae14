"""The Placement Controller's failure check runs when the role says it has something to find (issue 25 point 4,
timers from ``next_due()``): the earliest expiry of an instance status, a report that makes a failover likely or a
status expire sooner, and -- with a store other processes write -- every tick interval; not on a fixed period.

Counts, not wall-clock bounds: the ticks the loop ran before the migration it had to make (the fixed 50 ms period
it replaced ran about ten in the same time), and what ``next_due`` and a report's ``expires_at`` say."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kvsp_quic import keys as k
from kvsp_quic.auth import ALL, Principal, Role
from kvsp_quic.compat import InstanceState
from kvsp_quic.records import InstanceStatusRecord, PrefetchDirective, Sampler
from kvsp_quic.roles.controller import PlacementController
from kvsp_quic.roles.controller_records import SessionRequest, SessionResume, SessionStart
from kvsp_quic.roles.controller_reshard import ReshardMessage
from kvsp_quic.roles.index import IndexService
from kvsp_quic.roles.status import LifecyclePolicy, StatusTable
from kvsp_quic.storage.memory_index import MemoryIndexStore
from kvsp_runtime.controller_service import ControllerService
from tests.helpers import Clock
from tests.support.index import C1, S1

IA, IB = "https://ia.example/kvsp/", "https://ib.example/kvsp/"
FRONT = Principal("urn:kvsp:client:front", frozenset({Role.CLIENT}), ALL)


class Link:
    """Takes every start and resume; records where each went."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []
        self.moved = asyncio.Event()

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None: ...

    async def start(self, instance: str, start: SessionStart) -> None:
        self.sent.append(("start", instance))
        if instance == IB:
            self.moved.set()

    async def resume(self, instance: str, session: uuid.UUID, resume: SessionResume) -> None:
        self.sent.append(("resume", instance))

    async def set_state(self, instance: str, state: InstanceState) -> InstanceState:
        return state

    async def reshard(self, instance: str, message: ReshardMessage, timeout: float | None = None) -> None: ...

    async def cancel(self, instance: str, session: uuid.UUID) -> None: ...

    async def probe(self, instance: str, session: uuid.UUID, timeout: float) -> None: ...


def controller(clock: Any) -> tuple[PlacementController, ControllerService, Link]:
    status = StatusTable(clock, policy=LifecyclePolicy(), max_ttl_ms=60_000)
    role = PlacementController(IndexService(MemoryIndexStore(), clock=clock, status=status), clock=clock)
    link = Link()
    return role, ControllerService(role, link), link


def status(instance: str, ttl_ms: int, queued: int = 0) -> InstanceStatusRecord:
    return InstanceStatusRecord(instance, 1, InstanceState.ACTIVE, ttl_ms, queued=queued, batch_size=8,
                                prefill_tokens_per_s=1000.0)


async def report(svc: ControllerService, instance: str, ttl_ms: int, queued: int = 0) -> None:
    principal = Principal(instance, frozenset({Role.INSTANCE}), ALL)
    await svc.report_status(principal, k.uri_id(instance), status(instance, ttl_ms, queued))


@contextlib.asynccontextmanager
async def ticking(svc: ControllerService, interval: float, ticks: list[float]) -> AsyncIterator[None]:
    tick = svc.tick

    async def counted() -> list[asyncio.Task[bool]]:
        ticks.append(time.monotonic())
        return await tick()

    svc.tick = counted  # type: ignore[method-assign]
    loop = asyncio.create_task(svc.run(interval))
    try:
        yield
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await svc.aclose()


async def test_next_due_is_the_earliest_status_expiry() -> None:
    clock = Clock()
    role, svc, _ = controller(clock)
    assert role.next_due() is None  # nothing to watch
    await report(svc, IA, 3000)
    await report(svc, IB, 1000)
    assert role.next_due() == clock.now + 1.0
    clock.now += 1.5  # IB expired: no longer watched
    assert role.next_due() == clock.now + 1.5
    principal = Principal(IB, frozenset({Role.INSTANCE}), ALL)
    answer = role.report_status(principal, k.uri_id(IB), status(IB, 200))
    assert answer.expires_at == clock.now + 0.2 == role.next_due()


async def test_the_check_runs_when_a_status_expires_not_on_a_period() -> None:
    """IA (a 400 ms status) serves the session and falls silent; IB stays. The loop, asked for a 50 ms period,
    sleeps until IA's expiry and migrates then: a handful of ticks, not one per 50 ms."""
    _, svc, link = controller(time.monotonic)
    ticks: list[float] = []
    async with ticking(svc, 0.05, ticks):
        await report(svc, IB, 60_000, queued=4)
        await report(svc, IA, 400)  # expires before the loop's next look: it is woken to look then
        request = SessionRequest(uuid.UUID(int=1), S1, C1, (1, 2, 3), 8, Sampler("greedy", 0, 0, True))
        info, _ = await svc.create_session(FRONT, request)
        assert info.instance == IA
        placed_at = len(ticks)
        await asyncio.wait_for(link.moved.wait(), 30)  # IA expired: the session was started anew on IB
        assert link.sent == [("start", IA), ("start", IB)]
        assert len(ticks) - placed_at <= 3, ticks  # a 50 ms period: ~8 in the 400 ms


async def test_an_idle_controller_sleeps() -> None:
    """No instance, no session: after each tick the loop waits for an event up to its idle bound (1 s), where it
    ticked every 50 ms; with a store other processes write, it looks every tick interval."""
    _, svc, _ = controller(time.monotonic)
    ticks: list[float] = []
    async with ticking(svc, 0.05, ticks):
        before = svc._next_tick
        for n in (1, 2):
            if n == 2:
                svc.kick.set()  # an event: one more tick at once
            while len(ticks) < n or svc._next_tick == before:  # the loop planned its next look
                await asyncio.sleep(0.01)
            before = svc._next_tick
            assert svc._next_tick - ticks[-1] > 0.9, (svc._next_tick, ticks)
    _, shared, _ = controller(time.monotonic)
    shared.store.shared = True  # as RedisControlStore: other replicas' reports are seen only by reading it
    ticks = []
    async with ticking(shared, 0.05, ticks):
        while not ticks or not ticks[-1] <= shared._next_tick < float("inf"):
            await asyncio.sleep(0.01)
        assert shared._next_tick - ticks[-1] < 0.1
