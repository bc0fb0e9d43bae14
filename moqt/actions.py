"""Transport actions: what the session asks the transport adapter (aioquic, later) to do, in order.

Stream ids follow QUIC's numbering (RFC 9000 section 2.1): the session allocates its own streams (client
bidirectional 0, 4, ...; server bidirectional 1, 5, ...; client unidirectional 2, 6, ...; server unidirectional
3, 7, ...), so an adapter on a connection dedicated to MOQT can pass them straight to QUIC. ``OpenStream`` always
precedes the first ``SendStreamData`` of a stream the session opens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OpenStream:
    stream_id: int
    unidirectional: bool
    priority: int = 128  # a hint for the adapter's scheduler (lower is more urgent); control streams get 0


@dataclass(frozen=True, slots=True)
class SendStreamData:
    """Octets for a stream; ``data`` may be a view of the application's buffer (the payload of an object)."""

    stream_id: int
    data: bytes | memoryview
    fin: bool = False


@dataclass(frozen=True, slots=True)
class ResetStream:
    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class StopSending:
    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class SendDatagram:
    data: bytes


@dataclass(frozen=True, slots=True)
class CloseSession:
    """Close the QUIC connection (CONNECTION_CLOSE with this application error code)."""

    error_code: int
    reason: str = ""


Action = OpenStream | SendStreamData | ResetStream | StopSending | SendDatagram | CloseSession
