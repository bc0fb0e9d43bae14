"""The Index Service + Placement Controller over real sockets (kvsp_http.controller_app behind RoleServer, mutual TLS),
with fake inference instances: tiny ASGI apps behind RoleServer that record the PC's directives, take sessions,
and count the octets a reshard would move. Also ``/metrics`` on the PC and on a holder."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_app.config import ConfigError, IndexFile, build
from kvsp_app.serve import run_index
from kvsp_http.app_kit import JSON_MEDIA_TYPE
from kvsp_http.holder_app import holder_app
from kvsp_quic import keys as k
from kvsp_quic.auth import ALL, Policy, Principal, Role
from kvsp_quic.compat import InstanceState
from kvsp_quic.metrics import CONTENT_TYPE, Registry
from kvsp_quic.records import (
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
)
from kvsp_quic.roles.controller import ControllerConfig
from kvsp_quic.roles.controller_records import SessionInfo
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_runtime.controller_link import CommandStarter
from quic.tls import TlsFiles
from tests.pki import make_pki
from tests.support.descriptors import small_descriptor
from tests.support.index import bk, replica
from tests.support.metrics import check_format
from tests.support.pc_app import (
    BYTES_PER_TOKEN,
    Cluster,
    checkpoint,
    cluster,
    session_body,
)
from tests.support.waits import until


@pytest.fixture
async def c(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with cluster(tmp_path) as found:
        yield found


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

    await until(moved)
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
