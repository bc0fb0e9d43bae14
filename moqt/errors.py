"""Error codes of both drafts and the two exception families.

* :class:`MoqtError`: the peer broke the protocol (or the session must end): it carries the session termination code
  of the draft's table and is turned into a ``CloseSession`` action in one place, the session's input handlers.
* :class:`MoqtUsageError`: the local application misused the API (a request id it does not own, a write past an
  object's declared length, ...). Raised to the caller; the session stays as it was.

Request-level codes differ between the drafts: draft 14 has one table per error message (SUBSCRIBE_ERROR,
FETCH_ERROR, ...), draft 18 one REQUEST_ERROR table with renumbered codes. PUBLISH_DONE codes also moved
(EXPIRED / TOO_FAR_BEHIND swapped, MALFORMED_TRACK 0x7 -> 0x12).
"""

from __future__ import annotations

from enum import IntEnum


class SessionErrorCode(IntEnum):
    """Session termination codes (identical in drafts 14 and 18, except TOO_MANY_REQUESTS: draft 14 only)."""

    NO_ERROR = 0x0
    INTERNAL_ERROR = 0x1
    UNAUTHORIZED = 0x2
    PROTOCOL_VIOLATION = 0x3
    INVALID_REQUEST_ID = 0x4
    DUPLICATE_TRACK_ALIAS = 0x5
    KEY_VALUE_FORMATTING_ERROR = 0x6
    TOO_MANY_REQUESTS = 0x7  # draft 14 (request-id flow control was removed in draft 17)
    INVALID_PATH = 0x8
    MALFORMED_PATH = 0x9
    GOAWAY_TIMEOUT = 0x10
    CONTROL_MESSAGE_TIMEOUT = 0x11
    DATA_STREAM_TIMEOUT = 0x12
    AUTH_TOKEN_CACHE_OVERFLOW = 0x13
    DUPLICATE_AUTH_TOKEN_ALIAS = 0x14
    VERSION_NEGOTIATION_FAILED = 0x15
    MALFORMED_AUTH_TOKEN = 0x16
    UNKNOWN_AUTH_TOKEN_ALIAS = 0x17
    EXPIRED_AUTH_TOKEN = 0x18
    INVALID_AUTHORITY = 0x19
    MALFORMED_AUTHORITY = 0x1A


class RequestErrorCode14(IntEnum):
    """Draft 14: SUBSCRIBE_ERROR, TRACK_STATUS_ERROR, FETCH_ERROR, PUBLISH_ERROR, PUBLISH_NAMESPACE_ERROR (and
    _CANCEL), SUBSCRIBE_NAMESPACE_ERROR share 0x0-0x3 and the token codes; the rest is per message (below)."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    MALFORMED_AUTH_TOKEN = 0x10
    EXPIRED_AUTH_TOKEN = 0x12


class SubscribeErrorCode14(IntEnum):
    TRACK_DOES_NOT_EXIST = 0x4
    INVALID_RANGE = 0x5


class FetchErrorCode14(IntEnum):
    TRACK_DOES_NOT_EXIST = 0x4
    INVALID_RANGE = 0x5
    NO_OBJECTS = 0x6
    INVALID_JOINING_REQUEST_ID = 0x7
    UNKNOWN_STATUS_IN_RANGE = 0x8
    MALFORMED_TRACK = 0x9


class PublishNamespaceErrorCode14(IntEnum):
    UNINTERESTED = 0x4


class SubscribeNamespaceErrorCode14(IntEnum):
    NAMESPACE_PREFIX_UNKNOWN = 0x4
    NAMESPACE_PREFIX_OVERLAP = 0x5


class RequestErrorCode18(IntEnum):
    """Draft 18 REQUEST_ERROR codes."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    MALFORMED_AUTH_TOKEN = 0x4
    EXPIRED_AUTH_TOKEN = 0x5
    GOING_AWAY = 0x6
    EXCESSIVE_LOAD = 0x9
    DOES_NOT_EXIST = 0x10
    INVALID_RANGE = 0x11
    MALFORMED_TRACK = 0x12
    DUPLICATE_SUBSCRIPTION = 0x19
    UNINTERESTED = 0x20
    PREFIX_OVERLAP = 0x30
    NAMESPACE_TOO_LARGE = 0x31
    INVALID_JOINING_REQUEST_ID = 0x32
    UNSUPPORTED_EXTENSION = 0x33
    REDIRECT = 0x34


class PublishDoneCode14(IntEnum):
    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TRACK_ENDED = 0x2
    SUBSCRIPTION_ENDED = 0x3
    GOING_AWAY = 0x4
    EXPIRED = 0x5
    TOO_FAR_BEHIND = 0x6
    MALFORMED_TRACK = 0x7


class PublishDoneCode18(IntEnum):
    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TRACK_ENDED = 0x2
    SUBSCRIPTION_ENDED = 0x3
    GOING_AWAY = 0x4
    TOO_FAR_BEHIND = 0x5
    EXPIRED = 0x6
    UPDATE_FAILED = 0x8
    EXCESSIVE_LOAD = 0x9
    MALFORMED_TRACK = 0x12


class StreamResetCode(IntEnum):
    """RESET_STREAM / STOP_SENDING codes (draft 14 defines 0x0-0x3; draft 18 adds the rest)."""

    INTERNAL_ERROR = 0x0
    CANCELLED = 0x1
    DELIVERY_TIMEOUT = 0x2
    SESSION_CLOSED = 0x3
    GOING_AWAY = 0x4
    TOO_FAR_BEHIND = 0x5
    UNKNOWN_OBJECT_STATUS = 0x6
    EXPIRED_AUTH_TOKEN = 0x7
    EXCESSIVE_LOAD = 0x9
    MALFORMED_TRACK = 0x12


class MoqtError(Exception):
    """A protocol error: the session closes with :attr:`code` (a session termination code)."""

    def __init__(self, code: int, reason: str = "") -> None:
        super().__init__(f"{_code_name(code)}: {reason}" if reason else _code_name(code))
        self.code = int(code)
        self.reason = reason


class MoqtUsageError(Exception):
    """The API was used in a way the protocol or the session state does not allow."""


def _code_name(code: int) -> str:
    try:
        return SessionErrorCode(code).name
    except ValueError:
        return f"0x{code:x}"


def protocol_violation(reason: str) -> MoqtError:
    return MoqtError(SessionErrorCode.PROTOCOL_VIOLATION, reason)
