"""The Placement Controller role (spec: "Instance Status and Lifecycle", "Placement Inputs", "Prefetch
Directives", "Session Checkpoints and Migration", "Sequence-Sharded Caches and Resharding").

Protocol rules only: no HTTP. :class:`PlacementController` runs in the Index Service's process (the spec allows
combining them; docs/wire.md, "Placement Controller") and calls the :class:`~kvsp_quic.roles.index.IndexService`
directly for lookups and the :class:`~kvsp_quic.roles.status.StatusTable` for instance states. What it sends to
instances goes through an injected :class:`InstanceLink` (``http3.controller_app.HttpInstanceLink`` over HTTP);
clocks (monotonic seconds) and identifiers are injected too.

* **Lifecycle**: status reports go through :meth:`PlacementController.report_status` (epochs, expiry -> failed,
  sleep requests: :class:`~kvsp_quic.roles.status.LifecyclePolicy`); :meth:`set_instance_state` is ``PUT state``.
* **Placement** (:func:`rank`): a lookup of the prompt's Block Keys with every alive *active* instance as a target,
  the spec's cost per candidate, the cheapest first. Only active instances are ever candidates, and each is
  re-checked right before a directive or a start is sent to it.
* **Prefetch**: before the session starts, the chosen instance gets ``POST prefetch`` for the matched blocks it
  does not hold (when loading beats recomputing), so loading overlaps the request's arrival.
* **Capacity**: when no active instance has acceptable cost or capacity, a sleeping instance is woken
  (``PUT state`` active), else the start hook (:class:`Starter`) is run and the request waits for an instance to
  become active, which then gets the prefetch directive and the session at once.
* **Sessions**: checkpoints keep the highest ``output_offset``; a lower epoch is 409 ``kvsp-stale-epoch``, a
  checkpoint from another instance than the session's current one 403. When the instance fails (its status
  expired, it reported ``failed``, it restarted with a higher epoch, or a start was not answered) the session's
  epoch is incremented first -- fencing the old instance -- and it is resumed on the next instance by cost.
* **Resharding** (:meth:`reshard`): plans from :func:`~kvsp_quic.roles.controller_reshard.plan_reshard` to every
  member, commit after every acknowledgement, abort when one is missing at ``deadline_ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvsp_quic import cost
from kvsp_quic.auth import ALL, Principal, Role, require_scope
from kvsp_quic.compat import InstanceState
from kvsp_quic.fields import BlockKey
from kvsp_quic.metrics import KvspMetrics, Registry
from kvsp_quic.problems import (
    BadRequest,
    Forbidden,
    Incompatible,
    InvalidState,
    NotFound,
    PlanConflict,
    Problem,
    StaleEpoch,
    Unavailable,
)
from kvsp_quic.records import (
    CheckpointAck,
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    PrefetchBlock,
    PrefetchDirective,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    SessionCheckpoint,
    ShardMap,
    StateMessage,
)
from kvsp_quic.roles.controller_records import SessionInfo, SessionRequest, SessionResume, SessionStart, SessionState
from kvsp_quic.roles.controller_reshard import members, plan_reshard
from kvsp_quic.roles.index import IndexService
from kvsp_quic.roles.status import InstanceStatus, StatusTable

log = logging.getLogger("kvsp.controller")

Clock = Callable[[], float]
ReshardMessage = ReshardPlan | ReshardCommit | ReshardAbort


# -- what the controller sends, and how it starts instances ---------------------------------------------------


class InstanceLink(Protocol):
    """The PC's requests to instances. Each raises the :class:`~kvsp_quic.problems.Problem` the instance answered
    (any status other than 2xx), or ``OSError`` (``ConnectionError``, ``TimeoutError``) when it did not answer."""

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None: ...

    async def start(self, instance: str, start: SessionStart) -> None: ...

    async def resume(self, instance: str, session: uuid.UUID, resume: SessionResume) -> None: ...

    async def set_state(self, instance: str, state: InstanceState) -> InstanceState: ...

    async def reshard(self, instance: str, message: ReshardMessage, timeout: float | None = None) -> None: ...


class Starter(Protocol):
    """Starts a new inference instance (the start hook). Returns once the start is under way; the instance joins
    by reporting its status."""

    async def start(self, reason: str) -> None: ...


class CommandStarter:
    """The start hook as a command: ``argv`` is run (not through a shell) with ``KVSP_PC_URI`` (the PC's base
    URI) and ``KVSP_START_REASON`` in its environment. The PC does not wait for it, read its output or stop it:
    the command either starts the instance and exits, or is the instance. Its exit status is logged."""

    def __init__(self, argv: Sequence[str], *, pc_uri: str, env: Mapping[str, str] | None = None) -> None:
        if not argv:
            raise ValueError("the start hook needs a command")
        self.argv = list(argv)
        self.pc_uri = pc_uri
        self.env = dict(env) if env is not None else None
        self.started = 0
        self._waiters: set[asyncio.Task[None]] = set()

    async def start(self, reason: str) -> None:
        env = dict(os.environ if self.env is None else self.env)
        env.update(KVSP_PC_URI=self.pc_uri, KVSP_START_REASON=reason)
        proc = await asyncio.create_subprocess_exec(*self.argv, env=env, stdin=asyncio.subprocess.DEVNULL)
        self.started += 1
        log.info("start hook %r running (pid %d): %s", self.argv[0], proc.pid, reason)
        task = asyncio.create_task(self._reap(proc))
        self._waiters.add(task)
        task.add_done_callback(self._waiters.discard)

    async def _reap(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        (log.info if code == 0 else log.warning)("start hook %r (pid %d) exited with %d", self.argv[0], proc.pid,
                                                 code)

    async def settle(self, timeout: float) -> None:
        """Wait (up to *timeout* seconds) for the hook processes started so far to exit."""
        if self._waiters:
            await asyncio.wait(list(self._waiters), timeout=timeout)

    async def aclose(self) -> None:
        """Stop waiting for hook processes (they keep running)."""
        for task in list(self._waiters):
            task.cancel()
        for task in list(self._waiters):
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- configuration ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ControllerConfig:
    prefetch_deadline_ms: int = 1000  # of the directives sent before a session starts
    prefetch_lease_ms: int = 5000
    start_timeout_ms: int = 60_000  # how long a request waits for an instance the start hook starts
    start_interval_ms: int = 10_000  # at most one start hook run per interval
    max_cost_us: float | None = None  # above it a placement looks for more capacity (wake, start hook)
    session_ttl_ms: int = 3_600_000  # a session without a checkpoint for this long is forgotten
    done_ttl_ms: int = 600_000  # a finished session stays readable for this long
    max_sessions: int = 100_000
    reshard_deadline_ms: int = 5000  # default deadline_ms of reshard plans

    def __post_init__(self) -> None:
        for name in ("prefetch_deadline_ms", "prefetch_lease_ms", "start_timeout_ms", "start_interval_ms",
                     "session_ttl_ms", "done_ttl_ms", "max_sessions", "reshard_deadline_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.max_cost_us is not None and self.max_cost_us <= 0:
            raise ValueError("max_cost_us must be positive")


# -- placement --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """One candidate instance as :func:`rank` saw it. ``cost_us`` is None when the instance reports no prefill
    rate (it is ranked after every instance with a cost)."""

    instance: str
    cost_us: float | None
    use_cache: bool  # loading the matched blocks beats recomputing them (or nothing tells otherwise)
    has_capacity: bool  # running + queued (+ assigned since its last report) < batch_size, or no batch_size
    load: int
    fetch_us: float | None = None
    recompute_us: float | None = None  # of all tokens


def rank(candidates: Iterable[InstanceStatus], lookup: LookupResponse | None, tokens: int, max_tokens: int,
         block_tokens: int | None, pending: Mapping[str, int] | None = None) -> list[Choice]:
    """The candidates by the spec's cost, cheapest first (ties: lower load, then base URI).

    ``cost = wait_us + min(fetch_us + recompute_us_of_unmatched, recompute_us_of_all)`` with ``fetch_us`` from the
    lookup's estimate for the instance, ``recompute_us`` at its ``prefill_tokens_per_s``, and ``wait_us = queued *
    mean service time``, where *queued* counts the sessions the PC assigned since the instance's last report too
    (*pending*), and the mean service time is taken to be this request's: prefilling *tokens* plus decoding
    *max_tokens* at ``decode_tokens_per_s``. Without an estimate for the instance (no geometry known for the
    compat_id, nothing matched) the cost is ``wait_us + recompute_us_of_all``.
    """
    pending = pending or {}
    estimates = {t.instance: t for t in (lookup.targets or ())} if lookup is not None else {}
    matched = lookup.matched if lookup is not None else 0
    matched_tokens = min(tokens, matched * block_tokens) if block_tokens is not None else None
    out: list[Choice] = []
    for entry in candidates:
        r = entry.record
        queued = r.queued + pending.get(entry.instance, 0)
        load = r.running + queued
        capacity = r.batch_size is None or load < r.batch_size
        rate = r.prefill_tokens_per_s
        if not rate:
            out.append(Choice(entry.instance, None, matched > 0, capacity, load))
            continue
        recompute_all = cost.recompute_us(tokens, rate)
        decode = 1e6 * max_tokens / r.decode_tokens_per_s if r.decode_tokens_per_s else 0.0
        wait = cost.wait_us(queued, recompute_all + decode)
        est = estimates.get(entry.instance)
        if est is None or matched_tokens is None:
            out.append(Choice(entry.instance, wait + recompute_all, matched > 0, capacity, load, None,
                              recompute_all))
            continue
        unmatched = cost.recompute_us(tokens - matched_tokens, rate)
        total = cost.cost_us(wait, est.fetch_us, unmatched, recompute_all)
        use_cache = matched > 0 and est.fetch_us + unmatched < recompute_all
        out.append(Choice(entry.instance, total, use_cache, capacity, load, float(est.fetch_us), recompute_all))
    out.sort(key=lambda c: (c.cost_us is None, c.cost_us or 0.0, c.load, c.instance))
    return out


# -- sessions ---------------------------------------------------------------------------------------------------


@dataclass
class Session:
    request: SessionRequest
    owner: str  # the identity that created it (only it may read it)
    created: float
    touched: float
    epoch: int = 1  # the current epoch: checkpoints of lower epochs are refused
    served: int = 1  # the epoch of the last successful assignment (what the front end is shown)
    state: SessionState = SessionState.PLACING
    instance: str | None = None
    instance_epoch: int | None = None  # the status epoch of the instance's run that serves the session
    checkpoint: SessionCheckpoint | None = None
    failed_at: float | None = None
    migrations: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> uuid.UUID:
        return self.request.session

    @property
    def output_offset(self) -> int:
        return self.checkpoint.output_offset if self.checkpoint is not None else 0

    def info(self) -> SessionInfo:
        """What the front end sees: while the session is placed or migrated, the epoch it was last served in and
        no instance, so that "the epoch grew" always comes with the instance that serves the new epoch."""
        if self.state in (SessionState.RUNNING, SessionState.DONE):
            return SessionInfo(self.id, self.epoch, self.output_offset, self.state, self.instance)
        return SessionInfo(self.id, self.served, self.output_offset, self.state, None)


@dataclass
class ReshardOutcome:
    """What :meth:`PlacementController.reshard` did. ``version`` is the authoritative version afterwards."""

    map: str
    version: int
    committed: bool
    acknowledged: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # instance -> why it did not acknowledge
    undelivered: dict[str, str] = field(default_factory=dict)  # commit / abort that did not reach an instance

    def to_json(self) -> dict[str, Any]:
        return {"map": self.map, "version": self.version, "outcome": "committed" if self.committed else "aborted",
                "acknowledged": self.acknowledged, "failed": self.failed, "undelivered": self.undelivered}


_REFUSALS = (InvalidState, Incompatible)  # the instance definitely did not take the session


class PlacementController:
    """See the module docstring. ``index.status`` should use a :class:`~kvsp_quic.roles.status.LifecyclePolicy`
    (it decides sleep requests; with the default echo policy every sleep request is refused)."""

    def __init__(self, index: IndexService, link: InstanceLink, *, clock: Clock = time.monotonic,
                 config: ControllerConfig | None = None, starter: Starter | None = None,
                 metrics: Registry | None = None, identity: str = "urn:kvsp:controller",
                 new_id: Callable[[], uuid.UUID] = uuid.uuid4) -> None:
        self.index = index
        self.status: StatusTable = index.status
        self.link = link
        self.clock = clock
        self.config = config or ControllerConfig()
        self.starter = starter
        self.new_id = new_id
        # Lookups are made on the front end's behalf after its scope was checked: the PC's own principal.
        self.principal = Principal(identity, frozenset({Role.CONTROLLER}), ALL)
        self.sessions: dict[uuid.UUID, Session] = {}
        self.maps: dict[str, ShardMap] = {}
        self._resharding: set[str] = set()
        self._pending: dict[str, int] = {}  # sessions assigned since the instance's last report
        self._start_wait: tuple[float, asyncio.Event] | None = None  # until when, and set when one came
        self._last_start: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._migrating: set[uuid.UUID] = set()
        self.kick = asyncio.Event()  # set when a report makes a failover likely: the ticker runs at once
        self.registry = metrics or Registry()
        self._init_metrics()

    # -- metrics --------------------------------------------------------------------------------------------------

    def _init_metrics(self) -> None:
        reg = self.registry
        self.kvsp = KvspMetrics(reg)
        self.m_sessions = reg.counter("kvsp_controller_sessions_total", "Sessions asked for, by outcome",
                                      ("outcome",))
        self.m_prefetch = reg.counter("kvsp_prefetch_directives_total", "Prefetch directives sent, by outcome",
                                      ("outcome",))
        self.m_checkpoints = reg.counter("kvsp_checkpoints_total", "Checkpoints received, by outcome",
                                         ("outcome",))
        self.m_status = reg.counter("kvsp_status_reports_total", "Instance status reports, by outcome",
                                    ("outcome",))
        self.m_starts = reg.counter("kvsp_session_starts_total", "Session starts and resumes sent, by outcome",
                                    ("kind", "outcome"))
        self.m_reshards = reg.counter("kvsp_reshards_total", "Reshards, by outcome", ("outcome",))
        self.m_placement_tokens = reg.counter(
            "kvsp_placement_tokens_total", "Prompt tokens of placed sessions by what placement planned: loaded from "
            "the cache or recomputed", ("source",))
        self.m_hooks = reg.counter("kvsp_instance_starts_total", "Start hook runs and wake-ups", ("kind",))
        self.m_placement_seconds = reg.histogram("kvsp_placement_seconds", "Time to place a session (lookup, "
                                                 "prefetch, start)")
        self.m_migration_seconds = reg.histogram("kvsp_migration_seconds", "From detecting an instance failure to "
                                                 "the session resumed elsewhere",
                                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        reg.gauge("kvsp_sessions", "Sessions the PC holds, by state", ("state",)).collect(self._session_states)
        reg.gauge("kvsp_instances", "Instances by the state the PC holds (failed: expired or reported)",
                  ("state",)).collect(self._instance_states)
        policy = self.status.policy
        if hasattr(policy, "sleep_accepted"):
            reg.counter("kvsp_sleep_requests_total", "Sleep requests, by answer", ("answer",)).collect(
                lambda: [({"answer": "draining"}, getattr(policy, "sleep_accepted", 0)),
                         ({"answer": "active"}, getattr(policy, "sleep_refused", 0))])

    def _session_states(self) -> list[tuple[dict[str, str], float]]:
        counts = dict.fromkeys(SessionState, 0)
        for s in list(self.sessions.values()):
            counts[s.state] += 1
        return [({"state": k.value}, float(v)) for k, v in counts.items()]

    def _instance_states(self) -> list[tuple[dict[str, str], float]]:
        counts = dict.fromkeys(InstanceState, 0)
        for instance in self.known_instances():
            state = self.status.state(instance)
            if state is not None:
                counts[state] += 1
        return [({"state": k.value}, float(v)) for k, v in counts.items()]

    def known_instances(self) -> list[str]:
        return self.status.instances()

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def report_status(self, principal: Principal, instance_id: str, record: InstanceStatusRecord) -> StateMessage:
        """PUT instances/{instance-id}/status (the Index Service checks who may report)."""
        before = self.status.state(record.instance)
        previous_epoch = self.status.highest_epoch(record.instance)
        try:
            answer = self.index.report_status(principal, instance_id, record)
        except StaleEpoch:
            self.m_status.labels(outcome="stale").inc()
            raise
        self.m_status.labels(outcome="accepted").inc()
        self._pending.pop(record.instance, None)  # its running / queued now include what we assigned
        if answer.state is InstanceState.ACTIVE and before is not InstanceState.ACTIVE:
            self._activated()
        restarted = previous_epoch is not None and record.epoch > previous_epoch
        if restarted or answer.state is InstanceState.FAILED:
            self.kick.set()
        return answer

    async def set_instance_state(self, instance: str, state: InstanceState) -> InstanceState:
        """PUT state on *instance*; the state it answered is held from then on (spec: "The PC can also change
        the state of an instance with PUT state on the instance")."""
        if self.status.get(instance) is None:
            raise NotFound(f"no live status of instance {instance!r}")
        if state is InstanceState.FAILED:
            raise BadRequest("the PC does not set instances to failed")
        answered = await self.link.set_state(instance, state)
        self.status.set_state(instance, answered)
        if answered is InstanceState.ACTIVE:
            self._activated()
        return answered

    def instances(self) -> list[dict[str, Any]]:
        """Every instance the PC has heard of: its held state, epoch and last reported load."""
        out = []
        for instance in self.known_instances():
            entry = self.status.get(instance)
            item: dict[str, Any] = {"instance": instance, "epoch": self.status.highest_epoch(instance),
                                    "state": (self.status.state(instance) or InstanceState.FAILED).value}
            if entry is not None:
                r = entry.record
                item.update(running=r.running, queued=r.queued, reported_state=r.state.value,
                            ttl_ms=max(1, int((entry.expires_at - self.clock()) * 1000)))
            out.append(item)
        return out

    def active(self, exclude: Iterable[str] = ()) -> list[InstanceStatus]:
        skip = set(exclude)
        return [e for e in self.status.live() if e.state is InstanceState.ACTIVE and e.instance not in skip]

    # -- placement ------------------------------------------------------------------------------------------------

    async def _lookup(self, request: SessionRequest, keys: Sequence[BlockKey],
                      candidates: list[InstanceStatus]) -> LookupResponse | None:
        if not keys:
            return None
        keys = keys[:self.index.config.max_lookup_keys]
        targets = tuple(e.instance for e in candidates[:self.index.config.max_lookup_targets])
        found = await self.index.lookup(self.principal, LookupRequest(request.scope_id, request.compat_id,
                                                                      tuple(keys), targets))
        self.kvsp.lookup("controller", len(keys), found.matched)
        return found

    def _block_tokens(self, compat_id: bytes) -> int | None:
        geometry = self.index.config.geometry.get(bytes(compat_id))
        return geometry.block_tokens if geometry is not None else None

    async def _rank(self, session: Session, exclude: set[str]) -> tuple[list[Choice], LookupResponse | None]:
        request = session.request
        cp = session.checkpoint
        keys = cp.prompt_blocks if cp is not None else request.block_keys
        tokens = len(request.prompt) + (cp.output_offset if cp is not None else 0)
        remaining = request.max_tokens - (cp.output_offset if cp is not None else 0)
        candidates = self.active(exclude)
        if not candidates:
            return [], None
        found = await self._lookup(request, keys, candidates)
        choices = rank(candidates, found, tokens, max(remaining, 1), self._block_tokens(request.compat_id),
                       self._pending)
        return choices, found

    def _acceptable(self, choices: list[Choice]) -> bool:
        limit = self.config.max_cost_us
        return any(c.has_capacity and (limit is None or (c.cost_us is not None and c.cost_us <= limit))
                   for c in choices)

    async def _more_capacity(self, reason: str) -> bool:
        """Wake a sleeping instance, or run the start hook and wait for an instance to become active. True when an
        instance became active."""
        for entry in self.status.live():
            if entry.state is InstanceState.SLEEPING:
                try:
                    answered = await self.set_instance_state(entry.instance, InstanceState.ACTIVE)
                except (Problem, OSError) as exc:
                    log.warning("waking %s failed: %s", entry.instance, exc)
                    continue
                if answered is InstanceState.ACTIVE:
                    self.m_hooks.labels(kind="wake").inc()
                    log.info("woke %s (%s)", entry.instance, reason)
                    return True
        if self.starter is None:
            return False
        now = self.clock()
        waiting = self._start_wait
        if waiting is None or now >= waiting[0]:
            interval = self.config.start_interval_ms / 1000
            if self._last_start is not None and now - self._last_start < interval:
                return False  # the hook ran recently and its instance came (or never will): use what exists
            self._last_start = now
            try:
                await self.starter.start(reason)
            except Exception as exc:  # a broken hook must not fail the request; it is placed on what exists
                log.error("the start hook failed: %s", exc)
                return False
            self.m_hooks.labels(kind="hook").inc()
            waiting = self._start_wait = (now + self.config.start_timeout_ms / 1000, asyncio.Event())
        try:
            async with asyncio.timeout(max(0.0, waiting[0] - now)):
                await waiting[1].wait()
        except TimeoutError:
            log.warning("no instance became active within %d ms of the start hook", self.config.start_timeout_ms)
            return False
        return True

    def _activated(self) -> None:
        """An instance became active: whoever waits for the start hook's instance can go on."""
        waiting, self._start_wait = self._start_wait, None
        if waiting is not None:
            waiting[1].set()

    def _directive(self, session: Session, choice: Choice, found: LookupResponse | None) -> PrefetchDirective | None:
        if found is None or not choice.use_cache:
            return None
        blocks = []
        for match in found.blocks:
            if any(r.holder == choice.instance for r in match.replicas):
                continue  # resident at the instance (its own tiers)
            sources = tuple(dict.fromkeys(r.holder for r in match.replicas))
            blocks.append(PrefetchBlock(match.block_key, sources))
        if not blocks:
            return None
        r = session.request
        return PrefetchDirective(self.new_id(), r.scope_id, r.compat_id, tuple(blocks),
                                 self.config.prefetch_deadline_ms, self.config.prefetch_lease_ms,
                                 request_ref=str(session.id))

    async def _try(self, session: Session, choices: list[Choice], found: LookupResponse | None,
                   exclude: set[str]) -> bool:
        """Prefetch and start (or resume) *session* on the first choice that takes it."""
        matched = tuple(PrefetchBlock(m.block_key, tuple(dict.fromkeys(r.holder for r in m.replicas)))
                        for m in found.blocks) if found is not None else ()
        for choice in choices:
            instance = choice.instance
            entry = self.status.get(instance)
            if entry is None or entry.state is not InstanceState.ACTIVE:
                continue  # changed since the ranking: never a directive to an instance that is not active
            directive = self._directive(session, choice, found)
            if directive is not None:
                try:
                    await self.link.prefetch(instance, directive)
                    self.m_prefetch.labels(outcome="accepted").inc()
                except InvalidState:
                    self.m_prefetch.labels(outcome="refused").inc()
                    exclude.add(instance)
                    continue
                except Problem as exc:  # the session can still start: the instance loads or recomputes
                    self.m_prefetch.labels(outcome="failed").inc()
                    log.info("prefetch directive to %s refused: %s", instance, exc)
                except OSError as exc:
                    self.m_prefetch.labels(outcome="unreachable").inc()
                    log.warning("prefetch directive to %s failed: %s", instance, exc)
                    exclude.add(instance)
                    continue
            kind = "resume" if session.checkpoint is not None else "start"
            # The instance may checkpoint before its answer arrives: it is the session's instance from now on.
            session.instance, session.instance_epoch = instance, entry.record.epoch
            try:
                if session.checkpoint is not None:
                    await self.link.resume(instance, session.id, SessionResume(
                        session.epoch, session.checkpoint, session.request.max_tokens, session.request.prompt))
                else:
                    await self.link.start(instance, SessionStart.of(session.request, session.epoch, matched))
            except _REFUSALS as exc:
                self.m_starts.labels(kind=kind, outcome="refused").inc()
                log.info("%s of session %s refused by %s: %s", kind, session.id, instance, exc)
                session.instance = session.instance_epoch = None
                exclude.add(instance)
                continue
            except (Problem, OSError) as exc:  # maybe started, maybe not: fence this epoch
                self.m_starts.labels(kind=kind, outcome="failed").inc()
                log.warning("%s of session %s on %s failed (%s); epoch %d -> %d", kind, session.id, instance, exc,
                            session.epoch, session.epoch + 1)
                session.instance = session.instance_epoch = None
                session.epoch += 1
                exclude.add(instance)
                continue
            self.m_starts.labels(kind=kind, outcome="ok").inc()
            session.served = session.epoch
            self._pending[instance] = self._pending.get(instance, 0) + 1
            self._count_tokens(session, choice, found)
            return True
        return False

    def _count_tokens(self, session: Session, choice: Choice, found: LookupResponse | None) -> None:
        tokens = len(session.request.prompt)
        block_tokens = self._block_tokens(session.request.compat_id)
        cached = 0
        if choice.use_cache and found is not None and block_tokens is not None:
            cached = min(tokens, found.matched * block_tokens)
        self.m_placement_tokens.labels(source="cache").inc(cached)
        self.m_placement_tokens.labels(source="recompute").inc(tokens - cached)

    async def _place(self, session: Session) -> bool:
        """Assign *session* (its epoch already fresh): rank, look for capacity when nothing is acceptable, try."""
        exclude: set[str] = set()
        choices, found = await self._rank(session, exclude)
        if not self._acceptable(choices) and await self._more_capacity(f"session {session.id}"):
            choices, found = await self._rank(session, exclude)
        if await self._try(session, choices, found, exclude):
            return True
        if choices and await self._more_capacity(f"session {session.id}: every candidate refused"):
            choices, found = await self._rank(session, exclude)
            return await self._try(session, choices, found, exclude)
        return False

    # -- sessions -------------------------------------------------------------------------------------------------

    def _session(self, session_id: uuid.UUID) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"no session {session_id}")
        return session

    async def create_session(self, principal: Principal, request: SessionRequest) -> tuple[SessionInfo, bool]:
        """POST sessions: place and start the session; (its info, whether it was created now)."""
        require_scope(principal, request.scope_id)
        existing = self.sessions.get(request.session)
        if existing is not None:
            if existing.owner != principal.identity or existing.request != request:
                raise Problem(f"session {request.session} exists", status=409)
            return existing.info(), False  # a retry of the same request
        if len(self.sessions) >= self.config.max_sessions:
            raise Unavailable(f"the PC holds {len(self.sessions)} sessions, its maximum")
        now = self.clock()
        session = Session(request, principal.identity, now, now)
        self.sessions[request.session] = session
        started = time.perf_counter()
        async with session.lock:
            try:
                placed = await self._place(session)
            except BaseException:
                self.sessions.pop(request.session, None)
                raise
            if not placed:
                self.sessions.pop(request.session, None)
                self.m_sessions.labels(outcome="unplaced").inc()
                raise Unavailable("no active instance took the session")
            session.state = SessionState.RUNNING
        self.m_sessions.labels(outcome="placed").inc()
        self.m_placement_seconds.observe(time.perf_counter() - started)
        return session.info(), True

    def session_info(self, principal: Principal, session_id: uuid.UUID) -> SessionInfo:
        """GET sessions/{id}: only for the identity that created the session (others: 404, as if unknown)."""
        session = self.sessions.get(session_id)
        if session is None or session.owner != principal.identity:
            raise NotFound(f"no session {session_id}")
        return session.info()

    def checkpoint(self, principal: Principal, session_id: uuid.UUID, cp: SessionCheckpoint, *,
                   done: bool = False) -> CheckpointAck:
        """PUT sessions/{id}/checkpoint (spec, "Session Checkpoints and Migration")."""
        session = self._session(session_id)
        if cp.session != session_id:
            raise BadRequest(f"session: the checkpoint names {cp.session}, the path {session_id}")
        if cp.epoch < session.epoch:
            self.m_checkpoints.labels(outcome="stale").inc()
            raise StaleEpoch(f"session {session_id} is at epoch {session.epoch}; the checkpoint has {cp.epoch}")
        if cp.epoch > session.epoch:
            self.m_checkpoints.labels(outcome="rejected").inc()
            raise BadRequest(f"session {session_id} is at epoch {session.epoch}; epoch {cp.epoch} was never "
                             f"assigned")
        if session.instance is None or principal.identity != session.instance:
            self.m_checkpoints.labels(outcome="forbidden").inc()
            raise Forbidden(f"{principal.identity!r} does not serve session {session_id} in epoch {session.epoch}")
        request = session.request
        if cp.compat_id != request.compat_id:
            raise Incompatible("compat_id: not the session's")
        if cp.scope_id != request.scope_id:
            raise BadRequest("scope_id: not the session's")
        if cp.output_offset > request.max_tokens:
            raise BadRequest(f"output_offset: {cp.output_offset} exceeds max_tokens {request.max_tokens}")
        held = session.checkpoint
        if held is not None:
            n = min(held.output_offset, cp.output_offset)
            if cp.generated[:n] != held.generated[:n]:
                self.m_checkpoints.labels(outcome="rejected").inc()
                raise Problem(f"the checkpoint contradicts the acknowledged output of session {session_id} "
                              f"before index {n}", status=409)
        if held is None or cp.output_offset > held.output_offset or (
                cp.output_offset == held.output_offset and cp.epoch > held.epoch):
            session.checkpoint = cp
        session.touched = self.clock()
        if done or session.output_offset >= request.max_tokens:
            session.state = SessionState.DONE
        self.m_checkpoints.labels(outcome="accepted").inc()
        return CheckpointAck(session_id, session.epoch, session.output_offset)

    # -- failures -------------------------------------------------------------------------------------------------

    def _instance_failed(self, session: Session) -> bool:
        instance = session.instance
        if instance is None:
            return False
        state = self.status.state(instance)
        highest = self.status.highest_epoch(instance)
        return (state is None or state is InstanceState.FAILED
                or (highest is not None and session.instance_epoch is not None and highest > session.instance_epoch))

    def needs_migration(self, session: Session) -> bool:
        if session.state is SessionState.MIGRATING:
            return True
        return session.state is SessionState.RUNNING and self._instance_failed(session)

    async def migrate(self, session: Session) -> bool:
        """Move *session* off its failed instance: increment the epoch (fencing the old instance), pick the next
        instance by cost, prefetch, and resume there with the latest checkpoint (or start afresh, at the new
        epoch, when there is none yet). False when no instance took it (retried at the next tick)."""
        async with session.lock:
            if not self.needs_migration(session):
                return True
            if session.state is SessionState.RUNNING:
                log.warning("session %s: instance %s failed; epoch %d -> %d", session.id, session.instance,
                            session.epoch, session.epoch + 1)
                session.failed_at = self.clock()
                session.epoch += 1
                session.instance = session.instance_epoch = None
                session.state = SessionState.MIGRATING
            if not await self._place(session):
                return False
            session.state = SessionState.RUNNING
            session.migrations += 1
            self.kvsp.migrations.labels(component="controller").inc()
            if session.failed_at is not None:
                self.m_migration_seconds.observe(max(0.0, self.clock() - session.failed_at))
            session.failed_at = None
            log.info("session %s resumed on %s at epoch %d, output_offset %d", session.id, session.instance,
                     session.epoch, session.output_offset)
            return True

    def tick(self) -> list[asyncio.Task[bool]]:
        """Start the migrations that are due (each in its own task, returned) and forget old sessions."""
        now = self.clock()
        started = []
        for session in list(self.sessions.values()):
            if session.state is SessionState.DONE:
                if now - session.touched > self.config.done_ttl_ms / 1000:
                    del self.sessions[session.id]
                continue
            if now - session.touched > self.config.session_ttl_ms / 1000 and session.state is not \
                    SessionState.PLACING:
                del self.sessions[session.id]
                continue
            if session.id not in self._migrating and self.needs_migration(session):
                started.append(self._spawn_migration(session))
        return started

    def _spawn_migration(self, session: Session) -> asyncio.Task[bool]:
        self._migrating.add(session.id)
        task = asyncio.create_task(self.migrate(session))
        self._tasks.add(task)

        def done(t: asyncio.Task[bool]) -> None:
            self._tasks.discard(t)
            self._migrating.discard(session.id)
            if not t.cancelled() and t.exception() is not None:
                log.error("migrating session %s failed", session.id, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    async def run(self, interval: float) -> None:
        """Tick every *interval* seconds, and at once when a report says an instance failed or restarted."""
        while True:
            self.kick.clear()
            self.tick()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.kick.wait()

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- resharding -----------------------------------------------------------------------------------------------

    def shard_map(self, map_id: str) -> ShardMap:
        found = self.maps.get(map_id)
        if found is None:
            raise NotFound(f"no shard map {map_id!r}")
        return found

    def register_map(self, shard_map: ShardMap) -> None:
        """Make *shard_map* the authoritative version of a map the PC does not hold yet (a new parallel group)."""
        if shard_map.map in self.maps:
            raise PlanConflict(f"map {shard_map.map!r} exists at version {self.maps[shard_map.map].version}")
        self.maps[shard_map.map] = shard_map

    async def reshard(self, new: ShardMap, deadline_ms: int | None = None) -> ReshardOutcome:
        """Move a map from version v to v+1 = ``new.version`` (spec, "Sequence-Sharded Caches and Resharding"):
        send every member its plan; when all acknowledged (200, after loading their fetch ranges) within
        ``deadline_ms``, commit to all members and make v+1 authoritative; otherwise abort to all members and keep
        v."""
        old = self.shard_map(new.map)
        if new.map in self._resharding:
            raise PlanConflict(f"a reshard of map {new.map!r} is in progress")
        deadline_ms = deadline_ms or self.config.reshard_deadline_ms
        plans = plan_reshard(old, new, deadline_ms)
        everyone = members(old, new)
        outcome = ReshardOutcome(new.map, old.version, committed=False)
        self._resharding.add(new.map)
        try:
            deadline = deadline_ms / 1000
            tasks = {asyncio.create_task(self.link.reshard(i, plans[i], deadline)): i for i in everyone}
            done, pending = await asyncio.wait(tasks, timeout=deadline, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:
                task.cancel()
                outcome.failed[tasks[task]] = f"no acknowledgement within {deadline_ms} ms"
            for task in done:
                exc = task.exception()
                if exc is None:
                    outcome.acknowledged.append(tasks[task])
                else:
                    outcome.failed[tasks[task]] = f"{type(exc).__name__}: {exc}"
            if pending:
                await asyncio.wait(pending)
                for task in pending:
                    if not task.cancelled():
                        task.exception()  # retrieved: it is reported in outcome.failed already
            outcome.acknowledged.sort(key=everyone.index)
            message: ReshardMessage
            if not outcome.failed:
                message = ReshardCommit(new.map, new.version)
                self.maps[new.map] = new  # v+1 is authoritative once every member acknowledged
                outcome.committed, outcome.version = True, new.version
            else:
                message = ReshardAbort(new.map, new.version)
            results = await asyncio.gather(*(self.link.reshard(i, message) for i in everyone),
                                           return_exceptions=True)
            for instance, result in zip(everyone, results, strict=True):
                if isinstance(result, BaseException):
                    outcome.undelivered[instance] = f"{type(result).__name__}: {result}"
        finally:
            self._resharding.discard(new.map)
        self.m_reshards.labels(outcome="committed" if outcome.committed else "aborted").inc()
        log.info("reshard of map %s to version %d %s", new.map, new.version,
                 "committed" if outcome.committed else f"aborted ({outcome.failed})")
        return outcome


__all__ = [
    "Choice", "CommandStarter", "ControllerConfig", "InstanceLink", "PlacementController", "ReshardOutcome",
    "Session", "Starter", "rank",
]
