"""The ``moqt://`` source of :class:`kvsp_client.retrieval.BlockFetcher`: a replica's layers by MOQT FETCH, with the
same verification as HTTP, and the fallback to the ``https`` replica when MOQT is not possible.

    pool = MoqtPool(files)
    fetcher = BlockFetcher(client, index_uri, descriptors=[d], ranking=PreferMoqt(),
                           sources=[MoqtSource(pool, [d]), HttpSource(client)])

A holder publishes each replica twice (docs/moqt.md): an ``https`` record and its ``moqt://`` twin. With
:class:`PreferMoqt` the fetcher tries the ``moqt://`` record first; every way MOQT can fail is an
:class:`~kvsp_quic.retrieval_plan.AttemptError`, so the fetcher moves on to the ``https`` record (the same
container GET and checks as without MOQT) and, if layers already arrived over MOQT, asks it for the rest only:

* no MOQT ALPN at the holder, a refused certificate, a handshake or SETUP timeout: ``Failure.TRANSPORT``;
* FETCH_ERROR / REQUEST_ERROR: DOES_NOT_EXIST and INVALID_RANGE are ``MISS``, UNAUTHORIZED is ``REFUSED``,
  anything else ``SERVER_ERROR``;
* no FETCH_OK within *accept_timeout*, no object piece within *stall_timeout*, a reset data stream, a closed
  session: ``TRANSPORT``;

Timeouts scale with the path (issue 12, point 5): by default (*accept_timeout*, *stall_timeout* None) a wait
allows a few probe timeouts of the connection's measured RTT (:meth:`quic.connection.KvspQuicConnection.
path_timeout`: 4 PTOs, at least :data:`MIN_STALL` s) -- and FETCH_OK the time a block takes at a slow rate --
never more than :data:`MAX_STALL` s; and while nothing arrives the source probes the holder with a QUIC PING every
two PTOs (30 to 100 ms): a holder that died answers ICMP port unreachable, which ends the connection at once (a
client's socket is connected), so a dead holder costs milliseconds on loopback and most networks, a frozen one the
stall timeout.
A failure that shows nothing listens at the holder's port any more is marked ``unreachable``: the fetcher then
skips the holder's other records at the same host and port (its ``https`` twin) too. A stall is not (a slow
holder may still serve HTTP). Every transport failure is reported to the Index Service by the fetcher.
* objects that are not the layers asked for (group, order, status, length): ``MALFORMED``; a digest mismatch is
  found by the fetcher's decoder: ``CORRUPT``.

How the octets reach the fetcher: :meth:`MoqtSource.open` returns a container -- the header built from the
descriptor (a replica is a complete block of ``block_tokens`` tokens whose K and V sections have the descriptor's
section length), then each object's payload pieces (K || V, the layer digest's input) as they arrive, views of the
received datagrams -- and no representation digest; the fetcher's :class:`~kvsp_quic.container.ContainerDecoder`
checks every layer against the record's layer digests (and the replica digest for a whole block). So the source
only handles records whose compat_id it has a descriptor for; others are left to the ``https`` replica. MOQT has
no leases (KVSP leases are HTTP resources): ``lease`` returns None.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from kvsp_client.retrieval import HttpSource, Lease, SourceBody
from kvsp_moqt.tracks import (
    LayerAssembler,
    MalformedTrack,
    check_record,
    does_not_exist,
    fetch_range,
    invalid_range,
    record_track,
    unauthorized,
)
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import ContainerHeader, Truncated
from kvsp_quic.keys import uri_id
from kvsp_quic.records import LookupMatch, ReplicaRecord
from kvsp_quic.retrieval_plan import AttemptError, DefaultRanking, Failure, LayerRange, Ranking, endpoint_key
from moqt.aio import (
    FetchStream,
    MoqtConnectError,
    MoqtConnection,
    MoqtPool,
    MoqtRequestError,
    MoqtSessionClosed,
    MoqtStalled,
    MoqtStreamError,
)
from moqt.errors import MoqtUsageError
from moqt.types import Draft
from quic.protocol import peer_unreachable

T = TypeVar("T")
log = logging.getLogger("kvsp.moqt.source")

MIN_STALL = 1.0  # s: the shortest wait for a holder's next octets (a busy or frozen holder, not a dead one)
MAX_STALL = 5.0  # s: the longest, also before any RTT sample
PROBE_FLOOR = 0.03  # s: the shortest quiet time before a PING probes the holder
PROBE_CEILING = 0.1  # s: the longest (a PING is one small packet; a busy machine's RTT variance is not the path's)
WARM_EVERY = 5.0  # s: how often warm() may ask the pool for a connection to one holder
MAX_TWINS = 4096  # holders whose https base URI a LeasingMoqtSource remembers


class MoqtSource:
    """:class:`kvsp_client.retrieval.BlockSource` for ``moqt://`` replicas (see the module docstring)."""

    kind = "moqt"

    def __init__(self, pool: MoqtPool, descriptors: Iterable[CompatDescriptor], *,
                 accept_timeout: float | None = None, stall_timeout: float | None = None) -> None:
        self.pool = pool
        self.descriptors = {bytes(d.compat_id): d for d in descriptors}
        self.accept_timeout = accept_timeout
        self.stall_timeout = stall_timeout
        self._warm_until: dict[str, float] = {}  # holder -> when warm() may connect again
        self._warming: set[asyncio.Task[None]] = set()

    def warm(self, record: ReplicaRecord) -> None:
        """Open (in the background) a connection to *record*'s holder if there is none, at most once every
        :data:`WARM_EVERY` seconds per holder: :class:`kvsp_client.retrieval.BlockFetcher` warms the source it would
        fall back to, so that a failure of the first costs no handshake."""
        now = time.monotonic()
        if not self.handles(record) or now < self._warm_until.get(record.holder, 0.0):
            return
        if len(self._warm_until) >= 4096:
            self._warm_until = {h: t for h, t in self._warm_until.items() if t > now}
        self._warm_until[record.holder] = now + WARM_EVERY
        task = asyncio.get_running_loop().create_task(self._warm(record.holder), name=f"kvsp-warm-{record.holder}")
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _warm(self, holder: str) -> None:
        try:
            await self.pool.get(holder)
        except (MoqtConnectError, OSError, MoqtUsageError, RuntimeError) as exc:  # the fetch will say so too
            log.debug("warming %s: %s", holder, exc)

    def handles(self, record: ReplicaRecord) -> bool:
        return (record.holder.startswith("moqt://") and record.moqt_namespace is not None
                and record.layer_digests is not None and bytes(record.compat_id) in self.descriptors)

    def note_lookup(self, blocks: Sequence[LookupMatch]) -> None:
        pass

    async def lease(self, record: ReplicaRecord, ttl_ms: int) -> Lease | None:
        return None

    async def release(self, lease: Lease) -> bool:
        return True

    async def open(self, record: ReplicaRecord, layers: LayerRange | None, codec: int | None) -> SourceBody:
        where = f"{record.holder} (block {record.block_key.hex()})"
        if codec is not None and codec != record.codec:
            raise AttemptError(Failure.MISS, f"{where}: MOQT serves the stored codec {record.codec} only")
        descriptor = self.descriptors[bytes(record.compat_id)]
        try:
            first, last = check_record(record, layers)
            namespace, name = record_track(record)
        except ValueError as exc:
            raise AttemptError(Failure.MISS, f"{where}: {exc}") from None
        try:
            conn = await self.pool.get(record.holder)
        except (MoqtConnectError, OSError) as exc:
            raise _transport(f"{where}: {exc}", exc) from None
        start, end = fetch_range(first, last)
        section = descriptor.section_length(descriptor.block_tokens)
        stall = self.stall_timeout if self.stall_timeout is not None else conn.quic.path_timeout(
            floor=MIN_STALL, ceiling=MAX_STALL)
        accept = self.accept_timeout if self.accept_timeout is not None else conn.quic.path_timeout(
            floor=MIN_STALL, ceiling=MAX_STALL, octets=2 * section * (last - first + 1))
        try:
            fetch = conn.fetch(namespace, name, start, end, stall_timeout=stall)
        except (MoqtSessionClosed, MoqtUsageError) as exc:  # closed, or going away (GOAWAY) since the pool gave it
            raise AttemptError(Failure.TRANSPORT, f"{where}: {exc}") from None
        try:
            await _probing(fetch.wait_accepted, conn, accept)
        except MoqtRequestError as exc:
            await fetch.aclose()
            raise AttemptError(_failure_of(conn.draft, exc), f"{where}: FETCH {exc}") from None
        except MoqtStalled as exc:
            await fetch.aclose()
            raise AttemptError(Failure.TRANSPORT, f"{where}: FETCH: {exc}") from None
        except (MoqtSessionClosed, MoqtStreamError) as exc:
            await fetch.aclose()
            raise _transport(f"{where}: FETCH: {exc}", exc, conn) from None
        header = ContainerHeader(codec=record.codec, first_layer=first, token_count=descriptor.block_tokens,
                                 lengths=((section, section),) * (last - first + 1))
        chunks = _chunks(fetch, conn, stall, header,
                         LayerAssembler(record, first, last, descriptor=descriptor, verify=False), where)

        async def close() -> None:
            with contextlib.suppress(Exception):
                await chunks.aclose()
            await fetch.aclose()

        return SourceBody(chunks, None, f"MOQT/{conn.draft.value}", close)


