"""Where several Index Service processes share holders' liveness records and clients' failure reports
(:class:`LivenessStore`; issue 12, point 1): the records one read returns. The rules that use them (lapsed,
demoted, endpoints, how a read merges with a process's own reports) are :mod:`kvsp_quic.roles.liveness`'s; the
Redis implementation is :mod:`kvsp_quic.storage.redis_liveness`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

MAX_ENTRIES = 65536  # holders tracked (liveness) or (scope, holder) pairs demoted, in a process or a shared store


@dataclass(frozen=True)
class SharedHolder:
    """A holder's liveness record as a shared store returns it: *remaining_ms* on the store's clock at the read,
    negative once the record lapsed (a lapsed record is kept a while: its holder's replicas stay left out)."""

    holder: str
    ttl_ms: int
    remaining_ms: int


@dataclass(frozen=True)
class SharedDemotion:
    """A failure report's demotion as a shared store returns it (only those still running: *remaining_ms* > 0)."""

    scope_id: bytes
    holder: str
    remaining_ms: int


@dataclass(frozen=True)
class SharedLiveness:
    """One read of the shared tables (:meth:`LivenessStore.snapshot`)."""

    holders: tuple[SharedHolder, ...] = ()
    demotions: tuple[SharedDemotion, ...] = ()


class LivenessStore(Protocol):
    """The shared tables; expiry is judged on the store's clock. Raises the store's own errors when it cannot be
    reached."""

    async def report(self, holder: str, ttl_ms: int) -> None:
        """Write *holder*'s liveness record, valid for *ttl_ms* (already capped) from now."""

    async def report_failure(self, scope_id: bytes, holder: str, demote_ms: int) -> None:
        """Demote *holder* in the lookups of *scope_id* for *demote_ms* from now (a running demotion is never
        shortened)."""

    async def snapshot(self) -> SharedLiveness:
        """Every liveness record (lapsed ones for a while) and every running demotion."""


__all__ = ["MAX_ENTRIES", "LivenessStore", "SharedDemotion", "SharedHolder", "SharedLiveness"]
