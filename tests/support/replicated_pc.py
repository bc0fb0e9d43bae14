"""Two replicas of the Index Service + Placement Controller on one real redis-server (each its own RoleServer,
certificate and role, one RedisControlStore between them), with tests/support/pc_app.py's recording instances:
:func:`replicas`."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from http3.client import KvspClient
from http3.client import Response as ClientResponse
from http3.server import RoleServer, bind_pair
from kvsp_http.app_kit import JSON_MEDIA_TYPE
from kvsp_http.controller_app import controller_app
from kvsp_quic import keys as k
from kvsp_quic.auth import Policy
from kvsp_quic.compat import InstanceState
from kvsp_quic.metrics import Registry
from kvsp_quic.records import InstanceStatusRecord, Link
from kvsp_quic.roles.controller import ControllerConfig, PlacementController
from kvsp_quic.roles.index import Geometry, IndexConfig, IndexService
from kvsp_quic.roles.status import LifecyclePolicy, SleepPolicy, StatusTable
from kvsp_quic.storage.redis_control import RedisControlStore
from kvsp_quic.storage.redis_index import RedisIndexStore
from kvsp_runtime.controller_link import HttpInstanceLink
from kvsp_runtime.controller_service import ControllerService
from tests.pki import make_pki
from tests.support.index import C1, S1
from tests.support.pc_app import BLOCK, FakeInstance

NAMES = ("pc1", "pc2", "ia", "ic", "h1")


@dataclass
class Replicas:
    uris: dict[str, str]
    controllers: dict[str, ControllerService]
    servers: dict[str, RoleServer]
    instances: dict[str, FakeInstance]
    clients: dict[str, KvspClient]

    async def call(self, pc: str, who: str, method: str, path: str, body: Any = None) -> ClientResponse:
        content = None if body is None else json.dumps(body).encode()
        headers = {"content-type": JSON_MEDIA_TYPE} if content is not None else {}
        return await self.clients[who].request(method, self.uris[pc] + path, headers=headers, content=content)

    async def report(self, pc: str, name: str, *, ttl_ms: int = 60_000, epoch: int = 1) -> ClientResponse:
        uri = self.uris[name]
        record = InstanceStatusRecord(uri, epoch, InstanceState.ACTIVE, ttl_ms, running=0, queued=0, batch_size=8,
                                      prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0,
                                      links=(Link(self.uris["h1"], 1000.0, 50.0),))
        return await self.call(pc, name, "PUT", f"instances/{k.uri_id(uri)}/status", record.to_json())


def replica_policy(uris: dict[str, str]) -> Policy:
    return Policy.from_dict({"principal": [
        *({"identity": uris[n], "roles": ["controller"], "scopes": "*"} for n in ("pc1", "pc2")),
        {"identity": uris["h1"], "roles": ["holder"], "scopes": [S1.hex()]},
        *({"identity": uris[n], "roles": ["instance", "holder"], "scopes": [S1.hex()]} for n in ("ia", "ic")),
        {"identity": "urn:kvsp:client:alice", "roles": ["client"], "scopes": [S1.hex()]},
    ]})


def _controller(uri: str, redis_url: str, client: KvspClient) -> tuple[IndexService, ControllerService]:
    status = StatusTable(time.monotonic, policy=LifecyclePolicy(SleepPolicy()), max_ttl_ms=60_000)
    service = IndexService(RedisIndexStore.from_url(redis_url), clock=time.monotonic,
                           config=IndexConfig(geometry={C1: Geometry(BLOCK, 4)}), status=status)
    role = PlacementController(service, clock=time.monotonic, metrics=Registry(), identity=uri,
                               config=ControllerConfig(prefetch_deadline_ms=200, lease_ms=600))
    return service, ControllerService(role, HttpInstanceLink(client), store=RedisControlStore.from_url(redis_url))


@contextlib.asynccontextmanager
async def replicas(root: Path, redis_url: str) -> AsyncIterator[Replicas]:
    sockets: dict[str, tuple[socket.socket, socket.socket | None]] = {n: bind_pair("127.0.0.1", 0, 1 << 20)
                                                                      for n in NAMES}
    uris = {n: f"https://127.0.0.1:{s[0].getsockname()[1]}/kvsp/" for n, s in sockets.items()}
    pki = make_pki(root, roles=uris)
    policy = replica_policy(uris)
    pc_clients = {n: KvspClient(pki.files(n), timeout=5.0) for n in ("pc1", "pc2")}
    controllers, services, servers = {}, [], {}
    for n in ("pc1", "pc2"):
        service, controllers[n] = _controller(uris[n], redis_url, pc_clients[n])
        services.append(service)
        servers[n] = RoleServer(controller_app(service, controllers[n], policy, base_path="/kvsp/",
                                               tick_interval=0.05), pki.files(n))
    instances = {n: FakeInstance(n, uris[n]) for n in ("ia", "ic")}
    servers.update({n: RoleServer(inst.app(policy), pki.files(n)) for n, inst in instances.items()})
    clients = {n: KvspClient(pki.files(n), timeout=5.0) for n in ("ia", "ic", "alice")}
    try:
        for name, server in servers.items():
            await server.start(sockets=sockets[name])
        for s in sockets["h1"]:
            if s is not None:
                s.close()
        yield Replicas(uris, controllers, servers, instances, clients)
    finally:
        for client in [*clients.values(), *pc_clients.values()]:
            await client.aclose()
        for server in servers.values():
            with contextlib.suppress(Exception):
                await server.close()
        for service in services:
            await service.store.aclose()
        for pc in controllers.values():
            await pc.store.aclose()
