"""Fast migration (issue 12, point 4): SIGKILL of the serving instance -> the next token, through the front end.

    python -m benchmarks.bench_migration [--kills 20] [--baseline 4] [--redis URL] [--status-ttl-ms 3000]
                                         [--no-keepalive] [--freeze] [--seed 1] [--json] [--verbose]

Processes (``--dev`` with one directory: mutual TLS with the dev CA, 127.0.0.1): ``kvsp-quic index`` (the Index
Service with the Placement Controller; ``--redis URL``: ``--store redis`` on that server) and three
``kvsp-quic instance --device cpu`` of a tiny random model (4 layers, hidden 64, vocabulary 256; blocks of 4
tokens, a checkpoint every 4 tokens, status TTL ``--status-ttl-ms``). The front end is
:class:`kvsp_frontend.session.Frontend` in this process, as ``kvsp-quic frontend`` runs it.

Each round creates a session (alternately greedy and seeded top-p, whose tokens wait for acknowledged
checkpoints), reads its tokens, SIGKILLs the instance serving it after a random 12-27 tokens, and measures from
the kill to the first token of the new epoch delivered by the front end (tokens the dead instance sent before it
died and that were still in flight do not count: the clock stops at the first token the *new* instance produced).
The whole output is compared with an uninterrupted run of the same prompt and sampler: indices delivered twice,
missing, or with another token are counted. A replacement instance is started once the session has ended (a
process starting competes for the CPU the resume needs), and the next round waits until it is up and warm: every
instance serves a short session of each sampler before it may take a migrated one (:func:`warm`; the first
sessions of a fresh process are slow, and in a cluster that serves, the survivors of a failure are warm).

The first ``--kills`` rounds use suspect reports (docs/wire.md, "Suspect reports": the front end reports the stalled
stream, the PC probes the instance and migrates at once); ``--baseline`` more rounds in the same run use the path
before them (``Frontend(suspect=False)``: the PC notices the failure when the instance's status expires, the
front end asks the PC where the session went after ``stall_check_ms`` of silence). ``--no-keepalive``: the front
end sends no QUIC PINGs on its token connections, so a kill is noticed by the stall bound alone. ``--freeze``:
SIGSTOP instead of SIGKILL (a frozen instance: nothing answers, no ICMP either).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from http3.client import KvspClient
from kvsp_client.api import ServiceEndpoints
from kvsp_dev.processes import RoleProcess, stop_all
from kvsp_frontend.session import Completion, Frontend
from kvsp_quic.frontend import SamplingRequest
from kvsp_quic.keys import BlockKeyer
from quic.tls import TlsFiles

log = logging.getLogger("bench.migration")
PROMPT = [5, 17, 3, 99, 42, 7, 1, 250, 8, 64, 33, 21, 90, 11, 4, 6]
MAX_TOKENS = 64
METHODS = ("greedy", "top-p")


class Bytes:
    """Token ids as octets (the tiny model's vocabulary is 256): enough for the front end, which reads ids."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("latin-1")


def write_tiny_model(directory: Path) -> Path:
    from gpu.modelfiles import ModelConfig, write_random_model

    config = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, head_dim=16)
    return Path(write_random_model(directory, config, seed=3))


@dataclass
class Cluster:
    """``kvsp-quic index`` and the instances, all ``--dev`` with one directory (module docstring)."""

    workdir: Path
    redis_url: str | None = None
    status_ttl_ms: int = 3000
    index: RoleProcess | None = None
    instances: dict[str, RoleProcess] = field(default_factory=dict)  # base URI -> process
    starting: list[asyncio.Task[RoleProcess]] = field(default_factory=list)
    model: Path | None = None
    warm: set[str] = field(default_factory=set)  # instances that served a session of each sampler

    @property
    def dev(self) -> str:
        return str(self.workdir / "dev")

    @property
    def pc(self) -> str:
        assert self.index is not None
        return self.index.base

    def start_index(self) -> None:
        store = ["--store", "redis", "--redis", self.redis_url] if self.redis_url else []
        self.index = RoleProcess("index", "index", "--dev", self.dev, *store)
        self.index.wait_ready()

    async def spawn(self) -> RoleProcess:
        """Start an instance; returns once it printed its ready line."""
        assert self.model is not None
        proc = RoleProcess("instance", "instance", "--dev", self.dev, "--device", "cpu", "--model",
                           str(self.model), "--block-tokens", "4", "--warmup-tokens", "8", "--checkpoint-tokens", "4",
                           "--status-ttl-ms", str(self.status_ttl_ms), "--controller", self.pc, "--index", self.pc)
        await asyncio.to_thread(proc.wait_ready)
        self.instances[proc.base] = proc
        return proc

    def spawn_soon(self) -> None:
        self.starting.append(asyncio.ensure_future(self.spawn()))

    async def up(self, client: KvspClient, at_least: int) -> None:
        """Wait until the PC holds *at_least* instances active (the replacements started so far included)."""
        deadline = time.monotonic() + 120
        while True:
            self.starting = [t for t in self.starting if not t.done()]
            listed = (await client.request("GET", f"{self.pc}instances")).json()["instances"]
            active = [i for i in listed if i["state"] == "active" and i["instance"] in self.instances]
            if len(active) >= at_least:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(active)} instances active after 120 s")
            await asyncio.sleep(0.1)

    def files(self) -> TlsFiles:
        assert self.index is not None
        r = self.index.ready
        return TlsFiles(Path(r["ca"]), Path(r["client_cert"]), Path(r["client_key"]))

    def keyer(self) -> BlockKeyer:
        ready = next(iter(self.instances.values())).ready
        return BlockKeyer(bytes.fromhex(Path(ready["scope_key"]).read_text().strip()),
                          bytes.fromhex(ready["compat_id"]), ready["descriptor"]["block_tokens"])

    async def stop(self) -> None:
        for task in self.starting:
            proc = await task
            self.instances[proc.base] = proc
        stop_all(self.instances.values(), 20)
        if self.index is not None:
            self.index.stop(20)


