"""Holders' liveness records and clients' failure reports shared by every Index Service process, in Redis or
Redis Cluster (:class:`RedisLivenessStore`, a :class:`~kvsp_quic.storage.liveness_store.LivenessStore`; issue 12,
point 1: every piece of control-plane state lives in Redis; docs/wire.md, "Holder liveness and failure reports").

The rules (lapsed, demoted, endpoints) are :mod:`kvsp_quic.roles.liveness`'s; this module only keeps the two
tables where every process reads them. Layout: two hashes under the hash tag ``{live}`` (``{prefix}{live}:...``), so
both live on one slot of a cluster and one script reads both:

* ``holders`` -- holder URI -> ``<expiry ms on the Redis clock>:<granted ttl ms>``;
* ``failures`` -- ``<scope_id hex> <holder URI>`` -> ``<end of the demotion, ms on the Redis clock>``; a report
  never shortens a running demotion.

Expiry is judged on the Redis server's clock (``TIME`` inside the scripts:
:data:`~kvsp_quic.storage.redis_scripts.NOW`), never on a process's: :meth:`RedisLivenessStore.snapshot` returns
each record's *remaining* time, which a process adds to its own monotonic clock. A lapsed liveness record is kept
``retain_ms`` (an hour) past its expiry, so a process started after a holder died still leaves its replicas out
(replica records live at most the index's ``max_ttl_ms``, ten minutes by default); the snapshot script deletes
older ones and ended demotions. Each hash holds at most ``max_entries`` fields: beyond, a report of a new holder
(or scope and holder) is not stored -- other processes then never leave it out or demote it, the safe side --
while the receiving process still applies it.

Cost: a report is one script call; :meth:`~RedisLivenessStore.snapshot` is one script call that reads both hashes
(``HGETALL`` each), which each process makes once per sync period (250 ms).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import NoScriptError

from kvsp_quic.storage.liveness_store import MAX_ENTRIES, SharedDemotion, SharedHolder, SharedLiveness
from kvsp_quic.storage.redis_scripts import NOW

RETAIN_MS = 3_600_000  # how long a lapsed liveness record is kept after its expiry

# KEYS[1]: holders; ARGV: holder, ttl ms, max entries. Returns 1 when stored.
REPORT_SCRIPT = NOW + """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d:%d', now + tonumber(ARGV[2]), tonumber(ARGV[2])))
return 1
"""

# KEYS[1]: failures; ARGV: '<scope hex> <holder>', demote ms, max entries. Returns 1 when stored or lengthened.
FAILURE_SCRIPT = NOW + """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
local untl = now + tonumber(ARGV[2])
if old and tonumber(old) >= untl then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', untl))
return 1
"""

# KEYS: holders, failures; ARGV: retain ms. Returns {{holder, remaining ms, ttl ms, ...}, {field, remaining ms, ...}};
# deletes liveness records lapsed more than retain ms ago and ended demotions.
SNAPSHOT_SCRIPT = NOW + """
local retain = tonumber(ARGV[1])
local holders = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local v = all[i + 1]
  local c = string.find(v, ':', 1, true)
  local exp = tonumber(string.sub(v, 1, c - 1))
  if exp + retain <= now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    holders[#holders + 1] = all[i]
    holders[#holders + 1] = exp - now
    holders[#holders + 1] = tonumber(string.sub(v, c + 1))
  end
end
local failures = {}
all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local untl = tonumber(all[i + 1])
  if untl <= now then
    redis.call('HDEL', KEYS[2], all[i])
  else
    failures[#failures + 1] = all[i]
    failures[#failures + 1] = untl - now
  end
end
return {holders, failures}
"""


class _Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


_REPORT, _FAILURE, _SNAPSHOT = _Script(REPORT_SCRIPT), _Script(FAILURE_SCRIPT), _Script(SNAPSHOT_SCRIPT)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


class RedisLivenessStore:
    """:class:`~kvsp_quic.storage.liveness_store.LivenessStore` in Redis or Redis Cluster (module docstring)."""

    def __init__(self, client: Redis | RedisCluster, *, prefix: str = "kvsp:", owns_client: bool = False,
                 retain_ms: int = RETAIN_MS, max_entries: int = MAX_ENTRIES) -> None:
        if retain_ms < 0 or max_entries < 1:
            raise ValueError("retain_ms must not be negative and max_entries must be positive")
        self.client = client
        self.prefix = prefix + "{live}:"
        self.retain_ms = retain_ms
        self.max_entries = max_entries
        self._owns_client = owns_client

    @classmethod
    def from_url(cls, url: str, *, cluster: bool = False, prefix: str = "kvsp:", **kwargs: Any) -> RedisLivenessStore:
        """A store with its own client (closed by :meth:`aclose`)."""
        client: Redis | RedisCluster = (RedisCluster.from_url(url, **kwargs) if cluster
                                        else Redis.from_url(url, **kwargs))
        return cls(client, prefix=prefix, owns_client=True)

    def key(self, name: str) -> str:
        return self.prefix + name

    async def _eval(self, script: _Script, keys: Sequence[str], *args: str | int) -> Any:
        try:
            return await self.client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.eval(script.source, len(keys), *keys, *args)

    async def report(self, holder: str, ttl_ms: int) -> None:
        await self._eval(_REPORT, [self.key("holders")], holder, ttl_ms, self.max_entries)

    async def report_failure(self, scope_id: bytes, holder: str, demote_ms: int) -> None:
        await self._eval(_FAILURE, [self.key("failures")], f"{bytes(scope_id).hex()} {holder}", demote_ms,
                         self.max_entries)

    async def snapshot(self) -> SharedLiveness:
        raw_holders, raw_failures = await self._eval(_SNAPSHOT, [self.key("holders"), self.key("failures")],
                                                     self.retain_ms)
        holders = tuple(SharedHolder(_text(raw_holders[i]), int(raw_holders[i + 2]), int(raw_holders[i + 1]))
                        for i in range(0, len(raw_holders), 3))
        demotions = []
        for i in range(0, len(raw_failures), 2):
            scope_hex, _, holder = _text(raw_failures[i]).partition(" ")
            try:
                scope_id = bytes.fromhex(scope_hex)
            except ValueError:
                continue  # not ours
            demotions.append(SharedDemotion(scope_id, holder, int(raw_failures[i + 1])))
        return SharedLiveness(holders, tuple(demotions))

    async def ping(self) -> None:
        await self.client.ping()

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()


__all__ = ["FAILURE_SCRIPT", "REPORT_SCRIPT", "RETAIN_MS", "SNAPSHOT_SCRIPT", "RedisLivenessStore"]
