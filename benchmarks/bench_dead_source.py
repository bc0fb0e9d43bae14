"""Time to first token when the best source of a prompt's blocks dies mid-load (issue 12, point 5), against the
fault-free TTFT of the same prompts in the same run -- every server a ``kvsp-quic`` process of its own.

    python -m benchmarks.bench_dead_source [--reps 5] [--tokens 1536] [--block-tokens 256] [--kill-after 0.2] [--json]

Processes (``--dev``, one directory, 127.0.0.1): ``kvsp-quic index``; holders ``H1`` and ``H2`` and a relay ``R``
(``--workers 1``: one process each, so SIGKILL kills all of it); instances ``A`` (computes each prompt, the
producer), ``CLEAN`` (loads it without a fault) and ``FAULT`` (loads it while its best source is killed) of the
reference model of benchmarks/bench_prefill.py (``--device cpu``, MOQT first as by default).

Each repetition takes a new prompt: ``A`` computes it; its blocks are copied to ``H1``, fetched through the relay
over MOQT (so ``R`` caches them and publishes its ``moqt://`` records), then copied to ``H2``. Then, per case:

* ``holder``: the session at ``CLEAN``, then at ``FAULT``, lists the blocks at ``H1`` and ``H2``; the best source
  (``H1``'s ``moqt://`` replica, the instance's order) is killed with SIGKILL *--kill-after* of the fault-free
  TTFT after the session was started at ``FAULT``, and a new one started afterwards (empty, on a new port);
* ``relay``: the same with the blocks listed at ``R`` and ``H2``: the relay's ``moqt://`` replica is the best.

TTFT is measured by this client from ``POST sessions/{id}/start`` to the first token line. Every run's first token
is checked against ``A``'s (greedy). The ratio is the median fault TTFT over the median fault-free TTFT of the
same case; the FAULT instance logs at INFO, and the retrieval failures it logged at the victim after the kill
tell whether the kill cut transfers (mid-load) or came after the blocks were in (then it cost nothing): the
median ratio of the reps it cut is shown apart. Goal (issue 12): at most 1.5x.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.bench_h3 import SETTINGS
from benchmarks.bench_prefill import model_config
from benchmarks.bench_ttft import GREEDY
from gpu.modelfiles import derive_descriptor, write_random_model
from http3.client import KvspClient
from kvsp_app.serve import read_scope_key
from kvsp_client.api import KvspApi, Miss
from kvsp_client.retrieval import BlockFetcher
from kvsp_dev.processes import RoleProcess, stop_all
from kvsp_moqt.source import MoqtSource, PreferMoqt
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.keys import BlockKeyer, scope_id
from kvsp_quic.records import LookupMatch, LookupRequest, PrefetchBlock
from kvsp_quic.roles.controller_records import SessionStart
from kvsp_quic.roles.status import endpoint
from kvsp_runtime.instance_blocks import restrict
from moqt.aio import MoqtPool
from quic.tls import TlsFiles


class Proc(RoleProcess):
    """A ``kvsp-quic`` process, its log (WARNING) on this process's stderr; with *log*, its INFO log goes to that
    file (the FAULT instance's: the retrieval failures it met show that the kill happened while it was loading from
    the victim)."""

    def __init__(self, name: str, *args: str, log: Path | None = None) -> None:
        if log is None:
            super().__init__(name, *args)
        else:
            super().__init__(name, *args, stderr=log, log_level="INFO")

    def failures_at(self, since: int, uris: tuple[str, ...]) -> tuple[int, int]:
        """(retrieval failures at *uris* logged after offset *since*, the log's size now)."""
        assert self.log is not None
        text = self.log.read_text(errors="replace")
        lines = [line for line in text[since:].splitlines() if "kvsp.retrieval" in line and "replica of" in line
                 and any(uri in line for uri in uris)]
        return len(lines), len(text)


async def ttft(api: KvspApi, inst: Proc, prompt: list[int], d: CompatDescriptor, scope: bytes,
               blocks: list[PrefetchBlock], on_start: Any = None) -> tuple[float, int, dict[str, Any]]:
    sid = uuid.uuid4()
    start = SessionStart(sid, 1, ScopeId(scope), CompatId(bytes(d.compat_id)), tuple(prompt), 1, GREEDY,
                         blocks=tuple(blocks))
    t0 = time.perf_counter()
    killer = asyncio.ensure_future(on_start(t0)) if on_start is not None else None
    await api.start_session(inst.base, start)
    token = -1
    async with api.tokens(inst.base, sid, 0) as lines:
        async for line in lines:
            token = line.token if line.token is not None else -1
            break
    elapsed = time.perf_counter() - t0
    if killer is not None:
        await killer
    return elapsed, token, await api.session_run(inst.base, sid)


async def lookup(api: KvspApi, index: str, d: CompatDescriptor, scope: bytes, keys: list[bytes]) -> list[LookupMatch]:
    found = await api.lookup(index, LookupRequest(ScopeId(scope), CompatId(bytes(d.compat_id)),
                                                  tuple(BlockKey(k) for k in keys)))
    return list(found.blocks)


async def listed_everywhere(api: KvspApi, index: str, d: CompatDescriptor, scope: bytes, keys: list[bytes],
                            holders: set[str]) -> None:
    for _ in range(1500):
        blocks = await lookup(api, index, d, scope, keys)
        if len(blocks) == len(keys) and all(holders <= {r.holder for r in m.replicas} for m in blocks):
            return
        await asyncio.sleep(0.02)
    raise RuntimeError(f"the blocks were not published at {sorted(holders)}")


async def copy_blocks(api: KvspApi, source: str, target: str, d: CompatDescriptor, scope: bytes,
                      keys: list[bytes]) -> None:
    for k in keys:
        body = await api.get_block(source, bytes(d.compat_id), scope, k)
        assert not isinstance(body, Miss), body
        await api.put_block(target, bytes(d.compat_id), scope, k, await body.aread())


def best_source(blocks: list[LookupMatch], sources: tuple[str, ...]) -> str:
    """The replica an instance tries first for the first block (restricted to *sources*, MOQT first)."""
    match = restrict(blocks[0], sources)
    assert match is not None
    return PreferMoqt()(match.replicas, (0, 0))[0].holder


async def bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    b = args.block_tokens
    model_dir = write_random_model(tmp / "model", model_config(args.layers, args.hidden), seed=0)
    d = derive_descriptor(model_dir, b)
    (tmp / "descriptor.json").write_text(json.dumps(d.to_json()))
    dev = tmp / "dev"
    index = Proc("index", "index", "--dev", str(dev))
    index.wait_ready()
    serve = ["--dev", str(dev), "--index", index.base, "--workers", "1"]
    holding = ["--replica-ttl-ms", "600000", "--descriptor", str(tmp / "descriptor.json")]
    servers = {"H1": Proc("H1", "holder", *serve, *holding), "H2": Proc("H2", "holder", *serve, *holding),
               "R": Proc("R", "relay", *serve)}
    pages = (args.reps + 2) * (args.tokens // b) * 2 + 8
    common = ["instance", "--dev", str(dev), "--device", "cpu", "--model", str(model_dir), "--block-tokens", str(b),
              "--index", index.base, "--device-pages", str(pages), "--warmup-tokens", str(2 * b), "--max-tokens", "4"]
    instances = {name: Proc(name, *common) for name in ("A", "CLEAN")}
    instances["FAULT"] = Proc("FAULT", *common, log=tmp / "fault.log")
    procs = [*servers.values(), *instances.values()]
    times: dict[str, dict[str, list[float]]] = {"holder": {"clean": [], "fault": []},
                                                "relay": {"clean": [], "fault": []}}
    sources_seen: dict[str, list[dict[str, int]]] = {"holder": [], "relay": []}
    felt_by: dict[str, list[int]] = {"holder": [], "relay": []}  # transfers from the victim that failed, per rep
    try:
        for p in procs:
            p.wait_ready()
        a = instances["A"]
        key = read_scope_key(Path(a.ready["scope_key"]))
        scope = scope_id(key)
        keyer = BlockKeyer(key, bytes(d.compat_id), b)
        ready = a.ready
        files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
        async with KvspClient(files, settings=SETTINGS, timeout=120) as client, MoqtPool(files) as pool:
            api = KvspApi(client)
            relay_fetch = BlockFetcher(client, index.base, descriptors=[d], sources=[MoqtSource(pool, [d])])
            rng = random.Random(5)
            for rep in range(args.reps + 1):
                warm = rep == 0
                for case in ("holder", "relay"):
                    n = 4 * b if warm else args.tokens
                    prompt = [rng.randrange(32000) for _ in range(n)]
                    keys = [bytes(k) for k in keyer.keys(prompt)][:(n - 1) // b]
                    reference = (await ttft(api, a, prompt, d, scope, []))[1]
                    await listed_everywhere(api, index.base, d, scope, keys, {a.base})
                    h1, h2, relay = servers["H1"], servers["H2"], servers["R"]
                    for p in (h1, h2, relay):
                        if not p.ready:
                            p.wait_ready()
                    await copy_blocks(api, a.base, h1.base, d, scope, keys)
                    await listed_everywhere(api, index.base, d, scope, keys, {h1.ready["moqt"]})
                    for m in await lookup(api, index.base, d, scope, keys):  # through the relay: it caches them
                        twin = next(r for r in m.replicas if r.holder == h1.ready["moqt"])
                        got = await relay_fetch.fetch_block(LookupMatch(m.block_key, (dataclasses.replace(
                            twin, holder=relay.ready["moqt"]),)))
                        assert got is not None, "the relay did not serve a block"
                    await listed_everywhere(api, index.base, d, scope, keys, {relay.ready["moqt"]})
                    await copy_blocks(api, a.base, h2.base, d, scope, keys)  # last: listed after the relay
                    await listed_everywhere(api, index.base, d, scope, keys, {h2.ready["moqt"]})
                    sources = (h1.base, h2.base) if case == "holder" else (relay.ready["moqt"], h2.base)
                    listed = [PrefetchBlock(BlockKey(k), sources) for k in keys]
                    blocks = await lookup(api, index.base, d, scope, keys)
                    best = best_source(blocks, sources)
                    victim = next(name for name, p in servers.items()
                                  if endpoint(p.base) == endpoint(best) or endpoint(p.ready["moqt"]) == endpoint(best))
                    assert victim == ("H1" if case == "holder" else "R"), (case, best)
                    clean_t, token, _info = await ttft(api, instances["CLEAN"], prompt, d, scope, listed)
                    assert token == reference, (case, "clean", token, reference)
                    delay = args.kill_after * clean_t

                    async def kill(t0: float, victim: str = victim, delay: float = delay) -> None:
                        await asyncio.sleep(max(0.0, delay - (time.perf_counter() - t0)))
                        servers[victim].proc.kill()

                    victim_uris = (servers[victim].base, servers[victim].ready["moqt"])
                    _, offset = instances["FAULT"].failures_at(0, victim_uris)
                    fault_t, token, info = await ttft(api, instances["FAULT"], prompt, d, scope, listed, kill)
                    assert token == reference, (case, "fault", token, reference)
                    await asyncio.sleep(0.2)  # the log lines are written
                    felt, _ = instances["FAULT"].failures_at(offset, victim_uris)
                    servers[victim].proc.wait(10)
                    # a new one, on a new port: the clients' pooled connections to the old port would wait out a
                    # stall timeout at a new process there (it drops packets of connections it does not know)
                    kind = "holder" if victim != "R" else "relay"
                    extra = holding if kind == "holder" else []
                    servers[victim] = Proc(victim, kind, *serve, *extra)
                    procs.append(servers[victim])  # ready when next used (below, or in the next case)
                    if warm:
                        continue
                    times[case]["clean"].append(clean_t)
                    times[case]["fault"].append(fault_t)
                    sources_seen[case].append(dict(info["block_sources"]))
                    felt_by[case].append(felt)
                    print(f"rep {rep} {case}: clean {clean_t * 1000:.0f} ms, {victim} killed at "
                          f"{delay * 1000:.0f} ms: {fault_t * 1000:.0f} ms ({fault_t / clean_t:.2f}x); "
                          f"blocks {info['block_sources']}, computed {info['computed_tokens']} tokens; "
                          f"{felt} transfers from {victim} failed",
                          file=sys.stderr)
    finally:
        stop_all(procs, 20)
        index.stop(20)
    out: dict[str, Any] = {"tokens": args.tokens, "block_tokens": b, "reps": args.reps,
                           "kill_after": args.kill_after, "cases": {}}
    for case, t in times.items():
        clean, fault = statistics.median(t["clean"]), statistics.median(t["fault"])
        cut = [f / c for f, c, n in zip(t["fault"], t["clean"], felt_by[case], strict=True) if n]
        out["cases"][case] = {"clean_s": clean, "fault_s": fault, "ratio": fault / clean,
                              "ratio_when_cut": statistics.median(cut) if cut else None,
                              "ratios": [f / c for f, c in zip(t["fault"], t["clean"], strict=True)],
                              "fault_sources": sources_seen[case], "failed_transfers": felt_by[case]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--kill-after", type=float, default=0.2,
                        help="when to kill the best source, as a fraction of the fault-free TTFT (default 0.2)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dead-") as tmp:
        result = asyncio.run(bench(args, Path(tmp)))
    if args.json:
        print(json.dumps(result))
        return
    print(f"TTFT with the best source killed (SIGKILL) mid-load, {args.tokens}-token prompt, blocks of "
          f"{args.block_tokens} tokens, reference model ({args.layers} layers, hidden {args.hidden}), "
          f"{os.cpu_count()} cores; medians of {args.reps}\n")
    print("| best source killed | TTFT without the fault | TTFT with it | ratio (goal <= 1.5x) | median ratio of the "
          "reps whose transfers the kill cut | per rep | transfers cut by the kill, per rep |")
    print("|---|---|---|---|---|---|---|")
    for case, c in result["cases"].items():
        what = "holder H1 (its moqt:// replica)" if case == "holder" else "relay R (its moqt:// replica)"
        when_cut = "-" if c["ratio_when_cut"] is None else f"{c['ratio_when_cut']:.2f}x"
        print(f"| {what} | {c['clean_s'] * 1000:.0f} ms | {c['fault_s'] * 1000:.0f} ms | {c['ratio']:.2f}x | "
              f"{when_cut} | "
              f"{', '.join(f'{r:.2f}x' for r in c['ratios'])} | {', '.join(map(str, c['failed_transfers']))} |")


if __name__ == "__main__":
    main()
