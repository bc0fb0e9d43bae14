"""The instance's lifecycle as a transition table (kvsp_quic/roles/instance_lifecycle.py; issue 25 point 4): every
legal pair leads where the spec says, every other pair is refused with an error naming both, and the role's
operations go through the table."""

from __future__ import annotations

import itertools

import pytest

from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import InvalidState
from kvsp_quic.roles.instance_lifecycle import (
    LIFECYCLE_TRANSITIONS,
    IllegalLifecycleTransition,
    Lifecycle,
    LifecycleEvent,
    next_state,
)
from tests.helpers import Clock

S, E = InstanceState, LifecycleEvent
ILLEGAL = [pair for pair in itertools.product(S, E) if pair not in LIFECYCLE_TRANSITIONS]


def test_the_legal_transitions() -> None:
    assert next_state(S.SLEEPING, E.ACTIVATE) is S.ACTIVE and next_state(S.DRAINING, E.ACTIVATE) is S.ACTIVE
    assert next_state(S.ACTIVE, E.DRAIN) is S.DRAINING and next_state(S.SLEEPING, E.DRAIN) is S.DRAINING
    assert next_state(S.DRAINING, E.IDLE) is S.SLEEPING
    assert S.FAILED not in {state for state, _ in LIFECYCLE_TRANSITIONS} | set(LIFECYCLE_TRANSITIONS.values())


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=[f"{s.value}-{e.value}" for s, e in ILLEGAL])
def test_every_illegal_transition_is_refused(state: InstanceState, event: LifecycleEvent) -> None:
    with pytest.raises(IllegalLifecycleTransition, match=f"{state.value}.*{event.value}") as caught:
        next_state(state, event)
    assert (caught.value.state, caught.value.event) == (state, event)
    lifecycle = Lifecycle(Clock())
    lifecycle.state = state
    with pytest.raises(IllegalLifecycleTransition):
        lifecycle.apply(event)
    assert lifecycle.state is state  # refused: nothing changed


def test_the_operations_go_through_the_table_and_tell_of_each_change() -> None:
    clock = Clock()
    changes: list[InstanceState] = []
    lifecycle = Lifecycle(clock, sleep_after_idle_s=30.0)
    lifecycle.on_change = lambda: changes.append(lifecycle.state)
    lifecycle.sessions_changed(2)
    assert lifecycle.set_by_controller(S.DRAINING) is S.DRAINING  # two sessions in flight: draining
    with pytest.raises(InvalidState):
        lifecycle.admit()
    lifecycle.sessions_changed(0)  # the last one ended: asleep
    assert lifecycle.state is S.SLEEPING and lifecycle.set_by_controller(S.ACTIVE) is S.ACTIVE
    with pytest.raises(InvalidState):
        lifecycle.set_by_controller(S.FAILED)  # the PC concludes failed; nobody puts an instance there
    clock.now += 31
    assert lifecycle.requested_state() is S.SLEEPING  # idle long enough: it asks to sleep
    lifecycle.answer(S.SLEEPING, S.SLEEPING)  # granted: no session in flight, asleep at once
    assert changes == [S.DRAINING, S.SLEEPING, S.ACTIVE, S.DRAINING, S.SLEEPING]
    assert lifecycle.history == [S.ACTIVE, *changes]
