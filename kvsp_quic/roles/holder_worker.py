"""A holder's worker process (``kvsp-quic holder --workers N``): serves block GET and PUT on its own core.

The holder's state has one owner, the primary process and its :class:`~kvsp_quic.roles.holder.Holder`: what is
stored where, placement and eviction, leases, the records it publishes (one set of Replica Records, however many
workers serve). A :class:`HolderWorker` has the same surface for the HTTP and MOQT edges (``kvsp_http/holder_app.py``,
``kvsp_moqt/holder_tracks.py``) and does the per-octet work itself:

* reads come straight from the shared store: the shared host tier's files mapped into this process
  (:class:`~kvsp_quic.storage.shared_host.SharedHostReader`), or the local-storage directory, read and verified as
  the primary would (a fault is reported to the primary, which withdraws the replica);
* a PUT is received and verified here, into an unnamed file of the shared host tier, then *staged* and committed
  by the primary (:meth:`PrimaryLink.commit`): its placement, its record;
* leases are the primary's (one table, one quota per client, whichever worker a request reaches).

Every check a request meets is the holder's: the scope and compatibility checks, the precondition of PUT, the codec
and layer range of GET (:func:`~kvsp_quic.roles.holder.layer_range`). Differences, documented in docs/operations.md:
``Cache-Control: max-age`` of a worker's answer is the lower bound of what the replica's record has left (two
thirds of its TTL, or the retention left), and ``GET metrics`` counts the worker that answers.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kvsp_quic.auth import Principal, require_scope
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import ContainerHeader, EncodedContainer, cut
from kvsp_quic.problems import DigestMismatch, NotFound, PreconditionFailed
from kvsp_quic.records import LeaseRenewal, LeaseRequest, LeaseResponse, ReplicaRecord
from kvsp_quic.roles.holder import BlockUpload, Fetched, HolderSettings, stored_data_fault
from kvsp_quic.roles.holder_requests import check_put, descriptor_of, layer_range
from kvsp_quic.storage.shared_host import Allocation, SharedHostReader
from kvsp_quic.storage.tiers import HOST, LOCAL_STORAGE, BlockId, BlockMeta, ChainPosition, LocalStorageTier, TierFault


class PrimaryLink(Protocol):
    """What a worker asks the primary (blocking calls: each is one short exchange on a local socket). Problems
    (:mod:`kvsp_quic.problems`) the primary raises are raised again here."""

    def commit(self, block: BlockId, staged: str, reads: list[BlockId], owner: str | None,
               position: ChainPosition | None = None) -> ReplicaRecord:
        """Store the staged upload, against *owner*'s storage quota, at its declared chain *position*; *reads*
        (served since the last report) count for eviction first."""
        ...

    def create_lease(self, identity: str, request: LeaseRequest) -> LeaseResponse: ...

    def renew_lease(self, identity: str, lease_id: uuid.UUID, renewal: LeaseRenewal) -> LeaseResponse: ...

    def release_lease(self, identity: str, lease_id: uuid.UUID) -> None: ...

    def fault(self, block: BlockId, reason: str) -> None: ...

    def reads(self, blocks: list[BlockId]) -> None: ...


class HolderWorker:
    """The holder as a worker process serves it (see the module documentation)."""

    def __init__(self, settings: HolderSettings, host_directory: Path, primary: PrimaryLink, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.primary = primary
        self._clock = clock
        self._wall = wall
        self.host_directory = Path(host_directory)
        self.host = SharedHostReader(self.host_directory)
        self.local = LocalStorageTier(settings.local_storage) if settings.local_storage is not None else None
        self._descriptors = {bytes(d.compat_id): d for d in settings.descriptors}
        self._digests: collections.OrderedDict[BlockId, bytes] = collections.OrderedDict()  # repr digests
        self.reads: set[BlockId] = set()  # served since the last report to the primary (see take_reads)
        self.metrics: collections.Counter[str] = collections.Counter()

    @property
    def base_uri(self) -> str:
        return self.settings.base_uri

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def descriptor(self, compat_id: bytes) -> CompatDescriptor:
        return descriptor_of(self._descriptors, compat_id)

    # -- PUT ------------------------------------------------------------------------------------------------------

    def begin_store(self, principal: Principal, compat_id: bytes, scope_id: bytes, block_key: bytes,
                    if_none_match: str | None) -> BlockUpload:
        """The checks of :meth:`Holder.begin_store <kvsp_quic.roles.holder.Holder.begin_store>`, here. The upload's
        chain position, when set, goes to the primary with the commit."""
        block, descriptor = check_put(principal, self.descriptor, compat_id, scope_id, block_key, if_none_match)
        if self.host.exists(block) or (self.local is not None and self.local.path_of(block).exists()):
            raise PreconditionFailed(f"a replica of {block.block_key.hex()} exists; it is kept")
        return BlockUpload(self, block, descriptor, owner=principal.identity)

    def _allocate_upload(self, layers: int, size: int) -> tuple[memoryview, Allocation]:
        allocation = Allocation(self.host_directory, layers, size)
        return allocation.container, allocation

    def _commit(self, block: BlockId, header: ContainerHeader, layer_digests: tuple[bytes, ...],
                data: memoryview, allocation: Any = None, *, owner: str | None = None,
                position: ChainPosition | None = None) -> ReplicaRecord:
        assert isinstance(allocation, Allocation)
        staged = allocation.stage(BlockMeta(block, header, layer_digests, len(data)))
        # the primary removes the staged name, stored or not; the reads before this PUT are ordered before it
        record = self.primary.commit(block, staged, self.take_reads(), owner, position)
        self.metrics["stored"] += 1
        return record

    # -- GET ------------------------------------------------------------------------------------------------------

    def fetch(self, principal: Principal, compat_id: bytes, scope_id: bytes, block_key: bytes,
              layers: tuple[int, int] | None = None, codec: int | None = None) -> Fetched:
        block, meta, tier, data, stored_at = self._find(principal, compat_id, scope_id, block_key)
        first, last = layer_range(meta, layers, codec)
        container = cut(data, first, last, layer_digests=meta.layer_digests)
        if (first, last) == (meta.header.first_layer, meta.header.last_layer):  # the stored container
            digest = self._digests.get(block)
            if digest is None:
                digest = self._digests[block] = container.repr_digest()
                while len(self._digests) > self.host.max_open:
                    self._digests.popitem(last=False)
        else:
            digest = container.repr_digest()
        self._served(block)
        return Fetched(container, digest, self._max_age(stored_at), tier)

    def served_size(self, compat_id: bytes, scope_id: bytes, block_key: bytes) -> int | None:
        """The octets of the block's container in the shared host tier, or None (not there, or unreadable: the
        ASGI path then serves and reports it). As :meth:`Holder.served_size`: no check, only to choose a path."""
        try:
            mapped = self.host.get(BlockId(bytes(compat_id), bytes(scope_id), bytes(block_key)))
        except (TierFault, ValueError, OSError):
            return None
        return mapped.meta.size if mapped is not None else None

    def read(self, principal: Principal, compat_id: bytes, scope_id: bytes, block_key: bytes,
             layers: tuple[int, int] | None = None) -> EncodedContainer:
        """What :meth:`fetch` serves, without the representation digest (MOQT; a digest mismatch is NotFound,
        as at the primary: MOQT has no such error)."""
        try:
            block, meta, _tier, data, _stored_at = self._find(principal, compat_id, scope_id, block_key)
        except DigestMismatch as exc:
            raise NotFound(exc.detail) from None
        first, last = layer_range(meta, layers, None)
        self._served(block)
        return cut(data, first, last, layer_digests=meta.layer_digests)

    def _find(self, principal: Principal, compat_id: bytes, scope_id: bytes,
              block_key: bytes) -> tuple[BlockId, BlockMeta, str, memoryview, float]:
        """The checks that leak nothing (scope, compatibility, existence), then the block from the fastest tier."""
        require_scope(principal, scope_id)
        self.descriptor(compat_id)
        block = BlockId(bytes(compat_id), bytes(scope_id), bytes(block_key))
        try:
            mapped = self.host.get(block)
        except (TierFault, ValueError, OSError) as exc:
            self._fault(block, f"shared host tier: {getattr(exc, 'reason', exc)}")
            raise NotFound(f"the replica of {block.block_key.hex()} could not be read") from None
        if mapped is not None:
            return block, mapped.meta, HOST, mapped.container, mapped.stored_at
        if self.local is not None:
            path = self.local.path_of(block)
            try:
                stored_at = path.stat().st_mtime
                meta, container = self.local.read_file(block)
            except FileNotFoundError:
                pass
            except TierFault as fault:
                self._fault(block, fault.reason)
                raise stored_data_fault(block, fault) from None
            except Exception as exc:
                raise NotFound(f"no replica of {block.block_key.hex()} ({exc})") from None
            else:
                return block, meta, LOCAL_STORAGE, container, stored_at
        raise NotFound(f"no replica of {block.block_key.hex()}")

    def _served(self, block: BlockId) -> None:
        self.metrics["fetched"] += 1
        self.reads.add(block)

    def _fault(self, block: BlockId, reason: str) -> None:
        self.metrics["faults"] += 1
        self._digests.pop(block, None)
        self.primary.fault(block, reason)

    def _max_age(self, stored_at: float) -> int:
        """Seconds the replica's record has left at least: records are refreshed every third of their TTL."""
        left = self.settings.replica_ttl_ms * 2 / 3000
        if self.settings.retention_ms is not None:
            left = min(left, stored_at + self.settings.retention_ms / 1000 - self._wall())
        return max(0, int(left))

    def take_reads(self) -> list[BlockId]:
        """The blocks read since the last call (reported to the primary in batches, for its eviction order)."""
        reads, self.reads = list(self.reads), set()
        return reads

    # -- leases: the primary's -----------------------------------------------------------------------------------

    def create_lease(self, principal: Principal, request: LeaseRequest) -> LeaseResponse:
        require_scope(principal, request.scope_id)
        self.descriptor(request.compat_id)
        return self.primary.create_lease(principal.identity, request)

    def renew_lease(self, principal: Principal, lease_id: uuid.UUID, renewal: LeaseRenewal) -> LeaseResponse:
        return self.primary.renew_lease(principal.identity, lease_id, renewal)

    def release_lease(self, principal: Principal, lease_id: uuid.UUID) -> None:
        self.primary.release_lease(principal.identity, lease_id)

    def close(self) -> None:
        self.host.close()


__all__ = ["HolderWorker", "PrimaryLink"]
