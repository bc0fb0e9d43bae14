"""gpu/kvcache.py: pages, tiers, reference counts, eviction, residency, and kvsp-layout-1 conversion."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")

from gpu.kvcache import (  # noqa: E402
    DEVICE,
    HOST,
    KV_DTYPES,
    CacheFull,
    PagedKVCache,
    SequenceKV,
    as_octets,
    kv_torch_dtype,
    resolve_device,
)
from kvsp_quic import container as c  # noqa: E402
from kvsp_quic.records import ResidencyEntry  # noqa: E402
from kvsp_quic.samples import random_sections  # noqa: E402
from tests.support.descriptors import small_descriptor  # noqa: E402

LAYERS, HEADS, DIM, B = 4, 2, 8, 4
CUDA = torch.cuda.is_available()


def make_cache(kv_dtype: str = "fp32", device: str = "cpu", **kwargs: Any) -> PagedKVCache:
    kwargs.setdefault("device_pages", 8)
    return PagedKVCache(layers=LAYERS, kv_heads=HEADS, head_dim=DIM, block_tokens=B, kv_dtype=kv_dtype,
                        device=device, **kwargs)


def split(data: bytes, cuts: list[int]) -> tuple[memoryview, ...]:
    """*data* as read-only views cut at *cuts* (as a decoder in zero-copy mode hands them over)."""
    view = memoryview(data)
    bounds = [0, *cuts, len(data)]
    return tuple(view[a:b] for a, b in itertools.pairwise(bounds))


# -- conversion ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", sorted(KV_DTYPES))
def test_layout1_round_trip_for_every_element_type(kv_dtype: str) -> None:
    d = small_descriptor(layers=LAYERS, kv_heads=HEADS, head_dim=DIM, kv_dtype=kv_dtype)
    sections = random_sections(d, B, 0, LAYERS - 1, seed=5)
    cache = make_cache(kv_dtype)
    page = cache.new_page()
    for layer, (k, v) in enumerate(sections):
        kb, vb = k.tobytes(), v.tobytes()
        cache.write_layer(page, layer, split(kb, [1, 7, len(kb) // 2]), split(vb, []))  # odd part boundaries
    assert page.complete and page.tokens == B
    exported = cache.export_block(page)
    for (k, v), (ek, ev) in zip(sections, exported, strict=True):
        assert bytes(ek) == k.tobytes() and bytes(ev) == v.tobytes()
    # the container built from the export is the producer's container, octet for octet
    original = c.encode(sections, first_layer=0, token_count=B, descriptor=d)
    assert c.encode(exported, first_layer=0, token_count=B, descriptor=d).tobytes() == original.tobytes()
    # and the values are the numbers of the section: (tokens, kv_heads, head_dim), little-endian
    slot = page.slots[DEVICE][1]
    expected = torch.from_numpy(sections[1][0].copy()).view(torch.uint8).view(B, HEADS, DIM * cache.element_size)
    assert torch.equal(cache.tiers[DEVICE].k[1, slot].view(torch.uint8), expected)


def test_fp32_values_land_as_numbers() -> None:
    cache = make_cache("fp32")
    page = cache.new_page()
    k = np.arange(B * HEADS * DIM, dtype="<f4").reshape(B, HEADS, DIM)
    for layer in range(LAYERS):
        cache.write_layer(page, layer, (k.tobytes(),), ((k + 1).tobytes(),))
    out_k, out_v = torch.empty(B, HEADS, DIM), torch.empty(B, HEADS, DIM)
    cache.gather([page], 2, out_k, out_v)
    assert torch.equal(out_k, torch.from_numpy(k)) and torch.equal(out_v, torch.from_numpy(k + 1))


def test_export_is_a_view_of_the_page_on_cpu_tiers() -> None:
    cache = make_cache("bf16")
    page = cache.new_page()
    for layer in range(LAYERS):
        cache.write_tokens(page, layer, 0, torch.ones(B, HEADS, DIM), torch.zeros(B, HEADS, DIM))
    k, _v = cache.read_layer(page, 0)
    before = bytes(k)
    cache.write_tokens(page, 0, 0, torch.full((B, HEADS, DIM), 2.0), torch.zeros(B, HEADS, DIM))
    assert bytes(k) != before  # a view, not a copy
    assert bytes(k) == torch.full((B, HEADS, DIM), 2.0, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()


def test_partial_pages_export_their_tokens_only() -> None:
    cache = make_cache("fp16")
    page = cache.new_page()
    for layer in range(LAYERS):
        cache.write_tokens(page, layer, 0, torch.ones(3, HEADS, DIM), torch.ones(3, HEADS, DIM))
    k, v = cache.read_layer(page, 3)
    assert len(k) == len(v) == cache.section_length(3) == 3 * HEADS * DIM * 2


def test_import_rejects_wrong_lengths_and_as_octets_reads_readonly_views() -> None:
    cache = make_cache()
    page = cache.new_page()
    good = bytes(cache.section_length())
    with pytest.raises(ValueError, match="octets"):
        cache.write_layer(page, 0, (good[:-4],), (good,))
    with pytest.raises(ValueError, match="more"):
        cache.write_layer(page, 0, (good, b"xx"), (good,))
    assert not page.resident(0)
    t = as_octets(memoryview(b"abc"))
    assert t.tolist() == [97, 98, 99]
    assert as_octets(bytearray(b"\x01\x02")).tolist() == [1, 2]
    assert as_octets(b"").numel() == 0


def test_element_types_and_devices() -> None:
    assert kv_torch_dtype("bf16") is torch.bfloat16 and kv_torch_dtype("fp8-e4m3") is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="registry"):
        kv_torch_dtype("int4")
    assert resolve_device("cpu") == torch.device("cpu")
    if not CUDA:
        with pytest.raises(RuntimeError, match="use --device cpu"):
            resolve_device(0)
        with pytest.raises(RuntimeError, match="use --device cpu"):
            resolve_device("cuda:0")


# -- pages, references, eviction, residency ------------------------------------------------------------------


def fill(cache: PagedKVCache, page: Any, value: float = 1.0) -> None:
    for layer in range(LAYERS):
        t = torch.full((B, HEADS, DIM), value + layer)
        cache.write_tokens(page, layer, 0, t, -t)


def test_reference_counts_and_keys() -> None:
    cache = make_cache(device_pages=2)
    a = cache.new_page()
    fill(cache, a)
    cache.set_key(a, b"A" * 32)
    assert cache.lookup(b"A" * 32) is a
    cache.release(a)  # keyed: kept while unreferenced, until evicted
    assert cache.lookup(b"A" * 32) is a and a.refs == 0
    b = cache.new_page()  # the second slot: nothing evicted
    assert cache.lookup(b"A" * 32) is a
    cache.release(b)  # unkeyed: freed at once
    assert b.dropped and b.id not in cache.pages
    with pytest.raises(ValueError):
        cache.release(b)
    cache.acquire(a)
    with pytest.raises(KeyError, match="already holds"):
        cache.set_key(cache.new_page(), b"A" * 32)


def test_lru_eviction_of_unreferenced_pages_and_cache_full() -> None:
    evicted: list[bytes] = []
    cache = make_cache(device_pages=3, on_evict=lambda p: evicted.append(p.key or b""))
    pages = []
    for n in range(3):
        p = cache.new_page()
        fill(cache, p)
        cache.set_key(p, bytes([n]) * 32)
        pages.append(p)
    cache.release(pages[0])
    cache.release(pages[1])
    cache.acquire(pages[0])  # page 1 is now the least recently used unreferenced page
    cache.release(pages[0])
    fresh = cache.new_page()
    assert evicted == [bytes([1]) * 32] and pages[1].dropped and cache.lookup(bytes([1]) * 32) is None
    assert cache.evictions == 1
    fresh2 = cache.new_page()  # evicts page 0
    assert evicted[-1] == bytes([0]) * 32
    with pytest.raises(CacheFull):  # pages 2 and the fresh ones are referenced
        cache.new_page()
    assert {fresh.id, fresh2.id, pages[2].id} == set(cache.pages)


def test_device_pages_are_moved_to_the_host_tier_before_being_dropped() -> None:
    changed: list[int] = []
    cache = make_cache(device_pages=1, host_pages=2, on_residency=lambda p: changed.append(p.id))
    a = cache.new_page()
    fill(cache, a, 10.0)
    cache.set_key(a, b"a" * 32)
    want = [cache.read_layer(a, layer) for layer in range(LAYERS)]
    want = [(bytes(k), bytes(v)) for k, v in want]
    cache.release(a)
    b = cache.new_page()  # no device slot left: a moves to the host
    assert changed == [a.id] and cache.demotions == 1
    assert cache.residency(a) == (ResidencyEntry(HOST, (0, LAYERS - 1)),)
    assert [(bytes(k), bytes(v)) for k, v in cache.export_block(a)] == want  # exported from the host tier
    fill(cache, b)
    cache.set_key(b, b"b" * 32)
    cache.release(b)
    cache.acquire(a)
    cache.ensure_device(a)  # back to the device: b goes to the host
    assert cache.residency(a) == (ResidencyEntry(DEVICE, (0, LAYERS - 1)),)
    assert cache.residency(b) == (ResidencyEntry(HOST, (0, LAYERS - 1)),)
    out_k, out_v = torch.empty(B, HEADS, DIM), torch.empty(B, HEADS, DIM)
    cache.gather([a], 3, out_k, out_v)
    assert torch.equal(out_k, torch.full((B, HEADS, DIM), 13.0))


def test_split_residency_is_reported_per_layer_range() -> None:
    cache = make_cache(device_pages=2, host_pages=2)
    page = cache.new_page()
    fill(cache, page)
    cache.move(page, [2, 3], HOST)
    assert cache.residency(page) == (ResidencyEntry(DEVICE, (0, 1)), ResidencyEntry(HOST, (2, 3)))
    assert page.slots[DEVICE][2] == -1 and cache.tiers[DEVICE].free[2]  # the device slot was given back
    partial = cache.new_page(layers=[0, 1])
    cache.write_tokens(partial, 0, 0, torch.ones(B, HEADS, DIM), torch.ones(B, HEADS, DIM))
    assert cache.residency(partial) == (ResidencyEntry(DEVICE, (0, 0)),) and not partial.complete
    assert cache.utilization() == pytest.approx(4 / (2 * LAYERS))  # 2 + 2 device slots taken


def test_sequence_writes_span_pages_and_gather_follows_slots() -> None:
    cache = make_cache(device_pages=6)
    seq = SequenceKV(cache)
    seq.reserve(10)
    assert len(seq.pages) == 3
    k = torch.arange(10 * HEADS * DIM, dtype=torch.float32).view(10, HEADS, DIM)
    for layer in range(LAYERS):
        seq.write(layer, 0, k[:6], -k[:6])
        seq.write(layer, 6, k[6:], -k[6:])
    out_k, out_v = torch.zeros(12, HEADS, DIM), torch.zeros(12, HEADS, DIM)
    cache.gather(seq.pages[:2], 1, out_k, out_v)  # contiguous slots: one slice
    assert torch.equal(out_k[:8], k[:8]) and torch.equal(out_v[:8], -k[:8])
    cache.gather([seq.pages[2], seq.pages[0]], 1, out_k, out_v)  # non-contiguous slots: index_select
    assert torch.equal(out_k[4:6], k[:2]) and torch.equal(out_k[:2], k[8:10])
    out_bf = torch.zeros(12, HEADS, DIM, dtype=torch.bfloat16)
    cache.gather([seq.pages[2], seq.pages[0]], 1, out_bf, out_bf.clone())  # with a dtype conversion
    assert torch.equal(out_bf[:2], k[8:10].bfloat16())
    seq.release()
    assert not cache.pages


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_tiers_pinned_host_and_round_trip() -> None:
    d = small_descriptor(layers=LAYERS, kv_heads=HEADS, head_dim=DIM, kv_dtype="bf16")
    sections = random_sections(d, B, 0, LAYERS - 1, seed=9)
    cache = make_cache("bf16", device="cuda:0", device_pages=1, host_pages=2)
    assert cache.tiers[HOST].k.is_pinned() and cache.tiers[DEVICE].k.device.type == "cuda"
    page = cache.new_page()
    for layer, (k, v) in enumerate(sections):
        cache.write_layer(page, layer, split(k.tobytes(), [3]), (v.tobytes(),))
    assert [(bytes(k), bytes(v)) for k, v in cache.export_block(page)] == \
        [(k.tobytes(), v.tobytes()) for k, v in sections]
    cache.set_key(page, b"k" * 32)
    cache.release(page)
    other = cache.new_page()  # page moves to the pinned host tier
    assert cache.residency(page) == (ResidencyEntry(HOST, (0, LAYERS - 1)),)
    assert [(bytes(k), bytes(v)) for k, v in cache.export_block(page)] == \
        [(k.tobytes(), v.tobytes()) for k, v in sections]
    cache.release(other)
    cache.acquire(page)
    cache.ensure_device(page)
    assert [(bytes(k), bytes(v)) for k, v in cache.export_block(page)] == \
        [(k.tobytes(), v.tobytes()) for k, v in sections]


def test_cpu_twin_of_the_cuda_tier_test() -> None:
    """The same steps with the device tier on the CPU (host tier unpinned)."""
    d = small_descriptor(layers=LAYERS, kv_heads=HEADS, head_dim=DIM, kv_dtype="bf16")
    sections = random_sections(d, B, 0, LAYERS - 1, seed=9)
    cache = make_cache("bf16", device="cpu", device_pages=1, host_pages=2)
    assert not cache.tiers[HOST].k.is_pinned()
    page = cache.new_page()
    for layer, (k, v) in enumerate(sections):
        cache.write_layer(page, layer, split(k.tobytes(), [3]), (v.tobytes(),))
    cache.set_key(page, b"k" * 32)
    cache.release(page)
    other = cache.new_page()
    assert cache.residency(page) == (ResidencyEntry(HOST, (0, LAYERS - 1)),)
    cache.release(other)
    cache.acquire(page)
    cache.ensure_device(page)
    assert [(bytes(k), bytes(v)) for k, v in cache.export_block(page)] == \
        [(k.tobytes(), v.tobytes()) for k, v in sections]
