"""A development PKI: one CA and a certificate per principal (``kvsp-quic certs init``).

Every KVSP role authenticates with a certificate whose SAN URI is its base URI (DESIGN.md section 4); client-only
principals carry a SAN URI ``urn:kvsp:client:<name>``. Server certificates also carry the host of the base URI
as SAN IP or DNS name, so that clients verify them like any HTTPS server. Keys are ECDSA P-256.

Files in the directory: ``ca.pem``, ``ca.key``, and ``<name>.pem`` + ``<name>.key`` per principal; keys are
written with mode 0600, every file atomically. ``init`` is idempotent: an existing CA is reused, and a principal's
certificate is reissued only when it is missing, expires within a day, or names another URI.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvsp_quic.fields import RecordError, https_uri

CLIENT_URI_PREFIX = "urn:kvsp:client:"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"  # '_' for container service names
_HOST_RE = re.compile(rf"(\*\.)?{_LABEL}(\.{_LABEL})*")
DEFAULT_DAYS = 825
_RENEW_BEFORE = dt.timedelta(days=1)

PrivateKey = ec.EllipticCurvePrivateKey


class PkiError(Exception):
    """A bad principal name or URI, or an unreadable CA; the message is one line for the user."""


@dataclass(frozen=True)
class Principal:
    name: str
    uri: str  # the SAN URI: a role's base URI, or urn:kvsp:client:<name>
    server: bool  # a role (serves and calls others) rather than a client only

    @property
    def hosts(self) -> list[str]:
        if not self.server:
            return []
        host = urlsplit(self.uri).hostname
        return [host] if host else []


def role(name: str, base_uri: str) -> Principal:
    check_name(name)
    parts = urlsplit(base_uri)
    if parts.scheme != "https" or not parts.hostname or not parts.path.endswith("/"):
        raise PkiError(f"role {name!r}: base URI must be https://host[:port]/path/ ending with '/', got {base_uri!r}")
    try:  # the rest of the checks every base URI of the protocol gets (no query or fragment, a valid port)
        https_uri(base_uri, f"role {name!r}")
    except RecordError as exc:
        raise PkiError(f"{exc.detail}: {base_uri!r}") from None
    return Principal(name, base_uri, server=True)


def client(name: str) -> Principal:
    check_name(name)
    return Principal(name, CLIENT_URI_PREFIX + name, server=False)


def check_host(host: str) -> str:
    """*host* in canonical form: an IP address, or a DNS name of ASCII labels (letters, digits, '-', '_'; a
    leading '*.' wildcard), lowercased."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if len(host) > 253 or not _HOST_RE.fullmatch(host):
        raise PkiError(f"host {host!r}: not an IP address or DNS name")
    return host.lower()


def check_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name) or name == "ca":
        raise PkiError(f"principal name {name!r}: use letters, digits, '.', '_' or '-' (not 'ca'), at most 64")
    return name


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key() -> PrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def create_ca(common_name: str = "kvsp-quic dev CA", *, key: PrivateKey | None = None,
              not_before: dt.datetime | None = None, days: int = 3650) -> tuple[x509.Certificate, PrivateKey]:
    key = key or new_key()
    start = not_before or _now() - dt.timedelta(minutes=5)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue(ca_cert: x509.Certificate, ca_key: PrivateKey, principal: Principal, *,
          extra_hosts: Iterable[str] = (), key: PrivateKey | None = None, not_before: dt.datetime | None = None,
          not_after: dt.datetime | None = None) -> tuple[x509.Certificate, PrivateKey]:
    """A leaf certificate for *principal*; *not_before* / *not_after* let tests make expired ones."""
    key = key or new_key()
    start = not_before or _now() - dt.timedelta(minutes=5)
    end = not_after or start + dt.timedelta(days=DEFAULT_DAYS)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(principal.uri)]
    for host in dict.fromkeys([*principal.hosts, *extra_hosts]):  # in order, once each
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if principal.server:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, principal.name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def san_uris(cert: x509.Certificate) -> list[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return list(ext.value.get_values_for_type(x509.UniformResourceIdentifier))


def san_hosts(cert: x509.Certificate) -> set[str]:
    """The SAN IP addresses and DNS names of *cert*, as text."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return set()
    return {*ext.value.get_values_for_type(x509.DNSName), *map(str, ext.value.get_values_for_type(x509.IPAddress))}


# -- files -----------------------------------------------------------------------------------------------------


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_pair(directory: Path, name: str, cert: x509.Certificate, key: PrivateKey) -> None:
    write_atomically(directory / f"{name}.key", key_pem(key), 0o600)
    write_atomically(directory / f"{name}.pem", cert_pem(cert))


def load_pair(directory: Path, name: str) -> tuple[x509.Certificate, PrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((directory / f"{name}.pem").read_bytes())
        key = serialization.load_pem_private_key((directory / f"{name}.key").read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise PkiError(f"cannot load {directory / name}.pem/.key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{directory / name}.key: only EC keys are supported by the dev PKI")
    return cert, key


@dataclass(frozen=True)
class Issued:
    name: str
    uri: str
    cert: Path
    key: Path
    created: bool


def init(directory: str | os.PathLike[str], principals: Sequence[Principal], *,
         extra_hosts: Sequence[str] = ()) -> tuple[Path, list[Issued]]:
    """Create or reuse the CA in *directory* and make sure every principal has a current certificate.

    *extra_hosts* (IP addresses or DNS names) are added to every role certificate besides its base URI's host;
    a certificate whose hosts differ from those wanted is reissued.
    """
    wanted_extra = [check_host(host) for host in extra_hosts]
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if (root / "ca.pem").exists() or (root / "ca.key").exists():
        ca_cert, ca_key = load_pair(root, "ca")
    else:
        ca_cert, ca_key = create_ca()
        write_pair(root, "ca", ca_cert, ca_key)
    out = []
    seen: dict[str, str] = {}
    for p in principals:
        if seen.get(p.name, p.uri) != p.uri:
            raise PkiError(f"principal {p.name!r} is given twice with different URIs")
        seen[p.name] = p.uri
        hosts = list(dict.fromkeys([*map(check_host, p.hosts), *wanted_extra])) if p.server else []
        created = not _current(root, p, ca_cert, hosts)
        if created:
            write_pair(root, p.name, *issue(ca_cert, ca_key, p, extra_hosts=hosts))
        out.append(Issued(p.name, p.uri, root / f"{p.name}.pem", root / f"{p.name}.key", created))
    return root / "ca.pem", out


def _current(root: Path, p: Principal, ca_cert: x509.Certificate, hosts: Sequence[str]) -> bool:
    if not (root / f"{p.name}.pem").exists() or not (root / f"{p.name}.key").exists():
        return False
    try:
        cert, _ = load_pair(root, p.name)
    except PkiError:
        return False
    return (cert.issuer == ca_cert.subject and san_uris(cert) == [p.uri] and san_hosts(cert) == set(hosts)
            and cert.not_valid_after_utc - _RENEW_BEFORE > _now())
