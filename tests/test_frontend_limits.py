"""Issue 13, the front end: the caller must hold the front end's scope (no confused deputy), every request body is
read against the limit whatever its framing (413 as soon as it passes it, without reading the rest), and deeply
nested JSON is a 400. A real front end (``frontend_app`` behind a RoleServer on 127.0.0.1, a listener that takes
clients with or without a certificate), called over HTTP/1.1, HTTP/2 and HTTP/3 with client certificates."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from http3.client import KvspClient
from http3.h3_client import connect_h3
from http3.server import RoleServer
from kvsp_frontend.app import Frontend, frontend_app
from kvsp_quic.auth import Policy
from kvsp_quic.fields import MAX_JSON_DEPTH
from kvsp_quic.keys import BlockKeyer
from quic.tls import TlsFiles, TransportSettings
from tests.pki import TestPki
from tests.support.frontend import DESCRIPTOR, OneInstance, Utf8

LIMIT = 256 << 10  # the front end's body limit in these tests
CHUNK = 64 << 10
SCOPE_KEY = bytes(range(32))
OTHER_SCOPE = "ab" * 16


@dataclasses.dataclass
class Edge:
    base: str
    host: str
    port: int
    certs: TestPki


@pytest.fixture
async def edge(fresh_certs: TestPki) -> AsyncIterator[Edge]:
    certs = fresh_certs
    fake = OneInstance()
    pc, instance = RoleServer(fake.pc, certs.files("server")), RoleServer(fake.tokens, certs.files("server"))
    for server in (pc, instance):
        await server.start("127.0.0.1", 0)
    fake.instance = instance.base_uri()
    client = KvspClient(certs.files("alice"), retries=0)
    keyer = BlockKeyer(SCOPE_KEY, DESCRIPTOR.compat_id, DESCRIPTOR.block_tokens)
    frontend = Frontend(client, pc.base_uri(), keyer, Utf8(), "tiny", vocab_size=256)
    policy = Policy.from_dict({"principal": [  # alice holds the front end's scope; bob only another one
        {"identity": "urn:kvsp:client:alice", "roles": ["client"], "scopes": [keyer.scope_id.hex()]},
        {"identity": "urn:kvsp:client:bob", "roles": ["client"], "scopes": [OTHER_SCOPE]}]})
    server = RoleServer(frontend_app(frontend, policy, max_body_bytes=LIMIT), certs.files("server"),
                        settings=dataclasses.replace(TransportSettings(), client_cert_optional=True))
    await server.start("127.0.0.1", 0)
    yield Edge(server.base_uri(), "127.0.0.1", server.port, certs)
    await client.aclose()
    for s in (server, pc, instance):
        await s.close()


def _ssl(files: TlsFiles, alpn: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=files.ca)
    ctx.load_cert_chain(files.cert, files.key)
    ctx.set_alpn_protocols([alpn])
    return ctx


def _error(status: int, body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "param", "code"}, body
    return error


# -- HTTP/1.1, HTTP/2, HTTP/3 requests whose body never ends ------------------------------------------------------


async def _h1(edge: Edge, who: str, body: bytes | None, *, endless: bool) -> tuple[int, bytes]:
    """POST v1/completions over HTTP/1.1 with a chunked body (*body*, then -- *endless* -- 64 KiB chunks until the
    server answers; the body never ends); the status and response body."""
    reader, writer = await asyncio.open_connection(edge.host, edge.port, ssl=_ssl(edge.certs.files(who), "http/1.1"),
                                                   server_hostname="localhost")
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        if body is not None:
            writer.write(b"%x\r\n%s\r\n" % (len(body), body))
            if not endless:
                writer.write(b"0\r\n\r\n")
        await writer.drain()

        async def feed() -> None:
            while endless:
                writer.write(b"%x\r\n%s\r\n" % (CHUNK, b" " * CHUNK))
                SENT[0] += CHUNK
                await writer.drain()

        feeder = asyncio.ensure_future(feed())
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, ConnectionError):
                await feeder
        status = int(head.split(b" ", 2)[1])
        headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
        return status, await reader.readexactly(int(headers[b"content-length"]))
    finally:
        writer.close()


async def _h2(edge: Edge, who: str, body: bytes | None, *, endless: bool) -> tuple[int, bytes]:
    """The same over HTTP/2 (the h2 library on a TLS socket): DATA frames without a content-length."""
    reader, writer = await asyncio.open_connection(edge.host, edge.port, ssl=_ssl(edge.certs.files(who), "h2"),
                                                   server_hostname="localhost")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "POST"), (":scheme", "https"), (":authority", "127.0.0.1"),
                          (":path", "/v1/completions"), ("content-type", "application/json")])
    first = body or b""
    status, out, ended = 0, bytearray(), False
    try:
        while True:
            while status == 0 and not ended:  # send what the window allows
                window = min(conn.local_flow_control_window(1), conn.max_outbound_frame_size)
                if first:
                    part, first = first[:window], first[window:]
                elif endless:
                    part = b" " * window
                else:
                    conn.end_stream(1)
                    ended = True
                    break
                if not part:
                    break
                conn.send_data(1, part)
                SENT[0] += len(part)
                writer.write(conn.data_to_send())
                await writer.drain()
            writer.write(conn.data_to_send())
            await writer.drain()
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived) and event.stream_id == 1:
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived) and event.stream_id == 1:
                    out += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset) and event.stream_id == 1:
                    return status, bytes(out)
    finally:
        writer.close()


async def _h3(edge: Edge, who: str, body: bytes | None, *, endless: bool) -> tuple[int, bytes]:
    """The same over HTTP/3: DATA frames without a content-length."""
    conn = await connect_h3(edge.host, edge.port, edge.certs.files(who), settings=TransportSettings())

    async def chunks() -> AsyncIterator[bytes]:
        if body is not None:
            yield body
        while endless:
            SENT[0] += CHUNK
            yield b" " * CHUNK

    try:
        response = await conn.request("POST", f"127.0.0.1:{edge.port}", "/v1/completions",
                                      [(b"content-type", b"application/json")], chunks())
        return response.status, b"".join([chunk async for chunk in response.aiter_bytes()])
    finally:
        await conn.aclose()


SENT = [0]  # body octets the helper above sent (set to 0 before a call)
TRANSPORTS = {"http/1.1": _h1, "h2": _h2, "h3": _h3}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_a_body_without_a_declared_length_is_refused_as_it_passes_the_limit(edge: Edge, transport: str) -> None:
    """Before the fix the front end read the whole body (up to the transport's 1 GiB) before looking at its size:
    the transport's own limit (1 GiB) answered, in the problem+json shape, after that much was sent."""
    SENT[0] = 0
    status, body = await asyncio.wait_for(TRANSPORTS[transport](edge, "alice", b'{"prompt": "', endless=True), 60)
    assert status == 413, body
    assert "limit" in _error(status, body)["message"]
    assert SENT[0] < 64 << 20  # flow control held the rest back: TCP/QUIC windows, not the whole body


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_the_caller_must_hold_the_front_ends_scope(edge: Edge, transport: str) -> None:
    """bob is a client of the policy, but of another scope: the front end must not run his prompt in its own scope
    (403 in OpenAI's shape); alice, who holds it, is served."""
    prompt = json.dumps({"prompt": "ab", "max_tokens": 4}).encode()
    status, body = await asyncio.wait_for(TRANSPORTS[transport](edge, "bob", prompt, endless=False), 30)
    assert status == 403, body
    error = _error(status, body)
    assert error["type"] == "permission_error" and "scope" in error["message"]
    status, body = await asyncio.wait_for(TRANSPORTS[transport](edge, "alice", prompt, endless=False), 30)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"]


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_deeply_nested_json_is_a_400(edge: Edge, transport: str) -> None:
    nested = b'{"prompt": "ab", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, body = await asyncio.wait_for(TRANSPORTS[transport](edge, "alice", nested, endless=False), 30)
    assert status == 400, body
    assert f"{MAX_JSON_DEPTH} arrays or objects deep" in _error(status, body)["message"]


async def test_a_declared_length_above_the_limit_is_refused_before_reading(edge: Edge) -> None:
    ctx = ssl.create_default_context(cafile=edge.certs.ca)
    ctx.load_cert_chain(edge.certs.files("alice").cert, edge.certs.files("alice").key)
    async with httpx.AsyncClient(verify=ctx) as http:
        r = await http.post(edge.base + "v1/completions", content=b" " * (LIMIT + 1),
                            headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"]
