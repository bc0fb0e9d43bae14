"""Structures shared by the control and data planes of both drafts.

Draft differences handled here:

* Track Namespace: draft 14 allows 1-32 fields (fields may be empty); draft 18 allows 0-32 fields, each at least one
  octet, and bounds the namespace alone by 4096 octets. Both bound namespace + track name by 4096 octets.
* Key-Value-Pairs: even types carry a varint, odd types a length and octets (at most 2^16-1). Draft 14 writes each
  type as is; draft 18 writes each type as a delta from the previous one (so a list is written sorted by type).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Final, NewType

from moqt.errors import MoqtError, SessionErrorCode, protocol_violation
from moqt.varint import NeedMore, Reader, Writer, varint_max

Namespace = tuple[bytes, ...]
TrackAlias = NewType("TrackAlias", int)
KeyValuePair = tuple[int, int | bytes]  # (type, varint) for even types, (type, octets) for odd ones
KeyValuePairs = tuple[KeyValuePair, ...]

MAX_NAMESPACE_FIELDS: Final = 32
MAX_FULL_TRACK_NAME: Final = 4096
MAX_REASON: Final = 1024
MAX_KVP_VALUE: Final = 0xFFFF
MAX_URI: Final = 8192
DEFAULT_PRIORITY: Final = 128


class Draft(Enum):
    """A negotiated draft: its ALPN and (draft 14 only) the version number carried in SETUP."""

    D14 = 14
    D18 = 18

    @property
    def alpn(self) -> str:
        return "moq-00" if self is Draft.D14 else "moqt-18"

    @property
    def version(self) -> int:
        """The IETF draft version number (0xff000000 + draft)."""
        return 0xFF000000 + self.value

    @property
    def vi64(self) -> bool:
        return self is Draft.D18

    @classmethod
    def from_alpn(cls, alpn: str) -> Draft:
        for draft in cls:
            if draft.alpn == alpn:
                return draft
        raise ValueError(f"ALPN {alpn!r} is not a MOQT draft this implementation speaks (moq-00, moqt-18)")


PREFERRED_ALPNS: Final = tuple(d.alpn for d in sorted(Draft, key=lambda d: d.value, reverse=True))
"""The default order of preference, newest draft first (``moqt-18``, ``moq-00``), for every server (its ALPN list:
the TLS server picks the first of its own that the client offers) and every client (the order it offers). Draft 18,
section "Session establishment": "MOQT uses ALPN in QUIC ... to perform version negotiation", and "the client offers
any combination of MOQT ALPNs ... in its TLS ClientHello, in preference order". Override it with
``moqt_handlers(alpns=)``, ``connect_moqt(alpn=)`` or ``MoqtPool(alpn=)`` (docs/moqt.md, "Version negotiation")."""

ALPNS: Final = PREFERRED_ALPNS
"""Every MOQT ALPN this implementation speaks, in :data:`PREFERRED_ALPNS` order."""


def alpn_order(alpns: Sequence[str]) -> tuple[str, ...]:
    """A validated ALPN preference list (MOQT ALPNs only, each once, at least one), as given."""
    order = tuple(alpns)
    if not order:
        raise ValueError("offer at least one MOQT ALPN")
    if len(set(order)) != len(order):
        raise ValueError(f"MOQT ALPN listed twice: {', '.join(order)}")
    for alpn in order:
        Draft.from_alpn(alpn)
    return order


class GroupOrder(IntEnum):
    PUBLISHER = 0x0  # draft 14 requests only: "use the publisher's order"
    ASCENDING = 0x1
    DESCENDING = 0x2


class FilterType(IntEnum):
    NEXT_GROUP_START = 0x1
    LARGEST_OBJECT = 0x2
    ABSOLUTE_START = 0x3
    ABSOLUTE_RANGE = 0x4


class FetchType(IntEnum):
    STANDALONE = 0x1
    RELATIVE_JOINING = 0x2
    ABSOLUTE_JOINING = 0x3


class ObjectStatus(IntEnum):
    NORMAL = 0x0
    DOES_NOT_EXIST = 0x1  # draft 14 only
    END_OF_GROUP = 0x3
    END_OF_TRACK = 0x4


OBJECT_STATUSES: Final = {
    Draft.D14: frozenset({0x0, 0x1, 0x3, 0x4}),
    Draft.D18: frozenset({0x0, 0x3, 0x4}),
}


@dataclass(frozen=True, order=True)
class Location:
    """(group, object); ordered as the drafts order locations."""

    group: int
    object: int

    def __post_init__(self) -> None:
        if self.group < 0 or self.object < 0:
            raise ValueError("location fields are unsigned")

    def encode(self, w: Writer) -> None:
        w.varint(self.group)
        w.varint(self.object)

    @classmethod
    def decode(cls, r: Reader) -> Location:
        return cls(r.varint(), r.varint())


@dataclass(frozen=True)
class SubscriptionFilter:
    """Filter type with its Start Location (absolute types) and End Group (AbsoluteRange: an absolute group id;
    draft 18 carries it on the wire as a delta from the start group)."""

    type: FilterType
    start: Location | None = None
    end_group: int | None = None

    def __post_init__(self) -> None:
        has_start = self.type in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE)
        if has_start != (self.start is not None):
            raise ValueError(f"filter {self.type.name} {'needs' if has_start else 'has no'} start location")
        if (self.type is FilterType.ABSOLUTE_RANGE) != (self.end_group is not None):
            raise ValueError("only an AbsoluteRange filter has an end group")
        if self.start is not None and self.end_group is not None and self.end_group < self.start.group:
            raise ValueError("the end group precedes the start group")

    def encode(self, w: Writer, *, end_delta: bool) -> None:
        w.varint(self.type)
        if self.start is not None:
            self.start.encode(w)
        if self.end_group is not None:
            assert self.start is not None
            w.varint(self.end_group - self.start.group if end_delta else self.end_group)

    @classmethod
    def decode(cls, r: Reader, *, end_delta: bool) -> SubscriptionFilter:
        code = r.varint()
        try:
            ftype = FilterType(code)
        except ValueError:
            raise protocol_violation(f"unknown filter type {code}") from None
        start = Location.decode(r) if ftype in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE) else None
        end = None
        if ftype is FilterType.ABSOLUTE_RANGE:
            assert start is not None
            end = r.varint()
            if end_delta:
                end += start.group
                if end > varint_max(r.vi64):
                    raise protocol_violation("start group + end group delta exceeds 2^64-1")
            elif end < start.group:
                raise protocol_violation("AbsoluteRange end group precedes the start group")
        return cls(ftype, start, end)


LARGEST_OBJECT_FILTER: Final = SubscriptionFilter(FilterType.LARGEST_OBJECT)


# -- Namespaces and names ---------------------------------------------------------------------------------------


def check_namespace(ns: Namespace, vi64: bool, *, name: bytes = b"", empty: bool | None = None) -> None:
    """Validate a namespace (and its track name) as the draft requires; raises PROTOCOL_VIOLATION. Draft 14
    (section 2.4.1): "N can be between 1 and 32"; draft 18: 0-32 fields of at least one octet. *empty* overrides
    whether a tuple of 0 fields is allowed (draft 14's SUBSCRIBE_NAMESPACE prefix, see messages14.py)."""
    allow_empty = vi64 if empty is None else empty
    if len(ns) > MAX_NAMESPACE_FIELDS or (not allow_empty and not ns):
        low = 0 if allow_empty else 1
        raise protocol_violation(f"a track namespace has {low}-{MAX_NAMESPACE_FIELDS} fields, not {len(ns)}")
    total = sum(len(f) for f in ns)
    if vi64 and any(not f for f in ns):
        raise protocol_violation("draft 18 namespace fields are at least one octet")
    if total + len(name) > MAX_FULL_TRACK_NAME:
        raise protocol_violation(f"full track name of {total + len(name)} octets exceeds {MAX_FULL_TRACK_NAME}")


def encode_namespace(w: Writer, ns: Namespace) -> None:
    w.varint(len(ns))
    for field in ns:
        w.length_prefixed(field)


def decode_namespace(r: Reader, *, allow_empty: bool | None = None) -> Namespace:
    count = r.varint()
    if count > MAX_NAMESPACE_FIELDS:
        raise protocol_violation(f"track namespace with {count} fields (at most {MAX_NAMESPACE_FIELDS})")
    fields = tuple(r.length_prefixed(MAX_FULL_TRACK_NAME, "track namespace field") for _ in range(count))
    check_namespace(fields, r.vi64, empty=allow_empty)
    return fields


def decode_track_name(r: Reader, ns: Namespace) -> bytes:
    name = r.length_prefixed(MAX_FULL_TRACK_NAME, "track name")
    check_namespace(ns, r.vi64, name=name)
    return name


def decode_reason(r: Reader) -> bytes:
    return r.length_prefixed(MAX_REASON, "reason phrase")


def check_reason(reason: bytes) -> None:
    if len(reason) > MAX_REASON:
        raise ValueError(f"reason phrase of {len(reason)} octets exceeds {MAX_REASON}")


# -- Key-Value-Pairs --------------------------------------------------------------------------------------------


def check_kvps(pairs: KeyValuePairs) -> None:
    for ktype, value in pairs:
        if ktype < 0:
            raise ValueError("key-value types are unsigned")
        if ktype % 2 == 0 and not isinstance(value, int):
            raise ValueError(f"even key-value type {ktype} carries a varint")
        if ktype % 2 == 1 and not isinstance(value, bytes):
            raise ValueError(f"odd key-value type {ktype} carries octets")
        if isinstance(value, bytes) and len(value) > MAX_KVP_VALUE:
            raise ValueError(f"key-value of {len(value)} octets exceeds {MAX_KVP_VALUE}")


def encode_kvps(w: Writer, pairs: KeyValuePairs, *, delta: bool) -> None:
    """The pairs themselves (no count, no length): absolute types (draft 14) or sorted deltas (draft 18)."""
    prev = 0
    for ktype, value in sorted(pairs, key=lambda p: p[0]) if delta else pairs:
        w.varint(ktype - prev if delta else ktype)
        prev = ktype
        if isinstance(value, int):
            w.varint(value)
        else:
            w.length_prefixed(value)


def decode_kvp(r: Reader, prev: int, *, delta: bool) -> KeyValuePair:
    ktype = r.varint()
    if delta:
        ktype += prev
        if ktype > varint_max(r.vi64):
            raise protocol_violation("key-value type delta runs past 2^64-1")
    if ktype % 2 == 0:
        return ktype, r.varint()
    return ktype, r.length_prefixed(MAX_KVP_VALUE, f"key-value {ktype}")


def decode_kvps_until(r: Reader, end: int, *, delta: bool) -> KeyValuePairs:
    """Pairs from ``r.pos`` up to offset *end*, which the caller has checked is within ``r`` (object extensions,
    draft 18 setup options and track properties). A pair that overruns *end* is a KEY_VALUE_FORMATTING_ERROR."""
    out: list[KeyValuePair] = []
    prev = 0
    sub = Reader(r.buf, r.vi64, r.pos, end)
    try:
        while not sub.at_end():
            pair = decode_kvp(sub, prev, delta=delta)
            prev = pair[0]
            out.append(pair)
    except NeedMore:
        raise MoqtError(SessionErrorCode.KEY_VALUE_FORMATTING_ERROR,
                        "a key-value pair runs past the end of its block") from None
    r.pos = end
    return tuple(out)


def encode_kvp_block(w: Writer, pairs: KeyValuePairs, *, delta: bool) -> None:
    """A length in octets, then the pairs (object extensions / properties)."""
    inner = Writer(w.vi64)
    encode_kvps(inner, pairs, delta=delta)
    w.length_prefixed(inner.buf)


def decode_kvp_block(r: Reader, *, delta: bool, limit: int = 1 << 20) -> KeyValuePairs:
    n = r.varint()
    if n > limit:
        raise protocol_violation(f"extension block of {n} octets exceeds {limit}")
    if n > r.remaining:
        raise NeedMore
    return decode_kvps_until(r, r.pos + n, delta=delta)


def decode_counted_kvps(r: Reader, *, delta: bool) -> KeyValuePairs:
    count = r.varint()
    if count > r.remaining:  # every pair needs at least two octets: a count this large cannot be honest
        raise protocol_violation(f"{count} parameters cannot fit the message")
    out: list[KeyValuePair] = []
    prev = 0
    for _ in range(count):
        pair = decode_kvp(r, prev, delta=delta)
        prev = pair[0]
        out.append(pair)
    return tuple(out)


def encode_counted_kvps(w: Writer, pairs: KeyValuePairs, *, delta: bool) -> None:
    w.varint(len(pairs))
    encode_kvps(w, pairs, delta=delta)


def kvp_value(pairs: KeyValuePairs, ktype: int) -> int | bytes | None:
    for t, v in pairs:
        if t == ktype:
            return v
    return None


# -- Authorization tokens -----------------------------------------------------------------------------------------


class AliasType(IntEnum):
    DELETE = 0x0
    REGISTER = 0x1
    USE_ALIAS = 0x2
    USE_VALUE = 0x3


@dataclass(frozen=True)
class AuthToken:
    """The Token structure of an AUTHORIZATION TOKEN parameter (both drafts)."""

    alias_type: AliasType
    alias: int | None = None
    token_type: int | None = None
    value: bytes = b""

    def __post_init__(self) -> None:
        needs_alias = self.alias_type is not AliasType.USE_VALUE
        needs_type = self.alias_type in (AliasType.REGISTER, AliasType.USE_VALUE)
        if needs_alias != (self.alias is not None) or needs_type != (self.token_type is not None):
            raise ValueError(f"token {self.alias_type.name}: wrong set of fields")
        if not needs_type and self.value:
            raise ValueError(f"token {self.alias_type.name} carries no value")

    def encode(self, vi64: bool) -> bytes:
        w = Writer(vi64)
        w.varint(self.alias_type)
        if self.alias is not None:
            w.varint(self.alias)
        if self.token_type is not None:
            w.varint(self.token_type)
            w.octets(self.value)
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes, vi64: bool) -> AuthToken:
        """Raises KEY_VALUE_FORMATTING_ERROR when the structure cannot be decoded."""
        r = Reader(data, vi64)
        try:
            code = r.varint()
            kind = AliasType(code)
            alias = r.varint() if kind is not AliasType.USE_VALUE else None
            ttype = r.varint() if kind in (AliasType.REGISTER, AliasType.USE_VALUE) else None
            value = r.octets(r.remaining) if ttype is not None else b""
        except (NeedMore, ValueError):
            raise MoqtError(SessionErrorCode.KEY_VALUE_FORMATTING_ERROR, "undecodable authorization token") from None
        if not r.at_end():
            raise MoqtError(SessionErrorCode.KEY_VALUE_FORMATTING_ERROR, "octets after an authorization token")
        return cls(kind, alias, ttype, value)


