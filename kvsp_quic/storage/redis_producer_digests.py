"""Producer Digests in Redis or Redis Cluster (the ``redis`` extra), beside the replicas of
:mod:`kvsp_quic.storage.redis_index` (same client, same prefix).

Layout: one hash per Block Key, ``{prefix}p:{<block key hex>}`` (the braces are the cluster hash tag, as for the
replicas' ``{prefix}r:{...}``); field = the producer's instance-id (43 characters); value = ``<expiry ms>:`` || the
record's JSON (``producer`` included). Expiry per field on the Redis server's clock (``TIME`` inside the scripts), the
hash's ``PEXPIRE`` kept at its longest record, expired fields deleted by the reads that meet them -- as the replicas.
A read is one pipeline of one script call per key (one slot each in a cluster).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import orjson
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import NoScriptError

from kvsp_quic import keys as k
from kvsp_quic.producer_digests import ProducerDigest
from kvsp_quic.storage.redis_scripts import NOW as _NOW
from kvsp_quic.storage.redis_scripts import PUT_SCRIPT

# PUT_SCRIPT, the replicas' (KEYS[1]: block hash; ARGV: instance-id, ttl ms, JSON): 1 created, 0 replaced an
# unexpired record; one field per writer, expiry on the Redis server's clock.

# KEYS[1]: block hash. Returns {ttl1, json1, ttl2, json2, ...} of the unexpired records; deletes the expired ones.
GET_SCRIPT = _NOW + """
local all = redis.call('HGETALL', KEYS[1])
local out = {}
local dead = nil
for i = 1, #all, 2 do
  local v = all[i + 1]
  local c = string.find(v, ':', 1, true)
  local exp = tonumber(string.sub(v, 1, c - 1))
  if exp <= now then
    if dead == nil then dead = {} end
    dead[#dead + 1] = all[i]
  else
    out[#out + 1] = exp - now
    out[#out + 1] = string.sub(v, c + 1)
  end
end
if dead ~= nil then redis.call('HDEL', KEYS[1], unpack(dead)) end
return out
"""

_PUT_SHA = hashlib.sha1(PUT_SCRIPT.encode()).hexdigest()
_GET_SHA = hashlib.sha1(GET_SCRIPT.encode()).hexdigest()


class RedisProducerDigests:
    """:class:`~kvsp_quic.storage.producer_digests.ProducerDigestStore` in Redis (see the module docstring)."""

    def __init__(self, client: Redis | RedisCluster, *, prefix: bytes | str = b"kvsp:") -> None:
        self.client = client
        self.prefix = prefix.encode("utf-8") if isinstance(prefix, str) else bytes(prefix)

    def key(self, block_key: bytes) -> bytes:
        return self.prefix + b"p:{" + bytes(block_key).hex().encode("ascii") + b"}"

    async def put(self, record: ProducerDigest, now: float) -> bool:
        if record.producer is None:
            raise ValueError("a stored producer digest names its producer")
        args = (k.uri_id(record.producer).encode("ascii"), record.ttl_ms, orjson.dumps(record.to_json()))
        keys = [self.key(record.block_key)]
        try:
            created = await self.client.evalsha(_PUT_SHA, 1, *keys, *args)
        except NoScriptError:
            created = await self.client.eval(PUT_SCRIPT, 1, *keys, *args)
        return bool(created)

    async def get(self, scope_id: bytes, compat_id: bytes, block_keys: Sequence[bytes],
                  now: float) -> list[ProducerDigest]:
        if not block_keys:
            return []
        replies = await self._read(block_keys)
        out = []
        scope, compat = bytes(scope_id), bytes(compat_id)
        for reply in replies:
            for i in range(0, len(reply), 2):
                obj: dict[str, Any] = orjson.loads(reply[i + 1])
                obj["ttl_ms"] = max(1, int(reply[i]))
                record = ProducerDigest.from_json(obj)
                if bytes(record.scope_id) == scope and bytes(record.compat_id) == compat:
                    out.append(record)
        return out

    async def _read(self, block_keys: Sequence[bytes]) -> list[Any]:
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for b in block_keys:
                pipe.execute_command("EVALSHA", _GET_SHA, 1, self.key(b))  # pipe.evalsha is blocked in a cluster
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                await self.client.script_load(GET_SCRIPT)
                continue
            for r in replies:
                if isinstance(r, Exception):
                    raise r
            return replies
        raise AssertionError("unreachable")  # pragma: no cover

    async def expire(self, now: float, limit: int = 65536) -> int:
        return 0  # Redis expires the hashes; reads delete the expired fields they meet


__all__ = ["GET_SCRIPT", "PUT_SCRIPT", "RedisProducerDigests"]
