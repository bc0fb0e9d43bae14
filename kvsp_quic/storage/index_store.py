"""The Index Service's replica storage: a :class:`typing.Protocol` and the compact record encoding the backends share.

A store keeps Replica Records under (Block Key, holder-id) -- the resource ``replicas/{holder-id}/{block_key}`` --
each with an expiry. The role (:mod:`kvsp_quic.roles.index`) does every protocol check (authorization, path
against record, the TTL cap); a store only keeps what it is given and answers the chained lookup:

* ``put(record, now)``: store *record* until ``now + record.ttl_ms``; True when it created the entry (none was
  there, or only an expired one), False when it refreshed an unexpired one;
* ``get`` / ``delete`` by (holder-id, Block Key), for withdrawals;
* ``lookup(scope_id, compat_id, keys, now)``: for the keys in order, the unexpired replicas of that scope and
  compat, stopping at the first key that has none (Block Keys are chained, spec "Lookup");
* ``count`` and ``expire`` (sweeping expired entries; a no-op where the backend expires by itself).

Returned records carry the **remaining** TTL in ``ttl_ms`` (milliseconds, rounded up, at least 1).

*now* is the role's monotonic clock (seconds). The memory store keeps absolute expiries on that clock; the Redis
store hands relative TTLs to Redis, which expires entries on its own clock, so it ignores *now*.

The body encoding (:func:`pack_body` / :func:`unpack_body`) is what both backends store per replica besides the
fields they keep apart (Block Key, scope, compat, holder, expiry): ``<HBBQ`` codec, residency count, flags, size;
the replica digest (32 octets, only without layer digests -- with them it is their SHA-256 and is recomputed);
per residency entry ``<BIIQ`` tier index, first layer, last layer, read rate (0 = none); then, by flag, ``<I``
count + the raw layer digests, ``<H`` length + the UTF-8 MOQT namespace, and the names of unknown tiers.

Extension values (issue 13: the KVSP registries are extensible, so a newer holder may publish values this Index
Service does not know, and a newer client may use them): any codec fits the ``<H`` as it is; a tier outside
:data:`~kvsp_quic.compat.STORAGE_TIERS` is stored as the escape index 255 in its residency entry, and its name
(registry syntax: at most 32 ASCII octets, checked by the record's reader) follows at the end of the body as
``<B`` length + the name, one per escaped entry in residency order, flagged by ``_FLAG_TIER_NAMES``. Records
with known tiers only are packed exactly as before the escape existed.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import orjson

from kvsp_quic.compat import STORAGE_TIER_SET, STORAGE_TIERS
from kvsp_quic.records import ReplicaRecord, ResidencyEntry


@runtime_checkable
class IndexStore(Protocol):
    """Where the Index Service keeps Replica Records (see the module docstring for the contract)."""

    async def put(self, record: ReplicaRecord, now: float) -> bool:
        """Store *record* (its ``ttl_ms`` already capped) until ``now + ttl_ms``; True if created, False if an
        unexpired entry for the same (holder, Block Key) was refreshed."""
        ...

    async def get(self, holder_id: str, block_key: bytes, now: float) -> ReplicaRecord | None:
        """The unexpired record of *holder_id* for *block_key* (remaining TTL in ``ttl_ms``), or None."""
        ...

    async def delete(self, holder_id: str, block_key: bytes) -> bool:
        """Remove the entry; True if there was one."""
        ...

    async def lookup(self, scope_id: bytes, compat_id: bytes, block_keys: Sequence[bytes],
                     now: float) -> list[tuple[ReplicaRecord, ...]]:
        """Per leading key, the unexpired replicas of (scope, compat); stops at the first key with none."""
        ...

    async def count(self) -> int:
        """Entries stored (a backend may include expired entries it has not removed yet)."""
        ...

    async def expire(self, now: float, limit: int = 65536) -> int:
        """Remove expired entries, examining at most *limit* Block Keys; the number removed."""
        ...

    async def aclose(self) -> None:
        """Release connections the store owns."""
        ...


# -- the compact body encoding ----------------------------------------------------------------------------------

_HEAD = struct.Struct("<HBBQ")  # codec, residency entries, flags, size
_RES = struct.Struct("<BIIQ")  # tier index, first layer, last layer, read_mbit_per_s (0: none)
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_FLAG_LAYER_DIGESTS = 1
_FLAG_MOQT = 2
_FLAG_TIER_NAMES = 4  # some residency entry names a tier outside STORAGE_TIERS (index _TIER_ESCAPE)
_TIER_INDEX = {name: i for i, name in enumerate(STORAGE_TIERS)}
_TIER_ESCAPE = 255
_RESIDENCY_CACHE_MAX = 4096
_residency_cache: dict[bytes, tuple[ResidencyEntry, ...]] = {}


@functools.lru_cache(maxsize=256)
def _digests_struct(n: int) -> struct.Struct:
    return struct.Struct("32s" * n)


def digests_unpacker(n: int, offset: int) -> Callable[[bytes], tuple[bytes, ...]]:
    """A function reading *n* layer digests at *offset* of a packed body, as :func:`unpack_body` does."""
    return functools.partial(_digests_struct(n).unpack_from, offset=offset)


def pack_body(record: ReplicaRecord) -> bytes:
    """Everything of *record* but block_key, compat_id, scope_id, holder and ttl_ms, packed."""
    unknown = [r.tier.encode("ascii") for r in record.residency if r.tier not in STORAGE_TIER_SET]
    flags = (_FLAG_LAYER_DIGESTS if record.layer_digests is not None else 0) | (
        _FLAG_MOQT if record.moqt_namespace is not None else 0) | (_FLAG_TIER_NAMES if unknown else 0)
    parts = [_HEAD.pack(record.codec, len(record.residency), flags, record.size)]
    if record.layer_digests is None:
        parts.append(record.digest)
    parts.extend(_RES.pack(_TIER_INDEX.get(r.tier, _TIER_ESCAPE), r.layers[0], r.layers[1], r.read_mbit_per_s or 0)
                 for r in record.residency)
    if record.layer_digests is not None:
        parts.append(_U32.pack(len(record.layer_digests)))
        parts.extend(record.layer_digests)
    if record.moqt_namespace is not None:
        ns = record.moqt_namespace.encode("utf-8")
        parts.append(_U16.pack(len(ns)))
        parts.append(ns)
    for name in unknown:  # registry syntax: 1-32 ASCII octets (ResidencyEntry's check)
        parts.append(bytes((len(name),)))
        parts.append(name)
    return b"".join(parts)


def _tier_names(body: bytes, pos: int, res_raw: bytes) -> list[str]:
    """Per residency entry of *res_raw*, its tier name: from STORAGE_TIERS, or for the escape index the next name
    of the section :func:`pack_body` wrote at *pos*."""
    names: list[str] = []
    for t, *_rest in _RES.iter_unpack(res_raw):
        if t == _TIER_ESCAPE:
            n = body[pos]
            names.append(body[pos + 1:pos + 1 + n].decode("ascii"))
            pos += 1 + n
        else:
            names.append(STORAGE_TIERS[t])
    return names


def _read_head(body: bytes, offset: int, digest: bytes | None) -> tuple[int, int, int, bytes | None, bytes, int]:
    """(codec, flags, size, digest, packed residency, end of the residency) of the record at *offset*: the part of
    :func:`pack_body`'s encoding that :func:`unpack_body` and :func:`render_into` both read first."""
    codec, n_res, flags, size = _HEAD.unpack_from(body, offset)
    pos = offset + _HEAD.size
    if not flags & _FLAG_LAYER_DIGESTS:
        digest = body[pos:pos + 32]
        pos += 32
    end = pos + n_res * _RES.size
    return codec, flags, size, digest, body[pos:end], end


