"""The Index Service over HTTP/3: publish rate, lookup latency and lookup throughput against a real
``kvsp-quic index --dev`` process, each next to the same operation in-process in the same run, and the index
process's CPU time per operation (user + system, from /proc: what the index spends, whatever else the machine
runs; the client shares the machine).

    python -m benchmarks.bench_index_h3 [--records 8192] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from http3.client import KvspClient
from kvsp_dev.processes import RoleProcess
from kvsp_quic.auth import Policy
from kvsp_quic.keys import holder_id
from kvsp_quic.records import LookupRequest, ReplicaRecord, ResidencyEntry
from kvsp_quic.roles.index import IndexService
from kvsp_quic.storage.memory_index import MemoryIndexStore
from quic.tls import TlsFiles

HOLDER = "https://h1.example/kvsp/"
COMPAT, SCOPE = hashlib.sha256(b"compat").digest(), hashlib.sha256(b"scope").digest()[:16]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process *pid* so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def record(i: int) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(32))
    return ReplicaRecord(hashlib.sha256(b"key%d" % i).digest(), COMPAT, SCOPE, HOLDER, 1, 16 << 20,  # type: ignore[arg-type]
                         hashlib.sha256(b"".join(digests)).digest(), (ResidencyEntry("host", (0, 31)),), 600_000,
                         digests)


async def run(records: int, reps: int) -> list[tuple[str, str, str, float, str]]:
    rows = []
    recs = [record(i) for i in range(records)]
    keys = [r.block_key for r in recs]
    with tempfile.TemporaryDirectory() as tmp:
        proc = RoleProcess("index", "index", "--dev", tmp, log_level="ERROR")
        try:
            ready = proc.wait_ready()
            base = ready["base_uri"]
            files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
            async with KvspClient(files, timeout=120) as client:
                hid = holder_id(HOLDER)
                bodies = [json.dumps(r.to_json()).encode() for r in recs]
                headers = {"content-type": "application/kvsp+json"}
                sem = asyncio.Semaphore(64)

                async def publish(i: int) -> None:
                    async with sem:
                        r = await client.request("PUT", f"{base}replicas/{hid}/{keys[i].hex()}", content=bodies[i],
                                                 headers=headers)
                        assert r.status in (200, 201), r.content

                c0, t0 = cpu_seconds(proc.pid), time.perf_counter()
                await asyncio.gather(*(publish(i) for i in range(records)))
                h3_rate = records / (time.perf_counter() - t0)
                publish_cpu = (cpu_seconds(proc.pid) - c0) / records

                service = IndexService(MemoryIndexStore(), clock=time.monotonic)
                principal = Policy.dev_ca().principal("urn:kvsp:client:bench")
                assert principal is not None
                t0 = time.perf_counter()
                for r in recs:
                    await service.publish(principal, hid, r.block_key, r)
                local_rate = records / (time.perf_counter() - t0)
                rows.append((f"publish {records} records (32 layer digests), 64 in flight", f"{h3_rate:,.0f}/s",
                             f"{local_rate:,.0f}/s in-process", h3_rate / local_rate, f"{publish_cpu * 1e6:,.0f} us"))

                for hits in (64, records):
                    lookup_keys = [*keys[:hits], hashlib.sha256(b"miss").digest(), *keys[hits + 1:records]]
                    lookup_keys = lookup_keys[:8192]
                    request = LookupRequest(SCOPE, COMPAT, tuple(lookup_keys))  # type: ignore[arg-type]
                    body = json.dumps(request.to_json()).encode()
                    h3_times, local_times, cpu_times = [], [], []
                    for _ in range(reps):
                        c0, t0 = cpu_seconds(proc.pid), time.perf_counter()
                        r = await client.request("POST", f"{base}lookup", content=body, headers=headers)
                        h3_times.append(time.perf_counter() - t0)
                        cpu_times.append(cpu_seconds(proc.pid) - c0)
                        assert r.status == 200 and r.json()["matched"] == min(hits, len(lookup_keys))
                        t0 = time.perf_counter()
                        await service.lookup(principal, request)
                        local_times.append(time.perf_counter() - t0)
                    h3, local = statistics.median(h3_times), statistics.median(local_times)
                    rows.append((f"lookup of {len(lookup_keys)} keys, {min(hits, len(lookup_keys))} matched "
                                 f"({len(r.content) / 1e6:.2f} MB answer)", f"{h3 * 1e3:.1f} ms",
                                 f"{local * 1e3:.1f} ms in-process", local / h3,
                                 f"{statistics.median(cpu_times) * 1e3:.1f} ms"))

                small = json.dumps(LookupRequest(SCOPE, COMPAT, tuple(keys[:64])).to_json()).encode()  # type: ignore[arg-type]
                n = 2000

                async def one() -> None:
                    async with sem:
                        answer = await client.request("POST", f"{base}lookup", content=small, headers=headers)
                        assert answer.status == 200

                r = await client.request("POST", f"{base}lookup", content=small, headers=headers)

                c0, t0 = cpu_seconds(proc.pid), time.perf_counter()
                await asyncio.gather(*(one() for _ in range(n)))
                h3_qps = n / (time.perf_counter() - t0)
                small_cpu = (cpu_seconds(proc.pid) - c0) / n
                small_request = LookupRequest(SCOPE, COMPAT, tuple(keys[:64]))  # type: ignore[arg-type]
                t0 = time.perf_counter()
                for _ in range(n):
                    await service.lookup(principal, small_request)
                local_qps = n / (time.perf_counter() - t0)
                rows.append((f"lookup throughput, 64 keys all matched ({len(r.content) / 1e3:.0f} KB answers), 64 in "
                             f"flight", f"{h3_qps:,.0f}/s", f"{local_qps:,.0f}/s in-process", h3_qps / local_qps,
                             f"{small_cpu * 1e6:,.0f} us"))
        finally:
            proc.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rows = asyncio.run(run(args.records, args.reps))
    print(f"{os.cpu_count()} CPUs; the index in its own process (kvsp-quic index --dev), memory store\n")
    print("| operation | over HTTP/3 | in-process (same run) | ratio | index process CPU per operation |")
    print("|---|---|---|---|---|")
    for name, ours, base, ratio, cpu in rows:
        print(f"| {name} | {ours} | {base} | {ratio:.2f} | {cpu} |")


if __name__ == "__main__":
    main()
