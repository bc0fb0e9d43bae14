"""The relay's Index Service side (``kvsp-quic relay --index URI``): upstreams for KVSP tracks nobody published
to the relay, and Replica Records for the blocks it caches.

* **Upstreams.** For a KVSP track whose namespace no session published here, :meth:`IndexLink.resolve` looks the
  block up (``POST lookup``) and connects (:class:`~moqt.aio.MoqtPool`, the relay's own certificate) to the first
  ``moqt://`` replica whose ``moqt_namespace`` is the track's namespace and whose holder is not the relay itself.
  The record comes back with the connection: the relay keeps it with the fetch.
* **Records.** When a complete KVSP block enters the relay's cache, the relay needs the publisher's Replica Record
  for the digests (MOQT carries none). *Decision:* it takes the record the lookup above returned, or, for a block
  that came from a session that published its namespace to the relay, looks the block up once: the record whose
  ``moqt_namespace`` is the track's namespace, or else the ``https`` record whose holder-id is the namespace's
  fourth field. It then checks every cached layer's SHA-256 against ``layer_digests`` (a relay never advertises
  what it cannot vouch for: a mismatch drops the block from the cache) and publishes, at
  ``replicas/{holder-id of its moqt URI}/{block_key}``, the record with ``holder`` = the relay's ``moqt://`` URI,
  ``moqt_namespace`` = the track's namespace (unchanged: a FETCH through the relay names the same track),
  ``residency`` = all layers in ``host`` (memory), and the relay's TTL; refreshed every third of the TTL,
  withdrawn when the block leaves the cache and when the relay stops. No record is published for a block whose
  record cannot be found. The Index Service authorizes these like a holder's MOQT twins: the relay's identity
  needs the holder role and its ``moqt://`` URI in ``publish_for``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Callable
from typing import Any

from http3.api import KvspApi
from http3.client import KvspClient, TransportError
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
from moqt.aio import MoqtConnectError, MoqtConnection, MoqtPool
from moqt.relay.cache import TrackFetch
from moqt.types import Namespace

log = logging.getLogger("kvsp.relay.index")


class IndexLink:
    def __init__(self, client: KvspClient, index_base: str, pool: MoqtPool, *, moqt_uri: str,
                 publish: bool = True, ttl_ms: int = 60_000, timeout: float = 10.0) -> None:
        self.client = client
        self.api = KvspApi(client)
        self.index_base = KvspApi.base(index_base, "index base URI")
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
        self.failures = 0
        self.on_corrupt: Callable[[TrackFetch], None] | None = None  # the relay drops such a block from its cache

    # -- upstreams -----------------------------------------------------------------------------------------------

    async def lookup(self, track: KvspTrack) -> list[ReplicaRecord]:
        """The replicas of *track*'s block (:class:`~http3.api.KvspApi` failure semantics: raises
        :class:`~http3.api.RetryElsewhere` or the refusal's Problem)."""
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

    async def _original(self, fetch: TrackFetch) -> ReplicaRecord | None:
        if isinstance(fetch.origin, ReplicaRecord):  # the record resolve() found the upstream by
            return fetch.origin
        track = parse_track(fetch.namespace, fetch.track_name)
        assert track is not None
        try:
            records = await self.lookup(track)
        except (TransportError, Problem) as exc:
            log.info("no record for %s: %s", track.block_key.hex(), exc)
            return None
        for record in records:
            if record.holder != self.moqt_uri and record.moqt_namespace is not None and \
                    decode_moqt_namespace(record.moqt_namespace) == fetch.namespace:
                return record
        for record in records:
            if record.holder.startswith("https://") and holder_id(record.holder) == track.holder_id:
                return record
        return None

    async def _publish(self, fetch: TrackFetch) -> None:
        track = parse_track(fetch.namespace, fetch.track_name)
        assert track is not None
        original = await self._original(fetch)
        if original is None or original.layer_digests is None:
            log.info("block %s is cached but has no publisher's record to advertise", track.block_key.hex())
            return
        problem = verify(fetch, original)
        if problem is not None:
            log.warning("block %s from %s does not match its record (%s): not advertised", track.block_key.hex(),
                        fetch.upstream, problem)
            self.failures += 1
            if self.on_corrupt is not None:
                self.on_corrupt(fetch)
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
