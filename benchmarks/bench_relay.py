"""FETCH of a KVSP block through our MOQT relay vs directly from our publisher vs a raw tuned aioquic stream vs
through aiomoqt's relay, all in the same run; then fan-out of one block to 8 concurrent subscribers.

    python -m benchmarks.bench_relay [--reps 5] [--layers 32] [--layer-kib 512] [--drafts 14,18] [--fanout 8]
        [--datagram 1452,8952,16384]

Processes (2 cores here, so they share them): the publisher (a Holder's tracks served by HolderTracks: on its own
UDP port for direct FETCHes, and on client sessions to each relay, where it PUBLISH_NAMESPACEs its namespace), our
relay (the real ``kvsp-quic relay`` with a config file: the same tuning as bench_h3 and bench_moqt, 2 GiB of
cache), aiomoqt's relay (``python -m aiomoqt.tools.moq_interop_relay --quic`` in .venv-aiomoqt; its rows are left
out, saying why, when that environment does not exist), the raw baseline server of bench_h3, and this process,
the subscriber(s): ``moqt.aio.connect_moqt`` + ``kvsp_moqt.holder_tracks.fetch_layers``, every layer's SHA-256 checked
against the Replica Record as it arrives (the raw baseline checks nothing).

Rows (medians of ``--reps``, subjects alternating):

* raw aioquic stream: bench_h3's raw server, one stream of the block's size on a new connection per transfer;
* direct: FETCH from the publisher, established session;
* our relay, first FETCH: a block the relay has never seen (it goes upstream; the subscriber gets each layer as
  the relay receives it);
* our relay, cached: the same block again;
* aiomoqt relay: the same FETCH through it (it goes upstream each time and forwards once all is in, FACTS.md);
* fan-out: ``--fanout`` subscribers (one session each) FETCH one new block at once; wall time until all have all
  layers, aggregate MB/s, each subscriber's time to its first layer, and how many upstream FETCHes the relay made
  (from its ``GET status``).

Time to first layer: from sending the FETCH to the first complete, verified layer (raw: the first layer's
octets).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_h3 import DATAGRAM, SETTINGS, add_datagram_argument, per_datagram, start_server
from benchmarks.bench_moqt import block, descriptor, raw_fetch
from http3.client import KvspClient
from kvsp_dev.processes import RoleProcess
from kvsp_moqt.holder_tracks import HolderTracks, fetch_layers
from kvsp_moqt.tracks import moqt_record, track_namespace
from kvsp_quic.auth import Policy
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.roles.holder import Holder, HolderSettings
from moqt.aio import MoqtConnection, connect_moqt, moqt_handlers
from quic.listener import QuicListener
from quic.tls import TlsFiles

ROOT = Path(__file__).resolve().parent.parent
AIOMOQT = Path(os.environ.get("KVSP_AIOMOQT_PYTHON", ROOT / ".venv-aiomoqt" / "bin" / "python"))
PUBLISHER = "https://127.0.0.1/"  # the "server" certificate of tests.pki: the publisher's identity and base URI
RELAY = "https://127.0.0.1/relay/"
AIORELAY = "https://127.0.0.1/aiomoqt-relay/"
ALICE = "urn:kvsp:client:alice"
SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
ALPN = {14: "moq-00", 18: "moqt-18"}


def key(n: int) -> bytes:
    return hashlib.sha256(b"bench relay block %d" % n).digest()


# -- the publisher process --------------------------------------------------------------------------------------


async def publisher(cert_dir: str, layers: int, layer_kib: int, blocks: int, relays: list[str]) -> None:
    d = descriptor(layers, layer_kib)
    holder = Holder(HolderSettings(PUBLISHER, (d,), host_capacity=4 << 30))
    readers = [{"identity": i, "roles": ["holder"], "scopes": [SCOPE.hex()]} for i in (RELAY, AIORELAY)]
    policy = Policy.from_dict({"principal": [{"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
                                             *readers]})
    writer = policy.principal(ALICE)
    assert writer is not None
    records = [holder.store(writer, d.compat_id, SCOPE, key(n), block(d), "*").to_json() for n in range(blocks)]
    tracks = HolderTracks(holder, policy)
    files = TlsFiles.in_dir(cert_dir, "server")
    listener = QuicListener(files, moqt_handlers(tracks), settings=SETTINGS)
    await listener.start("127.0.0.1", 0)
    namespace = track_namespace(d.compat_id, SCOPE, PUBLISHER, 1)
    sessions = []
    for uri in relays:  # publish the namespace to every relay, one session per draft
        host, port = uri.removeprefix("moqt://").strip("/").rsplit(":", 1)
        for alpn in ALPN.values():
            conn = await connect_moqt(host, int(port), files, settings=SETTINGS, alpn=alpn, app=tracks, timeout=20)
            await conn.publish_namespace(namespace)
            sessions.append(conn)
    print(json.dumps({"port": listener.port, "records": records}), flush=True)
    await asyncio.Event().wait()


# -- the relays -------------------------------------------------------------------------------------------------


def start_our_relay(cert_dir: str, work: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    policy = work / "relay-policy.toml"
    policy.write_text(f'''
[[principal]]
identity = "{PUBLISHER}"
roles = ["holder"]
scopes = "*"

[[principal]]
identity = "{ALICE}"
roles = ["instance"]
scopes = ["{SCOPE.hex()}"]
''')
    config = work / "relay.toml"
    config.write_text(f'''
[server]
listen = "127.0.0.1:0"
base_uri = "{RELAY}"
policy = "{policy}"

[tls]
ca = "{cert_dir}/ca.pem"
cert = "{cert_dir}/relay.pem"
key = "{cert_dir}/relay.key"

[transport]
connection_window = {SETTINGS.connection_window}
max_datagram_size = {SETTINGS.max_datagram_size}
idle_timeout = {SETTINGS.idle_timeout}

[relay]
cache_bytes = {2 << 30}
open_prefixes = ["moq-test"]
''')
    relay = RoleProcess("relay", "relay", "--config", str(config))
    return relay.proc, relay.wait_ready()


async def ping_every(conns: list[MoqtConnection], seconds: float) -> None:
    while True:
        await asyncio.sleep(seconds)
        for conn in conns:
            if conn.closed is None:
                conn.quic.send_ping(0)
                conn.transport.transmit_soon()


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_aiomoqt_relay(cert_dir: str) -> tuple[subprocess.Popen[bytes] | None, int, str]:
    if not AIOMOQT.exists():
        return None, 0, f"aiomoqt is not installed ({AIOMOQT} missing: see interop/requirements-aiomoqt.txt)"
    port = free_udp_port()
    proc = subprocess.Popen([str(AIOMOQT), "-m", "aiomoqt.tools.moq_interop_relay", "--bind", "127.0.0.1",
                             "--port", str(port), "--cert", f"{cert_dir}/aiorelay.pem", "--key",
                             f"{cert_dir}/aiorelay.key", "--quic"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    files = TlsFiles.in_dir(cert_dir, "alice")
    for _ in range(100):
        try:
            conn = await connect_moqt("127.0.0.1", port, files, settings=SETTINGS, timeout=1)
            await conn.aclose()
            return proc, port, ""
        except ConnectionError:
            await asyncio.sleep(0.1)
    proc.terminate()
    return None, 0, "aiomoqt's relay did not start"


# -- the subscriber side ----------------------------------------------------------------------------------------


async def verified(conn: MoqtConnection, record: ReplicaRecord, d: Any) -> tuple[float, float]:
    start = time.perf_counter()
    first, count = 0.0, 0
    async for layer in fetch_layers(conn, record, descriptor=d, stall_timeout=30):
        count += 1
        if not first:
            first = time.perf_counter() - start
        assert layer.digest is not None
    assert count == d.layers
    return time.perf_counter() - start, first


async def fanout(conns: list[MoqtConnection], record: ReplicaRecord, d: Any) -> tuple[float, list[float], list[str]]:
    """(wall time, each complete subscriber's time to first layer, what went wrong for the others)."""
    start = time.perf_counter()
    results = await asyncio.gather(*(verified(c, record, d) for c in conns), return_exceptions=True)
    wall = time.perf_counter() - start
    firsts = [r[1] for r in results if not isinstance(r, BaseException)]
    failures = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    return wall, firsts, failures


async def upstream_fetches(client: KvspClient, base: str) -> int:
    status = (await client.request("GET", f"{base}status")).json()
    return int(status["metrics"].get("upstream_fetches", 0))


async def measure(cert_dir: str, work: Path, reps: int, layers: int, layer_kib: int, drafts: list[int],
                  fan: int) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float, float, str]],
                                     list[tuple[str, float, float]], str]:
    files = TlsFiles.in_dir(cert_dir, "alice")
    d = descriptor(layers, layer_kib)
    size = layers * layer_kib << 10
    relay_proc, relay_ready = start_our_relay(cert_dir, work)
    aio_proc, aio_port, aio_missing = await start_aiomoqt_relay(cert_dir)
    relays = [relay_ready["moqt"]] + ([f"moqt://127.0.0.1:{aio_port}/"] if aio_proc is not None else [])
    fan_reps = reps // 2 + 1
    blocks = (reps + 1) * len(drafts) + 2 * fan_reps + 1  # fresh blocks for "first" and the fan-outs; the last: direct
    pub = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_relay", "--publisher", cert_dir, str(layers),
                            str(layer_kib), str(blocks), *relays], stdout=subprocess.PIPE, text=True)
    raw_proc, raw_port = start_server("raw", cert_dir)
    procs: list[Any] = [pub, raw_proc, relay_proc] + ([aio_proc] if aio_proc is not None else [])
    rows: dict[str, list[tuple[float, float]]] = {}
    fan_rows: list[tuple[str, float, float, float, str]] = []
    aio_rows: list[tuple[str, float, float]] = []
    keep_alive: asyncio.Future[None] | None = None
    try:
        assert pub.stdout is not None
        ready = json.loads(pub.stdout.readline())
        originals = [ReplicaRecord.from_json(r) for r in ready["records"]]
        direct_uri = f"moqt://127.0.0.1:{ready['port']}/"
        ours = relay_ready["moqt"]
        host, port = "127.0.0.1", int(ours.rsplit(":", 1)[1].strip("/"))
        conns: dict[tuple[str, int], MoqtConnection] = {}
        for draft in drafts:
            conns[("direct", draft)] = await connect_moqt(host, ready["port"], files, settings=SETTINGS,
                                                          alpn=ALPN[draft])
            conns[("ours", draft)] = await connect_moqt(host, port, files, settings=SETTINGS, alpn=ALPN[draft])
            if aio_proc is not None:
                conns[("aiomoqt", draft)] = await connect_moqt(host, aio_port, files, settings=SETTINGS,
                                                               alpn=ALPN[draft])
        # aiomoqt's relay (picoquic) closes an idle session after its own idle timeout; at 1452-octet datagrams
        # the other rows take long enough for that, so every session is kept alive with PINGs
        keep_alive = asyncio.ensure_future(ping_every(list(conns.values()), 5.0))
        fresh = iter(range(len(originals) - 1))
        last_first: dict[int, ReplicaRecord] = {}

        def via(where: str, record: ReplicaRecord) -> ReplicaRecord:
            uri = {"direct": direct_uri, "ours": ours, "aiomoqt": f"moqt://127.0.0.1:{aio_port}/"}[where]
            return moqt_record(record, uri)

        async def first(draft: int) -> tuple[float, float]:
            record = originals[next(fresh)]
            last_first[draft] = record
            return await verified(conns[("ours", draft)], via("ours", record), d)

        async def cached(draft: int) -> tuple[float, float]:
            return await verified(conns[("ours", draft)], via("ours", last_first[draft]), d)

        subjects: dict[str, Callable[[], Awaitable[tuple[float, float]]]] = {
            "raw aioquic stream, tuned (baseline)": functools.partial(raw_fetch, raw_port, files, size,
                                                                      layer_kib << 10)}
        for draft in drafts:
            subjects[f"draft {draft}: direct from our publisher"] = functools.partial(
                verified, conns[("direct", draft)], via("direct", originals[-1]), d)
            subjects[f"draft {draft}: through our relay, first FETCH (goes upstream)"] = functools.partial(first, draft)
            subjects[f"draft {draft}: through our relay, cached"] = functools.partial(cached, draft)
            if aio_proc is not None:
                subjects[f"draft {draft}: through aiomoqt's relay"] = functools.partial(
                    verified, conns[("aiomoqt", draft)], via("aiomoqt", originals[-1]), d)
        for run in subjects.values():  # warm-up
            await run()
        for _ in range(reps):
            for label, run in subjects.items():
                rows.setdefault(label, []).append(await run())
        # fan-out: one new block to `fan` subscribers at once, each on its own session
        status = f"https://127.0.0.1:{port}/relay/"  # GET status on the relay's port (its base URI names none)
        async with KvspClient(files, settings=SETTINGS) as status_client:
            for where in ("ours", "aiomoqt"):
                if where == "aiomoqt" and aio_proc is None:
                    continue
                draft = drafts[-1]
                target = port if where == "ours" else aio_port
                subs = [await connect_moqt(host, target, files, settings=SETTINGS, alpn=ALPN[draft])
                        for _ in range(fan)]
                walls, firsts, ups, failed = [], [], [], []
                for _ in range(fan_reps):
                    record = originals[next(fresh)]
                    before = await upstream_fetches(status_client, status) if where == "ours" else 0
                    wall, fs, failures = await fanout(subs, via(where, record), d)
                    for failure in failures:
                        print(f"fan-out through {where}'s relay: a subscriber failed: {failure}", file=sys.stderr)
                    walls.append(wall)
                    firsts.extend(fs)
                    failed.extend(failures)
                    if where == "ours":
                        ups.append(await upstream_fetches(status_client, status) - before)
                for s in subs:
                    await s.aclose()
                wall = statistics.median(walls)
                label = (f"draft {draft}: {fan} subscribers, one new block, through "
                         f"{'our relay' if where == 'ours' else 'aiomoqt' + chr(39) + 's relay'}")
                upstream = (f"{statistics.median(ups):.0f} upstream FETCH" if ups else
                            f"{fan} upstream FETCHes (FACTS.md: no coalescing)")
                if failed:  # the aggregate rate counts complete subscribers only
                    upstream += f"; **{len(failed)} of {fan * fan_reps} fetches failed** ({failed[0]})"
                complete = fan * fan_reps - len(failed)
                fan_rows.append((label, wall, complete / fan_reps * size / 1e6 / wall,
                                 statistics.median(firsts) if firsts else float("nan"), upstream))
        for conn in conns.values():
            await conn.aclose()
        if aio_proc is not None:
            aio_rows = await aiomoqt_endpoints(cert_dir, {"aiomoqt's relay": f"moqt://127.0.0.1:{aio_port}/",
                                                          "our relay": ours}, reps, layers, layer_kib)
    finally:
        if keep_alive is not None:
            keep_alive.cancel()
        for p in procs:
            p.terminate()
            p.wait()
    mb = size / 1e6
    return ([(label, mb / statistics.median(t for t, _ in times), statistics.median(f for _, f in times))
             for label, times in rows.items()], fan_rows, aio_rows, aio_missing)


