"""A real inference instance loads blocks that exist only as partial (layer-range) replicas at two holders (issue 13;
spec, "Block Retrieval and Storage": a client assembles a layer range from the replicas that hold its parts).

The instance cluster of tests/support/instance.py (one RoleServer with the Index Service at ``/is/`` and a holder at
``/h1/``, a fake PC, instances built by :func:`kvsp_app.instance.build_instance` around a tiny random model),
with a second holder at ``/h2/``: a producer's prefill stores layers 0-1 of each block at h1 and layers 2-3 at h2,
and nowhere the whole block. The instance's BlockFetcher (kvsp_client/retrieval.py) assembles every block from the two
halves; the tokens equal those of a run without a cache, and the blocks were loaded, not recomputed.
"""

from __future__ import annotations

import uuid

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")

from gpu.kvcache import PagedKVCache  # noqa: E402
from gpu.model import LlamaModel  # noqa: E402
from gpu.prefill import prefill  # noqa: E402
from gpu.sampling import TokenSampler  # noqa: E402
from kvsp_http.holder_app import holder_app  # noqa: E402
from kvsp_quic import container as c  # noqa: E402
from kvsp_quic.auth import ALL, Policy, Principal, Role  # noqa: E402
from kvsp_quic.keys import holder_id  # noqa: E402
from kvsp_quic.roles.holder import Holder, HolderSettings  # noqa: E402
from tests.support.instance import (  # noqa: E402
    ADMIN,
    LAYERS,
    PROMPT,
    SCOPE,
    B,
    Cluster,
    expected_tokens,
    keys_of,
    lookup,
    post,
    read_stream,
    start_body,
    tokens_of,
)

SPLIT = LAYERS // 2  # h1 keeps layers 0..SPLIT-1 of each block, h2 the rest
STORER = Principal("urn:kvsp:client:alice", frozenset({Role.HOLDER}), ALL, ALL)


async def produce_halves(cl: Cluster, model: LlamaModel, blocks: int) -> list[bytes]:
    """A producer's prefill of PROMPT; of its first *blocks* blocks, layers 0..SPLIT-1 stored at h1 and the others at
    a second holder h2 (added to the cluster's server), each record published; no holder has a whole block."""
    d = model.descriptor(B)
    h2 = Holder(HolderSettings(cl.uri("h2"), (d,), replica_ttl_ms=60_000))
    cl.router.apps["/h2/"] = holder_app(h2, Policy.dev_ca())
    cache = PagedKVCache.for_descriptor(d, device_pages=64)
    result = await prefill(model, cache, PROMPT)
    keys = keys_of(PROMPT, d)
    for i in range(blocks):
        sections = [(bytes(k), bytes(v)) for k, v in cache.export_block(result.sequence.pages[i])]
        for holder, first, last in ((cl.holder, 0, SPLIT - 1), (h2, SPLIT, LAYERS - 1)):
            body = c.encode(sections[first:last + 1], first_layer=first, token_count=B, descriptor=d).tobytes()
            record = holder.store(STORER, d.compat_id, SCOPE, keys[i], body, "*")
            assert record.residency[0].layers == (first, last)
            await cl.index.publish(ADMIN, holder_id(record.holder), keys[i], record)
    result.sequence.release()
    return keys


async def test_an_instance_loads_blocks_kept_only_as_partial_replicas_at_two_holders(
        instance_cluster: Cluster, reference: LlamaModel) -> None:
    cl = instance_cluster
    d = reference.descriptor(B)
    keys = await produce_halves(cl, reference, 6)
    found = await lookup(cl, d, keys[:6])
    assert found["matched"] == 6  # a key with partial replicas only is matched (spec: "at least one replica")
    assert all(sorted(r["residency"][0]["layers"] for r in m["replicas"]) == [[0, SPLIT - 1], [SPLIT, LAYERS - 1]]
               for m in found["blocks"])
    node = await cl.instance(moqt=False)
    base = node.role.settings.base_uri
    sid = uuid.uuid4()
    r = await post(cl.alice, f"{base}sessions/{sid}/start", start_body(
        sid, PROMPT, max_tokens=8, d=d,
        blocks=[{"block_key": k.hex(), "sources": [cl.uri("h1"), cl.uri("h2")]} for k in keys[:6]]))
    assert r.status == 201, r.content
    lines = await read_stream(cl.alice, f"{base}sessions/{sid}/tokens?from=0")
    assert tokens_of(lines) == await expected_tokens(reference, PROMPT, 8, TokenSampler("greedy"))
    session = node.role.sessions.get(sid)
    assert session.loaded_blocks == 6 and session.recomputed_tokens == len(PROMPT) - 6 * B  # loaded, not recomputed
    gets = {name: [q for method, _path, q in cl.router.requests(f"/{name}/blocks/") if method == "GET"]
            for name in ("h1", "h2")}
    assert gets == {"h1": [f"layers=0-{SPLIT - 1}"] * 6, "h2": [f"layers={SPLIT}-{LAYERS - 1}"] * 6}
    metrics = node.service.fetcher.metrics
    assert metrics.digest_failures == 0 and metrics.layers >= 6 * LAYERS
