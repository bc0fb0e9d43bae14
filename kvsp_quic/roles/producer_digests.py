"""The Index Service's side of producer digests (docs/wire.md, "Producer digests"; :mod:`kvsp_quic.producer_digests`).

* publish, ``POST producer-digests`` ``{"digests": [...]}``: only a principal with the ``instance`` role, and the scope
  of every record (403 ``kvsp-scope-denied``, nothing stored) -- holders and clients never (403): a holder that
  publishes a wrong digest in its Replica Record cannot also forge the producer's. The Index Service stamps
  ``producer`` with the authenticated identity; a record that names another producer is 403. At most
  :data:`~kvsp_quic.producer_digests.MAX_BATCH` records (413). ``ttl_ms`` is capped at the replicas' ``max_ttl_ms``.
* lookup, ``POST producer-digests/lookup`` ``{"compat_id", "scope_id", "block_keys"}``: any principal of the scope
  (403 ``kvsp-scope-denied`` before anything is read), at most ``max_lookup_keys`` keys (413); the answer lists
  the unexpired records of those keys, in key order, with their remaining TTL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvsp_quic.auth import Principal, Role, require_role, require_scope
from kvsp_quic.problems import ContentTooLarge, Forbidden
from kvsp_quic.producer_digests import MAX_BATCH, ProducerDigest, ProducerDigestQuery, ProducerDigests
from kvsp_quic.storage.producer_digests import ProducerDigestStore


class ProducerDigestService:
    """Publish and look up producer digests; *clock*: the Index Service's monotonic clock (seconds)."""

    def __init__(self, store: ProducerDigestStore, *, clock: Callable[[], float], max_ttl_ms: int,
                 max_lookup_keys: int) -> None:
        self.store = store
        self.clock = clock
        self.max_ttl_ms = max_ttl_ms
        self.max_lookup_keys = max_lookup_keys

    async def publish(self, principal: Principal, body: ProducerDigests) -> ProducerDigests:
        """The records as stored: ``producer`` the principal's identity, ``ttl_ms`` the granted TTL."""
        require_role(principal, Role.INSTANCE)
        if len(body.digests) > MAX_BATCH:
            raise ContentTooLarge(f"a publish carries at most {MAX_BATCH} producer digests, got {len(body.digests)}")
        stored = []
        for i, record in enumerate(body.digests):
            if record.producer is not None and record.producer != principal.identity:
                raise Forbidden(f"digests[{i}].producer: identity {principal.identity!r} may publish producer "
                                f"digests only in its own name, not {record.producer!r}")
            require_scope(principal, record.scope_id)
            stored.append(dataclasses.replace(record, producer=principal.identity,
                                              ttl_ms=min(record.ttl_ms, self.max_ttl_ms)))
        now = self.clock()
        for record in stored:
            await self.store.put(record, now)
        return ProducerDigests(tuple(stored))

    async def lookup(self, principal: Principal, query: ProducerDigestQuery) -> ProducerDigests:
        n = len(query.block_keys)
        if n > self.max_lookup_keys:
            raise ContentTooLarge(f"a producer-digest lookup carries at most {self.max_lookup_keys} block keys, "
                                  f"got {n}")
        require_scope(principal, query.scope_id)
        found = await self.store.get(query.scope_id, query.compat_id, query.block_keys, self.clock())
        return ProducerDigests(tuple(found))

    async def sweep(self, limit: int = 65536) -> int:
        return await self.store.expire(self.clock(), limit)


__all__ = ["ProducerDigest", "ProducerDigestService"]
