"""Events the session returns from its input handlers. Draft-neutral: where the drafts say the same thing in
different messages (draft 14 UNSUBSCRIBE vs. a draft 18 STOP_SENDING on the subscription's stream, SUBSCRIBE_ERROR
vs. REQUEST_ERROR, ...) there is one event.

``auth_tokens`` are the decoded Token structures of a request's AUTHORIZATION TOKEN parameters; ``params`` are draft
14's raw Key-Value-Pairs (unknown ones included) or draft 18's typed ``Params18``.
"""

from __future__ import annotations

from dataclasses import dataclass

from moqt.messages18 import Params18, Redirect
from moqt.types import (
    AuthToken,
    Draft,
    FetchTarget,
    GroupOrder,
    KeyValuePairs,
    Location,
    Namespace,
    ObjectStatus,
    SubscriptionFilter,
)

Params = KeyValuePairs | Params18


# -- Session --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetupCompleted:
    draft: Draft
    version: int | None  # draft 14: the negotiated version; draft 18 negotiates by ALPN
    path: bytes | None = None
    authority: bytes | None = None
    implementation: bytes | None = None
    peer_max_request_id: int | None = None  # draft 14: the peer's initial MAX_REQUEST_ID
    setup_params: KeyValuePairs = ()


@dataclass(frozen=True, slots=True)
class SessionClosed:
    """The session is over: closed by us (``local``, after a protocol error or ``close()``) or by the peer."""

    error_code: int
    reason: str
    local: bool


@dataclass(frozen=True, slots=True)
class GoawayReceived:
    new_session_uri: bytes
    timeout_ms: int = 0  # draft 18
    request_id: int | None = None  # draft 18, control stream: our smallest request id the peer may not process
    for_request: int | None = None  # draft 18: the GOAWAY came on this request's stream (migrate that request)


@dataclass(frozen=True, slots=True)
class RequestsBlockedReceived:
    """Draft 14: the peer wants to send more requests than our MAX_REQUEST_ID allows (see ``grant_requests``)."""

    maximum_request_id: int


# -- Requests the peer made (we answer them) ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PublishNamespaceRequested:
    request_id: int
    namespace: Namespace
    auth_tokens: tuple[AuthToken, ...] = ()
    params: Params = ()


@dataclass(frozen=True, slots=True)
class SubscribeNamespaceRequested:
    request_id: int
    prefix: Namespace
    auth_tokens: tuple[AuthToken, ...] = ()
    params: Params = ()


@dataclass(frozen=True, slots=True)
class SubscribeRequested:
    request_id: int
    namespace: Namespace
    track_name: bytes
    subscriber_priority: int = 128
    group_order: GroupOrder = GroupOrder.PUBLISHER  # PUBLISHER: the subscriber leaves it to us
    forward: bool = True
    filter: SubscriptionFilter | None = None  # draft 18: None = unfiltered
    auth_tokens: tuple[AuthToken, ...] = ()
    params: Params = ()


@dataclass(frozen=True, slots=True)
class FetchRequested:
    """A FETCH. For a joining fetch ``namespace`` / ``track_name`` are those of the joined subscription and
    ``target`` says how to compute the range from its largest location; for a standalone one ``target`` holds it."""

    request_id: int
    namespace: Namespace
    track_name: bytes
    target: FetchTarget
    subscriber_priority: int = 128
    group_order: GroupOrder = GroupOrder.PUBLISHER
    auth_tokens: tuple[AuthToken, ...] = ()
    params: Params = ()


@dataclass(frozen=True, slots=True)
class TrackStatusRequested:
    request_id: int
    namespace: Namespace
    track_name: bytes
    auth_tokens: tuple[AuthToken, ...] = ()
    params: Params = ()


@dataclass(frozen=True, slots=True)
class PublishRequested:
    """Draft 18 PUBLISH: the peer starts a subscription to a track it publishes (section "PUBLISH"). Accept with
    ``accept_publish`` (PUBLISH_OK) or refuse with ``reject`` (UNINTERESTED, UNAUTHORIZED, ...); its objects arrive
    as ``ObjectReceived`` with this request id (possibly before PUBLISH_OK: the alias is bound on receipt)."""

    request_id: int
    namespace: Namespace
    track_name: bytes
    track_alias: int
    forward: bool = True  # FORWARD omitted or 1: objects come without waiting for PUBLISH_OK
    largest: Location | None = None
    expires: int = 0
    group_order: GroupOrder | None = None  # the DEFAULT_PUBLISHER_GROUP_ORDER track property, if sent
    auth_tokens: tuple[AuthToken, ...] = ()
    params: Params = ()
    properties: KeyValuePairs = ()


