"""What a session keeps per request, its configuration, and the checks of SETUP's PATH / AUTHORITY."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from moqt.errors import MoqtError, SessionErrorCode, protocol_violation
from moqt.types import FilterType, GroupOrder, KeyValuePairs, Location, Namespace, SubscriptionFilter
from moqt.writers import FetchStreamWriter


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"


@dataclass(frozen=True)
class SessionConfig:
    """Per-connection settings (policy; the session only applies them)."""

    path: bytes | None = None  # client, native QUIC: the path (and ?query) of the moqt:// URI
    authority: bytes | None = None  # client, native QUIC: the authority of the moqt:// URI
    implementation: bytes | None = b"kvsp-quic"  # MOQT_IMPLEMENTATION setup option
    request_credit: int = 64  # draft 14: request ids granted to the peer ahead of its last one
    auto_grant: bool = True  # draft 14: top the credit up with MAX_REQUEST_ID as the peer uses it
    datagrams: bool = False  # the QUIC DATAGRAM extension was negotiated
    # Draft 18's FETCH object has no Object Status field; moxygen and aiomoqt write one after a zero Payload Length
    # (as in subgroup objects). True follows them (interoperable); False follows the draft text.
    fetch_empty_object_status: bool = True
    max_buffered: int = 1 << 20  # octets of streams held while setup is incomplete (then: STOP_SENDING)
    setup_params: KeyValuePairs = ()  # extra setup parameters / options (unknown ones: the peer ignores them)


class Kind(Enum):
    SUBSCRIBE = "subscribe"
    FETCH = "fetch"
    TRACK_STATUS = "track_status"
    PUBLISH_NAMESPACE = "publish_namespace"
    SUBSCRIBE_NAMESPACE = "subscribe_namespace"
    UPDATE = "update"
    PUBLISH = "publish"  # moqt.publishing (draft 18), moqt.publishing14 (draft 14)
    SUBSCRIBE_TRACKS = "subscribe_tracks"  # draft 18 only


class RState(Enum):
    PENDING = "pending"  # no reply yet
    ACTIVE = "active"  # accepted (subscription established, namespace accepted, fetch accepted)
    DONE = "done"  # rejected, cancelled or ended; kept so that late messages are recognized


@dataclass(eq=False)
class Request:
    """What the session knows of one request, ours (``local``) or the peer's."""

    request_id: int
    kind: Kind
    local: bool
    state: RState = RState.PENDING
    namespace: Namespace = ()
    track_name: bytes = b""
    stream_id: int | None = None  # draft 18: the request's bidirectional stream
    track_alias: int | None = None
    group_order: GroupOrder = GroupOrder.ASCENDING  # fetch: the order its objects arrive in
    filter: SubscriptionFilter | None = None  # subscription: the current filter, when known
    forward: bool = True
    priority: int = 128  # subscriber priority
    target: int | None = None  # update / joining fetch: the request it refers to
    start: Location | None = None  # standalone fetch: its start
    data_streams: int = 0  # subscription we serve: subgroup streams opened
    writer: FetchStreamWriter | None = None  # fetch we serve: its data stream
    pending_updates: deque[int] = field(default_factory=deque)  # draft 18: our updates awaiting a reply
    replied: bool = False  # the (first) reply arrived
    data_ended: bool = False  # our fetch: its data stream ended (FIN or reset)
    namespaces: set[Namespace] = field(default_factory=set)  # draft 18 SUBSCRIBE_NAMESPACE: active ones


_PATH_OK: Final = frozenset(range(0x21, 0x7F)) - {ord("#")}


def check_path(path: bytes) -> None:
    """PATH: path-abempty [ "?" query ] (RFC 3986). MALFORMED_PATH otherwise."""
    if path and (path[:1] != b"/" or any(b not in _PATH_OK for b in path)):
        raise MoqtError(SessionErrorCode.MALFORMED_PATH, "PATH is not a path-abempty with an optional query")


def check_authority(authority: bytes) -> None:
    """AUTHORITY: [ userinfo "@" ] host [ ":" port ] with a non-empty host. MALFORMED_AUTHORITY otherwise."""
    hostport = authority.rpartition(b"@")[2]
    host = hostport if hostport.startswith(b"[") else hostport.partition(b":")[0]
    if not host or any(b not in _PATH_OK or b in b"/?" for b in authority):
        raise MoqtError(SessionErrorCode.MALFORMED_AUTHORITY, "AUTHORITY is not an authority with a host")


def absolute_filter(start: Location, end_group_plus_one: int) -> SubscriptionFilter:
    """Draft 14 SUBSCRIBE_UPDATE's start / end group (+1, 0 = open) as a filter (PROTOCOL_VIOLATION if the end
    group precedes the start)."""
    if end_group_plus_one == 0:
        return SubscriptionFilter(FilterType.ABSOLUTE_START, start)
    if end_group_plus_one - 1 < start.group:
        raise protocol_violation("SUBSCRIBE_UPDATE end group precedes its start")
    return SubscriptionFilter(FilterType.ABSOLUTE_RANGE, start, end_group_plus_one - 1)
