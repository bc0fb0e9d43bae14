"""The block data path end to end: our holder and client against a mutual-TLS socket ceiling, in one run.

    python -m benchmarks.bench_block_path                     # all cells, prints a Markdown table
    python -m benchmarks.bench_block_path --sizes 256k,16m --ops get --conc 1 --rounds 3 --before  # + httpx

* ours: ``kvsp-quic holder --dev DIR`` in its own process (pinned to CPU 0), with three Compatibility
  Descriptors whose blocks are 256 KiB, 1 MiB and 16 MiB containers; :class:`http3.client.KvspClient` in this
  process (pinned to CPU 1) over the TCP path (``prefer="tcp"``: HTTP/1.1 over TLS, :mod:`http3.h1_client`) and
  over HTTP/3. A GET delivers the body into a :class:`~kvsp_quic.container.ContainerDecoder` that assembles it in
  a preallocated buffer and verifies every layer digest as it arrives (``Response.receive_into``) and the whole
  container against ``Repr-Digest`` (the spec's MUST: a second SHA-256 pass); a PUT sends a
  new block (``If-None-Match: *``) and the holder verifies it.
* ceiling: a blocking ``ssl`` socket server (thread per connection, same CPU as the holder, same dev
  certificates, mutual TLS 1.3) and blocking socket clients (threads) moving the same octets over kept-open
  connections, with no HTTP and no digests.
* floor (``asyncio tls``): the same exchange on the event loop's own TLS transport -- an
  ``asyncio.BufferedProtocol`` server in its own process (same CPU as the holder) and client in this one, no HTTP,
  no digests, GET answers written as 1 MiB views, bodies received straight into touched buffers: the least any
  asyncio program (the holder and the client are ones) spends on these octets here.
* diagnostic (``ours h1, digests unchecked``, GET only): our HTTP/1.1 GET received into a buffer with no decoder and
  no SHA-256, which the spec requires of a client: it shows what the two digest passes cost.

Every cell runs its subjects alternately for several rounds and reports medians: aggregate MB/s (c clients, each
issuing requests back to back), the p50 latency of one request, and the CPU milliseconds per request of the
client process and of the server process (``/proc``: user + system), the stable figure on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.floor import GET_PASSES_SPEC, PUT_PASSES, floor_ms, sha256_cpu_ms
from http3.body_sink import copy_into
from http3.client import KvspClient
from http3.h1_client import IntoBuffer
from kvsp_app import event_loop
from kvsp_quic import container as c
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.repr_digest import parse_repr_digest
from kvsp_quic.samples import random_sections
from quic.tls import TlsFiles, TransportSettings, ssl_client_context, ssl_server_context

SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
SIZES = {"256k": (1, 64), "1m": (2, 128), "16m": (32, 128)}  # (layers, block tokens): 8 heads x 128 dims, bf16
SETTINGS = TransportSettings()
MTLS = "mtls socket"  # the ceiling: blocking sockets, mutual TLS, no HTTP, no digests
FLOOR = "asyncio tls"  # the floor of any asyncio program: the same exchange on the event loop's TLS transport
UNCHECKED = "ours h1, digests unchecked"  # diagnostic: our GET with the body's digests not computed
_TICK = os.sysconf("SC_CLK_TCK")


@functools.cache  # built once: a caller holds its descriptor (and its compat_id) across requests
def descriptor(name: str) -> CompatDescriptor:
    layers, tokens = SIZES[name]
    return CompatDescriptor.from_json({
        "model": f"bench-{name}", "model_digest": "sha-256:" + "11" * 32, "tokenizer_digest": "sha-256:" + "22" * 32,
        "layers": layers, "kv_heads": 8, "head_dim": 128, "kv_dtype": "bf16", "positional": "rope",
        "block_tokens": tokens, "layout": "kvsp-layout-1"})


def block(d: CompatDescriptor, seed: int) -> c.EncodedContainer:
    return c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, seed), first_layer=0,
                    token_count=d.block_tokens, descriptor=d)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


# -- the ceiling: blocking mutual-TLS sockets ---------------------------------------------------------------------


def _recv_exact(conn: ssl.SSLSocket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            raise ConnectionError("peer closed")
        out += part
    return bytes(out)


def _raw_connection(conn: ssl.SSLSocket) -> None:
    """'G' + 8-octet length -> that many octets; 'P' + length -> swallow them, answer 'k'; until EOF."""
    chunk = memoryview(bytearray(1 << 20))
    buf = bytearray(256 << 10)
    with conn:
        while True:
            try:
                head = _recv_exact(conn, 9)
            except (ConnectionError, OSError):
                return
            n = int.from_bytes(head[1:], "big")
            if head[:1] == b"G":
                while n > 0:
                    conn.sendall(chunk[:min(n, len(chunk))])
                    n -= len(chunk)
            else:
                while n > 0:
                    n -= conn.recv_into(buf, min(n, len(buf)))
                conn.sendall(b"k")


def serve_raw(cert_dir: str, name: str) -> None:
    ctx = ssl_server_context(TlsFiles.in_dir(cert_dir, name), alpn=("raw",))
    listener = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    while True:
        raw, _ = listener.accept()
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn = ctx.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            continue
        threading.Thread(target=_raw_connection, args=(conn,), daemon=True).start()


class RawClient:
    """One kept-open blocking mutual-TLS connection."""

    def __init__(self, port: int, files: TlsFiles) -> None:
        ctx = ssl_client_context(files, alpn=("raw",))
        raw = socket.create_connection(("127.0.0.1", port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        self.buf = memoryview(bytearray(17 << 20))
        self.payload = memoryview(bytes(17 << 20))

    def get(self, n: int) -> None:
        self.conn.sendall(b"G" + n.to_bytes(8, "big"))
        got = 0
        while got < n:
            got += self.conn.recv_into(self.buf[got:n])

    def put(self, n: int) -> None:
        self.conn.sendall(b"P" + n.to_bytes(8, "big"))
        self.conn.sendall(self.payload[:n])
        if self.conn.recv(1) != b"k":
            raise ConnectionError("raw put failed")

    def close(self) -> None:
        self.conn.close()



# -- the asyncio floor: the same raw exchange, but on the event loop's TLS transport ----------------------------


_PIECE = 1 << 20  # the floor server writes a GET answer in views of this size, as the holder does


class _FloorServer(asyncio.BufferedProtocol):
    """The raw protocol of :func:`_raw_connection` on the event loop's TLS transport, with nothing else: no HTTP,
    no digests. A GET answer leaves in 1 MiB views of one preallocated buffer, a PUT body is received into
    another (both touched once, as a full holder's recycled buffers are)."""

    payload = memoryview(bytes(17 << 20))
    sink = memoryview(bytearray(17 << 20))

    def __init__(self) -> None:
        self.head = bytearray()
        self.head_view = memoryview(bytearray(64))
        self.left = 0  # PUT body octets still to come
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.sink[:self.left] if self.left else self.head_view

    def buffer_updated(self, nbytes: int) -> None:
        assert self.transport is not None
        if self.left:
            self.left -= nbytes
            if not self.left:
                self.transport.write(b"k")
            return
        self.head += self.head_view[:nbytes]
        if len(self.head) < 9:
            return
        n = int.from_bytes(self.head[1:9], "big")
        op, rest = self.head[:1], len(self.head) - 9  # a PUT head's read may hold the body's first octets
        self.head = bytearray()
        if op == b"G":
            self.transport.writelines([self.payload[i:min(i + _PIECE, n)] for i in range(0, n, _PIECE)])
        elif rest >= n:
            self.transport.write(b"k")
        else:
            self.left = n - rest


def serve_floor(cert_dir: str, name: str, loop_choice: str) -> None:
    async def run() -> None:
        ctx = ssl_server_context(TlsFiles.in_dir(cert_dir, name), alpn=("raw",))
        server = await asyncio.get_running_loop().create_server(_FloorServer, "127.0.0.1", 0, ssl=ctx)
        print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
        await asyncio.Event().wait()

    event_loop.run(run(), loop_choice)


class FloorClient(asyncio.BufferedProtocol):
    """One kept-open connection on the event loop's TLS transport: a GET is received straight into the caller's
    buffer, a PUT body written in 1 MiB views (the client-side twin of :class:`_FloorServer`)."""

    payload = memoryview(bytes(17 << 20))

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.into: memoryview | None = None
        self.got = 0
        self.waiter: asyncio.Future[None] | None = None
        self.spare = memoryview(bytearray(64))

    @classmethod
    async def connect(cls, port: int, files: TlsFiles) -> FloorClient:
        ctx = ssl_client_context(files, alpn=("raw",))
        _, protocol = await asyncio.get_running_loop().create_connection(cls, "127.0.0.1", port, ssl=ctx,
                                                                         server_hostname="127.0.0.1")
        return protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.into[self.got:] if self.into is not None else self.spare

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.into is not None and self.got >= len(self.into) and self.waiter is not None:
            self.waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("floor server closed the connection"))

    async def _exchange(self, request: list[memoryview | bytes], into: memoryview) -> None:
        assert self.transport is not None
        self.into, self.got = into, 0
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.writelines(request)
        await self.waiter

    async def get(self, n: int, into: memoryview) -> None:
        await self._exchange([b"G" + n.to_bytes(8, "big")], into[:n])

    async def put(self, n: int) -> None:
        body = [self.payload[i:min(i + _PIECE, n)] for i in range(0, n, _PIECE)]
        await self._exchange([b"P" + n.to_bytes(8, "big"), *body], self.spare[:1])

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class HttpxH1:
    """The TCP path as KvspClient had it before http3.h1_client: httpx over HTTP/1.1 (``--before``)."""

    def __init__(self, files: TlsFiles) -> None:
        self.http = httpx.AsyncClient(verify=ssl_client_context(files, alpn=("http/1.1",)), timeout=120,
                                      limits=httpx.Limits(max_connections=64))

    async def request(self, method: str, url: str, *, headers: dict[str, str], content: bytes) -> Any:
        response = await self.http.request(method, url, headers=headers, content=content)
        response.status = response.status_code  # type: ignore[attr-defined]
        return response

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str) -> AsyncIterator[Any]:
        async with self.http.stream(method, url) as response:
            response.status = response.status_code  # type: ignore[attr-defined]

            async def receive_into(sink: Any) -> int:
                return sum([copy_into(sink, chunk) async for chunk in response.aiter_raw()])

            response.receive_into = receive_into  # type: ignore[attr-defined]
            yield response

    async def aclose(self) -> None:
        await self.http.aclose()


