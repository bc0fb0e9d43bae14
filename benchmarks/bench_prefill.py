"""Time to first token with the prompt's prefix loaded from a holder over HTTP/3 vs recomputed, and layer-streamed
prefill vs load-then-compute.

    python -m benchmarks.bench_prefill [--reps 3] [--tokens 8192] [--block-tokens 256] [--link-mbit 600] [--quick]

The reference model (gpu/model.py) with seeded random weights, sized to mean something on a 2-core CPU and still
finish in about two minutes: 8 layers, hidden 512, 8 query heads and 2 KV heads of 64 dimensions, SwiGLU 1408,
vocabulary 32000, bf16 (weights, compute and cache), RoPE theta 500000. The prompt has 8192 tokens in blocks of
256 (one block's K and V: 8 layers x 2 x 256 x 2 x 64 x 2 octets = 1 MiB).

The Index Service and a Holder run in a process of their own (one RoleServer: HTTP/3 with mutual TLS, tuned as in
FACTS.md); a second such process sends block bodies through an emulated link of --link-mbit (every body message
leaves once its octets have passed a shared rate limiter), for the case where the network, not the CPU, sets the
load time. The producer PUTs its blocks to the holders and publishes their records. TTFT is measured from the
lookup to the first token (argmax of the last logits), each run with a cache allocated beforehand, medians of
--reps (after a warm-up, except in the long half-prefix case):

* recompute: the whole prompt is prefilled (the engine's chunking: 256-token chunks);
* streamed: lookup, then every matched block streamed with ``BlockFetcher.fetch_layers`` straight into
  :func:`gpu.prefill.prefill`, which computes layer l of the uncached tokens once layer l of every block is in;
* load, then compute: lookup + ``load_prefix`` (every block in), then the same prefill from memory;
* load only / compute only bound the two: max(load, compute) is what perfect overlap would give.

A prompt of 8192 tokens has 32 complete blocks; 31 are loaded (the last token is always computed, and with it its
block). A second prompt shares only its first half with the stored one (4096 tokens loaded, 4096 computed).
Every loaded run's logits are checked to be bit-identical to the recompute's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_h3 import SETTINGS
from gpu.kvcache import PagedKVCache
from gpu.model import LlamaModel
from gpu.modelfiles import ModelConfig, write_random_model
from gpu.prefill import PrefillTrace, prefill, preloaded
from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_client.api import KvspApi
from kvsp_client.retrieval import BlockFetcher
from kvsp_http.holder_app import holder_app
from kvsp_http.index_app import index_app
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.keys import BlockKeyer, scope_id
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.index import IndexService
from kvsp_quic.storage.memory_index import MemoryIndexStore
from quic.tls import TlsFiles

SCOPE_KEY = bytes(range(32))


def model_config(layers: int, hidden: int) -> ModelConfig:
    heads = hidden // 64
    return ModelConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=32000,
                       head_dim=64, rope_theta=500000.0, dtype="bfloat16", max_position_embeddings=1 << 15)


# -- the server process: Index Service at /is/, Holder at /h1/ ------------------------------------------------------


class Router:
    def __init__(self) -> None:
        self.apps: dict[str, Any] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] == "http":
            await self.apps["/" + scope["path"].split("/")[1] + "/"](scope, receive, send)


class Link:
    """The holder's side of an emulated link of *mbit* Mbit/s: every body message leaves when its octets have
    passed the link (one queue for all responses, so concurrent responses share the rate)."""

    def __init__(self, app: Any, mbit: float) -> None:
        self.app = app
        self.rate = mbit * 1e6 / 8
        self.free_at = 0.0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()

        async def paced(message: dict[str, Any]) -> None:
            size = len(message.get("body", b"")) if message["type"] == "http.response.body" else 0
            if size:
                now = loop.time()
                self.free_at = max(now, self.free_at) + size / self.rate
                await asyncio.sleep(self.free_at - now)
            await send(message)

        await self.app(scope, receive, paced)


async def serve(cert_dir: str, descriptor_json: str, link_mbit: str) -> None:
    d = CompatDescriptor.loads(descriptor_json)
    router = Router()
    server = RoleServer(router, TlsFiles.in_dir(cert_dir, "server"), settings=SETTINGS)
    await server.start("127.0.0.1", 0)
    policy = Policy.dev_ca()
    holder = Holder(HolderSettings(server.base_uri("/h1/"), (d,), host_capacity=4 << 30, replica_ttl_ms=3_600_000))
    router.apps["/is/"] = index_app(IndexService(MemoryIndexStore(), clock=time.monotonic), policy, base_path="/is/",
                                    sweep_interval=None)
    router.apps["/h1/"] = holder_app(holder, policy)
    if float(link_mbit):
        router.apps["/h1/"] = Link(router.apps["/h1/"], float(link_mbit))
    print(json.dumps({"port": server.port}), flush=True)
    await asyncio.Event().wait()


def start_servers(cert_dir: str, d: CompatDescriptor, link_mbit: float) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_prefill", "--serve", cert_dir,
                             json.dumps(d.to_json()), str(link_mbit)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["port"]


# -- the runs ------------------------------------------------------------------------------------------------------


async def median_of(reps: int, run: Callable[[], Awaitable[tuple[float, Any]]], *, warmup: bool = True
                    ) -> tuple[float, Any]:
    if warmup:
        await run()
    times, last = [], None
    for _ in range(reps):
        t, last = await run()
        times.append(t)
    return statistics.median(times), last


def timeline(trace: PrefillTrace, t0: float, layers: int) -> str:
    """When each layer was in (first and last block) and when its step ran, in ms from the request."""
    out = []
    for layer in range(layers):
        arrived = [e.t for e in trace.events if e.kind == "arrive" and e.layer == layer]
        span = f"in {(min(arrived) - t0) * 1e3:.0f}-{(max(arrived) - t0) * 1e3:.0f}" if arrived else "in -"
        out.append(f"L{layer} {span} step {(trace.time_of('start', layer) - t0) * 1e3:.0f}-"
                   f"{(trace.time_of('end', layer) - t0) * 1e3:.0f}")
    return "; ".join(out)


async def bench(args: argparse.Namespace, tmp: Path) -> list[tuple[str, float, str]]:
    model_dir = write_random_model(tmp / "model", model_config(args.layers, args.hidden), seed=0)
    model = LlamaModel.load(model_dir)
    b = args.block_tokens
    d = model.descriptor(b)
    scope = scope_id(SCOPE_KEY)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 32000, (args.tokens,), generator=gen).tolist()
    half = args.tokens // 2 // b * b
    other = prompt[:half] + torch.randint(0, 32000, (args.tokens - half,), generator=gen).tolist()
    keyer = BlockKeyer(SCOPE_KEY, d.compat_id, b)
    keys, other_keys = keyer.keys(prompt), keyer.keys(other)
    pages = args.tokens // b + 2

    def cache() -> PagedKVCache:  # an instance allocates its cache once: never inside a timed region
        return PagedKVCache.for_descriptor(d, device_pages=pages)

    async def recompute(tokens: list[int]) -> tuple[float, Any]:
        kv = cache()
        t = time.perf_counter()
        result = await prefill(model, kv, tokens)
        int(result.logits.argmax())
        return time.perf_counter() - t, result

    t_full, full = await median_of(args.reps, lambda: recompute(prompt))
    _t, other_full = await recompute(other)  # the reference logits of the second prompt (same length, same cost)
    rows: list[tuple[str, float, str]] = [(f"recompute all {args.tokens} tokens", t_full, "1.0x (baseline)")]

    cert_dir = tmp / "pki"
    from tests.pki import make_pki

    make_pki(cert_dir, roles={"server": "https://127.0.0.1/"})
    links = [0.0] + ([args.link_mbit] if args.link_mbit else [])
    servers = [start_servers(str(cert_dir), d, mbit) for mbit in links]
    try:
        async with KvspClient(TlsFiles.in_dir(str(cert_dir), "alice"), settings=SETTINGS, timeout=120) as client:
            api = KvspApi(client)
            fetchers = []
            for _proc, port in servers:  # the producer stores its blocks at each holder and publishes them
                base = f"https://127.0.0.1:{port}/"
                for key, page in zip(keys, full.sequence.pages, strict=False):
                    body = c.encode(full.sequence.cache.export_block(page), first_layer=0, token_count=b,
                                    descriptor=d).tobytes()
                    record = await api.put_block(base + "h1/", d.compat_id, scope, key, body)
                    await api.publish(base + "is/", record)
                fetchers.append(BlockFetcher(client, base + "is/", descriptors=[d]))

            async def streamed(fetcher: BlockFetcher, tokens: list[int], block_keys: list[bytes]
                               ) -> tuple[float, Any]:
                kv = cache()
                trace = PrefillTrace()
                t = time.perf_counter()
                found = await fetcher.lookup(d.compat_id, scope, block_keys)
                result = await prefill(model, kv, tokens, [fetcher.fetch_layers(m) for m in found.blocks],
                                       trace=trace)
                int(result.logits.argmax())
                elapsed = time.perf_counter() - t
                if args.trace:
                    print(timeline(trace, t, model.num_layers), file=sys.stderr)
                return elapsed, result

            async def load(fetcher: BlockFetcher, block_keys: list[bytes]) -> tuple[float, Any]:
                t, cpu = time.perf_counter(), time.process_time()
                loaded = await fetcher.load_prefix(d.compat_id, scope, block_keys, concurrency=len(block_keys))
                elapsed = time.perf_counter() - t
                if args.trace:
                    print(f"load: {elapsed * 1e3:.0f} ms, client CPU {(time.process_time() - cpu) * 1e3:.0f} ms",
                          file=sys.stderr)
                return elapsed, [r for r in loaded if r is not None]

            async def load_then_compute(fetcher: BlockFetcher, tokens: list[int], block_keys: list[bytes]
                                        ) -> tuple[float, Any]:
                kv = cache()
                t = time.perf_counter()
                _t, loaded = await load(fetcher, block_keys)
                result = await prefill(model, kv, tokens, [preloaded(r.layers) for r in loaded])
                int(result.logits.argmax())
                return time.perf_counter() - t, result

            async def compute_only(tokens: list[int], loaded: list[Any]) -> tuple[float, Any]:
                kv = cache()
                t = time.perf_counter()
                result = await prefill(model, kv, tokens, [preloaded(r.layers) for r in loaded])
                int(result.logits.argmax())
                return time.perf_counter() - t, result

            async def scenario(label: str, fetcher: BlockFetcher, tokens: list[int], block_keys: list[bytes],
                               reference: Any, warmup: bool) -> None:
                t_load, loaded = await median_of(args.reps, lambda: load(fetcher, block_keys), warmup=warmup)
                t_comp, res = await median_of(args.reps, lambda: compute_only(tokens, loaded), warmup=warmup)
                assert torch.equal(res.logits, reference.logits)
                t_s, res = await median_of(args.reps, lambda: streamed(fetcher, tokens, block_keys), warmup=warmup)
                assert res.loaded_blocks == list(range(len(loaded))) and torch.equal(res.logits, reference.logits)
                t_lc, res = await median_of(args.reps, lambda: load_then_compute(fetcher, tokens, block_keys),
                                            warmup=warmup)
                assert torch.equal(res.logits, reference.logits)
                bound = max(t_load, t_comp)
                rows.extend([
                    (f"**{label}**: {res.computed_from} tokens loaded, {len(tokens) - res.computed_from} computed",
                     float("nan"), ""),
                    ("  load only (lookup + every block, verified)", t_load, f"{len(loaded)} blocks"),
                    ("  compute only (the blocks already in memory)", t_comp, ""),
                    ("  streamed (layer l starts when layer l is in)", t_s,
                     f"**{t_full / t_s:.1f}x faster**; {t_s / bound:.2f} x max(load, compute)"),
                    ("  load, then compute", t_lc,
                     f"{t_full / t_lc:.1f}x faster; {t_lc / bound:.2f} x max(load, compute)"),
                ])

            usable = (args.tokens - 1) // b
            await scenario("whole prefix, HTTP/3 over loopback", fetchers[0], prompt, keys[:usable], full, True)
            if args.link_mbit:
                await scenario(f"whole prefix, HTTP/3 over an emulated {args.link_mbit:g} Mbit/s link", fetchers[1],
                               prompt, keys[:usable], full, True)
            if not args.quick:
                await scenario("half prefix, HTTP/3 over loopback", fetchers[0], other, other_keys[:half // b],
                               other_full, False)
            moved = sum(sum(f.metrics.bytes_by_transport.values()) for f in fetchers)
            failures = sum(f.metrics.digest_failures for f in fetchers)
            rows.append((f"(moved {moved / (1 << 20):.0f} MiB in all, {failures} digest failures)", float("nan"), ""))
    finally:
        for proc, _port in servers:
            proc.terminate()
            proc.wait()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--link-mbit", type=float, default=600.0,
                        help="also run the whole-prefix case behind an emulated link of this rate (600; 0: skip)")
    parser.add_argument("--quick", action="store_true", help="skip the half-prefix case (the long one)")
    parser.add_argument("--trace", action="store_true", help="print each streamed run's timeline to stderr")
    parser.add_argument("--serve", nargs=3, metavar=("CERT_DIR", "DESCRIPTOR", "MBIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(*args.serve))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(bench(args, Path(tmp)))
    c_ = model_config(args.layers, args.hidden)
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; model: "
          f"{c_.num_hidden_layers} layers, hidden {c_.hidden_size}, {c_.num_attention_heads} heads / "
          f"{c_.num_key_value_heads} KV heads x {c_.head_dim}, bf16; blocks of {args.block_tokens} tokens; "
          f"medians of {args.reps}\n")
    print("| time to first token | TTFT | |")
    print("|---|---|---|")
    for label, t, note in rows:
        print(f"| {label} | {'' if t != t else f'{t:.3f} s'} | {note} |")


if __name__ == "__main__":
    main()