def _transport(detail: str, exc: BaseException, conn: MoqtConnection | None = None) -> AttemptError:
    """A transport failure; ``unreachable`` when the connection ended because nothing listens at the holder (ICMP
    port unreachable: the handshake's error was raised from :class:`quic.protocol.PeerUnreachable`, or *conn*'s
    QUIC connection says so)."""
    unreachable = peer_unreachable(exc) or (conn is not None and conn.transport.peer_unreachable)
    return AttemptError(Failure.TRANSPORT, detail, unreachable=unreachable)


async def _probing(wait: Callable[[float], Awaitable[T]], conn: MoqtConnection, limit: float) -> T:
    """``wait(timeout)`` for at most *limit* seconds in all, probing the holder with a QUIC PING whenever a PTO or
    two pass with nothing arriving (a dead holder's ICMP port unreachable then closes the session at once:
    MoqtSessionClosed). MoqtStalled after *limit*."""
    probe_every = conn.quic.path_timeout(floor=PROBE_FLOOR, ceiling=min(limit, PROBE_CEILING), multiplier=2.0)
    waited = 0.0
    while True:
        step = min(probe_every, limit - waited)
        try:
            return await wait(step)
        except MoqtStalled:
            waited += step
            if waited >= limit - 1e-6:
                raise MoqtStalled(f"nothing arrived for {limit:.3g} s") from None
            conn.quic.probe()
            conn.transport.transmit_soon()


