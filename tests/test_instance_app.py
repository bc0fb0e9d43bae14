"""The Inference Instance over real sockets (kvsp_http/instance_app.py and http3/instance_*.py, gpu/engine.py,
kvsp_quic/roles/instance*.py, assembled by kvsp_app/instance.py).

One RoleServer (HTTP/3 + HTTP/1.1/2, mutual TLS) serves the Index Service at ``/is/``, a Holder at ``/h1/`` and a
fake Placement Controller at ``/pc/`` (a tiny ASGI app that records status reports and checkpoints and answers
them); each instance is a RoleServer of its own (its resources, its replicas over HTTP and MOQT), built with
:func:`kvsp_app.instance.build_instance` around a tiny random model. Blocks reach the holder from a producer
prefill in the test; the instances publish what they load and compute, and load from each other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the gpu extra (safetensors) is not installed")

from gpu.engine import Engine  # noqa: E402
from gpu.generate import decode_step, generate_tokens  # noqa: E402
from gpu.kvcache import PagedKVCache  # noqa: E402
from gpu.model import LlamaModel  # noqa: E402
from gpu.modelfiles import ModelConfig, write_random_model  # noqa: E402
from gpu.prefill import prefill  # noqa: E402
from gpu.sampling import TokenSampler  # noqa: E402
from http3.client import KvspClient  # noqa: E402
from http3.server import RoleServer, bind_pair  # noqa: E402
from kvsp_app.instance import InstanceNode, build_instance  # noqa: E402
from kvsp_http.holder_app import holder_app  # noqa: E402
from kvsp_http.index_app import index_app  # noqa: E402
from kvsp_quic import container as c  # noqa: E402
from kvsp_quic.auth import ALL, Policy, Principal, Role  # noqa: E402
from kvsp_quic.compat import CompatDescriptor  # noqa: E402
from kvsp_quic.keys import BlockKeyer, holder_id, scope_id  # noqa: E402
from kvsp_quic.roles.holder import Holder, HolderSettings  # noqa: E402
from kvsp_quic.roles.index import IndexService  # noqa: E402
from kvsp_quic.roles.instance import InstanceOptions  # noqa: E402
from kvsp_quic.storage.memory_index import MemoryIndexStore  # noqa: E402
from kvsp_runtime.instance_service import ServiceOptions  # noqa: E402
from tests.asgi import Router, read_body  # noqa: E402
from tests.pki import TestPki, make_pki  # noqa: E402

B = 4
LAYERS = 4
SCOPE_KEY = bytes(range(32))
SCOPE = scope_id(SCOPE_KEY)
PROMPT = [(7 * i + 3) % 256 for i in range(6 * B + 3)]  # six complete blocks and three tokens
ADMIN = Principal("urn:test:admin", frozenset({Role.HOLDER}), ALL, ALL)
JSON = {"content-type": "application/kvsp+json"}
SERVER_IDENTITY = "https://127.0.0.1/"


def tiny_config() -> ModelConfig:
    return ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, head_dim=16, rope_theta=500000.0, dtype="float32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("model") / "tiny", tiny_config(), seed=5)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"), roles={"server": SERVER_IDENTITY})


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LlamaModel:
    return LlamaModel.load(model_dir)


def instance_policy() -> Policy:
    return Policy.from_dict({"principal": [
        {"identity": "urn:kvsp:client:alice", "roles": ["controller", "client"], "scopes": [SCOPE.hex()]},
        {"identity": "urn:kvsp:client:bob", "roles": ["client"], "scopes": [SCOPE.hex()]},
        {"identity": SERVER_IDENTITY, "roles": ["instance", "holder"], "scopes": "*"},
    ]})


# -- the infrastructure: Index Service, holder, fake PC -----------------------------------------------------------


class FakePC:
    """Records ``PUT instances/{id}/status`` and ``PUT sessions/{id}/checkpoint``; answers as told."""

    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.answer_state: Callable[[dict[str, Any]], str] = lambda record: record["state"]
        self.ack_gate: asyncio.Event | None = None  # checkpoints wait for it before their answer
        self.stale_from: int | None = None  # answer kvsp-stale-epoch to checkpoints with an epoch below this

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_body(receive)
        parts = scope["path"].strip("/").split("/")  # pc, instances|sessions, id, status|checkpoint
        obj = json.loads(body) if body else {}
        status, answer = 404, {}
        if scope["method"] == "PUT" and parts[1:2] == ["instances"] and parts[3:] == ["status"]:
            self.statuses.append(obj)
            status, answer = 200, {"state": self.answer_state(obj)}
        elif scope["method"] == "PUT" and parts[1:2] == ["sessions"] and parts[3:] == ["checkpoint"]:
            if self.ack_gate is not None:
                await self.ack_gate.wait()
            if self.stale_from is not None and obj["epoch"] < self.stale_from:
                status, answer = 409, {"type": "https://iana.org/assignments/kvsp#kvsp-stale-epoch",
                                       "title": "Stale Epoch", "status": 409}
            else:
                self.checkpoints.append(obj)
                status, answer = 200, {"session": obj["session"], "epoch": obj["epoch"],
                                       "output_offset": obj["output_offset"]}
        data = json.dumps(answer).encode()
        media = b"application/problem+json" if status >= 400 else b"application/kvsp+json"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", media), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


@dataclasses.dataclass
class Cluster:
    certs: TestPki
    model_dir: Path
    server: RoleServer
    router: Router
    index: IndexService
    holder: Holder
    pc: FakePC
    alice: KvspClient
    bob: KvspClient
    nodes: list[tuple[InstanceNode, RoleServer, Engine]] = dataclasses.field(default_factory=list)

    def uri(self, name: str) -> str:
        return self.server.base_uri(f"/{name}/")

    async def instance(self, *, controller: bool = True, warmup: int = 0, prefer_transport: str = "h3",
                       moqt: bool = True, **settings: Any) -> InstanceNode:
        engine = Engine.load(str(self.model_dir), block_tokens=B, device_pages=256)
        await engine.warmup(warmup)
        tcp, udp = bind_pair("127.0.0.1", 0, 1 << 20)
        base = f"https://127.0.0.1:{tcp.getsockname()[1]}/"
        node = build_instance(engine, base_uri=base, files=self.certs.files("server"), policy=instance_policy(),
                              scope_keys=[SCOPE_KEY], index=self.uri("is"), options=InstanceOptions(**settings),
                              service=ServiceOptions(controller=self.uri("pc") if controller else None,
                                                     request_timeout_ms=5000, prefer_transport=prefer_transport),
                              moqt=moqt)
        node.service.publisher.max_sleep = 0.05  # type: ignore[union-attr]
        server = RoleServer(node.app, self.certs.files("server"), quic_handlers=node.quic_handlers)
        await server.start(sockets=(tcp, udp))
        await node.start()
        self.nodes.append((node, server, engine))
        return node

    async def store(self, d: CompatDescriptor, key: bytes, sections: Sequence[tuple[bytes, bytes]]) -> None:
        body = c.encode(list(sections), first_layer=0, token_count=B, descriptor=d).tobytes()
        principal = Principal("urn:kvsp:client:alice", frozenset({Role.HOLDER}), ALL, ALL)
        record = self.holder.store(principal, d.compat_id, SCOPE, key, body, "*")
        await self.index.publish(ADMIN, holder_id(record.holder), key, record)


@pytest.fixture
async def cluster(certs: TestPki, model_dir: Path) -> AsyncIterator[Cluster]:
    router = Router()
    server = RoleServer(router, certs.files("server"))
    await server.start("127.0.0.1", 0)
    d = LlamaModel.load(model_dir).descriptor(B)
    policy = Policy.dev_ca()
    index = IndexService(MemoryIndexStore(), clock=time.monotonic)
    holder = Holder(HolderSettings(server.base_uri("/h1/"), (d,), replica_ttl_ms=60_000))
    pc = FakePC()
    router.apps["/is/"] = index_app(index, policy, base_path="/is/", sweep_interval=None)
    router.apps["/h1/"] = holder_app(holder, policy)
    router.apps["/pc/"] = pc
    alice = KvspClient(certs.files("alice"), timeout=10.0)
    bob = KvspClient(certs.files("bob"), timeout=10.0)
    cl = Cluster(certs, model_dir, server, router, index, holder, pc, alice, bob)
    try:
        yield cl
    finally:
        for node, srv, engine in reversed(cl.nodes):
            await node.aclose()
            await srv.close()
            engine.close()
        await alice.aclose()
        await bob.aclose()
        await server.close()


# -- helpers -----------------------------------------------------------------------------------------------------


def keys_of(tokens: Sequence[int], d: CompatDescriptor) -> list[bytes]:
    return [bytes(k) for k in BlockKeyer(SCOPE_KEY, d.compat_id, B).keys(tokens)]


async def produce(cl: Cluster, model: LlamaModel, prompt: Sequence[int], blocks: int) -> list[bytes]:
    """A producer's full prefill; its first *blocks* blocks stored at the holder and published."""
    d = model.descriptor(B)
    cache = PagedKVCache.for_descriptor(d, device_pages=64)
    result = await prefill(model, cache, prompt)
    keys = keys_of(prompt, d)
    for i in range(blocks):
        sections = [(bytes(k), bytes(v)) for k, v in cache.export_block(result.sequence.pages[i])]
        await cl.store(d, keys[i], sections)
    result.sequence.release()
    return keys


