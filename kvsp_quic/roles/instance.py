"""The Inference Instance role (spec: "Instance Status and Lifecycle", "Prefetch Directives", "Session Checkpoints
and Migration", "Sequence-Sharded Caches and Resharding") as plain objects with an injected monotonic clock.

No torch, no asyncio, no HTTP: ``gpu/engine.py`` runs the model, ``http3/instance_app.py`` translates requests and
drives the timers (docs/inference.md is the contract with the Placement Controller and the front end).

* :class:`Lifecycle` -- ``active`` / ``draining`` / ``sleeping``: new sessions only when active; a draining
  instance finishes what it admitted, then sleeps and reports it; a sleeping one wakes only on ``PUT state`` from
  the PC; after ``sleep_after_idle_s`` without a session it asks to sleep (``requested_state``), and the PC's
  answer to that report (``draining``/``sleeping``: accepted, ``active``: refused) is applied.
* :class:`DirectiveTable` -- prefetch directives: quotas, idempotent re-sends, blocks already held count as loaded
  at once, the deadline turns a directive ``partial``; finished directives are kept for ``directive_retention_s``.
* :class:`Session` / :class:`SessionTable` -- epochs (a lower epoch is refused with ``kvsp-stale-epoch``; a higher
  one supersedes the run in progress), the output tokens with their indices, when a checkpoint is due (a block of
  generated tokens completes, ``checkpoint_tokens`` tokens since the last, the end), and which tokens may be
  released to the front end (all with a deterministic sampler or without a PC; otherwise those covered by an
  acknowledged checkpoint).
* :class:`ReshardBook` -- the map versions and plans of sequence-sharded contexts, with commit / abort exactly as
  the spec orders them; which blocks to keep, fetch and drop is returned to the caller.
* :class:`InstanceRole` -- all of the above plus the Instance Status Record (rates, links, utilization).
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsp_quic import fields as f
from kvsp_quic.compat import InstanceState
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.problems import (
    BadRequest,
    Incompatible,
    InvalidState,
    NotFound,
    PlanConflict,
    Problem,
    StaleEpoch,
    TooManyRequests,
)
from kvsp_quic.records import (
    InstanceStatusRecord,
    Link,
    PrefetchDirective,
    PrefetchState,
    PrefetchStatus,
    Record,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    Sampler,
    SessionCheckpoint,
    TokenRange,
    wire,
)

Clock = Callable[[], float]
MAX_CHECKPOINT_TOKENS = 64  # spec: "at least every 64 output tokens"


@dataclass(frozen=True)
class InstanceSettings:
    base_uri: str  # the instance's base URI (the "instance" of its status records, and its holder URI)
    compat_id: bytes  # the Compatibility ID of its cache
    block_tokens: int
    status_ttl_ms: int = 3000  # ttl_ms of status records; reported every third of it
    max_running: int = 4  # sessions computed at once (batch_size)
    max_queued: int = 64  # admitted sessions waiting for a slot
    max_directives: int = 64  # pending prefetch directives (spec, Security Considerations: a required quota)
    max_directive_blocks: int = 8192
    directive_retention_s: float = 600.0  # finished directives answer GET this long
    session_retention_s: float = 600.0  # finished sessions answer GET tokens this long
    checkpoint_tokens: int = 16  # a checkpoint at least every this many output tokens (<= 64)
    max_tokens: int = 4096  # per session (a resume without max_tokens gets this)
    max_prompt_tokens: int = 1 << 17
    sleep_after_idle_s: float | None = None  # ask to sleep after this long without sessions (None: never)
    deterministic_greedy: bool = True  # greedy output is bit-identical on every eligible instance (see docs)
    controller: bool = True  # a PC acknowledges checkpoints (False: tokens are released at once)

    def __post_init__(self) -> None:
        f.base_uri(self.base_uri, "instance base URI")
        if len(self.compat_id) != 32 or self.block_tokens < 1:
            raise ValueError("compat_id is 32 octets and block_tokens positive")
        if not 1 <= self.checkpoint_tokens <= MAX_CHECKPOINT_TOKENS:
            raise ValueError(f"checkpoint_tokens must be 1..{MAX_CHECKPOINT_TOKENS}")
        for name in ("status_ttl_ms", "max_running", "max_directives", "max_tokens", "max_prompt_tokens",
                     "max_directive_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.max_queued < 0:
            raise ValueError("max_queued must not be negative")


# -- Lifecycle --------------------------------------------------------------------------------------------------


class Lifecycle:
    """The instance's state (spec, "Instance Status and Lifecycle"). ``failed`` is what the PC concludes when
    reports stop; an instance is never put into it."""

    def __init__(self, clock: Clock, *, sleep_after_idle_s: float | None = None) -> None:
        self._clock = clock
        self.sleep_after_idle_s = sleep_after_idle_s
        self.state = InstanceState.ACTIVE
        self.in_flight = 0
        self._idle_since: float | None = clock()
        self.changed = False  # a report is due because the state changed
        self.history: list[InstanceState] = [self.state]

    def _enter(self, state: InstanceState) -> None:
        if state is not self.state:
            self.state = state
            self.changed = True
            self.history = [*self.history[-63:], state]
        if state is InstanceState.ACTIVE and self.in_flight == 0:
            self._idle_since = self._clock()

    def admit(self) -> None:
        """New work (a session, a directive) is allowed only when active (409 kvsp-invalid-state otherwise)."""
        if self.state is not InstanceState.ACTIVE:
            raise InvalidState(f"the instance is {self.state.value}: it accepts no new sessions or directives")

    def set_by_controller(self, state: InstanceState) -> InstanceState:
        """``PUT state`` from the PC. ``draining`` and ``sleeping`` both stop admissions; the instance sleeps once
        its in-flight sessions are done (at once when there are none). Returns the state now held."""
        if state is InstanceState.FAILED:
            raise InvalidState("an instance cannot be put into the failed state; the PC concludes it")
        if state is InstanceState.ACTIVE:
            self._enter(InstanceState.ACTIVE)
        else:
            self._enter(InstanceState.DRAINING)
            self._settle()
        return self.state

    def sessions_changed(self, in_flight: int) -> None:
        self.in_flight = in_flight
        if in_flight:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = self._clock()
        self._settle()

    def _settle(self) -> None:
        if self.state is InstanceState.DRAINING and self.in_flight == 0:
            self._enter(InstanceState.SLEEPING)

    def requested_state(self) -> InstanceState | None:
        """``sleeping`` once the instance has been idle and active for ``sleep_after_idle_s``."""
        if (self.sleep_after_idle_s is not None and self.state is InstanceState.ACTIVE and self.in_flight == 0
                and self._idle_since is not None and self._clock() - self._idle_since >= self.sleep_after_idle_s):
            return InstanceState.SLEEPING
        return None

    def answer(self, held: InstanceState, requested: InstanceState | None) -> None:
        """The PC's answer ``{"state"}`` to a status report that carried *requested*. Only a report that asked to
        sleep changes anything: ``draining`` or ``sleeping`` accept (the instance drains, then sleeps),
        ``active`` refuses (the idle timer starts again). Other differences are left to ``PUT state``."""
        if requested is not InstanceState.SLEEPING or self.state is not InstanceState.ACTIVE:
            return
        if held in (InstanceState.DRAINING, InstanceState.SLEEPING):
            self._enter(InstanceState.DRAINING)
            self._settle()
        else:
            self._idle_since = self._clock()


# -- Prefetch directives ------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Directive:
    record: PrefetchDirective
    keys: tuple[bytes, ...]  # distinct, in the directive's order
    received_at: float
    deadline: float
    loaded: set[bytes] = field(default_factory=set)
    failed: set[bytes] = field(default_factory=set)
    state: PrefetchState = PrefetchState.PENDING
    finished_at: float | None = None

    @property
    def id(self) -> uuid.UUID:
        return self.record.directive

    @property
    def pending(self) -> list[bytes]:
        return [k for k in self.keys if k not in self.loaded and k not in self.failed]

    def sources(self, key: bytes) -> tuple[str, ...]:
        return next(b.sources for b in self.record.blocks if bytes(b.block_key) == key)

    def status(self) -> PrefetchStatus:
        loaded = tuple(BlockKey(k) for k in self.keys if k in self.loaded)
        return PrefetchStatus(directive=self.id, state=self.state, loaded=loaded)


class DirectiveTable:
    def __init__(self, settings: InstanceSettings, clock: Clock) -> None:
        self.settings = settings
        self._clock = clock
        self._all: dict[uuid.UUID, Directive] = {}

    def __len__(self) -> int:
        return len(self._all)

    def pending_count(self) -> int:
        return sum(1 for d in self._all.values() if d.state is PrefetchState.PENDING)

    def accept(self, record: PrefetchDirective, held: Callable[[bytes], bool]) -> tuple[Directive, bool]:
        """A new directive (or the one already known by that id: (it, False) -- a re-sent POST is idempotent).
        Blocks *held* already are loaded at once; a directive with nothing left to load is complete."""
        self.sweep()
        known = self._all.get(record.directive)
        if known is not None:
            if known.record != record:
                raise Problem(f"directive {record.directive} exists with other contents", status=409)
            return known, False
        if bytes(record.compat_id) != self.settings.compat_id:
            raise Incompatible(f"this instance's cache has Compatibility ID {self.settings.compat_id.hex()}")
        if self.pending_count() >= self.settings.max_directives:
            raise TooManyRequests(f"{self.settings.max_directives} directives are pending; try again later")
        keys = tuple(dict.fromkeys(bytes(b.block_key) for b in record.blocks))
        if len(keys) > self.settings.max_directive_blocks:
            raise BadRequest(f"blocks: at most {self.settings.max_directive_blocks} per directive")
        now = self._clock()
        d = Directive(record, keys, now, now + record.deadline_ms / 1000)
        d.loaded = {k for k in keys if held(k)}
        self._all[d.id] = d
        self._settle(d)
        return d, True

    def known(self, directive: uuid.UUID) -> bool:
        return directive in self._all

    def get(self, directive: uuid.UUID) -> Directive:
        d = self._all.get(directive)
        if d is None:
            raise NotFound(f"no directive {directive}")
        return d

    def status(self, directive: uuid.UUID) -> PrefetchStatus:
        self.expire()
        return self.get(directive).status()

    def block_loaded(self, d: Directive, key: bytes) -> None:
        if d.state is PrefetchState.PENDING and key in d.keys:
            d.loaded.add(key)
            d.failed.discard(key)
            self._settle(d)

    def block_failed(self, d: Directive, key: bytes) -> None:
        if d.state is PrefetchState.PENDING and key in d.keys and key not in d.loaded:
            d.failed.add(key)
            self._settle(d)

    def _settle(self, d: Directive) -> None:
        if d.state is not PrefetchState.PENDING or d.pending:
            return
        if len(d.loaded) == len(d.keys):
            self._finish(d, PrefetchState.COMPLETE)
        else:
            self._finish(d, PrefetchState.PARTIAL if d.loaded else PrefetchState.FAILED)

    def _finish(self, d: Directive, state: PrefetchState) -> None:
        d.state = state
        d.finished_at = self._clock()

    def expire(self) -> list[Directive]:
        """Directives whose deadline passed while loading: now ``partial`` (the caller stops their loads)."""
        now = self._clock()
        out = []
        for d in self._all.values():
            if d.state is PrefetchState.PENDING and now >= d.deadline:
                self._finish(d, PrefetchState.PARTIAL)
                out.append(d)
        return out

    def next_deadline(self) -> float | None:
        return min((d.deadline for d in self._all.values() if d.state is PrefetchState.PENDING), default=None)

    def sweep(self) -> None:
        now = self._clock()
        keep = self.settings.directive_retention_s
        for d in [d for d in self._all.values() if d.finished_at is not None and now - d.finished_at > keep]:
            del self._all[d.id]


# -- Sessions -----------------------------------------------------------------------------------------------------


class Phase(enum.Enum):
    QUEUED = "queued"  # admitted, waiting for a compute slot
    PREFILL = "prefill"  # loading and computing the prompt (or rebuilding after a resume)
    DECODE = "decode"
    DONE = "done"  # finished: reason "length" or "stop"
    FAILED = "failed"  # finished with reason "error"
    SUPERSEDED = "superseded"  # fenced: a newer epoch runs elsewhere (or here); its stream ends without a done line

    @property
    def finished(self) -> bool:
        return self in (Phase.DONE, Phase.FAILED, Phase.SUPERSEDED)


@dataclass(eq=False)
class Session:
    """One session's run at this instance in one epoch. Output indices count from the session's first token;
    after a resume, ``output[:base_offset]`` are the checkpoint's tokens."""

    id: uuid.UUID
    epoch: int
    compat_id: CompatId
    scope_id: ScopeId
    prompt_len: int
    prompt_blocks: tuple[BlockKey, ...]
    prompt_tail: tuple[int, ...]
    max_tokens: int
    method: str
    params: Mapping[str, Any]
    seed: int
    base_step: int  # the sampler's step at output index base_offset
    base_offset: int
    deterministic: bool
    block_tokens: int
    checkpoint_tokens: int
    gated: bool  # tokens are released only once an acknowledged checkpoint covers them
    stop: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    phase: Phase = Phase.QUEUED
    reason: str | None = None  # "length" | "stop" | "error" once finished
    detail: str = ""
    acked: int = 0  # output_offset of the latest acknowledged checkpoint
    snapshot_offset: int = 0  # output_offset of the latest checkpoint made
    pending: SessionCheckpoint | None = None  # made and not yet sent
    in_flight: int | None = None  # output_offset of the checkpoint being sent
    started_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    loaded_blocks: int = 0  # blocks whose K and V were loaded rather than computed
    recomputed_tokens: int = 0  # prompt (or, after a resume, sequence) tokens computed by the prefill
    block_sources: dict[str, int] = field(default_factory=dict)  # loaded blocks by where from ("HTTP/3", ...)
    listeners: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.acked = self.snapshot_offset = self.base_offset

    def notify(self) -> None:
        for listener in list(self.listeners):
            listener()

    @property
    def length(self) -> int:
        """Tokens of the sequence so far (prompt and output)."""
        return self.prompt_len + len(self.output)

    @property
    def remaining(self) -> int:
        return max(0, self.max_tokens - len(self.output))

    def sampler(self) -> Sampler:
        """The checkpointable sampler state after the current output."""
        return Sampler(method=self.method, seed=self.seed, step=self.base_step + len(self.output) - self.base_offset,
                       deterministic=self.deterministic, params=dict(self.params))

    def append(self, token: int, now: float) -> bool:
        """One more output token; True when a checkpoint was made (a generated block completed, or
        ``checkpoint_tokens`` since the last one)."""
        if self.phase.finished:
            raise RuntimeError(f"session {self.id} is {self.phase.value}")
        self.output.append(token)
        if self.first_token_at is None:
            self.first_token_at = now
        due = self.length % self.block_tokens == 0 or len(self.output) - self.snapshot_offset >= \
            self.checkpoint_tokens
        if due:
            self.snapshot()
        self.notify()
        return due

    def snapshot(self) -> None:
        self.pending = self.checkpoint()
        self.snapshot_offset = len(self.output)

    def checkpoint(self) -> SessionCheckpoint:
        return SessionCheckpoint(session=self.id, epoch=self.epoch, compat_id=self.compat_id, scope_id=self.scope_id,
                                 prompt_blocks=self.prompt_blocks, prompt_tail=self.prompt_tail,
                                 generated=tuple(self.output), output_offset=len(self.output), sampler=self.sampler())

    def take_checkpoint(self) -> SessionCheckpoint | None:
        """The latest checkpoint to send (None: nothing new, or one is in flight)."""
        if self.pending is None or self.in_flight is not None:
            return None
        cp, self.pending = self.pending, None
        self.in_flight = cp.output_offset
        return cp

    def checkpoint_done(self, offset: int, acknowledged: bool) -> None:
        """The PC answered the checkpoint of *offset* (200), or it failed (retry: it is pending again unless a
        newer one was made meanwhile)."""
        self.in_flight = None
        if acknowledged:
            self.acked = max(self.acked, offset)
        elif self.pending is None and offset > self.acked and self.phase is not Phase.SUPERSEDED:
            self.snapshot()  # made anew (it covers whatever was generated meanwhile too)
        self.notify()

    @property
    def checkpoints_settled(self) -> bool:
        return self.pending is None and self.in_flight is None

    def finish(self, phase: Phase, reason: str | None, now: float, detail: str = "") -> None:
        if self.phase.finished:
            return
        self.phase = phase
        self.reason = reason
        self.detail = detail
        self.finished_at = now
        if phase is Phase.DONE and (self.pending is None or len(self.output) > self.snapshot_offset):
            self.snapshot()  # the final checkpoint (sent with "done": true), even when it covers nothing new
        self.notify()

    def info(self) -> dict[str, Any]:
        """*(extension)* ``GET sessions/{id}``: where the run stands."""
        ttft = None if self.first_token_at is None else round((self.first_token_at - self.started_at) * 1000, 3)
        return {"session": str(self.id), "epoch": self.epoch, "state": self.phase.value, "reason": self.reason,
                "output_offset": len(self.output), "released": self.releasable(), "prompt_tokens": self.prompt_len,
                "loaded_blocks": self.loaded_blocks, "computed_tokens": self.recomputed_tokens,
                "block_sources": dict(self.block_sources), "ttft_ms": ttft}

    def releasable(self) -> int:
        """Output indices [0, n) may be sent to the front end."""
        return min(self.acked, len(self.output)) if self.gated else len(self.output)

    def stream_done(self, position: int) -> bool:
        """Whether a stream at *position* has sent everything it ever will (then the final line, if any)."""
        if not self.phase.finished:
            return False
        if self.phase is Phase.SUPERSEDED:
            return True
        if not self.gated:
            return position >= len(self.output)
        return self.checkpoints_settled and position >= self.releasable()


