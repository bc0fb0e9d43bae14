"""A paged KV cache with a device tier and a host tier, and conversion to and from kvsp-layout-1.

A *page* holds the K and V of one block: ``block_tokens`` consecutive tokens, every layer. Each tier is a pool
of per-layer slots::

    tier.k[layer, slot] : (block_tokens, kv_heads, head_dim) of the KV element type   (tier.v alike)

which is exactly one kvsp-layout-1 section of a complete block (token index slowest, dimension fastest, and
little-endian, as torch stores numbers on every platform it runs on here). Importing a received layer is
therefore one copy of its octets into the slot (``torch.frombuffer`` on the received views, no intermediate),
and exporting one is a view of the slot (CPU tiers) or one device-to-host copy (CUDA).

Slots are taken per (tier, layer), so a page can keep some layers on the device and the others on the host
(spec, Replica Record "residency"); :meth:`PagedKVCache.residency` reports that split as
:class:`~kvsp_quic.records.ResidencyEntry` values. Pages are reference counted; when a tier runs out of slots
the least recently used unreferenced page makes room: from the device tier it is moved to the host tier when
the host has room, otherwise (and from the host tier) it is dropped, and ``on_evict`` is told (the instance
withdraws its replica record).

The device tier lives on ``cuda:N`` or on the CPU; the host tier is pinned memory under CUDA.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvsp_quic.compat import ELEMENT_TYPES, CompatDescriptor
from kvsp_quic.records import ResidencyEntry

DEVICE = "device"
HOST = "host"
TIERS = (DEVICE, HOST)

KV_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
if hasattr(torch, "float8_e4m3fn"):
    KV_DTYPES["fp8-e4m3"] = torch.float8_e4m3fn  # KVSP fp8-e4m3: NaN is S.1111.111 only, no infinities
if hasattr(torch, "float8_e5m2"):
    KV_DTYPES["fp8-e5m2"] = torch.float8_e5m2
TORCH_TO_KV = {v: k for k, v in KV_DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every platform torch supports here is little-endian
    raise ImportError("gpu.kvcache copies octets as they are: kvsp-layout-1 is little-endian and so must the "
                      "host be")


class CacheFull(RuntimeError):
    """No slot is free and every page that holds one is referenced."""


def kv_torch_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype of a KVSP element type (ValueError when torch lacks it)."""
    if kv_dtype not in ELEMENT_TYPES:
        raise ValueError(f"{kv_dtype!r} is not in the KVSP Element Types registry")
    try:
        return KV_DTYPES[kv_dtype]
    except KeyError:
        raise ValueError(f"this torch has no dtype for {kv_dtype!r}") from None


def as_octets(view: Any) -> torch.Tensor:
    """A uint8 tensor over a bytes-like object, without copying (read-only buffers included: the tensor is only
    ever read). torch warns once per process about non-writable buffers; that warning is suppressed here."""
    mv = memoryview(view)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if not len(mv):
        return torch.empty(0, dtype=torch.uint8)
    if not mv.readonly:
        return torch.frombuffer(mv, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mv, dtype=torch.uint8)


