"""Worker processes (`--workers N`): the shared host tier, real multi-process holders and relays on one port.

The shared host tier is tested as a tier (its files, the worker's reader, staging and adoption); the holder is
started for real with two workers and driven over many connections -- which the kernel spreads over the processes
(``SO_REUSEPORT``); the test checks from /proc that both really served -- on HTTP/1.1 and HTTP/3, with an Index
Service: every block readable whichever process stored it, one record per block, leases and their quota through
any process, eviction seen by every process, a killed worker started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.records import LeaseRenewal, LeaseRequest, LeaseResponse
from kvsp_quic.storage.shared_host import STAGED_PREFIX, Allocation, SharedHostReader, SharedHostTier
from kvsp_quic.storage.tiers import TieredStore
from quic.tls import TlsFiles
from tests.helpers import Process
from tests.support.cluster import CONTAINER_SIZE, DESCRIPTOR, KEYER, block, block_url, matched
from tests.support.descriptors import small_descriptor
from tests.support.tiers import block as tier_block
from tests.support.tiers import never

# -- the shared host tier ----------------------------------------------------------------------------------------


@pytest.fixture
def d() -> CompatDescriptor:
    return small_descriptor()


def _names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_uploads_are_received_where_they_are_served(d: CompatDescriptor, tmp_path: Path) -> None:
    tier = SharedHostTier(tmp_path, 10 << 20)
    store = TieredStore([tier])
    meta, data = tier_block(d, 1)
    alloc = tier.allocate(d.layers, len(data))
    alloc.container[:] = data
    assert _names(tmp_path) == set()  # an unnamed file until stored
    store.put(meta, alloc.container, never)
    assert _names(tmp_path) == {tier.path_of(meta.id).name}
    assert bytes(tier.read(meta.id)) == bytes(data)
    # another process's view: the same octets, from the file
    reader = SharedHostReader(tmp_path)
    entry = reader.get(meta.id)
    assert entry is not None and bytes(entry.container) == bytes(data)
    assert entry.meta == meta
    # an abandoned upload leaves no file behind
    Allocation(tmp_path, d.layers, len(data)).discard()
    assert len(_names(tmp_path)) == 1


def test_eviction_is_seen_by_readers(d: CompatDescriptor, tmp_path: Path) -> None:
    meta1, data1 = tier_block(d, 1)
    tier = SharedHostTier(tmp_path, int(len(data1) * 1.5))
    store = TieredStore([tier])
    store.put(meta1, data1, never)  # octets from elsewhere: a file of their own
    reader = SharedHostReader(tmp_path)
    held = reader.get(meta1.id)
    assert held is not None
    meta2, data2 = tier_block(d, 2)
    outcome = store.put(meta2, data2, never)
    assert [m.id for m in outcome.evicted] == [meta1.id]
    assert reader.get(meta1.id) is None  # the file lost its name: the reader lets go
    assert bytes(held.container) == bytes(data1)  # a view in use stays valid
    entry = reader.get(meta2.id)
    assert entry is not None and bytes(entry.container) == bytes(data2)


def test_a_staged_upload_is_adopted_once(d: CompatDescriptor, tmp_path: Path) -> None:
    tier = SharedHostTier(tmp_path, 10 << 20)
    store = TieredStore([tier])
    meta, data = tier_block(d, 3)
    worker_alloc = Allocation(tmp_path, d.layers, len(data))  # as a worker receives it
    worker_alloc.container[:] = data
    name = worker_alloc.stage(meta)
    assert name.startswith(STAGED_PREFIX) and name in _names(tmp_path)
    adopted = tier.adopt(name, meta.id)
    assert adopted.layer_digests == meta.layer_digests
    store.put(meta, adopted.container, never)
    adopted.discard()
    worker_alloc.discard()
    assert _names(tmp_path) == {tier.path_of(meta.id).name}
    assert bytes(tier.read(meta.id)) == bytes(data)
    with pytest.raises(ValueError, match="not a staged upload"):
        tier.adopt("../etc/passwd", meta.id)


def test_a_refused_staged_upload_leaves_nothing(d: CompatDescriptor, tmp_path: Path) -> None:
    tier = SharedHostTier(tmp_path, 10 << 20)
    meta, data = tier_block(d, 4)
    alloc = Allocation(tmp_path, d.layers, len(data))
    alloc.container[:] = data
    name = alloc.stage(meta)
    adopted = tier.adopt(name, meta.id)
    adopted.discard()  # the primary refused it (e.g. 412: the block exists)
    alloc.discard()
    assert _names(tmp_path) == set()


# -- a real holder with two workers ------------------------------------------------------------------------------


def _sockets_of(pid: int) -> set[str]:
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    out.add(target[8:-1])
    return out


def _established(port: int) -> set[str]:
    """Socket inodes of the established TCP connections whose local port is *port*."""
    inodes = set()
    with open("/proc/net/tcp") as fh:
        next(fh)
        for line in fh:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":
                inodes.add(fields[9])
    return inodes


@pytest.fixture
def workers_cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    dev = tmp_path / "dev"
    procs: list[Process] = []
    try:
        index = Process("index", "--dev", str(dev))
        procs.append(index)
        holder = Process("holder", "--dev", str(dev), "--index", index.ready["base_uri"], "--workers", "2",
                         "--host-capacity", str(3 * CONTAINER_SIZE + CONTAINER_SIZE // 2))
        procs.append(holder)
        yield {"index": index.ready, "holder": holder.ready, "holder_proc": holder}
    finally:
        for proc in reversed(procs):
            err = proc.stop()
            assert "Traceback" not in err, err


def _files(ready: dict[str, Any]) -> TlsFiles:
    return TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))


async def _tls_connections(ready: dict[str, Any], count: int) -> list[asyncio.StreamWriter]:
    files = _files(ready)
    ctx = ssl.create_default_context(cafile=str(files.ca))
    ctx.load_cert_chain(str(files.cert), str(files.key))
    port = int(ready["base_uri"].rsplit(":", 1)[1].strip("/"))
    writers = []
    for _ in range(count):
        _reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
        writers.append(writer)
    return writers


async def test_two_workers_serve_one_store_and_one_set_of_records(workers_cluster: dict[str, Any]) -> None:
    ready = workers_cluster["holder"]
    holder = ready["base_uri"]
    assert ready["workers"] == 2 and len(ready["worker_pids"]) == 1
    pids = [workers_cluster["holder_proc"].proc.pid, *ready["worker_pids"]]
    port = int(holder.rsplit(":", 1)[1].strip("/"))

    # 16 TCP connections: the kernel hands them to both processes
    writers = await _tls_connections(ready, 16)
    try:
        held = _established(port)
        owners = {pid: len(_sockets_of(pid) & held) for pid in pids}
        assert sum(owners.values()) == 16 and all(n > 0 for n in owners.values()), owners
    finally:
        for w in writers:
            w.close()
        for w in writers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(w.wait_closed(), 5)

    # blocks stored through many clients (each its own connections) are read back through every other one
    clients = [KvspClient(_files(ready), timeout=20, prefer=prefer) for prefer in ("h3", "tcp") * 4]
    try:
        for i, client in enumerate(clients[:3]):
            key, body = block(i)
            r = await client.request("PUT", block_url(holder, key), content=body,
                                     headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            assert r.status == 201, await r.aread()
        for client in clients:
            for i in range(3):
                key, body = block(i)
                r = await client.request("GET", block_url(holder, key))
                assert r.status == 200 and await r.aread() == body
            again = await client.request("PUT", block_url(holder, block(0)[0]), content=block(0)[1],
                                         headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            assert again.status == 412  # whichever process is asked: the block exists and is kept

        # one record per block at the index, published by the primary
        fetcher = BlockFetcher(clients[0], workers_cluster["index"]["base_uri"])
        deadline = time.monotonic() + 10
        while not all([await matched(fetcher, i) for i in range(3)]):
            assert time.monotonic() < deadline, "the records never appeared"
            await asyncio.sleep(0.1)
        found = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(i)[0] for i in range(3)])
        for match in found.blocks:  # the holder's record and its moqt:// twin, once each
            assert sorted(r.holder for r in match.replicas) == sorted([holder, ready["moqt"]])

        # a lease made through one client is renewed and released through others (one lease table)
        request = LeaseRequest(DESCRIPTOR.compat_id, KEYER.scope_id, (block(0)[0],), 2000)
        r = await clients[1].request("POST", f"{holder}leases", content=json.dumps(request.to_json()).encode(),
                                     headers={"content-type": "application/kvsp+json"})
        assert r.status == 201, await r.aread()
        lease = LeaseResponse.from_json(r.json())
        for client in clients[2:6]:
            r = await client.request("PUT", f"{holder}leases/{lease.lease}",
                                     content=json.dumps(LeaseRenewal(2000).to_json()).encode(),
                                     headers={"content-type": "application/kvsp+json"})
            assert r.status == 200, await r.aread()
        # block 0 is leased: storing 3 more forces evictions of 1 and 2 only, whichever process stores them
        for i, client in zip(range(3, 6), clients[5:8], strict=True):
            key, body = block(i)
            r = await client.request("PUT", block_url(holder, key), content=body,
                                     headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            assert r.status == 201, await r.aread()
        for client in clients:
            assert (await client.request("GET", block_url(holder, block(0)[0]))).status == 200
            assert (await client.request("GET", block_url(holder, block(1)[0]))).status == 404
        r = await clients[7].request("DELETE", f"{holder}leases/{lease.lease}")
        assert r.status == 204
        r = await clients[6].request("DELETE", f"{holder}leases/{lease.lease}")
        assert r.status == 404
    finally:
        for client in clients:
            await client.aclose()


async def test_a_killed_worker_is_started_again(workers_cluster: dict[str, Any]) -> None:
    ready = workers_cluster["holder"]
    (worker,) = ready["worker_pids"]
    os.kill(worker, signal.SIGKILL)
    primary = workers_cluster["holder_proc"].proc.pid
    deadline = time.monotonic() + 30
    while True:
        children = set()
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{primary}/task"):
                children |= set(Path(f"/proc/{primary}/task/{tid}/children").read_text().split())
        live = {int(c) for c in children} - {worker}
        # the new worker serves once it owns a socket bound to the port
        if any(_sockets_of(pid) for pid in live):
            break
        assert time.monotonic() < deadline, "the worker was not started again"
        await asyncio.sleep(0.2)
    key, body = block(7)
    statuses = []
    for _ in range(8):  # a fresh client each time: new connections, spread over both processes
        async with KvspClient(_files(ready), timeout=20, prefer="tcp") as client:
            r = await client.request("PUT", block_url(ready["base_uri"], key), content=body,
                                     headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            statuses.append(r.status)
            r = await client.request("GET", block_url(ready["base_uri"], key))
            assert r.status == 200 and await r.aread() == body
    assert sorted(statuses) == [201] + [412] * 7
    err_proc = workers_cluster["holder_proc"]
    assert err_proc.proc.poll() is None


# -- a real relay with two workers -------------------------------------------------------------------------------


async def test_relay_workers_each_fetch_kvsp_tracks_upstream(tmp_path: Path) -> None:
    from kvsp_moqt.holder_tracks import fetch_layers
    from moqt.aio import connect_moqt

    dev = tmp_path / "dev"
    procs = [Process("index", "--dev", str(dev))]
    try:
        index = procs[0].ready["base_uri"]
        procs.append(Process("holder", "--dev", str(dev), "--index", index, "--workers", "2"))
        procs.append(Process("relay", "--dev", str(dev), "--index", index, "--workers", "2", "--cache-size", "64MiB"))
        holder, relay = procs[1].ready, procs[2].ready
        assert relay["workers"] == 2 and relay["cache_bytes"] == 64 << 20 and len(relay["worker_pids"]) == 1
        key, body = block(0)
        async with KvspClient(_files(holder), timeout=20) as client:
            r = await client.request("PUT", block_url(holder["base_uri"], key), content=body,
                                     headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            assert r.status == 201
            fetcher = BlockFetcher(client, index)
            record = None
            for _ in range(200):
                found = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [key])
                record = next((rep for m in found.blocks for rep in m.replicas if rep.holder == holder["moqt"]), None)
                if record is not None:
                    break
                await asyncio.sleep(0.05)
            assert record is not None
        port = int(relay["moqt"].rsplit(":", 1)[1].strip("/"))
        for _ in range(6):  # fresh connections: the kernel spreads them over the relay's processes
            conn = await connect_moqt("127.0.0.1", port, _files(relay), timeout=10)
            try:
                layers = [layer async for layer in fetch_layers(conn, record, descriptor=DESCRIPTOR)]
            finally:
                await conn.aclose()
            assert [layer.index for layer in layers] == list(range(DESCRIPTOR.layers))
            assert b"".join(bytes(layer.k) + bytes(layer.v) for layer in layers) == \
                b"".join(bytes(k) + bytes(v) for k, v in _sections(body))
    finally:
        for proc in reversed(procs):
            assert "Traceback" not in proc.stop()


def _sections(body: bytes) -> list[tuple[memoryview, memoryview]]:
    from kvsp_quic import container as c

    _header, layers = c.decode(body, DESCRIPTOR)
    return [(layer.k, layer.v) for layer in layers]


@pytest.mark.parametrize("extra", [["--open-prefix", "moq-test", "--index", "https://127.0.0.1:9/"], []])
def test_published_namespaces_need_one_relay_process(tmp_path: Path, extra: list[str]) -> None:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "kvsp_app", "relay", "--dev", str(tmp_path / "dev"), "--workers", "2",
                          *extra], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and run.stdout == ""
    assert "--workers 1" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


async def test_the_storage_quota_holds_whichever_process_receives(tmp_path: Path) -> None:
    config = tmp_path / "holder.toml"
    config.write_text(f"[holder]\nworkers = 2\nmax_octets_per_principal = {2 * CONTAINER_SIZE + CONTAINER_SIZE // 2}\n")
    holder = Process("holder", "--dev", str(tmp_path / "dev"), "--config", str(config))
    try:
        ready = holder.ready
        assert ready["workers"] == 2
        for i in range(4):  # a fresh client each time: new connections, spread over both processes
            async with KvspClient(_files(ready), timeout=20, prefer="tcp") as client:
                key, body = block(i)
                r = await client.request("PUT", block_url(ready["base_uri"], key), content=body,
                                         headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
                assert r.status == 201, await r.aread()
        async with KvspClient(_files(ready), timeout=20) as client:
            found = [(await client.request("GET", block_url(ready["base_uri"], block(i)[0]))).status
                     for i in range(4)]
        assert found == [404, 404, 200, 200]  # the principal's own oldest replicas made room
    finally:
        assert "Traceback" not in holder.stop()
