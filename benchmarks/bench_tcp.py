"""HTTP/1.1 and HTTP/2 over TLS (http3.tcp_server) against a raw TLS socket, in one run, on loopback.

    python -m benchmarks.bench_tcp              # 64 MiB, 7 alternating repetitions, prints a Markdown table
    python -m benchmarks.bench_tcp --reps 3 --mib 32 --no-httpx

The servers run in a child process pinned to one core, the clients in this one pinned to the other, so that
neither side steals the other's CPU. Every transfer uses the same certificates (a fresh dev PKI, ECDSA P-256,
mutual TLS 1.3):

* baseline: a blocking ``ssl`` socket server that sends (GET) or swallows (PUT) the bytes with no HTTP at all;
* ours: :class:`http3.tcp_server.TcpServer` running a minimal ASGI app that sends 1 MiB body chunks from one
  preallocated buffer (GET) or counts what it receives (PUT);
* also shown: an asyncio TLS transport without HTTP (the ceiling any asyncio server has here).

Clients: our own small clients over blocking ``ssl`` sockets (HTTP/1.1 written by hand, HTTP/2 with the h2
library, 16 MiB windows and 1 MiB frames), reading with ``recv_into`` into a reused buffer; and httpx (the
client the project uses), streaming with 1 MiB chunks. Each measurement starts after the TLS handshake and ends
with the last body octet (GET) or the response (PUT). Runs alternate subject and baseline; medians are reported.

Two figures per transfer: wall-clock MB/s, and MB per CPU-second of the server process (its user + system time
over the transfer). The second is the stable one on a shared 2-core machine: the blocking baseline's wall-clock
rate is bimodal here (~700 or ~1300 MB/s from one row to the next; likely because its ``SSL_read`` takes one
16 KiB record per call, which makes it sensitive to how often it sleeps for data), while CPU per byte hardly moves.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import socket
import ssl
import statistics
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings

from http3.tcp_h2 import H2Core
from kvsp_dev import pki
from quic.tls import TlsFiles, ssl_client_context, ssl_server_context

CHUNK = 1 << 20
READ = 256 << 10


# -- servers (child process) -------------------------------------------------------------------------------------


def _raw_serve(ctx: ssl.SSLContext, listener: socket.socket) -> None:
    """Blocking TLS: 'G' + 8-octet length -> that many octets; 'P' + length -> swallow, answer 'k'."""
    chunk = memoryview(bytearray(CHUNK))
    buf = bytearray(READ)
    while True:
        try:
            raw, _ = listener.accept()
        except OSError:
            return
        with ctx.wrap_socket(raw, server_side=True) as conn:
            head = _recv_exact(conn, 9)
            n = int.from_bytes(head[1:], "big")
            if head[:1] == b"G":
                while n > 0:
                    conn.sendall(chunk[:min(n, CHUNK)])
                    n -= CHUNK
            else:
                while n > 0:
                    n -= conn.recv_into(buf)
                conn.sendall(b"k")
            conn.recv(1)  # wait for the client to close


def _recv_exact(conn: ssl.SSLSocket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            raise ConnectionError("peer closed")
        out += part
    return out


class _AsyncRaw(asyncio.Protocol):
    """The asyncio TLS transport with no HTTP: the same commands as :func:`_raw_serve`."""

    def __init__(self) -> None:
        self.head = b""
        self.left = -1
        self.mode = b""
        self.paused: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=1 << 20)

    def data_received(self, data: bytes) -> None:
        if self.left < 0:
            self.head += data
            if len(self.head) < 9:
                return
            self.mode, self.left, data = self.head[:1], int.from_bytes(self.head[1:9], "big"), self.head[9:]
            if self.mode == b"G":
                asyncio.get_running_loop().create_task(self._send())
                return
        if self.mode == b"P":
            self.left -= len(data)
            if self.left <= 0:
                self.transport.write(b"k")

    async def _send(self) -> None:
        chunk = memoryview(bytes(CHUNK))
        n = self.left
        while n > 0:
            self.transport.write(chunk[:min(n, CHUNK)])
            n -= CHUNK
            if self.transport.get_write_buffer_size() > (1 << 20):
                self.paused = asyncio.get_running_loop().create_future()
                await self.paused

    def resume_writing(self) -> None:
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)

    def pause_writing(self) -> None:
        pass


_BLOB = memoryview(bytes(CHUNK))


async def _app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    if scope["type"] != "http":
        return
    if scope["method"] == "GET":
        n = int(scope["query_string"].decode().partition("=")[2] or 0)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(n).encode())]})
        while n > CHUNK:
            await send({"type": "http.response.body", "body": _BLOB, "more_body": True})
            n -= CHUNK
        await send({"type": "http.response.body", "body": _BLOB[:n]})
        return
    got = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        got += len(message["body"])
        if not message.get("more_body"):
            break
    body = str(got).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def _cpu_clock(conn: Any) -> None:
    """Answers every message on *conn* with this process's CPU time (all threads, user + system)."""
    while True:
        try:
            conn.recv()
            conn.send(time.process_time())
        except (EOFError, OSError):
            return


