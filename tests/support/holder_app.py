"""A holder over real sockets (RoleServer + holder_app, mutual TLS): its identities, blocks by number, and
:class:`Setup` (the server, the role and alice's and bob's clients)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from http3.client import KvspClient, Response
from http3.server import RoleServer
from kvsp_quic import container as c
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.roles.holder import Holder
from kvsp_quic.samples import random_sections

HOLDER_URI = "https://127.0.0.1/kvsp/"
INDEX_URI = "https://127.0.0.1/is/"
SCOPE = "6d1c6481cd428737da312c089db3832a"
OTHER_SCOPE = "00112233445566778899aabbccddeeff"
ALICE = "urn:kvsp:client:alice"
BOB = "urn:kvsp:client:bob"
BLOCK = "application/kvsp-block"
JSON = "application/kvsp+json"


def key(n: int) -> str:
    return hashlib.sha256(b"key%d" % n).hexdigest()


def body(d: CompatDescriptor, n: int) -> bytes:
    return c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, n), first_layer=0,
                    token_count=d.block_tokens, descriptor=d).tobytes()


@dataclass
class Setup:
    server: RoleServer
    holder: Holder
    d: CompatDescriptor
    alice: KvspClient
    bob: KvspClient

    def url(self, path: str) -> str:
        return self.server.base_uri("/kvsp/") + path

    def block_url(self, n: int, query: str = "", scope: str = SCOPE, compat: str | None = None) -> str:
        compat = compat or self.d.compat_id.hex()
        return self.url(f"blocks/{compat}/{scope}/{key(n)}") + (f"?{query}" if query else "")

    async def put(self, n: int, client: KvspClient | None = None, content: Any = None,
                  headers: dict[str, str] | None = None) -> Response:
        headers = {"content-type": BLOCK, "if-none-match": "*"} if headers is None else headers
        return await (client or self.alice).request("PUT", self.block_url(n), headers=headers,
                                                    content=body(self.d, n) if content is None else content)


def problem_type(response: Response) -> str:
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["cache-control"] == "no-store"
    return str(response.json()["type"]).removeprefix("https://iana.org/assignments/kvsp#")