# -- aiomoqt's endpoints through both relays --------------------------------------------------------------------

PEER = ROOT / "interop" / "aiomoqt_peer.py"


async def aiomoqt_fetch(cert_dir: str, url: str, track: str, common: list[str]) -> tuple[float, float]:
    proc = await asyncio.create_subprocess_exec(
        str(AIOMOQT), str(PEER), "fetch", "--url", url, "--cert", f"{cert_dir}/alice.pem", "--key",
        f"{cert_dir}/alice.key", "--ca", f"{cert_dir}/ca.pem", *common, "--track", track, "--timeout", "60",
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out, _ = await proc.communicate()
    result = json.loads(out.splitlines()[0])["results"][0]
    assert "error" not in result and len(result["objects"]) > 0, result
    return result["seconds"], result["first_s"]


async def aiomoqt_endpoints(cert_dir: str, relays: dict[str, str], reps: int, layers: int,
                           layer_kib: int) -> list[tuple[str, float, float]]:
    """aiomoqt's publisher and FETCH client (picoquic) through each relay: the relays' own comparison, with no
    aioquic endpoint in the path (our relay then sends 1440-octet datagrams, picoquic's max_udp_payload_size)."""
    common = ["--draft", "14", "--namespace", json.dumps(["moq-test", "bench"]), "--objects", str(layers),
              "--size", str(layer_kib << 10)]
    publishers = []
    try:
        for url in relays.values():
            proc = await asyncio.create_subprocess_exec(
                str(AIOMOQT), str(PEER), "publish", "--url", url, "--cert", f"{cert_dir}/alice.pem", "--key",
                f"{cert_dir}/alice.key", "--ca", f"{cert_dir}/ca.pem", *common, "--track", "t", "--any-track",
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            publishers.append(proc)
            assert proc.stdout is not None
            json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        rows: dict[str, list[tuple[float, float]]] = {}
        for rep in range(reps + 1):
            for name, url in relays.items():
                track = f"t-{name}-{rep}"
                first = await aiomoqt_fetch(cert_dir, url, track, common)
                if rep:
                    rows.setdefault(f"aiomoqt publisher + client, through {name}, first FETCH", []).append(first)
                if name == "our relay":
                    cached = await aiomoqt_fetch(cert_dir, url, track, common)
                    if rep:
                        rows.setdefault(f"aiomoqt publisher + client, through {name}, cached", []).append(cached)
    finally:
        for proc in publishers:
            proc.terminate()
            await proc.wait()
    mb = layers * layer_kib * 1024 / 1e6
    return [(label, mb / statistics.median(t for t, _ in times), statistics.median(f for _, f in times))
            for label, times in rows.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--layer-kib", type=int, default=512)
    parser.add_argument("--drafts", default="14,18")
    parser.add_argument("--fanout", type=int, default=8)
    add_datagram_argument(parser)
    parser.add_argument("--publisher", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publisher:
        cert_dir, layers, layer_kib, blocks, *relays = args.publisher
        asyncio.run(publisher(cert_dir, int(layers), int(layer_kib), int(blocks), relays))
        return
    if per_datagram(args, "benchmarks.bench_relay"):
        return
    from tests.pki import make_pki

    drafts = [int(x) for x in args.drafts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        make_pki(Path(tmp), roles={"server": PUBLISHER, "relay": RELAY, "aiorelay": AIORELAY})
        rows, fan_rows, aio_rows, missing = asyncio.run(measure(tmp, Path(tmp), args.reps, args.layers, args.layer_kib,
                                                      drafts, args.fanout))
    base = rows[0][1]
    print(f"{os.cpu_count()} CPUs; one block of {args.layers} layers x {args.layer_kib} KiB "
          f"({args.layers * args.layer_kib >> 10} MiB) per FETCH, every layer verified; QUIC datagrams of {DATAGRAM} "
          f"octets on our endpoints (aiomoqt's choose their own); medians of {args.reps}\n")
    print("| path | datagram | MB/s | vs raw (same run) | time to first layer |")
    print("|---|---|---|---|---|")
    for label, mbs, first in rows:
        print(f"| {label} | {DATAGRAM} | {mbs:.0f} | {mbs / base:.2f} | {first * 1000:.1f} ms |")
    if missing:
        print(f"\n(aiomoqt rows left out: {missing})")
    if aio_rows:
        print("\n| aiomoqt's endpoints (draft 14), not verified | MB/s | vs raw (same run) | time to first object |")
        print("|---|---|---|---|")
        for label, mbs, first in aio_rows:
            print(f"| {label} | {mbs:.0f} | {mbs / base:.2f} | {first * 1000:.1f} ms |")
    print("\n| fan-out | wall time | aggregate MB/s | time to first layer (median) | upstream |")
    print("|---|---|---|---|---|")
    for label, wall, mbs, first, upstream in fan_rows:
        print(f"| {label} | {wall * 1000:.0f} ms | {mbs:.0f} | {first * 1000:.1f} ms | {upstream} |")


if __name__ == "__main__":
    main()