async def expected_tokens(model: LlamaModel, prompt: Sequence[int], n: int, sampler: TokenSampler, *,
                          forced: Sequence[int] = ()) -> list[int]:
    """The tokens of an uninterrupted run without any cache (its first tokens *forced*, as a checkpoint's)."""
    cache = PagedKVCache.for_descriptor(model.descriptor(B), device_pages=64)
    result = await prefill(model, cache, prompt)
    try:
        logits = result.logits
        for token in forced:
            sampler.sample(logits)
            logits = decode_step(model, result.sequence, token)
        rest = generate_tokens(model, dataclasses.replace(result, logits=logits), sampler,
                               max_new_tokens=n - len(forced)).tokens
        return [*forced, *rest]
    finally:
        result.sequence.release()


def start_body(sid: uuid.UUID, prompt: Sequence[int], *, max_tokens: int, epoch: int = 1,
               sampler: dict[str, Any] | None = None, blocks: list[dict[str, Any]] | None = None,
               d: CompatDescriptor) -> bytes:
    body: dict[str, Any] = {
        "session": str(sid), "epoch": epoch, "scope_id": SCOPE.hex(), "compat_id": d.compat_id.hex(),
        "prompt": list(prompt), "max_tokens": max_tokens,
        "sampler": sampler or {"method": "greedy", "seed": 0, "step": 0, "deterministic": True}}
    if blocks is not None:
        body["blocks"] = blocks
    return json.dumps(body).encode()


