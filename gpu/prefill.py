"""Layer-streamed prefill: compute layer l of the uncached tokens as soon as layer l of every loaded block is in.

    result = await prefill(model, cache, tokens, [fetcher.fetch_layers(m) for m in found.blocks])
    token = int(result.logits.argmax())

Each entry of *blocks* covers block i of the prompt (tokens [i*B, (i+1)*B)), in prefix order: a resident
:class:`~gpu.kvcache.Page` of this cache (an earlier request left it), or an async iterable of verified
:class:`~kvsp_quic.container.DecodedLayer` values in ascending layer order (``BlockFetcher.fetch_layers``, a
MOQT FETCH, ranged GETs). Every block source is consumed concurrently, each arriving layer copied once into its
page. The computation runs layer-major: the step for layer l (every uncached chunk of tokens, in order) starts
once layer l of every loaded block is resident, in a worker thread, so the event loop keeps receiving the later
layers meanwhile.

A block whose source fails or ends early (a digest mismatch with no other replica, a deadline) is recomputed:
its tokens become a chunk that first catches up with the layers already done, then goes on with the others. At
least the last prompt token is always computed (its logits are the output), so at most (N - 1) // B blocks are
used.

Exactness: the uncached tokens are split at the absolute multiples of *chunk_tokens* (default: the block size),
and each chunk's step attends over a context buffer of the same size in both cases, so a prefill with a loaded
prefix of P tokens runs exactly the same kernels on exactly the same operands as a full recompute for every
chunk after P whenever P is a multiple of *chunk_tokens* (always, with the default). Its logits and the K and V it
writes are then bit-identical to the recompute's (tests/test_gpu_prefill.py; docs/gpu.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu.kvcache import DEVICE, Page, PagedKVCache, SequenceKV
from gpu.model import StepModel, chunk_bounds
from gpu.sampling import position_logprobs
from kvsp_quic.container import DecodedLayer

log = logging.getLogger("kvsp.gpu.prefill")

LayerSource = AsyncIterable[DecodedLayer]
BlockInput = Page | LayerSource
Logprobs = tuple[float, tuple[tuple[int, float], ...]]  # kvsp_quic.engine.Logprobs


# -- trace -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceEvent:
    t: float
    kind: str  # "arrive" (block, layer), "fail" (block), "start" / "end" (layer step), "catchup" (block)
    layer: int | None = None
    block: int | None = None


@dataclass
class PrefillTrace:
    """What happened when, for tests and benchmarks (the clock is injected)."""

    clock: Callable[[], float] = time.perf_counter
    events: list[TraceEvent] = field(default_factory=list)

    def add(self, kind: str, layer: int | None = None, block: int | None = None) -> None:
        self.events.append(TraceEvent(self.clock(), kind, layer, block))

    def time_of(self, kind: str, layer: int | None = None, block: int | None = None) -> float:
        for e in self.events:
            if e.kind == kind and (layer is None or e.layer == layer) and (block is None or e.block == block):
                return e.t
        raise KeyError(f"no {kind} event for layer {layer}, block {block}")

    def order(self) -> list[tuple[str, int | None, int | None]]:
        return [(e.kind, e.layer, e.block) for e in self.events]


# -- chunks and layer steps ------------------------------------------------------------------------------------


@dataclass
class Chunk:
    """Consecutive tokens [start, end) that are computed; *hidden* is the input of layer *layer*."""

    start: int
    end: int
    hidden: torch.Tensor
    layer: int = 0


def _page_runs(indexes: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in indexes:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def run_layer(model: StepModel, seq: SequenceKV, layer: int, chunks: Sequence[Chunk], k_ctx: torch.Tensor,
              v_ctx: torch.Tensor, loaded_pages: Sequence[int]) -> None:
    """One layer step: context rows of *loaded_pages* (indexes into ``seq.pages``) are gathered from the cache,
    then every chunk (ascending) is computed, its K and V written to the context and to the sequence's pages."""
    cache = seq.cache
    b = cache.block_tokens
    for first, stop in _page_runs(loaded_pages):
        cache.gather(seq.pages[first:stop], layer, k_ctx[first * b:], v_ctx[first * b:])
    for chunk in chunks:
        start = chunk.start

        def store(k: torch.Tensor, v: torch.Tensor, start: int = start) -> None:
            seq.write(layer, start, k, v)

        chunk.hidden = model.layer_step(layer, chunk.hidden, start, k_ctx, v_ctx, store)
        chunk.layer = layer + 1