@dataclass(frozen=True, slots=True)
class SubscribeTracksRequested:
    """Draft 18 SUBSCRIBE_TRACKS: the peer asks for a PUBLISH for every track (now and later) under ``prefix``.
    Accept with ``accept_subscribe_tracks``, then ``publish`` each matching track (``forward`` as asked)."""

    request_id: int
    prefix: Namespace
    forward: bool = True
    auth_tokens: tuple[AuthToken, ...] = ()
    params: Params = ()


@dataclass(frozen=True, slots=True)
class SubscribeTracksEnded:
    """The peer withdrew a SUBSCRIBE_TRACKS we accepted (FIN or reset of its stream)."""

    request_id: int
    prefix: Namespace


@dataclass(frozen=True, slots=True)
class UpdateRequested:
    """SUBSCRIBE_UPDATE (draft 14: no reply) or REQUEST_UPDATE (draft 18: answer with ``accept_update`` or
    ``reject``) of request ``target_request_id``. ``None`` fields are unchanged. Draft 14's start / end group arrive
    as an absolute filter."""

    request_id: int
    target_request_id: int
    filter: SubscriptionFilter | None = None
    subscriber_priority: int | None = None
    forward: bool | None = None
    reply_required: bool = False
    params: Params = ()


@dataclass(frozen=True, slots=True)
class Unsubscribed:
    """The subscriber ended a subscription we serve (UNSUBSCRIBE, or a cancelled request stream)."""

    request_id: int


@dataclass(frozen=True, slots=True)
class FetchCancelled:
    request_id: int


@dataclass(frozen=True, slots=True)
class PublishNamespaceDone:
    """The peer withdrew a namespace it published to us."""

    request_id: int
    namespace: Namespace


@dataclass(frozen=True, slots=True)
class PublishNamespaceCancelled:
    """The peer revoked its acceptance of a namespace we published."""

    request_id: int
    namespace: Namespace
    error_code: int = 0
    reason: bytes = b""


@dataclass(frozen=True, slots=True)
class SubscribeNamespaceEnded:
    """The peer withdrew a SUBSCRIBE_NAMESPACE we accepted."""

    request_id: int
    prefix: Namespace


# -- Replies to our requests ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PublishNamespaceAccepted:
    request_id: int


@dataclass(frozen=True, slots=True)
class SubscribeNamespaceAccepted:
    request_id: int


@dataclass(frozen=True, slots=True)
class PublishAccepted:
    """Draft 18 PUBLISH_OK (a REQUEST_OK on our PUBLISH's stream): the subscription is established. ``forward``
    False: send no objects until an update sets it (``UpdateRequested``)."""

    request_id: int
    forward: bool = True
    filter: SubscriptionFilter | None = None
    subscriber_priority: int | None = None
    group_order: GroupOrder | None = None
    params: Params = ()


@dataclass(frozen=True, slots=True)
class SubscribeTracksAccepted:
    request_id: int


@dataclass(frozen=True, slots=True)
class PublishBlocked:
    """Draft 18 PUBLISH_BLOCKED on one of our SUBSCRIBE_TRACKS streams: no PUBLISH will come for this track
    (``namespace`` is the full one: prefix + suffix); SUBSCRIBE to it instead."""

    request_id: int
    namespace: Namespace
    track_name: bytes


@dataclass(frozen=True, slots=True)
class SubscribeAccepted:
    request_id: int
    track_alias: int
    expires: int = 0
    group_order: GroupOrder | None = None  # draft 18 carries it as a track property, if at all
    largest: Location | None = None
    params: Params = ()
    properties: KeyValuePairs = ()


@dataclass(frozen=True, slots=True)
class FetchAccepted:
    request_id: int
    end_location: Location
    end_of_track: bool = False
    group_order: GroupOrder | None = None
    params: Params = ()
    properties: KeyValuePairs = ()


@dataclass(frozen=True, slots=True)
class TrackStatusReceived:
    request_id: int
    largest: Location | None = None
    expires: int = 0
    group_order: GroupOrder | None = None
    params: Params = ()
    properties: KeyValuePairs = ()


