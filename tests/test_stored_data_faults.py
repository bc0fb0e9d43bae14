"""Issue 13: 422 for stored-data faults. A real ``kvsp-quic holder --local-storage`` whose block file goes bad on
disk after it was stored (one octet flipped while the holder runs) answers the next GET of that block with 422
``kvsp-digest-mismatch`` (spec, Problem Types: "Stored data does not match its digest") -- never 200 with the bad
octets, never 500; before, 404, so a client could not tell corruption from eviction. The replica is dropped
(the next GET is 404) and withdrawn from the Index Service (a lookup no longer finds it)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic.problems import KVSP_TYPE_BASE
from tests.helpers import Process
from tests.support.cluster import CONTAINER_SIZE, DESCRIPTOR, KEYER, block, block_url, put_in_chain, settle


@pytest.mark.parametrize("workers", ["1", "2"])  # 2: a GET may be served by the worker process
async def test_a_corrupt_local_storage_file_answers_422_and_is_dropped_and_withdrawn(
        index: dict[str, object], index_client: KvspClient, tmp_path: Path, workers: str) -> None:
    storage = tmp_path / "local"
    proc = Process("holder", "--dev", str(tmp_path / "dev"), "--index", str(index["base_uri"]), "--workers", workers,
                   "--host-capacity", str(2 * CONTAINER_SIZE + CONTAINER_SIZE // 2), "--local-storage", str(storage),
                   "--replica-ttl-ms", "60000")
    try:
        holder = proc.ready["base_uri"]
        fetcher = BlockFetcher(index_client, str(index["base_uri"]))
        for i in range(6):  # blocks 0..3 go down to local storage; 4 and 5 stay in memory
            await put_in_chain(index_client, holder, i)
        assert await settle(fetcher, 6, lambda n: n == 6) == 6
        bad = storage / f"{DESCRIPTOR.compat_id.hex()}.{KEYER.scope_id.hex()}.{block(1)[0].hex()}.kvb"
        raw = bytearray(bad.read_bytes())
        raw[-7] ^= 0x40  # block 1's file goes bad on disk while the holder runs
        bad.write_bytes(raw)

        r = await index_client.request("GET", block_url(holder, block(1)[0]))
        body = await r.aread()
        assert r.status == 422, (r.status, body[:200])
        assert (r.headers.get("content-type") or "").startswith("application/problem+json")
        problem = r.json()
        assert problem["type"] == KVSP_TYPE_BASE + "kvsp-digest-mismatch" and problem["status"] == 422
        # dropped: not served again (whichever process answers), and withdrawn from the Index Service
        deadline = time.monotonic() + 15
        while (await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(1)[0]])).matched:
            assert time.monotonic() < deadline, "the bad replica's record was not withdrawn"
            await asyncio.sleep(0.1)
        while (await index_client.request("GET", block_url(holder, block(1)[0]))).status != 404:
            assert time.monotonic() < deadline, "the bad replica is still there"  # (dropped once withdrawn)
            await asyncio.sleep(0.1)
        for _ in range(4):  # whichever process answers
            assert (await index_client.request("GET", block_url(holder, block(1)[0]))).status == 404
        for i in (0, 2, 3, 4, 5):  # the others are intact and served
            r = await index_client.request("GET", block_url(holder, block(i)[0]))
            assert r.status == 200 and await r.aread() == block(i)[1]
    finally:
        err = proc.stop()
        assert "Traceback" not in err, err
