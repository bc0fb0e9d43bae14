"""Holder throughput: block GET/PUT over our HTTP/3 vs the raw QUIC ceiling, and in-process store/fetch vs copying.

    python -m benchmarks.bench_holder [--reps 5] [--datagram 1452,8952,16384]

One 16 MiB block: 32 layers of 128 tokens x 8 KV heads x 128 dims, bf16 (256 KiB per K or V section).

* Over the network: the holder (RoleServer + holder_app, HTTP/3, mutual TLS) runs in its own process, like
  benchmarks/bench_h3.py's servers. GET of the whole block and of an 8-layer range (layers=8-15, 4 MiB), and
  PUT of a new block, each timed from the request to the last octet, against benchmarks.bench_h3's raw aioquic
  stream (same tuning, no HTTP, no storage) moving the same number of octets in the same run.
* In process: Holder.store (one copy into the replica's buffer + SHA-256 of every layer) vs a copy into fresh
  memory plus one SHA-256 pass (fresh: stored blocks stay, so their pages are first touched by the store);
  Holder.fetch of the whole block and of a range (views; the range also hashes its Repr-Digest) vs copying /
  hashing those octets; and fetches from local storage (read back, verified, optionally decrypted) vs reading
  the file and hashing (and decrypting) it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from benchmarks.bench_h3 import DATAGRAM, SETTINGS, add_datagram_argument, per_datagram, raw_transfer
from benchmarks.bench_h3 import start_server as start_raw_server
from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_http.holder_app import holder_app
from kvsp_quic import container as c
from kvsp_quic.auth import ALL, Policy, Principal, Role
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.samples import random_sections
from kvsp_quic.storage.tiers import LocalStorageConfig
from quic.tls import TlsFiles

HOLDER_URI = "https://127.0.0.1/kvsp/"
ALICE = "urn:kvsp:client:alice"
SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
RANGE = (8, 15)


def descriptor() -> CompatDescriptor:
    return CompatDescriptor.from_json({
        "model": "bench-model", "model_digest": "sha-256:" + "11" * 32, "tokenizer_digest": "sha-256:" + "22" * 32,
        "layers": 32, "kv_heads": 8, "head_dim": 128, "kv_dtype": "bf16", "positional": "rope",
        "block_tokens": 128, "layout": "kvsp-layout-1"})


def block_body(d: CompatDescriptor, seed: int = 1) -> bytes:
    return c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, seed), first_layer=0,
                    token_count=d.block_tokens, descriptor=d).tobytes()


def key(n: int) -> bytes:
    return hashlib.sha256(b"bench%d" % n).digest()


# -- the holder process ----------------------------------------------------------------------------------------------


async def serve(cert_dir: str) -> None:
    d = descriptor()
    holder = Holder(HolderSettings(HOLDER_URI, (d,), host_capacity=2 << 30))
    app = holder_app(holder, Policy.dev([ALICE]))
    server = RoleServer(app, TlsFiles.in_dir(cert_dir, "holder"), settings=SETTINGS)
    await server.start("127.0.0.1", 0)
    print(json.dumps({"port": server.port}), flush=True)
    await asyncio.Event().wait()


def start_holder(cert_dir: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_holder", "--serve", cert_dir],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["port"]


# -- over the network -----------------------------------------------------------------------------------------------


async def network(cert_dir: str, reps: int) -> list[tuple[str, int, float, float]]:
    d = descriptor()
    body = block_body(d)
    files = TlsFiles.in_dir(cert_dir, "alice")
    holder_proc, holder_port = start_holder(cert_dir)
    raw_proc, raw_port = start_raw_server("raw", cert_dir)
    base = f"https://127.0.0.1:{holder_port}/kvsp/blocks/{d.compat_id.hex()}/{SCOPE.hex()}/"
    part = c.cut(body, *RANGE)
    sizes = {"get": len(body), "range": len(part), "put": len(body)}
    times: dict[str, list[float]] = {f"{w} {k}": [] for w in ("h3", "raw") for k in sizes}
    try:
        async with KvspClient(files, settings=SETTINGS, timeout=120) as client:
            put_headers = {"content-type": "application/kvsp-block", "if-none-match": "*"}
            first = await client.request("PUT", base + key(0).hex(), headers=put_headers, content=body)
            assert first.status == 201, first.content
            for rep in range(reps):
                for kind, size in sizes.items():
                    times[f"raw {kind}"].append(await raw_transfer(raw_port, files, size,
                                                                   "put" if kind == "put" else "get"))
                for kind, query in (("get", ""), ("range", f"?layers={RANGE[0]}-{RANGE[1]}")):
                    t = time.perf_counter()
                    received = 0
                    async with client.stream("GET", base + key(0).hex() + query) as response:
                        assert response.status == 200
                        async for chunk in response.aiter_bytes():  # counted, not kept, as the raw client does
                            received += len(chunk)
                    times[f"h3 {kind}"].append(time.perf_counter() - t)
                    assert received == sizes[kind]
                t = time.perf_counter()
                response = await client.request("PUT", base + key(rep + 1).hex(), headers=put_headers, content=body)
                times["h3 put"].append(time.perf_counter() - t)
                assert response.status == 201
    finally:
        for proc in (holder_proc, raw_proc):
            proc.terminate()
            proc.wait()
    labels = {"get": f"GET whole block ({len(body) >> 20} MiB, 32 layers)",
              "range": f"GET layers={RANGE[0]}-{RANGE[1]} ({len(part) / (1 << 20):.1f} MiB)",
              "put": f"PUT new block ({len(body) >> 20} MiB, stored + verified)"}
    return [(labels[k], sizes[k], sizes[k] / 1e6 / statistics.median(times[f"h3 {k}"]),
             sizes[k] / 1e6 / statistics.median(times[f"raw {k}"])) for k in sizes]


# -- in process ---------------------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm up
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def in_process(reps: int, tmp: Path) -> list[tuple[str, float, str, float]]:
    d = descriptor()
    body = block_body(d)
    n = len(body)
    who = Principal(ALICE, frozenset({Role.INSTANCE}), ALL)
    rows: list[tuple[str, float, str, float]] = []

    counter = iter(range(1, 1 << 30))
    holder = Holder(HolderSettings(HOLDER_URI, (d,), host_capacity=64 << 30))

    def store() -> None:
        holder.store(who, d.compat_id, SCOPE, key(next(counter)), body, "*")

    kept: list[bytearray] = []  # stored blocks stay in memory: every store gets fresh (never touched) pages

    def copy_and_hash() -> None:
        buf = bytearray(n)
        buf[:] = body
        kept.append(buf)
        for i in range(32):  # the holder hashes layer by layer
            hashlib.sha256(memoryview(buf)[i * (n // 32):(i + 1) * (n // 32)])

    rows.append(("store 16 MiB (host)", timed(store, reps), "copy into fresh memory + SHA-256",
                 timed(copy_and_hash, reps)))
    kept.clear()
    holder.store(who, d.compat_id, SCOPE, key(0), body, "*")
    warm = bytearray(n)

    def fetch_whole() -> None:
        for _chunk in holder.fetch(who, d.compat_id, SCOPE, key(0)).container.chunks():
            pass

    def copy_whole() -> None:
        warm[:] = body

    rows.append(("fetch whole (host, views)", timed(fetch_whole, reps), "copy into a warm buffer",
                 timed(copy_whole, reps)))
    part = c.cut(body, *RANGE).tobytes()

    def fetch_range() -> None:
        holder.fetch(who, d.compat_id, SCOPE, key(0), layers=RANGE)

    rows.append((f"fetch layers {RANGE[0]}-{RANGE[1]} (host, + Repr-Digest)", timed(fetch_range, reps),
                 "SHA-256 of the range", timed(lambda: hashlib.sha256(part).digest(), reps)))

    for label, enc_key in (("local-storage", None), ("local-storage, AES-256-GCM", os.urandom(32))):
        disk = Holder(HolderSettings(HOLDER_URI, (d,), host_capacity=1 << 20,  # too small: blocks go to disk
                                     local_storage=LocalStorageConfig(tmp / label, 1 << 30, encryption_key=enc_key)))
        disk.store(who, d.compat_id, SCOPE, key(0), body, "*")
        path = next((tmp / label).iterdir())
        aead = AESGCM(enc_key) if enc_key is not None else None
        ciphertext = aead.encrypt(bytes(12), body, None) if aead is not None else b""

        def fetch_disk(h: Holder = disk) -> None:
            h.fetch(who, d.compat_id, SCOPE, key(0))

        def baseline(p: Path = path, a: AESGCM | None = aead, ct: bytes = ciphertext) -> None:
            raw = p.read_bytes()
            hashlib.sha256(a.decrypt(bytes(12), ct, None) if a is not None else raw).digest()

        base_label = "read file + SHA-256" if aead is None else "read file + AES-GCM decrypt + SHA-256"
        rows.append((f"fetch whole ({label}, verified)", timed(fetch_disk, reps), base_label, timed(baseline, reps)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    add_datagram_argument(parser)
    parser.add_argument("--serve", metavar="CERT_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    if per_datagram(args, "benchmarks.bench_holder"):
        return
    from tests.pki import SERVER_URI, make_pki

    with tempfile.TemporaryDirectory() as tmp:
        make_pki(Path(tmp) / "pki", roles={"server": SERVER_URI, "holder": HOLDER_URI})
        net = asyncio.run(network(str(Path(tmp) / "pki"), args.reps))
        local = in_process(args.reps, Path(tmp))
    size = len(block_body(descriptor()))
    print(f"{os.cpu_count()} CPUs; one block of {size} octets (32 layers x 2 x 256 KiB + header); "
          f"QUIC datagrams of {DATAGRAM} octets; medians of {args.reps}\n")
    print("| over HTTP/3 (holder in its own process) | datagram | ours | raw aioquic stream, same octets, same run "
          "| ratio |")
    print("|---|---|---|---|---|")
    for label, _n, ours, raw in net:
        print(f"| {label} | {DATAGRAM} | {ours:.0f} MB/s | {raw:.0f} MB/s | {ours / raw:.2f} |")
    print()
    print("| in process | time | MB/s of the block | baseline (same octets) | time | MB/s |")
    print("|---|---|---|---|---|---|")
    for label, t, base_label, base in local:
        octets = c.cut(block_body(descriptor()), *RANGE).header.total_length if "layers" in label else size
        print(f"| {label} | {t * 1e3:.2f} ms | {octets / 1e6 / t:.0f} | {base_label} | {base * 1e3:.2f} ms | "
              f"{octets / 1e6 / base:.0f} |")


if __name__ == "__main__":
    main()