class SessionTable:
    def __init__(self, settings: InstanceSettings, clock: Clock) -> None:
        self.settings = settings
        self._clock = clock
        self.sessions: dict[uuid.UUID, Session] = {}
        self.epochs: dict[uuid.UUID, int] = {}  # the highest epoch seen per session (kept after it ends)

    def get(self, session: uuid.UUID) -> Session:
        s = self.sessions.get(session)
        if s is None:
            raise NotFound(f"no session {session} at this instance")
        return s

    def in_flight(self) -> int:
        return sum(1 for s in self.sessions.values() if not s.phase.finished)

    def running(self) -> int:
        return sum(1 for s in self.sessions.values() if s.phase in (Phase.PREFILL, Phase.DECODE))

    def queued(self) -> int:
        return sum(1 for s in self.sessions.values() if s.phase is Phase.QUEUED)

    def check_epoch(self, session: uuid.UUID, epoch: int) -> Session | None:
        """Fencing: a lower epoch than seen is refused (409 kvsp-stale-epoch); the epoch of the run admitted here
        returns that run (a re-sent request); a higher one is a new run."""
        highest = self.epochs.get(session)
        if highest is not None and epoch < highest:
            raise StaleEpoch(f"session {session}: epoch {epoch} is older than {highest}")
        current = self.sessions.get(session)
        if current is not None and current.epoch == epoch:
            return current
        return None

    def capacity_check(self) -> None:
        limit = self.settings.max_running + self.settings.max_queued
        if self.in_flight() >= limit:
            raise TooManyRequests(f"{limit} sessions are admitted; try again later")

    def add(self, session: Session) -> Session | None:
        """Admit *session*; returns the run of an older epoch it supersedes, if one is still in flight."""
        old = self.sessions.get(session.id)
        self.epochs[session.id] = session.epoch
        self.sessions[session.id] = session
        session.started_at = self._clock()
        if old is not None and not old.phase.finished:
            old.finish(Phase.SUPERSEDED, None, self._clock(), f"superseded by epoch {session.epoch}")
            return old
        return None

    def fence(self, session: Session, detail: str) -> None:
        """The PC refused a checkpoint with kvsp-stale-epoch: another instance serves a newer epoch."""
        self.epochs[session.id] = max(self.epochs.get(session.id, 0), session.epoch + 1)  # a newer one exists
        session.finish(Phase.SUPERSEDED, None, self._clock(), detail)

    def sweep(self) -> None:
        now = self._clock()
        keep = self.settings.session_retention_s
        for s in [s for s in self.sessions.values() if s.finished_at is not None and now - s.finished_at > keep
                  and s.checkpoints_settled]:
            del self.sessions[s.id]


