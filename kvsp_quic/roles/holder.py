"""The Holder role (spec: "Block Retrieval and Storage", "Leases", "Publishing and Withdrawing Replicas").

Plain objects with an injected monotonic clock (seconds); no HTTP, no asyncio. ``kvsp_http/holder_app.py`` translates
requests into calls on :class:`Holder`; ``kvsp_runtime/publisher.py`` drains the :class:`ReplicaOutbox` to the Index
Service and drives the holder's timers (:meth:`Holder.tick`). docs/wire.md ("Holder") records the decisions:

* a holder stores complete blocks and **layer ranges** of blocks (``block_tokens`` tokens; the container's First
  Layer and Layer Count name the layers, issue 13); a replica's record states the layers it holds in its
  residency, and lists one layer digest per layer of the block, 32 zero octets for layers it does not hold; any
  inclusive range of the layers it holds can be served, others are 404 ``kvsp-layers-unavailable``;
* ``PUT`` requires ``If-None-Match: *`` (else 428); an existing replica gives 412 and is kept;
* ``GET`` with ``codec=n`` other than the stored codec gives 406: this holder does not transcode;
* every stored block is a replica, published when stored (and when it moves between tiers, since its residency
  changes), refreshed every third of the TTL the Index Service granted, withdrawn right after eviction;
* eviction is prefix-aware by default: the deepest blocks of the coldest chains go first, a chain being what the
  producers declared when storing (``PUT ...?chain=&position=``, :class:`~kvsp_quic.storage.tiers.ChainPosition`);
* with local storage, blocks of faster tiers are written through, and a journal of the records this holder may
  have left at the Index Service (:class:`~kvsp_quic.storage.journal.ReplicaJournal`) lets a restart withdraw
  every record it cannot serve any more and publish exactly what it recovered;
* eviction never touches a leased replica; a store that cannot make room otherwise fails with 507;
* a replica that fails verification on read (a fault) stops being served at once, its leases are marked
  broken, its record is withdrawn, and only then -- or once its advertised record has expired anyway -- are
  its octets dropped.
"""

from __future__ import annotations

import collections
import heapq
import os
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvsp_quic.auth import Principal, require_scope
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import (
    ContainerHeader,
    EncodedContainer,
    GeometryMismatch,
    cut,
    parse_header,
)
from kvsp_quic.fields import BlockKey, CompatId, ScopeId, base_uri
from kvsp_quic.problems import (
    DigestMismatch,
    InsufficientStorage,
    LeaseQuota,
    NotFound,
    PreconditionFailed,
)
from kvsp_quic.records import LeaseRenewal, LeaseRequest, LeaseResponse, ReplicaRecord, ResidencyEntry
from kvsp_quic.repr_digest import format_repr_digest
from kvsp_quic.roles.holder_outbox import Intent, IntentKind, ReplicaOutbox
from kvsp_quic.roles.holder_requests import check_put, descriptor_of, layer_range
from kvsp_quic.roles.holder_upload import BlockUpload  # (re-exported: imported from here by holder_worker)
from kvsp_quic.roles.leases import LeaseLimits, LeaseTable
from kvsp_quic.storage.journal import ReplicaJournal
from kvsp_quic.storage.tiers import (
    HOST,
    LOCAL_STORAGE,
    BlockId,
    BlockMeta,
    ChainPosition,
    HostTier,
    LocalStorageConfig,
    LocalStorageTier,
    NoRoom,
    PutOutcome,
    TieredStore,
    TierFault,
    eviction_policy,
)


