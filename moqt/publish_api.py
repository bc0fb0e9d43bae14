"""The PUBLISH / SUBSCRIBE_TRACKS surface of every :class:`~moqt.session.MoqtSession` (a base class of it).

Draft 18 implements all of it (:mod:`moqt.publishing`), draft 14 PUBLISH (0x1D, PUBLISH_OK 0x1E, PUBLISH_ERROR 0x1F:
:mod:`moqt.publishing14`) but has no SUBSCRIBE_TRACKS (type 0x51 is unknown there: "An endpoint that receives an
unknown message type MUST close the session"), so the SUBSCRIBE_TRACKS methods raise
:class:`~moqt.errors.MoqtUsageError` on it. The defaults here raise too (a session class without them).
"""

from __future__ import annotations

from moqt.errors import MoqtUsageError
from moqt.types import GroupOrder, Location, Namespace, SubscriptionFilter


class PublishingApi:
    """PUBLISH / SUBSCRIBE_TRACKS on any session (see the module docstring)."""

    def publish(self, namespace: Namespace, track_name: bytes, *, forward: bool = True,
                largest: Location | None = None, expires: int = 0, group_order: GroupOrder | None = None,
                track_alias: int | None = None) -> int:
        """PUBLISH: start a subscription of the peer to a track we publish; returns the request id (events:
        ``PublishAccepted`` / ``RequestRejected``; ``Unsubscribed`` when the subscriber stops it). Write its objects
        with ``open_subgroup`` (also before PUBLISH_OK, when *forward*), end it with ``publish_done``."""
        raise MoqtUsageError("this session does not implement PUBLISH")

    def accept_publish(self, request_id: int, *, forward: bool | None = None, subscriber_priority: int | None = None,
                       filter: SubscriptionFilter | None = None, group_order: GroupOrder | None = None) -> None:
        """PUBLISH_OK for the peer's PUBLISH *request_id* (None: the PUBLISH's / the draft's default)."""
        raise MoqtUsageError("this session does not implement PUBLISH")

    def subscribe_tracks(self, prefix: Namespace, *, forward: bool = True) -> int:
        """SUBSCRIBE_TRACKS: ask for a PUBLISH of every track under *prefix* (events: ``SubscribeTracksAccepted`` /
        ``RequestRejected``, then ``PublishRequested`` per track, ``PublishBlocked``)."""
        raise MoqtUsageError("draft 14 has no SUBSCRIBE_TRACKS")

    def accept_subscribe_tracks(self, request_id: int) -> None:
        raise MoqtUsageError("draft 14 has no SUBSCRIBE_TRACKS")

    def publish_blocked(self, request_id: int, namespace: Namespace, track_name: bytes) -> None:
        """PUBLISH_BLOCKED on the peer's SUBSCRIBE_TRACKS *request_id*: no PUBLISH will come for that track."""
        raise MoqtUsageError("draft 14 has no SUBSCRIBE_TRACKS")

    def unsubscribe_tracks(self, request_id: int) -> None:
        """Cancel one of our SUBSCRIBE_TRACKS (its stream is reset)."""
        raise MoqtUsageError("draft 14 has no SUBSCRIBE_TRACKS")


__all__ = ["PublishingApi"]
