"""Resharding through any replica of a replicated PC (issue 12, points 1 and 8), with real processes on 127.0.0.1:
one ``redis-server``, two ``kvsp-quic index --store redis`` replicas (IS + PC) and two CPU ``kvsp-quic instance``
processes reporting to both.

The map's context (extension member ``"context"`` of ``PUT maps/{map}``, docs/wire.md "Resharding") lives with the
map in the shared store: it is given to replica A with the map, the reshard is asked of replica B, and B's plans
carry it, so the instance that fetches can name the blocks it loads (spec, "Sequence-Sharded Caches and Resharding":
"An instance acknowledges the plan with 200 after it has loaded all ranges listed in "fetch""). Before the context
was stored, B sent plans without it and the fetching instance refused its plan (400): the reshard aborted.
The store's side, and a reshard's context replacing the map's: tests/test_control_store_maps.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from http3.client import KvspClient
from kvsp_client.api import KvspApi
from tests.helpers import Process
from tests.redis_server import needs_redis
from tests.support.instance_processes import active, files_of, keyer_of, start_instances, tiny_model
from tests.support.reshard import PROMPT, B, block_at, fetched, map_with_context, published_at, put_map

pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
pytestmark = needs_redis


async def test_a_reshard_at_one_replica_sends_the_context_given_to_another(tmp_path: Path, redis_url: str,
                                                                             procs: list[Process]) -> None:
    """(*redis_url* before *procs*: Redis stops after the processes that use it.)"""
    model = tiny_model(tmp_path)
    dev = str(tmp_path / "dev")
    pcs = [Process("index", "--dev", dev, "--store", "redis", "--redis", redis_url) for _ in range(2)]
    procs.extend(pcs)
    a, b = (pc.ready["base_uri"] for pc in pcs)
    instances = await start_instances(2, dev, model, [a, b], procs)
    keyer = keyer_of(instances[0])
    keys = keyer.keys(PROMPT)
    assert len(keys) == len(PROMPT) // B
    async with KvspClient(files_of(pcs[0].ready), timeout=20) as client:
        await active(client, a, instances)
        await active(client, b, instances)
        api = KvspApi(client)
        x, y = await map_with_context(client, a, keyer, keys, instances)  # the map and its context, at replica A
        assert (await client.request("GET", f"{b}maps/ctx1")).json()["version"] == 0
        before = {i: await fetched(client, i) for i in (x, y)}

        # v0 -> v1 asked of replica B, without the context: y fetches [12, 24) from x, x keeps [0, 12) in place
        status, answer = await put_map(client, b, {"map": "ctx1", "version": 1, "deadline_ms": 20_000, "shards": [
            {"tokens": [0, 12], "instance": x}, {"tokens": [12, 24], "instance": y}]})
        assert status == 200, answer
        assert answer["outcome"] == "committed" and sorted(answer["acknowledged"]) == sorted([x, y]), str(answer)
        assert answer["failed"] == {} and answer["undelivered"] == {}
        for pc in (a, b):
            assert (await client.request("GET", f"{pc}maps/ctx1")).json()["version"] == 1
        moved = {i: tuple(n - m for n, m in zip(await fetched(client, i), before[i], strict=True)) for i in (x, y)}
        assert moved[x] == (0, 0), "a retained range was transferred"
        assert moved[y][0] == 3 and moved[y][1] > 0, f"the fetched range did not move: {moved[y]}"
        for key in keys[3:]:  # the blocks y fetched are the blocks x computed, octet for octet
            assert await block_at(client, y, keyer, key) == await block_at(client, x, keyer, key)
        await published_at(api, b, keyer, keys[3:], y)
