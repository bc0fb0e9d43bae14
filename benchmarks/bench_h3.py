"""HTTP/3 throughput: our server and client vs a raw, tuned aioquic stream, in the same run.

    python -m benchmarks.bench_h3 [--size-mib 64] [--reps 5] [--datagram 1452,8952,16384] [--no-tcp] [--steps]

The server runs in its own process (two cores: one for each side, like two hosts). Baseline: one QUIC stream
carrying the same octets between plain aioquic endpoints with the same tuning (the same datagram size, 64 MiB
windows, 4 MiB socket buffers) and no HTTP at all. Subject: a PUT of the body to an ASGI app that reads and
discards it, and a GET of the same size, through quic.listener + http3.h3_server and http3.client.

Each datagram size (``--datagram``; default 1452 and 8952, what 1500 and 9000 octet MTUs carry over IPv4, and
loopback's 16384) is measured in a run of its own (:func:`per_datagram`: this module again, with
``KVSP_BENCH_DATAGRAM`` set, so that every endpoint, server processes included, uses that size). Each row also
shows the CPU time of each side per transfer (client: this process; server: its process, from /proc), and, unless
``--no-tcp``, the same-run GET rate of the TCP path (our HTTP/1.1 server, http3.tcp_server, with the lean blocking
client of benchmarks.bench_tcp) that issue 16 goal 4 compares HTTP/3 at 1452 octets with.

``--steps`` measures instead what each of quic/'s per-packet changes bought: one GET per step, the steps switched
on one after another and alternating, client and server in this process, CPU of both sides per 16 MiB
(docs/performance.md, "QUIC packets").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from http3.client import KvspClient
from http3.h3_server import h3_handler
from quic.listener import QuicListener
from quic.tls import TlsFiles, TransportSettings, quic_configuration
from quic.udp import BatchedUdpTransport, bind_udp

DATAGRAMS = (1452, 8952, 16384)  # 1500 and 9000 octet MTUs less IPv4 and UDP headers; loopback's 16 KiB
DATAGRAM_ENV = "KVSP_BENCH_DATAGRAM"


def settings_for(datagram: int) -> TransportSettings:
    # idle_timeout: at 1452 octets a benchmark's connections can sit unused for more than a minute while other
    # rows run (aioquic sends no keep-alives)
    return TransportSettings(max_datagram_size=datagram, stream_window=64 << 20, connection_window=64 << 20,
                             idle_timeout=600.0)


DATAGRAM = int(os.environ.get(DATAGRAM_ENV, "16384"))
SETTINGS = settings_for(DATAGRAM)  # every benchmark endpoint of this run (and of its server processes)


def add_datagram_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--datagram", default=",".join(map(str, DATAGRAMS)),
                        help="QUIC datagram sizes to measure, comma-separated (default: %(default)s)")


def per_datagram(args: argparse.Namespace, module: str) -> bool:
    """Run *module* once per ``--datagram`` size, each in a process of its own with ``KVSP_BENCH_DATAGRAM`` set.

    Returns False when this process is that run (one size, already in force), True when it ran them all."""
    sizes = [int(x) for x in str(args.datagram).split(",") if x.strip()]
    if sizes == [DATAGRAM] and os.environ.get(DATAGRAM_ENV):
        return False
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--datagram":
            skip = True
        elif not arg.startswith("--datagram="):
            argv.append(arg)
    for size in sizes:
        print(f"\n### QUIC datagrams of {size} octets\n", flush=True)
        subprocess.run([sys.executable, "-m", module, *argv, "--datagram", str(size)],
                       env={**os.environ, DATAGRAM_ENV: str(size)}, check=True)
    return True


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the raw baseline: one stream, no HTTP ----------------------------------------------------------------------


class RawServerProtocol(QuicConnectionProtocol):
    """'G<n>' on a stream: send n octets back; 'P' + data: count and answer with the count at FIN."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._got: dict[int, int] = {}
        self._payload = bytes(1 << 20)
        self._tasks: set[asyncio.Task[None]] = set()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            seen = self._got.get(event.stream_id, 0)
            if seen == 0 and event.data[:1] == b"G":
                task = asyncio.ensure_future(self._send(event.stream_id, int(event.data[1:])))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                self._got[event.stream_id] = -1
                return
            if seen >= 0:
                self._got[event.stream_id] = seen + len(event.data)
                if event.end_stream:
                    self._quic.send_stream_data(event.stream_id, str(self._got[event.stream_id]).encode(), True)
                    self.transmit()

    async def _send(self, stream_id: int, n: int) -> None:
        stream = self._quic._streams[stream_id]
        sent = 0
        while sent < n:
            while len(stream.sender._buffer) > (4 << 20):
                await asyncio.sleep(0.0005)
            piece = self._payload[:min(len(self._payload), n - sent)]
            sent += len(piece)
            self._quic.send_stream_data(stream_id, piece, sent >= n)
            self.transmit()


class RawClientProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.done: asyncio.Future[int] | None = None
        self.received = 0

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            self.received += len(event.data)
            if event.end_stream and self.done is not None:
                self.done.set_result(self.received)


async def raw_transfer(port: int, files: TlsFiles, size: int, direction: str) -> float:
    loop = asyncio.get_running_loop()
    config = quic_configuration(files, is_client=True, alpn=["raw"], settings=SETTINGS, server_name="127.0.0.1")
    sock = bind_udp("127.0.0.1", 0, SETTINGS.socket_buffer)
    transport, proto = await loop.create_datagram_endpoint(
        lambda: RawClientProtocol(QuicConnection(configuration=config)), sock=sock)
    proto.connect(("127.0.0.1", port))
    await proto.wait_connected()
    quic = proto._quic
    stream_id = quic.get_next_available_stream_id()
    proto.done = loop.create_future()
    proto.received = 0
    start = time.perf_counter()
    if direction == "get":
        quic.send_stream_data(stream_id, f"G{size}".encode(), True)
        proto.transmit()
    else:
        payload = bytes(1 << 20)
        stream = quic._streams.get(stream_id)
        quic.send_stream_data(stream_id, b"P", False)
        sent = 0
        stream = quic._streams[stream_id]
        while sent < size:
            while len(stream.sender._buffer) > (4 << 20):
                await asyncio.sleep(0.0005)
            piece = payload[:min(len(payload), size - sent)]
            sent += len(piece)
            quic.send_stream_data(stream_id, piece, sent >= size)
            proto.transmit()
    await proto.done
    elapsed = time.perf_counter() - start
    proto.close()
    transport.close()
    return elapsed


# -- the server process ------------------------------------------------------------------------------------------


async def sink_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            break
    if scope["method"] == "GET":
        size = int(scope["query_string"] or b"0")
        chunk = bytes(1 << 20)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(size).encode())]})
        sent = 0
        while sent < size:
            piece = chunk[:min(len(chunk), size - sent)]
            sent += len(piece)
            await send({"type": "http.response.body", "body": piece, "more_body": sent < size})
        return
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def serve(kind: str, cert_dir: str) -> None:
    files = TlsFiles.in_dir(cert_dir, "server")
    if kind == "raw":
        config = quic_configuration(files, is_client=False, alpn=["raw"], settings=SETTINGS)
        loop = asyncio.get_running_loop()
        sock = bind_udp("127.0.0.1", 0, SETTINGS.socket_buffer)
        await loop.create_datagram_endpoint(lambda: QuicServer(configuration=config, create_protocol=RawServerProtocol),
                                            sock=sock)
        port = sock.getsockname()[1]
    else:
        listener = QuicListener(files, {"h3": h3_handler(sink_app)}, settings=SETTINGS)
        await listener.start("127.0.0.1", 0)
        port = listener.port
    print(json.dumps({"port": port}), flush=True)
    await asyncio.Event().wait()


# -- the run -----------------------------------------------------------------------------------------------------


