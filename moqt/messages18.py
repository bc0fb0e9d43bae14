"""Draft 18 control messages (ALPN "moqt-18").

What changed against draft 14, as far as the codec goes:

* vi64 varints everywhere; framing is still Type | Length (16) | Payload.
* SETUP (0x2F00) replaces CLIENT_SETUP / SERVER_SETUP; no version list (ALPN negotiates); its options run to the end
  of the message as delta-typed Key-Value-Pairs.
* Message Parameters are not Key-Value-Pairs: a count, then Type Delta and a value whose encoding each parameter
  defines (uint8, varint, Location, length-prefixed, namespace). An unknown parameter, or a known one in a message that
  may not carry it, is a PROTOCOL_VIOLATION. Subscriber priority, group order, forward, filter, expires and largest
  location moved from fixed fields into parameters.
* Requests travel on their own bidirectional stream: replies carry no Request ID. One REQUEST_OK (PUBLISH_OK,
  TRACK_STATUS_OK, ...: 0x1E decodes as REQUEST_OK too) and one REQUEST_ERROR (with a Retry Interval and, for
  REDIRECT, a Redirect) replace the per-request replies; cancellation is a stream reset, not a message.
* Track Properties (delta-typed Key-Value-Pairs to the end of the message) follow SUBSCRIBE_OK, PUBLISH, FETCH_OK and
  REQUEST_OK.
* SUBSCRIBE_NAMESPACE is 0x50; SUBSCRIBE_TRACKS (0x51), NAMESPACE, NAMESPACE_DONE and PUBLISH_BLOCKED are new.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar, Final, Self

from moqt.errors import RequestErrorCode18, protocol_violation
from moqt.message import Message, check_no_duplicates, read_flag
from moqt.types import (
    MAX_FULL_TRACK_NAME,
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
    decode_fetch_target,
    decode_kvps_until,
    decode_namespace,
    decode_reason,
    decode_track_name,
    encode_fetch_target,
    encode_kvps,
    encode_namespace,
)
from moqt.varint import NeedMore, Reader, Writer, varint_max


class Param18(IntEnum):
    OBJECT_DELIVERY_TIMEOUT = 0x02
    AUTHORIZATION_TOKEN = 0x03
    RENDEZVOUS_TIMEOUT = 0x04
    SUBGROUP_DELIVERY_TIMEOUT = 0x06
    EXPIRES = 0x08
    LARGEST_OBJECT = 0x09
    FILL_TIMEOUT = 0x0A
    FORWARD = 0x10
    SUBSCRIBER_PRIORITY = 0x20
    SUBSCRIPTION_FILTER = 0x21
    GROUP_ORDER = 0x22
    NEW_GROUP_REQUEST = 0x32
    TRACK_NAMESPACE_PREFIX = 0x34


P = Param18

# Which message may carry which parameter (the "MAY appear in" lists of the draft).
_AUTH = frozenset({P.AUTHORIZATION_TOKEN})
_SUBSCRIBE = frozenset({P.AUTHORIZATION_TOKEN, P.OBJECT_DELIVERY_TIMEOUT, P.SUBGROUP_DELIVERY_TIMEOUT,
                        P.RENDEZVOUS_TIMEOUT, P.SUBSCRIBER_PRIORITY, P.GROUP_ORDER, P.SUBSCRIPTION_FILTER,
                        P.FORWARD, P.NEW_GROUP_REQUEST})
_SUBSCRIBE_OK = frozenset({P.EXPIRES, P.LARGEST_OBJECT})
_PUBLISH = frozenset({P.AUTHORIZATION_TOKEN, P.EXPIRES, P.LARGEST_OBJECT, P.FORWARD})
_FETCH = frozenset({P.AUTHORIZATION_TOKEN, P.FILL_TIMEOUT, P.SUBSCRIBER_PRIORITY, P.GROUP_ORDER})
_UPDATE = frozenset({P.AUTHORIZATION_TOKEN, P.OBJECT_DELIVERY_TIMEOUT, P.SUBGROUP_DELIVERY_TIMEOUT,
                     P.SUBSCRIBER_PRIORITY, P.SUBSCRIPTION_FILTER, P.EXPIRES, P.FORWARD, P.NEW_GROUP_REQUEST,
                     P.TRACK_NAMESPACE_PREFIX})
_SUBSCRIBE_TRACKS = frozenset({P.AUTHORIZATION_TOKEN, P.FORWARD})
# REQUEST_OK stands for PUBLISH_OK, REQUEST_UPDATE_OK, TRACK_STATUS_OK, SUBSCRIBE_NAMESPACE_OK, PUBLISH_NAMESPACE_OK:
# the codec cannot tell which, so it allows the union.
_REQUEST_OK = frozenset({P.OBJECT_DELIVERY_TIMEOUT, P.SUBGROUP_DELIVERY_TIMEOUT, P.SUBSCRIBER_PRIORITY,
                         P.GROUP_ORDER, P.SUBSCRIPTION_FILTER, P.EXPIRES, P.FORWARD, P.NEW_GROUP_REQUEST,
                         P.LARGEST_OBJECT})
_NONE: Final[frozenset[int]] = frozenset()


@dataclass(frozen=True)
class Params18:
    """The Message Parameters of draft 18, typed. ``None`` = absent (the draft's default applies)."""

    object_delivery_timeout: int | None = None
    auth_tokens: tuple[bytes, ...] = ()  # each the octets of a Token structure (see types.AuthToken)
    rendezvous_timeout: int | None = None
    subgroup_delivery_timeout: int | None = None
    expires: int | None = None
    largest_object: Location | None = None
    fill_timeout: int | None = None
    forward: bool | None = None
    subscriber_priority: int | None = None
    subscription_filter: SubscriptionFilter | None = None
    group_order: GroupOrder | None = None
    new_group_request: int | None = None
    track_namespace_prefix: Namespace | None = None

    def __post_init__(self) -> None:
        if self.subscriber_priority is not None:
            check_uint8(self.subscriber_priority, "subscriber priority")
        if self.group_order is GroupOrder.PUBLISHER:
            raise ValueError("draft 18 expresses 'publisher's order' by omitting GROUP_ORDER")
        if self.track_namespace_prefix is not None:
            check_namespace(self.track_namespace_prefix, True)

    def types(self) -> list[int]:
        return [ptype for ptype, _ in self._items()]

    def _items(self) -> list[tuple[int, Callable[[Writer], None]]]:
        items: list[tuple[int, Callable[[Writer], None]]] = []

        def varint(ptype: int, value: int | None) -> None:
            if value is not None:
                items.append((ptype, lambda w: w.varint(value)))

        def uint8(ptype: int, value: int | None) -> None:
            if value is not None:
                items.append((ptype, lambda w: w.uint8(value)))

        varint(P.OBJECT_DELIVERY_TIMEOUT, self.object_delivery_timeout)
        for token in self.auth_tokens:
            items.append((P.AUTHORIZATION_TOKEN, lambda w, t=token: w.length_prefixed(t)))  # type: ignore[misc]
        varint(P.RENDEZVOUS_TIMEOUT, self.rendezvous_timeout)
        varint(P.SUBGROUP_DELIVERY_TIMEOUT, self.subgroup_delivery_timeout)
        varint(P.EXPIRES, self.expires)
        if self.largest_object is not None:
            items.append((P.LARGEST_OBJECT, self.largest_object.encode))
        varint(P.FILL_TIMEOUT, self.fill_timeout)
        uint8(P.FORWARD, None if self.forward is None else int(self.forward))
        uint8(P.SUBSCRIBER_PRIORITY, self.subscriber_priority)
        if self.subscription_filter is not None:
            flt = self.subscription_filter

            def put_filter(w: Writer) -> None:
                inner = Writer(w.vi64)
                flt.encode(inner, end_delta=True)
                w.length_prefixed(inner.buf)
            items.append((P.SUBSCRIPTION_FILTER, put_filter))
        uint8(P.GROUP_ORDER, None if self.group_order is None else int(self.group_order))
        varint(P.NEW_GROUP_REQUEST, self.new_group_request)
        if self.track_namespace_prefix is not None:
            prefix = self.track_namespace_prefix
            items.append((P.TRACK_NAMESPACE_PREFIX, lambda w: encode_namespace(w, prefix)))
        return items

    def encode(self, w: Writer) -> None:
        items = self._items()
        w.varint(len(items))
        prev = 0
        for ptype, put in items:  # built in ascending type order
            w.varint(ptype - prev)
            prev = ptype
            put(w)

    @classmethod
    def decode(cls, r: Reader, allowed: frozenset[int], what: str) -> Params18:
        count = r.varint()
        if count > r.remaining:
            raise protocol_violation(f"{what}: {count} parameters cannot fit the message")
        values: dict[str, object] = {}
        tokens: list[bytes] = []
        ptype = 0
        for _ in range(count):
            ptype += r.varint()
            if ptype > varint_max(True):
                raise protocol_violation(f"{what}: parameter type delta runs past 2^64-1")
            try:
                param = Param18(ptype)
            except ValueError:
                raise protocol_violation(f"{what}: unknown parameter 0x{ptype:x}") from None
            if param not in allowed:
                raise protocol_violation(f"{what} may not carry {param.name}")
            key = param.name.lower()
            if param is P.AUTHORIZATION_TOKEN:
                tokens.append(r.length_prefixed(0xFFFF, "authorization token"))
                continue
            if key in values:
                raise protocol_violation(f"{what}: {param.name} repeated")
            values[key] = _decode_value(param, r)
        return cls(auth_tokens=tuple(tokens), **values)  # type: ignore[arg-type]


def _decode_value(param: Param18, r: Reader) -> object:
    if param in (P.FORWARD, P.SUBSCRIBER_PRIORITY, P.GROUP_ORDER):
        value = r.uint8()
        if param is P.FORWARD:
            if value > 1:
                raise protocol_violation(f"FORWARD is {value}, not 0 or 1")
            return value == 1
        if param is P.GROUP_ORDER:
            if value not in (1, 2):
                raise protocol_violation(f"GROUP_ORDER is {value}, not 1 or 2")
            return GroupOrder(value)
        return value
    if param is P.LARGEST_OBJECT:
        return Location.decode(r)
    if param is P.SUBSCRIPTION_FILTER:
        n = r.varint()
        if n > r.remaining:
            raise protocol_violation("SUBSCRIPTION_FILTER runs past the message")
        inner = Reader(r.buf, True, r.pos, r.pos + n)
        try:
            flt = SubscriptionFilter.decode(inner, end_delta=True)
        except NeedMore:
            raise protocol_violation("SUBSCRIPTION_FILTER is shorter than its filter") from None
        if not inner.at_end():
            raise protocol_violation("octets after the subscription filter")
        r.pos += n
        return flt
    if param is P.TRACK_NAMESPACE_PREFIX:
        return decode_namespace(r)
    return r.varint()


def _properties(r: Reader) -> KeyValuePairs:
    return decode_kvps_until(r, r.end, delta=True)


def _put_properties(w: Writer, properties: KeyValuePairs) -> None:
    encode_kvps(w, properties, delta=True)


_SETUP_SINGLE: Final = frozenset({SetupParam.PATH, SetupParam.MAX_AUTH_TOKEN_CACHE_SIZE, SetupParam.AUTHORITY,
                                  SetupParam.MOQT_IMPLEMENTATION})


# -- Session ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup(Message):
    TYPE: ClassVar[int] = 0x2F00
    NAME: ClassVar[str] = "SETUP"
    options: KeyValuePairs = ()

    def __post_init__(self) -> None:
        check_kvps(self.options)

    def encode_body(self, w: Writer) -> None:
        encode_kvps(w, self.options, delta=True)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        options = decode_kvps_until(r, r.end, delta=True)
        check_no_duplicates(options, _SETUP_SINGLE, cls.NAME)
        return cls(options)


@dataclass(frozen=True)
class Goaway(Message):
    TYPE: ClassVar[int] = 0x10
    NAME: ClassVar[str] = "GOAWAY"
    new_session_uri: bytes = b""
    timeout: int = 0  # milliseconds
    request_id: int | None = None  # control stream only: the smallest peer request id not (surely) processed

    def encode_body(self, w: Writer) -> None:
        w.length_prefixed(self.new_session_uri)
        w.varint(self.timeout)
        if self.request_id is not None:
            w.varint(self.request_id)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        uri = r.length_prefixed(MAX_URI, "new session URI")
        timeout = r.varint()
        return cls(uri, timeout, None if r.at_end() else r.varint())


# -- Requests -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TrackRequest(Message):
    ALLOWED: ClassVar[frozenset[int]]
    request_id: int
    namespace: Namespace
    track_name: bytes
    params: Params18 = field(default_factory=Params18)

    def __post_init__(self) -> None:
        check_namespace(self.namespace, True, name=self.track_name)
        _check_allowed(self.params, self.ALLOWED, self.NAME)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        encode_namespace(w, self.namespace)
        w.length_prefixed(self.track_name)
        self.params.encode(w)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        rid = r.varint()
        ns = decode_namespace(r)
        name = decode_track_name(r, ns)
        return cls(rid, ns, name, Params18.decode(r, cls.ALLOWED, cls.NAME))


def _check_allowed(params: Params18, allowed: frozenset[int], what: str) -> None:
    for ptype in params.types():
        if ptype not in allowed:
            raise ValueError(f"{what} may not carry {Param18(ptype).name}")


@dataclass(frozen=True)
class Subscribe(_TrackRequest):
    TYPE: ClassVar[int] = 0x3
    NAME: ClassVar[str] = "SUBSCRIBE"
    ALLOWED: ClassVar[frozenset[int]] = _SUBSCRIBE


@dataclass(frozen=True)
class TrackStatus(_TrackRequest):
    TYPE: ClassVar[int] = 0xD
    NAME: ClassVar[str] = "TRACK_STATUS"
    ALLOWED: ClassVar[frozenset[int]] = _AUTH


@dataclass(frozen=True)
class SubscribeOk(Message):
    TYPE: ClassVar[int] = 0x4
    NAME: ClassVar[str] = "SUBSCRIBE_OK"
    track_alias: int
    params: Params18 = field(default_factory=Params18)
    properties: KeyValuePairs = ()

    def __post_init__(self) -> None:
        _check_allowed(self.params, _SUBSCRIBE_OK, self.NAME)
        check_kvps(self.properties)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.track_alias)
        self.params.encode(w)
        _put_properties(w, self.properties)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint(), Params18.decode(r, _SUBSCRIBE_OK, cls.NAME), _properties(r))


