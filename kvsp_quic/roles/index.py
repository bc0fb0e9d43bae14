"""The Index Service role (spec: "Publishing and Withdrawing Replicas", "Lookup", "Placement Inputs").

Protocol rules only: no HTTP, no storage engine. :class:`IndexService` takes an
:class:`~kvsp_quic.storage.index_store.IndexStore`, a :class:`~kvsp_quic.roles.status.StatusTable` (the
Index Service and the Placement Controller run as one process, so the instance statuses that lookups with
``targets`` need are reported here) and an injected monotonic clock in seconds. Every method takes the
authenticated :class:`~kvsp_quic.auth.Principal` and raises :class:`~kvsp_quic.problems.Problem` subclasses.

Decisions (docs/wire.md, "Index Service"):

* publish: the path must name the record (``holder_id == holder-id(record.holder)``, ``block_key ==
  record.block_key``), else 400; then the principal must be that holder or publish for it (403), and be
  authorized for the record's scope (403 ``kvsp-scope-denied``). A ``moqt://`` record is authorized by the
  publisher its ``moqt_namespace`` names (spec, "Records": "The publisher of that namespace is the holder for
  the purposes of authorization"): the principal must also publish for the namespace's holder-id, or -- a relay
  advertising its copy -- the Index Service must hold that publisher's own unexpired record of the block with
  the same scope, compat_id, codec, digest and layer digests (the publisher vouches for the octets; the relay
  only for its address), else 403 (docs/security.md, "Relay poisoning"). ``ttl_ms`` is capped at ``max_ttl_ms``; the
  stored and returned record carries the capped TTL. A PUT of an unexpired replica refreshes it.
* withdraw: the principal must be the holder or publish for it, decided from the path's holder-id before the
  store is read (403); an unknown or expired replica is 404 ``kvsp-not-found``; the stored record's scope must
  be one of the principal's (403 ``kvsp-scope-denied``).
* lookup: more than ``max_lookup_keys`` keys (or ``max_lookup_targets`` targets) is 413; the scope is checked
  before anything is read; replicas are returned with their **remaining** TTL.
* liveness and failure reports (issue 12, point 5; :mod:`kvsp_quic.roles.liveness`): a lookup leaves out the
  replicas at a holder or relay whose liveness record lapsed (as those at an instance whose status expired), and
  moves those at a holder a client of the scope reported failed last, for a while. ``PUT holders/{holder-id}/
  liveness`` is the holder's (or one that publishes for it); ``POST holders/{holder-id}/failures`` any principal
  of the scope named. With a shared :class:`~kvsp_quic.storage.liveness_store.LivenessStore` (``--store redis``:
  issue 12, point 1) both are written through to it (:meth:`IndexService.report_liveness_shared`,
  :meth:`IndexService.report_failure_shared`) and the tables are a cache of it, reloaded by
  :meth:`IndexService.sync_liveness` (the app's lifespan runs it every 250 ms), so every process leaves out and
  demotes the same replicas.
* estimates: for each target with an unexpired status that states ``prefill_tokens_per_s``, when the
  compat_id's geometry (``block_tokens``, and ``layers`` if known) is configured; other targets are left out of
  ``targets`` (which is then present, possibly empty). The geometry comes only from the configured descriptors
  (``[index] descriptors``, ``--descriptor FILE``): instances report the compat_id they serve (status extension
  ``"engine"``) but not its block size, and a replica's ``size`` does not give it either (octets per token are
  unknown). So an instance reporting a compat_id without a descriptor is logged once as a WARNING
  (:data:`NO_GEOMETRY`): lookups cannot estimate fetch cost for it and placement ignores where its blocks are.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kvsp_quic import cost
from kvsp_quic import keys as k
from kvsp_quic.auth import ALL, Principal, Role, require_publish_for, require_role, require_scope
from kvsp_quic.compat import CompatDescriptor, InstanceState
from kvsp_quic.problems import BadRequest, ContentTooLarge, Forbidden, NotFound
from kvsp_quic.records import (
    InstanceStatusRecord,
    LookupMatch,
    LookupRequest,
    LookupResponse,
    ReplicaRecord,
    StateMessage,
    TargetEstimate,
    lookup_answer,
)
from kvsp_quic.roles.liveness import FailureReports, LivenessStore, LivenessTable, demote
from kvsp_quic.roles.producer_digests import ProducerDigestService
from kvsp_quic.roles.status import StatusTable, endpoint
from kvsp_quic.storage.index_store import IndexStore, collections_deferred, with_ttl
from kvsp_quic.storage.producer_digests import store_for

Clock = Callable[[], float]

log = logging.getLogger("kvsp_quic.index")

NO_GEOMETRY = ("lookups cannot estimate fetch cost; placement ignores where blocks are; pass --descriptor FILE "
               "(or [index] descriptors) with the Compatibility Descriptor the instances serve")

DEFAULT_MAX_TTL_MS = 600_000  # the spec's example TTL: ten minutes
DEFAULT_MAX_LOOKUP_KEYS = 8192  # 8192 blocks of 16 tokens: a 131072-token prompt
DEFAULT_MAX_LOOKUP_TARGETS = 256
DEFAULT_MAX_STATUS_TTL_MS = 60_000


@dataclass(frozen=True)
class Geometry:
    """What the Index Service must know of a Compatibility Descriptor to estimate: the block size in tokens and,
    optionally, the number of layers (else taken from the replicas)."""

    block_tokens: int
    layers: int | None = None

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or (self.layers is not None and self.layers < 1):
            raise ValueError("block_tokens and layers must be positive")

    @classmethod
    def of(cls, descriptor: CompatDescriptor) -> Geometry:
        return cls(descriptor.block_tokens, descriptor.layers)


@dataclass(frozen=True)
class IndexOptions:
    """What an Index Service's operator sets: the ``[index]`` section of ``kvsp-quic index``'s file is these fields
    (plus the store and the descriptor files the composition root resolves: ``kvsp_app.config.IndexSection``)."""

    max_ttl_ms: int = DEFAULT_MAX_TTL_MS  # replica TTLs are capped at this
    max_lookup_keys: int = DEFAULT_MAX_LOOKUP_KEYS
    max_lookup_targets: int = DEFAULT_MAX_LOOKUP_TARGETS
    max_status_ttl_ms: int = DEFAULT_MAX_STATUS_TTL_MS

    def __post_init__(self) -> None:
        for name in ("max_ttl_ms", "max_lookup_keys", "max_lookup_targets", "max_status_ttl_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive")


@dataclass(frozen=True)
class IndexConfig(IndexOptions):
    """The Index Service's settings: its options and the geometry of the descriptors it knows."""

    geometry: Mapping[bytes, Geometry] = field(default_factory=lambda: MappingProxyType({}))  # by compat_id

    @classmethod
    def with_descriptors(cls, descriptors: list[CompatDescriptor], **options: int) -> IndexConfig:
        geometry = {bytes(d.compat_id): Geometry.of(d) for d in descriptors}
        return cls(geometry=MappingProxyType(geometry), **options)


