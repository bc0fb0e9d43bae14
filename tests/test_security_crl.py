"""Issue 13: revocation. A server role takes ``[tls] crl`` / ``--crl FILE`` (the CA's CRL) and refuses a peer
certificate it revokes at the handshake, over TCP (HTTP/1.1, HTTP/2: OpenSSL's CRL check) and QUIC (HTTP/3, MOQT:
quic.connection's client-certificate check); SIGHUP re-reads the policy and the CRL (kvsp_app.reload): new
handshakes and the next request on an established connection see the new ones, a broken file keeps the old ones.
A real ``kvsp-quic holder`` process on 127.0.0.1 with the test PKI (docs/security.md)."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
from pathlib import Path

import pytest
from cryptography import x509

from kvsp_dev import pki
from kvsp_quic.samples import example_descriptor
from moqt.aio import MoqtConnectError, connect_moqt
from quic.crl import CrlError, CrlSet
from tests.authz_matrix import TLS, Requester
from tests.pki import make_pki
from tests.support.crl import SCOPE, holder, make_files, write_crl, write_policy

TRANSPORTS = ("HTTP/1.1", "HTTP/2", "HTTP/3")
CLIENTS = ("alice", "bob", "carol", "dave", "erin")


def test_crl_files_are_checked(tmp_path: Path) -> None:
    root = tmp_path / "pki"
    tls = make_pki(root)
    crl = tmp_path / "ca.crl"
    write_crl(root, ["alice"], crl, der=True)  # DER is read as well as PEM
    loaded = CrlSet.load(crl, tls.ca.read_bytes())
    alice = x509.load_pem_x509_certificate((root / "alice.pem").read_bytes())
    bob = x509.load_pem_x509_certificate((root / "bob.pem").read_bytes())
    assert loaded.count == 1 and loaded.refusal(alice) == "the certificate is revoked" and loaded.refusal(bob) is None
    assert loaded.refusal(bob, dt.datetime.now(dt.UTC) + dt.timedelta(days=2)) is not None  # past nextUpdate
    with pytest.raises(CrlError, match="not signed by a CA"):  # another CA's CRL
        CrlSet.load(crl, (root / "foreign" / "ca.pem").read_bytes())
    crl.write_text("-----BEGIN X509 CRL-----\nbroken\n-----END X509 CRL-----\n")
    with pytest.raises(CrlError, match="not a PEM or DER CRL"):
        CrlSet.load(crl, tls.ca.read_bytes())


async def statuses(base: str, root: Path, name: str, requesters: dict[str, Requester] | None = None
                   ) -> dict[str, int | str]:
    """The answer to ``GET blocks/...`` for client *name* over each transport (``tls``: the handshake refused);
    *requesters* keeps their connections open for later requests."""
    compat = example_descriptor().compat_id.hex()
    path = f"blocks/{compat}/{SCOPE}/{'ab' * 32}"
    out: dict[str, int | str] = {}
    for transport in TRANSPORTS:
        requester = Requester(base, make_files(root, name), root / "ca.pem", transport)
        out[transport] = await requester.request("GET", path, None, {})
        if requesters is not None:
            requesters[transport] = requester
        else:
            await requester.aclose()
    return out


async def again(requesters: dict[str, Requester]) -> dict[str, int | str]:
    """The same request on the connections *requesters* hold (no new handshake unless the server closed one)."""
    compat = example_descriptor().compat_id.hex()
    path = f"blocks/{compat}/{SCOPE}/{'ab' * 32}"
    return {t: await r.request("GET", path, None, {}) for t, r in requesters.items()}


async def moqt_refused(moqt_uri: str, root: Path, name: str) -> bool:
    host, port = moqt_uri.removeprefix("moqt://").rstrip("/").rsplit(":", 1)
    try:
        conn = await connect_moqt(host, int(port), make_files(root, name), timeout=10)
    except (MoqtConnectError, ConnectionError):
        return True
    await conn.aclose()
    return False


def served(answers: dict[str, int | str]) -> bool:
    return all(a not in (TLS, 401, 403) for a in answers.values())


@pytest.mark.parametrize("workers", [1, 2])  # 2: the primary passes SIGHUP on to its worker process
async def test_revoked_clients_are_refused_and_sighup_reloads_the_crl_and_policy(tmp_path: Path,
                                                                                 workers: int) -> None:
    root = tmp_path / "pki"
    make_pki(root)
    ca_cert, ca_key = pki.load_pair(root, "ca")
    for name in ("carol", "dave", "erin"):
        pki.write_pair(root, name, *pki.issue(ca_cert, ca_key, pki.client(name)))
    policy, crl = tmp_path / "policy.toml", tmp_path / "ca.crl"
    write_policy(policy, [f"{n}" for n in CLIENTS])
    write_crl(root, ["alice"], crl)
    with holder(tmp_path, root, policy, crl, workers) as server:
        base, moqt = server.ready["base_uri"], server.ready["moqt"]
        # alice's certificate is revoked: refused at the handshake over every transport; the others are served
        assert await statuses(base, root, "alice") == {t: TLS for t in TRANSPORTS}
        assert await moqt_refused(moqt, root, "alice")
        for name in ("bob", "dave"):
            assert served(await statuses(base, root, name)), name
            assert not await moqt_refused(moqt, root, name)
        carols: dict[str, Requester] = {}  # carol keeps her connections across the reload
        erins: dict[str, Requester] = {}
        assert served(await statuses(base, root, "carol", carols))
        assert served(await statuses(base, root, "erin", erins))

        # bob and carol revoked, erin removed from the policy; SIGHUP
        write_crl(root, ["alice", "bob", "carol"], crl)
        write_policy(policy, ["alice", "bob", "carol", "dave"])
        server.reload("reloaded policy (4 principals) and CRL (3 revoked)")
        assert await statuses(base, root, "bob") == {t: TLS for t in TRANSPORTS}
        assert await moqt_refused(moqt, root, "bob")
        assert await again(carols) == {t: 403 for t in TRANSPORTS}  # her established connections: refused
        assert await again(erins) == {t: 403 for t in TRANSPORTS}  # not in the policy any more
        assert served(await statuses(base, root, "dave"))
        assert not await moqt_refused(moqt, root, "dave")

        # a broken CRL on SIGHUP: one ERROR line, the previous CRL (and policy) stay, the server serves on
        crl.write_text("-----BEGIN X509 CRL-----\nnot a CRL\n-----END X509 CRL-----\n")
        write_policy(policy, list(CLIENTS))
        server.reload("reload failed, keeping the previous policy and CRL")
        assert await statuses(base, root, "bob") == {t: TLS for t in TRANSPORTS}
        assert await statuses(base, root, "erin") == {t: 403 for t in TRANSPORTS}  # the policy was not applied
        assert served(await statuses(base, root, "dave"))
        # a broken policy is refused the same way
        write_crl(root, ["alice"], crl)
        policy.write_text("[[principal]]\nidentity = 3\n")
        server.reload("reload failed, keeping the previous policy and CRL")
        assert await statuses(base, root, "bob") == {t: TLS for t in TRANSPORTS}
        for requester in [*carols.values(), *erins.values()]:
            await requester.aclose()
        await asyncio.sleep(0)
        log = server.log_file.read_text()
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 2 * workers and all("reload failed" in line for line in errors), log
    assert server.proc.returncode == 0 or server.proc.returncode == -signal.SIGTERM


def test_the_tls_section_takes_a_crl(tmp_path: Path) -> None:
    from kvsp_app.config import HolderFile, build

    cfg = build(HolderFile, {"tls": {"ca": "ca.pem", "cert": "h.pem", "key": "h.key", "crl": "ca.crl"}},
                root=tmp_path)
    assert cfg.tls is not None and cfg.tls.crl == tmp_path / "ca.crl"
    assert build(HolderFile, {"tls": {"ca": "ca.pem", "cert": "h.pem", "key": "h.key"}}).tls.crl is None  # type: ignore[union-attr]