def unpack_body(body: bytes, block_key: bytes, scope_id: bytes, compat_id: bytes, holder: str,
                ttl_ms: int, offset: int = 0, digest: bytes | None = None) -> ReplicaRecord:
    """The record :func:`pack_body` packed (at *offset* of *body*), with the fields stored apart. *digest*: the
    record's digest when the caller kept it (else, for a record with layer digests, it is their SHA-256).

    The record is rebuilt without running its constructor checks again: it passed them when it was published,
    and the encoding round-trips exactly (tests/test_index.py checks that against the validated constructor).
    """
    codec, flags, size, digest, res_raw, end = _read_head(body, offset, digest)
    named = flags & _FLAG_TIER_NAMES
    residency = None if named else _residency_cache.get(res_raw)
    if residency is None and not named:
        residency = tuple(ResidencyEntry(STORAGE_TIERS[t], (a, b), r or None)
                          for t, a, b, r in _RES.iter_unpack(res_raw))
        if len(_residency_cache) < _RESIDENCY_CACHE_MAX:
            _residency_cache[res_raw] = residency
    pos = end
    layer_digests: tuple[bytes, ...] | None = None
    if flags & _FLAG_LAYER_DIGESTS:
        (n,) = _U32.unpack_from(body, pos)
        pos += 4
        layer_digests = _digests_struct(n).unpack_from(body, pos)
        if digest is None:
            digest = hashlib.sha256(body[pos:pos + 32 * n]).digest()
        pos += 32 * n
    moqt_namespace: str | None = None
    if flags & _FLAG_MOQT:
        (n,) = _U16.unpack_from(body, pos)
        pos += 2
        moqt_namespace = body[pos:pos + n].decode("utf-8")
        pos += n
    if residency is None:  # unknown tiers: their names follow (never cached: the packed entries do not name them)
        residency = tuple(ResidencyEntry(name, (a, b), r or None) for name, (_t, a, b, r)
                          in zip(_tier_names(body, pos, res_raw), _RES.iter_unpack(res_raw), strict=True))
    record = _new(ReplicaRecord)
    _set(record, "block_key", block_key)
    _set(record, "compat_id", compat_id)
    _set(record, "scope_id", scope_id)
    _set(record, "holder", holder)
    _set(record, "codec", codec)
    _set(record, "size", size)
    _set(record, "digest", digest)
    _set(record, "residency", residency)
    _set(record, "ttl_ms", ttl_ms)
    _set(record, "layer_digests", layer_digests)
    _set(record, "moqt_namespace", moqt_namespace)
    return record


