"""A role's endpoint end to end: one app, one port, HTTP/1.1 + HTTP/2 on TCP and HTTP/3 on UDP, mutual TLS, and
authorization by identity, role and scope -- the same verdicts whatever the transport."""

from __future__ import annotations

import ssl
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from http3.client import KvspClient, TransportError
from http3.h3_client import H3ConnectError, connect_h3
from http3.server import RoleServer, bind_pair
from kvsp_http.authz import Authorization, Rule, principal_of
from kvsp_http.problem_response import install
from kvsp_quic.auth import Policy, require_scope
from quic.tls import TlsFiles, TransportSettings, scope_identity, ssl_client_context
from tests.pki import TestPki
from tests.support.transport import connect_without_certificate

SCOPE_A, SCOPE_B = "aa" * 16, "bb" * 16
SETTINGS = TransportSettings(shutdown_grace=2.0)


def build_app() -> Any:
    async def scoped(request: Request) -> JSONResponse:
        principal = principal_of(request)
        require_scope(principal, bytes.fromhex(request.path_params["scope"]))
        return JSONResponse({"identity": scope_identity(request.scope), "http": request.scope["http_version"]})

    app = Starlette(routes=[Route("/things/{scope}", scoped, methods=["GET"]),
                            Route("/admin", scoped, methods=["GET"])])
    install(app)
    policy = Policy.from_dict({"principal": [
        {"identity": "urn:kvsp:client:alice", "roles": ["client"], "scopes": [SCOPE_A]},
        {"identity": "urn:kvsp:client:bob", "roles": ["instance"], "scopes": "*"},
    ]})
    return Authorization(app, policy, [Rule("GET", "things/{scope}", ["client", "instance"]),
                                       Rule("GET", "admin", ["controller"])])


@pytest.fixture
async def server(fresh_certs: TestPki):
    srv = RoleServer(build_app(), fresh_certs.files("server"), settings=SETTINGS)
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.close()


def client_context(files: TlsFiles, alpn: list[str]) -> ssl.SSLContext:
    return ssl_client_context(files, alpn=alpn)


async def get(server: RoleServer, files: TlsFiles, transport: str, path: str) -> tuple[int, dict[str, Any], str]:
    """GET over exactly one transport: "h1" / "h2" with httpx, "h3" with our client."""
    url = server.base_uri(path)
    if transport == "h3":
        async with KvspClient(files, settings=SETTINGS, retries=0) as client:
            response = await client.request("GET", url)
            return response.status, response.json(), response.http_version
    async with httpx.AsyncClient(verify=client_context(files, ["h2"] if transport == "h2" else ["http/1.1"]),
                                 http2=transport == "h2", http1=transport == "h1") as client:
        r = await client.get(url)
        return r.status_code, r.json(), r.http_version


