"""Publisher-initiated subscriptions: PUBLISH and SUBSCRIBE_TRACKS (draft 18), on top of :mod:`moqt.session18`.

Draft 18, "Subscriptions": "A publisher initiates a subscription to a track by sending the PUBLISH message. The
subscriber either accepts or rejects the subscription using PUBLISH_OK or REQUEST_ERROR." PUBLISH_OK is a REQUEST_OK
on the PUBLISH's request stream ("REQUEST_OK": "This document uses the shorthand PUBLISH_OK ... to refer to a
REQUEST_OK sent in response to the corresponding request type"). "The subscriber terminates a subscription in the
`Pending (Subscriber)` or `Established` states by sending STOP_SENDING. The publisher terminates a subscription in
the `Pending (Publisher)` or `Established` states by sending PUBLISH_DONE and closing the stream." "Publishers MAY
start sending Objects on PUBLISH-initiated subscriptions before receiving a PUBLISH_OK": the alias of a PUBLISH we
receive is bound at once, so its objects resolve to its request id.

"SUBSCRIBE_TRACKS requests track subscriptions: the publisher sends PUBLISH messages for tracks within matching
namespaces, excluding tracks published by the subscriber." It is answered with REQUEST_OK / REQUEST_ERROR; "If a
Subscription cannot be created because there are no available bidirectional streams, the Publisher sends a
PUBLISH_BLOCKED message on the SUBSCRIBE_TRACKS response stream"; it "can be cancelled by closing the stream with
either a FIN or RESET_STREAM".

Who publishes what under a SUBSCRIBE_TRACKS is the application's decision (a relay: :mod:`moqt.relay.published`);
the session keeps the request states, the aliases and the streams. The draft-neutral API is
:class:`moqt.publish_api.PublishingApi` (draft 14 refuses it).
"""

from __future__ import annotations

from moqt.errors import MoqtUsageError, PublishDoneCode18, StreamResetCode, protocol_violation
from moqt.events import (
    PublishAccepted,
    PublishBlocked,
    PublishDone,
    PublishRequested,
    RequestCancelled,
    RequestRejected,
    SubscribeTracksAccepted,
    SubscribeTracksEnded,
    SubscribeTracksRequested,
    Unsubscribed,
    UpdateRequested,
)
from moqt.message import Message
from moqt.messages18 import (
    Goaway,
    Params18,
    Publish,
    Redirect,
    RequestError,
    RequestOk,
    RequestUpdate,
    SubscribeTracks,
)
from moqt.messages18 import PublishBlocked as PublishBlockedMsg
from moqt.messages18 import PublishDone as PublishDoneMsg
from moqt.requests import Kind, Request, RState
from moqt.session import MoqtSession
from moqt.session18 import DEFAULT_PUBLISHER_GROUP_ORDER, Session18, _property_order
from moqt.types import GroupOrder, KeyValuePairs, Location, Namespace, SubscriptionFilter

_PUBLISHING = (Kind.PUBLISH, Kind.SUBSCRIBE_TRACKS)