class SetupParam(IntEnum):
    """Setup parameters / options (one namespace across versions). Draft 14 gives MOQT_IMPLEMENTATION the code 0x05
    of AUTHORITY; draft 15 moved it to 0x07, which deployed draft 14 peers (aiomoqt) use too: so do we."""

    PATH = 0x01
    MAX_REQUEST_ID = 0x02  # draft 14 only
    AUTHORIZATION_TOKEN = 0x03
    MAX_AUTH_TOKEN_CACHE_SIZE = 0x04
    AUTHORITY = 0x05
    MOQT_IMPLEMENTATION = 0x07


@dataclass(frozen=True)
class StandaloneFetch:
    namespace: Namespace
    track_name: bytes
    start: Location
    end: Location  # the end location plus one object; object 0 means "the whole end group"

    def encode(self, w: Writer) -> None:
        encode_namespace(w, self.namespace)
        w.length_prefixed(self.track_name)
        self.start.encode(w)
        self.end.encode(w)

    @classmethod
    def decode(cls, r: Reader) -> StandaloneFetch:
        ns = decode_namespace(r)
        return cls(ns, decode_track_name(r, ns), Location.decode(r), Location.decode(r))


@dataclass(frozen=True)
class JoiningFetch:
    """A joining fetch: relative (start = groups before the subscription's largest group) or absolute."""

    request_id: int
    start: int
    absolute: bool = False

    @property
    def fetch_type(self) -> FetchType:
        return FetchType.ABSOLUTE_JOINING if self.absolute else FetchType.RELATIVE_JOINING


