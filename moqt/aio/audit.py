"""Why MOQT sessions end and handshakes fail: one INFO line each, and counters by reason.

Every :class:`~moqt.aio.connection.MoqtConnection` (server and client side, relay and holder alike) reports its end
here. A session closed with an error code -- by us, because the peer broke the protocol (the session turned a
:class:`~moqt.errors.MoqtError` into ``CloseSession``) or the application gave up, or by the peer -- gets one
INFO line on the ``kvsp.moqt`` logger with the peer's address, its verified identity (if any), the draft and the
reason, and one count in :data:`AUDIT` by (``by``, draft, reason). A clean close (NO_ERROR, the listener's
shutdown, an idle timeout) is counted as ``no_error`` and logged at DEBUG.

Handshakes: :func:`~moqt.aio.endpoints.connect_moqt` reports a refused or failed handshake or SETUP of ours
(``side="client"``); a server reports the handshakes it refused (no or a bad client certificate, no common ALPN)
through :meth:`SessionAudit.handshake_refused` -- the QUIC listener, which sees them before any MOQT handler
exists, calls it (``side="server"``).

``/metrics`` exposes the counters (kvsp_http/relay_app.py: ``kvsp_moqt_sessions_closed_total{by,draft,reason}`` and
``kvsp_moqt_handshakes_refused_total{side,reason}``).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field

from moqt.errors import SessionErrorCode

log = logging.getLogger("kvsp.moqt")

# QUIC CONNECTION_CLOSE codes that mean "no error" for a MOQT connection: MOQT's NO_ERROR and HTTP/3's
# H3_NO_ERROR (the shared listener closes every connection with it when the server shuts down).
_CLEAN = frozenset({int(SessionErrorCode.NO_ERROR), 0x100})
_TLS_ALERTS = {0x128: "handshake_failure", 0x12A: "bad_certificate", 0x12D: "certificate_expired",
               0x12E: "certificate_unknown", 0x130: "unknown_ca", 0x174: "certificate_required",
               0x178: "no_application_protocol"}


def reason_label(error_code: int) -> str:
    """A low-cardinality label for a close code: the draft's termination code name (``protocol_violation``), a
    TLS alert carried as a QUIC CRYPTO_ERROR (``certificate_required``), or ``code_0x..``."""
    if error_code in _CLEAN:
        return "no_error"
    try:
        return SessionErrorCode(error_code).name.lower()
    except ValueError:
        return _TLS_ALERTS.get(error_code, f"code_{error_code:#x}")


def _address(peer: tuple[str, int] | None) -> str:
    if peer is None:
        return "-"
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class SessionAudit:
    """Counters of session closes and refused handshakes (thread-safe; one per process: :data:`AUDIT`)."""

    closed: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    """(by: "us" / "peer", draft ALPN, reason label) -> sessions."""
    refused: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    """(side: "server" / "client", reason label) -> handshakes."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def session_closed(self, *, local: bool, error_code: int, reason: str, alpn: str,
                       peer: tuple[str, int] | None, identity: str | None, role: str) -> None:
        label = reason_label(error_code)
        by = "us" if local else "peer"
        with self._lock:
            self.closed[(by, alpn, label)] += 1
        if label == "no_error":
            log.debug("MOQT session closed by %s: peer %s identity %s draft %s (%s)", by, _address(peer),
                      identity or "-", alpn, reason or "no error")
            return
        log.info("MOQT session closed by %s (%s side): peer %s identity %s draft %s: %s (%#x) %s", by, role,
                 _address(peer), identity or "-", alpn, label.upper(), error_code, reason or "-")

    def handshake_refused(self, *, side: str, reason: str, peer: tuple[str, int] | None,
                          alpn: str | None = None, identity: str | None = None, detail: str = "") -> None:
        """A handshake (QUIC/TLS, or MOQT SETUP) that did not become a session. *reason*: a label
        (``certificate_required``, ``no_application_protocol``, ``timeout``, ...)."""
        with self._lock:
            self.refused[(side, reason)] += 1
        log.info("MOQT handshake refused (%s side): peer %s identity %s draft %s: %s %s", side, _address(peer),
                 identity or "-", alpn or "-", reason, detail or "")

    def snapshot(self) -> tuple[dict[tuple[str, str, str], int], dict[tuple[str, str], int]]:
        with self._lock:
            return dict(self.closed), dict(self.refused)


AUDIT = SessionAudit()
"""The process's counters: every MOQT endpoint of the process reports here, /metrics reads them."""


__all__ = ["AUDIT", "SessionAudit", "reason_label"]
