"""MOQT servers as configured (issue 17): the operator's draft order (``moqt_alpns``), and a refused QUIC
handshake leaving a log line and a counter -- the listener sees it before any MOQT handler exists and reports it to
the role's audit (``kvsp_moqt_handshakes_refused_total{side="server"}``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from http3.client import KvspClient
from kvsp_dev import pki
from moqt.aio import MoqtConnectError, connect_moqt
from quic.tls import TlsFiles
from tests.helpers import Process


def _refused(scrape: bytes) -> dict[str, float]:
    out = {}
    for m in re.finditer(rb'kvsp_moqt_handshakes_refused_total\{reason="([^"]+)",side="server"\} ([0-9.e+]+)', scrape):
        out[m.group(1).decode()] = float(m.group(2))
    return out


async def test_a_certificate_of_another_ca_is_refused_logged_and_counted(tmp_path: Path) -> None:
    relay = Process("relay", "--dev", str(tmp_path / "dev"), "--workers", "1", "--log-level", "INFO")
    err = ""
    try:
        ready = relay.ready
        port = int(ready["moqt"].rsplit(":", 1)[1].strip("/"))
        ours = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
        # mallory's certificate comes from her own CA; she trusts ours, so only the server can refuse
        pki.init(tmp_path / "mallory", [pki.client("mallory")])
        theirs = TlsFiles(Path(ready["ca"]), tmp_path / "mallory" / "mallory.pem", tmp_path / "mallory" / "mallory.key")
        async with KvspClient(ours) as client:
            before = _refused((await client.request("GET", f"{ready['base_uri']}metrics")).content or b"")
            with pytest.raises(MoqtConnectError):
                await connect_moqt("127.0.0.1", port, theirs, timeout=5)
            after = before
            for _ in range(50):
                after = _refused((await client.request("GET", f"{ready['base_uri']}metrics")).content or b"")
                if sum(after.values()) > sum(before.values()):
                    break
            assert sum(after.values()) == sum(before.values()) + 1, (before, after)
            (reason,) = [r for r in after if after[r] != before.get(r, 0)]
            assert reason in ("bad_certificate", "unknown_ca", "certificate_unknown"), reason
    finally:
        err = relay.stop()
    assert "MOQT handshake refused (server side): peer 127.0.0.1:" in err


@pytest.mark.parametrize("order", [["moq-00"], ["moq-00", "moqt-18"], ["moqt-18", "moq-00"]])
async def test_the_configured_draft_order_decides(tmp_path: Path, order: list[str]) -> None:
    config = tmp_path / "relay.toml"
    alpns = ", ".join(f'"{a}"' for a in order)
    config.write_text(f"[relay]\nmoqt_alpns = [{alpns}]\n")
    relay = Process("relay", "--dev", str(tmp_path / "dev"), "--workers", "1", "--config", str(config))
    try:
        ready = relay.ready
        files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
        port = int(ready["moqt"].rsplit(":", 1)[1].strip("/"))
        conn = await connect_moqt("127.0.0.1", port, files, timeout=5)  # we offer both, newest first
        try:
            assert conn.alpn == order[0]  # the server's preference wins
        finally:
            await conn.aclose()
    finally:
        assert "Traceback" not in relay.stop()
