"""The Redis store against real servers: its key layout, expiry by Redis, several Index Service processes sharing
one Redis, lost scripts, and a three-node Redis Cluster. (tests/test_index.py runs the role suite on it too.)"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.redis_server import RedisClusterServers, RedisServer, command, needs_redis
from tests.support.index import C1, H1, H2, II7, PC, S1, S2, bk, hid, replica, who

pytest.importorskip("redis", reason="the redis extra is not installed (pip install -e '.[redis]')")

from redis.asyncio import Redis, RedisCluster

from kvsp_quic.records import LookupRequest
from kvsp_quic.roles.index import IndexConfig, IndexService
from kvsp_quic.storage.redis_index import RedisIndexStore

pytestmark = needs_redis


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer.start(tmp_path_factory.mktemp("redis")) as s:
        yield s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    with RedisClusterServers.start(tmp_path_factory.mktemp("cluster"), nodes=3) as c:
        yield c


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[Redis]:
    c = Redis(host="127.0.0.1", port=server.port)
    yield c
    await c.aclose()


def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


async def test_layout(client: Redis) -> None:
    store = RedisIndexStore(client, prefix=prefix())
    assert await store.put(replica(0, ttl_ms=60_000), 0.0)
    assert await store.put(replica(0, holder=H2, ttl_ms=5_000), 0.0)
    key = store.key(bk(0))
    assert key == store.prefix + b"r:{" + bk(0).hex().encode() + b"}"  # the hash tag is the Block Key
    fields = await client.hgetall(key)
    assert set(fields) == {hid(H1).encode(), hid(H2).encode()}
    expiry, _, rest = fields[hid(H1).encode()].partition(b":")
    assert expiry.isdigit() and rest.startswith(S1 + C1)
    assert 59_000 < await client.pttl(key) <= 60_000  # the hash lives as long as its longest replica
    assert await store.put(replica(0, holder=II7, ttl_ms=1_000), 0.0)
    assert 58_000 < await client.pttl(key) <= 60_000  # a shorter TTL does not shorten it
    assert await store.count() == 3


async def test_redis_expires_replicas_and_blocks(client: Redis) -> None:
    store = RedisIndexStore(client, prefix=prefix())
    await store.put(replica(0, ttl_ms=200), 0.0)
    await store.put(replica(0, holder=H2, ttl_ms=60_000), 0.0)
    await store.put(replica(1, ttl_ms=200), 0.0)
    [[a, b]] = await store.lookup(S1, C1, [bk(0), bk(2)], 0.0)
    assert {a.holder, b.holder} == {H1, H2} and all(0 < r.ttl_ms <= 60_000 for r in (a, b))
    await asyncio.sleep(0.3)
    [[left]] = await store.lookup(S1, C1, [bk(0), bk(1)], 0.0)
    assert left.holder == H2
    assert await client.hlen(store.key(bk(0))) == 1  # the lookup deleted the expired field
    assert await client.exists(store.key(bk(1))) == 0  # Redis dropped the block whose replicas all expired
    assert await store.get(hid(H1), bk(0), 0.0) is None
    assert await store.expire(0.0) == 0


async def test_processes_share_one_redis(server: RedisServer) -> None:
    shared = prefix()
    clients = [Redis(host="127.0.0.1", port=server.port) for _ in range(2)]
    try:
        a, b = (IndexService(RedisIndexStore(c, prefix=shared), clock=lambda: 0.0,
                             config=IndexConfig()) for c in clients)
        assert (await a.publish(who(H1), hid(H1), bk(0), replica(0))).created
        assert not (await b.publish(who(H1), hid(H1), bk(0), replica(0))).created  # a refresh, via b
        await b.publish(who(H1), hid(H1), bk(1), replica(1))
        response = await a.lookup(who(PC), LookupRequest(S1, C1, (bk(0), bk(1)), None))  # type: ignore[arg-type]
        assert response.matched == 2
        await a.withdraw(who(H1), hid(H1), bk(1))
        assert (await b.lookup(who(PC), LookupRequest(S1, C1, (bk(0), bk(1)), None))).matched == 1  # type: ignore[arg-type]
    finally:
        for c in clients:
            await c.aclose()


async def test_lost_scripts_are_loaded_again(client: Redis) -> None:
    store = RedisIndexStore(client, prefix=prefix())
    await client.script_flush()
    assert await store.put(replica(0), 0.0)
    await client.script_flush()
    assert len(await store.lookup(S1, C1, [bk(0)], 0.0)) == 1
    await client.script_flush()
    assert await store.get(hid(H1), bk(0), 0.0) is not None


async def test_owned_client_is_closed(server: RedisServer) -> None:
    store = RedisIndexStore.from_url(server.url, prefix=prefix())
    assert await store.put(replica(0), 0.0)
    await store.aclose()


async def test_cluster(cluster: RedisClusterServers) -> None:
    client = RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        store = RedisIndexStore(client, prefix=prefix(), first_chunk=8)
        assert store.cluster
        for node in cluster.ports:
            command(node, "SCRIPT", "FLUSH")
        service = IndexService(store, clock=lambda: 0.0, config=IndexConfig())
        n = 60
        for i in range(n):
            assert (await service.publish(who(H1), hid(H1), bk(i), replica(i))).created
        await service.publish(who(H2), hid(H2), bk(3), replica(3, holder=H2, scope=S2))
        for node in cluster.ports:  # the scripts are gone from every node: lookups load them again
            command(node, "SCRIPT", "FLUSH")
        request = LookupRequest(S1, C1, tuple(bk(i) for i in range(n + 5)), None)  # type: ignore[arg-type]
        response = await service.lookup(who(PC), request)
        assert response.matched == n
        assert [m.block_key for m in response.blocks] == [bk(i) for i in range(n)]
        assert all(len(m.replicas) == 1 for m in response.blocks)  # H2's S2 replica of block 3 is not S1's
        await service.withdraw(who(H1), hid(H1), bk(10))
        assert (await service.lookup(who(PC), request)).matched == 10
        assert await store.count() == n  # 59 of H1 + 1 of H2
        per_node = [int(command(p, "DBSIZE").strip(b":\r\n")) for p in cluster.ports]
        assert sum(per_node) == n - 1 and all(per_node)  # one hash per block, partitioned over every node
    finally:
        await client.aclose()