async def post(client: KvspClient, url: str, body: Any, method: str = "POST") -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await client.request(method, url, content=data, headers=JSON)


async def read_stream(client: KvspClient, url: str) -> list[dict[str, Any]]:
    lines = []
    async with client.stream("GET", url) as response:
        assert response.status == 200, await response.aread()
        assert (response.headers.get("content-type") or "").startswith("application/x-ndjson")
        buffer = b""
        async for chunk in response.aiter_bytes():
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            lines += [json.loads(x) for x in complete if x.strip()]
    return lines


def tokens_of(lines: list[dict[str, Any]]) -> list[int]:
    assert lines and lines[-1].get("done"), lines[-3:]
    body = lines[:-1]
    assert [x["index"] for x in body] == list(range(body[0]["index"], body[0]["index"] + len(body)))
    return [x["token"] for x in body]


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def lookup(cl: Cluster, d: CompatDescriptor, keys: Sequence[bytes]) -> dict[str, Any]:
    r = await post(cl.alice, f"{cl.uri('is')}lookup", {"scope_id": SCOPE.hex(), "compat_id": d.compat_id.hex(),
                                                       "block_keys": [k.hex() for k in keys]})
    assert r.status == 200, r.content
    return r.json()  # type: ignore[no-any-return]


async def directive_state(cl: Cluster, node: InstanceNode, directive: uuid.UUID) -> dict[str, Any]:
    url = f"{node.role.settings.base_uri}prefetch/{directive}"
    while True:
        r = await cl.alice.request("GET", url)
        assert r.status == 200, r.content
        state = r.json()
        if state["state"] != "pending":
            return state  # type: ignore[no-any-return]
        await asyncio.sleep(0.02)


# -- blocks over the TCP path ----------------------------------------------------------------------------------------


async def test_with_the_tcp_path_preferred_blocks_load_over_http_1_1_and_the_tokens_equal_a_recompute(
        cluster: Cluster, reference: LlamaModel) -> None:
    cl = cluster
    d = reference.descriptor(B)
    keys = await produce(cl, reference, PROMPT, 6)
    node = await cl.instance(prefer_transport="tcp", moqt=False)
    assert node.client.transport_for(cl.uri("h1")) == "tcp"
    base = node.role.settings.base_uri
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(
        sid, PROMPT, max_tokens=6, d=d, blocks=[{"block_key": k.hex(), "sources": [cl.uri("h1")]} for k in keys]))
    assert r.status == 201, r.content
    lines = await read_stream(cl.alice, f"{base}sessions/{sid}/tokens?from=0")
    assert tokens_of(lines) == await expected_tokens(reference, PROMPT, 6, TokenSampler("greedy"))
    session = node.role.sessions.get(sid)
    assert session.loaded_blocks == 6 and session.block_sources == {"HTTP/1.1": 6}


# -- prefetch, then a session that uses the loaded blocks ----------------------------------------------------------


