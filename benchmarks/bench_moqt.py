"""MOQT FETCH of a KVSP block: our publisher (a Holder's tracks) vs a raw, tuned aioquic stream, in the same run.

    python -m benchmarks.bench_moqt [--reps 7] [--layers 32] [--layer-kib 512] [--datagram 1452,8952,16384]

The subject: a 16 MiB block (32 layers of 512 KiB: K and V of 256 KiB each) stored in a Holder, served by
kvsp_moqt.holder_tracks.HolderTracks on a QuicListener (both drafts) in its own process; the client
(moqt.aio.connect_moqt on
an established session) FETCHes group 0 and verifies every layer's SHA-256 against the Replica Record as it
arrives (kvsp_moqt.holder_tracks.fetch_layers). Also measured: the same FETCH without verification (the adapter alone).
Baseline: benchmarks.bench_h3's raw server: one QUIC stream carrying the same octets between plain aioquic
endpoints with the same tuning (the same datagram size, 64 MiB windows, 4 MiB socket buffers), no MOQT, no hashing.
The baseline opens a new connection per transfer (handshake not timed), so it starts with a cold congestion
window; the MOQT FETCHes run on an established session, and once more on a new connection each ("new
connection") for the like-for-like comparison. Time to first layer: from sending the FETCH (the raw request) to
the first complete, verified layer (the first layer's octets). Subject and baseline alternate; medians reported.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from benchmarks.bench_h3 import (
    DATAGRAM,
    SETTINGS,
    RawClientProtocol,
    add_datagram_argument,
    per_datagram,
    start_server,
)
from kvsp_moqt.holder_tracks import HolderTracks, fetch_layers
from kvsp_moqt.tracks import fetch_range, moqt_record, record_track
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.roles.holder import Holder, HolderSettings
from moqt.aio import connect_moqt, moqt_handlers
from quic.listener import QuicListener
from quic.tls import TlsFiles, quic_configuration
from quic.udp import bind_udp

ALICE = "urn:kvsp:client:alice"
HOLDER = "https://127.0.0.1/kvsp/"
SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
KEY = bytes(range(32))


def descriptor(layers: int, layer_kib: int) -> CompatDescriptor:
    # bf16, 8 heads x 128 dims: 2 KiB per token and section; K and V of a layer are layer_kib / 2 each.
    tokens = layer_kib // 4
    return CompatDescriptor.from_json({
        "model": "bench", "model_digest": "sha-256:" + "00" * 32, "tokenizer_digest": "sha-256:" + "11" * 32,
        "layers": layers, "kv_heads": 8, "head_dim": 128, "kv_dtype": "bf16", "positional": "rope",
        "block_tokens": tokens, "layout": "kvsp-layout-1"})


def block(d: CompatDescriptor) -> bytes:
    section = d.section_length(d.block_tokens)
    rows = [(os.urandom(section), os.urandom(section)) for _ in range(d.layers)]
    return c.encode(rows, first_layer=0, token_count=d.block_tokens, descriptor=d).tobytes()


# -- the publisher process ----------------------------------------------------------------------------------------


async def serve(cert_dir: str, layers: int, layer_kib: int) -> None:
    d = descriptor(layers, layer_kib)
    holder = Holder(HolderSettings(HOLDER, (d,), host_capacity=1 << 30))
    policy = Policy.from_dict({"principal": [{"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]}]})
    writer = policy.principal(ALICE)
    assert writer is not None
    record = holder.store(writer, d.compat_id, SCOPE, KEY, block(d), "*")
    listener = QuicListener(TlsFiles.in_dir(cert_dir, "server"), moqt_handlers(HolderTracks(holder, policy)),
                            settings=SETTINGS)
    await listener.start("127.0.0.1", 0)
    print(json.dumps({"port": listener.port, "record": record.to_json()}), flush=True)
    await asyncio.Event().wait()


# -- the raw baseline with a first-layer time ----------------------------------------------------------------------


class FirstLayerClient(RawClientProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_at = 0.0
        self.first_size = 0

    def quic_event_received(self, event: events.QuicEvent) -> None:
        super().quic_event_received(event)
        if isinstance(event, events.StreamDataReceived) and not self.first_at and self.received >= self.first_size:
            self.first_at = time.perf_counter()


async def raw_fetch(port: int, files: TlsFiles, size: int, first_size: int) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    config = quic_configuration(files, is_client=True, alpn=["raw"], settings=SETTINGS, server_name="127.0.0.1")
    sock = bind_udp("127.0.0.1", 0, SETTINGS.socket_buffer)
    transport, proto = await loop.create_datagram_endpoint(
        lambda: FirstLayerClient(QuicConnection(configuration=config)), sock=sock)
    proto.connect(("127.0.0.1", port))
    await proto.wait_connected()
    quic = proto._quic
    stream_id = quic.get_next_available_stream_id()
    proto.done = loop.create_future()
    proto.received, proto.first_at, proto.first_size = 0, 0.0, first_size
    start = time.perf_counter()
    quic.send_stream_data(stream_id, f"G{size}".encode(), True)
    proto.transmit()
    await proto.done
    elapsed = time.perf_counter() - start
    proto.close()
    transport.close()
    return elapsed, proto.first_at - start


# -- the run --------------------------------------------------------------------------------------------------------


async def measure(cert_dir: str, reps: int, layers: int, layer_kib: int) -> list[tuple[str, float, float]]:
    files = TlsFiles.in_dir(cert_dir, "alice")
    d = descriptor(layers, layer_kib)
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_moqt", "--serve", cert_dir, str(layers),
                             str(layer_kib)], stdout=subprocess.PIPE, text=True)
    raw_proc, raw_port = start_server("raw", cert_dir)
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    record = moqt_record(ReplicaRecord.from_json(ready["record"]), f"moqt://127.0.0.1:{ready['port']}/")
    size = layers * layer_kib << 10
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        conns = {alpn: await connect_moqt("127.0.0.1", ready["port"], files, settings=SETTINGS, alpn=alpn)
                 for alpn in ("moq-00", "moqt-18")}

        async def verified(alpn: str, conn: Any = None) -> tuple[float, float]:
            start = time.perf_counter()
            first = 0.0
            count = 0
            async for layer in fetch_layers(conn or conns[alpn], record, descriptor=d):
                count += 1
                if not first:
                    first = time.perf_counter() - start
                assert layer.digest is not None
            assert count == layers
            return time.perf_counter() - start, first

        async def fresh(alpn: str) -> tuple[float, float]:
            """On a new connection (handshake and SETUP not timed), as the raw baseline: no warm congestion window."""
            conn = await connect_moqt("127.0.0.1", ready["port"], files, settings=SETTINGS, alpn=alpn)
            try:
                return await verified(alpn, conn)
            finally:
                await conn.aclose()

        async def unverified(alpn: str) -> tuple[float, float]:
            namespace, name = record_track(record)
            start = time.perf_counter()
            first, got = 0.0, 0
            async with conns[alpn].fetch(namespace, name, *fetch_range(0, layers - 1)) as fetch:
                while (piece := await fetch.next_piece()) is not None:
                    got += len(piece.data)
                    if piece.complete and not first:
                        first = time.perf_counter() - start
            assert got == size
            return time.perf_counter() - start, first

        subjects: dict[str, Callable[[], Awaitable[tuple[float, float]]]] = {
            "raw aioquic stream (baseline)": functools.partial(raw_fetch, raw_port, files, size, layer_kib << 10)}
        for alpn, draft in (("moq-00", "14"), ("moqt-18", "18")):
            subjects[f"MOQT draft {draft} FETCH, verified layers"] = functools.partial(verified, alpn)
            subjects[f"MOQT draft {draft} FETCH, not verified"] = functools.partial(unverified, alpn)
            subjects[f"MOQT draft {draft} FETCH, verified, new connection"] = functools.partial(fresh, alpn)
        for run in subjects.values():  # warm-up
            await run()
        for _ in range(reps):
            for label, run in subjects.items():
                rows.setdefault(label, []).append(await run())
        for conn in conns.values():
            await conn.aclose()
    finally:
        for p in (proc, raw_proc):
            p.terminate()
            p.wait()
    mb = size / 1e6
    return [(label, mb / statistics.median(t for t, _ in times), statistics.median(f for _, f in times))
            for label, times in rows.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--layer-kib", type=int, default=512)
    add_datagram_argument(parser)
    parser.add_argument("--serve", nargs=3, metavar=("CERT_DIR", "LAYERS", "LAYER_KIB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve[0], int(args.serve[1]), int(args.serve[2])))
        return
    if per_datagram(args, "benchmarks.bench_moqt"):
        return
    from tests.pki import make_pki

    with tempfile.TemporaryDirectory() as tmp:
        make_pki(Path(tmp))
        rows = asyncio.run(measure(tmp, args.reps, args.layers, args.layer_kib))
    base = rows[0][1]
    print(f"{os.cpu_count()} CPUs; one block of {args.layers} layers x {args.layer_kib} KiB "
          f"({args.layers * args.layer_kib >> 10} MiB) per FETCH; QUIC datagrams of {DATAGRAM} octets; "
          f"medians of {args.reps}\n")
    print("| path | datagram | MB/s | vs raw (same run) | time to first layer |")
    print("|---|---|---|---|---|")
    for label, mbs, first in rows:
        print(f"| {label} | {DATAGRAM} | {mbs:.0f} | {mbs / base:.2f} | {first * 1000:.1f} ms |")


if __name__ == "__main__":
    main()
