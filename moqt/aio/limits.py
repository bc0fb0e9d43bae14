"""Per-principal bounds on the requests an endpoint serves at once (issue 13), for any :class:`~moqt.aio.MoqtApp`.

MOQT's own flow control bounds requests per *session* (draft 14 MAX_REQUEST_ID; draft 18 the peer's request
streams), not per peer: an authenticated peer can open as many sessions as it likes, each with its full request
credit. An endpoint whose requests cost it resources beyond the session -- a relay's upstream FETCHes and the
octets it buffers for them, a holder's send buffers -- bounds them per principal (the peer's verified identity;
its address when it has none) with a :class:`PeerLimits`:

* **in flight**: requests of one principal being served at once (:meth:`PeerLimits.acquire` gives a
  :class:`Slot`, released when the request is over);
* **buffered**: octets held on behalf of one principal (:meth:`PeerLimits.charge` names a buffer -- anything with
  a ``size`` -- held until :meth:`PeerLimits.discharge`); a principal at or above its budget gets no new slot.

Over a limit, the request is refused (:meth:`PeerLimits.refuse`) with the draft's code for it: draft 18
REQUEST_ERROR ``EXCESSIVE_LOAD`` (0x9: "The responder is overloaded and cannot process the request at this time.
The sender SHOULD use the Retry Interval to indicate when the request can be retried", section "REQUEST_ERROR")
with a Retry Interval ("The minimum time (in milliseconds) before the request SHOULD be sent again, plus one");
draft 14, whose FETCH_ERROR / SUBSCRIBE_ERROR have neither, ``INTERNAL_ERROR`` (0x0, "An implementation specific
or generic error occurred") with the same hint in the reason phrase. Other principals are not affected.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from moqt.errors import RequestErrorCode14, RequestErrorCode18
from moqt.types import Draft

if TYPE_CHECKING:
    from moqt.aio.connection import MoqtConnection


def excessive_load_code(draft: Draft) -> int:
    """The refusal code of a request the endpoint will not serve now (see the module docstring)."""
    return int(RequestErrorCode14.INTERNAL_ERROR if draft is Draft.D14 else RequestErrorCode18.EXCESSIVE_LOAD)


class Buffer(Protocol):
    @property
    def size(self) -> int: ...


def principal_of(conn: MoqtConnection) -> str:
    """Whom a request counts against: the peer's verified identity, else its address."""
    if conn.peer_identity is not None:
        return conn.peer_identity
    return f"address:{conn.peer[0]}" if conn.peer is not None else "address:-"


@dataclass(eq=False)
class Slot:
    """One request in flight for *principal*; :meth:`release` (idempotent) ends it."""

    limits: PeerLimits
    principal: str
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limits._release(self.principal)


@dataclass
class _Usage:
    in_flight: int = 0
    buffers: set[int] = field(default_factory=set)  # ids of the buffers charged (see PeerLimits._buffers)


class PeerLimits:
    """Requests in flight and octets buffered per principal (see the module docstring). *max_buffered* None: no
    octet budget. *retry_ms*: the hint sent with a refusal."""

    def __init__(self, *, max_in_flight: int, max_buffered: int | None = None, retry_ms: int = 1000) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if max_buffered is not None and max_buffered < 1:
            raise ValueError("max_buffered must be positive")
        if retry_ms < 0:
            raise ValueError("retry_ms must not be negative")
        self.max_in_flight = max_in_flight
        self.max_buffered = max_buffered
        self.retry_ms = retry_ms
        self.refused: collections.Counter[str] = collections.Counter()  # by what ("in_flight", "buffered")
        self._usage: dict[str, _Usage] = {}
        self._buffers: dict[int, Buffer] = {}
        self.last_refusal = ""  # the limit the last failed acquire met: "in_flight" or "buffered"

    # -- in flight

    def acquire(self, conn: MoqtConnection) -> Slot | None:
        """A slot for one more request of *conn*'s principal, or None when it is at a limit (then :meth:`refuse`
        the request; :attr:`last_refusal` says which limit)."""
        principal = principal_of(conn)
        usage = self._usage.setdefault(principal, _Usage())
        if usage.in_flight >= self.max_in_flight:
            self.last_refusal = "in_flight"
        elif self.max_buffered is not None and self.buffered(principal) >= self.max_buffered:
            self.last_refusal = "buffered"
        else:
            usage.in_flight += 1
            return Slot(self, principal)
        self._drop_if_idle(principal)
        return None

    def in_flight(self, principal: str) -> int:
        usage = self._usage.get(principal)
        return usage.in_flight if usage is not None else 0

    def _release(self, principal: str) -> None:
        usage = self._usage.get(principal)
        if usage is not None:
            usage.in_flight -= 1
            self._drop_if_idle(principal)

    # -- buffered octets

    def charge(self, principal: str, buffer: Buffer) -> None:
        """*buffer*'s octets (its ``size``, read when asked) count against *principal* until :meth:`discharge`."""
        self._usage.setdefault(principal, _Usage()).buffers.add(id(buffer))
        self._buffers[id(buffer)] = buffer

    def discharge(self, principal: str, buffer: Buffer) -> None:
        usage = self._usage.get(principal)
        if usage is not None and id(buffer) in usage.buffers:
            usage.buffers.discard(id(buffer))
            self._buffers.pop(id(buffer), None)
            self._drop_if_idle(principal)

    def buffered(self, principal: str) -> int:
        usage = self._usage.get(principal)
        return sum(self._buffers[b].size for b in usage.buffers) if usage is not None else 0

    def _drop_if_idle(self, principal: str) -> None:
        usage = self._usage.get(principal)
        if usage is not None and usage.in_flight <= 0 and not usage.buffers:
            del self._usage[principal]

    # -- refusing

    def refuse(self, conn: MoqtConnection, request_id: int, what: str = "request") -> None:
        """Refuse *request_id* of *conn* as over the limit (the draft's code, a retry hint) and count it."""
        why = self.last_refusal or "in_flight"
        self.refused[why] += 1
        if why == "buffered":
            detail = f"{self.max_buffered} octets are buffered for this client already"
        else:
            detail = f"{self.max_in_flight} {what}s of this client are in flight already"
        reason = f"excessive load: {detail}; retry after {self.retry_ms} ms".encode()
        conn.reject(request_id, excessive_load_code(conn.draft), reason, retry_interval=self.retry_ms + 1)

    def status(self) -> dict[str, int]:
        return {"principals": len(self._usage), "in_flight": sum(u.in_flight for u in self._usage.values()),
                "refused_in_flight": self.refused["in_flight"], "refused_buffered": self.refused["buffered"]}


__all__ = ["Buffer", "PeerLimits", "Slot", "excessive_load_code", "principal_of"]
