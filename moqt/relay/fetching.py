"""The relay's FETCH: served from the cache, or joined to a running upstream FETCH (coalescing), or from a new
upstream FETCH; each downstream FETCH written by its own task as the pieces arrive (cut-through).

A FETCH from an authorized reader is served from the cache when a cached fetch covers its range; else it joins an
upstream FETCH already running for the same track whose range covers it (8 concurrent FETCHes of a track are one
upstream FETCH); else the relay starts one: to the session that published the longest prefix of the namespace,
or -- for a track nobody published here -- to the upstream the :class:`~moqt.relay.interfaces.UpstreamDirectory`
names. For a track of one immutable group (:class:`~moqt.relay.interfaces.TrackShapes`) the upstream FETCH runs
from the first object asked for to the end of the group, so that later requests for the rest join it. Every
downstream FETCH is written from the shared :class:`~moqt.relay.cache.TrackFetch` as the pieces arrive (the first
object leaves before the second has arrived), FETCH_OK as soon as the upstream's is known (objects may precede it:
the drafts allow a relay to send objects before FETCH_OK). Completed upstream fetches enter the LRU cache only
once the directory admits them (:meth:`~moqt.relay.interfaces.UpstreamDirectory.admit`: for KVSP, the layers
match the publisher's Replica Record), and the directory hears of them (and of their eviction).

Per principal (issue 13, :mod:`moqt.aio.limits`): a FETCH the cache cannot answer -- it joins or starts an upstream
FETCH -- takes one of the principal's ``client_max_in_flight`` slots while it is served, and the payload octets of
the upstream FETCHes it started count against its ``client_max_buffered_bytes`` until they are over (cached or
failed). A FETCH over either is refused with EXCESSIVE_LOAD (draft 18, with a Retry Interval; draft 14:
INTERNAL_ERROR) and counted (``limit_refused``); cache hits are never refused, and other principals never wait.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from moqt import events as ev
from moqt.aio import FetchCancelled, MoqtConnection, MoqtSessionClosed, MoqtStalled, PeerLimits, ServedFetch
from moqt.errors import FetchErrorCode14, RequestErrorCode18, StreamResetCode
from moqt.relay.cache import WHOLE, Key, RelayCache, TrackFetch, TrackKey, end_key, end_location, start_key
from moqt.relay.codes import request_code, upstream_error, verdict_code
from moqt.relay.fanout import Joined
from moqt.relay.interfaces import AccessRules, NoUpstream, RelayConfig, TrackShapes, Upstream, UpstreamDirectory
from moqt.relay.namespaces import Namespaces, render
from moqt.types import Draft, GroupOrder, JoiningFetch, Location, Namespace

log = logging.getLogger("kvsp.relay")


class Fetches:
    """FETCH at one relay: the cache and the upstream fetches in flight (see the module docstring)."""

    def __init__(self, rules: AccessRules, config: RelayConfig, namespaces: Namespaces,
                 metrics: collections.Counter[str], spawn: Callable[[Coroutine[Any, Any, None]], None], *,
                 tracks: TrackShapes | None = None, upstreams: UpstreamDirectory | None = None,
                 limits: PeerLimits | None = None) -> None:
        self.rules = rules
        self.config = config
        self.namespaces = namespaces
        self.metrics = metrics
        self.tracks = tracks
        self.upstreams = upstreams
        self._spawn = spawn
        self.cache = RelayCache(config.cache_bytes, on_evict=self._evicted)
        self.inflight: dict[TrackKey, list[TrackFetch]] = {}
        self.limits = limits or PeerLimits(max_in_flight=config.client_max_in_flight,
                                           max_buffered=config.client_max_buffered_bytes,
                                           retry_ms=config.client_retry_ms)

    def misses(self, namespace: Namespace, track_name: bytes, start: Key, end: Key) -> bool:
        """Would ``[start, end)`` of the track go upstream (join or start an upstream FETCH)? Nothing is touched."""
        cached = self.cache.peek((namespace, track_name))
        return cached is None or not cached.covers(start, end)

    def refuse(self, conn: MoqtConnection, request_id: int, what: str) -> None:
        """Refuse a request over its principal's limits (EXCESSIVE_LOAD with a retry hint) and count it."""
        self.metrics["limit_refused"] += 1
        log.debug("%s %d of %s refused: over its limits", what, request_id, conn.peer_identity or conn.peer)
        self.limits.refuse(conn, request_id, what)

    async def fetch(self, conn: MoqtConnection, request: ev.FetchRequested) -> None:
        """A standalone FETCH (a joining one: :meth:`joining_fetch`)."""
        draft, rid = conn.draft, request.request_id
        target = request.target
        assert not isinstance(target, JoiningFetch)
        decision = self.rules.read(conn.peer_identity, request.namespace)
        if not decision.ok:
            self.metrics["fetch_refused"] += 1
            conn.reject(rid, verdict_code(draft, decision), decision.reason.encode())
            return
        group = self.tracks.single_group(request.namespace, request.track_name) if self.tracks is not None else None
        start, end = start_key(target.start), end_key(target.end)
        if group is not None:  # an immutable one-group track: a later end means "through its last object"
            end = min(end, (group, WHOLE))
        if end <= start:
            conn.reject(rid, request_code(draft, "invalid-range"), b"the end precedes the start")
            return
        if request.group_order is GroupOrder.DESCENDING and end[0] > start[0]:
            conn.reject(rid, request_code(draft, "not-supported"), b"the relay sends fetched groups ascending")
            return
        self.metrics["fetches"] += 1
        await self._serve_range(conn, request, request.namespace, request.track_name, start, end, group)

    async def joining_fetch(self, conn: MoqtConnection, request: ev.FetchRequested, target: JoiningFetch,
                            joined: Joined | None) -> None:
        """A joining FETCH names the subscriber's subscription. The relay resolves it against the Joining Location
        it gave that subscriber (the largest location it had forwarded when it answered the SUBSCRIBE) and serves
        the range as a standalone FETCH (cache, coalescing and all): from group ``largest - start`` (or group
        ``start``, absolute) to that location. *joined*: the subscription named, None when there is none (or it is
        not accepted yet)."""
        draft = conn.draft
        if joined is None:
            code = int(RequestErrorCode18.INVALID_JOINING_REQUEST_ID if draft is Draft.D18
                       else FetchErrorCode14.INVALID_JOINING_REQUEST_ID)
            conn.reject(request.request_id, code, b"no such subscription at this relay")
            return
        anchor = joined.anchor
        if anchor is None:
            conn.reject(request.request_id, request_code(draft, "invalid-range"),
                        b"the subscription had no largest object when it began")
            return
        first = target.start if target.absolute else max(0, anchor.group - target.start)
        start, end = (first, 0), (anchor.group, anchor.object + 1)
        if end <= start:
            conn.reject(request.request_id, request_code(draft, "invalid-range"), b"the joining range is empty")
            return
        self.metrics["joining_fetches"] += 1
        await self._serve_range(conn, request, joined.namespace, joined.track_name, start, end, None)

    async def _serve_range(self, conn: MoqtConnection, request: ev.FetchRequested, namespace: Namespace,
                           track_name: bytes, start: Key, end: Key, group: int | None) -> None:
        """Serve [start, end) of a track to *conn* from its (possibly shared) source fetch; a cache miss takes one
        of the principal's slots (refused when it has none left)."""
        slot = None
        if self.misses(namespace, track_name, start, end):
            slot = self.limits.acquire(conn)
            if slot is None:
                self.refuse(conn, request.request_id, "FETCH")
                return
        try:
            source = self._source(namespace, track_name, start, end, group, slot.principal if slot else None)
            source.downstreams += 1
            source.attach()
            try:
                await self._serve(conn, request, source, start, end)
            finally:
                source.detach()
        finally:
            if slot is not None:
                slot.release()

    async def _watch(self, fetch: TrackFetch) -> None:
        """Until the upstream fetch is complete or failed; nothing from it for ``upstream_timeout_ms`` fails it --
        unless the relay itself holds its credit (every downstream stopped taking octets): then pacing stops, the
        upstream gets all its credit, and the fetch goes on into the cache."""
        timeout = self.config.upstream_timeout_s
        while not fetch.finished:
            seen = fetch.last_activity
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await fetch.changed()
            if fetch.last_activity == seen and not fetch.finished:
                if fetch.pacing and fetch.held:
                    fetch.stop_pacing()
                    self.metrics["pacing_stopped"] += 1
                    continue
                fetch.fetch_failed(MoqtStalled(f"nothing from the upstream for {timeout:.3g} s"))

    def source(self, namespace: Namespace, name: bytes, start: Key, end: Key, group: int | None,
               owner: str | None = None) -> TrackFetch:
        """The cached fetch, the running upstream fetch, or a new upstream fetch, that covers ``[start, end)`` (a
        new one runs to its end, into the cache, whoever reads it; its octets count against *owner*)."""
        return self._source(namespace, name, start, end, group, owner)

    def _source(self, namespace: Namespace, name: bytes, start: Key, end: Key, group: int | None,
                owner: str | None = None) -> TrackFetch:
        """The cached fetch, the running upstream fetch, or a new upstream fetch, that covers ``[start, end)``."""
        key = (namespace, name)
        cached = self.cache.get(key, start, end)
        if cached is not None:
            self.metrics["cache_hits"] += 1
            return cached
        for running in self.inflight.get(key, ()):
            if running.error is None and running.covers(start, end):
                self.metrics["coalesced"] += 1
                return running
        # An immutable group: fetch it from the first object asked for to its end, so later requests join it.
        up_end = (group, WHOLE) if group is not None and start[0] == group else end
        fetch = TrackFetch(namespace, name, start, up_end)
        if owner is not None:
            fetch.owner = owner
            self.limits.charge(owner, fetch)
        self.inflight.setdefault(key, []).append(fetch)
        self.metrics["upstream_fetches"] += 1
        self._spawn(self._run_upstream(fetch))
        return fetch

    async def _run_upstream(self, fetch: TrackFetch) -> None:
        stream = None
        admitted = False
        try:
            upstream = await self._upstream(fetch)
            conn, fetch.origin = upstream.conn, upstream.origin
            fetch.upstream = f"{conn.peer_identity or conn.peer} ({conn.alpn})"
            fetch.upstream_draft = conn.draft
            stream = fetch.stream = conn.fetch(fetch.namespace, fetch.track_name, Location(*fetch.start),
                                               end_location(fetch.end), sink=fetch)
            await self._watch(fetch)
            # Verified before it is cached (and so before it is served from the cache or advertised); while
            # this runs the fetch stays in flight, so requests for the track keep joining it.
            admitted = fetch.complete and (self.upstreams is None or await self.upstreams.admit(fetch))
        except asyncio.CancelledError:
            fetch.fetch_failed(MoqtSessionClosed(0, "the relay is shutting down"))
            raise
        except Exception as exc:  # every failure goes to the downstream requests
            fetch.fetch_failed(exc)
        finally:
            if fetch.error is not None and not isinstance(fetch.error, NoUpstream):
                log.info("upstream FETCH of %s from %s failed: %s", render(fetch.namespace), fetch.upstream,
                         fetch.error)
            if stream is not None:
                await stream.aclose()
            if fetch.owner is not None:
                self.limits.discharge(fetch.owner, fetch)
            running = self.inflight.get(fetch.key, [])
            if fetch in running:
                running.remove(fetch)
            if not running:
                self.inflight.pop(fetch.key, None)
        if fetch.complete:
            self.metrics["upstream_octets"] += fetch.size
            if not admitted:
                self.metrics["not_admitted"] += 1
            elif self.cache.put(fetch) and self.upstreams is not None:
                self.upstreams.cached(fetch)

    async def _upstream(self, fetch: TrackFetch) -> Upstream:
        announcement = self.namespaces.publisher_for(fetch.namespace)
        if announcement is not None:
            return Upstream(announcement.conn)
        if self.upstreams is not None:
            found = await self.upstreams.resolve(fetch.namespace, fetch.track_name)
            if found is not None:
                self.metrics["index_upstreams"] += 1
                return found
        raise NoUpstream("nobody publishes this track here")

    def _evicted(self, fetch: TrackFetch) -> None:
        if self.upstreams is not None:
            self.upstreams.evicted(fetch)

    def drop(self, fetch: TrackFetch) -> None:
        """Take the track of *fetch* out of the cache (its objects turned out not to be what they should be)."""
        self.cache.remove(fetch.key)

    async def _serve(self, conn: MoqtConnection, request: ev.FetchRequested, source: TrackFetch, start: Key,
                     end: Key) -> None:
        """Write ``[start, end)`` of *source* downstream as its pieces arrive (see the module docstring)."""
        rid, draft = request.request_id, conn.draft
        served: ServedFetch | None = None
        ok_sent = False
        index = 0  # the next object of source.objects to look at
        part = 0  # parts of it written
        begun = False  # its header is written
        octets = 0
        try:
            while True:
                if not ok_sent and source.accepted is not None:
                    up_end = end_key(source.accepted.end_location)
                    down_end = min(end, up_end)
                    if down_end <= start:
                        conn.reject(rid, request_code(draft, "invalid-range"),
                                    b"the track has no objects in the range asked for")
                        return
                    eot = source.accepted.end_of_track and down_end == up_end
                    location = end_location(down_end)
                    if served is None:
                        served = conn.accept_fetch(rid, location, end_of_track=eot)
                    else:
                        served.send_ok(location, end_of_track=eot)
                    ok_sent, end = True, down_end
                range_done = False
                while index < len(source.objects):
                    obj = source.objects[index]
                    if obj.key < start:
                        index += 1
                        continue
                    if obj.key >= end:
                        range_done = True
                        break
                    if served is None:  # objects before FETCH_OK
                        served = conn.accept_fetch(rid, None)
                    if not begun:
                        served.begin_object(obj.object_id, obj.length, group=obj.group, subgroup=obj.subgroup,
                                            priority=obj.priority if obj.priority is not None else 128,
                                            status=obj.status, extensions=obj.extensions)
                        begun, part = True, 0
                    while part < len(obj.parts):
                        chunk = obj.parts[part]
                        await served.write(chunk)
                        octets += len(chunk)
                        part += 1
                    source.progress(obj.base + obj.received)  # all its parts so far are written
                    if not obj.complete:
                        break
                    index += 1
                    begun = False
                if source.ended and index >= len(source.objects) and not begun:
                    range_done = True
                if range_done and ok_sent:
                    if served is None:
                        served = conn.accept_fetch(rid, end_location(end))
                    served.finish()
                    self.metrics["fetches_served"] += 1
                    self.metrics["octets_served"] += octets
                    return
                if source.error is not None and not (range_done and source.accepted is not None):
                    if not ok_sent:
                        code, reason = upstream_error(draft, source.error, source.upstream_draft)
                        conn.reject(rid, code, reason)
                    elif served is not None:
                        served.reset(StreamResetCode.INTERNAL_ERROR)
                    self.metrics["fetch_upstream_errors"] += 1
                    return
                await source.changed()
        except (FetchCancelled, MoqtSessionClosed):
            self.metrics["fetches_cancelled"] += 1
            raise
        except BaseException:
            if served is not None and conn.closed is None:
                served.reset()
            raise


__all__ = ["Fetches"]
