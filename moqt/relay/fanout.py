"""The relay's SUBSCRIBE: one upstream subscription per track serves every downstream subscriber (fan-out).

A SUBSCRIBE (any track the identity may read) is forwarded to the session that published the track's namespace;
each subgroup stream of the upstream is forwarded object by object as it arrives, PUBLISH_DONE once the upstream's
streams have ended. Draft 18's RENDEZVOUS_TIMEOUT makes a SUBSCRIBE for a track nobody publishes yet wait
(bounded) for its publisher, then fail with TIMEOUT. A joining FETCH resolves against the Joining Location the
relay gave the subscriber (:meth:`Subscriptions.joined`).

A SUBSCRIBE that makes the relay subscribe upstream (nobody subscribed to the track here yet) takes one of its
principal's in-flight slots (:mod:`moqt.aio.limits`, ``client_max_in_flight``) for as long as that subscriber stays;
over the limit it is refused with EXCESSIVE_LOAD (draft 14: INTERNAL_ERROR) and a retry hint. Joining an upstream
subscription that exists costs the relay nothing upstream and is not counted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from moqt import events as ev
from moqt.aio import MoqtConnection, MoqtRequestError, MoqtStalled, PeerLimits, Slot
from moqt.errors import MoqtUsageError, PublishDoneCode14, StreamResetCode
from moqt.messages18 import Params18
from moqt.relay.codes import publish_done_code, request_code, upstream_error, verdict_code
from moqt.relay.interfaces import AccessRules, RelayConfig, Verdict
from moqt.relay.namespaces import Announcement, Namespaces
from moqt.types import Draft, GroupOrder, Location, Namespace, ObjectStatus
from moqt.writers import SubgroupWriter

log = logging.getLogger("kvsp.relay")

UNKNOWN_STREAM_COUNT = (1 << 62) - 1  # PUBLISH_DONE from a publisher that does not count its streams


@dataclass(eq=False)
class Downstream:
    conn: MoqtConnection
    request_id: int
    accepted: bool = False
    pushed: bool = False  # draft 18: the relay PUBLISHed the track to it (SUBSCRIBE_TRACKS); accepted at PUBLISH_OK
    joined_at: Location | None = None  # the largest location when SUBSCRIBE_OK was sent (its Joining Location)
    writers: dict[int, SubgroupWriter] = field(default_factory=dict)  # by upstream data stream id
    slot: Slot | None = None  # its principal's in-flight slot, when its SUBSCRIBE started the upstream one


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
    published: bool = False  # the publisher PUBLISHed it (draft 18): kept while published, with or without readers


@dataclass(frozen=True)
class Joined:
    """What a joining FETCH names: an accepted subscription's track and its Joining Location (None when the
    track had no largest object when the subscription began)."""

    namespace: Namespace
    track_name: bytes
    anchor: Location | None


class Subscriptions:
    """SUBSCRIBE at one relay: upstream subscriptions and their downstream subscribers (see the module docstring)."""

    def __init__(self, rules: AccessRules, config: RelayConfig, namespaces: Namespaces,
                 metrics: collections.Counter[str], spawn: Callable[[Coroutine[Any, Any, None]], None], *,
                 limits: PeerLimits | None = None) -> None:
        self.rules = rules
        self.config = config
        self.limits = limits or PeerLimits(max_in_flight=config.client_max_in_flight, retry_ms=config.client_retry_ms)
        self.namespaces = namespaces
        self.metrics = metrics
        self._spawn = spawn
        self.subscriptions: dict[tuple[int, int], Subscription] = {}  # (id(publisher conn), upstream request id)
        self._by_alias: dict[tuple[int, int], Subscription] = {}  # (id(publisher conn), track alias)
        self._downstream: dict[tuple[int, int], Subscription] = {}  # (id(subscriber conn), downstream request id)
        self.published: dict[tuple[Namespace, bytes], Subscription] = {}  # PUBLISHed tracks (moqt.relay.published)

    def published_track(self, namespace: Namespace, track_name: bytes) -> Subscription | None:
        sub = self.published.get((namespace, track_name))
        if sub is not None and sub.finished:
            del self.published[(namespace, track_name)]
            return None
        return sub

    def add_published(self, sub: Subscription) -> None:
        """A track a publisher PUBLISHed (accepted): its objects fan out like an upstream subscription's."""
        self.subscriptions[(id(sub.conn), sub.request_id)] = sub
        if sub.alias is not None:
            self._by_alias[(id(sub.conn), sub.alias)] = sub
        self.published[(sub.namespace, sub.track_name)] = sub

    def add_downstream(self, sub: Subscription, down: Downstream) -> None:
        sub.downstreams.append(down)
        self._downstream[(id(down.conn), down.request_id)] = sub
        if sub.accepted is not None and not down.pushed:
            self._accept_downstream(sub, down)

    def downstream(self, conn: MoqtConnection, request_id: int) -> tuple[Subscription, Downstream] | None:
        sub = self._downstream.get((id(conn), request_id))
        down = next((d for d in sub.downstreams if d.conn is conn and d.request_id == request_id), None) \
            if sub is not None else None
        return (sub, down) if sub is not None and down is not None else None

    def joined(self, conn: MoqtConnection, request_id: int) -> Joined | None:
        """The accepted subscription *request_id* of *conn*, for a joining FETCH."""
        sub = self._downstream.get((id(conn), request_id))
        if sub is None:
            return None
        down = next((d for d in sub.downstreams if d.conn is conn and d.request_id == request_id), None)
        if down is None or not down.accepted:
            return None
        return Joined(sub.namespace, sub.track_name, down.joined_at)

    def unsubscribed(self, conn: MoqtConnection, event: ev.Unsubscribed) -> None:
        sub = self._downstream.get((id(conn), event.request_id))
        if sub is not None:
            for down in [d for d in sub.downstreams if d.conn is conn and d.request_id == event.request_id]:
                self._detach(sub, down)

    def stream_stopped(self, conn: MoqtConnection, event: ev.StreamStopped) -> None:
        """A subscriber stopped one of the subgroup streams we forward to it."""
        sub = self._downstream.get((id(conn), event.request_id))
        if sub is not None:
            for down in sub.downstreams:
                if down.conn is conn:
                    for sid, writer in list(down.writers.items()):
                        if writer.stream_id == event.stream_id:
                            writer.reset(StreamResetCode.CANCELLED)
                            del down.writers[sid]
            conn.flush()

    def session_closed(self, conn: MoqtConnection) -> None:
        for key, sub in list(self.subscriptions.items()):
            if sub.conn is conn:  # the publisher went away
                self._end_subscription(sub, int(PublishDoneCode14.GOING_AWAY), b"the publisher's session ended")
                self.subscriptions.pop(key, None)
            else:
                for down in [d for d in sub.downstreams if d.conn is conn]:
                    self._detach(sub, down)

    def subscribe(self, conn: MoqtConnection, request: ev.SubscribeRequested) -> None:
        draft, rid = conn.draft, request.request_id
        decision = self.rules.read(conn.peer_identity, request.namespace)
        wait = request.params.rendezvous_timeout if isinstance(request.params, Params18) else None
        if not decision.ok:
            self.metrics["subscribe_refused"] += 1
            if wait and decision.verdict is Verdict.DOES_NOT_EXIST:
                # Outside every namespace the relay carries no publisher can appear; the subscriber asked to wait
                # for one, and draft 18 says "the relay SHOULD hold the subscription ... If the timeout expires
                # without a publisher, the relay SHOULD respond with REQUEST_ERROR with error code TIMEOUT".
                self._spawn(self._no_rendezvous(conn, rid, min(wait / 1000, self.config.rendezvous_limit_s)))
                return
            conn.reject(rid, verdict_code(draft, decision), decision.reason.encode())
            return
        published = self.published_track(request.namespace, request.track_name)
        if published is not None:
            self.metrics["subscriptions_joined"] += 1
            self.add_downstream(published, Downstream(conn, rid))
            return
        publisher = self.namespaces.publisher_for(request.namespace)
        if publisher is None:
            if wait:
                self._spawn(self._rendezvous(conn, request, min(wait / 1000, self.config.rendezvous_limit_s)))
                return
            conn.reject(rid, request_code(draft, "does-not-exist"), b"nobody publishes this track here")
            return
        self._attach(conn, request, publisher)

    async def _rendezvous(self, conn: MoqtConnection, request: ev.SubscribeRequested, seconds: float) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        while (publisher := self.namespaces.publisher_for(request.namespace)) is None:
            # "if the relay is holding a downstream SUBSCRIBE awaiting a publisher for this Track ..., it MUST proceed
            # with the SUBSCRIBE" (draft 18, "Publisher Interactions"): a PUBLISH of the track ends the wait too
            published = self.published_track(request.namespace, request.track_name)
            if published is not None and conn.closed is None:
                self.add_downstream(published, Downstream(conn, request.request_id))
                return
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or conn.closed is not None:
                conn.reject(request.request_id, request_code(conn.draft, "timeout"),
                            b"no publisher appeared within the rendezvous timeout")
                return
            await self.namespaces.wait_published(left)
        self._attach(conn, request, publisher)

    async def _no_rendezvous(self, conn: MoqtConnection, request_id: int, seconds: float) -> None:
        await asyncio.sleep(seconds)
        conn.reject(request_id, request_code(conn.draft, "timeout"), b"no publisher appeared within the rendezvous "
                                                                     b"timeout")

    def _attach(self, conn: MoqtConnection, request: ev.SubscribeRequested, publisher: Announcement) -> None:
        down = Downstream(conn, request.request_id)
        sub = next((s for s in self.subscriptions.values() if s.conn is publisher.conn and not s.finished
                    and s.namespace == request.namespace and s.track_name == request.track_name), None)
        if sub is None:
            down.slot = self.limits.acquire(conn)
            if down.slot is None:
                self.metrics["limit_refused"] += 1
                self.limits.refuse(conn, request.request_id, "SUBSCRIBE")
                return
            upstream = publisher.conn
            try:
                up_rid = upstream.session.subscribe(
                    request.namespace, request.track_name, filter=request.filter,
                    subscriber_priority=request.subscriber_priority, group_order=request.group_order,
                    forward=True)
            except MoqtUsageError as exc:
                down.slot.release()
                conn.reject(request.request_id, request_code(conn.draft, "internal"), str(exc).encode())
                return
            upstream.flush()
            sub = Subscription(upstream, up_rid, request.namespace, request.track_name)
            self.subscriptions[(id(upstream), up_rid)] = sub
            self.metrics["upstream_subscriptions"] += 1
            self._spawn(self._subscribe_deadline(sub))
        else:
            self.metrics["subscriptions_joined"] += 1
        self.add_downstream(sub, down)

    async def _subscribe_deadline(self, sub: Subscription) -> None:
        await asyncio.sleep(self.config.upstream_timeout_s)
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
            _release(down)
        sub.downstreams.clear()

    def _detach(self, sub: Subscription, down: Downstream) -> None:
        _release(down)
        if down in sub.downstreams:
            sub.downstreams.remove(down)
        self._downstream.pop((id(down.conn), down.request_id), None)
        for writer in down.writers.values():
            writer.reset(StreamResetCode.CANCELLED)
        down.writers.clear()
        if down.conn.closed is None:
            down.conn.flush()
        if not sub.downstreams and not sub.finished and not sub.published:  # nobody wants it any more
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
                if down.accepted or down.pushed:  # our PUBLISH ends with PUBLISH_DONE, accepted or not
                    with contextlib.suppress(MoqtUsageError):
                        down.conn.session.publish_done(down.request_id,
                                                       publish_done_code(status, up_draft, down.conn.draft), reason)
                else:  # the track ended before the publisher accepted (or its session went away): for this
                    # subscriber it does not exist here (a benign refusal, as if it came before the publisher)
                    kind = "internal" if status == int(PublishDoneCode14.INTERNAL_ERROR) else "does-not-exist"
                    down.conn.reject(down.request_id, request_code(down.conn.draft, kind), reason)
                down.conn.flush()
            self._downstream.pop((id(down.conn), down.request_id), None)
            _release(down)
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

    def upstream_event(self, conn: MoqtConnection, event: ev.Event) -> None:
        """An event of a publisher's session: the reply to our SUBSCRIBE, its data streams and objects, its end."""
        handler = _UPSTREAM_HANDLERS.get(type(event))
        if handler is not None:
            handler(self, conn, event)

    def _on_accepted(self, conn: MoqtConnection, event: ev.SubscribeAccepted) -> None:
        sub = self.subscriptions.get((id(conn), event.request_id))
        if sub is None:
            return
        sub.accepted, sub.alias = event, event.track_alias
        if event.largest is not None and (sub.largest is None or event.largest > sub.largest):
            sub.largest = event.largest
        self._by_alias[(id(conn), event.track_alias)] = sub
        for down in list(sub.downstreams):
            if not down.accepted and not down.pushed:
                self._accept_downstream(sub, down)

    def _on_refusal(self, conn: MoqtConnection, event: ev.RequestRejected | ev.RequestCancelled) -> None:
        sub = self.subscriptions.get((id(conn), event.request_id))
        if sub is None and isinstance(event, ev.RequestRejected):  # a subscriber refused the relay's PUBLISH
            found = self.downstream(conn, event.request_id)
            if found is not None:
                self._detach(*found)
        if sub is not None:
            if sub.accepted is None:
                reason = event.reason if isinstance(event, ev.RequestRejected) else b"cancelled"
                self._fail_subscription(sub, MoqtRequestError(event.request_id, event.error_code, reason))
            else:
                self._end_subscription(sub, int(PublishDoneCode14.INTERNAL_ERROR), b"upstream cancelled")
                self.subscriptions.pop((id(conn), event.request_id), None)

    def _on_data_stream(self, conn: MoqtConnection, event: ev.DataStreamOpened) -> None:
        if event.fetch:
            return
        sub = self._subscription_of(conn, event.request_id, event.track_alias)
        if sub is not None:
            sub.opened += 1
            sub.streams[event.stream_id] = UpstreamStream(event.stream_id, event.group, event.subgroup,
                                                          event.priority, event.end_of_group)

    def _on_object(self, conn: MoqtConnection, event: ev.ObjectReceived) -> None:
        if event.stream_id is None:
            return  # datagrams are not relayed
        sub = self._subscription_of(conn, event.request_id, event.track_alias)
        stream = sub.streams.get(event.stream_id) if sub is not None else None
        if sub is not None and stream is not None:
            here = Location(event.group, event.object_id)
            normal = event.status is ObjectStatus.NORMAL  # an End of Group / Track marker is no object published
            if event.offset == 0 and normal and (sub.largest is None or here > sub.largest):
                sub.largest = here
            self._forward_piece(sub, stream, event)

    def _on_stream_closed(self, conn: MoqtConnection, event: ev.StreamEnded | ev.StreamReset) -> None:
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

    def _on_publish_done(self, conn: MoqtConnection, event: ev.PublishDone) -> None:
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
        await asyncio.sleep(self.config.publish_done_grace_s)
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


def _release(down: Downstream) -> None:
    if down.slot is not None:
        down.slot.release()
        down.slot = None


_UPSTREAM_HANDLERS: dict[type, Callable[[Subscriptions, MoqtConnection, Any], None]] = {
    ev.SubscribeAccepted: Subscriptions._on_accepted,
    ev.RequestRejected: Subscriptions._on_refusal,
    ev.RequestCancelled: Subscriptions._on_refusal,
    ev.DataStreamOpened: Subscriptions._on_data_stream,
    ev.ObjectReceived: Subscriptions._on_object,
    ev.StreamEnded: Subscriptions._on_stream_closed,
    ev.StreamReset: Subscriptions._on_stream_closed,
    ev.PublishDone: Subscriptions._on_publish_done,
}
"""How :meth:`Subscriptions.upstream_event` routes the events of a publisher's session; others are ignored."""


__all__ = ["Downstream", "Joined", "Subscription", "Subscriptions", "UpstreamStream"]
