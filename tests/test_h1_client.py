"""http3.h1_client (the lean HTTP/1.1-over-TLS client), KvspClient's TCP path and transport preference, and the
holder's block hot path -- all against real servers (http3.tcp_server, http3.server.RoleServer) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from http3.asgi_types import Receive, Scope, Send
from http3.client import KvspClient, RequestTimeout, TransportError
from http3.h1_client import HEAD_READ, H1Pool, IntoBuffer
from http3.server import RoleServer
from http3.tcp_server import TcpServer
from kvsp_http.holder_app import holder_app
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.samples import random_sections
from quic.tls import TransportSettings, ssl_client_context
from tests.pki import TestPki
from tests.support.descriptors import small_descriptor
from tests.support.waits import until

MiB = 1 << 20
BIG = os.urandom(16 * MiB + 123)
HOLDER_URI = "https://127.0.0.1/kvsp/"  # clients check the SAN URI names the host called (issue 13)
ALICE = "urn:kvsp:client:alice"
BOB = "urn:kvsp:client:bob"
SCOPE = "6d1c6481cd428737da312c089db3832a"
POLICY = Policy.from_dict({"principal": [
    {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE]},
    {"identity": BOB, "roles": ["client"], "scopes": [SCOPE]},
]})


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """/big: BIG with Content-Length; /chunked: three pieces, no length; /sha: SHA-256 and size of the body;
    /broken: half of what it announces, then it fails; /empty: 204; /silent: no answer for 3 s; /stall: the head
    and 64 KiB of the MiB it announces, then nothing for 3 s."""
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/big":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(BIG))]})
        await send({"type": "http.response.body", "body": BIG[:MiB], "more_body": True})
        await send({"type": "http.response.body", "body": BIG[MiB:], "more_body": False})
    elif path == "/chunked":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in (b"alpha-", b"", b"beta-" * 1000, b"gamma"):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    elif path == "/sha":
        digest, n = hashlib.sha256(), 0
        while True:
            message = await receive()
            digest.update(message.get("body", b""))
            n += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        out = json.dumps({"sha": digest.hexdigest(), "n": n}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})
    elif path == "/broken":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % MiB)]})
        await send({"type": "http.response.body", "body": BIG[:MiB // 2], "more_body": True})
        raise RuntimeError("the app fails midway")
    elif path == "/silent":
        await asyncio.sleep(3)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/stall":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % MiB)]})
        await send({"type": "http.response.body", "body": BIG[:64 << 10], "more_body": True})
        await asyncio.sleep(3)
        await send({"type": "http.response.body", "body": BIG[64 << 10:MiB], "more_body": False})
    elif path == "/empty":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"no"})


@pytest.fixture
async def server(server_holder_certs: TestPki) -> AsyncIterator[TcpServer]:
    srv = TcpServer(app, server_holder_certs.files("server"), settings=TransportSettings(max_body_bytes=32 * MiB))
    await srv.start("127.0.0.1", 0)
    try:
        yield srv
    finally:
        await srv.close()


@pytest.fixture
async def pool(server_holder_certs: TestPki) -> AsyncIterator[H1Pool]:
    p = H1Pool(ssl_client_context(server_holder_certs.files("alice"), alpn=("http/1.1",)))
    try:
        yield p
    finally:
        await p.aclose()


async def test_get_keep_alive_and_readinto(server: TcpServer, pool: H1Pool) -> None:
    port = server.port
    response = await pool.request("127.0.0.1", port, "GET", "/big")
    assert response.status == 200 and response.content_length == len(BIG)
    assert await response.aread() == BIG
    buffer = bytearray(len(BIG) + 10)
    for _ in range(3):
        response = await pool.request("127.0.0.1", port, "GET", "/big")
        assert await response.readinto(buffer) == len(BIG)
        assert bytes(buffer[:len(BIG)]) == BIG
    empty = await pool.request("127.0.0.1", port, "GET", "/empty")
    assert empty.status == 204 and await empty.aread() == b""
    head = await pool.request("127.0.0.1", port, "HEAD", "/big")  # Content-Length, and no body to read
    assert head.status == 200 and await head.aread() == b""
    again = await pool.request("127.0.0.1", port, "GET", "/nothing")
    assert (again.status, await again.aread()) == (404, b"no")
    assert pool.connects == 1 and pool.idle("127.0.0.1", port) == 1  # one connection carried everything


async def test_readinto_refuses_a_small_buffer(server: TcpServer, pool: H1Pool) -> None:
    response = await pool.request("127.0.0.1", server.port, "GET", "/big")
    with pytest.raises(TransportError, match="larger than the buffer"):
        await response.readinto(bytearray(MiB))
    assert pool.idle("127.0.0.1", server.port) == 0  # that connection is gone, the next one is fresh
    response = await pool.request("127.0.0.1", server.port, "GET", "/big")
    assert await response.aread() == BIG and pool.connects == 2


async def test_chunked_response(server: TcpServer, pool: H1Pool) -> None:
    for _ in range(2):
        response = await pool.request("127.0.0.1", server.port, "GET", "/chunked")
        assert response.content_length is None
        assert b"".join([chunk async for chunk in response.aiter_bytes()]) == b"alpha-" + b"beta-" * 1000 + b"gamma"
    into = bytearray(10_000)
    response = await pool.request("127.0.0.1", server.port, "GET", "/chunked")
    n = await response.readinto(into)
    assert bytes(into[:n]) == b"alpha-" + b"beta-" * 1000 + b"gamma"
    assert pool.connects == 1


async def test_request_bodies(server: TcpServer, pool: H1Pool) -> None:
    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(BIG), 3 * MiB):
            yield BIG[i:i + 3 * MiB]

    for body in (BIG, memoryview(BIG), bytearray(b"small"), pieces()):
        response = await pool.request("127.0.0.1", server.port, "PUT", "/sha", [(b"content-type", b"x/y")], body)
        got = json.loads(await response.aread())
        expected = BIG if not isinstance(body, bytearray) else b"small"
        assert got == {"sha": hashlib.sha256(expected).hexdigest(), "n": len(expected)}
    response = await pool.request("127.0.0.1", server.port, "POST", "/sha")  # no body: Content-Length: 0
    assert json.loads(await response.aread())["n"] == 0
    assert pool.connects == 1
    for fields in ([(b"x-a", b"1\r\nx-injected: 1")], [(b"bad name", b"1")]):
        with pytest.raises(ValueError, match="invalid header field"):
            await pool.request("127.0.0.1", server.port, "GET", "/big", fields)


async def test_body_waits_in_the_connection_for_its_sink(server: TcpServer, pool: H1Pool) -> None:
    """After the head of a Content-Length body the connection stops reading until the caller takes the body, so
    that TLS decrypts it straight into the caller's sink (readinto, receive_into) rather than into scratch
    ``bytes`` first (issue 16: a second copy of every block); streamed reading resumes it as well."""
    response = await pool.request("127.0.0.1", server.port, "GET", "/big")
    await asyncio.sleep(0.3)  # the server has sent all it can meanwhile
    assert 0 <= response.buffered <= HEAD_READ
    into = bytearray(len(BIG))
    assert await response.readinto(into) == len(BIG) and into == BIG
    response = await pool.request("127.0.0.1", server.port, "GET", "/big")
    await asyncio.sleep(0.1)
    assert response.buffered <= HEAD_READ
    assert b"".join([chunk async for chunk in response.aiter_bytes()]) == BIG
    assert pool.connects == 1 and pool.idle("127.0.0.1", server.port) == 1


async def test_deadlines_of_the_head_and_the_body(server_holder_certs: TestPki) -> None:
    """The lean path's timeouts (one timer per pool, :class:`http3.h1_client.Deadlines`): a head that does not
    come by the request's deadline and a body that stalls past the read timeout end the exchange (and its
    connection) with a timeout; the pool goes on with fresh connections."""
    srv = TcpServer(app, server_holder_certs.files("server"), settings=TransportSettings(shutdown_grace=0.5))
    await srv.start("127.0.0.1", 0)
    pool = H1Pool(ssl_client_context(server_holder_certs.files("alice"), alpn=("http/1.1",)))
    loop = asyncio.get_running_loop()
    try:
        start = loop.time()
        with pytest.raises(RequestTimeout):
            await pool.request("127.0.0.1", srv.port, "GET", "/silent", deadline=start + 0.3)
        assert 0.25 < loop.time() - start < 2.5
        response = await pool.request("127.0.0.1", srv.port, "GET", "/stall", deadline=loop.time() + 10)
        start = loop.time()
        with pytest.raises(RequestTimeout):
            await response.readinto(bytearray(MiB), timeout=0.3)
        assert 0.25 < loop.time() - start < 2.5
        ok = await pool.request("127.0.0.1", srv.port, "GET", "/big", deadline=loop.time() + 10)
        assert await ok.aread() == BIG and pool.connects == 3
        async with KvspClient(server_holder_certs.files("alice"), prefer="tcp", retries=0, timeout=0.3) as client:
            start = loop.time()
            with pytest.raises(RequestTimeout, match=r"no response within 0\.3 s"):
                await client.request("GET", f"https://127.0.0.1:{srv.port}/silent")
            async with client.stream("GET", f"https://127.0.0.1:{srv.port}/stall", timeout=10) as streamed:
                streamed.read_timeout = 0.3
                with pytest.raises(RequestTimeout, match=r"did not arrive within 0\.3 s"):
                    await streamed.readinto(bytearray(MiB))
            async with client.stream("GET", f"https://127.0.0.1:{srv.port}/stall", timeout=10) as streamed:
                streamed.read_timeout = 0.3
                got = bytearray()
                with pytest.raises(RequestTimeout, match=r"no response data for 0\.3 s"):
                    async for chunk in streamed.aiter_bytes():
                        got += chunk
                assert got == BIG[:64 << 10]
            assert loop.time() - start < 7.5
            big = await client.request("GET", f"https://127.0.0.1:{srv.port}/big", timeout=10)
            assert big.content == BIG
    finally:
        await pool.aclose()
        await srv.close()


async def test_early_answer_stops_the_body(server_holder_certs: TestPki) -> None:
    srv = TcpServer(app, server_holder_certs.files("server"), settings=TransportSettings(max_body_bytes=MiB))
    await srv.start("127.0.0.1", 0)
    try:
        async with KvspClient(server_holder_certs.files("alice"), prefer="tcp") as client:
            url = f"https://127.0.0.1:{srv.port}/sha"
            response = await client.request("PUT", url, content=BIG)  # the server answers 413 at once
            assert response.status == 413 and response.http_version == "HTTP/1.1"
            assert response.json()["status"] == 413
            ok = await client.request("PUT", url, content=b"x" * 1000)  # a fresh connection
            assert ok.status == 200 and ok.json()["n"] == 1000
    finally:
        await srv.close()


async def test_broken_body_and_refused_connect(server_holder_certs: TestPki, server: TcpServer, pool: H1Pool) -> None:
    response = await pool.request("127.0.0.1", server.port, "GET", "/broken")
    with pytest.raises(TransportError):
        await response.aread()
    with pytest.raises(TransportError):
        await pool.request("127.0.0.1", 1, "GET", "/")
    async with KvspClient(server_holder_certs.files("alice"), prefer="tcp", retries=0) as client:
        with pytest.raises(TransportError):
            await client.request("GET", f"https://127.0.0.1:{server.port}/broken")
        with pytest.raises(TransportError):
            await client.request("GET", "https://127.0.0.1:1/refused")


async def test_server_closes_idle_connection(server_holder_certs: TestPki) -> None:
    srv = TcpServer(app, server_holder_certs.files("server"), settings=TransportSettings(idle_timeout=0.2))
    await srv.start("127.0.0.1", 0)
    pool = H1Pool(ssl_client_context(server_holder_certs.files("alice"), alpn=("http/1.1",)))
    try:
        first = await pool.request("127.0.0.1", srv.port, "GET", "/chunked")
        await first.aread()
        await until(lambda: pool.idle("127.0.0.1", srv.port) == 0, 5.0, "the server's close of the idle connection")
        second = await pool.request("127.0.0.1", srv.port, "GET", "/big")
        assert await second.aread() == BIG and pool.connects == 2
    finally:
        await pool.aclose()
        await srv.close()


async def test_kvsp_client_prefers_tcp(server_holder_certs: TestPki, server: TcpServer) -> None:
    url = f"https://127.0.0.1:{server.port}/big"
    with pytest.raises(ValueError):
        KvspClient(server_holder_certs.files("alice"), prefer="udp")
    async with KvspClient(server_holder_certs.files("alice"), prefer={f"127.0.0.1:{server.port}": "tcp"}) as client:
        assert client.transport_for(url) == "tcp" and client.transport_for("https://127.0.0.1:1/") == "h3"
        response = await client.request("GET", url)
        assert response.http_version == "HTTP/1.1" and response.content == BIG
        async with client.stream("GET", url) as streamed:
            into = bytearray(len(BIG))
            assert await streamed.readinto(into) == len(BIG) and into == BIG
        client.prefer_transport("127.0.0.1:1", "tcp")
        assert client.transport_for("https://127.0.0.1:1/x") == "tcp"


# -- containers verified as they arrive, and the holder's hot path ---------------------------------------------------


def container(d: CompatDescriptor, seed: int) -> c.EncodedContainer:
    return c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, seed), first_layer=0,
                    token_count=d.block_tokens, descriptor=d)


@pytest.fixture
async def holder_server(server_holder_certs: TestPki) -> AsyncIterator[tuple[RoleServer, Holder]]:
    d = small_descriptor(layers=8)
    holder = Holder(HolderSettings(HOLDER_URI, (d,), host_capacity=64 * MiB))
    srv = RoleServer(holder_app(holder, POLICY), server_holder_certs.files("holder"))
    await srv.start("127.0.0.1", 0)
    try:
        yield srv, holder
    finally:
        await srv.close()


async def test_receive_into_a_verifying_decoder(server_holder_certs: TestPki,
                                                holder_server: tuple[RoleServer, Holder]) -> None:
    srv, holder = holder_server
    d = holder.settings.descriptors[0]
    block = container(d, 7)
    url = srv.base_uri("/kvsp/") + f"blocks/{d.compat_id.hex()}/{SCOPE}/{'ab' * 32}"
    async with KvspClient(server_holder_certs.files("alice"), prefer="tcp") as client:
        put = await client.request("PUT", url, content=block.tobytes(),
                                   headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
        assert put.status == 201 and put.http_version == "HTTP/1.1"
        assert block.layer_digests is not None
        into = bytearray(len(block) + 100)
        decoder = c.ContainerDecoder(d, expected_layer_digests=block.layer_digests,
                                     allocate=lambda n: memoryview(into)[:n])
        async with client.stream("GET", url) as response:
            assert await response.receive_into(decoder) == len(block)
        decoder.finish()
        assert decoder.done and bytes(into[:len(block) - block.header.size]) == block.tobytes()[block.header.size:]
        wrong = list(block.layer_digests)
        wrong[3] = bytes(32)
        bad = c.ContainerDecoder(d, expected_layer_digests=wrong)
        async with client.stream("GET", url) as response:
            with pytest.raises(c.LayerDigestMismatch):
                await response.receive_into(bad)
        again = await client.request("GET", url)  # the connection of the failed exchange is not reused
        assert again.content == block.tobytes()
        sink = IntoBuffer(bytearray(len(block)))
        async with client.stream("GET", url) as response:
            assert await response.receive_into(sink) == len(block) and bytes(sink.view) == block.tobytes()


async def test_the_block_resource_answers_alike_on_every_transport(server_holder_certs: TestPki) -> None:
    """Issue 25 point 3: one serving path (kvsp_http.holder_app.BlockResource) answers the block resource on HTTP/1.1
    (small GETs through respond_now), HTTP/2 and HTTP/3 -- refusals, errors and successes alike."""
    answers: dict[str, list[tuple[Any, ...]]] = {}
    transports = {"HTTP/1.1": {"prefer": "tcp"}, "HTTP/2": {"prefer": "tcp", "fallback_http2": True},
                  "HTTP/3": {"prefer": "h3", "fallback": False}}
    for name, options in transports.items():
        d = small_descriptor(layers=8)
        holder = Holder(HolderSettings(HOLDER_URI, (d,), host_capacity=64 * MiB))
        srv = RoleServer(holder_app(holder, POLICY), server_holder_certs.files("holder"))
        await srv.start("127.0.0.1", 0)
        block = container(d, 3).tobytes()

        def url(key: str = "cd" * 32, query: str = "", compat: str = d.compat_id.hex(), scope: str = SCOPE,
                srv: RoleServer = srv) -> str:
            return srv.base_uri("/kvsp/") + f"blocks/{compat}/{scope}/{key}" + (f"?{query}" if query else "")

        put = {"content-type": "application/kvsp-block", "if-none-match": "*"}
        async with KvspClient(server_holder_certs.files("alice"), **options) as alice, \
                KvspClient(server_holder_certs.files("bob"), **options) as bob:
            cases = [
                await bob.request("PUT", url(), headers=put, content=block),  # a client may not store: 403
                await alice.request("PUT", url(), headers={"content-type": "text/plain", "if-none-match": "*"},
                                    content=block),  # 415
                await alice.request("PUT", url(), headers={"content-type": "application/kvsp-block"},
                                    content=block),  # 428
                await alice.request("PUT", url(), headers=put, content=block[:100]),  # truncated: 400
                await alice.request("PUT", url(), headers=put, content=block),  # 201
                await alice.request("PUT", url(), headers=put, content=block),  # exists: 412
                await bob.request("GET", url()),  # 200
                await alice.request("GET", url(query="layers=2-3")),  # a range: 200
                await alice.request("GET", url(query="layers=9-12")),  # beyond the block
                await alice.request("GET", url(query="codec=zz")),  # 400
                await alice.request("GET", url(key="ef" * 32)),  # 404
                await alice.request("GET", url(key="EF" * 32)),  # not lowercase hex: 400
                await alice.request("GET", url(scope="00" * 16)),  # no such scope for alice: 403
                await alice.request("GET", url() + "/extra"),  # no such resource: 404
                await alice.request("HEAD", url()),  # 200, no body
                await alice.request("DELETE", url()),  # no such resource: 404
            ]
        await srv.close()
        assert {r.http_version for r in cases} == {name}, name
        rows = []
        for r in cases:
            body: Any = r.content
            if r.headers.get("content-type") == "application/kvsp+json":
                body = sorted(json.loads(body or b"{}"))  # record members (their times differ)
            elif r.headers.get("content-type") == "application/problem+json":
                problem = json.loads(body or b"{}")
                body = (problem.get("type"), problem.get("status"))
            cache = (r.headers.get("cache-control") or "").split("max-age=")[0]  # the remaining TTL may tick
            rows.append((r.status, r.headers.get("content-type"), r.headers.get("content-length"),
                         r.headers.get("repr-digest"), cache, body))
        answers[name] = rows
    assert [row[0] for row in answers["HTTP/1.1"]] == [403, 415, 428, 400, 201, 412, 200, 200, 404, 400, 404, 400,
                                                       403, 404, 200, 404]
    assert answers["HTTP/1.1"] == answers["HTTP/2"] == answers["HTTP/3"]


async def test_kvsp_client_refuses_urls_it_cannot_send(server_holder_certs: TestPki, server: TcpServer) -> None:
    """The URL is split once per request: the scheme and the host are still checked before anything is sent, and
    a target with a query string still reaches its path."""
    async with KvspClient(server_holder_certs.files("alice"), prefer="tcp") as client:
        for url in ("http://127.0.0.1/big", "https:///big", "ftp://127.0.0.1/big"):
            with pytest.raises(ValueError, match="KVSP URLs are https"):
                await client.request("GET", url)
        response = await client.request("GET", f"https://127.0.0.1:{server.port}/big?layers=0-1&x=%41")
        assert response.status == 200 and response.content == BIG and response.http_version == "HTTP/1.1"
