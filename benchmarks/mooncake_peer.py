"""The Mooncake Store side of ``benchmarks.bench_vs_mooncake``: run by the Mooncake venv's Python, stdlib only.

    .venv-mooncake/bin/python -m benchmarks.mooncake_peer segment --master 127.0.0.1:P --metadata URL --size N
    .venv-mooncake/bin/python -m benchmarks.mooncake_peer client --master 127.0.0.1:P --metadata URL --buffer N

``segment``: a ``MooncakeDistributedStore`` that provides a global segment of N octets (where objects live),
protocol "tcp"; it prints ``{"ready": "segment"}`` and serves until standard input closes.

``client``: the put/get client (``global_segment_size=0``) with one registered buffer of N octets; it prints
``{"ready": "client"}`` and then answers one JSON line per JSON command line on standard input:

* ``{"cmd": "load", "name": S, "path": F}``: copy file F into the buffer's source area S (the block's octets);
* ``{"cmd": "seed", "name": S, "keys": [K, ...]}``: ``put_from`` S under every key (for the GETs);
* ``{"cmd": "get", "name": S, "keys": [K, ...], "rounds": R}``: R rounds of ``get_into`` of every key at once
  (one thread per key, each into its own destination slot), then a comparison of every slot with S;
* ``{"cmd": "get", ..., "batch": true}``: the same with one ``batch_get_into`` of every key per round
  (Mooncake's own way to have several transfers in flight; threads calling ``get_into`` are slower);
* ``{"cmd": "put", "name": S, "conc": C, "rounds": R, "prefix": P}``: R rounds of C concurrent ``put_from`` of S
  under fresh keys, removed after each round (not timed), so the segment's space is reused as in steady state;
* ``{"cmd": "quit"}``.

A timed command answers ``{"ok": true, "rounds": [seconds, ...], "ops": [seconds, ...], "cpu": seconds}`` (wall
time of each round, of each operation, and the process's CPU time over the command); an error answers
``{"ok": false, "error": ...}``. Loops are bounded by the command; the process ends when its standard input
closes. ``MOONCAKE_STORE_CHECKSUM=1`` in the environment of both processes turns Mooncake's checksums on.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import mmap
import sys
import threading
import time
from typing import Any

SLOT_ALIGN = 1 << 12


def _store(args: argparse.Namespace, segment: int, buffer: int) -> Any:
    store_module = importlib.import_module("mooncake.store")  # only in the Mooncake venv
    store = store_module.MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", args.metadata, segment, buffer, "tcp", "", args.master)
    if rc != 0:
        raise SystemExit(f"MooncakeDistributedStore.setup failed: {rc}")
    return store


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve_segment(args: argparse.Namespace) -> None:
    store = _store(args, args.size, 16 << 20)
    _say({"ready": "segment"})
    sys.stdin.read()  # until the driver closes our standard input (or dies)
    store.close()


class Client:
    def __init__(self, store: Any, size: int) -> None:
        self.store = store
        self.mem = mmap.mmap(-1, size)
        self.view = memoryview(self.mem)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        rc = store.register_buffer(self.base, size)
        if rc != 0:
            raise SystemExit(f"register_buffer failed: {rc}")
        self.free = 0
        self.sources: dict[str, tuple[int, int]] = {}  # name -> (offset, length)
        self.slots: list[tuple[int, int]] = []  # destination areas: (offset, length)

    def _alloc(self, n: int) -> int:
        off = self.free
        self.free = (off + n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
        if self.free > len(self.mem):
            raise ValueError(f"the registered buffer ({len(self.mem)} octets) is too small")
        return off

    def load(self, name: str, path: str) -> dict[str, Any]:
        with open(path, "rb") as f:
            data = f.read()
        off = self._alloc(len(data))
        self.view[off:off + len(data)] = data
        self.sources[name] = (off, len(data))
        return {"ok": True, "octets": len(data)}

    def _slot(self, i: int, n: int) -> int:
        while len(self.slots) <= i:
            self.slots.append((-1, 0))
        off, length = self.slots[i]
        if length < n:
            off = self._alloc(n)
            self.slots[i] = (off, n)
        return off

    def seed(self, name: str, keys: list[str]) -> dict[str, Any]:
        off, n = self.sources[name]
        for key in keys:
            self.store.remove(key, True)  # a leftover of an earlier command
            rc = self.store.put_from(key, self.base + off, n)
            if rc != 0:
                return {"ok": False, "error": f"put_from {key}: {rc}"}
        return {"ok": True}

    def _rounds(self, rounds: int, calls: list[Any], after_round: Any = None) -> dict[str, Any]:
        """*rounds* rounds of every call in *calls* at once (threads when more than one); each returns an rc.
        *after_round* runs after each round, untimed."""
        ops: list[float] = []
        times: list[float] = []
        errors: list[str] = []
        cpu0 = time.process_time()

        def one(call: Any) -> None:
            t = time.perf_counter()
            rc = call()
            ops.append(time.perf_counter() - t)
            if rc != 0:
                errors.append(str(rc))

        for _ in range(rounds):
            t0 = time.perf_counter()
            if len(calls) == 1:
                one(calls[0])
            else:
                threads = [threading.Thread(target=one, args=(c,)) for c in calls]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
            times.append(time.perf_counter() - t0)
            if after_round is not None:
                after_round()
            if errors:
                return {"ok": False, "error": "mooncake returned " + ", ".join(errors)}
        return {"ok": True, "rounds": times, "ops": ops, "cpu": time.process_time() - cpu0}

    def get(self, name: str, keys: list[str], rounds: int, batch: bool) -> dict[str, Any]:
        src, n = self.sources[name]
        offs = [self._slot(i, n) for i in range(len(keys))]

        def call(key: str, off: int) -> Any:
            def run() -> int:
                got = self.store.get_into(key, self.base + off, n)
                return 0 if got == n else got  # get_into answers the octets read (or a negative error)
            return run

        def batched() -> int:
            got = self.store.batch_get_into(keys, [self.base + o for o in offs], [n] * len(keys))
            return 0 if all(g == n for g in got) else min(got)

        calls = [batched] if batch else [call(k, o) for k, o in zip(keys, offs, strict=True)]
        out = self._rounds(rounds, calls)
        if out["ok"]:
            for off in offs:
                if self.view[off:off + n] != self.view[src:src + n]:
                    return {"ok": False, "error": "get_into returned other octets than were put"}
        return out

    def put(self, name: str, conc: int, rounds: int, prefix: str) -> dict[str, Any]:
        off, n = self.sources[name]
        counter = iter(range(1 << 40))
        lock = threading.Lock()
        used: list[str] = []

        def run() -> int:
            with lock:
                key = f"{prefix}-{next(counter)}"
                used.append(key)
            return int(self.store.put_from(key, self.base + off, n))

        def drop() -> None:  # steady state: the segment's space is freed and reused, as under eviction
            for key in used:
                self.store.remove(key, True)
            used.clear()

        return self._rounds(rounds, [run] * conc, after_round=drop)


def serve_client(args: argparse.Namespace) -> None:
    store = _store(args, 0, 16 << 20)
    client = Client(store, args.buffer)
    _say({"ready": "client"})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "load":
                out = client.load(cmd["name"], cmd["path"])
            elif cmd["cmd"] == "seed":
                out = client.seed(cmd["name"], cmd["keys"])
            elif cmd["cmd"] == "get":
                out = client.get(cmd["name"], cmd["keys"], int(cmd["rounds"]), bool(cmd.get("batch")))
            elif cmd["cmd"] == "put":
                out = client.put(cmd["name"], int(cmd["conc"]), int(cmd["rounds"]), cmd["prefix"])
            else:
                out = {"ok": False, "error": f"unknown command {cmd['cmd']!r}"}
        except Exception as exc:  # reported to the driver, which decides
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        _say(out)
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["segment", "client"])
    parser.add_argument("--master", required=True, help="the master's HOST:PORT")
    parser.add_argument("--metadata", required=True, help="http://HOST:PORT/metadata of the master")
    parser.add_argument("--size", type=int, default=1 << 30, help="segment: octets of the global segment")
    parser.add_argument("--buffer", type=int, default=256 << 20, help="client: octets of the registered buffer")
    args = parser.parse_args()
    if args.role == "segment":
        serve_segment(args)
    else:
        serve_client(args)


if __name__ == "__main__":
    main()