TRANSPORTS = ["h1", "h2", "h3"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_valid_certificate_sees_its_identity(server: RoleServer, fresh_certs: TestPki, transport: str) -> None:
    status, body, version = await get(server, fresh_certs.files("alice"), transport, f"/things/{SCOPE_A}")
    assert status == 200
    assert body == {"identity": "urn:kvsp:client:alice", "http": {"h1": "1.1", "h2": "2", "h3": "3"}[transport]}
    assert version == {"h1": "HTTP/1.1", "h2": "HTTP/2", "h3": "HTTP/3"}[transport]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("who", ["none", "foreign", "expired", "notyet"])
async def test_bad_certificates_are_refused(server: RoleServer, fresh_certs: TestPki, transport: str, who: str) -> None:
    if who == "none":
        files = None
    else:
        bad = fresh_certs.foreign if who == "foreign" else fresh_certs.files(who)
        files = TlsFiles(fresh_certs.ca, bad.cert, bad.key)
    url = server.base_uri(f"/things/{SCOPE_A}")
    if transport == "h3":  # refused in the QUIC handshake
        if files is None:
            assert "client certificate is required" in await connect_without_certificate(fresh_certs.ca, server.port)
        else:
            with pytest.raises(H3ConnectError):
                await connect_h3("127.0.0.1", server.port, files, settings=SETTINGS, timeout=2)
        return
    ctx = ssl.create_default_context(cafile=str(fresh_certs.ca))
    if files is not None:
        ctx.load_cert_chain(str(files.cert), str(files.key))
    ctx.set_alpn_protocols(["h2"] if transport == "h2" else ["http/1.1"])
    async with httpx.AsyncClient(verify=ctx, http2=transport == "h2", http1=transport == "h1") as client:
        with pytest.raises(httpx.TransportError):
            await client.get(url)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("who", "path", "status", "type_"), [
    ("alice", f"/things/{SCOPE_B}", 403, "https://iana.org/assignments/kvsp#kvsp-scope-denied"),
    ("alice", "/admin", 403, "about:blank"),
    ("nouri", f"/things/{SCOPE_A}", 403, "about:blank"),
    ("bob", f"/things/{SCOPE_B}", 200, None),
])
async def test_authorization_is_the_same_on_every_transport(server: RoleServer, fresh_certs: TestPki, transport: str,
                                                            who: str, path: str, status: int,
                                                            type_: str | None) -> None:
    got, body, _ = await get(server, fresh_certs.files(who), transport, path)
    assert got == status
    if type_ is not None:
        assert body["type"] == type_ and body["status"] == status


async def test_tcp_advertises_http3_on_the_same_port(server: RoleServer, fresh_certs: TestPki) -> None:
    async with httpx.AsyncClient(verify=client_context(fresh_certs.files("alice"), ["h2"]), http2=True) as client:
        r = await client.get(server.base_uri(f"/things/{SCOPE_A}"))
    assert r.headers["alt-svc"] == f'h3=":{server.port}"; ma=86400'
    assert r.headers["content-type"] == "application/json"


@pytest.mark.parametrize("http2", [False, True])
async def test_client_falls_back_to_tcp_when_udp_has_no_http3(fresh_certs: TestPki, http2: bool) -> None:
    srv = RoleServer(build_app(), fresh_certs.files("server"), settings=SETTINGS, http3=False)
    await srv.start("127.0.0.1", 0)
    version = "HTTP/2" if http2 else "HTTP/1.1"
    try:
        async with KvspClient(fresh_certs.files("alice"), settings=SETTINGS, connect_timeout=0.5,
                              fallback_http2=http2) as client:
            url = srv.base_uri(f"/things/{SCOPE_A}")
            response = await client.request("GET", url)
            assert response.status == 200 and response.http_version == version
            assert response.json()["identity"] == "urn:kvsp:client:alice"
            assert client.transport_for(url) == "tcp"  # remembered: the next request goes straight to TCP
            again = await client.request("GET", url)
            assert again.status == 200 and again.http_version == version
    finally:
        await srv.close()


def test_bind_pair_gives_the_same_port_number() -> None:
    tcp, udp = bind_pair("127.0.0.1", 0, 1 << 16)
    try:
        assert udp is not None and tcp.getsockname()[1] == udp.getsockname()[1]
    finally:
        tcp.close()
        if udp is not None:
            udp.close()


@pytest.mark.parametrize(("method", "content", "attempts"), [("GET", None, 3), ("PUT", b"x", 3), ("POST", b"x", 1)])
async def test_only_idempotent_requests_are_retried(fresh_certs: TestPki, method: str, content: bytes | None,
                                                    attempts: int) -> None:
    import asyncio

    accepted = 0

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        writer.transport.abort()  # a server that drops every connection at once

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with KvspClient(fresh_certs.files("alice"), h3=False, retries=2) as client:
            with pytest.raises(TransportError):
                await client.request(method, f"https://127.0.0.1:{port}/x", content=content)
    finally:
        server.close()
        await server.wait_closed()
    assert accepted == attempts
