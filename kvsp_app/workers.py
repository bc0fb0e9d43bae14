"""Worker processes of a server role (``--workers N``): started, watched, started again, stopped.

A role that serves on every core (the holder: ``kvsp_app.holder_workers``; the relay:
``kvsp_app.serve_relay.run_relay``) binds its port with ``SO_REUSEPORT`` in the process the command started (the
primary) and starts N-1 workers that bind the same port: the kernel hands each new TCP connection, and each QUIC
connection's datagrams (by address hash), to one of them. Workers are ``multiprocessing`` processes (spawned, so
they share nothing by accident) running ``target(spec, ready)``; each sets its *ready* event once it serves.

A worker that dies is started again, at most :data:`MAX_RESTARTS` times a minute. Note that a process joining or
leaving the port's group changes the kernel's hash for UDP: QUIC connections of other workers may then land on a
process that does not know them and fail (their clients reconnect); TCP connections are not affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvsp.workers")

MAX_RESTARTS = 5  # per worker per minute; beyond that the worker stays down (logged)


def worker_process(index: int, level: int) -> None:
    """What every worker does first: logging tagged with its number, SIGINT left to the primary (which stops its
    workers with SIGTERM)."""
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s %(name)s[worker {index}]: %(message)s")
    logging.getLogger("quic").setLevel(logging.ERROR)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Workers:
    """Workers 1..count-1 of a role: ``target(spec_for(i), ready_event)`` in their own processes."""

    def __init__(self, name: str, target: Callable[[Any, Any], None], spec_for: Callable[[int], Any],
                 count: int) -> None:
        self.name = name
        self.target = target
        self.spec_for = spec_for
        self.count = count
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: dict[int, Any] = {}
        self._ready: dict[int, Any] = {}
        self._restarts: dict[int, list[float]] = {}
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    def _spawn(self, index: int) -> None:
        ready = self._ctx.Event()
        proc = self._ctx.Process(target=self.target, args=(self.spec_for(index), ready),
                                 name=f"kvsp-{self.name}-worker-{index}")
        proc.start()
        self._procs[index] = proc
        self._ready[index] = ready

    async def start(self, timeout: float = 60.0) -> None:
        """Start the workers and wait until each serves (RuntimeError naming the first that did not)."""
        for index in range(1, self.count):
            self._spawn(index)
        deadline = time.monotonic() + timeout
        while not all(event.is_set() for event in self._ready.values()):
            for index, proc in self._procs.items():
                if not proc.is_alive():
                    raise RuntimeError(f"{self.name} worker {index} exited while starting (code {proc.exitcode}); "
                                       f"see its log above")
            if time.monotonic() > deadline:
                late = sum(not e.is_set() for e in self._ready.values())
                raise RuntimeError(f"{late} {self.name} worker(s) did not start within {timeout:.0f} s")
            await asyncio.sleep(0.05)
        self._watch = asyncio.create_task(self._watch_loop())

    async def _watch_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.5)
            for index, proc in list(self._procs.items()):
                if proc.is_alive() or self._stopping:
                    continue
                now = time.monotonic()
                recent = [t for t in self._restarts.get(index, []) if now - t < 60]
                if len(recent) >= MAX_RESTARTS:
                    del self._procs[index]
                    log.error("%s worker %d died %d times in a minute (code %s): left down", self.name, index,
                              len(recent), proc.exitcode)
                    continue
                log.warning("%s worker %d exited (code %s): starting it again", self.name, index, proc.exitcode)
                self._restarts[index] = [*recent, now]
                self._spawn(index)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values() if p.is_alive()]

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to every worker (they finish what is in flight), SIGKILL after *grace* seconds."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for proc in self._procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self._procs.values():
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                proc.kill()
            proc.join(1.0)
