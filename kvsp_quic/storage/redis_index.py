"""The shared Index Service store: Redis or Redis Cluster through ``redis.asyncio`` (the ``redis`` extra).

Several Index Service processes share one Redis (or one Redis Cluster); each is stateless apart from its
connection pool. Layout (docs/wire.md, "Index Service"):

* **one hash per Block Key**: ``{prefix}r:{<block key hex>}`` -- the braces are the Redis Cluster hash tag, so the
  whole block lives on one slot and the index is partitioned by Block Key, as the spec's Operational
  Considerations suggest (keys are uniformly distributed);
* **one field per holder**: the field is the holder-id (43 characters), the value
  ``<expiry ms, decimal>:`` || scope_id (16) || compat_id (32) || ``<H`` holder length || holder || packed body
  (:func:`~kvsp_quic.storage.index_store.pack_body`);
* **expiry per replica** without Redis 7.4's per-field ``HPEXPIRE`` (Debian 12 ships Redis 7.0): the expiry in
  each value is on the Redis server's clock (``TIME``, read inside the scripts, so every Index Service process
  and every cluster node judges a block by the clock of the node that holds it), and the hash's own ``PEXPIRE``
  is kept at the longest remaining replica TTL, so Redis drops a block whose replicas have all expired. Expired
  fields of a live hash are deleted by the next lookup or publish that sees them.

All reads and writes are Lua scripts (one key each, so they run on the slot's node in a cluster): *put* tells
created from refreshed atomically, *lookup* returns, per key in order, the unexpired replicas of the requested
scope and compat with their remaining TTL and stops at the first key without one. A lookup sends its keys in
growing chunks (``first_chunk``, then four times as many each round): against one Redis server a chunk is one
script call over all its keys, which stops at the first missing key; against a cluster it is one pipeline of
one call per key (keys of different blocks live on different slots), and the chunk after the first missing key
is never sent. With the default ``first_chunk`` of 512, a lookup of 8192 keys takes at most three round trips.

Needs Redis >= 5 (scripts that call ``TIME`` before writing rely on effects replication).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import NoScriptError

from kvsp_quic import keys as k
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.storage.index_store import pack_body, unpack_body
from kvsp_quic.storage.redis_scripts import NOW, PUT_SCRIPT

_U16 = struct.Struct("<H")

_NOW = NOW

# KEYS: block hashes in prefix order; ARGV[1]: scope_id || compat_id.
# Returns, per leading key with a live replica of that scope and compat: {ttl1, value1, ttl2, value2, ...}
# (the stored values whole: cutting them in Lua copies them once more); stops at the first key without one.
LOOKUP_SCRIPT = _NOW + """
local sc = ARGV[1]
local out = {}
for n = 1, #KEYS do
  local all = redis.call('HGETALL', KEYS[n])
  local hit = {}
  local dead = nil
  for i = 1, #all, 2 do
    local v = all[i + 1]
    local c = string.find(v, ':', 1, true)
    local exp = tonumber(string.sub(v, 1, c - 1))
    if exp <= now then
      if dead == nil then dead = {} end
      dead[#dead + 1] = all[i]
    elseif string.sub(v, c + 1, c + 48) == sc then
      hit[#hit + 1] = exp - now
      hit[#hit + 1] = v
    end
  end
  if dead ~= nil then redis.call('HDEL', KEYS[n], unpack(dead)) end
  if #hit == 0 then break end
  out[#out + 1] = hit
end
return out
"""

# PUT_SCRIPT (kvsp_quic.storage.redis_scripts): KEYS[1]: block hash; ARGV: holder-id, ttl ms, scope_id || compat_id ||
# holder || body. Returns 1 created, 0 refreshed.


# KEYS[1]: block hash; ARGV[1]: holder-id. Returns {ttl, value-after-expiry} or nil.
GET_SCRIPT = _NOW + """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return nil end
local c = string.find(v, ':', 1, true)
local exp = tonumber(string.sub(v, 1, c - 1))
if exp <= now then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return nil
end
return {exp - now, string.sub(v, c + 1)}
"""


class _Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


_LOOKUP = _Script(LOOKUP_SCRIPT)
_PUT = _Script(PUT_SCRIPT)
_GET = _Script(GET_SCRIPT)


def _decode_value(value: bytes, block_key: bytes, ttl_ms: int, offset: int = 0,
                  scope_compat: bytes | None = None) -> ReplicaRecord:
    """A record from ``[scope_id || compat_id] || <H len || holder || body`` at *offset*."""
    if scope_compat is None:
        scope_compat = value[offset:offset + 48]
        offset += 48
    (n,) = _U16.unpack_from(value, offset)
    holder = value[offset + 2:offset + 2 + n].decode("utf-8")
    return unpack_body(value, block_key, scope_compat[:16], scope_compat[16:], holder, ttl_ms,
                       offset + 2 + n)


class RedisIndexStore:
    """:class:`~kvsp_quic.storage.index_store.IndexStore` in Redis or Redis Cluster (see the module docstring)."""

    def __init__(self, client: Redis | RedisCluster, *, prefix: str = "kvsp:", first_chunk: int = 512,
                 owns_client: bool = False) -> None:
        if first_chunk < 1:
            raise ValueError("first_chunk must be positive")
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.prefix = prefix.encode("utf-8")
        self.first_chunk = first_chunk
        self._owns_client = owns_client

    @classmethod
    def from_url(cls, url: str, *, cluster: bool = False, prefix: str = "kvsp:", **kwargs: Any) -> RedisIndexStore:
        """A store with its own client (closed by :meth:`aclose`): ``redis://host:port/0``, ``rediss://...``."""
        client: Redis | RedisCluster = (RedisCluster.from_url(url, **kwargs) if cluster
                                        else Redis.from_url(url, **kwargs))
        return cls(client, prefix=prefix, owns_client=True)

    def key(self, block_key: bytes) -> bytes:
        return self.prefix + b"r:{" + bytes(block_key).hex().encode("ascii") + b"}"

    def producer_digest_store(self) -> Any:
        """Producer digests beside these replicas: same client, same prefix (kvsp_quic.storage.producer_digests)."""
        from kvsp_quic.storage.redis_producer_digests import RedisProducerDigests

        return RedisProducerDigests(self.client, prefix=self.prefix)

    async def _eval(self, script: _Script, keys: Sequence[bytes], *args: bytes | int) -> Any:
        try:
            return await self.client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.eval(script.source, len(keys), *keys, *args)

    # -- IndexStore -------------------------------------------------------------------------------------------

    async def put(self, record: ReplicaRecord, now: float) -> bool:
        holder = record.holder.encode("utf-8")
        value = (bytes(record.scope_id) + bytes(record.compat_id) + _U16.pack(len(holder)) + holder
                 + pack_body(record))
        created = await self._eval(_PUT, [self.key(record.block_key)], k.holder_id(record.holder).encode("ascii"),
                                   record.ttl_ms, value)
        return bool(created)

    async def get(self, holder_id: str, block_key: bytes, now: float) -> ReplicaRecord | None:
        reply = await self._eval(_GET, [self.key(block_key)], holder_id.encode("ascii"))
        if reply is None:
            return None
        ttl, value = reply
        return _decode_value(value, block_key, int(ttl))

    async def delete(self, holder_id: str, block_key: bytes) -> bool:
        removed = await self.client.hdel(self.key(block_key), holder_id)
        return bool(removed)

    async def lookup(self, scope_id: bytes, compat_id: bytes, block_keys: Sequence[bytes],
                     now: float) -> list[tuple[ReplicaRecord, ...]]:
        sc = bytes(scope_id) + bytes(compat_id)
        out: list[tuple[ReplicaRecord, ...]] = []
        start, size = 0, self.first_chunk
        while start < len(block_keys):
            chunk = block_keys[start:start + size]
            replies = await (self._lookup_cluster(chunk, sc) if self.cluster else self._lookup_one(chunk, sc))
            for key, hits in zip(chunk, replies, strict=False):
                if not hits:
                    return out
                out.append(tuple(_decode_value(v, key, int(hits[i]), v.index(b":") + 49, sc)
                                 for i in range(0, len(hits), 2) for v in (hits[i + 1],)))
            if len(replies) < len(chunk):
                return out
            start += len(chunk)
            size *= 4
        return out

    async def _lookup_one(self, chunk: Sequence[bytes], sc: bytes) -> list[Any]:
        reply: list[Any] = await self._eval(_LOOKUP, [self.key(b) for b in chunk], sc)
        return reply

    async def _lookup_cluster(self, chunk: Sequence[bytes], sc: bytes) -> list[Any]:
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for b in chunk:
                pipe.execute_command("EVALSHA", _LOOKUP.sha, 1, self.key(b), sc)  # pipe.evalsha is blocked in a cluster
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                await self.client.script_load(_LOOKUP.source)
                continue
            for r in replies:
                if isinstance(r, Exception):
                    raise r
            # one reply per key: {} for a key without a live replica, else {{ttl, value, ...}}
            return [r[0] if r else [] for r in replies]
        raise AssertionError("unreachable")  # pragma: no cover

    async def count(self) -> int:
        """Replica fields stored (expired fields not yet deleted included); scans every node: for tests and
        operators, not for the request path."""
        total = 0
        async for key in self.client.scan_iter(match=self.prefix + b"r:*", count=1000):
            total += int(await self.client.hlen(key))
        return total

    async def expire(self, now: float, limit: int = 65536) -> int:
        return 0  # Redis expires the hashes; lookups and publishes delete expired fields they meet

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()


__all__ = ["GET_SCRIPT", "LOOKUP_SCRIPT", "PUT_SCRIPT", "RedisIndexStore"]
