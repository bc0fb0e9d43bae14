"""A 16 MiB block GET across a real MTU: HTTP/3 (our client) vs HTTP/1.1 (curl) from one holder, in the same run.

    python -m benchmarks.bench_path [--reps 3] [--mtu 1500,9000]

Per MTU, two network namespaces joined by a veth pair (tests/support/netns.py; root), a ``kvsp-quic holder --dev
--workers 1`` in one, the clients in the other (as on two hosts: every octet crosses the veth link). The holder
sizes its QUIC datagrams to the path (issue 28, point 4): 1452 octets at MTU 1500, 8952 at 9000. Each rep is one
HTTP/3 GET (our KvspClient, a fresh process: one warm-up GET on the connection, then the one timed) then one
HTTP/1.1 GET (curl, a fresh TLS connection), so both see the same machine load; the holder's CPU for the HTTP/3
rep is halved (two GETs and a handshake). Reported: medians of MB/s, CPU ms per MiB of the client and of the
holder (the holder's from /proc, the client's its own process time, curl's from its rusage), and the IP fragments
the holder's namespace made (FragCreates: 0 is the point).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_h3 import process_cpu
from kvsp_dev.processes import RoleProcess
from kvsp_quic import container as c
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.samples import example_descriptor, random_sections
from tests.support.netns import VethPair, veth_pair

ROOT = Path(__file__).resolve().parent.parent
SCOPE = "6d1c6481cd428737da312c089db3832a"
KEY = hashlib.sha256(b"bench path").hexdigest()
MIB = 1 << 20


def descriptor() -> CompatDescriptor:  # the example geometry, 128 tokens: 16 MiB of K and V per block
    return CompatDescriptor.from_json({**example_descriptor().to_json(), "block_tokens": 128})


# -- the HTTP/3 client, run in the client namespace --------------------------------------------------------------


async def h3_client(ready: dict[str, Any], d: CompatDescriptor, reps: int, put: bool) -> list[dict[str, float]]:
    from http3.client import KvspClient
    from quic.tls import TlsFiles

    files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
    url = f"{ready['base_uri']}blocks/{d.compat_id.hex()}/{SCOPE}/{KEY}"
    out = []
    async with KvspClient(files, timeout=120) as client:
        if put:
            body = c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, 3), first_layer=0,
                            token_count=d.block_tokens, descriptor=d).tobytes()
            stored = await client.request("PUT", url, content=body,
                                          headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            assert stored.status in (201, 412), stored.status
            return []
        for _ in range(reps + 1):  # the first warms the connection up (handshake, congestion window)
            t, cpu, n = time.perf_counter(), time.process_time(), 0
            async with client.stream("GET", url) as response:
                assert response.status == 200
                async for chunk in response.aiter_bytes():
                    n += len(chunk)
            out.append({"seconds": time.perf_counter() - t, "cpu": time.process_time() - cpu, "octets": n})
    return out[1:]


# -- the benchmark -------------------------------------------------------------------------------------------------


def run_h3(pair: VethPair, ready: dict[str, Any], reps: int, put: bool = False) -> list[dict[str, float]]:
    done = subprocess.run([*pair.exec(pair.b), sys.executable, "-m", "benchmarks.bench_path", "--client",
                           json.dumps(ready), "--reps", str(reps), *(["--put"] if put else [])],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def run_curl(pair: VethPair, ready: dict[str, Any], url: str) -> tuple[float, float, int]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([*pair.exec(pair.b), "curl", "-s", "--http1.1", "-o", "/dev/null", "--cacert",
                           ready["ca"], "--cert", ready["client_cert"], "--key", ready["client_key"], "-w",
                           "%{time_total} %{size_download}", url], capture_output=True, text=True, timeout=120,
                          check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds, size = done.stdout.split()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(seconds), cpu, int(size)


def measure(mtu: int, reps: int, work: Path) -> dict[str, Any]:
    d = descriptor()
    (work / f"d{mtu}.json").write_text(json.dumps(d.to_json()))
    with veth_pair(mtu) as pair:
        holder = RoleProcess("holder", "holder", "--dev", str(work / f"dev{mtu}"), "--listen", f"{pair.a_ip}:0",
                             "--workers", "1", "--descriptor", str(work / f"d{mtu}.json"), "--host-capacity",
                             "1GiB", stderr="pipe", launcher=pair.exec(pair.a))
        try:
            ready = holder.wait_ready(60)
            url = f"{ready['base_uri']}blocks/{d.compat_id.hex()}/{SCOPE}/{KEY}"
            run_h3(pair, ready, 0, put=True)
            frags = pair.ip_counters(pair.a)["FragCreates"]
            h3, h1 = [], []
            for _ in range(reps):
                server = process_cpu(holder.pid)
                gets = run_h3(pair, ready, 1)
                server = process_cpu(holder.pid) - server  # one handshake and a warm-up GET included: halved
                g = gets[0]
                h3.append((g["octets"] / g["seconds"] / 1e6, g["cpu"] * 1e3 / (g["octets"] / MIB),
                           server / 2 * 1e3 / (g["octets"] / MIB)))
                server = process_cpu(holder.pid)
                seconds, cpu, size = run_curl(pair, ready, url)
                server = process_cpu(holder.pid) - server
                h1.append((size / seconds / 1e6, cpu * 1e3 / (size / MIB), server * 1e3 / (size / MIB)))
            frags = pair.ip_counters(pair.a)["FragCreates"] - frags
        finally:
            holder.stop()
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    return {"mtu": mtu, "datagram": mtu - 48, "h3": [med(h3, i) for i in range(3)],
            "h1": [med(h1, i) for i in range(3)], "fragments": frags}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mtu", default="1500,9000")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # the HTTP/3 client, in its namespace: a ready line
    parser.add_argument("--put", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(h3_client(json.loads(args.client), descriptor(), args.reps, args.put))))
        return
    print("| MTU (datagram) | HTTP/3 MB/s | HTTP/1.1 (curl) MB/s | ratio | HTTP/3 CPU ms/MiB client + holder "
          "| HTTP/1.1 CPU ms/MiB client + holder | FragCreates |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for mtu in (int(x) for x in args.mtu.split(",")):
            r = measure(mtu, args.reps, Path(tmp))
            h3, h1 = r["h3"], r["h1"]
            print(f"| {mtu} ({r['datagram']}) | {h3[0]:.0f} | {h1[0]:.0f} | {h3[0] / h1[0]:.2f} | "
                  f"{h3[1]:.1f} + {h3[2]:.1f} | {h1[1]:.1f} + {h1[2]:.1f} | {r['fragments']} |", flush=True)


if __name__ == "__main__":
    main()
