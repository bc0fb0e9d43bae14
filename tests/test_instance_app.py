"""The Inference Instance over real sockets (kvsp_http/instance_app.py and http3/instance_*.py, gpu/engine.py,
kvsp_quic/roles/instance*.py, assembled by kvsp_app/instance.py).

One RoleServer (HTTP/3 + HTTP/1.1/2, mutual TLS) serves the Index Service at ``/is/``, a Holder at ``/h1/`` and a
fake Placement Controller at ``/pc/`` (a tiny ASGI app that records status reports and checkpoints and answers
them); each instance is a RoleServer of its own (its resources, its replicas over HTTP and MOQT), built with
:func:`kvsp_app.instance.build_instance` around a tiny random model. Blocks reach the holder from a producer
prefill in the test; the instances publish what they load and compute, and load from each other. The cluster and
the helpers are tests/support/instance.py's, the fixtures (``instance_cluster``, ``reference``) tests/conftest.py's.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the gpu extra (safetensors) is not installed")

from gpu.model import LlamaModel  # noqa: E402
from gpu.sampling import TokenSampler  # noqa: E402
from kvsp_quic.compat import CompatDescriptor  # noqa: E402
from tests.support.instance import (  # noqa: E402
    LAYERS,
    PROMPT,
    SCOPE,
    B,
    Cluster,
    directive_state,
    expected_tokens,
    keys_of,
    lookup,
    post,
    produce,
    read_stream,
    start_body,
    tokens_of,
)
from tests.support.waits import until  # noqa: E402

# -- blocks over the TCP path ----------------------------------------------------------------------------------------


async def test_with_the_tcp_path_preferred_blocks_load_over_http_1_1_and_the_tokens_equal_a_recompute(
        instance_cluster: Cluster, reference: LlamaModel) -> None:
    cl = instance_cluster
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
        instance_cluster: Cluster, reference: LlamaModel) -> None:
    cl = instance_cluster
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


async def test_a_directive_past_its_deadline_is_partial_and_stops_loading(instance_cluster: Cluster,
                                                                          reference: LlamaModel) -> None:
    cl = instance_cluster
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
        instance_cluster: Cluster, reference: LlamaModel) -> None:
    cl = instance_cluster
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
        instance_cluster: Cluster) -> None:
    cl = instance_cluster
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


async def test_checkpoints_reach_the_pc_and_a_resume_elsewhere_continues_exactly(instance_cluster: Cluster,
                                                                                 reference: LlamaModel) -> None:
    cl = instance_cluster
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
        instance_cluster: Cluster, reference: LlamaModel) -> None:
    cl = instance_cluster
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


async def test_a_stale_epoch_answer_fences_the_session(instance_cluster: Cluster, reference: LlamaModel) -> None:
    cl = instance_cluster
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


async def test_directives_and_sessions_only_from_the_controller(instance_cluster: Cluster,
                                                                reference: LlamaModel) -> None:
    cl = instance_cluster
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
        instance_cluster: Cluster, reference: LlamaModel) -> None:
    cl = instance_cluster
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
        instance_cluster: Cluster, reference: LlamaModel) -> None:
    cl = instance_cluster
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
        instance_cluster: Cluster, reference: LlamaModel) -> None:
    """The directive reserves its blocks (a session start follows them), then its lookup outlasts its deadline: no
    load is ever begun. The session recomputes those blocks instead of waiting for them until it is cancelled
    (found by ``kvsp-quic chaos``: prefills that waited ~30 s, until the PC cancelled the session)."""
    cl = instance_cluster
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
