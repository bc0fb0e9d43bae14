"""One placement of a session as the steps the Placement Controller's adapter carries out (no I/O).

The sequence is the role's: rank the candidates (a lookup of the prompt's Block Keys, when it has any), look for
more capacity when no candidate is acceptable (wake a sleeping instance, else run the start hook and wait for an
instance to become active) and rank again, then try the choices in order (a prefetch directive when loading beats
recomputing, then the start or resume); when every candidate refused, look for capacity once more, rank and try
again. :class:`PlacementPlan` yields each I/O it needs as a step; the adapter
(``kvsp_runtime.controller_service.ControllerService``) performs it, writes the result into the step, and asks for
the next one. Every judgement stays with the role (:class:`PlacementRules`, which
:class:`~kvsp_quic.roles.controller.PlacementController` implements)::

    plan = PlacementPlan(role, session, can_start=starter is not None)
    for step in plan:
        if isinstance(step, LookupStep):
            step.found = await index.lookup(role.principal, step.request)
        elif ...            # WakeStep, StartHookStep, AwaitInstanceStep, PrefetchStep, StoreStep, StartStep
    placed = plan.placed

A :class:`StartStep` that an instance refuses with 400 raises that problem out of the plan (the request itself is
bad: every instance of the model would refuse it).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import BadRequest, Problem
from kvsp_quic.records import LookupRequest, LookupResponse, PrefetchDirective
from kvsp_quic.roles.controller_records import SessionStart
from kvsp_quic.roles.controller_sessions import (
    Assignment,
    CapacityAction,
    CapacityStep,
    PlacedSession,
    PlacementQuery,
    PrefetchOutcome,
    StartOutcome,
)
from kvsp_quic.roles.placement import Choice
from kvsp_quic.roles.status import InstanceStatus


class PlacementRules(Protocol):
    """The decisions of the role that a placement consults (:class:`~kvsp_quic.roles.controller.
    PlacementController`'s methods of the same names)."""

    def placement_query(self, session: PlacedSession, exclude: Iterable[str]) -> PlacementQuery | None: ...

    def rank(self, session: PlacedSession, query: PlacementQuery, found: LookupResponse | None) -> list[Choice]: ...

    def acceptable(self, choices: Iterable[Choice]) -> bool: ...

    def sleeping(self, scope_id: bytes | None = None) -> list[str]: ...

    def woke(self, instance: str, answered: InstanceState, reason: str) -> bool: ...

    def capacity_step(self) -> CapacityStep: ...

    def hook_ran(self) -> None: ...

    def still_active(self, instance: str, scope_id: bytes | None = None) -> InstanceStatus | None: ...

    def directive(self, session: PlacedSession, choice: Choice, found: LookupResponse | None
                  ) -> PrefetchDirective | None: ...

    def prefetch_outcome(self, instance: str, error: Problem | OSError | None) -> PrefetchOutcome: ...

    def assign(self, session: PlacedSession, entry: InstanceStatus, found: LookupResponse | None) -> Assignment: ...

    def start_outcome(self, session: PlacedSession, assignment: Assignment, error: Problem | OSError | None,
                      choice: Choice, found: LookupResponse | None) -> StartOutcome: ...


# -- the steps: what the adapter does, and the field it fills in --------------------------------------------------


@dataclass
class LookupStep:
    """Look *request* up at the Index Service (as the PC's own principal); ``found`` is its answer."""

    request: LookupRequest
    found: LookupResponse | None = None


@dataclass
class WakeStep:
    """``PUT state`` active on the sleeping *instance*; ``answered`` is the state it answered (None: the request
    failed)."""

    instance: str
    reason: str
    answered: InstanceState | None = None


@dataclass
class StartHookStep:
    """Run the start hook (*reason* goes to it); ``ran`` is whether it started."""

    reason: str
    ran: bool = False


@dataclass
class AwaitInstanceStep:
    """Wait up to *wait_s* seconds for an instance to become active (the one a start hook run started, just now or
    earlier); ``activated`` is whether one did."""

    wait_s: float
    activated: bool = False


@dataclass
class PrefetchStep:
    """Send *directive* to *instance*; ``error`` is what the request raised (None: accepted)."""

    instance: str
    directive: PrefetchDirective
    error: Problem | OSError | None = None


@dataclass
class StoreStep:
    """Write what the placement changed in the session to the control store: before a start or resume is sent (the
    instance may checkpoint, at any replica, before it answers) and once its answer is judged."""


@dataclass
class StartStep:
    """Send the start or resume of *assignment* to its instance; ``error`` is what the request raised (None:
    taken)."""

    assignment: Assignment
    error: Problem | OSError | None = None


PlacementStep = LookupStep | WakeStep | StartHookStep | AwaitInstanceStep | PrefetchStep | StoreStep | StartStep


@dataclass
class PlacementPlan:
    """The steps of one placement of *session* (its epoch already fresh), in order (module docstring). Iterate it
    once; :attr:`placed` then says whether an instance took the session. *can_start*: a start hook is configured."""

    rules: PlacementRules
    session: PlacedSession
    can_start: bool
    placed: bool = False
    exclude: set[str] = field(default_factory=set)  # instances that refused or failed this placement

    def __iter__(self) -> Iterator[PlacementStep]:
        self.placed = yield from self._steps()

    def _steps(self) -> Generator[PlacementStep, None, bool]:
        reason = f"session {self.session.id}"
        choices, found = yield from self._rank()
        if not self.rules.acceptable(choices) and (yield from self._more_capacity(reason)):
            choices, found = yield from self._rank()
        if (yield from self._try(choices, found)):
            return True
        if choices and (yield from self._more_capacity(f"{reason}: every candidate refused")):
            choices, found = yield from self._rank()
            return (yield from self._try(choices, found))
        return False

    def _rank(self) -> Generator[PlacementStep, None, tuple[list[Choice], LookupResponse | None]]:
        """The candidates left, ranked by the policy on the lookup's answer."""
        query = self.rules.placement_query(self.session, self.exclude)
        if query is None:
            return [], None
        found = None
        if query.lookup is not None:
            lookup = LookupStep(query.lookup)
            yield lookup
            found = lookup.found
        return self.rules.rank(self.session, query, found), found

    def _more_capacity(self, reason: str) -> Generator[PlacementStep, None, bool]:
        """Wake a sleeping instance of the session's scope, or run the start hook and wait for an instance to
        become active (:meth:`PlacementRules.capacity_step`). True when an instance became active."""
        for instance in self.rules.sleeping(self.session.request.scope_id):
            wake = WakeStep(instance, reason)
            yield wake
            if wake.answered is not None and self.rules.woke(instance, wake.answered, reason):
                return True
        if not self.can_start:
            return False
        capacity = self.rules.capacity_step()
        if capacity.action is CapacityAction.NONE:
            return False
        if capacity.action is CapacityAction.RUN_HOOK:
            hook = StartHookStep(reason)
            yield hook
            if not hook.ran:  # a broken hook does not fail the request: it is placed on what exists
                return False
            self.rules.hook_ran()
        wait = AwaitInstanceStep(capacity.wait_s)
        yield wait
        return wait.activated

    def _try(self, choices: list[Choice], found: LookupResponse | None) -> Generator[PlacementStep, None, bool]:
        """Prefetch and start (or resume) the session on the first choice that takes it."""
        session, rules = self.session, self.rules
        for choice in choices:
            entry = rules.still_active(choice.instance, session.request.scope_id)
            if entry is None:
                continue
            directive = rules.directive(session, choice, found)
            if directive is not None:
                prefetch = PrefetchStep(choice.instance, directive)
                yield prefetch
                if rules.prefetch_outcome(choice.instance, prefetch.error).next_instance:
                    self.exclude.add(choice.instance)
                    continue
            start = StartStep(rules.assign(session, entry, found))
            yield StoreStep()
            yield start
            outcome = rules.start_outcome(session, start.assignment, start.error, choice, found)
            if isinstance(start.error, BadRequest) and isinstance(start.assignment.message, SessionStart):
                # The instance refused the request itself (a token id beyond the vocabulary, a prompt too long):
                # every instance of the model would, so it is the caller's 400, not tried elsewhere.
                raise start.error
            yield StoreStep()
            if outcome is StartOutcome.OK:
                return True
            self.exclude.add(choice.instance)
        return False


__all__ = ["AwaitInstanceStep", "LookupStep", "PlacementPlan", "PlacementRules", "PlacementStep", "PrefetchStep",
           "StartHookStep", "StartStep", "StoreStep", "WakeStep"]
