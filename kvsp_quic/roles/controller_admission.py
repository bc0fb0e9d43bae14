"""Whether the Placement Controller admits a new session (``POST sessions``): the PC's and each client's limits.

:class:`SessionAdmission` is the rule :meth:`kvsp_quic.roles.controller.PlacementController.admit` applies to a
request that is not a retry of a session its principal created (a retry is never refused). Its limits are
:class:`~kvsp_quic.roles.controller_config.ControllerConfig`'s, the ``[controller]`` keys operators write:

* ``client_max_in_flight`` (issue 13): the principal's sessions admitted here and still being placed;
* ``client_max_sessions`` (issue 13): the sessions the principal owns among those this PC holds that are not done;
* ``max_sessions``: the sessions the PC holds in all.

Beyond a client's limit the answer is 429 :class:`~kvsp_quic.problems.TooManyRequests` carrying
``retry_after_s`` (``client_retry_ms`` rounded up), which the HTTP edge sends as ``Retry-After``; beyond the PC's
it is 503. With a shared control store each replica counts what it holds and places, so a client spread over R
replicas may have up to R times either limit. No I/O: the adapter reports when a placement ends (:meth:`ended`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from kvsp_quic.problems import TooManyRequests, Unavailable
from kvsp_quic.roles.controller_config import ControllerConfig
from kvsp_quic.roles.controller_records import SessionState
from kvsp_quic.roles.controller_sessions import PlacedSession


class SessionsAtLimit(TooManyRequests):
    """429: the client owns ``client_max_sessions`` sessions that are not done, as this PC holds them (with a shared
    store another replica may have seen some end: the adapter reads them again, :meth:`SessionAdmission.live`)."""


class SessionAdmission:
    """The limits of ``POST sessions`` and the placements under way they count (module docstring)."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self._placing: dict[str, set[uuid.UUID]] = {}  # per principal: its sessions admitted and not yet placed

    def in_flight(self, identity: str) -> int:
        """The sessions of *identity* admitted here whose first placement has not ended."""
        return len(self._placing.get(identity, ()))

    def check(self, identity: str, held: Mapping[uuid.UUID, PlacedSession]) -> None:
        """Raise unless a new session of *identity* may be admitted next to the sessions *held*."""
        config = self.config
        placing = self.in_flight(identity)
        if placing >= config.client_max_in_flight:
            raise TooManyRequests(f"{placing} session requests of {identity!r} are being placed, its limit "
                                  f"(max_in_flight {config.client_max_in_flight})",
                                  retry_after_s=config.client_retry_after_s)
        if len(held) >= config.client_max_sessions:  # (fewer sessions in all: nobody can be over the limit)
            live = len(self.live(identity, held))
            if live >= config.client_max_sessions:
                raise SessionsAtLimit(f"{identity!r} has {live} sessions that are not done, its limit "
                                      f"(max_sessions {config.client_max_sessions})",
                                      retry_after_s=config.client_retry_after_s)
        if len(held) >= config.max_sessions:
            raise Unavailable(f"the PC holds {len(held)} sessions, its maximum")

    @staticmethod
    def live(identity: str, held: Mapping[uuid.UUID, PlacedSession]) -> list[uuid.UUID]:
        """The sessions of *identity* among *held* that are not done."""
        return [i for i, s in held.items() if s.owner == identity and s.state is not SessionState.DONE]

    def began(self, session: PlacedSession) -> None:
        """*session* was admitted: its placement is under way."""
        self._placing.setdefault(session.owner, set()).add(session.id)

    def ended(self, session: PlacedSession) -> None:
        """The first placement of *session* ended, however (placed, unplaced, abandoned); idempotent."""
        placing = self._placing.get(session.owner)
        if placing is not None:
            placing.discard(session.id)
            if not placing:
                del self._placing[session.owner]


__all__ = ["SessionAdmission", "SessionsAtLimit"]