@dataclass(frozen=True)
class RequestUpdate(Message):
    TYPE: ClassVar[int] = 0x2
    NAME: ClassVar[str] = "REQUEST_UPDATE"
    request_id: int
    params: Params18 = field(default_factory=Params18)

    def __post_init__(self) -> None:
        _check_allowed(self.params, _UPDATE, self.NAME)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        self.params.encode(w)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint(), Params18.decode(r, _UPDATE, cls.NAME))


@dataclass(frozen=True)
class Publish(Message):
    TYPE: ClassVar[int] = 0x1D
    NAME: ClassVar[str] = "PUBLISH"
    request_id: int
    namespace: Namespace
    track_name: bytes
    track_alias: int
    params: Params18 = field(default_factory=Params18)
    properties: KeyValuePairs = ()

    def __post_init__(self) -> None:
        check_namespace(self.namespace, True, name=self.track_name)
        _check_allowed(self.params, _PUBLISH, self.NAME)
        check_kvps(self.properties)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        encode_namespace(w, self.namespace)
        w.length_prefixed(self.track_name)
        w.varint(self.track_alias)
        self.params.encode(w)
        _put_properties(w, self.properties)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        rid = r.varint()
        ns = decode_namespace(r)
        name = decode_track_name(r, ns)
        alias = r.varint()
        return cls(rid, ns, name, alias, Params18.decode(r, _PUBLISH, cls.NAME), _properties(r))


