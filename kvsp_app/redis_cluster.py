"""A real redis-server, or a Redis Cluster of them, on this machine: 127.0.0.1, free ports, a directory, no
persistence. ``kvsp-quic chaos --redis-cluster`` starts its cluster with it; the tests use it through
``tests/redis_server.py`` (one copy of the starter).

    with RedisServer.start(directory) as server:                  # or: server = RedisServer.start(dir); server.stop()
        url = server.url                                           # redis://127.0.0.1:PORT/0

    with RedisClusterServers.start(directory, nodes=3) as cluster:  # primaries only, the 16384 slots split evenly
        url = cluster.url                                          # redis://127.0.0.1:PORT (--redis-cluster)

``redis-server`` must be on PATH (Debian/Ubuntu: ``apt-get install -y redis-server``): :data:`REDIS_SERVER` is None
otherwise, and ``start`` raises :class:`RuntimeError` with :data:`REDIS_MISSING`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")
REDIS_MISSING = "redis-server is not on PATH (Debian/Ubuntu: apt-get install -y redis-server)"
_SLOTS = 16384


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def command(port: int, *args: str, timeout: float = 5.0) -> bytes:
    """Send one command in RESP and return the raw reply (enough for PING, CLUSTER, CONFIG)."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        data = b""
        while not data.endswith(b"\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        if data.startswith(b"$"):  # a bulk string: read the rest of it
            size = int(data[1:data.index(b"\r\n")])
            while size >= 0 and len(data) < data.index(b"\r\n") + 2 + size + 2:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        return data


@dataclass
class RedisServer:
    port: int
    directory: Path
    process: subprocess.Popen[bytes]
    log: Path = field(default=Path())

    @classmethod
    def start(cls, directory: str | os.PathLike[str], *, extra: tuple[str, ...] = (), attempts: int = 5) -> RedisServer:
        binary = shutil.which("redis-server") or REDIS_SERVER
        if binary is None:
            raise RuntimeError(REDIS_MISSING)
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        last = ""
        for _ in range(attempts):  # a free port can be taken between the probe and the bind: retry
            port = free_port()
            log = root / f"redis-{port}.log"
            args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(root), "--logfile", str(log), "--protected-mode", "no", *extra]
            process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            server = cls(port, root, process, log)
            if server._wait_ready():
                return server
            server.stop()
            last = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server did not start: {last}")

    def _wait_ready(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                if command(self.port, "PING", timeout=1.0).startswith(b"+PONG"):
                    return True
            except OSError:
                pass
            time.sleep(0.01)
        return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class RedisClusterServers:
    """A Redis Cluster of *nodes* primaries on 127.0.0.1 (no replicas), its slots split evenly."""

    servers: list[RedisServer]

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def url(self) -> str:
        """A startup node of the cluster, for ``kvsp-quic index --redis URL --redis-cluster``."""
        return f"redis://127.0.0.1:{self.servers[0].port}"

    @classmethod
    def start(cls, directory: str | os.PathLike[str], *, nodes: int = 3) -> RedisClusterServers:
        root = Path(directory)
        servers: list[RedisServer] = []
        try:
            for i in range(nodes):
                node_dir = root / f"node{i}"
                servers.append(RedisServer.start(node_dir, extra=(
                    "--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
                    "--cluster-node-timeout", "2000")))
            per = _SLOTS // nodes
            for i, server in enumerate(servers):
                last = _SLOTS - 1 if i == nodes - 1 else (i + 1) * per - 1
                reply = command(server.port, "CLUSTER", "ADDSLOTSRANGE", str(i * per), str(last))
                if not reply.startswith(b"+OK"):
                    raise RuntimeError(f"CLUSTER ADDSLOTSRANGE: {reply!r}")
            for server in servers[1:]:
                command(server.port, "CLUSTER", "MEET", "127.0.0.1", str(servers[0].port))
            cluster = cls(servers)
            cluster._wait_ok()
            return cluster
        except BaseException:
            for s in servers:
                s.stop()
            raise

    def _wait_ok(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok = all(b"cluster_state:ok" in command(s.port, "CLUSTER", "INFO")
                     and command(s.port, "CLUSTER", "NODES").count(b"master") == len(self.servers)
                     for s in self.servers)
            if ok:
                return
            time.sleep(0.05)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> RedisClusterServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["REDIS_MISSING", "REDIS_SERVER", "RedisClusterServers", "RedisServer", "command", "free_port"]
