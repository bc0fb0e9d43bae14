"""The Index Service + Placement Controller over real sockets (kvsp_http.controller_app behind a RoleServer, mutual
TLS) with fake inference instances that record the PC's directives: :func:`cluster`, session bodies and
checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.client import KvspClient
from http3.client import Response as ClientResponse
from http3.server import RoleServer, bind_pair
from kvsp_http.app_kit import JSON_MEDIA_TYPE, kvsp_json, read_json_body, role_app
from kvsp_http.authz import Rule
from kvsp_http.controller_app import controller_app
from kvsp_http.problem_response import install
from kvsp_quic import keys as k
from kvsp_quic.auth import Policy
from kvsp_quic.compat import InstanceState
from kvsp_quic.metrics import Registry
from kvsp_quic.problems import InvalidState
from kvsp_quic.records import (
    CheckpointAck,
    InstanceStatusRecord,
    Link,
    PrefetchDirective,
    ReshardPlan,
    Sampler,
    SessionCheckpoint,
    StateMessage,
    parse_reshard,
)
from kvsp_quic.roles.controller import ControllerConfig, PlacementController
from kvsp_quic.roles.controller_records import SessionResume, SessionStart
from kvsp_quic.roles.index import Geometry, IndexConfig, IndexService
from kvsp_quic.roles.status import LifecyclePolicy, SleepPolicy, StatusTable
from kvsp_quic.storage.memory_index import MemoryIndexStore
from kvsp_runtime.controller_link import HttpInstanceLink
from kvsp_runtime.controller_service import ControllerService
from tests.pki import make_pki
from tests.support.index import C1, S1, bk

BLOCK = 16
BYTES_PER_TOKEN = 1024  # what a fake instance counts per token it would transfer in a reshard


@dataclass
class FakeInstance:
    """Records the PC's directives; answers like an instance (docs/inference.md)."""

    name: str
    uri: str = ""
    calls: list[tuple[str, Any]] = field(default_factory=list)
    state: InstanceState = InstanceState.ACTIVE
    reshard_delay: float = 0.0
    fetched_bytes: int = 0  # octets it would have loaded for reshard fetch ranges
    retained_bytes_moved: int = 0  # octets moved for ranges it retained: must stay 0
    held: set[int] = field(default_factory=set)  # tokens of the sharded context it holds

    def of(self, kind: str) -> list[Any]:
        return [body for kind_, body in self.calls if kind_ == kind]

    def app(self, policy: Policy) -> Any:
        async def body(request: Request) -> dict[str, Any]:
            return json.loads(await read_json_body(request, 1 << 22))  # type: ignore[no-any-return]

        def not_active(kind: str, what: Any) -> None:
            if self.state is not InstanceState.ACTIVE:
                self.calls.append(("refused " + kind, what))
                raise InvalidState(f"{self.name} is {self.state.value}")

        async def prefetch(request: Request) -> Response:
            directive = PrefetchDirective.from_json(await body(request))
            not_active("prefetch", directive)
            self.calls.append(("prefetch", directive))
            return kvsp_json({"directive": str(directive.directive), "state": "pending"}, 202,
                             {"location": f"prefetch/{directive.directive}"})

        async def start(request: Request) -> Response:
            start = SessionStart.from_json(await body(request))
            not_active("start", start)
            self.calls.append(("start", start))
            return kvsp_json(CheckpointAck(start.session, start.epoch, 0).to_json(), 201)

        async def resume(request: Request) -> Response:
            resume = SessionResume.from_json(await body(request))
            not_active("resume", resume)
            self.calls.append(("resume", resume))
            session = uuid.UUID(request.path_params["session"])
            return kvsp_json(CheckpointAck(session, resume.epoch, resume.checkpoint.output_offset).to_json())

        async def put_state(request: Request) -> Response:
            self.state = StateMessage.from_json(await body(request)).state
            self.calls.append(("state", self.state))
            return kvsp_json({"state": self.state.value})

        async def reshard(request: Request) -> Response:
            message = parse_reshard(await body(request))
            self.calls.append(("reshard", message))
            if isinstance(message, ReshardPlan):
                for fetch in message.fetch:  # "load" the range: count what would travel
                    tokens = set(range(*fetch.tokens))
                    self.retained_bytes_moved += len(tokens & self.held) * BYTES_PER_TOKEN
                    self.fetched_bytes += len(tokens) * BYTES_PER_TOKEN
                await asyncio.sleep(self.reshard_delay)
            return kvsp_json({"map": message.map})

        app = Starlette(routes=[
            Route("/prefetch", prefetch, methods=["POST"]),
            Route("/sessions/{session}/start", start, methods=["POST"]),
            Route("/sessions/{session}/resume", resume, methods=["POST"]),
            Route("/state", put_state, methods=["PUT"]),
            Route("/reshard", reshard, methods=["POST"]),
        ])
        install(app)
        rules = [Rule(m, p, ["controller"]) for m, p in (("POST", "prefetch"), ("POST", "sessions/{s}/start"),
                                                         ("POST", "sessions/{s}/resume"), ("PUT", "state"),
                                                         ("POST", "reshard"))]
        return role_app(app, policy, rules, "/kvsp/")


