"""The Placement Controller in process: its principals and policy, a fake InstanceLink that records what would be
sent to instances, :class:`Env` (the role and its asyncio adapter on an injected clock, the Index Service beside
it), session requests and checkpoints."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvsp_quic import keys as k
from kvsp_quic.auth import Policy, Principal
from kvsp_quic.compat import InstanceState
from kvsp_quic.metrics import Registry
from kvsp_quic.records import (
    InstanceStatusRecord,
    Link,
    PrefetchDirective,
    ReshardPlan,
    Sampler,
    SessionCheckpoint,
    StateMessage,
)
from kvsp_quic.roles.controller import ControllerConfig, PlacementController
from kvsp_quic.roles.controller_records import SessionRequest, SessionResume, SessionStart
from kvsp_quic.roles.controller_reshard import ReshardMessage
from kvsp_quic.roles.index import Geometry, IndexConfig, IndexService
from kvsp_quic.roles.status import LifecyclePolicy, SleepPolicy, StatusTable
from kvsp_quic.storage.memory_index import MemoryIndexStore
from kvsp_runtime.controller_service import ControllerService
from tests.helpers import Clock
from tests.support.index import C1, S1, bk, replica

H1 = "https://h1.example/kvsp/"
IA = "https://ia.example/kvsp/"
IB = "https://ib.example/kvsp/"
IC = "https://ic.example/kvsp/"
FRONT = "urn:kvsp:client:front"
OTHER = "urn:kvsp:client:other"
BLOCK = 16  # tokens per block (Geometry of C1 below)

POLICY = Policy.from_dict({"principal": [
    {"identity": H1, "roles": ["holder"], "scopes": [S1.hex()]},
    *({"identity": i, "roles": ["instance", "holder"], "scopes": [S1.hex()]} for i in (IA, IB, IC)),
    {"identity": FRONT, "roles": ["client"], "scopes": [S1.hex()]},
    {"identity": OTHER, "roles": ["client"], "scopes": [S1.hex()]},
]})


def who(identity: str) -> Principal:
    principal = POLICY.principal(identity)
    assert principal is not None
    return principal


@dataclass
class FakeLink:
    """Records every directive; ``fail[instance]`` is raised by start/resume/prefetch there."""

    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    fail: dict[str, BaseException] = field(default_factory=dict)
    prefetch_fail: dict[str, BaseException] = field(default_factory=dict)
    state_answer: dict[str, InstanceState] = field(default_factory=dict)
    reshard_delay: dict[str, float] = field(default_factory=dict)
    on_start: Any = None

    def of(self, kind: str) -> list[tuple[str, Any]]:
        return [(i, body) for kind_, i, body in self.calls if kind_ == kind]

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        self.calls.append(("prefetch", instance, directive))
        if instance in self.prefetch_fail:
            raise self.prefetch_fail[instance]

    async def start(self, instance: str, start: SessionStart) -> None:
        self.calls.append(("start", instance, start))
        if self.on_start is not None:
            self.on_start(instance, start)
        if instance in self.fail:
            raise self.fail[instance]

    async def resume(self, instance: str, session: uuid.UUID, resume: SessionResume) -> None:
        self.calls.append(("resume", instance, resume))
        if instance in self.fail:
            raise self.fail[instance]

    async def set_state(self, instance: str, state: InstanceState) -> InstanceState:
        self.calls.append(("state", instance, state))
        return self.state_answer.get(instance, state)

    async def reshard(self, instance: str, message: ReshardMessage, timeout: float | None = None) -> None:
        self.calls.append(("reshard", instance, message))
        if isinstance(message, ReshardPlan):
            await asyncio.sleep(self.reshard_delay.get(instance, 0.0))


class Env:
    def __init__(self, *, sleep: SleepPolicy | None = None, config: ControllerConfig | None = None,
                 starter: Any = None) -> None:
        self.clock = Clock()
        status = StatusTable(self.clock, policy=LifecyclePolicy(sleep), max_ttl_ms=60_000)
        self.index = IndexService(MemoryIndexStore(), clock=self.clock,
                                  config=IndexConfig(geometry={C1: Geometry(BLOCK, 4)}), status=status)
        self.link = FakeLink()
        ids = (uuid.UUID(int=n) for n in itertools.count(1))
        self.registry = Registry()
        self.pc = PlacementController(self.index, clock=self.clock, config=config, metrics=self.registry,
                                      new_id=lambda: next(ids))
        self.svc = ControllerService(self.pc, self.link, starter=starter)
        self.epochs: dict[str, int] = {}

    async def report(self, instance: str, *, epoch: int | None = None, state: InstanceState = InstanceState.ACTIVE,
                     rate: float | None = 1000.0, queued: int = 0, running: int = 0, batch_size: int | None = 8,
                     requested: InstanceState | None = None, ttl_ms: int = 3000, **changes: Any) -> StateMessage:
        epoch = epoch if epoch is not None else self.epochs.get(instance, 1)
        self.epochs[instance] = epoch
        record = InstanceStatusRecord(instance, epoch, state, ttl_ms, running=running, queued=queued,
                                      batch_size=batch_size, prefill_tokens_per_s=rate,
                                      decode_tokens_per_s=100.0, links=(Link(H1, 1000.0, 50.0),),
                                      requested_state=requested, **changes)
        return await self.svc.report_status(who(instance), k.uri_id(instance), record)

    async def publish(self, n: int, holder: str = H1) -> None:
        for i in range(n):
            await self.index.publish(who(holder), k.holder_id(holder), bk(i), replica(i, holder=holder))

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds

    def samples(self, name: str) -> dict[Any, float]:
        return self.registry.samples(name)


def request(n_blocks: int = 4, tail: int = 3, *, session: int = 1, max_tokens: int = 32,
            keys: int | None = None) -> SessionRequest:
    prompt = tuple(range(100, 100 + n_blocks * BLOCK + tail))
    return SessionRequest(uuid.UUID(int=1000 + session), S1, C1, prompt, max_tokens,
                          Sampler("greedy", 0, 0, True), tuple(bk(i) for i in range(n_blocks if keys is None
                                                                                       else keys)))


def checkpoint(req: SessionRequest, epoch: int, generated: Sequence[int], offset: int | None = None
               ) -> SessionCheckpoint:
    return SessionCheckpoint(req.session, epoch, req.compat_id, req.scope_id, req.block_keys,
                             req.prompt[len(req.block_keys) * BLOCK:], tuple(generated),
                             len(generated) if offset is None else offset, replace(req.sampler, step=len(generated)))
