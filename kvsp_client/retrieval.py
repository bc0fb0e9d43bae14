"""The retrieval client: look blocks up at the Index Service, fetch them from their replicas, verify every octet.

Used by everyone who loads blocks (inference instances, the Placement Controller's prefetch, tools). Spec:
"Lookup", "Leases", "Block Retrieval and Storage", "Error Handling"; docs/wire.md, "Retrieval".

    fetcher = BlockFetcher(client, "https://is.example/kvsp/")
    results = await fetcher.load_prefix(compat_id, scope_id, keys, lease_ms=2000)   # [FetchResult | None, ...]

    found = await fetcher.find(compat_id, scope_id, keys)               # LookupResponse | IndexUnavailable
    if isinstance(found, IndexUnavailable): ...                          # recompute (found.detail says why)
    async with fetcher.fetch_layers(found.blocks[0], layers=(0, 15)) as stream:
        async for layer in stream:                                       # verified, in ascending order,
            place(layer.index, layer.k_parts, layer.v_parts)             # while later layers still arrive
    if not stream.complete: ...                                          # missing: recompute from stream.next_layer

Leases are per call (*lease_ms* of :meth:`~BlockFetcher.fetch_layers`, :meth:`~BlockFetcher.fetch_block`,
:meth:`~BlockFetcher.load_prefix`; the fetcher's *lease_ms* is the default). For each block the candidate replicas
are ordered by a :class:`~kvsp_quic.retrieval_plan.Ranking` (default:
link estimates, then tier, then https first) and tried in turn, skipping holders that failed recently. One
attempt: optionally ``POST {holder}leases`` (a refusal moves on), then ``GET {holder}blocks/{compat}/{scope}/
{key}[?layers=a-b][&codec=n]``, the body streamed through :class:`~kvsp_quic.container.ContainerDecoder` with
the record's layer digests (and the replica digest when the whole block is fetched) while SHA-256 of the whole
body is checked against ``Repr-Digest``; the lease is released (``DELETE``) after the transfer. Over the lean
HTTP/1.1 path the body is not iterated: the transport delivers it into a sink around the decoder
(``Response.receive_into``), TLS decrypting straight into the decoder's buffers (no scratch buffer, no chunk copy;
issue 16), and the sink hands each completed layer over exactly as the chunk path would. A layer is handed
to the caller as soon as it is complete and its layer digest matched the record; the layers of the chunk that
ends the container are held back until the body has ended and ``Repr-Digest`` matched. Without layer digests
to check (a record without them, or a transcoded codec) every layer is held back until the end.

When an attempt fails after some layers were delivered, the next replica is asked for the remaining layers
only (``layers=n-b``), so the caller sees each layer once, in order.

Partial replicas (issue 13: a holder may keep a layer range of a block; its record's residency names the range and
its ``layer_digests`` hold 32 zero octets for the layers it lacks). The wanted range is assembled part by part
(:func:`~kvsp_quic.retrieval_plan.next_parts`): from ``next_layer`` on, a replica holding every remaining layer is
preferred; else the fetcher takes the first part of the cheapest chain of ranges (fewest parts), asks its replica
for ``layers=n-e`` (``e``: the end of what it holds, or of the wanted range), and goes on from ``e + 1``. A part
that fails is asked of another replica holding that layer on (the same failover as for a whole block); when no
chain of the remaining replicas covers what is left, nothing more is fetched and the block is missing from
``next_layer`` on. Each layer is verified against the layer digest of the replica it came from, never against a
placeholder (a part never reaches past its replica's residency); the replica digest only when one replica gives
the whole block (spec, "Block Retrieval and Storage"). Over MOQT a part is a FETCH of its objects.

A digest mismatch or a malformed container withdraws the replica on the holder's behalf (``DELETE {is}replicas/
{holder-id}/{key}``; a 403 is only noted). A block no replica delivers is reported missing -- a miss is never an
exception; only misuse raises. A holder that is gone (nothing listens at its port: ``AttemptError.unreachable``)
is skipped at its host and port, its ``https`` and ``moqt://`` records alike, and reported to the Index Service
(docs/wire.md, "Dead sources").

Source kinds (kvsp_client/sources.py): an attempt talks to a :class:`BlockSource` chosen by the replica's holder URI.
:class:`HttpSource` serves ``https`` holders through :class:`kvsp_client.api.KvspApi`, whose failure classes (miss,
retry elsewhere, refused) it maps onto :class:`~kvsp_quic.retrieval_plan.Failure`;
:class:`kvsp_moqt.source.MoqtSource` serves ``moqt://`` holders the same way: its ``open`` returns the container
octets (a header built from the descriptor, then each object's K || V payload, which is the layer digest's input)
with ``repr_digest=None``, and the same decoder verifies the layer digests.

Concurrency: streams are independent; bound them with a semaphore::

    sem = asyncio.Semaphore(8)
    async def load(match):
        async with sem, fetcher.fetch_layers(match) as stream:
            async for layer in stream: ...
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from http3.client import KvspClient, TransportError
from kvsp_client.api import KvspApi, Lease, RetryElsewhere, ServiceEndpoints
from kvsp_client.producer_digests import ProducerCheck
from kvsp_client.retrieval_sink import LayerSink, receive_inline, stop_delivery
from kvsp_client.sources import BlockSource as BlockSource
from kvsp_client.sources import HttpSource as HttpSource
from kvsp_client.sources import SourceBody as SourceBody
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import (
    ContainerDecoder,
    ContainerError,
    ContainerHeader,
    DecodedLayer,
    EncodedContainer,
    encode,
)
from kvsp_quic.cost import block_layer_count
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.problems import DigestMismatch, Problem
from kvsp_quic.records import Link, LookupMatch, LookupRequest, LookupResponse, ReplicaRecord
from kvsp_quic.retrieval_plan import (
    AttemptError,
    DefaultRanking,
    Failure,
    FailureMemory,
    LayerRange,
    Ranking,
    RetrievalMetrics,
    decodable,
    endpoint_key,
    next_parts,
)

log = logging.getLogger("kvsp.retrieval")

DEFAULT_MAX_LOOKUP_KEYS = 8192  # the Index Service's default limit; longer lookups are sent in parts
REPORT_TIMEOUT = 2.0  # s: a failure report to the Index Service (best effort, in the background)
MAX_PENDING_REPORTS = 64
# The zero-copy decoder's fresh buffers on a path that delivers into them (the lean HTTP/1.1 path): one for the
# rest of the container, up to this size. Measured per 16 MiB block (issue 16): 64 KiB buffers ~84 ms of client
# CPU, 1-4 MiB ~72 ms, one buffer ~55 ms (fewer allocations, and the allocator reuses one large block's memory).
SINK_CHUNK = 64 << 20


# -- results ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FetchResult:
    """A block (or layer range) loaded and verified. ``layers`` are views of the received octets."""

    block_key: bytes
    layers: tuple[DecodedLayer, ...]
    records: tuple[ReplicaRecord, ...]  # the replicas the layers came from (several after a failure midway)
    transports: tuple[str, ...]  # per record: "HTTP/3", "HTTP/1.1", ...
    codec: int
    token_count: int

    @property
    def record(self) -> ReplicaRecord:
        """The replica the first layer came from."""
        return self.records[0]

    @property
    def http_version(self) -> str:
        return self.transports[0]

    @property
    def first_layer(self) -> int:
        return self.layers[0].index

    @property
    def last_layer(self) -> int:
        return self.layers[-1].index

    def container(self) -> EncodedContainer:
        """The layers as a container (header rebuilt; sections are the received views, joined only when a layer
        arrived in several chunks)."""
        return encode([(layer.k, layer.v) for layer in self.layers], first_layer=self.first_layer,
                      token_count=self.token_count, codec=self.codec, digests=False)

    def tobytes(self) -> bytes:
        return self.container().tobytes()


class LayerStream:
    """The verified layers of one block (or layer range), in ascending order, as they arrive.

    Iterate it once (``async for``); use ``async with`` (or :meth:`aclose`) when you may stop early, so that the
    transfer is cancelled and the lease released at once. Afterwards ``complete`` says whether every requested
    layer was delivered; if not, the block is missing from ``next_layer`` on (recompute it).
    """

    def __init__(self, fetcher: BlockFetcher, match: LookupMatch, layers: LayerRange, whole: bool,
                 codec: int | None, count: bool, lease_ms: int | None) -> None:
        self._fetcher = fetcher
        self.match = match
        self.lease_ms = lease_ms  # each replica leased for this long before it is fetched (None: no lease)
        self.first, self.last = layers
        self.whole = whole  # the caller asked for the whole block (the replica digest can be checked)
        self.codec = codec
        self.next_layer = self.first
        self.records: list[ReplicaRecord] = []
        self.transports: list[str] = []
        self.header: ContainerHeader | None = None  # the header of the last container that delivered layers
        self.done = False
        self._count = count
        self._iterator: AsyncGenerator[DecodedLayer, None] | None = None

    @property
    def block_key(self) -> bytes:
        return bytes(self.match.block_key)

    @property
    def complete(self) -> bool:
        return self.next_layer > self.last

    def __aiter__(self) -> AsyncIterator[DecodedLayer]:
        if self._iterator is not None:
            raise RuntimeError("a LayerStream can be iterated only once")
        self._iterator = self._run()
        return self._iterator

    async def aclose(self) -> None:
        if self._iterator is not None:
            await self._iterator.aclose()

    async def __aenter__(self) -> LayerStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self) -> AsyncGenerator[DecodedLayer, None]:
        fetcher = self._fetcher
        try:
            usable = fetcher._usable(self.match, (self.first, self.last), self.codec)
            tried: set[str] = set()  # holders (one replica per key each) that failed in this stream
            warmed = False
            while not self.complete:
                # the next part, from the replicas holding next_layer on (partial replicas assembled: issue 13)
                parts = fetcher._parts([r for r in usable if r.holder not in tried], (self.next_layer, self.last))
                if not warmed:
                    fetcher._warm_alternate(parts)
                    warmed = True
                if not parts:
                    break
                record, source, (_first, end) = parts[0]
                if fetcher.failures.recent(record.holder):  # failed while this stream was running
                    fetcher.metrics.skipped_recent_failures += 1
                    tried.add(record.holder)
                    continue
                fetcher.metrics.attempts += 1
                lease: Lease | None = None
                before = self.next_layer
                try:
                    if self.lease_ms is not None:
                        lease = await source.lease(record, self.lease_ms)
                        if lease is not None:
                            fetcher.metrics.leases_taken += 1
                    async with contextlib.aclosing(self._attempt(source, record, end)) as attempt:
                        async for layer in attempt:
                            yield layer
                except AttemptError as err:
                    tried.add(record.holder)
                    await fetcher._failed(record, err)
                finally:
                    if lease is not None and await source.release(lease):
                        fetcher.metrics.leases_released += 1
                if self.next_layer == before:  # no progress without an error: never ask it again
                    tried.add(record.holder)
        finally:
            self.done = True
        if self._count:
            if self.complete:
                fetcher.metrics.hits += 1
            else:
                fetcher.metrics.misses += 1

    async def _attempt(self, source: BlockSource, record: ReplicaRecord,
                       end: int) -> AsyncGenerator[DecodedLayer, None]:
        """One replica: stream, verify and yield layers from ``next_layer`` to *end* (``last``, or the end of the
        part a partial replica gives); AttemptError on failure. Each layer is checked against *record*'s layer
        digest for it (a part never reaches past the replica's residency, so never against a placeholder); the
        replica digest only when this one replica gives the whole block (spec, "Block Retrieval and Storage")."""
        fetcher = self._fetcher
        first, last = self.next_layer, end
        whole_request = self.whole and first == 0 and last == self.last
        transcoded = self.codec is not None and self.codec != record.codec
        expected = None if transcoded else record.layer_digests
        body = await source.open(record, None if whole_request else (first, last), self.codec)
        decoder = ContainerDecoder(
            fetcher.descriptors.get(bytes(record.compat_id)),
            expected_layer_digests=expected,
            expected_replica_digest=record.digest if whole_request and not transcoded else None,
            assemble=fetcher.assemble, allocate=fetcher.allocate,
            max_data=fetcher.max_block_bytes if transcoded else record.size,
            # delivered into: the zero-copy mode's fresh buffers are the decoder's own, so few large ones
            chunk_size=SINK_CHUNK if body.receive_into is not None else 1 << 16)
        streaming = expected is not None  # each layer can be checked on its own
        if not streaming and body.repr_digest is None:
            await body.close()
            raise AttemptError(Failure.BAD_RESPONSE, f"{record.holder}: nothing to verify the block against (no "
                                                     f"layer digests, no representation digest)")
        delivered = False

        def deliver(layer: DecodedLayer) -> DecodedLayer:
            nonlocal delivered
            if not delivered:  # this replica is a source of the result from its first layer on
                delivered = True
                self.records.append(record)
                self.transports.append(body.transport)
                self.header = decoder.header
            self.next_layer = layer.index + 1
            fetcher.metrics.layers += 1
            return layer

        whole = hashlib.sha256() if body.repr_digest is not None else None  # sources without one: no extra pass
        held: list[DecodedLayer] = []
        checked = False
        try:
            if body.receive_into is not None:  # TLS decrypts into the decoder's buffers; layers come as they complete
                sink = LayerSink(decoder, whole, streaming, held,
                                  lambda header: self._check_header(header, record, first, last),
                                  functools.partial(fetcher.metrics.add_bytes, body.transport))
                receiving: asyncio.Task[int] | None = None
                if not streaming or first == last:  # every layer ends the container: no task, nothing to hand over
                    await receive_inline(body.receive_into, sink, body.stall_timeout)
                else:
                    receiving = asyncio.get_running_loop().create_task(sink.receive(body.receive_into))
                try:
                    while receiving is not None:
                        if sink.ready:
                            ready, sink.ready = sink.ready, []
                            for layer in ready:
                                yield deliver(layer)
                        elif receiving.done():
                            receiving.result()  # the sink's exception (a digest mismatch...) or the transport's
                            break
                        else:
                            await sink.wait(body.stall_timeout)
                finally:
                    if receiving is not None:
                        await stop_delivery(receiving)
            else:
                async for chunk in body.chunks:
                    fetcher.metrics.add_bytes(body.transport, len(chunk))
                    if whole is not None:
                        whole.update(chunk)
                    layers = decoder.feed(chunk)
                    if not checked and decoder.header is not None:
                        self._check_header(decoder.header, record, first, last)
                        checked = True
                    if streaming and not decoder.done:
                        for layer in layers:
                            yield deliver(layer)
                    else:  # the layers that end the container wait for the end of the body and Repr-Digest
                        held.extend(layers)
            decoder.finish()
            if whole is not None and whole.digest() != body.repr_digest:
                raise AttemptError(Failure.CORRUPT, f"{record.holder}: Repr-Digest does not match the body")
        except DigestMismatch as exc:
            raise AttemptError(Failure.CORRUPT, f"{record.holder}: {exc.detail}") from None
        except ContainerError as exc:
            raise AttemptError(Failure.MALFORMED, f"{record.holder}: {exc.detail}") from None
        except TransportError as exc:
            raise AttemptError(Failure.TRANSPORT, f"{record.holder}: {exc}") from None
        finally:
            await body.close()
        for layer in held:
            yield deliver(layer)

    def _check_header(self, header: ContainerHeader, record: ReplicaRecord, first: int, last: int) -> None:
        codec = record.codec if self.codec is None else self.codec
        if header.first_layer != first or header.last_layer != last or header.codec != codec:
            raise ContainerError(f"asked for layers {first}-{last} in codec {codec}; got layers "
                                 f"{header.first_layer}-{header.last_layer} in codec {header.codec}")
        if self.header is not None and header.token_count != self.header.token_count:
            raise ContainerError(f"token count {header.token_count} differs from the {self.header.token_count} "
                                 f"of the layers already delivered")


@dataclass(frozen=True)
class IndexUnavailable:
    """A lookup the Index Service did not answer (unreachable, timed out, 5xx, 429, an unreadable answer): nothing
    is known of the blocks, the caller recomputes them (and may ask again later)."""

    detail: str


class Default:
    """The type of :data:`DEFAULT`: a call's *lease_ms* left to the fetcher's."""


DEFAULT = Default()


# -- the fetcher ------------------------------------------------------------------------------------------------


class BlockFetcher:
    """Lookups at one Index Service and verified block retrieval from the replicas it lists.

    * *client*: the mutual-TLS client for the Index Service and ``https`` holders.
    * *lease_ms*: the default of the calls' *lease_ms*: take a lease of this TTL at each replica before fetching
      it (released afterwards); None, no lease.
    * *ranking*: orders the replicas of a block (default :class:`DefaultRanking` with *links*).
    * *links*: this client's links to holders (as in its Instance Status Record), for the default ranking.
    * *failures*: the memory of holders that failed recently (default: 10 s).
    * *descriptors*: Compatibility Descriptors; a container of a known compat_id is checked against its geometry.
    * *exclude_holders*: holders never fetched from (an instance's own base URI).
    * *sources*: the source kinds (default: one :class:`HttpSource` over *client*).
    * *withdraw_corrupt*: withdraw replicas that served wrong data on the holder's behalf (needs the ``holder``
      role with ``publish_for`` at the Index Service; a 403 is only counted).
    * *require_producer_digest*: the producer-digest mode (docs/wire.md, "Producer digests"): a lookup keeps only
      replicas whose digests equal those a producing instance published (:class:`kvsp_client.producer_digests.
      ProducerCheck`); the prefix ends at the first block without one, which the caller recomputes.
    * *report_failures*: after a transport failure, report the holder to the Index Service in the background
      (``POST {is}holders/{holder-id}/failures``; it tries the holder last for a while: docs/wire.md, "Dead
      sources"), once per holder while *failures* remembers it.
    * *assemble*, *allocate*: decoder mode. Default: zero-copy, a layer's K and V are the received chunks'
      views (``k_parts``); ``assemble=True`` copies each container into one buffer from *allocate*.
    """

    def __init__(self, client: KvspClient, index_uri: str | Sequence[str] | ServiceEndpoints, *,
                 lease_ms: int | None = None,
                 metrics: RetrievalMetrics | None = None, ranking: Ranking | None = None,
                 links: Iterable[Link] | Mapping[str, Link] | None = None, failures: FailureMemory | None = None,
                 descriptors: Iterable[CompatDescriptor] = (), exclude_holders: Iterable[str] = (),
                 sources: Sequence[BlockSource] | None = None, withdraw_corrupt: bool = True,
                 assemble: bool = False, allocate: Callable[[int], Any] | None = None,
                 max_block_bytes: int = 1 << 30, max_lookup_keys: int = DEFAULT_MAX_LOOKUP_KEYS,
                 timeout: float | None = None, report_failures: bool = True,
                 require_producer_digest: bool = False) -> None:
        _check_lease_ms(lease_ms)
        if max_lookup_keys < 1:
            raise ValueError("max_lookup_keys must be positive")
        if ranking is not None and links is not None:
            raise ValueError("links feed the default ranking; give them to your ranking instead")
        self.client = client
        self.api = KvspApi(client, timeout=timeout)
        self.index_uri = ServiceEndpoints.of(index_uri, "index URI")  # one URI or several (failover)
        self.lease_ms = lease_ms
        self.metrics = metrics if metrics is not None else RetrievalMetrics()
        self.ranking: Ranking = ranking if ranking is not None else DefaultRanking(links)
        self.failures = failures if failures is not None else FailureMemory()
        self.descriptors = {bytes(d.compat_id): d for d in descriptors}
        self.exclude_holders = frozenset(exclude_holders)
        self.sources: tuple[BlockSource, ...] = tuple(sources) if sources is not None else (
            HttpSource(client, timeout=timeout),)
        self.withdraw_corrupt = withdraw_corrupt
        self.assemble = assemble
        self.allocate = allocate
        self.max_block_bytes = max_block_bytes
        self.max_lookup_keys = max_lookup_keys
        self.timeout = timeout
        self._withdraw_denied: set[str] = set()  # holders the Index Service refused withdrawals for
        self.report_failures = report_failures
        self._reports: set[asyncio.Task[None]] = set()  # failure reports under way
        self.producer_check: ProducerCheck | None = None
        self.require_producer_digest(require_producer_digest)

    def require_producer_digest(self, on: bool) -> None:
        """The producer-digest mode (issue 13), on or off: lookups keep only replicas whose digests a producing
        instance published."""
        self.producer_check = ProducerCheck(self.client, timeout=self.timeout, max_keys=self.max_lookup_keys) \
            if on else None

    # -- lookup -------------------------------------------------------------------------------------------------

    async def lookup(self, compat_id: bytes, scope_id: bytes, keys: Sequence[bytes],
                     targets: Sequence[str] | None = None) -> LookupResponse:
        """:meth:`find`, with an Index Service that did not answer as an empty match (the caller recomputes)."""
        found = await self.find(compat_id, scope_id, keys, targets)
        if isinstance(found, IndexUnavailable):
            return LookupResponse(0, (), () if targets is not None else None)
        return found

    async def find(self, compat_id: bytes, scope_id: bytes, keys: Sequence[bytes],
                   targets: Sequence[str] | None = None) -> LookupResponse | IndexUnavailable:
        """``POST {is}lookup``: the matched prefix of *keys* with its replicas.

        More keys than *max_lookup_keys* are sent in parts, the next only while every key so far matched. An
        Index Service that cannot be reached, times out or answers 5xx gives :class:`IndexUnavailable` (counted in
        ``lookup_errors``); a 4xx answer is a misconfiguration and raises its :class:`~kvsp_quic.problems.Problem`
        (403 ``kvsp-scope-denied``: this client lacks the scope). The sources are told what was found
        (:meth:`BlockSource.note_lookup`).
        """
        compat, scope, keys = _check_ids(compat_id, scope_id, keys)
        targets = list(targets) if targets is not None else None
        self.metrics.lookups += 1
        self.metrics.lookup_keys += len(keys)
        if not keys and targets is None:
            return LookupResponse(0, ())
        blocks: list[LookupMatch] = []
        estimates = None
        start = 0
        while True:
            part = keys[start:start + self.max_lookup_keys]
            answer = await self._lookup_part(compat, scope, part, targets if start == 0 else None)
            if isinstance(answer, IndexUnavailable):
                self.metrics.lookup_errors += 1
                return answer
            if start == 0:
                estimates = answer.targets
            matched = _usable_prefix(answer, compat, scope, part)
            blocks.extend(matched)
            start += len(part)
            if len(matched) < len(part) or start >= len(keys):
                break
        self.metrics.lookup_matched += len(blocks)
        if self.producer_check is not None:
            blocks = await self.producer_check.vouched(self.index_uri, compat, scope, blocks, self.metrics)
        for source in self.sources:
            source.note_lookup(blocks)
        return LookupResponse(len(blocks), tuple(blocks), estimates)

    async def _lookup_part(self, compat: bytes, scope: bytes, keys: list[bytes],
                           targets: list[str] | None) -> LookupResponse | IndexUnavailable:
        request = LookupRequest(ScopeId(scope), CompatId(compat), tuple(BlockKey(k) for k in keys),
                                tuple(targets) if targets is not None else None)
        try:
            return await self.api.lookup(self.index_uri, request)
        except RetryElsewhere as exc:  # unreachable, 5xx, 429, unreadable: the caller recomputes
            log.warning("lookup at %s failed: %s", self.index_uri, exc)
            return IndexUnavailable(str(exc))

    # -- retrieval ----------------------------------------------------------------------------------------------

    def fetch_layers(self, match: LookupMatch, layers: LayerRange | None = None, *, codec: int | None = None,
                     lease_ms: int | Default | None = DEFAULT) -> LayerStream:
        """The verified layers of *match*'s block (all of them, or the inclusive range *layers*), as they arrive.

        *codec* asks the holders for a codec (``codec=n``); a transcoded representation is protected only by
        Repr-Digest, so its layers are delivered after the whole body was verified. *lease_ms*: lease each replica
        for that long before fetching it (None: no lease; default: the fetcher's *lease_ms*).
        """
        return self._stream(match, layers, codec, count=True, lease_ms=lease_ms)

    async def fetch_block(self, match: LookupMatch, layers: LayerRange | None = None, *, codec: int | None = None,
                          lease_ms: int | Default | None = DEFAULT) -> FetchResult | None:
        """The whole block (or *layers*), verified; None when no replica delivers it (the caller recomputes)."""
        return await self._collect(self._stream(match, layers, codec, count=True, lease_ms=lease_ms))

    async def load_prefix(self, compat_id: bytes, scope_id: bytes, keys: Sequence[bytes], *,
                          layers: LayerRange | None = None, codec: int | None = None,
                          concurrency: int = 4, lease_ms: int | Default | None = DEFAULT) -> list[FetchResult | None]:
        """Look *keys* (a prompt's Block Keys in prefix order) up and load the matched blocks, at most
        *concurrency* at a time. One result per key; every key from the first missing block on is None (later
        blocks depend on earlier ones, so the caller recomputes from there), and their transfers are cancelled.
        """
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        found = await self.lookup(compat_id, scope_id, keys)
        results: list[FetchResult | None] = [None] * len(keys)
        gate = asyncio.Semaphore(concurrency)
        first_missing = len(keys)

        async def one(i: int, match: LookupMatch) -> FetchResult | None:
            nonlocal first_missing
            async with gate:
                if i > first_missing:  # an earlier block is missing: this one is recomputed anyway
                    return None
                result = await self._collect(self._stream(match, layers, codec, count=False, lease_ms=lease_ms))
                if result is None:
                    first_missing = min(first_missing, i)
                return result

        tasks = [asyncio.create_task(one(i, match)) for i, match in enumerate(found.blocks)]
        loaded = 0
        try:
            for i, task in enumerate(tasks):
                result = await task
                if result is None:
                    break
                results[i] = result
                loaded += 1
        finally:
            pending = [task for task in tasks if not task.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self.metrics.hits += loaded
        self.metrics.misses += len(keys) - loaded
        return results

    def _stream(self, match: LookupMatch, layers: LayerRange | None, codec: int | None, *, count: bool,
                lease_ms: int | Default | None) -> LayerStream:
        if not isinstance(match, LookupMatch):
            raise TypeError("fetch a LookupMatch (an entry of LookupResponse.blocks)")
        lease = self.lease_ms if isinstance(lease_ms, Default) else _check_lease_ms(lease_ms)
        if codec is not None and (isinstance(codec, bool) or not 0 < codec <= 0xFFFF):
            raise ValueError(f"codec must be 1-65535, got {codec!r}")
        descriptor = self.descriptors.get(bytes(match.replicas[0].compat_id))
        total = block_layer_count(match.replicas, descriptor.layers if descriptor is not None else None)
        if layers is None:
            return LayerStream(self, match, (0, total - 1), True, codec, count, lease)
        first, last = layers
        if not (isinstance(first, int) and isinstance(last, int)) or not 0 <= first <= last < total:
            raise ValueError(f"layers {layers!r}: need 0 <= first <= last < {total} (the block's layers)")
        return LayerStream(self, match, (first, last), first == 0 and last == total - 1, codec, count, lease)

    async def _collect(self, stream: LayerStream) -> FetchResult | None:
        async with stream:
            layers = tuple([layer async for layer in stream])
        if not stream.complete or stream.header is None:
            return None
        used = [(r, t) for r, t in zip(stream.records, stream.transports, strict=True)]
        return FetchResult(stream.block_key, layers, tuple(r for r, _ in used), tuple(t for _, t in used),
                           stream.header.codec, stream.header.token_count)

    def _usable(self, match: LookupMatch, layers: LayerRange,
                codec: int | None = None) -> list[ReplicaRecord]:
        """The replicas of *match* worth trying for some of *layers*: of the match's compat_id and scope, holding a
        layer of *layers*, fetchable by a source; not those whose codec (or the requested *codec*) this client
        cannot decode (:func:`~kvsp_quic.retrieval_plan.decodable`), nor those whose holder failed recently."""
        reference = match.replicas[0]
        first, last = layers
        usable: list[ReplicaRecord] = []
        for record in match.replicas:
            if record.compat_id != reference.compat_id or record.scope_id != reference.scope_id:
                continue
            if not decodable(record, codec):
                self.metrics.skipped_unknown_codec += 1
                continue
            if record.holder in self.exclude_holders or \
                    not any(e.layers[0] <= last and e.layers[1] >= first for e in record.residency):
                continue
            if self._source_for(record) is None:
                continue
            if self.failures.recent(record.holder):
                self.metrics.skipped_recent_failures += 1
                continue
            usable.append(record)
        return usable

    def _parts(self, usable: Sequence[ReplicaRecord],
               layers: LayerRange) -> list[tuple[ReplicaRecord, BlockSource, LayerRange]]:
        """The replicas to try next for *layers* (:func:`~kvsp_quic.retrieval_plan.next_parts`: one replica
        holding them all first, else the start of the cheapest chain of partial replicas), best first, each with
        its source and the part it gives."""
        out: list[tuple[ReplicaRecord, BlockSource, LayerRange]] = []
        for record, part in next_parts(usable, layers, self.ranking):
            source = self._source_for(record)
            if source is not None:
                out.append((record, source, part))
        return out

    def _warm_alternate(self, candidates: Sequence[tuple[ReplicaRecord, BlockSource, LayerRange]]) -> None:
        """Have the source of the best candidate at another host and port than the first -- where a failure of the
        first falls back to -- open its connection in the background (a source with a ``warm(record)`` method:
        :class:`kvsp_moqt.source.MoqtSource`), so that a source dying mid-load costs the refetch, not a handshake
        too."""
        if len(candidates) < 2:
            return
        first = endpoint_key(candidates[0][0].holder)
        for record, source, _part in candidates[1:]:
            if endpoint_key(record.holder) != first:
                warm = getattr(source, "warm", None)
                if warm is not None:
                    warm(record)
                return

    def _source_for(self, record: ReplicaRecord) -> BlockSource | None:
        return next((s for s in self.sources if s.handles(record)), None)

    async def _failed(self, record: ReplicaRecord, err: AttemptError) -> None:
        failure = err.failure
        self.metrics.count_failure(failure)
        level = logging.WARNING if failure.withdraws else logging.INFO
        log.log(level, "replica of %s at %s: %s", record.block_key.hex(), record.holder, err.detail)
        if failure.remembered:
            if err.unreachable:
                self.metrics.unreachable += 1
            if self.report_failures and failure is Failure.TRANSPORT and not self.failures.recent(record.holder):
                self._report(record)  # once per holder while it is remembered
            self.failures.note(record.holder, unreachable=err.unreachable)
        if failure.withdraws and self.withdraw_corrupt:
            await self.withdraw(record)

    def _report(self, record: ReplicaRecord) -> None:
        """Tell the Index Service, in the background, that *record*'s holder could not be reached, so that other
        clients of the scope try its replicas last (docs/wire.md, "Holder liveness and failure reports")."""
        async def report() -> None:
            try:
                await self.api.report_failure(self.index_uri, record.holder, record.scope_id, timeout=REPORT_TIMEOUT)
                self.metrics.failures_reported += 1
            except (TransportError, Problem) as exc:
                log.info("reporting %s to the Index Service: %s", record.holder, exc)

        if len(self._reports) < MAX_PENDING_REPORTS:
            task = asyncio.get_running_loop().create_task(report(), name=f"kvsp-report-{record.holder}")
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)

    # -- withdrawal on a holder's behalf --------------------------------------------------------------------------

    async def withdraw(self, record: ReplicaRecord) -> bool:
        """``DELETE {is}replicas/{holder-id}/{block_key}`` for a replica that served wrong data (spec, Error
        Handling). True when the record is gone (204, or 404: it already was). A 403 is counted and that
        holder's replicas are not withdrawn again by this fetcher."""
        if record.holder in self._withdraw_denied:
            self.metrics.withdrawals_denied += 1
            return False
        url = self.api.replica_url(self.index_uri, record.holder, record.block_key)
        try:
            await self.api.withdraw(self.index_uri, record.holder, record.block_key)  # False: already gone
        except Problem as exc:
            if exc.status != 403:
                self.metrics.withdrawal_errors += 1
                log.info("withdrawing %s: %s", url, exc)
                return False
            self.metrics.withdrawals_denied += 1
            self._withdraw_denied.add(record.holder)
            log.info("not authorized to withdraw replicas of %s: %s", record.holder, exc)
            return False
        except TransportError as exc:
            self.metrics.withdrawal_errors += 1
            log.info("withdrawing %s failed: %s", url, exc)
            return False
        self.metrics.withdrawals += 1
        log.warning("withdrew the replica of %s at %s on its holder's behalf", record.block_key.hex(), record.holder)
        return True


# -- helpers ----------------------------------------------------------------------------------------------------


def _check_lease_ms(lease_ms: int | None) -> int | None:
    if lease_ms is not None and (isinstance(lease_ms, bool) or not isinstance(lease_ms, int) or lease_ms <= 0):
        raise ValueError("lease_ms must be a positive number of milliseconds")
    return lease_ms


def _check_ids(compat_id: bytes, scope_id: bytes, keys: Sequence[bytes]) -> tuple[bytes, bytes, list[bytes]]:
    if not isinstance(compat_id, bytes | bytearray) or len(compat_id) != 32:
        raise ValueError("compat_id is 32 octets")
    if not isinstance(scope_id, bytes | bytearray) or len(scope_id) != 16:
        raise ValueError("scope_id is 16 octets")
    as_object: object = keys
    if isinstance(as_object, bytes | bytearray | str):
        raise TypeError("keys is a sequence of 32-octet Block Keys")
    out = [bytes(key) for key in keys]
    if any(len(key) != 32 for key in out):
        raise ValueError("every Block Key is 32 octets")
    return bytes(compat_id), bytes(scope_id), out


def _usable_prefix(answer: LookupResponse, compat: bytes, scope: bytes, keys: list[bytes]) -> list[LookupMatch]:
    """The answer's blocks that are the requested keys in order, keeping only replicas of the request's scope and
    compat_id; stops at the first block left without a replica."""
    out: list[LookupMatch] = []
    for i, match in enumerate(answer.blocks):
        if i >= len(keys) or bytes(match.block_key) != keys[i]:
            break
        replicas = tuple(r for r in match.replicas if r.compat_id == compat and r.scope_id == scope)
        if not replicas:
            break
        out.append(match if len(replicas) == len(match.replicas) else LookupMatch(match.block_key, replicas))
    return out


__all__ = [
    "DEFAULT", "BlockFetcher", "BlockSource", "FetchResult", "HttpSource", "IndexUnavailable", "LayerStream", "Lease",
    "SourceBody",
]
