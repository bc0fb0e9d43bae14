"""Connect and stall timeouts on the retrieval path scale with the measured RTT and the block size (issue 12,
point 5), instead of a fixed 5 s (HTTP/3, HTTP/1.1) or 10 s (MOQT).

Unit tests of :mod:`quic.rtt` (the formulas, the bounded RTT table, TCP_INFO), then real processes on 127.0.0.1
(``kvsp-quic index --dev`` and ``kvsp-quic holder --dev``): a "black hole" -- a UDP socket bound on 127.0.0.1 that
never reads (no ICMP, no answer) with a TCP socket on the same port number that never accepts (the kernel completes
the TCP handshake, nobody answers the TLS ClientHello) -- listed first among a block's replicas, a real holder
second: the block comes from the real one about one scaled connect timeout later; and a holder frozen with SIGSTOP
in the middle of a block's HTTP/3 body: the fetcher moves on after the scaled stall timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher, HttpSource
from kvsp_moqt.source import MoqtSource
from kvsp_quic.records import LookupMatch, ReplicaRecord
from kvsp_quic.retrieval_plan import LayerRange
from moqt.aio import MoqtPool
from quic.rtt import (
    CONNECT_FLOOR,
    TCP_INFO_SIZE,
    RttSample,
    RttTable,
    connect_timeout,
    path_timeout,
    tcp_info_rtt,
)
from quic.tls import TlsFiles, TransportSettings
from tests.helpers import Clock, Process
from tests.support.cluster import DESCRIPTOR, KEYER, block, block_url

# -- the formulas -----------------------------------------------------------------------------------------------


def test_connect_timeout_is_the_configured_one_without_an_rtt_and_a_few_rtts_with_one() -> None:
    assert connect_timeout(None, ceiling=5.0) == 5.0
    assert connect_timeout(None, ceiling=10.0) == 10.0
    loopback = RttSample(0.0005, 0.0002, 0.025)
    assert connect_timeout(loopback, ceiling=10.0) == CONNECT_FLOOR == 1.0  # the floor decides on loopback
    wan = RttSample(0.1, 0.01, 0.025)  # 3 x (3 x 100 ms + PTO 100 + 40 + 25 ms) = 1.395 s
    assert connect_timeout(wan, ceiling=10.0) == pytest.approx(3 * (0.3 + 0.1 + 0.04 + 0.025))
    assert connect_timeout(RttSample(1.0, 0.5, 0.025), ceiling=5.0) == 5.0  # never beyond the configured one
    assert connect_timeout(loopback, ceiling=0.5) == 0.5  # nor the floor beyond it
    assert connect_timeout(wan, ceiling=10.0, floor=2.0) == 2.0


def test_path_timeout_adds_the_transfer_time_of_the_octets() -> None:
    sample = RttSample(0.01, 0.005, 0.025)  # PTO 55 ms
    assert path_timeout(None, floor=1.0, ceiling=30.0) == 30.0
    assert path_timeout(sample, floor=1.0, ceiling=30.0) == 1.0
    assert path_timeout(sample, floor=0.01, ceiling=30.0) == pytest.approx(4 * 0.055)
    assert path_timeout(sample, floor=1.0, ceiling=30.0, octets=500_000_000) == pytest.approx(4 * 0.055 + 10.0)
    assert path_timeout(sample, floor=1.0, ceiling=5.0, octets=500_000_000) == 5.0
    assert sample.pto == pytest.approx(0.01 + 0.02 + 0.025)
    with pytest.raises(ValueError):
        RttSample(-1.0, 0.0)


# -- the table --------------------------------------------------------------------------------------------------


def test_rtt_table_is_bounded_and_forgets_lapsed_hosts() -> None:
    clock = Clock(100.0)
    table = RttTable(capacity=2, ttl=60.0, clock=clock)
    assert table.get("a") is None and table.connect_timeout("a", 5.0) == 5.0
    table.record("a", 0.01, 0.001)
    clock.now += 1
    table.record("b", 0.02, 0.002)
    clock.now += 1
    table.record("c", 0.03, 0.003)  # a third host: the least recently recorded ("a") goes
    assert len(table) == 2 and "a" not in table and "b" in table and "c" in table
    table.record("b", 0.02, 0.002)  # recorded again: now "c" is the oldest
    table.record("d", 0.04, 0.004)
    assert "c" not in table and "b" in table and "d" in table
    assert table.connect_timeout("d", 5.0) == 1.0
    clock.now += 61  # no sample for 61 s: lapsed, the configured timeout again
    assert table.get("b") is None and table.connect_timeout("d", 5.0) == 5.0
    assert len(table) == 0
    with pytest.raises(ValueError):
        RttTable(capacity=0)


def test_rtt_table_takes_a_slower_path_at_once_and_a_faster_one_slowly() -> None:
    table = RttTable(clock=Clock())
    table.record("h", 0.1, 0.01)
    slower = table.record("h", 0.3, 0.01)
    assert slower.smoothed == 0.3 and slower.variance == pytest.approx(0.01 + (0.2 - 0.01) / 4)
    faster = table.record("h", 0.1, 0.01)
    assert faster.smoothed == pytest.approx(0.3 - 0.2 / 8)
    table.observe("h", [None, RttSample(0.5, 0.02)])  # connections without a sample are skipped
    sample = table.get("h")
    assert sample is not None and sample.smoothed == 0.5


def test_tcp_info_rtt() -> None:
    raw = bytes(8) + struct.pack("=17I", *([0] * 15), 1500, 700)
    assert tcp_info_rtt(raw) == (0.0015, 0.0007)
    assert tcp_info_rtt(raw[:-1]) is None
    assert tcp_info_rtt(bytes(TCP_INFO_SIZE)) is None  # no sample yet
    if not hasattr(socket, "TCP_INFO"):
        return
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        conn, _ = server.accept()
        with conn:
            client.sendall(b"x")
            conn.recv(1)
            found = tcp_info_rtt(client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SIZE))
    assert found is not None and 0 < found[0] < 1.0  # the kernel's estimate of a loopback path


# -- real processes ---------------------------------------------------------------------------------------------


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port on 127.0.0.1 where a UDP socket is bound that never reads (datagrams are dropped, no ICMP comes
    back) and a TCP socket listens that never accepts (nobody answers the TLS ClientHello)."""
    for _ in range(20):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        port = int(udp.getsockname()[1])
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            tcp.bind(("127.0.0.1", port))
        except OSError:
            udp.close()
            tcp.close()
            continue
        tcp.listen(8)
        try:
            yield port
        finally:
            udp.close()
            tcp.close()
        return
    raise RuntimeError("no port free for both UDP and TCP")


