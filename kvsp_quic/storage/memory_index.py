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
* records are rebuilt only for the matches a lookup returns; the HTTP edge's lookups do not even do that:
  :meth:`MemoryIndexStore.lookup_rendered` writes the answer's JSON straight from the packed entries;
* what a body holds is decoded once per entry a lookup returns and kept for the next lookups of that entry in a
  bounded *recent* table (:class:`_Recent`, keyed by the body): for records, the fields the body holds with the
  layer digests decoded (a new record is that dict plus the entry's own fields and its remaining TTL: the 32
  ``bytes`` digests are not rebuilt per lookup); for JSON, the record's JSON around its ``ttl_ms`` value
  (:func:`~kvsp_quic.storage.index_store.render_into`, written once). Codec, size and residency are decoded once
  per distinct packed head (:meth:`MemoryIndexStore._shape`). Repeated lookups of one prefix (every request
  sharing a system prompt or a conversation) are the common case; a first lookup decodes, about as before;
* the loop that builds a lookup's records defers the collector's passes
  (:func:`~kvsp_quic.storage.index_store.collections_deferred`).

Expired entries are skipped by lookups and replaced by puts; :meth:`MemoryIndexStore.expire` removes them
incrementally (a bounded number of keys per call, from a snapshot of the keys), so memory is returned without a
stop-the-world sweep.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from kvsp_quic import keys as k
from kvsp_quic.records import LookupMatch, ReplicaRecord
from kvsp_quic.storage.index_store import (
    collections_deferred,
    digests_unpacker,
    pack_body,
    remaining_ms,
    render_into,
    unpack_body,
)

Entry = tuple[float, str, bytes, bytes]  # expires_at, holder, scope_id + compat_id (interned), packed body
Slot = Entry | tuple[Entry, ...]

_N_RES = 2  # the residency count octet of pack_body's head (<HBBQ)
_FLAGS = 3  # its flags octet: bit 0 = layer digests present, other bits: a MOQT namespace, unknown tier names
_FLAG_LAYER_DIGESTS = 1
_HEAD_SIZE = 12  # <HBBQ
_RES_SIZE = 17  # <BIIQ per residency entry
_MAX_SHAPES = 4096


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


def _render(body: bytes) -> tuple[bytes, bytes]:
    """:meth:`MemoryIndexStore._json` of a body not in the recent table."""
    parts: list[bytes] = []
    render_into(parts, body, b"", 0, 0, _digest(body))
    before = parts[1]  # parts[0] is the empty head; parts[1] ends with the ttl_ms value written, 0
    assert before.endswith(b'"ttl_ms":0')
    return before[:-1], b"".join(parts[2:])


