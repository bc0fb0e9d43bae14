"""The asyncio MOQT adapter (moqt/aio/) over real sockets on 127.0.0.1: one RoleServer port serving HTTP/3 and both
MOQT drafts with mutual TLS, identities on both sides, fetches with backpressure and cancellation, flow control that
keeps control messages flowing while data waits unread, and connect failures."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from http3.server import RoleServer
from moqt import Location
from moqt.aio import (
    FetchCancelled,
    MoqtApp,
    MoqtConnectError,
    MoqtConnection,
    MoqtRequestError,
    MoqtStalled,
    connect_moqt,
    moqt_handlers,
    not_supported_code,
)
from moqt.events import FetchRequested
from quic.tls import TransportSettings, scope_identity
from tests.pki import SERVER_URI, TestPki

ALICE = "urn:kvsp:client:alice"
NS = (b"test", b"objects")
ALPNS = ["moq-00", "moqt-18"]
DRAFTS = pytest.mark.parametrize("alpn", ALPNS)


def payload(i: int, size: int) -> bytes:
    return bytes([i % 251]) * (size - 2) + i.to_bytes(2, "big")


class Objects(MoqtApp):
    """FETCH of track ``b"<count>x<size>"``: *count* objects of *size* octets in group 0 (``payload``). Track
    ``b"stall"`` is accepted and never written."""

    def __init__(self) -> None:
        self.identities: list[str | None] = []
        self.cancelled = 0
        self.finished = 0
        self.conns: list[MoqtConnection] = []

    def session_ready(self, conn: MoqtConnection) -> None:
        self.identities.append(conn.peer_identity)
        self.conns.append(conn)

    async def fetch(self, conn: MoqtConnection, request: FetchRequested) -> None:
        if request.track_name == b"stall":
            conn.accept_fetch(request.request_id, Location(0, 1))
            await asyncio.Event().wait()
        try:
            count, size = map(int, request.track_name.split(b"x"))
        except ValueError:
            conn.reject(request.request_id, not_supported_code(conn.draft), b"no such track")
            return
        served = conn.accept_fetch(request.request_id, Location(0, count), end_of_track=True)
        try:
            for i in range(count):
                await served.write_object(i, [memoryview(payload(i, size))])
            served.finish()
            self.finished += 1
        except FetchCancelled:
            self.cancelled += 1
            raise


async def identity_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    body = (scope_identity(scope) or "-").encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@dataclasses.dataclass
class Served:
    server: RoleServer
    app: Objects
    certs: TestPki

    async def connect(self, alpn: str | list[str] = ALPNS, name: str = "alice", **kw: Any) -> MoqtConnection:
        return await connect_moqt("127.0.0.1", self.server.port, self.certs.files(name), alpn=alpn, timeout=3, **kw)


@pytest.fixture
async def served(certs: TestPki) -> AsyncIterator[Served]:
    app = Objects()
    server = RoleServer(identity_app, certs.files("server"), quic_handlers=moqt_handlers(app))
    await server.start("127.0.0.1", 0)
    try:
        yield Served(server, app, certs)
    finally:
        await server.close()


@DRAFTS
async def test_h3_and_moqt_share_the_port_with_identities(served: Served, alpn: str) -> None:
    async with KvspClient(served.certs.files("alice")) as client:
        response = await client.request("GET", served.server.base_uri("/who"))
        assert response.status == 200 and response.http_version == "HTTP/3" and response.content == ALICE.encode()
    conn = await served.connect(alpn)
    try:
        assert conn.alpn == alpn and conn.setup is not None and conn.setup.draft.alpn == alpn
        assert conn.peer_identity == SERVER_URI  # the server's certificate, verified
        assert served.app.identities == [ALICE]  # the MOQT side knows who connected
        async with conn.fetch(NS, b"32x5000", Location(0, 0), Location(0, 32)) as fetch:
            accepted = await fetch.wait_accepted(2)
            assert accepted.end_location == Location(0, 32) and accepted.end_of_track
            objects = [obj async for obj in fetch.objects()]
        assert [o.object_id for o in objects] == list(range(32)) and {o.group for o in objects} == {0}
        assert all(o.payload == payload(o.object_id, 5000) for o in objects)
        assert served.app.finished == 1
        assert conn.quic._kvsp_unread_total == 0  # every octet taken was credited back
    finally:
        await conn.aclose()


async def test_offering_both_drafts_lets_the_server_choose(served: Served) -> None:
    conn = await served.connect()
    try:
        assert conn.alpn in ALPNS
        async with conn.fetch(NS, b"3x10", Location(0, 0), Location(0, 0)) as fetch:
            assert [obj.payload async for obj in fetch.objects()] == [payload(i, 10) for i in range(3)]
    finally:
        await conn.aclose()


@DRAFTS
async def test_refusals_and_cancellation(served: Served, alpn: str) -> None:
    conn = await served.connect(alpn)
    try:
        async with conn.fetch(NS, b"nonsense", Location(0, 0), Location(0, 1)) as refused:
            with pytest.raises(MoqtRequestError) as info:
                await refused.wait_accepted(2)
            assert info.value.error_code == not_supported_code(conn.draft)
        # Stop after two of 64 objects of 512 KiB (more than the windows): the publisher is told and stops.
        async with conn.fetch(NS, b"64x524288", Location(0, 0), Location(0, 64)) as fetch:
            got = []
            async for obj in fetch.objects():
                got.append(obj.object_id)
                if len(got) == 2:
                    break
        for _ in range(100):
            if served.app.cancelled:
                break
            await asyncio.sleep(0.01)
        assert served.app.cancelled == 1 and served.app.finished == 0
        # The session goes on, and a fetch nobody writes to is reported stalled.
        async with conn.fetch(NS, b"stall", Location(0, 0), Location(0, 1), stall_timeout=0.2) as stalled:
            await stalled.wait_accepted(2)
            with pytest.raises(MoqtStalled):
                await stalled.next_piece()
        async with conn.fetch(NS, b"2x100", Location(0, 0), Location(0, 2)) as fetch:
            assert len([o async for o in fetch.objects()]) == 2
    finally:
        await conn.aclose()
    await asyncio.sleep(0.05)
    assert served.server.quic is not None
    await asyncio.wait_for(served.app.conns[-1].drain(), 2)  # the stalled fetch's task ended with the session


@DRAFTS
async def test_unread_data_never_blocks_control_messages(served: Served, alpn: str) -> None:
    """One data stream admitted at a time, 256 KiB windows: a 4 MiB fetch nobody reads fills its window, and
    another fetch's FETCH_OK still arrives; reading the first lets the second's data in."""
    settings = TransportSettings(stream_window=256 << 10, connection_window=256 << 10)
    conn = await served.connect(alpn, settings=settings, data_streams=1)
    try:
        quic = conn.quic
        assert quic._kvsp_uni_budget == 2  # data streams + 1
        window = quic._kvsp_connection_window
        assert window == 2 * (256 << 10) + (1 << 20)  # (data streams + 1) x stream window + the control reserve
        big = conn.fetch(NS, b"64x65536", Location(0, 0), Location(0, 64))
        await big.wait_accepted(2)
        await asyncio.sleep(0.3)  # the publisher has written into the window; nothing is read
        assert 0 < quic._kvsp_unread_total <= 256 << 10
        small = conn.fetch(NS, b"1x1000", Location(0, 0), Location(0, 1))
        assert (await small.wait_accepted(2)).end_location == Location(0, 1)  # control got through
        received = 0
        async for obj in big.objects():
            assert obj.payload == payload(obj.object_id, 65536)
            received += 1
        assert received == 64
        assert [o.payload async for o in small.objects()] == [payload(0, 1000)]
        await big.aclose()
        await small.aclose()
        assert quic._kvsp_unread_total == 0
    finally:
        await conn.aclose()


async def test_connect_failures(served: Served, certs: TestPki, tmp_path: Path) -> None:
    plain = RoleServer(identity_app, certs.files("server"))  # HTTP/3 only: no MOQT ALPN on its UDP port
    await plain.start("127.0.0.1", 0)
    try:
        with pytest.raises(MoqtConnectError, match="QUIC error"):
            await connect_moqt("127.0.0.1", plain.port, certs.files("alice"), timeout=3)
    finally:
        await plain.close()
    with pytest.raises(MoqtConnectError):  # a client of another CA: refused in the handshake
        await connect_moqt("127.0.0.1", served.server.port, certs.foreign, timeout=3)
    with pytest.raises(ValueError):
        await connect_moqt("127.0.0.1", served.server.port, certs.files("alice"), alpn="h3")
    assert served.app.identities == []
