"""The asyncio adapter's exceptions: a failed connect, a closed session, a refused request, a reset or stalled
fetch, a fetch the peer cancelled."""

from __future__ import annotations

from quic.protocol import QuicConnectError


class MoqtConnectError(QuicConnectError):
    """The QUIC handshake or the MOQT setup failed (no MOQT ALPN at the peer, certificate refused, timeout)."""


class MoqtSessionClosed(ConnectionError):
    """The session (or its QUIC connection) is over."""

    def __init__(self, error_code: int, reason: str) -> None:
        super().__init__(f"MOQT session closed (code 0x{error_code:x}{': ' + reason if reason else ''})")
        self.error_code = error_code
        self.reason = reason


class MoqtRequestError(Exception):
    """The peer refused one of our requests (FETCH_ERROR / REQUEST_ERROR ...) or cancelled it."""

    def __init__(self, request_id: int, error_code: int, reason: bytes = b"", *, cancelled: bool = False,
                 retry_interval: int = 0) -> None:
        what = "cancelled" if cancelled else "refused"
        text = reason.decode("utf-8", "replace")
        super().__init__(f"request {request_id} {what} (code 0x{error_code:x}{': ' + text if text else ''})")
        self.request_id = request_id
        self.error_code = error_code
        self.reason = reason
        self.cancelled = cancelled
        self.retry_interval = retry_interval
        """Draft 18 REQUEST_ERROR's Retry Interval: milliseconds before a retry, plus one (0: do not retry)."""


class MoqtStreamError(ConnectionError):
    """The peer reset a data stream of ours."""


class MoqtStalled(TimeoutError):
    """Nothing arrived for a fetch within its deadline."""


class FetchCancelled(Exception):
    """The peer cancelled (or stopped the data stream of) a fetch we serve: stop writing."""


__all__ = ["FetchCancelled", "MoqtConnectError", "MoqtRequestError", "MoqtSessionClosed", "MoqtStalled",
           "MoqtStreamError"]
