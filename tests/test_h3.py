"""HTTP/3 server and client over real UDP sockets on 127.0.0.1, with mutual TLS."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import ssl
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient, TransportError
from http3.h1_client import IntoBuffer
from http3.h3_client import H3ConnectError, connect_h3
from http3.h3_server import h3_handler
from quic.listener import QuicListener
from quic.tls import TlsFiles, scope_identity
from quic.udp import bind_udp
from tests.pki import TestPki, make_pki
from tests.support.transport import SMALL_WINDOWS, connect_without_certificate


class App:
    """Echoes identity and body digest; /slow-upload reads slowly and records how much the server held."""

    def __init__(self) -> None:
        self.calls = 0
        self.max_unread = 0
        self.max_buffered = 0
        self.listener: QuicListener | None = None
        self.gate = asyncio.Event()

    def _quic_stats(self) -> None:
        assert self.listener is not None
        for conn in self.listener._connections:
            self.max_unread = max(self.max_unread, conn.quic._kvsp_unread_total)
            for stream_id in list(conn.quic._streams):
                self.max_buffered = max(self.max_buffered, conn.buffered(stream_id))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        path = scope["path"]
        if path == "/boom":
            raise RuntimeError("boom")
        if path == "/wait":
            await self.gate.wait()
        if path == "/into":  # the body straight into the app's buffer (kvsp.receive_into), then its SHA-256
            size = int(dict(scope["headers"])[b"content-length"])
            sink = IntoBuffer(bytearray(size))
            got = await scope["extensions"]["kvsp.receive_into"](sink)
            body = f"{got} {hashlib.sha256(sink.view[:sink.filled]).hexdigest()}".encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        h, n = hashlib.sha256(), 0
        while True:
            if path == "/slow-upload":  # a slow reader: what arrived meanwhile waits, unread, in the server
                await asyncio.sleep(0.002)
                self._quic_stats()
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            h.update(message["body"])
            n += len(message["body"])
            if not message["more_body"]:
                break
        if path.startswith("/download/"):
            size = int(path.rsplit("/", 1)[1])
            data = bytes(range(256)) * (size // 256)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(data)).encode())]})
            for offset in range(0, len(data), 4 << 20):
                await send({"type": "http.response.body", "body": data[offset:offset + (4 << 20)],
                            "more_body": offset + (4 << 20) < len(data)})
                self._quic_stats()
            return
        body = f"{scope_identity(scope)} {scope['http_version']} {scope['method']} {n} {h.hexdigest()}".encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def server(fresh_certs: TestPki):
    app = App()
    listener = QuicListener(fresh_certs.files("server"), {"h3": h3_handler(app)}, settings=SMALL_WINDOWS)
    app.listener = listener
    await listener.start("127.0.0.1", 0)
    yield listener, app
    await listener.close()


def url(listener: QuicListener, path: str = "/") -> str:
    return f"https://127.0.0.1:{listener.port}{path}"


async def test_valid_certificate_gets_200_and_identity(server, fresh_certs: TestPki) -> None:
    listener, _ = server
    async with KvspClient(fresh_certs.files("alice"), settings=SMALL_WINDOWS) as client:
        response = await client.request("POST", url(listener, "/x?y=1"), content=b"hello")
    assert response.status == 200 and response.http_version == "HTTP/3"
    assert response.content == (b"urn:kvsp:client:alice 3 POST 5 " + hashlib.sha256(b"hello").hexdigest().encode())


@pytest.mark.parametrize("who", ["expired", "notyet", "foreign"])
async def test_bad_certificates_are_refused_in_the_handshake(server, fresh_certs: TestPki, who: str) -> None:
    listener, app = server
    files = fresh_certs.foreign if who == "foreign" else fresh_certs.files(who)
    files = TlsFiles(fresh_certs.ca, files.cert, files.key)  # the client itself trusts the server
    with pytest.raises(H3ConnectError) as info:  # the server's verdict arrives before connect_h3 returns
        await connect_h3("127.0.0.1", listener.port, files, settings=SMALL_WINDOWS, timeout=5)
    reason = {"expired": "no longer valid", "notyet": "not valid yet", "foreign": "unable to get local issuer"}[who]
    assert reason in str(info.value)
    assert app.calls == 0


async def test_no_client_certificate_is_refused(server, fresh_certs: TestPki) -> None:
    listener, app = server
    assert "client certificate is required" in await connect_without_certificate(fresh_certs.ca, listener.port)
    assert app.calls == 0


async def test_client_refuses_a_server_of_another_ca(server, fresh_certs: TestPki) -> None:
    listener, _ = server
    foreign = fresh_certs.foreign
    with pytest.raises(H3ConnectError, match="unable to get local issuer"):
        await connect_h3("127.0.0.1", listener.port, foreign, settings=SMALL_WINDOWS, timeout=5)


async def test_certificate_without_uri_reaches_the_app_without_identity(server, fresh_certs: TestPki) -> None:
    # The handshake only proves the CA issued it; authorization (kvsp_http.authz) refuses it for want of an identity.
    listener, _ = server
    async with KvspClient(fresh_certs.files("nouri"), settings=SMALL_WINDOWS) as client:
        response = await client.request("GET", url(listener))
    assert response.content is not None and response.content.startswith(b"None 3 GET")


async def test_64_mib_up_and_down_with_bounded_memory(server, fresh_certs: TestPki) -> None:
    listener, app = server
    body = os.urandom(1 << 20) * 64
    async with KvspClient(fresh_certs.files("alice"), settings=SMALL_WINDOWS, timeout=120) as client:
        response = await client.request("PUT", url(listener, "/slow-upload"), content=body)
        assert response.content is not None and response.content.endswith(hashlib.sha256(body).hexdigest().encode())
        # The app read slowly: the server never held more than one stream window of unread body.
        assert 0 < app.max_unread <= SMALL_WINDOWS.stream_window
        digest, n = hashlib.sha256(), 0
        async with client.stream("GET", url(listener, f"/download/{64 << 20}")) as response:
            async for chunk in response.aiter_bytes():
                digest.update(chunk)
                n += len(chunk)
                await asyncio.sleep(0) if n % (8 << 20) else await asyncio.sleep(0.05)  # a reader that pauses
    assert n == 64 << 20
    assert digest.hexdigest() == hashlib.sha256(bytes(range(256)) * ((64 << 20) // 256)).hexdigest()
    # The app's 4 MiB writes were sliced and each waited for QUIC's send buffer to drain.
    assert 0 < app.max_buffered <= SMALL_WINDOWS.send_buffer + SMALL_WINDOWS.send_buffer // 2


async def test_receive_into_takes_a_body_larger_than_the_windows(server, fresh_certs: TestPki) -> None:
    # kvsp.receive_into over HTTP/3: every octet the sink takes gives its flow-control credit back at once, so a
    # body many stream and connection windows long goes through (before: stalled after the first window)
    listener, _ = server
    body = os.urandom(1 << 20) * 24
    async with KvspClient(fresh_certs.files("alice"), settings=SMALL_WINDOWS, timeout=30) as client:
        response = await client.request("PUT", url(listener, "/into"), content=body,
                                        headers={"content-length": str(len(body))})
    assert response.status == 200
    assert response.content == f"{len(body)} {hashlib.sha256(body).hexdigest()}".encode()


async def test_many_concurrent_requests_share_one_connection(server, fresh_certs: TestPki) -> None:
    listener, _ = server
    async with KvspClient(fresh_certs.files("alice"), settings=SMALL_WINDOWS) as client:
        responses = await asyncio.gather(*(client.request("POST", url(listener), content=str(i).encode())
                                           for i in range(60)))
        assert {r.status for r in responses} == {200}
        assert listener.connections == 1
        # more requests than the stream limit over time: closed streams give credit back
        for _ in range(3):
            await asyncio.gather(*(client.request("GET", url(listener)) for _ in range(60)))
        assert listener.connections == 1


async def test_limits_and_errors(server, fresh_certs: TestPki) -> None:
    listener, _ = server
    async with KvspClient(fresh_certs.files("alice"), settings=SMALL_WINDOWS) as client:
        too_big = await client.request("PUT", url(listener), content=bytes(SMALL_WINDOWS.max_body_bytes + 1))
        assert too_big.status == 413 and too_big.headers["content-type"] == "application/problem+json"
        assert too_big.json()["status"] == 413
        many = {f"x-h{i}": "a" * 1000 for i in range(80)}  # 80 KB of fields > the 64 KiB limit
        huge_header = await client.request("GET", url(listener), headers=many)
        assert huge_header.status == 431
        boom = await client.request("GET", url(listener, "/boom"))
        assert boom.status == 500 and boom.json()["title"] == "Internal Server Error"
        assert "boom" not in (boom.content or b"").decode()  # no internals leak
        ok = await client.request("GET", url(listener))  # the connection survived all of that
        assert ok.status == 200


async def test_graceful_shutdown_finishes_in_flight_requests(fresh_certs: TestPki) -> None:
    app = App()
    listener = QuicListener(fresh_certs.files("server"), {"h3": h3_handler(app)}, settings=SMALL_WINDOWS)
    app.listener = listener
    await listener.start("127.0.0.1", 0)
    async with KvspClient(fresh_certs.files("alice"), settings=SMALL_WINDOWS, retries=0, timeout=10) as client:
        in_flight = asyncio.ensure_future(client.request("GET", url(listener, "/wait")))
        while app.calls == 0:
            await asyncio.sleep(0.01)
        closing = asyncio.ensure_future(listener.close())
        await asyncio.sleep(0.1)
        assert not closing.done()  # waiting for the request
        app.gate.set()
        response = await in_flight
        assert response.status == 200
        await closing
    async with KvspClient(fresh_certs.files("alice"), settings=SMALL_WINDOWS, retries=0, connect_timeout=1) as client:
        with pytest.raises(TransportError):
            await client.request("GET", url(listener))  # nothing listens any more (and no TCP fallback)


async def test_client_falls_back_and_remembers(fresh_certs: TestPki) -> None:
    # Nothing answers on UDP: the client falls back to TCP (here refused too) and remembers the origin.
    sock = bind_udp("127.0.0.1", 0, 1 << 16)  # a UDP port that swallows datagrams: QUIC times out
    port = sock.getsockname()[1]
    try:
        async with KvspClient(fresh_certs.files("alice"), connect_timeout=0.3, retries=0) as client:
            target = f"https://127.0.0.1:{port}/"
            assert client.transport_for(target) == "h3"
            with pytest.raises(TransportError):
                await client.request("GET", target)
            assert client.transport_for(target) == "tcp"
    finally:
        sock.close()


def test_server_requires_a_handler(fresh_certs: TestPki) -> None:
    with pytest.raises(ValueError):
        QuicListener(fresh_certs.files("server"), {})


def test_server_context_asks_for_client_certificates(fresh_certs: TestPki) -> None:
    # The TLS posture of the TCP side is checked in test_tcp_server; here the QUIC configuration.
    from quic.tls import quic_configuration

    config = quic_configuration(fresh_certs.files("server"), is_client=False, alpn=["h3"])
    assert config.verify_mode == ssl.CERT_REQUIRED and config.cadata == fresh_certs.ca.read_bytes()


async def test_head_responses_keep_their_content_length(fresh_certs: TestPki) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"1234")]})
        await send({"type": "http.response.body", "body": b""})

    listener = QuicListener(fresh_certs.files("server"), {"h3": h3_handler(app)}, settings=SMALL_WINDOWS)
    await listener.start("127.0.0.1", 0)
    try:
        async with KvspClient(fresh_certs.files("alice"), settings=SMALL_WINDOWS) as client:
            response = await client.request("HEAD", url(listener))
            assert response.status == 200 and response.headers["content-length"] == "1234"
            assert response.content == b""
            assert (await client.request("HEAD", url(listener))).status == 200  # the connection survived
    finally:
        await listener.close()


async def test_role_certificates_with_a_port_in_their_uri(tmp_path: Path) -> None:
    # Every real role's certificate names its base URI with a port; aioquic's stock name check chokes on that.
    # Clients pin that port (issue 13): the certificate names the port the listener then binds.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    certs = make_pki(tmp_path, roles={"server": f"https://127.0.0.1:{port}/kvsp/"})
    listener = QuicListener(certs.files("server"), {"h3": h3_handler(App())}, settings=SMALL_WINDOWS)
    await listener.start("127.0.0.1", port)
    try:
        async with KvspClient(certs.files("alice"), settings=SMALL_WINDOWS) as client:
            assert (await client.request("GET", url(listener))).status == 200
    finally:
        await listener.close()


def test_server_name_check(fresh_certs: TestPki) -> None:
    from aioquic import tls
    from cryptography import x509

    from quic.connection import check_server_name

    cert = x509.load_pem_x509_certificate(fresh_certs.files("server").cert.read_bytes())
    check_server_name(cert, "127.0.0.1")
    check_server_name(cert, "LOCALHOST.")
    for wrong in ("127.0.0.2", "example.com", "::1"):
        with pytest.raises(tls.AlertBadCertificate):
            check_server_name(cert, wrong)
    with pytest.raises(tls.AlertBadCertificate):
        check_server_name(x509.load_pem_x509_certificate(fresh_certs.ca.read_bytes()), "127.0.0.1")


@pytest.mark.parametrize("datagram", [1452, 8952])
async def test_real_packet_sizes_round_trip(fresh_certs: TestPki, datagram: int) -> None:
    """HTTP/3 with the datagrams of 1500 and 9000 octet MTUs: octets exact both ways, no datagram above the size,
    and the server's datagrams leave in segmentation-offload runs (fewer system calls than datagrams)."""
    settings = replace(SMALL_WINDOWS, max_datagram_size=datagram)
    app = App()
    listener = QuicListener(fresh_certs.files("server"), {"h3": h3_handler(app)}, settings=settings)
    app.listener = listener
    await listener.start("127.0.0.1", 0)
    sizes: list[int] = []
    try:
        async with KvspClient(fresh_certs.files("alice"), settings=settings, timeout=60) as client:
            body = os.urandom(3 << 20)
            response = await client.request("PUT", url(listener, "/up"), content=body)
            assert response.content is not None
            assert response.content.endswith(hashlib.sha256(body).hexdigest().encode())
            conn = next(c for conns in client._pool._conns.values() for c in conns)
            receive = conn._quic.receive_datagram

            def counting(data: bytes, addr: Any, now: float) -> None:
                sizes.append(len(data))
                receive(data, addr, now=now)

            conn._quic.receive_datagram = counting  # type: ignore[method-assign]  # the real one, counted
            digest, n = hashlib.sha256(), 0
            async with client.stream("GET", url(listener, f"/download/{8 << 20}")) as r:
                async for chunk in r.aiter_bytes():
                    digest.update(chunk)
                    n += len(chunk)
        assert n == 8 << 20
        assert digest.hexdigest() == hashlib.sha256(bytes(range(256)) * ((8 << 20) // 256)).hexdigest()
        assert max(sizes) <= datagram and sizes.count(datagram) > (8 << 20) // datagram // 2
        transport = listener._transport
        assert transport is not None
        if transport.gso:
            assert transport.system_calls < transport.datagrams_sent / 4
    finally:
        await listener.close()
