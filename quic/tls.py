"""TLS material and settings shared by every transport: QUIC (aioquic) and TCP (``ssl``).

Mutual TLS is the mode of every KVSP role: servers require a client certificate issued by the configured CA,
clients verify the server against the same CA, both present their own certificate, TLS 1.3 only (spec, "HTTP
Usage"). The one exception is the OpenAI-compatible front end, whose users are not KVSP principals:
``TransportSettings.client_cert_optional`` lets a client without a certificate finish the handshake (one that is
sent is still verified), and the app authenticates by API key.
The peer's verified chain is exposed to ASGI apps through the TLS extension, built by :func:`tls_extension`
in one place for every transport, so the identity an app sees does not depend on the transport.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from quic.crl import Revocation, any_active, revoked_in_process

ALPN_H3 = "h3"
ALPN_MOQT_14 = "moq-00"
ALPN_MOQT_18 = "moqt-18"
TLS_1_3 = 0x0304


class TlsConfigError(Exception):
    """Missing or unreadable certificate, key or CA file; one line for the user."""


@dataclass(frozen=True)
class TlsFiles:
    """A principal's certificate and key, and the CA that issues every peer's certificate."""

    ca: Path
    cert: Path
    key: Path
    # The CRL of the CA (``[tls] crl``; servers only): peer certificates it revokes are refused (quic.crl)
    crl: Revocation | None = field(default=None, compare=False)

    @classmethod
    def of(cls, ca: str | os.PathLike[str], cert: str | os.PathLike[str],
           key: str | os.PathLike[str]) -> TlsFiles:
        files = cls(Path(ca), Path(cert), Path(key))
        for what, path in (("CA", files.ca), ("certificate", files.cert), ("key", files.key)):
            if not path.is_file():
                raise TlsConfigError(f"{what} file {os.fspath(path)!r} does not exist")
        return files

    @classmethod
    def in_dir(cls, directory: str | os.PathLike[str], name: str) -> TlsFiles:
        """The files ``kvsp-quic certs init`` writes: DIR/ca.pem, DIR/NAME.pem, DIR/NAME.key."""
        root = Path(directory)
        return cls.of(root / "ca.pem", root / f"{name}.pem", root / f"{name}.key")

    @functools.cached_property
    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    @functools.cached_property
    def ca_pem(self) -> bytes:
        return self.ca.read_bytes()


@dataclass(frozen=True)
class TransportSettings:
    """Tuning and limits of the HTTP transports (FACTS.md lists what mattered on loopback)."""

    max_datagram_size: int = 16384  # QUIC payload per datagram; loopback tolerates 16 KiB, not 32 KiB; real
    # networks carry 1452 (1500 octet MTU, IPv4) or 8952 (9000): the benchmarks measure all three
    pacing_burst: int = 256 << 10  # octets QUIC sends back to back before pacing waits (quic.connection, point 5)
    stream_window: int = 16 << 20  # per-stream receive window (octets not yet consumed by the app)
    connection_window: int = 64 << 20  # per-connection receive window
    socket_buffer: int = 4 << 20  # SO_RCVBUF / SO_SNDBUF of UDP sockets
    send_buffer: int = 4 << 20  # per-stream unsent + unacknowledged octets before a writer waits
    connection_send_buffer: int = 16 << 20  # the same over all the streams of a connection (issue 13)
    idle_timeout: float = 60.0
    # Slow and idle peers (issue 13, "resource tests"): a TCP peer that has begun a request head (HTTP/1.1) or a
    # header block (HTTP/2) has this long to finish it, or the connection is closed (slowloris).
    header_timeout: float = 10.0
    # Connections per listener (TCP and QUIC each), all peers together and per peer IP address; beyond them a
    # TCP connection is closed once accepted and a QUIC Initial is answered with CONNECTION_REFUSED.
    max_connections: int = 8192
    max_connections_per_address: int = 1024
    max_streams: int = 128  # concurrent request streams per connection
    max_header_bytes: int = 64 << 10
    max_body_bytes: int = 1 << 30  # request bodies larger than this get 413
    shutdown_grace: float = 10.0  # graceful shutdown waits this long for in-flight requests
    extra_alpn: Mapping[str, Any] = field(default_factory=dict)  # reserved for MOQT handlers (ALPN -> factory)
    # The OpenAI-compatible front end only (``kvsp-quic frontend``): its users authenticate with a client
    # certificate *or* an API key, so its listeners ask for a certificate, verify one that is sent, and accept a
    # handshake without one (the app then requires ``Authorization: Bearer``). Every KVSP role keeps the default.
    client_cert_optional: bool = False


def ssl_server_context(files: TlsFiles, alpn: Sequence[str] = ("h2", "http/1.1"), *,
                       client_cert_optional: bool = False) -> ssl.SSLContext:
    """TLS 1.3 over TCP; a client certificate from the CA is required (*client_cert_optional*: asked for and
    verified when sent, but a client may send none -- the front end's API-key users)."""
    def build(crl_pem: str | None) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_OPTIONAL if client_cert_optional else ssl.CERT_REQUIRED
        _load(ctx, files)
        ctx.set_alpn_protocols(list(alpn))
        if crl_pem is not None:  # OpenSSL refuses a revoked leaf, or one whose issuer has no (current) CRL
            _load_crls(ctx, crl_pem)
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
            ctx.num_tickets = 0  # no TLS 1.3 resumption: it would skip the certificate check of a revoked peer
        return ctx

    revocation = files.crl
    if revocation is None:
        return build(None)
    first = build(revocation.current.pem)
    key = object()  # this listener's contexts, one per CRL generation

    def current(ssl_object: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _ctx: ssl.SSLContext) -> None:
        # Called by OpenSSL for every ClientHello, before the client certificate is verified: a handshake after a
        # reload (SIGHUP) is moved to the context whose store holds the CRLs read last (quic.crl).
        ctx = revocation.current_context(key, build)
        if ssl_object.context is not ctx:
            ssl_object.context = ctx

    revocation.current_context(key, lambda _pem: first)
    first.sni_callback = current
    return first


def _load_crls(ctx: ssl.SSLContext, crl_pem: str) -> None:
    # ``cadata`` takes certificates only; a PEM file given as ``cafile`` may hold CRLs (X509_load_cert_crl_file)
    with tempfile.NamedTemporaryFile("w", suffix=".crl.pem") as tmp:
        tmp.write(crl_pem)
        tmp.flush()
        ctx.load_verify_locations(cafile=tmp.name)


def ssl_client_context(files: TlsFiles, alpn: Sequence[str] = ("h2", "http/1.1")) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load(ctx, files)
    ctx.set_alpn_protocols(list(alpn))
    return ctx


def _load(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    try:
        ctx.load_verify_locations(cafile=os.fspath(files.ca))
        ctx.load_cert_chain(os.fspath(files.cert), os.fspath(files.key))
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load TLS files ({files.cert}, {files.key}, CA {files.ca}): {exc}") from None


@dataclass
class KvspQuicConfiguration(QuicConfiguration):
    """aioquic's configuration and, on a server, the CRL its client-certificate check consults
    (:func:`quic.connection.verify_client_certificate`)."""

    revocation: Revocation | None = None


def quic_configuration(files: TlsFiles, *, is_client: bool, alpn: Sequence[str],
                       settings: TransportSettings = TransportSettings(),
                       server_name: str | None = None) -> QuicConfiguration:
    """An aioquic configuration with our certificate, the CA, and the tuned windows and datagram size.

    On the server side this alone does not make aioquic ask for or verify client certificates: the server
    in :mod:`quic.listener` installs :mod:`http3.quic_tls` on every connection for that.
    """
    config = KvspQuicConfiguration(
        revocation=None if is_client else files.crl,
        is_client=is_client,
        alpn_protocols=list(alpn),
        max_datagram_size=settings.max_datagram_size,
        max_data=settings.connection_window,
        max_stream_data=settings.stream_window,
        idle_timeout=settings.idle_timeout,
        verify_mode=ssl.CERT_REQUIRED,
        server_name=server_name,
    )
    try:
        config.load_cert_chain(os.fspath(files.cert), os.fspath(files.key))
        config.load_verify_locations(cadata=files.ca_pem)
    except (OSError, ValueError) as exc:
        raise TlsConfigError(f"cannot load TLS files ({files.cert}, {files.key}, CA {files.ca}): {exc}") from None
    return config


# -- The ASGI TLS extension --------------------------------------------------------------------------------------


def tls_extension(peer_chain_der: Sequence[bytes], *, server_cert_pem: bytes | None, tls_version: int | None,
                  cipher_suite: int | None) -> dict[str, Any]:
    """``scope["extensions"]["tls"]`` of the ASGI TLS extension, from the verified peer chain (DER, leaf first)."""
    chain = [_der_to_pem(der) for der in peer_chain_der]
    return {
        "server_cert": server_cert_pem.decode("ascii") if server_cert_pem else None,
        "client_cert_chain": chain,
        "client_cert_name": _subject_of(peer_chain_der[0]) if peer_chain_der else None,
        "client_cert_error": None,
        "tls_version": tls_version,
        "cipher_suite": cipher_suite,
    }


@functools.lru_cache(maxsize=4096)
def _der_to_pem(der: bytes) -> str:
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM).decode("ascii")


@functools.lru_cache(maxsize=4096)
def _subject_of(der: bytes) -> str:
    return x509.load_der_x509_certificate(der).subject.rfc4514_string()


@functools.lru_cache(maxsize=4096)
def identity_of_pem(pem: str) -> str | None:
    """The identity of a certificate: its single SAN URI (None when it has none or several)."""
    cert = x509.load_pem_x509_certificate(pem.encode("ascii"))
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        return None
    return uris[0] if len(uris) == 1 else None


# -- The server's role identity (clients) ----------------------------------------------------------------------
#
# A client that calls a role checks, besides the chain and the host name, that the server *is* that role: its
# certificate's SAN URI (the role's base URI, its identity) must cover the URL called (:func:`serves`). Without
# this, any certificate of the CA naming the host -- every ``--dev`` certificate names 127.0.0.1 and localhost --
# would answer for any role there. A server certificate must also allow serverAuth (a client's certificate,
# which ``kvsp_dev.pki`` issues with clientAuth only, never serves).


class ServerIdentityError(ConnectionError):
    """The server's certificate is valid, but not for the role called: one line for the user."""


@functools.lru_cache(maxsize=4096)
def identity_of_der(der: bytes) -> str | None:
    """The identity of a DER certificate: its single SAN URI (None when it has none or several)."""
    cert = x509.load_der_x509_certificate(der)
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except (x509.ExtensionNotFound, ValueError):
        return None
    return uris[0] if len(uris) == 1 else None


def _host(host: str | None) -> str:
    text = (host or "").lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        return text


def serves(identity: str | None, scheme: str, host: str, port: int, path: str) -> str | None:
    """None when a server whose certificate names *identity* may answer for ``scheme://host:port/path``; else
    why not (one line). The identity must be an ``https`` base URI of the URL's origin: its host is *host* (IP
    addresses compared as addresses, names case-insensitively) and its port -- when it states one -- is *port*;
    an identity without a port names the role on any port (test and deployment PKIs that do not fix ports;
    ``--dev`` certificates always state theirs, and co-located roles differ by port). The base path is not
    compared: an origin is one TLS endpoint with one certificate and one SAN URI, so roles that share an origin
    (the Index Service and the PC in one process) share it, and *path* is kept for the callers' messages.
    *scheme* ``moqt``: the port is not compared (a MOQT endpoint listens beside its role's ``https`` port)."""
    if identity is None:
        return "the server certificate names no role (no single SAN URI)"
    try:
        parts = urlsplit(identity)
        wanted_port = parts.port
    except ValueError:
        return f"the server certificate's SAN URI {identity!r} is not a base URI"
    if parts.scheme != "https" or not parts.hostname or not parts.path.endswith("/"):
        return f"the server's identity {identity!r} is not a role's https base URI"
    if _host(parts.hostname) != _host(host):
        return f"the server's identity {identity!r} is not for host {host}"
    if scheme != "moqt" and wanted_port is not None and wanted_port != port:
        return f"the server's identity {identity!r} is not the role at port {port}"
    return None


def check_server_auth(cert: x509.Certificate) -> None:
    """ValueError unless *cert* may authenticate a server (no Extended Key Usage, or one with serverAuth)."""
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return
    if ExtendedKeyUsageOID.SERVER_AUTH not in eku:
        raise ValueError("the server certificate is not valid for server authentication (no serverAuth)")


def ssl_peer_identity(transport: Any) -> str | None:
    """The SAN URI of the peer certificate of an asyncio TLS *transport* (None: none, or not TLS)."""
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return identity_of_der(der) if der else None


def scope_identity(scope: Mapping[str, Any]) -> str | None:
    """The authenticated identity of an ASGI request, or None when there is no verified client certificate or a
    CRL loaded in this process revokes it since the connection was established (quic.crl; SIGHUP reload)."""
    tls = scope.get("extensions", {}).get("tls")
    if not tls or tls.get("client_cert_error") or not tls.get("client_cert_chain"):
        return None
    leaf = tls["client_cert_chain"][0]
    if any_active() and revoked_in_process(_cert_of_pem(leaf)):
        return None
    return identity_of_pem(leaf)


@functools.lru_cache(maxsize=4096)
def _cert_of_pem(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode("ascii"))
