"""The Inference Instance role (spec: "Instance Status and Lifecycle", "Prefetch Directives", "Session Checkpoints
and Migration", "Sequence-Sharded Caches and Resharding") as plain objects with an injected monotonic clock.

No torch, no asyncio, no HTTP: the engine (``gpu/engine.py``, behind :mod:`kvsp_quic.engine`) runs the model,
``kvsp_runtime/instance_service.py`` drives the timers and loads, ``kvsp_http/instance_app.py`` translates requests
(docs/inference.md is the contract with the Placement Controller and the front end).

* :class:`~kvsp_quic.roles.instance_lifecycle.Lifecycle` -- ``active`` / ``draining`` / ``sleeping`` (a transition
  table: :mod:`kvsp_quic.roles.instance_lifecycle`): new sessions only when active; a draining
  instance finishes what it admitted, then sleeps and reports it; a sleeping one wakes only on ``PUT state`` from
  the PC; after ``sleep_after_idle_ms`` without a session it asks to sleep (``requested_state``), and the PC's
  answer to that report (``draining``/``sleeping``: accepted, ``active``: refused) is applied.
* :class:`DirectiveTable` -- prefetch directives: quotas, idempotent re-sends, blocks already held count as loaded
  at once, the deadline turns a directive ``partial``; finished directives are kept for ``directive_retention_ms``.
* :class:`~kvsp_quic.roles.instance_sessions.InstanceSession` / :class:`~kvsp_quic.roles.instance_sessions.
  SessionTable` -- the runs of sessions: epochs, output indices, when a checkpoint is due, which tokens may be
  released (:mod:`kvsp_quic.roles.instance_sessions`).
* :class:`~kvsp_quic.roles.instance_reshard.ReshardBook` -- the map versions and plans of sequence-sharded
  contexts (:mod:`kvsp_quic.roles.instance_reshard`).
* :class:`InstanceRole` -- all of the above, the checks of a session start or resume (scope key, compatibility,
  token ids, the Block Keys and tail of the prompt, the sampler and its step, limits: :class:`Admission`), the
  context of a reshard plan, and the Instance Status Record (rates, links, utilization).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from kvsp_quic import fields as f
from kvsp_quic.auth import Principal, require_scope
from kvsp_quic.compat import InstanceState
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.problems import (
    BadRequest,
    Incompatible,
    NotFound,
    PlanConflict,
    Problem,
    ScopeDenied,
    TooManyRequests,
)
from kvsp_quic.records import (
    EngineStatus,
    InstanceStatusRecord,
    Link,
    PrefetchDirective,
    PrefetchState,
    PrefetchStatus,
    ReshardPlan,
    Sampler,
)
from kvsp_quic.roles.controller_records import SessionResume, SessionStart
from kvsp_quic.roles.instance_lifecycle import Lifecycle
from kvsp_quic.roles.instance_reshard import MapState, PlanSteps, ReshardBook, ReshardContext
from kvsp_quic.roles.instance_sessions import Clock, InstanceSession, Phase, SessionTable

MAX_CHECKPOINT_TOKENS = 64  # spec: "at least every 64 output tokens"
ENGINE_NAMES = ("reference", "transformers")  # the engines of gpu/ (docs/inference.md, "Engines")


def next_instance_epoch(previous: int | None, now_ms: int) -> int:
    """The epoch of an instance starting now, from the one it persisted at its previous start (None: none).

    Spec, "Instance Status and Lifecycle": 'The "epoch" of an instance MUST increase every time it restarts; the
    start time of the instance in milliseconds since the Unix epoch satisfies this without persistent state,
    provided that the instance's clock does not move backward across restarts; otherwise the instance persists a
    counter.' The counter persisted here goes up by one at every start, and never below the start time in ms, so
    that it stays above the epochs of instances that used the start time (a PC remembers the highest epoch of
    each instance: a counter restarting at 1 would be discarded there) -- and a clock set back leaves it
    increasing by one per start."""
    if previous is not None and previous < 0:
        raise ValueError(f"a persisted epoch is not negative: {previous}")
    return now_ms if previous is None else max(previous + 1, now_ms)


@dataclass(frozen=True, kw_only=True)
class InstanceOptions:
    """What an instance's operator sets: the ``[instance]`` section of ``kvsp-quic instance``'s file has these
    fields (with the engine's and the service's: ``kvsp_app.config.InstanceSection``). Durations in
    milliseconds; the role reads seconds (``*_s``)."""

    status_ttl_ms: int = 3000  # ttl_ms of status records; reported every third of it
    max_running: int = 4  # sessions computed at once (batch_size)
    max_queued: int = 64  # admitted sessions waiting for a slot
    max_directives: int = 64  # pending prefetch directives (spec, Security Considerations: a required quota)
    max_directive_blocks: int = 8192
    directive_retention_ms: int = 600_000  # finished directives answer GET this long
    session_retention_ms: int = 600_000  # finished sessions answer GET tokens this long
    checkpoint_tokens: int = 16  # a checkpoint at least every this many output tokens (<= 64)
    max_tokens: int = 4096  # per session (a resume without max_tokens gets this)
    max_prompt_tokens: int = 1 << 17
    sleep_after_idle_ms: int | None = None  # ask to sleep after this long without sessions (None: never)
    deterministic_greedy: bool = True  # greedy output is bit-identical on every eligible instance (see docs)
    engine: str = "reference"  # what computes: "reference" (our Llama model) or "transformers" (its HF modules)
    # The file of the persisted instance epoch (next_instance_epoch; default with --dev: DIR/instance.epoch;
    # None without --dev: the start time in ms, which the spec allows only while the clock never moves backward)
    epoch_file: Path | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_NAMES:
            raise ValueError(f"engine: {self.engine!r} is not one of {', '.join(ENGINE_NAMES)}")
        if not 1 <= self.checkpoint_tokens <= MAX_CHECKPOINT_TOKENS:
            raise ValueError(f"checkpoint_tokens: at most {MAX_CHECKPOINT_TOKENS} (spec: a checkpoint at least "
                             f"every {MAX_CHECKPOINT_TOKENS} tokens), and positive")
        for name in ("status_ttl_ms", "max_running", "max_directives", "max_tokens", "max_prompt_tokens",
                     "max_directive_blocks", "directive_retention_ms", "session_retention_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive")
        if self.max_queued < 0:
            raise ValueError("max_queued: must not be negative")
        if self.sleep_after_idle_ms is not None and self.sleep_after_idle_ms < 1:
            raise ValueError("sleep_after_idle_ms: must be positive")

    @property
    def directive_retention_s(self) -> float:
        return self.directive_retention_ms / 1000

    @property
    def session_retention_s(self) -> float:
        return self.session_retention_ms / 1000

    @property
    def sleep_after_idle_s(self) -> float | None:
        return None if self.sleep_after_idle_ms is None else self.sleep_after_idle_ms / 1000


@dataclass(frozen=True)
class InstanceSettings(InstanceOptions):
    """An instance's settings: its :class:`InstanceOptions` and what its engine and wiring make it."""

    base_uri: str  # the instance's base URI (the "instance" of its status records, and its holder URI)
    compat_id: bytes  # the Compatibility ID of its cache
    block_tokens: int
    controller: bool = True  # a PC acknowledges checkpoints (False: tokens are released at once)
    vocab_size: int | None = None  # the model's: token ids are below it (None: not checked)

    def __post_init__(self) -> None:
        super().__post_init__()
        f.base_uri(self.base_uri, "instance base URI")
        if len(self.compat_id) != 32 or self.block_tokens < 1:
            raise ValueError("compat_id is 32 octets and block_tokens positive")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError("vocab_size must be positive")


