"""Where the Index Service keeps Producer Digests (:mod:`kvsp_quic.producer_digests`): a Protocol and the memory store.

A store keeps one record per (Block Key, producer) -- a producer that publishes a block again replaces its record --
until ``now + ttl_ms``, and answers, per requested key, the unexpired records of a scope and compat_id with their
**remaining** TTL (milliseconds, rounded up, at least 1), as the replica stores do. The role
(:mod:`kvsp_quic.roles.producer_digests`) does every check (authorization, the producer's identity, the TTL cap).

:func:`store_for` picks the store that goes with the Index Service's replica store: a store that offers
``producer_digest_store()`` (the Redis store: :mod:`kvsp_quic.storage.redis_producer_digests`, same client and
prefix) gives its own; any other gets a :class:`MemoryProducerDigests`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvsp_quic.producer_digests import ProducerDigest


@runtime_checkable
class ProducerDigestStore(Protocol):
    async def put(self, record: ProducerDigest, now: float) -> bool:
        """Keep *record* (``producer`` set, ``ttl_ms`` capped) until ``now + ttl_ms``; True when no unexpired
        record of that producer for the block was there."""
        ...

    async def get(self, scope_id: bytes, compat_id: bytes, block_keys: Sequence[bytes],
                  now: float) -> list[ProducerDigest]:
        """The unexpired records of *block_keys* (in key order) of that scope and compat; ``ttl_ms``: remaining."""
        ...

    async def expire(self, now: float, limit: int = 65536) -> int:
        """Drop expired records (up to *limit* keys examined); how many were dropped."""
        ...


def remaining_ms(expiry: float, now: float) -> int:
    return max(1, math.ceil((expiry - now) * 1000))


class MemoryProducerDigests:
    """:class:`ProducerDigestStore` in this process's memory: Block Key -> {producer -> (expiry, record)}."""

    def __init__(self) -> None:
        self._blocks: dict[bytes, dict[str, tuple[float, ProducerDigest]]] = {}
        self._sweep_keys: list[bytes] = []
        self._sweep_pos = 0

    async def put(self, record: ProducerDigest, now: float) -> bool:
        if record.producer is None:
            raise ValueError("a stored producer digest names its producer")
        entries = self._blocks.setdefault(bytes(record.block_key), {})
        old = entries.get(record.producer)
        entries[record.producer] = (now + record.ttl_ms / 1000, record)
        return old is None or old[0] <= now

    async def get(self, scope_id: bytes, compat_id: bytes, block_keys: Sequence[bytes],
                  now: float) -> list[ProducerDigest]:
        out = []
        scope, compat = bytes(scope_id), bytes(compat_id)
        for key in block_keys:
            for expiry, record in (self._blocks.get(bytes(key)) or {}).values():
                if expiry > now and bytes(record.scope_id) == scope and bytes(record.compat_id) == compat:
                    out.append(dataclasses.replace(record, ttl_ms=remaining_ms(expiry, now)))
        return out

    async def expire(self, now: float, limit: int = 65536) -> int:
        """Incremental: each call examines the next *limit* keys of a snapshot taken when the last one ended."""
        if self._sweep_pos >= len(self._sweep_keys):
            self._sweep_keys, self._sweep_pos = list(self._blocks), 0
        chunk = self._sweep_keys[self._sweep_pos:self._sweep_pos + limit]
        self._sweep_pos += len(chunk)
        dropped = 0
        for key in chunk:
            entries = self._blocks.get(key)
            if entries is None:
                continue
            for producer in [p for p, (expiry, _r) in entries.items() if expiry <= now]:
                del entries[producer]
                dropped += 1
            if not entries:
                del self._blocks[key]
        return dropped

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._blocks.values())


def store_for(index_store: Any) -> ProducerDigestStore:
    """The producer-digest store that goes with *index_store* (see the module docstring)."""
    make = getattr(index_store, "producer_digest_store", None)
    if make is not None:
        store: ProducerDigestStore = make()
        return store
    return MemoryProducerDigests()


__all__ = ["MemoryProducerDigests", "ProducerDigestStore", "remaining_ms", "store_for"]
