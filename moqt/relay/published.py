"""The relay's PUBLISH (drafts 14 and 18) and SUBSCRIBE_TRACKS (draft 18): tracks a publisher pushes without a prior
SUBSCRIBE.

Draft 18, "Publisher Interactions": "There are two ways to publish through a relay: 1. Send a PUBLISH message for a
specific Track to the relay. The relay MAY respond with PUBLISH_OK in Forward State=0 until there are known
subscribers for new Tracks. 2. Send a PUBLISH_NAMESPACE ..." and "Relays MUST verify that publishers are authorized
to publish the set of Tracks whose Track Namespace matches the namespace in a PUBLISH_NAMESPACE, or the Full Track
Name in PUBLISH." The relay asks the same :class:`~moqt.relay.interfaces.AccessRules` ``publish`` rule as for
PUBLISH_NAMESPACE (the track's namespace), and answers PUBLISH_OK with Forward State 1 (so that a subscriber that
comes later gets objects at once; it does not hold the publisher at Forward 0). An accepted PUBLISH becomes a
:class:`~moqt.relay.fanout.Subscription` marked ``published``: a SUBSCRIBE for the track joins it ("When a Relay
receives an authorized SUBSCRIBE for a Track with one or more `Established` upstream subscriptions, it MUST reply
with SUBSCRIBE_OK"), its objects fan out as an upstream subscription's do, and it lasts until the publisher's
PUBLISH_DONE (forwarded), its reset or its session's end, whoever reads it. A second PUBLISH of a track that another
live PUBLISH carries is refused DUPLICATE_SUBSCRIPTION (the relay would be subscribed twice; draft 14:
UNINTERESTED).

"When a relay receives an incoming PUBLISH message, it MUST send a PUBLISH request to each subscriber that has sent
SUBSCRIBE_TRACKS for the Track's namespace or a prefix thereof" -- and for the tracks already published when the
SUBSCRIBE_TRACKS arrives ("as well as future track publications"), "excluding tracks published by the subscriber",
and only to a subscriber the rules let read the track ("relays MUST NOT send any PUBLISH messages without knowing the
client is interested in and authorized to receive the content"). SUBSCRIBE_TRACKS is authorized like
SUBSCRIBE_NAMESPACE (``discover``); a prefix that shares a prefix with another of the session's SUBSCRIBE_TRACKS is
refused PREFIX_OVERLAP. The relay's PUBLISH forwards objects once the subscriber's PUBLISH_OK says Forward 1, and a
REQUEST_UPDATE of it (Forward) is applied and answered REQUEST_OK. Draft 14 has no SUBSCRIBE_TRACKS; there "the
recipient of [SUBSCRIBE_NAMESPACE] will send any relevant PUBLISH_NAMESPACE, PUBLISH_NAMESPACE_DONE or PUBLISH
messages", so the relay adds each accepted draft 14 SUBSCRIBE_NAMESPACE here as well (:meth:`add_subscriber`).

Not done: objects of published tracks are forwarded, not cached (as for subscribed tracks: the cache holds FETCHed
tracks); a FETCH of a published track goes to the session that published its namespace, if any.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from dataclasses import dataclass, field

from moqt import events as ev
from moqt.aio import MoqtConnection
from moqt.errors import MoqtUsageError, RequestErrorCode18
from moqt.relay.codes import request_code
from moqt.relay.fanout import Downstream, Subscription, Subscriptions
from moqt.relay.interfaces import AccessRules, under
from moqt.relay.namespaces import Namespaces, render
from moqt.types import Draft, Namespace

log = logging.getLogger("kvsp.relay")


@dataclass(eq=False)
class TracksSubscriber:
    """A SUBSCRIBE_TRACKS the relay accepted."""

    conn: MoqtConnection
    request_id: int
    prefix: Namespace
    forward: bool
    sent: set[tuple[Namespace, bytes]] = field(default_factory=set)  # tracks PUBLISHed to it


class PublishedTracks:
    """PUBLISH and SUBSCRIBE_TRACKS at one relay (see the module docstring)."""

    def __init__(self, rules: AccessRules, subscriptions: Subscriptions, namespaces: Namespaces,
                 metrics: collections.Counter[str]) -> None:
        self.rules = rules
        self.subscriptions = subscriptions
        self.namespaces = namespaces
        self.metrics = metrics
        self.subscribers: list[TracksSubscriber] = []

    # -- PUBLISH from a publisher -----------------------------------------------------------------------------------

    def publish(self, conn: MoqtConnection, request: ev.PublishRequested) -> None:
        rid, namespace, name = request.request_id, request.namespace, request.track_name
        decision = self.rules.publish(conn.peer_identity, namespace)
        if not decision.ok:
            self.metrics["publish_refused"] += 1
            log.info("PUBLISH %s/%s from %s refused: %s", render(namespace), name.decode("utf-8", "replace"),
                     conn.peer_identity, decision.reason)
            conn.reject(rid, request_code(conn.draft, "unauthorized"), decision.reason.encode())
            return
        if self.subscriptions.published_track(namespace, name) is not None:
            # draft 14's PUBLISH_ERROR has no such code: UNINTERESTED (0x4), "not of interest to the endpoint"
            code = int(RequestErrorCode18.DUPLICATE_SUBSCRIPTION) if conn.draft is Draft.D18 else 0x4
            conn.reject(rid, code, b"another session publishes this track")
            return
        accepted = ev.SubscribeAccepted(rid, request.track_alias, request.expires, request.group_order,
                                        request.largest, request.params, request.properties)
        sub = Subscription(conn, rid, namespace, name, alias=request.track_alias, accepted=accepted,
                           largest=request.largest, published=True)
        try:
            conn.session.accept_publish(rid, forward=None if request.forward else True)
        except MoqtUsageError:
            return
        conn.flush()
        self.subscriptions.add_published(sub)
        self.metrics["tracks_published"] += 1
        log.info("track %s/%s published by %s", render(namespace), name.decode("utf-8", "replace"),
                 conn.peer_identity)
        self.namespaces.notify_published()  # a SUBSCRIBE waiting for its publisher (RENDEZVOUS_TIMEOUT)
        for subscriber in self.subscribers:
            self._push(subscriber, sub)

    # -- SUBSCRIBE_TRACKS from a subscriber -------------------------------------------------------------------------

    def subscribe_tracks(self, conn: MoqtConnection, request: ev.SubscribeTracksRequested) -> None:
        rid, prefix = request.request_id, request.prefix
        decision = self.rules.discover(conn.peer_identity, prefix)
        if not decision.ok:
            conn.reject(rid, request_code(conn.draft, "unauthorized"), decision.reason.encode())
            return
        if any(s.conn is conn and (under(prefix, s.prefix) or under(s.prefix, prefix)) for s in self.subscribers):
            conn.reject(rid, int(RequestErrorCode18.PREFIX_OVERLAP), b"overlaps another SUBSCRIBE_TRACKS")
            return
        try:
            conn.session.accept_subscribe_tracks(rid)
        except MoqtUsageError:
            return
        conn.flush()
        self.metrics["track_subscriptions"] += 1
        self.add_subscriber(TracksSubscriber(conn, rid, prefix, request.forward))

    def add_subscriber(self, subscriber: TracksSubscriber) -> None:
        """A SUBSCRIBE_TRACKS (draft 18) or an accepted draft 14 SUBSCRIBE_NAMESPACE (its recipient "will send any
        relevant PUBLISH_NAMESPACE, PUBLISH_NAMESPACE_DONE or PUBLISH messages for that namespace"): PUBLISH the
        tracks published so far, and later ones."""
        self.subscribers.append(subscriber)
        for sub in list(self.subscriptions.published.values()):
            if not sub.finished:
                self._push(subscriber, sub)

    def ended(self, conn: MoqtConnection, event: ev.SubscribeTracksEnded | ev.SubscribeNamespaceEnded) -> None:
        """The subscriber withdrew its SUBSCRIBE_TRACKS (the PUBLISHes already made stay)."""
        self.subscribers = [s for s in self.subscribers if not (s.conn is conn and s.request_id == event.request_id)]

    def _push(self, subscriber: TracksSubscriber, sub: Subscription) -> None:
        conn, key = subscriber.conn, (sub.namespace, sub.track_name)
        if conn is sub.conn or conn.closed is not None or key in subscriber.sent \
                or not under(sub.namespace, subscriber.prefix) or not self.rules.read(conn.peer_identity,
                                                                                     sub.namespace).ok:
            return
        order = sub.accepted.group_order if sub.accepted is not None else None
        try:
            rid = conn.session.publish(sub.namespace, sub.track_name, forward=subscriber.forward, largest=sub.largest,
                                       group_order=order)
        except MoqtUsageError as exc:
            log.debug("PUBLISH to %r: %s", conn, exc)
            return
        subscriber.sent.add(key)
        self.subscriptions.add_downstream(sub, Downstream(conn, rid, pushed=True))
        self.metrics["publishes_sent"] += 1
        conn.flush()

    # -- replies of subscribers to the relay's PUBLISH ----------------------------------------------------------------

    def accepted(self, conn: MoqtConnection, event: ev.PublishAccepted) -> None:
        found = self.subscriptions.downstream(conn, event.request_id)
        if found is not None and found[1].pushed:
            sub, down = found
            down.accepted = event.forward
            down.joined_at = sub.largest

    def update(self, conn: MoqtConnection, event: ev.UpdateRequested) -> bool:
        """A REQUEST_UPDATE of one of the relay's PUBLISHes: apply Forward, answer REQUEST_OK. False if it is not
        one (the caller answers it)."""
        found = self.subscriptions.downstream(conn, event.target_request_id)
        if found is None or not found[1].pushed:
            return False
        if event.forward is not None:
            found[1].accepted = event.forward
        with contextlib.suppress(MoqtUsageError):
            conn.session.accept_update(event.request_id)
        conn.flush()
        return True

    def session_closed(self, conn: MoqtConnection) -> None:
        self.subscribers = [s for s in self.subscribers if s.conn is not conn]


__all__ = ["PublishedTracks", "TracksSubscriber"]