@dataclass(frozen=True)
class ServiceOptions:
    """The settings of the instance's asyncio service (``kvsp_runtime.instance_service``), in ``[instance]`` of
    ``kvsp-quic instance``'s file with :class:`InstanceOptions`. Durations in milliseconds; read in seconds."""

    # The Placement Controller's base URIs (status reports, checkpoints; the client fails over between them)
    controller: Annotated[list[str], f.BASE_URIS] = field(default_factory=list)
    session_lease_ms: int | None = None  # leases for blocks a session start loads itself (None: none)
    request_timeout_ms: int = 10_000  # of each request to the Index Service, the PC, holders
    checkpoint_retry_ms: int = 500
    load_timeout_ms: int | None = 30_000  # a block still arriving after this long is recomputed (None: waits)
    # The transport tried first for https requests (blocks, lookups, checkpoints): "h3", or "tcp" (HTTP/1.1 over
    # TLS, the faster path for bulk blocks on this implementation: docs/performance.md). The other one is the
    # fallback either way; moqt:// replicas are fetched over MOQT first regardless (the [instance] moqt flag).
    prefer_transport: str = "h3"
    # QUIC connections per holder that block loads are spread over (HTTP/3: a holder with several workers on one
    # port gets one connection on each of up to this many); the HTTP/1.1 path opens one per concurrent load anyway.
    block_connections: int = 4
    # The producer-digest mode (issue 13; docs/wire.md, "Producer digests"): publish the digests of the blocks this
    # instance computes to the Index Service, and (require) load only replicas whose digests equal a producer's --
    # a block without one is recomputed. require_producer_digest implies publishing.
    publish_producer_digests: bool = False
    require_producer_digest: bool = False

    def __post_init__(self) -> None:
        if self.block_connections < 1:
            raise ValueError("block_connections: must be at least 1")
        object.__setattr__(self, "controller", f.base_uris(self.controller, "controller"))
        if self.prefer_transport not in ("h3", "tcp"):
            raise ValueError(f"prefer_transport: 'h3' or 'tcp', not {self.prefer_transport!r}")
        for name in ("session_lease_ms", "request_timeout_ms", "checkpoint_retry_ms", "load_timeout_ms"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be positive")

    @property
    def request_timeout_s(self) -> float:
        return self.request_timeout_ms / 1000

    @property
    def checkpoint_retry_s(self) -> float:
        return self.checkpoint_retry_ms / 1000

    @property
    def load_timeout_s(self) -> float | None:
        return None if self.load_timeout_ms is None else self.load_timeout_ms / 1000


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

    def next_due(self) -> float | None:
        """When :meth:`expire` or :meth:`sweep` next has work: the next deadline, or the end of a retention."""
        keep = self.settings.directive_retention_s
        kept = (d.finished_at + keep for d in self._all.values() if d.finished_at is not None)
        return min((t for t in (self.next_deadline(), min(kept, default=None)) if t is not None), default=None)

    def sweep(self) -> None:
        now = self._clock()
        keep = self.settings.directive_retention_s
        for d in [d for d in self._all.values() if d.finished_at is not None and now - d.finished_at > keep]:
            del self._all[d.id]


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


# -- The role --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineFigures:
    """What the engine measures, for the status record."""

    kv_utilization: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None


def with_prompt_tokens(sampler: Sampler, prompt: Sequence[int]) -> Sampler:
    """*sampler* with the prompt's distinct token ids as its ``prompt_tokens`` when it asks for a repetition
    penalty (which counts the prompt's tokens too): the checkpoint carries them, since a resumed run may not know the
    prompt's tokens (docs/inference.md, "Samplers")."""
    if sampler.params.get("repetition_penalty", 1) == 1 or "prompt_tokens" in sampler.params:
        return sampler
    return dataclasses.replace(sampler, params={**sampler.params, "prompt_tokens": sorted(set(prompt))})


SamplerCheck = Callable[[Sampler], None]  # raises ValueError for a sampler the engine cannot run


@dataclass(frozen=True)
class Admission:
    """A session start or resume that passed the role's checks."""

    session: InstanceSession  # the run: new, or the one admitted before (a re-sent request of its epoch)
    superseded: InstanceSession | None  # the run of an older epoch it ended, if one was in flight
    new: bool  # False: a re-sent request of the admitted epoch; nothing to compute
    keyer: BlockKeyer  # the scope's: names the pages the run completes


class InstanceRole:
    """The instance's protocol state and rules. *keyers*: the scope keys this instance holds (one
    :class:`~kvsp_quic.keys.BlockKeyer` per scope, for its Compatibility ID and block size); *check_sampler*: the
    engine's test of a sampler (None: any)."""

    def __init__(self, settings: InstanceSettings, *, epoch: int, clock: Clock, links: Iterable[Link] = (),
                 keyers: Iterable[BlockKeyer] = (), check_sampler: SamplerCheck | None = None) -> None:
        self.settings = settings
        self.epoch = epoch  # the instance's epoch: higher at every start (next_instance_epoch, docs/inference.md)
        self._clock = clock
        self.lifecycle = Lifecycle(clock, sleep_after_idle_s=settings.sleep_after_idle_s)
        self.directives = DirectiveTable(settings, clock)
        self.sessions = SessionTable(clock, capacity=settings.max_running + settings.max_queued,
                                     retention_s=settings.session_retention_s)
        self.reshard = ReshardBook(settings.block_tokens)
        self.links = LinkMeter(links)
        self.keyers: dict[bytes, BlockKeyer] = {}
        for keyer in keyers:
            if bytes(keyer.compat_id) != settings.compat_id or keyer.block_tokens != settings.block_tokens:
                raise ValueError(f"the scope key of scope {bytes(keyer.scope_id).hex()} is set up for another "
                                 f"Compatibility ID or block size")
            self.keyers[bytes(keyer.scope_id)] = keyer
        self._check_sampler = check_sampler
        self._last_report: float | None = None
        self._requested: InstanceState | None = None
        # the engine's (name, build), reported as the "engine" status extension (set by the service)
        self.engine_identity: tuple[str, str] | None = None
        self.reports = 0

    @property
    def clock(self) -> Clock:
        return self._clock

    # -- admission -----------------------------------------------------------------------------------------

    def admit_directive(self, record: PrefetchDirective, held: Callable[[bytes], bool]) -> tuple[Directive, bool]:
        if not self.directives.known(record.directive):
            self.lifecycle.admit()  # a re-sent directive is answered whatever the state
        return self.directives.accept(record, held)

    def keyer(self, scope_id: bytes) -> BlockKeyer:
        """The Block Keyer of *scope_id* (403 kvsp-scope-denied when this instance holds no key for it)."""
        keyer = self.keyers.get(bytes(scope_id))
        if keyer is None:
            raise ScopeDenied(f"this instance holds no scope key for scope {bytes(scope_id).hex()} (configure it "
                              f"with --scope-key)")
        return keyer

    def start_session(self, principal: Principal, session: uuid.UUID, body: SessionStart) -> Admission:
        """``POST sessions/{session}/start``: the scope (of the principal, and a key for it here), the Compatibility
        ID, the prompt's token ids, the ``block_keys`` the PC looked up (a prefix of the prompt's Block Keys in
        the scope), the sampler and the limits; then :meth:`new_session`."""
        if body.session != session:
            raise BadRequest(f"session: {body.session} in a request for {session}")
        require_scope(principal, body.scope_id)
        keyer = self.keyer(body.scope_id)
        self._check_compat(body.compat_id)
        self._check_tokens(body.prompt, "prompt")
        keys = keyer.keys(body.prompt)
        if body.block_keys and tuple(bytes(k) for k in body.block_keys) != tuple(keys[:len(body.block_keys)]):
            raise BadRequest("block_keys: they are not the Block Keys of the prompt in this scope")
        sampler = with_prompt_tokens(body.sampler, body.prompt)
        self._sampler_ok(sampler)
        b = self.settings.block_tokens
        run, old, new = self.new_session(
            session=session, epoch=body.epoch, compat_id=body.compat_id, scope_id=body.scope_id,
            prompt_len=len(body.prompt), prompt_blocks=keys, prompt_tail=body.prompt[len(keys) * b:],
            max_tokens=self.max_tokens(body.max_tokens), sampler=sampler)
        return Admission(run, old, new, keyer)

    def resume_session(self, principal: Principal, session: uuid.UUID, body: SessionResume) -> Admission:
        """``POST sessions/{session}/resume``: the checkpoint's session, scope and Compatibility ID, its token ids,
        a tail shorter than a block, the ``prompt`` (when sent) against the checkpoint's blocks and tail; the
        generated tokens after ``output_offset`` are dropped and the sampler's step moved back by as many (they are
        generated again); then :meth:`new_session` with the covered output."""
        cp = body.checkpoint
        if cp.session != session:
            raise BadRequest(f"checkpoint.session: {cp.session} in a request for {session}")
        require_scope(principal, cp.scope_id)
        keyer = self.keyer(cp.scope_id)
        self._check_compat(cp.compat_id)
        b = self.settings.block_tokens
        self._check_tokens([*cp.prompt_tail, *cp.generated, *(body.prompt or ())], "checkpoint")
        prompt_len = len(cp.prompt_blocks) * b + len(cp.prompt_tail)
        if len(cp.prompt_tail) >= b:
            raise BadRequest(f"checkpoint.prompt_tail: {len(cp.prompt_tail)} tokens; a tail is shorter than a block")
        if body.prompt is not None and (
                len(body.prompt) != prompt_len or tuple(keyer.keys(body.prompt)) != tuple(cp.prompt_blocks)
                or tuple(body.prompt[len(cp.prompt_blocks) * b:]) != tuple(cp.prompt_tail)):
            raise BadRequest("prompt: it is not the prompt of the checkpoint's blocks and tail")
        offset = cp.output_offset
        if offset == 0 and not cp.prompt_tail and body.prompt is None and cp.prompt_blocks:
            raise BadRequest("a checkpoint at output_offset 0 whose prompt ends on a block boundary cannot be "
                             "resumed without the prompt (the last prompt token's logits need its token): send "
                             "'prompt', or start the session again")
        extra = len(cp.generated) - offset  # tokens after the offset are not covered: they are generated again
        sampler = dataclasses.replace(cp.sampler, step=max(0, cp.sampler.step - extra))
        self._sampler_ok(sampler)
        run, old, new = self.new_session(
            session=session, epoch=body.epoch, compat_id=cp.compat_id, scope_id=cp.scope_id, prompt_len=prompt_len,
            prompt_blocks=cp.prompt_blocks, prompt_tail=cp.prompt_tail, max_tokens=self.max_tokens(body.max_tokens),
            sampler=sampler, output=cp.generated[:offset])
        return Admission(run, old, new, keyer)

    def max_tokens(self, requested: int | None) -> int:
        """The output limit of a run: as requested, at most ``max_tokens`` of the settings (their value when
        none is requested)."""
        limit = self.settings.max_tokens
        if requested is None:
            return limit
        if requested > limit:
            raise BadRequest(f"max_tokens: at most {limit} at this instance")
        return requested

    def _check_compat(self, compat_id: bytes) -> None:
        if bytes(compat_id) != self.settings.compat_id:
            raise Incompatible(f"this instance runs Compatibility ID {self.settings.compat_id.hex()}")

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        vocab = self.settings.vocab_size
        if vocab is not None and tokens and max(tokens) >= vocab:
            raise BadRequest(f"{what}: token ids are below the model's vocabulary size {vocab}")

    def _sampler_ok(self, sampler: Sampler) -> None:
        if self._check_sampler is None:
            return
        try:
            self._check_sampler(sampler)
        except ValueError as exc:
            raise BadRequest(f"sampler: {exc}") from None

    def new_session(self, *, session: uuid.UUID, epoch: int, compat_id: bytes, scope_id: bytes, prompt_len: int,
                    prompt_blocks: Sequence[bytes], prompt_tail: Sequence[int], max_tokens: int, sampler: Sampler,
                    stop: Iterable[int] = (), output: Sequence[int] = ()
                    ) -> tuple[InstanceSession, InstanceSession | None, bool]:
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
        ids = sampler.params.get("stop_token_ids")  # the sampler's stop tokens: the checkpoint carries them
        stop = {*stop, *(t for t in (ids if isinstance(ids, list) else ()) if isinstance(t, int))}
        s = InstanceSession(
            id=session, epoch=epoch, compat_id=CompatId(bytes(compat_id)), scope_id=ScopeId(bytes(scope_id)),
            prompt_len=prompt_len, prompt_blocks=tuple(BlockKey(bytes(k)) for k in prompt_blocks),
            prompt_tail=tuple(prompt_tail), max_tokens=max_tokens, method=sampler.method, params=dict(sampler.params),
            seed=sampler.seed, base_step=sampler.step, base_offset=len(output), deterministic=deterministic,
            block_tokens=self.settings.block_tokens, checkpoint_tokens=self.settings.checkpoint_tokens,
            gated=self.settings.controller and not deterministic, stop=frozenset(stop), output=list(output))
        old = self.sessions.add(s)
        self.sessions_changed()
        return s, old, True

    def sessions_changed(self) -> None:
        self.lifecycle.sessions_changed(self.sessions.in_flight())

    def finish_session(self, session: InstanceSession, phase: Phase, reason: str | None, detail: str = "") -> None:
        session.finish(phase, reason, self._clock(), detail)
        self.sessions_changed()

    # -- resharding -----------------------------------------------------------------------------------------

    def plan_reshard(self, principal: Principal, plan: ReshardPlan, context: ReshardContext | None) -> PlanSteps:
        """``POST reshard`` with a plan: its ``context`` (extension) must be of a scope the principal may use and of
        this instance's cache. The same plan again is answered once its fetches are in (``new`` False); while they
        are still loading it is a conflict."""
        if context is not None:
            require_scope(principal, context.scope_id)
            if bytes(context.compat_id) != self.settings.compat_id:
                raise Incompatible("context.compat_id: not this instance's cache")
        steps = self.reshard.plan(plan, context)
        if not steps.new and not steps.state.acknowledged:
            raise PlanConflict(f"map {steps.state.map}: the plan to version {plan.to_version} is still loading")
        return steps

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

    def status_record(self, figures: EngineFigures = EngineFigures(), *,
                      engine: tuple[str, str] | None = None) -> InstanceStatusRecord:
        """The record to report now (and remember what it requested, for the PC's answer). *engine* (default:
        :attr:`engine_identity`): the engine's ``(name, build)``, reported with the cache's Compatibility ID as the
        ``"engine"`` extension member (:class:`~kvsp_quic.records.EngineStatus`: the PC's test of deterministic
        samplers)."""
        engine = engine if engine is not None else self.engine_identity
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
            links=self.links.links(), requested_state=self._requested,
            engine=None if engine is None else EngineStatus(engine[0], engine[1], CompatId(self.settings.compat_id)))

    def reported(self, answer: InstanceState | None) -> None:
        """A report went out (*answer*: the PC's ``{"state"}``, None when it failed)."""
        self._last_report = self._clock()
        self.reports += 1
        self.lifecycle.changed = False
        if answer is not None:
            self.lifecycle.answer(answer, self._requested)

    def sweep(self) -> list[Directive]:
        """Timers: directives past their deadline become ``partial`` (returned), finished directives and sessions
        past their retention are forgotten."""
        self.sessions.sweep()
        self.directives.sweep()
        return self.directives.expire()

    def next_due(self) -> float | None:
        """The earliest clock time :meth:`sweep` has work (None: nothing scheduled): a pending directive's
        deadline, or the end of a finished directive's or session's retention."""
        return min((t for t in (self.directives.next_due(), self.sessions.next_due()) if t is not None), default=None)


__all__ = [
    "ENGINE_NAMES", "Admission", "Directive", "DirectiveTable", "EngineFigures", "InstanceRole", "InstanceSession",
    "InstanceSettings", "LinkMeter", "MapState", "Phase", "PlanSteps", "RateMeter", "ReshardBook",
    "ReshardContext", "SamplerCheck", "SessionTable",
]
