"""How an instance finds and loads blocks: lookups at the Index Service, fetches from the replicas it lists, and
the blocks arriving into the engine's cache.

* :class:`BlockFinder` -- lookups and the instance's :class:`~kvsp_client.retrieval.BlockFetcher`.
* :class:`BlockLoads` -- blocks being loaded into pages (prefetch directives, reshard fetches), shared: a prefill
  that needs a block still arriving follows its layers as they come instead of fetching it again.
* :func:`restrict` -- a lookup's replicas cut down to the sources a directive or the PC named.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic

from http3.client import KvspClient
from kvsp_client.api import ServiceEndpoints
from kvsp_client.retrieval import BlockFetcher, BlockSource, HttpSource, IndexUnavailable
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import DecodedLayer
from kvsp_quic.engine import P, PageCache
from kvsp_quic.keys import uri_id
from kvsp_quic.records import LookupMatch
from kvsp_quic.retrieval_plan import Ranking, RetrievalMetrics

log = logging.getLogger("kvsp.instance")

def restrict(match: LookupMatch, sources: Sequence[str] | None) -> LookupMatch | None:
    """*match* with only the replicas at *sources* (base URIs; a ``moqt://`` twin published by a listed holder
    counts as that holder's), or None when none is left. *sources* None: every replica."""
    if sources is None:
        return match
    ids = {uri_id(s) for s in sources}
    keep = tuple(r for r in match.replicas if r.holder in sources or r.publisher_id in ids)
    if not keep:
        return None
    return match if len(keep) == len(match.replicas) else LookupMatch(match.block_key, keep)


async def nothing() -> AsyncIterator[DecodedLayer]:
    """A block source that delivers no layer: the prefill recomputes that block."""
    none: tuple[DecodedLayer, ...] = ()
    for layer in none:
        yield layer


async def close_all(items: Iterable[object]) -> None:
    """Close the layer streams among *items* (best effort)."""
    for item in items:
        closer = getattr(item, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()


class BlockFinder:
    """Lookups at the Index Service *index* and the fetcher of an instance: one
    :class:`~kvsp_client.retrieval.BlockFetcher` (leases are per call). *own*: its own base URIs (never fetched
    from); *sources*: how replicas are fetched (default: ``https`` only); *ranking*: the order in which a block's
    replicas are tried (default :class:`~kvsp_quic.retrieval_plan.DefaultRanking`); *require_producer_digest*: the
    producer-digest mode (:class:`kvsp_client.producer_digests.ProducerCheck`)."""

    def __init__(self, client: KvspClient, index: str | Sequence[str] | ServiceEndpoints, *,
                 descriptor: CompatDescriptor, own: Sequence[str],
                 sources: Sequence[BlockSource] | None = None, ranking: Ranking | None = None, timeout: float = 10.0,
                 metrics: RetrievalMetrics | None = None, require_producer_digest: bool = False) -> None:
        self.descriptor = descriptor
        self.fetcher = BlockFetcher(
            client, ServiceEndpoints.of(index, "index"), descriptors=[descriptor], exclude_holders=own,
            sources=list(sources) if sources is not None else [HttpSource(client, timeout=timeout)],
            timeout=timeout, ranking=ranking, metrics=metrics, require_producer_digest=require_producer_digest)

    @property
    def metrics(self) -> RetrievalMetrics:
        return self.fetcher.metrics

    async def lookup(self, compat_id: bytes, scope_id: bytes, keys: Sequence[bytes], *,
                     skip_gaps: bool = False) -> dict[bytes, LookupMatch]:
        """The replicas of *keys* at the Index Service. A lookup stops at the first key without a replica; with
        *skip_gaps* the keys after it are looked up again (a directive's keys need not be a prefix). An Index
        Service that does not answer ends the lookups: what was found so far."""
        out: dict[bytes, LookupMatch] = {}
        start = 0
        while start < len(keys):
            found = await self.fetcher.find(compat_id, scope_id, keys[start:])
            if isinstance(found, IndexUnavailable):
                break  # the rest would fail too
            for match in found.blocks:
                out[bytes(match.block_key)] = match
            start += found.matched + 1
            if not skip_gaps:
                break
        return out


# -- blocks being loaded ------------------------------------------------------------------------------------------


@dataclass(eq=False)
class BlockLoad:
    """One block arriving into a page: its verified layers as they come, for followers."""

    key: bytes
    scope_id: bytes | None = None  # the scope it is loaded for (known once its source is)
    layers: list[DecodedLayer] = field(default_factory=list)
    done: bool = False
    ok: bool = False
    interest: int = 0  # directives and prefills that still want it
    task: asyncio.Task[None] | None = None
    started: float = 0.0
    first_layer_at: float | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def octets(self) -> int:
        """The K and V octets received."""
        return sum(x.k_length + x.v_length for x in self.layers)

    async def wait(self) -> bool:
        """Until the load ends; whether it succeeded."""
        while not self.done:
            await self._changed.wait()
        return self.ok

    async def follow(self) -> AsyncIterator[DecodedLayer]:
        """The layers received so far, then the rest as they arrive; ends early if the load fails (the prefill
        then recomputes the block)."""
        self.interest += 1
        try:
            i = 0
            while True:
                while i < len(self.layers):
                    yield self.layers[i]
                    i += 1
                if self.done:
                    return
                changed = self._changed
                await changed.wait()
        finally:
            self.interest -= 1


class BlockLoads(Generic[P]):
    """Blocks being loaded into the cache (each block at most once at a time). ``on_loaded(load, page, digests)``:
    a block is complete and named in its page (*digests*: its layer digests when every layer carried one);
    ``on_finished(load, stream)``: a load ended, in success or not."""

    def __init__(self, cache: PageCache[P], *, on_loaded: Callable[[BlockLoad, P, tuple[bytes, ...] | None], None],
                 on_finished: Callable[[BlockLoad, Any], None] | None = None) -> None:
        self.cache = cache
        self.on_loaded = on_loaded
        self.on_finished = on_finished
        self._loads: dict[bytes, BlockLoad] = {}

    def __len__(self) -> int:
        return len(self._loads)

    def get(self, key: bytes) -> BlockLoad | None:
        return self._loads.get(bytes(key))

    def reserve(self, key: bytes) -> BlockLoad:
        """Announce that *key* is about to be loaded (its source is being looked up): prefills that need it
        follow this load instead of fetching the block themselves. Then :meth:`begin` or :meth:`abandon`."""
        key = bytes(key)
        if key in self._loads:
            raise ValueError(f"block {key.hex()} is being loaded already")
        load = BlockLoad(key, started=time.perf_counter())
        self._loads[key] = load
        return load

    def begin(self, load: BlockLoad, stream: AsyncIterable[DecodedLayer], scope_id: bytes) -> BlockLoad:
        """Load the reserved block of *scope_id* from *stream* (verified layers in ascending order) into a new
        page; the page is named by the key and ``on_loaded`` is told once every layer is in."""
        load.scope_id = bytes(scope_id)
        load.started = time.perf_counter()
        load.task = asyncio.get_running_loop().create_task(self._run(load, stream), name=f"load-{load.key.hex()[:8]}")
        return load

    def start(self, key: bytes, stream: AsyncIterable[DecodedLayer], scope_id: bytes) -> BlockLoad:
        return self.begin(self.reserve(key), stream, scope_id)

    def abandon(self, load: BlockLoad) -> None:
        """A reserved block will not be loaded (no source): its followers recompute it."""
        if load.task is None and not load.done:
            load.done = True
            self._loads.pop(load.key, None)
            load._notify()

    async def _run(self, load: BlockLoad, stream: AsyncIterable[DecodedLayer]) -> None:
        cache = self.cache
        page: P | None = None
        try:
            page = cache.new_page()
            async for layer in stream:
                expected = len(load.layers)
                if layer.index != expected:
                    raise ValueError(f"layer {layer.index} arrived, expected {expected}")
                cache.write_layer(page, layer.index, layer.k_parts, layer.v_parts)
                if load.first_layer_at is None:
                    load.first_layer_at = time.perf_counter()
                load.layers.append(layer)
                load._notify()
            if len(load.layers) == cache.layers:
                digests = tuple(x.digest for x in load.layers if x.digest is not None)
                if cache.lookup(load.key) is None:
                    cache.set_key(page, load.key)
                    self.on_loaded(load, page, digests if len(digests) == cache.layers else None)
                load.ok = True
        except asyncio.CancelledError:
            log.info("loading block %s was cancelled", load.key.hex())
        except Exception as exc:
            log.info("loading block %s failed: %r", load.key.hex(), exc)
        finally:
            closer = getattr(stream, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
            if page is not None:
                cache.release(page)  # a named page stays cached; an incomplete one is freed
            load.done = True
            self._loads.pop(load.key, None)
            load._notify()
            if self.on_finished is not None:
                self.on_finished(load, stream)

    def cancel(self, key: bytes) -> None:
        load = self._loads.get(bytes(key))
        if load is None:
            return
        if load.task is not None:
            load.task.cancel()
        else:
            self.abandon(load)

    async def aclose(self) -> None:
        for load in [x for x in self._loads.values() if x.task is None]:
            self.abandon(load)
        tasks = [load.task for load in self._loads.values() if load.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["BlockFinder", "BlockLoad", "BlockLoads", "close_all", "nothing", "restrict"]