async def test_prefetch_loads_from_a_holder_then_a_session_uses_them_and_equals_a_run_without_cache(
        cluster: Cluster, reference: LlamaModel) -> None:
    cl = cluster
    d = reference.descriptor(B)
    keys = await produce(cl, reference, PROMPT, 6)
    node = await cl.instance()
    base = node.role.settings.base_uri
    directive = uuid.uuid4()
    body = {"directive": str(directive), "request_ref": "r1", "scope_id": SCOPE.hex(), "compat_id": d.compat_id.hex(),
            "blocks": [{"block_key": k.hex(), "sources": [cl.uri("h1")]} for k in keys[:6]],
            "layer_order": "ascending", "deadline_ms": 5000, "lease_ms": 2000}
    r = await post(cl.alice, f"{base}prefetch", body)
    assert r.status == 202, r.content
    assert r.headers["location"] == f"prefetch/{directive}" and r.headers["cache-control"] == "no-store"
    state = await directive_state(cl, node, directive)
    assert state == {"directive": str(directive), "state": "complete", "loaded": [k.hex() for k in keys[:6]]}
    metrics = node.service.fetcher.metrics
    assert metrics.leases_taken == 6 and metrics.leases_released == 6 and metrics.digest_failures == 0
    assert len(cl.holder.leases) == 0
    # the instance publishes its new replicas with their residency
    mine: list[Any] = []
    for _ in range(200):
        found = await lookup(cl, d, keys[:6])
        mine = [r for m in found["blocks"] for r in m["replicas"] if r["holder"] == base]
        if len(mine) == 6:
            break
        await asyncio.sleep(0.02)
    assert len(mine) == 6 and all(r["residency"] == [{"tier": "device", "layers": [0, LAYERS - 1]}]
                                  for r in mine)
    assert sum(1 for m in found["blocks"] for r in m["replicas"] if r["holder"].startswith("moqt://")) == 6
    # a re-sent directive is idempotent
    r = await post(cl.alice, f"{base}prefetch", body)
    assert r.status == 202 and r.json()["state"] == "complete"
    gets = cl.router.block_gets
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(
        sid, PROMPT, max_tokens=10, d=d, blocks=[{"block_key": k.hex(), "sources": [cl.uri("h1"), base]}
                                                  for k in keys[:6]]))
    assert r.status == 201, r.content
    assert r.json() == {"session": str(sid), "epoch": 1, "output_offset": 0}
    lines = await read_stream(cl.alice, f"{base}sessions/{sid}/tokens?from=0")
    assert tokens_of(lines) == await expected_tokens(reference, PROMPT, 10, TokenSampler("greedy"))
    assert lines[-1] == {"index": 10, "epoch": 1, "done": True, "reason": "length"}
    session = node.role.sessions.get(sid)
    assert session.loaded_blocks == 6 and cl.router.block_gets == gets  # nothing fetched again
    r = await cl.alice.request("GET", f"{base}sessions/{sid}")
    info = r.json()
    assert info["state"] == "done" and info["output_offset"] == info["released"] == 10
    assert info["block_sources"] == {"resident": 6} and info["computed_tokens"] == 3 and info["ttft_ms"] > 0
    metrics = (await cl.bob.request("GET", f"{base}metrics")).content.decode()
    assert 'kvsp_fetched_tokens_total{component="instance"} 24' in metrics
    assert 'kvsp_recomputed_tokens_total{component="instance"} 3' in metrics
    assert 'kvsp_transfer_bytes_total{component="retrieval",direction="in",transport="HTTP/3"}' in metrics
    # a later reader from the middle
    lines = await read_stream(cl.alice, f"{base}sessions/{sid}/tokens?from=7")
    assert [x["index"] for x in lines] == [7, 8, 9, 10]


async def test_a_directive_past_its_deadline_is_partial_and_stops_loading(cluster: Cluster,
                                                                          reference: LlamaModel) -> None:
    cl = cluster
    d = reference.descriptor(B)
    keys = await produce(cl, reference, PROMPT, 6)
    node = await cl.instance()
    base = node.role.settings.base_uri
    held = keys[0]
    # one block is resident already (a session left it): it counts as loaded at once
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(sid, PROMPT[:B + 1], max_tokens=1, d=d,
                                                                       blocks=[]))
    assert r.status == 201
    await read_stream(cl.alice, f"{base}sessions/{sid}/tokens")
    assert node.service.holder.holds(held)
    cl.router.block_delay = 1.0  # every block GET at the holder now takes a second
    directive = uuid.uuid4()
    body = {"directive": str(directive), "scope_id": SCOPE.hex(), "compat_id": d.compat_id.hex(),
            "blocks": [{"block_key": k.hex(), "sources": [cl.uri("h1")]} for k in keys[:6]],
            "deadline_ms": 300, "lease_ms": 2000}
    started = time.monotonic()
    r = await post(cl.alice, f"{base}prefetch", body)
    assert r.status == 202 and r.json()["loaded"] == [held.hex()]
    state = await directive_state(cl, node, directive)
    assert time.monotonic() - started < 0.9
    assert state == {"directive": str(directive), "state": "partial", "loaded": [held.hex()]}
    await until(lambda: len(node.service.loads) == 0)  # the loads were cancelled
    assert all(not node.service.holder.holds(k) for k in keys[1:6])
    await until(lambda: len(cl.holder.leases) == 0)  # and their leases released
    # a directive for blocks nobody has fails
    cl.router.block_delay = 0.0
    other = uuid.uuid4()
    body = dict(body, directive=str(other), blocks=[{"block_key": "ab" * 32, "sources": [cl.uri("h1")]}])
    assert (await post(cl.alice, f"{base}prefetch", body)).status == 202
    assert (await directive_state(cl, node, other))["state"] == "failed"
    r = await cl.alice.request("GET", f"{base}prefetch/{uuid.uuid4()}")
    assert r.status == 404 and r.json()["type"].endswith("kvsp-not-found")


