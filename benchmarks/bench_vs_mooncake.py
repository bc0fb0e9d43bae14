"""Mooncake Store head to head: the same KV Block Containers through Mooncake, our holder, and bare sockets.

    python -m benchmarks.bench_vs_mooncake            # a few minutes
    python -m benchmarks.bench_vs_mooncake --quick    # about a minute

It installs nothing. What it needs, and checks (whatever is missing is printed with the command that installs it,
and the rest still runs; the Mooncake columns then read "n/a"):

* Mooncake Store in its own Python 3.11 venv at ``.venv-mooncake`` (``--mooncake-venv``; .gitignore keeps it out)::

      python3.11 -m venv .venv-mooncake
      .venv-mooncake/bin/pip install mooncake-transfer-engine-non-cuda     # 0.3.13.x; import mooncake.store

* Debian's ``libibverbs1`` and ``librdmacm1`` (Mooncake's libraries link them even for TCP)::

      apt-get install -y libibverbs1 librdmacm1

* ``MC_TCP_BIND_ADDRESS=127.0.0.1`` (otherwise Mooncake advertises eth0); the benchmark sets it for the Mooncake
  processes it starts and says so when your environment lacks it.

How Mooncake runs here (FACTS.md, "Added 2026-12-01"): one ``mooncake_master --rpc_address=127.0.0.1
--enable_http_metadata_server=true --http_metadata_server_host=127.0.0.1`` (the venv's binary, free ports,
metrics on 127.0.0.1), a ``MooncakeDistributedStore`` that provides a 512 MiB segment in one process, the put/get
client (``global_segment_size=0``) in another, protocol "tcp". Both are :mod:`benchmarks.mooncake_peer` run by the
venv's Python; the client calls ``put_from`` / ``get_into`` on one registered buffer (``batch_get_into`` for
several GETs in flight) and answers the driver in JSON lines. Two such stacks run side by side: checksums off, and
``MOONCAKE_STORE_CHECKSUM=1`` (its per-object checksum) in the environment of all three processes of the other.

Ours: ``kvsp-quic holder --dev DIR`` in its own process, and the public client API in this one --
:class:`kvsp_client.api.KvspApi` over :class:`http3.client.KvspClient`, once over HTTP/3 and once over the TCP path
(``KvspClient(h3=False)``: HTTP/1.1 over TLS). A GET reads the container into a preallocated buffer (the
response's ``readinto`` where the client has one, else its chunks) and checks it against the holder's
``Repr-Digest`` (SHA-256): verified, as Mooncake with checksums is and Mooncake without is not. A PUT sends the
container to a fresh key; the holder verifies it and answers its Replica Record.

Ceilings: a server process with blocking Python sockets, one thread per connection, over plain TCP and over
mutual TLS 1.3 (the holder's dev certificates), on persistent connections: ``G`` + length sends the block of that
length, ``P`` + length swallows that many octets and answers ``k``; the client reads with ``recv_into`` into a
preallocated buffer, one blocking socket per concurrent transfer.

Blocks: three Compatibility Descriptors whose containers carry 256 KiB, 1 MiB and 16 MiB of KV (bf16; 16 layers
x 16 tokens x 4 heads x 64 dims, 16 x 16 x 8 x 128, 32 x 128 x 8 x 128), random contents, the same container
octets for every subject. Operations: GET 256 KiB, 1 MiB, 16 MiB one at a time (c1), 16 MiB eight at a time (c8:
eight keys holding the same block), PUT 256 KiB and 16 MiB (c1). Each operation runs in rounds; every round runs a
batch of every subject in turn (the order rotates), after one untimed warm-up batch each: steady state, subjects
alternating on a noisy shared machine. Reported: medians (MB/s = octets moved per operation / median seconds per
operation; for c8 per round of eight), and the p50 latency for 256 KiB; then a second table of CPU milliseconds
per operation, client and server together (this process plus the subject's processes, from /proc: for Mooncake
its master, segment and client), the steadier figure on a busy shared machine. All servers listen on 127.0.0.1
only; every process started is stopped at the end, also on an error or after ``--timeout`` seconds (default 600).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes.util
import functools
import hashlib
import json
import os
import platform
import select
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from benchmarks.floor import PUT_PASSES, floor_ms, sha256_cpu_ms
from kvsp_app import event_loop

REPO = Path(__file__).resolve().parent.parent
MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda"
MOONCAKE_VERSION = "0.3.13"
SEGMENT_SIZE = 512 << 20
SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
KIB, MIB = 1 << 10, 1 << 20

# name -> (layers, block_tokens, kv_heads, head_dim); bf16, so the KV octets are layers * 2 * tokens * heads * dim * 2
BLOCKS: dict[str, tuple[int, int, int, int]] = {
    "256 KiB": (16, 16, 4, 64),
    "1 MiB": (16, 16, 8, 128),
    "16 MiB": (32, 128, 8, 128),
}
# (operation, block, concurrency)
OPS: list[tuple[str, str, int]] = [
    ("get", "256 KiB", 1), ("get", "1 MiB", 1), ("get", "16 MiB", 1), ("get", "16 MiB", 8),
    ("put", "256 KiB", 1), ("put", "16 MiB", 1),
]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SUBJECTS = ["mooncake", "mooncake+checksum", "ours h3", "ours h1", "tcp socket", "mtls socket"]
Op = tuple[str, str, int]
Batch = Callable[[Op, int], Awaitable[list[float]]]  # (op, operations) -> seconds of each op (c8: of each round)


# -- the environment ---------------------------------------------------------------------------------------------


@dataclass
class Environment:
    python: Path | None = None  # the Mooncake venv's interpreter, when `import mooncake.store` works there
    master: Path | None = None
    version: str | None = None
    missing: list[str] = field(default_factory=list)  # what is missing, each with the command that installs it
    notes: list[str] = field(default_factory=list)

    @property
    def mooncake(self) -> bool:
        return self.python is not None and self.master is not None


def _debian_package(name: str, soname: str) -> bool:
    if shutil.which("dpkg-query"):
        out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", name], capture_output=True, text=True)
        return out.returncode == 0 and "install ok installed" in out.stdout
    return ctypes.util.find_library(soname) is not None


def check_environment(venv: Path, environ: dict[str, str] | None = None) -> Environment:
    """What Mooncake needs here: found, or listed in ``missing`` with the command that installs it."""
    env = Environment()
    environ = dict(os.environ) if environ is None else environ
    libs = [p for p, so in (("libibverbs1", "ibverbs"), ("librdmacm1", "rdmacm")) if not _debian_package(p, so)]
    if libs:
        env.missing.append(f"Debian {' and '.join(libs)}: apt-get install -y {' '.join(libs)}")
    python = venv / "bin" / "python"
    install = f"python3.11 -m venv {venv} && {venv}/bin/pip install {MOONCAKE_PACKAGE}"
    if not python.exists():
        env.missing.append(f"the Mooncake venv {venv}: {install}")
    else:
        probe = ("import importlib.metadata as m, mooncake.store; "
                 f"print(m.version({MOONCAKE_PACKAGE!r}))")
        try:
            out = subprocess.run([os.fspath(python), "-c", probe], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            out = subprocess.CompletedProcess([], 1, "", "timed out after 60 s")
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["?"])[-1]
            env.missing.append(f"`import mooncake.store` fails in {venv} ({last}): {venv}/bin/pip install "
                               f"{MOONCAKE_PACKAGE}" + (" (and the Debian packages above)" if libs else ""))
        else:
            env.version = out.stdout.strip()
            if not env.version.startswith(MOONCAKE_VERSION):
                env.notes.append(f"{MOONCAKE_PACKAGE} {env.version} (measured with {MOONCAKE_VERSION}.x)")
            master = venv / "bin" / "mooncake_master"
            if not master.exists():
                env.missing.append(f"{master}: {venv}/bin/pip install --force-reinstall {MOONCAKE_PACKAGE}")
            else:
                env.python, env.master = python, master
    if environ.get("MC_TCP_BIND_ADDRESS") != "127.0.0.1":
        env.notes.append("MC_TCP_BIND_ADDRESS is not 127.0.0.1 here (export MC_TCP_BIND_ADDRESS=127.0.0.1); this "
                         "benchmark sets it for the Mooncake processes it starts")
    return env


# -- processes -------------------------------------------------------------------------------------------------


class Processes:
    """Every process the benchmark starts, each in its own process group; :meth:`stop_all` ends them all."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[IO[str]] = []

    def start(self, argv: list[str], *, env: dict[str, str] | None = None, stdin: bool = False,
              log: Path | None = None) -> subprocess.Popen[str]:
        """Start *argv* (standard output a pipe; standard error appended to *log*, else discarded)."""
        err: IO[str] | int = subprocess.DEVNULL
        if log is not None:
            err = log.open("a")
            self.logs.append(err)
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env, cwd=REPO, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(OSError, ValueError):
                if proc.stdin is not None:
                    proc.stdin.close()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
            with contextlib.suppress(OSError, ValueError):
                if proc.stdout is not None:
                    proc.stdout.close()
        self.procs.clear()
        for log in self.logs:
            log.close()
        self.logs.clear()


