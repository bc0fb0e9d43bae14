"""http3.tcp_server: HTTP/1.1 and HTTP/2 over mutual TLS, with real sockets on 127.0.0.1.

Clients: httpx (HTTP/1.1 and HTTP/2), curl (an independent implementation, nghttp2 for HTTP/2), and raw h11/h2
byte streams over asyncio TLS connections where a test needs to misbehave.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import socket
import ssl
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import pytest
from hyperframe.frame import DataFrame, Frame, HeadersFrame

from http3.asgi_bridge import LifespanFailure, split_target
from http3.tcp_h2 import H2Core
from http3.tcp_server import TcpServer
from quic.tls import TlsFiles, TransportSettings, scope_identity, ssl_client_context
from tests.peers import needs_peer
from tests.pki import TestPki

MiB = 1 << 20
BLOCK = os.urandom(MiB)
PROTOCOLS = ["h1", "h2"]
PROBLEM_413 = {"type": "about:blank", "title": "Content Too Large", "status": 413}


class App:
    """A test app: routes by path, counts calls, records scopes and what receive() returned."""

    def __init__(self) -> None:
        self.calls = 0
        self.scopes: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []
        self.lifespan: list[str] = []
        self.started = asyncio.Event()  # a slow request is in the app
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                self.lifespan.append(message["type"])
                if message["type"] == "lifespan.startup":
                    scope["state"]["answer"] = 42
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        self.calls += 1
        self.scopes.append(scope)
        path = scope["path"]
        if path == "/hash":  # consume slowly, answer the SHA-256 of the body
            digest, n = hashlib.sha256(), 0
            while True:
                message = await receive()
                self.received.append({"type": message["type"], "more_body": message.get("more_body")})
                if message["type"] == "http.disconnect":
                    return
                digest.update(message["body"])
                n += len(message["body"])
                if n % (4 * MiB) < len(message["body"]):
                    await asyncio.sleep(0.002)
                if not message["more_body"]:
                    break
            await self.reply(send, 200, f"{n} {digest.hexdigest()}".encode())
        elif path == "/blob":  # BLOCK repeated n times, in 1 MiB messages
            n = int(scope["query_string"].decode().partition("=")[2])
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(n * MiB).encode())]})
            for i in range(n):
                await send({"type": "http.response.body", "body": BLOCK, "more_body": i < n - 1})
        elif path == "/into":  # the body straight into the app's buffer (kvsp.receive_into)
            query = scope["query_string"].decode()
            sink = _Into(int(dict(scope["headers"])[b"content-length"]),
                         int(query.partition("=")[2]) if query.startswith("fail=") else None)
            self.started.set()
            try:
                n = await scope["extensions"]["kvsp.receive_into"](sink)
            except ValueError as exc:
                await self.reply(send, 400, str(exc).encode())
                return
            if n is None:
                self.received.append({"type": "into: the client left", "more_body": None})
                self.release.set()
                return
            after = await receive()  # the body is over for receive() too
            self.received.append({"type": after["type"], "more_body": after.get("more_body")})
            digest = hashlib.sha256(sink.view[:sink.filled]).hexdigest()
            await self.reply(send, 200, f"{n} {sink.filled} {digest}".encode())
        elif path == "/raise":
            raise RuntimeError("boom (expected by the test)")
        elif path == "/raise-late":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("late boom (expected by the test)")
        elif path == "/slow":
            self.started.set()
            await self.release.wait()
            await self.reply(send, 200, b"slow done")
        elif path == "/alt-svc":
            await self.reply(send, 200, b"", [(b"alt-svc", b"clear")])
        elif path == "/wait-disconnect":
            self.started.set()
            while True:
                message = await receive()
                self.received.append({"type": message["type"], "more_body": message.get("more_body")})
                if message["type"] == "http.disconnect":
                    self.release.set()
                    return
        else:
            await self.reply(send, 200, f"{scope['http_version']} {scope_identity(scope)}".encode())

    @staticmethod
    async def reply(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain"), *(headers or [])]})
        await send({"type": "http.response.body", "body": body})


class _Into:
    """A BufferSink: one buffer of the declared size; raises ValueError once *fail_at* octets are in."""

    def __init__(self, size: int, fail_at: int | None) -> None:
        self.view = memoryview(bytearray(size))
        self.filled = 0
        self.fail_at = fail_at

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.fail_at is not None and self.filled >= self.fail_at:
            raise ValueError(f"refused at {self.filled}")


async def _leave_mid_upload(c: httpx.AsyncClient, app: App, put: Any) -> None:
    """Start *put* (a body that never ends), let the app begin reading it, then go away; the app says it saw that."""
    task = asyncio.create_task(put)
    await asyncio.wait_for(app.started.wait(), 5)
    await asyncio.sleep(0.1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await c.aclose()
    await asyncio.wait_for(app.release.wait(), 5)


@contextlib.asynccontextmanager
async def serving(pki: TestPki, app: Any = None, **kwargs: Any) -> AsyncIterator[TcpServer]:
    server = TcpServer(app or App(), pki.files("server"), **kwargs)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close()


def client(pki: TestPki, proto: str, files: TlsFiles | None = None, **kwargs: Any) -> httpx.AsyncClient:
    ctx = ssl_client_context(files or pki.files("alice"))
    return httpx.AsyncClient(verify=ctx, http1=proto == "h1", http2=proto == "h2", timeout=20, **kwargs)


def url(server: TcpServer, path: str = "/") -> str:
    return f"https://127.0.0.1:{server.port}{path}"


# -- identity, scope, alt-svc ----------------------------------------------------------------------------------


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_valid_certificate_reaches_the_app_with_its_identity(certs: TestPki, proto: str) -> None:
    app = App()
    async with serving(certs, app) as server, client(certs, proto) as c:
        r = await c.get(url(server, "/a%20b/c?x=1&y=%20"))
    assert r.status_code == 200
    version = "1.1" if proto == "h1" else "2"
    assert r.text == f"{version} urn:kvsp:client:alice"
    assert r.headers["alt-svc"] == f'h3=":{server.port}"; ma=86400'
    assert "date" in r.headers
    scope = app.scopes[0]
    assert scope["type"] == "http" and scope["asgi"]["version"] == "3.0"
    assert scope["http_version"] == version and scope["method"] == "GET" and scope["scheme"] == "https"
    assert scope["path"] == "/a b/c" and scope["raw_path"] == b"/a%20b/c" and scope["query_string"] == b"x=1&y=%20"
    assert scope["root_path"] == "" and scope["state"] == {"answer": 42}
    assert scope["client"][0] == "127.0.0.1" and scope["server"] == ("127.0.0.1", server.port)
    assert (b"host", f"127.0.0.1:{server.port}".encode()) in scope["headers"]
    assert all(name == name.lower() for name, _ in scope["headers"])
    tls = scope["extensions"]["tls"]
    assert tls["tls_version"] == 0x0304 and tls["cipher_suite"] in (0x1301, 0x1302, 0x1303)
    assert len(tls["client_cert_chain"]) == 1 and tls["client_cert_name"] == "CN=alice"
    assert tls["server_cert"] == certs.files("server").cert_pem.decode()
    assert app.lifespan == ["lifespan.startup", "lifespan.shutdown"]


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_alt_svc_port_and_the_apps_own_alt_svc(certs: TestPki, proto: str) -> None:
    async with serving(certs, alt_svc_port=4433) as server, client(certs, proto) as c:
        plain = await c.get(url(server, "/"))
        own = await c.get(url(server, "/alt-svc"))
        head = await c.head(url(server, "/"))
    assert plain.headers["alt-svc"] == 'h3=":4433"; ma=86400'
    assert own.headers.get_list("alt-svc") == ["clear"]
    assert head.status_code == 200 and head.content == b"" and head.headers["alt-svc"] == 'h3=":4433"; ma=86400'


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_certificate_without_uri_connects_without_identity(certs: TestPki, proto: str) -> None:
    async with serving(certs) as server, client(certs, proto, certs.files("nouri")) as c:
        r = await c.get(url(server, "/"))
    assert r.status_code == 200 and r.text.endswith(" None")


def _no_cert_context(pki: TestPki) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=str(pki.ca))
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx


@pytest.mark.parametrize("proto", PROTOCOLS)
@pytest.mark.parametrize("who", ["none", "foreign", "expired", "notyet"])
async def test_bad_client_certificates_are_refused_in_the_handshake(certs: TestPki, proto: str, who: str) -> None:
    if who == "none":
        ctx = _no_cert_context(certs)
    elif who == "foreign":  # mallory's certificate comes from another CA; she does verify our server
        ctx = ssl_client_context(TlsFiles(certs.ca, certs.foreign.cert, certs.foreign.key))
    else:
        ctx = ssl_client_context(certs.files(who))
    app = App()
    async with (serving(certs, app) as server,
                httpx.AsyncClient(verify=ctx, http1=proto == "h1", http2=proto == "h2", timeout=5) as c):
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            await c.get(url(server, "/"))
    assert app.calls == 0


# -- bodies: streaming, backpressure, limits --------------------------------------------------------------------


async def _blocks(n: int) -> AsyncIterator[bytes]:
    for _ in range(n):
        yield BLOCK
        await asyncio.sleep(0)


def _expected(n: int) -> str:
    digest = hashlib.sha256()
    for _ in range(n):
        digest.update(BLOCK)
    return digest.hexdigest()


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_64_mib_up_and_down_with_bounded_server_memory(certs: TestPki, proto: str) -> None:
    # Small HTTP/2 windows here so that the flow-control bound is visible: the receive window is what a
    # stream may hold unread.
    settings = TransportSettings(stream_window=2 * MiB, connection_window=4 * MiB)
    n = 64
    app = App()
    async with serving(certs, app, settings=settings) as server, client(certs, proto) as c:
        await c.get(url(server, "/"))  # connect first: handshakes and imports are no part of the peak
        tracemalloc.start()
        try:
            r = await c.put(url(server, "/hash"), content=_blocks(n), headers={"content-length": str(n * MiB)})
            _, up_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            down = hashlib.sha256()
            got = 0
            async with c.stream("GET", url(server, f"/blob?n={n}")) as response:
                async for part in response.aiter_raw():
                    down.update(part)
                    got += len(part)
                    if got % (8 * MiB) < len(part):
                        await asyncio.sleep(0.005)  # a slow reader: the server must wait, not buffer
            _, down_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert r.status_code == 200 and r.text == f"{n * MiB} {_expected(n)}"
    assert got == n * MiB and down.hexdigest() == _expected(n)
    # The server never held more than a few MiB of request body; client and server together stayed far
    # below the 64 MiB that went through in each direction.
    assert server.ctx.peak_body_buffered <= 3 * MiB, server.ctx.peak_body_buffered
    assert up_peak < 16 * MiB and down_peak < 16 * MiB, (up_peak, down_peak)
    assert len(app.received) > 16  # the body arrived in many pieces


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_receive_into_takes_the_body_into_the_apps_buffer(certs: TestPki, proto: str) -> None:
    # kvsp.receive_into: the body lands in the app's own buffer (over HTTP/1.1 TLS decrypts into it), receive()
    # then says the body is over, and the connection goes on with the next request
    n = 9
    app = App()
    async with serving(certs, app) as server, client(certs, proto) as c:
        r = await c.put(url(server, "/into"), content=_blocks(n), headers={"content-length": str(n * MiB)})
        again = await c.put(url(server, "/into"), content=BLOCK[:1000])
        after = await c.get(url(server, "/"))
    assert r.status_code == 200 and r.text == f"{n * MiB} {n * MiB} {_expected(n)}"
    assert again.status_code == 200 and again.text == f"1000 1000 {hashlib.sha256(BLOCK[:1000]).hexdigest()}"
    assert after.status_code == 200
    assert [m for m in app.received] == [{"type": "http.request", "more_body": False}] * 2
    assert server.ctx.peak_body_buffered <= 2 * MiB  # nothing queued beyond what came before the app asked


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_receive_into_a_sink_that_refuses(certs: TestPki, proto: str) -> None:
    app = App()
    async with serving(certs, app) as server, client(certs, proto) as c:
        refused = await c.put(url(server, "/into?fail=3145728"), content=_blocks(6),
                              headers={"content-length": str(6 * MiB)})
        ok = await c.put(url(server, "/into"), content=BLOCK)
    assert refused.status_code == 400 and refused.text.startswith("refused at ")
    assert int(refused.text.split()[-1]) >= 3 * MiB
    assert ok.status_code == 200 and ok.text.startswith(f"{MiB} {MiB} ")


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_receive_into_says_when_the_client_left(certs: TestPki, proto: str) -> None:
    app = App()
    async with serving(certs, app) as server, client(certs, proto) as c:
        async def upload() -> AsyncIterator[bytes]:
            yield BLOCK
            await asyncio.Event().wait()  # never finishes

        await _leave_mid_upload(c, app, c.put(url(server, "/into"), content=upload(),
                                              headers={"content-length": str(4 * MiB)}))
    assert app.received[-1]["type"] == "into: the client left"


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_too_large_body_gets_413(certs: TestPki, proto: str) -> None:
    app = App()
    settings = TransportSettings(max_body_bytes=MiB)
    async with serving(certs, app, settings=settings) as server, client(certs, proto) as c:
        declared = await c.put(url(server, "/hash"), content=BLOCK + b"x")  # content-length: refused upfront
        assert app.calls == 0
        streamed = await c.put(url(server, "/hash"), content=_blocks(3))  # no length: refused on the way
        ok = await c.put(url(server, "/hash"), content=BLOCK)
    for r in (declared, streamed):
        assert r.status_code == 413
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json() == PROBLEM_413
        assert r.headers["alt-svc"] == f'h3=":{server.port}"; ma=86400'
    assert {"type": "http.disconnect", "more_body": None} in app.received  # the streaming app was told
    assert ok.status_code == 200  # the limit is inclusive


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_app_exceptions(certs: TestPki, proto: str, caplog: pytest.LogCaptureFixture) -> None:
    async with serving(certs) as server, client(certs, proto) as c:
        r = await c.get(url(server, "/raise"))
        assert r.status_code == 500
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json() == {"type": "about:blank", "title": "Internal Server Error", "status": 500}
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):  # started: the stream is reset
            await c.get(url(server, "/raise-late"))
    assert sum("ASGI app failed" in rec.message for rec in caplog.records) == 2


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_client_disconnect_reaches_receive(certs: TestPki, proto: str) -> None:
    app = App()
    async with serving(certs, app) as server, client(certs, proto) as c:
        async def upload() -> AsyncIterator[bytes]:
            yield b"x" * 1000
            await asyncio.Event().wait()  # never finishes

        await _leave_mid_upload(c, app, c.put(url(server, "/wait-disconnect"), content=upload()))
    assert app.received[-1]["type"] == "http.disconnect"


# -- lifecycle ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_graceful_close_waits_for_the_request_in_flight(certs: TestPki, proto: str) -> None:
    app = App()
    server = TcpServer(app, certs.files("server"))
    await server.start("127.0.0.1", 0)
    async with client(certs, proto) as c:
        request = asyncio.create_task(c.get(url(server, "/slow")))
        await asyncio.wait_for(app.started.wait(), 5)
        closing = asyncio.create_task(server.close())
        await asyncio.sleep(0.1)
        assert not closing.done()  # waiting for /slow
        with pytest.raises(OSError):  # no longer accepting
            socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
        app.release.set()
        r = await request
        await asyncio.wait_for(closing, 5)
    assert r.status_code == 200 and r.text == "slow done"
    assert server.connections == 0


async def test_close_gives_up_after_the_grace_period(certs: TestPki) -> None:
    app = App()
    server = TcpServer(app, certs.files("server"), settings=TransportSettings(shutdown_grace=0.2))
    await server.start("127.0.0.1", 0)
    async with client(certs, "h2") as c:
        request = asyncio.create_task(c.get(url(server, "/slow")))
        await asyncio.wait_for(app.started.wait(), 5)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await server.close()
        assert loop.time() - t0 < 2
        with pytest.raises(httpx.TransportError):
            await request


async def test_start_on_a_bound_socket_and_lifespan_failures(certs: TestPki) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    async with serving(certs) as s0:  # (a second server just to show ports are independent)
        server = TcpServer(App(), certs.files("server"))
        await server.start(sock=sock)
        try:
            assert server.port == port != s0.port
            async with client(certs, "h1") as c:
                assert (await c.get(url(server, "/"))).status_code == 200
        finally:
            await server.close()

    async def failing(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no database"})

    with pytest.raises(LifespanFailure, match="no database"):
        await TcpServer(failing, certs.files("server")).start("127.0.0.1", 0)

    async def no_lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError("only http")
        await App.reply(send, 200, b"ok")

    async with serving(certs, no_lifespan) as server, client(certs, "h2") as c:
        assert (await c.get(url(server, "/"))).text == "ok"


async def test_idle_keep_alive_connections_are_closed(certs: TestPki) -> None:
    async with serving(certs, settings=TransportSettings(idle_timeout=0.3)) as server:
        reader, writer = await _open(certs, server, "http/1.1")
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        assert await asyncio.wait_for(reader.read(), 3) == b""  # the server closed the idle connection
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


# -- malformed input and raw clients ----------------------------------------------------------------------------


async def _open(pki: TestPki, server: TcpServer, alpn: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    ctx = ssl_client_context(pki.files("alice"), (alpn,))
    return await asyncio.open_connection("127.0.0.1", server.port, ssl=ctx, server_hostname="127.0.0.1")


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n",
    b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
])
async def test_malformed_http1_gets_400_and_close(certs: TestPki, request_bytes: bytes,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    app = App()
    async with serving(certs, app) as server:
        reader, writer = await _open(certs, server, "http/1.1")
        writer.write(request_bytes)
        answer = await asyncio.wait_for(reader.read(), 5)  # read to EOF: the server closes
        await _close(writer)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer
    assert b"connection: close" in answer.lower()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_header_limit_and_pipelining(certs: TestPki, caplog: pytest.LogCaptureFixture) -> None:
    async with serving(certs, settings=TransportSettings(max_header_bytes=4096)) as server:
        reader, writer = await _open(certs, server, "http/1.1")
        writer.write(b"GET /1 HTTP/1.1\r\nhost: x\r\n\r\nGET /2 HTTP/1.1\r\nhost: x\r\n\r\n")
        for _ in range(2):  # two pipelined requests, answered in order
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ")
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 8192 + b"\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        await _close(writer)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:40]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def _response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, await reader.readexactly(length)


async def test_pipelined_requests_with_bodies(certs: TestPki) -> None:
    async with serving(certs) as server:
        reader, writer = await _open(certs, server, "http/1.1")
        writer.write(b"PUT /hash HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
                     b"PUT /hash HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\nde\r\n0\r\n\r\n"
                     b"PUT /hash HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
                     b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        bodies = [(await _response(reader))[1] for _ in range(4)]
        await _close(writer)
    assert bodies == [f"{len(b)} {hashlib.sha256(b).hexdigest()}".encode() for b in (b"abc", b"de", b"")] + [
        b"1.1 urn:kvsp:client:alice"]


async def test_unread_request_body_is_discarded_or_the_connection_closed(certs: TestPki) -> None:
    async with serving(certs) as server:
        reader, writer = await _open(certs, server, "http/1.1")
        # The app answers "/" without reading the body: a small rest is read and dropped, the connection stays.
        writer.write(b"PUT / HTTP/1.1\r\nhost: x\r\ncontent-length: 200000\r\n\r\n" + b"x" * 200000)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        for _ in range(2):
            head, body = await _response(reader)
            assert head.startswith(b"HTTP/1.1 200 ") and body == b"1.1 urn:kvsp:client:alice"
        # A large rest is not worth reading: the response comes, then the connection closes.
        writer.write(b"PUT / HTTP/1.1\r\nhost: x\r\ncontent-length: 100000000\r\n\r\n")
        head, body = await _response(reader)
        assert body == b"1.1 urn:kvsp:client:alice"
        try:
            for _ in range(40):
                writer.write(bytes(MiB))
                await writer.drain()
            closed = await asyncio.wait_for(reader.read(), 5) == b""
        except (ConnectionResetError, ssl.SSLError):  # the server closed with our data still unread
            closed = True
        assert closed
        await _close(writer)


@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_stalled_request_body_times_out(certs: TestPki, proto: str) -> None:
    app = App()
    async with serving(certs, app, settings=TransportSettings(idle_timeout=0.3)) as server:
        _, writer = await _open(certs, server, "http/1.1" if proto == "h1" else "h2")
        if proto == "h1":
            writer.write(b"PUT /wait-disconnect HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
        else:
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            conn.send_headers(1, [(":method", "PUT"), (":scheme", "https"), (":authority", "x"),
                                  (":path", "/wait-disconnect")])
            conn.send_data(1, b"abc")
            writer.write(conn.data_to_send())
        await asyncio.wait_for(app.started.wait(), 5)
        await asyncio.wait_for(app.release.wait(), 5)  # the app saw http.disconnect: the peer went silent
        await _close(writer)
    assert [m["type"] for m in app.received] == ["http.request", "http.disconnect"]


async def test_expect_100_continue(certs: TestPki) -> None:
    async with serving(certs) as server:
        reader, writer = await _open(certs, server, "http/1.1")
        writer.write(b"PUT /hash HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 ")
        writer.write(b"hello")
        head = await reader.readuntil(b"\r\n\r\n")
        body = await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        await _close(writer)
    assert body == f"5 {hashlib.sha256(b'hello').hexdigest()}".encode()


async def test_malformed_http2_closes_the_connection(certs: TestPki, caplog: pytest.LogCaptureFixture) -> None:
    app = App()
    async with serving(certs, app) as server:
        reader, writer = await _open(certs, server, "h2")
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x04\x08\x00\x00\x00\x00\x00" + b"garbage!" * 4)
        data = await asyncio.wait_for(reader.read(), 5)  # the server closes after a GOAWAY
        await _close(writer)
    assert b"\x07" in data  # a GOAWAY frame (type 7) came back
    assert app.calls == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_h2_stream_reset_by_the_client_reaches_receive(certs: TestPki) -> None:
    app = App()
    async with serving(certs, app) as server:
        _, writer = await _open(certs, server, "h2")
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "PUT"), (":scheme", "https"), (":authority", "x"),
                              (":path", "/wait-disconnect")])
        conn.send_data(1, b"abc")
        writer.write(conn.data_to_send())
        await asyncio.wait_for(app.started.wait(), 5)
        conn.reset_stream(1)
        writer.write(conn.data_to_send())
        await asyncio.wait_for(app.release.wait(), 5)
        await _close(writer)
    assert [m["type"] for m in app.received] == ["http.request", "http.disconnect"]


async def test_h2_settings_come_from_transport_settings(certs: TestPki) -> None:
    settings = TransportSettings(max_streams=7, stream_window=3 * MiB, connection_window=5 * MiB,
                                 max_header_bytes=9000)
    async with serving(certs, settings=settings) as server:
        reader, writer = await _open(certs, server, "h2")
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        events: list[h2.events.Event] = []
        while not any(isinstance(e, h2.events.WindowUpdated) for e in events):
            events += conn.receive_data(await asyncio.wait_for(reader.read(65536), 5))
        await _close(writer)
    remote = conn.remote_settings
    assert (remote.max_concurrent_streams, remote.initial_window_size, remote.max_header_list_size) == (
        7, 3 * MiB, 9000)
    assert conn.outbound_flow_control_window == 5 * MiB  # the connection window, opened right away


def test_h2core_round_trip_with_plain_h2() -> None:
    """H2Core's shortcuts (receive path, quiet frames, chunk output) against an unmodified h2 peer, in memory."""
    server = H2Core(h2.config.H2Configuration(client_side=False))
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server.initiate_connection()
    peer.initiate_connection()
    peer.receive_data(b"".join(server.output()))
    peer.send_headers(1, [(":method", "PUT"), (":scheme", "https"), (":authority", "x"), (":path", "/")])
    peer.send_data(1, b"plain")
    peer.send_data(1, b"padded", pad_length=4)
    peer.send_data(1, b"", end_stream=True)
    wire = peer.data_to_send()
    events = [e for i in range(0, len(wire), 7) for e in server.receive_data(wire[i:i + 7])]  # byte dribble
    data = [e for e in events if isinstance(e, h2.events.DataReceived)]
    assert [(e.data, e.flow_controlled_length) for e in data] == [(b"plain", 5), (b"padded", 11), (b"", 0)]
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)
    server.send_headers(1, [(":status", "200")])
    body = os.urandom(60_000)  # within the peer's default 64 KiB window
    for i in range(0, len(body), 16384):
        server.send_chunk(1, memoryview(body)[i:i + 16384], end_stream=i + 16384 >= len(body))
    received = b"".join(e.data for e in peer.receive_data(b"".join(server.output()))
                        if isinstance(e, h2.events.DataReceived))
    assert received == body