@dataclass(frozen=True, kw_only=True)
class HolderOptions:
    """What a holder's operator sets: the ``[holder]`` section of ``kvsp-quic holder``'s file is these fields
    (plus what the composition root resolves: the Index Service, the descriptor files, the local-storage tier with
    its key file -- ``kvsp_app.config.HolderSection``). Durations in milliseconds, sizes in octets."""

    host_capacity: int = 1 << 30  # octets of containers kept in memory
    host_read_mbit_per_s: int | None = None  # advertised for the host tier, when set
    eviction: str = "prefix"  # a name in kvsp_quic.storage.tiers.EVICTION_POLICIES, for every tier
    replica_ttl_ms: int = 300_000  # ttl_ms of published records; refreshed every third of it
    retention_ms: int | None = None  # drop replicas this long after they were stored (None: no limit)
    max_block_bytes: int = 1 << 30  # the largest container accepted by PUT
    # octets one principal may have stored here plus being uploaded (None: the holder's whole capacity); over it,
    # its own oldest unleased replicas are evicted first, and 507 when that is not enough (docs/wire.md, "Holder")
    max_octets_per_principal: int | None = None
    leases: LeaseLimits = field(default_factory=LeaseLimits)
    publish_backoff_ms: tuple[int, int] = (500, 30_000)  # first and longest retry delay of a failed publish
    # with local storage: write every block a faster tier takes through to it before answering the PUT, so a
    # restart loses nothing acknowledged (the directory then holds up to host_capacity more octets)
    write_through: bool = True

    def __post_init__(self) -> None:
        for name in ("host_capacity", "replica_ttl_ms", "max_block_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        for name in ("host_read_mbit_per_s", "retention_ms", "max_octets_per_principal"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}: must be positive")
        first, longest = self.publish_backoff_ms
        if not 0 < first <= longest:
            raise ValueError("publish_backoff_ms: [first, longest] with 0 < first <= longest")
        try:
            eviction_policy(self.eviction)
        except ValueError as exc:
            raise ValueError(f"eviction: {exc}") from None

    @property
    def publish_backoff_s(self) -> tuple[float, float]:
        return self.publish_backoff_ms[0] / 1000, self.publish_backoff_ms[1] / 1000


@dataclass(frozen=True)
class HolderSettings(HolderOptions):
    """A holder's settings: its :class:`HolderOptions` and what it is (base URI, descriptors, local storage)."""

    base_uri: str  # the holder's base URI: the "holder" of its Replica Records and its identity
    descriptors: tuple[CompatDescriptor, ...]  # the caches it serves
    local_storage: LocalStorageConfig | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        base_uri(self.base_uri, "holder base_uri", schemes=("https",))
        if not self.descriptors:
            raise ValueError("a holder serves at least one Compatibility Descriptor")
        ids = [d.compat_id for d in self.descriptors]
        if len(set(ids)) != len(ids):
            raise ValueError("the holder's descriptors repeat a Compatibility ID")


# -- Replicas --------------------------------------------------------------------------------------------------------


@dataclass
class Replica:
    meta: BlockMeta
    digest: bytes  # replica digest
    stored_at: float
    advertised_until: float  # when the last record sent to the Index Service expires there, at the latest
    expires_at: float | None  # retention limit
    faulted: str | None = None  # why it is no longer served (awaiting withdrawal before its octets go)
    repr_digest: bytes | None = None  # SHA-256 of the whole container, computed on first need
    granted_until: float | None = None  # when the record expires at the Index Service, by the TTL it granted

    @property
    def codec(self) -> int:
        return self.meta.header.codec


@dataclass(frozen=True)
class Fetched:
    """A block (or layer range) to send: views of the stored container, nothing copied."""

    container: EncodedContainer
    repr_digest: bytes
    max_age_s: int  # the remaining TTL of the replica, for Cache-Control max-age
    tier: str

    @property
    def size(self) -> int:
        return len(self.container)

    @property
    def repr_digest_field(self) -> str:
        """The value of the Repr-Digest field (RFC 9530)."""
        return format_repr_digest(self.repr_digest)


# -- The role --------------------------------------------------------------------------------------------------------


def stored_data_fault(block: BlockId, fault: TierFault) -> NotFound | DigestMismatch:
    """The answer to a read whose stored octets failed (the caller has dropped the replica): octets that do not
    match their digests (or header, or authentication tag) are spec, Problem Types, "kvsp-digest-mismatch 422
    Stored data does not match its digest" -- a client can tell corruption from eviction and need not retry
    here; a file that could not be read at all is a replica that is gone (404)."""
    if fault.integrity:
        return DigestMismatch(f"the stored replica of {block.block_key.hex()} does not match its digest "
                              f"({fault.reason}); it was dropped")
    return NotFound(f"the replica of {block.block_key.hex()} could not be read and was dropped")


