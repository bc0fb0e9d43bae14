"""The Index Service over real sockets (kvsp_http.index_app behind a RoleServer, mutual TLS): its identities and
policy, and :func:`serve` (the app on a manual clock, with clients for h1, h2, ii7, alice and bob)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from http3.client import KvspClient, Response
from http3.server import RoleServer
from kvsp_http.app_kit import JSON_MEDIA_TYPE as MEDIA_TYPE
from kvsp_http.index_app import index_app
from kvsp_quic import keys as k
from kvsp_quic.auth import Policy
from kvsp_quic.problems import (
    problem_from_json,
)
from kvsp_quic.records import (
    ReplicaRecord,
)
from kvsp_quic.roles.index import Geometry, IndexConfig, IndexService
from kvsp_quic.storage.memory_index import MemoryIndexStore
from quic.tls import TlsFiles
from tests.support.index import C1, S1, S2

INDEX = "https://127.0.0.1/kvsp/"
H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example/kvsp/"
II7 = "https://ii7.example/kvsp/"
ALICE = "urn:kvsp:client:alice"  # a client with scope S1
BOB = "urn:kvsp:client:bob"  # not in the policy
MAX_KEYS = 100
MAX_BODY = 16 << 10


POLICY = Policy.from_dict({"principal": [
    {"identity": H1, "roles": ["holder"], "scopes": [S1.hex()]},
    {"identity": H2, "roles": ["holder"], "scopes": [S1.hex(), S2.hex()], "publish_for": [H1]},
    {"identity": II7, "roles": ["instance", "holder"], "scopes": [S1.hex()]},
    {"identity": ALICE, "roles": ["client"], "scopes": [S1.hex()]},
]})


@dataclass
class Harness:
    server: RoleServer
    service: IndexService
    clients: dict[str, KvspClient]

    def url(self, path: str) -> str:
        return self.server.base_uri("/kvsp/") + path

    async def call(self, who: str, method: str, path: str, body: Any = None, *,
                   content_type: str = MEDIA_TYPE, raw: bytes | None = None) -> Response:
        content = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"content-type": content_type} if content is not None else {}
        response = await self.clients[who].request(method, self.url(path), headers=headers, content=content)
        assert response.headers.get("cache-control") == "no-store"
        return response

    async def publish(self, who: str, record: ReplicaRecord, holder: str | None = None) -> Response:
        return await self.call(who, "PUT", replica_path(record, holder), record.to_json())


def replica_path(record: ReplicaRecord, holder: str | None = None) -> str:
    return f"replicas/{k.holder_id(holder or record.holder)}/{record.block_key.hex()}"


def problem(response: Response) -> Any:
    assert response.headers.get("content-type") == "application/problem+json"
    return problem_from_json(response.status, response.content or b"")


@contextlib.asynccontextmanager
async def serve(pki_dir: Path, *, h3: bool = True) -> AsyncIterator[Harness]:
    service = IndexService(MemoryIndexStore(), clock=manual_clock, config=IndexConfig(
        max_ttl_ms=600_000, max_lookup_keys=MAX_KEYS, geometry={C1: Geometry(16, 4)}))
    app = index_app(service, POLICY, base_path="/kvsp/", max_body_bytes=MAX_BODY, sweep_interval=0.05)
    server = RoleServer(app, TlsFiles.in_dir(pki_dir, "index"))
    await server.start("127.0.0.1", 0)
    clients = {name: KvspClient(TlsFiles.in_dir(pki_dir, name), h3=h3, timeout=10.0)
               for name in ("h1", "h2", "ii7", "alice", "bob")}
    try:
        yield Harness(server, service, clients)
    finally:
        for c in clients.values():
            await c.aclose()
        await server.close()


NOW = [0.0]  # the time of :func:`serve`'s Index Service, in seconds: tests set NOW[0]


def manual_clock() -> float:
    return NOW[0]
