"""Resharding that moves data between our own PC and our own instances (issue 12, point 8), with real processes on
127.0.0.1: one ``kvsp-quic index`` (IS + PC) and two CPU ``kvsp-quic instance`` processes.

Spec, "Sequence-Sharded Caches and Resharding": "A token range assigned to the same instance in both versions MUST
appear in "retain" for that instance and MUST NOT be transferred", "An instance acknowledges the plan with 200
after it has loaded all ranges listed in "fetch"", and "Version v remains authoritative until all instances have
acknowledged; the PC then sends POST reshard with {"map": ..., "commit": v+1} to all members". The PC learns the
map's context (its Block Keys) with ``PUT maps/{map}`` (extension member ``"context"``, docs/wire.md
"Resharding") and sends it with every plan, so that a plan with ``fetch`` ranges commits.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_client.api import KvspApi
from kvsp_frontend.session import Completion, Frontend
from kvsp_quic.fields import BlockKey
from kvsp_quic.frontend import SamplingRequest
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.records import LookupRequest
from tests.helpers import Process
from tests.test_fast_migration import Bytes, active, counter, files_of, keyer_of, start_instances, tiny_model

pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")

PROMPT = [(7 * i + 3) % 256 for i in range(24)]  # 6 blocks of 4 tokens
B = 4


async def published_at(api: KvspApi, index: str, keyer: BlockKeyer, keys: list[BlockKey], holder: str) -> None:
    """Wait until the IS lists a replica of every key in *keys* at *holder*."""
    deadline = time.monotonic() + 30
    while True:
        found = await api.lookup(index, LookupRequest(keyer.scope_id, keyer.compat_id, tuple(keys)))
        at = {bytes(m.block_key) for m in found.blocks if any(r.holder == holder for r in m.replicas)}
        if at >= set(keys):
            return
        assert time.monotonic() < deadline, f"blocks not published by {holder}: {len(at)} of {len(keys)}"
        await asyncio.sleep(0.1)


async def fetched(client: KvspClient, instance: str) -> tuple[float, float]:
    """(blocks, body octets) *instance* loaded from other holders, over any transport (its retrieval client)."""
    metrics = ((await client.request("GET", f"{instance}metrics")).content or b"").decode()
    octets = 0.0
    for line in metrics.splitlines():
        m = re.match(r'^kvsp_transfer_bytes_total\{([^}]*)\} (\S+)$', line)
        if m and 'component="retrieval"' in m.group(1) and 'direction="in"' in m.group(1):
            octets += float(m.group(2))
    return counter(metrics, "kvsp_retrieval_blocks_total", component="retrieval", outcome="hit"), octets


async def block_at(client: KvspClient, instance: str, keyer: BlockKeyer, key: bytes) -> bytes:
    r = await client.request("GET", f"{instance}blocks/{keyer.compat_id.hex()}/{keyer.scope_id.hex()}/{key.hex()}")
    assert r.status == 200, (instance, r.status, r.content)
    return r.content or b""


async def put_map(client: KvspClient, pc: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = await client.request("PUT", f"{pc}maps/{body['map']}", content=json.dumps(body).encode(),
                             headers={"content-type": "application/kvsp+json"})
    return r.status, r.json()


async def map_with_context(client: KvspClient, pc: str, keyer: BlockKeyer, keys: Sequence[bytes],
                           instances: list[Process]) -> tuple[str, str]:
    """A completion of PROMPT through *pc* (the instance x that runs it computes the context and publishes its
    blocks), then map "ctx1" v0 registered at *pc* with its context, all of it at x: (x, the other instance y)."""
    frontend = Frontend(client, pc, keyer, Bytes(), "tiny", vocab_size=256)
    run = Completion(frontend, list(PROMPT), 2, SamplingRequest.from_openai(0.0, None, None, 7))
    await run.place()
    async for _ in run.tokens():
        pass
    x = run.instance  # computed the context: holds its blocks
    assert x is not None
    y = next(p.ready["base_uri"] for p in instances if p.ready["base_uri"] != x)
    await published_at(KvspApi(client), pc, keyer, keys, x)
    context = {"compat_id": keyer.compat_id.hex(), "scope_id": keyer.scope_id.hex(),
               "block_keys": [k.hex() for k in keys]}
    status, answer = await put_map(client, pc, {"map": "ctx1", "version": 0, "context": context,
                                                "shards": [{"tokens": [0, 24], "instance": x}]})
    assert status == 201 and answer["outcome"] == "registered", answer
    return x, y


async def test_a_reshard_that_fetches_commits_and_retained_ranges_move_nothing(tmp_path: Path,
                                                                               procs: list[Process]) -> None:
    model = tiny_model(tmp_path)
    dev = str(tmp_path / "dev")
    pc = Process("index", "--dev", dev)
    procs.append(pc)
    uri = pc.ready["base_uri"]
    instances = await start_instances(2, dev, model, [uri], procs)
    keyer = keyer_of(instances[0])
    keys = keyer.keys(PROMPT)
    assert len(keys) == len(PROMPT) // B
    async with KvspClient(files_of(pc.ready), timeout=20) as client:
        await active(client, uri, instances)
        api = KvspApi(client)
        x, y = await map_with_context(client, uri, keyer, keys, instances)
        before = {i: await fetched(client, i) for i in (x, y)}

        # v0 -> v1: x keeps [0, 12) in place, y fetches [12, 24) from x
        status, answer = await put_map(client, uri, {"map": "ctx1", "version": 1, "deadline_ms": 20_000, "shards": [
            {"tokens": [0, 12], "instance": x}, {"tokens": [12, 24], "instance": y}]})
        assert status == 200, answer
        assert answer["outcome"] == "committed" and sorted(answer["acknowledged"]) == sorted([x, y]), answer
        assert answer["failed"] == {} and answer["undelivered"] == {}
        assert (await client.request("GET", f"{uri}maps/ctx1")).json()["version"] == 1
        moved = {i: tuple(a - b for a, b in zip(await fetched(client, i), before[i], strict=True)) for i in (x, y)}
        assert moved[x] == (0, 0), "a retained range was transferred"
        assert moved[y][0] == 3 and moved[y][1] > 0, f"the fetched range did not move: {moved[y]}"
        for key in keys[3:]:  # the blocks y fetched are the blocks x computed, octet for octet
            assert await block_at(client, y, keyer, key) == await block_at(client, x, keyer, key)
        await published_at(api, uri, keyer, keys[3:], y)

        # v1 -> v2, the same split: everything is retained, nothing moves
        status, answer = await put_map(client, uri, {"map": "ctx1", "version": 2, "shards": [
            {"tokens": [0, 12], "instance": x}, {"tokens": [12, 24], "instance": y}]})
        assert status == 200 and answer["outcome"] == "committed", answer
        assert {i: tuple(a - b for a, b in zip(await fetched(client, i), before[i], strict=True))
                for i in (x, y)} == moved

        # a map registered without its context: a plan that fetches is refused by the instance, the PC aborts
        status, answer = await put_map(client, uri, {"map": "bare", "version": 0,
                                                      "shards": [{"tokens": [0, 24], "instance": x}]})
        assert status == 201, answer
        status, answer = await put_map(client, uri, {"map": "bare", "version": 1, "shards": [
            {"tokens": [0, 12], "instance": x}, {"tokens": [12, 24], "instance": y}]})
        assert status == 200 and answer["outcome"] == "aborted", answer
        assert any("context" in why for why in answer["failed"].values()), answer  # the first refusal stops the PC
        assert (await client.request("GET", f"{uri}maps/bare")).json()["version"] == 0
