"""Lua scripts shared by the Redis stores of the Index Service (:mod:`kvsp_quic.storage.redis_index`,
:mod:`kvsp_quic.storage.redis_producer_digests`): records kept as hash fields with their expiry on the Redis
server's clock."""

NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1]: block hash; ARGV: writer id (holder-id, instance-id), ttl ms, value. Returns 1 created, 0 refreshed.
PUT_SCRIPT = NOW + """
local ttl = tonumber(ARGV[2])
local created = 1
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local c = string.find(old, ':', 1, true)
  if tonumber(string.sub(old, 1, c - 1)) > now then created = 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d:', now + ttl) .. ARGV[3])
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
return created
"""
