"""Exact across engines: instances of the reference engine and of the transformers engine (gpu/hf_engine.py) over
real sockets (RoleServers with mutual TLS, an Index Service, a Placement Controller double that records
checkpoints), on model directories written by transformers itself.

A prompt one engine computed and published is loaded by the other over HTTP/3 or MOQT; the loading engine's
next-token logits then equal its own full recompute (fp32: within 1e-5; bf16: the greedy tokens are identical),
in both orders. A session checkpointed on one engine resumes on the other with nothing lost or duplicated.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
pytest.importorskip("transformers", reason="the test extra (transformers) is not installed")

from gpu.engine import Engine  # noqa: E402
from gpu.generate import generate_tokens  # noqa: E402
from gpu.sampling import TokenSampler  # noqa: E402
from http3.client import KvspClient  # noqa: E402
from http3.server import RoleServer, bind_pair  # noqa: E402
from kvsp_app.instance import InstanceNode, build_instance  # noqa: E402
from kvsp_http.index_app import index_app  # noqa: E402
from kvsp_quic.auth import Policy  # noqa: E402
from kvsp_quic.compat import CompatDescriptor  # noqa: E402
from kvsp_quic.keys import BlockKeyer  # noqa: E402
from kvsp_quic.roles.index import IndexService  # noqa: E402
from kvsp_quic.roles.instance import InstanceOptions  # noqa: E402
from kvsp_quic.storage.memory_index import MemoryIndexStore  # noqa: E402
from kvsp_runtime.instance_service import ServiceOptions  # noqa: E402
from tests.asgi import Router  # noqa: E402
from tests.pki import TestPki  # noqa: E402
from tests.support.hf_model import write_hf_model  # noqa: E402
from tests.support.instance import (  # noqa: E402
    SCOPE_KEY,
    B,
    FakePC,
    instance_policy,
    post,
    read_stream,
    start_body,
    tokens_of,
)
from tests.support.waits import until  # noqa: E402

PROMPT = [(7 * i + 3) % 300 for i in range(6 * B + 3)]  # six complete blocks and three tokens
ORDERS = [("reference", "transformers"), ("transformers", "reference")]


class Nodes:
    """An Index Service and a PC double on one RoleServer; instances of either engine on RoleServers of their own."""

    def __init__(self, certs: TestPki, server: RoleServer, pc: FakePC) -> None:
        self.certs = certs
        self.server = server
        self.pc = pc
        self.alice = KvspClient(certs.files("alice"), timeout=10.0)
        self.nodes: list[tuple[InstanceNode, RoleServer, Engine]] = []

    def uri(self, name: str) -> str:
        return self.server.base_uri(f"/{name}/")

    async def instance(self, root: Path, engine_name: str, *, moqt: bool = True) -> tuple[InstanceNode, Engine]:
        engine = Engine.load(str(root), block_tokens=B, device_pages=256, engine=engine_name)
        tcp, udp = bind_pair("127.0.0.1", 0, 1 << 20)
        base = f"https://127.0.0.1:{tcp.getsockname()[1]}/"
        node = build_instance(engine, base_uri=base, files=self.certs.files("server"), policy=instance_policy(),
                              scope_keys=[SCOPE_KEY], index=self.uri("is"),
                              options=InstanceOptions(engine=engine_name),
                              service=ServiceOptions(controller=self.uri("pc"), request_timeout_ms=5000),
                              moqt=moqt)
        node.service.publisher.max_sleep = 0.05  # type: ignore[union-attr]
        server = RoleServer(node.app, self.certs.files("server"), quic_handlers=node.quic_handlers)
        await server.start(sockets=(tcp, udp))
        await node.start()
        self.nodes.append((node, server, engine))
        return node, engine


@pytest.fixture
async def nodes(certs: TestPki) -> AsyncIterator[Nodes]:
    router = Router()
    server = RoleServer(router, certs.files("server"))
    await server.start("127.0.0.1", 0)
    index = IndexService(MemoryIndexStore(), clock=time.monotonic)
    pc = FakePC()
    router.apps["/is/"] = index_app(index, Policy.dev_ca(), base_path="/is/", sweep_interval=None)
    router.apps["/pc/"] = pc
    out = Nodes(certs, server, pc)
    try:
        yield out
    finally:
        for node, srv, engine in reversed(out.nodes):
            await node.aclose()
            await srv.close()
            engine.close()
        await out.alice.aclose()
        await server.close()


def keys_of(tokens: list[int], d: CompatDescriptor) -> list[bytes]:
    return [bytes(k) for k in BlockKeyer(SCOPE_KEY, d.compat_id, B).keys(tokens)]


async def run_session(n: Nodes, node: InstanceNode, d: CompatDescriptor, prompt: list[int], max_tokens: int
                      ) -> tuple[uuid.UUID, list[int]]:
    base = node.role.settings.base_uri
    sid = uuid.uuid4()
    r = await post(n.alice, f"{base}sessions/{sid}/start", start_body(sid, prompt, max_tokens=max_tokens, d=d))
    assert r.status == 201, r.content
    return sid, tokens_of(await read_stream(n.alice, f"{base}sessions/{sid}/tokens?from=0"))


async def published(n: Nodes, d: CompatDescriptor, keys: list[bytes], holder: str) -> None:
    body = {"scope_id": BlockKeyer(SCOPE_KEY, d.compat_id, B).scope_id.hex(), "compat_id": d.compat_id.hex(),
            "block_keys": [k.hex() for k in keys]}
    for _ in range(300):
        found = (await post(n.alice, f"{n.uri('is')}lookup", body)).json()
        if found["matched"] == len(keys) and all(any(x["holder"] == holder for x in m["replicas"])
                                                 for m in found["blocks"]):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{holder} did not publish the blocks")


async def logits_loaded_and_full(engine: Engine, keys: list[bytes], prompt: list[int]) -> tuple[Any, Any]:
    """The engine's last-token logits with its named pages of *keys* as the loaded prefix, and computing all."""
    pages = [engine.cache.lookup(k) for k in keys]
    assert all(p is not None for p in pages)
    loaded = await engine.prefill(prompt, pages)
    assert loaded.loaded_blocks == list(range(len(keys)))
    full = await engine.prefill(prompt)
    try:
        return loaded.logits, full.logits
    finally:
        loaded.sequence.release()
        full.sequence.release()


