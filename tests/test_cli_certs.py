from __future__ import annotations

import ipaddress
import json
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from kvsp_dev import pki
from quic.tls import scope_identity
from tests.asgi import http_scope
from tests.helpers import run_cli

H1 = "https://127.0.0.1:4433/kvsp/"
INDEX = "https://index.example:8443/"


def load(path: str | Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


def sans(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def eku(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_init_prints_and_writes_the_pki(capsys, tmp_path: Path) -> None:
    d = tmp_path / "pki"
    code, out, err = run_cli(capsys, "certs", "init", str(d), "--role", f"h1={H1}", "--role", f"index={INDEX}",
                         "--client", "alice")
    assert code == 0, err
    report = json.loads(out)
    assert report["ca"] == str(d / "ca.pem")
    assert report["principals"] == [
        {"name": "h1", "uri": H1, "cert": str(d / "h1.pem"), "key": str(d / "h1.key"), "created": True},
        {"name": "index", "uri": INDEX, "cert": str(d / "index.pem"), "key": str(d / "index.key"), "created": True},
        {"name": "alice", "uri": "urn:kvsp:client:alice", "cert": str(d / "alice.pem"), "key": str(d / "alice.key"),
         "created": True},
    ]
    ca = load(d / "ca.pem")
    h1, index, alice = load(d / "h1.pem"), load(d / "index.pem"), load(d / "alice.pem")
    for cert in (h1, index, alice):
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
    assert sans(h1).get_values_for_type(x509.UniformResourceIdentifier) == [H1]
    assert sans(h1).get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert sans(index).get_values_for_type(x509.DNSName) == ["index.example"]
    assert eku(h1) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    assert sans(alice).get_values_for_type(x509.UniformResourceIdentifier) == ["urn:kvsp:client:alice"]
    assert eku(alice) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    for name in ("ca", "h1", "index", "alice"):
        assert stat.S_IMODE(os.stat(d / f"{name}.key").st_mode) == 0o600
    # The identity the servers will see is the certificate's SAN URI.
    scope = http_scope(pem=(d / "alice.pem").read_text())
    assert scope_identity(scope) == "urn:kvsp:client:alice"


def test_reuse_keeps_files_and_reissues_what_changed(capsys, tmp_path: Path) -> None:
    d = tmp_path / "pki"
    args = ["certs", "init", str(d), "--role", f"h1={H1}", "--role", f"index={INDEX}", "--client", "alice"]
    assert run_cli(capsys, *args)[0] == 0
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and [p["created"] for p in json.loads(out)["principals"]] == [False, False, False]
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # byte-identical, CA included

    moved = "https://127.0.0.1:4434/kvsp/"
    code, out, _ = run_cli(capsys, "certs", "init", str(d), "--role", f"h1={moved}", "--role", f"index={INDEX}",
                       "--client", "alice", "--client", "bob")
    assert code == 0
    assert {p["name"]: p["created"] for p in json.loads(out)["principals"]} == {
        "h1": True, "index": False, "alice": False, "bob": True}
    after = {p.name: p.read_bytes() for p in d.iterdir()}
    for name in ("ca.pem", "ca.key", "index.pem", "index.key", "alice.pem", "alice.key"):
        assert after[name] == before[name], name
    assert after["h1.pem"] != before["h1.pem"] and after["h1.key"] != before["h1.key"]
    assert sans(load(d / "h1.pem")).get_values_for_type(x509.UniformResourceIdentifier) == [moved]
    load(d / "h1.pem").verify_directly_issued_by(load(d / "ca.pem"))


def test_extra_hosts(capsys, tmp_path: Path) -> None:
    d = tmp_path / "pki"
    code, _, err = run_cli(capsys, "certs", "init", str(d), "--role", f"index={INDEX}", "--client", "alice",
                       "--host", "localhost", "--host", "::1", "--host", "127.0.0.1")
    assert code == 0, err
    names = sans(load(d / "index.pem"))
    assert names.get_values_for_type(x509.DNSName) == ["index.example", "localhost"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("::1"), ipaddress.ip_address("127.0.0.1")]
    assert sans(load(d / "alice.pem")).get_values_for_type(x509.DNSName) == []  # clients get no hosts
    # The same hosts: nothing is reissued; another set of hosts: the role certificates are.
    code, out, _ = run_cli(capsys, "certs", "init", str(d), "--role", f"index={INDEX}", "--client", "alice",
                       "--host", "LOCALHOST", "--host", "0:0::1", "--host", "127.0.0.1")
    assert code == 0 and [p["created"] for p in json.loads(out)["principals"]] == [False, False]
    code, out, _ = run_cli(capsys, "certs", "init", str(d), "--role", f"index={INDEX}", "--client", "alice")
    assert code == 0 and [p["created"] for p in json.loads(out)["principals"]] == [True, False]
    assert sans(load(d / "index.pem")).get_values_for_type(x509.IPAddress) == []


def test_only_a_ca(capsys, tmp_path: Path) -> None:
    code, out, _ = run_cli(capsys, "certs", "init", str(tmp_path / "new" / "dir"))
    assert code == 0 and json.loads(out) == {"ca": str(tmp_path / "new" / "dir" / "ca.pem"), "principals": []}
    assert load(tmp_path / "new" / "dir" / "ca.pem").extensions.get_extension_for_class(x509.BasicConstraints).value.ca


@pytest.mark.parametrize(("args", "message"), [
    (["--role", "h1"], "--role 'h1': expected NAME=BASE_URI"),
    (["--role", "=https://h/"], "--role '=https://h/': expected NAME=BASE_URI"),
    (["--role", "h1="], "--role 'h1=': expected NAME=BASE_URI"),
    (["--role", "h1=http://h/"], "role 'h1': base URI must be https://host[:port]/path/ ending with '/'"),
    (["--role", "h1=https://h/kvsp"], "ending with '/', got 'https://h/kvsp'"),
    (["--role", "h1=https://h/?q=1"], "role 'h1': a base URI has no query or fragment"),
    (["--role", "h1=https://h:70000/"], "role 'h1': not a valid URI"),
    (["--role", "ca=https://h/"], "principal name 'ca'"),
    (["--client", "a b"], "principal name 'a b'"),
    (["--role", "x=https://h/", "--client", "x"], "principal 'x' is given twice with different URIs"),
    (["--host", "bad host"], "host 'bad host': not an IP address or DNS name"),
])
def test_errors_are_one_line(capsys, tmp_path: Path, args: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, "certs", "init", str(tmp_path / "d"), *args)
    assert code == 1 and out == ""
    assert message in err and err.startswith("kvsp-quic: error: ") and err.count("\n") == 1


def test_unreadable_ca_is_an_error(capsys, tmp_path: Path) -> None:
    d = tmp_path / "pki"
    d.mkdir()
    (d / "ca.pem").write_text("not a certificate")
    code, out, err = run_cli(capsys, "certs", "init", str(d), "--client", "alice")
    assert code == 1 and out == "" and f"cannot load {d / 'ca'}.pem/.key" in err and err.count("\n") == 1
    assert not (d / "alice.pem").exists()
    (d / "ca.pem").unlink()  # a key without its certificate is not silently replaced either
    (d / "ca.key").write_text("x")
    code, _, err = run_cli(capsys, "certs", "init", str(d), "--client", "alice")
    assert code == 1 and "cannot load" in err and err.count("\n") == 1


def test_directory_errors(capsys, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run_cli(capsys, "certs", "init", str(blocker / "sub"), "--client", "alice")
    assert code == 1 and "kvsp-quic: error:" in err and err.count("\n") == 1


def test_help_and_usage(capsys) -> None:
    for cmd in (["certs"], ["certs", "init"]):
        code, out, _ = run_cli(capsys, *cmd, "--help")
        assert code == 0 and "usage:" in out
    code, out, _ = run_cli(capsys, "certs", "init", "--help")
    assert "--role NAME=BASE_URI" in out and "--client NAME" in out and "--host H" in out
    code, _, err = run_cli(capsys, "certs")
    assert code == 2 and "usage:" in err
    code, _, err = run_cli(capsys, "certs", "init")
    assert code == 2 and "DIR" in err


def test_library_init_matches(tmp_path: Path) -> None:
    """The CLI is a thin wrapper: pki.init gives the same reuse decision."""
    ca, issued = pki.init(tmp_path, [pki.client("alice")])
    assert ca == tmp_path / "ca.pem" and issued[0].created
    _, again = pki.init(tmp_path, [pki.client("alice")], extra_hosts=["ignored.for.clients"])
    assert not again[0].created