class InOrder:
    """A ranking that keeps the replicas in the order the match lists them."""

    def __call__(self, replicas: Sequence[ReplicaRecord], layers: LayerRange) -> list[ReplicaRecord]:
        return list(replicas)


def files_of(ready: dict[str, Any]) -> TlsFiles:
    return TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))


async def stored(client: KvspClient, fetcher: BlockFetcher, holders: Sequence[dict[str, Any]],
                 count: int) -> list[LookupMatch]:
    """PUT blocks 0..count-1 at every holder; their matches once the Index Service lists every replica."""
    for holder in holders:
        for i in range(count):
            key, body = block(i)
            r = await client.request("PUT", block_url(holder["base_uri"], key), content=body,
                                     headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            assert r.status == 201, await r.aread()
    wanted = {h[kind] for h in holders for kind in ("base_uri", "moqt")}
    deadline = time.monotonic() + 15
    while True:
        found = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(i)[0] for i in range(count)])
        if len(found.blocks) == count and all({r.holder for r in m.replicas} == wanted for m in found.blocks):
            return list(found.blocks)
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.1)


def replica(match: LookupMatch, holder: str) -> ReplicaRecord:
    return next(r for r in match.replicas if r.holder == holder)


@pytest.mark.parametrize("kind", ["moqt", "https"])
async def test_a_black_hole_replica_costs_one_scaled_connect_timeout(two_holder_cluster: dict[str, Any],
                                                                   black_hole: int, kind: str) -> None:
    """The first replica of a block is at a port that answers nothing: the fetcher gives up on it after the
    connect timeout scaled from the RTT it measured to 127.0.0.1 (1 s, the floor) -- HTTP/3, then HTTP/1.1 over
    TCP for an ``https`` record -- and the real holder's replica delivers the block. With the fixed timeouts it
    took 10 s (MOQT) and 5 s + 5 s (HTTP/3, then HTTP/1.1; the GET was retried twice more: 20 s)."""
    ready = two_holder_cluster["index"]
    holder = two_holder_cluster["holders"][0]
    files = files_of(ready)
    rtts = RttTable()
    async with KvspClient(files, timeout=30, rtts=rtts) as client, \
            MoqtPool(files, rtts=rtts) as pool:
        assert pool.dial_timeout("127.0.0.1") == 10.0 and client._pool.dial_timeout("127.0.0.1") == 5.0
        fetcher = BlockFetcher(client, ready["base_uri"], descriptors=[DESCRIPTOR], ranking=InOrder(),
                               sources=[MoqtSource(pool, [DESCRIPTOR]), HttpSource(client)], report_failures=False)
        matches = await stored(client, fetcher, [holder], 2)
        warm = await fetcher.fetch_block(LookupMatch(matches[0].block_key, (replica(matches[0], holder["moqt"]),)))
        assert warm is not None and warm.tobytes() == block(0)[1]  # an earlier connection to 127.0.0.1
        assert rtts.get("127.0.0.1") is not None
        assert pool.dial_timeout("127.0.0.1") == 1.0 and client._pool.dial_timeout("127.0.0.1") == 1.0
        async with MoqtPool(files) as fixed:  # a pool without a table keeps its configured connect timeout
            assert fixed.dial_timeout("127.0.0.1") == 10.0

        real = replica(matches[1], holder[kind if kind == "moqt" else "base_uri"])
        dead = dataclasses.replace(real, holder=f"{kind}://127.0.0.1:{black_hole}/")
        start = time.monotonic()
        result = await fetcher.fetch_block(LookupMatch(matches[1].block_key, (dead, real)))
        elapsed = time.monotonic() - start
        assert result is not None and result.tobytes() == block(1)[1]
        assert [r.holder for r in result.records] == [real.holder]
        assert fetcher.metrics.transport_errors == 1, fetcher.metrics.snapshot()
        # MOQT: one connect (1 s). https: HTTP/3's connect (1 s), then HTTP/1.1's (1 s), not retried
        bound = 2.5 if kind == "moqt" else 3.5
        assert elapsed < bound, f"{elapsed:.2f} s (the fixed connect timeouts were 10 s MOQT, 5 + 5 s HTTP)"
        assert elapsed >= 0.9 * (1.0 if kind == "moqt" else 2.0)  # it did wait for the black hole


