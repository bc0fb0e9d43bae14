"""The Placement Controller's state: a :class:`typing.Protocol` and the JSON encoding the backends share.

Every piece of the PC's state that the PC and the status resource need lives in a :class:`ControlStore`, read
before each decision and written after it, whether one process holds it or several share it: a single-replica PC
keeps it in :class:`~kvsp_quic.storage.memory_control.MemoryControlStore`; with ``--store redis``
:class:`~kvsp_quic.storage.redis_control.RedisControlStore` holds it, so that any number of ``kvsp-quic index``
processes sharing it are interchangeable (docs/operations.md, "Replicated Index Service and Placement
Controller"):

* **sessions** (request, owner, epochs, instance, latest checkpoint, state, as the role encodes them:
  ``kvsp_quic.roles.controller_store``) -- each with a *version*; :meth:`ControlStore.save` is a compare-and-set
  on it, so an epoch increment and "the highest checkpoint wins" are atomic: of two replicas that both read
  version v and both decide to migrate, one writes v+1 and the other stands down;
* **a lease per session** being placed or migrated (:meth:`ControlStore.lease`): one replica at a time places it;
  a replica that does not get the lease stands down; a dead holder's lease lapses after ``ttl_ms``;
* **the index of running sessions per instance run** (``instance``, ``instance_epoch``) and of sessions waiting
  for a migration, kept by :meth:`ControlStore.save`, so that a replica's tick finds the sessions of a failed
  instance without reading every session (:meth:`ControlStore.candidates`);
* **instance statuses** (:class:`StoredStatus`: the record, the state held, the state the PC decided for the run,
  the reporter's scopes, expiry on the store's clock) and the highest epoch of every instance;
* **shard maps**, each with its *context* (extension, docs/wire.md "Resharding": the Block Keys its plans name,
  encoded by ``kvsp_quic.roles.controller_reshard.context_bytes``; stored with the map, so a reshard through any
  replica sends the context given to another), and the one-reshard-per-map lock.

What stays per process, and why that is fine: the sessions assigned since an instance's last report (a placement
hint that only spreads one replica's own burst of placements; every replica sees every report), the start hook's
timing (each replica runs the hook for the requests it places: at most once per ``start_interval_ms`` per
replica), the metrics (per process, as Prometheus scrapes them), the copy of each session the replica last read or
wrote (the role's table: what its metrics and the clients' session limits count), and the asyncio bookkeeping of
the work under way at this replica (per-session locks, the epoch it last stored for a session it places, its
migration tasks, the requests waiting for an instance to become active -- which also read the stored statuses, so
an instance that reports to another replica wakes them). Prefetch directives need no bookkeeping at the PC: each is
sent with the start or resume it precedes and judged on its answer only.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import orjson

from kvsp_quic.auth import ALL, Scopes
from kvsp_quic.compat import InstanceState
from kvsp_quic.fields import ScopeId
from kvsp_quic.records import InstanceStatusRecord, ShardMap


@dataclass(frozen=True)
class StoredStatus:
    """One instance's status as the store keeps it. ``remaining_ms``: until the record expires (<= 0: expired)."""

    record: InstanceStatusRecord
    state: InstanceState
    remaining_ms: int
    decided: InstanceState | None = None  # what the PC decided for this run (record.epoch) of the instance
    scopes: Scopes | None = None  # of the principal that reported it

    def to_bytes(self) -> bytes:
        scopes: Any = None
        if self.scopes is ALL:
            scopes = "*"
        elif self.scopes is not None:
            scopes = sorted(bytes(s).hex() for s in self.scopes)
        return orjson.dumps({"record": self.record.to_json(), "state": self.state.value,
                             "decided": self.decided.value if self.decided is not None else None,
                             "scopes": scopes})

    @classmethod
    def from_bytes(cls, data: bytes, remaining_ms: int) -> StoredStatus:
        obj = orjson.loads(data)
        raw = obj.get("scopes")
        scopes: Scopes | None = None
        if raw == "*":
            scopes = ALL
        elif raw is not None:
            scopes = frozenset(ScopeId(bytes.fromhex(s)) for s in raw)
        decided = obj.get("decided")
        return cls(InstanceStatusRecord.from_json(obj["record"]), InstanceState(obj["state"]), remaining_ms,
                   InstanceState(decided) if decided is not None else None, scopes)


@dataclass(frozen=True)
class StatusSnapshot:
    """Every instance status the store holds (expired ones left out) and the highest epoch of every instance, at
    the store's *revision* of them (None: the store counts none; each read is a full snapshot)."""

    entries: tuple[StoredStatus, ...]
    epochs: dict[str, int]
    revision: int | None = None


@dataclass(frozen=True)
class StatusWrite:
    """What :meth:`ControlStore.put_status` did. ``higher``: the higher epoch the store knows of the instance (a
    stale report: nothing was written). ``revisions``: the store's revision of the statuses just before and just
    after the write (None: it counts none), so a writer whose view was at the first is at the second."""

    higher: int | None = None
    revisions: tuple[int, int] | None = None


# -- sessions -----------------------------------------------------------------------------------------------------


