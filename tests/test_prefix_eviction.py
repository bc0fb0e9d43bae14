"""Issue 12, points 6 and 7, with real processes (``kvsp-quic index --dev`` and ``kvsp-quic holder --dev`` on
127.0.0.1, blocks PUT over HTTP/3):

* a holder filled past its capacity with one long chain keeps a leading run of it, so a lookup at the Index
  Service still matches blocks (with LRU it kept the chain's tail and a lookup matched none);
* a holder killed and started again on its local storage loses nothing it acknowledged (write-through), and
  withdraws the record of a block it cannot serve any more (a file that went bad while it was down) instead of
  leaving it advertised until its TTL runs out.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher
from tests.helpers import Process
from tests.support.cluster import CONTAINER_SIZE, DESCRIPTOR, KEYER, block, block_url, put_in_chain, settle

CHAIN = 24  # blocks in the chain
ROOM = 5  # blocks the holder's memory holds


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_holder_over_capacity_keeps_a_leading_run_of_a_long_chain(
        index: dict[str, Any], index_client: KvspClient, tmp_path: Path, workers: str) -> None:
    holder_proc = Process("holder", "--dev", str(tmp_path / "dev"), "--index", index["base_uri"],
                          "--workers", workers, "--host-capacity", str(ROOM * CONTAINER_SIZE + CONTAINER_SIZE // 2),
                          "--replica-ttl-ms", "60000")
    try:
        holder = holder_proc.ready["base_uri"]
        fetcher = BlockFetcher(index_client, index["base_uri"])
        for i in range(CHAIN):  # (with two processes, the kernel spreads the PUTs over both)
            await put_in_chain(index_client, holder, i)
        # every eviction took the deepest block held: blocks 0..ROOM-2 stay, with the newest block behind a gap
        run = await settle(fetcher, CHAIN, lambda n: n == ROOM - 1)
        assert run == ROOM - 1
        for i in range(ROOM - 1):
            r = await index_client.request("GET", block_url(holder, block(i)[0]))
            assert r.status == 200 and await r.aread() == block(i)[1]
        assert (await index_client.request("GET", block_url(holder, block(CHAIN - 2)[0]))).status == 404
    finally:
        err = holder_proc.stop()
        assert "Traceback" not in err, err


async def test_a_restarted_holder_serves_and_advertises_exactly_what_it_recovered(
        index: dict[str, Any], index_client: KvspClient, tmp_path: Path) -> None:
    storage = tmp_path / "local"
    args = ["holder", "--dev", str(tmp_path / "dev"), "--index", index["base_uri"], "--workers", "1",
            "--host-capacity", str(2 * CONTAINER_SIZE + CONTAINER_SIZE // 2), "--local-storage", str(storage),
            "--replica-ttl-ms", "60000"]
    first = Process(*args)
    holder = first.ready["base_uri"]
    fetcher = BlockFetcher(index_client, index["base_uri"])
    try:
        for i in range(6):  # 4 go down to local storage, 2 stay in memory (and are written through)
            await put_in_chain(index_client, holder, i)
        assert await settle(fetcher, 6, lambda n: n == 6) == 6
    finally:
        first.proc.send_signal(signal.SIGKILL)  # nothing withdrawn, nothing written at exit
        first.proc.wait(10)
        first.stop()
    bad = storage / f"{DESCRIPTOR.compat_id.hex()}.{KEYER.scope_id.hex()}.{block(3)[0].hex()}.kvb"
    raw = bytearray(bad.read_bytes())
    raw[-7] ^= 0x40  # block 3's file goes bad while the holder is down
    bad.write_bytes(raw)
    assert {p.stat().st_mode & 0o777 for p in storage.iterdir()} == {0o600}
    assert storage.stat().st_mode & 0o777 == 0o700

    port = holder.rsplit(":", 1)[1].strip("/")
    again = Process(*args, "--listen", f"127.0.0.1:{port}")
    try:
        assert again.ready["base_uri"] == holder
        # block 3's record is withdrawn at once (not after its 60 s TTL): the lookup stops there
        assert await settle(fetcher, 6, lambda n: n == 3) == 3
        for i in (0, 1, 2, 4, 5):  # everything else acknowledged survived, memory blocks included
            r = await index_client.request("GET", block_url(holder, block(i)[0]))
            assert r.status == 200 and await r.aread() == block(i)[1]
            found = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(i)[0]])
            assert found.matched == 1 and holder in {r.holder for r in found.blocks[0].replicas}
        assert (await index_client.request("GET", block_url(holder, block(3)[0]))).status == 404
        found = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(3)[0]])
        assert found.matched == 0
        assert not bad.exists() and os.path.exists(storage / "replicas.journal")
    finally:
        err = again.stop()
        assert "Traceback" not in err, err
