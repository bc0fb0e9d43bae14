"""Test PKI: a CA with certificates for roles and clients, plus the bad ones every transport must refuse.

``make_pki(tmp_path)`` writes, with ``kvsp_dev.pki``:
  ca.pem/ca.key, server.pem/.key (role "server" at https://127.0.0.1:<any>/ -- hosts 127.0.0.1 and localhost),
  alice.pem/.key (client "alice"), expired.pem/.key, notyet.pem/.key (clients of the same CA, out of validity),
  foreign/ca.pem + foreign/mallory.pem/.key (a client of another CA), nouri.pem/.key (same CA, no SAN URI),
  plain.pem/.key (a server certificate for 127.0.0.1 / localhost with no SAN URI, for peers that cannot parse one).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from kvsp_dev import pki
from quic.tls import TlsFiles

SERVER_URI = "https://127.0.0.1/"


@dataclass(frozen=True)
class TestPki:
    __test__ = False  # not a pytest test class
    root: Path

    def files(self, name: str) -> TlsFiles:
        return TlsFiles(self.root / "ca.pem", self.root / f"{name}.pem", self.root / f"{name}.key")

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    @property
    def foreign(self) -> TlsFiles:
        return TlsFiles(self.root / "foreign" / "ca.pem", self.root / "foreign" / "mallory.pem",
                        self.root / "foreign" / "mallory.key")


def make_pki(root: Path, *, roles: dict[str, str] | None = None) -> TestPki:
    roles = roles or {"server": SERVER_URI}
    principals = [pki.role(name, uri) for name, uri in roles.items()] + [pki.client("alice"), pki.client("bob")]
    pki.init(root, principals)
    ca_cert, ca_key = pki.load_pair(root, "ca")
    for name in roles:  # servers answer on 127.0.0.1 and localhost whatever their base URI says
        cert, key = pki.issue(ca_cert, ca_key, pki.role(name, roles[name]), extra_hosts=["localhost", "127.0.0.1"])
        pki.write_pair(root, name, cert, key)
    now = dt.datetime.now(dt.UTC)
    expired = pki.issue(ca_cert, ca_key, pki.client("expired"), not_before=now - dt.timedelta(days=10),
                        not_after=now - dt.timedelta(days=1))
    pki.write_pair(root, "expired", *expired)
    notyet = pki.issue(ca_cert, ca_key, pki.client("notyet"), not_before=now + dt.timedelta(days=1),
                       not_after=now + dt.timedelta(days=10))
    pki.write_pair(root, "notyet", *notyet)
    key = pki.new_key()
    nouri = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nouri")]))
             .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .sign(ca_key, hashes.SHA256()))
    pki.write_pair(root, "nouri", nouri, key)
    key = pki.new_key()
    plain = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "plain")]))
             .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
             .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                         x509.DNSName("localhost")]), critical=False)
             .sign(ca_key, hashes.SHA256()))
    pki.write_pair(root, "plain", plain, key)
    foreign = root / "foreign"
    foreign.mkdir(exist_ok=True)
    pki.init(foreign, [pki.client("mallory")])
    return TestPki(root)
