"""The interop matrix's niquests-h3 driver (interop/drivers.py) against a real server: its workaround for niquests'
parse of URI subjectAltNames lets it talk to KVSP role certificates, while qh3 still verifies the chain -- a
server certificate of another CA is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from interop.drivers import PEERS_PYTHON, NiquestsDriver, Refused, Reply, Request
from quic.tls import TlsFiles
from tests.helpers import Process
from tests.peers import needs_peer
from tests.pki import make_pki

pytestmark = needs_peer(None if PEERS_PYTHON.exists() else f"no niquests environment at {PEERS_PYTHON}")


@pytest.fixture
def index(tmp_path: Path) -> Iterator[dict[str, Any]]:
    proc = Process("index", "--dev", "dev", cwd=tmp_path)
    try:
        yield {**proc.ready, "root": tmp_path}
    finally:
        proc.stop(15)


async def test_niquests_reads_a_kvsp_server_certificate_and_refuses_another_ca(index: dict[str, Any],
                                                                               tmp_path: Path) -> None:
    root = index["root"]
    url = f"{index['base_uri']}metrics"
    client = (root / index["client_cert"], root / index["client_key"])
    log: list[str] = []
    reply = await NiquestsDriver().send(Request("GET", url), TlsFiles(root / index["ca"], *client), log)
    assert isinstance(reply, Reply) and reply.status == 200 and reply.http_version == "h3", (reply, log)
    # the server certificate's identity, a URI, is in niquests' ConnectionInfo as the ssl module names it
    assert any(f"['URI', '{index['base_uri']}']" in line for line in log), log

    other = make_pki(tmp_path / "other")  # a CA that did not issue the server's certificate
    log = []
    refused = await NiquestsDriver().send(Request("GET", url), TlsFiles(other.ca, *client), log)
    assert isinstance(refused, Refused), (refused, log)
    # the one difference from the call above is the trust anchor: qh3 refused the server's certificate
    assert "server certificate is unacceptable" in refused.reason, refused.reason