def _check_geometry(model: StepModel, cache: PagedKVCache) -> None:
    c = model.config
    if (cache.layers, cache.kv_heads, cache.head_dim) != (c.num_hidden_layers, c.num_key_value_heads, c.head_dim):
        raise ValueError(f"the cache holds {cache.layers} layers x {cache.kv_heads} heads x {cache.head_dim}; the "
                         f"model has {c.num_hidden_layers} x {c.num_key_value_heads} x {c.head_dim}")
    if cache.dtype != model.kv_dtype:
        raise ValueError(f"the cache stores {cache.kv_dtype}; the model's KV element type is {model.kv_dtype_name}")
    if cache.device != model.device:
        raise ValueError(f"the cache's device tier is {cache.device}; the model is on {model.device}")


# -- the prefill -----------------------------------------------------------------------------------------------


@dataclass
class PrefillResult:
    sequence: SequenceKV  # the prompt's pages, referenced (release() when done)
    logits: torch.Tensor  # float32 (vocab,) of the last token; (N - computed_from, vocab) with all_logits
    computed_from: int  # first token of the computed suffix
    loaded_blocks: list[int]  # blocks whose K and V came from the inputs
    recomputed_blocks: list[int]  # inputs that failed and were computed instead
    trace: PrefillTrace
    # with prompt_logprobs: per prompt token, its log probability after the tokens before it and the best
    # alternatives (gpu.sampling.position_logprobs); None for the first token
    prompt_logprobs: list[Logprobs | None] | None = None


class _Loads:
    """Arrival state of the block sources, shared between their receiving tasks and the layer loop."""

    def __init__(self, count: int, layers: int, trace: PrefillTrace) -> None:
        self.arrived = [0] * count  # layers 0..arrived-1 are resident
        self.failed = [False] * count
        self.changed = asyncio.Event()
        self.layers = layers
        self.trace = trace

    def ready(self, layer: int) -> bool:
        return all(f or a > layer for a, f in zip(self.arrived, self.failed, strict=True))

    def fail(self, block: int, why: str) -> None:
        if not self.failed[block]:
            log.info("block %d: %s; it is recomputed", block, why)
            self.failed[block] = True
            self.trace.add("fail", block=block)
            self.changed.set()


async def _receive(index: int, source: LayerSource, page: Page, cache: PagedKVCache, loads: _Loads) -> None:
    try:
        async with contextlib.AsyncExitStack() as stack:
            if hasattr(source, "aclose") or hasattr(source, "__aexit__"):
                stack.push_async_callback(_close, source)
            async for layer in source:
                expected = loads.arrived[index]
                if expected >= loads.layers:
                    raise ValueError(f"layer {layer.index} arrived after all {loads.layers} layers")
                if layer.index != expected:
                    raise ValueError(f"layer {layer.index} arrived, expected {expected} (ascending order)")
                cache.write_layer(page, layer.index, layer.k_parts, layer.v_parts)
                loads.arrived[index] = expected + 1
                loads.trace.add("arrive", layer.index, index)
                loads.changed.set()
    except asyncio.CancelledError:
        if loads.arrived[index] < loads.layers:
            loads.fail(index, "loading was cancelled")
        raise
    except Exception as exc:
        if loads.arrived[index] < loads.layers:
            loads.fail(index, f"its source failed: {exc!r}")
        else:
            log.info("block %d: every layer arrived, then its source failed: %r", index, exc)
        return
    if loads.arrived[index] < loads.layers:
        loads.fail(index, f"its source ended after {loads.arrived[index]} of {loads.layers} layers")