def read_line(proc: subprocess.Popen[str], timeout: float, what: str) -> dict[str, Any]:
    """The next JSON line *proc* writes, within *timeout* seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        code = proc.poll()
        raise RuntimeError(f"{what}: no answer within {timeout:.0f} s" if code is None else
                           f"{what}: exited with status {code}")
    out: dict[str, Any] = json.loads(line)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_port(port: int, proc: subprocess.Popen[str], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what}: port {port} not open after {timeout:.0f} s")


# -- Mooncake --------------------------------------------------------------------------------------------------


class MooncakeStack:
    """One mooncake_master, one segment process and one client process (benchmarks.mooncake_peer)."""

    def __init__(self, env: Environment, procs: Processes, workdir: Path, *, checksum: bool) -> None:
        assert env.python is not None and env.master is not None
        self.checksum = checksum
        self.tag = "mooncake+checksum" if checksum else "mooncake"
        child = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        child.pop("MOONCAKE_STORE_CHECKSUM", None)
        if checksum:
            child["MOONCAKE_STORE_CHECKSUM"] = "1"
        rpc, meta, metrics = free_port(), free_port(), free_port()
        log = workdir / f"{self.tag}.log"
        master = procs.start([os.fspath(env.master), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                              "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                              f"--http_metadata_server_port={meta}", "--metrics_host=127.0.0.1",
                              f"--metrics_port={metrics}"], env=child, log=log)
        wait_port(rpc, master, 30, f"{self.tag} master")
        wait_port(meta, master, 30, f"{self.tag} metadata server")
        where = ["--master", f"127.0.0.1:{rpc}", "--metadata", f"http://127.0.0.1:{meta}/metadata"]
        peer = [os.fspath(env.python), "-m", "benchmarks.mooncake_peer"]
        segment = procs.start([*peer, "segment", *where, "--size", str(SEGMENT_SIZE)], env=child, stdin=True, log=log)
        read_line(segment, 60, f"{self.tag} segment")
        self.client = procs.start([*peer, "client", *where, "--buffer", str(256 << 20)], env=child, stdin=True,
                                  log=log)
        read_line(self.client, 60, f"{self.tag} client")
        self.pids = [master.pid, segment.pid, self.client.pid]
        self.counter = 0

    def call(self, cmd: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
        assert self.client.stdin is not None
        self.client.stdin.write(json.dumps(cmd) + "\n")
        self.client.stdin.flush()
        out = read_line(self.client, timeout, f"{self.tag} client")
        if not out.get("ok"):
            raise RuntimeError(f"{self.tag}: {cmd['cmd']}: {out.get('error')}")
        return out

    def prepare(self, blocks: dict[str, Path], get_keys: dict[str, list[bytes]]) -> None:
        for name, path in blocks.items():
            self.call({"cmd": "load", "name": name, "path": os.fspath(path)})
            self.call({"cmd": "seed", "name": name, "keys": [k.hex() for k in get_keys[name]]})

    async def batch(self, op: Op, n: int, get_keys: dict[str, list[bytes]]) -> list[float]:
        kind, name, conc = op
        if kind == "get":
            keys = [k.hex() for k in get_keys[name][:conc]]
            out = self.call({"cmd": "get", "name": name, "keys": keys, "rounds": n, "batch": conc > 1})
        else:
            self.counter += 1
            out = self.call({"cmd": "put", "name": name, "conc": conc, "rounds": n, "prefix": f"put{self.counter}"})
        rounds: list[float] = out["rounds"]
        return rounds


# -- ours --------------------------------------------------------------------------------------------------------


def descriptor_json(name: str) -> dict[str, Any]:
    layers, tokens, heads, dim = BLOCKS[name]
    return {"model": f"bench-{name.replace(' ', '').lower()}", "model_digest": "sha-256:" + "11" * 32,
            "tokenizer_digest": "sha-256:" + "22" * 32, "layers": layers, "kv_heads": heads, "head_dim": dim,
            "kv_dtype": "bf16", "positional": "rope", "block_tokens": tokens, "layout": "kvsp-layout-1"}


def make_blocks(workdir: Path, names: list[str]) -> tuple[dict[str, Any], dict[str, bytes], dict[str, Path]]:
    """Descriptors, container octets and their files (for Mooncake and the socket server) of each block."""
    from kvsp_quic import container
    from kvsp_quic.compat import CompatDescriptor
    from kvsp_quic.samples import random_sections

    descriptors: dict[str, Any] = {}
    bodies: dict[str, bytes] = {}
    files: dict[str, Path] = {}
    for i, name in enumerate(names):
        d = CompatDescriptor.from_json(descriptor_json(name))
        body = container.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, seed=i + 1), first_layer=0,
                                token_count=d.block_tokens, descriptor=d).tobytes()
        descriptors[name], bodies[name] = d, body
        files[name] = workdir / f"block-{i}.kvb"
        files[name].write_bytes(body)
        (workdir / f"descriptor-{i}.json").write_text(json.dumps(descriptor_json(name)))
    return descriptors, bodies, files


def start_holder(procs: Processes, workdir: Path, names: list[str], loop: str = "auto") -> dict[str, Any]:
    exe = Path(sys.executable).parent / "kvsp-quic"
    argv = [os.fspath(exe)] if exe.exists() else [sys.executable, "-c", "from kvsp_app.cli import main; main()"]
    # one process: the CPU figures read one pid (worker scaling is benchmarks.bench_workers)
    argv += ["holder", "--dev", os.fspath(workdir / "dev"), "--host-capacity", "4GiB", "--log-level", "WARNING",
             "--workers", "1", "--event-loop", loop]
    for i in range(len(names)):
        argv += ["--descriptor", os.fspath(workdir / f"descriptor-{i}.json")]
    proc = procs.start(argv, log=workdir / "holder.log")
    ready = read_line(proc, 60, "kvsp-quic holder --dev")
    ready["pid"] = proc.pid
    return ready


class Ours:
    """Our holder through the public client API, over HTTP/3 or over the TCP path."""

    def __init__(self, ready: dict[str, Any], descriptors: dict[str, Any], bodies: dict[str, bytes], *,
                 h3: bool) -> None:
        from http3.client import KvspClient
        from kvsp_client.api import KvspApi
        from quic.tls import TlsFiles

        files = TlsFiles.of(ready["ca"], ready["client_cert"], ready["client_key"])
        self.client = KvspClient(files, h3=h3, fallback=not h3, timeout=120)
        self.api = KvspApi(self.client)
        self.base: str = ready["base_uri"]
        self.descriptors = descriptors
        self.bodies = bodies
        self.buffers = [bytearray(max(len(b) for b in bodies.values())) for _ in range(8)]
        self.counter = 0
        self.http_version = ""

    async def put(self, name: str, key: bytes) -> None:
        d = self.descriptors[name]
        await self.api.put_block(self.base, d.compat_id, SCOPE, key, self.bodies[name])

    async def get(self, name: str, key: bytes, buffer: bytearray) -> None:
        from kvsp_client.api import Miss

        d, want = self.descriptors[name], self.bodies[name]
        body = await self.api.get_block(self.base, d.compat_id, SCOPE, key)
        if isinstance(body, Miss):
            raise RuntimeError(f"GET {name}: {body}")
        async with body:
            self.http_version = body.http_version
            view = memoryview(buffer)[:len(want)]
            readinto = getattr(body.response, "readinto", None)  # the client's zero-copy read, where it has one
            if readinto is not None:
                n = await readinto(view)
            else:
                n = 0
                async for chunk in body.aiter_bytes():
                    view[n:n + len(chunk)] = chunk
                    n += len(chunk)
        if n != len(want) or body.repr_digest is None or hashlib.sha256(view).digest() != body.repr_digest:
            raise RuntimeError(f"GET {name}: {n} octets that do not match the holder's Repr-Digest")

    async def batch(self, op: Op, n: int, get_keys: dict[str, list[bytes]]) -> list[float]:
        kind, name, conc = op
        times = []
        for _ in range(n):
            if kind == "get":
                work = [self.get(name, k, b) for k, b in zip(get_keys[name][:conc], self.buffers, strict=False)]
            else:
                keys = []
                for _ in range(conc):
                    self.counter += 1
                    keys.append(hashlib.sha256(b"put-%d-%d" % (id(self), self.counter)).digest())
                work = [self.put(name, k) for k in keys]
            t = time.perf_counter()
            await asyncio.gather(*work)
            times.append(time.perf_counter() - t)
        return times


# -- the socket ceilings ---------------------------------------------------------------------------------------


def serve_sockets(spec: dict[str, Any]) -> None:
    """The ceiling server (its own process): plain TCP and mutual TLS 1.3 listeners, one thread per connection."""
    from quic.tls import TlsFiles, ssl_server_context

    blocks = {}
    for path in spec["blocks"]:
        data = Path(path).read_bytes()
        blocks[len(data)] = memoryview(data)
    ctx = ssl_server_context(TlsFiles.of(spec["ca"], spec["cert"], spec["key"]), alpn=("kvsp-bench",))
    listeners = {}
    for kind in ("tcp", "tls"):
        sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        listeners[kind] = sock

    def handle(conn: socket.socket) -> None:
        scratch = bytearray(1 << 20)
        with conn:
            while True:
                head = _recv_exact(conn, 9)
                if head is None:
                    return
                n = int.from_bytes(head[1:], "big")
                if head[:1] == b"G":
                    conn.sendall(blocks[n])
                else:
                    while n > 0:
                        got = conn.recv_into(scratch, min(n, len(scratch)))
                        if not got:
                            return
                        n -= got
                    conn.sendall(b"k")

    def accept(kind: str, sock: socket.socket) -> None:
        while True:
            raw, _ = sock.accept()
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                conn = ctx.wrap_socket(raw, server_side=True) if kind == "tls" else raw
            except (OSError, ssl.SSLError):
                raw.close()
                continue
            threading.Thread(target=_quiet(handle), args=(conn,), daemon=True).start()

    for kind, sock in listeners.items():
        threading.Thread(target=accept, args=(kind, sock), daemon=True).start()
    print(json.dumps({k: s.getsockname()[1] for k, s in listeners.items()}), flush=True)
    sys.stdin.read()  # until the driver closes our standard input


def _quiet(fn: Callable[[socket.socket], None]) -> Callable[[socket.socket], None]:
    def run(conn: socket.socket) -> None:
        with contextlib.suppress(OSError, KeyError):
            fn(conn)
    return run


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            return None
        out += part
    return out


def holder_tls(workdir: Path, ready: dict[str, Any]) -> dict[str, str]:
    """The holder's own dev certificate and key (the socket ceilings present the same certificate)."""
    port = urlsplit(ready["base_uri"]).port
    return {"ca": ready["ca"], "cert": os.fspath(workdir / "dev" / f"holder-{port}.pem"),
            "key": os.fspath(workdir / "dev" / f"holder-{port}.key")}


