"""Draft 14 control messages (ALPN "moq-00"): one bidirectional control stream, every message framed as
Type (varint) | Length (16) | Payload, QUIC varints, Key-Value-Pair parameters with absolute types.

Every request (SUBSCRIBE, SUBSCRIBE_UPDATE, PUBLISH, FETCH, TRACK_STATUS, PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE)
carries a Request ID and every reply echoes it; errors have one message type per request kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, Final, Self

from moqt.errors import protocol_violation
from moqt.message import Message, check_no_duplicates, read_flag, read_group_order
from moqt.types import (
    LARGEST_OBJECT_FILTER,
    MAX_URI,
    FetchTarget,
    GroupOrder,
    KeyValuePairs,
    Location,
    Namespace,
    SetupParam,
    StandaloneFetch,
    SubscriptionFilter,
    check_kvps,
    check_namespace,
    check_reason,
    check_uint8,
    decode_counted_kvps,
    decode_fetch_target,
    decode_namespace,
    decode_reason,
    decode_track_name,
    encode_counted_kvps,
    encode_fetch_target,
    encode_namespace,
)
from moqt.varint import Reader, Writer


class Param14(IntEnum):
    """Version-specific (message) parameters of draft 14; unknown ones are ignored."""

    DELIVERY_TIMEOUT = 0x02
    AUTHORIZATION_TOKEN = 0x03
    MAX_CACHE_DURATION = 0x04


_SINGLE: Final = frozenset({Param14.DELIVERY_TIMEOUT, Param14.MAX_CACHE_DURATION})
_SETUP_SINGLE: Final = frozenset({SetupParam.PATH, SetupParam.MAX_REQUEST_ID, SetupParam.MAX_AUTH_TOKEN_CACHE_SIZE,
                                  SetupParam.AUTHORITY, SetupParam.MOQT_IMPLEMENTATION})


def _params(r: Reader, what: str, single: frozenset[int] = _SINGLE) -> KeyValuePairs:
    params = decode_counted_kvps(r, delta=False)
    check_no_duplicates(params, single, what)
    return params


def _put_params(w: Writer, params: KeyValuePairs) -> None:
    encode_counted_kvps(w, params, delta=False)


# -- Session -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSetup(Message):
    TYPE: ClassVar[int] = 0x20
    NAME: ClassVar[str] = "CLIENT_SETUP"
    versions: tuple[int, ...]
    params: KeyValuePairs = ()

    def __post_init__(self) -> None:
        check_kvps(self.params)

    def encode_body(self, w: Writer) -> None:
        w.varint(len(self.versions))
        for v in self.versions:
            w.varint(v)
        _put_params(w, self.params)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        count = r.varint()
        if count > r.remaining:
            raise protocol_violation(f"{count} versions cannot fit CLIENT_SETUP")
        versions = tuple(r.varint() for _ in range(count))
        return cls(versions, _params(r, cls.NAME, _SETUP_SINGLE))


@dataclass(frozen=True)
class ServerSetup(Message):
    TYPE: ClassVar[int] = 0x21
    NAME: ClassVar[str] = "SERVER_SETUP"
    version: int
    params: KeyValuePairs = ()

    def __post_init__(self) -> None:
        check_kvps(self.params)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.version)
        _put_params(w, self.params)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint(), _params(r, cls.NAME, _SETUP_SINGLE))


@dataclass(frozen=True)
class Goaway(Message):
    TYPE: ClassVar[int] = 0x10
    NAME: ClassVar[str] = "GOAWAY"
    new_session_uri: bytes = b""

    def encode_body(self, w: Writer) -> None:
        w.length_prefixed(self.new_session_uri)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.length_prefixed(MAX_URI, "new session URI"))


@dataclass(frozen=True)
class MaxRequestId(Message):
    TYPE: ClassVar[int] = 0x15
    NAME: ClassVar[str] = "MAX_REQUEST_ID"
    request_id: int  # the new maximum plus one: ids below it may be used

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint())


@dataclass(frozen=True)
class RequestsBlocked(Message):
    TYPE: ClassVar[int] = 0x1A
    NAME: ClassVar[str] = "REQUESTS_BLOCKED"
    maximum_request_id: int

    def encode_body(self, w: Writer) -> None:
        w.varint(self.maximum_request_id)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint())


# -- Shapes shared by several messages -------------------------------------------------------------------------


@dataclass(frozen=True)
class _RequestIdOnly(Message):
    request_id: int

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint())


@dataclass(frozen=True)
class ErrorReply(Message):
    request_id: int
    error_code: int
    reason: bytes = b""

    def __post_init__(self) -> None:
        check_reason(self.reason)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        w.varint(self.error_code)
        w.length_prefixed(self.reason)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint(), r.varint(), decode_reason(r))


@dataclass(frozen=True)
class _SubscribeShape(Message):
    request_id: int
    namespace: Namespace
    track_name: bytes
    subscriber_priority: int = 128
    group_order: GroupOrder = GroupOrder.PUBLISHER
    forward: bool = True
    filter: SubscriptionFilter = LARGEST_OBJECT_FILTER
    params: KeyValuePairs = ()

    def __post_init__(self) -> None:
        check_namespace(self.namespace, False, name=self.track_name)
        check_uint8(self.subscriber_priority, "subscriber priority")
        check_kvps(self.params)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        encode_namespace(w, self.namespace)
        w.length_prefixed(self.track_name)
        w.uint8(self.subscriber_priority)
        w.uint8(self.group_order)
        w.uint8(int(self.forward))
        self.filter.encode(w, end_delta=False)
        _put_params(w, self.params)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        rid = r.varint()
        ns = decode_namespace(r)
        name = decode_track_name(r, ns)
        priority = r.uint8()
        order = read_group_order(r, allow_publisher=True)
        forward = read_flag(r, "forward")
        flt = SubscriptionFilter.decode(r, end_delta=False)
        return cls(rid, ns, name, priority, order, forward, flt, _params(r, cls.NAME))


@dataclass(frozen=True)
class _SubscribeOkShape(Message):
    request_id: int
    track_alias: int
    expires: int = 0
    group_order: GroupOrder = GroupOrder.ASCENDING
    largest: Location | None = None  # Content Exists = 1 and the Largest Location, or 0
    params: KeyValuePairs = ()

    def __post_init__(self) -> None:
        if self.group_order is GroupOrder.PUBLISHER:
            raise ValueError(f"{self.NAME} carries the group order actually used")
        check_kvps(self.params)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        w.varint(self.track_alias)
        w.varint(self.expires)
        w.uint8(self.group_order)
        w.uint8(int(self.largest is not None))
        if self.largest is not None:
            self.largest.encode(w)
        _put_params(w, self.params)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        rid, alias, expires = r.varint(), r.varint(), r.varint()
        order = read_group_order(r, allow_publisher=False)
        largest = Location.decode(r) if read_flag(r, "content exists") else None
        return cls(rid, alias, expires, order, largest, _params(r, cls.NAME))


# -- Subscriptions ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Subscribe(_SubscribeShape):
    TYPE: ClassVar[int] = 0x3
    NAME: ClassVar[str] = "SUBSCRIBE"


@dataclass(frozen=True)
class SubscribeOk(_SubscribeOkShape):
    TYPE: ClassVar[int] = 0x4
    NAME: ClassVar[str] = "SUBSCRIBE_OK"


@dataclass(frozen=True)
class SubscribeError(ErrorReply):
    TYPE: ClassVar[int] = 0x5
    NAME: ClassVar[str] = "SUBSCRIBE_ERROR"


@dataclass(frozen=True)
class SubscribeUpdate(Message):
    TYPE: ClassVar[int] = 0x2
    NAME: ClassVar[str] = "SUBSCRIBE_UPDATE"
    request_id: int
    subscription_request_id: int
    start: Location
    end_group: int  # the end group plus one; 0 = open-ended
    subscriber_priority: int = 128
    forward: bool = True
    params: KeyValuePairs = ()

    def __post_init__(self) -> None:
        check_uint8(self.subscriber_priority, "subscriber priority")
        check_kvps(self.params)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        w.varint(self.subscription_request_id)
        self.start.encode(w)
        w.varint(self.end_group)
        w.uint8(self.subscriber_priority)
        w.uint8(int(self.forward))
        _put_params(w, self.params)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        rid, sid = r.varint(), r.varint()
        start, end = Location.decode(r), r.varint()
        priority = r.uint8()
        forward = read_flag(r, "forward")
        return cls(rid, sid, start, end, priority, forward, _params(r, cls.NAME))


@dataclass(frozen=True)
class Unsubscribe(_RequestIdOnly):
    TYPE: ClassVar[int] = 0xA
    NAME: ClassVar[str] = "UNSUBSCRIBE"


@dataclass(frozen=True)
class PublishDone(Message):
    TYPE: ClassVar[int] = 0xB
    NAME: ClassVar[str] = "PUBLISH_DONE"
    request_id: int
    status_code: int
    stream_count: int
    reason: bytes = b""

    def __post_init__(self) -> None:
        check_reason(self.reason)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        w.varint(self.status_code)
        w.varint(self.stream_count)
        w.length_prefixed(self.reason)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint(), r.varint(), r.varint(), decode_reason(r))


@dataclass(frozen=True)
class Publish(Message):
    TYPE: ClassVar[int] = 0x1D
    NAME: ClassVar[str] = "PUBLISH"
    request_id: int
    namespace: Namespace
    track_name: bytes
    track_alias: int
    group_order: GroupOrder = GroupOrder.ASCENDING
    largest: Location | None = None
    forward: bool = True
    params: KeyValuePairs = ()

    def __post_init__(self) -> None:
        check_namespace(self.namespace, False, name=self.track_name)
        if self.group_order is GroupOrder.PUBLISHER:
            raise ValueError("PUBLISH carries the group order actually used")
        check_kvps(self.params)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        encode_namespace(w, self.namespace)
        w.length_prefixed(self.track_name)
        w.varint(self.track_alias)
        w.uint8(self.group_order)
        w.uint8(int(self.largest is not None))
        if self.largest is not None:
            self.largest.encode(w)
        w.uint8(int(self.forward))
        _put_params(w, self.params)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        rid = r.varint()
        ns = decode_namespace(r)
        name = decode_track_name(r, ns)
        alias = r.varint()
        order = read_group_order(r, allow_publisher=False)
        largest = Location.decode(r) if read_flag(r, "content exists") else None
        forward = read_flag(r, "forward")
        return cls(rid, ns, name, alias, order, largest, forward, _params(r, cls.NAME))


@dataclass(frozen=True)
class PublishOk(Message):
    TYPE: ClassVar[int] = 0x1E
    NAME: ClassVar[str] = "PUBLISH_OK"
    request_id: int
    forward: bool
    subscriber_priority: int
    group_order: GroupOrder
    filter: SubscriptionFilter
    params: KeyValuePairs = ()

    def __post_init__(self) -> None:
        check_uint8(self.subscriber_priority, "subscriber priority")
        if self.group_order is GroupOrder.PUBLISHER:
            raise ValueError("PUBLISH_OK carries an ascending or descending group order")
        check_kvps(self.params)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        w.uint8(int(self.forward))
        w.uint8(self.subscriber_priority)
        w.uint8(self.group_order)
        self.filter.encode(w, end_delta=False)
        _put_params(w, self.params)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        rid = r.varint()
        forward = read_flag(r, "forward")
        priority = r.uint8()
        order = read_group_order(r, allow_publisher=False)
        flt = SubscriptionFilter.decode(r, end_delta=False)
        return cls(rid, forward, priority, order, flt, _params(r, cls.NAME))


@dataclass(frozen=True)
class PublishError(ErrorReply):
    TYPE: ClassVar[int] = 0x1F
    NAME: ClassVar[str] = "PUBLISH_ERROR"


# -- Fetch -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fetch(Message):
    TYPE: ClassVar[int] = 0x16
    NAME: ClassVar[str] = "FETCH"
    request_id: int
    target: FetchTarget
    subscriber_priority: int = 128
    group_order: GroupOrder = GroupOrder.PUBLISHER
    params: KeyValuePairs = ()

    def __post_init__(self) -> None:
        check_uint8(self.subscriber_priority, "subscriber priority")
        check_kvps(self.params)
        if isinstance(self.target, StandaloneFetch):
            check_namespace(self.target.namespace, False, name=self.target.track_name)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        w.uint8(self.subscriber_priority)
        w.uint8(self.group_order)
        encode_fetch_target(w, self.target)
        _put_params(w, self.params)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        rid = r.varint()
        priority = r.uint8()
        order = read_group_order(r, allow_publisher=True)
        target = decode_fetch_target(r)
        return cls(rid, target, priority, order, _params(r, cls.NAME))


@dataclass(frozen=True)
class FetchOk(Message):
    TYPE: ClassVar[int] = 0x18
    NAME: ClassVar[str] = "FETCH_OK"
    request_id: int
    end_location: Location
    end_of_track: bool = False
    group_order: GroupOrder = GroupOrder.ASCENDING
    params: KeyValuePairs = ()

    def __post_init__(self) -> None:
        if self.group_order is GroupOrder.PUBLISHER:
            raise ValueError("FETCH_OK carries an ascending or descending group order")
        check_kvps(self.params)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        w.uint8(self.group_order)
        w.uint8(int(self.end_of_track))
        self.end_location.encode(w)
        _put_params(w, self.params)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        rid = r.varint()
        order = read_group_order(r, allow_publisher=False)
        eot = read_flag(r, "end of track")
        end = Location.decode(r)
        return cls(rid, end, eot, order, _params(r, cls.NAME))


@dataclass(frozen=True)
class FetchError(ErrorReply):
    TYPE: ClassVar[int] = 0x19
    NAME: ClassVar[str] = "FETCH_ERROR"


@dataclass(frozen=True)
class FetchCancel(_RequestIdOnly):
    TYPE: ClassVar[int] = 0x17
    NAME: ClassVar[str] = "FETCH_CANCEL"


# -- Track status ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrackStatus(_SubscribeShape):
    TYPE: ClassVar[int] = 0xD
    NAME: ClassVar[str] = "TRACK_STATUS"


@dataclass(frozen=True)
class TrackStatusOk(_SubscribeOkShape):
    TYPE: ClassVar[int] = 0xE
    NAME: ClassVar[str] = "TRACK_STATUS_OK"


@dataclass(frozen=True)
class TrackStatusError(ErrorReply):
    TYPE: ClassVar[int] = 0xF
    NAME: ClassVar[str] = "TRACK_STATUS_ERROR"


# -- Namespaces ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _NamespaceRequest(Message):
    EMPTY_OK: ClassVar[bool] = False  # a namespace (prefix) of 0 fields accepted (see SubscribeNamespace)
    request_id: int
    namespace: Namespace
    params: KeyValuePairs = ()

    def __post_init__(self) -> None:
        check_namespace(self.namespace, False, empty=self.EMPTY_OK)
        check_kvps(self.params)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        encode_namespace(w, self.namespace)
        _put_params(w, self.params)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint(), decode_namespace(r, allow_empty=cls.EMPTY_OK), _params(r, cls.NAME))


@dataclass(frozen=True)
class _NamespaceOnly(Message):
    EMPTY_OK: ClassVar[bool] = False
    namespace: Namespace

    def __post_init__(self) -> None:
        check_namespace(self.namespace, False, empty=self.EMPTY_OK)

    def encode_body(self, w: Writer) -> None:
        encode_namespace(w, self.namespace)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(decode_namespace(r, allow_empty=cls.EMPTY_OK))


@dataclass(frozen=True)
class PublishNamespace(_NamespaceRequest):
    TYPE: ClassVar[int] = 0x6
    NAME: ClassVar[str] = "PUBLISH_NAMESPACE"


@dataclass(frozen=True)
class PublishNamespaceOk(_RequestIdOnly):
    TYPE: ClassVar[int] = 0x7
    NAME: ClassVar[str] = "PUBLISH_NAMESPACE_OK"


@dataclass(frozen=True)
class PublishNamespaceError(ErrorReply):
    TYPE: ClassVar[int] = 0x8
    NAME: ClassVar[str] = "PUBLISH_NAMESPACE_ERROR"


@dataclass(frozen=True)
class PublishNamespaceDone(_NamespaceOnly):
    TYPE: ClassVar[int] = 0x9
    NAME: ClassVar[str] = "PUBLISH_NAMESPACE_DONE"


@dataclass(frozen=True)
class PublishNamespaceCancel(Message):
    TYPE: ClassVar[int] = 0xC
    NAME: ClassVar[str] = "PUBLISH_NAMESPACE_CANCEL"
    namespace: Namespace
    error_code: int
    reason: bytes = b""

    def __post_init__(self) -> None:
        check_namespace(self.namespace, False)
        check_reason(self.reason)

    def encode_body(self, w: Writer) -> None:
        encode_namespace(w, self.namespace)
        w.varint(self.error_code)
        w.length_prefixed(self.reason)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(decode_namespace(r), r.varint(), decode_reason(r))


@dataclass(frozen=True)
class SubscribeNamespace(_NamespaceRequest):
    """Draft 14, section "SUBSCRIBE_NAMESPACE": "If an endpoint receives a Track Namespace Prefix tuple with an
    N of 0 or more than 32, it MUST close the session with a Protocol Violation." *Decision* (docs/moqt.md): a
    prefix of 0 fields is accepted and means every namespace, as from draft 16 on; peers that speak several drafts
    (moq-rs) send it on draft 14 too, right after setup. The relay's rules decide what such a subscriber hears
    (the draft's "SUBSCRIBE_NAMESPACE with short prefixes" consideration). More than 32 fields is still a
    PROTOCOL_VIOLATION."""

    TYPE: ClassVar[int] = 0x11
    NAME: ClassVar[str] = "SUBSCRIBE_NAMESPACE"
    EMPTY_OK: ClassVar[bool] = True


@dataclass(frozen=True)
class SubscribeNamespaceOk(_RequestIdOnly):
    TYPE: ClassVar[int] = 0x12
    NAME: ClassVar[str] = "SUBSCRIBE_NAMESPACE_OK"


@dataclass(frozen=True)
class SubscribeNamespaceError(ErrorReply):
    TYPE: ClassVar[int] = 0x13
    NAME: ClassVar[str] = "SUBSCRIBE_NAMESPACE_ERROR"


@dataclass(frozen=True)
class UnsubscribeNamespace(_NamespaceOnly):
    TYPE: ClassVar[int] = 0x14
    NAME: ClassVar[str] = "UNSUBSCRIBE_NAMESPACE"
    EMPTY_OK: ClassVar[bool] = True  # withdraws an empty-prefix SUBSCRIBE_NAMESPACE


MESSAGES: Final[dict[int, type[Message]]] = {cls.TYPE: cls for cls in (
    ClientSetup, ServerSetup, Goaway, MaxRequestId, RequestsBlocked,
    Subscribe, SubscribeOk, SubscribeError, SubscribeUpdate, Unsubscribe, PublishDone,
    Publish, PublishOk, PublishError, Fetch, FetchOk, FetchError, FetchCancel,
    TrackStatus, TrackStatusOk, TrackStatusError,
    PublishNamespace, PublishNamespaceOk, PublishNamespaceError, PublishNamespaceDone, PublishNamespaceCancel,
    SubscribeNamespace, SubscribeNamespaceOk, SubscribeNamespaceError, UnsubscribeNamespace,
)}

# Messages that open a request and consume a Request ID (checked against the advertised maximum).
REQUESTS: Final = (Subscribe, SubscribeUpdate, Publish, Fetch, TrackStatus, PublishNamespace, SubscribeNamespace)
