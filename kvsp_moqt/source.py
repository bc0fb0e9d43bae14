"""The ``moqt://`` source of :class:`http3.retrieval.BlockFetcher`: a replica's layers by MOQT FETCH, with the same
verification as HTTP, and the fallback to the ``https`` replica when MOQT is not possible.

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

import contextlib
from collections.abc import AsyncGenerator, Iterable, Sequence

from http3.retrieval import Lease, SourceBody
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
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.retrieval_plan import AttemptError, DefaultRanking, Failure, LayerRange, Ranking
from moqt.aio import (
    FetchStream,
    MoqtConnectError,
    MoqtPool,
    MoqtRequestError,
    MoqtSessionClosed,
    MoqtStalled,
    MoqtStreamError,
)
from moqt.errors import MoqtUsageError
from moqt.types import Draft


class MoqtSource:
    """:class:`http3.retrieval.BlockSource` for ``moqt://`` replicas (see the module docstring)."""

    kind = "moqt"

    def __init__(self, pool: MoqtPool, descriptors: Iterable[CompatDescriptor], *,
                 accept_timeout: float = 5.0, stall_timeout: float = 5.0) -> None:
        self.pool = pool
        self.descriptors = {bytes(d.compat_id): d for d in descriptors}
        self.accept_timeout = accept_timeout
        self.stall_timeout = stall_timeout

    def handles(self, record: ReplicaRecord) -> bool:
        return (record.holder.startswith("moqt://") and record.moqt_namespace is not None
                and record.layer_digests is not None and bytes(record.compat_id) in self.descriptors)

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
            raise AttemptError(Failure.TRANSPORT, f"{where}: {exc}") from None
        start, end = fetch_range(first, last)
        try:
            fetch = conn.fetch(namespace, name, start, end, stall_timeout=self.stall_timeout)
        except (MoqtSessionClosed, MoqtUsageError) as exc:  # closed, or going away (GOAWAY) since the pool gave it
            raise AttemptError(Failure.TRANSPORT, f"{where}: {exc}") from None
        try:
            await fetch.wait_accepted(self.accept_timeout)
        except MoqtRequestError as exc:
            await fetch.aclose()
            raise AttemptError(_failure_of(conn.draft, exc), f"{where}: FETCH {exc}") from None
        except (MoqtStalled, MoqtSessionClosed, MoqtStreamError) as exc:
            await fetch.aclose()
            raise AttemptError(Failure.TRANSPORT, f"{where}: FETCH: {exc}") from None
        section = descriptor.section_length(descriptor.block_tokens)
        header = ContainerHeader(codec=record.codec, first_layer=first, token_count=descriptor.block_tokens,
                                 lengths=((section, section),) * (last - first + 1))
        chunks = _chunks(fetch, header, LayerAssembler(record, first, last, descriptor=descriptor, verify=False),
                         where)

        async def close() -> None:
            with contextlib.suppress(Exception):
                await chunks.aclose()
            await fetch.aclose()

        return SourceBody(chunks, None, f"MOQT/{conn.draft.value}", close)


async def _chunks(fetch: FetchStream, header: ContainerHeader, assembler: LayerAssembler,
                  where: str) -> AsyncGenerator[bytes | memoryview, None]:
    """The container: *header*, then the payload pieces as they arrive (structure checked, digests left to the
    fetcher's decoder)."""
    yield header.pack()
    try:
        while (piece := await fetch.next_piece()) is not None:
            assembler.feed(piece)
            if piece.data:
                yield piece.data if isinstance(piece.data, memoryview) else memoryview(piece.data)
        assembler.finish()
    except (MalformedTrack, Truncated) as exc:
        raise AttemptError(Failure.MALFORMED, f"{where}: {exc.detail}") from None
    except MoqtStalled as exc:
        raise AttemptError(Failure.TRANSPORT, f"{where}: stalled: {exc}") from None
    except (MoqtStreamError, MoqtSessionClosed, MoqtRequestError) as exc:
        raise AttemptError(Failure.TRANSPORT, f"{where}: {exc}") from None


def _failure_of(draft: Draft, exc: MoqtRequestError) -> Failure:
    if exc.cancelled:
        return Failure.TRANSPORT
    if exc.error_code in (does_not_exist(draft), invalid_range(draft)):
        return Failure.MISS
    if exc.error_code == unauthorized(draft):
        return Failure.REFUSED
    return Failure.SERVER_ERROR


class PreferMoqt:
    """A ranking that tries ``moqt://`` replicas before the others, each group in the order of *inner* (default:
    :class:`~kvsp_quic.retrieval_plan.DefaultRanking`)."""

    def __init__(self, inner: Ranking | None = None) -> None:
        self.inner: Ranking = inner if inner is not None else DefaultRanking()

    def __call__(self, replicas: Sequence[ReplicaRecord], layers: LayerRange) -> list[ReplicaRecord]:
        ordered = self.inner(replicas, layers)
        return sorted(ordered, key=lambda r: 0 if r.holder.startswith("moqt://") else 1)


__all__ = ["MoqtSource", "PreferMoqt"]
