"""SIGHUP: a running server re-reads its policy file and its CRL (``[tls] crl``), without a restart.

Both files are read first; only when both load are they installed, so a server never runs with half a reload:
one INFO line ``reloaded policy (N principals) and CRL (M revoked)`` then, else one ERROR line saying which file
failed and that the previous policy and CRL stay. The server never stops because of a reload.

What a reload reaches (docs/security.md):

* the policy (:meth:`kvsp_quic.auth.Policy.replace_with`): every app asks the same object for each request, so
  the next request on any connection, new or established, is judged by the new policy;
* the CRL (:class:`quic.crl.Revocation`): new handshakes over TCP and QUIC, and -- through
  :func:`quic.tls.scope_identity` -- the next HTTP request on a connection established before (a revoked
  certificate is then unauthenticated: 401);
* established MOQT sessions (relay, holder and instance MOQT endpoints; :func:`moqt.aio.recheck_sessions`): each
  one whose peer certificate is now revoked, or whose identity lost every right it used there (the app's
  ``recheck``), is closed with the session error UNAUTHORIZED and its QUIC connection with it; one INFO line per
  session (``... closed after the reload: <why>``) and the count in the INFO line of the reload;
* worker processes (``holder`` and ``relay`` with ``--workers N``): the primary passes the signal on to each, and
  each reloads its own copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("kvsp.server")

WORKER_PREFIX = "kvsp-"  # kvsp_app.workers names its processes kvsp-ROLE-worker-N


def reload_now(policy: Any, policy_file: Path | None, files: Any,
               derive: Callable[[Any], Any] | None = None) -> bool:
    """Re-read *policy_file* (into *policy*, in place) and the CRL of *files* (a ``quic.tls.TlsFiles``); True when
    both were installed. *derive* turns the policy read into the one to serve (the front end's ``--dev`` key)."""
    from kvsp_quic.auth import Policy, PolicyError
    from quic.crl import CrlError

    revocation = getattr(files, "crl", None)
    try:
        fresh = Policy.load(policy_file) if policy_file is not None else None
        if fresh is not None and derive is not None:
            fresh = derive(fresh)
        crl = revocation.read() if revocation is not None else None
    except (PolicyError, CrlError, ValueError) as exc:
        log.error("reload failed, keeping the previous policy and CRL: %s", exc)
        return False
    if fresh is not None:
        policy.replace_with(fresh)
    if crl is not None and revocation is not None:
        revocation.install(crl)
    principals = f"{len(policy)} principals" if policy_file is not None else "unchanged: no policy file"
    revoked = f"{crl.count} revoked" if crl is not None else "none configured"
    closed = _recheck_moqt_sessions()
    log.info("reloaded policy (%s) and CRL (%s)%s", principals, revoked,
             f"; {closed} MOQT session(s) closed" if closed else "")
    return True


def _recheck_moqt_sessions() -> int:
    """Close the MOQT sessions of this process that may no longer be served (moqt.aio.revocation)."""
    from moqt.aio import recheck_sessions

    try:
        return recheck_sessions()
    except Exception:  # never let a reload end the server
        log.exception("re-checking the MOQT sessions failed")
        return 0


def _signal_workers() -> None:
    for child in multiprocessing.active_children():
        if child.name.startswith(WORKER_PREFIX) and child.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGHUP)


def reload_on_sighup(policy: Any, policy_file: Path | None, files: Any,
                     derive: Callable[[Any], Any] | None = None) -> bool:
    """Install the SIGHUP handler of this process's running event loop (False where signals cannot be handled:
    not the main thread, or no signals on the platform). A primary passes the signal on to its workers."""
    loop = asyncio.get_running_loop()

    def on_hup() -> None:
        try:
            reload_now(policy, policy_file, files, derive)
        except Exception:  # never let a reload end the server
            log.exception("reload failed, keeping the previous policy and CRL")
        _signal_workers()

    try:
        loop.add_signal_handler(signal.SIGHUP, on_hup)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):
        return False
    return True


__all__ = ["reload_now", "reload_on_sighup"]
