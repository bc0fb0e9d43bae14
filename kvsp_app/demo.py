"""``kvsp-quic demo``: a whole working cluster on one machine, a workload with shared prefixes, a failure, a report.

It writes a small random-weights model, starts -- as real processes on 127.0.0.1, with fresh dev certificates --
the Index Service with the Placement Controller, a holder, a relay, two inference instances and the front end,
then sends requests through the front end (OpenAI-compatible, streamed, over HTTP/3):

1. a cold request: nothing is cached anywhere, every token is computed;
2. a burst of requests sharing the same long system prefix: the prefix's blocks are found, fetched or already
   resident, and only the suffix is computed;
3. a long generation whose instance is killed (SIGKILL) mid-way: the Placement Controller notices the missed
   status report, resumes the session on the other instance at the last checkpoint, and the front end delivers
   every token index exactly once; the output is compared with the same generation run without a failure.
4. where ``redis-server`` is installed, the Index Service + Placement Controller runs as two replicas on a Redis of
   its own, and the same generation runs once more while the PC replica receiving its checkpoints is killed
   (SIGKILL): the session goes on through the other replica, compared with the same reference.

It prints a report (``--json``: as JSON) and stops every process it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsp_app.redis_cluster import RedisServer
from kvsp_dev.processes import RoleDidNotStart, RoleProcess, stop_all
from kvsp_quic.problems import Unavailable
from kvsp_quic.roles.controller_records import SessionState, TokenLine

SYSTEM_PROMPT = (
    "You are a helpful assistant for an operator of a large language model serving fleet. The fleet shares "
    "attention KV caches between inference instances with the KV Cache Storage Protocol: blocks of tokens are "
    "named by keyed hash chains, copies are recorded in an index with the tiers that hold each layer, leases "
    "protect copies while they load, and sessions survive the loss of an instance through checkpoints. "
)
QUESTIONS = [
    "What is a Block Key?", "Why are leases needed?", "How does a session survive a failure?",
    "What does the index record?", "Why are scopes keyed?", "How are layers streamed?",
    "What is a replica?", "What does the relay cache?",
]


@dataclass
class DemoOptions:
    workdir: Path | None = None
    keep: bool = False
    requests: int = 4  # warm requests sharing the prefix
    prefix_tokens: int = 1536  # length of the shared system prompt, in tokens (bytes of the byte tokenizer)
    max_tokens: int = 24
    long_tokens: int = 480  # the generation that loses its instance
    kill_after: int = 40  # tokens received before the kill
    layers: int = 8
    hidden: int = 512
    timeout: float = 120.0


@dataclass
class Cluster:
    """Role processes named by the caller, started in *root* (their working directory) with their INFO log appended
    to ``root/NAME.log``."""

    root: Path
    progress: Callable[[str], None]
    procs: dict[str, RoleProcess] = field(default_factory=dict)

    def start(self, name: str, *args: str, timeout: float = 120.0) -> dict[str, Any]:
        """Start ``kvsp-quic ARGS`` as *name* (in place of an ended process of that name); its ready line. Raises
        Unavailable (with the message of :class:`kvsp_dev.processes.RoleDidNotStart`) when it ends first or prints
        none within *timeout* seconds."""
        process = RoleProcess(name, *args, stderr=self.root / f"{name}.log", append=True, log_level="INFO",
                              cwd=self.root)
        try:
            ready = process.wait_ready(timeout)
        except RoleDidNotStart as exc:
            raise Unavailable(str(exc)) from exc
        self.procs[name] = process
        return ready

    def kill(self, name: str) -> None:
        self.procs[name].kill()

    def stop(self) -> None:
        stop_all(reversed(list(self.procs.values())))


async def _stream(client: Any, url: str, prompt: str, max_tokens: int,
                  on_token: Callable[[str, int, int, int], Awaitable[None]] | None = None,
                  sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed completion: time to first token, the (index, epoch, token) triples, the session id."""
    # greedy by default (the OpenAI default is temperature 1.0): the run with a failure is compared with one without;
    # a seeded top-p *sampling* ({"temperature", "top_p", "seed"}) is as reproducible
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       **(sampling or {"temperature": 0})}).encode()
    start = time.perf_counter()
    ttft: float | None = None
    tokens: list[tuple[int, int, int]] = []
    session = ""
    buffer = b""
    async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            await r.aread()
            raise Unavailable(f"the front end answered {r.status}: {(r.content or b'')[:200]!r}")
        async for chunk in r.aiter_bytes():
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    continue
                item = json.loads(data)
                if "error" in item:
                    raise Unavailable(f"the completion failed: {item['error'].get('detail')}")
                session = item["id"].removeprefix("cmpl-")
                label = item.get("kvsp")
                if label is None:
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - start
                line = TokenLine.from_json(label, "kvsp")
                assert line.token is not None, "the front end labels output tokens only"
                tokens.append((line.index, line.epoch, line.token))
                if on_token is not None:
                    await on_token(session, *tokens[-1])
    return {"ttft": ttft or 0.0, "tokens": tokens, "session": session, "seconds": time.perf_counter() - start}