@dataclass(frozen=True)
class PublishDone(Message):
    TYPE: ClassVar[int] = 0xB
    NAME: ClassVar[str] = "PUBLISH_DONE"
    status_code: int
    stream_count: int
    reason: bytes = b""

    def __post_init__(self) -> None:
        check_reason(self.reason)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.status_code)
        w.varint(self.stream_count)
        w.length_prefixed(self.reason)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint(), r.varint(), decode_reason(r))


@dataclass(frozen=True)
class Fetch(Message):
    TYPE: ClassVar[int] = 0x16
    NAME: ClassVar[str] = "FETCH"
    request_id: int
    target: FetchTarget
    params: Params18 = field(default_factory=Params18)

    def __post_init__(self) -> None:
        if isinstance(self.target, StandaloneFetch):
            check_namespace(self.target.namespace, True, name=self.target.track_name)
        _check_allowed(self.params, _FETCH, self.NAME)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        encode_fetch_target(w, self.target)
        self.params.encode(w)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        rid = r.varint()
        target = decode_fetch_target(r)
        return cls(rid, target, Params18.decode(r, _FETCH, cls.NAME))


@dataclass(frozen=True)
class FetchOk(Message):
    TYPE: ClassVar[int] = 0x18
    NAME: ClassVar[str] = "FETCH_OK"
    end_location: Location
    end_of_track: bool = False
    params: Params18 = field(default_factory=Params18)
    properties: KeyValuePairs = ()

    def __post_init__(self) -> None:
        _check_allowed(self.params, _NONE, self.NAME)
        check_kvps(self.properties)

    def encode_body(self, w: Writer) -> None:
        w.uint8(int(self.end_of_track))
        self.end_location.encode(w)
        self.params.encode(w)
        _put_properties(w, self.properties)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        eot = read_flag(r, "end of track")
        end = Location.decode(r)
        return cls(end, eot, Params18.decode(r, _NONE, cls.NAME), _properties(r))


