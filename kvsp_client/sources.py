"""The source kinds of :class:`kvsp_client.retrieval.BlockFetcher`: how one attempt gets a replica's octets.

A :class:`BlockSource` is chosen by the replica's holder URI; :class:`HttpSource` serves ``https`` holders through
:class:`kvsp_client.api.KvspApi`, whose failure classes (miss, retry elsewhere, refused) it maps onto
:class:`~kvsp_quic.retrieval_plan.Failure`; ``kvsp_moqt.source.MoqtSource`` serves ``moqt://`` holders the same way.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from http3.body_sink import BufferSink
from http3.client import KvspClient, TransportError
from kvsp_client.api import BadResponse, KvspApi, Lease, Miss, RetryElsewhere
from kvsp_quic.problems import LeaseQuota, Problem
from kvsp_quic.records import LeaseRequest, LookupMatch, ReplicaRecord
from kvsp_quic.retrieval_plan import AttemptError, Failure, LayerRange, failure_for_status

log = logging.getLogger("kvsp.retrieval")


@dataclass(frozen=True)
class SourceBody:
    """The container octets one source sends for one request."""

    chunks: AsyncIterator[bytes | memoryview]  # immutable chunks (kept as views in the zero-copy decoder mode)
    repr_digest: bytes | None  # SHA-256 of the whole body as the source states it; None: this kind states none
    transport: str  # "HTTP/3", "HTTP/2", "HTTP/1.1", "moqt", ...: the key of RetrievalMetrics.bytes_by_transport
    close: Callable[[], Awaitable[None]]
    # Set where the transport delivers the body into a sink itself, TLS decrypting straight into the sink's buffers
    # (the lean HTTP/1.1 path: http3.client.Response.receive_into): the attempt then hands it a sink around its
    # decoder instead of iterating *chunks* (issue 16: no scratch buffer, no bytes copy). The whole body is
    # delivered by one call; *stall_timeout* (s) bounds how long it may go without octets (the attempt keeps it).
    receive_into: Callable[[BufferSink], Coroutine[Any, Any, int]] | None = None
    stall_timeout: float | None = None


class BlockSource(Protocol):
    """One way of fetching a replica's octets. Methods raise :class:`AttemptError` for every failure that
    should move on to the next replica (the engine counts it, remembers the holder, withdraws corrupt data)."""

    kind: str

    def handles(self, record: ReplicaRecord) -> bool:
        """Whether this source can fetch *record* (by its holder URI's scheme)."""
        ...

    def note_lookup(self, blocks: Sequence[LookupMatch]) -> None:
        """The replicas a lookup of the fetcher returned (a source that leases ``moqt://`` replicas at their
        publisher's ``https`` twin learns the twins here)."""
        ...

    async def lease(self, record: ReplicaRecord, ttl_ms: int) -> Lease | None:
        """Take a lease on the replica; None when this kind of source has no leases."""
        ...

    async def release(self, lease: Lease) -> bool:
        """Release a lease (best effort; never raises for a failure). True when the holder confirmed."""
        ...

    async def open(self, record: ReplicaRecord, layers: LayerRange | None, codec: int | None) -> SourceBody:
        """Start the transfer of the container (the whole block when *layers* is None)."""
        ...


class HttpSource:
    """``https`` holders, through :class:`~kvsp_client.api.KvspApi` (HTTP/3, falling back to HTTP/1.1 or 2): its
    failure classes become :class:`~kvsp_quic.retrieval_plan.Failure` kinds here."""

    kind = "https"

    def __init__(self, client: KvspClient, *, timeout: float | None = None) -> None:
        self.client = client
        self.timeout = timeout
        self.api = KvspApi(client, timeout=timeout)

    def handles(self, record: ReplicaRecord) -> bool:
        return record.holder.startswith("https://")

    def note_lookup(self, blocks: Sequence[LookupMatch]) -> None:
        pass

    async def lease(self, record: ReplicaRecord, ttl_ms: int) -> Lease | None:
        request = LeaseRequest(record.compat_id, record.scope_id, (record.block_key,), ttl_ms)
        what = f"POST {record.holder}leases"
        try:
            granted = await self.api.create_lease(record.holder, request)
        except BadResponse as exc:  # an unreadable grant; any other unexpected answer: no lease there
            raise AttemptError(Failure.BAD_RESPONSE if exc.status == 201 else Failure.LEASE_REFUSED,
                               str(exc)) from None
        except RetryElsewhere as exc:
            failure = _failure(exc)
            if isinstance(exc.problem, LeaseQuota) or exc.status == 429:
                failure = Failure.LEASE_REFUSED
            raise AttemptError(failure, str(exc), unreachable=_unreachable(exc)) from None
        except Problem as exc:  # 403 and friends: this client gets no lease there
            raise AttemptError(Failure.LEASE_REFUSED, f"{what}: {exc}") from None
        if isinstance(granted, Miss):
            raise AttemptError(Failure.MISS, str(granted))
        return granted

    async def release(self, lease: Lease) -> bool:
        try:
            return await self.api.release_lease(lease)  # False: expired meanwhile
        except (TransportError, Problem) as exc:
            log.info("releasing lease %s failed: %s", lease.url, exc)
            return False

    async def open(self, record: ReplicaRecord, layers: LayerRange | None, codec: int | None) -> SourceBody:
        try:
            body = await self.api.get_block(record.holder, record.compat_id, record.scope_id, record.block_key,
                                            layers=layers, codec=codec)
        except RetryElsewhere as exc:
            raise AttemptError(_failure(exc), str(exc), unreachable=_unreachable(exc)) from None
        except Problem as exc:
            raise AttemptError(failure_for_status(exc.status), f"GET {record.holder}: {exc}") from None
        if isinstance(body, Miss):
            raise AttemptError(Failure.MISS, f"GET {body}")
        # a holder that goes silent mid-body (frozen, or gone where no ICMP comes back) costs a few RTTs and the
        # block's transfer time at a slow rate, not the request timeout (issue 12, point 5: quic.rtt.path_timeout)
        response = body.response
        stall = self.client.stall_timeout(record.holder, octets=record.size, ceiling=response.read_timeout)
        response.read_timeout = stall
        chunks = body.aiter_bytes()

        async def close() -> None:
            await chunks.aclose()  # type: ignore[attr-defined]  # an async generator
            await body.aclose()

        if not response.delivers_into:  # HTTP/3, httpx: chunk by chunk (the decoder keeps views of them)
            return SourceBody(chunks, body.repr_digest, body.http_version, close)

        async def receive_into(sink: BufferSink) -> int:
            # the attempt times stalls itself, from the sink's progress: no deadline for the whole body here
            response.read_timeout = None
            return await response.receive_into(sink)

        return SourceBody(chunks, body.repr_digest, body.http_version, close, receive_into, stall)


def _unreachable(exc: RetryElsewhere) -> bool:
    """Whether a failure without an answer shows that nothing listens at the holder's port (ICMP port unreachable
    ended the HTTP/3 connection: :class:`quic.protocol.PeerUnreachable`)."""
    return exc.status is None and exc.unreachable


def _failure(exc: RetryElsewhere) -> Failure:
    """The retrieval failure kind of a "retry elsewhere" answer."""
    if isinstance(exc, BadResponse):
        return Failure.BAD_RESPONSE
    if exc.status is None:
        return Failure.TRANSPORT
    return failure_for_status(exc.status)



__all__ = ["BlockSource", "HttpSource", "SourceBody"]
