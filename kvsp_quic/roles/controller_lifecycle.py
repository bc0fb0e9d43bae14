"""The lifecycle of a session at the Placement Controller, as a transition table (h11 style; no I/O).

A session's :class:`~kvsp_quic.roles.controller_records.SessionState` changes only by an event applied with
:func:`next_state` (through :meth:`kvsp_quic.roles.controller_sessions.PlacedSession.apply`): the pair (state,
event) is looked up in :data:`SESSION_TRANSITIONS`; a pair the table does not hold is a broken rule of the PC and
raises :class:`IllegalSessionTransition`, naming both. ::

    placing --placed--> running --instance-failed--> migrating --migrated--> running
    placing --placement-abandoned--> migrating              (another replica takes an abandoned placement over)
    placing | running | migrating | done --finished--> done (the instance reported the last token)
    done --placed | migrated--> done                        (the last token came before the start's answer)

``done`` absorbs the end of a placement: an instance may checkpoint -- its last token too -- before it answers the
start or resume that gave it the session (with a shared control store, at another replica), so a placement that
succeeds after that leaves the session done. Nothing leaves ``done``: a done session is never migrated.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from kvsp_quic.roles.controller_records import SessionState
from kvsp_quic.roles.transitions import IllegalTransition, TransitionTable


class SessionEvent(enum.Enum):
    """What happens to a session at the PC (the value names it in errors and logs)."""

    PLACED = "placed"  # its first placement succeeded: an instance serves it
    INSTANCE_FAILED = "instance-failed"  # the instance serving it failed (its epoch was incremented, fencing it)
    PLACEMENT_ABANDONED = "placement-abandoned"  # the replica placing it is gone: this one places it, as a migration
    MIGRATED = "migrated"  # it was placed again after its instance failed
    FINISHED = "finished"  # its instance reported the last token (a checkpoint with done, or at max_tokens)


class IllegalSessionTransition(IllegalTransition):
    """An event that the session's state does not allow (a broken rule of the PC, never the client's doing)."""

    subject = "a session"


_S, _E = SessionState, SessionEvent

SESSIONS: TransitionTable[SessionState, SessionEvent] = TransitionTable({
    (_S.PLACING, _E.PLACED): _S.RUNNING,
    (_S.PLACING, _E.PLACEMENT_ABANDONED): _S.MIGRATING,
    (_S.PLACING, _E.FINISHED): _S.DONE,
    (_S.RUNNING, _E.INSTANCE_FAILED): _S.MIGRATING,
    (_S.RUNNING, _E.FINISHED): _S.DONE,
    (_S.MIGRATING, _E.MIGRATED): _S.RUNNING,
    (_S.MIGRATING, _E.FINISHED): _S.DONE,
    (_S.DONE, _E.PLACED): _S.DONE,
    (_S.DONE, _E.MIGRATED): _S.DONE,
    (_S.DONE, _E.FINISHED): _S.DONE,
}, IllegalSessionTransition)
"""The session's machine: every legal (state, event) pair and the state it leads to (module docstring)."""

SESSION_TRANSITIONS: Mapping[tuple[SessionState, SessionEvent], SessionState] = SESSIONS.pairs
next_state = SESSIONS.next_state
"""The state an event leads to from a state; :class:`IllegalSessionTransition` when the table has no such pair."""


__all__ = ["SESSIONS", "SESSION_TRANSITIONS", "IllegalSessionTransition", "SessionEvent", "next_state"]
