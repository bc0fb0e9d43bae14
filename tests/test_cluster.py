"""The cache with real processes: ``kvsp-quic index --dev`` and ``kvsp-quic holder --dev``, talking HTTP/3 with
mutual TLS on 127.0.0.1, driven by a client holding the dev certificate -- with the in-memory index and with the
Redis-backed one."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic import container
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.records import LeaseRequest
from kvsp_quic.samples import example_descriptor, random_sections
from quic.tls import TlsFiles
from tests.helpers import Process
from tests.peers import missing_peer
from tests.redis_server import REDIS_SERVER, SKIP_REASON, RedisServer

DESCRIPTOR = example_descriptor()  # 32 layers, 4-token blocks, 8 heads x 128 bf16: 512 KiB of K and V a block
SCOPE_KEY = bytes(range(32))
KEYER = BlockKeyer(SCOPE_KEY, DESCRIPTOR.compat_id, DESCRIPTOR.block_tokens)
CONTAINER_SIZE = len(container.encode(random_sections(DESCRIPTOR, 4, 0, 31, 0), first_layer=0, token_count=4,
                                      descriptor=DESCRIPTOR, digests=False))


@pytest.fixture(params=["memory", "redis"])
def index_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[str]]:
    if request.param == "memory":
        yield []
        return
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
    with RedisServer.start(tmp_path / "redis") as server:
        yield ["--redis", server.url]


@pytest.fixture
def cluster(tmp_path: Path, index_store: list[str]) -> Iterator[dict[str, Any]]:
    dev = tmp_path / "dev"
    procs: list[Process] = []
    try:
        index = Process("index", "--dev", str(dev), *index_store)
        procs.append(index)
        # Room for two blocks in memory: a third one forces an eviction.
        holder = Process("holder", "--dev", str(dev), "--index", index.ready["base_uri"],
                         "--host-capacity", str(2 * CONTAINER_SIZE + CONTAINER_SIZE // 2), "--replica-ttl-ms", "30000")
        procs.append(holder)
        yield {"index": index.ready, "holder": holder.ready, "dev": dev}
    finally:
        for proc in reversed(procs):
            err = proc.stop()
            assert "Traceback" not in err, err


@pytest.fixture
async def client(cluster: dict[str, Any]) -> AsyncIterator[KvspClient]:
    ready = cluster["holder"]
    async with KvspClient(TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"])),
                          timeout=20) as c:
        yield c


def block(i: int) -> tuple[bytes, bytes]:
    """Block *i* of a prompt: its key and its container (seeded, so the test can compare octets)."""
    tokens = list(range(1000, 1000 + 4 * (i + 1)))
    key = KEYER.keys(tokens)[-1]
    enc = container.encode(random_sections(DESCRIPTOR, 4, 0, 31, seed=i), first_layer=0, token_count=4,
                           descriptor=DESCRIPTOR)
    return key, enc.tobytes()


def block_url(holder: str, key: bytes) -> str:
    return f"{holder}blocks/{DESCRIPTOR.compat_id.hex()}/{KEYER.scope_id.hex()}/{key.hex()}"


async def put(client: KvspClient, holder: str, i: int) -> Any:
    key, body = block(i)
    return await client.request("PUT", block_url(holder, key), content=body,
                                headers={"content-type": "application/kvsp-block", "if-none-match": "*"})


async def matched(fetcher: BlockFetcher, i: int) -> bool:
    response = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(i)[0]])
    return response.matched == 1


async def eventually(fetcher: BlockFetcher, i: int, present: bool, timeout: float = 10.0) -> None:
    """The publisher works asynchronously: wait for the index to say what we expect."""
    deadline = time.monotonic() + timeout
    while await matched(fetcher, i) != present:
        assert time.monotonic() < deadline, f"block {i} {'never appeared in' if present else 'stayed in'} the index"
        await asyncio.sleep(0.05)


async def test_publish_lookup_and_verified_layer_range(cluster: dict[str, Any], client: KvspClient) -> None:
    holder = cluster["holder"]["base_uri"]
    fetcher = BlockFetcher(client, cluster["index"]["base_uri"])
    created = await put(client, holder, 0)
    assert created.status == 201 and created.http_version == "HTTP/3"
    again = await put(client, holder, 0)
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


async def test_a_lease_protects_a_replica_until_it_expires(cluster: dict[str, Any], client: KvspClient) -> None:
    holder = cluster["holder"]["base_uri"]
    fetcher = BlockFetcher(client, cluster["index"]["base_uri"])
    for i in (0, 1):
        assert (await put(client, holder, i)).status == 201
    await eventually(fetcher, 0, True)
    await eventually(fetcher, 1, True)
    lease = LeaseRequest(DESCRIPTOR.compat_id, KEYER.scope_id, (block(0)[0],), ttl_ms=2000)
    granted = await client.request("POST", f"{holder}leases", content=json.dumps(lease.to_json()).encode(),
                                   headers={"content-type": "application/kvsp+json"})
    assert granted.status == 201 and granted.headers["location"].startswith("leases/")

    # Memory pressure: block 2 needs room. Block 0 is the least recently used, but leased: block 1 goes.
    assert (await put(client, holder, 2)).status == 201
    await eventually(fetcher, 1, False)  # evicted and withdrawn
    assert await matched(fetcher, 0) and await matched(fetcher, 2)
    assert (await client.request("GET", block_url(holder, block(0)[0]))).status == 200
    assert (await client.request("GET", block_url(holder, block(1)[0]))).status == 404

    await asyncio.sleep(2.2)  # the lease expires: block 0 is an ordinary replica again
    assert (await client.request("GET", block_url(holder, block(2)[0]))).status == 200  # now 0 is the LRU one
    assert (await put(client, holder, 3)).status == 201
    await eventually(fetcher, 0, False)
    assert (await client.request("GET", block_url(holder, block(0)[0]))).status == 404
    assert await matched(fetcher, 2) and await matched(fetcher, 3)


async def test_the_dev_client_has_every_right_and_strangers_none(cluster: dict[str, Any], tmp_path: Path) -> None:
    from tests.pki import make_pki

    holder = cluster["holder"]["base_uri"]
    other = make_pki(tmp_path / "other")  # a client of another CA
    files = TlsFiles(Path(cluster["holder"]["ca"]), other.files("alice").cert, other.files("alice").key)
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