@pytest.mark.parametrize(("first", "second"), ORDERS)
@pytest.mark.parametrize(("config", "moqt"), [
    ({}, True),
    ({"kv_heads": 1, "tie_word_embeddings": True,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}}, False),
    ({"kv_heads": 4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
     True),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, False),
], ids=["gqa2-plain-moqt", "mqa-llama3-tied-http", "mha-yarn-moqt", "gqa2-linear-http"])
async def test_a_prompt_computed_by_one_engine_loads_into_the_other_exactly(
        nodes: Nodes, tmp_path: Path, first: str, second: str, config: dict[str, Any], moqt: bool) -> None:
    root = write_hf_model(tmp_path / "m", **config)
    a, a_engine = await nodes.instance(root, first, moqt=moqt)
    b, b_engine = await nodes.instance(root, second, moqt=moqt)
    d = a_engine.descriptor
    assert b_engine.descriptor == d  # one compat_id
    keys = keys_of(PROMPT, d)
    _, a_tokens = await run_session(nodes, a, d, PROMPT, 4)
    # B finds A's published blocks through the Index Service, loads them and computes the rest
    await published(nodes, d, keys[:6], a.role.settings.base_uri)
    sid, b_tokens = await run_session(nodes, b, d, PROMPT, 4)
    session = b.role.sessions.get(sid)
    assert session.loaded_blocks == 6 and sum(session.block_sources.values()) == 6, session.block_sources
    assert ("MOQT" in " ".join(session.block_sources)) == moqt, session.block_sources
    loaded, full = await logits_loaded_and_full(b_engine, keys[:6], PROMPT)
    assert (loaded - full).abs().max().item() <= 1e-5
    assert b_tokens == a_tokens  # greedy: the same tokens on both engines, loaded or computed


async def test_bf16_blocks_across_engines_give_the_same_greedy_tokens(nodes: Nodes, tmp_path: Path) -> None:
    root = write_hf_model(tmp_path / "m", dtype="bfloat16")
    for first, second in ORDERS:
        a, a_engine = await nodes.instance(root, first)
        b, b_engine = await nodes.instance(root, second)
        d = a_engine.descriptor
        assert d.kv_dtype == "bf16" and b_engine.descriptor == d
        prompt = [(11 * i + 5 + len(nodes.nodes)) % 300 for i in range(6 * B + 3)]
        keys = keys_of(prompt, d)
        await run_session(nodes, a, d, prompt, 1)
        await published(nodes, d, keys[:6], a.role.settings.base_uri)
        sid, b_tokens = await run_session(nodes, b, d, prompt, 6)
        assert b.role.sessions.get(sid).loaded_blocks == 6
        loaded, full = await logits_loaded_and_full(b_engine, keys[:6], prompt)
        assert int(loaded.argmax()) == int(full.argmax())
        full_run = await b_engine.prefill(prompt)  # the same engine computing everything itself
        try:
            own = generate_tokens(b_engine.model, full_run, TokenSampler("greedy"), max_new_tokens=6).tokens
        finally:
            full_run.sequence.release()
        assert b_tokens == own


@pytest.mark.parametrize(("first", "second"), ORDERS)
async def test_a_session_migrates_across_engines_with_nothing_lost_or_duplicated(
        nodes: Nodes, tmp_path: Path, first: str, second: str) -> None:
    root = write_hf_model(tmp_path / "m")
    a, a_engine = await nodes.instance(root, first)
    b, _ = await nodes.instance(root, second)
    d = a_engine.descriptor
    sid, tokens = await run_session(nodes, a, d, PROMPT, 16)
    await until(lambda: a.role.sessions.get(sid).checkpoints_settled)
    cps = [x for x in nodes.pc.checkpoints if x["session"] == str(sid)]
    cp = next(x for x in cps if x["output_offset"] >= 9)
    offset = 9
    cp = dict(cp, generated=cp["generated"][:offset], output_offset=offset, sampler=dict(cp["sampler"], step=offset))
    b_uri = b.role.settings.base_uri
    r = await post(nodes.alice, f"{b_uri}sessions/{sid}/resume", {"epoch": 2, "checkpoint": cp, "max_tokens": 16})
    assert r.status == 200, r.content
    lines = await read_stream(nodes.alice, f"{b_uri}sessions/{sid}/tokens?from=0")
    assert [x["index"] for x in lines[:-1]] == list(range(16))  # 0 lost, 0 duplicated
    assert tokens_of(lines) == tokens  # the checkpoint's tokens, then the other engine's continuation: identical
    assert b.role.sessions.get(sid).loaded_blocks >= 6
    assert b.role.sessions.get(sid).epoch == 2
