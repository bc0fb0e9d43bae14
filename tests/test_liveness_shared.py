"""Holders' liveness records and failure reports shared by every Index Service process on one Redis (issue 12,
point 1; kvsp_quic.storage.redis_liveness, the load/merge rules of kvsp_quic.roles.liveness, the sync task of
kvsp_http.index_app): a liveness record or a failure report received by one process leaves out or demotes the same
replicas in every other process's lookups, within the sync period; a Redis outage keeps the last view."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient, Response
from http3.server import RoleServer
from kvsp_http.app_kit import JSON_MEDIA_TYPE
from kvsp_http.index_app import index_app, liveness_syncer
from kvsp_quic import keys as k
from kvsp_quic.records import LookupRequest
from kvsp_quic.roles.index import IndexConfig, IndexService
from kvsp_quic.roles.liveness import FailureReports, LivenessTable, SharedDemotion, SharedHolder
from kvsp_quic.storage.memory_index import MemoryIndexStore
from quic.tls import TlsFiles
from tests.helpers import Clock, Process
from tests.peers import missing_peer
from tests.pki import make_pki
from tests.redis_server import REDIS_SERVER, SKIP_REASON, RedisClusterServers, RedisServer, free_port, needs_redis
from tests.support.index import C1, H1, H2, PC, S1, S2, bk, hid, make_config, replica, who
from tests.support.index_app import POLICY
from tests.support.waits import until

pytest.importorskip("redis", reason="the redis extra is not installed (pip install -e '.[redis]')")

from redis.asyncio import Redis, RedisCluster

from kvsp_quic.storage.redis_liveness import RedisLivenessStore

INDEX = "https://127.0.0.1/kvsp/"
EP1 = ("h1.example", 443)


def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


# -- the merge rules (kvsp_quic.roles.liveness), no Redis -----------------------------------------------------------


def test_a_load_takes_newer_shared_records_and_never_undoes_a_newer_local_one() -> None:
    clock = Clock()
    table = LivenessTable(clock)
    table.load([SharedHolder(H1, 1000, 400)])  # reported 600 ms ago elsewhere: 400 ms left
    assert table.alive(H1) is True
    clock.now += 0.5
    assert table.alive(H1) is False and table.lapsed_endpoints() == {EP1}
    table.load([SharedHolder(H1, 1000, -100)])  # the same record read back lapsed: still lapsed
    assert table.lapsed_endpoints() == {EP1}
    table.report(H1, 5000)  # reported here just now; a read that started before it must not undo it
    table.load([SharedHolder(H1, 1000, -200)])
    assert table.alive(H1) is True
    table.load([SharedHolder(H2, 1000, -1)])  # a holder that lapsed at another process: known here too
    assert table.lapsed_endpoints() == {("h2.example", 443)}
    assert {s.holder for s in table.snapshot()} == {H1, H2}
    clock.now += 1.0
    table.load([SharedHolder(H1, 300, 300)])  # reported again elsewhere, after this process's report
    assert [s.ttl_ms for s in table.snapshot() if s.holder == H1] == [300]


def test_a_load_only_lengthens_demotions() -> None:
    clock = Clock()
    reports = FailureReports(clock, demote_ms=1000)
    reports.load([SharedDemotion(S1, H1, 2000), SharedDemotion(S2, H2, 0)])  # an ended one is not taken
    assert reports.demoted(S1) == {EP1} and reports.demoted(S2) == frozenset()
    reports.report(S1, H1)  # 1 s from now: shorter than the shared 2 s, which stays
    clock.now += 1.5
    assert reports.demoted(S1) == {EP1}
    reports.load([SharedDemotion(S1, H1, 100)])  # a stale read does not shorten it
    clock.now += 0.4
    assert reports.demoted(S1) == {EP1}
    clock.now += 0.2
    assert reports.demoted(S1) == frozenset()


# -- the Redis store --------------------------------------------------------------------------------------------------


@needs_redis
async def test_the_store_on_redis(redis_url: str) -> None:
    store = RedisLivenessStore.from_url(redis_url, prefix=prefix())
    try:
        await store.report(H1, 300)
        await store.report(H2, 60_000)
        await store.report_failure(S1, H1, 60_000)
        await store.report_failure(S1, H1, 1000)  # a report never shortens a running demotion
        await store.report_failure(S2, H2, 200)
        shared = await store.snapshot()
        got = {h.holder: h for h in shared.holders}
        assert got.keys() == {H1, H2} and got[H1].ttl_ms == 300 and 0 < got[H1].remaining_ms <= 300
        assert {(d.scope_id, d.holder) for d in shared.demotions} == {(S1, H1), (S2, H2)}
        assert [d.remaining_ms > 50_000 for d in shared.demotions if d.scope_id == S1] == [True]
        # one hash per table, both under one hash tag: one slot of a cluster, one script reads both
        assert store.key("holders").endswith("{live}:holders") and store.key("failures").endswith("{live}:failures")
        assert await store.client.hlen(store.key("holders")) == 2
        await asyncio.sleep(0.4)  # H1 lapsed (on the Redis clock); S2's demotion ended
        shared = await store.snapshot()
        lapsed = [h for h in shared.holders if h.holder == H1]
        assert lapsed and lapsed[0].remaining_ms < 0  # kept: its replicas stay left out everywhere
        assert {(d.scope_id, d.holder) for d in shared.demotions} == {(S1, H1)}
        assert await store.client.hlen(store.key("failures")) == 1  # the ended one was deleted
        # lapsed records are dropped retain_ms after their expiry
        short = RedisLivenessStore(store.client, prefix=store.prefix[:-len("{live}:")], retain_ms=0)
        assert {h.holder for h in (await short.snapshot()).holders} == {H2}
        assert await store.client.hlen(store.key("holders")) == 1
    finally:
        await store.aclose()


@needs_redis
async def test_the_store_is_bounded(redis_url: str) -> None:
    client = Redis.from_url(redis_url)
    try:
        store = RedisLivenessStore(client, prefix=prefix(), max_entries=2)
        for holder in (H1, H2, "https://h3.example/kvsp/"):
            await store.report(holder, 60_000)
        await store.report(H1, 1000)  # a known holder still refreshes
        holders = {h.holder: h.ttl_ms for h in (await store.snapshot()).holders}
        assert holders == {H1: 1000, H2: 60_000}
        for scope in (S1, S2, bytes([3]) * 16):
            await store.report_failure(scope, H1, 60_000)
        assert len((await store.snapshot()).demotions) == 2
    finally:
        await client.aclose()


async def test_the_store_on_a_redis_cluster(tmp_path: Path) -> None:
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
    with RedisClusterServers.start(tmp_path / "cluster", nodes=3) as cluster:
        client = RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        try:
            store = RedisLivenessStore(client, prefix=prefix())
            slots = {await client.cluster_keyslot(store.key(n)) for n in ("holders", "failures")}
            assert len(slots) == 1
            await store.report(H1, 60_000)
            await store.report_failure(S1, H2, 60_000)
            shared = await store.snapshot()
            assert [h.holder for h in shared.holders] == [H1]
            assert [(d.scope_id, d.holder) for d in shared.demotions] == [(S1, H2)]
        finally:
            await client.aclose()


# -- two Index Service processes' roles on one Redis --------------------------------------------------------------


async def names(service: IndexService, n: int = 2, scope: bytes = S1) -> list[list[str]]:
    response = await service.lookup(who(PC), LookupRequest(scope, C1, tuple(bk(i) for i in range(n))))  # type: ignore[arg-type]
    return [[r.holder for r in m.replicas] for m in response.blocks]


@needs_redis
async def test_two_roles_share_liveness_and_failures(redis_url: str) -> None:
    """The roles with a hand clock each (the Redis clock judges expiry; the remaining time lands on the role's)."""
    shared = prefix()
    stores = [RedisLivenessStore.from_url(redis_url, prefix=shared) for _ in range(2)]
    clocks = [Clock(), Clock(50.0)]
    a, b = (IndexService(MemoryIndexStore(), clock=c, config=make_config(), shared_liveness=s)
            for c, s in zip(clocks, stores, strict=True))
    try:
        for service in (a, b):
            for holder in (H1, H2):
                for i in range(2):
                    await service.publish(who(holder), hid(holder), bk(i), replica(i, holder))
        assert await a.report_liveness_shared(who(H1), hid(H1), H1, 10**9) == a.liveness.max_ttl_ms
        assert await a.report_liveness_shared(who(H1), hid(H1), H1, 1000) == 1000
        assert a.liveness.alive(H1) is True  # at once where it was received
        assert b.liveness.alive(H1) is None
        assert await b.sync_liveness()
        assert b.liveness.alive(H1) is True
        clocks[1].now += 1.1  # B's view: lapsed by its own clock, without a new read
        assert await names(b) == [[H2], [H2]]
        await a.report_failure_shared(who(PC), hid(H2), H2, S1)
        await a.report_liveness_shared(who(H1), hid(H1), H1, 60_000)
        await b.sync_liveness()
        assert await names(b) == [[H1, H2], [H1, H2]]  # back, and H2 (reported failed) tried last
        assert await names(b, scope=S2) == []
        assert b.failures.demoted(S1) == {("h2.example", 443)} and b.failures.demoted(S2) == frozenset()
        assert not await IndexService(MemoryIndexStore(), clock=Clock()).sync_liveness()  # no shared store
    finally:
        for s in stores:
            await s.aclose()


@needs_redis
async def test_an_outage_keeps_the_last_view(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    redis = RedisServer.start(tmp_path / "redis")
    store = RedisLivenessStore.from_url(redis.url, prefix=prefix(), socket_timeout=1, socket_connect_timeout=1)
    clock = Clock()
    service = IndexService(MemoryIndexStore(), clock=clock, config=make_config(), shared_liveness=store)
    try:
        for holder in (H1, H2):
            await service.publish(who(holder), hid(holder), bk(0), replica(0, holder))
        await store.report(H1, 1)
        await asyncio.sleep(0.01)  # lapsed (on the Redis clock)
        await store.report_failure(S1, H2, 60_000)
        await service.sync_liveness()
        assert await names(service, 1) == [[H2]]
        redis.stop()
        with caplog.at_level(logging.WARNING, logger="kvsp.index"):
            task = asyncio.create_task(liveness_syncer(service, 0.05))
            await asyncio.sleep(0.6)  # several periods, all failing
            assert not task.done()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        warned = [r for r in caplog.records if "liveness" in r.getMessage()]
        assert len(warned) == 1 and "last view" in warned[0].getMessage() and warned[0].exc_info is None
        assert await names(service, 1) == [[H2]]  # the last view: H1 still left out
        assert service.failures.demoted(S1) == {("h2.example", 443)}
        with pytest.raises(Exception, match=r"(?i)connect|timeout|closed"):
            await service.report_liveness_shared(who(H1), hid(H1), H1, 1000)
        assert service.liveness.alive(H1) is False  # a write that failed is not applied here either
    finally:
        await store.aclose()
        redis.stop()


# -- two Index Service apps over HTTP/3 on one Redis ------------------------------------------------------------------


@dataclass
class Pair:
    servers: dict[str, RoleServer]
    services: dict[str, IndexService]
    clients: dict[str, KvspClient]

    async def call(self, at: str, who: str, method: str, path: str, body: Any) -> Response:
        return await self.clients[who].request(method, self.servers[at].base_uri("/kvsp/") + path,
                                               headers={"content-type": JSON_MEDIA_TYPE},
                                               content=json.dumps(body).encode())

    async def liveness(self, at: str, holder: str, ttl_ms: int) -> Response:
        return await self.call(at, "h1", "PUT", f"holders/{k.holder_id(holder)}/liveness",
                               {"holder": holder, "ttl_ms": ttl_ms})

    async def lookup(self, at: str, n: int = 2) -> list[list[str]]:
        response = await self.call(at, "alice", "POST", "lookup", {
            "scope_id": S1.hex(), "compat_id": C1.hex(), "block_keys": [bk(i).hex() for i in range(n)]})
        assert response.status == 200, response.content
        return [[r["holder"] for r in b["replicas"]] for b in response.json()["blocks"]]


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # its own roles (tests/conftest.py's pki_dir, for tests/support/index_app.py, names an instance ii7 too)
    root = tmp_path_factory.mktemp("pki")
    make_pki(root, roles={"index": INDEX, "h1": H1, "h2": H2})
    return root


@contextlib.asynccontextmanager
async def two_indexes(pki_dir: Path, redis_url: str) -> AsyncIterator[Pair]:
    """Two Index Service apps (A and B), each its own RoleServer, replica store and liveness store, on one Redis."""
    from kvsp_quic.storage.redis_index import RedisIndexStore

    shared = prefix()
    servers, services = {}, {}
    for name in ("a", "b"):
        index_store = RedisIndexStore.from_url(redis_url, prefix=shared)
        services[name] = IndexService(index_store, clock=time.monotonic, config=IndexConfig(),
                                      shared_liveness=RedisLivenessStore(index_store.client, prefix=shared))
        servers[name] = RoleServer(index_app(services[name], POLICY, base_path="/kvsp/"),
                                   TlsFiles.in_dir(pki_dir, "index"))
    clients = {n: KvspClient(TlsFiles.in_dir(pki_dir, n), timeout=10.0) for n in ("h1", "h2", "alice")}
    try:
        for server in servers.values():
            await server.start("127.0.0.1", 0)
        yield Pair(servers, services, clients)
    finally:
        for c in clients.values():
            await c.aclose()
        for server in servers.values():
            with contextlib.suppress(Exception):
                await server.close()
        for service in services.values():
            await service.store.aclose()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
    with RedisServer.start(tmp_path / "redis") as server:
        yield server


async def test_two_index_apps_leave_out_and_demote_the_same_replicas(pki_dir: Path,
                                                                     redis_server: RedisServer) -> None:
    async with two_indexes(pki_dir, redis_server.url) as p:
        for holder, name in ((H1, "h1"), (H2, "h2")):
            for i in range(2):
                record = replica(i, holder)
                put = await p.call("a", name, "PUT", f"replicas/{k.holder_id(holder)}/{bk(i).hex()}",
                                   record.to_json())
                assert put.status == 201, put.content
        granted = await p.liveness("a", H1, 1500)  # reported at A only, with a short TTL
        assert granted.status == 200 and granted.json() == {"holder": H1, "ttl_ms": 1500}
        assert sorted(map(sorted, await p.lookup("b"))) == [[H1, H2], [H1, H2]]
        # H1 stops refreshing: after its TTL, B leaves its replicas out (as A does), H2's stay
        await asyncio.sleep(1.5)
        await until(lambda: _only(p, "b", [[H2], [H2]]))
        assert await p.lookup("a") == [[H2], [H2]]
        # H1 is back (at A): B lists it again within the sync period
        assert (await p.liveness("a", H1, 60_000)).status == 200
        await until(lambda: _has(p, "b", H1))
        # a failure report at A demotes the holder B lists first, in B's lookups of that scope
        first = (await p.lookup("b"))[0][0]
        other = H2 if first == H1 else H1
        report = await p.call("a", "alice", "POST", f"holders/{k.holder_id(first)}/failures",
                              {"holder": first, "scope_id": S1.hex()})
        assert report.status == 202
        took = await until(lambda: _only(p, "b", [[other, first], [other, first]]))
        assert took < 5.0  # the sync period is 250 ms; generous for a loaded machine
        # Redis down: a liveness PUT or a failure report answers 503 problem+json, never 500
        redis_server.stop()
        down = await p.liveness("b", H1, 60_000)
        assert down.status == 503 and down.headers.get("content-type") == "application/problem+json"
        down = await p.call("b", "alice", "POST", f"holders/{k.holder_id(H1)}/failures",
                            {"holder": H1, "scope_id": S1.hex()})
        assert down.status == 503 and down.headers.get("content-type") == "application/problem+json"


async def _only(p: Pair, at: str, expected: list[list[str]]) -> bool:
    return await p.lookup(at) == expected


async def _has(p: Pair, at: str, holder: str) -> bool:
    return all(holder in names for names in await p.lookup(at))


# -- two `kvsp-quic index --store redis` processes (the composition root's wiring) --------------------------------


async def test_two_index_processes_share_liveness(tmp_path: Path, redis_server: RedisServer,
                                                  procs: list[Process]) -> None:
    dev = str(tmp_path / "dev")
    for _ in range(2):
        procs.append(Process("index", "--dev", dev, "--listen", f"127.0.0.1:{free_port()}", "--store", "redis",
                             "--redis", redis_server.url))
    a, b = (p.ready for p in procs)
    files = TlsFiles(Path(a["ca"]), Path(a["client_cert"]), Path(a["client_key"]))  # the dev client: every role
    async with KvspClient(files, timeout=20) as client:
        async def call(ready: dict[str, Any], method: str, path: str, body: Any) -> Response:
            return await client.request(method, ready["base_uri"] + path, content=json.dumps(body).encode(),
                                        headers={"content-type": JSON_MEDIA_TYPE})

        async def listed_at_b() -> list[str]:
            found = await call(b, "POST", "lookup", {"scope_id": S1.hex(), "compat_id": C1.hex(),
                                                      "block_keys": [bk(0).hex()]})
            assert found.status == 200, found.content
            return [r["holder"] for m in found.json()["blocks"] for r in m["replicas"]]

        for holder in (H1, H2):
            put = await call(a, "PUT", f"replicas/{k.holder_id(holder)}/{bk(0).hex()}", replica(0, holder).to_json())
            assert put.status == 201, put.content
        live = await call(a, "PUT", f"holders/{k.holder_id(H1)}/liveness", {"holder": H1, "ttl_ms": 1000})
        assert live.status == 200 and live.json()["ttl_ms"] == 1000
        assert sorted(await listed_at_b()) == [H1, H2]
        await asyncio.sleep(1.0)
        await until(lambda: _listed(listed_at_b, [H2]))


async def _listed(listed: Any, expected: list[str]) -> bool:
    return bool(await listed() == expected)