@dataclass(frozen=True)
class _NamespaceRequest(Message):
    ALLOWED: ClassVar[frozenset[int]]
    request_id: int
    namespace: Namespace
    params: Params18 = field(default_factory=Params18)

    def __post_init__(self) -> None:
        check_namespace(self.namespace, True)
        _check_allowed(self.params, self.ALLOWED, self.NAME)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.request_id)
        encode_namespace(w, self.namespace)
        self.params.encode(w)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(r.varint(), decode_namespace(r), Params18.decode(r, cls.ALLOWED, cls.NAME))


@dataclass(frozen=True)
class PublishNamespace(_NamespaceRequest):
    TYPE: ClassVar[int] = 0x6
    NAME: ClassVar[str] = "PUBLISH_NAMESPACE"
    ALLOWED: ClassVar[frozenset[int]] = _AUTH


@dataclass(frozen=True)
class SubscribeNamespace(_NamespaceRequest):
    TYPE: ClassVar[int] = 0x50
    NAME: ClassVar[str] = "SUBSCRIBE_NAMESPACE"
    ALLOWED: ClassVar[frozenset[int]] = _AUTH


@dataclass(frozen=True)
class SubscribeTracks(_NamespaceRequest):
    TYPE: ClassVar[int] = 0x51
    NAME: ClassVar[str] = "SUBSCRIBE_TRACKS"
    ALLOWED: ClassVar[frozenset[int]] = _SUBSCRIBE_TRACKS


