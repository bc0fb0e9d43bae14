"""Leases at an inference instance: the instance is a holder of its own cache's pages (gpu/engine.py CacheHolder),
so a prefetch directive that names another instance as the source leases the blocks there (spec, "Prefetch
Directives": "For each block it does not already hold, the instance acquires a lease of lease_ms at one of the
listed sources"), as benchmarks/bench_ttft.py's PRE instance does.

Regression: the holder's global lease cap (issue #13, ``max_leased_fraction`` of the holder's capacity) was taken
from the bookkeeping tier of the instance's holder, whose capacity is a placeholder of 1 octet, so every lease at an
instance was refused (429 kvsp-lease-quota, "the client holds 0 of its quota of 1") and every directive sourced
from an instance ended ``failed`` with nothing loaded. The cap is now what the cache's pages can hold.

Real servers on 127.0.0.1, the instance cluster of tests/support/instance.py (Index Service, fake PC, instances built by
:func:`kvsp_app.instance.build_instance` around a tiny random model).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the gpu extra (safetensors) is not installed")

from gpu.engine import CacheHolder, Engine
from gpu.model import LlamaModel
from gpu.sampling import TokenSampler
from kvsp_quic.container import ContainerHeader
from kvsp_quic.problems import LeaseQuota
from kvsp_quic.roles.holder import HolderSettings
from kvsp_quic.storage.tiers import BlockId
from tests.support.instance import (
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
    read_stream,
    start_body,
    tokens_of,
)
from tests.support.waits import until


def test_an_instance_holder_leases_up_to_what_its_cache_holds(model_dir: Path) -> None:
    engine = Engine.load(str(model_dir), block_tokens=B, device_pages=10)
    try:
        cache = engine.cache
        holder = CacheHolder(HolderSettings("https://127.0.0.1/", (engine.descriptor,)), cache)
        header = ContainerHeader(codec=1, first_layer=0, token_count=B,
                                 lengths=((cache.section_length(),) * 2,) * LAYERS)
        replica = header.size + header.data_length  # the container of one complete page
        assert holder.leases.global_cap == 10 * replica
        # every page of the cache can be leased at once, by one client (default limits), and no more
        blocks = [BlockId(b"c" * 32, bytes(SCOPE), bytes([i]) * 32) for i in range(11)]
        lease = holder.leases.create("urn:test:a", blocks[:10], [replica] * 10, 1000)
        assert lease.octets == 10 * replica
        with pytest.raises(LeaseQuota):
            holder.leases.create("urn:test:b", blocks[10:], [replica], 1000)
    finally:
        engine.close()


async def test_a_directive_sourced_from_another_instance_leases_there_and_completes(
        instance_cluster: Cluster, reference: LlamaModel) -> None:
    cl = instance_cluster
    d = reference.descriptor(B)
    keys = keys_of(PROMPT, d)
    producer = await cl.instance()
    p_base = producer.role.settings.base_uri
    # the producer computes the prompt and publishes its six complete blocks (https and moqt:// records)
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{p_base}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=1, d=d, blocks=[]))
    assert r.status == 201, r.content
    await read_stream(cl.alice, f"{p_base}sessions/{sid}/tokens")

    async def published() -> int:
        found = await lookup(cl, d, keys)
        return sum(1 for m in found["blocks"] for x in m["replicas"] if x["holder"] == p_base)

    for _ in range(250):
        if await published() == 6:
            break
        await asyncio.sleep(0.02)
    assert await published() == 6
    # another instance prefetches them from the producer, leasing them there
    node = await cl.instance()
    base = node.role.settings.base_uri
    directive = uuid.uuid4()
    listed = [{"block_key": k.hex(), "sources": [p_base]} for k in keys]
    r = await post(cl.alice, f"{base}prefetch", {
        "directive": str(directive), "scope_id": SCOPE.hex(), "compat_id": d.compat_id.hex(), "blocks": listed,
        "deadline_ms": 10_000, "lease_ms": 5000})
    assert r.status == 202, r.content
    state = await directive_state(cl, node, directive)
    assert state == {"directive": str(directive), "state": "complete", "loaded": [k.hex() for k in keys]}
    metrics = node.service.fetcher.metrics
    assert metrics.leases_taken == 6 and metrics.digest_failures == 0
    await until(lambda: metrics.leases_released == 6)
    await until(lambda: len(producer.service.holder.leases) == 0)
    # the session then finds the prefix resident, and its tokens are a recompute's
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=4, d=d,
                                                                       blocks=listed))
    assert r.status == 201, r.content
    lines = await read_stream(cl.alice, f"{base}sessions/{sid}/tokens?from=0")
    assert tokens_of(lines) == await expected_tokens(reference, PROMPT, 4, TokenSampler("greedy"))
    info = (await cl.alice.request("GET", f"{base}sessions/{sid}")).json()
    assert info["block_sources"] == {"resident": 6} and info["computed_tokens"] == len(PROMPT) - 6 * B
