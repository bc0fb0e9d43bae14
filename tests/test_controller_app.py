"""The Index Service + Placement Controller over real sockets (kvsp_http.controller_app behind RoleServer, mutual TLS),
with fake inference instances: tiny ASGI apps behind RoleServer that record the PC's directives, take sessions,
and count the octets a reshard would move. Also ``/metrics`` on the PC and on a holder."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.client import KvspClient
from http3.client import Response as ClientResponse
from http3.server import RoleServer, bind_pair
from kvsp_app.config import ConfigError, IndexFile, build
from kvsp_app.serve import run_index
from kvsp_http.app_kit import JSON_MEDIA_TYPE, kvsp_json, read_json_body, role_app
from kvsp_http.authz import Rule
from kvsp_http.controller_app import controller_app
from kvsp_http.holder_app import holder_app
from kvsp_http.problem_response import install
from kvsp_quic import keys as k
from kvsp_quic.auth import ALL, Policy, Principal, Role
from kvsp_quic.compat import InstanceState
from kvsp_quic.metrics import CONTENT_TYPE, Registry
from kvsp_quic.problems import InvalidState
from kvsp_quic.records import (
    CheckpointAck,
    InstanceStatusRecord,
    Link,
    PrefetchDirective,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    Sampler,
    SessionCheckpoint,
    StateMessage,
    parse_reshard,
)
from kvsp_quic.roles.controller import ControllerConfig, PlacementController
from kvsp_quic.roles.controller_records import SessionInfo, SessionResume, SessionStart
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.index import Geometry, IndexConfig, IndexService
from kvsp_quic.roles.status import LifecyclePolicy, SleepPolicy, StatusTable
from kvsp_quic.storage.memory_index import MemoryIndexStore
from kvsp_runtime.controller_link import CommandStarter, HttpInstanceLink
from kvsp_runtime.controller_service import ControllerService
from quic.tls import TlsFiles
from tests.conftest import small_descriptor
from tests.pki import make_pki
from tests.test_index import C1, S1, bk, replica
from tests.test_metrics import check_format

BLOCK = 16
BYTES_PER_TOKEN = 1024  # what a fake instance counts per token it would transfer in a reshard
NAMES = ("pc", "ia", "ib", "ic", "h1")


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
async def cluster(root: Path) -> AsyncIterator[Cluster]:
    sockets: dict[str, tuple[socket.socket, socket.socket | None]] = {n: bind_pair("127.0.0.1", 0, 1 << 20)
                                                                      for n in NAMES}
    uris = {n: f"https://127.0.0.1:{s[0].getsockname()[1]}/kvsp/" for n, s in sockets.items()}
    pki = make_pki(root, roles=uris)
    policy = policy_for(uris)
    status = StatusTable(time.monotonic, policy=LifecyclePolicy(SleepPolicy()), max_ttl_ms=60_000)
    service = IndexService(MemoryIndexStore(), clock=time.monotonic,
                           config=IndexConfig(geometry={C1: Geometry(BLOCK, 4)}), status=status)
    pc_client = KvspClient(pki.files("pc"), timeout=5.0)
    role = PlacementController(service, clock=time.monotonic, config=ControllerConfig(prefetch_deadline_ms=200),
                               metrics=Registry(), identity=uris["pc"])
    controller = ControllerService(role, HttpInstanceLink(pc_client))
    servers = [RoleServer(controller_app(service, controller, policy, base_path="/kvsp/", tick_interval=0.05),
                          pki.files("pc"))]
    instances = {n: FakeInstance(n, uris[n]) for n in ("ia", "ib", "ic")}
    servers += [RoleServer(inst.app(policy), pki.files(n)) for n, inst in instances.items()]
    clients = {n: KvspClient(pki.files(n), timeout=5.0) for n in ("pc", "ia", "ib", "ic", "alice")}
    try:
        for name, server in zip(("pc", "ia", "ib", "ic"), servers, strict=True):
            await server.start(sockets=sockets[name])
        sockets["h1"][0].close()
        if sockets["h1"][1] is not None:
            sockets["h1"][1].close()
        yield Cluster(uris["pc"], uris, service, controller, instances, clients)
    finally:
        for client in [*clients.values(), pc_client]:
            await client.aclose()
        for server in servers:
            await server.close()


@pytest.fixture
async def c(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with cluster(tmp_path) as found:
        yield found


def session_body(n: int = 1, blocks: int = 4) -> dict[str, Any]:
    prompt = list(range(100, 100 + blocks * BLOCK + 3))
    return {"session": str(uuid.UUID(int=n)), "scope_id": S1.hex(), "compat_id": C1.hex(), "prompt": prompt,
            "max_tokens": 16, "sampler": Sampler("top-p", 7, 0, False, {"p": 0.9}).to_json(),
            "block_keys": [bk(i).hex() for i in range(blocks)]}


def checkpoint(body: dict[str, Any], epoch: int, generated: list[int]) -> dict[str, Any]:
    return SessionCheckpoint(uuid.UUID(body["session"]), epoch, C1, S1, tuple(bk(i) for i in range(4)),
                             tuple(body["prompt"][64:]), tuple(generated), len(generated),
                             Sampler("top-p", 7, len(generated), False, {"p": 0.9})).to_json()


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


# -- sessions, placement, lifecycle -------------------------------------------------------------------------------


async def test_placement_checkpoints_failover_metrics(c: Cluster) -> None:
    h1 = c.uris["h1"]  # a holder every instance reports a link to
    for i in range(4):
        await c.service.publish(Principal(h1, frozenset({Role.HOLDER}), ALL), k.holder_id(h1), bk(i),
                                replica(i, holder=h1))

    # status: ia cheapest (idle), ib draining, ic queued
    assert (await c.report("ia", ttl_ms=600)).json() == {"state": "active"}
    assert (await c.report("ib", state=InstanceState.DRAINING)).json() == {"state": "draining"}
    assert (await c.report("ic", queued=2)).json() == {"state": "active"}
    stale = await c.report("ic", epoch=0)
    assert stale.status == 409 and stale.json()["type"].endswith("#kvsp-stale-epoch")

    body = session_body()
    created = await c.call("alice", "POST", "sessions", body)
    assert created.status == 201, created.content
    info = SessionInfo.from_json(created.json())
    assert (info.instance, info.epoch) == (c.uri("ia"), 1)
    assert created.headers["location"] == f"sessions/{body['session']}"
    ia, ib, ic = (c.instances[n] for n in ("ia", "ib", "ic"))
    directive, = ia.of("prefetch")  # loading overlaps the request: the directive comes before the start
    assert [b.block_key for b in directive.blocks] == [bk(i) for i in range(4)]
    assert directive.blocks[0].sources == (h1,) and directive.request_ref == body["session"]
    start, = ia.of("start")
    assert [kind for kind, _ in ia.calls] == ["prefetch", "start"]
    assert start.epoch == 1 and start.prompt == tuple(body["prompt"]) and len(start.blocks) == 4
    assert ib.calls == [] and ic.calls == []  # never a directive to the draining one
    again = await c.call("alice", "POST", "sessions", body)
    assert again.status == 200 and len(ia.of("start")) == 1

    # checkpoints: the current instance only, the current epoch only
    ack = await c.call("ia", "PUT", f"sessions/{body['session']}/checkpoint", checkpoint(body, 1, [1, 2, 3]))
    assert ack.json() == {"session": body["session"], "epoch": 1, "output_offset": 3}
    denied = await c.call("ic", "PUT", f"sessions/{body['session']}/checkpoint", checkpoint(body, 1, [1, 2, 3, 4]))
    assert denied.status == 403
    forbidden = await c.call("alice", "PUT", f"sessions/{body['session']}/checkpoint", checkpoint(body, 1, [1]))
    assert forbidden.status == 403  # not an instance

    # ia falls silent: its record (600 ms) expires -> failed -> the ticker resumes the session on ic, epoch 2
    async def moved() -> bool:
        got = await c.call("alice", "GET", f"sessions/{body['session']}")
        return bool(got.json()["epoch"] == 2 and got.json().get("instance") == c.uri("ic"))

    await wait_for(moved)
    resume, = ic.of("resume")
    assert resume.epoch == 2 and resume.checkpoint.generated == (1, 2, 3) and resume.max_tokens == 16
    late = await c.call("ia", "PUT", f"sessions/{body['session']}/checkpoint", checkpoint(body, 1, [1, 2, 3, 4]))
    assert late.status == 409 and late.json()["type"].endswith("#kvsp-stale-epoch")
    ok = await c.call("ic", "PUT", f"sessions/{body['session']}/checkpoint", checkpoint(body, 2, [1, 2, 3, 4]))
    assert ok.json()["output_offset"] == 4
    assert (await c.call("alice", "GET", f"sessions/{uuid.UUID(int=99)}")).status == 404

    # /metrics: any principal of the policy
    scraped = await c.call("alice", "GET", "metrics")
    assert scraped.status == 200 and scraped.headers["content-type"] == CONTENT_TYPE
    samples = check_format((scraped.content or b"").decode())
    assert samples['kvsp_migrations_total{component="controller"}'] == 1
    assert samples['kvsp_controller_sessions_total{outcome="placed"}'] == 1
    assert samples['kvsp_checkpoints_total{outcome="stale"}'] == 1
    assert samples['kvsp_instances{state="failed"}'] == 1 and samples['kvsp_instances{state="draining"}'] == 1
    assert samples['kvsp_prefetch_directives_total{outcome="accepted"}'] == 2  # the start, and the resume
    assert samples['kvsp_lookup_hit_ratio{component="controller"}'] == 1.0
    assert samples['kvsp_transfer_bytes_total{component="index",direction="in",transport="HTTP/3"}'] > 0
    assert samples["kvsp_migration_seconds_count"] == 1


async def test_lifecycle_over_http(c: Cluster) -> None:
    ia, ib = c.instances["ia"], c.instances["ib"]
    await c.report("ia", running=2)
    await c.report("ib", running=1)
    # ia may sleep: ib has 7 spare slots for ia's 2 sessions; then ib may not: ia is no longer active
    assert (await c.report("ia", running=2, requested_state=InstanceState.SLEEPING)).json() == {"state": "draining"}
    assert (await c.report("ib", running=1, requested_state=InstanceState.SLEEPING)).json() == {"state": "active"}
    created = await c.call("alice", "POST", "sessions", session_body(blocks=0) | {"block_keys": []})
    assert created.json()["instance"] == c.uri("ib") and ia.calls == []
    assert (await c.report("ia", state=InstanceState.DRAINING, running=0)).json() == {"state": "draining"}
    assert (await c.report("ia", state=InstanceState.SLEEPING)).json() == {"state": "sleeping"}
    assert (await c.report("ia")).json() == {"state": "sleeping"}  # only the PC wakes it
    # an operator (a principal with the controller role) wakes it through the PC: PUT state on the instance
    woke = await c.call("pc", "PUT", f"instances/{k.uri_id(c.uri('ia'))}/state", {"state": "active"})
    assert woke.json() == {"state": "active"} and ia.of("state") == [InstanceState.ACTIVE]
    assert (await c.report("ia")).json() == {"state": "active"}
    assert (await c.call("alice", "PUT", f"instances/{k.uri_id(c.uri('ia'))}/state", {"state": "active"})
            ).status == 403
    unknown = await c.call("pc", "PUT", f"instances/{k.uri_id('https://nobody.example/')}/state", {"state": "active"})
    assert unknown.status == 404
    listed = (await c.call("pc", "GET", "instances")).json()["instances"]
    assert {i["instance"]: i["state"] for i in listed} == {c.uri("ia"): "active", c.uri("ib"): "active"}
    # a start refused by an instance that is not active after all: the next one takes it, same epoch
    ib.state = InstanceState.DRAINING
    await c.report("ia", queued=3)
    created = await c.call("alice", "POST", "sessions", session_body(2, blocks=0) | {"block_keys": []})
    assert created.status == 201 and created.json()["instance"] == c.uri("ia") and created.json()["epoch"] == 1
    assert ib.of("refused start")[-1].session == uuid.UUID(int=2)


async def test_reshard_commit_and_abort(c: Cluster) -> None:
    ia, ib, ic = (c.instances[n] for n in ("ia", "ib", "ic"))
    v1 = {"map": "ctx-1", "version": 1, "shards": [{"tokens": [0, 4096], "instance": c.uri("ia")},
                                                  {"tokens": [4096, 8192], "instance": c.uri("ib")}]}
    assert (await c.call("pc", "PUT", "maps/ctx-1", v1)).status == 201
    ia.held, ib.held = set(range(0, 4096)), set(range(4096, 8192))
    # prefill is over: two instances become three; ia keeps [0, 2048), ib keeps [4096, 6144)
    v2 = {"map": "ctx-1", "version": 2, "deadline_ms": 2000,
          "shards": [{"tokens": [0, 2048], "instance": c.uri("ia")},
                     {"tokens": [2048, 4096], "instance": c.uri("ic")},
                     {"tokens": [4096, 6144], "instance": c.uri("ib")},
                     {"tokens": [6144, 8192], "instance": c.uri("ic")}]}
    outcome = (await c.call("pc", "PUT", "maps/ctx-1", v2)).json()
    assert outcome["outcome"] == "committed" and outcome["version"] == 2, outcome
    plan_a = next(m for m in ia.of("reshard") if isinstance(m, ReshardPlan))
    assert plan_a.retain == ((0, 2048),) and plan_a.fetch == () and plan_a.release == ((2048, 4096),)
    # retained ranges never move: nothing was fetched by ia and ib, and ic fetched exactly the moved half
    assert ia.fetched_bytes == ib.fetched_bytes == 0
    assert ic.fetched_bytes == 4096 * BYTES_PER_TOKEN
    assert ia.retained_bytes_moved == ib.retained_bytes_moved == ic.retained_bytes_moved == 0
    for inst in (ia, ib, ic):
        assert inst.of("reshard")[-1] == ReshardCommit("ctx-1", 2)
    assert (await c.call("pc", "GET", "maps/ctx-1")).json()["version"] == 2

    # back to two instances, but ic does not acknowledge within the deadline: abort, version 2 stays
    ic.reshard_delay = 1.5
    v3 = {"map": "ctx-1", "version": 3, "deadline_ms": 300,
          "shards": [{"tokens": [0, 4096], "instance": c.uri("ia")},
                     {"tokens": [4096, 8192], "instance": c.uri("ic")}]}
    started = time.monotonic()
    outcome = (await c.call("pc", "PUT", "maps/ctx-1", v3)).json()
    assert outcome["outcome"] == "aborted" and outcome["version"] == 2 and list(outcome["failed"]) == [c.uri("ic")]
    assert time.monotonic() - started < 1.2  # aborted at the deadline, not when ic answers
    for inst in (ia, ib):
        assert inst.of("reshard")[-1] == ReshardAbort("ctx-1", 3)
    assert (await c.call("pc", "GET", "maps/ctx-1")).json() == {k_: v for k_, v in v2.items() if k_ != "deadline_ms"}
    conflict = await c.call("pc", "PUT", "maps/ctx-1", dict(v3, version=5))
    assert conflict.status == 409 and conflict.json()["type"].endswith("#kvsp-plan-conflict")
    assert (await c.call("alice", "GET", "maps/ctx-1")).status == 403


async def test_holder_metrics_over_http(tmp_path: Path) -> None:
    d = small_descriptor()
    pki = make_pki(tmp_path, roles={"holder": "https://127.0.0.1/kvsp/"})
    policy = Policy.from_dict({"principal": [{"identity": "urn:kvsp:client:alice", "roles": ["client"]}]})
    registry = Registry()
    holder = Holder(HolderSettings("https://127.0.0.1/kvsp/", (d,)))
    holder.metrics["lease_rejections"] += 2
    server = RoleServer(holder_app(holder, policy, metrics=registry), pki.files("holder"))
    await server.start("127.0.0.1", 0)
    client = KvspClient(pki.files("alice"))
    try:
        first = await client.request("GET", server.base_uri("/kvsp/metrics"))
        assert first.status == 200 and first.http_version == "HTTP/3"
        second = await client.request("GET", server.base_uri("/kvsp/metrics"))
        samples = check_format((second.content or b"").decode())
        assert samples['kvsp_lease_rejections_total{component="holder"}'] == 2
        assert samples['kvsp_transfer_bytes_total{component="holder",direction="out",transport="HTTP/3"}'] == \
            len(first.content or b"")
        denied = await client.request("GET", server.base_uri("/kvsp/leases"))
        assert denied.status in (403, 404)
    finally:
        await client.aclose()
        await server.close()


# -- composition: configuration, the start hook, `kvsp-quic index` ----------------------------------------------


def test_controller_configuration() -> None:
    cfg = build(IndexFile, {"controller": {"start_hook": ["start-instance", "--gpu", "0"], "sleep": "never",
                                           "max_cost_us": 5000, "tick_ms": 50}})
    assert cfg.controller.start_hook == ["start-instance", "--gpu", "0"] and cfg.controller.max_cost_us == 5000.0
    assert build(IndexFile, {}).controller == ControllerConfig()
    for bad in ({"sleep": "sometimes"}, {"tick_ms": 0}, {"sleep_max_kv_utilization": 2}, {"unknown": 1}):
        with pytest.raises(ConfigError):
            build(IndexFile, {"controller": bad})


async def test_command_starter(tmp_path: Path) -> None:
    out = tmp_path / "started"
    script = "import os, sys; open(sys.argv[1], 'w').write(os.environ['KVSP_PC_URI'] + ' ' + " \
             "os.environ['KVSP_START_REASON'])"
    starter = CommandStarter([sys.executable, "-c", script, str(out)], pc_uri="https://pc.example/")
    await starter.start("no capacity")
    for _ in range(200):
        if out.exists() and out.read_text():
            break
        await asyncio.sleep(0.02)
    assert out.read_text() == "https://pc.example/ no capacity" and starter.started == 1
    await starter.settle(10)  # the hook has exited: no process outlives the test
    await starter.aclose()
    with pytest.raises(ValueError):
        CommandStarter([], pc_uri="https://pc.example/")


async def test_kvsp_quic_index_serves_the_controller(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(run_index(IndexFile(), dev_dir=tmp_path, stop=stop))
    ready: dict[str, Any] = {}
    for _ in range(250):
        out = capsys.readouterr().out
        if out:
            ready = json.loads(out.splitlines()[0])
            break
        assert not task.done()
        await asyncio.sleep(0.02)
    assert ready["ready"] == "index" and ready["controller"] is True
    client = KvspClient(TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"])))
    try:
        scraped = await client.request("GET", ready["metrics"])
        assert scraped.status == 200 and "kvsp_sessions{" in (scraped.content or b"").decode()
        assert (await client.request("GET", ready["base_uri"] + "instances")).json() == {"instances": []}
        refused = await client.request("POST", ready["base_uri"] + "sessions", content=json.dumps(
            session_body(blocks=0) | {"block_keys": []}).encode(), headers={"content-type": JSON_MEDIA_TYPE})
        assert refused.status == 503  # no instance reported yet
    finally:
        await client.aclose()
        stop.set()
        await task
