"""Resource attacks on real server processes: the legitimate client that keeps fetching and verifying blocks during
an attack (in a thread of its own), the server's RSS, the holder started for an attack, the RESOURCE lines."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import statistics
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_dev import pki
from kvsp_quic.repr_digest import parse_repr_digest
from quic.tls import TlsFiles
from tests.helpers import Process
from tests.support.cluster import block, block_url

SLOW = os.environ.get("KVSP_SLOW") == "1"
slow = pytest.mark.skipif(not SLOW, reason="a bigger attack: KVSP_SLOW=1")
ATTACKER = "127.0.0.2"  # the attackers' source address; the legitimate client's is 127.0.0.1
BLOCKS = 4  # blocks the legitimate client fetches in turn (512 KiB containers)
MiB = 1 << 20


def rss(pid: int) -> int:
    """The resident set of process *pid* in octets (VmRSS of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class RssProbe:
    """Samples a process's RSS every 50 ms in a thread (the test's event loop is busy attacking): before the attack,
    its peak during it, and after."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = rss(pid)
        self.peak = self.before
        self.after = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(OSError, RuntimeError):
                self.peak = max(self.peak, rss(self.pid))

    def __enter__(self) -> RssProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss(self.pid))

    def settle(self) -> None:
        self.after = rss(self.pid)

    @property
    def growth(self) -> int:
        return self.peak - self.before

    def text(self) -> str:
        return (f"RSS before {self.before / MiB:.1f} MiB, peak {self.peak / MiB:.1f} MiB, "
                f"after {self.after / MiB:.1f} MiB")


@dataclass
class Legit:
    """What the legitimate client saw: one latency per verified block GET, and anything that went wrong."""

    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def text(self) -> str:
        if not self.latencies:
            return "legit: none served"
        return (f"legit: {len(self.latencies)} GETs verified, {len(self.failures)} failed, latency p50 "
                f"{statistics.median(self.latencies) * 1000:.0f} ms, max {max(self.latencies) * 1000:.0f} ms")

    def done(self) -> int:
        return len(self.latencies) + len(self.failures)

    async def one_more(self, timeout: float = 30.0) -> None:
        """Until the legitimate client has finished one more GET than now (it runs in its own thread)."""
        seen = self.done()
        async with asyncio.timeout(timeout):
            while self.done() == seen:
                await asyncio.sleep(0.005)

    def check(self, max_latency: float, at_least: int = 3) -> None:
        assert not self.failures, self.failures[:5]
        assert len(self.latencies) >= at_least, self.text()
        assert max(self.latencies) < max_latency, self.text()


def client_files(ready: dict[str, Any]) -> TlsFiles:
    return TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))


def port_of(ready: dict[str, Any]) -> int:
    return int(ready["base_uri"].rstrip("/").rsplit(":", 1)[1])


async def verified_get(client: KvspClient, ready: dict[str, Any], i: int) -> str | None:
    """GET block *i* and verify it; None when it is right, else what was wrong."""
    key, body = block(i)
    response = await client.request("GET", block_url(ready["base_uri"], key))
    data = await response.aread()
    if response.status != 200:
        return f"block {i}: status {response.status}"
    digest = parse_repr_digest(response.headers.get("repr-digest"))
    if digest != hashlib.sha256(data).digest():
        return f"block {i}: Repr-Digest does not match the octets"
    if data != body:
        return f"block {i}: other octets than uploaded"
    return None


async def legit_gets(ready: dict[str, Any], stop: threading.Event, legit: Legit, *, prefer: str = "tcp",
                     pause: float = 0.2) -> None:
    """Fetch and verify the blocks in turn until *stop*; one client, fallback off (an HTTP/3 client stays HTTP/3)."""
    async with KvspClient(client_files(ready), timeout=30, prefer=prefer, fallback=False) as client:
        i = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                problem = await verified_get(client, ready, i % BLOCKS)
            except Exception as exc:
                problem = f"block {i % BLOCKS}: {exc!r}"
            if problem is None:
                legit.latencies.append(time.monotonic() - started)
            else:
                legit.failures.append(problem)
            i += 1
            await asyncio.sleep(pause)


async def upload_blocks(ready: dict[str, Any]) -> None:
    async with KvspClient(client_files(ready), timeout=30, prefer="tcp") as client:
        for i in range(BLOCKS):
            key, body = block(i)
            r = await client.request("PUT", block_url(ready["base_uri"], key), content=body,
                                     headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            assert r.status == 201, await r.aread()


def start_holder(tmp_path: Path, procs: list[Process], config: str = "", *extra: str) -> Process:
    """A one-process holder on a free port with the dev CA of tmp_path/dev (and *config*'s TOML, if any)."""
    args = ["holder", "--dev", str(tmp_path / "dev"), "--workers", "1", *extra]
    if config:
        path = tmp_path / "holder.toml"
        path.write_text(config)
        args += ["--config", str(path)]
    holder = Process(*args)
    procs.append(holder)
    return holder


def report(name: str, **figures: object) -> None:
    print(f"\nRESOURCE {name}: " + "; ".join(f"{k} {v}" for k, v in figures.items()), flush=True)


@contextlib.asynccontextmanager
async def legit_during(ready: dict[str, Any], legit: Legit, **kwargs: Any) -> AsyncIterator[None]:
    """:func:`legit_gets` in a thread with its own event loop while the body runs: the attack's client work in
    the test's loop does not stall it (they share the GIL only)."""
    stop = threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(legit_gets(ready, stop, legit, **kwargs)), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 60)


def issue_client(ready: dict[str, Any], name: str) -> TlsFiles:
    """Another client certificate of the holder's dev CA (every certificate of it has every right there)."""
    dev = Path(ready["ca"]).parent
    pki.init(dev, [pki.client(name)])
    return TlsFiles.in_dir(dev, name)