# -- Measurements for the status record ---------------------------------------------------------------------------


class RateMeter:
    """An exponential moving average of a rate (tokens per second)."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value is None else self.alpha * rate + (1 - self.alpha) * self.value


@dataclass
class _LinkEstimate:
    mbit: RateMeter = field(default_factory=RateMeter)
    rtt_us: RateMeter = field(default_factory=RateMeter)


class LinkMeter:
    """Links to holders for the status record: configured ones as given, others measured from the blocks loaded
    from them (throughput from the first to the last layer of a block, and the time to its first layer as an
    upper bound of the round trip)."""

    def __init__(self, configured: Iterable[Link] = ()) -> None:
        self.configured = {link.holder: link for link in configured}
        self._measured: dict[str, _LinkEstimate] = {}

    def observe(self, holder: str, octets: int, transfer_s: float, first_layer_s: float) -> None:
        est = self._measured.setdefault(holder, _LinkEstimate())
        if transfer_s > 0:
            est.mbit.add(octets * 8 / 1e6, transfer_s)
        if first_layer_s > 0:
            est.rtt_us.add(first_layer_s * 1e6, 1.0)

    def links(self) -> tuple[Link, ...]:
        out = dict(self.configured)
        for holder, est in self._measured.items():
            if holder not in out and est.mbit.value is not None:
                out[holder] = Link(holder=holder, mbit_per_s=round(est.mbit.value, 1),
                                   rtt_us=round(est.rtt_us.value or 0.0))
        return tuple(out[h] for h in sorted(out))


# -- Resharding --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReshardContext(Record):
    """*(extension)* ``"context"`` of a reshard plan: the blocks of the map's context, so that the instance can
    name the token ranges it fetches (block i covers tokens [i*B, (i+1)*B)). KVSP plans carry token ranges only."""

    compat_id: CompatId = wire(f.compat_id)
    scope_id: ScopeId = wire(f.scope_id)
    block_keys: tuple[BlockKey, ...] = wire(lambda v, p: f.array(v, p, f.block_key, nonempty=True))


@dataclass
class MapState:
    map: str
    version: int  # the version authoritative at this instance
    context: ReshardContext | None = None
    held: set[int] = field(default_factory=set)  # block indexes this instance keeps for the map (pinned)
    plan: ReshardPlan | None = None  # the plan of version + 1 being prepared
    fetched: set[int] = field(default_factory=set)  # blocks loaded for the plan (discarded on abort)
    acknowledged: bool = False  # every fetch of the plan is in


@dataclass(frozen=True)
class PlanSteps:
    """What the caller does for a plan: make *retain* blocks resident and keep them (they must not move),
    fetch *fetch* blocks from their instance."""

    state: MapState
    retain: tuple[int, ...]
    fetch: tuple[tuple[int, str], ...]  # (block index, the instance to fetch it from)
    new: bool  # False: the same plan again (idempotent), nothing to do


class ReshardBook:
    """Map versions and plans of the contexts this instance holds shards of (spec, "Sequence-Sharded Caches and
    Resharding"). Token ranges are handled as the complete blocks they cover: a range must start on a block
    boundary and end on one (or at the end of the context, whose partial last block has no key)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.maps: dict[str, MapState] = {}

    def blocks_of(self, tokens: TokenRange, context: ReshardContext | None, what: str) -> range:
        a, b = tokens
        bt = self.block_tokens
        total = len(context.block_keys) * bt if context is not None else None
        if a % bt:
            raise BadRequest(f"{what} [{a}, {b}): ranges start on a block boundary (block_tokens {bt})")
        if b % bt and (total is None or b < total):
            raise BadRequest(f"{what} [{a}, {b}): ranges end on a block boundary (block_tokens {bt})")
        last = b // bt if total is None else min(b // bt, len(context.block_keys)) if context else b // bt
        return range(a // bt, last)

    def plan(self, plan: ReshardPlan, context: ReshardContext | None) -> PlanSteps:
        state = self.maps.get(plan.map)
        if state is None:
            state = MapState(plan.map, plan.from_version, context)
            self.maps[plan.map] = state
        if context is not None:
            if state.context is not None and state.context != context:
                raise PlanConflict(f"map {plan.map}: the plan names another context than before")
            state.context = context
        if state.plan is not None:
            if state.plan == plan:
                return PlanSteps(state, (), (), False)
            raise PlanConflict(f"map {plan.map}: a plan to version {state.plan.to_version} is in progress")
        if state.version != plan.from_version:
            raise PlanConflict(f"map {plan.map}: this instance holds version {state.version}, the plan moves from "
                               f"{plan.from_version}")
        if plan.fetch and state.context is None:
            raise BadRequest("fetch: this instance needs the plan's context (extension member 'context': compat_id, "
                             "scope_id, block_keys) to name the blocks of the ranges it fetches")
        retain = tuple(i for r in plan.retain for i in self.blocks_of(r, state.context, "retain"))
        fetch = tuple((i, x.source) for x in plan.fetch for i in self.blocks_of(x.tokens, state.context, "fetch"))
        for r in plan.release:
            self.blocks_of(r, state.context, "release")
        state.plan = plan
        state.fetched = set()
        state.acknowledged = False
        return PlanSteps(state, retain, fetch, True)

    def retained(self, state: MapState, blocks: Iterable[int]) -> None:
        state.held.update(blocks)

    def fetched(self, state: MapState, blocks: Iterable[int]) -> None:
        state.fetched.update(blocks)

    def acknowledge(self, state: MapState) -> None:
        state.acknowledged = True

    def commit(self, msg: ReshardCommit) -> tuple[MapState, set[int]]:
        """Version ``commit`` becomes authoritative; returns the blocks to let go (``release`` of the plan)."""
        state = self.maps.get(msg.map)
        if state is None:
            raise PlanConflict(f"no plan for map {msg.map} at this instance")
        if state.plan is None:
            if state.version == msg.commit:
                return state, set()  # committed already
            raise PlanConflict(f"map {msg.map}: no plan to version {msg.commit} (version {state.version} holds)")
        if state.plan.to_version != msg.commit:
            raise PlanConflict(f"map {msg.map}: the plan in progress moves to {state.plan.to_version}, not "
                               f"{msg.commit}")
        if not state.acknowledged:
            raise PlanConflict(f"map {msg.map}: the fetches of version {msg.commit} are not complete here")
        plan = state.plan
        state.held |= state.fetched
        drop: set[int] = set()
        for r in plan.release:
            drop.update(self.blocks_of(r, state.context, "release"))
        keep = {i for r in plan.retain for i in self.blocks_of(r, state.context, "retain")}
        keep |= {i for x in plan.fetch for i in self.blocks_of(x.tokens, state.context, "fetch")}
        drop -= keep
        state.held -= drop
        state.version = msg.commit
        state.plan = None
        state.fetched = set()
        return state, drop

    def abort(self, msg: ReshardAbort) -> tuple[MapState | None, set[int]]:
        """Version ``abort`` is abandoned; returns the blocks fetched for it (to discard). Version v stays."""
        state = self.maps.get(msg.map)
        if state is None:
            return None, set()
        if state.plan is None:
            if state.version == msg.abort:
                raise PlanConflict(f"map {msg.map}: version {msg.abort} was committed here")
            return state, set()  # nothing in progress: aborted already
        if state.plan.to_version != msg.abort:
            raise PlanConflict(f"map {msg.map}: the plan in progress moves to {state.plan.to_version}, not "
                               f"{msg.abort}")
        discard = state.fetched - state.held
        state.plan = None
        state.fetched = set()
        state.acknowledged = False
        return state, discard


# -- The role --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineFigures:
    """What the engine measures, for the status record."""

    kv_utilization: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None


class InstanceRole:
    def __init__(self, settings: InstanceSettings, *, epoch: int, clock: Clock,
                 links: Iterable[Link] = ()) -> None:
        self.settings = settings
        self.epoch = epoch  # the instance's epoch: its start time in ms since the Unix epoch (docs/inference.md)
        self._clock = clock
        self.lifecycle = Lifecycle(clock, sleep_after_idle_s=settings.sleep_after_idle_s)
        self.directives = DirectiveTable(settings, clock)
        self.sessions = SessionTable(settings, clock)
        self.reshard = ReshardBook(settings.block_tokens)
        self.links = LinkMeter(links)
        self._last_report: float | None = None
        self._requested: InstanceState | None = None
        self.reports = 0

    @property
    def clock(self) -> Clock:
        return self._clock

    # -- admission -----------------------------------------------------------------------------------------

    def admit_directive(self, record: PrefetchDirective, held: Callable[[bytes], bool]) -> tuple[Directive, bool]:
        if not self.directives.known(record.directive):
            self.lifecycle.admit()  # a re-sent directive is answered whatever the state
        return self.directives.accept(record, held)

    def new_session(self, *, session: uuid.UUID, epoch: int, compat_id: bytes, scope_id: bytes, prompt_len: int,
                    prompt_blocks: Sequence[bytes], prompt_tail: Sequence[int], max_tokens: int, sampler: Sampler,
                    stop: Iterable[int] = (), output: Sequence[int] = ()) -> tuple[Session, Session | None, bool]:
        """Admit a session run (start, or resume with the checkpoint's *output*). Returns (the run, the older run it
        supersedes, whether it is new: False for a re-sent request of the same epoch)."""
        same = self.sessions.check_epoch(session, epoch)
        if same is not None:
            return same, None, False
        self.lifecycle.admit()
        if bytes(compat_id) != self.settings.compat_id:
            raise Incompatible(f"this instance's cache has Compatibility ID {self.settings.compat_id.hex()}")
        self.sessions.capacity_check()
        if prompt_len > self.settings.max_prompt_tokens:
            raise BadRequest(f"prompt: at most {self.settings.max_prompt_tokens} tokens")
        deterministic = (sampler.method == "greedy" and self.settings.deterministic_greedy and sampler.deterministic)
        s = Session(id=session, epoch=epoch, compat_id=CompatId(bytes(compat_id)), scope_id=ScopeId(bytes(scope_id)),
                    prompt_len=prompt_len, prompt_blocks=tuple(BlockKey(bytes(k)) for k in prompt_blocks),
                    prompt_tail=tuple(prompt_tail), max_tokens=max_tokens, method=sampler.method,
                    params=dict(sampler.params), seed=sampler.seed, base_step=sampler.step, base_offset=len(output),
                    deterministic=deterministic, block_tokens=self.settings.block_tokens,
                    checkpoint_tokens=self.settings.checkpoint_tokens,
                    gated=self.settings.controller and not deterministic, stop=frozenset(stop), output=list(output))
        old = self.sessions.add(s)
        self.sessions_changed()
        return s, old, True

    def sessions_changed(self) -> None:
        self.lifecycle.sessions_changed(self.sessions.in_flight())

    def finish_session(self, session: Session, phase: Phase, reason: str | None, detail: str = "") -> None:
        session.finish(phase, reason, self._clock(), detail)
        self.sessions_changed()

    # -- status ------------------------------------------------------------------------------------------

    @property
    def report_interval(self) -> float:
        """Seconds between status reports: a third of the record's TTL."""
        return self.settings.status_ttl_ms / 3000

    def report_due(self) -> float:
        """Seconds until the next report is due (0: now)."""
        if self._last_report is None or self.lifecycle.changed:
            return 0.0
        return max(0.0, self._last_report + self.report_interval - self._clock())

    def status_record(self, figures: EngineFigures = EngineFigures()) -> InstanceStatusRecord:
        """The record to report now (and remember what it requested, for the PC's answer)."""
        self._requested = self.lifecycle.requested_state()
        prefill = figures.prefill_tokens_per_s
        decode = figures.decode_tokens_per_s
        return InstanceStatusRecord(
            instance=self.settings.base_uri, epoch=self.epoch, state=self.lifecycle.state,
            ttl_ms=self.settings.status_ttl_ms, running=self.sessions.running(), queued=self.sessions.queued(),
            batch_size=self.settings.max_running,
            kv_utilization=None if figures.kv_utilization is None else round(min(1.0, figures.kv_utilization), 4),
            prefill_tokens_per_s=None if prefill is None else round(prefill, 1),
            decode_tokens_per_s=None if decode is None else round(decode, 1),
            links=self.links.links(), requested_state=self._requested)

    def reported(self, answer: InstanceState | None) -> None:
        """A report went out (*answer*: the PC's ``{"state"}``, None when it failed)."""
        self._last_report = self._clock()
        self.reports += 1
        self.lifecycle.changed = False
        if answer is not None:
            self.lifecycle.answer(answer, self._requested)

    def sweep(self) -> list[Directive]:
        self.sessions.sweep()
        self.directives.sweep()
        return self.directives.expire()


__all__ = [
    "Directive", "DirectiveTable", "EngineFigures", "InstanceRole", "InstanceSettings", "Lifecycle", "LinkMeter",
    "MapState", "Phase", "PlanSteps", "RateMeter", "ReshardBook", "ReshardContext", "Session", "SessionTable",
]
