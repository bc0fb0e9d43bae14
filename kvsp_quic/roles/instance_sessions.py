"""The runs of sessions at an instance (spec, "Session Checkpoints and Migration"; docs/inference.md): epochs (a
lower epoch is refused with ``kvsp-stale-epoch``; a higher one supersedes the run in progress), the output tokens
with their indices, when a checkpoint is due (a block of generated tokens completes, ``checkpoint_tokens`` tokens
since the last, the end), and which tokens may be released to the front end (all with a deterministic sampler or
without a PC; otherwise those covered by an acknowledged checkpoint). Pure: no I/O, an injected clock.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.problems import NotFound, StaleEpoch, TooManyRequests
from kvsp_quic.records import Sampler, SessionCheckpoint

Clock = Callable[[], float]
Logprobs = tuple[float, tuple[tuple[int, float], ...]]  # kvsp_quic.engine.Logprobs (that module imports this one)


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
class InstanceSession:
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
    logprobs: dict[int, Logprobs] = field(default_factory=dict)  # by output index, when the sampler asks for them
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
    owner: str | None = None  # the identity that created the session at the PC (None: the PC did not say)
    prompt_logprobs: list[Logprobs | None] | None = None  # per prompt token, once the prefill computed them

    def __post_init__(self) -> None:
        self.acked = self.snapshot_offset = self.base_offset

    def readable_by(self, identity: str, *, controller: bool) -> bool:
        """Whether *identity* may read this run (its token stream, ``GET sessions/{id}``): the PC, or the session's
        owner (docs/wire.md, "Session owner"). A run whose start or resume named no owner is readable by any
        principal of its scope (the caller checks the scope first)."""
        return controller or self.owner is None or identity == self.owner

    def notify(self) -> None:
        for listener in list(self.listeners):
            listener()

    @property
    def length(self) -> int:
        """Tokens of the sequence so far (prompt and output)."""
        return self.prompt_len + len(self.output)

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """The sampler's ``prompt_logprobs`` (alternatives per prompt token; docs/wire.md, "Prompt log
        probabilities"), None when it asks for none."""
        value = self.params.get("prompt_logprobs")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def remaining(self) -> int:
        return max(0, self.max_tokens - len(self.output))

    def sampler(self) -> Sampler:
        """The checkpointable sampler state after the current output."""
        return Sampler(method=self.method, seed=self.seed, step=self.base_step + len(self.output) - self.base_offset,
                       deterministic=self.deterministic, params=dict(self.params))

    def append(self, token: int, now: float, logprobs: Logprobs | None = None) -> bool:
        """One more output token (and its log probabilities); True when a checkpoint was made (a generated block
        completed, or ``checkpoint_tokens`` since the last one)."""
        if self.phase.finished:
            raise RuntimeError(f"session {self.id} is {self.phase.value}")
        if logprobs is not None:
            self.logprobs[len(self.output)] = logprobs
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
        """*(extension)* ``GET sessions/{id}``: where the run stands; with ``prompt_logprobs`` once computed
        (docs/wire.md, "Prompt log probabilities")."""
        ttft = None if self.first_token_at is None else round((self.first_token_at - self.started_at) * 1000, 3)
        out = {"session": str(self.id), "epoch": self.epoch, "state": self.phase.value, "reason": self.reason,
               "output_offset": len(self.output), "released": self.releasable(), "prompt_tokens": self.prompt_len,
               "loaded_blocks": self.loaded_blocks, "computed_tokens": self.recomputed_tokens,
               "block_sources": dict(self.block_sources), "ttft_ms": ttft}
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [None if lp is None else [lp[0], [list(pair) for pair in lp[1]]]
                                      for lp in self.prompt_logprobs]
        return out

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
    """The runs admitted here by session id (the latest epoch's), and the highest epoch seen of every session.
    At most *capacity* runs are in flight; finished ones answer for *retention_s* seconds."""

    def __init__(self, clock: Clock, *, capacity: int, retention_s: float) -> None:
        self._clock = clock
        self.capacity = capacity
        self.retention_s = retention_s
        self.sessions: dict[uuid.UUID, InstanceSession] = {}
        self.epochs: dict[uuid.UUID, int] = {}  # the highest epoch seen per session (kept after it ends)

    def get(self, session: uuid.UUID) -> InstanceSession:
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

    def check_epoch(self, session: uuid.UUID, epoch: int) -> InstanceSession | None:
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
        if self.in_flight() >= self.capacity:
            raise TooManyRequests(f"{self.capacity} sessions are admitted; try again later")

    def add(self, session: InstanceSession) -> InstanceSession | None:
        """Admit *session*; returns the run of an older epoch it supersedes, if one is still in flight."""
        old = self.sessions.get(session.id)
        self.epochs[session.id] = session.epoch
        self.sessions[session.id] = session
        session.started_at = self._clock()
        if old is not None and not old.phase.finished:
            old.finish(Phase.SUPERSEDED, None, self._clock(), f"superseded by epoch {session.epoch}")
            return old
        return None

    def fence(self, session: InstanceSession, detail: str) -> None:
        """The PC refused a checkpoint with kvsp-stale-epoch: another instance serves a newer epoch."""
        self.epochs[session.id] = max(self.epochs.get(session.id, 0), session.epoch + 1)  # a newer one exists
        session.finish(Phase.SUPERSEDED, None, self._clock(), detail)

    def sweep(self) -> None:
        now = self._clock()
        keep = self.retention_s
        for s in [s for s in self.sessions.values() if s.finished_at is not None and now - s.finished_at > keep
                  and s.checkpoints_settled]:
            del self.sessions[s.id]

    def next_due(self) -> float | None:
        """When :meth:`sweep` may next forget a session: the end of the earliest retention of a session whose
        checkpoints are settled (None: none; one that settles later is found by the next sweep)."""
        return min((s.finished_at + self.retention_s for s in self.sessions.values()
                    if s.finished_at is not None and s.checkpoints_settled), default=None)


__all__ = ["Clock", "InstanceSession", "Phase", "SessionTable"]
