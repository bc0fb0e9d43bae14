"""gpu/prefill.py and gpu/generate.py: a prefill with a loaded prefix equals a full recompute, and it computes
layer l while later layers are still arriving.

The exactness tests load the prefix from a real holder: one RoleServer (HTTP/3 + HTTP/1.1/2, mutual TLS) serves
the Index Service at ``/is/`` and a Holder at ``/h1/`` on 127.0.0.1; a producer prefill stores its blocks there
and publishes them, and a consumer looks them up and streams them with BlockFetcher.fetch_layers into its own
prefill. The streaming tests use fake sources that deliver layers slowly and out of lockstep across blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the gpu extra (safetensors) is not installed")

from gpu.generate import decode_step, generate_tokens  # noqa: E402
from gpu.kvcache import PagedKVCache  # noqa: E402
from gpu.model import LlamaModel  # noqa: E402
from gpu.modelfiles import ModelConfig, write_random_model  # noqa: E402
from gpu.prefill import PrefillResult, PrefillTrace, prefill, prefill_sync, preloaded  # noqa: E402
from gpu.sampling import TokenSampler  # noqa: E402
from http3.client import KvspClient  # noqa: E402
from http3.server import RoleServer  # noqa: E402
from kvsp_client.retrieval import BlockFetcher  # noqa: E402
from kvsp_http.holder_app import holder_app  # noqa: E402
from kvsp_http.index_app import index_app  # noqa: E402
from kvsp_quic import container as c  # noqa: E402
from kvsp_quic.auth import ALL, Policy, Principal, Role  # noqa: E402
from kvsp_quic.compat import CompatDescriptor  # noqa: E402
from kvsp_quic.container import DecodedLayer  # noqa: E402
from kvsp_quic.keys import BlockKeyer, holder_id, scope_id  # noqa: E402
from kvsp_quic.roles.holder import Holder, HolderSettings  # noqa: E402
from kvsp_quic.roles.index import IndexService  # noqa: E402
from kvsp_quic.storage.memory_index import MemoryIndexStore  # noqa: E402
from tests.asgi import Router  # noqa: E402
from tests.pki import TestPki  # noqa: E402

B = 4  # block tokens
LAYERS = 4
SCOPE_KEY = bytes(range(32))
ALICE = "urn:kvsp:client:alice"
ADMIN = Principal("urn:test:admin", frozenset({Role.HOLDER}), ALL, ALL)
PROMPT = [(7 * i + 3) % 256 for i in range(6 * B + 3)]  # six complete blocks and three tokens
CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda:0", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])]


def tiny_config(dtype: str = "float32") -> ModelConfig:
    return ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, head_dim=16, rope_theta=500000.0, dtype=dtype,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {dtype: write_random_model(root / dtype, tiny_config(dtype), seed=11) for dtype in ("float32", "bfloat16")}


def load(model_dirs: dict[str, Path], dtype: str = "float32", device: str = "cpu", kv_dtype: str | None = None
         ) -> LlamaModel:
    return LlamaModel.load(model_dirs[dtype], device=device, kv_dtype=kv_dtype)


def new_cache(model: LlamaModel, pages: int = 32) -> PagedKVCache:
    return PagedKVCache(layers=model.num_layers, kv_heads=model.kv_heads, head_dim=model.head_dim, block_tokens=B,
                        kv_dtype=model.kv_dtype_name, device=model.device, device_pages=pages)


def exported(cache: PagedKVCache, result: PrefillResult, blocks: int) -> list[list[tuple[bytes, bytes]]]:
    return [[(bytes(k), bytes(v)) for k, v in cache.export_block(page)] for page in result.sequence.pages[:blocks]]


def greedy(model: LlamaModel, result: PrefillResult, n: int = 6) -> list[int]:
    """Greedy continuation (decoding into the result's sequence)."""
    if result.logits.dim() == 2:  # all_logits: the last row is the last token's
        result = dataclasses.replace(result, logits=result.logits[-1])
    return generate_tokens(model, result, TokenSampler("greedy"), max_new_tokens=n).tokens


# -- the holder --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Net:
    server: RoleServer
    router: Router
    index: IndexService
    holder: Holder
    client: KvspClient
    alice: Principal

    def uri(self, name: str) -> str:
        return self.server.base_uri(f"/{name}/")

    async def store(self, d: CompatDescriptor, key: bytes, sections: Sequence[tuple[bytes, bytes]]) -> None:
        """The producer's PUT: the block stored at the holder and its record published at the index."""
        body = c.encode(list(sections), first_layer=0, token_count=B, descriptor=d).tobytes()
        record = self.holder.store(self.alice, d.compat_id, SCOPE_KEY_ID, key, body, "*")
        await self.index.publish(ADMIN, holder_id(record.holder), key, record)

    def fetcher(self, d: CompatDescriptor) -> BlockFetcher:
        return BlockFetcher(self.client, self.uri("is"), descriptors=[d], lease_ms=2000)


SCOPE_KEY_ID = scope_id(SCOPE_KEY)


@pytest.fixture
async def net(certs: TestPki, model_dirs: dict[str, Path]) -> AsyncIterator[Net]:
    router = Router()
    server = RoleServer(router, certs.files("server"))
    await server.start("127.0.0.1", 0)
    descriptors = tuple(LlamaModel.load(p).descriptor(B) for p in model_dirs.values())
    policy = Policy.from_dict({"principal": [
        {"identity": ALICE, "roles": ["client", "instance", "holder"], "scopes": [SCOPE_KEY_ID.hex()]}]})
    index = IndexService(MemoryIndexStore(), clock=time.monotonic)
    holder = Holder(HolderSettings(server.base_uri("/h1/"), descriptors, replica_ttl_ms=60_000))
    router.apps["/is/"] = index_app(index, policy, base_path="/is/", sweep_interval=None)
    router.apps["/h1/"] = holder_app(holder, policy)
    client = KvspClient(certs.files("alice"), timeout=10.0)
    alice = policy.principal(ALICE)
    assert alice is not None
    try:
        yield Net(server, router, index, holder, client, alice)
    finally:
        await client.aclose()
        await server.close()


async def produce_and_consume(net: Net, model: LlamaModel, *, stored_blocks: int = 6
                              ) -> tuple[PrefillResult, PrefillResult, PagedKVCache, PagedKVCache]:
    """Producer: full recompute, blocks stored at the holder. Consumer: lookup, streamed prefill."""
    d = model.descriptor(B)
    keys = BlockKeyer(SCOPE_KEY, d.compat_id, B).keys(PROMPT)
    producer_cache = new_cache(model)
    full = await prefill(model, producer_cache, PROMPT, all_logits=True)
    for key, sections in zip(keys[:stored_blocks], exported(producer_cache, full, stored_blocks), strict=True):
        await net.store(d, key, sections)
    fetcher = net.fetcher(d)
    found = await fetcher.lookup(d.compat_id, SCOPE_KEY_ID, keys)
    assert found.matched == stored_blocks
    consumer_cache = new_cache(model)
    loaded = await prefill(model, consumer_cache, PROMPT, [fetcher.fetch_layers(m) for m in found.blocks],
                           all_logits=True, keys=keys)
    assert fetcher.metrics.hits == stored_blocks and fetcher.metrics.digest_failures == 0
    return full, loaded, producer_cache, consumer_cache


# -- exactness -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
async def test_fp32_prefix_loaded_from_a_holder_equals_a_full_recompute_exactly(net: Net, model_dirs: dict[str, Path],
                                                                               device: str) -> None:
    model = load(model_dirs, "float32", device)
    full, loaded, producer_cache, consumer_cache = await produce_and_consume(net, model)
    assert loaded.loaded_blocks == list(range(6)) and loaded.computed_from == 6 * B
    assert loaded.recomputed_blocks == []
    assert torch.equal(loaded.logits, full.logits[6 * B:])  # every computed position, bit for bit
    # the K and V the consumer computed for the tail equal the producer's, and the loaded ones arrived intact
    assert exported(consumer_cache, loaded, 7) == exported(producer_cache, full, 7)
    assert greedy(model, loaded) == greedy(model, full)
    assert net.router.block_gets == 6


async def test_a_partial_match_computes_the_rest_exactly(net: Net, model_dirs: dict[str, Path]) -> None:
    model = load(model_dirs)
    full, loaded, *_ = await produce_and_consume(net, model, stored_blocks=3)
    assert loaded.computed_from == 3 * B and loaded.loaded_blocks == [0, 1, 2]
    assert torch.equal(loaded.logits, full.logits[3 * B:])


@pytest.mark.parametrize("device", DEVICES)
async def test_bf16_prefix_loaded_from_a_holder(net: Net, model_dirs: dict[str, Path], device: str) -> None:
    """bf16 on the same device: exact as well (same kernels on the same operands). Against the fp32 computation
    of the same bf16 weights the logits agree within the stated tolerance: |diff| <= 0.1 + 0.05 |logit|."""
    model = load(model_dirs, "bfloat16", device)
    assert model.dtype is torch.bfloat16 and model.kv_dtype_name == "bf16"
    full, loaded, *_ = await produce_and_consume(net, model)
    assert torch.equal(loaded.logits, full.logits[6 * B:])
    assert greedy(model, loaded) == greedy(model, full)
    reference = LlamaModel.load(model_dirs["bfloat16"], device=device, dtype="fp32")  # same weights, fp32 math
    assert reference.kv_dtype_name == "fp32"
    ref = (await prefill(reference, new_cache(reference), PROMPT, all_logits=True)).logits[6 * B:]
    assert torch.allclose(loaded.logits, ref, atol=0.1, rtol=0.05), (loaded.logits - ref).abs().max()


async def test_fp8_cache_is_exact_between_loaded_and_recomputed(model_dirs: dict[str, Path]) -> None:
    model = load(model_dirs, "bfloat16", kv_dtype="fp8-e4m3")
    assert model.descriptor(B).kv_dtype == "fp8-e4m3"
    producer = new_cache(model)
    full = await prefill(model, producer, PROMPT, all_logits=True)
    blocks = exported(producer, full, 6)
    assert len(blocks[0][0][0]) == B * model.kv_heads * model.head_dim  # one octet per element
    loaded = await prefill(model, new_cache(model), PROMPT, [source(blocks[i]) for i in range(6)], all_logits=True)
    assert torch.equal(loaded.logits, full.logits[6 * B:])


async def test_pages_of_an_earlier_request_are_reused_and_decoding_matches(model_dirs: dict[str, Path]) -> None:
    model = load(model_dirs)
    d = model.descriptor(B)
    keys = BlockKeyer(SCOPE_KEY, d.compat_id, B).keys(PROMPT)
    cache = new_cache(model, pages=24)
    first = await prefill(model, cache, PROMPT, keys=keys, all_logits=True)
    assert [cache.lookup(k) for k in keys] == first.sequence.pages[:6]
    first_tokens = greedy(model, first, 5)
    first.sequence.release()  # keyed pages stay in the cache
    hits = [cache.lookup(k) for k in keys]
    assert all(p is not None for p in hits)
    again = await prefill(model, cache, PROMPT, [p for p in hits if p is not None], all_logits=True)
    assert again.loaded_blocks == list(range(6)) and torch.equal(again.logits, first.logits[6 * B:])
    assert greedy(model, again, 5) == first_tokens
    # a whole-prompt match still computes the last token: at most (N - 1) // B blocks are used
    exact = PROMPT[:6 * B]
    result = await prefill(model, cache, exact, [p for p in hits if p is not None])
    assert result.computed_from == 5 * B and result.loaded_blocks == list(range(5))


async def test_decode_steps_continue_the_sequence(model_dirs: dict[str, Path]) -> None:
    model = load(model_dirs)
    result = await prefill(model, new_cache(model), PROMPT[:10])
    longer = await prefill(model, new_cache(model), PROMPT[:11], all_logits=True)
    logits = decode_step(model, result.sequence, PROMPT[10])
    assert result.sequence.tokens == 11
    assert torch.allclose(logits, longer.logits[-1], atol=1e-4)  # another chunking: equal up to rounding


# -- streaming -----------------------------------------------------------------------------------------------------


async def source(layers: Sequence[tuple[bytes, bytes]], *, before: Callable[[int], Any] | None = None,
                 fail_at: int | None = None, stop_at: int | None = None,
                 order: Sequence[int] | None = None) -> AsyncIterator[DecodedLayer]:
    """A fake block source: layer l after ``await before(l)``; raises at *fail_at*; ends early at *stop_at*;
    delivers the layers in *order* (default ascending)."""
    for index in order if order is not None else range(len(layers)):
        k, v = layers[index]
        if before is not None:
            await before(index)
        if index == fail_at:
            raise ConnectionResetError("the holder went away")
        if index == stop_at:
            return
        yield DecodedLayer(index, (memoryview(k),), (memoryview(v),), None)


@dataclasses.dataclass
class Reference:
    model: LlamaModel
    logits: Any  # all positions of a full recompute
    blocks: list[list[tuple[bytes, bytes]]]  # its six complete blocks, exported
    tokens: list[int]  # its greedy continuation


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> Reference:
    model = load(model_dirs)
    cache = new_cache(model)
    full = prefill_sync(model, cache, PROMPT, all_logits=True)
    blocks = exported(cache, full, 6)
    last = prefill_sync(model, new_cache(model), PROMPT)
    return Reference(model, full.logits, blocks, greedy(model, last))


async def wait_until(trace: PrefillTrace, kind: str, layer: int) -> None:
    async with asyncio.timeout(10):  # a prefill that waits for every layer before computing never gets here
        while not any(e.kind == kind and e.layer == layer for e in trace.events):
            await asyncio.sleep(0.001)


async def test_layer_l_starts_before_layer_l_plus_1_of_the_loaded_blocks_arrives(reference: Reference) -> None:
    model, blocks = reference.model, reference.blocks
    trace = PrefillTrace()

    def slow(block: int) -> Callable[[int], Any]:
        async def before(layer: int) -> None:
            if layer:  # layer l only once the prefill started computing layer l - 1
                await wait_until(trace, "start", layer - 1)
            await asyncio.sleep(0.002 * block)  # staggered: the blocks are out of lockstep
        return before

    sources = [source(blocks[0])] + [source(blocks[i], before=slow(i)) for i in range(1, 6)]
    result = await prefill(model, new_cache(model), PROMPT, sources, trace=trace, all_logits=True)
    assert torch.equal(result.logits, reference.logits[6 * B:])
    for layer in range(LAYERS):
        start = trace.time_of("start", layer)
        assert all(trace.time_of("arrive", layer, b) <= start for b in range(6))  # never before its inputs
        if layer + 1 < LAYERS:
            assert all(trace.time_of("arrive", layer + 1, b) > start for b in range(1, 6))  # before the next
    # out of lockstep: block 0 had every layer before block 5 had layer 1; blocks arrive in staggered order
    assert trace.time_of("arrive", LAYERS - 1, 0) < trace.time_of("arrive", 1, 5)
    assert trace.time_of("arrive", 1, 1) < trace.time_of("arrive", 1, 5)


async def test_the_event_loop_keeps_receiving_while_a_layer_is_computed(reference: Reference) -> None:
    model, blocks = reference.model, reference.blocks
    trace = PrefillTrace()
    executor = ThreadPoolExecutor(1)

    def slow_step(fn: Callable[[], None]) -> None:
        time.sleep(0.05)  # a long layer step, in the worker thread
        fn()

    class SlowExecutor(ThreadPoolExecutor):
        def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
            return executor.submit(slow_step, lambda: fn(*args, **kwargs))

    async def tick(layer: int) -> None:
        await asyncio.sleep(0.01)

    sources = [source(blocks[i], before=tick) for i in range(6)]
    slow_executor = SlowExecutor(1)
    try:
        result = await prefill(model, new_cache(model), PROMPT, sources, trace=trace, executor=slow_executor,
                               all_logits=True)
    finally:
        slow_executor.shutdown()
        executor.shutdown()
    assert torch.equal(result.logits, reference.logits[6 * B:])
    start, end = trace.time_of("start", 0), trace.time_of("end", 0)
    during = [e for e in trace.events if e.kind == "arrive" and start < e.t < end]
    assert during, "no layer arrived while layer 0 was being computed"


@pytest.mark.parametrize("how", ["raises", "ends_early", "wrong_order", "deadline"])
async def test_a_failed_block_is_recomputed_and_the_result_is_still_exact(reference: Reference, how: str) -> None:
    model, blocks = reference.model, reference.blocks
    trace = PrefillTrace()
    bad: AsyncIterator[DecodedLayer]
    timeout = None
    if how == "raises":
        bad = source(blocks[2], fail_at=2)
    elif how == "ends_early":
        bad = source(blocks[2], stop_at=3)
    elif how == "wrong_order":
        bad = source(blocks[2], order=[0, 2, 1, 3])
    else:
        timeout = 0.3

        async def never(layer: int) -> None:
            if layer == 2:
                await asyncio.Event().wait()

        bad = source(blocks[2], before=never)
    sources = [source(blocks[i]) if i != 2 else bad for i in range(6)]
    result = await prefill(model, new_cache(model), PROMPT, sources, trace=trace, all_logits=True,
                           load_timeout=timeout)
    assert result.recomputed_blocks == [2] and result.loaded_blocks == [0, 1, 3, 4, 5]
    assert ("fail", None, 2) in trace.order() and any(k == "catchup" and b == 2 for k, _l, b in trace.order())
    assert torch.equal(result.logits, reference.logits[6 * B:])
    last = await prefill(model, new_cache(model), PROMPT, [source(blocks[i]) for i in range(6)])
    assert greedy(model, last) == reference.tokens


async def test_load_then_compute_with_preloaded_layers(reference: Reference) -> None:
    model, blocks = reference.model, reference.blocks
    layers = [[DecodedLayer(i, (k,), (v,), None) for i, (k, v) in enumerate(block)] for block in blocks]
    result = await prefill(model, new_cache(model), PROMPT, [preloaded(x) for x in layers], all_logits=True)
    assert torch.equal(result.logits, reference.logits[6 * B:])


async def test_misuse_is_refused(reference: Reference, model_dirs: dict[str, Path]) -> None:
    model = reference.model
    with pytest.raises(ValueError, match="at least one token"):
        await prefill(model, new_cache(model), [])
    other = PagedKVCache(layers=2, kv_heads=2, head_dim=16, block_tokens=B, kv_dtype="fp32")
    with pytest.raises(ValueError, match="cache holds"):
        await prefill(model, other, PROMPT)
    wrong_type = PagedKVCache(layers=LAYERS, kv_heads=2, head_dim=16, block_tokens=B, kv_dtype="bf16")
    with pytest.raises(ValueError, match="stores bf16"):
        await prefill(model, wrong_type, PROMPT)
