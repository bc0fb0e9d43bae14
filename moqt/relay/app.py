"""The relay: one :class:`~moqt.aio.MoqtApp` for every connection of the relay's UDP port, both drafts, composed of
its :class:`~moqt.relay.namespaces.Namespaces`, :class:`~moqt.relay.fetching.Fetches` and
:class:`~moqt.relay.fanout.Subscriptions`; what it is told rather than knows (access rules, track shapes,
upstream directory) is injected (:mod:`moqt.relay.interfaces`)."""

from __future__ import annotations

import asyncio
import collections
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from moqt import events as ev
from moqt.aio import MoqtApp, MoqtConnection
from moqt.relay.cache import RelayCache, TrackFetch, TrackKey
from moqt.relay.complete import CompleteTracks
from moqt.relay.fanout import Subscriptions
from moqt.relay.fetching import Fetches
from moqt.relay.interfaces import AccessRules, RelayConfig, TrackShapes, UpstreamDirectory
from moqt.relay.namespaces import Announcement, Namespaces, render
from moqt.relay.published import PublishedTracks, TracksSubscriber
from moqt.types import Draft, JoiningFetch, Namespace


class Relay(MoqtApp):
    """A MOQT relay (see :mod:`moqt.relay`). *rules* decide who may publish, read and discover what; *tracks* says
    which tracks are one immutable group; *upstreams* names upstreams for tracks nobody published here and hears
    of what the cache keeps."""

    def __init__(self, rules: AccessRules, config: RelayConfig | None = None, *, tracks: TrackShapes | None = None,
                 upstreams: UpstreamDirectory | None = None) -> None:
        config = config or RelayConfig()
        self.rules = rules
        self.config = config
        self.metrics: collections.Counter[str] = collections.Counter()
        self.started = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()
        self._connections: set[MoqtConnection] = set()
        self._reads: weakref.WeakKeyDictionary[MoqtConnection, set[Namespace]] = weakref.WeakKeyDictionary()
        self.namespaces = Namespaces(rules, self.metrics)
        self.fetches = Fetches(rules, config, self.namespaces, self.metrics, self._spawn, tracks=tracks,
                               upstreams=upstreams)
        self.subscriptions = Subscriptions(rules, config, self.namespaces, self.metrics, self._spawn,
                                           limits=self.fetches.limits)
        self.complete = CompleteTracks(rules, self.fetches, self.metrics, self._spawn)
        self.published = PublishedTracks(rules, self.subscriptions, self.namespaces, self.metrics)
        self._requests: dict[type, Callable[[MoqtConnection, Any], None]] = {
            ev.PublishNamespaceRequested: self.namespaces.publish,
            ev.SubscribeRequested: self._subscribe,
            ev.SubscribeNamespaceRequested: self._subscribe_namespace,
            ev.PublishRequested: self.published.publish,
            ev.SubscribeTracksRequested: self.published.subscribe_tracks,
            ev.UpdateRequested: self._update,
        }
        self._events: dict[type, Callable[[MoqtConnection, Any], None]] = {
            ev.PublishNamespaceDone: self.namespaces.done,
            ev.SubscribeNamespaceEnded: self._subscribe_namespace_ended,
            ev.Unsubscribed: self._unsubscribed,
            ev.StreamStopped: self.subscriptions.stream_stopped,
            ev.PublishAccepted: self.published.accepted,
            ev.SubscribeTracksEnded: self.published.ended,
            ev.UpdateRequested: self._update_event,
        }

    @property
    def cache(self) -> RelayCache:
        return self.fetches.cache

    @property
    def inflight(self) -> dict[TrackKey, list[TrackFetch]]:
        return self.fetches.inflight

    @property
    def announcements(self) -> list[Announcement]:
        return self.namespaces.announcements

    def publisher_for(self, namespace: Namespace) -> Announcement | None:
        return self.namespaces.publisher_for(namespace)

    def drop(self, fetch: TrackFetch) -> None:
        """Take the track of *fetch* out of the cache (an upstream directory found it corrupt)."""
        self.fetches.drop(fetch)

    # -- status ------------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        cache = self.cache
        return {
            "connections": len(self._connections),
            "namespaces": [render(a.namespace) for a in self.announcements],
            "cache": {"entries": len(cache), "bytes": cache.size, "budget": cache.budget, "hits": cache.hits,
                      "evictions": cache.evictions},
            "inflight": sum(len(v) for v in self.inflight.values()),
            "subscriptions": len(self.subscriptions.subscriptions),
            "published_tracks": sum(not s.finished for s in self.subscriptions.published.values()),
            "limits": self.fetches.limits.status(),
            "metrics": dict(sorted(self.metrics.items())),
            "uptime_s": round(time.monotonic() - self.started, 1),
        }

    # -- sessions ----------------------------------------------------------------------------------------------

    def session_ready(self, conn: MoqtConnection) -> None:
        self._connections.add(conn)
        self.metrics["sessions"] += 1

    def session_closed(self, conn: MoqtConnection) -> None:
        self._connections.discard(conn)
        self._reads.pop(conn, None)
        self.namespaces.session_closed(conn)
        self.subscriptions.session_closed(conn)
        self.complete.session_closed(conn)
        self.published.session_closed(conn)

    def recheck(self, conn: MoqtConnection) -> str | None:
        """After a reload (:mod:`moqt.aio.revocation`): a session whose identity lost every right it used here --
        to publish the namespaces it published (PUBLISH_NAMESPACE, PUBLISH), to discover the prefixes it subscribed
        to, to read the namespaces it read -- is no longer served; one that used none, when the rules would not let
        it discover anything (KVSP: it is not in the policy any more)."""
        rules = self.rules
        who = conn.peer_identity
        rights = [rules.publish(who, a.namespace) for a in self.namespaces.announcements if a.conn is conn]
        rights += [rules.publish(who, s.namespace) for s in self.subscriptions.published.values()
                   if s.conn is conn and not s.finished]
        rights += [rules.discover(who, s.prefix) for s in self.namespaces.subscribers if s.conn is conn]
        rights += [rules.read(who, namespace) for namespace in self._reads.get(conn, ())]
        if not rights:
            decision = rules.discover(who, ())
            return None if decision.ok else f"no right left at the relay: {decision.reason}"
        if any(decision.ok for decision in rights):
            return None
        return f"the identity lost every right it used at the relay ({rights[0].reason})"

    def session_revoked(self, conn: MoqtConnection, reason: str) -> None:
        self.metrics["sessions_revoked"] += 1

    def _read(self, conn: MoqtConnection, namespace: Namespace) -> None:
        """Remember a namespace *conn* was allowed to read (for :meth:`recheck`)."""
        reads = self._reads.setdefault(conn, set())
        if namespace not in reads and len(reads) < 1024 and self.rules.read(conn.peer_identity, namespace).ok:
            reads.add(namespace)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- requests and events of sessions -----------------------------------------------------------------------

    async def fetch(self, conn: MoqtConnection, request: ev.FetchRequested) -> None:
        target = request.target
        if isinstance(target, JoiningFetch):
            joined = self.subscriptions.joined(conn, target.request_id) or \
                self.complete.joined(conn, target.request_id)
            await self.fetches.joining_fetch(conn, request, target, joined)
        else:
            self._read(conn, request.namespace)
            await self.fetches.fetch(conn, request)

    def _subscribe(self, conn: MoqtConnection, request: ev.SubscribeRequested) -> None:
        """A track of one immutable group is answered here (:mod:`moqt.relay.complete`); others fan out."""
        self._read(conn, request.namespace)
        group = self.complete.group(request)
        if group is None:
            self.subscriptions.subscribe(conn, request)
        else:
            self.complete.subscribe(conn, request, group)

    def _update(self, conn: MoqtConnection, request: ev.UpdateRequested) -> None:
        """REQUEST_UPDATE of a PUBLISH of the relay's (:mod:`moqt.relay.published`); other updates: NOT_SUPPORTED."""
        if not self.published.update(conn, request):
            super().request(conn, request)

    def _update_event(self, conn: MoqtConnection, event: ev.UpdateRequested) -> None:
        """A draft 14 SUBSCRIBE_UPDATE (no reply) of a PUBLISH of the relay's: its Forward State."""
        self.published.update(conn, event)

    def _subscribe_namespace(self, conn: MoqtConnection, request: ev.SubscribeNamespaceRequested) -> None:
        """Draft 14: an accepted SUBSCRIBE_NAMESPACE also gets a PUBLISH of each published track under its prefix."""
        self.namespaces.subscribe(conn, request)
        if conn.draft is Draft.D14 and any(s.conn is conn and s.request_id == request.request_id
                                           for s in self.namespaces.subscribers):
            self.published.add_subscriber(TracksSubscriber(conn, request.request_id, request.prefix, True))

    def _subscribe_namespace_ended(self, conn: MoqtConnection, event: ev.SubscribeNamespaceEnded) -> None:
        self.namespaces.subscription_ended(conn, event)
        self.published.ended(conn, event)

    def _unsubscribed(self, conn: MoqtConnection, event: ev.Unsubscribed) -> None:
        self.subscriptions.unsubscribed(conn, event)
        self.complete.unsubscribed(conn, event)

    def request(self, conn: MoqtConnection, request: ev.Event) -> None:
        handler = self._requests.get(type(request))
        if handler is None:
            super().request(conn, request)
        else:
            handler(conn, request)

    def event(self, conn: MoqtConnection, event: ev.Event) -> None:
        """Withdrawals and cancellations by type (``_events``); the rest (replies to our SUBSCRIBEs, their data
        streams and objects) concerns the upstream side of subscriptions."""
        handler = self._events.get(type(event))
        if handler is None:
            self.subscriptions.upstream_event(conn, event)
        else:
            handler(conn, event)


__all__ = ["Relay"]
