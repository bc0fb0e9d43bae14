"""Revocation: CRLs and policy files of the test PKI, and a real ``kvsp-quic holder`` that reads them (and reloads
them on SIGHUP)."""

from __future__ import annotations

import contextlib
import datetime as dt
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from kvsp_dev import pki
from kvsp_dev.processes import RoleProcess
from quic.tls import TlsFiles

SCOPE = "0d" * 16


DESCRIPTOR = Path(__file__).resolve().parents[2] / "kvsp_quic" / "data" / "example-descriptor.json"


def write_crl(root: Path, revoked: list[str], path: Path, *, der: bool = False) -> None:
    """A CRL of the test CA revoking the client certificates *revoked* (by name)."""
    ca_cert, ca_key = pki.load_pair(root, "ca")
    now = dt.datetime.now(dt.UTC)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
               .last_update(now - dt.timedelta(minutes=1)).next_update(now + dt.timedelta(days=1)))
    for name in revoked:
        cert = x509.load_pem_x509_certificate((root / f"{name}.pem").read_bytes())
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(cert.serial_number).revocation_date(now).build())
    crl = builder.sign(ca_key, hashes.SHA256())
    path.write_bytes(crl.public_bytes(serialization.Encoding.DER if der else serialization.Encoding.PEM))


def write_policy(path: Path, clients: list[str]) -> None:
    lines = []
    for name in clients:
        lines += ["[[principal]]", f'identity = "urn:kvsp:client:{name}"', 'roles = ["client"]',
                  f'scopes = ["{SCOPE}"]', ""]
    path.write_text("\n".join(lines))


class Holder(RoleProcess):
    """``kvsp-quic holder`` with the test PKI, a policy file and a CRL; its log goes to a file (INFO lines)."""

    def __init__(self, tmp_path: Path, root: Path, policy: Path, crl: Path, workers: int) -> None:
        self.workers = workers
        self.log_file = tmp_path / "holder.log"
        super().__init__("holder", "holder", "--tls-dir", str(root), "--name", "server", "--listen", "127.0.0.1:0",
                         "--policy", str(policy), "--crl", str(crl), "--workers", str(workers), "--descriptor",
                         str(DESCRIPTOR), stderr=self.log_file, log_level="INFO")
        self.wait_ready()

    def reload(self, expect: str, timeout: float = 30.0) -> None:
        """SIGHUP, then wait for *expect* in the log once more than before from each process (they share it)."""
        before = self.log_file.read_text().count(expect)
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while self.log_file.read_text().count(expect) < before + self.workers:
            assert self.proc.poll() is None, f"the holder ended on SIGHUP: {self.log_file.read_text()}"
            assert time.monotonic() < deadline, f"no {expect!r} in the log: {self.log_file.read_text()}"
            time.sleep(0.1)


@contextlib.contextmanager
def holder(tmp_path: Path, root: Path, policy: Path, crl: Path, workers: int) -> Iterator[Holder]:
    server = Holder(tmp_path, root, policy, crl, workers)
    try:
        yield server
    finally:
        server.stop()


def make_files(root: Path, name: str) -> TlsFiles:
    return TlsFiles(root / "ca.pem", root / f"{name}.pem", root / f"{name}.key")
