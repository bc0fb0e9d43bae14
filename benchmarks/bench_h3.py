"""HTTP/3 throughput: our server and client vs a raw, tuned aioquic stream, in the same run.

    python -m benchmarks.bench_h3 [--size-mib 64] [--reps 5]

The server runs in its own process (two cores: one for each side, like two hosts). Baseline: one QUIC stream
carrying the same octets between plain aioquic endpoints with the same tuning (16 KiB datagrams, 64 MiB
windows, 4 MiB socket buffers) and no HTTP at all. Subject: a PUT of the body to an ASGI app that reads and
discards it, and a GET of the same size, through quic.listener + http3.h3_server and http3.client.
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
from quic.udp import bind_udp

SETTINGS = TransportSettings(stream_window=64 << 20, connection_window=64 << 20)


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


async def measure(cert_dir: str, size: int, reps: int) -> list[tuple[str, float, float]]:
    files = TlsFiles.in_dir(cert_dir, "alice")
    raw_proc, raw_port = start_server("raw", cert_dir)
    h3_proc, h3_port = start_server("h3", cert_dir)
    body = bytes(size)
    results: dict[str, list[float]] = {k: [] for k in ("raw get", "raw put", "h3 get", "h3 put")}
    try:
        async with KvspClient(files, settings=SETTINGS, timeout=120) as client:
            url = f"https://127.0.0.1:{h3_port}/"
            await client.request("GET", url + "?1")  # connect outside the timing, as the raw runs do
            for _ in range(reps):
                for direction in ("get", "put"):
                    results[f"raw {direction}"].append(await raw_transfer(raw_port, files, size, direction))
                t = time.perf_counter()
                received = 0
                async with client.stream("GET", f"{url}?{size}") as response:
                    async for chunk in response.aiter_bytes():  # counted, not kept, as the raw client does
                        received += len(chunk)
                assert received == size
                results["h3 get"].append(time.perf_counter() - t)
                t = time.perf_counter()
                response = await client.request("PUT", url, content=body)
                assert response.status == 204
                results["h3 put"].append(time.perf_counter() - t)
    finally:
        for proc in (raw_proc, h3_proc):
            proc.terminate()
            proc.wait()
    mb = size / 1e6
    return [(d, mb / statistics.median(results[f"h3 {d}"]), mb / statistics.median(results[f"raw {d}"]))
            for d in ("get", "put")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "CERT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(*args.serve))
        return
    from tests.pki import make_pki

    with tempfile.TemporaryDirectory() as tmp:
        make_pki(Path(tmp))
        rows = asyncio.run(measure(tmp, args.size_mib << 20, args.reps))
    print(f"{os.cpu_count()} CPUs; {args.size_mib} MiB per transfer; medians of {args.reps}\n")
    print("| transfer | our HTTP/3 | raw aioquic stream (same run) | ratio |")
    print("|---|---|---|---|")
    for direction, ours, raw in rows:
        label = "GET (server -> client)" if direction == "get" else "PUT (client -> server)"
        print(f"| {args.size_mib} MiB {label} | {ours:.0f} MB/s | {raw:.0f} MB/s | {ours / raw:.2f} |")


if __name__ == "__main__":
    main()