@dataclass(frozen=True, slots=True)
class UpdateAccepted:
    """Draft 18: REQUEST_OK for one of our REQUEST_UPDATEs."""

    request_id: int
    params: Params = ()


@dataclass(frozen=True, slots=True)
class RequestRejected:
    """Any of our requests failed (SUBSCRIBE_ERROR, FETCH_ERROR, ..., REQUEST_ERROR); codes are the draft's."""

    request_id: int
    error_code: int
    reason: bytes = b""
    retry_interval: int = 0
    redirect: Redirect | None = None


@dataclass(frozen=True, slots=True)
class RequestCancelled:
    """Draft 18: the peer reset or stopped a request stream where no more specific event applies (a fetch or
    subscription we made, a track status, ...)."""

    request_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class PublishDone:
    request_id: int
    status_code: int
    stream_count: int
    reason: bytes = b""


@dataclass(frozen=True, slots=True)
class NamespaceReceived:
    """Draft 18: NAMESPACE (``active``) or NAMESPACE_DONE on one of our SUBSCRIBE_NAMESPACE streams; ``namespace``
    is the full namespace (prefix + suffix)."""

    request_id: int
    namespace: Namespace
    active: bool = True


# -- Data -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DataStreamOpened:
    """A subgroup stream's or a fetch stream's header arrived. ``request_id`` is the fetch's, or the subscription's
    when the track alias is known; ``priority`` None = the subscription's default (draft 18)."""

    stream_id: int
    fetch: bool
    request_id: int | None
    track_alias: int | None = None
    group: int | None = None
    subgroup: int | None = None
    priority: int | None = None
    end_of_group: bool = False


@dataclass(frozen=True, slots=True)
class ObjectReceived:
    """A piece of an object's payload, as it arrives: ``data`` holds octets ``offset`` to ``offset + len(data)``
    of a payload of ``length`` octets (a view of the received buffer: copy it before the buffer is reused). An
    object arrives as one or more events; the last has ``complete``. Objects with a status other than NORMAL, and
    empty ones, arrive as one event with no data. ``stream_id`` is None for a datagram."""

    stream_id: int | None
    request_id: int | None
    track_alias: int | None
    group: int
    subgroup: int | None
    object_id: int
    priority: int | None
    status: ObjectStatus
    extensions: KeyValuePairs
    length: int
    offset: int
    data: memoryview | bytes
    end_of_group: bool = False  # datagrams: the END_OF_GROUP type bit

    @property
    def complete(self) -> bool:
        return self.offset + len(self.data) == self.length


@dataclass(frozen=True, slots=True)
class FetchRangeEnded:
    """Draft 18: the objects after the previous one up to ``location`` do not exist (or, ``unknown``, have an
    unknown status)."""

    stream_id: int
    request_id: int
    location: Location
    unknown: bool


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """A data stream ended with FIN after a whole number of objects."""

    stream_id: int
    request_id: int | None
    track_alias: int | None = None


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The peer reset a data stream."""

    stream_id: int
    request_id: int | None
    error_code: int
    track_alias: int | None = None


@dataclass(frozen=True, slots=True)
class StreamStopped:
    """The peer sent STOP_SENDING on one of our data streams (a group it no longer wants, a cancelled fetch):
    ``reset()`` its writer (further writes raise MoqtUsageError)."""

    stream_id: int
    request_id: int
    error_code: int


Event = (SetupCompleted | SessionClosed | GoawayReceived | RequestsBlockedReceived | PublishNamespaceRequested
         | SubscribeNamespaceRequested | SubscribeRequested | FetchRequested | TrackStatusRequested
         | UpdateRequested | Unsubscribed | FetchCancelled | PublishNamespaceDone
         | PublishNamespaceCancelled | SubscribeNamespaceEnded | PublishNamespaceAccepted | SubscribeNamespaceAccepted
         | SubscribeAccepted | FetchAccepted | TrackStatusReceived | UpdateAccepted | RequestRejected
         | RequestCancelled | PublishDone
         | NamespaceReceived | DataStreamOpened | ObjectReceived | FetchRangeEnded | StreamEnded | StreamReset
         | StreamStopped | PublishRequested | SubscribeTracksRequested | SubscribeTracksEnded | PublishAccepted
         | SubscribeTracksAccepted | PublishBlocked)