def _pin(index: int) -> None:
    """Keep this process (and the threads it starts) on one CPU: client and server on different cores, always."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[index]})


def _serve(root: str, ports: Any, stop: Any, cpu: Any) -> None:
    from http3.tcp_server import TcpServer

    _pin(1)
    files = TlsFiles.in_dir(root, "server")
    threading.Thread(target=_cpu_clock, args=(cpu,), daemon=True).start()

    async def main() -> None:
        server = TcpServer(_app, files, lifespan=False)
        await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        raw_async = await loop.create_server(_AsyncRaw, "127.0.0.1", 0, ssl=ssl_server_context(files))
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_raw_serve, args=(ssl_server_context(files), listener), daemon=True).start()
        ports.put((server.port, raw_async.sockets[0].getsockname()[1], listener.getsockname()[1]))
        await loop.run_in_executor(None, stop.wait)
        listener.close()
        raw_async.close()
        await server.close()

    asyncio.run(main())


# -- clients (this process) ----------------------------------------------------------------------------------------


class Clients:
    def __init__(self, files: TlsFiles, n: int) -> None:
        self.files = files
        self.n = n
        self.buf = bytearray(READ)
        self.big = bytearray(4 * CHUNK)
        self.chunk = memoryview(bytearray(CHUNK))

    def connect(self, port: int, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLSocket:
        ctx = ssl_client_context(self.files, alpn)
        sock = socket.create_connection(("127.0.0.1", port))
        return ctx.wrap_socket(sock, server_hostname="127.0.0.1")

    # raw TLS
    def raw_get(self, port: int) -> float:
        with self.connect(port) as s:
            t0 = time.perf_counter()
            s.sendall(b"G" + self.n.to_bytes(8, "big"))
            got = 0
            while got < self.n:
                got += s.recv_into(self.buf)
            return time.perf_counter() - t0

    def raw_put(self, port: int) -> float:
        with self.connect(port) as s:
            t0 = time.perf_counter()
            s.sendall(b"P" + self.n.to_bytes(8, "big"))
            self._send_n(s)
            assert s.recv(1) == b"k"
            return time.perf_counter() - t0

    def _send_n(self, s: ssl.SSLSocket) -> None:
        left = self.n
        while left > 0:
            s.sendall(self.chunk[:min(left, CHUNK)])
            left -= CHUNK

    # HTTP/1.1 by hand
    def _h1_response(self, s: ssl.SSLSocket) -> tuple[int, int]:
        """Reads the head; returns (content-length, body octets already read)."""
        head = bytearray()
        while b"\r\n\r\n" not in head:
            n = s.recv_into(self.buf)
            if not n:
                raise ConnectionError("closed before the response head")
            head += self.buf[:n]
        end = head.index(b"\r\n\r\n") + 4
        assert head.startswith(b"HTTP/1.1 200"), bytes(head[:60])
        length = next(int(line.split(b":", 1)[1]) for line in head[:end].split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return length, len(head) - end

    def h1_get(self, port: int) -> float:
        with self.connect(port) as s:
            t0 = time.perf_counter()
            s.sendall(b"GET /blob?n=%d HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n" % self.n)
            length, got = self._h1_response(s)
            while got < length:
                got += s.recv_into(self.buf)
            assert got == self.n
            return time.perf_counter() - t0

    def h1_put(self, port: int) -> float:
        with self.connect(port) as s:
            t0 = time.perf_counter()
            s.sendall(b"PUT /sink HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: %d\r\n\r\n" % self.n)
            self._send_n(s)
            self._h1_response(s)
            return time.perf_counter() - t0

    # HTTP/2 with h2
    def _h2(self, port: int) -> tuple[ssl.SSLSocket, H2Core]:
        s = self.connect(port, ("h2",))
        conn = H2Core(h2.config.H2Configuration(client_side=True, header_encoding=None))
        conn.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 16 << 20,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: CHUNK,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        })
        conn.max_inbound_frame_size = CHUNK
        conn.initiate_connection()
        conn.increment_flow_control_window((64 << 20) - 65535)
        self._h2_send(s, conn)
        return s, conn

    def _h2_send(self, s: ssl.SSLSocket, conn: H2Core) -> None:
        for chunk in conn.output():
            s.sendall(chunk)

    def _h2_pump(self, s: ssl.SSLSocket, conn: H2Core) -> list[h2.events.Event]:
        view = memoryview(self.big)
        n = s.recv_into(view)  # one TLS record (16 KiB) at most: gather what else is there for h2
        if not n:
            raise ConnectionError("closed")
        s.setblocking(False)
        try:
            while n < len(view):
                n += s.recv_into(view[n:])
        except (ssl.SSLWantReadError, BlockingIOError):
            pass
        finally:
            s.setblocking(True)
        events = conn.receive_data(view[:n])
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.flow_controlled_length:
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self._h2_send(s, conn)
        return events

    def _h2_headers(self, method: bytes, path: bytes, extra: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [(b":method", method), (b":scheme", b"https"), (b":authority", b"127.0.0.1"), (b":path", path),
                *extra]

    def h2_get(self, port: int) -> float:
        s, conn = self._h2(port)
        with s:
            t0 = time.perf_counter()
            conn.send_headers(1, self._h2_headers(b"GET", b"/blob?n=%d" % self.n, []), end_stream=True)
            self._h2_send(s, conn)
            got, ended = 0, False
            while not ended:
                for event in self._h2_pump(s, conn):
                    if isinstance(event, h2.events.DataReceived):
                        got += len(event.data or b"")
                    elif isinstance(event, h2.events.StreamEnded):
                        ended = True
            assert got == self.n
            return time.perf_counter() - t0

    def h2_put(self, port: int) -> float:
        s, conn = self._h2(port)
        with s:
            t0 = time.perf_counter()
            conn.send_headers(1, self._h2_headers(b"PUT", b"/sink", [(b"content-length", b"%d" % self.n)]))
            self._h2_send(s, conn)
            left = self.n
            while left > 0:
                window = min(conn.local_flow_control_window(1), conn.max_outbound_frame_size, left)
                if window <= 0:
                    self._h2_pump(s, conn)
                    continue
                left -= window
                conn.send_chunk(1, self.chunk[:window], end_stream=left == 0)
                self._h2_send(s, conn)
            ended = False
            while not ended:
                ended = any(isinstance(e, h2.events.StreamEnded) for e in self._h2_pump(s, conn))
            return time.perf_counter() - t0

    # httpx
    def httpx_get(self, port: int, http2: bool) -> float:
        return asyncio.run(self._httpx(port, http2, put=False))

    def httpx_put(self, port: int, http2: bool) -> float:
        return asyncio.run(self._httpx(port, http2, put=True))

    async def _httpx(self, port: int, http2: bool, put: bool) -> float:
        import httpx

        ctx = ssl_client_context(self.files)
        url = f"https://127.0.0.1:{port}"
        async with httpx.AsyncClient(verify=ctx, http1=not http2, http2=http2, timeout=60) as client:
            await client.get(url + "/blob?n=1")  # connect and handshake before the clock starts
            t0 = time.perf_counter()
            if put:
                response = await client.put(url + "/sink", content=self._chunks(), headers={
                    "content-length": str(self.n)})
                assert int(response.text) == self.n
            else:
                got = 0
                async with client.stream("GET", url + f"/blob?n={self.n}") as response:
                    async for part in response.aiter_raw(CHUNK):
                        got += len(part)
                assert got == self.n
            return time.perf_counter() - t0

    async def _chunks(self) -> AsyncIterator[bytes]:
        left = self.n
        chunk = bytes(CHUNK)
        while left > 0:
            yield chunk[:min(left, CHUNK)] if left < CHUNK else chunk
            left -= CHUNK


class Row:
    """Medians of alternating runs: wall-clock MB/s, and MB per CPU-second of the server process."""

    def __init__(self, name: str, ours: list[tuple[float, float]], base: list[tuple[float, float]], n: int) -> None:
        self.name = name
        self.mbps = n / statistics.median(t for t, _ in ours) / 1e6
        self.base_mbps = n / statistics.median(t for t, _ in base) / 1e6
        self.cpu = n / statistics.median(c for _, c in ours) / 1e6
        self.base_cpu = n / statistics.median(c for _, c in base) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--no-httpx", action="store_true")
    args = parser.parse_args()
    n = args.mib << 20
    with tempfile.TemporaryDirectory() as tmp:
        pki.init(tmp, [pki.role("server", "https://127.0.0.1/"), pki.client("bench")])
        spawn = mp.get_context("spawn")
        ports, stop = spawn.Queue(), spawn.Event()
        cpu, child_cpu = spawn.Pipe()
        child = spawn.Process(target=_serve, args=(tmp, ports, stop, child_cpu))
        child.start()
        _pin(0)
        try:
            ours_port, async_port, raw_port = ports.get(timeout=30)
            c = Clients(TlsFiles.in_dir(Path(tmp), "bench"), n)
            rows: list[Row] = []

            def measure(fn: Callable[[], float]) -> tuple[float, float]:
                cpu.send(None)
                before = cpu.recv()
                elapsed = fn()
                cpu.send(None)
                return elapsed, cpu.recv() - before

            def row(name: str, fn: Callable[[], float], base: Callable[[], float]) -> None:
                fn(), base()  # warm-up
                ours, baseline = [], []
                for _ in range(args.reps):
                    ours.append(measure(fn))
                    baseline.append(measure(base))
                rows.append(Row(name, ours, baseline, n))

            row("asyncio TLS transport, no HTTP (ceiling of any asyncio server): GET",
                lambda: c.raw_get(async_port), lambda: c.raw_get(raw_port))
            row("asyncio TLS transport, no HTTP: PUT", lambda: c.raw_put(async_port), lambda: c.raw_put(raw_port))
            row("HTTP/1.1 GET, own client", lambda: c.h1_get(ours_port), lambda: c.raw_get(raw_port))
            row("HTTP/1.1 PUT, own client", lambda: c.h1_put(ours_port), lambda: c.raw_put(raw_port))
            row("HTTP/2 GET, own h2 client", lambda: c.h2_get(ours_port), lambda: c.raw_get(raw_port))
            row("HTTP/2 PUT, own h2 client", lambda: c.h2_put(ours_port), lambda: c.raw_put(raw_port))
            if not args.no_httpx:
                row("HTTP/1.1 GET, httpx", lambda: c.httpx_get(ours_port, False), lambda: c.raw_get(raw_port))
                row("HTTP/1.1 PUT, httpx", lambda: c.httpx_put(ours_port, False), lambda: c.raw_put(raw_port))
                row("HTTP/2 GET, httpx", lambda: c.httpx_get(ours_port, True), lambda: c.raw_get(raw_port))
                row("HTTP/2 PUT, httpx", lambda: c.httpx_put(ours_port, True), lambda: c.raw_put(raw_port))
        finally:
            stop.set()
            child.join(15)
            if child.is_alive():
                child.kill()
    print(f"{args.mib} MiB per transfer, medians of {args.reps} alternating runs, Python "
          f"{platform.python_version()}, {ssl.OPENSSL_VERSION}\n")
    print("| transfer (server: http3.tcp_server unless named) | ours MB/s | raw TLS socket MB/s (same run) | ratio "
          "| ours MB per server CPU-s | raw TLS MB per server CPU-s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.name} | {r.mbps:.0f} | {r.base_mbps:.0f} | {r.mbps / r.base_mbps:.2f} | {r.cpu:.0f} "
              f"| {r.base_cpu:.0f} | {r.cpu / r.base_cpu:.2f} |")


if __name__ == "__main__":
    main()
