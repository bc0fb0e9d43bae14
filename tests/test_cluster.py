"""The cache with real processes: ``kvsp-quic index --dev`` and ``kvsp-quic holder --dev``, talking HTTP/3 with
mutual TLS on 127.0.0.1, driven by a client holding the dev certificate -- with the in-memory index and with the
Redis-backed one."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic import container
from kvsp_quic.records import LeaseRequest
from quic.tls import TlsFiles
from tests.support.cluster import (
    DESCRIPTOR,
    KEYER,
    block,
    block_url,
    eventually,
    matched,
    put,
)


async def test_publish_lookup_and_verified_layer_range(dev_cluster: dict[str, Any], dev_client: KvspClient) -> None:
    holder = dev_cluster["holder"]["base_uri"]
    fetcher = BlockFetcher(dev_client, dev_cluster["index"]["base_uri"])
    created = await put(dev_client, holder, 0)
    assert created.status == 201 and created.http_version == "HTTP/3"
    again = await put(dev_client, holder, 0)
    assert again.status == 412  # the key names the prefix, not the octets: the first copy stays
    await eventually(fetcher, 0, True)

    lookup = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(0)[0], block(1)[0]])
    # stops at the missing key; the holder publishes an https and a moqt:// replica of each block
    assert lookup.matched == 1 and holder in {r.holder for r in lookup.blocks[0].replicas}
    layers = [layer async for layer in fetcher.fetch_layers(lookup.blocks[0], layers=(4, 9))]
    decoded = container.decode(block(0)[1], DESCRIPTOR)[1]
    assert [layer.index for layer in layers] == list(range(4, 10))
    for got in layers:  # each layer checked against its digest in the Replica Record as it arrived
        assert bytes(got.k) == bytes(decoded[got.index].k) and bytes(got.v) == bytes(decoded[got.index].v)
    whole = await fetcher.fetch_block(lookup.blocks[0])
    assert whole is not None and whole.tobytes() == block(0)[1]
    assert fetcher.metrics.digest_failures == 0


async def test_a_lease_protects_a_replica_until_it_expires(dev_cluster: dict[str, Any], dev_client: KvspClient) -> None:
    holder = dev_cluster["holder"]["base_uri"]
    fetcher = BlockFetcher(dev_client, dev_cluster["index"]["base_uri"])
    for i in (0, 1):
        assert (await put(dev_client, holder, i)).status == 201
    await eventually(fetcher, 0, True)
    await eventually(fetcher, 1, True)
    lease = LeaseRequest(DESCRIPTOR.compat_id, KEYER.scope_id, (block(0)[0],), ttl_ms=2000)
    granted = await dev_client.request("POST", f"{holder}leases", content=json.dumps(lease.to_json()).encode(),
                                   headers={"content-type": "application/kvsp+json"})
    assert granted.status == 201 and granted.headers["location"].startswith("leases/")

    # Memory pressure: block 2 needs room. Block 0 is the least recently used, but leased: block 1 goes.
    assert (await put(dev_client, holder, 2)).status == 201
    await eventually(fetcher, 1, False)  # evicted and withdrawn
    assert await matched(fetcher, 0) and await matched(fetcher, 2)
    assert (await dev_client.request("GET", block_url(holder, block(0)[0]))).status == 200
    assert (await dev_client.request("GET", block_url(holder, block(1)[0]))).status == 404

    await asyncio.sleep(2.2)  # the lease expires: block 0 is an ordinary replica again
    assert (await dev_client.request("GET", block_url(holder, block(2)[0]))).status == 200  # now 0 is the LRU one
    assert (await put(dev_client, holder, 3)).status == 201
    await eventually(fetcher, 0, False)
    assert (await dev_client.request("GET", block_url(holder, block(0)[0]))).status == 404
    assert await matched(fetcher, 2) and await matched(fetcher, 3)


async def test_the_dev_client_has_every_right_and_strangers_none(dev_cluster: dict[str, Any], tmp_path: Path) -> None:
    from tests.pki import make_pki

    holder = dev_cluster["holder"]["base_uri"]
    other = make_pki(tmp_path / "other")  # a client of another CA
    files = TlsFiles(Path(dev_cluster["holder"]["ca"]), other.files("alice").cert, other.files("alice").key)
    async with KvspClient(files, retries=0, connect_timeout=2) as stranger:
        with pytest.raises(ConnectionError):
            await stranger.request("GET", block_url(holder, block(0)[0]))


def test_without_dev_certificates_and_a_policy_are_required(tmp_path: Path) -> None:
    for role in ("index", "holder"):
        run = subprocess.run([sys.executable, "-m", "kvsp_app", role, "--descriptor",
                              str(Path(__file__).parent.parent / "examples" / "descriptor.json")],
                             capture_output=True, text=True, timeout=30, env={**os.environ})
        assert run.returncode == 1 and run.stdout == ""
        assert run.stderr.count("\n") == 1 and "[tls] ca, cert and key are required" in run.stderr
