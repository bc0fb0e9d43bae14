"""Resharding between real instance processes: a prompt of six blocks, maps registered with their context, where
blocks are published and what an instance fetched."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from typing import Any

from http3.client import KvspClient
from kvsp_client.api import KvspApi
from kvsp_frontend.session import Completion, Frontend
from kvsp_quic.fields import BlockKey
from kvsp_quic.frontend import SamplingRequest
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.records import LookupRequest
from tests.helpers import Process
from tests.support.instance_processes import Bytes, counter

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