def session(frontend: Frontend, method: str, seed: int = 7, max_tokens: int = MAX_TOKENS) -> Completion:
    temperature, top_p = (0.0, None) if method == "greedy" else (0.9, 0.95)
    return Completion(frontend, list(PROMPT), max_tokens, SamplingRequest.from_openai(temperature, top_p, seed, seed))


async def warm(cluster: Cluster, frontend: Frontend) -> None:
    """Let every instance serve a short greedy and a top-p session before it may take a migrated one: the first
    sessions of a fresh process are slow (seen: a resume's first token 1.5 s after admission instead of 0.1 s), and
    surviving instances are warm in a cluster that serves. Concurrent sessions spread over the instances (the PC
    counts what it assigned since each one's last report); up to five tries."""
    for _ in range(5):
        cold = [i for i in cluster.instances if i not in cluster.warm]
        if not cold:
            return
        runs = [session(frontend, METHODS[n % 2], seed=n, max_tokens=8) for n in range(4 * len(cold))]

        async def drain(run: Completion) -> None:
            async for _ in run.tokens():
                pass

        await asyncio.gather(*(drain(r) for r in runs))
        served: dict[str, set[str]] = {}
        for n, r in enumerate(runs):
            served.setdefault(r.instance, set()).add(METHODS[n % 2])
        cluster.warm.update(i for i, methods in served.items() if len(methods) == len(METHODS))


async def reference(frontend: Frontend, method: str) -> list[int]:
    out: dict[int, int] = {}
    async for index, token, _ in session(frontend, method).tokens():
        out[index] = token
    return [out[i] for i in range(len(out))]


@dataclass
class Round:
    method: str
    suspect: bool
    killed: str
    kill_after: int
    migration_ms: float | None  # kill -> the first token of the new epoch delivered (None: none came)
    lost: int
    duplicated: int
    altered: int
    epochs: int  # epochs seen by the front end


async def kill_round(cluster: Cluster, frontend: Frontend, method: str, expected: list[int], kill_after: int,
                     freeze: bool = False) -> Round:
    """One session whose serving instance is SIGKILLed (*freeze*: SIGSTOPped, killed after the session) after
    *kill_after* delivered tokens (module docstring)."""
    frozen: list[RoleProcess] = []
    run = session(frontend, method)
    await run.place()
    seen: dict[int, list[int]] = {}
    killed_at: float | None = None
    killed_epoch = 0
    resumed: float | None = None
    killed = ""
    epochs = {run.relay.epoch}
    async for index, token, _ in run.tokens():
        seen.setdefault(index, []).append(token)
        epochs.add(run.relay.epoch)
        if killed_at is not None and resumed is None and run.relay.epoch > killed_epoch:
            resumed = time.perf_counter()
            log.info("first token of epoch %d: index %d", run.relay.epoch, index)
        if killed_at is None and len(seen) == kill_after:
            killed = run.instance
            killed_epoch = run.relay.epoch
            victim = cluster.instances.pop(killed)
            if freeze:
                victim.freeze()
                frozen.append(victim)
            else:
                victim.kill()
            killed_at = time.perf_counter()
            log.info("killed %s after token %d", killed, index)
    for victim in frozen:  # ends as a killed one would, once the session is over
        victim.kill()
    if killed:
        cluster.spawn_soon()  # after the session: a process starting competes for the CPU the resume needs
    if log.isEnabledFor(logging.INFO):
        try:
            log.info("at %s: %s", run.instance, await frontend.api.session_run(run.instance, run.session))
        except Exception as exc:  # the figures are for the log only
            log.info("at %s: %s", run.instance, exc)
    lost = sum(1 for i in range(len(expected)) if i not in seen)
    duplicated = sum(len(v) - 1 for v in seen.values())
    altered = sum(1 for i, v in seen.items() if i >= len(expected) or any(t != expected[i] for t in v))
    ms = None if killed_at is None or resumed is None else (resumed - killed_at) * 1000
    return Round(method, frontend.suspect, killed, kill_after, ms, lost, duplicated, altered, len(epochs))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(rounds: list[Round]) -> dict[str, Any]:
    ms = [r.migration_ms for r in rounds if r.migration_ms is not None]
    out: dict[str, Any] = {"kills": len(rounds), "resumed": len(ms)}
    if ms:
        out.update(p50_ms=round(statistics.median(ms), 1), p95_ms=round(percentile(ms, 0.95), 1),
                   max_ms=round(max(ms), 1), min_ms=round(min(ms), 1))
    for what in ("lost", "duplicated", "altered"):
        out[what] = sum(getattr(r, what) for r in rounds)
    return out