# -- Replies and notifications on request streams ----------------------------------------------------------------


@dataclass(frozen=True)
class _Suffix(Message):
    suffix: Namespace

    def __post_init__(self) -> None:
        check_namespace(self.suffix, True)

    def encode_body(self, w: Writer) -> None:
        encode_namespace(w, self.suffix)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(decode_namespace(r))


@dataclass(frozen=True)
class NamespaceMsg(_Suffix):
    TYPE: ClassVar[int] = 0x8
    NAME: ClassVar[str] = "NAMESPACE"


@dataclass(frozen=True)
class NamespaceDone(_Suffix):
    TYPE: ClassVar[int] = 0xE
    NAME: ClassVar[str] = "NAMESPACE_DONE"


@dataclass(frozen=True)
class PublishBlocked(Message):
    TYPE: ClassVar[int] = 0xF
    NAME: ClassVar[str] = "PUBLISH_BLOCKED"
    suffix: Namespace
    track_name: bytes

    def __post_init__(self) -> None:
        check_namespace(self.suffix, True, name=self.track_name)

    def encode_body(self, w: Writer) -> None:
        encode_namespace(w, self.suffix)
        w.length_prefixed(self.track_name)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        ns = decode_namespace(r)
        return cls(ns, decode_track_name(r, ns))