FetchTarget = StandaloneFetch | JoiningFetch


def encode_fetch_target(w: Writer, target: FetchTarget) -> None:
    if isinstance(target, StandaloneFetch):
        w.varint(FetchType.STANDALONE)
        target.encode(w)
    else:
        w.varint(target.fetch_type)
        w.varint(target.request_id)
        w.varint(target.start)


def decode_fetch_target(r: Reader) -> FetchTarget:
    code = r.varint()
    if code == FetchType.STANDALONE:
        return StandaloneFetch.decode(r)
    if code in (FetchType.RELATIVE_JOINING, FetchType.ABSOLUTE_JOINING):
        return JoiningFetch(r.varint(), r.varint(), code == FetchType.ABSOLUTE_JOINING)
    raise protocol_violation(f"unknown fetch type {code}")


def check_uint8(value: int, what: str) -> None:
    if not 0 <= value <= 0xFF:
        raise ValueError(f"{what} {value} does not fit 8 bits")


# -- Textual form of names (draft 18, "Representing Namespace and Track Names") -------------------------------

_LITERAL: Final = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_HEX: Final = frozenset("0123456789abcdef")


def _render(field: bytes) -> str:
    return "".join(chr(b) if b in _LITERAL else f".{b:02x}" for b in field)


def render_name(namespace: Namespace, track_name: bytes | None = None) -> str:
    """Fields joined by "-", then "--" and the track name; bytes outside [a-zA-Z0-9_] as ".xx" (lowercase hex).
    Filename- and URL-safe, and bijective (see :func:`parse_name`)."""
    text = "-".join(_render(f) for f in namespace)
    return text if track_name is None else f"{text}--{_render(track_name)}"


def _parse_field(text: str) -> bytes:
    out = bytearray()
    i = 0
    while i < len(text):
        c = text[i]
        if c == ".":
            digits = text[i + 1:i + 3]
            if len(digits) != 2 or not set(digits) <= _HEX:
                raise ValueError(f"'.' must be followed by two lowercase hex digits in {text!r}")
            b = int(digits, 16)
            if b in _LITERAL:
                raise ValueError(f"{text!r} escapes {chr(b)!r}, which is written literally")
            out.append(b)
            i += 3
        elif ord(c) < 128 and ord(c) in _LITERAL:
            out.append(ord(c))
            i += 1
        else:
            raise ValueError(f"{c!r} may not appear in a rendered name")
    return bytes(out)


def parse_name(text: str) -> tuple[Namespace, bytes | None]:
    """The inverse of :func:`render_name`; ValueError for anything but the canonical form."""
    ns_text, sep, name_text = text.partition("--")
    fields = tuple(_parse_field(f) for f in ns_text.split("-")) if ns_text else ()
    if any(not f for f in fields):
        raise ValueError(f"empty namespace field in {text!r}")
    return fields, (_parse_field(name_text) if sep else None)