async def _close(source: Any) -> None:
    closer = getattr(source, "aclose", None)
    if closer is not None:
        await closer()


async def prefill(model: StepModel, cache: PagedKVCache, tokens: Sequence[int],
                  blocks: Sequence[BlockInput] = (), *, chunk_tokens: int | None = None,
                  executor: Executor | None = None, trace: PrefillTrace | None = None, all_logits: bool = False,
                  load_timeout: float | None = None, keys: Sequence[bytes] | None = None,
                  prompt_logprobs: int | None = None, decoded_from: int | None = None) -> PrefillResult:
    """Prefill *tokens*, with the K and V of the first ``len(blocks)`` blocks loaded from *blocks*.

    * *chunk_tokens*: the computation's chunk size (default and for exactness: a divisor of the loaded prefix,
      e.g. the block size).
    * *executor*: where the layer steps run (default: asyncio's default executor).
    * *load_timeout*: seconds from the start after which blocks still arriving are given up and recomputed.
    * *keys*: the prompt's Block Keys; its complete pages are named by them in the cache (so later requests,
      and the instance's replica records, find them).
    * *prompt_logprobs*: also compute every prompt token's log probability and that many alternatives
      (``result.prompt_logprobs``): every position is computed then, so *blocks* must be empty. The last token's
      logits are computed as without it (bit for bit): the sampled tokens do not change.
    * *decoded_from*: the positions from here on were first computed one token at a time, by decode steps (a
      resumed session's generated tokens: the prompt's length). Every position at or after it that is computed
      here -- a generated block whose source failed, the suffix -- is computed so again, one token per chunk, and
      no chunk reaches over it (the prompt's tail is the chunk that first computed it). Without it such a block
      would be computed as one chunk of the block: K and V equal to the decode steps' only up to rounding (a matrix
      product's rows depend on how many rows it has on the CPU), and every later logit with them.
    """
    _check_geometry(model, cache)
    n = len(tokens)
    if n < 1:
        raise ValueError("a prompt has at least one token")
    b = cache.block_tokens
    chunk = chunk_tokens or b
    if chunk < 1:
        raise ValueError("chunk_tokens must be positive")
    trace = trace if trace is not None else PrefillTrace()
    layers = model.num_layers

    def bounds(start: int, end: int) -> list[tuple[int, int]]:
        """The chunks of [start, end): at the multiples of *chunk* before *decoded_from*, one token each after."""
        if decoded_from is None or end <= decoded_from:
            return chunk_bounds(start, end, chunk)
        out = chunk_bounds(start, decoded_from, chunk) if start < decoded_from else []
        return out + [(p, p + 1) for p in range(max(start, decoded_from), end)]

    usable = min(len(blocks), (n - 1) // b)
    if prompt_logprobs is not None and usable:
        raise ValueError("prompt log probabilities need the hidden states of every prompt position: load no block")
    for extra in blocks[usable:]:  # the last prompt token is always computed: these are not needed
        if not isinstance(extra, Page):
            await _close(extra)
    seq = SequenceKV(cache)
    sources: list[tuple[int, LayerSource, Page]] = []
    tasks: list[asyncio.Task[None]] = []
    loads = _Loads(usable, layers, trace)
    try:
        for i, item in enumerate(blocks[:usable]):
            if isinstance(item, Page):
                if not item.complete:
                    raise ValueError(f"block {i}: page {item.id} does not hold every layer")
                cache.acquire(item)
                seq.append_page(item)
                cache.ensure_device(item)
                loads.arrived[i] = layers
            else:
                page = cache.new_page()
                seq.append_page(page)
                sources.append((i, item, page))
        seq.reserve(n)
        seq.tokens = n
        tasks = [asyncio.create_task(_receive(i, src, page, cache, loads)) for i, src, page in sources]
        loop = asyncio.get_running_loop()
        deadline = None if load_timeout is None else loop.time() + load_timeout

        rows = len(seq.pages) * b
        k_ctx, v_ctx = model.new_context(rows)
        suffix = usable * b
        chunks = [Chunk(s, e, model.embed(tokens[s:e])) for s, e in bounds(suffix, n)]
        converted: set[int] = set()
        for layer in range(layers):
            while not loads.ready(layer):
                loads.changed.clear()
                if loads.ready(layer):
                    break
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    await asyncio.wait_for(loads.changed.wait(), timeout)
                except TimeoutError:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
            new = [i for i in range(usable) if loads.failed[i] and i not in converted]
            catchup: list[Chunk] = []
            for i in new:
                converted.add(i)
                trace.add("catchup", layer, i)
                catchup += [Chunk(s, e, model.embed(tokens[s:e])) for s, e in bounds(i * b, (i + 1) * b)]
            if catchup:
                chunks = sorted(chunks + catchup, key=lambda c: c.start)
            loaded_now = [i for i in range(usable) if not loads.failed[i]]

            def step(layer: int = layer, chunks: list[Chunk] = chunks, catchup: list[Chunk] = catchup,
                     loaded_now: list[int] = loaded_now) -> None:
                for j in range(layer if catchup else 0):  # failed blocks catch up with the layers done so far
                    resident = [p for p, page in enumerate(seq.pages) if page.resident(j, DEVICE)]
                    run_layer(model, seq, j, catchup, k_ctx, v_ctx, resident)
                run_layer(model, seq, layer, chunks, k_ctx, v_ctx, loaded_now)

            trace.add("start", layer)
            await loop.run_in_executor(executor, step)
            trace.add("end", layer)
        if all_logits:
            regular = [c for c in chunks if c.start >= suffix]
            logits = torch.cat([model.logits(c.hidden) for c in regular])
        else:
            logits = model.logits(chunks[-1].hidden[-1:])[0]
        per_position: list[Logprobs | None] | None = None
        if prompt_logprobs is not None:
            top = prompt_logprobs

            def score() -> list[Logprobs | None]:
                out: list[Logprobs | None] = [None]  # the first token follows nothing
                for c in chunks:  # every position, in order (nothing was loaded)
                    rows = min(c.end, n - 1) - c.start  # the last position's row predicts the first output token
                    if rows > 0:
                        out += position_logprobs(model.logits(c.hidden[:rows]), tokens[c.start + 1:c.start + 1 + rows],
                                                 top)
                return out

            per_position = await loop.run_in_executor(executor, score)
        loaded = [i for i in range(usable) if not loads.failed[i]]
        if keys is not None:
            for i, page in enumerate(seq.pages[:min(len(keys), n // b)]):
                if page.key is None and cache.lookup(keys[i]) is None:
                    cache.set_key(page, keys[i])
        return PrefillResult(seq, logits, suffix, loaded, sorted(converted), trace, per_position)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        seq.release()
        raise
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


async def preloaded(layers: Iterable[DecodedLayer]) -> AsyncIterator[DecodedLayer]:
    """Layers already in memory (``FetchResult.layers``, a decoded container) as a block source."""
    for layer in layers:
        yield layer


def prefill_sync(model: StepModel, cache: PagedKVCache, tokens: Sequence[int], **kwargs: Any) -> PrefillResult:
    """A full recompute (nothing loaded), for code without an event loop."""
    return asyncio.run(prefill(model, cache, tokens, (), **kwargs))


__all__ = [
    "BlockInput",
    "Chunk",
    "LayerSource",
    "PrefillResult",
    "PrefillTrace",
    "TraceEvent",
    "prefill",
    "prefill_sync",
    "preloaded",
    "run_layer",
]
