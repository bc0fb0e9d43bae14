"""``kvsp-quic chaos``: a whole replicated cluster on this machine, a mixed workload, one fault after another.

It writes a tiny random-weights model and starts, as real processes on 127.0.0.1 with fresh dev certificates
(:mod:`kvsp_app.chaos_cluster`): a ``redis-server`` of its own (or, with ``redis_cluster``, a 3-node Redis
Cluster), two ``kvsp-quic index`` replicas on it (Index Service + Placement Controller), two holders (one with local
storage), a relay, three CPU inference instances and the front end, every role given both replicas. It runs the
workload -- concurrent streams through the front end that share a system prefix, half greedy and half seeded top-p
-- once without a fault (the reference tokens) and more (the warm TTFT baseline), then, for each round and each
fault, runs the same workload again and injects the fault:

=================  ==============================================================================================
instance-kill      SIGKILL of the instance serving the first stream, after ``fault_after`` of its tokens
instance-stop      SIGSTOP of that instance (SIGCONT once the workload has finished: it must stay fenced)
pc-kill            SIGKILL of the PC replica that receives the serving instance's checkpoints, mid-generation
is-kill            SIGKILL of each IS replica in turn (two runs), as the requests are sent (lookups in flight)
holder-kill        SIGKILL of holder-b while the instances load a prefix from it (its only source)
relay-kill         SIGKILL of the relay while the instances load a prefix from it (its only source)
holder-restart     the same for holder-a (local storage), restarted at once on the same port and storage
=================  ==============================================================================================

The source faults (the last three) run on a prefix of their own, placed at the victim only, and fire at the first
block the victim serves (:mod:`kvsp_app.chaos_sources`); their rows also report ``served`` and ``cut`` (the
transfers that failed at the instances), and a row that cut no load is not ok. Every killed process is restarted
on its port, and the cluster left alone for ``settle`` seconds, before the next fault. Each fault's row reports the
requests completed, the tokens lost, duplicated and altered against the reference (same prompts, same seeds), the
time from the fault to the first stream's recovery, the TTFT penalty against the warm baseline (a source fault's:
against its prefix's fault-free, computed run), and the prompt tokens the instances loaded (rather than computed)
during the run. Any incomplete request or lost, duplicated or altered token is a failure (``kvsp-quic chaos``
exits 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsp_app.chaos_cluster import ChaosCluster
from kvsp_app.chaos_sources import SOURCE_FAULTS, Seeded, Sources, kill_on_first_load, seed
from kvsp_app.demo import QUESTIONS, SYSTEM_PROMPT, _stream

FAULTS = ("instance-kill", "instance-stop", "pc-kill", "is-kill", "holder-kill", "relay-kill", "holder-restart")
MID_GENERATION = {"instance-kill", "instance-stop", "pc-kill"}


@dataclass
class ChaosOptions:
    faults: tuple[str, ...] = FAULTS
    rounds: int = 1
    workdir: Path | None = None
    keep: bool = False
    streams: int = 4  # concurrent streams per run: even ones greedy, odd ones seeded top-p
    prefix_tokens: int = 384  # the shared system prefix (bytes of the byte tokenizer)
    max_tokens: int = 96
    fault_after: int = 12  # tokens of the first stream before a mid-generation fault
    layers: int = 2
    hidden: int = 128
    timeout: float = 120.0  # per request
    settle: float = 2.0  # seconds the cluster is left alone after a restart: each fault meets a healthy cluster
    redis_cluster: bool = False  # the IS+PC replicas on a 3-node Redis Cluster instead of one redis-server
    source_prefix_tokens: int = 2048  # a source fault's own prefix (128 blocks of 16 tokens), loaded from the victim


@dataclass
class Row:
    fault: str
    target: str | None = None
    round: int = 1
    requests: int = 0
    completed: int = 0
    tokens_expected: int = 0
    tokens_delivered: int = 0
    tokens_lost: int = 0
    tokens_duplicated: int = 0
    tokens_altered: int = 0
    recover_ms: float | None = None
    ttft_ms: float | None = None
    ttft_penalty_ms: float | None = None
    epochs_seen: list[int] = field(default_factory=list)
    fetched_tokens: float | None = None  # prompt tokens the instances loaded instead of computing, during the run
    served: float | None = None  # source faults: blocks the victim had been asked for when it was killed
    cut: float | None = None  # source faults: transfer attempts that failed at the instances during the run
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.completed == self.requests and not self.tokens_lost and not self.tokens_duplicated
                and not self.tokens_altered and not self.errors)


def workload(options: ChaosOptions, prefix: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The prompts and sampling of one run: a shared prefix, greedy and seeded top-p streams."""
    if prefix is None:
        prefix = (SYSTEM_PROMPT * (options.prefix_tokens // len(SYSTEM_PROMPT) + 1))[:options.prefix_tokens]
    out = []
    for i in range(options.streams):
        sampling: dict[str, Any] = ({"temperature": 0} if i % 2 == 0
                                    else {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i})
        out.append((prefix + QUESTIONS[i % len(QUESTIONS)], sampling))
    return out


Trigger = Callable[[int, str, int, int], Awaitable[None]]  # stream number, session, index, epoch
Results = list[dict[str, Any] | BaseException]


async def run_workload(cluster: ChaosCluster, options: ChaosOptions, trigger: Trigger | None = None,
                       prefix: str | None = None) -> tuple[Results, dict[int, list[tuple[float, int]]]]:
    """All streams at once; *trigger* sees every token. Returns each stream's result (or error) and the arrival
    time and epoch of each stream's tokens."""
    arrivals: dict[int, list[tuple[float, int]]] = {}

    def hook(n: int) -> Callable[[str, int, int, int], Awaitable[None]]:
        async def on_token(session: str, index: int, epoch: int, token: int) -> None:
            del token
            arrivals.setdefault(n, []).append((time.perf_counter(), epoch))
            if trigger is not None:
                await trigger(n, session, index, epoch)
        return on_token

    runs = [asyncio.wait_for(_stream(cluster.client, cluster.completions, prompt, options.max_tokens,
                                     on_token=hook(n), sampling=sampling), options.timeout * 2)
            for n, (prompt, sampling) in enumerate(workload(options, prefix))]
    results = await asyncio.gather(*runs, return_exceptions=True)
    return list(results), arrivals


def reference_tokens(results: Results) -> list[list[int]]:
    """Each stream's tokens in index order, from a fault-free run; a stream that lacks an index or has one twice
    is an error (its tokens, taken by position, would make every later token of the faulted runs look altered)."""
    out = []
    for n, result in enumerate(results):
        if isinstance(result, BaseException):
            raise RuntimeError(f"stream {n} of the fault-free run failed: {result!r}")
        indices = [i for i, _, _ in result["tokens"]]
        if indices != list(range(len(indices))):
            missing = sorted(set(range(max(indices, default=-1) + 1)) - set(indices))
            raise RuntimeError(f"stream {n} of the fault-free run delivered {len(indices)} tokens, indices not 0.."
                               f"{len(indices) - 1} once each (missing {missing[:8]}): tokens were lost or repeated")
        out.append([t for _, _, t in result["tokens"]])
    return out


def compare(row: Row, results: Results, reference: list[list[int]],
            baseline_ttft: float) -> None:
    row.requests = len(results)
    ttfts = []
    epochs: set[int] = set()
    for n, result in enumerate(results):
        expected = reference[n]
        row.tokens_expected += len(expected)
        if isinstance(result, BaseException):
            row.errors.append(f"stream {n}: {type(result).__name__}: {result}"[:300])
            row.tokens_lost += len(expected)
            continue
        got = result["tokens"]
        indices = [i for i, _, _ in got]
        received = {i: t for i, _, t in got}
        row.tokens_delivered += len(received)
        row.tokens_duplicated += len(indices) - len(received)
        row.tokens_lost += sum(1 for i in range(len(expected)) if i not in received)
        row.tokens_altered += sum(1 for i, t in received.items() if i >= len(expected) or expected[i] != t)
        epochs |= {e for _, e, _ in got}
        if len(received) == len(expected):
            row.completed += 1
        ttfts.append(result["ttft"])
    row.epochs_seen = sorted(epochs)
    if ttfts:
        ttft = statistics.median(ttfts)
        row.ttft_ms = round(ttft * 1e3, 1)
        row.ttft_penalty_ms = round((ttft - baseline_ttft) * 1e3, 1)


async def inject(cluster: ChaosCluster, options: ChaosOptions, fault: str, target: str | None,
                 reference: list[list[int]], baseline_ttft: float, round_: int,
                 progress: Callable[[str], None], sources: Sources | None = None) -> Row:
    row = Row(fault, target, round_)
    state: dict[str, Any] = {}
    seeded: Seeded | None = None
    if fault in SOURCE_FAULTS and sources is not None and target is not None:
        # a prefix of its own, at the victim only (kvsp_app/chaos_sources.py); its fault-free run is the
        # reference of this row, and its median TTFT (the prefix computed) the baseline of the penalty
        cold: dict[str, float] = {}

        async def reference_run(prefix: str) -> list[list[int]]:
            results, _ = await run_workload(cluster, options, prefix=prefix)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise RuntimeError(f"the fault-free run of the fresh prefix failed: {failed[0]!r}")
            cold["ttft"] = statistics.median(r["ttft"] for r in results if isinstance(r, dict))
            return reference_tokens(results)

        try:
            seeded = await seed(cluster, sources, target, options.source_prefix_tokens, reference_run, progress)
        except Exception as exc:  # the row reports it; the next fault runs anyway
            row.errors.append(f"{fault}: the prefix could not be placed at {target} only: {exc}"[:300])
            return row
        reference, baseline_ttft = seeded.reference, cold["ttft"]
        await asyncio.sleep(options.settle)  # the restarted instances report their status

    async def fire(name: str, how: str) -> None:
        state.update(target=name, at=time.perf_counter())
        if how == "stop":
            cluster.freeze(name)
        else:
            cluster.kill(name)
        progress(f"      {fault}: {'SIGSTOP' if how == 'stop' else 'SIGKILL'} {name}")
        if fault == "holder-restart":
            await asyncio.to_thread(cluster.restart, name)
            progress(f"      {fault}: {name} restarted on its port and storage")

    async def trigger(n: int, session: str, index: int, epoch: int) -> None:
        if n != 0 or "at" in state or index + 1 < options.fault_after:
            return
        state.update(at=-1.0, epoch=epoch)  # once
        if fault == "pc-kill":
            await fire(await cluster.checkpointing_replica(), "kill")
            return
        serving = await cluster.serving_instance(uuid.UUID(session))
        if serving is None:
            row.errors.append("the first stream's session has no instance at the PC; no fault injected")
            return
        await fire(serving, "stop" if fault == "instance-stop" else "kill")

    async def at_start() -> None:
        await asyncio.sleep(0.05)  # the requests are on their way: placement, lookups, loads
        await fire(target or "", "kill")

    fetched = await cluster.fetched_tokens()
    done = asyncio.Event()
    early: asyncio.Future[None] | None = None
    failed_before: dict[str, float] = {}
    if seeded is not None and sources is not None:
        failed_before = await sources.failed_attempts()
        victim = seeded.victim
        served_before = await sources.served(victim) or 0.0
        early = asyncio.ensure_future(kill_on_first_load(
            sources, victim, served_before, lambda: fire(victim, "kill"), done, state))
    elif fault not in MID_GENERATION:
        early = asyncio.ensure_future(at_start())
    try:
        results, arrivals = await run_workload(cluster, options, trigger if fault in MID_GENERATION else None,
                                               prefix=seeded.prefix if seeded is not None else None)
    finally:
        done.set()
    if early is not None:
        await early
    compare(row, results, reference, baseline_ttft)
    now = await cluster.fetched_tokens()  # an instance killed during the run is not counted
    row.fetched_tokens = sum(max(now[n] - fetched[n], 0.0) for n in now.keys() & fetched.keys())
    if seeded is not None and sources is not None:
        failed_after = await sources.failed_attempts()
        row.served = state.get("served", 0.0)
        row.cut = sum(max(failed_after[n] - failed_before[n], 0.0) for n in failed_after.keys() & failed_before.keys())
        if not row.served or not row.cut:
            row.errors.append(f"not cut: no load from {seeded.victim} was in flight at the kill (it had served "
                              f"{row.served:.0f} blocks; {row.cut:.0f} transfers failed at the instances)")
    row.target = state.get("target", target)
    at = state.get("at", -1.0)
    if at > 0:
        row.recover_ms = recovery(fault, at, state.get("epoch", 0), arrivals.get(0, []))
    else:
        row.errors.append(f"{fault}: the fault was never injected (the first stream ended too early?)")
    # back to a whole cluster for the next fault
    if row.target and fault == "instance-stop":
        cluster.resume(row.target)
    elif row.target and fault != "holder-restart":
        await asyncio.to_thread(cluster.restart, row.target)
    await asyncio.sleep(options.settle)
    return row


def recovery(fault: str, at: float, epoch: int, arrivals: list[tuple[float, int]]) -> float | None:
    """Milliseconds from the fault to the first stream's recovery: for an instance fault, its first token of a later
    epoch (tokens the front end had buffered do not count); otherwise the longest wait for a token after the fault."""
    if fault in ("instance-kill", "instance-stop"):
        resumed = [t for t, e in arrivals if t > at and e > epoch]
        return round((resumed[0] - at) * 1e3, 1) if resumed else None
    times = [at] + [t for t, _ in arrivals if t > at]
    if len(times) < 2:
        return None
    return round(max(b - a for a, b in itertools.pairwise(times)) * 1e3, 1)


def plan(options: ChaosOptions) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for fault in options.faults:
        if fault == "is-kill":
            out += [(fault, "index-a"), (fault, "index-b")]
        else:
            out.append((fault, SOURCE_FAULTS.get(fault)))
    return out


async def run(options: ChaosOptions, progress: Callable[[str], None]) -> dict[str, Any]:
    unknown = sorted(set(options.faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault {', '.join(unknown)} (known: {', '.join(FAULTS)})")
    root = options.workdir or Path(tempfile.mkdtemp(prefix="kvsp-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    cluster = ChaosCluster(root, progress, redis_cluster=options.redis_cluster)
    rows: list[Row] = []
    ok = False
    try:
        await cluster.start_all(layers=options.layers, hidden=options.hidden)
        progress(f"[6/7] the workload without a fault ({options.streams} streams, {options.max_tokens} tokens each): "
                 "reference tokens, then warm runs (the fastest: the baseline)")
        async with cluster.clients():
            first, _ = await run_workload(cluster, options)
            failed = [r for r in first if isinstance(r, BaseException)]
            if failed:
                raise RuntimeError(f"the fault-free run failed: {failed[0]!r}")
            reference = reference_tokens(first)
            baseline = Row("none")
            for _ in range(3):  # the fastest warm run is the baseline (the first runs after start-up are slower)
                warm, _ = await run_workload(cluster, options)
                candidate = Row("none")
                compare(candidate, warm, reference, 0.0)
                if baseline.ttft_ms is None or (candidate.ttft_ms or 0.0) < baseline.ttft_ms or not candidate.ok:
                    baseline = candidate
                if not candidate.ok:
                    break
            baseline_ttft = (baseline.ttft_ms or 0.0) / 1e3
            baseline.ttft_penalty_ms = 0.0
            rows.append(baseline)
            progress(f"      warm median TTFT {baseline.ttft_ms} ms; {baseline.completed}/{baseline.requests} "
                     f"completed, {baseline.tokens_altered} tokens differ from the first run")
            faults = plan(options)
            sources = Sources(cluster)
            progress(f"[7/7] {options.rounds} round(s) of {len(faults)} fault(s)")
            for round_ in range(1, options.rounds + 1):
                for fault, target in faults:
                    progress(f"      round {round_}: {fault}" + (f" ({target})" if target else ""))
                    row = await inject(cluster, options, fault, target, reference, baseline_ttft, round_, progress,
                                       sources)
                    rows.append(row)
                    progress(f"      -> {row.completed}/{row.requests} completed, lost/dup/altered "
                             f"{row.tokens_lost}/{row.tokens_duplicated}/{row.tokens_altered}, "
                             f"recover {row.recover_ms} ms, TTFT {row.ttft_ms} ms"
                             + ("" if row.ok else f"  FAILED {row.errors[:1]}"))
        ok = all(r.ok for r in rows)
        return {"ok": ok, "rounds": options.rounds, "workdir": str(root),
                "rows": [dict(vars(r), ok=r.ok) for r in rows]}
    finally:
        with contextlib.suppress(Exception):
            cluster.stop()
        if ok and not options.keep and options.workdir is None:  # a failure keeps its logs
            shutil.rmtree(root, ignore_errors=True)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render(report: dict[str, Any]) -> str:
    head = (f"{'fault':<15}{'target':<12}{'rnd':>4}{'done':>7}{'lost':>6}{'dup':>5}{'alt':>5}"
            f"{'recover ms':>12}{'TTFT ms':>10}{'penalty':>10}{'epochs':>8}{'fetched':>9}{'served':>8}{'cut':>5}"
            "  result")
    lines = ["kvsp-quic chaos: report", head]
    for r in report["rows"]:
        lines.append(f"{r['fault']:<15}{r['target'] or '-':<12}{r['round']:>4}"
                     f"{str(r['completed']) + '/' + str(r['requests']):>7}{r['tokens_lost']:>6}"
                     f"{r['tokens_duplicated']:>5}{r['tokens_altered']:>5}{_cell(r['recover_ms']):>12}"
                     f"{_cell(r['ttft_ms']):>10}{_cell(r['ttft_penalty_ms']):>10}"
                     f"{','.join(map(str, r['epochs_seen'])):>8}{_cell(r['fetched_tokens']):>9}"
                     f"{_cell(r.get('served')):>8}{_cell(r.get('cut')):>5}  "
                     f"{'ok' if r['ok'] else 'FAILED: ' + '; '.join(r['errors'])[:200]}")
    lines.append("all faults survived: 0 lost, duplicated or altered tokens" if report["ok"]
                 else f"FAILURES (logs kept in {report['workdir']})")
    return "\n".join(lines)
