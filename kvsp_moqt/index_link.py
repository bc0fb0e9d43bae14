"""The relay's Index Service side (``kvsp-quic relay --index URI``): upstreams for KVSP tracks nobody published
to the relay, and Replica Records for the blocks it caches.

* **Upstreams.** For a KVSP track whose namespace no session published here, :meth:`IndexLink.resolve` looks the
  block up (``POST lookup``) and connects (:class:`~moqt.aio.MoqtPool`, the relay's own certificate) to the first
  ``moqt://`` replica whose ``moqt_namespace`` is the track's namespace and whose holder is not the relay itself.
  The record comes back with the connection: the relay keeps it with the fetch.
* **Records.** The relay caches a complete KVSP block only once its layers match a Replica Record from the Index
  Service, and advertises only what it cached (:meth:`IndexLink.admit`, asked before the block enters the cache;
  docs/security.md, "Relay poisoning"). The record is bound to the namespace's publisher (the fourth field): the
  publisher's own ``https`` record (holder-id = that field) first, else a ``moqt://`` record of another endpoint
  whose ``moqt_namespace`` is the track's namespace (the Index Service authorizes such a record by the
  namespace's publisher, spec "Records"; the record :meth:`resolve` found the upstream by is one of these). Every
  layer's SHA-256 must equal ``layer_digests``; else -- or when no record is found, or the Index Service cannot
  be reached -- the block is not cached (what was already forwarded downstream was cut-through: the subscribers
  verify it against their own records) and nothing is advertised. An admitted block is published, at
  ``replicas/{holder-id of its moqt URI}/{block_key}``, as the record with ``holder`` = the relay's ``moqt://``
  URI, ``moqt_namespace`` = the track's namespace (unchanged: a FETCH through the relay names the same track),
  ``residency`` = all layers in ``host`` (memory), and the relay's TTL; refreshed every third of the TTL,
  withdrawn when the block leaves the cache and when the relay stops. The Index Service authorizes these by the
  relay's identity (the holder role and its ``moqt://`` URI in ``publish_for``) and by the namespace's publisher:
  either the relay may publish for it too, or the publisher's own record of the block carries the same digests.
* **Liveness.** From its first record on, the relay keeps a liveness record of its ``moqt://`` URI fresh at the
  Index Service (:class:`kvsp_runtime.publisher.LivenessReporter`): a relay that died drops out of lookups within
  *liveness_ttl_ms* instead of being advertised until its records expire (docs/wire.md, "Holder liveness and
  failure reports").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from http3.client import KvspClient, TransportError
from kvsp_client.api import KvspApi, ServiceEndpoints
from kvsp_moqt.tracks import KvspTrack, parse_track
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.keys import holder_id
from kvsp_quic.problems import Problem
from kvsp_quic.records import (
    LookupRequest,
    ReplicaRecord,
    ResidencyEntry,
    decode_moqt_namespace,
    encode_moqt_namespace,
)
from kvsp_runtime.publisher import DEFAULT_LIVENESS_TTL_MS, LivenessReporter
from moqt.aio import MoqtConnectError, MoqtConnection, MoqtPool
from moqt.relay.cache import TrackFetch
from moqt.types import Namespace

log = logging.getLogger("kvsp.relay.index")


class IndexLink:
    def __init__(self, client: KvspClient, index_base: str | Sequence[str] | ServiceEndpoints, pool: MoqtPool, *,
                 moqt_uri: str,
                 publish: bool = True, ttl_ms: int = 60_000, timeout: float = 10.0,
                 liveness_ttl_ms: int | None = DEFAULT_LIVENESS_TTL_MS) -> None:
        self.client = client
        self.api = KvspApi(client)
        self.index_base = ServiceEndpoints.of(index_base, "index base URI")  # one URI or several (failover)
        self.pool = pool
        self.moqt_uri = KvspApi.base(moqt_uri, "relay moqt URI", schemes=("moqt",))
        self.holder_id = holder_id(self.moqt_uri)
        self.publish = publish
        self.ttl_ms = ttl_ms
        self.timeout = timeout
        self.published: dict[tuple[bytes, bytes, bytes], ReplicaRecord] = {}  # (compat, scope, key) -> record
        self.refused = False  # the Index Service answered 403 for our records (logged once)
        self._tasks: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self.failures = 0  # blocks whose layers did not match their records (not cached)
        self.unverified = 0  # blocks without a record to check them against (not cached)
        self.liveness = LivenessReporter(self.api, self.index_base, self.moqt_uri, ttl_ms=liveness_ttl_ms,
                                         timeout=timeout) if publish and liveness_ttl_ms is not None else None

    # -- upstreams -----------------------------------------------------------------------------------------------

    async def lookup(self, track: KvspTrack) -> list[ReplicaRecord]:
        """The replicas of *track*'s block (:class:`~kvsp_client.api.KvspApi` failure semantics: raises
        :class:`~kvsp_client.api.RetryElsewhere` or the refusal's Problem)."""
        request = LookupRequest(ScopeId(track.scope_id), CompatId(track.compat_id), (BlockKey(track.block_key),))
        answer = await self.api.lookup(self.index_base, request, timeout=self.timeout)
        return [r for match in answer.blocks if match.block_key == track.block_key for r in match.replicas]

    async def resolve(self, track: KvspTrack, namespace: Namespace) -> tuple[MoqtConnection, ReplicaRecord] | None:
        try:
            records = await self.lookup(track)
        except (TransportError, Problem) as exc:
            log.warning("index lookup for %s failed: %s", track.block_key.hex(), exc)
            return None
        for record in records:
            if not record.holder.startswith("moqt://") or record.holder == self.moqt_uri \
                    or record.moqt_namespace is None or decode_moqt_namespace(record.moqt_namespace) != namespace:
                continue
            try:
                return await self.pool.get(record.holder), record
            except (MoqtConnectError, ValueError) as exc:
                log.info("upstream %s for %s: %s", record.holder, track.block_key.hex(), exc)
        return None

    # -- records of what the relay caches --------------------------------------------------------------------

    def cached(self, fetch: TrackFetch) -> None:
        """An admitted block entered the cache: advertise it."""
        if self.publish:
            self._spawn(self._publish(fetch))

    def evicted(self, fetch: TrackFetch) -> None:
        track = parse_track(fetch.namespace, fetch.track_name)
        if track is None:
            return
        record = self.published.pop((track.compat_id, track.scope_id, track.block_key), None)
        if record is not None:
            self._spawn(self._withdraw(track.block_key))

    def url(self, block_key: bytes) -> str:
        return self.api.replica_url(self.index_base, self.moqt_uri, block_key)

    def relay_record(self, original: ReplicaRecord, namespace: Namespace) -> ReplicaRecord:
        assert original.layer_digests is not None
        last = len(original.layer_digests) - 1
        return dataclasses.replace(original, holder=self.moqt_uri, moqt_namespace=encode_moqt_namespace(namespace),
                                   residency=(ResidencyEntry("host", (0, last)),), ttl_ms=self.ttl_ms)

    def candidates(self, fetch: TrackFetch, records: list[ReplicaRecord]) -> list[ReplicaRecord]:
        """The records a cached block may be checked against, best first: the namespace's publisher's own
        ``https`` record, then ``moqt://`` records of the same namespace at other endpoints (never the relay's)."""
        track = parse_track(fetch.namespace, fetch.track_name)
        assert track is not None
        own = [r for r in records if r.holder.startswith("https://") and holder_id(r.holder) == track.holder_id]
        twins = [r for r in records if r.holder != self.moqt_uri and r.namespace == fetch.namespace]
        return [r for r in own + twins if r.layer_digests is not None and bytes(r.block_key) == track.block_key]

    async def admit(self, fetch: TrackFetch) -> bool:
        """Whether a complete fetch of a KVSP block may enter the relay's cache: its layers match a record from
        the Index Service (see the module docstring). The record that matched becomes ``fetch.origin`` (what
        :meth:`cached` advertises)."""
        track = parse_track(fetch.namespace, fetch.track_name)
        assert track is not None
        origin = fetch.origin if isinstance(fetch.origin, ReplicaRecord) else None
        records = self.candidates(fetch, [origin]) if origin is not None else []
        if not records:
            try:
                records = self.candidates(fetch, await self.lookup(track))
            except (TransportError, Problem) as exc:
                log.info("no record for %s (%s): not cached", track.block_key.hex(), exc)
                self.unverified += 1
                return False
        if not records:
            log.info("block %s has no record of its namespace's publisher: not cached", track.block_key.hex())
            self.unverified += 1
            return False
        problems = []
        for record in records:
            problem = verify(fetch, record)
            if problem is None:
                fetch.origin = record
                return True
            problems.append(f"{record.holder}: {problem}")
        log.warning("block %s from %s does not match its records (%s): not cached", track.block_key.hex(),
                    fetch.upstream, "; ".join(problems))
        self.failures += 1
        return False

    async def _publish(self, fetch: TrackFetch) -> None:
        track = parse_track(fetch.namespace, fetch.track_name)
        assert track is not None
        original = fetch.origin
        if not isinstance(original, ReplicaRecord) or original.layer_digests is None:  # not admitted
            return
        record = self.relay_record(original, fetch.namespace)
        if await self._put(record):
            self.published[(track.compat_id, track.scope_id, track.block_key)] = record
            self._ensure_refresher()

    async def _put(self, record: ReplicaRecord) -> bool:
        try:
            await self.api.publish(self.index_base, record, timeout=self.timeout)
        except TransportError as exc:
            log.info("publishing %s: %s", record.block_key.hex(), exc)
            return False
        except Problem as exc:
            if exc.status == 403 and not self.refused:
                self.refused = True
                log.warning("the Index Service refuses the relay's records (403): give the relay's identity the "
                            "holder role and %s in publish_for", self.moqt_uri)
            return False
        return True

    async def _withdraw(self, block_key: bytes) -> None:
        with contextlib.suppress(TransportError, Problem):
            await self.api.withdraw(self.index_base, self.moqt_uri, block_key, timeout=self.timeout)

    def _ensure_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.ensure_future(self._refresh())
        if self.liveness is not None:
            self.liveness.start()

    async def _refresh(self) -> None:
        while self.published:
            await asyncio.sleep(self.ttl_ms / 3000)
            for record in list(self.published.values()):
                await self._put(record)

    def _spawn(self, work: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Until the records being published or withdrawn are."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self, *, withdraw: bool = True) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self.liveness is not None:
            await self.liveness.stop()
        await self.drain()
        if withdraw:
            await asyncio.gather(*(self._withdraw(r.block_key) for r in self.published.values()),
                                 return_exceptions=True)
        self.published.clear()


def verify(fetch: TrackFetch, record: ReplicaRecord) -> str | None:
    """None when the cached objects are the record's layers, all of them, in order; else what is wrong."""
    digests = record.layer_digests or ()
    if len(fetch.objects) != len(digests):
        return f"{len(fetch.objects)} objects for {len(digests)} layers"
    for index, obj in enumerate(fetch.objects):
        if obj.key != (0, index):
            return f"object {obj.key} where layer {index} was expected"
        h = hashlib.sha256()
        for part in obj.parts:
            h.update(part)
        if h.digest() != bytes(digests[index]):
            return f"layer {index}: SHA-256 differs"
    return None


__all__ = ["IndexLink", "verify"]