_set = object.__setattr__
_new = object.__new__
_residency_json_cache: dict[bytes, bytes] = {}


def render_into(parts: list[bytes], body: bytes, head: bytes, ttl_ms: int, offset: int = 0,
                digest: bytes | None = None) -> None:
    """Append to *parts* the JSON of the record :func:`pack_body` packed (at *offset*), exactly as
    ``unpack_body(...).to_json_bytes()`` writes it, without building the record: *head* is its JSON up to the
    holder (``{"block_key":"..","compat_id":"..","scope_id":"..","holder":".."``), *digest* as for unpack_body.
    In pieces: a lookup joins its whole answer once."""
    codec, flags, size, digest, res_raw, end = _read_head(body, offset, digest)
    named = flags & _FLAG_TIER_NAMES
    residency = None if named else _residency_json_cache.get(res_raw)
    if residency is None and not named:
        residency = _residency_json(STORAGE_TIERS, res_raw)
        if len(_residency_json_cache) < _RESIDENCY_CACHE_MAX:
            _residency_json_cache[res_raw] = residency
    pos = end
    layers = b""
    if flags & _FLAG_LAYER_DIGESTS:
        (n,) = _U32.unpack_from(body, pos)
        pos += 4
        raw = body[pos:pos + 32 * n]
        pos += 32 * n
        if digest is None:
            digest = hashlib.sha256(raw).digest()
        layers = raw.hex(",", 32).replace(",", '","').encode()
    assert digest is not None
    moqt = None
    if flags & _FLAG_MOQT:
        (n,) = _U16.unpack_from(body, pos)
        moqt = body[pos + 2:pos + 2 + n].decode("utf-8")
        pos += 2 + n
    if residency is None:  # unknown tiers: their names follow the namespace (never cached)
        residency = _residency_json(_tier_names(body, pos, res_raw), res_raw)
    parts.append(head)
    parts.append(b',"codec":%d,"size":%d,"digest":"sha-256:%s","residency":%s,"ttl_ms":%d' % (
        codec, size, digest.hex().encode(), residency, ttl_ms))
    if layers:
        parts.append(b',"layer_digests":["')
        parts.append(layers)
        parts.append(b'"]')
    if moqt is not None:
        parts.append(b',"moqt_namespace":' + orjson.dumps(moqt))
    parts.append(b"}")