class Holder:
    def __init__(self, settings: HolderSettings, *, clock: Callable[[], float] = time.monotonic,
                 random: Callable[[int], bytes] = os.urandom, new_id: Callable[[], uuid.UUID] = uuid.uuid4,
                 store: TieredStore | None = None) -> None:
        self.settings = settings
        self._clock = clock
        self._descriptors: dict[bytes, CompatDescriptor] = {bytes(d.compat_id): d for d in settings.descriptors}
        if store is None:
            tiers: list[HostTier | LocalStorageTier] = [HostTier(settings.host_capacity,
                                                                 eviction_policy(settings.eviction))]
            if settings.local_storage is not None:
                tiers.append(LocalStorageTier(settings.local_storage, eviction_policy(settings.eviction),
                                              random=random))
            store = TieredStore(tiers)
        self.storage = store
        if settings.write_through and settings.local_storage is not None:
            store.enable_write_through()
        self.journal = (ReplicaJournal(settings.local_storage.path, fsync=settings.local_storage.fsync)
                        if settings.local_storage is not None else None)
        self._rates: dict[str, int | None] = {
            HOST: settings.host_read_mbit_per_s,
            LOCAL_STORAGE: settings.local_storage.read_mbit_per_s if settings.local_storage else None,
        }
        self.leases = LeaseTable(settings.leases, clock=clock, new_id=new_id,
                                 capacity=sum(tier.capacity for tier in store.tiers))
        self.outbox = ReplicaOutbox(settings.publish_backoff_s)
        self._replicas: dict[BlockId, Replica] = {}
        self._faulted: set[BlockId] = set()
        self._expiries: list[tuple[float, BlockId]] = []  # retention limits (heap; stale entries skipped)
        self._owner: dict[BlockId, str] = {}  # the principal that stored each replica (storage quotas)
        self._owned: dict[str, dict[BlockId, int]] = {}  # per principal: its replicas' sizes, oldest first
        self._owned_octets: collections.Counter[str] = collections.Counter()  # per principal: their sum
        self._uploading: collections.Counter[str] = collections.Counter()  # octets reserved by uploads under way
        self.metrics: collections.Counter[str] = collections.Counter()

    # -- lookups ------------------------------------------------------------------------------------------------

    @property
    def base_uri(self) -> str:
        return self.settings.base_uri

    @property
    def clock(self) -> Callable[[], float]:
        """The monotonic clock (seconds) the holder runs on; its adapters schedule with it too."""
        return self._clock

    def descriptor(self, compat_id: bytes) -> CompatDescriptor:
        return descriptor_of(self._descriptors, compat_id)

    def replica(self, block: BlockId) -> Replica | None:
        rep = self._replicas.get(block)
        return rep if rep is not None and rep.faulted is None else None

    def blocks(self) -> list[BlockId]:
        return [b for b, r in self._replicas.items() if r.faulted is None]

    def record(self, block: BlockId) -> ReplicaRecord:
        rep = self.replica(block)
        if rep is None:
            raise NotFound(f"no replica of {block.block_key.hex()}")
        return self._record(block, rep, self._clock())

    def _record(self, block: BlockId, rep: Replica, now: float) -> ReplicaRecord:
        tier = self.storage.tier_of(block)
        assert tier is not None
        header = rep.meta.header  # the layers stored: all of the block's, or a range of them
        residency = (ResidencyEntry(tier=tier.name, layers=(header.first_layer, header.last_layer),
                                    read_mbit_per_s=self._rates.get(tier.name)),)
        return ReplicaRecord(
            block_key=BlockKey(block.block_key), compat_id=CompatId(block.compat_id),
            scope_id=ScopeId(block.scope_id), holder=self.base_uri, codec=rep.codec, size=rep.meta.size,
            digest=rep.digest, residency=residency, ttl_ms=self._record_ttl_ms(rep, now),
            layer_digests=rep.meta.layer_digests)

    def _record_ttl_ms(self, rep: Replica, now: float) -> int:
        ttl = self.settings.replica_ttl_ms
        if rep.expires_at is not None:
            ttl = min(ttl, int((rep.expires_at - now) * 1000))
        return max(ttl, 1)

    # -- store ------------------------------------------------------------------------------------------------

    def begin_store(self, principal: Principal, compat_id: bytes, scope_id: bytes, block_key: bytes,
                    if_none_match: str | None) -> BlockUpload:
        """Check a PUT before its body is read: the precondition (428), the scope (403), the Compatibility ID
        (409) and that no replica exists (412). Set the upload's ``position`` when the client declared where the
        block sits in its chain (``?chain=&position=``; :func:`parse_position`)."""
        block, descriptor = check_put(principal, self.descriptor, compat_id, scope_id, block_key, if_none_match)
        self._check_absent(block)
        return BlockUpload(self, block, descriptor, owner=principal.identity)

    def store(self, principal: Principal, compat_id: bytes, scope_id: bytes, block_key: bytes, body: Any,
              if_none_match: str | None, *, position: ChainPosition | None = None) -> ReplicaRecord:
        """PUT blocks/{compat}/{scope}/{block_key} with a body held in memory (one copy, into the replica)."""
        upload = self.begin_store(principal, compat_id, scope_id, block_key, if_none_match)
        upload.position = position
        upload.feed(body)
        return upload.finish()

    def _check_absent(self, block: BlockId) -> None:
        if self.replica(block) is not None:
            raise PreconditionFailed(f"a replica of {block.block_key.hex()} exists; it is kept")

    def _allocate_upload(self, layers: int, size: int) -> tuple[memoryview, Any]:
        """A writable buffer of *size* octets for an upload, and its allocation when it lies in a shared host tier
        (:class:`~kvsp_quic.storage.shared_host.SharedHostTier`: the octets are received where they are served)."""
        tier = self.storage.tiers[0]
        allocate = getattr(tier, "allocate", None)
        if allocate is None:  # in this process: a HostTier's recycled, pre-touched buffer when it has one
            take = getattr(tier, "take_buffer", None)
            return (take(size) if take is not None else memoryview(bytearray(size))), None
        allocation = allocate(layers, size)
        return allocation.container, allocation

    def commit_staged(self, block: BlockId, staged: str, *, owner: str | None = None,
                      position: ChainPosition | None = None) -> ReplicaRecord:
        """Store the complete, verified block a worker process received into the shared host tier under the
        temporary name *staged* (``kvsp_quic.roles.holder_worker``): the placement, the record, the publishing
        and *owner*'s storage quota are this holder's, as for its own uploads. The staged file is removed whatever
        the outcome."""
        adopt = getattr(self.storage.tiers[0], "adopt", None)
        if adopt is None:
            raise ValueError("this holder has no shared host tier to adopt uploads from")
        self.descriptor(block.compat_id)
        allocation = adopt(staged, block)
        try:
            data = allocation.container
            header = parse_header(data)
            digests = tuple(allocation.layer_digests)
            return self._commit(block, header, digests, data, allocation, owner=owner, position=position)
        finally:
            allocation.discard()

    def note_reads(self, blocks: list[BlockId]) -> None:
        """Reads served by a worker process: they count for eviction as the holder's own reads do."""
        for block in blocks:
            tier = self.storage.tier_of(block)
            if tier is not None:
                tier.policy.accessed(block)

    # -- storage quotas per principal ---------------------------------------------------------------------------

    @property
    def principal_quota(self) -> int:
        """Octets one principal may have stored plus being uploaded (``max_octets_per_principal``, by default the
        capacity of every tier together)."""
        quota = self.settings.max_octets_per_principal
        return quota if quota is not None else sum(tier.capacity for tier in self.storage.tiers)

    def stored_by(self, owner: str) -> tuple[int, int]:
        """(octets of replicas *owner* stored here, octets its uploads under way have reserved)."""
        return self._owned_octets[owner], self._uploading[owner]

    def reserve_upload(self, upload: BlockUpload, owner: str, size: int) -> Callable[[], Any]:
        """Count *size* octets of an upload under way against *owner*'s quota, before its buffer is allocated
        (507 when they do not fit); returns what gives them back, called at the latest when *upload* is gone."""
        self._make_room_for(owner, size)
        self._uploading[owner] += size
        return weakref.finalize(upload, self._unreserve, owner, size)

    def _unreserve(self, owner: str, size: int) -> None:
        self._uploading[owner] -= size
        if self._uploading[owner] <= 0:
            del self._uploading[owner]

    def _make_room_for(self, owner: str, size: int) -> None:
        """Make *owner*'s stored plus reserved octets leave room for *size* more: evict its own unleased replicas
        (never another principal's) in the eviction policy's order (slowest tier first; by default the deepest
        blocks of its coldest chains), else 507."""
        quota = self.principal_quota
        stored, uploading = self.stored_by(owner)
        if stored + uploading + size <= quota:
            return
        if size <= quota:
            now = self._clock()
            owned = self._owned.get(owner, {})
            victims: list[BlockId] = []
            freed = 0
            for tier in reversed(self.storage.tiers):
                for block in tier.policy.victims():  # (collected first: the tiers do not change while iterating)
                    if stored - freed + uploading + size <= quota:
                        break
                    if block in owned and not self.leases.protects(block):
                        victims.append(block)
                        freed += owned[block]
            for block in victims:
                stored -= self._owned[owner][block]
                self.metrics["evicted"] += 1
                self.metrics["quota_evicted"] += 1
                self._drop(block)
                self._withdraw(block, now)  # right after the eviction
        if stored + uploading + size > quota:
            self.metrics["quota_rejections"] += 1
            raise InsufficientStorage(f"{owner!r} has {stored} octets stored and {uploading} being uploaded here; "
                                      f"{size} more exceed its quota of {quota}")

    def _own(self, block: BlockId, owner: str, size: int) -> None:
        self._disown(block)  # a replaced replica's octets are no longer anyone's
        self._owner[block] = owner
        self._owned.setdefault(owner, {})[block] = size
        self._owned_octets[owner] += size

    def _disown(self, block: BlockId) -> None:
        owner = self._owner.pop(block, None)
        if owner is not None:
            owned = self._owned[owner]
            self._owned_octets[owner] -= owned.pop(block, 0)
            if not owned:
                del self._owned[owner]
                del self._owned_octets[owner]

    def _commit(self, block: BlockId, header: ContainerHeader, layer_digests: tuple[bytes, ...],
                data: memoryview, allocation: Any = None, *, owner: str | None = None,
                position: ChainPosition | None = None) -> ReplicaRecord:
        self._check_absent(block)  # again: another PUT of the same key may have finished meanwhile
        now = self._clock()
        if block in self._replicas:  # a faulted copy awaiting withdrawal: the new replica replaces it
            self._drop(block)
        if owner is not None:
            self._make_room_for(owner, len(data))
        meta = BlockMeta(block, header, layer_digests, len(data))
        try:
            outcome = self.storage.put(meta, data, self.leases.protects, position)
        except NoRoom as exc:
            if exc.outcome is not None:
                self._apply(exc.outcome, now)
            raise InsufficientStorage(str(exc)) from None
        self._apply(outcome, now)
        retention = self.settings.retention_ms
        rep = Replica(meta, meta.digest, now, now + self.settings.replica_ttl_ms / 1000,
                      now + retention / 1000 if retention is not None else None)
        self._replicas[block] = rep
        if owner is not None:
            self._own(block, owner, len(data))
        if rep.expires_at is not None:
            heapq.heappush(self._expiries, (rep.expires_at, block))
        self.metrics["stored"] += 1
        if self.journal is not None:
            self.journal.add(block, position)
        self.outbox.publish(block, now)
        return self._record(block, rep, now)

    def _apply(self, outcome: PutOutcome, now: float) -> None:
        """Follow up on what a placement did to other replicas."""
        for block, _tier in outcome.demoted:
            self.metrics["demoted"] += 1
            if block in self._replicas:
                self.outbox.publish(block, now)  # its residency changed
        for meta in outcome.evicted:
            self.metrics["evicted"] += 1
            self._replicas.pop(meta.id, None)
            self._disown(meta.id)
            self._faulted.discard(meta.id)
            self._withdraw(meta.id, now)  # right after the eviction
        for fault in outcome.faulted:
            self.metrics["faults"] += 1
            self.leases.break_block(fault.block, fault.reason)
            self._replicas.pop(fault.block, None)
            self._disown(fault.block)
            self._faulted.discard(fault.block)
            self._withdraw(fault.block, now)

    # -- fetch ------------------------------------------------------------------------------------------------

    def fetch(self, principal: Principal, compat_id: bytes, scope_id: bytes, block_key: bytes,
              layers: tuple[int, int] | None = None, codec: int | None = None) -> Fetched:
        """GET blocks/{compat}/{scope}/{block_key}[?layers=a-b][&codec=n]."""
        rep, tier, container = self._read(principal, compat_id, scope_id, block_key, layers, codec)
        if container.header == rep.meta.header:  # the stored container: its digest is computed once
            if rep.repr_digest is None:
                rep.repr_digest = container.repr_digest()
            digest = rep.repr_digest
        else:
            digest = container.repr_digest()
        return Fetched(container, digest, self._max_age(rep, self._clock()), tier)

    def served_size(self, compat_id: bytes, scope_id: bytes, block_key: bytes) -> int | None:
        """The octets of the block's stored container, or None when no replica is held. No check runs: a server
        uses it only to choose how to serve a GET (:meth:`fetch` then checks and answers), never as an answer."""
        rep = self.replica(BlockId(bytes(compat_id), bytes(scope_id), bytes(block_key)))
        return rep.meta.size if rep is not None else None

    def read(self, principal: Principal, compat_id: bytes, scope_id: bytes, block_key: bytes,
             layers: tuple[int, int] | None = None) -> EncodedContainer:
        """What :meth:`fetch` checks and returns, without the representation digest: for transports that carry
        the sections with their layer digests only (MOQT). The sections are views of the stored container.
        Stored octets that fail verification are NotFound here: MOQT has no digest-mismatch error, and the
        replica is gone once the fault is seen."""
        try:
            return self._read(principal, compat_id, scope_id, block_key, layers, None)[2]
        except DigestMismatch as exc:
            raise NotFound(exc.detail) from None

    def _read(self, principal: Principal, compat_id: bytes, scope_id: bytes, block_key: bytes,
              layers: tuple[int, int] | None, codec: int | None) -> tuple[Replica, str, EncodedContainer]:
        block, rep, first, last = self._readable(principal, compat_id, scope_id, block_key, layers, codec)
        tier, container = self._sections(block, rep, first, last)
        self.metrics["fetched"] += 1
        return rep, tier, container

    def _readable(self, principal: Principal, compat_id: bytes, scope_id: bytes, block_key: bytes,
                  layers: tuple[int, int] | None, codec: int | None) -> tuple[BlockId, Replica, int, int]:
        """The checks of every read, in the order that leaks nothing: scope, compatibility, existence, codec,
        layer range. Returns the block, its replica and the inclusive layer range to serve."""
        require_scope(principal, scope_id)
        self.descriptor(compat_id)
        block = BlockId(bytes(compat_id), bytes(scope_id), bytes(block_key))
        rep = self.replica(block)
        if rep is None:
            raise NotFound(f"no replica of {block.block_key.hex()}")
        first, last = layer_range(rep.meta, layers, codec)
        return block, rep, first, last

    def _sections(self, block: BlockId, rep: Replica, first: int, last: int) -> tuple[str, EncodedContainer]:
        """The tier that served them and the container of layers *first*..*last* (views of the stored octets)."""
        try:
            tier, data = self.storage.read(block)
        except TierFault as fault:
            self.fault(block, fault.reason)
            raise stored_data_fault(block, fault) from None
        return tier.name, cut(data, first, last, layer_digests=rep.meta.layer_digests)

    def _max_age(self, rep: Replica, now: float) -> int:
        """Seconds the replica's record has left at the Index Service (by the TTL it granted, once known), capped
        by the retention limit: ``Cache-Control: max-age`` is never longer than the record lives."""
        until = rep.advertised_until if rep.granted_until is None else min(rep.advertised_until, rep.granted_until)
        if rep.expires_at is not None:
            until = min(until, rep.expires_at)
        return max(0, int(until - now))

    # -- faults, eviction by time ---------------------------------------------------------------------------

    def fault(self, block: BlockId, reason: str) -> None:
        """*block*'s stored octets are bad: stop serving it, break its leases, withdraw it, then drop it."""
        rep = self._replicas.get(block)
        if rep is None or rep.faulted is not None:
            return
        rep.faulted = reason
        self.metrics["faults"] += 1
        self.leases.break_block(block, reason)
        self._faulted.add(block)
        if not self._withdraw(block, self._clock()):
            self._drop(block)  # never published: nothing to withdraw first

    def _withdraw(self, block: BlockId, now: float) -> bool:
        """Want *block*'s record withdrawn; False when none was ever sent (nothing to withdraw)."""
        if self.outbox.withdraw(block, now):
            return True
        self._unjournal(block)
        return False

    def _unjournal(self, block: BlockId) -> None:
        """The journal forgets *block* once it is neither held nor possibly advertised."""
        if self.journal is not None and block not in self._replicas and self.outbox.state(block) is None:
            self.journal.remove(block)

    def _drop(self, block: BlockId) -> None:
        self._replicas.pop(block, None)
        self._disown(block)
        self._faulted.discard(block)
        self.storage.remove(block)
        self._unjournal(block)

    def tick(self) -> None:
        """Timers: forget expired leases, drop faulted replicas whose records expired at the Index Service
        anyway, and evict replicas past their retention limit (unless leased; withdrawn right after)."""
        now = self._clock()
        self.leases.expire()
        for block in list(self._faulted):
            rep = self._replicas.get(block)
            if rep is None or now >= rep.advertised_until:
                self._drop(block)
        deferred: list[tuple[float, BlockId]] = []
        while self._expiries and self._expiries[0][0] <= now:
            due, block = heapq.heappop(self._expiries)
            rep = self._replicas.get(block)
            if rep is None or rep.expires_at != due or rep.faulted is not None:
                continue
            if self.leases.protects(block):
                deferred.append((now + 1.0, block))  # look again once the lease may have ended
                continue
            self.metrics["expired"] += 1
            self._drop(block)
            self._withdraw(block, now)
        for due, block in deferred:
            rep = self._replicas.get(block)
            if rep is not None:
                rep.expires_at = due
                heapq.heappush(self._expiries, (due, block))

    def next_due(self) -> float | None:
        """The earliest time :meth:`take_intents` or :meth:`tick` has work (None: nothing scheduled)."""
        times = [t for t in (self.outbox.next_due(), self._expiries[0][0] if self._expiries else None)
                 if t is not None]
        times += [self._replicas[b].advertised_until for b in self._faulted if b in self._replicas]
        return min(times, default=None)

    # -- the Index Service side --------------------------------------------------------------------------------

    def take_intents(self, limit: int = 64) -> list[Intent]:
        """Publish / withdraw requests due now, marked in flight; report each with :meth:`intent_done`."""
        now = self._clock()
        out: list[Intent] = []
        for kind, block, version in self.outbox.take_due(now, limit):
            if kind is IntentKind.PUBLISH:
                rep = self.replica(block)
                if rep is None:  # gone without a withdraw being wanted: nothing to publish
                    self.outbox.complete(block, kind, version, True, now)
                    continue
                record = self._record(block, rep, now)
                rep.advertised_until = max(rep.advertised_until, now + record.ttl_ms / 1000)
                out.append(Intent(kind, block, version, now, record))
            else:
                out.append(Intent(kind, block, version, now))
        if self.journal is not None:
            self.journal.sync()  # every block about to be published is on record before its record can exist
        return out

    def intent_done(self, intent: Intent, ok: bool, granted_ttl_ms: int | None = None) -> None:
        """Report an intent taken from :meth:`take_intents`. *granted_ttl_ms* is the ``ttl_ms`` of the record the
        Index Service answered a publish with (it caps TTLs): the next refresh is due a third of it after the
        request was sent, and ``Cache-Control: max-age`` never outlives it."""
        now = self._clock()
        refresh_at = None
        if intent.record is not None:
            ttl_ms = intent.record.ttl_ms
            if ok and granted_ttl_ms is not None and granted_ttl_ms > 0:
                ttl_ms = min(ttl_ms, granted_ttl_ms)
                rep = self._replicas.get(intent.block)
                if rep is not None:
                    rep.granted_until = intent.taken_at + ttl_ms / 1000
            refresh_at = intent.taken_at + ttl_ms / 3000
        withdrawn = self.outbox.complete(intent.block, intent.kind, intent.version, ok, now, refresh_at)
        if withdrawn and intent.block in self._faulted:
            self._drop(intent.block)  # withdrawn first, now dropped
        elif withdrawn:
            self._unjournal(intent.block)
        self.metrics["published" if intent.kind is IntentKind.PUBLISH else "withdrawn"] += ok

    def withdraw_all(self) -> int:
        """Want every replica withdrawn (a holder going away for good); returns how many need a request."""
        now = self._clock()
        return sum(self.outbox.withdraw(block, now) for block in list(self._replicas))

    # -- restart --------------------------------------------------------------------------------------------------

    def recover(self) -> int:
        """Adopt the verified blocks found on local storage as replicas (to be published), and replace the set of
        records under this holder's identity at the Index Service with exactly those: every block of the journal
        (the records this holder may have left there before it stopped) that was not recovered is withdrawn.
        Files of caches this holder does not serve, or that another encryption key wrote, are left alone;
        corrupt ones are deleted. Returns how many blocks were recovered."""
        now = self._clock()
        journal = self.journal.live if self.journal is not None else {}
        recovered, dropped, evicted = self.storage.recover(self._acceptable, journal.get)
        retention = self.settings.retention_ms
        for meta in recovered:
            rep = Replica(meta, meta.digest, now, now + self.settings.replica_ttl_ms / 1000,
                          now + retention / 1000 if retention is not None else None)
            self._replicas[meta.id] = rep
            if rep.expires_at is not None:
                heapq.heappush(self._expiries, (rep.expires_at, meta.id))
            self.outbox.publish(meta.id, now)
        self.metrics["faults"] += len(dropped)
        self.metrics["evicted"] += len(evicted)
        if self.journal is not None:
            stale = [block for block in journal if block not in self._replicas]
            for block in stale:
                self.outbox.withdraw_stale(block, now)
            for meta in recovered:
                if meta.id not in journal:
                    journal[meta.id] = None
            self.journal.rewrite()
            self.metrics["stale_withdrawn"] += len(stale)
        self.metrics["recovered"] += len(recovered)
        return len(recovered)

    def _acceptable(self, meta: BlockMeta) -> str | None:
        descriptor = self._descriptors.get(meta.id.compat_id)
        if descriptor is None:
            return "a Compatibility ID this holder does not serve"
        try:
            meta.header.validate(descriptor)
        except GeometryMismatch as exc:
            return f"does not match its descriptor: {exc.detail}"
        if len(meta.layer_digests) != descriptor.layers:  # a complete block or a layer range of one (issue 13)
            return f"lists {len(meta.layer_digests)} layer digests for a block of {descriptor.layers} layers"
        return None

    # -- leases -------------------------------------------------------------------------------------------------

    def create_lease(self, principal: Principal, request: LeaseRequest) -> LeaseResponse:
        """POST leases: every key must name a replica held here (else 404, and no lease is created)."""
        require_scope(principal, request.scope_id)
        self.descriptor(request.compat_id)
        keys = list(dict.fromkeys(request.block_keys))
        blocks = [BlockId(bytes(request.compat_id), bytes(request.scope_id), bytes(k)) for k in keys]
        missing = [b.block_key.hex() for b in blocks if self.replica(b) is None]
        if missing:
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            raise NotFound(f"no replica of {', '.join(missing[:4])}{more}; no lease was created")
        sizes = [self._replicas[b].meta.size for b in blocks]
        try:
            lease = self.leases.create(principal.identity, blocks, sizes, request.ttl_ms)
        except LeaseQuota:
            self.metrics["lease_rejections"] += 1
            raise
        return LeaseResponse(lease=lease.id, ttl_ms=lease.ttl_ms, block_keys=tuple(keys))

    def renew_lease(self, principal: Principal, lease_id: uuid.UUID, renewal: LeaseRenewal) -> LeaseResponse:
        try:
            lease = self.leases.renew(principal.identity, lease_id, renewal.ttl_ms)
        except LeaseQuota:
            self.metrics["lease_rejections"] += 1
            raise
        return LeaseResponse(lease=lease.id, ttl_ms=lease.ttl_ms,
                             block_keys=tuple(BlockKey(b.block_key) for b in lease.blocks))

    def release_lease(self, principal: Principal, lease_id: uuid.UUID) -> None:
        self.leases.release(principal.identity, lease_id)


__all__ = ["BlockUpload", "Fetched", "Holder", "HolderOptions", "HolderSettings", "Replica"]