def start_socket_server(procs: Processes, files: dict[str, str], blocks: list[Path]) -> dict[str, int]:
    spec = json.dumps({**files, "blocks": [os.fspath(p) for p in blocks]})
    proc = procs.start([sys.executable, "-m", "benchmarks.bench_vs_mooncake", "--serve-sockets", spec], stdin=True)
    return {**{k: int(v) for k, v in read_line(proc, 30, "socket server").items()}, "pid": proc.pid}


class Sockets:
    """Blocking sockets (plain TCP or mutual TLS 1.3), one persistent connection per concurrent transfer."""

    def __init__(self, port: int, ctx: ssl.SSLContext | None, bodies: dict[str, bytes]) -> None:
        self.port, self.ctx, self.bodies = port, ctx, bodies
        self.conns: list[socket.socket] = []
        size = max(len(b) for b in bodies.values())
        self.buffers = [bytearray(size) for _ in range(8)]

    def connection(self, i: int) -> socket.socket:
        while len(self.conns) <= i:
            raw = socket.create_connection(("127.0.0.1", self.port))
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns.append(self.ctx.wrap_socket(raw, server_hostname="127.0.0.1") if self.ctx else raw)
        return self.conns[i]

    def get(self, name: str, i: int) -> memoryview:
        """One GET on connection *i*; the octets received (a view of the connection's buffer)."""
        n = len(self.bodies[name])
        conn = self.connection(i)
        conn.sendall(b"G" + n.to_bytes(8, "big"))
        view = memoryview(self.buffers[i])
        pos = 0
        while pos < n:
            got = conn.recv_into(view[pos:n])
            if not got:
                raise ConnectionError("the socket server closed the connection")
            pos += got
        return view[:n]

    def put(self, name: str, i: int) -> None:
        body = self.bodies[name]
        conn = self.connection(i)
        conn.sendall(b"P" + len(body).to_bytes(8, "big"))
        conn.sendall(body)
        if conn.recv(1) != b"k":
            raise ConnectionError("the socket server did not acknowledge the PUT")

    def one_round(self, op: Op) -> None:
        kind, name, conc = op
        fn = self.get if kind == "get" else self.put
        if conc == 1:
            fn(name, 0)
            return
        for i in range(conc):
            self.connection(i)
        threads = [threading.Thread(target=fn, args=(name, i)) for i in range(conc)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    async def batch(self, op: Op, n: int, get_keys: dict[str, list[bytes]]) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            self.one_round(op)
            times.append(time.perf_counter() - t)
        return times

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()
        self.conns.clear()


class Deadline(SystemExit):
    """--timeout passed (or SIGTERM). A SystemExit, which asyncio and every retry loop let through."""


# -- the run -------------------------------------------------------------------------------------------------------


def batch_size(op: Op, quick: bool) -> int:
    """Operations (rounds, for c > 1) per batch: ~64 MiB of transfer, 3 to 50 (c > 1: at least 2; quick: ~32 MiB,
    2 to 25)."""
    _, name, conc = op
    layers, tokens, heads, dim = BLOCKS[name]
    octets = layers * 2 * tokens * heads * dim * 2 * conc
    if quick:
        return max(2, min(25, (32 * MIB) // octets))
    return max(3 if conc == 1 else 2, min(50, (64 * MIB) // octets))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of this process and of the processes *pids* (all their threads)."""
    total = time.process_time()
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return total


@dataclass
class Measured:
    times: dict[Op, dict[str, list[float]]] = field(default_factory=dict)  # seconds per op (c > 1: per round)
    cpu: dict[Op, dict[str, float]] = field(default_factory=dict)  # CPU seconds per operation, all processes


async def measure(subjects: dict[str, Batch], ops: list[Op], rounds: int, quick: bool,
                  pids: dict[str, list[int]] | None = None, log: Callable[[str], None] = print) -> Measured:
    """Per operation: *rounds* rounds, each a batch of every subject (the order rotating), after a warm-up batch;
    wall time of each operation, and the CPU time of the subject's processes (*pids*, and this one) per operation."""
    out = Measured()
    pids = pids or {}
    for op in ops:
        n = batch_size(op, quick)
        samples: dict[str, list[float]] = {s: [] for s in subjects}
        cpu = dict.fromkeys(subjects, 0.0)
        names = list(subjects)
        t0 = time.perf_counter()
        for name in names:
            await subjects[name](op, 1)  # warm-up: connections, caches, the allocator
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                c0 = cpu_seconds(pids.get(name, []))
                samples[name] += await subjects[name](op, n)
                cpu[name] += cpu_seconds(pids.get(name, [])) - c0
        out.times[op] = samples
        out.cpu[op] = {s: c / (rounds * n * op[2]) for s, c in cpu.items()}
        log(f"  {op_label(op)}: {rounds} rounds x {n} in {time.perf_counter() - t0:.1f} s")
    return out


def op_label(op: Op) -> str:
    kind, name, conc = op
    return f"{kind} {name}, c{conc}"


def octets(op: Op, bodies: dict[str, bytes]) -> int:
    return len(bodies[op[1]]) * op[2]


def table(results: dict[Op, dict[str, list[float]]], bodies: dict[str, bytes]) -> list[str]:
    """The issue's table: MB/s of every subject (and the p50 latency for 256 KiB GETs), and ours against three."""
    cols = ["Mooncake TCP MB/s", "Mooncake + checksum", "ours h3", "ours h1", "TCP socket", "mTLS socket",
            "ours best/Mooncake", "ours best/Mooncake+checksum", "ours best/mTLS socket"]
    lines = ["| op, block, concurrency | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for op, samples in results.items():
        rate: dict[str, float | None] = {}
        cells = []
        for s in SUBJECTS:
            got = samples.get(s)
            if not got:
                rate[s] = None
                cells.append("n/a")
                continue
            med = statistics.median(got)
            rate[s] = octets(op, bodies) / 1e6 / med
            cells.append(f"{rate[s]:.0f}" + (f" ({med * 1e3:.2f} ms)" if op == ("get", "256 KiB", 1) else ""))
        ours = [r for r in (rate["ours h3"], rate["ours h1"]) if r is not None]
        best = max(ours) if ours else None
        for base in ("mooncake", "mooncake+checksum", "mtls socket"):
            b = rate.get(base)
            cells.append(f"{best / b:.2f}" if best is not None and b else "n/a")
        label = op_label(op) + (" (p50)" if op == ("get", "256 KiB", 1) else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


GET_PASSES = 1  # this head-to-head's GET checks Repr-Digest (Mooncake's checks nothing by default)


def cpu_table(cpu: dict[Op, dict[str, float]], sha_ms: dict[str, float]) -> list[str]:
    """CPU milliseconds per operation, client and server processes together (the steadier figure here), and the
    same-run floor (benchmarks/floor.py: the mTLS socket's CPU + one SHA-256 pass per digest: the GET's
    Repr-Digest, the PUT's layer digests at the holder) with ours against it."""
    cols = ["Mooncake", "Mooncake + checksum", "ours h3", "ours h1", "TCP socket", "mTLS socket",
            "floor (mTLS + SHA-256)", "ours least/Mooncake", "ours least/mTLS socket", "ours least/floor"]
    lines = ["| CPU ms per op (client + server), op | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for op, per in cpu.items():
        cells = [f"{per[s] * 1e3:.2f}" if s in per else "n/a" for s in SUBJECTS]
        ours = [per[s] for s in ("ours h3", "ours h1") if s in per]
        best = min(ours) if ours else None
        socket = per.get("mtls socket")
        passes = GET_PASSES if op[0] == "get" else PUT_PASSES
        floor = floor_ms(socket * 1e3, sha_ms[op[1]], passes) if socket else None
        cells.append(f"{floor:.2f} ({passes} pass{'es' if passes > 1 else ''})" if floor is not None else "n/a")
        for base in ("mooncake", "mtls socket"):
            cells.append(f"{best / per[base]:.1f}x" if best is not None and per.get(base) else "n/a")
        cells.append(f"{best * 1e3 / floor:.2f}x" if best is not None and floor else "n/a")
        lines.append(f"| {op_label(op)} | " + " | ".join(cells) + " |")
    return lines


async def run(args: argparse.Namespace, env: Environment, procs: Processes, workdir: Path) -> None:
    from quic.tls import TlsFiles, ssl_client_context

    ops = [op for op in OPS if not args.ops or op_label(op) in args.ops]
    names = [n for n in BLOCKS if any(op[1] == n for op in ops)]
    descriptors, bodies, files = make_blocks(workdir, names)
    get_keys = {n: [hashlib.sha256(f"get-{n}-{i}".encode()).digest() for i in range(8 if n == "16 MiB" else 1)]
                for n in names}
    print(f"blocks: {', '.join(f'{n} = {len(bodies[n])} octets' for n in names)}", flush=True)

    ready = start_holder(procs, workdir, names, args.event_loop)
    print(f"holder: {ready['base_uri']} (pid {ready['pid']})", flush=True)
    tls = TlsFiles.of(ready["ca"], ready["client_cert"], ready["client_key"])
    ports = start_socket_server(procs, holder_tls(workdir, ready), list(files.values()))
    h3 = Ours(ready, descriptors, bodies, h3=True)
    h1 = Ours(ready, descriptors, bodies, h3=False)
    tcp_sock = Sockets(ports["tcp"], None, bodies)
    tls_sock = Sockets(ports["tls"], ssl_client_context(tls, alpn=("kvsp-bench",)), bodies)
    subjects: dict[str, Batch] = {}
    pids: dict[str, list[int]] = {"ours h3": [ready["pid"]], "ours h1": [ready["pid"]],
                                  "tcp socket": [ports["pid"]], "mtls socket": [ports["pid"]]}
    try:
        if env.mooncake and not args.no_mooncake:
            for checksum in (False, True):
                if ("mooncake+checksum" if checksum else "mooncake") in args.skip:
                    continue
                stack = MooncakeStack(env, procs, workdir, checksum=checksum)
                stack.prepare(files, get_keys)
                subjects[stack.tag] = functools.partial(stack.batch, get_keys=get_keys)
                pids[stack.tag] = stack.pids
                print(f"{stack.tag}: master, segment and client up (pids {stack.pids})", flush=True)
        ours = {"ours h3": h3, "ours h1": h1}
        for name in names:  # seed the holder (it verifies every PUT), then check each path once
            for key in get_keys[name]:
                await (h1 if "ours h3" in args.skip else h3).put(name, key)
            for tag, client in ours.items():
                if tag not in args.skip:
                    await client.get(name, get_keys[name][0], client.buffers[0])
                    subjects[tag] = functools.partial(client.batch, get_keys=get_keys)
        print(f"ours: h3 answers over {h3.http_version or '-'}, h1 over {h1.http_version or '-'}", flush=True)
        for tag, sock in (("tcp socket", tcp_sock), ("mtls socket", tls_sock)):
            for name in names:
                if sock.get(name, 0) != bodies[name]:
                    raise RuntimeError("the socket server sent other octets")
            if tag not in args.skip:
                subjects[tag] = functools.partial(sock.batch, get_keys=get_keys)
        t0 = time.perf_counter()
        results = await measure(subjects, ops, args.rounds, args.quick, pids)
        print(f"measured in {time.perf_counter() - t0:.0f} s\n", flush=True)
    finally:
        tcp_sock.close()
        tls_sock.close()
        await h3.client.aclose()
        await h1.client.aclose()
    print(f"{os.cpu_count()} CPUs, Python {platform.python_version()}, Mooncake "
          f"{env.version if subjects.get('mooncake') else 'not run'}; medians of {args.rounds} rounds per "
          f"subject{' (--quick)' if args.quick else ''}; ours = GET into a buffer + Repr-Digest check, PUT verified "
          "by the holder\n")
    print("\n".join(table(results.times, bodies)))
    print()
    sha_ms = {name: sha256_cpu_ms(len(bodies[name])) for name in names}  # the same run's SHA-256, per block
    print(f"SHA-256 here: {', '.join(f'{n} {ms:.2f} ms' for n, ms in sha_ms.items())} of CPU per pass\n")
    print("\n".join(cpu_table(results.cpu, sha_ms)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="about a minute: 2 rounds of smaller batches")
    parser.add_argument("--rounds", type=int, help="rounds per operation (default 5; --quick: 2)")
    parser.add_argument("--mooncake-venv", type=Path, default=REPO / ".venv-mooncake")
    parser.add_argument("--no-mooncake", action="store_true", help="skip Mooncake even where it is installed")
    parser.add_argument("--ops", nargs="*", metavar="OP", help='only these rows, e.g. "get 16 MiB, c8"')
    parser.add_argument("--skip", action="append", default=[], choices=SUBJECTS, help="leave out this column")
    parser.add_argument("--event-loop", default="auto", choices=event_loop.CHOICES,
                        help="the loop of our holder and client (kvsp_app/event_loop.py; auto: uvloop)")
    parser.add_argument("--timeout", type=float, default=600, help="stop everything after this many seconds")
    parser.add_argument("--serve-sockets", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_sockets:
        serve_sockets(json.loads(args.serve_sockets))
        return
    args.rounds = args.rounds or (2 if args.quick else 5)
    env = check_environment(args.mooncake_venv)
    for item in env.missing:
        print(f"missing: {item}")
    for note in env.notes:
        print(f"note: {note}")
    if not env.mooncake:
        print("Mooncake cannot run here: its columns read n/a; everything else runs.")
    elif env.version:
        print(f"Mooncake: {MOONCAKE_PACKAGE} {env.version} in {args.mooncake_venv}")
    sys.stdout.flush()

    def timed_out(signum: int, frame: Any) -> None:
        raise Deadline(f"--timeout {args.timeout:.0f} s passed" if signum == signal.SIGALRM else "terminated")

    signal.signal(signal.SIGALRM, timed_out)
    signal.signal(signal.SIGTERM, timed_out)
    signal.setitimer(signal.ITIMER_REAL, args.timeout)
    procs = Processes()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-vs-mooncake-") as tmp:
            try:
                event_loop.run(run(args, env, procs, Path(tmp)), args.event_loop)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                procs.stop_all()
    except Deadline as exc:
        raise SystemExit(f"stopped: {exc}") from None


if __name__ == "__main__":
    main()
