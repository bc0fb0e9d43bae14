"""The Placement Controller's sessions and the outcomes of its decisions, as types (no I/O).

:class:`PlacedSession` is what the PC holds per session (spec, "Session Checkpoints and Migration"): its request,
epochs, the instance serving it and the highest checkpoint. The other types are what the role
(:class:`~kvsp_quic.roles.controller.PlacementController`) returns to its asyncio adapter
(``kvsp_runtime.controller_service.ControllerService``) and what the adapter reports back: each step of a placement is a
decision of the role, carried out by the adapter, whose result the role then judges.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from kvsp_quic.problems import Problem
from kvsp_quic.records import LookupRequest, SessionCheckpoint, StateMessage
from kvsp_quic.roles.controller_lifecycle import SessionEvent, next_state
from kvsp_quic.roles.controller_records import SessionInfo, SessionRequest, SessionResume, SessionStart, SessionState
from kvsp_quic.roles.status import InstanceStatus, StatusTable


@dataclass
class PlacedSession:
    """A session the PC placed (or is placing) on an instance: mutable bookkeeping of the role. Its ``state``
    changes only through :meth:`apply` (the transition table of :mod:`kvsp_quic.roles.controller_lifecycle`)."""

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
    version: int = 0  # of the stored copy this one was read from (a shared ControlStore's compare-and-set)

    @property
    def id(self) -> uuid.UUID:
        return self.request.session

    @property
    def output_offset(self) -> int:
        return self.checkpoint.output_offset if self.checkpoint is not None else 0

    def apply(self, event: SessionEvent) -> SessionState:
        """Move the session's state by *event* (:func:`~kvsp_quic.roles.controller_lifecycle.next_state`: an
        illegal pair raises ``IllegalSessionTransition`` and changes nothing); the new state."""
        self.state = next_state(self.state, event)
        return self.state

    def adopt(self, fresh: PlacedSession) -> None:
        """Take what others may have written since this copy was read -- the checkpoint (the highest wins) and the
        end of the session -- from *fresh*, the stored copy, and its version. Used by the replica that places the
        session (it holds the session's lease: the placement fields are its own)."""
        if fresh.checkpoint is not None and fresh.output_offset >= self.output_offset:
            self.checkpoint = fresh.checkpoint
        if fresh.state is SessionState.DONE:
            self.apply(SessionEvent.FINISHED)
        self.version = fresh.version

    def info(self) -> SessionInfo:
        """What the front end sees: while the session is placed or migrated, the epoch it was last served in and
        no instance, so that "the epoch grew" always comes with the instance that serves the new epoch."""
        if self.state in (SessionState.RUNNING, SessionState.DONE):
            return SessionInfo(self.id, self.epoch, self.output_offset, self.state, self.instance)
        return SessionInfo(self.id, self.served, self.output_offset, self.state, None)


def engines_agree(eligible: Iterable[InstanceStatus], compat_id: bytes) -> bool:
    """Whether a session of *compat_id* may keep a deterministic sampler (spec, "Records": "sampler.deterministic"
    is true only if every instance eligible to resume the session produces bit-identical output tokens from the
    same state): every instance of *eligible* (the live instances of the session's scope) that reports
    *compat_id* in its ``"engine"`` status extension reports the same engine name and build fingerprint, and at
    least one does. An eligible instance that reports no ``"engine"`` member could be of any engine: the answer
    is then False. Instances of another Compatibility ID cannot resume the session and do not count."""
    seen: set[tuple[str, str]] = set()
    for entry in eligible:
        engine = entry.record.engine
        if engine is None:
            return False
        if bytes(engine.compat_id) == bytes(compat_id):
            seen.add((engine.name, engine.build))
    return len(seen) == 1


# -- creating a session -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    """``POST sessions`` for a new session: it is held (state placing) and must now be placed."""

    session: PlacedSession


@dataclass(frozen=True)
class Repeated:
    """``POST sessions`` repeating the request of an existing session: answered with its info, nothing is sent."""

    info: SessionInfo


Admission = Admitted | Repeated


# -- one placement ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementQuery:
    """The first step of a placement: the candidates (alive, active, not excluded) and the lookup of the prompt's
    Block Keys with them as targets (None: no keys to look up)."""

    candidates: tuple[InstanceStatus, ...]
    lookup: LookupRequest | None


class PrefetchOutcome(enum.Enum):
    """What a prefetch directive before a start came to (the value is the metric label)."""

    ACCEPTED = "accepted"
    REFUSED = "refused"  # the instance is not active after all: try the next one
    FAILED = "failed"  # another problem: the session can still start there (the instance loads or recomputes)
    UNREACHABLE = "unreachable"  # no answer: try the next one

    @property
    def next_instance(self) -> bool:
        """True when the placement moves on to the next choice instead of starting the session here."""
        return self in (PrefetchOutcome.REFUSED, PrefetchOutcome.UNREACHABLE)


class StartKind(enum.Enum):
    START = "start"
    RESUME = "resume"


@dataclass(frozen=True)
class Assignment:
    """A session given to *instance*: the start (no checkpoint yet) or resume message to send it."""

    instance: str
    message: SessionStart | SessionResume

    @property
    def kind(self) -> StartKind:
        return StartKind.RESUME if isinstance(self.message, SessionResume) else StartKind.START


class StartOutcome(enum.Enum):
    """What a start or resume came to (the value is the metric label)."""

    OK = "ok"  # the instance serves the session in its current epoch
    REFUSED = "refused"  # definitely not taken: the next choice, same epoch
    FAILED = "failed"  # maybe taken: the epoch was incremented (fencing the instance), the next choice


# -- capacity -----------------------------------------------------------------------------------------------------


class CapacityAction(enum.Enum):
    NONE = "none"  # nothing to do: place on what exists
    RUN_HOOK = "run-hook"  # run the start hook, then wait for an instance to become active
    WAIT = "wait"  # a hook run is under way: wait for its instance


@dataclass(frozen=True)
class CapacityStep:
    """The role's answer when no active instance is acceptable and no sleeping one woke: what to do, and how long
    to wait (seconds) for an instance to become active."""

    action: CapacityAction
    wait_s: float = 0.0


# -- suspect reports (extension: docs/wire.md, "Suspect reports") ----------------------------------------------


class SuspectStep(enum.Enum):
    """What a suspect report of a session's current epoch calls for (the role's first answer)."""

    ANSWER = "answer"  # nothing to verify: the session is at a newer epoch, or done
    WAIT = "wait"  # the session is being placed or migrated already: wait for its new epoch
    PROBE = "probe"  # ask the instance for the session (a short timeout) before deciding
    MIGRATE = "migrate"  # the PC holds the instance run failed already: migrate now


class RunHealth(enum.Enum):
    """What the probe of a suspected run came to (the value is the metric label)."""

    ALIVE = "alive"  # the instance answered for the session: a false alarm, nothing moves
    GONE = "gone"  # the instance answered that it has no such session: this session's run is lost
    SILENT = "silent"  # no answer within the first probe's timeout (a loaded instance?): probe once more, longer
    DEAD = "dead"  # no answer (a refused or closed connection; silence twice): the instance run is failed


def judge_probe(error: object | None, *, last: bool = True) -> RunHealth:
    """The probe of a suspected run is ``GET sessions/{id}`` at its instance; *error* is what it raised (None: 200;
    a :class:`~kvsp_quic.problems.Problem` for another answer; an ``OSError`` for none). Only no answer fails the
    instance run; a 404 loses this session's run only; any other answer is an instance alive enough to answer. A
    timeout of the first probe (not *last*) is :attr:`RunHealth.SILENT`: a loaded instance may answer a second."""
    if error is None or (isinstance(error, Problem) and error.status != 404):
        return RunHealth.ALIVE
    if isinstance(error, Problem):
        return RunHealth.GONE
    return RunHealth.SILENT if isinstance(error, TimeoutError) and not last else RunHealth.DEAD


def fail_run(table: StatusTable, instance: str, instance_epoch: int) -> bool:
    """Hold *instance*'s run *instance_epoch* failed in *table*, as if its status had just expired (its highest
    epoch is kept). False when the table holds no live status of that run."""
    entry = table.get(instance)
    if entry is None or entry.record.epoch != instance_epoch:
        return False
    epochs = {i: e for i in table.instances() if (e := table.highest_epoch(i)) is not None}
    table.replace([e for e in table.live() if e.instance != instance], epochs)
    return True


# -- status reports -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatusReport:
    """A status report as the PC took it: the answer for the instance, whether an instance became active (whoever
    waits for capacity can go on), whether a failover is likely due (the instance failed or restarted), and when the
    status now held expires (clock seconds: the PC's failure check must look again by then, ``next_due``)."""

    answer: StateMessage
    activated: bool
    failover_due: bool
    expires_at: float | None = None


__all__ = [
    "Admission", "Admitted", "Assignment", "CapacityAction", "CapacityStep", "PlacedSession", "PlacementQuery",
    "PrefetchOutcome", "Repeated", "RunHealth", "StartKind", "StartOutcome", "StatusReport", "SuspectStep",
    "engines_agree", "fail_run", "judge_probe",
]