@dataclass(frozen=True)
class RequestOk(Message):
    TYPE: ClassVar[int] = 0x7
    NAME: ClassVar[str] = "REQUEST_OK"
    params: Params18 = field(default_factory=Params18)
    properties: KeyValuePairs = ()

    def __post_init__(self) -> None:
        _check_allowed(self.params, _REQUEST_OK, self.NAME)
        check_kvps(self.properties)

    def encode_body(self, w: Writer) -> None:
        self.params.encode(w)
        _put_properties(w, self.properties)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        return cls(Params18.decode(r, _REQUEST_OK, cls.NAME), _properties(r))


@dataclass(frozen=True)
class Redirect:
    connect_uri: bytes = b""
    namespace: Namespace = ()
    track_name: bytes = b""


@dataclass(frozen=True)
class RequestError(Message):
    TYPE: ClassVar[int] = 0x5
    NAME: ClassVar[str] = "REQUEST_ERROR"
    error_code: int
    retry_interval: int = 0  # milliseconds plus one; 0 = do not retry
    reason: bytes = b""
    redirect: Redirect | None = None  # present exactly when error_code is REDIRECT

    def __post_init__(self) -> None:
        check_reason(self.reason)
        if (self.error_code == RequestErrorCode18.REDIRECT) != (self.redirect is not None):
            raise ValueError("a Redirect accompanies exactly the REDIRECT error code")
        if self.redirect is not None:
            check_namespace(self.redirect.namespace, True, name=self.redirect.track_name)

    def encode_body(self, w: Writer) -> None:
        w.varint(self.error_code)
        w.varint(self.retry_interval)
        w.length_prefixed(self.reason)
        if self.redirect is not None:
            w.length_prefixed(self.redirect.connect_uri)
            encode_namespace(w, self.redirect.namespace)
            w.length_prefixed(self.redirect.track_name)

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        code, retry, reason = r.varint(), r.varint(), decode_reason(r)
        redirect = None
        if code == RequestErrorCode18.REDIRECT:
            uri = r.length_prefixed(MAX_URI, "redirect URI")
            ns = decode_namespace(r)
            redirect = Redirect(uri, ns, r.length_prefixed(MAX_FULL_TRACK_NAME, "track name"))
            check_namespace(ns, True, name=redirect.track_name)
        return cls(code, retry, reason, redirect)


MESSAGES: Final[dict[int, type[Message]]] = {cls.TYPE: cls for cls in (
    Setup, Goaway, Subscribe, SubscribeOk, RequestUpdate, Publish, PublishDone, Fetch, FetchOk, TrackStatus,
    PublishNamespace, SubscribeNamespace, SubscribeTracks, NamespaceMsg, NamespaceDone, PublishBlocked,
    RequestOk, RequestError,
)}
MESSAGES[0x1E] = RequestOk  # PUBLISH_OK: the table still lists 0x1E; the message is a REQUEST_OK

# Messages that may open a request stream ("Request, First").
FIRST_ON_REQUEST_STREAM: Final = (Subscribe, Publish, Fetch, TrackStatus, PublishNamespace, SubscribeNamespace,
                                  SubscribeTracks)
