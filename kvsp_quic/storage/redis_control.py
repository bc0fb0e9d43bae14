"""The Placement Controller's shared state in Redis or Redis Cluster (:class:`RedisControlStore`).

Every key carries the hash tag ``{pc}`` (``{prefix}{pc}:...``), so the whole control plane lives on one slot of a
cluster and every script may touch several keys atomically; it is small (sessions, statuses, maps), unlike the
replica records, which are partitioned by Block Key (:mod:`kvsp_quic.storage.redis_index`). Layout:

* ``s:<session uuid>`` -- a hash: ``v`` the version, ``d`` the encoded session, ``r`` its run index entry;
  expires ``ttl_ms`` after its last write (the PC's ``session_ttl_ms``, ``done_ttl_ms`` once done);
* ``run:<epoch>|<instance>`` -- the ids of the sessions that run serves; ``runs`` -- the run entries in use;
  ``mig`` -- the ids of sessions waiting for a migration;
* ``lease:<session uuid>`` -- the replica placing or migrating the session (``SET NX PX``);
* ``status`` -- a hash: instance URI -> ``<expiry ms on the Redis clock>:`` || the stored status; ``epochs`` -- a
  hash: instance URI -> its highest epoch (kept after the status expires: a restarted instance's predecessor
  cannot come back);
* ``maps`` -- a hash: map id -> the authoritative Shard Map; ``mapctx`` -- a hash: map id -> its context
  (extension, docs/wire.md "Resharding"), under the same hash tag, so the scripts that write a map and its
  context touch both atomically on a cluster too; ``reshard:<map>`` -- the one-reshard-per-map lock.

Writes that must be atomic are Lua scripts: the compare-and-set of a session (with its indexes), the status report
(the epoch check and the write), a probed run held failed, the registration of a map with its context, the commit
of a map version, the replacement of a map's context, lease renewal and release.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import NoScriptError

from kvsp_quic.records import ShardMap
from kvsp_quic.storage.control_store import (
    EncodedSession,
    StatusSnapshot,
    StatusWrite,
    StoredSession,
    StoredStatus,
    decode_map,
    encode_map,
    ids_of,
    parse_run_key,
)

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: session hash, runs, mig; ARGV: expected version (0: create), data, run entry, migrating (1/0), ttl ms,
# key prefix (for run:<entry>), session id. Returns the new version, or -1.
SAVE_SCRIPT = """
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if v ~= tonumber(ARGV[1]) then return -1 end
local old = redis.call('HGET', KEYS[1], 'r') or ''
local new = ARGV[3]
if old ~= new then
  if old ~= '' then redis.call('SREM', ARGV[6] .. 'run:' .. old, ARGV[7]) end
  if new ~= '' then
    redis.call('SADD', ARGV[6] .. 'run:' .. new, ARGV[7])
    redis.call('SADD', KEYS[2], new)
  end
end
if ARGV[4] == '1' then redis.call('SADD', KEYS[3], ARGV[7]) else redis.call('SREM', KEYS[3], ARGV[7]) end
redis.call('HSET', KEYS[1], 'v', v + 1, 'd', ARGV[2], 'r', new)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]))
return v + 1
"""

# KEYS: session hash, mig; ARGV: key prefix, session id.
DELETE_SCRIPT = """
local old = redis.call('HGET', KEYS[1], 'r') or ''
if old ~= '' then redis.call('SREM', ARGV[1] .. 'run:' .. old, ARGV[2]) end
redis.call('SREM', KEYS[2], ARGV[2])
return redis.call('DEL', KEYS[1])
"""

# KEYS: runs, mig; ARGV: key prefix, session id. Drops an id the indexes name but whose session is gone.
FORGET_SCRIPT = """
if redis.call('EXISTS', ARGV[1] .. 's:' .. ARGV[2]) == 1 then return 0 end
redis.call('SREM', KEYS[2], ARGV[2])
for _, run in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  redis.call('SREM', ARGV[1] .. 'run:' .. run, ARGV[2])
  if redis.call('SCARD', ARGV[1] .. 'run:' .. run) == 0 then redis.call('SREM', KEYS[1], run) end
