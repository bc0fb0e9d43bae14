"""A transition table (h11 style; no I/O): the one shape of the roles' state machines.

A machine's state changes only by an event: the pair (state, event) is looked up in the table; a pair the table does
not hold is a broken rule of the role (never a peer's doing) and raises the table's :class:`IllegalTransition`,
naming both. Used by the PC's sessions (controller_lifecycle.py) and the instance's lifecycle (instance_lifecycle.py).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar, Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """An event that the state does not allow; *subject* names what has the state ("a session", "an instance")."""

    subject: ClassVar[str] = "a machine"

    def __init__(self, state: enum.Enum, event: enum.Enum) -> None:
        super().__init__(f"{self.subject} in state {state.value!r} cannot take the event {event.value!r}")
        self.state = state
        self.event = event


class TransitionTable(Generic[S, E]):
    """Every legal (state, event) pair of a machine and the state it leads to; *illegal* is raised for the rest."""

    def __init__(self, pairs: Mapping[tuple[S, E], S], illegal: type[IllegalTransition]) -> None:
        self.pairs: Mapping[tuple[S, E], S] = MappingProxyType(dict(pairs))
        self.illegal = illegal

    def next_state(self, state: S, event: E) -> S:
        """The state *event* leads to from *state*; the table's :class:`IllegalTransition` when it has no such pair."""
        try:
            return self.pairs[state, event]
        except KeyError:
            raise self.illegal(state, event) from None


__all__ = ["IllegalTransition", "TransitionTable"]