async def test_draining_finishes_sessions_refuses_new_ones_then_sleeps_until_the_pc_wakes_it(
        cluster: Cluster, reference: LlamaModel) -> None:
    cl = cluster
    d = reference.descriptor(B)
    node = await cl.instance(status_ttl_ms=300)
    base = node.role.settings.base_uri
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=12, d=d))
    assert r.status == 201
    r = await post(cl.alice, f"{base}state", {"state": "draining"}, "PUT")
    assert r.status == 200 and r.json() == {"state": "draining"}
    refused = uuid.uuid4()
    r = await post(cl.alice, f"{base}sessions/{refused}/start", start_body(refused, PROMPT, max_tokens=2, d=d))
    assert r.status == 409 and r.json()["type"] == "https://iana.org/assignments/kvsp#kvsp-invalid-state"
    r = await post(cl.alice, f"{base}prefetch", {
        "directive": str(uuid.uuid4()), "scope_id": SCOPE.hex(), "compat_id": d.compat_id.hex(),
        "blocks": [{"block_key": "ab" * 32, "sources": [cl.uri("h1")]}], "deadline_ms": 100, "lease_ms": 100})
    assert r.status == 409
    lines = await read_stream(cl.alice, f"{base}sessions/{sid}/tokens")  # the admitted session completes
    assert tokens_of(lines) == await expected_tokens(reference, PROMPT, 12, TokenSampler("greedy"))
    await until(lambda: node.role.lifecycle.state.value == "sleeping")
    await until(lambda: any(s["state"] == "sleeping" for s in cl.pc.statuses))  # and it reports it
    r = await post(cl.alice, f"{base}sessions/{refused}/start", start_body(refused, PROMPT, max_tokens=2, d=d))
    assert r.status == 409
    r = await post(cl.alice, f"{base}state", {"state": "active"}, "PUT")
    assert r.json() == {"state": "active"}
    r = await post(cl.alice, f"{base}sessions/{refused}/start", start_body(refused, PROMPT, max_tokens=2, d=d))
    assert r.status == 201
    r = await post(cl.alice, f"{base}state", {"state": "failed"}, "PUT")
    assert r.status == 409
    records = [s for s in cl.pc.statuses if s["instance"] == base]
    assert {s["epoch"] for s in records} == {node.role.epoch} and all(s["ttl_ms"] == 300 for s in records)
    assert [x.value for x in node.role.lifecycle.history] == ["active", "draining", "sleeping", "active"]


async def test_status_reports_every_third_of_the_ttl_and_an_idle_instance_asks_to_sleep(
        cluster: Cluster) -> None:
    cl = cluster
    cl.pc.answer_state = lambda record: "draining" if record.get("requested_state") == "sleeping" else record["state"]
    node = await cl.instance(status_ttl_ms=300, sleep_after_idle_ms=500, warmup=2 * B)
    base = node.role.settings.base_uri
    started = time.monotonic()
    await until(lambda: node.role.lifecycle.state.value == "sleeping", timeout=5)
    elapsed = time.monotonic() - started
    mine = [s for s in cl.pc.statuses if s["instance"] == base]
    assert elapsed >= 0.45
    assert len(mine) >= 3 and len(mine) <= elapsed / 0.1 + 2  # about every 100 ms (a third of 300 ms)
    assert mine[0]["requested_state"] is None and mine[0]["state"] == "active"
    assert mine[0]["prefill_tokens_per_s"] > 0 and mine[0]["decode_tokens_per_s"] > 0
    assert any(s["requested_state"] == "sleeping" for s in mine)
    await until(lambda: cl.pc.statuses[-1]["state"] == "sleeping")
    r = await cl.alice.request("GET", f"{base}status")
    assert r.status == 200 and r.json()["state"] == "sleeping" and r.json()["epoch"] == node.role.epoch
    assert r.json()["batch_size"] == 4 and 0 <= r.json()["kv_utilization"] <= 1


async def published_by(cl: Cluster, d: CompatDescriptor, keys: Sequence[bytes], holder: str) -> None:
    for _ in range(300):
        found = await lookup(cl, d, keys)
        if found["matched"] == len(keys) and all(any(r["holder"] == holder for r in m["replicas"])
                                                 for m in found["blocks"]):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{holder} did not publish the blocks")


