"""The instance's engine: the model, its paged KV cache, and the one thread that runs torch.

    engine = Engine.load("models/tiny", device="cpu", block_tokens=16, device_pages=1024)
    result = await engine.prefill(tokens, blocks, keys=keys)          # layer steps on the engine thread
    logits = await engine.decode(result.sequence, token)

Every torch computation of every session (layer steps of prefills, decode steps, sampling, digests of pages read
from a CUDA tier) runs on one executor thread, in the order submitted, so requests interleave step by step and the
event loop stays free for the network: blocks arriving for a prefill or a prefetch directive are copied into their
pages on the event loop (a memcpy, ``PagedKVCache.write_layer``) while the engine thread computes.

The instance's service sees these through the Protocols of :mod:`kvsp_quic.engine` (it never imports ``gpu``):

* :class:`Engine` -- model, cache, executor, measured prefill and decode rates: an
  :class:`~kvsp_quic.engine.InstanceEngine`.
* :func:`run_session` (:meth:`Engine.run`) -- one session: the prefill (blocks loaded or streamed, the rest
  computed), the decode steps that replay a resumed session's generated tokens exactly as they were first computed,
  then generation, naming every completed page by its Block Key as it completes.
* :class:`CacheHolder` -- the instance as a holder of its own tiers: a :class:`~kvsp_quic.engine.PageHolder`
  (leases, the publisher's outbox, the HTTP and MOQT block resources) over the cache's pages, with their
  device/host residency, pinned while leased, withdrawn when evicted.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from gpu.generate import decode_step
from gpu.kvcache import DEVICE, Page, PagedKVCache
from gpu.model import LlamaModel, StepModel
from gpu.prefill import BlockInput, PrefillResult, PrefillTrace, prefill
from gpu.sampling import Pick, TokenSampler
from kvsp_quic.auth import Principal
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import ContainerHeader, EncodedContainer
from kvsp_quic.engine import PageHolder, PrefixUnavailable, RunEnd, RunPlan, SessionHooks
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.problems import NotFound
from kvsp_quic.records import LeaseRenewal, LeaseRequest, LeaseResponse, ReplicaRecord, ResidencyEntry, Sampler
from kvsp_quic.roles.holder import HolderSettings, Replica
from kvsp_quic.roles.instance import ENGINE_NAMES, EngineFigures, RateMeter
from kvsp_quic.storage.tiers import BlockId, BlockMeta, LruPolicy, Tier, TieredStore

T = TypeVar("T")
ENGINES = ENGINE_NAMES


class Engine:
    """A model and its cache on one device, computed on one thread (a :class:`kvsp_quic.engine.InstanceEngine`)."""

    def __init__(self, model: StepModel, cache: PagedKVCache, descriptor: CompatDescriptor, *,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.model = model
        self.cache = cache
        self.descriptor = descriptor
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsp-engine")
        self.prefill_rate = RateMeter()  # computed prompt tokens per second of layer steps (EMA)
        self.decode_rate = RateMeter()  # decode steps per second (EMA; one engine thread: no batching)
        self.prefill_tokens = 0  # computed by prefills
        self.loaded_tokens = 0  # loaded into prefills instead
        self.decode_tokens = 0

    @classmethod
    def load(cls, directory: str, *, device: str = "cpu", dtype: str | None = None, kv_dtype: str | None = None,
             block_tokens: int = 16, device_pages: int = 1024, host_pages: int = 0,
             name: str | None = None, engine: str = "reference") -> Engine:
        """The model of *directory* computed by *engine* (one of :data:`ENGINES`: ``reference``, our Llama model;
        ``transformers``, the model's own Hugging Face modules, gpu/hf_engine.py), with its paged cache. Both
        derive the same descriptor for the directory, and both stream prefills layer by layer."""
        model: StepModel
        if engine == "reference":
            model = LlamaModel.load(directory, device=device, dtype=dtype, kv_dtype=kv_dtype)
        elif engine == "transformers":
            from gpu.hf_engine import HfModel

            model = HfModel.load(directory, device=device, dtype=dtype, kv_dtype=kv_dtype)
        else:
            raise ValueError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
        descriptor = model.descriptor(block_tokens, name=name)
        cache = PagedKVCache.for_descriptor(descriptor, device=model.device, device_pages=device_pages,
                                            host_pages=host_pages)
        return cls(model, cache, descriptor)

    @property
    def block_tokens(self) -> int:
        return self.cache.block_tokens

    @property
    def name(self) -> str:
        """The engine that computes: ``reference`` or ``transformers``."""
        return self.model.engine_name

    @property
    def build(self) -> str:
        """Its build fingerprint (library versions, device type, KV dtype): equal fingerprints, equal bits."""
        return self.model.build

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def figures(self) -> EngineFigures:
        return EngineFigures(kv_utilization=self.cache.utilization(), prefill_tokens_per_s=self.prefill_rate.value,
                             decode_tokens_per_s=self.decode_rate.value)

    def check_sampler(self, sampler: Sampler) -> None:
        """ValueError when :class:`~gpu.sampling.TokenSampler` cannot sample with *sampler*."""
        TokenSampler.from_record(sampler).check_vocab(self.model.config.vocab_size)

    async def run(self, plan: RunPlan[Page], hooks: SessionHooks[Page]) -> RunEnd:
        return await run_session(self, plan, hooks)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """*fn(*args)* on the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def prefill(self, tokens: Sequence[int], blocks: Sequence[BlockInput] = (), *,
                      keys: Sequence[bytes] | None = None, load_timeout: float | None = None,
                      prompt_logprobs: int | None = None, decoded_from: int | None = None) -> PrefillResult:
        trace = PrefillTrace()
        result = await prefill(self.model, self.cache, tokens, blocks, executor=self.executor, trace=trace,
                               keys=keys, load_timeout=load_timeout, prompt_logprobs=prompt_logprobs,
                               decoded_from=decoded_from)
        computed = len(tokens) - len(result.loaded_blocks) * self.block_tokens
        busy = 0.0
        started: float | None = None
        for event in trace.events:
            if event.kind == "start":
                started = event.t
            elif event.kind == "end" and started is not None:
                busy += event.t - started
                started = None
        self.prefill_tokens += computed
        self.loaded_tokens += len(result.loaded_blocks) * self.block_tokens
        self.prefill_rate.add(computed, busy)
        return result

    async def decode(self, seq: Any, token: int) -> torch.Tensor:
        def step() -> tuple[torch.Tensor, float]:
            t0 = time.perf_counter()
            logits = decode_step(self.model, seq, token)
            return logits, time.perf_counter() - t0

        logits, seconds = await self.call(step)
        self.decode_tokens += 1
        self.decode_rate.add(1, seconds)
        return logits

    async def sample(self, sampler: TokenSampler, logits: torch.Tensor) -> Pick:
        return await self.call(sampler.choose, logits)

    async def warmup(self, tokens: int) -> None:
        """A throwaway prefill of *tokens* tokens and a few decode steps: the first torch calls are slow, and the
        rates it measures are in the first status record."""
        if tokens < 1:
            return
        vocab = self.model.config.vocab_size
        prompt = [(7 * i + 3) % vocab for i in range(tokens)]
        result = await self.prefill(prompt)
        try:
            for token in prompt[:3]:
                await self.decode(result.sequence, token)
        finally:
            result.sequence.release()

    def page_sections(self, page: Page, first: int = 0, last: int | None = None) -> list[tuple[bytes, bytes]]:
        """Copies of layers *first*..*last* of *page* (kvsp-layout-1 sections), safe to keep after the page goes.
        Call with a reference held on the page."""
        last = self.cache.layers - 1 if last is None else last
        out = []
        for layer in range(first, last + 1):
            k, v = self.cache.read_layer(page, layer)
            out.append((bytes(k), bytes(v)))
        return out

    async def digests(self, page: Page) -> tuple[bytes, ...]:
        """The layer digests of a complete page (SHA-256 of K || V per layer), on the engine thread."""
        def run() -> tuple[bytes, ...]:
            out = []
            for layer in range(self.cache.layers):
                k, v = self.cache.read_layer(page, layer)
                h = hashlib.sha256(k)
                h.update(v)
                out.append(h.digest())
            return tuple(out)

        return await self.call(run)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


# -- one session ---------------------------------------------------------------------------------------------


async def run_session(engine: Engine, plan: RunPlan[Page], hooks: SessionHooks[Page]) -> RunEnd:
    """Run one session (:class:`~kvsp_quic.engine.RunPlan`); returns the reason it ended."""
    cache = engine.cache
    sampler = TokenSampler.from_record(plan.sampler, plan.output)
    b = cache.block_tokens
    # the prompt's length: the positions after it were first computed by decode steps (a resume's generated
    # tokens, prefilled or replayed), and a generated block recomputed here must be computed as they were
    prompt_len = len(plan.tokens) + len(plan.replay) - len(plan.output)
    result = await engine.prefill(plan.tokens, plan.blocks, keys=plan.keys, load_timeout=plan.load_timeout,
                                  prompt_logprobs=plan.prompt_logprobs, decoded_from=prompt_len)
    seq = result.sequence
    try:
        lost = [i for i in result.recomputed_blocks if i < plan.must_load]
        if lost:
            raise PrefixUnavailable(f"prompt block(s) {lost} could not be loaded and their tokens are unknown")
        _name_pages(cache, seq.pages[:seq.tokens // b], plan.keys, hooks)
        hooks.prefilled(result)
        logits = result.logits
        for token in plan.replay:
            logits = await engine.decode(seq, token)
            _after_decode(cache, seq, plan, token, hooks)
        for n in range(1, plan.max_new + 1):
            token, logprobs = await engine.sample(sampler, logits)
            if not hooks.token(token, logprobs):
                return RunEnd.FENCED
            if token in plan.stop:
                return RunEnd.STOP
            if n == plan.max_new:
                break
            logits = await engine.decode(seq, token)
            _after_decode(cache, seq, plan, token, hooks)
        return RunEnd.LENGTH
    finally:
        seq.release()


def _name_pages(cache: PagedKVCache, pages: Sequence[Page], keys: Sequence[bytes], hooks: SessionHooks[Page]) -> None:
    for page, key in zip(pages, keys, strict=False):
        _name(cache, page, key, hooks)


def _name(cache: PagedKVCache, page: Page, key: bytes, hooks: SessionHooks[Page]) -> None:
    if page.key is None:
        if cache.lookup(key) is not None:
            return  # another page holds this block already (loaded by a directive meanwhile)
        cache.set_key(page, key)
    if page.key == key:
        hooks.page_complete(page, key)


def _after_decode(cache: PagedKVCache, seq: Any, plan: RunPlan[Page], token: int, hooks: SessionHooks[Page]) -> None:
    """*token*'s K and V are in: name the page it completed, if any."""
    if plan.chain is None:
        return
    new = plan.chain.append([token])
    start = plan.chain_first_block + len(plan.chain.keys) - len(new)
    for j, key in enumerate(new):
        _name(cache, seq.pages[start + j], key, hooks)


# -- the instance as a holder of its own tiers -----------------------------------------------------------------


def _page_header(descriptor: CompatDescriptor, cache: PagedKVCache) -> ContainerHeader:
    """The header of the container of one complete page (every layer, codec raw)."""
    section = descriptor.section_length(cache.block_tokens)
    return ContainerHeader(codec=1, first_layer=0, token_count=cache.block_tokens,
                           lengths=((section, section),) * cache.layers)


class CacheTier(Tier):
    """Bookkeeping only: the blocks live in the cache's pages, and the cache evicts (footprint 0, never full).
    Its *capacity* is what the cache's pages hold (the containers of all its pages, device and host tiers): the
    holder's global lease cap (``max_leased_fraction`` of its capacity, kvsp_quic/roles/leases.py) is taken from it;
    it was 1 octet, which refused every lease at an instance."""

    def __init__(self, capacity: int) -> None:
        super().__init__(DEVICE, capacity, LruPolicy())

    def footprint(self, meta: BlockMeta) -> int:
        return 0

    def _keep(self, meta: BlockMeta, data: memoryview) -> None:
        pass

    def _read(self, meta: BlockMeta) -> memoryview:  # pragma: no cover - CacheHolder reads pages itself
        raise KeyError(meta.id)

    def _forget(self, meta: BlockMeta) -> None:
        pass


class CacheHolder(PageHolder[Page]):
    """A :class:`~kvsp_quic.engine.PageHolder` whose replicas are the named pages of an instance's cache.

    Records carry the page's residency (which layers in the device tier, which in the host tier); blocks are
    served from copies of the page's sections taken while holding a reference on it; a leased page holds a
    reference (the cache never evicts a referenced page); an evicted page is withdrawn, a demoted one republished.
    The cache may call back from the engine thread: ``attach`` routes those calls through the event loop.
    """

    def __init__(self, settings: HolderSettings, cache: PagedKVCache, *, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        pages = sum(pool.capacity for pool in cache.tiers.values())
        header = _page_header(settings.descriptors[0], cache)
        super().__init__(settings, clock=clock,
                         store=TieredStore([CacheTier(pages * (header.size + header.data_length))]))
        self.cache = cache
        self._pages: dict[BlockId, Page] = {}
        self._by_key: dict[bytes, BlockId] = {}
        self._pinned: set[BlockId] = set()

    def attach(self, call_soon_threadsafe: Callable[..., object]) -> None:
        """Take the cache's eviction and residency callbacks (they may come from the engine thread: they run through
        *call_soon_threadsafe*, e.g. the event loop's)."""
        def evicted(page: Page) -> None:
            if page.key is not None:
                call_soon_threadsafe(self.forget, page.key)

        def moved(page: Page) -> None:
            if page.key is not None:
                call_soon_threadsafe(self.residency_changed, page.key)

        self.cache.on_evict = evicted
        self.cache.on_residency = moved

    # -- replicas ---------------------------------------------------------------------------------------------

    def holds(self, key: bytes) -> bool:
        """Whether the cache has a complete page for *key* (published or about to be)."""
        return self.cache.lookup(key) is not None

    def page_of(self, key: bytes) -> Page | None:
        return self.cache.lookup(key)

    def adopted(self, key: bytes) -> bool:
        return bytes(key) in self._by_key

    def adopt(self, scope_id: bytes, key: bytes, page: Page, layer_digests: Sequence[bytes]) -> ReplicaRecord | None:
        """Serve and publish the named complete *page* as a replica of *key* in *scope_id*."""
        key = bytes(key)
        if page.dropped or page.key != key or not page.complete or key in self._by_key:
            return None
        descriptor = self.settings.descriptors[0]
        header = _page_header(descriptor, self.cache)
        block = BlockId(bytes(descriptor.compat_id), bytes(scope_id), key)
        meta = BlockMeta(block, header, tuple(layer_digests), header.size + header.data_length)
        now = self.clock()
        self.storage.put(meta, memoryview(b""), self.leases.protects)
        rep = Replica(meta, meta.digest, now, now + self.settings.replica_ttl_ms / 1000, None)
        self._replicas[block] = rep
        self._pages[block] = page
        self._by_key[key] = block
        self.metrics["stored"] += 1
        self.outbox.publish(block, now)
        return self._record(block, rep, now)

    def forget(self, key: bytes) -> None:
        """The cache evicted *key*'s page: drop the replica and withdraw its record."""
        block = self._by_key.pop(bytes(key), None)
        if block is None:
            return
        self._pages.pop(block, None)
        self._replicas.pop(block, None)
        self._pinned.discard(block)
        self.storage.remove(block)
        self.metrics["evicted"] += 1
        self.outbox.withdraw(block, self.clock())

    def residency_changed(self, key: bytes) -> None:
        block = self._by_key.get(bytes(key))
        if block is not None and block in self._replicas:
            self.outbox.publish(block, self.clock())

    def replica(self, block: BlockId) -> Replica | None:
        page = self._pages.get(block)
        if page is None or page.dropped:
            return None
        return super().replica(block)

    def _record(self, block: BlockId, rep: Replica, now: float) -> ReplicaRecord:
        page = self._pages[block]
        residency = self.cache.residency(page) or (ResidencyEntry(DEVICE, (0, self.cache.layers - 1)),)
        return ReplicaRecord(
            block_key=BlockKey(block.block_key), compat_id=CompatId(block.compat_id),
            scope_id=ScopeId(block.scope_id), holder=self.base_uri, codec=rep.codec, size=rep.meta.size,
            digest=rep.digest, residency=residency, ttl_ms=self._record_ttl_ms(rep, now),
            layer_digests=rep.meta.layer_digests)

    def _sections(self, block: BlockId, rep: Replica, first: int, last: int) -> tuple[str, EncodedContainer]:
        """Layers *first*..*last* read out of the block's cache page (the checks are the holder's)."""
        page = self._pages[block]
        try:
            self.cache.acquire(page)
        except KeyError:
            raise NotFound(f"the replica of {block.block_key.hex()} was just evicted") from None
        try:
            tier = DEVICE if page.ready[DEVICE][first] else "host"
            sections = []
            for layer in range(first, last + 1):
                k, v = self.cache.read_layer(page, layer)
                sections += [bytes(k), bytes(v)]  # a copy: the slot may be reused once the page is released
        finally:
            self.cache.release(page)
        header = ContainerHeader(codec=rep.codec, first_layer=first, token_count=self.cache.block_tokens,
                                 lengths=tuple((len(sections[2 * i]), len(sections[2 * i + 1]))
                                               for i in range(last - first + 1)))
        return tier, EncodedContainer(header, header.pack(), tuple(memoryview(s) for s in sections),
                                      tuple(rep.meta.layer_digests[first:last + 1]))

    # -- leases pin pages ------------------------------------------------------------------------------------

    def sync_pins(self) -> None:
        """A leased replica's page holds a reference (the cache evicts only unreferenced pages)."""
        for block, page in list(self._pages.items()):
            want = self.leases.protects(block)
            if want and block not in self._pinned:
                try:
                    self.cache.acquire(page)
                except KeyError:
                    continue
                self._pinned.add(block)
            elif not want and block in self._pinned:
                self._pinned.discard(block)
                self.cache.release(page)

    def create_lease(self, principal: Principal, request: LeaseRequest) -> LeaseResponse:
        granted = super().create_lease(principal, request)
        self.sync_pins()
        return granted

    def renew_lease(self, principal: Principal, lease_id: Any, renewal: LeaseRenewal) -> LeaseResponse:
        granted = super().renew_lease(principal, lease_id, renewal)
        self.sync_pins()
        return granted

    def release_lease(self, principal: Principal, lease_id: Any) -> None:
        super().release_lease(principal, lease_id)
        self.sync_pins()

    def tick(self) -> None:
        super().tick()
        self.sync_pins()

    def begin_store(self, principal: Principal, compat_id: bytes, scope_id: bytes, block_key: bytes,
                    if_none_match: str | None) -> Any:
        raise NotFound("an instance stores blocks it computes or loads itself; PUT is not offered")


__all__ = [
    "ENGINES", "CacheHolder", "CacheTier", "Engine", "PrefixUnavailable", "RunEnd", "RunPlan", "SessionHooks",
    "run_session",
]