def _residency_json(names: Sequence[str], res_raw: bytes) -> bytes:
    """The ``residency`` array of packed entries *res_raw*, tier names by index (*names*: STORAGE_TIERS, or one name
    per entry from :func:`_tier_names`)."""
    if names is STORAGE_TIERS:
        rows = [(STORAGE_TIERS[t], a, b, r) for t, a, b, r in _RES.iter_unpack(res_raw)]
    else:
        rows = [(name, a, b, r) for name, (_t, a, b, r) in zip(names, _RES.iter_unpack(res_raw), strict=True)]
    return orjson.dumps([{"tier": name, "layers": [a, b]} if not r else
                         {"tier": name, "layers": [a, b], "read_mbit_per_s": r} for name, a, b, r in rows])


def unchecked_replica(**values: Any) -> ReplicaRecord:
    """A ReplicaRecord from values that already passed its checks (four times faster than the constructor)."""
    record = object.__new__(ReplicaRecord)
    try:
        vars(record).update(values)
    except TypeError:  # pragma: no cover - only if records become slotted dataclasses
        return ReplicaRecord(**values)
    return record


DEFER_COLLECTIONS = True


@contextlib.contextmanager
def collections_deferred() -> Iterator[None]:
    """Defer the cyclic garbage collector's passes over a synchronous loop that builds a lookup's answer.

    Such a loop allocates tens of thousands of container objects that all survive it (8192 records, their
    ``__dict__``, the matches): every 700 of them the collector would scan the young ones, every 10 of those
    passes the middle generation, and the surviving records would trigger full passes over everything the
    process holds -- more CPU than building them. Deferred, the collector scans them once, in one young-generation
    pass after the loop, and the older generations fill ten times more slowly.

    Bounded: the block holds no ``await`` and calls no code of other components, so it lasts as long as the loop
    (tens of milliseconds for the largest lookup); nothing it creates is cyclic garbage (every object is in the
    answer or freed by its reference count); the collector is re-enabled on the way out, even on an exception,
    and only if it was enabled on the way in (an application that disabled it keeps it disabled)."""
    if not (DEFER_COLLECTIONS and gc.isenabled()):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def remaining_ms(expires_at: float, now: float) -> int:
    """The remaining TTL in whole milliseconds, rounded up, at least 1 (for an entry not yet expired)."""
    return max(1, math.ceil((expires_at - now) * 1000.0))


def with_ttl(record: ReplicaRecord, ttl_ms: int) -> ReplicaRecord:
    """*record* with another ``ttl_ms`` (no re-validation)."""
    values = dict(vars(record))
    values["ttl_ms"] = ttl_ms
    return unchecked_replica(**values)


__all__ = ["DEFER_COLLECTIONS", "IndexStore", "collections_deferred", "digests_unpacker", "pack_body", "remaining_ms",
           "render_into", "unchecked_replica", "unpack_body", "with_ttl"]
