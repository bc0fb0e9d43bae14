"""Time to first token through the inference instance: an 8192-token prompt whose prefix is loaded over MOQT and
over HTTP/3, vs recomputed -- every server a ``kvsp-quic`` process of its own.

    python -m benchmarks.bench_ttft [--reps 3] [--tokens 8192] [--block-tokens 256] [--engine transformers]
                                    [--no-prefetch] [--json]

Processes (all ``--dev`` with one directory: mutual TLS with the dev CA, 127.0.0.1): ``kvsp-quic index``, and five
``kvsp-quic instance --device cpu`` of the reference model of benchmarks/bench_prefill.py (8 layers, hidden 512,
2 KV heads of 64, vocabulary 32000, bf16; blocks of 256 tokens are 1 MiB of K and V):

* ``A`` computes each prompt from scratch (the recompute baseline) and so holds, and publishes, its blocks
  (``https`` records and their ``moqt://`` twins);
* ``HTTP`` (``--no-moqt``), ``TCP`` (``--no-moqt --prefer-transport tcp``: the blocks over HTTP/1.1) and ``MOQT``
  start the same prompt with the lookup's blocks listed at ``A``
  (``POST sessions/{id}/start`` with ``"blocks"``, as the Placement Controller sends it): 31 blocks stream from
  ``A`` into the prefill (layer l computed once layer l of every block is in) and the last 256 tokens are computed;
* ``PRE`` gets a prefetch directive for the 31 blocks first (``POST prefetch``, leases at ``A``, polled until
  ``complete``), then the session, whose prefix is then resident (``--no-prefetch``: no ``PRE``, no such rows);
* a second session of the same prompt at ``HTTP`` finds the prefix resident;
* with ``--engine transformers`` (docs/inference.md, "Engines"), in the same run: ``transformers-A``
  (``--engine transformers``, without ``--index``: it cannot find ``A``'s blocks, so it computes the prompt from
  scratch), and ``transformers-HTTP`` (``--engine transformers --no-moqt``) starts it with the 31 blocks listed at
  ``A`` -- the blocks the reference engine computed, loaded over HTTP/3 into the transformers engine's prefill. Its
  first token is checked against ``transformers-A``'s.

TTFT is measured by this client from sending ``POST sessions/{id}/start`` to reading the first token line of
``GET sessions/{id}/tokens`` (the instance's own figure, from admission to the first sampled token, is in
``GET sessions/{id}``); medians of --reps prompts after a warm-up round with a short prompt. Every loaded run's
first token is checked to equal the recompute's (greedy), the block sources reported by the instance are
checked (MOQT for the MOQT instance -- some may come over its HTTP/3 fallback, shown in the row -- HTTP/3 for the
other), and every recompute row is checked to have loaded nothing and computed every token (``GET sessions/{id}``:
``loaded_blocks``, ``computed_tokens``).
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
from gpu.modelfiles import derive_descriptor, write_random_model
from http3.client import KvspClient
from kvsp_app.serve import read_scope_key
from kvsp_client.api import KvspApi
from kvsp_dev.processes import RoleProcess, stop_all
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.keys import BlockKeyer, scope_id
from kvsp_quic.records import LookupRequest, PrefetchBlock, PrefetchDirective, PrefetchState, Sampler
from kvsp_quic.roles.controller_records import SessionStart
from quic.tls import TlsFiles

GREEDY = Sampler("greedy", 0, 0, True)
IDLE_TIMEOUT = 900.0  # seconds (QUIC idle timeout and request timeout of the client and the instances)


async def first_token(api: KvspApi, inst: RoleProcess, prompt: list[int], d: dict[str, Any], scope: bytes,
                      blocks: list[PrefetchBlock]) -> tuple[float, int, dict[str, Any]]:
    """TTFT of a session with *prompt* at *inst* (seconds from POST start to the first token line)."""
    sid = uuid.uuid4()
    start = SessionStart(sid, 1, ScopeId(scope), CompatId(bytes.fromhex(d["compat_id"])), tuple(prompt), 1, GREEDY,
                         blocks=tuple(blocks))
    t0 = time.perf_counter()
    await api.start_session(inst.base, start)
    token = -1
    async with api.tokens(inst.base, sid, 0) as lines:
        async for line in lines:
            token = line.token if line.token is not None else -1
            break
    elapsed = time.perf_counter() - t0
    return elapsed, token, await api.session_run(inst.base, sid)


async def published(api: KvspApi, index: str, d: dict[str, Any], scope: bytes, keys: list[bytes],
                    holder: str) -> None:
    request = LookupRequest(ScopeId(scope), CompatId(bytes.fromhex(d["compat_id"])), tuple(BlockKey(k) for k in keys))
    for _ in range(1000):
        found = await api.lookup(index, request)
        moqt_twin = holder.replace("https://", "moqt://")
        if found.matched == len(keys) and all({holder, moqt_twin} <= {x.holder for x in m.replicas}
                                              for m in found.blocks):
            return
        await asyncio.sleep(0.02)
    raise RuntimeError("the producer's blocks were not published")


async def prefetch(api: KvspApi, inst: RoleProcess, d: dict[str, Any], scope: bytes, keys: list[bytes],
                   source: str) -> float:
    directive = uuid.uuid4()
    record = PrefetchDirective(directive, ScopeId(scope), CompatId(bytes.fromhex(d["compat_id"])),
                               tuple(PrefetchBlock(BlockKey(k), (source,)) for k in keys), 60_000, 30_000)
    t0 = time.perf_counter()
    state = await api.prefetch(inst.base, record)
    while True:
        state = await api.prefetch_status(inst.base, directive)
        if state.state is not PrefetchState.PENDING:
            break
        await asyncio.sleep(0.005)
    assert state.state is PrefetchState.COMPLETE, state
    return time.perf_counter() - t0


async def bench(args: argparse.Namespace, tmp: Path) -> list[tuple[str, float | None, float | None, str]]:
    b = args.block_tokens
    model_dir = write_random_model(tmp / "model", model_config(args.layers, args.hidden), seed=0)
    dev = tmp / "dev"
    config = tmp / "instance.toml"
    # idle_timeout: an 8192-token recompute on a busy CPU can outlast QUIC's 60 s idle timeout, with nothing sent
    # while the client's GET tokens waits for the first token
    config.write_text(f"[transport]\nstream_window = {SETTINGS.stream_window}\n"
                      f"connection_window = {SETTINGS.connection_window}\nidle_timeout = {IDLE_TIMEOUT}\n")
    blocks = args.tokens // b
    pages = (args.reps + 2) * blocks + 8
    index = RoleProcess("index", "index", "--dev", str(dev))
    index.wait_ready()
    alone = ["instance", "--dev", str(dev), "--device", "cpu", "--model", str(model_dir), "--block-tokens", str(b),
             "--device-pages", str(pages), "--warmup-tokens", str(2 * b), "--config", str(config), "--max-tokens", "16"]
    common = [*alone, "--index", index.base]
    procs = {"A": RoleProcess("A", *common), "HTTP": RoleProcess("HTTP", *common, "--no-moqt"),
             "TCP": RoleProcess("TCP", *common, "--no-moqt", "--prefer-transport", "tcp"),
             "MOQT": RoleProcess("MOQT", *common)}
    if args.prefetch:
        procs["PRE"] = RoleProcess("PRE", *common)
    others = [e for e in dict.fromkeys(args.engine or ()) if e != "reference"]
    for e in others:
        # no Index Service: an instance looks up every block of a start that lists none (kvsp_runtime/instance_runs.py,
        # block_inputs) and would load A's blocks (same Compatibility ID) instead of computing them
        procs[f"{e}-A"] = RoleProcess(f"{e}-A", *alone, "--engine", e)
        procs[f"{e}-HTTP"] = RoleProcess(f"{e}-HTTP", *common, "--engine", e, "--no-moqt")
    rows: list[tuple[str, float | None, float | None, str]] = []
    try:
        for p in procs.values():
            p.wait_ready()
        a = procs["A"]
        ready = a.ready
        d = ready["descriptor"] | {"compat_id": ready["compat_id"]}
        assert d["compat_id"] == derive_descriptor(model_dir, b).compat_id.hex()
        key = read_scope_key(Path(ready["scope_key"]))
        scope = scope_id(key)
        keyer = BlockKeyer(key, bytes.fromhex(d["compat_id"]), b)
        files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
        results: dict[str, list[float]] = {}
        inner: dict[str, list[float]] = {}
        notes: dict[str, str] = {}
        async with KvspClient(files, settings=dataclasses.replace(SETTINGS, idle_timeout=IDLE_TIMEOUT),
                              timeout=IDLE_TIMEOUT) as client:
            api = KvspApi(client)
            rng = random.Random(1)
            for rep in range(args.reps + 1):
                warm = rep == 0  # a short prompt first: connections, first requests
                n = 4 * b if warm else args.tokens
                prompt = [rng.randrange(32000) for _ in range(n)]
                keys = [bytes(k) for k in keyer.keys(prompt)]
                usable = keys[:(n - 1) // b]
                listed = [PrefetchBlock(BlockKey(k), (a.base,)) for k in usable]
                runs: dict[str, tuple[float, int, dict[str, Any]]] = {}
                runs["recompute"] = await first_token(api, a, prompt, d, scope, [])
                await published(api, index.base, d, scope, keys, a.base)
                runs["http"] = await first_token(api, procs["HTTP"], prompt, d, scope, listed)
                runs["tcp"] = await first_token(api, procs["TCP"], prompt, d, scope, listed)
                runs["moqt"] = await first_token(api, procs["MOQT"], prompt, d, scope, listed)
                load = None
                if args.prefetch:
                    load = await prefetch(api, procs["PRE"], d, scope, usable, a.base)
                    runs["prefetched"] = await first_token(api, procs["PRE"], prompt, d, scope, listed)
                runs["resident"] = await first_token(api, procs["HTTP"], prompt, d, scope, listed)
                for e in others:  # the other engine: its own recompute, then the reference engine's blocks loaded
                    assert procs[f"{e}-A"].ready["engine"] == e and procs[f"{e}-A"].ready["compat_id"] == d["compat_id"]
                    runs[f"{e}-recompute"] = await first_token(api, procs[f"{e}-A"], prompt, d, scope, [])
                    runs[f"{e}-http"] = await first_token(api, procs[f"{e}-HTTP"], prompt, d, scope, listed)
                reference = runs["recompute"][1]
                for label, (_t, token, info) in runs.items():
                    engine = next((e for e in others if label.startswith(f"{e}-")), None)
                    # bf16: each engine's greedy token, loaded or computed, is its own recompute's
                    assert token == (runs[f"{engine}-recompute"][1] if engine else reference), (label, token)
                    if label.endswith("recompute"):  # computed, every token: nothing found and loaded
                        assert info["loaded_blocks"] == 0 and info["computed_tokens"] == n, (label, info)
                    else:
                        assert info["loaded_blocks"] == len(usable) and info["computed_tokens"] == n - len(usable) * b
                sources = {label: info["block_sources"] for label, (_t, _tok, info) in runs.items()}
                assert set(sources["http"]) == {"HTTP/3"}, sources
                assert set(sources["tcp"]) == {"HTTP/1.1"}, sources
                # MOQT first, HTTP/3 the fallback (a FETCH that fails or times out, e.g. on a loaded machine): the
                # row's note shows the mix
                assert any(s.startswith("MOQT") for s in sources["moqt"]), sources
                assert all(s.startswith("MOQT") or s == "HTTP/3" for s in sources["moqt"]), sources
                if set(sources["moqt"]) - {s for s in sources["moqt"] if s.startswith("MOQT")}:
                    print(f"rep {rep}: the MOQT instance fell back to HTTP/3 for some blocks: {sources['moqt']}",
                          file=sys.stderr)
                assert {*sources.get("prefetched", {"resident": 1}), *sources["resident"]} == {"resident"}, sources
                assert all(set(sources[f"{e}-http"]) == {"HTTP/3"} for e in others), sources
                if warm:
                    continue
                for label, (t, _tok, info) in runs.items():
                    results.setdefault(label, []).append(t)
                    inner.setdefault(label, []).append(info["ttft_ms"] / 1000)
                    notes[label] = ", ".join(f"{v} {k}" for k, v in sorted(info["block_sources"].items()))
                if load is not None:
                    results.setdefault("load", []).append(load)
                print(f"rep {rep}: " + ", ".join(f"{k} {v[0]:.3f} s" for k, v in runs.items()) +
                      ("" if load is None else f", directive {load:.3f} s"), file=sys.stderr)
        med = {k: statistics.median(v) for k, v in results.items()}
        imed = {k: statistics.median(v) for k, v in inner.items()}
        base_t = med["recompute"]
        loaded = (args.tokens - 1) // b * b
        rows.append((f"recompute all {args.tokens} tokens (instance A, nothing cached)", med["recompute"],
                     imed["recompute"], "1.0x (baseline)"))
        for label, title in (("http", f"prefix loaded over HTTP/3 from instance A ({loaded} tokens), "
                                      f"{args.tokens - loaded} computed"),
                             ("tcp", "prefix loaded over HTTP/1.1 (the TCP path, --prefer-transport tcp), the rest "
                                     "computed"),
                             ("moqt", "prefix loaded over MOQT from instance A, the rest computed")):
            rows.append((title, med[label], imed[label], f"**{base_t / med[label]:.1f}x faster**; "
                                                          f"blocks: {notes[label]}"))
        if args.prefetch:
            rows.append((f"prefetch directive first ({loaded // b} blocks, MOQT first, leased at A): complete after",
                         med["load"], None, "polled GET prefetch/{id}"))
            rows.append(("  then the session (prefix resident)", med["prefetched"], imed["prefetched"],
                         f"{base_t / med['prefetched']:.1f}x faster"))
        rows.append(("prefix resident (a second session of the prompt)", med["resident"], imed["resident"],
                     f"{base_t / med['resident']:.1f}x faster"))
        for e in others:
            own = med[f"{e}-recompute"]
            rows.append((f"{e} engine: recompute all {args.tokens} tokens ({e}-A)", own, imed[f"{e}-recompute"],
                         f"1.0x ({e} baseline; {own / base_t:.2f}x the reference engine's time)"))
            ratio = own / med[f"{e}-http"]
            versus = f"**{ratio:.1f}x faster**" if ratio >= 1 else f"{1 / ratio:.1f}x slower"
            rows.append((f"{e} engine: prefix loaded over HTTP/3 from instance A (the reference engine's blocks), "
                         f"the rest computed", med[f"{e}-http"], imed[f"{e}-http"],
                         f"{versus} than its recompute; blocks: {notes[f'{e}-http']}"))
    finally:
        stop_all(procs.values(), 20)
        index.stop(20)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--engine", action="append", choices=("reference", "transformers"),
                        help="also measure this engine's instances (repeatable; the reference engine always runs)")
    parser.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                        help="leave out the prefetch-directive instance (PRE) and its rows")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of Markdown")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp:
        rows = asyncio.run(bench(args, Path(tmp)))
    if args.json:
        print(json.dumps([{"case": c, "ttft_s": t, "instance_ttft_s": i, "note": n} for c, t, i, n in rows]))
        return
    print(f"Time to first token, {args.tokens}-token prompt, reference model ({args.layers} layers, hidden "
          f"{args.hidden}, bf16), blocks of {args.block_tokens} tokens, {os.cpu_count()} cores, every server its own "
          f"process; medians of {args.reps}\n")
    print("| case | TTFT (client) | TTFT (instance) | |")
    print("|---|---|---|---|")
    for case, t, inner_t, note in rows:
        print(f"| {case} | {_seconds(t)} | {_seconds(inner_t)} | {note} |")


def _seconds(x: float | None) -> str:
    return "" if x is None else f"{x:.3f} s"


if __name__ == "__main__":
    main()