def resolve_device(spec: str | int | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``N`` (a GPU index). Raises RuntimeError with one line that points to
    the CPU when CUDA is not there."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = f"cuda:{spec}"
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{device}: CUDA is not available on this machine (use --device cpu)")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"{device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise RuntimeError(f"{device}: only cpu and cuda devices are supported")
    return device


# -- pages and pools -------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Page:
    """One block's K and V. ``slots[tier][layer]`` is its slot there (-1: none); ``ready[tier][layer]`` says the
    slot holds the layer's data (a slot is taken before a streamed layer arrives)."""

    id: int
    layers: int
    tokens: int = 0  # tokens filled, from the start of the block
    key: bytes | None = None
    refs: int = 0
    last_use: int = 0
    slots: dict[str, list[int]] = field(default_factory=dict)
    ready: dict[str, list[bool]] = field(default_factory=dict)
    dropped: bool = False

    def __post_init__(self) -> None:
        for tier in TIERS:
            self.slots.setdefault(tier, [-1] * self.layers)
            self.ready.setdefault(tier, [False] * self.layers)

    def resident(self, layer: int, tier: str | None = None) -> bool:
        if tier is not None:
            return self.ready[tier][layer]
        return any(self.ready[t][layer] for t in TIERS)

    @property
    def complete(self) -> bool:
        """Every layer is resident in some tier."""
        return all(self.resident(layer) for layer in range(self.layers))

    def tier_layers(self, tier: str) -> list[int]:
        return [layer for layer, ok in enumerate(self.ready[tier]) if ok]


class TierPool:
    """Per-layer slot pools of one tier: ``k[layer, slot]`` and ``v[layer, slot]`` are (B, kv_heads, head_dim)."""

    def __init__(self, name: str, capacity: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                 device: torch.device, pin: bool = False) -> None:
        layers, block_tokens, kv_heads, head_dim = shape
        self.name = name
        self.capacity = capacity
        self.device = device
        full = (layers, capacity, block_tokens, kv_heads, head_dim)
        if pin:
            self.k = torch.empty(full, dtype=dtype, pin_memory=True)
            self.v = torch.empty(full, dtype=dtype, pin_memory=True)
            self.k.view(torch.uint8).zero_()
            self.v.view(torch.uint8).zero_()
        else:
            self.k = torch.zeros(full, dtype=dtype, device=device)
            self.v = torch.zeros(full, dtype=dtype, device=device)
        self.k_octets = self.k.view(torch.uint8)  # (layers, capacity, B, kv_heads, head_dim * element size)
        self.v_octets = self.v.view(torch.uint8)
        # CPU tiers are also written through numpy views of the same memory: a plain memcpy on the receiving
        # thread, where a torch copy would start an OpenMP team that fights the computing thread's for the cores.
        self.k_array: Any = self.k_octets.numpy() if device.type == "cpu" else None
        self.v_array: Any = self.v_octets.numpy() if device.type == "cpu" else None
        self.free: list[list[int]] = [list(range(capacity - 1, -1, -1)) for _ in range(layers)]

    @property
    def cpu(self) -> bool:
        return self.device.type == "cpu"

    def used(self) -> int:
        return sum(self.capacity - len(f) for f in self.free)


# -- the cache -------------------------------------------------------------------------------------------------


class PagedKVCache:
    """Pages of ``block_tokens`` tokens in a device tier (``device_pages`` slots per layer) and a host tier
    (``host_pages``). Thread safety: bookkeeping takes one lock; tensors of a page are written by one party at a
    time (the prefill that owns it)."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, block_tokens: int, kv_dtype: str = "bf16",
                 device: str | torch.device = "cpu", device_pages: int = 256, host_pages: int = 0,
                 pin_host: bool | None = None, on_evict: Callable[[Page], None] | None = None,
                 on_residency: Callable[[Page], None] | None = None) -> None:
        for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                            ("block_tokens", block_tokens), ("device_pages", device_pages)):
            if value < 1:
                raise ValueError(f"{name} must be positive")
        if host_pages < 0:
            raise ValueError("host_pages must not be negative")
        self.layers, self.kv_heads, self.head_dim, self.block_tokens = layers, kv_heads, head_dim, block_tokens
        self.kv_dtype = kv_dtype
        self.dtype = kv_torch_dtype(kv_dtype)
        self.element_size = ELEMENT_TYPES[kv_dtype].size
        self.device = resolve_device(device)
        shape = (layers, block_tokens, kv_heads, head_dim)
        pin = self.device.type == "cuda" if pin_host is None else pin_host
        self.tiers: dict[str, TierPool] = {DEVICE: TierPool(DEVICE, device_pages, shape, self.dtype, self.device)}
        if host_pages:
            self.tiers[HOST] = TierPool(HOST, host_pages, shape, self.dtype, torch.device("cpu"), pin=pin)
        self.on_evict = on_evict
        self.on_residency = on_residency
        self.pages: dict[int, Page] = {}
        self.by_key: dict[bytes, Page] = {}
        self._next_id = 0
        self._tick = 0
        self._lock = threading.RLock()
        self.evictions = 0
        self.demotions = 0

    @classmethod
    def for_descriptor(cls, descriptor: CompatDescriptor, **kwargs: Any) -> PagedKVCache:
        return cls(layers=descriptor.layers, kv_heads=descriptor.kv_heads, head_dim=descriptor.head_dim,
                   block_tokens=descriptor.block_tokens, kv_dtype=descriptor.kv_dtype, **kwargs)

    # -- geometry --------------------------------------------------------------------------------------------

    def section_length(self, tokens: int | None = None) -> int:
        """Octets of one kvsp-layout-1 K (or V) section of *tokens* tokens (default: a whole block)."""
        n = self.block_tokens if tokens is None else tokens
        return n * self.kv_heads * self.head_dim * self.element_size

    def utilization(self) -> float:
        """Share of device slots in use (the Instance Status Record's kv_utilization)."""
        pool = self.tiers[DEVICE]
        return pool.used() / (pool.capacity * self.layers)

    # -- pages -----------------------------------------------------------------------------------------------

    def new_page(self, *, tier: str = DEVICE, layers: Iterable[int] | None = None) -> Page:
        """A new page, referenced once by the caller, with slots in *tier* for *layers* (default: all)."""
        with self._lock:
            page = Page(self._next_id, self.layers, refs=1)
            self._next_id += 1
            self.pages[page.id] = page
            self._touch(page)
            try:
                for layer in range(self.layers) if layers is None else layers:
                    self._slot(page, tier, layer)
            except CacheFull:
                self._free(page)
                raise
            return page

    def new_pages(self, count: int) -> list[Page]:
        """*count* new pages with device slots for every layer (all or none)."""
        out: list[Page] = []
        try:
            for _ in range(count):
                out.append(self.new_page())
        except CacheFull:
            for page in out:
                self.release(page)
            raise
        return out

    def acquire(self, page: Page) -> Page:
        with self._lock:
            if page.dropped:
                raise KeyError(f"page {page.id} was dropped")
            page.refs += 1
            self._touch(page)
            return page

    def release(self, page: Page) -> None:
        """Drop one reference; a page without a key and without references is freed at once."""
        with self._lock:
            if page.refs <= 0:
                raise ValueError(f"page {page.id} is not referenced")
            page.refs -= 1
            self._touch(page)
            if page.refs == 0 and page.key is None:
                self._free(page)

    def lookup(self, key: bytes) -> Page | None:
        """The complete page of Block Key *key*, if this cache holds one (not acquired)."""
        with self._lock:
            page = self.by_key.get(bytes(key))
            return page if page is not None and page.complete else None

    def set_key(self, page: Page, key: bytes) -> None:
        """Name a page by its Block Key: it then outlives its references until evicted."""
        with self._lock:
            key = bytes(key)
            other = self.by_key.get(key)
            if other is not None and other is not page:
                raise KeyError(f"another page already holds block {key.hex()}")
            page.key = key
            self.by_key[key] = page

    def drop(self, page: Page) -> None:
        """Free an unreferenced page now (``on_evict`` is called for keyed pages)."""
        with self._lock:
            if page.refs:
                raise ValueError(f"page {page.id} is referenced")
            self._evict(page)

    def keyed_pages(self) -> Iterator[Page]:
        with self._lock:
            yield from list(self.by_key.values())

    # -- slots and eviction ----------------------------------------------------------------------------------

    def _touch(self, page: Page) -> None:
        self._tick += 1
        page.last_use = self._tick

    def _slot(self, page: Page, tier: str, layer: int) -> int:
        slot = page.slots[tier][layer]
        if slot >= 0:
            return slot
        pool = self._pool(tier)
        if not pool.free[layer]:
            self._make_room(tier, layer)
        slot = pool.free[layer].pop()
        page.slots[tier][layer] = slot
        page.ready[tier][layer] = False
        return slot

    def _pool(self, tier: str) -> TierPool:
        try:
            return self.tiers[tier]
        except KeyError:
            raise ValueError(f"this cache has no {tier!r} tier") from None

    def _make_room(self, tier: str, layer: int) -> None:
        victims = sorted((p for p in self.pages.values() if p.refs == 0 and p.slots[tier][layer] >= 0),
                         key=lambda p: p.last_use)
        for victim in victims:
            if tier == DEVICE and HOST in self.tiers and victim.complete and self._demote_all(victim):
                return
            self._evict(victim)
            return
        raise CacheFull(f"no free {tier} slot for layer {layer}: every page holding one is referenced")

    def _demote_all(self, page: Page) -> bool:
        """Move every device layer of *page* to the host tier, if the host has (or can make) room for them."""
        host = self.tiers[HOST]
        layers = [layer for layer in page.tier_layers(DEVICE) if not page.ready[HOST][layer]]
        for layer in layers:
            if not host.free[layer]:
                victims = [p for p in self.pages.values() if p is not page and p.refs == 0
                           and p.slots[HOST][layer] >= 0]
                if not victims:
                    return False
                self._evict(min(victims, key=lambda p: p.last_use))
        self._move(page, layers, DEVICE, HOST)
        self.demotions += 1
        if self.on_residency is not None:
            self.on_residency(page)
        return True

    def _move(self, page: Page, layers: Iterable[int], src: str, dst: str) -> None:
        a, b = self.tiers[src], self.tiers[dst]
        for layer in layers:
            if not page.ready[src][layer]:
                raise ValueError(f"page {page.id} layer {layer} is not in the {src} tier")
            s = page.slots[src][layer]
            d = self._slot(page, dst, layer)
            b.k[layer, d].copy_(a.k[layer, s])  # synchronous: the source slot is reused at once
            b.v[layer, d].copy_(a.v[layer, s])
            page.ready[dst][layer] = True
            self._release_slot(page, src, layer)

    def _release_slot(self, page: Page, tier: str, layer: int) -> None:
        slot = page.slots[tier][layer]
        if slot >= 0:
            self.tiers[tier].free[layer].append(slot)
            page.slots[tier][layer] = -1
            page.ready[tier][layer] = False

    def _free(self, page: Page) -> None:
        for tier in self.tiers:
            for layer in range(self.layers):
                self._release_slot(page, tier, layer)
        self.pages.pop(page.id, None)
        if page.key is not None and self.by_key.get(page.key) is page:
            del self.by_key[page.key]
        page.dropped = True

    def _evict(self, page: Page) -> None:
        self._free(page)
        self.evictions += 1
        if page.key is not None and self.on_evict is not None:
            self.on_evict(page)

    def move(self, page: Page, layers: Iterable[int], dst: str) -> None:
        """Move *layers* of *page* into tier *dst* (device -> host to free device memory while keeping a split
        residency; host -> device before computing with them)."""
        src = HOST if dst == DEVICE else DEVICE
        with self._lock:
            todo = [layer for layer in layers if not page.ready[dst][layer]]
            if not todo:
                return
            self._move(page, todo, src, dst)
            if self.on_residency is not None:
                self.on_residency(page)

    def ensure_device(self, page: Page, layers: Iterable[int] | None = None) -> None:
        """Bring *layers* (default: all) of *page* to the device tier."""
        self.move(page, range(self.layers) if layers is None else layers, DEVICE)

    def residency(self, page: Page) -> tuple[ResidencyEntry, ...]:
        """Which layers are in which tier, as Replica Record residency entries (a layer in both tiers is
        reported in the device tier only, so the ranges never overlap)."""
        tier_of = []
        for layer in range(self.layers):
            if page.ready[DEVICE][layer]:
                tier_of.append(DEVICE)
            elif HOST in self.tiers and page.ready[HOST][layer]:
                tier_of.append(HOST)
            else:
                tier_of.append("")
        out: list[ResidencyEntry] = []
        start = 0
        for layer in range(1, self.layers + 1):
            if layer == self.layers or tier_of[layer] != tier_of[start]:
                if tier_of[start]:
                    out.append(ResidencyEntry(tier_of[start], (start, layer - 1)))
                start = layer
        return tuple(out)

    # -- data: kvsp-layout-1 sections ------------------------------------------------------------------------

    def write_layer(self, page: Page, layer: int, k_parts: Sequence[Any], v_parts: Sequence[Any], *,
                    tokens: int | None = None, tier: str = DEVICE) -> None:
        """Import one layer of a block from its kvsp-layout-1 K and V sections (each given as the parts it
        arrived in, e.g. ``DecodedLayer.k_parts``): one copy of the octets into the page's slot."""
        n = self.block_tokens if tokens is None else tokens
        if not 0 < n <= self.block_tokens:
            raise ValueError(f"a page holds 1..{self.block_tokens} tokens, not {n}")
        want = self.section_length(n)
        with self._lock:
            slot = self._slot(page, tier, layer)
        pool = self.tiers[tier]
        for parts, octets, array in ((k_parts, pool.k_octets, pool.k_array), (v_parts, pool.v_octets, pool.v_array)):
            offset = 0
            for part in parts:
                size = memoryview(part).nbytes
                if offset + size > want:
                    raise ValueError(f"layer {layer}: a section of {n} tokens has {want} octets; got more")
                if array is not None:  # CPU memory: numpy's memcpy
                    array[layer, slot].reshape(-1)[offset:offset + size] = np.frombuffer(part, dtype=np.uint8)
                else:  # device memory: one host-to-device copy straight from the received octets
                    octets[layer, slot].view(-1)[offset:offset + size].copy_(as_octets(part))
                offset += size
            if offset != want:
                raise ValueError(f"layer {layer}: a section of {n} tokens has {want} octets, got {offset}")
        with self._lock:
            page.tokens = max(page.tokens, n)
            page.ready[tier][layer] = True

    def write_tokens(self, page: Page, layer: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store computed K and V of shape (tokens, kv_heads, head_dim) at token *offset* of the page's device
        slot (converted to the KV element type)."""
        n = k.shape[0]
        if offset + n > self.block_tokens:
            raise ValueError(f"tokens {offset}..{offset + n} do not fit a page of {self.block_tokens}")
        pool = self.tiers[DEVICE]
        with self._lock:
            slot = self._slot(page, DEVICE, layer)
        pool.k[layer, slot, offset:offset + n].copy_(k)
        pool.v[layer, slot, offset:offset + n].copy_(v)
        with self._lock:
            page.tokens = max(page.tokens, offset + n)
            page.ready[DEVICE][layer] = True

    def read_layer(self, page: Page, layer: int) -> tuple[memoryview, memoryview]:
        """The layer's K and V sections in kvsp-layout-1 (``page.tokens`` rows). From a CPU tier they are views
        of the slot (valid while the page is referenced and not rewritten); from a CUDA tier, one copy."""
        tier = HOST if HOST in self.tiers and page.ready[HOST][layer] else DEVICE
        if not page.ready[tier][layer]:
            raise ValueError(f"page {page.id} does not hold layer {layer}")
        pool = self.tiers[tier]
        slot = page.slots[tier][layer]
        out = []
        for octets in (pool.k_octets, pool.v_octets):
            t = octets[layer, slot, :page.tokens]
            if not pool.cpu:
                t = t.to("cpu")
            array: Any = t.numpy()
            out.append(memoryview(array).cast("B"))
        return out[0], out[1]

    def export_block(self, page: Page) -> list[tuple[memoryview, memoryview]]:
        """Every layer's (K, V) sections, ready for :func:`kvsp_quic.container.encode`."""
        return [self.read_layer(page, layer) for layer in range(self.layers)]

    # -- data: attention -------------------------------------------------------------------------------------

    def gather(self, pages: Sequence[Page], layer: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Copy layer *layer* of *pages* (device-resident) into ``k_out[:len(pages) * B]`` / ``v_out`` (token
        major, (tokens, kv_heads, head_dim), any float dtype)."""
        if not pages:
            return
        pool = self.tiers[DEVICE]
        slots = [p.slots[DEVICE][layer] for p in pages]
        if any(s < 0 for s in slots):
            raise ValueError(f"layer {layer} of a page is not on the device")
        rows = len(pages) * self.block_tokens
        shape = (len(pages), self.block_tokens, self.kv_heads, self.head_dim)
        first = slots[0]
        contiguous = slots == list(range(first, first + len(slots)))
        for src, out in ((pool.k, k_out), (pool.v, v_out)):
            dst = out[:rows].view(shape)
            if contiguous:
                dst.copy_(src[layer, first:first + len(slots)])
            elif out.dtype == self.dtype:
                index = torch.tensor(slots, dtype=torch.int64, device=pool.device)
                torch.index_select(src[layer], 0, index, out=dst)
            else:
                index = torch.tensor(slots, dtype=torch.int64, device=pool.device)
                dst.copy_(src[layer].index_select(0, index))


class SequenceKV:
    """The pages of one token sequence in a :class:`PagedKVCache`, in order. Holds a reference on each."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.pages: list[Page] = []
        self.tokens = 0

    def __len__(self) -> int:
        return self.tokens

    def append_page(self, page: Page) -> None:
        """Adopt *page* (its reference moves to the sequence)."""
        self.pages.append(page)

    def reserve(self, tokens: int) -> None:
        """Make room for *tokens* tokens in total (new pages, device slots for every layer)."""
        need = -(-tokens // self.cache.block_tokens) - len(self.pages)
        if need > 0:
            self.pages.extend(self.cache.new_pages(need))

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V (tokens, kv_heads, head_dim) of tokens [start, start + n) of layer *layer*."""
        b = self.cache.block_tokens
        n = k.shape[0]
        pos = 0
        while pos < n:
            index, offset = divmod(start + pos, b)
            take = min(b - offset, n - pos)
            self.cache.write_tokens(self.pages[index], layer, offset, k[pos:pos + take], v[pos:pos + take])
            pos += take

    def release(self) -> None:
        for page in self.pages:
            self.cache.release(page)
        self.pages = []
        self.tokens = 0
