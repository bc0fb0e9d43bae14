"""Issue 13: the front end's 503 when the Placement Controller cannot place a session carries no internal URL and
no transport or peer error text (docs/security.md): a real front end (frontend_app behind a RoleServer on
127.0.0.1) answers the OpenAI error shape with a generic message and a reference id; the detail goes to its log
under that id."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import ssl
from pathlib import Path

import httpx
import pytest

from http3.asgi_types import Receive, Scope, Send
from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_frontend.app import Frontend, frontend_app
from kvsp_frontend.auth import with_dev_key
from kvsp_quic.auth import Policy
from kvsp_quic.keys import BlockKeyer
from quic.tls import TransportSettings
from tests.asgi import read_body
from tests.pki import make_pki
from tests.support.frontend import DESCRIPTOR, KEY, Utf8

INTERNAL = "https://10.9.8.7:4433/kvsp/ refused the start: connection reset by peer"


async def leaky_pc(scope: Scope, receive: Receive, send: Send) -> None:
    """A PC that answers ``POST sessions`` with a 503 whose detail names an internal instance and its error."""
    await read_body(receive)
    body = json.dumps({"type": "about:blank", "title": "Service Unavailable", "status": 503,
                       "detail": INTERNAL}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/problem+json")]})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("pc_kind", ["gone", "leaky"])
async def test_the_503_of_an_unplaceable_session_names_no_internal_detail(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, pc_kind: str) -> None:
    certs = make_pki(tmp_path)
    pc_server = RoleServer(leaky_pc, certs.files("server"))
    await pc_server.start("127.0.0.1", 0)
    pc = pc_server.base_uri()
    if pc_kind == "gone":
        await pc_server.close()  # nothing answers there any more: a transport error naming the URL
    client = KvspClient(certs.files("alice"), retries=0, connect_timeout=1, h3=False)
    keyer = BlockKeyer(bytes(range(32)), DESCRIPTOR.compat_id, DESCRIPTOR.block_tokens)
    frontend = Frontend(client, pc, keyer, Utf8(), "tiny", vocab_size=256, placement_timeout_s=2)
    server = RoleServer(frontend_app(frontend, with_dev_key(Policy.dev_ca(), KEY)), certs.files("server"),
                        settings=dataclasses.replace(TransportSettings(), client_cert_optional=True))
    await server.start("127.0.0.1", 0)
    port = pc.split(":")[2].split("/")[0]
    try:
        with caplog.at_level(logging.WARNING, logger="kvsp.frontend"):
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=tmp_path / "ca.pem")) as http:
                for body in ({"prompt": "ab", "stream": True}, {"prompt": "ab"}):
                    r = await http.post(server.base_uri("/v1/completions"), headers={"authorization": f"Bearer {KEY}"},
                                        json=body)
                    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
                    error = r.json()["error"]
                    assert set(error) >= {"message", "type", "param", "code"} and error["type"] == "server_error"
                    message = error["message"]
                    assert "Placement Controller" in message
                    for secret in ("https://", "127.0.0.1", f":{port}", "10.9.8.7", "refused", "reset", "Error"):
                        assert secret not in r.text, (secret, r.text)
                    ref = re.search(r"\(ref ([0-9a-f]{12})\)", message)
                    assert ref is not None, message
                    logged = [rec.getMessage() for rec in caplog.records if ref.group(1) in rec.getMessage()]
                    assert logged, "the detail is in the log under the reference"
                    if pc_kind == "leaky":
                        assert INTERNAL in logged[0]
    finally:
        await server.close()
        await client.aclose()
        if pc_kind == "leaky":
            await pc_server.close()