async def test_checkpoints_reach_the_pc_and_a_resume_elsewhere_continues_exactly(cluster: Cluster,
                                                                                 reference: LlamaModel) -> None:
    cl = cluster
    d = reference.descriptor(B)
    a = await cl.instance()
    b = await cl.instance()
    a_uri, b_uri = a.role.settings.base_uri, b.role.settings.base_uri
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{a_uri}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=16, d=d))
    assert r.status == 201
    tokens = tokens_of(await read_stream(cl.alice, f"{a_uri}sessions/{sid}/tokens"))
    assert tokens == await expected_tokens(reference, PROMPT, 16, TokenSampler("greedy"))
    await until(lambda: a.role.sessions.get(sid).checkpoints_settled)
    cps = [x for x in cl.pc.checkpoints if x["session"] == str(sid)]
    # a block of generated tokens completes at lengths 28, 32, 36, 40; the last checkpoint covers everything
    offsets = [x["output_offset"] for x in cps]
    assert offsets == sorted(set(offsets)) and set(offsets) <= {1, 5, 9, 13, 16} and offsets[-1] == 16
    assert cps[-1].get("done") is True and not any(x.get("done") for x in cps[:-1])
    keys = keys_of(PROMPT, d)
    for x in cps:
        n = x["output_offset"]
        assert x["epoch"] == 1 and x["generated"] == tokens[:n] and x["prompt_tail"] == PROMPT[6 * B:]
        assert x["prompt_blocks"] == [k.hex() for k in keys] and x["scope_id"] == SCOPE.hex()
        assert x["sampler"] == {"method": "greedy", "seed": 0, "step": n, "deterministic": True, "params": {}}
    # A published its prompt blocks and the generated blocks (10 complete blocks of 43 tokens, the last undecoded)
    all_keys = keys_of(PROMPT + tokens, d)
    await published_by(cl, d, all_keys[:10], a_uri)
    for epoch, offset, loaded in ((2, 9, 8), (3, 11, 9)):
        cp = next(x for x in cps if x["output_offset"] >= offset)
        cp = dict(cp, generated=cp["generated"][:offset], output_offset=offset,
                  sampler=dict(cp["sampler"], step=offset))
        r = await post(cl.alice, f"{b_uri}sessions/{sid}/resume", {"epoch": epoch, "checkpoint": cp,
                                                                   "max_tokens": 16})
        assert r.status == 200, r.content
        assert r.json() == {"session": str(sid), "epoch": epoch, "output_offset": offset}
        lines = await read_stream(cl.alice, f"{b_uri}sessions/{sid}/tokens?from=0")
        assert tokens_of(lines) == tokens  # the checkpoint's tokens, then the continuation: identical
        assert {x["epoch"] for x in lines} == {epoch}
        session = b.role.sessions.get(sid)
        assert session.loaded_blocks == loaded  # 6 prompt blocks and the generated blocks A published
        assert sum(session.block_sources.values()) == loaded
    transports = b.service.fetcher.metrics.bytes_by_transport
    assert any(t.startswith("MOQT") for t in transports), transports  # A's moqt:// replicas first
    # fencing: a lower epoch is refused; the same request again is answered as before
    r = await post(cl.alice, f"{b_uri}sessions/{sid}/resume", {"epoch": 2, "checkpoint": dict(cps[2], epoch=1)})
    assert r.status == 409 and r.json()["type"].endswith("kvsp-stale-epoch")
    await until(lambda: b.role.sessions.get(sid).checkpoints_settled)
    b_cps = [x for x in cl.pc.checkpoints if x["session"] == str(sid) and x["epoch"] == 3]
    assert b_cps and b_cps[-1]["output_offset"] == 16 and b_cps[-1]["generated"] == tokens
    # a prompt block nobody holds, and no prompt to recompute it: the session fails with reason "error"
    lost = uuid.uuid4()
    other = [(5 * i + 1) % 256 for i in range(2 * B + 1)]
    cp = {"session": str(lost), "epoch": 1, "compat_id": d.compat_id.hex(), "scope_id": SCOPE.hex(),
          "prompt_blocks": [k.hex() for k in keys_of(other, d)], "prompt_tail": other[2 * B:], "generated": [7],
          "output_offset": 1, "sampler": {"method": "greedy", "seed": 0, "step": 1, "deterministic": True}}
    r = await post(cl.alice, f"{b_uri}sessions/{lost}/resume", {"epoch": 2, "checkpoint": cp, "max_tokens": 4})
    assert r.status == 200
    lines = await read_stream(cl.alice, f"{b_uri}sessions/{lost}/tokens")
    assert lines[-1]["done"] and lines[-1]["reason"] == "error" and "unknown" in lines[-1]["detail"]
    # with the prompt (extension member) the missing blocks are recomputed
    r = await post(cl.alice, f"{b_uri}sessions/{lost}/resume", {"epoch": 3, "checkpoint": cp, "max_tokens": 4,
                                                                "prompt": other})
    assert r.status == 200
    continued = tokens_of(await read_stream(cl.alice, f"{b_uri}sessions/{lost}/tokens"))
    assert continued == await expected_tokens(reference, other, 4, TokenSampler("greedy"), forced=[7])


