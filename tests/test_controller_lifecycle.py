"""The Placement Controller's session lifecycle as a transition table (kvsp_quic.roles.controller_lifecycle, issue 25
point 4): every legal (state, event) pair leads where the table says, every other pair -- the whole complement of
the table -- raises IllegalSessionTransition and changes nothing, and the role changes a session's state only by
its events (a session done before its start was answered stays done)."""

from __future__ import annotations

import itertools
import uuid

import pytest

from kvsp_quic import keys as k
from kvsp_quic.auth import ALL, Principal, Role
from kvsp_quic.compat import InstanceState
from kvsp_quic.records import InstanceStatusRecord, Sampler, SessionCheckpoint
from kvsp_quic.roles.controller import PlacementController
from kvsp_quic.roles.controller_lifecycle import (
    SESSION_TRANSITIONS,
    IllegalSessionTransition,
    SessionEvent,
    next_state,
)
from kvsp_quic.roles.controller_records import SessionRequest, SessionState
from kvsp_quic.roles.controller_sessions import Admitted, PlacedSession
from kvsp_quic.roles.index import IndexService
from kvsp_quic.roles.status import LifecyclePolicy, StatusTable
from kvsp_quic.storage.memory_index import MemoryIndexStore
from tests.helpers import Clock

S, E = SessionState, SessionEvent
SCOPE, COMPAT = bytes([1]) * 16, bytes([0xC1]) * 32
IA = "https://ia.example/kvsp/"

ILLEGAL = sorted(set(itertools.product(S, E)) - set(SESSION_TRANSITIONS), key=lambda p: (p[0].value, p[1].value))


def _session(state: SessionState) -> PlacedSession:
    request = SessionRequest(uuid.UUID(int=1), SCOPE, COMPAT, (1, 2, 3), 4, Sampler("greedy", 0, 0, True))
    return PlacedSession(request, "urn:kvsp:client:front", 0.0, 0.0, state=state)


def test_the_table() -> None:
    assert dict(SESSION_TRANSITIONS) == {
        (S.PLACING, E.PLACED): S.RUNNING, (S.PLACING, E.PLACEMENT_ABANDONED): S.MIGRATING,
        (S.PLACING, E.FINISHED): S.DONE, (S.RUNNING, E.INSTANCE_FAILED): S.MIGRATING, (S.RUNNING, E.FINISHED): S.DONE,
        (S.MIGRATING, E.MIGRATED): S.RUNNING, (S.MIGRATING, E.FINISHED): S.DONE, (S.DONE, E.PLACED): S.DONE,
        (S.DONE, E.MIGRATED): S.DONE, (S.DONE, E.FINISHED): S.DONE,
    }
    assert all(next_state(state, event) is to for (state, event), to in SESSION_TRANSITIONS.items())
    assert {to for (state, _), to in SESSION_TRANSITIONS.items() if state is S.DONE} == {S.DONE}  # nothing leaves done
    assert len(ILLEGAL) == len(S) * len(E) - len(SESSION_TRANSITIONS) > 0


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=[f"{s.value}-{e.value}" for s, e in ILLEGAL])
def test_every_illegal_transition_raises(state: SessionState, event: SessionEvent) -> None:
    with pytest.raises(IllegalSessionTransition) as raised:
        next_state(state, event)
    assert (raised.value.state, raised.value.event) == (state, event)
    assert repr(state.value) in str(raised.value) and repr(event.value) in str(raised.value)
    session = _session(state)
    with pytest.raises(IllegalSessionTransition):
        session.apply(event)
    assert session.state is state  # unchanged


@pytest.mark.parametrize(("state", "event"), list(SESSION_TRANSITIONS),
                         ids=[f"{s.value}-{e.value}" for s, e in SESSION_TRANSITIONS])
def test_every_legal_transition_applies(state: SessionState, event: SessionEvent) -> None:
    session = _session(state)
    assert session.apply(event) is SESSION_TRANSITIONS[state, event] is session.state


def test_a_session_done_before_its_start_was_answered_stays_done() -> None:
    """The instance may checkpoint its last token before it answers the start: the placement that then succeeds
    leaves the session done (it was set running again before the table)."""
    clock = Clock()
    status = StatusTable(clock, policy=LifecyclePolicy(), max_ttl_ms=60_000)
    role = PlacementController(IndexService(MemoryIndexStore(), clock=clock, status=status), clock=clock)
    instance = Principal(IA, frozenset({Role.INSTANCE}), ALL)
    front = Principal("urn:kvsp:client:front", frozenset({Role.CLIENT}), ALL)
    role.report_status(instance, k.uri_id(IA), InstanceStatusRecord(IA, 1, InstanceState.ACTIVE, 3000))
    request = SessionRequest(uuid.UUID(int=1), SCOPE, COMPAT, (1, 2, 3), 2, Sampler("greedy", 0, 0, True))
    admitted = role.admit(front, request)
    assert isinstance(admitted, Admitted)
    session = admitted.session
    entry = role.still_active(IA, SCOPE)
    assert entry is not None
    role.assign(session, entry, None)
    done = SessionCheckpoint(request.session, 1, COMPAT, SCOPE, (), request.prompt, (7, 8), 2,
                             Sampler("greedy", 0, 2, True))
    role.checkpoint(instance, request.session, done)
    assert session.state is S.DONE
    assert role.placed(session, 0.01).state is S.DONE
    with pytest.raises(IllegalSessionTransition):  # a done session is never migrated
        session.apply(E.INSTANCE_FAILED)
    role.begin_migration(session)  # the role's own guard: nothing to do for a done session
    assert session.state is S.DONE and session.epoch == 1
