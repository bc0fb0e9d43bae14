"""Liveness of holders and relays at the Index Service, and the failures clients report (issue 12, point 5;
docs/wire.md, "Holder liveness and failure reports"). Pure bookkeeping on an injected monotonic clock.

The spec lets the Index Service decide what a lookup returns ("Lookup": the replicas it knows, with their
remaining TTL) and says nothing of how it learns that a holder died; an instance's liveness is its status record
(:mod:`kvsp_quic.roles.status`). A holder or relay has no status record, so it refreshes a small liveness record
instead, and lookups leave out its replicas once that record lapsed:

* :class:`LivenessTable` -- ``PUT holders/{holder-id}/liveness`` ``{"holder": uri, "ttl_ms": n}`` refreshes the
  holder's record (``ttl_ms`` capped at ``max_ttl_ms``); a holder whose record expired is *lapsed* until it
  reports again: its replicas, at its host and port (its ``https`` records and their ``moqt://`` twins, which share
  the UDP port), are left out of lookups. A holder that never reported is never left out (holders of other
  implementations keep working; their records expire with their TTL, as the spec says).
* :class:`FailureReports` -- ``POST holders/{holder-id}/failures`` ``{"holder": uri, "scope_id": hex}``: a client
  of the scope could not fetch from the holder (connection refused, timeout, a transfer that stalled). One report
  proves nothing (the client's own network may be at fault, or it may lie), so the Index Service drops no record
  on it: it only moves that holder's replicas *last* in the lookups of that scope for ``demote_ms``, so other
  clients try the other replicas first and still reach this one when no other is left. Liveness is the Index
  Service's own check: a reported holder that keeps refreshing its liveness record stays listed.

Both tables live in each Index Service process, where lookups read them synchronously. With several processes on
one shared store (``--store redis``, issue 12 point 1: every piece of control-plane state lives in Redis) they are
a cache of shared tables (:class:`~kvsp_quic.storage.liveness_store.LivenessStore`, in Redis
:mod:`kvsp_quic.storage.redis_liveness`): a liveness record or a failure report received by any process is written
there first (a write that fails fails the request) and then applied to the receiving process's tables at once;
every process reloads the shared tables periodically (:meth:`LivenessTable.load`, :meth:`FailureReports.load`: one
read of a :class:`~kvsp_quic.storage.liveness_store.SharedLiveness`; every 250 ms in
``kvsp_http.index_app.liveness_syncer``), so another process's news reaches its lookups within one period plus a
round trip. A load never undoes a newer local write: a holder keeps its latest report (by report time), a demotion
its latest end. While the shared store cannot be read, a process keeps its last view (and its own writes). Without
a shared store (the memory store: one process) the tables are the process's own, with no reload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvsp_quic.records import ReplicaRecord
from kvsp_quic.roles.status import endpoint
from kvsp_quic.storage.liveness_store import (
    MAX_ENTRIES,
    LivenessStore,
    SharedDemotion,
    SharedHolder,
    SharedLiveness,
)

Clock = Callable[[], float]
Endpoint = tuple[str, int]

DEFAULT_MAX_LIVENESS_TTL_MS = 60_000
DEFAULT_DEMOTE_MS = 10_000
# MAX_ENTRIES (kvsp_quic.storage.liveness_store): holders tracked or (scope, holder) pairs demoted; the oldest go
# first beyond
NEWER_S = 0.05  # a shared record replaces a process's own only when reported this much later (read-back jitter)


@dataclass(frozen=True)
class Liveness:
    """A holder's liveness record as the Index Service holds it."""

    holder: str
    ttl_ms: int  # as granted (capped)
    expires_at: float