# -- the run ---------------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, work: Path, holder: subprocess.Popen[str], ready: dict[str, Any], raw: subprocess.Popen[str],
                 raw_port: int, floor: subprocess.Popen[str], floor_port: int) -> None:
        self.work = work
        self.holder, self.raw, self.floor = holder, raw, floor
        self.floor_port = floor_port
        self.per_client: int | None = None  # requests per client and round (None: ~64 MiB of blocks per round)
        self.base = ready["base_uri"]
        self.files = TlsFiles.of(ready["ca"], ready["client_cert"], ready["client_key"])
        self.raw_port = raw_port
        self.blocks: dict[str, c.EncodedContainer] = {}
        self.bodies: dict[str, bytes] = {}
        self.get_key: dict[str, bytes] = {}
        self.keys = 0
        self.pool = ThreadPoolExecutor(8)

    def url(self, size: str, key: bytes) -> str:
        return f"{self.base}blocks/{descriptor(size).compat_id.hex()}/{SCOPE.hex()}/{key.hex()}"

    def new_key(self) -> bytes:
        self.keys += 1
        return hashlib.sha256(b"bench-block-path %d %f" % (self.keys, time.time())).digest()

    async def put_block(self, client: Any, size: str, key: bytes) -> None:
        response = await client.request("PUT", self.url(size, key), content=self.bodies[size],
                                        headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
        if response.status != 201:
            raise RuntimeError(f"PUT {size}: {response.status} {response.content!r}")

    async def get_block(self, client: Any, size: str, key: bytes, into: memoryview) -> None:
        d = descriptor(size)
        expected = self.blocks[size]
        decoder = c.ContainerDecoder(d, expected_layer_digests=expected.layer_digests,
                                     allocate=lambda n: into[:n], repr_digest=True)
        async with client.stream("GET", self.url(size, key)) as response:
            if response.status != 200:
                raise RuntimeError(f"GET {size}: {response.status}")
            stated = parse_repr_digest(response.headers.get("repr-digest"))
            await response.receive_into(decoder)
        decoder.finish()
        if not decoder.done:
            raise RuntimeError("GET: incomplete container")
        if decoder.repr_digest != stated:  # spec, Block Retrieval and Storage: "Clients MUST verify Repr-Digest"
            raise RuntimeError("GET: Repr-Digest does not match the body")

    async def get_unchecked(self, client: Any, size: str, key: bytes, into: memoryview) -> None:
        """The GET of :data:`UNCHECKED`: the body into *into* and nothing else (a diagnostic: no decoder, no
        digest, which the spec requires of a real client)."""
        sink = IntoBuffer(into)
        async with client.stream("GET", self.url(size, key)) as response:
            if response.status != 200:
                raise RuntimeError(f"GET {size}: {response.status}")
            await response.receive_into(sink)
        if sink.filled != len(self.bodies[size]):
            raise RuntimeError("GET: incomplete body")

    async def _round(self, subject: str, op: str, size: str, conc: int, per_client: int, n_bytes: int,
                     raws: list[RawClient], floors: list[FloorClient], intos: list[memoryview], client: Any,
                     key: bytes) -> tuple[float, float, float, float]:
        """One round of one subject: (MB/s, p50 ms, client CPU ms per op, server CPU ms per op)."""
        lat: list[float] = []
        server_pid = {MTLS: self.raw.pid, FLOOR: self.floor.pid}.get(subject, self.holder.pid)
        s0, c0, t0 = cpu_seconds(server_pid), time.process_time(), time.perf_counter()
        if subject == FLOOR:
            async def floor(i: int) -> None:
                for _ in range(per_client):
                    t = time.perf_counter()
                    await (floors[i].get(n_bytes, intos[i]) if op == "get" else floors[i].put(n_bytes))
                    lat.append(time.perf_counter() - t)
            await asyncio.gather(*(floor(i) for i in range(conc)))
        elif subject == MTLS:
            def run(i: int) -> None:
                for _ in range(per_client):
                    t = time.perf_counter()
                    (raws[i].get if op == "get" else raws[i].put)(n_bytes)
                    lat.append(time.perf_counter() - t)
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(self.pool, run, i) for i in range(conc)))
        else:
            async def one(i: int) -> None:
                for _ in range(per_client):
                    t = time.perf_counter()
                    if op == "get" and subject == UNCHECKED:
                        await self.get_unchecked(client, size, key, intos[i])
                    elif op == "get":
                        await self.get_block(client, size, key, intos[i])
                    else:
                        await self.put_block(client, size, self.new_key())
                    lat.append(time.perf_counter() - t)
            await asyncio.gather(*(one(i) for i in range(conc)))
        c1, t1, s1 = time.process_time(), time.perf_counter(), cpu_seconds(server_pid)
        ops = per_client * conc
        return (ops * n_bytes / (t1 - t0) / 1e6, statistics.median(lat) * 1e3, (c1 - c0) / ops * 1e3,
                (s1 - s0) / ops * 1e3)

    async def cell(self, op: str, size: str, conc: int, rounds: int, clients: dict[str, Any],
                   subjects: list[str]) -> dict[str, dict[str, float]]:
        n_bytes = len(self.bodies[size])
        per_client = self.per_client or max(2, min(64, (64 << 20) // (n_bytes * conc)))
        key = self.get_key[size]
        results: dict[str, list[tuple[float, float, float, float]]] = {s: [] for s in subjects}
        raws = [RawClient(self.raw_port, self.files) for _ in range(conc)]
        floors = [await FloorClient.connect(self.floor_port, self.files) for _ in range(conc)]
        intos = [memoryview(bytearray(n_bytes)) for _ in range(conc)]
        for b in intos:  # touch the buffers once
            b[:] = bytes(n_bytes)
        try:
            for _ in range(rounds + 1):  # the first round warms up and is dropped
                for subject in subjects:
                    results[subject].append(await self._round(
                        subject, op, size, conc, per_client, n_bytes, raws, floors, intos, clients.get(subject),
                        key))
        finally:
            for r in raws:
                r.close()
            for f in floors:
                f.close()
        out: dict[str, dict[str, float]] = {}
        for subject, rows in results.items():
            rows = rows[1:]
            out[subject] = {name: statistics.median(r[i] for r in rows)
                            for i, name in enumerate(("mbps", "p50_ms", "client_cpu_ms", "server_cpu_ms"))}
        return out


async def main_async(args: argparse.Namespace) -> None:
    sizes = args.sizes.split(",")
    ops = args.ops.split(",")
    concs = [int(x) for x in args.conc.split(",")]
    subjects = [MTLS, FLOOR, "ours h1", *([] if args.no_h3 else ["ours h3"]),
                *(["httpx h1 (before)"] if args.before else [])]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths = []
        for size in SIZES:
            p = work / f"d-{size}.json"
            p.write_text(json.dumps(descriptor(size).to_json()))
            paths.append(p)
        cmd = [sys.executable, "-c", "import sys; from kvsp_app.cli import main; sys.exit(main())",
               "holder", "--dev", str(work / "dev"),
               "--host-capacity", args.host_capacity,
               "--workers", "1",  # one process: pinned, its CPU read (bench_workers scales)
               "--event-loop", args.event_loop]
        for p in paths:
            cmd += ["--descriptor", str(p)]
        holder = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, stderr=subprocess.DEVNULL)
        assert holder.stdout is not None
        ready = json.loads(holder.stdout.readline())
        cert_dir = Path(ready["ca"]).parent
        server_name = next(p.stem for p in cert_dir.glob("holder-*.pem"))  # the holder's own certificate
        raw = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_block_path", "--serve-raw", str(cert_dir),
                                server_name], stdout=subprocess.PIPE, text=True)
        assert raw.stdout is not None
        raw_port = json.loads(raw.stdout.readline())["port"]
        floor = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_block_path", "--serve-floor", str(cert_dir),
                                  server_name, "--event-loop", args.event_loop], stdout=subprocess.PIPE, text=True)
        assert floor.stdout is not None
        floor_port = json.loads(floor.stdout.readline())["port"]
        if not args.no_pin and len(os.sched_getaffinity(0)) >= 2:
            for pid in (holder.pid, raw.pid, floor.pid):
                os.sched_setaffinity(pid, {0})
            os.sched_setaffinity(0, {int(x) for x in args.client_cpus.split(",")})
        bench = Bench(work, holder, ready, raw, raw_port, floor, floor_port)
        bench.per_client = args.per_client
        rows: list[str] = []
        try:
            h1 = KvspClient(bench.files, prefer="tcp", timeout=120)
            h3 = KvspClient(bench.files, timeout=120, settings=SETTINGS)
            before = HttpxH1(bench.files)
            clients: dict[str, Any] = {"ours h1": h1, UNCHECKED: h1, "ours h3": h3, "httpx h1 (before)": before}
            for size in sizes:
                bench.blocks[size] = block(descriptor(size), 1)
                bench.bodies[size] = bench.blocks[size].tobytes()
                key = bench.new_key()
                await bench.put_block(h1, size, key)
                bench.get_key[size] = key
            sha_ms = {size: sha256_cpu_ms(len(bench.bodies[size])) for size in sizes}  # this run's SHA-256
            print("verified floor = the mTLS socket's CPU (client + server) + one SHA-256 pass per digest: GET "
                  f"{GET_PASSES_SPEC} (Repr-Digest, layer digests), PUT {PUT_PASSES} (the holder's layer digests); "
                  + ", ".join(f"SHA-256 of {s} {ms:.2f} ms" for s, ms in sha_ms.items()))
            print("| op | block | c | subject | MB/s | p50 ms | client CPU ms/op | server CPU ms/op | x mTLS socket "
                  "| verified floor ms/op | x verified floor |")
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for op in ops:
                for size in sizes:
                    for conc in concs:
                        res = await bench.cell(op, size, conc, args.rounds, clients,
                                               [*subjects, UNCHECKED] if op == "get" else subjects)
                        base = res[MTLS]["mbps"]
                        verified = floor_ms(res[MTLS]["client_cpu_ms"] + res[MTLS]["server_cpu_ms"], sha_ms[size],
                                            GET_PASSES_SPEC if op == "get" else PUT_PASSES)
                        for subject, r in res.items():
                            cpu = r["client_cpu_ms"] + r["server_cpu_ms"]
                            row = (f"| {op} | {size} | {conc} | {subject} | {r['mbps']:.0f} | {r['p50_ms']:.2f} | "
                                   f"{r['client_cpu_ms']:.2f} | {r['server_cpu_ms']:.2f} | {r['mbps'] / base:.2f} | "
                                   f"{verified:.2f} | {cpu / verified:.2f} |")
                            rows.append(row)
                            print(row, flush=True)
            await h1.aclose()
            await h3.aclose()
            await before.aclose()
        finally:
            for process in (holder, raw, floor):
                process.terminate()
            for process in (holder, raw, floor):
                process.wait()
            bench.pool.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256k,1m,16m")
    p.add_argument("--ops", default="get,put")
    p.add_argument("--conc", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-h3", action="store_true", help="only the TCP path and the ceiling")
    p.add_argument("--per-client", type=int, help="requests per client and round (default: about 64 MiB of blocks "
                   "per round, at most 64 requests); more makes steadier per-request CPU figures")
    p.add_argument("--host-capacity", default="2GiB",
                   help="the holder's host tier; a small one (e.g. 64MiB) makes PUTs evict, as a full holder does")
    p.add_argument("--before", action="store_true", help="also httpx over HTTP/1.1, the TCP path before")
    p.add_argument("--event-loop", default="auto", choices=event_loop.CHOICES,
                   help="the loop of the holder and of this client (kvsp_app/event_loop.py; auto: uvloop)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the processes to CPUs 0 and 1")
    p.add_argument("--client-cpus", default="1", help="the CPUs of this (the client) process; 0,1 lets the client's "
                   "threads use the servers' CPU too (the servers stay on CPU 0)")
    p.add_argument("--serve-raw", nargs=2, metavar=("CERT_DIR", "NAME"), help=argparse.SUPPRESS)
    p.add_argument("--serve-floor", nargs=2, metavar=("CERT_DIR", "NAME"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_raw:
        serve_raw(*args.serve_raw)
        return
    if args.serve_floor:
        serve_floor(*args.serve_floor, args.event_loop)
        return
    event_loop.run(main_async(args), args.event_loop)


if __name__ == "__main__":
    main()
