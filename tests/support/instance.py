"""The instance cluster (needs the gpu extra): one RoleServer serving the Index Service at ``/is/``, a holder at
``/h1/`` and a fake Placement Controller at ``/pc/``, and :class:`Cluster` building real instances around a tiny
random model (kvsp_app.instance.build_instance); the helpers of the tests that drive them (start bodies, token
streams, lookups, a producer's prefill, the tokens of a run without cache). The fixtures (``model_dir``,
``reference``, ``instance_cluster``) are tests/conftest.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the gpu extra (safetensors) is not installed")

from gpu.engine import Engine  # noqa: E402
from gpu.generate import decode_step, generate_tokens  # noqa: E402
from gpu.kvcache import PagedKVCache  # noqa: E402
from gpu.model import LlamaModel  # noqa: E402
from gpu.modelfiles import ModelConfig  # noqa: E402
from gpu.prefill import prefill  # noqa: E402
from gpu.sampling import TokenSampler  # noqa: E402
from http3.client import KvspClient  # noqa: E402
from http3.server import RoleServer, bind_pair  # noqa: E402
from kvsp_app.instance import InstanceNode, build_instance  # noqa: E402
from kvsp_quic import container as c  # noqa: E402
from kvsp_quic.auth import ALL, Policy, Principal, Role  # noqa: E402
from kvsp_quic.compat import CompatDescriptor  # noqa: E402
from kvsp_quic.keys import BlockKeyer, holder_id, scope_id  # noqa: E402
from kvsp_quic.roles.holder import Holder  # noqa: E402
from kvsp_quic.roles.index import IndexService  # noqa: E402
from kvsp_quic.roles.instance import InstanceOptions  # noqa: E402
from kvsp_runtime.instance_service import ServiceOptions  # noqa: E402
from tests.asgi import Router, read_body  # noqa: E402
from tests.pki import TestPki  # noqa: E402

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


def instance_policy() -> Policy:
    return Policy.from_dict({"principal": [
        {"identity": "urn:kvsp:client:alice", "roles": ["controller", "client"], "scopes": [SCOPE.hex()]},
        {"identity": "urn:kvsp:client:bob", "roles": ["client"], "scopes": [SCOPE.hex()]},
        {"identity": SERVER_IDENTITY, "roles": ["instance", "holder"], "scopes": "*"},
    ]})


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
