"""The relay's namespaces: which session published which namespace (PUBLISH_NAMESPACE / _DONE), who subscribed to
which prefix (SUBSCRIBE_NAMESPACE), and the announcements that follow: published namespaces under a subscriber's
prefix that it could read are announced (draft 14: PUBLISH_NAMESPACE / _DONE; draft 18: NAMESPACE /
NAMESPACE_DONE), now and as they come and go."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass, field

from moqt import events as ev
from moqt.aio import MoqtConnection
from moqt.errors import MoqtUsageError
from moqt.relay.codes import request_code
from moqt.relay.interfaces import AccessRules, under
from moqt.types import Draft, Namespace

log = logging.getLogger("kvsp.relay")


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


class Namespaces:
    """Published namespaces and namespace subscribers of one relay."""

    def __init__(self, rules: AccessRules, metrics: collections.Counter[str]) -> None:
        self.rules = rules
        self.metrics = metrics
        self.announcements: list[Announcement] = []
        self.subscribers: list[NamespaceSubscriber] = []
        self._published: asyncio.Event | None = None  # set (and replaced) whenever a namespace is published

    # -- PUBLISH_NAMESPACE ----------------------------------------------------------------------------------------

    def publish(self, conn: MoqtConnection, request: ev.PublishNamespaceRequested) -> None:
        decision = self.rules.publish(conn.peer_identity, request.namespace)
        if not decision.ok:
            self.metrics["publish_refused"] += 1
            log.info("PUBLISH_NAMESPACE %s from %s refused: %s", render(request.namespace), conn.peer_identity,
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
        log.info("namespace %s published by %s", render(request.namespace), conn.peer_identity)
        self.notify_published()
        for subscriber in self.subscribers:
            self._announce(subscriber, request.namespace)

    def done(self, conn: MoqtConnection, event: ev.PublishNamespaceDone) -> None:
        """PUBLISH_NAMESPACE_DONE: the session withdraws a namespace."""
        for a in [a for a in self.announcements if a.conn is conn and a.request_id == event.request_id]:
            self.withdraw(a)

    def withdraw(self, announcement: Announcement) -> None:
        if announcement not in self.announcements:
            return
        self.announcements.remove(announcement)
        namespace = announcement.namespace
        if any(a.namespace == namespace for a in self.announcements):
            return  # another session still publishes it
        for subscriber in self.subscribers:
            self._unannounce(subscriber, namespace)

    def publisher_for(self, namespace: Namespace) -> Announcement | None:
        """The session that published the longest prefix of *namespace* (the latest, among equals)."""
        best: Announcement | None = None
        for a in self.announcements:
            if under(namespace, a.namespace) and a.conn.closed is None and \
                    (best is None or len(a.namespace) >= len(best.namespace)):
                best = a
        return best

    def notify_published(self) -> None:
        """Wake :meth:`wait_published` (a namespace, or a track (PUBLISH), was published)."""
        if self._published is not None:
            self._published.set()
            self._published = None

    async def wait_published(self, timeout: float) -> None:
        """Until some namespace is published, or *timeout* seconds have passed."""
        if self._published is None:
            self._published = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._published.wait()

    # -- SUBSCRIBE_NAMESPACE --------------------------------------------------------------------------------------

    def subscribe(self, conn: MoqtConnection, request: ev.SubscribeNamespaceRequested) -> None:
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
        self.subscribers.append(subscriber)
        for namespace in dict.fromkeys(a.namespace for a in self.announcements):
            self._announce(subscriber, namespace)

    def subscription_ended(self, conn: MoqtConnection, event: ev.SubscribeNamespaceEnded) -> None:
        self.subscribers = [s for s in self.subscribers if not (s.conn is conn and s.request_id == event.request_id)]

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
            log.debug("announcing %s to %r: %s", render(namespace), conn, exc)
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

    # -- sessions -------------------------------------------------------------------------------------------------

    def session_closed(self, conn: MoqtConnection) -> None:
        for announcement in [a for a in self.announcements if a.conn is conn]:
            self.withdraw(announcement)
        self.subscribers = [s for s in self.subscribers if s.conn is not conn]


def render(namespace: Namespace) -> str:
    """A namespace for logs and status: its fields joined by ``/``."""
    return b"/".join(namespace).decode("utf-8", "replace")


__all__ = ["Announcement", "NamespaceSubscriber", "Namespaces", "render"]