async def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cluster = Cluster(workdir, args.redis, args.status_ttl_ms)
    cluster.model = write_tiny_model(workdir / "tiny")
    cluster.start_index()
    rng = random.Random(args.seed)
    try:
        await asyncio.gather(*(cluster.spawn() for _ in range(3)))
        async with KvspClient(cluster.files(), timeout=10) as client:
            await cluster.up(client, 3)
            frontend = Frontend(client, ServiceEndpoints([cluster.pc], "controller"), cluster.keyer(), Bytes(),
                                "tiny", vocab_size=256)
            if args.no_keepalive:
                frontend.stream_keepalive = None
            await warm(cluster, frontend)
            expected = {m: await reference(frontend, m) for m in METHODS}
            rounds: list[Round] = []
            plan = [True] * args.kills + [False] * args.baseline
            for n, suspect in enumerate(plan):
                await cluster.up(client, 3)  # the replacement of the last round's victim is up, and warm
                await warm(cluster, frontend)
                frontend.suspect = suspect
                method = METHODS[n % 2]
                r = await kill_round(cluster, frontend, method, expected[method], rng.randrange(12, 28),
                                     args.freeze)
                rounds.append(r)
                ms = "-" if r.migration_ms is None else round(r.migration_ms)
                print(f"  {n + 1:2d} {'suspect' if suspect else 'baseline':8s} {method:6s} kill after "
                      f"{r.kill_after:2d}: {ms} ms; lost/dup/altered {r.lost}/{r.duplicated}/{r.altered}; "
                      f"epochs {r.epochs}", file=sys.stderr if args.json else sys.stdout, flush=True)
    finally:
        await cluster.stop()
    report: dict[str, Any] = {"store": "redis" if args.redis else "memory", "status_ttl_ms": args.status_ttl_ms,
                              "keepalive": not args.no_keepalive, "signal": "SIGSTOP" if args.freeze else "SIGKILL"}
    for label, suspect in (("suspect", True), ("baseline", False)):
        picked = [r for r in rounds if r.suspect is suspect]
        if picked:
            report[label] = {m: summary([r for r in picked if r.method == m]) for m in METHODS}
            report[label]["all"] = summary(picked)
    report["rounds"] = [r.__dict__ for r in rounds]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="rounds with suspect reports (20)")
    parser.add_argument("--baseline", type=int, default=4, help="rounds without them, in the same run (4)")
    parser.add_argument("--redis", metavar="URL", help="the PC's store: this Redis (default: memory)")
    parser.add_argument("--status-ttl-ms", type=int, default=3000, help="the instances' status TTL (3000)")
    parser.add_argument("--no-keepalive", action="store_true",
                        help="no QUIC PINGs on the token connections: a kill is noticed by the stall bound")
    parser.add_argument("--freeze", action="store_true",
                        help="SIGSTOP the serving instance instead (SIGKILLed once the session is over)")
    parser.add_argument("--seed", type=int, default=1, help="of the kill points (1)")
    parser.add_argument("--workdir", type=Path, help="keep the model and certificates here")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="the front end's log on stderr")
    args = parser.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        report = asyncio.run(bench(args, args.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="kvsp-migration-") as tmp:
            report = asyncio.run(bench(args, Path(tmp)))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"store {report['store']}, status TTL {report['status_ttl_ms']} ms; kill -> first token of the new epoch")
    for label in ("suspect", "baseline"):
        for method, s in report.get(label, {}).items():
            if "p50_ms" in s:
                print(f"  {label:8s} {method:6s} kills {s['kills']:2d}: p50 {s['p50_ms']:7.1f} ms  p95 "
                      f"{s['p95_ms']:7.1f} ms  max {s['max_ms']:7.1f} ms;  lost {s['lost']} dup {s['duplicated']} "
                      f"altered {s['altered']}")
            else:
                print(f"  {label:8s} {method:6s} kills {s['kills']:2d}: none resumed")


if __name__ == "__main__":
    main()