class LivenessTable:
    """The liveness records of holders and relays (module docstring)."""

    def __init__(self, clock: Clock, *, max_ttl_ms: int = DEFAULT_MAX_LIVENESS_TTL_MS) -> None:
        if max_ttl_ms < 1:
            raise ValueError("max_ttl_ms must be positive")
        self.clock = clock
        self.max_ttl_ms = max_ttl_ms
        self._entries: dict[str, Liveness] = {}

    def report(self, holder: str, ttl_ms: int) -> Liveness:
        """Refresh *holder*'s record; the record held (with the granted TTL)."""
        if ttl_ms < 1:
            raise ValueError("ttl_ms must be positive")
        ttl_ms = min(ttl_ms, self.max_ttl_ms)
        entry = Liveness(holder, ttl_ms, self.clock() + ttl_ms / 1000.0)
        self._put(entry)
        return entry

    def _put(self, entry: Liveness) -> None:
        self._entries.pop(entry.holder, None)
        if len(self._entries) >= MAX_ENTRIES:
            del self._entries[next(iter(self._entries))]  # the one refreshed longest ago
        self._entries[entry.holder] = entry

    def load(self, records: Iterable[SharedHolder]) -> int:
        """Merge the shared records read just now (module docstring): a holder's shared record replaces this
        process's own when it was reported later (by more than :data:`NEWER_S`: the same report read back moves
        by a round trip); holders known here only stay. The records taken."""
        now, taken = self.clock(), 0
        for r in records:
            expires_at = now + r.remaining_ms / 1000.0
            mine = self._entries.get(r.holder)
            if mine is not None and \
                    expires_at - r.ttl_ms / 1000.0 <= mine.expires_at - mine.ttl_ms / 1000.0 + NEWER_S:
                continue
            self._put(Liveness(r.holder, r.ttl_ms, expires_at))
            taken += 1
        return taken

    def snapshot(self) -> tuple[SharedHolder, ...]:
        """The records held, as a shared store would return them (remaining time from now)."""
        now = self.clock()
        return tuple(SharedHolder(e.holder, e.ttl_ms, round((e.expires_at - now) * 1000))
                     for e in self._entries.values())

    def alive(self, holder: str) -> bool | None:
        """True while *holder*'s record is unexpired, False once it lapsed, None if it never reported."""
        entry = self._entries.get(holder)
        if entry is None:
            return None
        return self.clock() < entry.expires_at

    def lapsed_endpoints(self) -> frozenset[Endpoint]:
        """(host, port) of every holder whose record lapsed, less those of holders alive at the same endpoint
        (a holder restarted under another base URI on the same port)."""
        now = self.clock()
        lapsed: set[Endpoint] = set()
        alive: set[Endpoint] = set()
        for holder, entry in self._entries.items():
            (alive if now < entry.expires_at else lapsed).add(endpoint(holder))
        return frozenset(lapsed - alive)

    def __len__(self) -> int:
        return len(self._entries)


class FailureReports:
    """Clients' reports of holders they could not fetch from, as demotions in the lookup order of one scope for
    *demote_ms* (module docstring)."""

    def __init__(self, clock: Clock, *, demote_ms: int = DEFAULT_DEMOTE_MS) -> None:
        if demote_ms < 0:
            raise ValueError("demote_ms must not be negative")
        self.clock = clock
        self.demote_ms = demote_ms
        self._until: dict[tuple[bytes, Endpoint], float] = {}
        self.reports = 0

    def report(self, scope_id: bytes, holder: str) -> None:
        self.reports += 1
        if self.demote_ms == 0:
            return
        key, until = (bytes(scope_id), endpoint(holder)), self.clock() + self.demote_ms / 1000.0
        self._put(key, max(until, self._until.get(key, until)))  # never shortened (a longer one was loaded)

    def _put(self, key: tuple[bytes, Endpoint], until: float) -> None:
        self._until.pop(key, None)
        if len(self._until) >= MAX_ENTRIES:
            self.expire()
            if len(self._until) >= MAX_ENTRIES:
                del self._until[next(iter(self._until))]
        self._until[key] = until

    def load(self, demotions: Iterable[SharedDemotion]) -> int:
        """Merge the shared demotions read just now (module docstring): a demotion ends at the later of this
        process's end and the shared one (a failure report never shortens one). The demotions lengthened or added."""
        now, taken = self.clock(), 0
        for d in demotions:
            key, until = (bytes(d.scope_id), endpoint(d.holder)), now + d.remaining_ms / 1000.0
            old = self._until.get(key)
            if d.remaining_ms <= 0 or (old is not None and until <= old + NEWER_S):
                continue
            self._put(key, until)
            taken += 1
        return taken

    def demoted(self, scope_id: bytes) -> frozenset[Endpoint]:
        """The endpoints demoted in the lookups of *scope_id* now."""
        if not self._until:
            return frozenset()
        now, scope = self.clock(), bytes(scope_id)
        return frozenset(ep for (s, ep), until in self._until.items() if s == scope and now < until)

    def expire(self) -> int:
        now = self.clock()
        gone = [key for key, until in self._until.items() if until <= now]
        for key in gone:
            del self._until[key]
        return len(gone)

    def __bool__(self) -> bool:
        return bool(self._until)


def demote(replicas: Sequence[ReplicaRecord], demoted: frozenset[Endpoint]) -> tuple[ReplicaRecord, ...]:
    """*replicas* with those at a demoted endpoint moved last (each group in its order)."""
    first = tuple(r for r in replicas if endpoint(r.holder) not in demoted)
    if len(first) == len(replicas):
        return tuple(replicas)
    return first + tuple(r for r in replicas if endpoint(r.holder) in demoted)


__all__ = ["DEFAULT_DEMOTE_MS", "DEFAULT_MAX_LIVENESS_TTL_MS", "MAX_ENTRIES", "FailureReports", "Liveness",
           "LivenessStore", "LivenessTable", "SharedDemotion", "SharedHolder", "SharedLiveness", "demote"]
