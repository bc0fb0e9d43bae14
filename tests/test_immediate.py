"""Block GETs answered without the ASGI exchange (http3.immediate, BlockHotPath.respond_now, tcp_h1): the same
octets as the ASGI path, pipelining kept in order, requests it must not take left to the ASGI path, and a peer
that does not read bounded (over HTTP/1.1 pipelining and over many HTTP/2 streams) -- against real servers on
127.0.0.1 over raw TLS sockets."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from http3.immediate import IMMEDIATE_MAX, Immediate
from http3.server import RoleServer
from http3.tcp_server import _unsent
from kvsp_http.holder_app import holder_app
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.samples import random_sections
from quic.tls import ssl_client_context
from tests.pki import TestPki, make_pki
from tests.support.descriptors import small_descriptor

HOLDER_URI = "https://127.0.0.1/kvsp/"
SCOPE = "6d1c6481cd428737da312c089db3832a"
OTHER_SCOPE = "00112233445566778899aabbccddeeff"
POLICY = Policy.from_dict({"principal": [
    {"identity": "urn:kvsp:client:alice", "roles": ["instance"], "scopes": [SCOPE]},
    {"identity": "urn:kvsp:client:bob", "roles": ["client"], "scopes": [OTHER_SCOPE]},  # another tenant
]})
SMALL = small_descriptor(layers=8, kv_heads=8, head_dim=128, block_tokens=16)  # 512 KiB containers
LARGE = small_descriptor(layers=8, kv_heads=8, head_dim=128, block_tokens=64)  # 2 MiB: the ASGI path
KEY = "ab" * 32


def container(d: CompatDescriptor, seed: int) -> c.EncodedContainer:
    return c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, seed), first_layer=0,
                    token_count=d.block_tokens, descriptor=d)


@dataclass
class Spy:
    """Counts the server's calls of the app's respond_now and the answers it got."""

    inner: Any
    calls: int = 0
    answers: list[int] = field(default_factory=list)

    def __call__(self, method: str, path: str, query: bytes, scope: dict[str, Any]) -> Immediate | None:
        self.calls += 1
        answer = self.inner(method, path, query, scope)
        if answer is not None:
            self.answers.append(answer.status)
        return answer


@dataclass
class Servers:
    holder: Holder
    immediate: RoleServer  # answers what it can at once
    asgi: RoleServer  # the same app and holder, the hook switched off
    spy: Spy
    blocks: dict[str, c.EncodedContainer]


# Its own PKI, one per module: a holder only, at HOLDER_URI (no fixture of tests/conftest.py has exactly these roles).
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"), roles={"holder": HOLDER_URI})


@pytest.fixture
async def servers(pki: TestPki) -> AsyncIterator[Servers]:
    holder = Holder(HolderSettings(HOLDER_URI, (SMALL, LARGE), host_capacity=64 << 20))
    blocks = {"small": container(SMALL, 1), "large": container(LARGE, 2)}
    assert len(blocks["small"]) <= IMMEDIATE_MAX < len(blocks["large"])
    immediate = RoleServer(holder_app(holder, POLICY), pki.files("holder"))
    asgi = RoleServer(holder_app(holder, POLICY), pki.files("holder"))
    await immediate.start("127.0.0.1", 0)
    await asgi.start("127.0.0.1", 0)
    assert immediate.tcp is not None and asgi.tcp is not None
    assert immediate.tcp.ctx.respond_now is not None  # the holder's app offers the hook
    spy = immediate.tcp.ctx.respond_now = Spy(immediate.tcp.ctx.respond_now)
    asgi.tcp.ctx.respond_now = None
    try:
        for name, d in (("small", SMALL), ("large", LARGE)):
            conn = await Raw.open(pki, "alice", asgi)
            status, _, _ = await conn.exchange(
                f"PUT {block_path(d)} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/kvsp-block\r\n"
                f"if-none-match: *\r\ncontent-length: {len(blocks[name])}\r\n\r\n".encode() + blocks[name].tobytes())
            assert status == 201
            conn.close()
        yield Servers(holder, immediate, asgi, spy, blocks)
    finally:
        await immediate.close()
        await asgi.close()


def block_path(d: CompatDescriptor, key: str = KEY, scope: str = SCOPE) -> str:
    return f"/kvsp/blocks/{d.compat_id.hex()}/{scope}/{key}"


def get(path: str, *extra: str) -> bytes:
    return "".join([f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n", *(f"{h}\r\n" for h in extra), "\r\n"]).encode()


class Raw:
    """One HTTP/1.1 connection over mutual TLS, written and read octet by octet."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, pki: TestPki, who: str, srv: RoleServer) -> Raw:
        ctx = ssl_client_context(pki.files(who), alpn=("http/1.1",))
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port, ssl=ctx, server_hostname="127.0.0.1",
                                                       limit=1 << 22)
        return cls(reader, writer)

    async def response(self) -> tuple[int, bytes, bytes]:
        """(status, head, body) of the next response (Content-Length framed, as every one here is)."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        length = re.search(rb"\r\ncontent-length: (\d+)\r\n", head)
        assert length is not None, head
        body = await asyncio.wait_for(self.reader.readexactly(int(length.group(1))), 10)
        return int(head.split(b" ", 2)[1]), head, body

    async def exchange(self, request: bytes) -> tuple[int, bytes, bytes]:
        self.writer.write(request)
        return await self.response()

    def close(self) -> None:
        self.writer.close()


def comparable(head: bytes) -> bytes:
    """A head without what the clock writes (the date, the max-age the replica's remaining TTL gives) and without
    the server's own port (the two servers advertise their own in Alt-Svc)."""
    head = re.sub(rb"\r\ndate: [^\r]*", b"", head)
    head = re.sub(rb'h3=":\d+"', b'h3=":PORT"', head)
    return re.sub(rb"max-age=\d+", b"max-age=N", head)


async def test_same_octets_as_the_asgi_path(pki: TestPki, servers: Servers) -> None:
    cases = [
        ("alice", get(block_path(SMALL)), 200),  # answered at once
        ("bob", get(block_path(SMALL)), 403),  # another tenant's block: the holder's scope check, at once
        ("alice", get(block_path(SMALL, key="cd" * 32)), 404),  # not held: the ASGI path
        ("alice", get(block_path(SMALL) + "?layers=2-3"), 200),  # a layer range: the ASGI path
        ("alice", get(block_path(LARGE)), 200),  # above IMMEDIATE_MAX: the ASGI path
        ("alice", get(block_path(SMALL, scope="EF" * 16)), 400),  # not lowercase hex: refused at once
    ]
    for who, request, status in cases:
        answers = []
        for srv in (servers.immediate, servers.asgi):
            conn = await Raw.open(pki, who, srv)
            answers.append(await conn.exchange(request))
            conn.close()
        (s1, h1, b1), (s2, h2, b2) = answers
        assert s1 == s2 == status, (request, s1, s2)
        assert comparable(h1) == comparable(h2) and b1 == b2, request
    assert servers.spy.answers == [200, 403, 400]  # the three it could take; the others went the ASGI way
    small = servers.blocks["small"].tobytes()
    conn = await Raw.open(pki, "alice", servers.immediate)
    status, head, body = await conn.exchange(get(block_path(SMALL)))
    conn.close()
    assert status == 200 and body == small
    assert b"repr-digest: sha-256=:%s:" % base64.b64encode(hashlib.sha256(small).digest()) in head
    assert b"alt-svc: h3=" in head and b"\r\ndate: " in head  # what the server adds to every response


async def test_pipelined_requests_answered_in_order(pki: TestPki, servers: Servers) -> None:
    """Immediate answers and ASGI ones interleaved on one connection, all requests in one write."""
    small = servers.blocks["small"]
    conn = await Raw.open(pki, "alice", servers.immediate)
    conn.writer.write(get(block_path(SMALL)) + get(block_path(SMALL) + "?layers=0-1")
                      + get(block_path(SMALL)) + get(block_path(SMALL, key="cd" * 32)) + get(block_path(SMALL)))
    got = [await conn.response() for _ in range(5)]
    assert [s for s, _, _ in got] == [200, 200, 200, 404, 200]
    assert got[0][2] == got[2][2] == got[4][2] == small.tobytes()
    assert got[1][2] == c.cut(small.tobytes(), 0, 1, layer_digests=small.layer_digests).tobytes()
    status, _, body = await conn.exchange(get(block_path(SMALL)))  # the connection is still usable
    assert status == 200 and body == small.tobytes()
    conn.close()
    assert servers.spy.answers.count(200) == 4


async def test_requests_it_must_not_take(pki: TestPki, servers: Servers) -> None:
    """Connection: close, HTTP/1.0, HEAD and a GET with a body go the ASGI way, with its framing."""
    for request in (get(block_path(SMALL), "connection: close"),
                    f"GET {block_path(SMALL)} HTTP/1.0\r\nhost: 127.0.0.1\r\n\r\n".encode(),
                    get(block_path(SMALL), "content-length: 0")):
        conn = await Raw.open(pki, "alice", servers.immediate)
        status, head, body = await conn.exchange(request)
        assert status == 200 and body == servers.blocks["small"].tobytes()
        if b"connection: close" in request or b"HTTP/1.0" in request:
            assert b"connection: close" in head.lower()
            assert await asyncio.wait_for(conn.reader.read(), 5) == b""  # and the server closes
        conn.close()
    conn = await Raw.open(pki, "alice", servers.immediate)
    conn.writer.write(f"HEAD {block_path(SMALL)} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".encode())
    head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200 ") and b"content-length: %d" % len(servers.blocks["small"]) in head
    conn.close()
    assert servers.spy.calls == 0  # the server did not even ask the app


async def stalled(srv: RoleServer) -> Any:
    """The server's one connection, once the transport has paused its writing (the peer reads nothing) and the
    server has had every chance to go on: the event loop -- the server's too -- ran 200 more times meanwhile, so
    anything it still wanted to buffer is buffered (no wall-clock wait: on a slow machine as on a fast one)."""
    assert srv.tcp is not None
    async with asyncio.timeout(10):
        while not (srv.tcp._connections and next(iter(srv.tcp._connections))._write_paused):
            await asyncio.sleep(0.001)
    for _ in range(200):
        await asyncio.sleep(0)
    (server_conn,) = srv.tcp._connections  # the one connection (white box: its write buffer)
    assert server_conn._write_paused
    return server_conn


@pytest.mark.parametrize("path", ["immediate", "asgi"])
async def test_a_peer_that_does_not_read_is_bounded(pki: TestPki, servers: Servers, path: str) -> None:
    """64 pipelined GETs of a 512 KiB block (32 MiB of answers) from a peer that reads nothing. Once the transport
    is paused the server stops answering at once, and the ASGI path takes the next request only when the transport
    has drained (it took it as soon as the response was written, so such a peer made the server buffer every
    answer: 8.4 MB after one second and growing, before this test), so the connection holds about its high-water
    mark plus one answer. Then the peer reads, and every answer arrives."""
    small = servers.blocks["small"].tobytes()
    srv = servers.immediate if path == "immediate" else servers.asgi
    conn = await Raw.open(pki, "alice", srv)
    conn.writer.write(get(block_path(SMALL)) * 64)
    server_conn = await stalled(srv)
    buffered = _unsent(server_conn.transport)  # TLS's buffer and the socket transport's below it
    assert buffered <= 3 * IMMEDIATE_MAX, buffered
    assert len(servers.spy.answers) < 64
    digests = set()
    for _ in range(64):
        status, _, body = await conn.response()
        assert status == 200
        digests.add(hashlib.sha256(body).digest())
    assert digests == {hashlib.sha256(small).digest()}
    conn.close()
    if path == "immediate":
        assert 0 < len(servers.spy.answers) < 64  # some answered at once, the rest once the peer read


async def test_an_http2_peer_that_does_not_read_is_bounded(pki: TestPki, servers: Servers) -> None:
    """32 HTTP/2 streams, each a GET of a 512 KiB block, from a peer that opens every flow-control window as wide
    as it goes and reads nothing: each stream wrote its answer before waiting for the transport to drain, so the
    server buffered every one (16 MiB); now a stream writes only while the transport is below its high-water mark.
    Then the peer reads, and every answer arrives."""
    small = servers.blocks["small"].tobytes()
    ctx = ssl_client_context(pki.files("alice"), alpn=("h2",))
    reader, writer = await asyncio.open_connection("127.0.0.1", servers.asgi.port, ssl=ctx,
                                                   server_hostname="127.0.0.1")
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    conn.increment_flow_control_window(2**31 - 1 - 65535)
    streams = [1 + 2 * i for i in range(32)]
    for stream in streams:
        conn.send_headers(stream, [(":method", "GET"), (":scheme", "https"), (":authority", "127.0.0.1"),
                                   (":path", block_path(SMALL))], end_stream=True)
    writer.write(conn.data_to_send())
    server_conn = await stalled(servers.asgi)
    buffered = _unsent(server_conn.transport)
    assert buffered <= 3 * IMMEDIATE_MAX, buffered
    bodies: dict[int, bytearray] = {stream: bytearray() for stream in streams}
    ended: set[int] = set()
    while len(ended) < len(streams):
        data = await asyncio.wait_for(reader.read(1 << 20), 10)
        assert data, "the server closed the connection"
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                bodies[event.stream_id] += event.data
            elif isinstance(event, h2.events.StreamEnded):
                ended.add(event.stream_id)
        writer.write(conn.data_to_send())
    assert all(bytes(body) == small for body in bodies.values())
    writer.close()
