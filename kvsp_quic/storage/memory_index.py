"""The embedded Index Service store: one process, one dict, compact entries.

Layout, chosen for the lookup loop and for memory (benchmarks/bench_index.py measures both):

* one ``dict`` from Block Key (the 32 raw octets) to either one entry or a tuple of entries (several holders
  of the same block);
* an entry is a 4-tuple ``(expires_at, holder, scope_compat, body)``: the absolute expiry on the role's
  monotonic clock, the holder URI (``sys.intern``-ed, so all entries of a holder share one string), the 48
  octets scope_id || compat_id interned in a table of the store (compared by identity in the lookup loop), and
  the rest of the record packed by :func:`~kvsp_quic.storage.index_store.pack_body` (layer digests as one
  ``bytes`` blob), followed, for a record with layer digests, by its digest (32 octets, 2% more memory: the
  SHA-256 of the layer digests is not recomputed for every record a lookup returns). Tuples of floats, strings
  and bytes are untracked by the cycle collector after their first collection, so a million entries cost the
  garbage collector nothing;
* records are rebuilt (:func:`~kvsp_quic.storage.index_store.unpack_body`) only for the matches a lookup returns;
  the HTTP edge's lookups do not even do that: :meth:`MemoryIndexStore.lookup_rendered` writes the answer's JSON
  straight from the packed entries (:func:`~kvsp_quic.storage.index_store.render_into`).

Expired entries are skipped by lookups and replaced by puts; :meth:`MemoryIndexStore.expire` removes them
incrementally (a bounded number of keys per call, from a snapshot of the keys), so memory is returned without a
stop-the-world sweep.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from kvsp_quic import keys as k
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.storage.index_store import pack_body, remaining_ms, render_into, unpack_body

Entry = tuple[float, str, bytes, bytes]  # expires_at, holder, scope_id + compat_id (interned), packed body
Slot = Entry | tuple[Entry, ...]

_FLAGS = 3  # the flags octet of pack_body's head (<HBBQ): bit 0 = layer digests present


def _body(record: ReplicaRecord) -> bytes:
    """pack_body, plus the digest of a record with layer digests (pack_body leaves it out)."""
    body = pack_body(record)
    return body + record.digest if record.layer_digests is not None else body


def _digest(body: bytes) -> bytes | None:
    """The digest :func:`_body` appended, or None (then it is inside the packed body)."""
    return body[-32:] if body[_FLAGS] & 1 else None


@functools.lru_cache(maxsize=65536)
def _holder_id(holder: str) -> str:
    return k.holder_id(holder)


def _entries(slot: Slot) -> tuple[Entry, ...]:
    return (slot,) if slot[0].__class__ is float else slot  # type: ignore[return-value]


class MemoryIndexStore:
    """:class:`~kvsp_quic.storage.index_store.IndexStore` in this process's memory."""

    def __init__(self) -> None:
        self._blocks: dict[bytes, Slot] = {}
        self._sc: dict[bytes, bytes] = {}  # scope_id + compat_id -> the one shared bytes object
        self._count = 0
        self._sweep_keys: list[bytes] = []
        self._sweep_pos = 0

    def _intern_sc(self, sc: bytes) -> bytes:
        return self._sc.setdefault(sc, sc)

    # -- IndexStore -------------------------------------------------------------------------------------------

    async def put(self, record: ReplicaRecord, now: float) -> bool:
        return self.put_sync(record, now)

    def put_sync(self, record: ReplicaRecord, now: float) -> bool:
        key = bytes(record.block_key)
        holder = sys.intern(record.holder)
        entry: Entry = (now + record.ttl_ms / 1000.0, holder,
                        self._intern_sc(bytes(record.scope_id) + bytes(record.compat_id)), _body(record))
        slot = self._blocks.get(key)
        if slot is None:
            self._blocks[key] = entry
            self._count += 1
            return True
        created = True
        kept: list[Entry] = []
        for old in _entries(slot):
            if old[1] == holder:
                created = old[0] <= now
            elif old[0] > now:
                kept.append(old)
        self._count += len(kept) + 1 - len(_entries(slot))
        kept.append(entry)
        self._blocks[key] = kept[0] if len(kept) == 1 else tuple(kept)
        return created

    async def get(self, holder_id: str, block_key: bytes, now: float) -> ReplicaRecord | None:
        slot = self._blocks.get(bytes(block_key))
        if slot is None:
            return None
        for expires_at, holder, sc, body in _entries(slot):
            if expires_at > now and _holder_id(holder) == holder_id:
                return unpack_body(body, block_key, sc[:16], sc[16:], holder, remaining_ms(expires_at, now),
                                   digest=_digest(body))
        return None

    async def delete(self, holder_id: str, block_key: bytes) -> bool:
        key = bytes(block_key)
        slot = self._blocks.get(key)
        if slot is None:
            return False
        entries = _entries(slot)
        kept = tuple(e for e in entries if _holder_id(e[1]) != holder_id)
        if len(kept) == len(entries):
            return False
        self._count -= len(entries) - len(kept)
        if not kept:
            del self._blocks[key]
        else:
            self._blocks[key] = kept[0] if len(kept) == 1 else kept
        return True

    async def lookup(self, scope_id: bytes, compat_id: bytes, block_keys: Sequence[bytes],
                     now: float) -> list[tuple[ReplicaRecord, ...]]:
        return self.materialize(self.chain(scope_id, compat_id, block_keys, now), block_keys, scope_id,
                                compat_id, now)

    async def count(self) -> int:
        return self._count

    async def expire(self, now: float, limit: int = 65536) -> int:
        return self.expire_sync(now, limit)

    async def aclose(self) -> None:
        return None

    # -- the parts of a lookup (separate for the benchmark) --------------------------------------------------

    def chain(self, scope_id: bytes, compat_id: bytes, block_keys: Sequence[bytes], now: float) -> list[Slot]:
        """Per leading key, its live entries of (scope, compat) -- one entry, or a tuple of them -- up to the
        first key without one. Nothing is decoded."""
        sc = self._sc.get(bytes(scope_id) + bytes(compat_id))
        if sc is None:
            return []
        get = self._blocks.get
        out: list[Slot] = []
        append = out.append
        for key in block_keys:
            slot: Any = get(key)
            if slot is None:
                break
            if slot[0].__class__ is float:  # one entry: the common case
                if slot[2] is sc and slot[0] > now:
                    append(slot)
                    continue
                break
            live = tuple(e for e in slot if e[2] is sc and e[0] > now)
            if not live:
                break
            append(live[0] if len(live) == 1 else live)
        return out

    @staticmethod
    def materialize(chain: list[Slot], block_keys: Sequence[bytes], scope_id: bytes, compat_id: bytes,
                    now: float) -> list[tuple[ReplicaRecord, ...]]:
        scope_id, compat_id = bytes(scope_id), bytes(compat_id)
        out: list[tuple[ReplicaRecord, ...]] = []
        append = out.append
        ceil = math.ceil
        for key, slot in zip(block_keys, chain, strict=False):
            if slot[0].__class__ is float:  # one entry: the common case, written out
                expires_at, holder, _sc, body = slot
                ttl = ceil((expires_at - now) * 1000.0)  # remaining_ms, inline: the chain holds live entries only
                append((unpack_body(body, key, scope_id, compat_id, holder, ttl if ttl > 1 else 1, 0,
                                    body[-32:] if body[_FLAGS] & 1 else None),))
            else:
                append(tuple(unpack_body(body, key, scope_id, compat_id, holder, remaining_ms(expires_at, now),
                                         digest=_digest(body))
                             for expires_at, holder, _sc, body in _entries(slot)))
        return out

    def lookup_rendered(self, scope_id: bytes, compat_id: bytes, block_keys: Sequence[bytes],
                        now: float) -> tuple[int, list[bytes]]:
        """:meth:`lookup` written as JSON: the number of matched keys, and pieces whose concatenation is the
        matches' ``{"block_key": .., "replicas": [..]}`` objects, comma-separated, exactly as
        :meth:`~kvsp_quic.records.LookupResponse.to_json_bytes` writes them, without building the records (what
        the HTTP edge sends)."""
        chain = self.chain(scope_id, compat_id, block_keys, now)
        tail = b'","compat_id":"%s","scope_id":"%s","holder":' % (bytes(compat_id).hex().encode(),
                                                                   bytes(scope_id).hex().encode())
        heads: dict[str, bytes] = {}
        parts: list[bytes] = []
        append = parts.append
        ceil = math.ceil
        for n, (key, slot) in enumerate(zip(block_keys, chain, strict=False)):
            key_hex = bytes(key).hex().encode()
            append(b'{"block_key":"%s","replicas":[' % key_hex if not n else
                   b',{"block_key":"%s","replicas":[' % key_hex)
            for i, (expires_at, holder, _sc, body) in enumerate(_entries(slot)):
                head = heads.get(holder)
                if head is None:
                    head = heads[holder] = tail + orjson.dumps(holder)
                ttl = ceil((expires_at - now) * 1000.0)  # remaining_ms: the chain holds live entries only
                render_into(parts, body, (b',{"block_key":"' if i else b'{"block_key":"') + key_hex + head,
                            ttl if ttl > 1 else 1, 0, body[-32:] if body[_FLAGS] & 1 else None)
            append(b"]}")
        return len(chain), parts

    def expire_sync(self, now: float, limit: int = 65536) -> int:
        """Examine up to *limit* keys of a snapshot of the keys (taken when the previous one is used up) and
        remove their expired entries."""
        if self._sweep_pos >= len(self._sweep_keys):
            self._sweep_keys = list(self._blocks)
            self._sweep_pos = 0
        batch = self._sweep_keys[self._sweep_pos:self._sweep_pos + limit]
        self._sweep_pos += len(batch)
        if self._sweep_pos >= len(self._sweep_keys):
            self._sweep_keys, self._sweep_pos = [], 0
        removed = 0
        blocks = self._blocks
        for key in batch:
            slot = blocks.get(key)
            if slot is None:
                continue
            entries = _entries(slot)
            kept = tuple(e for e in entries if e[0] > now)
            if len(kept) == len(entries):
                continue
            removed += len(entries) - len(kept)
            if not kept:
                del blocks[key]
            else:
                blocks[key] = kept[0] if len(kept) == 1 else kept
        self._count -= removed
        return removed

    def __len__(self) -> int:
        return self._count


__all__ = ["MemoryIndexStore"]