async def _chunks(fetch: FetchStream, conn: MoqtConnection, stall: float, header: ContainerHeader,
                  assembler: LayerAssembler, where: str) -> AsyncGenerator[bytes | memoryview, None]:
    """The container: *header*, then the payload pieces as they arrive (structure checked, digests left to the
    fetcher's decoder); at most *stall* seconds without a piece (probing the holder meanwhile)."""
    yield header.pack()
    try:
        while (piece := await _probing(fetch.next_piece, conn, stall)) is not None:
            assembler.feed(piece)
            if piece.data:
                yield piece.data if isinstance(piece.data, memoryview) else memoryview(piece.data)
        assembler.finish()
    except (MalformedTrack, Truncated) as exc:
        raise AttemptError(Failure.MALFORMED, f"{where}: {exc.detail}") from None
    except MoqtStalled as exc:
        raise AttemptError(Failure.TRANSPORT, f"{where}: stalled: {exc}") from None
    except (MoqtStreamError, MoqtSessionClosed, MoqtRequestError) as exc:
        raise _transport(f"{where}: {exc}", exc, conn) from None


def _failure_of(draft: Draft, exc: MoqtRequestError) -> Failure:
    if exc.cancelled:
        return Failure.TRANSPORT
    if exc.error_code in (does_not_exist(draft), invalid_range(draft)):
        return Failure.MISS
    if exc.error_code == unauthorized(draft):
        return Failure.REFUSED
    return Failure.SERVER_ERROR