def test_h2core_writes_the_frames_h2_would() -> None:
    core = H2Core(h2.config.H2Configuration(client_side=False))
    frames: list[Frame] = [HeadersFrame(1, data=b"hdr", flags=["END_HEADERS"]), DataFrame(1, data=b"abc"),
              DataFrame(3, data=b"", flags=["END_STREAM"]), DataFrame(5, data=b"padded", flags=["PADDED"],
                                                                      pad_length=3)]
    core._prepare_for_sending(frames)
    assert b"".join(core.output()) == b"".join(f.serialize() for f in frames)


def test_split_target() -> None:
    assert split_target(b"/a?b=c?d") == (b"/a", b"b=c?d")
    assert split_target(b"https://h:1/x/y?q") == (b"/x/y", b"q")
    assert split_target(b"https://h:1") == (b"/", b"")
    assert split_target(b"*") == (b"*", b"")


# -- curl: an independent client --------------------------------------------------------------------------------

CURL = shutil.which("curl")


@needs_peer("curl is not installed (Debian: apt-get install curl)" if CURL is None else None)
@pytest.mark.parametrize("proto", PROTOCOLS)
async def test_curl(certs: TestPki, proto: str, tmp_path: Path) -> None:
    assert CURL is not None
    upload = tmp_path / "upload.bin"
    upload.write_bytes(BLOCK * 3)
    flag = "--http1.1" if proto == "h1" else "--http2"
    alice = certs.files("alice")
    base = [CURL, "-sS", flag, "--cacert", str(certs.ca), "--max-time", "20"]
    auth = ["--cert", str(alice.cert), "--key", str(alice.key)]

    async def curl(*args: str) -> tuple[int, bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        return proc.returncode or 0, out, err

    app = App()
    async with serving(certs, app) as server:
        code, out, err = await curl(*base, *auth, "-i", url(server, "/"))
        assert code == 0, err
        version = "1.1" if proto == "h1" else "2"
        assert out.startswith(f"HTTP/{version} 200".encode()), out
        assert f'alt-svc: h3=":{server.port}"; ma=86400'.encode() in out
        assert out.endswith(f"{version} urn:kvsp:client:alice".encode())
        code, out, err = await curl(*base, *auth, "-T", str(upload), url(server, "/hash"))
        assert code == 0, err
        assert out == f"{3 * MiB} {_expected(3)}".encode()
        code, out, err = await curl(*base, *auth, url(server, "/blob?n=3"))
        assert code == 0 and hashlib.sha256(out).hexdigest() == _expected(3)
        calls = app.calls
        code, out, err = await curl(*base, url(server, "/"))  # no client certificate
        assert code != 0 and app.calls == calls
        foreign = certs.foreign
        code, out, err = await curl(*base, "--cert", str(foreign.cert), "--key", str(foreign.key), url(server, "/"))
        assert code != 0 and app.calls == calls
