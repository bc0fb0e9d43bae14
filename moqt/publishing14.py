"""PUBLISH in draft 14 ("moq-00"), on top of :mod:`moqt.session14`: the same publisher-initiated subscription as draft
18's (:mod:`moqt.publishing`), on the control stream, with its own replies.

Draft 14, "Subscriptions": "A publisher initiates a subscription to a track by sending the PUBLISH message. The
subscriber either accepts or rejects the subscription using PUBLISH_OK or PUBLISH_ERROR." PUBLISH carries Group
Order, Content Exists / Largest Location and Forward as fields; PUBLISH_OK carries Forward, Subscriber Priority,
Group Order and a filter ("This overwrites the GroupOrder specified PUBLISH"). "A subscriber receiving a PUBLISH for
a Track it does not wish to receive SHOULD send PUBLISH_ERROR with error code `UNINTERESTED`, and abandon reading
any publisher initiated streams associated with that subscription using a STOP_SENDING frame." The publisher ends
it with PUBLISH_DONE (Request ID = the PUBLISH's), the subscriber with UNSUBSCRIBE (the same Request ID), and
SUBSCRIBE_UPDATE names it as it names a SUBSCRIBE. PUBLISH uses a Request ID, so MAX_REQUEST_ID governs it.

Draft 14 has no SUBSCRIBE_TRACKS: "The recipient of [SUBSCRIBE_NAMESPACE] will send any relevant PUBLISH_NAMESPACE,
PUBLISH_NAMESPACE_DONE or PUBLISH messages for that namespace" -- which PUBLISHes to send is the application's
decision (the relay: :mod:`moqt.relay.published`).
"""

from __future__ import annotations

from moqt.errors import MoqtUsageError, StreamResetCode, protocol_violation
from moqt.events import PublishAccepted, PublishDone, PublishRequested, RequestRejected, Unsubscribed, UpdateRequested
from moqt.message import Message
from moqt.messages14 import Publish, PublishError, PublishOk, SubscribeUpdate, Unsubscribe
from moqt.messages14 import PublishDone as PublishDoneMsg
from moqt.messages18 import Redirect
from moqt.publishing import choose_alias, stop_reading
from moqt.requests import Kind, Request, RState, absolute_filter
from moqt.session14 import Session14
from moqt.types import LARGEST_OBJECT_FILTER, GroupOrder, Location, Namespace, SubscriptionFilter