Found = list[tuple[ReplicaRecord, ...]]


def _without(found: Found, failed: frozenset[tuple[str, int]]) -> Found:
    """The matched prefix without replicas at failed instances; it ends where a key has no replica left."""
    out = []
    for replicas in found:
        alive = tuple(r for r in replicas if endpoint(r.holder) not in failed)
        if not alive:
            break
        out.append(alive)
    return out


@dataclass(frozen=True)
class PublishResult:
    created: bool  # False: an unexpired replica was refreshed
    record: ReplicaRecord  # as stored: ttl_ms is the granted (capped) TTL


@functools.lru_cache(maxsize=65536)
def _uri_id(uri: str) -> str:
    return k.holder_id(uri)


def may_publish_for_id(principal: Principal, holder_id: str) -> bool:
    """Whether *principal* may publish for the holder whose holder-id is *holder_id* (the URI is not known)."""
    if Role.HOLDER not in principal.roles:
        return False
    if principal.publish_for is ALL or _uri_id(principal.identity) == holder_id:
        return True
    return any(_uri_id(uri) == holder_id for uri in principal.publish_for)


def same_octets(a: ReplicaRecord, b: ReplicaRecord) -> bool:
    """Do two records of a block describe the same octets (scope, compat_id, codec, size, digests)?"""
    return (bytes(a.scope_id), bytes(a.compat_id), a.codec, a.size, a.digest) == \
        (bytes(b.scope_id), bytes(b.compat_id), b.codec, b.size, b.digest) and \
        [bytes(x) for x in a.layer_digests or ()] == [bytes(x) for x in b.layer_digests or ()]


