"""The relay: one :class:`~moqt.aio.MoqtApp` for every connection of the relay's UDP port, both drafts, composed of
its :class:`~moqt.relay.namespaces.Namespaces`, :class:`~moqt.relay.fetching.Fetches` and
:class:`~moqt.relay.fanout.Subscriptions`; what it is told rather than knows (access rules, track shapes,
upstream directory) is injected (:mod:`moqt.relay.interfaces`)."""

from __future__ import annotations

import asyncio
import collections
import time
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
from moqt.types import JoiningFetch, Namespace


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
        self.namespaces = Namespaces(rules, self.metrics)
        self.fetches = Fetches(rules, config, self.namespaces, self.metrics, self._spawn, tracks=tracks,
                               upstreams=upstreams)
        self.subscriptions = Subscriptions(rules, config, self.namespaces, self.metrics, self._spawn)
        self.complete = CompleteTracks(rules, self.fetches, self.metrics, self._spawn)
        self._requests: dict[type, Callable[[MoqtConnection, Any], None]] = {
            ev.PublishNamespaceRequested: self.namespaces.publish,
            ev.SubscribeRequested: self._subscribe,
            ev.SubscribeNamespaceRequested: self.namespaces.subscribe,
        }
        self._events: dict[type, Callable[[MoqtConnection, Any], None]] = {
            ev.PublishNamespaceDone: self.namespaces.done,
            ev.SubscribeNamespaceEnded: self.namespaces.subscription_ended,
            ev.Unsubscribed: self._unsubscribed,
            ev.StreamStopped: self.subscriptions.stream_stopped,
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
            "metrics": dict(sorted(self.metrics.items())),
            "uptime_s": round(time.monotonic() - self.started, 1),
        }

    # -- sessions ----------------------------------------------------------------------------------------------

    def session_ready(self, conn: MoqtConnection) -> None:
        self._connections.add(conn)
        self.metrics["sessions"] += 1

    def session_closed(self, conn: MoqtConnection) -> None:
        self._connections.discard(conn)
        self.namespaces.session_closed(conn)
        self.subscriptions.session_closed(conn)
        self.complete.session_closed(conn)

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
            await self.fetches.fetch(conn, request)

    def _subscribe(self, conn: MoqtConnection, request: ev.SubscribeRequested) -> None:
        """A track of one immutable group is answered here (:mod:`moqt.relay.complete`); others fan out."""
        group = self.complete.group(request)
        if group is None:
            self.subscriptions.subscribe(conn, request)
        else:
            self.complete.subscribe(conn, request, group)

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
