"""Revocation: a server's certificate revocation list (``[tls] crl``), checked at every handshake and request.

A server role may name a CRL file (PEM, one or more ``X509 CRL`` blocks, or one DER CRL) of the CA that issues its
peers' certificates. :class:`Revocation` holds what was read last; ``kvsp_app.reload`` re-reads it on SIGHUP
(:meth:`Revocation.read`, :meth:`Revocation.install`), and a file that fails to load keeps the previous list.

Where it is checked:

* TCP (HTTP/1.1, HTTP/2): OpenSSL itself, with the CRLs in the context's store and ``VERIFY_CRL_CHECK_LEAF``
  (:func:`quic.tls.ssl_server_context`). A context's store cannot drop a CRL, so a reload builds a new context
  and each new handshake is moved to the current one from the server-name callback, which OpenSSL calls for
  every ClientHello, with or without SNI (:meth:`Revocation.current_context`).
* QUIC (HTTP/3, MOQT): :func:`quic.connection.verify_client_certificate` asks :meth:`Revocation.refusal` after
  the chain is verified (aioquic has no CRL support).
* Requests on connections that were established before a reload: :func:`quic.tls.scope_identity` -- the one
  place every role app's authentication reads the peer's identity -- answers None (unauthenticated, so 401) for a
  certificate that a CRL loaded in this process revokes (:func:`revoked_in_process`). A CRL is the CA's signed
  statement and is accepted only with a valid signature of a CA in the configured CA file, so honouring it for
  every server of the process that meets a certificate of that CA is right.
* Established MOQT sessions: on a reload, :func:`moqt.aio.revocation.recheck_sessions` closes every session whose
  peer certificate is now revoked (:func:`pem_revoked_in_process`) with the session error UNAUTHORIZED.

The rules follow OpenSSL's, so that both transports answer alike: with a CRL configured, a peer certificate is
refused when it is revoked, when the file has no CRL of its issuer, or when that CRL is past its ``nextUpdate``.
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

_PEM_CRL = b"-----BEGIN X509 CRL-----"


class CrlError(ValueError):
    """The CRL file cannot be read, parsed, or is not signed by a configured CA; one line for the user."""


@dataclass(frozen=True)
class CrlSet:
    """The CRLs of one file: per issuer (DER name) the revoked serial numbers and the ``nextUpdate``."""

    path: Path
    pem: str  # every CRL, as PEM, for OpenSSL's store
    revoked: dict[bytes, frozenset[int]]
    next_update: dict[bytes, dt.datetime | None]

    @property
    def count(self) -> int:
        """How many certificates the file revokes."""
        return sum(len(serials) for serials in self.revoked.values())

    @classmethod
    def load(cls, path: str | os.PathLike[str], ca_pem: bytes) -> CrlSet:
        where = f"CRL {os.fspath(path)!r}"
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise CrlError(f"{where}: {exc.strerror or exc}") from None
        try:
            crls = ([x509.load_pem_x509_crl(_PEM_CRL + block) for block in data.split(_PEM_CRL)[1:]]
                    if _PEM_CRL in data else [x509.load_der_x509_crl(data)])
        except ValueError as exc:
            raise CrlError(f"{where}: not a PEM or DER CRL ({exc})") from None
        if not crls:
            raise CrlError(f"{where}: no CRL in the file")
        try:
            cas = x509.load_pem_x509_certificates(ca_pem)
        except ValueError as exc:
            raise CrlError(f"{where}: the CA file cannot be read ({exc})") from None
        revoked: dict[bytes, set[int]] = {}
        next_update: dict[bytes, dt.datetime | None] = {}
        for crl in crls:
            issuer = crl.issuer.public_bytes()
            signers = [ca for ca in cas if ca.subject.public_bytes() == issuer]
            if not any(_signed_by(crl, ca.public_key()) for ca in signers):
                raise CrlError(f"{where}: the CRL of {crl.issuer.rfc4514_string()!r} is not signed by a CA of "
                               f"the CA file")
            serials = revoked.setdefault(issuer, set())
            serials.update(entry.serial_number for entry in crl)
            when = crl.next_update_utc
            before = next_update.get(issuer)
            next_update[issuer] = when if before is None or (when is not None and when > before) else before
        pem = "".join(c.public_bytes(serialization.Encoding.PEM).decode("ascii") for c in crls)
        return cls(Path(path), pem, {k: frozenset(v) for k, v in revoked.items()}, next_update)

    def refusal(self, cert: x509.Certificate, now: dt.datetime | None = None) -> str | None:
        """Why *cert* is refused (one line), or None when it is not."""
        issuer = cert.issuer.public_bytes()
        serials = self.revoked.get(issuer)
        if serials is None:
            return "the CRL file has no CRL of the certificate's issuer"
        if cert.serial_number in serials:
            return "the certificate is revoked"
        expiry = self.next_update.get(issuer)
        if expiry is not None and expiry < (now or dt.datetime.now(dt.UTC)):
            return "the CRL of the certificate's issuer has expired"
        return None


def _signed_by(crl: x509.CertificateRevocationList, key: Any) -> bool:
    try:
        return crl.is_signature_valid(key)
    except (TypeError, ValueError):  # a key type the CRL's algorithm does not use
        return False


_ACTIVE: weakref.WeakSet[Revocation] = weakref.WeakSet()
_ACTIVE_LOCK = threading.Lock()


class Revocation:
    """A server's CRL file and what was read from it last; shared by its listeners and replaced in place."""

    def __init__(self, path: str | os.PathLike[str], ca_pem: bytes) -> None:
        self.path = Path(path)
        self._ca_pem = ca_pem
        self.current = CrlSet.load(self.path, ca_pem)  # CrlError: a server does not start with a bad CRL
        self.generation = 0
        self._contexts: dict[Any, tuple[int, ssl.SSLContext]] = {}
        self._lock = threading.Lock()
        with _ACTIVE_LOCK:
            _ACTIVE.add(self)

    def __reduce__(self) -> tuple[Any, ...]:  # worker processes read the file themselves
        return (Revocation, (self.path, self._ca_pem))

    def read(self) -> CrlSet:
        """The file as it is now (CrlError when it fails to load); :meth:`install` makes it current."""
        return CrlSet.load(self.path, self._ca_pem)

    def install(self, fresh: CrlSet) -> None:
        """Make *fresh* the list every later handshake and request is checked against."""
        with self._lock:
            self.current = fresh
            self.generation += 1

    def refusal(self, cert: x509.Certificate) -> str | None:
        return self.current.refusal(cert)

    def current_context(self, key: Any, build: Callable[[str], ssl.SSLContext]) -> ssl.SSLContext:
        """The TLS context of the listener *key* built (by *build*, given the CRLs' PEM) for the current list."""
        with self._lock:
            cached = self._contexts.get(key)
            if cached is None or cached[0] != self.generation:
                cached = (self.generation, build(self.current.pem))
                self._contexts[key] = cached
            return cached[1]


def revoked_in_process(cert: x509.Certificate) -> bool:
    """True when a CRL loaded by a server of this process revokes *cert* (its issuer's CRL lists its serial)."""
    with _ACTIVE_LOCK:
        active = list(_ACTIVE)
    for revocation in active:
        serials = revocation.current.revoked.get(cert.issuer.public_bytes())
        if serials is not None and cert.serial_number in serials:
            return True
    return False


def pem_revoked_in_process(pem: str) -> bool:
    """:func:`revoked_in_process` for a PEM certificate (False when no CRL is loaded, or it cannot be read)."""
    if not any_active():
        return False
    try:
        cert = x509.load_pem_x509_certificate(pem.encode("ascii"))
    except ValueError:
        return False
    return revoked_in_process(cert)


def any_active() -> bool:
    return len(_ACTIVE) > 0


__all__ = ["CrlError", "CrlSet", "Revocation", "any_active", "pem_revoked_in_process", "revoked_in_process"]