class IndexService:
    def __init__(self, store: IndexStore, *, clock: Clock, config: IndexConfig | None = None,
                 status: StatusTable | None = None, liveness: LivenessTable | None = None,
                 failures: FailureReports | None = None, shared_liveness: LivenessStore | None = None) -> None:
        self.store = store
        self.clock = clock
        self.config = config or IndexConfig()
        # not `status or ...`: an empty StatusTable is falsy (it has __len__)
        self.status = status if status is not None else StatusTable(clock, max_ttl_ms=self.config.max_status_ttl_ms)
        self.liveness = liveness if liveness is not None else LivenessTable(clock)
        self.failures = failures if failures is not None else FailureReports(clock)
        # liveness records and failure reports shared by every Index Service process (None: this process's own)
        self.shared_liveness = shared_liveness
        self.without_geometry: set[bytes] = set()  # compat_ids instances reported that have no descriptor here
        # producer digests (issue 13; docs/wire.md, "Producer digests"), kept beside the replicas (the same Redis)
        self.producers = ProducerDigestService(store_for(store), clock=clock, max_ttl_ms=self.config.max_ttl_ms,
                                               max_lookup_keys=self.config.max_lookup_keys)

    # -- replicas -----------------------------------------------------------------------------------------------

    async def publish(self, principal: Principal, holder_id: str, block_key: bytes,
                      record: ReplicaRecord) -> PublishResult:
        """PUT replicas/{holder-id}/{block_key}."""
        if holder_id != _uri_id(record.holder):
            raise BadRequest(f"the path's holder-id {holder_id!r} is not that of the record's holder "
                             f"{record.holder!r}")
        if bytes(block_key) != bytes(record.block_key):
            raise BadRequest("the path's block_key differs from the record's block_key")
        require_publish_for(principal, record.holder)
        require_scope(principal, record.scope_id)
        if record.moqt_namespace is not None:
            await self._require_namespace_publisher(principal, record)
        if record.ttl_ms > self.config.max_ttl_ms:
            record = with_ttl(record, self.config.max_ttl_ms)
        created = await self.store.put(record, self.clock())
        return PublishResult(created, record)

    async def _require_namespace_publisher(self, principal: Principal, record: ReplicaRecord) -> None:
        """A ``moqt://`` record: the namespace's publisher (its holder-id field) is the holder for authorization."""
        publisher = record.publisher_id
        if publisher is None:  # the record's reader requires the five fields; never here
            raise BadRequest("moqt_namespace: no publisher's holder-id")
        if may_publish_for_id(principal, publisher):
            return
        vouched = await self.store.get(publisher, record.block_key, self.clock())
        if vouched is None or not same_octets(vouched, record):
            raise Forbidden(f"identity {principal.identity!r} may not publish for holder-id {publisher!r} (the "
                            f"publisher of moqt_namespace), and that holder has no record of block "
                            f"{bytes(record.block_key).hex()} with these digests")

    async def withdraw(self, principal: Principal, holder_id: str, block_key: bytes) -> None:
        """DELETE replicas/{holder-id}/{block_key}."""
        if not may_publish_for_id(principal, holder_id):
            if Role.HOLDER not in principal.roles:
                raise Forbidden(f"identity {principal.identity!r} is not a holder and may not withdraw replicas")
            raise Forbidden(f"identity {principal.identity!r} may not withdraw replicas of holder-id {holder_id!r}")
        stored = await self.store.get(holder_id, block_key, self.clock())
        if stored is None:
            raise NotFound(f"no replica of holder-id {holder_id!r} for block {bytes(block_key).hex()}")
        require_scope(principal, stored.scope_id)
        await self.store.delete(holder_id, block_key)

    # -- lookup -------------------------------------------------------------------------------------------------

    def _admit(self, principal: Principal, request: LookupRequest) -> None:
        n, limit = len(request.block_keys), self.config.max_lookup_keys
        if n > limit:
            raise ContentTooLarge(f"a lookup carries at most {limit} block keys, got {n}")
        targets = request.targets
        if targets is not None and len(targets) > self.config.max_lookup_targets:
            raise ContentTooLarge(f"a lookup names at most {self.config.max_lookup_targets} targets, "
                                  f"got {len(targets)}")
        require_scope(principal, request.scope_id)

    async def lookup_json(self, principal: Principal, request: LookupRequest) -> tuple[int, bytes]:
        """POST lookup, answered as the JSON body: (matched, ``lookup(...).to_json_bytes()``). A store that can
        write its matches as JSON itself (``lookup_rendered``, the memory store) does, when no targets are asked
        for and no instance is marked failed; otherwise the records are built and written."""
        render: Callable[[bytes, bytes, Sequence[bytes], float], tuple[int, list[bytes]]] | None = getattr(
            self.store, "lookup_rendered", None)
        if render is not None and request.targets is None:
            self._admit(principal, request)
            if not self.status.failed_endpoints() and not self._adjusted(request.scope_id):
                matched, blocks = render(request.scope_id, request.compat_id, request.block_keys, self.clock())
                return matched, lookup_answer(matched, blocks, None)
        response = await self.lookup(principal, request)
        return response.matched, response.to_json_bytes()

    async def lookup(self, principal: Principal, request: LookupRequest) -> LookupResponse:
        """POST lookup."""
        self._admit(principal, request)
        targets = request.targets
        build: Callable[[bytes, bytes, Sequence[bytes], float], Awaitable[list[LookupMatch]]] | None = getattr(
            self.store, "lookup_matches", None)
        if build is not None and not self.status.failed_endpoints() and not self._adjusted(request.scope_id):
            # nothing to leave out or reorder: the store builds the matches (the memory store, in one loop)
            blocks = tuple(await build(request.scope_id, request.compat_id, request.block_keys, self.clock()))
            estimates = None if targets is None else tuple(self.estimates(
                request.compat_id, targets, [m.replicas for m in blocks]))
            return LookupResponse(len(blocks), blocks, estimates)
        found = await self.store.lookup(request.scope_id, request.compat_id, request.block_keys, self.clock())
        failed = self.status.failed_endpoints() | self.liveness.lapsed_endpoints()
        if failed:  # replicas at an instance the PC saw fail, or a holder whose liveness lapsed, are unreachable
            found = _without(found, failed)
        demoted = self.failures.demoted(request.scope_id)
        if demoted:  # reported failed by a client of the scope: tried last
            found = [demote(replicas, demoted) for replicas in found]
        of_store = LookupMatch.of_store
        with collections_deferred():  # thousands of matches that all survive: scanned once, after (its docstring)
            blocks = tuple([of_store(key, replicas) for key, replicas in zip(request.block_keys, found, strict=False)])
        estimates = None if targets is None else tuple(self.estimates(request.compat_id, targets, found))
        return LookupResponse(len(blocks), blocks, estimates)

    def estimates(self, compat_id: bytes, targets: tuple[str, ...],
                  found: list[tuple[ReplicaRecord, ...]]) -> list[TargetEstimate]:
        geometry = self.config.geometry.get(bytes(compat_id))
        if geometry is None:
            return []
        out = []
        for target in dict.fromkeys(targets):
            entry = self.status.get(target)
            if entry is None or entry.state is InstanceState.FAILED:
                continue
            est = cost.estimate(target, entry.record, found, geometry.block_tokens, geometry.layers)
            if est is not None:
                out.append(est)
        return out

    def _adjusted(self, scope_id: bytes) -> bool:
        """Whether lookups of *scope_id* leave out or reorder replicas now (liveness, failure reports)."""
        return bool(self.liveness.lapsed_endpoints()) or bool(self.failures and self.failures.demoted(scope_id))

    # -- holder liveness and failure reports (docs/wire.md, "Holder liveness and failure reports") ------------------

    def report_liveness(self, principal: Principal, holder_id: str, holder: str, ttl_ms: int) -> int:
        """PUT holders/{holder-id}/liveness: the holder (or one that publishes for it) is alive; the TTL granted.
        This process's table only (:meth:`report_liveness_shared` writes through a shared store first)."""
        return self.liveness.report(holder, self._admit_liveness(principal, holder_id, holder, ttl_ms)).ttl_ms

    async def report_liveness_shared(self, principal: Principal, holder_id: str, holder: str, ttl_ms: int) -> int:
        """PUT holders/{holder-id}/liveness through the shared store when there is one: written there first (its
        outage fails the request), then to this process's table at once."""
        granted = self._admit_liveness(principal, holder_id, holder, ttl_ms)
        if self.shared_liveness is not None:
            await self.shared_liveness.report(holder, granted)
        return self.liveness.report(holder, granted).ttl_ms

    def _admit_liveness(self, principal: Principal, holder_id: str, holder: str, ttl_ms: int) -> int:
        """The checks of a liveness report; the TTL to grant (capped)."""
        if holder_id != _uri_id(holder):
            raise BadRequest(f"the path's holder-id {holder_id!r} is not that of holder {holder!r}")
        if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms < 1:
            raise BadRequest("ttl_ms: a positive integer of milliseconds")
        require_publish_for(principal, holder)
        return min(ttl_ms, self.liveness.max_ttl_ms)

    def report_failure(self, principal: Principal, holder_id: str, holder: str, scope_id: bytes) -> None:
        """POST holders/{holder-id}/failures: a client of the scope could not fetch from *holder*. Nothing is
        dropped: the holder's replicas are tried last in this scope's lookups for a while. This process's table
        only (:meth:`report_failure_shared` writes through a shared store first)."""
        self._admit_failure(principal, holder_id, holder, scope_id)
        self.failures.report(scope_id, holder)

    async def report_failure_shared(self, principal: Principal, holder_id: str, holder: str,
                                    scope_id: bytes) -> None:
        """POST holders/{holder-id}/failures through the shared store when there is one (as
        :meth:`report_liveness_shared`)."""
        self._admit_failure(principal, holder_id, holder, scope_id)
        if self.shared_liveness is not None and self.failures.demote_ms > 0:
            await self.shared_liveness.report_failure(scope_id, holder, self.failures.demote_ms)
        self.failures.report(scope_id, holder)

    @staticmethod
    def _admit_failure(principal: Principal, holder_id: str, holder: str, scope_id: bytes) -> None:
        if holder_id != _uri_id(holder):
            raise BadRequest(f"the path's holder-id {holder_id!r} is not that of holder {holder!r}")
        require_scope(principal, scope_id)

    async def sync_liveness(self) -> bool:
        """Reload the shared liveness records and failure reports into this process's tables (the store's errors
        are raised: the tables keep their view). False without a shared store."""
        if self.shared_liveness is None:
            return False
        shared = await self.shared_liveness.snapshot()
        self.liveness.load(shared.holders)
        self.failures.load(shared.demotions)
        return True

    # -- instance status ----------------------------------------------------------------------------------------

    def report_status(self, principal: Principal, instance_id: str, record: InstanceStatusRecord) -> StateMessage:
        """PUT instances/{instance-id}/status: only the instance itself reports its status."""
        require_role(principal, Role.INSTANCE)
        if instance_id != _uri_id(principal.identity):
            raise Forbidden(f"identity {principal.identity!r} may only report its own status")
        if record.instance != principal.identity:
            raise BadRequest(f"instance: {record.instance!r} is not the reporting instance "
                             f"{principal.identity!r}")
        answer = StateMessage(self.status.report(record).state)
        if record.engine is not None:
            self._check_geometry(bytes(record.engine.compat_id), record.instance)
        return answer

    def _check_geometry(self, compat_id: bytes, instance: str) -> None:
        if compat_id in self.config.geometry or compat_id in self.without_geometry:
            return
        self.without_geometry.add(compat_id)
        log.warning("instance %s serves compat_id %s, for which this Index Service has no Compatibility "
                    "Descriptor: %s", instance, compat_id.hex(), NO_GEOMETRY)

    # -- housekeeping -------------------------------------------------------------------------------------------

    async def sweep(self, limit: int = 65536) -> int:
        """Remove expired replicas (up to *limit* keys examined) and expired statuses; the replicas removed."""
        self.status.expire()
        self.failures.expire()
        await self.producers.sweep(limit)
        return await self.store.expire(self.clock(), limit)


__all__ = ["NO_GEOMETRY", "Geometry", "IndexConfig", "IndexService", "PublishResult", "may_publish_for_id",
           "same_octets"]