class _Recent:
    """Values derived from packed bodies (the layer digests tuples of the records lookups returned), kept for the
    next lookups of the same entries: two generations of at most *limit* bodies each, the older dropped whole
    when the younger is full (O(1), bounded, no per-hit bookkeeping beyond moving an old hit to the young one).
    Keyed by the body itself: equal bodies give equal values, and a bytes object's hash is computed once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.young: dict[bytes, Any] = {}
        self.old: dict[bytes, Any] = {}

    def miss(self, body: bytes, make: Callable[[bytes], Any]) -> Any:
        """The value of *body*, from the older generation or made, put in the young one."""
        value = self.old.get(body)
        if value is None:
            value = make(body)
        if self.limit:
            if len(self.young) >= self.limit:
                self.old, self.young = self.young, {}
            self.young[body] = value
        return value

    def __len__(self) -> int:
        return len(self.young) + len(self.old)


class MemoryIndexStore:
    """:class:`~kvsp_quic.storage.index_store.IndexStore` in this process's memory.

    *recent*: how many records' layer digests a lookup keeps decoded for the next lookups (two generations of
    that many, see :class:`_Recent`; 0: none). Lookups of the same prefix repeat (every request that shares a
    system prompt or a conversation looks up the same leading keys); decoding the 32 digests of a record is most of
    rebuilding it. About 2.6 KB per record with 32 layer digests: the default, one maximal lookup (8192), holds
    at most ~43 MB."""

    def __init__(self, *, recent: int = 8192) -> None:
        self._recent = _Recent(recent)  # body -> _template
        self._recent_json = _Recent(recent)  # body -> _json
        self._blocks: dict[bytes, Slot] = {}
        self._sc: dict[bytes, bytes] = {}  # scope_id + compat_id -> the one shared bytes object
        self._count = 0
        self._shapes: dict[bytes, tuple[Any, ...]] = {}  # see _shape
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

    def materialize(self, chain: list[Slot], block_keys: Sequence[bytes], scope_id: bytes, compat_id: bytes,
                    now: float) -> list[tuple[ReplicaRecord, ...]]:
        """The records of *chain*'s entries (per key, a tuple), with their remaining TTL (see :meth:`_build`)."""
        return self._build(chain, block_keys, scope_id, compat_id, now, False)

    async def lookup_matches(self, scope_id: bytes, compat_id: bytes, block_keys: Sequence[bytes],
                             now: float) -> list[LookupMatch]:
        """:meth:`lookup` as the answer's matches (``LookupMatch.of_store`` of each key and its records), built in
        the same loop (the role uses it when it has no replica to leave out or reorder)."""
        return self._build(self.chain(scope_id, compat_id, block_keys, now), block_keys, scope_id, compat_id, now,
                           True)

    def _build(self, chain: list[Slot], block_keys: Sequence[bytes], scope_id: bytes, compat_id: bytes,
               now: float, matches: bool) -> list[Any]:
        """Per key of *chain*, the tuple of its records (or, with *matches*, a LookupMatch of it), each a new
        ReplicaRecord whose fields from the packed body (codec, size, digest, residency, layer digests,
        namespace) come from the body's template (:meth:`_template`: decoded once, then kept in the recent
        table), its others from the entry, with the remaining TTL."""
        scope_id, compat_id = bytes(scope_id), bytes(compat_id)
        out: list[Any] = []
        append = out.append
        ceil = math.ceil
        new = object.__new__
        recent_get = self._recent.young.get
        template_of = self._template
        with collections_deferred():  # bounded: see its docstring
            for key, slot in zip(block_keys, chain, strict=False):
                if slot[0].__class__ is float:  # one entry: the common case, written out
                    expires_at, holder, _sc, body = slot
                    template = recent_get(body) or template_of(body)
                    ttl = ceil((expires_at - now) * 1000.0)  # remaining_ms, inline: the chain holds live entries only
                    record = new(ReplicaRecord)
                    values = record.__dict__
                    values.update(template)  # every field, in the dataclass's order; then the entry's own
                    values["block_key"] = key
                    values["compat_id"] = compat_id
                    values["scope_id"] = scope_id
                    values["holder"] = holder
                    values["ttl_ms"] = ttl if ttl > 1 else 1
                    replicas: tuple[ReplicaRecord, ...] = (record,)
                else:
                    replicas = tuple([self._record(entry, key, scope_id, compat_id, now) for entry in _entries(slot)])
                if matches:  # LookupMatch.of_store, inline
                    match = new(LookupMatch)
                    fields = match.__dict__
                    fields["block_key"] = key
                    fields["replicas"] = replicas
                    append(match)
                else:
                    append(replicas)
        return out

    def _record(self, entry: Entry, key: bytes, scope_id: bytes, compat_id: bytes, now: float) -> ReplicaRecord:
        """One record of :meth:`materialize`, for a key with several entries."""
        expires_at, holder, _sc, body = entry
        record = object.__new__(ReplicaRecord)
        values = record.__dict__
        values.update(self._recent.young.get(body) or self._template(body))
        values["block_key"] = key
        values["compat_id"] = compat_id
        values["scope_id"] = scope_id
        values["holder"] = holder
        values["ttl_ms"] = remaining_ms(expires_at, now)
        return record

    def _template(self, body: bytes) -> dict[str, Any]:
        """The fields of a record that *body* holds, as the dataclass's ``__dict__`` (every field in order; those
        kept in the entry are placeholders), from the recent table or decoded and put there."""
        return self._recent.miss(body, self._decode)  # type: ignore[no-any-return]

    def _decode(self, body: bytes) -> dict[str, Any]:
        flags = body[_FLAGS]
        if flags == _FLAG_LAYER_DIGESTS:  # head, residency, count | layer digests | digest
            skey = body[:_HEAD_SIZE + 4 + _RES_SIZE * body[_N_RES]]
        elif not flags:  # head | digest | residency
            skey = body[:_HEAD_SIZE] + body[_HEAD_SIZE + 32:]
        else:  # a MOQT namespace, unknown tier names: the general decoder
            return dict(vars(unpack_body(body, b"", b"", b"", "", 1, 0, _digest(body))))
        shape = self._shapes.get(skey) or self._shape(skey, body)
        return {"block_key": b"", "compat_id": b"", "scope_id": b"", "holder": "", "codec": shape[0],
                "size": shape[1], "digest": body[-32:] if flags else body[_HEAD_SIZE:_HEAD_SIZE + 32],
                "residency": shape[2], "ttl_ms": 1, "layer_digests": shape[3](body) if flags else None,
                "moqt_namespace": None}

    def _shape(self, skey: bytes, body: bytes) -> tuple[Any, ...]:
        """(codec, size, residency, unpacker of the layer digests or None) of a body whose packed head and
        residency are *skey* (see :meth:`_decode`), kept for the next bodies of that shape while the table
        holds fewer than :data:`_MAX_SHAPES` (a publisher choosing sizes cannot grow it without bound)."""
        record = unpack_body(body, b"", b"", b"", "", 1, 0, _digest(body))
        digests = record.layer_digests
        shape = (record.codec, record.size, record.residency,
                 None if digests is None else digests_unpacker(len(digests), len(skey)))
        if len(self._shapes) < _MAX_SHAPES:
            self._shapes[skey] = shape
        return shape

    def lookup_rendered(self, scope_id: bytes, compat_id: bytes, block_keys: Sequence[bytes],
                        now: float) -> tuple[int, list[bytes]]:
        """:meth:`lookup` written as JSON: the number of matched keys, and pieces whose concatenation is the
        matches' ``{"block_key": .., "replicas": [..]}`` objects, comma-separated, exactly as
        :meth:`~kvsp_quic.records.LookupResponse.to_json_bytes` writes them, without building the records (what
        the HTTP edge sends). What a body holds is written once (:meth:`_json`) and kept in the recent table."""
        chain = self.chain(scope_id, compat_id, block_keys, now)
        tail = b'","compat_id":"%s","scope_id":"%s","holder":' % (bytes(compat_id).hex().encode(),
                                                                   bytes(scope_id).hex().encode())
        heads: dict[str, bytes] = {}
        parts: list[bytes] = []
        append = parts.append
        extend = parts.extend
        ceil = math.ceil
        json_get = self._recent_json.young.get
        json_of = self._json
        for n, (key, slot) in enumerate(zip(block_keys, chain, strict=False)):
            key_hex = bytes(key).hex().encode()
            if slot[0].__class__ is float:  # one entry: the common case, in pieces joined once
                expires_at, holder, _sc, body = slot
                head = heads.get(holder)
                if head is None:
                    head = heads[holder] = tail + orjson.dumps(holder)
                ttl = ceil((expires_at - now) * 1000.0)  # remaining_ms: the chain holds live entries only
                before, after = json_get(body) or json_of(body)
                extend((b',{"block_key":"' if n else b'{"block_key":"', key_hex, b'","replicas":[{"block_key":"',
                        key_hex, head, before, b"%d" % (ttl if ttl > 1 else 1), after, b"]}"))  # no formatting
                continue
            append(b'{"block_key":"%s","replicas":[' % key_hex if not n else
                   b',{"block_key":"%s","replicas":[' % key_hex)
            for i, (expires_at, holder, _sc, body) in enumerate(slot):  # type: ignore[misc]
                head = heads.get(holder)
                if head is None:
                    head = heads[holder] = tail + orjson.dumps(holder)
                before, after = json_get(body) or json_of(body)
                append(b'%s{"block_key":"%s%s%s%d' % (b"," if i else b"", key_hex, head, before,
                                                      remaining_ms(expires_at, now)))
                append(after)
            append(b"]}")
        return len(chain), parts

    def _json(self, body: bytes) -> tuple[bytes, bytes]:
        """The JSON of the record *body* holds, around its ``ttl_ms`` value: from the holder's value to ``"ttl_ms":``,
        and from there to the end (as :func:`~kvsp_quic.storage.index_store.render_into` writes them), from the
        recent table or written and put there."""
        return self._recent_json.miss(body, _render)  # type: ignore[no-any-return]

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
