"""The instance's lifecycle (spec, "Instance Status and Lifecycle") as a transition table (h11 style; no I/O).

The state changes only by an event applied with :func:`next_state` (through :meth:`Lifecycle.apply`): the pair
(state, event) is looked up in :data:`LIFECYCLE` (a kvsp_quic.roles.transitions table); a pair the table lacks
raises :class:`IllegalLifecycleTransition`, naming both. ::

    active | draining | sleeping --activate--> active      (PUT state active)
    active | draining | sleeping --drain--> draining       (PUT state draining or sleeping; the PC granted a sleep)
    draining --idle--> sleeping                            (no session in flight any more)

``failed`` is what the PC concludes when reports stop: no event leads into it or out of it here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping

from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import InvalidState
from kvsp_quic.roles.instance_sessions import Clock
from kvsp_quic.roles.transitions import IllegalTransition, TransitionTable


class LifecycleEvent(enum.Enum):
    """What changes the instance's state (the value names it in errors)."""

    ACTIVATE = "activate"  # the PC puts it (back) to work
    DRAIN = "drain"  # the PC asks it to drain or sleep, or grants the sleep it requested
    IDLE = "idle"  # its last session in flight ended while draining


class IllegalLifecycleTransition(IllegalTransition):
    """An event the instance's state does not allow (a broken rule of the role, never a peer's doing)."""

    subject = "an instance"


_S, _E = InstanceState, LifecycleEvent

LIFECYCLE: TransitionTable[InstanceState, LifecycleEvent] = TransitionTable({
    (_S.ACTIVE, _E.ACTIVATE): _S.ACTIVE,
    (_S.DRAINING, _E.ACTIVATE): _S.ACTIVE,
    (_S.SLEEPING, _E.ACTIVATE): _S.ACTIVE,
    (_S.ACTIVE, _E.DRAIN): _S.DRAINING,
    (_S.DRAINING, _E.DRAIN): _S.DRAINING,
    (_S.SLEEPING, _E.DRAIN): _S.DRAINING,
    (_S.DRAINING, _E.IDLE): _S.SLEEPING,
}, IllegalLifecycleTransition)
"""The instance's machine: every legal (state, event) pair and the state it leads to (module docstring)."""

LIFECYCLE_TRANSITIONS: Mapping[tuple[InstanceState, LifecycleEvent], InstanceState] = LIFECYCLE.pairs
next_state = LIFECYCLE.next_state
"""The state an event leads to from a state; :class:`IllegalLifecycleTransition` when the table has no such pair."""


class Lifecycle:
    """The instance's state. New work only when active; a draining instance sleeps once its sessions in flight are
    done; with *sleep_after_idle_s* an idle active instance asks the PC (in its status report) to let it sleep.
    *on_change* is called after every change of state (the instance's runtime reports it at once)."""

    def __init__(self, clock: Clock, *, sleep_after_idle_s: float | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self._clock = clock
        self.sleep_after_idle_s = sleep_after_idle_s
        self.on_change = on_change
        self.state = InstanceState.ACTIVE
        self.in_flight = 0
        self._idle_since: float | None = clock()
        self.changed = False  # a report is due because the state changed
        self.history: list[InstanceState] = [self.state]

    def apply(self, event: LifecycleEvent) -> InstanceState:
        """Take *event* (:data:`LIFECYCLE_TRANSITIONS`); the state now held."""
        state = next_state(self.state, event)
        if state is not self.state:
            self.state = state
            self.changed = True
            self.history = [*self.history[-63:], state]
            if self.on_change is not None:
                self.on_change()
        if state is InstanceState.ACTIVE and self.in_flight == 0:
            self._idle_since = self._clock()
        return state

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
            self.apply(LifecycleEvent.ACTIVATE)
        else:
            self.apply(LifecycleEvent.DRAIN)
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
            self.apply(LifecycleEvent.IDLE)

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
            self.apply(LifecycleEvent.DRAIN)
            self._settle()
        else:
            self._idle_since = self._clock()


__all__ = ["LIFECYCLE", "LIFECYCLE_TRANSITIONS", "IllegalLifecycleTransition", "Lifecycle", "LifecycleEvent",
           "next_state"]