_METRIC_RE = re.compile(r'^([a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$')


async def _metrics(client: Any, base: str) -> dict[str, float]:
    r = await client.request("GET", f"{base}metrics")
    out: dict[str, float] = {}
    for line in (r.content or b"").decode().splitlines():
        m = _METRIC_RE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


async def checkpointing_replica(client: Any, replicas: dict[str, str]) -> str:
    """The name of the PC replica (name -> base URI) receiving checkpoints now: the one whose accepted-checkpoint
    counter grows (the first one when none does)."""
    async def counts() -> dict[str, float]:
        out = {}
        for name, uri in replicas.items():
            with contextlib.suppress(Exception):
                values = await _metrics(client, uri)
                out[name] = sum(v for k, v in values.items()
                                if k.startswith("kvsp_checkpoints_total{") and 'outcome="accepted"' in k)
        return out

    before = await counts()
    await asyncio.sleep(0.3)
    after = await counts()
    return max(replicas, key=lambda n: (after.get(n, 0.0) - before.get(n, 0.0), after.get(n, 0.0)))


def compare_tokens(got: list[tuple[int, int, int]], expected: list[int]) -> tuple[int, int, int]:
    """(lost, duplicated, altered) of the (index, epoch, token) triples *got* against the *expected* tokens."""
    indices = [i for i, _, _ in got]
    received = {i: t for i, _, t in got}
    lost = sum(1 for i in range(len(expected)) if i not in received)
    altered = sum(1 for i, t in received.items() if i >= len(expected) or expected[i] != t)
    return lost, len(indices) - len(received), altered


