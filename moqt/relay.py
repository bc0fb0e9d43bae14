"""``kvsp-quic relay``: a MOQT relay for KVSP tracks (and, for interop, open namespaces), on the asyncio adapter.

One :class:`Relay` (a :class:`~moqt.aio.MoqtApp`) serves every connection of the relay's UDP port, both drafts, with
the same mutual TLS as every role. docs/moqt.md ("Relay") records the decisions; in short:

* **Publishers** connect and PUBLISH_NAMESPACE; :class:`kvsp_quic.roles.relay.RelayRules` decides who may publish
  what (for KVSP namespaces the fourth field, the publisher's holder-id, must be the identity's own or one it may
  publish for). The relay remembers which session published which namespace.
* **FETCH** (standalone; a block is immutable) from an authorized reader (scope = the namespace's third field) is
  served from the cache when a cached fetch covers its range; else it joins an upstream FETCH already running
  for the same track whose range covers it (**coalescing**: 8 concurrent FETCHes of a block are one upstream
  FETCH); else the relay starts one: to the session that published the longest prefix of the namespace, or --
  for a KVSP namespace nobody published here -- to the ``moqt://`` holder the Index Service names
  (:mod:`kvsp_moqt.index_link`). For a KVSP track the upstream FETCH runs from the first layer asked for to the end of
  the block, so that later requests for the rest join it. Every downstream FETCH is written by its own task
  from the shared :class:`~moqt.relay_cache.TrackFetch` as the pieces arrive (**cut-through**: the first layer
  leaves before the second has arrived), FETCH_OK as soon as the upstream's is known (objects may precede it:
  the drafts allow a relay to send objects before FETCH_OK).
* **Cache**: completed upstream fetches, LRU within ``cache_bytes`` payload octets. With an Index Service, each
  complete cached KVSP block whose layers match the publisher's Replica Record is advertised with a record of
  the relay's own (``holder`` = the relay's ``moqt://`` URI), withdrawn when evicted.
* **SUBSCRIBE** (any track the identity may read) is forwarded to the publishing session; one upstream
  subscription per track serves every downstream subscriber (fan-out), each subgroup stream forwarded object by
  object as it arrives, PUBLISH_DONE once the upstream's streams have ended. Draft 18's RENDEZVOUS_TIMEOUT makes
  a SUBSCRIBE for a track nobody publishes yet wait (bounded) for its publisher, then fail with TIMEOUT.
* **SUBSCRIBE_NAMESPACE**: published namespaces under the prefix that the subscriber could read are announced
  (draft 14: PUBLISH_NAMESPACE / _DONE; draft 18: NAMESPACE / NAMESPACE_DONE), now and as they come and go.

Not relayed: PUBLISH (publisher-initiated subscriptions: the session answers NOT_SUPPORTED), joining FETCH,
TRACK_STATUS, datagrams, FETCH end-of-range markers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvsp_moqt.tracks import GROUP, KvspTrack, parse_track
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.roles.relay import Decision, RelayRules, Verdict, under
from moqt import events as ev
from moqt.aio import (
    FetchCancelled,
    MoqtApp,
    MoqtConnection,
    MoqtRequestError,
    MoqtSessionClosed,
    MoqtStalled,
    ServedFetch,
)
from moqt.errors import (
    FetchErrorCode14,
    MoqtUsageError,
    PublishDoneCode14,
    PublishDoneCode18,
    RequestErrorCode14,
    RequestErrorCode18,
    StreamResetCode,
)
from moqt.messages18 import Params18
from moqt.relay_cache import WHOLE, Key, RelayCache, TrackFetch, TrackKey, end_key, end_location, start_key
from moqt.types import Draft, GroupOrder, JoiningFetch, Location, Namespace
from moqt.writers import SubgroupWriter

log = logging.getLogger("kvsp.relay")

UNKNOWN_STREAM_COUNT = (1 << 62) - 1  # PUBLISH_DONE from a publisher that does not count its streams


class NoUpstream(LookupError):
    """Nobody publishes the track (no session published its namespace, and the Index Service names no holder)."""


class UpstreamResolver(Protocol):
    """Index-guided upstreams (:class:`kvsp_moqt.index_link.IndexLink`)."""

    async def resolve(self, track: KvspTrack, namespace: Namespace) -> tuple[MoqtConnection, ReplicaRecord] | None:
        ...

    def cached(self, fetch: TrackFetch) -> None:
        """A complete KVSP block entered the cache."""

    def evicted(self, fetch: TrackFetch) -> None:
        """... and left it."""


@dataclass(frozen=True)
class RelayConfig:
    moqt_uri: str | None = None  # the relay's own moqt://host:port/ (its records; never an upstream of itself)
    cache_bytes: int = 1 << 30  # payload octets of completed fetches kept (LRU)
    upstream_timeout: float = 10.0  # for the upstream's FETCH_OK / next piece, and SUBSCRIBE_OK
    rendezvous_limit: float = 10.0  # the longest a SUBSCRIBE waits for its publisher (draft 18 RENDEZVOUS_TIMEOUT)
    publish_done_grace: float = 2.0  # how long PUBLISH_DONE waits for the upstream's data streams to end


# -- request error codes across drafts -------------------------------------------------------------------------


def _kind_of(draft: Draft | None, code: int) -> str:
    if draft is Draft.D14:
        table14 = {int(FetchErrorCode14.TRACK_DOES_NOT_EXIST): "does-not-exist",
                   int(FetchErrorCode14.INVALID_RANGE): "invalid-range",
                   int(RequestErrorCode14.NOT_SUPPORTED): "not-supported", int(RequestErrorCode14.TIMEOUT): "timeout"}
        return table14.get(code, "internal")
    table18 = {int(RequestErrorCode18.DOES_NOT_EXIST): "does-not-exist",
               int(RequestErrorCode18.INVALID_RANGE): "invalid-range",
               int(RequestErrorCode18.NOT_SUPPORTED): "not-supported", int(RequestErrorCode18.TIMEOUT): "timeout"}
    return table18.get(code, "internal")


def request_code(draft: Draft, kind: str) -> int:
    """The request error code of *kind* in *draft* (FETCH_ERROR / SUBSCRIBE_ERROR share them in draft 14)."""
    if draft is Draft.D14:
        return int({"does-not-exist": FetchErrorCode14.TRACK_DOES_NOT_EXIST, "invalid-range":
                    FetchErrorCode14.INVALID_RANGE, "unauthorized": RequestErrorCode14.UNAUTHORIZED,
                    "not-supported": RequestErrorCode14.NOT_SUPPORTED, "timeout": RequestErrorCode14.TIMEOUT}
                   .get(kind, RequestErrorCode14.INTERNAL_ERROR))
    return int({"does-not-exist": RequestErrorCode18.DOES_NOT_EXIST, "invalid-range": RequestErrorCode18.INVALID_RANGE,
                "unauthorized": RequestErrorCode18.UNAUTHORIZED, "not-supported": RequestErrorCode18.NOT_SUPPORTED,
                "timeout": RequestErrorCode18.TIMEOUT}.get(kind, RequestErrorCode18.INTERNAL_ERROR))


def verdict_code(draft: Draft, decision: Decision) -> int:
    return request_code(draft, "unauthorized" if decision.verdict is Verdict.UNAUTHORIZED else "does-not-exist")


def upstream_error(draft: Draft, error: BaseException, upstream: Draft | None) -> tuple[int, bytes]:
    """The downstream REQUEST_ERROR for an upstream failure. An upstream refusal keeps its meaning (does not exist,
    invalid range, ...) except UNAUTHORIZED: the publisher refused the *relay*, which the subscriber cannot fix,
    so that is an INTERNAL_ERROR downstream."""
    if isinstance(error, NoUpstream):
        return request_code(draft, "does-not-exist"), str(error).encode()
    if isinstance(error, MoqtRequestError) and not error.cancelled:
        kind = _kind_of(upstream, error.error_code)
        return request_code(draft, kind), b"upstream: " + error.reason[:200]
    return request_code(draft, "internal"), f"upstream failed: {type(error).__name__}: {error}"[:300].encode()


def publish_done_code(code: int, upstream: Draft, downstream: Draft) -> int:
    """PUBLISH_DONE status codes moved between the drafts (EXPIRED / TOO_FAR_BEHIND swapped, MALFORMED_TRACK)."""
    if upstream is downstream:
        return code
    source: type[PublishDoneCode14] | type[PublishDoneCode18] = \
        PublishDoneCode14 if upstream is Draft.D14 else PublishDoneCode18
    target: type[PublishDoneCode14] | type[PublishDoneCode18] = \
        PublishDoneCode18 if upstream is Draft.D14 else PublishDoneCode14
    try:
        name = source(code).name
        return int(target[name])
    except (ValueError, KeyError):
        return code


# -- published namespaces and subscriptions --------------------------------------------------------------------


@dataclass(eq=False)
class Announcement:
    conn: MoqtConnection
    request_id: int
    namespace: Namespace


@dataclass(eq=False)
class NamespaceSubscriber:
    conn: MoqtConnection
    request_id: int
    prefix: Namespace
    announced: dict[Namespace, int] = field(default_factory=dict)  # draft 14: our PUBLISH_NAMESPACE's request id


@dataclass(eq=False)
class Downstream:
    conn: MoqtConnection
    request_id: int
    accepted: bool = False
    joined_at: Location | None = None  # the largest location when SUBSCRIBE_OK was sent (its Joining Location)
    writers: dict[int, SubgroupWriter] = field(default_factory=dict)  # by upstream data stream id


@dataclass(eq=False)
class UpstreamStream:
    stream_id: int
    group: int | None
    subgroup: int | None
    priority: int | None
    end_of_group: bool


@dataclass(eq=False)
class Subscription:
    """One upstream SUBSCRIBE, shared by the downstream subscribers of the track."""

    conn: MoqtConnection  # the publisher's session
    request_id: int
    namespace: Namespace
    track_name: bytes
    alias: int | None = None
    accepted: ev.SubscribeAccepted | None = None
    largest: Location | None = None  # the largest location the upstream reported or sent
    downstreams: list[Downstream] = field(default_factory=list)
    streams: dict[int, UpstreamStream] = field(default_factory=dict)
    opened: int = 0  # upstream data streams seen
    ended: int = 0  # ... ended (FIN or reset)
    done: ev.PublishDone | None = None
    finished: bool = False


# -- the relay --------------------------------------------------------------------------------------------------


class Relay(MoqtApp):
    def __init__(self, rules: RelayRules, config: RelayConfig = RelayConfig(), *,
                 resolver: UpstreamResolver | None = None) -> None:
        self.rules = rules
        self.config = config
        self.resolver = resolver
        self.cache = RelayCache(config.cache_bytes, on_evict=self._evicted)
        self.inflight: dict[TrackKey, list[TrackFetch]] = {}
        self.announcements: list[Announcement] = []
        self.namespace_subscribers: list[NamespaceSubscriber] = []
        self.subscriptions: dict[tuple[int, int], Subscription] = {}  # (id(publisher conn), upstream request id)
        self._by_alias: dict[tuple[int, int], Subscription] = {}  # (id(publisher conn), track alias)
        self._downstream: dict[tuple[int, int], Subscription] = {}  # (id(subscriber conn), downstream request id)
        self._connections: set[MoqtConnection] = set()
        self._published: asyncio.Event | None = None  # set (and replaced) whenever a namespace is published
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics: collections.Counter[str] = collections.Counter()
        self.started = time.monotonic()

    # -- status ------------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "connections": len(self._connections),
            "namespaces": [b"/".join(a.namespace).decode("utf-8", "replace") for a in self.announcements],
            "cache": {"entries": len(self.cache), "bytes": self.cache.size, "budget": self.cache.budget,
                      "hits": self.cache.hits, "evictions": self.cache.evictions},
            "inflight": sum(len(v) for v in self.inflight.values()),
            "subscriptions": len(self.subscriptions),
            "metrics": dict(sorted(self.metrics.items())),
            "uptime_s": round(time.monotonic() - self.started, 1),
        }

    # -- sessions ----------------------------------------------------------------------------------------------

    def session_ready(self, conn: MoqtConnection) -> None:
        self._connections.add(conn)
        self.metrics["sessions"] += 1

    def session_closed(self, conn: MoqtConnection) -> None:
        self._connections.discard(conn)
        for announcement in [a for a in self.announcements if a.conn is conn]:
            self._withdraw(announcement)
        self.namespace_subscribers = [s for s in self.namespace_subscribers if s.conn is not conn]
        for key, sub in list(self.subscriptions.items()):
            if sub.conn is conn:  # the publisher went away
                self._end_subscription(sub, int(PublishDoneCode14.GOING_AWAY), b"the publisher's session ended")
                self.subscriptions.pop(key, None)
            else:
                for down in [d for d in sub.downstreams if d.conn is conn]:
                    self._detach(sub, down)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, work: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- PUBLISH_NAMESPACE ------------------------------------------------------------------------------------------

    def request(self, conn: MoqtConnection, request: ev.Event) -> None:
        if isinstance(request, ev.PublishNamespaceRequested):
            self._publish_namespace(conn, request)
        elif isinstance(request, ev.SubscribeRequested):
            self._subscribe(conn, request)
        elif isinstance(request, ev.SubscribeNamespaceRequested):
            self._subscribe_namespace(conn, request)
        else:
            super().request(conn, request)

    def _publish_namespace(self, conn: MoqtConnection, request: ev.PublishNamespaceRequested) -> None:
        decision = self.rules.publish(conn.peer_identity, request.namespace)
        if not decision.ok:
            self.metrics["publish_refused"] += 1
            log.info("PUBLISH_NAMESPACE %s from %s refused: %s", _ns(request.namespace), conn.peer_identity,
                     decision.reason)
            conn.reject(request.request_id, request_code(conn.draft, "unauthorized"), decision.reason.encode())
            return
        try:
            conn.session.accept_publish_namespace(request.request_id)
        except MoqtUsageError:
            return
        conn.flush()
        announcement = Announcement(conn, request.request_id, request.namespace)
        self.announcements.append(announcement)
        self.metrics["namespaces_published"] += 1
        log.info("namespace %s published by %s", _ns(request.namespace), conn.peer_identity)
        if self._published is not None:
            self._published.set()
            self._published = None
        for subscriber in self.namespace_subscribers:
            self._announce(subscriber, request.namespace)

    def _withdraw(self, announcement: Announcement) -> None:
        if announcement not in self.announcements:
            return
        self.announcements.remove(announcement)
        namespace = announcement.namespace
        if any(a.namespace == namespace for a in self.announcements):
            return  # another session still publishes it
        for subscriber in self.namespace_subscribers:
            self._unannounce(subscriber, namespace)

    def publisher_for(self, namespace: Namespace) -> Announcement | None:
        """The session that published the longest prefix of *namespace* (the latest, among equals)."""
        best: Announcement | None = None
        for a in self.announcements:
            if under(namespace, a.namespace) and a.conn.closed is None and \
                    (best is None or len(a.namespace) >= len(best.namespace)):
                best = a
        return best

    # -- SUBSCRIBE_NAMESPACE ------------------------------------------------------------------------------------------

    def _subscribe_namespace(self, conn: MoqtConnection, request: ev.SubscribeNamespaceRequested) -> None:
        decision = self.rules.discover(conn.peer_identity, request.prefix)
        if not decision.ok:
            conn.reject(request.request_id, request_code(conn.draft, "unauthorized"), decision.reason.encode())
            return
        try:
            conn.session.accept_subscribe_namespace(request.request_id)
        except MoqtUsageError:
            return
        conn.flush()
        subscriber = NamespaceSubscriber(conn, request.request_id, request.prefix)
        self.namespace_subscribers.append(subscriber)
        for namespace in dict.fromkeys(a.namespace for a in self.announcements):
            self._announce(subscriber, namespace)

    def _announce(self, subscriber: NamespaceSubscriber, namespace: Namespace) -> None:
        conn = subscriber.conn
        if not under(namespace, subscriber.prefix) or namespace in subscriber.announced or conn.closed is not None \
                or not self.rules.visible(conn.peer_identity, namespace):
            return
        try:
            if conn.draft is Draft.D14:
                subscriber.announced[namespace] = conn.session.publish_namespace(namespace)
            else:
                conn.session.send_namespace(subscriber.request_id, namespace, active=True)
                subscriber.announced[namespace] = -1
        except MoqtUsageError as exc:
            log.debug("announcing %s to %r: %s", _ns(namespace), conn, exc)
            return
        conn.flush()

    def _unannounce(self, subscriber: NamespaceSubscriber, namespace: Namespace) -> None:
        rid = subscriber.announced.pop(namespace, None)
        conn = subscriber.conn
        if rid is None or conn.closed is not None:
            return
        with contextlib.suppress(MoqtUsageError):
            if conn.draft is Draft.D14:
                conn.session.publish_namespace_done(rid)
            else:
                conn.session.send_namespace(subscriber.request_id, namespace, active=False)
        conn.flush()

    # -- events of sessions (replies to our requests, objects of our subscriptions, withdrawals) -----------------

    def event(self, conn: MoqtConnection, event: ev.Event) -> None:
        if isinstance(event, ev.PublishNamespaceDone):
            for a in [a for a in self.announcements if a.conn is conn and a.request_id == event.request_id]:
                self._withdraw(a)
        elif isinstance(event, ev.SubscribeNamespaceEnded):
            self.namespace_subscribers = [s for s in self.namespace_subscribers
                                          if not (s.conn is conn and s.request_id == event.request_id)]
        elif isinstance(event, ev.Unsubscribed):
            sub = self._downstream.get((id(conn), event.request_id))
            if sub is not None:
                for down in [d for d in sub.downstreams if d.conn is conn and d.request_id == event.request_id]:
                    self._detach(sub, down)
        elif isinstance(event, ev.StreamStopped):
            sub = self._downstream.get((id(conn), event.request_id))
            if sub is not None:
                for down in sub.downstreams:
                    if down.conn is conn:
                        for sid, writer in list(down.writers.items()):
                            if writer.stream_id == event.stream_id:
                                writer.reset(StreamResetCode.CANCELLED)
                                del down.writers[sid]
                conn.flush()
        else:
            self._upstream_event(conn, event)

    # -- FETCH ----------------------------------------------------------------------------------------------------

    async def fetch(self, conn: MoqtConnection, request: ev.FetchRequested) -> None:
        draft, rid = conn.draft, request.request_id
        target = request.target
        if isinstance(target, JoiningFetch):
            await self._joining_fetch(conn, request, target)
            return
        decision = self.rules.read(conn.peer_identity, request.namespace)
        if not decision.ok:
            self.metrics["fetch_refused"] += 1
            conn.reject(rid, verdict_code(draft, decision), decision.reason.encode())
            return
        kvsp = parse_track(request.namespace, request.track_name)
        start, end = start_key(target.start), end_key(target.end)
        if kvsp is not None:  # a block is group 0: a later end means "through the last layer"
            end = min(end, (GROUP, WHOLE))
        if end <= start:
            conn.reject(rid, request_code(draft, "invalid-range"), b"the end precedes the start")
            return
        if request.group_order is GroupOrder.DESCENDING and end[0] > start[0]:
            conn.reject(rid, request_code(draft, "not-supported"), b"the relay sends fetched groups ascending")
            return
        self.metrics["fetches"] += 1
        source = self._source(request.namespace, request.track_name, start, end, kvsp)
        source.downstreams += 1
        source.attach()
        try:
            await self._serve(conn, request, source, start, end)
        finally:
            source.detach()

    async def _joining_fetch(self, conn: MoqtConnection, request: ev.FetchRequested, target: JoiningFetch) -> None:
        """A joining FETCH names the subscriber's subscription. The relay resolves it against the Joining Location
        it gave that subscriber (the largest location it had forwarded when it answered the SUBSCRIBE) and serves
        the range as a standalone FETCH (cache, coalescing and all): from group ``largest - start`` (or group
        ``start``, absolute) to that location."""
        sub = self._downstream.get((id(conn), target.request_id))
        down = next((d for d in sub.downstreams if d.conn is conn and d.request_id == target.request_id), None) \
            if sub is not None else None
        draft = conn.draft
        if sub is None or down is None or not down.accepted:
            code = int(RequestErrorCode18.INVALID_JOINING_REQUEST_ID if draft is Draft.D18
                       else FetchErrorCode14.INVALID_JOINING_REQUEST_ID)
            conn.reject(request.request_id, code, b"no such subscription at this relay")
            return
        anchor = down.joined_at
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
        source = self._source(sub.namespace, sub.track_name, start, end, None)
        source.downstreams += 1
        source.attach()
        try:
            await self._serve(conn, request, source, start, end)
        finally:
            source.detach()

    async def _watch(self, fetch: TrackFetch) -> None:
        """Until the upstream fetch is complete or failed; nothing from it for ``upstream_timeout`` fails it --
        unless the relay itself holds its credit (every downstream stopped taking octets): then pacing stops, the
        upstream gets all its credit, and the fetch goes on into the cache."""
        timeout = self.config.upstream_timeout
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

    def _source(self, namespace: Namespace, name: bytes, start: Key, end: Key, kvsp: KvspTrack | None) -> TrackFetch:
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
        # A block is immutable: fetch it from the first layer asked for to its end, so later requests join it.
        up_end = (GROUP, WHOLE) if kvsp is not None and start[0] == GROUP else end
        fetch = TrackFetch(namespace, name, start, up_end, kvsp=kvsp)
        self.inflight.setdefault(key, []).append(fetch)
        self.metrics["upstream_fetches"] += 1
        self._spawn(self._run_upstream(fetch))
        return fetch

    async def _run_upstream(self, fetch: TrackFetch) -> None:
        stream = None
        try:
            conn, record = await self._upstream_connection(fetch)
            fetch.record = record
            fetch.upstream = f"{conn.peer_identity or conn.peer} ({conn.alpn})"
            fetch.upstream_draft = conn.draft
            stream = fetch.stream = conn.fetch(fetch.namespace, fetch.track_name, Location(*fetch.start),
                                               end_location(fetch.end), sink=fetch)
            await self._watch(fetch)
        except asyncio.CancelledError:
            fetch.fetch_failed(MoqtSessionClosed(0, "the relay is shutting down"))
            raise
        except Exception as exc:  # every failure goes to the downstream requests
            fetch.fetch_failed(exc)
        finally:
            if fetch.error is not None and not isinstance(fetch.error, NoUpstream):
                log.info("upstream FETCH of %s from %s failed: %s", _ns(fetch.namespace), fetch.upstream, fetch.error)
            if stream is not None:
                await stream.aclose()
            running = self.inflight.get(fetch.key, [])
            if fetch in running:
                running.remove(fetch)
            if not running:
                self.inflight.pop(fetch.key, None)
        if fetch.complete:
            self.metrics["upstream_octets"] += fetch.size
            if self.cache.put(fetch) and fetch.kvsp is not None and self.resolver is not None:
                self.resolver.cached(fetch)

    async def _upstream_connection(self, fetch: TrackFetch) -> tuple[MoqtConnection, ReplicaRecord | None]:
        announcement = self.publisher_for(fetch.namespace)
        if announcement is not None:
            return announcement.conn, None
        if fetch.kvsp is not None and self.resolver is not None:
            found = await self.resolver.resolve(fetch.kvsp, fetch.namespace)
            if found is not None:
                self.metrics["index_upstreams"] += 1
                return found
        raise NoUpstream("nobody publishes this track here")

    def _evicted(self, fetch: TrackFetch) -> None:
        if fetch.kvsp is not None and self.resolver is not None:
            self.resolver.evicted(fetch)

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

    # -- SUBSCRIBE ----------------------------------------------------------------------------------------------------

    def _subscribe(self, conn: MoqtConnection, request: ev.SubscribeRequested) -> None:
        draft, rid = conn.draft, request.request_id
        decision = self.rules.read(conn.peer_identity, request.namespace)
        if not decision.ok:
            self.metrics["subscribe_refused"] += 1
            conn.reject(rid, verdict_code(draft, decision), decision.reason.encode())
            return
        publisher = self.publisher_for(request.namespace)
        if publisher is None:
            wait = request.params.rendezvous_timeout if isinstance(request.params, Params18) else None
            if wait:
                self._spawn(self._rendezvous(conn, request, min(wait / 1000, self.config.rendezvous_limit)))
                return
            conn.reject(rid, request_code(draft, "does-not-exist"), b"nobody publishes this track here")
            return
        self._attach(conn, request, publisher)

    async def _rendezvous(self, conn: MoqtConnection, request: ev.SubscribeRequested, seconds: float) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        while (publisher := self.publisher_for(request.namespace)) is None:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or conn.closed is not None:
                conn.reject(request.request_id, request_code(conn.draft, "timeout"),
                            b"no publisher appeared within the rendezvous timeout")
                return
            if self._published is None:
                self._published = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._published.wait()
        self._attach(conn, request, publisher)

    def _attach(self, conn: MoqtConnection, request: ev.SubscribeRequested, publisher: Announcement) -> None:
        down = Downstream(conn, request.request_id)
        sub = next((s for s in self.subscriptions.values() if s.conn is publisher.conn and not s.finished
                    and s.namespace == request.namespace and s.track_name == request.track_name), None)
        if sub is None:
            upstream = publisher.conn
            try:
                up_rid = upstream.session.subscribe(
                    request.namespace, request.track_name, filter=request.filter,
                    subscriber_priority=request.subscriber_priority, group_order=request.group_order,
                    forward=True)
            except MoqtUsageError as exc:
                conn.reject(request.request_id, request_code(conn.draft, "internal"), str(exc).encode())
                return
            upstream.flush()
            sub = Subscription(upstream, up_rid, request.namespace, request.track_name)
            self.subscriptions[(id(upstream), up_rid)] = sub
            self.metrics["upstream_subscriptions"] += 1
            self._spawn(self._subscribe_deadline(sub))
        else:
            self.metrics["subscriptions_joined"] += 1
        sub.downstreams.append(down)
        self._downstream[(id(conn), request.request_id)] = sub
        if sub.accepted is not None:
            self._accept_downstream(sub, down)

    async def _subscribe_deadline(self, sub: Subscription) -> None:
        await asyncio.sleep(self.config.upstream_timeout)
        if sub.accepted is None and not sub.finished:
            self._fail_subscription(sub, MoqtStalled("no SUBSCRIBE_OK from the publisher"))

    def _accept_downstream(self, sub: Subscription, down: Downstream) -> None:
        assert sub.accepted is not None
        try:
            order = sub.accepted.group_order
            down.conn.session.accept_subscribe(
                down.request_id, expires=sub.accepted.expires, largest=sub.largest,
                group_order=order if order in (GroupOrder.ASCENDING, GroupOrder.DESCENDING) else GroupOrder.ASCENDING)
        except MoqtUsageError as exc:
            log.debug("SUBSCRIBE_OK to %r: %s", down.conn, exc)
            self._detach(sub, down)
            return
        down.accepted, down.joined_at = True, sub.largest
        down.conn.flush()

    def _fail_subscription(self, sub: Subscription, error: BaseException) -> None:
        sub.finished = True
        self.subscriptions.pop((id(sub.conn), sub.request_id), None)
        for down in list(sub.downstreams):
            code, reason = upstream_error(down.conn.draft, error, sub.conn.draft)
            down.conn.reject(down.request_id, code, reason)
            self._downstream.pop((id(down.conn), down.request_id), None)
        sub.downstreams.clear()

    def _detach(self, sub: Subscription, down: Downstream) -> None:
        if down in sub.downstreams:
            sub.downstreams.remove(down)
        self._downstream.pop((id(down.conn), down.request_id), None)
        for writer in down.writers.values():
            writer.reset(StreamResetCode.CANCELLED)
        down.writers.clear()
        if down.conn.closed is None:
            down.conn.flush()
        if not sub.downstreams and not sub.finished:  # nobody wants it any more
            sub.finished = True
            self.subscriptions.pop((id(sub.conn), sub.request_id), None)
            if sub.alias is not None:
                self._by_alias.pop((id(sub.conn), sub.alias), None)
            if sub.conn.closed is None:
                with contextlib.suppress(MoqtUsageError):
                    sub.conn.session.unsubscribe(sub.request_id)
                sub.conn.flush()

    def _end_subscription(self, sub: Subscription, status: int, reason: bytes) -> None:
        """PUBLISH_DONE to every downstream subscriber (their streams closed first)."""
        sub.finished = True
        up_draft = sub.conn.draft
        for down in list(sub.downstreams):
            for writer in down.writers.values():
                writer.reset(StreamResetCode.CANCELLED)
            down.writers.clear()
            if down.conn.closed is None:
                if down.accepted:
                    with contextlib.suppress(MoqtUsageError):
                        down.conn.session.publish_done(down.request_id,
                                                       publish_done_code(status, up_draft, down.conn.draft), reason)
                else:
                    down.conn.reject(down.request_id, request_code(down.conn.draft, "internal"), reason)
                down.conn.flush()
            self._downstream.pop((id(down.conn), down.request_id), None)
        sub.downstreams.clear()
        if sub.alias is not None:
            self._by_alias.pop((id(sub.conn), sub.alias), None)

    def _subscription_of(self, conn: MoqtConnection, request_id: int | None, alias: int | None) -> Subscription | None:
        if request_id is not None:
            sub = self.subscriptions.get((id(conn), request_id))
            if sub is not None:
                return sub
        if alias is not None:
            return self._by_alias.get((id(conn), alias))
        return None

    def _upstream_event(self, conn: MoqtConnection, event: ev.Event) -> None:
        if isinstance(event, ev.SubscribeAccepted):
            sub = self.subscriptions.get((id(conn), event.request_id))
            if sub is None:
                return
            sub.accepted, sub.alias = event, event.track_alias
            if event.largest is not None and (sub.largest is None or event.largest > sub.largest):
                sub.largest = event.largest
            self._by_alias[(id(conn), event.track_alias)] = sub
            for down in list(sub.downstreams):
                if not down.accepted:
                    self._accept_downstream(sub, down)
        elif isinstance(event, ev.RequestRejected | ev.RequestCancelled):
            sub = self.subscriptions.get((id(conn), event.request_id))
            if sub is not None:
                if sub.accepted is None:
                    reason = event.reason if isinstance(event, ev.RequestRejected) else b"cancelled"
                    self._fail_subscription(sub, MoqtRequestError(event.request_id, event.error_code, reason))
                else:
                    self._end_subscription(sub, int(PublishDoneCode14.INTERNAL_ERROR), b"upstream cancelled")
                    self.subscriptions.pop((id(conn), event.request_id), None)
        elif isinstance(event, ev.DataStreamOpened):
            if event.fetch:
                return
            sub = self._subscription_of(conn, event.request_id, event.track_alias)
            if sub is not None:
                sub.opened += 1
                sub.streams[event.stream_id] = UpstreamStream(event.stream_id, event.group, event.subgroup,
                                                              event.priority, event.end_of_group)
        elif isinstance(event, ev.ObjectReceived):
            if event.stream_id is None:
                return  # datagrams are not relayed
            sub = self._subscription_of(conn, event.request_id, event.track_alias)
            stream = sub.streams.get(event.stream_id) if sub is not None else None
            if sub is not None and stream is not None:
                here = Location(event.group, event.object_id)
                if event.offset == 0 and (sub.largest is None or here > sub.largest):
                    sub.largest = here
                self._forward_piece(sub, stream, event)
        elif isinstance(event, ev.StreamEnded | ev.StreamReset):
            sub = self._subscription_of(conn, event.request_id, event.track_alias)
            if sub is None:
                return
            stream = sub.streams.pop(event.stream_id, None)
            if stream is None:
                return
            sub.ended += 1
            for down in sub.downstreams:
                writer = down.writers.pop(event.stream_id, None)
                if writer is None or writer.closed:
                    continue
                with contextlib.suppress(MoqtUsageError):
                    if isinstance(event, ev.StreamEnded):
                        writer.finish()
                    else:
                        writer.reset(StreamResetCode.INTERNAL_ERROR if event.error_code != StreamResetCode.CANCELLED
                                     else StreamResetCode.CANCELLED)
                down.conn.flush()
            self._maybe_done(sub)
        elif isinstance(event, ev.PublishDone):
            sub = self.subscriptions.get((id(conn), event.request_id))
            if sub is not None:
                sub.done = event
                if not self._maybe_done(sub):
                    self._spawn(self._done_after_grace(sub))

    def _forward_piece(self, sub: Subscription, stream: UpstreamStream, piece: ev.ObjectReceived) -> None:
        for down in sub.downstreams:
            if not down.accepted or down.conn.closed is not None:
                continue
            writer = down.writers.get(stream.stream_id)
            try:
                if writer is None:
                    if piece.offset != 0:
                        continue  # attached in the middle of an object: from the next stream on
                    group = stream.group if stream.group is not None else piece.group
                    subgroup = stream.subgroup if stream.subgroup is not None else (piece.subgroup or 0)
                    priority = stream.priority if stream.priority is not None else piece.priority
                    if priority is None and down.conn.draft is Draft.D14:
                        priority = 128
                    writer = down.conn.session.open_subgroup(down.request_id, group, subgroup, priority=priority,
                                                             extensions=True, end_of_group=stream.end_of_group)
                    down.writers[stream.stream_id] = writer
                if piece.offset == 0:
                    writer.begin_object(piece.object_id, piece.length, status=piece.status,
                                        extensions=piece.extensions)
                if piece.data:
                    writer.write(bytes(piece.data))  # subscription payloads are small; a copy frees the buffer
            except MoqtUsageError as exc:
                log.debug("forwarding to %r: %s", down.conn, exc)
                if writer is not None:
                    writer.reset(StreamResetCode.INTERNAL_ERROR)
                down.writers.pop(stream.stream_id, None)
            down.conn.flush()

    def _maybe_done(self, sub: Subscription) -> bool:
        """Forward the upstream's PUBLISH_DONE once its data streams have all ended."""
        done = sub.done
        if done is None or sub.streams:
            return False
        if done.stream_count != UNKNOWN_STREAM_COUNT and sub.opened < done.stream_count:
            return False
        self._finish_subscription(sub)
        return True

    async def _done_after_grace(self, sub: Subscription) -> None:
        await asyncio.sleep(self.config.publish_done_grace)
        if not sub.finished:
            self._finish_subscription(sub)

    def _finish_subscription(self, sub: Subscription) -> None:
        if sub.finished:
            return
        done = sub.done
        assert done is not None
        for down in sub.downstreams:
            for writer in down.writers.values():
                with contextlib.suppress(MoqtUsageError):
                    if writer.remaining:
                        writer.reset(StreamResetCode.INTERNAL_ERROR)
                    else:
                        writer.finish()
            down.writers.clear()
        self._end_subscription(sub, done.status_code, done.reason)
        self.subscriptions.pop((id(sub.conn), sub.request_id), None)


def _ns(namespace: Namespace) -> str:
    return b"/".join(namespace).decode("utf-8", "replace")


__all__ = ["Announcement", "NoUpstream", "Relay", "RelayConfig", "UpstreamResolver", "publish_done_code",
           "request_code", "upstream_error"]
