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

from pathlib import Path

import pytest

from http3.client import KvspClient
from kvsp_client.api import KvspApi
from tests.helpers import Process
from tests.support.instance_processes import active, files_of, keyer_of, start_instances, tiny_model
from tests.support.reshard import PROMPT, B, block_at, fetched, map_with_context, published_at, put_map

pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")


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