@dataclass
class Cluster:
    pc_uri: str
    uris: dict[str, str]
    service: IndexService
    controller: ControllerService
    instances: dict[str, FakeInstance]
    clients: dict[str, KvspClient]
    epochs: dict[str, int] = field(default_factory=dict)

    def uri(self, name: str) -> str:
        return self.uris[name]

    async def call(self, who: str, method: str, path: str, body: Any = None) -> ClientResponse:
        content = None if body is None else json.dumps(body).encode()
        headers = {"content-type": JSON_MEDIA_TYPE} if content is not None else {}
        response = await self.clients[who].request(method, self.pc_uri + path, headers=headers, content=content)
        assert response.headers.get("cache-control") == "no-store"
        return response

    async def report(self, name: str, *, epoch: int | None = None, state: InstanceState = InstanceState.ACTIVE,
                     ttl_ms: int = 60_000, **changes: Any) -> ClientResponse:
        uri = self.uri(name)
        epoch = epoch if epoch is not None else self.epochs.setdefault(name, 1)
        fields: dict[str, Any] = dict(running=0, queued=0, batch_size=8, prefill_tokens_per_s=1000.0,
                                      decode_tokens_per_s=100.0, links=(Link(self.uri("h1"), 1000.0, 50.0),))
        fields.update(changes)
        record = InstanceStatusRecord(uri, epoch, state, ttl_ms, **fields)
        return await self.call(name, "PUT", f"instances/{k.uri_id(uri)}/status", record.to_json())


def policy_for(uris: dict[str, str]) -> Policy:
    return Policy.from_dict({"principal": [
        {"identity": uris["pc"], "roles": ["controller"], "scopes": "*"},
        {"identity": uris["h1"], "roles": ["holder"], "scopes": [S1.hex()]},
        *({"identity": uris[n], "roles": ["instance", "holder"], "scopes": [S1.hex()]} for n in ("ia", "ib", "ic")),
        {"identity": "urn:kvsp:client:alice", "roles": ["client"], "scopes": [S1.hex()]},
    ]})


@contextlib.asynccontextmanager
async def cluster(root: Path, policy_of: Callable[[dict[str, str]], Policy] = policy_for,
                  instances_named: Sequence[str] = ("ia", "ib", "ic"), holders: Sequence[str] = ("h1",),
                  clients_named: Sequence[str] = ("alice",), *, config: ControllerConfig | None = None,
                  wrap: Callable[[str, Any], Any] | None = None, client_retries: int | None = None,
                  client_timeout: float = 5.0) -> AsyncIterator[Cluster]:
    """The index + PC app and recording instances (*instances_named*) behind RoleServers, under *policy_of*'s
    policy; *holders* are names with a URI (and a certificate) but no server; *clients_named* get a client each.
    *config*: the PC's (its prefetch deadline is 200 ms); *wrap(name, app)*: an ASGI app in front of an instance's;
    *client_retries*, *client_timeout*: the clients' (the KvspClient default retries when None)."""
    names = ("pc", *instances_named, *holders)
    sockets: dict[str, tuple[socket.socket, socket.socket | None]] = {n: bind_pair("127.0.0.1", 0, 1 << 20)
                                                                      for n in names}
    uris = {n: f"https://127.0.0.1:{s[0].getsockname()[1]}/kvsp/" for n, s in sockets.items()}
    pki = make_pki(root, roles=uris)
    policy = policy_of(uris)
    status = StatusTable(time.monotonic, policy=LifecyclePolicy(SleepPolicy()), max_ttl_ms=60_000)
    service = IndexService(MemoryIndexStore(), clock=time.monotonic,
                           config=IndexConfig(geometry={C1: Geometry(BLOCK, 4)}), status=status)
    pc_client = KvspClient(pki.files("pc"), timeout=5.0)
    config = dataclasses.replace(config or ControllerConfig(), prefetch_deadline_ms=200)
    role = PlacementController(service, clock=time.monotonic, config=config, metrics=Registry(), identity=uris["pc"])
    controller = ControllerService(role, HttpInstanceLink(pc_client))
    servers = [RoleServer(controller_app(service, controller, policy, base_path="/kvsp/", tick_interval=0.05),
                          pki.files("pc"))]
    instances = {n: FakeInstance(n, uris[n]) for n in instances_named}
    servers += [RoleServer(inst.app(policy) if wrap is None else wrap(n, inst.app(policy)), pki.files(n))
                for n, inst in instances.items()]
    options: dict[str, Any] = {"timeout": client_timeout} | ({} if client_retries is None else
                                                            {"retries": client_retries})
    clients = {n: KvspClient(pki.files(n), **options) for n in ("pc", *instances_named, *clients_named)}
    try:
        for name, server in zip(("pc", *instances_named), servers, strict=True):
            await server.start(sockets=sockets[name])
        for name in holders:
            for sock in sockets[name]:
                if sock is not None:
                    sock.close()
        yield Cluster(uris["pc"], uris, service, controller, instances, clients)
    finally:
        for client in [*clients.values(), pc_client]:
            await client.aclose()
        for server in servers:
            await server.close()


def session_body(n: int = 1, blocks: int = 4) -> dict[str, Any]:
    prompt = list(range(100, 100 + blocks * BLOCK + 3))
    return {"session": str(uuid.UUID(int=n)), "scope_id": S1.hex(), "compat_id": C1.hex(), "prompt": prompt,
            "max_tokens": 16, "sampler": Sampler("top-p", 7, 0, False, {"p": 0.9}).to_json(),
            "block_keys": [bk(i).hex() for i in range(blocks)]}


def checkpoint(body: dict[str, Any], epoch: int, generated: list[int]) -> dict[str, Any]:
    return SessionCheckpoint(uuid.UUID(body["session"]), epoch, C1, S1, tuple(bk(i) for i in range(4)),
                             tuple(body["prompt"][64:]), tuple(generated), len(generated),
                             Sampler("top-p", 7, len(generated), False, {"p": 0.9})).to_json()