async def test_top_p_tokens_are_released_only_once_a_checkpoint_covering_them_is_acknowledged(
        cluster: Cluster, reference: LlamaModel) -> None:
    cl = cluster
    d = reference.descriptor(B)
    cl.pc.ack_gate = asyncio.Event()
    node = await cl.instance(checkpoint_tokens=3)
    base = node.role.settings.base_uri
    sid = uuid.uuid4()
    sampler = {"method": "top-p", "params": {"p": 0.9, "temperature": 1.0}, "seed": 7, "step": 0,
               "deterministic": False}
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=10, d=d,
                                                                       sampler=sampler))
    assert r.status == 201
    received: list[dict[str, Any]] = []

    async def reader() -> None:
        async with cl.bob.stream("GET", f"{base}sessions/{sid}/tokens?from=0") as response:
            assert response.status == 200
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                received.extend(json.loads(x) for x in complete if x.strip())

    task = asyncio.create_task(reader())
    session = node.role.sessions.get(sid)
    await until(lambda: session.phase.finished)
    await asyncio.sleep(0.1)
    assert len(session.output) == 10 and received == []  # generated, but nothing acknowledged: nothing released
    cl.pc.ack_gate.set()
    await asyncio.wait_for(task, 10)
    want = await expected_tokens(reference, PROMPT, 10, TokenSampler("top-p", params={"p": 0.9, "temperature": 1.0},
                                                                     seed=7))
    assert tokens_of(received) == want
    cps = [x for x in cl.pc.checkpoints if x["session"] == str(sid)]
    offsets = [x["output_offset"] for x in cps]
    assert offsets == sorted(set(offsets)) and offsets[-1] == 10
    assert all(x["sampler"]["step"] == x["output_offset"] and x["sampler"]["deterministic"] is False for x in cps)


async def test_a_stale_epoch_answer_fences_the_session(cluster: Cluster, reference: LlamaModel) -> None:
    cl = cluster
    d = reference.descriptor(B)
    cl.pc.stale_from = 2  # the PC moved every session to epoch 2 elsewhere
    node = await cl.instance()
    base = node.role.settings.base_uri
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=40, d=d))
    assert r.status == 201
    lines = await read_stream(cl.alice, f"{base}sessions/{sid}/tokens")
    assert not any(x.get("done") for x in lines)  # no final line: the front end asks the PC
    session = node.role.sessions.get(sid)
    assert session.phase.value == "superseded" and len(session.output) < 40
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=4, d=d))
    assert r.status == 409 and r.json()["type"].endswith("kvsp-stale-epoch")


async def test_directives_and_sessions_only_from_the_controller(cluster: Cluster, reference: LlamaModel) -> None:
    cl = cluster
    d = reference.descriptor(B)
    node = await cl.instance(controller=False)
    base = node.role.settings.base_uri
    sid = uuid.uuid4()
    for method, path, body in (("POST", "prefetch", {}), ("POST", f"sessions/{sid}/start", {}),
                               ("PUT", "state", {"state": "draining"}), ("POST", "reshard", {})):
        r = await post(cl.bob, f"{base}{path}", body, method)
        assert r.status == 403, (path, r.content)
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=3, d=d))
    assert r.status == 201
    assert len(tokens_of(await read_stream(cl.bob, f"{base}sessions/{sid}/tokens"))) == 3  # bob reads (client)
    r = await cl.bob.request("PUT", f"{base}blocks/{d.compat_id.hex()}/{SCOPE.hex()}/{'ab' * 32}", content=b"x")
    assert r.status == 404  # an instance does not offer PUT blocks
    foreign = uuid.uuid4()
    body = json.loads(start_body(foreign, PROMPT, max_tokens=3, d=d))
    body["scope_id"] = "ff" * 16
    r = await post(cl.alice, f"{base}sessions/{foreign}/start", body)
    assert r.status == 403 and r.json()["type"].endswith("kvsp-scope-denied")


