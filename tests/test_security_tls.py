"""Clients check servers by role identity (issue 13, docs/security.md): the server certificate's SAN URI must
name the origin of the base URI called (host, and port when the identity states one -- every ``--dev``
certificate does), and a QUIC server's certificate must allow serverAuth. Real servers on 127.0.0.1 with ``--dev``-style
certificates: every role's certificate names 127.0.0.1 and localhost, exactly as ``kvsp-quic ... --dev`` issues
them (``kvsp_app.serve``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from http3.client import KvspClient, TransportError
from http3.h3_client import H3ConnectError, connect_h3
from http3.server import RoleServer
from kvsp_dev import pki
from kvsp_moqt.relay_policy import kvsp_relay
from kvsp_moqt.relay_rules import RelayRules
from kvsp_quic.auth import Policy
from moqt.aio import MoqtConnectError, connect_moqt, moqt_handlers
from quic.listener import QuicListener
from quic.tls import TlsFiles, TransportSettings, serves
from tests.support.tls import Counting, dev_roles


def test_the_matching_rule() -> None:
    assert serves("https://127.0.0.1:8443/kvsp/", "https", "127.0.0.1", 8443, "/kvsp/blocks/x") is None
    assert serves("https://127.0.0.1:8443/kvsp/", "https", "127.0.0.1", 8444, "/kvsp/blocks/x")  # another port
    # one origin, one certificate: the path is not the certificate's to decide (IS and PC share a process)
    assert serves("https://127.0.0.1:8443/kvsp/", "https", "127.0.0.1", 8443, "/is/lookup") is None
    assert serves("https://127.0.0.1:8443/kvsp/", "https", "localhost", 8443, "/kvsp/x")  # another host name
    assert serves("https://h1.example/kvsp/", "https", "H1.EXAMPLE.", 9000, "/kvsp/x") is None  # no port stated
    assert serves("urn:kvsp:client:alice", "https", "127.0.0.1", 443, "/") is not None
    assert serves(None, "https", "127.0.0.1", 443, "/") is not None
    assert serves("https://[::1]:7/x/", "https", "::1", 7, "/x/y") is None
    assert serves("https://127.0.0.1:1/kvsp/", "moqt", "127.0.0.1", 2, "/") is None  # MOQT beside its https port


@pytest.mark.parametrize("transport", ["h3", "tcp"])
async def test_a_co_located_dev_role_cannot_answer_for_another(tmp_path: Path, transport: str) -> None:
    async with dev_roles(tmp_path) as (roles, client_files):
        (holder_pair, holder_base, _), (index_pair, index_base, index_files) = roles["holder"], roles["index"]
        # The index's process holds the holder's port (restarted in its place, or traffic sent there): its
        # certificate is valid for 127.0.0.1, but names the index, not the holder called.
        app = Counting()
        impostor = RoleServer(app, index_files)
        await impostor.start(sockets=holder_pair)
        genuine = RoleServer(app, index_files)
        await genuine.start(sockets=index_pair)
        try:
            async with KvspClient(client_files, prefer=transport, fallback=False, retries=0) as client:
                with pytest.raises(TransportError, match="not the role at port"):
                    await client.request("GET", f"{holder_base}blocks/x")
                assert app.requests == 0  # nothing was sent to the wrong role
                assert (await client.request("GET", f"{index_base}lookup")).status == 200
                assert app.requests == 1
        finally:
            await impostor.close()
            await genuine.close()


async def test_a_client_certificate_never_authenticates_a_server(tmp_path: Path) -> None:
    """A principal's client certificate (clientAuth only) that names 127.0.0.1 cannot serve, over QUIC or TCP."""
    pki.init(tmp_path, [pki.client("dev")])
    ca_cert, ca_key = pki.load_pair(tmp_path, "ca")
    pki.write_pair(tmp_path, "rogue", *pki.issue(ca_cert, ca_key, pki.client("rogue"), extra_hosts=["127.0.0.1"]))
    server = RoleServer(Counting(), TlsFiles.in_dir(tmp_path, "rogue"))
    await server.start("127.0.0.1", 0)
    try:
        with pytest.raises(H3ConnectError, match=r"server authentication|unsupported"):
            await connect_h3("127.0.0.1", server.port, TlsFiles.in_dir(tmp_path, "dev"), settings=TransportSettings(),
                             timeout=5)
        async with KvspClient(TlsFiles.in_dir(tmp_path, "dev"), prefer="tcp", fallback=False, retries=0) as c:
            with pytest.raises(TransportError):
                await c.request("GET", f"https://127.0.0.1:{server.port}/")
    finally:
        await server.close()


async def test_moqt_clients_pin_the_relay_identity(tmp_path: Path) -> None:
    async with dev_roles(tmp_path) as (roles, client_files):
        _, holder_base, _ = roles["holder"]
        _, index_base, index_files = roles["index"]
        relay = kvsp_relay(RelayRules(Policy.dev_ca()))
        listener = QuicListener(index_files, moqt_handlers(relay))
        await listener.start("127.0.0.1", 0)
        try:
            with pytest.raises(MoqtConnectError, match="is not"):
                await connect_moqt("127.0.0.1", listener.port, client_files, expect_identity=holder_base, timeout=5)
            conn = await connect_moqt("127.0.0.1", listener.port, client_files, expect_identity=index_base,
                                      timeout=5)
            assert conn.peer_identity == index_base
            await conn.aclose()
        finally:
            await relay.aclose()
            await listener.close()