class PublishingSession14(Session14):
    """The draft 14 session with PUBLISH (see the module docstring)."""

    def _on_message(self, msg: Message) -> None:
        if self.setup is None:
            super()._on_message(msg)
        elif isinstance(msg, Publish):
            self._accept_request_id(msg.request_id)
            tokens = self._tokens(msg.params)
            req = self._register(msg.request_id, Kind.PUBLISH, msg.namespace, msg.track_name, forward=msg.forward,
                                 group_order=msg.group_order)
            self._bind_alias(msg.track_alias, msg.request_id)
            req.track_alias = msg.track_alias
            self._events.append(PublishRequested(msg.request_id, msg.namespace, msg.track_name, msg.track_alias,
                                                 msg.forward, msg.largest, 0, msg.group_order, tokens, msg.params))
        elif isinstance(msg, SubscribeUpdate) and self._names_our_publish(msg.subscription_request_id):
            self._accept_request_id(msg.request_id)
            self._update_our_publish(msg)
        else:
            super()._on_message(msg)

    def _names_our_publish(self, rid: int) -> bool:
        req = self.requests.get(rid)
        return req is not None and req.local and req.kind is Kind.PUBLISH

    def _on_other(self, msg: Message) -> None:
        match msg:
            case PublishOk() | PublishError():
                self._on_publish_reply(msg)
            case PublishDoneMsg() if self._is_peers_publish(msg.request_id):
                req = self.requests.get(msg.request_id)
                if req is not None and req.state is not RState.DONE:
                    self._events.append(PublishDone(req.request_id, msg.status_code, msg.stream_count, msg.reason))
                    self._forget(req)  # late objects keep their alias (request_id None)
            case Unsubscribe() if msg.request_id % 2 == self._next_request_id % 2:  # names a request of ours
                req = self.requests.get(msg.request_id)
                if req is None and self._was_ours(msg.request_id):
                    return  # a PUBLISH we ended meanwhile
                if req is None or req.kind is not Kind.PUBLISH:
                    raise protocol_violation(f"UNSUBSCRIBE for request {msg.request_id}, which is no PUBLISH of ours")
                if req.state is not RState.DONE:
                    self._end_served(req, StreamResetCode.CANCELLED)
                    self._events.append(Unsubscribed(req.request_id))
                    self._forget(req)
            case _:
                super()._on_other(msg)

    def _is_peers_publish(self, rid: int) -> bool:
        req = self.requests.get(rid)
        if req is not None:
            return not req.local and req.kind is Kind.PUBLISH
        return rid % 2 == self._peer_parity() and self._was_peers(rid)  # a forgotten one: ignore what trails it

    def _on_publish_reply(self, msg: PublishOk | PublishError) -> None:
        rid = msg.request_id
        req = self.requests.get(rid)
        if req is None and self._was_ours(rid):
            return  # we ended it meanwhile
        if req is None or not req.local or req.kind is not Kind.PUBLISH:
            raise protocol_violation(f"{msg.NAME} for request {rid}, which is not one of our PUBLISHes")
        if req.replied:
            raise protocol_violation(f"a second reply ({msg.NAME}) to request {rid}")
        req.replied = True
        if req.state is RState.DONE:
            return
        if isinstance(msg, PublishError):
            self._end_served(req, StreamResetCode.CANCELLED)
            self._forget(req)
            self._events.append(RequestRejected(rid, msg.error_code, msg.reason))
            return
        req.state, req.forward, req.filter, req.group_order = RState.ACTIVE, msg.forward, msg.filter, msg.group_order
        self._events.append(PublishAccepted(rid, msg.forward, msg.filter, msg.subscriber_priority, msg.group_order,
                                            msg.params))

    def _update_our_publish(self, msg: SubscribeUpdate) -> None:
        req = self.requests[msg.subscription_request_id]
        if req.state is RState.DONE:
            return
        flt = absolute_filter(msg.start, msg.end_group)
        req.filter, req.forward, req.priority = flt, msg.forward, msg.subscriber_priority
        self._events.append(UpdateRequested(msg.request_id, req.request_id, flt, msg.subscriber_priority,
                                            msg.forward, False, msg.params))

    def _served(self, request_id: int) -> Request:
        req = self.requests.get(request_id)
        if req is not None and req.local and req.kind is Kind.PUBLISH:
            if req.state is RState.DONE or self.closed:
                raise MoqtUsageError(f"publish {request_id} has ended")
            return req  # objects may precede PUBLISH_OK
        return super()._served(request_id)

    def _send_cancel(self, req: Request) -> None:
        if req.kind is Kind.PUBLISH:  # the subscriber ends a PUBLISH-initiated subscription
            self._send_request(Unsubscribe(req.request_id), None)
        else:
            super()._send_cancel(req)

    def _send_error(self, req: Request, code: int, reason: bytes, retry_interval: int,
                    redirect: Redirect | None) -> None:
        super()._send_error(req, code, reason, retry_interval, None)
        if req.kind is Kind.PUBLISH and not req.local:
            stop_reading(self, req)  # "abandon reading any publisher initiated streams"

    # -- API ------------------------------------------------------------------------------------------------------

    def publish(self, namespace: Namespace, track_name: bytes, *, forward: bool = True,
                largest: Location | None = None, expires: int = 0, group_order: GroupOrder | None = None,
                track_alias: int | None = None) -> int:
        self._check_track(namespace, track_name)
        if group_order is GroupOrder.PUBLISHER:
            raise MoqtUsageError("PUBLISH states the group order used: ascending or descending")
        track_alias = choose_alias(self, track_alias)
        order = group_order or GroupOrder.ASCENDING
        req = self._new_request(Kind.PUBLISH, namespace=namespace, track_name=track_name, forward=forward,
                                track_alias=track_alias, group_order=order)
        self._aliases_out[track_alias] = req.request_id
        self._send_request(Publish(req.request_id, namespace, track_name, track_alias, order, largest, forward),
                           req.request_id)
        return req.request_id

    def accept_publish(self, request_id: int, *, forward: bool | None = None, subscriber_priority: int | None = None,
                       filter: SubscriptionFilter | None = None, group_order: GroupOrder | None = None) -> None:
        req = self._theirs(request_id, Kind.PUBLISH, pending=True)
        if forward is not None:
            req.forward = forward
        order = req.group_order if group_order in (None, GroupOrder.PUBLISHER) else group_order
        assert order is not None
        req.state, req.replied = RState.ACTIVE, True
        self._send_control(PublishOk(request_id, req.forward, 128 if subscriber_priority is None else
                                     subscriber_priority, order, filter or LARGEST_OBJECT_FILTER))

    def unsubscribe(self, request_id: int) -> None:
        """Also ends a PUBLISH of the peer's (UNSUBSCRIBE with its Request ID; its data streams stopped)."""
        req = self.requests.get(request_id)
        if req is None or req.local or req.kind is not Kind.PUBLISH:
            super().unsubscribe(request_id)
            return
        if self.closed:
            raise MoqtUsageError("the session is closed")
        if req.state is not RState.DONE:
            req.state = RState.DONE
            self._send_cancel(req)
        stop_reading(self, req)
        self._forget(req)


__all__ = ["PublishingSession14"]