end
return 1
"""

# KEYS: status, epochs; ARGV: instance, epoch, ttl ms, stored status. Returns 0, or the higher epoch known.
STATUS_SCRIPT = _NOW + """
local hi = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if tonumber(ARGV[2]) < hi then return hi end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d:', now + tonumber(ARGV[3])) .. ARGV[4])
return 0
"""

# KEYS: status, epochs. Returns {epochs (flat hash), {instance, remaining ms, status, ...}}; drops expired statuses.
STATUSES_SCRIPT = _NOW + """
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local v = all[i + 1]
  local c = string.find(v, ':', 1, true)
  local exp = tonumber(string.sub(v, 1, c - 1))
  if exp <= now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    out[#out + 1] = all[i]
    out[#out + 1] = exp - now
    out[#out + 1] = string.sub(v, c + 1)
  end
end
return {redis.call('HGETALL', KEYS[2]), out}
"""

# KEYS: status; ARGV: instance, epoch. Drops the instance's status if it is of that run: held failed from then on, as
# if it had expired (a probe found it silent). Returns 1 when dropped.
FAIL_STATUS_SCRIPT = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local c = string.find(v, ':', 1, true)
local ok, obj = pcall(cjson.decode, string.sub(v, c + 1))
if not ok or type(obj['record']) ~= 'table' or tonumber(obj['record']['epoch']) ~= tonumber(ARGV[2]) then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""

# KEYS: maps; ARGV: map id, expected version, new map. Returns 1 when committed.
COMMIT_MAP_SCRIPT = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local ok, obj = pcall(cjson.decode, cur)
if not ok or tonumber(obj['version']) ~= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""

# KEYS: maps, mapctx; ARGV: map id, map, context ('' for none). Registers the map with its context (a new map has
# exactly the context it is registered with); returns nil, or the stored map when one exists (nothing is written).
ADD_MAP_SCRIPT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return redis.call('HGET', KEYS[1], ARGV[1]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) else redis.call('HDEL', KEYS[2], ARGV[1]) end
return false
"""

# KEYS: maps, mapctx; ARGV: map id, context. Returns 1 when set (the map exists).
SET_MAP_CONTEXT_SCRIPT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# KEYS: lock; ARGV: owner, ttl ms. Take it, or renew it for its owner. Returns 1 when held.
LEASE_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
return 1
"""

# KEYS: lock; ARGV: owner.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class _Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


_SAVE, _DELETE, _FORGET = _Script(SAVE_SCRIPT), _Script(DELETE_SCRIPT), _Script(FORGET_SCRIPT)
_STATUS, _STATUSES, _FAIL = _Script(STATUS_SCRIPT), _Script(STATUSES_SCRIPT), _Script(FAIL_STATUS_SCRIPT)
_COMMIT_MAP, _LEASE, _RELEASE = _Script(COMMIT_MAP_SCRIPT), _Script(LEASE_SCRIPT), _Script(RELEASE_SCRIPT)
_ADD_MAP, _SET_MAP_CONTEXT = _Script(ADD_MAP_SCRIPT), _Script(SET_MAP_CONTEXT_SCRIPT)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _raw(value: bytes | str) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


class RedisControlStore:
    """:class:`~kvsp_quic.storage.control_store.ControlStore` in Redis or Redis Cluster (module docstring)."""

    shared = True  # every replica of the PC writes it

    def __init__(self, client: Redis | RedisCluster, *, prefix: str = "kvsp:", owns_client: bool = False) -> None:
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.prefix = prefix + "{pc}:"
        self._owns_client = owns_client

    @classmethod
    def from_url(cls, url: str, *, cluster: bool = False, prefix: str = "kvsp:", **kwargs: Any) -> RedisControlStore:
        client: Redis | RedisCluster = (RedisCluster.from_url(url, **kwargs) if cluster
                                        else Redis.from_url(url, **kwargs))
        return cls(client, prefix=prefix, owns_client=True)

    def key(self, name: str) -> str:
        return self.prefix + name

    async def _eval(self, script: _Script, keys: Sequence[str], *args: bytes | str | int) -> Any:
        try:
            return await self.client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.eval(script.source, len(keys), *keys, *args)

    # -- sessions -------------------------------------------------------------------------------------------------

    async def load(self, session_id: uuid.UUID) -> StoredSession | None:
        found = await self.client.hgetall(self.key(f"s:{session_id}"))
        if not found:
            return None
        got = {_text(k): v for k, v in found.items()}
        if "d" not in got:
            return None
        return StoredSession(EncodedSession(_raw(got["d"])), int(got.get("v", b"0")), _text(got.get("r", b"")), False)

    async def save(self, session_id: uuid.UUID, session: StoredSession, ttl_ms: int) -> int | None:
        version = await self._eval(_SAVE, [self.key(f"s:{session_id}"), self.key("runs"), self.key("mig")],
                                   session.version, session.payload.encoded(), session.run,
                                   1 if session.migrating else 0, ttl_ms, self.prefix, str(session_id))
        return None if int(version) < 0 else int(version)

    async def delete(self, session_id: uuid.UUID) -> None:
        await self._eval(_DELETE, [self.key(f"s:{session_id}"), self.key("mig")], self.prefix, str(session_id))

    async def candidates(self, failed: Callable[[str, int], bool]) -> list[uuid.UUID]:
        runs = [_text(r) for r in await self.client.smembers(self.key("runs"))]
        due = [r for r in runs if failed(*parse_run_key(r))]
        out = ids_of(list(await self.client.smembers(self.key("mig"))))
        for run in due:
            members = list(await self.client.smembers(self.key(f"run:{run}")))
            if not members:
                await self.client.srem(self.key("runs"), run)
            out.extend(ids_of(members))
        return list(dict.fromkeys(out))

    async def forget(self, session_id: uuid.UUID) -> None:
        await self._eval(_FORGET, [self.key("runs"), self.key("mig")], self.prefix, str(session_id))

    async def lease(self, session_id: uuid.UUID, owner: str, ttl_ms: int) -> bool:
        return bool(await self._eval(_LEASE, [self.key(f"lease:{session_id}")], owner, ttl_ms))

    async def release(self, session_id: uuid.UUID, owner: str) -> None:
        await self._eval(_RELEASE, [self.key(f"lease:{session_id}")], owner)

    # -- instance statuses ----------------------------------------------------------------------------------------

    async def put_status(self, status: StoredStatus) -> StatusWrite:
        record = status.record
        higher = await self._eval(_STATUS, [self.key("status"), self.key("epochs")], record.instance, record.epoch,
                                  max(1, status.remaining_ms), status.to_bytes())
        return StatusWrite(int(higher) or None)

    async def statuses(self, since: int | None = None) -> StatusSnapshot:  # no revisions: always a snapshot
        epochs_raw, entries_raw = await self._eval(_STATUSES, [self.key("status"), self.key("epochs")])
        epochs = {_text(epochs_raw[i]): int(epochs_raw[i + 1]) for i in range(0, len(epochs_raw), 2)}
        entries = tuple(StoredStatus.from_bytes(bytes(entries_raw[i + 2]), int(entries_raw[i + 1]))
                        for i in range(0, len(entries_raw), 3))
        return StatusSnapshot(entries, epochs)

    async def fail_status(self, instance: str, epoch: int) -> bool:
        return bool(await self._eval(_FAIL, [self.key("status")], instance, epoch))

    # -- shard maps -----------------------------------------------------------------------------------------------

    async def get_map(self, map_id: str) -> ShardMap | None:
        raw = await self.client.hget(self.key("maps"), map_id)
        return decode_map(_raw(raw)) if raw is not None else None

    async def add_map(self, shard_map: ShardMap, context: bytes | None = None) -> ShardMap | None:
        existing = await self._eval(_ADD_MAP, [self.key("maps"), self.key("mapctx")], shard_map.map,
                                    encode_map(shard_map), context or b"")
        return decode_map(_raw(existing)) if existing is not None else None

    async def commit_map(self, old_version: int, new: ShardMap) -> bool:
        return bool(await self._eval(_COMMIT_MAP, [self.key("maps")], new.map, old_version, encode_map(new)))

    async def map_context(self, map_id: str) -> bytes | None:
        raw = await self.client.hget(self.key("mapctx"), map_id)
        return _raw(raw) if raw is not None else None

    async def set_map_context(self, map_id: str, context: bytes) -> bool:
        return bool(await self._eval(_SET_MAP_CONTEXT, [self.key("maps"), self.key("mapctx")], map_id, context))

    async def lock_map(self, map_id: str, owner: str, ttl_ms: int) -> bool:
        return bool(await self.client.set(self.key(f"reshard:{map_id}"), owner, nx=True, px=ttl_ms))

    async def unlock_map(self, map_id: str, owner: str) -> None:
        await self._eval(_RELEASE, [self.key(f"reshard:{map_id}")], owner)

    # -- the connection -------------------------------------------------------------------------------------------

    async def ping(self) -> None:
        await self.client.ping()

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()


__all__ = ["RedisControlStore"]
