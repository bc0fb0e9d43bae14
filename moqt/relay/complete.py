"""The relay's SUBSCRIBE to a track of one immutable group (:meth:`~moqt.relay.interfaces.TrackShapes.single_group`;
KVSP: a block): answered by the relay itself, from its FETCH side, never by an upstream subscription.

Such a track's objects are all in the past, and "Subscribe only delivers newly published or received Objects.
Objects from the past are retrieved using FETCH" (drafts 14 and 18, SUBSCRIBE). The relay resolves the group as a
FETCH of it would -- the cache, a running upstream FETCH, or a new one to the publishing session or to the upstream
the directory names (:class:`~moqt.relay.fetching.Fetches`), so the FETCH a subscriber sends next is served from
it -- and once the upstream's FETCH_OK (or the whole group) says where the group ends, answers SUBSCRIBE_OK with the
Largest Location (draft 14 Content Exists 1; draft 18 LARGEST_OBJECT, which the publisher "MUST include" once
objects were published). The subscription then carries one subgroup stream with only the End of Group status one
past the last object (draft 14: "Object ID is one greater than the largest Object produced in the Group"; draft
18: "no objects with the specified Group ID and the Object ID that is greater than or equal to the one specified
exist") and no object ever; it stays open until the subscriber ends it, and its Largest Location is the Joining
Location of a joining FETCH (moq-rs fills the group it subscribed to with one). An AbsoluteRange filter asks for
a range whose "entire End Group has already been published": INVALID_RANGE (draft 18 "Subscription Filters").
Such a SUBSCRIBE that the cache cannot answer counts against its principal's limits as a FETCH does
(:mod:`moqt.relay.fetching`) until it is answered.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from moqt import events as ev
from moqt.aio import MoqtConnection, Slot
from moqt.errors import MoqtUsageError
from moqt.relay.cache import WHOLE, TrackFetch
from moqt.relay.codes import request_code, upstream_error, verdict_code
from moqt.relay.fanout import Joined
from moqt.relay.fetching import Fetches
from moqt.relay.interfaces import AccessRules
from moqt.types import FilterType, GroupOrder, Location, ObjectStatus

log = logging.getLogger("kvsp.relay")


class CompleteTracks:
    """SUBSCRIBE at one relay for tracks of one immutable group (see the module docstring)."""

    def __init__(self, rules: AccessRules, fetches: Fetches, metrics: collections.Counter[str],
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.rules = rules
        self.fetches = fetches
        self.metrics = metrics
        self._spawn = spawn
        self._joined: dict[tuple[int, int], Joined] = {}  # (id(conn), request id) of accepted subscriptions

    def group(self, request: ev.SubscribeRequested) -> int | None:
        """The one group of the track *request* names, or None when it is not such a track."""
        tracks = self.fetches.tracks
        return tracks.single_group(request.namespace, request.track_name) if tracks is not None else None

    def subscribe(self, conn: MoqtConnection, request: ev.SubscribeRequested, group: int) -> None:
        draft, rid = conn.draft, request.request_id
        decision = self.rules.read(conn.peer_identity, request.namespace)
        if not decision.ok:
            self.metrics["subscribe_refused"] += 1
            conn.reject(rid, verdict_code(draft, decision), decision.reason.encode())
            return
        if request.filter is not None and request.filter.type is FilterType.ABSOLUTE_RANGE:
            conn.reject(rid, request_code(draft, "invalid-range"),
                        b"the track is one group, published entirely: nothing in a range can still arrive (FETCH it)")
            return
        slot = None
        if self.fetches.misses(request.namespace, request.track_name, (group, 0), (group, WHOLE)):
            slot = self.fetches.limits.acquire(conn)
            if slot is None:
                self.fetches.refuse(conn, rid, "SUBSCRIBE")
                return
        self._spawn(self._answer_within(conn, request, group, slot))

    async def _answer_within(self, conn: MoqtConnection, request: ev.SubscribeRequested, group: int,
                             slot: Slot | None) -> None:
        try:
            await self._answer(conn, request, group, slot.principal if slot is not None else None)
        finally:
            if slot is not None:
                slot.release()

    async def _answer(self, conn: MoqtConnection, request: ev.SubscribeRequested, group: int,
                      owner: str | None) -> None:
        rid = request.request_id
        source = self.fetches.source(request.namespace, request.track_name, (group, 0), (group, WHOLE), group,
                                     owner)
        while source.error is None and _end_of_group(source, group) is None:
            await source.changed()
        if conn.closed is not None:
            return
        if source.error is not None:
            code, reason = upstream_error(conn.draft, source.error, source.upstream_draft)
            conn.reject(rid, code, reason)
            return
        end = _end_of_group(source, group)
        assert end is not None
        largest = Location(group, end - 1) if end else None  # None: the group has no objects (Content Exists 0)
        try:
            conn.session.accept_subscribe(rid, largest=largest, group_order=GroupOrder.ASCENDING)
            marker = conn.session.open_subgroup(rid, group, 0, priority=128)
            marker.begin_object(end, 0, status=ObjectStatus.END_OF_GROUP)
            marker.finish()
        except MoqtUsageError as exc:  # the subscriber went away meanwhile
            log.debug("SUBSCRIBE_OK to %r: %s", conn, exc)
            return
        finally:
            conn.flush()
        self._joined[(id(conn), rid)] = Joined(request.namespace, request.track_name, largest)
        self.metrics["complete_subscriptions"] += 1

    def joined(self, conn: MoqtConnection, request_id: int) -> Joined | None:
        return self._joined.get((id(conn), request_id))

    def unsubscribed(self, conn: MoqtConnection, event: ev.Unsubscribed) -> None:
        self._joined.pop((id(conn), event.request_id), None)

    def session_closed(self, conn: MoqtConnection) -> None:
        for key in [k for k in self._joined if k[0] == id(conn)]:
            del self._joined[key]


def _end_of_group(source: TrackFetch, group: int) -> int | None:
    """The object id one past the last object of *group* (0: it has none), once known: from the upstream's FETCH_OK
    End Location, or -- when that says "the entire group" -- from the objects once the fetch is complete."""
    accepted = source.accepted
    if accepted is not None and accepted.end_location.group == group and accepted.end_location.object > 0:
        return accepted.end_location.object
    if source.complete:
        return max((o.object_id + 1 for o in source.objects if o.group == group and o.status is ObjectStatus.NORMAL),
                   default=0)
    return None


__all__ = ["CompleteTracks"]
