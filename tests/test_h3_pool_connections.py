"""H3Pool's connections_per_origin against a real HTTP/3 server on 127.0.0.1: concurrent requests to one origin are
spread over up to K QUIC connections (each from its own UDP port, as the server sees it), sequential requests reuse
one, a discarded connection is replaced, and a slow connect does not hold up requests an open connection can take.
Then the instance's case: a real holder's blocks, all fetched at once through the retrieval client, arrive over K
connections, verified; and ``block_connections`` of the ``[instance]`` section.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from http3.asgi_types import ASGIApp, Receive, Scope, Send
from http3.client import KvspClient, TransportError
from http3.h3_client import H3Pool
from http3.h3_server import h3_handler
from http3.server import RoleServer
from kvsp_app.config import ConfigError, InstanceFile, build
from kvsp_client.retrieval import BlockFetcher
from kvsp_http.holder_app import holder_app
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.records import LookupMatch
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.instance import ServiceOptions
from kvsp_quic.samples import random_sections
from quic.listener import QuicListener
from quic.tls import TransportSettings
from tests.pki import TestPki
from tests.support.descriptors import small_descriptor
from tests.support.transport import DelayingRelay

SETTINGS = TransportSettings(shutdown_grace=2.0)


def payload(name: str) -> bytes:
    """What the server answers for /hold/<name>: 64 KiB that depend on the name."""
    return hashlib.sha256(name.encode()).digest() * 2048


class App:
    """/hold/<name> records the peer address it came from and waits until the test opens the gate (or the request
    is listed in *through*), then answers payload(name)."""

    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []
        self.arrived = 0
        self.changed = asyncio.Event()
        self.gate = asyncio.Event()
        self.through: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope["path"].rsplit("/", 1)[-1]
        self.peers.append((scope["client"][0], scope["client"][1]))
        self.arrived += 1
        self.changed.set()
        if name not in self.through:
            await self.gate.wait()
        body = payload(name)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def until(self, arrived: int, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while self.arrived < arrived:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def server(fresh_certs: TestPki) -> AsyncIterator[tuple[QuicListener, App]]:
    app = App()
    listener = QuicListener(fresh_certs.files("server"), {"h3": h3_handler(app)}, settings=SETTINGS)
    await listener.start("127.0.0.1", 0)
    yield listener, app
    app.gate.set()
    await listener.close()


def url(port: int, name: str) -> str:
    return f"https://127.0.0.1:{port}/hold/{name}"


def pool_of(client: KvspClient) -> H3Pool:
    return client._pool


async def get(client: KvspClient, port: int, name: str) -> bytes:
    response = await client.request("GET", url(port, name))
    assert response.status == 200 and response.http_version == "HTTP/3"
    assert response.content is not None
    return response.content


async def burst(client: KvspClient, port: int, app: App, names: list[str]) -> None:
    """*names* requested at once, answered only once all of them reached the server; every answer checked."""
    before = app.arrived
    app.gate.clear()
    tasks = [asyncio.create_task(get(client, port, name)) for name in names]
    try:
        await app.until(before + len(names))
    finally:
        app.gate.set()
    bodies = await asyncio.gather(*tasks)
    assert bodies == [payload(name) for name in names]


async def test_concurrent_requests_spread_over_k_connections(server: tuple[QuicListener, App],
                                                             fresh_certs: TestPki) -> None:
    listener, app = server
    async with KvspClient(fresh_certs.files("alice"), settings=SETTINGS, fallback=False,
                          connections_per_origin=3) as client:
        await burst(client, listener.port, app, [f"r{i}" for i in range(6)])
        per_port = Counter(app.peers)
        assert len(per_port) == 3 and all(addr[0] == "127.0.0.1" for addr in per_port)
        assert sorted(per_port.values()) == [2, 2, 2]  # least-loaded first: two requests on each
        assert pool_of(client).connects == 3 and client.pooled(url(listener.port, "x")) == 3
        assert listener.connections == 3
        client_ports = {c._transport.get_extra_info("sockname")[1]  # type: ignore[union-attr]
                        for c in pool_of(client).connections("127.0.0.1", listener.port)}
        assert client_ports == {port for _, port in per_port}

        await burst(client, listener.port, app, [f"s{i}" for i in range(6)])  # the same three again
        assert pool_of(client).connects == 3 and len(set(app.peers)) == 3


async def test_one_connection_per_origin_by_default(server: tuple[QuicListener, App], fresh_certs: TestPki) -> None:
    listener, app = server
    async with KvspClient(fresh_certs.files("alice"), settings=SETTINGS, fallback=False) as client:
        assert client.connections_per_origin == 1
        await burst(client, listener.port, app, [f"r{i}" for i in range(6)])
        assert len(set(app.peers)) == 1 and len(app.peers) == 6
        assert pool_of(client).connects == 1 and listener.connections == 1


async def test_sequential_requests_reuse_one_connection(server: tuple[QuicListener, App], fresh_certs: TestPki) -> None:
    listener, app = server
    app.gate.set()
    async with KvspClient(fresh_certs.files("alice"), settings=SETTINGS, fallback=False,
                          connections_per_origin=3) as client:
        for i in range(5):
            assert await get(client, listener.port, f"q{i}") == payload(f"q{i}")
        async with client.stream("GET", url(listener.port, "streamed")) as response:  # read in pieces
            assert b"".join([chunk async for chunk in response.aiter_bytes()]) == payload("streamed")
        assert await get(client, listener.port, "last") == payload("last")
    assert len(set(app.peers)) == 1 and len(app.peers) == 7
    assert pool_of(client).connects == 1


async def test_a_discarded_connection_is_replaced(server: tuple[QuicListener, App], fresh_certs: TestPki) -> None:
    listener, app = server
    async with KvspClient(fresh_certs.files("alice"), settings=SETTINGS, fallback=False,
                          connections_per_origin=3) as client:
        pool = pool_of(client)
        await burst(client, listener.port, app, [f"a{i}" for i in range(6)])
        first = set(app.peers)
        dropped = pool.connections("127.0.0.1", listener.port)[0]
        pool.discard(dropped)  # what a timeout or a broken connection does
        assert client.pooled(url(listener.port, "x")) == 2
        async with asyncio.timeout(5):
            while not dropped.closed:  # no stream in flight: it closes at once
                await asyncio.sleep(0.01)

        app.peers.clear()
        await burst(client, listener.port, app, [f"b{i}" for i in range(6)])
        second = Counter(app.peers)
        assert len(second) == 3 and sorted(second.values()) == [2, 2, 2]
        assert len(set(second) - first) == 1  # one new connection took the dropped one's place
        assert pool.connects == 4 and client.pooled(url(listener.port, "x")) == 3
        assert dropped not in pool.connections("127.0.0.1", listener.port)


async def test_a_slow_connect_does_not_hold_up_requests_an_open_connection_takes(server: tuple[QuicListener, App],
                                                                                   fresh_certs: TestPki) -> None:
    listener, app = server
    loop = asyncio.get_running_loop()
    relay = DelayingRelay(("127.0.0.1", listener.port), delay=1.0, slow_for=1.5)
    transport, _ = await loop.create_datagram_endpoint(lambda: relay, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    try:
        async with KvspClient(fresh_certs.files("alice"), settings=SETTINGS, fallback=False, connect_timeout=10,
                              connections_per_origin=2) as client:
            app.through.add("warm")
            assert await get(client, port, "warm") == payload("warm")  # the first connection, at full speed
            app.gate.clear()
            held = asyncio.create_task(get(client, port, "held"))  # in flight on it...
            await app.until(2)
            second = asyncio.create_task(get(client, port, "second"))  # ...so this one opens a second, slowly
            await asyncio.sleep(0.05)
            assert len(pool_of(client)._connecting[("127.0.0.1", port)]) == 1
            app.through.add("third")
            start = loop.time()
            third = await get(client, port, "third")  # the first connection takes it meanwhile
            assert third == payload("third") and loop.time() - start < 0.5
            assert not second.done()
            app.gate.set()
            assert await held == payload("held") and await second == payload("second")
            assert pool_of(client).connects == 2 and len(set(app.peers)) == 2
            assert Counter(app.peers).most_common(1)[0][1] == 3  # warm, held and third on the first
    finally:
        relay.close()


async def test_a_failed_connect_fails_every_request_waiting_for_it(fresh_certs: TestPki) -> None:
    listener = QuicListener(fresh_certs.files("server"), {"h3": h3_handler(App())}, settings=SETTINGS)
    await listener.start("127.0.0.1", 0)
    port = listener.port
    await listener.close()  # nothing listens there any more
    loop = asyncio.get_running_loop()
    async with KvspClient(fresh_certs.files("alice"), settings=SETTINGS, fallback=False, retries=0, connect_timeout=1,
                          connections_per_origin=3) as client:
        start = loop.time()
        results = await asyncio.gather(*(get(client, port, f"r{i}") for i in range(6)), return_exceptions=True)
        assert all(isinstance(r, TransportError) for r in results), results
        assert loop.time() - start < 3  # three connects at once, each request waited for one of them
        assert pool_of(client).connects == 0 and client.pooled(url(port, "x")) == 0
        assert not pool_of(client)._connecting.get(("127.0.0.1", port))


async def test_connections_per_origin_is_validated(fresh_certs: TestPki) -> None:
    with pytest.raises(ValueError):
        KvspClient(fresh_certs.files("alice"), connections_per_origin=0)


# -- the instance's case: block loads from one holder ------------------------------------------------------------

SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")


class Watch:
    """In front of a real holder app: notes the peer of every block GET and holds each until *hold* GETs are in
    flight at once (or a second passed), so that the test sees how many connections concurrent loads use."""

    def __init__(self, hold: int) -> None:
        self.inner: ASGIApp | None = None
        self.hold = hold
        self.peers: list[tuple[str, int]] = []
        self.all_in = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and "/blocks/" in scope["path"]:
            self.peers.append((scope["client"][0], scope["client"][1]))
            if len(self.peers) >= self.hold:
                self.all_in.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.all_in.wait()
        assert self.inner is not None
        await self.inner(scope, receive, send)


async def test_concurrent_block_loads_from_one_holder_use_k_connections(fresh_certs: TestPki) -> None:
    d = small_descriptor(layers=4)
    blocks = 8
    watch = Watch(hold=blocks)
    server = RoleServer(watch, fresh_certs.files("server"))
    await server.start("127.0.0.1", 0)
    base = server.base_uri("/")
    policy = Policy.from_dict({"principal": [
        {"identity": "urn:kvsp:client:alice", "roles": ["client", "holder"], "scopes": [SCOPE.hex()]}]})
    holder = Holder(HolderSettings(base, (d,), replica_ttl_ms=60_000))
    watch.inner = holder_app(holder, policy)
    alice = policy.principal("urn:kvsp:client:alice")
    assert alice is not None
    matches, bodies = [], []
    for n in range(blocks):
        key = hashlib.sha256(b"block %d" % n).digest()
        sections = list(random_sections(d, d.block_tokens, 0, d.layers - 1, n))
        bodies.append(c.encode(sections, first_layer=0, token_count=d.block_tokens, descriptor=d).tobytes())
        record = holder.store(alice, d.compat_id, SCOPE, key, bodies[-1], "*")
        matches.append(LookupMatch(record.block_key, (record,)))
    try:
        async with KvspClient(fresh_certs.files("alice"), timeout=10.0, fallback=False,
                              connections_per_origin=3) as client:
            fetcher = BlockFetcher(client, server.base_uri("/is/"), descriptors=[d])
            # as a prefill does: every block's stream consumed at once
            results = await asyncio.gather(*(fetcher.fetch_block(m) for m in matches))
            assert watch.all_in.is_set()  # all eight were in flight together
            for result, body in zip(results, bodies, strict=True):
                assert result is not None and result.tobytes() == body and result.http_version == "HTTP/3"
            per_port = Counter(watch.peers)
            assert len(per_port) == 3 and sorted(per_port.values()) == [2, 3, 3]
            assert pool_of(client).connects == 3
    finally:
        await server.close()


def test_block_connections_in_the_instance_section() -> None:
    assert ServiceOptions().block_connections == 4
    assert build(InstanceFile, {"instance": {"block_connections": 2}}).instance.block_connections == 2
    with pytest.raises(ConfigError, match="block_connections"):
        build(InstanceFile, {"instance": {"block_connections": 0}})
