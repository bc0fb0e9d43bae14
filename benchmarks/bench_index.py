"""Benchmarks of the Index Service, each against a baseline measured in the same run.

    python -m benchmarks.bench_index            # all, prints a Markdown table
    python -m benchmarks.bench_index --quick    # fewer repetitions, 200k records for the memory rows
    python -m benchmarks.bench_index --records 1000000 --no-redis

* lookup of 8192 keys in-process (memory store, every key a hit), against a plain ``dict.get`` loop over the
  same keys: the chain walk alone, then with the matches rebuilt as ReplicaRecords, then the role's whole
  lookup, then with the JSON body written from those records (``kvsp_http.index_app.lookup_body``), then that body
  written by the store without building records (``IndexService.lookup_json``, what the HTTP edge sends); the
  role lookup and the store's JSON again from a store without a recent table (what a first lookup of entries
  costs), and the role lookup with the collector's passes not deferred;
* publish rate in-process (the role's checks + the memory store), against plain dict inserts of the same records;
* memory of 1M records (RSS growth of a fresh process), with 32 layer digests and without, against the floor
  (the octets the records hold, packed) and against keeping the parsed ReplicaRecords in a dict;
* the Redis store against a real redis-server (started on a free port; skipped without one): lookup of 8192
  keys against a raw pipelined GET of 8192 keys holding values of the same size, and publish rate against
  sequential SETs with an expiry.

Runs alternate subject and baseline and report medians (the machine is noisy); the ratio is what counts.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from benchmarks.timing import acompare, compare
from kvsp_http.index_app import lookup_body
from kvsp_quic import keys as k
from kvsp_quic.auth import Policy
from kvsp_quic.compat import InstanceState
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.records import InstanceStatusRecord, Link, LookupRequest, ReplicaRecord, ResidencyEntry
from kvsp_quic.roles.index import Geometry, IndexConfig, IndexService
from kvsp_quic.storage import index_store
from kvsp_quic.storage.index_store import pack_body
from kvsp_quic.storage.memory_index import MemoryIndexStore

Row = tuple[str, str, str, float]
SCOPE = ScopeId(bytes(range(16)))
COMPAT = CompatId(bytes(range(32)))
HOLDER = "https://h1.example/kvsp/"  # also the instance of the targeted lookups, which fetches from OTHER
OTHER = "https://h2.example/kvsp/"
N_KEYS = 8192
POLICY = Policy.dev([HOLDER, OTHER])
PRINCIPAL = POLICY.principal(HOLDER)
RESIDENCY = (ResidencyEntry("device", (0, 15)), ResidencyEntry("host", (16, 31), 400_000))
RESIDENCY_FULL = (ResidencyEntry("device", (0, 31)),)
# One loop for the in-process rows: asyncio.run() formats the finished task with its result when it restores the
# SIGINT handler (Python 3.11), which for a lookup response of 8192 records costs more than the lookup.
LOOP = asyncio.new_event_loop()


def record(i: int, layer_digests: bool = True, seed: bytes = b"", holder: str = OTHER) -> ReplicaRecord:
    key = hashlib.sha256(seed + i.to_bytes(8, "big")).digest()
    if layer_digests:
        raw = os.urandom(32 * 32)
        digests = tuple(raw[j:j + 32] for j in range(0, 1024, 32))
        return ReplicaRecord(BlockKey(key), COMPAT, SCOPE, holder, 1, 2 << 20, hashlib.sha256(raw).digest(),
                             RESIDENCY, 600_000, digests)
    return ReplicaRecord(BlockKey(key), COMPAT, SCOPE, holder, 1, 2 << 20, hashlib.sha256(key).digest(),
                         RESIDENCY_FULL, 600_000)




def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


# -- in-process lookup and publish ----------------------------------------------------------------------------------


def bench_lookup(reps: int) -> list[Row]:
    return _bench_lookup(reps, True) + _bench_lookup(reps, False)


def _bench_lookup(reps: int, digests: bool) -> list[Row]:
    rows: list[Row] = []
    label = "32 layer digests" if digests else "no layer digests"
    store = MemoryIndexStore()
    records = [record(i, digests) for i in range(N_KEYS)]
    for r in records:
        store.put_sync(r, 0.0)
    keys = [r.block_key for r in records]
    plain = {r.block_key: r for r in records}
    service = IndexService(store, clock=lambda: 1.0,
                           config=IndexConfig(geometry=MappingProxyType({bytes(COMPAT): Geometry(16, 32)})))
    request = LookupRequest(SCOPE, COMPAT, tuple(keys), None)
    assert PRINCIPAL is not None
    principal = PRINCIPAL
    service.report_status(principal, k.instance_id(HOLDER), InstanceStatusRecord(
        HOLDER, 1, InstanceState.ACTIVE, 60_000, prefill_tokens_per_s=40_000, links=(Link(OTHER, 200_000, 10),)))
    targeted = LookupRequest(SCOPE, COMPAT, tuple(keys), (HOLDER,))

    def baseline() -> list[Any]:
        out = []
        get = plain.get
        for key in keys:
            v = get(key)
            if v is None:
                break
            out.append(v)
        return out

    def chain() -> None:
        assert len(store.chain(SCOPE, COMPAT, keys, 1.0)) == N_KEYS

    def materialized() -> None:
        assert len(store.materialize(store.chain(SCOPE, COMPAT, keys, 1.0), keys, SCOPE, COMPAT, 1.0)) == N_KEYS

    def role() -> None:
        assert LOOP.run_until_complete(service.lookup(principal, request)).matched == N_KEYS

    def with_targets() -> None:
        response = LOOP.run_until_complete(service.lookup(principal, targeted))
        assert response.targets and response.targets[0].fetch_us > 0

    def with_json() -> None:
        lookup_body(LOOP.run_until_complete(service.lookup(principal, request)))

    def rendered() -> None:
        matched, _ = LOOP.run_until_complete(service.lookup_json(principal, request))
        assert matched == N_KEYS

    # the same entries in a store without a recent table: every lookup decodes what the entries hold, as the first
    # lookup of entries does (MemoryIndexStore's docstring)
    cold_store = MemoryIndexStore(recent=0)
    for r in records:
        cold_store.put_sync(r, 0.0)
    cold = IndexService(cold_store, clock=lambda: 1.0, config=service.config)

    def role_cold() -> None:
        assert LOOP.run_until_complete(cold.lookup(principal, request)).matched == N_KEYS

    def rendered_cold() -> None:
        assert LOOP.run_until_complete(cold.lookup_json(principal, request))[0] == N_KEYS

    def role_collecting() -> None:  # the cyclic collector's passes not deferred (index_store.collections_deferred)
        index_store.DEFER_COLLECTIONS = False
        try:
            role()
        finally:
            index_store.DEFER_COLLECTIONS = True

    body = lookup_body(LOOP.run_until_complete(service.lookup(principal, request)))
    for name, fn, n in (("chain walk (no decoding)", chain, reps),
                        ("+ matches rebuilt as ReplicaRecords", materialized, max(3, reps // 4)),
                        ("role lookup (IndexService.lookup)", role, max(3, reps // 4)),
                        ("role lookup with one target (estimates)", with_targets, max(3, reps // 4)),
                        (f"role lookup + JSON body ({len(body) / 1e6:.1f} MB)", with_json, max(3, reps // 8)),
                        ("the JSON body straight from the store (IndexService.lookup_json: what the HTTP edge "
                         "sends)", rendered, max(3, reps // 4)),
                        ("role lookup, entries not looked up before (no recent table)", role_cold, max(3, reps // 4)),
                        ("role lookup, collector passes not deferred", role_collecting, max(3, reps // 4)),
                        ("the JSON body straight from the store, entries not looked up before (no recent table)",
                         rendered_cold, max(3, reps // 4))):
        ours, base = compare(fn, baseline, n)
        rows.append((f"lookup {N_KEYS} keys in-process, all hit, {label}: {name}", ms(ours),
                     f"{ms(base)} (dict.get loop)", base / ours))
    return rows


def bench_publish(reps: int, n: int = 20_000) -> list[Row]:
    records = [record(i, True, b"pub", holder=HOLDER) for i in range(n)]
    holder_id = k.holder_id(HOLDER)
    assert PRINCIPAL is not None
    principal = PRINCIPAL

    def ours() -> None:
        service = IndexService(MemoryIndexStore(), clock=lambda: 1.0, config=IndexConfig())

        async def run() -> None:
            for r in records:
                await service.publish(principal, holder_id, r.block_key, r)
        LOOP.run_until_complete(run())

    def baseline() -> None:
        d = {}
        for r in records:
            d[r.block_key] = r

    s, b = compare(ours, baseline, max(3, reps // 4))
    return [(f"publish in-process, {n} records with 32 layer digests", f"{n / s / 1e3:.0f} k/s",
             f"{n / b / 1e3:.0f} k/s (dict insert of the records)", b / s)]


# -- memory -----------------------------------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(kind: str, n: int, digests: bool) -> None:
    """Runs in a fresh process: RSS growth for *n* records kept by *kind* ("store" or "records")."""
    gc.collect()
    before = _rss()
    store = MemoryIndexStore()
    kept: dict[bytes, ReplicaRecord] = {}
    payload = 0
    for i in range(n):
        r = record(i, digests)
        payload += 32 + 8 + len(pack_body(r)) if i < 1000 else 0  # key, expiry, body; holder and scope are shared
        if kind == "store":
            store.put_sync(r, 0.0)
        else:
            kept[r.block_key] = r
    gc.collect()
    after = _rss()
    print(json.dumps({"rss": after - before, "payload_per_record": payload / min(n, 1000), "count": len(store)
                      if kind == "store" else len(kept)}))


def run_child(kind: str, n: int, digests: bool) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_index", "--memory-child", kind, str(n),
                          "1" if digests else "0"], check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(out.stdout)
    return result


def bench_memory(n: int) -> list[Row]:
    rows: list[Row] = []
    for digests in (True, False):
        label = "32 layer digests" if digests else "no layer digests"
        store = run_child("store", n, digests)
        naive = run_child("records", n, digests)
        floor = store["payload_per_record"] * n
        rows.append((f"memory, {n:,} records, {label} (RSS growth; GiB)", f"{store['rss'] / 2**30:.3f} GiB "
                     f"({store['rss'] / n:.0f} B/record)",
                     f"{floor / 2**30:.3f} GiB packed payload floor; {naive['rss'] / 2**30:.3f} GiB as a dict of "
                     f"ReplicaRecords", floor / store["rss"]))
    return rows


# -- Redis ---------------------------------------------------------------------------------------------------------


async def bench_redis_async(port: int, reps: int) -> list[Row]:
    from redis.asyncio import Redis

    from kvsp_quic.storage.redis_index import RedisIndexStore

    client = Redis(host="127.0.0.1", port=port)
    rows: list[Row] = []
    try:
        for digests in (True, False):
            label = "32 layer digests" if digests else "no layer digests"
            await client.flushall()
            store = RedisIndexStore(client, prefix="bench:")
            records = [record(i, digests, b"redis") for i in range(N_KEYS)]
            for r in records:
                await store.put(r, 0.0)
            keys = [r.block_key for r in records]
            sample = await client.hgetall(store.key(keys[0]))
            value = next(iter(sample.values()))
            raw_keys = [b"raw:" + key for key in keys]
            pipe = client.pipeline(transaction=False)
            for key in raw_keys:
                pipe.set(key, value)
            await pipe.execute()

            async def lookup(store: RedisIndexStore = store, keys: list[BlockKey] = keys) -> None:
                assert len(await store.lookup(SCOPE, COMPAT, keys, 0.0)) == N_KEYS

            async def pipelined_get(raw_keys: list[bytes] = raw_keys) -> None:
                pipe = client.pipeline(transaction=False)
                for key in raw_keys:
                    pipe.get(key)
                assert len(await pipe.execute()) == N_KEYS

            s, b = await acompare(lookup, pipelined_get, max(3, reps // 4))
            rows.append((f"Redis lookup {N_KEYS} keys, all hit, {label} ({len(value)} B values)", ms(s),
                         f"{ms(b)} (one pipelined GET of {N_KEYS} keys)", b / s))

        n = 2000
        records = [record(i, True, b"redis-pub") for i in range(n)]
        store = RedisIndexStore(client, prefix="benchpub:")

        async def publish() -> None:
            for r in records:
                await store.put(r, 0.0)

        async def set_px() -> None:
            for r in records:
                await client.set(b"rawpub:" + r.block_key, pack_body(r), px=600_000)

        s, b = await acompare(publish, set_px, max(3, reps // 8))
        rows.append((f"Redis publish, {n} sequential puts, 32 layer digests", f"{n / s / 1e3:.1f} k/s",
                     f"{n / b / 1e3:.1f} k/s (sequential SET PX)", b / s))
    finally:
        await client.aclose()
    return rows


def bench_redis(reps: int) -> list[Row]:
    try:
        import redis  # noqa: F401
    except ImportError:
        return [("Redis store", "skipped: the redis package is not installed (pip install -e '.[redis]')", "-", 0.0)]
    if shutil.which("redis-server") is None:
        return [("Redis store", "skipped: redis-server is not installed (apt-get install -y redis-server)", "-", 0.0)]
    from tests.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp, RedisServer.start(tmp) as server:
        return asyncio.run(bench_redis_async(server.port, reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--records", type=int, default=None, help="records for the memory rows (default 1M)")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-child", nargs=3, metavar=("KIND", "N", "DIGESTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        kind, n, digests = args.memory_child
        memory_child(kind, int(n), digests == "1")
        return
    reps = 5 if args.quick else 21
    records = args.records or (200_000 if args.quick else 1_000_000)
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}\n")
    print("| benchmark | ours | baseline (same run) | ratio ours/baseline speed (memory: floor/ours) |")
    print("|---|---|---|---|")
    benches: list[Callable[[], list[Row]]] = [lambda: bench_lookup(reps), lambda: bench_publish(reps)]
    if not args.no_memory:
        benches.append(lambda: bench_memory(records))
    if not args.no_redis:
        benches.append(lambda: bench_redis(reps))
    for bench in benches:
        for name, ours, base, ratio in bench():
            print(f"| {name} | {ours} | {base} | {ratio:.2f} |", flush=True)
    LOOP.close()


if __name__ == "__main__":
    main()