class LeasingMoqtSource(MoqtSource):
    """A :class:`MoqtSource` that leases a ``moqt://`` replica at its publisher's ``https`` base URI (MOQT has no
    leases: KVSP leases are HTTP resources), through *http*. The twins are learnt from the fetcher's lookups
    (:meth:`note_lookup`: every ``https`` record names its holder, whose holder-id a ``moqt://`` twin carries as
    its publisher), at most :data:`MAX_TWINS` of them, the oldest forgotten first.

    A relay's copy (a ``moqt://`` record at another host and port than its publisher: the publisher's own twin
    shares its UDP port) is served from the relay's cache whatever the publisher holds now, so a lease the
    publisher refuses there (404: it gave the block up; 429; unreachable) is no reason to skip the relay: the
    transfer goes on without a lease. At the publisher's own endpoint a refusal still skips the replica."""

    def __init__(self, pool: MoqtPool, descriptors: Iterable[CompatDescriptor], http: HttpSource,
                 **kwargs: Any) -> None:
        super().__init__(pool, descriptors, **kwargs)
        self.http = http
        self.https_of: OrderedDict[str, str] = OrderedDict()  # holder-id -> the holder's https base URI

    def note_lookup(self, blocks: Sequence[LookupMatch]) -> None:
        for match in blocks:
            for record in match.replicas:
                if record.holder.startswith("https://"):
                    holder_id = uri_id(record.holder)
                    self.https_of[holder_id] = record.holder
                    self.https_of.move_to_end(holder_id)
        while len(self.https_of) > MAX_TWINS:
            self.https_of.popitem(last=False)

    async def lease(self, record: ReplicaRecord, ttl_ms: int) -> Lease | None:
        publisher = record.publisher_id
        https = self.https_of.get(publisher) if publisher is not None else None
        if https is None:
            return None
        twin = dataclasses.replace(record, holder=https, moqt_namespace=None)
        if endpoint_key(record.holder) == endpoint_key(https):
            return await self.http.lease(twin, ttl_ms)
        try:
            return await self.http.lease(twin, ttl_ms)
        except AttemptError as exc:  # a relay's copy: its cache serves it without the publisher's lease
            log.info("no lease at %s for the relay copy at %s (%s): fetching without one", https, record.holder, exc)
            return None

    async def release(self, lease: Lease) -> bool:
        return await self.http.release(lease)


class PreferMoqt:
    """A ranking that tries ``moqt://`` replicas before the others, each group in the order of *inner* (default:
    :class:`~kvsp_quic.retrieval_plan.DefaultRanking`)."""

    def __init__(self, inner: Ranking | None = None) -> None:
        self.inner: Ranking = inner if inner is not None else DefaultRanking()

    def __call__(self, replicas: Sequence[ReplicaRecord], layers: LayerRange) -> list[ReplicaRecord]:
        ordered = self.inner(replicas, layers)
        return sorted(ordered, key=lambda r: 0 if r.holder.startswith("moqt://") else 1)


__all__ = ["LeasingMoqtSource", "MoqtSource", "PreferMoqt"]