class PublishingSession18(Session18):
    """The draft 18 session with PUBLISH and SUBSCRIBE_TRACKS (see the module docstring)."""

    # -- The peer's requests --------------------------------------------------------------------------------------

    def _on_new_request(self, sid: int, msg: Message) -> None:
        if isinstance(msg, Publish):
            p = msg.params
            tokens = self._check_tokens(p.auth_tokens)
            forward = p.forward is not False
            req = self._register(sid, msg.request_id, Kind.PUBLISH, msg.namespace, msg.track_name, forward=forward)
            self._bind_alias(msg.track_alias, msg.request_id)
            req.track_alias = msg.track_alias
            self._events.append(PublishRequested(msg.request_id, msg.namespace, msg.track_name, msg.track_alias,
                                                 forward, p.largest_object, p.expires or 0,
                                                 _property_order(msg.properties), tokens, p, msg.properties))
        elif isinstance(msg, SubscribeTracks):
            tokens = self._check_tokens(msg.params.auth_tokens)
            forward = msg.params.forward is not False
            self._register(sid, msg.request_id, Kind.SUBSCRIBE_TRACKS, msg.namespace, forward=forward)
            self._events.append(SubscribeTracksRequested(msg.request_id, msg.namespace, forward, tokens, msg.params))
        else:
            super()._on_new_request(sid, msg)

    def _on_requester_message(self, sid: int, msg: Message) -> None:
        rid = self._stream_request.get(sid)
        req = self.requests.get(rid) if rid is not None else None
        if req is None or req.kind is not Kind.PUBLISH or isinstance(msg, Goaway):
            super()._on_requester_message(sid, msg)
            return
        # The peer's PUBLISH: after the PUBLISH only PUBLISH_DONE comes from the publisher on its stream.
        if not isinstance(msg, PublishDoneMsg):
            raise protocol_violation(f"{msg.NAME} from the publisher on a PUBLISH stream")
        if req.state is not RState.DONE:
            req.state = RState.DONE
            self._events.append(PublishDone(req.request_id, msg.status_code, msg.stream_count, msg.reason))

    def _requester_finished(self, sid: int) -> None:
        rid = self._stream_request.get(sid)
        req = self.requests.get(rid) if rid is not None else None
        if req is None or req.kind not in _PUBLISHING:
            super()._requester_finished(sid)
            return
        if req.state is not RState.DONE:
            if req.kind is Kind.SUBSCRIBE_TRACKS:
                self._events.append(SubscribeTracksEnded(req.request_id, req.namespace))
            else:  # a PUBLISH stream closed without PUBLISH_DONE: the subscription is over all the same
                self._events.append(RequestCancelled(req.request_id, 0))
        req.state = RState.DONE
        self._finish_stream(sid)
        self._forget(req)

    # -- Replies on our request streams -----------------------------------------------------------------------------

    def _on_response(self, sid: int, msg: Message) -> None:
        req = self.requests[self._stream_request[sid]]
        if req.kind not in _PUBLISHING or isinstance(msg, Goaway):
            super()._on_response(sid, msg)
            return
        rid = req.request_id
        if not req.replied:
            req.replied = True
            if isinstance(msg, RequestError):
                self._events.append(RequestRejected(rid, msg.error_code, msg.reason, msg.retry_interval,
                                                    msg.redirect))
                self._forget(req)
                return
            if not isinstance(msg, RequestOk):
                raise protocol_violation(f"{msg.NAME} is not a reply to a {req.kind.value} request")
            if msg.properties:
                raise protocol_violation(f"track properties in the REQUEST_OK of a {req.kind.value} request")
            if req.state is RState.DONE:
                return  # cancelled meanwhile
            req.state = RState.ACTIVE
            if req.kind is Kind.SUBSCRIBE_TRACKS:
                self._events.append(SubscribeTracksAccepted(rid))
                return
            p = msg.params
            if p.forward is not None:
                req.forward = p.forward
            if p.subscription_filter is not None:
                req.filter = p.subscription_filter
            self._events.append(PublishAccepted(rid, req.forward, p.subscription_filter, p.subscriber_priority,
                                                p.group_order, p))
            return
        if req.state is RState.DONE:
            return  # late messages of a request we ended
        if req.kind is Kind.SUBSCRIBE_TRACKS and isinstance(msg, PublishBlockedMsg):
            self._events.append(PublishBlocked(rid, req.namespace + msg.suffix, msg.track_name))
        elif req.kind is Kind.PUBLISH and isinstance(msg, RequestUpdate):
            self._accept_request_id(msg.request_id)
            self.requests[msg.request_id] = Request(msg.request_id, Kind.UPDATE, False, stream_id=sid, target=rid)
            p = msg.params
            if p.subscription_filter is not None:
                req.filter = p.subscription_filter
            if p.forward is not None:
                req.forward = p.forward
            self._events.append(UpdateRequested(msg.request_id, rid, p.subscription_filter, p.subscriber_priority,
                                                p.forward, True, p))
        else:
            raise protocol_violation(f"{msg.NAME} on the stream of a {req.kind.value} request")

    def _responder_finished(self, sid: int) -> None:
        req = self.requests[self._stream_request[sid]]
        if req.kind is not Kind.PUBLISH or req.state is RState.DONE:
            super()._responder_finished(sid)
            return
        # The subscriber closed its half of our PUBLISH's stream: it will send nothing more; treat it as the end.
        req.state = RState.DONE
        self._events.append(Unsubscribed(req.request_id))
        self._forget(req)

    def _request_stream_cancelled(self, sid: int, code: int) -> None:
        rid = self._stream_request.get(sid)
        req = self.requests.get(rid) if rid is not None else None
        if req is None or req.state is RState.DONE or not (
                (req.kind is Kind.PUBLISH and req.local) or (req.kind is Kind.SUBSCRIBE_TRACKS and not req.local)):
            super()._request_stream_cancelled(sid, code)
            return
        # The subscriber stopped our PUBLISH (STOP_SENDING), or withdrew its SUBSCRIBE_TRACKS (reset).
        req.state = RState.DONE
        for writer in list(self._writers.values()):
            if writer.request_id == req.request_id:
                writer.reset(StreamResetCode.CANCELLED)
        if sid not in self._fin_sent:
            self._fin_sent.add(sid)
            self._reset_stream(sid, StreamResetCode.CANCELLED)
        self._stream_parsers.pop(sid, None)
        self._forget(req)
        if req.kind is Kind.PUBLISH:
            self._events.append(Unsubscribed(req.request_id))
        else:
            self._events.append(SubscribeTracksEnded(req.request_id, req.namespace))

    def _send_error(self, req: Request, code: int, reason: bytes, retry_interval: int,
                    redirect: Redirect | None) -> None:
        target = self.requests.get(req.target) if req.kind is Kind.UPDATE and req.target is not None else None
        if target is not None and target.kind is Kind.PUBLISH:  # a failed update ends the subscription
            try:
                msg = RequestError(code, retry_interval, reason, redirect)
            except ValueError as exc:
                raise MoqtUsageError(str(exc)) from None
            self._reply(target, msg)
            if target.state is not RState.DONE:
                self._reply(target, PublishDoneMsg(PublishDoneCode18.UPDATE_FAILED, target.data_streams), fin=True)
            self._forget(target)
            return
        super()._send_error(req, code, reason, retry_interval, redirect)
        if req.kind is Kind.PUBLISH and not req.local:
            self._stop_reading(req)  # "abandon reading any publisher initiated streams ... using STOP_SENDING"

    def _stop_reading(self, req: Request) -> None:
        stop_reading(self, req)

    def _served(self, request_id: int) -> Request:
        req = self.requests.get(request_id)
        if req is not None and req.local and req.kind is Kind.PUBLISH:
            if req.state is RState.DONE or self.closed:
                raise MoqtUsageError(f"publish {request_id} has ended")
            return req  # objects may precede PUBLISH_OK
        return super()._served(request_id)

    # -- API ------------------------------------------------------------------------------------------------------

    def publish(self, namespace: Namespace, track_name: bytes, *, forward: bool = True,
                largest: Location | None = None, expires: int = 0, group_order: GroupOrder | None = None,
                track_alias: int | None = None) -> int:
        self._check_track(namespace, track_name)
        if group_order is GroupOrder.PUBLISHER:
            raise MoqtUsageError("PUBLISH states the group order used: ascending or descending")
        track_alias = choose_alias(self, track_alias)
        req = self._new_request(Kind.PUBLISH, namespace=namespace, track_name=track_name, forward=forward,
                                track_alias=track_alias, group_order=group_order or GroupOrder.ASCENDING)
        self._aliases_out[track_alias] = req.request_id
        props: KeyValuePairs = ((DEFAULT_PUBLISHER_GROUP_ORDER, int(group_order)),) \
            if group_order is GroupOrder.DESCENDING else ()
        params = Params18(forward=None if forward else False, largest_object=largest, expires=expires or None)
        self._open_request(req, Publish(req.request_id, namespace, track_name, track_alias, params, props))
        return req.request_id

    def accept_publish(self, request_id: int, *, forward: bool | None = None, subscriber_priority: int | None = None,
                       filter: SubscriptionFilter | None = None, group_order: GroupOrder | None = None) -> None:
        req = self._theirs(request_id, Kind.PUBLISH, pending=True)
        if group_order is GroupOrder.PUBLISHER:
            group_order = None
        req.state, req.replied = RState.ACTIVE, True
        if forward is not None:
            req.forward = forward
        self._reply(req, RequestOk(Params18(forward=forward, subscriber_priority=subscriber_priority,
                                            subscription_filter=filter, group_order=group_order)))

    def subscribe_tracks(self, prefix: Namespace, *, forward: bool = True) -> int:
        self._check_track(prefix, b"")
        req = self._new_request(Kind.SUBSCRIBE_TRACKS, namespace=prefix, forward=forward)
        self._open_request(req, SubscribeTracks(req.request_id, prefix, Params18(forward=None if forward else False)))
        return req.request_id

    def accept_subscribe_tracks(self, request_id: int) -> None:
        req = self._theirs(request_id, Kind.SUBSCRIBE_TRACKS, pending=True)
        req.state, req.replied = RState.ACTIVE, True
        self._reply(req, RequestOk())

    def publish_blocked(self, request_id: int, namespace: Namespace, track_name: bytes) -> None:
        req = self._theirs(request_id, Kind.SUBSCRIBE_TRACKS, pending=False)
        prefix = req.namespace
        if namespace[:len(prefix)] != prefix:
            raise MoqtUsageError(f"namespace {namespace!r} does not start with the prefix {prefix!r}")
        self._check_track(namespace, track_name)
        self._reply(req, PublishBlockedMsg(namespace[len(prefix):], track_name))

    def unsubscribe_tracks(self, request_id: int) -> None:
        req = self._own(request_id, Kind.SUBSCRIBE_TRACKS)
        if req.state is not RState.DONE:
            req.state = RState.DONE
            self._send_cancel(req)
        self._forget(req)

    def unsubscribe(self, request_id: int) -> None:
        """Also ends a PUBLISH of the peer's that we accepted (STOP_SENDING on its stream, its data streams
        stopped)."""
        req = self.requests.get(request_id)
        if req is None or req.local or req.kind is not Kind.PUBLISH:
            super().unsubscribe(request_id)
            return
        if self.closed:
            raise MoqtUsageError("the session is closed")
        if req.state is not RState.DONE:
            req.state = RState.DONE
            self._send_cancel(req)
        self._stop_reading(req)
        self._forget(req)

def choose_alias(session: MoqtSession, track_alias: int | None) -> int:
    """The alias of a PUBLISH we send: from the space of the aliases we give (SUBSCRIBE_OK's)."""
    if track_alias is None:
        while session._next_alias in session._aliases_out:
            session._next_alias += 1
        track_alias = session._next_alias
        session._next_alias += 1
    elif track_alias in session._aliases_out:
        raise MoqtUsageError(f"track alias {track_alias} is in use")
    return track_alias


def stop_reading(session: MoqtSession, req: Request) -> None:
    """Stop (STOP_SENDING) the data streams of the peer's PUBLISH *req* we refused or ended."""
    for sid, parser in list(session._parsers.items()):
        if parser.track_alias == req.track_alias and not parser.fetch:
            del session._parsers[sid]
            session._ignored.add(sid)
            session._stop_sending(sid, StreamResetCode.CANCELLED)


__all__ = ["PublishingSession18", "choose_alias", "stop_reading"]