def start_server(kind: str, cert_dir: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_h3", "--serve", kind, cert_dir],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["port"]


class Sample:
    """Medians of one kind of transfer: wall time, CPU of the client (this process) and of the server process."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.client: list[float] = []
        self.server: list[float] = []

    def add(self, wall: float, client: float, server: float) -> None:
        self.wall.append(wall)
        self.client.append(client)
        self.server.append(server)

    def mbps(self, size: int) -> float:
        return size / 1e6 / statistics.median(self.wall)

    def cpu_ms(self, size: int) -> tuple[float, float]:
        """Client and server CPU milliseconds per 16 MiB."""
        scale = 1e3 * (16 << 20) / size
        return statistics.median(self.client) * scale, statistics.median(self.server) * scale


async def timed(sample: Sample, pid: int, run: Any) -> None:
    server0, client0, t0 = process_cpu(pid), time.process_time(), time.perf_counter()
    elapsed = await run()  # a run that connects first returns the time after its handshake
    wall, client = time.perf_counter() - t0, time.process_time() - client0
    sample.add(elapsed if isinstance(elapsed, float) else wall, client, process_cpu(pid) - server0)


class TcpPath:
    """The TCP path of issue 16 goal 4: http3.tcp_server (HTTP/1.1) in a process of its own, bench_tcp's client."""

    def __init__(self, size: int) -> None:
        import multiprocessing as mp

        from benchmarks.bench_tcp import Clients, _serve
        from kvsp_dev import pki

        self._tmp = tempfile.TemporaryDirectory()
        pki.init(self._tmp.name, [pki.role("server", "https://127.0.0.1/"), pki.client("bench")])
        spawn = mp.get_context("spawn")
        ports, self._stop = spawn.Queue(), spawn.Event()
        self._cpu, child_cpu = spawn.Pipe()
        self._child = spawn.Process(target=_serve, args=(self._tmp.name, ports, self._stop, child_cpu))
        self._child.start()
        self.port = ports.get(timeout=30)[0]
        self.clients = Clients(TlsFiles.in_dir(Path(self._tmp.name), "bench"), size)

    @property
    def pid(self) -> int:
        assert self._child.pid is not None
        return self._child.pid

    async def get(self) -> float:
        return self.clients.h1_get(self.port)  # blocking: nothing else runs in this process meanwhile

    def close(self) -> None:
        self._stop.set()
        self._child.join(15)
        if self._child.is_alive():
            self._child.kill()
        self._tmp.cleanup()


async def measure(cert_dir: str, size: int, reps: int, tcp: bool) -> dict[str, Sample]:
    files = TlsFiles.in_dir(cert_dir, "alice")
    raw_proc, raw_port = start_server("raw", cert_dir)
    h3_proc, h3_port = start_server("h3", cert_dir)
    tcp_path = TcpPath(size) if tcp else None
    body = bytes(size)
    results = {k: Sample() for k in ("raw get", "raw put", "h3 get", "h3 put", "tcp get")}
    try:
        async with KvspClient(files, settings=SETTINGS, timeout=120) as client:
            url = f"https://127.0.0.1:{h3_port}/"
            await client.request("GET", url + "?1")  # connect outside the timing, as the raw runs do

            async def h3_get() -> None:
                received = 0
                async with client.stream("GET", f"{url}?{size}") as response:
                    async for chunk in response.aiter_bytes():  # counted, not kept, as the raw client does
                        received += len(chunk)
                assert received == size

            async def h3_put() -> None:
                response = await client.request("PUT", url, content=body)
                assert response.status == 204

            for _ in range(reps):
                for direction in ("get", "put"):
                    await timed(results[f"raw {direction}"], raw_proc.pid,
                                lambda d=direction: raw_transfer(raw_port, files, size, d))  # type: ignore[misc]
                await timed(results["h3 get"], h3_proc.pid, h3_get)
                await timed(results["h3 put"], h3_proc.pid, h3_put)
                if tcp_path is not None:
                    await timed(results["tcp get"], tcp_path.pid, tcp_path.get)
    finally:
        for proc in (raw_proc, h3_proc):
            proc.terminate()
            proc.wait()
        if tcp_path is not None:
            tcp_path.close()
    return results


# -- what each step of the per-packet work bought (--steps) --------------------------------------------------------


STEPS = ("before (stream limits worked out for every stream in every packet, 16-packet pacing bursts, a send call "
         "per datagram, an event per packet, timer ACKs)", "+ stream limits: an early return when none is due",
         "+ pacing bursts counted in octets (256 KiB)", "+ UDP segmentation offload (one sendmsg per run)",
         "+ adjacent STREAM events merged per batch", "+ one ACK per batch of datagrams",
         "+ UDP receive offload (GRO: one recvmsg per run)")


def _stream_limits_before(self: Any, builder: Any, space: Any, stream: Any) -> None:
    """quic.connection's KvspQuicConnection._write_stream_limits before the early return (the "before" row)."""
    from aioquic.quic.connection import QuicConnection as Aioquic

    if stream.max_stream_data_local:
        window = self._kvsp_stream_window
        consumed = stream.receiver.starting_offset() - self._kvsp_unread.get(stream.stream_id, 0)
        target = consumed + window
        if target - stream.max_stream_data_local >= window // 4:
            stream.max_stream_data_local = target
    highest, stream.receiver.highest_offset = stream.receiver.highest_offset, 0
    try:
        Aioquic._write_stream_limits(self, builder, space, stream)
    finally:
        stream.receiver.highest_offset = highest


async def step_run(cert_dir: str, size: int, step: int) -> tuple[float, float]:
    """One GET of *size* octets with steps 1..*step* on, client and server in this process: (seconds, CPU seconds
    of both sides together). Steps off are switched off on our classes for this run only."""
    import quic.protocol as qp
    from quic.connection import KvspQuicConnection

    saved = qp.coalesce_stream_data, KvspQuicConnection.ack_now, KvspQuicConnection._write_stream_limits
    if step < 1:
        KvspQuicConnection._write_stream_limits = _stream_limits_before  # type: ignore[method-assign]
    if step < 4:
        qp.coalesce_stream_data = lambda quic: None  # type: ignore[assignment]
    if step < 5:
        KvspQuicConnection.ack_now = lambda self, now: None  # type: ignore[method-assign]
    settings = SETTINGS if step >= 2 else replace(SETTINGS, pacing_burst=16 * DATAGRAM)
    listener = QuicListener(TlsFiles.in_dir(cert_dir, "server"), {"h3": h3_handler(sink_app)}, settings=settings)
    try:
        await listener.start("127.0.0.1", 0)
        async with KvspClient(TlsFiles.in_dir(cert_dir, "alice"), settings=settings, timeout=120) as client:
            url = f"https://127.0.0.1:{listener.port}/"
            await client.request("GET", url + "?1")
            transports = [listener._transport] + [c._transport for cs in client._pool._conns.values() for c in cs]
            for transport in transports:
                if isinstance(transport, BatchedUdpTransport):
                    transport.gso = transport.gso and step >= 3
                    if step < 6:
                        transport.stop_receive_offload()
            c0, t0 = time.process_time(), time.perf_counter()
            received = 0
            async with client.stream("GET", f"{url}?{size}") as response:
                async for chunk in response.aiter_bytes():
                    received += len(chunk)
            assert received == size
            return time.perf_counter() - t0, time.process_time() - c0
    finally:
        await listener.close()
        (qp.coalesce_stream_data, KvspQuicConnection.ack_now,  # type: ignore[method-assign]
         KvspQuicConnection._write_stream_limits) = saved


def print_steps(size: int, reps: int) -> None:
    from tests.pki import make_pki

    runs: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(STEPS))}
    with tempfile.TemporaryDirectory() as tmp:
        make_pki(Path(tmp))
        for _ in range(reps):
            for step in range(len(STEPS)):
                runs[step].append(asyncio.run(step_run(tmp, size, step)))
    print(f"{size >> 20} MiB GET over HTTP/3, QUIC datagrams of {DATAGRAM} octets, client and server in one process "
          f"(one core); medians of {reps}, steps alternating\n")
    print("| step | datagram | CPU ms per 16 MiB, both sides | MB/s | CPU vs before |")
    print("|---|---|---|---|---|")
    first = 0.0
    for step, label in enumerate(STEPS):
        cpu = statistics.median(c for _, c in runs[step]) * 1e3 * (16 << 20) / size
        first = first or cpu
        mbs = size / 1e6 / statistics.median(t for t, _ in runs[step])
        print(f"| {label} | {DATAGRAM} | {cpu:.0f} | {mbs:.0f} | {cpu / first:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-tcp", action="store_true", help="leave out the TCP path GET row")
    parser.add_argument("--steps", action="store_true",
                        help="instead: one GET per step of the per-packet work, steps alternating, both sides in "
                             "this process (CPU of both sides per 16 MiB, MB/s)")
    add_datagram_argument(parser)
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "CERT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(*args.serve))
        return
    if per_datagram(args, "benchmarks.bench_h3"):
        return
    from tests.pki import make_pki

    size = args.size_mib << 20
    if args.steps:
        print_steps(size, args.reps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        make_pki(Path(tmp))
        res = asyncio.run(measure(tmp, size, args.reps, not args.no_tcp))
    print(f"{os.cpu_count()} CPUs; {args.size_mib} MiB per transfer; QUIC datagrams of {DATAGRAM} octets; "
          f"medians of {args.reps}\n")
    print("| transfer | datagram | our HTTP/3 MB/s | raw aioquic stream MB/s (same run) | ratio "
          "| CPU ms per 16 MiB, client / server: ours | raw |")
    print("|---|---|---|---|---|---|---|")
    for d in ("get", "put"):
        label = "GET (server -> client)" if d == "get" else "PUT (client -> server)"
        ours, raw = res[f"h3 {d}"], res[f"raw {d}"]
        (oc, os_), (rc, rs) = ours.cpu_ms(size), raw.cpu_ms(size)
        print(f"| {args.size_mib} MiB {label} | {DATAGRAM} | {ours.mbps(size):.0f} | {raw.mbps(size):.0f} "
              f"| {ours.mbps(size) / raw.mbps(size):.2f} | {oc:.0f} / {os_:.0f} | {rc:.0f} / {rs:.0f} |")
    if res["tcp get"].wall:
        tcp, h3 = res["tcp get"], res["h3 get"]
        (tc, ts) = tcp.cpu_ms(size)
        print(f"\n| {args.size_mib} MiB GET | datagram | HTTP/3 MB/s | TCP path (HTTP/1.1, lean client) MB/s "
              "| HTTP/3 / TCP | TCP CPU ms per 16 MiB, client / server |")
        print("|---|---|---|---|---|---|")
        print(f"| same run | {DATAGRAM} | {h3.mbps(size):.0f} | {tcp.mbps(size):.0f} "
              f"| {h3.mbps(size) / tcp.mbps(size):.2f} | {tc:.0f} / {ts:.0f} |")


if __name__ == "__main__":
    main()