def _merged(replicas: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of the PC replicas as one: counters summed, the controller's hit ratio weighted by lookups."""
    out: dict[str, float] = {}
    for values in replicas:
        for k, v in values.items():
            out[k] = out.get(k, 0.0) + v
    ratio, lookups = 'kvsp_lookup_hit_ratio{component="controller"}', 'kvsp_lookups_total{component="controller"}'
    weights = [values.get(lookups, 0.0) for values in replicas]
    if sum(weights) > 0:
        out[ratio] = sum(w * values.get(ratio, 0.0) for w, values in zip(weights, replicas, strict=True)) \
            / sum(weights)
    elif replicas:
        out[ratio] = max(values.get(ratio, 0.0) for values in replicas)
    return out


async def _pc_kill(cluster: Cluster, client: Any, completions: str, prompt: str, replicas: dict[str, str],
                   options: DemoOptions, reference: list[int], progress: Callable[[str], None]) -> dict[str, Any]:
    """The generation once more; the PC replica receiving its checkpoints is SIGKILLed after ``kill_after``
    tokens; the tokens against *reference*, and the longest wait for a token after the kill."""
    killed: dict[str, Any] = {}
    arrivals: list[float] = []

    async def on_token(session: str, index_: int, epoch: int, token: int) -> None:
        del session, epoch, token
        arrivals.append(time.perf_counter())
        if index_ + 1 != options.kill_after or "name" in killed:
            return
        name = await checkpointing_replica(client, replicas)
        killed.update(name=name, at=time.perf_counter(), offset=len(arrivals))
        cluster.kill(name)
        progress(f"      killed the PC replica {name} (SIGKILL), the one receiving its checkpoints, after token "
                 f"{options.kill_after}")

    result = await _stream(client, completions, prompt, options.long_tokens, on_token=on_token)
    lost, duplicated, altered = compare_tokens(result["tokens"], reference)
    after = [t for t in arrivals if t > killed.get("at", float("inf"))]
    gaps = [b - a for a, b in itertools.pairwise([killed["at"], *after])] if after else []
    return {"pc_killed": killed.get("name"), "pc_tokens_after_kill": len(after),
            "pc_longest_wait_ms": round(max(gaps) * 1e3, 1) if gaps else None,
            "pc_tokens_lost": lost, "pc_tokens_duplicated": duplicated, "pc_tokens_altered": altered}


def demo_ok(report: dict[str, Any]) -> bool:
    return not any(report.get(f"{p}tokens_{what}") for p in ("", "pc_") for what in ("lost", "duplicated", "altered"))


async def run(options: DemoOptions, progress: Callable[[str], None]) -> dict[str, Any]:
    from gpu.modelfiles import ModelConfig, write_random_model
    from http3.client import KvspClient
    from kvsp_client.api import KvspApi
    from quic.tls import TlsFiles

    root = options.workdir or Path(tempfile.mkdtemp(prefix="kvsp-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root, progress)
    steps = 8
    redis: RedisServer | None = None
    try:
        progress(f"[1/{steps}] writing a random-weights model ({options.layers} layers, hidden {options.hidden}) "
                 f"in {root}")
        heads = max(options.hidden // 64, 1)
        write_random_model(root / "model", ModelConfig(
            hidden_size=options.hidden, intermediate_size=2 * options.hidden, num_hidden_layers=options.layers,
            num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), vocab_size=512, head_dim=64,
            name="kvsp-demo"), seed=1)
        dev = ["--dev", "dev"]
        replicas: dict[str, str] = {}
        if shutil.which("redis-server") is not None:
            progress(f"[2/{steps}] starting the Index Service with the Placement Controller: two replicas on a "
                     "redis-server of its own")
            redis = RedisServer.start(root)
            for name in ("index-a", "index-b"):
                replicas[name] = cluster.start(name, "index", *dev, "--redis", redis.url)["base_uri"]
        else:
            progress(f"[2/{steps}] starting the Index Service with the Placement Controller (one: no redis-server "
                     "for replicas)")
            replicas["index"] = cluster.start("index", "index", *dev)["base_uri"]
        index = next(iter(replicas.values()))
        uris = {"--index": [x for u in replicas.values() for x in ("--index", u)],
                "--controller": [x for u in replicas.values() for x in ("--controller", u)]}
        progress(f"[3/{steps}] starting a holder and a relay")
        cluster.start("holder", "holder", *dev, *uris["--index"])
        cluster.start("relay", "relay", *dev, *uris["--index"])
        progress(f"[4/{steps}] starting two inference instances (loading the model, warming up)")
        instances = {}
        for name in ("instance-a", "instance-b"):
            ready = cluster.start(name, "instance", *dev, "--device", "cpu", "--model", "model", *uris["--index"],
                                  *uris["--controller"], "--status-ttl-ms", "1500")
            instances[ready["base_uri"]] = name
        progress(f"[5/{steps}] starting the front end")
        fe = cluster.start("frontend", "frontend", *dev, *uris["--controller"], "--model", "model")
        completions = fe["completions"]
        files = TlsFiles(root / fe["ca"], root / fe["client_cert"], root / fe["client_key"])
        prefix = (SYSTEM_PROMPT * (options.prefix_tokens // len(SYSTEM_PROMPT) + 1))[:options.prefix_tokens]
        fe_port = fe["base_uri"].rstrip("/").rsplit(":", 1)[1]
        fe_files = TlsFiles(root / fe["ca"], root / "dev" / f"frontend-{fe_port}.pem",
                            root / "dev" / f"frontend-{fe_port}.key")
        async with KvspClient(files, timeout=options.timeout) as client, \
                KvspClient(fe_files, timeout=options.timeout) as as_frontend:
            progress(f"[6/{steps}] cold request: a {options.prefix_tokens}-token system prompt nobody has cached")
            cold = await _stream(client, completions, prefix + QUESTIONS[0], options.max_tokens)
            progress(f"      time to first token {cold['ttft'] * 1e3:.0f} ms")
            progress(f"[7/{steps}] {options.requests} requests sharing that prefix, two at a time")
            warm: list[dict[str, Any]] = []
            for i in range(0, options.requests, 2):
                batch = [prefix + QUESTIONS[1 + (i + j) % (len(QUESTIONS) - 1)]
                         for j in range(min(2, options.requests - i))]
                warm += await asyncio.gather(*(_stream(client, completions, p, options.max_tokens) for p in batch))
            warm_ttft = statistics.median(w["ttft"] for w in warm)
            progress(f"      median time to first token {warm_ttft * 1e3:.0f} ms")
            before = {name: await _metrics(client, base) for base, name in instances.items()}

            progress(f"[8/{steps}] a {options.long_tokens}-token generation; its instance is killed after "
                     f"{options.kill_after} tokens")
            long_prompt = prefix + "Explain session migration step by step."
            killed: dict[str, Any] = {}

            async def on_token(session: str, index_: int, epoch: int, token: int) -> None:
                if epoch > 1 and "resumed" not in killed and "at" in killed:
                    killed["resumed"] = time.perf_counter()
                if index_ + 1 != options.kill_after or "name" in killed:
                    return
                # The PC shows a session only to the principal that created it: the front end.
                state = await KvspApi(as_frontend).session_info(index, uuid.UUID(session))
                if state.state is SessionState.DONE or state.instance not in instances:
                    killed["name"] = None
                    progress("      the generation finished before the kill could happen")
                    return
                serving = instances[state.instance]
                killed.update(name=serving, at=time.perf_counter())
                cluster.kill(serving)
                progress(f"      killed {serving} (SIGKILL) after token {options.kill_after}")

            result = await _stream(client, completions, long_prompt, options.long_tokens, on_token=on_token)
            if killed.get("resumed"):
                progress(f"      resumed on the other instance {(killed['resumed'] - killed['at']) * 1e3:.0f} ms "
                         f"after the kill")
            progress("      the session finished; running the same generation without a failure for comparison")
            reference = await _stream(client, completions, long_prompt, options.long_tokens)
            index_metrics = _merged([await _metrics(client, uri) for uri in replicas.values()])
            survivor = next(base for base, name in instances.items() if name != killed.get("name"))
            after = {instances[survivor]: await _metrics(client, survivor)}
            pc: dict[str, Any] = {}
            if len(replicas) > 1:
                progress("      the same generation again; this time the PC replica receiving its checkpoints is "
                         f"killed after {options.kill_after} tokens")
                pc = await _pc_kill(cluster, client, completions, long_prompt, replicas, options,
                                    [t for _, _, t in reference["tokens"]], progress)
        report = _report(options, cold, warm, result, reference, killed, index_metrics, before, after)
        report.update(pc)
        return report
    finally:
        cluster.stop()
        if redis is not None:
            redis.stop()
        if not options.keep and options.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def _report(options: DemoOptions, cold: dict[str, Any], warm: list[dict[str, Any]], failing: dict[str, Any],
            reference: dict[str, Any], killed: dict[str, Any], index_metrics: dict[str, float],
            before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    got = failing["tokens"]
    indices = [i for i, _, _ in got]
    lost, duplicated, altered = compare_tokens(got, [t for _, _, t in reference["tokens"]])

    def instance_sum(metric: str) -> float:
        total = 0.0
        for name, values in {**before, **after}.items():
            del name
            total += values.get(metric + '{component="instance"}', 0.0)
        return total

    return {
        "requests": 2 + len(warm),
        "lookup_hit_ratio": index_metrics.get('kvsp_lookup_hit_ratio{component="controller"}'),
        "fetched_tokens": instance_sum("kvsp_fetched_tokens_total"),
        "recomputed_tokens": instance_sum("kvsp_recomputed_tokens_total"),
        "ttft_cold_ms": round(cold["ttft"] * 1e3, 1),
        "ttft_with_cache_ms": round(statistics.median(w["ttft"] for w in warm) * 1e3, 1),
        "migrations": index_metrics.get('kvsp_migrations_total{component="controller"}'),
        "killed": killed.get("name"),
        "migration_ms": round((killed["resumed"] - killed["at"]) * 1e3, 1) if "resumed" in killed else None,
        "tokens_delivered": len(set(indices)),
        "tokens_lost": lost,
        "tokens_duplicated": duplicated,
        "tokens_altered": altered,
        "epochs_seen": sorted({e for _, e, _ in got}),
        "prefix_tokens": options.prefix_tokens,
    }


def render(report: dict[str, Any]) -> str:
    ok = report["tokens_lost"] == 0 and report["tokens_duplicated"] == 0 and report["tokens_altered"] == 0
    pc_ok = not (report.get("pc_tokens_lost") or report.get("pc_tokens_duplicated") or report.get("pc_tokens_altered"))
    lines = [
        "kvsp-quic demo: report",
        f"  requests through the front end      {report['requests']}",
        f"  lookup hit ratio (controller)       {report['lookup_hit_ratio'] or 0:.2f}",
        f"  prompt tokens fetched / recomputed  {report['fetched_tokens']:.0f} / {report['recomputed_tokens']:.0f}",
        f"  time to first token, cold           {report['ttft_cold_ms']} ms",
        f"  time to first token, with the cache {report['ttft_with_cache_ms']} ms "
        f"({report['ttft_cold_ms'] / max(report['ttft_with_cache_ms'], 0.001):.1f}x)",
        f"  instance killed                     {report['killed']}",
        f"  migration (kill -> next token)      {report['migration_ms']} ms; epochs seen {report['epochs_seen']}",
        f"  tokens delivered                    {report['tokens_delivered']}",
        f"  tokens lost / duplicated / altered  {report['tokens_lost']} / {report['tokens_duplicated']} / "
        f"{report['tokens_altered']}  {'(ok)' if ok else '(NOT OK)'}",
    ]
    if "pc_killed" in report:
        lines += [
            f"  PC replica killed                   {report['pc_killed']}; longest wait for a token after it "
            f"{report['pc_longest_wait_ms']} ms ({report['pc_tokens_after_kill']} tokens after the kill)",
            f"  tokens lost / duplicated / altered  {report['pc_tokens_lost']} / {report['pc_tokens_duplicated']} / "
            f"{report['pc_tokens_altered']}  {'(ok)' if pc_ok else '(NOT OK)'}",
        ]
    return "\n".join(lines)
