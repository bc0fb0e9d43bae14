"""Revocation of established MOQT sessions (issue 13): after a reload of the policy and the CRL, every open
session of the process is judged again, and one whose peer may no longer be served is closed.

A session's identity is fixed at its handshake, and its requests are judged by the policy as they come; but what a
session holds -- published namespaces, subscriptions, namespace subscriptions, FETCHes under way -- outlives the
rights that let it in. So :func:`recheck_sessions` (``kvsp_app.reload`` calls it on SIGHUP, once the new
policy and CRL are installed) closes each open session of the process (server side: every connection our
listeners accepted; client side too, for a revoked server certificate)

* whose peer certificate a CRL loaded in this process now revokes (:func:`quic.crl.pem_revoked_in_process`, the
  same rule as the HTTP side's :func:`quic.tls.scope_identity`), or
* that its :class:`~moqt.aio.MoqtApp` no longer serves (:meth:`~moqt.aio.MoqtApp.recheck`: for the relay and a
  holder, a principal that lost every right it used, or that is not in the policy any more),

with the drafts' session termination code ``UNAUTHORIZED`` (0x2; drafts 14 and 18, "Session Termination"), which
closes the QUIC connection (CONNECTION_CLOSE with that code). Each close is one INFO line on ``kvsp.moqt`` (and the
audit's line and count: ``kvsp_moqt_sessions_closed_total{by="us",reason="unauthorized"}``, :mod:`moqt.aio.audit`),
and the app hears of it (:meth:`~moqt.aio.MoqtApp.session_revoked`). The peer's next handshake is refused by the
CRL (``quic.connection``), or its requests by the policy.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Protocol

from quic.crl import pem_revoked_in_process

log = logging.getLogger("kvsp.moqt")


class Revocable(Protocol):
    """What is re-checked of a session (:class:`moqt.aio.MoqtConnection`)."""

    @property
    def closed(self) -> Any: ...

    @property
    def tls(self) -> dict[str, Any]: ...

    @property
    def peer_identity(self) -> str | None: ...

    def recheck(self) -> str | None: ...

    def revoke(self, reason: str) -> None: ...


_SESSIONS: weakref.WeakSet[Revocable] = weakref.WeakSet()


def track(conn: Revocable) -> None:
    """Register a session for :func:`recheck_sessions` (every :class:`MoqtConnection` does, once created)."""
    _SESSIONS.add(conn)


def open_sessions() -> list[Revocable]:
    return [conn for conn in list(_SESSIONS) if conn.closed is None]


def refusal_of(conn: Revocable) -> str | None:
    """Why *conn* may no longer be served (one line), or None."""
    chain = conn.tls.get("client_cert_chain") or []
    if chain and pem_revoked_in_process(chain[0]):
        return "the peer's certificate is revoked"
    return conn.recheck()


def recheck_sessions() -> int:
    """Close every open session of the process whose peer may no longer be served (see the module docstring);
    returns how many were closed."""
    closed = 0
    for conn in open_sessions():
        try:
            reason = refusal_of(conn)
        except Exception:  # a broken app check must not stop the others being judged
            log.exception("%r: re-checking the session failed", conn)
            continue
        if reason is None:
            continue
        log.info("%r closed after the reload: %s", conn, reason)
        conn.revoke(reason)
        closed += 1
    return closed


__all__ = ["Revocable", "open_sessions", "recheck_sessions", "refusal_of", "track"]