async def test_reshard_fetches_from_the_named_instance_retains_in_place_commits_and_aborts(
        cluster: Cluster, reference: LlamaModel) -> None:
    cl = cluster
    d = reference.descriptor(B)
    a = await cl.instance(controller=False)
    b = await cl.instance(controller=False)
    a_uri, b_uri = a.role.settings.base_uri, b.role.settings.base_uri
    sid = uuid.uuid4()
    await post(cl.alice, f"{a_uri}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=1, d=d))
    await read_stream(cl.alice, f"{a_uri}sessions/{sid}/tokens")
    keys = keys_of(PROMPT, d)
    await published_by(cl, d, keys, a_uri)
    context = {"compat_id": d.compat_id.hex(), "scope_id": SCOPE.hex(), "block_keys": [k.hex() for k in keys]}
    plan = {"map": "m1", "from": 0, "to": 1, "deadline_ms": 5000, "retain": [],
            "fetch": [{"tokens": [0, 24], "from": a_uri}], "release": [], "context": context}
    r = await post(cl.alice, f"{b_uri}reshard", plan)
    assert r.status == 200, r.content
    assert r.json() == {"map": "m1", "from": 0, "to": 1, "acknowledged": True}
    assert all(b.service.holder.holds(k) for k in keys)
    fetched = sum(b.service.fetcher.metrics.bytes_by_transport.values())
    assert fetched > 0
    r = await post(cl.alice, f"{b_uri}reshard", {"map": "m1", "commit": 1})
    assert r.json() == {"map": "m1", "version": 1}
    r = await post(cl.alice, f"{b_uri}reshard", {"map": "m1", "from": 1, "to": 2, "deadline_ms": 100,
                                                 "retain": [[0, 16]], "release": [[16, 24]]})
    assert r.status == 200
    assert sum(b.service.fetcher.metrics.bytes_by_transport.values()) == fetched  # retained: no transfer
    r = await post(cl.alice, f"{b_uri}reshard", {"map": "m1", "commit": 2})
    assert r.json() == {"map": "m1", "version": 2}
    assert sorted(i for m, i in b.service.resharding.pins if m == "m1") == [0, 1, 2, 3]  # released blocks let go
    r = await post(cl.alice, f"{b_uri}reshard", {"map": "m1", "from": 5, "to": 6, "deadline_ms": 100})
    assert r.status == 409 and r.json()["type"].endswith("kvsp-plan-conflict")
    # a fetch that cannot be done: no acknowledgement, version 2 stays until the PC aborts
    nobody = keys_of([(3 * i + 2) % 256 for i in range(2 * B)], d)
    r = await post(cl.alice, f"{b_uri}reshard", {
        "map": "m2", "from": 0, "to": 1, "deadline_ms": 300, "fetch": [{"tokens": [0, 8], "from": a_uri}],
        "context": dict(context, block_keys=[k.hex() for k in nobody])})
    assert r.status == 503
    r = await post(cl.alice, f"{b_uri}reshard", {"map": "m2", "commit": 1})
    assert r.status == 409
    r = await post(cl.alice, f"{b_uri}reshard", {"map": "m2", "abort": 1})
    assert r.json() == {"map": "m2", "version": 0}
    r = await post(cl.alice, f"{b_uri}reshard", {"map": "m1", "from": 2, "to": 3, "deadline_ms": 100,
                                                 "fetch": [{"tokens": [0, 6], "from": a_uri}], "context": context})
    assert r.status == 400  # ranges are whole blocks


async def test_a_start_right_after_a_directive_follows_its_loads_instead_of_fetching_again(
        cluster: Cluster, reference: LlamaModel) -> None:
    cl = cluster
    d = reference.descriptor(B)
    keys = await produce(cl, reference, PROMPT, 6)
    node = await cl.instance()
    base = node.role.settings.base_uri
    cl.router.block_delay = 0.2  # the blocks are still arriving when the session starts
    listed = [{"block_key": k.hex(), "sources": [cl.uri("h1")]} for k in keys[:6]]
    directive = uuid.uuid4()
    r = await post(cl.alice, f"{base}prefetch", {
        "directive": str(directive), "scope_id": SCOPE.hex(), "compat_id": d.compat_id.hex(), "blocks": listed,
        "deadline_ms": 5000, "lease_ms": 5000, "request_ref": "s"})
    assert r.status == 202
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=6, d=d,
                                                                       blocks=listed))
    assert r.status == 201
    lines = await read_stream(cl.alice, f"{base}sessions/{sid}/tokens")
    assert tokens_of(lines) == await expected_tokens(reference, PROMPT, 6, TokenSampler("greedy"))
    info = (await cl.alice.request("GET", f"{base}sessions/{sid}")).json()
    assert info["block_sources"] == {"prefetch": 6}, info
    assert cl.router.block_gets == 6  # each block crossed the network once
    assert (await directive_state(cl, node, directive))["state"] == "complete"


async def test_a_start_following_a_directive_whose_lookup_outlasts_its_deadline_recomputes(
        cluster: Cluster, reference: LlamaModel) -> None:
    """The directive reserves its blocks (a session start follows them), then its lookup outlasts its deadline: no
    load is ever begun. The session recomputes those blocks instead of waiting for them until it is cancelled
    (found by ``kvsp-quic chaos``: prefills that waited ~30 s, until the PC cancelled the session)."""
    cl = cluster
    d = reference.descriptor(B)
    keys = await produce(cl, reference, PROMPT, 6)
    node = await cl.instance()
    base = node.role.settings.base_uri
    cl.router.lookup_delay = 1.0  # every lookup at the Index Service now takes a second
    listed = [{"block_key": k.hex(), "sources": [cl.uri("h1")]} for k in keys[:6]]
    directive = uuid.uuid4()
    r = await post(cl.alice, f"{base}prefetch", {
        "directive": str(directive), "scope_id": SCOPE.hex(), "compat_id": d.compat_id.hex(), "blocks": listed,
        "deadline_ms": 300, "lease_ms": 2000})
    assert r.status == 202
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=4, d=d,
                                                                       blocks=listed))
    assert r.status == 201
    lines = await asyncio.wait_for(read_stream(cl.alice, f"{base}sessions/{sid}/tokens"), 30)
    assert tokens_of(lines) == await expected_tokens(reference, PROMPT, 4, TokenSampler("greedy"))
    assert (await directive_state(cl, node, directive))["state"] in ("partial", "failed")
