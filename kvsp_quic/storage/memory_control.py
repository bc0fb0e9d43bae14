"""The Placement Controller's state in this process (:class:`MemoryControlStore`): the single-replica PC's store.

It keeps what :class:`~kvsp_quic.storage.redis_control.RedisControlStore` keeps, with the same rules, so the PC's
adapter (``kvsp_runtime.controller_service.ControllerService``) has one code path whether its state is shared or
not: sessions with a version (a compare-and-set on :meth:`~MemoryControlStore.save`) and an expiry, the index of
the sessions each instance run serves and of those waiting for a migration, placement leases, instance statuses
with the highest epoch of every instance, shard maps with their contexts and the one-reshard-per-map lock.
Expiries are on the injected clock (seconds), the role's.

A session's payload is kept as it is given, never encoded: the role hands over a snapshot of its own object
(``kvsp_quic.roles.controller_store.SessionSnapshot``), so a checkpoint costs a copy, not a JSON round trip of the
prompt. No I/O, no asyncio: the methods are ``async`` for the Protocol only and never suspend, so each runs
atomically with respect to the event loop.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from kvsp_quic.records import ShardMap
from kvsp_quic.storage.control_store import StatusSnapshot, StatusWrite, StoredSession, StoredStatus, parse_run_key

Clock = Callable[[], float]
K = TypeVar("K")


@dataclass(frozen=True)
class _Held:
    """Something kept until *expires_at* (on the store's clock)."""

    value: StoredSession
    expires_at: float


@dataclass(frozen=True)
class _Lock:
    owner: str
    expires_at: float


class MemoryControlStore:
    """:class:`~kvsp_quic.storage.control_store.ControlStore` in this process (module docstring)."""

    shared = False  # only this process writes it: whoever reads it learns every change by its own events

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._sessions: dict[uuid.UUID, _Held] = {}
        self._runs: dict[str, set[uuid.UUID]] = {}  # run_key -> the sessions that run serves
        self._migrating: set[uuid.UUID] = set()
        self._leases: dict[uuid.UUID, _Lock] = {}
        self._statuses: dict[str, tuple[StoredStatus, float]] = {}  # instance -> (status, expiry)
        self._epochs: dict[str, int] = {}  # instance -> highest epoch (kept after its status expires)
        self._revision = 0  # of the statuses: counts their writes (an expiry changes nothing a reader lacks)
        self._maps: dict[str, ShardMap] = {}
        self._contexts: dict[str, bytes] = {}
        self._map_locks: dict[str, _Lock] = {}

    # -- sessions -------------------------------------------------------------------------------------------------

    def _live(self, session_id: uuid.UUID) -> StoredSession | None:
        held = self._sessions.get(session_id)
        if held is None:
            return None
        if held.expires_at <= self.clock():
            self._drop(session_id)
            return None
        return held.value

    def _drop(self, session_id: uuid.UUID) -> None:
        held = self._sessions.pop(session_id, None)
        if held is not None:
            self._unindex(session_id, held.value.run)
        self._migrating.discard(session_id)

    def _unindex(self, session_id: uuid.UUID, run: str) -> None:
        members = self._runs.get(run)
        if members is not None:
            members.discard(session_id)
            if not members:
                del self._runs[run]

    async def load(self, session_id: uuid.UUID) -> StoredSession | None:
        return self._live(session_id)

    async def save(self, session_id: uuid.UUID, session: StoredSession, ttl_ms: int) -> int | None:
        current = self._live(session_id)
        version = current.version if current is not None else 0
        if version != session.version:
            return None
        old_run = current.run if current is not None else ""
        if old_run != session.run:
            self._unindex(session_id, old_run)
            if session.run:
                self._runs.setdefault(session.run, set()).add(session_id)
        if session.migrating:
            self._migrating.add(session_id)
        else:
            self._migrating.discard(session_id)
        self._sessions[session_id] = _Held(replace(session, version=version + 1), self.clock() + ttl_ms / 1000)
        return version + 1

    async def delete(self, session_id: uuid.UUID) -> None:
        self._drop(session_id)

    async def candidates(self, failed: Callable[[str, int], bool]) -> list[uuid.UUID]:
        out = [i for i in list(self._migrating) if self._live(i) is not None]
        for run in [r for r in self._runs if failed(*parse_run_key(r))]:
            out.extend(i for i in list(self._runs.get(run, ())) if self._live(i) is not None)
        return list(dict.fromkeys(out))

    async def forget(self, session_id: uuid.UUID) -> None:
        if self._live(session_id) is None:
            self._migrating.discard(session_id)
            for run in [r for r, members in self._runs.items() if session_id in members]:
                self._unindex(session_id, run)

    async def lease(self, session_id: uuid.UUID, owner: str, ttl_ms: int) -> bool:
        return _take(self._leases, session_id, owner, ttl_ms, self.clock(), renew=True)

    async def release(self, session_id: uuid.UUID, owner: str) -> None:
        _release(self._leases, session_id, owner)

    # -- instance statuses ----------------------------------------------------------------------------------------

    async def put_status(self, status: StoredStatus) -> StatusWrite:
        record = status.record
        highest = self._epochs.get(record.instance, 0)
        if record.epoch < highest:
            return StatusWrite(highest)
        self._epochs[record.instance] = record.epoch
        self._statuses[record.instance] = (status, self.clock() + max(1, status.remaining_ms) / 1000)
        self._revision += 1
        return StatusWrite(None, (self._revision - 1, self._revision))

    async def statuses(self, since: int | None = None) -> StatusSnapshot | None:
        if since == self._revision:
            return None
        now = self.clock()
        entries = []
        for instance, (s, expires_at) in list(self._statuses.items()):
            if expires_at <= now:
                del self._statuses[instance]
            else:
                remaining = max(1, round((expires_at - now) * 1000))
                entries.append(StoredStatus(s.record, s.state, remaining, s.decided, s.scopes))
        return StatusSnapshot(tuple(entries), dict(self._epochs), self._revision)

    async def fail_status(self, instance: str, epoch: int) -> bool:
        held = self._statuses.get(instance)
        if held is None or held[0].record.epoch != epoch:
            return False
        del self._statuses[instance]
        self._revision += 1
        return True

    # -- shard maps -----------------------------------------------------------------------------------------------

    async def get_map(self, map_id: str) -> ShardMap | None:
        return self._maps.get(map_id)

    async def add_map(self, shard_map: ShardMap, context: bytes | None = None) -> ShardMap | None:
        existing = self._maps.get(shard_map.map)
        if existing is not None:
            return existing
        self._maps[shard_map.map] = shard_map
        if context is not None:
            self._contexts[shard_map.map] = context
        else:
            self._contexts.pop(shard_map.map, None)
        return None

    async def commit_map(self, old_version: int, new: ShardMap) -> bool:
        current = self._maps.get(new.map)
        if current is None or current.version != old_version:
            return False
        self._maps[new.map] = new
        return True

    async def map_context(self, map_id: str) -> bytes | None:
        return self._contexts.get(map_id)

    async def set_map_context(self, map_id: str, context: bytes) -> bool:
        if map_id not in self._maps:
            return False
        self._contexts[map_id] = context
        return True

    async def lock_map(self, map_id: str, owner: str, ttl_ms: int) -> bool:
        return _take(self._map_locks, map_id, owner, ttl_ms, self.clock(), renew=False)

    async def unlock_map(self, map_id: str, owner: str) -> None:
        _release(self._map_locks, map_id, owner)

    # -- the connection (none) ------------------------------------------------------------------------------------

    async def ping(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def _take(locks: dict[K, _Lock], key: K, owner: str, ttl_ms: int, now: float, *, renew: bool) -> bool:
    """Take the lock *key* for *owner* (or, with *renew*, renew it for its owner); False when another holds it."""
    held = locks.get(key)
    if held is not None and held.expires_at > now and (held.owner != owner or not renew):
        return False
    locks[key] = _Lock(owner, now + ttl_ms / 1000)
    return True


def _release(locks: dict[K, _Lock], key: K, owner: str) -> None:
    held = locks.get(key)
    if held is not None and held.owner == owner:
        del locks[key]


__all__ = ["MemoryControlStore"]
