"""Leases at a holder (spec: "Leases"): commitments not to evict replicas, with per-client quotas.

Pure bookkeeping with an injected monotonic clock (seconds) and id source; the holder role
(:mod:`kvsp_quic.roles.holder`) checks scopes and which replicas exist, and asks :meth:`LeaseTable.protects`
before it evicts anything. docs/wire.md ("Holder") records the decisions:

* the client is the authenticated identity; its quota counts the octets of the replicas named by each of its
  unexpired leases (a replica leased twice counts twice) and the number of its leases;
* a request whose ``ttl_ms`` exceeds the maximum, or that would take the client over a quota, is refused with
  ``kvsp-lease-quota`` (429) -- nothing is clamped;
* quotas protect capacity (spec, Security Considerations: "Leases reserve holder memory. Quotas on leased octets,
  lease TTL ... are REQUIRED"): given the holder's *capacity*, every client's leases together cover at most
  ``max_leased_fraction`` of it, and no client's quota is above ``max_client_share`` of that global cap (below 1.0,
  one client cannot starve the others); a refusal a later expiry would lift carries ``Retry-After``; a lease can
  be renewed at most ``max_renewals`` times and never past ``max_lifetime_ms`` after it was created (429 beyond),
  so a replica is pinned for a bounded time whatever its client does;
* only the owner may renew or release a lease; anyone else gets 404 ``kvsp-not-found``, like an unknown or
  expired lease, so lease ids reveal nothing to other clients;
* a lease whose replica the holder had to drop after a fault is *broken*: it still protects its other
  replicas until it expires, but cannot be renewed (404); releasing it works.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvsp_quic.problems import LeaseQuota, NotFound
from kvsp_quic.storage.tiers import BlockId


@dataclass(frozen=True)
class LeaseLimits:
    """A holder's lease quotas (spec, Security Considerations): the ``[holder.leases]`` / ``[instance.leases]``
    sections as they are."""

    max_ttl_ms: int = 60_000  # the longest lease a client may ask for (and renew to)
    max_octets_per_client: int = 16 << 30  # leased replica octets per client, over its unexpired leases
    max_leases_per_client: int = 1024
    max_keys_per_lease: int = 1024
    max_leased_fraction: float = 1.0  # of the holder's capacity leased by all clients together (global cap)
    max_client_share: float = 1.0  # of the global cap one client may lease (below 1.0 no client starves the others)
    max_renewals: int = 30  # renewals of one lease
    max_lifetime_ms: int = 600_000  # a lease is never renewed past this long after its creation

    def __post_init__(self) -> None:
        for name in ("max_ttl_ms", "max_octets_per_client", "max_leases_per_client", "max_keys_per_lease",
                     "max_lifetime_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        if self.max_renewals < 0:
            raise ValueError("max_renewals: must not be negative")
        if not 0.0 < self.max_leased_fraction <= 1.0:
            raise ValueError("max_leased_fraction: must be in (0, 1]")
        if not 0.0 < self.max_client_share <= 1.0:
            raise ValueError("max_client_share: must be in (0, 1]")


@dataclass
class Lease:
    id: uuid.UUID
    owner: str  # the authenticated identity that created it
    blocks: tuple[BlockId, ...]
    octets: int
    ttl_ms: int  # as granted last (creation or renewal)
    expires_at: float
    created_at: float = 0.0
    renewals: int = 0
    broken: str | None = None  # why, once a replica it covers was dropped after a fault

    def valid(self, now: float) -> bool:
        return now < self.expires_at


@dataclass
class _Usage:
    octets: int = 0
    leases: set[uuid.UUID] = field(default_factory=set)


class LeaseTable:
    """The leases of one holder. With *capacity* (octets the holder can store), the leases of every client together
    cover at most ``limits.max_leased_fraction`` of it (:attr:`global_cap`)."""

    def __init__(self, limits: LeaseLimits = LeaseLimits(), *, clock: Callable[[], float] = time.monotonic,
                 new_id: Callable[[], uuid.UUID] = uuid.uuid4, capacity: int | None = None) -> None:
        self.limits = limits
        self.global_cap = int(capacity * limits.max_leased_fraction) if capacity is not None else None
        self.leased = 0  # octets covered by the unexpired leases of every client
        self._clock = clock
        self._new_id = new_id
        self._leases: dict[uuid.UUID, Lease] = {}
        self._by_block: dict[BlockId, set[uuid.UUID]] = {}
        self._usage: dict[str, _Usage] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: uuid.UUID) -> Lease | None:
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.valid(self._clock()) else None

    def usage(self, owner: str) -> tuple[int, int]:
        """(leased octets, number of leases) of *owner*, over its unexpired leases."""
        self.expire()
        u = self._usage.get(owner)
        return (u.octets, len(u.leases)) if u is not None else (0, 0)

    def _check_ttl(self, ttl_ms: int) -> None:
        if ttl_ms > self.limits.max_ttl_ms:
            raise LeaseQuota(f"ttl_ms {ttl_ms} exceeds this holder's maximum lease TTL of {self.limits.max_ttl_ms} ms")

    def create(self, owner: str, blocks: Sequence[BlockId], sizes: Sequence[int], ttl_ms: int) -> Lease:
        """A new lease of *blocks* (whose replicas have *sizes* octets) for *ttl_ms*, or :class:`LeaseQuota`."""
        if len(blocks) != len(sizes) or not blocks:
            raise ValueError("one size per block, at least one block")
        self._check_ttl(ttl_ms)
        if len(blocks) > self.limits.max_keys_per_lease:
            raise LeaseQuota(f"{len(blocks)} block keys exceed the maximum of {self.limits.max_keys_per_lease} "
                             f"per lease")
        octets = sum(sizes)
        used, count = self.usage(owner)
        if count + 1 > self.limits.max_leases_per_client:
            raise LeaseQuota(f"the client already holds {count} leases, the maximum",
                             retry_after_s=self._retry_after(owner))
        quota = self.client_quota
        if used + octets > quota:
            raise LeaseQuota(f"the lease would cover {octets} octets; the client holds {used} of its quota of "
                             f"{quota}", retry_after_s=self._retry_after(owner) if used else None)
        if self.global_cap is not None and self.leased + octets > self.global_cap:
            raise LeaseQuota(f"the lease would cover {octets} octets; {self.leased} of the {self.global_cap} this "
                             f"holder leases to all clients together are taken", retry_after_s=self._retry_after())
        lease_id = self._new_id()
        while lease_id in self._leases:  # an injected id source might repeat; uuid4 does not in practice
            lease_id = self._new_id()
        now = self._clock()
        lease = Lease(lease_id, owner, tuple(blocks), octets, ttl_ms, now + ttl_ms / 1000, now)
        self._leases[lease_id] = lease
        self.leased += octets
        for block in lease.blocks:
            self._by_block.setdefault(block, set()).add(lease_id)
        usage = self._usage.setdefault(owner, _Usage())
        usage.octets += octets
        usage.leases.add(lease_id)
        return lease

    @property
    def client_quota(self) -> int:
        """The octets one client may have leased: ``max_octets_per_client``, and at most ``max_client_share`` of the
        global cap when the capacity is known."""
        quota = self.limits.max_octets_per_client
        if self.global_cap is not None:
            quota = min(quota, max(1, int(self.global_cap * self.limits.max_client_share)))
        return quota

    def _retry_after(self, owner: str | None = None) -> int:
        """Whole seconds until the soonest unexpired lease (of *owner*, or of anyone) expires: the earliest moment a
        refused request can succeed without a release (``Retry-After`` of the 429)."""
        now = self._clock()
        ids = self._usage[owner].leases if owner is not None and owner in self._usage else self._leases.keys()
        soonest = min((self._leases[i].expires_at for i in ids), default=now + 1)
        return max(1, math.ceil(soonest - now))

    def _owned(self, owner: str, lease_id: uuid.UUID) -> Lease:
        lease = self.get(lease_id)
        if lease is None or lease.owner != owner:
            raise NotFound(f"lease {lease_id} is unknown or has expired")
        return lease

    def renew(self, owner: str, lease_id: uuid.UUID, ttl_ms: int) -> Lease:
        """Extend the owner's lease to *ttl_ms* from now (shorter than before is allowed)."""
        self.expire()
        lease = self._owned(owner, lease_id)
        if lease.broken is not None:
            raise NotFound(f"lease {lease_id} is broken: {lease.broken}")
        self._check_ttl(ttl_ms)
        if lease.renewals >= self.limits.max_renewals:
            raise LeaseQuota(f"lease {lease_id} was renewed {lease.renewals} times, the maximum")
        now = self._clock()
        if now + ttl_ms / 1000 > lease.created_at + self.limits.max_lifetime_ms / 1000:
            raise LeaseQuota(f"lease {lease_id} would last past {self.limits.max_lifetime_ms} ms after its creation, "
                             f"the longest a lease lasts")
        lease.ttl_ms = ttl_ms
        lease.expires_at = now + ttl_ms / 1000
        lease.renewals += 1
        return lease

    def release(self, owner: str, lease_id: uuid.UUID) -> Lease:
        self.expire()
        lease = self._owned(owner, lease_id)
        self._remove(lease)
        return lease

    def protects(self, block: BlockId) -> bool:
        """Whether an unexpired lease covers *block* (the holder must then not evict it)."""
        ids = self._by_block.get(block)
        if not ids:
            return False
        now = self._clock()
        return any(self._leases[i].valid(now) for i in ids)

    def leases_of(self, block: BlockId) -> list[Lease]:
        now = self._clock()
        return [self._leases[i] for i in self._by_block.get(block, ()) if self._leases[i].valid(now)]

    def break_block(self, block: BlockId, reason: str) -> list[Lease]:
        """Mark every unexpired lease covering *block* broken (its replica was dropped after a fault)."""
        broken = self.leases_of(block)
        for lease in broken:
            if lease.broken is None:
                lease.broken = reason
        return broken

    def expire(self) -> list[Lease]:
        """Forget the leases that have expired; returns them."""
        now = self._clock()
        gone = [lease for lease in self._leases.values() if not lease.valid(now)]
        for lease in gone:
            self._remove(lease)
        return gone

    def next_expiry(self) -> float | None:
        return min((lease.expires_at for lease in self._leases.values()), default=None)

    def _remove(self, lease: Lease) -> None:
        del self._leases[lease.id]
        self.leased -= lease.octets
        for block in lease.blocks:
            ids = self._by_block.get(block)
            if ids is not None:
                ids.discard(lease.id)
                if not ids:
                    del self._by_block[block]
        usage = self._usage[lease.owner]
        usage.octets -= lease.octets
        usage.leases.discard(lease.id)
        if not usage.leases:
            del self._usage[lease.owner]

    def all(self) -> Iterable[Lease]:
        return list(self._leases.values())