async def test_a_holder_frozen_mid_body_costs_one_scaled_stall_timeout(two_holder_cluster: dict[str, Any]) -> None:
    """A holder stopped with SIGSTOP while it sends a block over HTTP/3 (our receive window is small, so most of
    the block is still at the holder): no octet arrives any more, no ICMP either; the fetcher gives up after the
    stall timeout scaled from the RTT (1 s, the floor, and the block's transfer time at 50 MB/s) and asks the other
    holder for the layers still missing. Before, the body waited out the request timeout (30 s here)."""
    ready = two_holder_cluster["index"]
    frozen, alive = two_holder_cluster["holders"]
    files = files_of(ready)
    settings = TransportSettings(stream_window=64 << 10, connection_window=256 << 10)
    async with KvspClient(files, timeout=30, settings=settings, rtts=RttTable()) as client:
        fetcher = BlockFetcher(client, ready["base_uri"], descriptors=[DESCRIPTOR], ranking=InOrder(),
                               sources=[HttpSource(client)], report_failures=False)
        match = (await stored(client, fetcher, [frozen, alive], 1))[0]
        first, second = replica(match, frozen["base_uri"]), replica(match, alive["base_uri"])
        layers = []
        start = 0.0
        async with fetcher.fetch_layers(LookupMatch(match.block_key, (first, second))) as stream:
            async for layer in stream:
                layers.append(layer)
                if len(layers) == 1:
                    two_holder_cluster["procs"][1].proc.send_signal(signal.SIGSTOP)
                    start = time.monotonic()
        elapsed = time.monotonic() - start
        two_holder_cluster["procs"][1].proc.send_signal(signal.SIGCONT)
        assert stream.complete and [x.index for x in layers] == list(range(DESCRIPTOR.layers))
        assert [r.holder for r in stream.records] == [first.holder, second.holder]
        assert fetcher.metrics.transport_errors == 1, fetcher.metrics.snapshot()
        assert 0.9 <= elapsed < 5.0, f"{elapsed:.2f} s (the request timeout was 30 s)"


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="TCP_INFO is Linux's")
async def test_an_http11_connection_records_the_kernels_rtt(tmp_path: Path) -> None:
    """HTTP/1.1 connections feed the table with the kernel's estimate (TCP_INFO): a later connect to the host is
    scaled even when no QUIC connection went there."""
    proc = Process("index", "--dev", str(tmp_path / "dev"))
    try:
        rtts = RttTable()
        async with KvspClient(files_of(proc.ready), prefer="tcp", rtts=rtts) as client:
            assert client._h1.rtts is rtts and rtts.get("127.0.0.1") is None
            r = await client.request("GET", proc.ready["base_uri"] + "metrics")
            assert r.http_version == "HTTP/1.1"
            sample = rtts.get("127.0.0.1")
            assert sample is not None and 0 < sample.smoothed < 0.5
            assert rtts.connect_timeout("127.0.0.1", 5.0) == CONNECT_FLOOR
    finally:
        proc.stop()