class SessionPayload(Protocol):
    """A session's content as the role hands it to a store (``kvsp_quic.roles.controller_store.SessionSnapshot``)
    or a store that keeps octets reads it back (:class:`EncodedSession`). A store in this process keeps it as is; a
    store outside it keeps :meth:`encoded`."""

    def encoded(self) -> bytes:
        """The session's encoding (JSON, ``kvsp_quic.roles.controller_store``)."""
        ...


@dataclass(frozen=True)
class EncodedSession:
    """A session's payload as read back from a store that keeps octets."""

    data: bytes

    def encoded(self) -> bytes:
        return self.data


@dataclass(frozen=True)
class StoredSession:
    """A session as stored: its payload, its version, and the two index facts the store keeps for it: the instance
    run serving it (:func:`run_key`, '' for none) and whether it waits for a migration."""

    payload: SessionPayload
    version: int = 0
    run: str = ""
    migrating: bool = False


def run_key(instance: str, instance_epoch: int) -> str:
    """The index entry of an instance run (what :meth:`ControlStore.candidates` hands back to be judged)."""
    return f"{instance_epoch}|{instance}"


def parse_run_key(key: str) -> tuple[str, int]:
    epoch, _, instance = key.partition("|")
    return instance, int(epoch)


@runtime_checkable
class ControlStore(Protocol):
    """Where the Placement Controller's state lives (module docstring): in this process, or shared by replicas."""

    shared: bool  # other processes write it too: their changes reach this one only by reading it (readers poll)

    # sessions
    async def load(self, session_id: uuid.UUID) -> StoredSession | None:
        """The stored session, or None."""
        ...

    async def save(self, session_id: uuid.UUID, session: StoredSession, ttl_ms: int) -> int | None:
        """Write *session* if the stored version is still ``session.version`` (0: only if there is none: a new
        session); the new version, or None when another replica wrote it since (or it is gone, or exists). Keeps
        the run and migration indexes; the session expires *ttl_ms* after its last write."""
        ...

    async def delete(self, session_id: uuid.UUID) -> None: ...

    async def candidates(self, failed: Callable[[str, int], bool]) -> list[uuid.UUID]:
        """The sessions of the instance runs for which *failed(instance, instance_epoch)* is true, and those waiting
        for a migration."""
        ...

    async def forget(self, session_id: uuid.UUID) -> None:
        """Drop a session id the indexes still name but that is gone."""
        ...

    async def lease(self, session_id: uuid.UUID, owner: str, ttl_ms: int) -> bool:
        """Take (or renew, for its owner) the placement lease of a session; False when another owner holds it."""
        ...

    async def release(self, session_id: uuid.UUID, owner: str) -> None: ...

    # instance statuses
    async def put_status(self, status: StoredStatus) -> StatusWrite:
        """Store *status* (for ``remaining_ms``) unless the store knows a higher epoch of the instance (a stale
        report: :attr:`StatusWrite.higher`)."""
        ...

    async def statuses(self, since: int | None = None) -> StatusSnapshot | None:
        """Every status held; None when *since* is still the store's revision of them (nothing changed since the
        snapshot of that revision: a store that counts revisions)."""
        ...

    async def fail_status(self, instance: str, epoch: int) -> bool:
        """Drop *instance*'s status if it is of run *epoch* (the PC found it silent): it counts as failed from then
        on, as if it had expired; its highest epoch is kept. True when one was dropped."""
        ...

    # shard maps
    async def get_map(self, map_id: str) -> ShardMap | None: ...

    async def add_map(self, shard_map: ShardMap, context: bytes | None = None) -> ShardMap | None:
        """Register a new map with its *context* (None: none), atomically; the stored map instead when one exists
        (nothing is written: neither the map nor its context)."""
        ...

    async def commit_map(self, old_version: int, new: ShardMap) -> bool:
        """Make *new* authoritative if the stored version is still *old_version* (the map keeps its context)."""
        ...

    async def map_context(self, map_id: str) -> bytes | None:
        """The context stored with the map (None: the map has none, or there is no such map)."""
        ...

    async def set_map_context(self, map_id: str, context: bytes) -> bool:
        """Make *context* the map's, replacing the one it had; False (nothing written) when there is no such map."""
        ...

    async def lock_map(self, map_id: str, owner: str, ttl_ms: int) -> bool: ...

    async def unlock_map(self, map_id: str, owner: str) -> None: ...

    async def ping(self) -> None:
        """Raise unless the store answers."""
        ...

    async def aclose(self) -> None: ...


def encode_map(shard_map: ShardMap) -> bytes:
    return orjson.dumps(shard_map.to_json())


def decode_map(data: bytes) -> ShardMap:
    return ShardMap.from_json(orjson.loads(data))


def ids_of(raw: Sequence[bytes | str]) -> list[uuid.UUID]:
    out = []
    for item in raw:
        text = item.decode("ascii") if isinstance(item, bytes) else item
        try:
            out.append(uuid.UUID(text))
        except ValueError:
            continue
    return out


__all__ = ["ControlStore", "EncodedSession", "SessionPayload", "StatusSnapshot", "StatusWrite", "StoredSession",
           "StoredStatus",
           "decode_map", "encode_map", "ids_of", "parse_run_key", "run_key"]
