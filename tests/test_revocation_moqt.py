"""Issue 13: revocation reaches established MOQT sessions. On a reload of the policy and the CRL (SIGHUP;
kvsp_app.reload.reload_now, which the handler calls), every MOQT session of the process whose peer
certificate is now revoked, or whose identity lost every right it used, is closed with the session error
UNAUTHORIZED (moqt/aio/revocation.py); the peer's next handshake is refused; other sessions are untouched.
Real servers on 127.0.0.1: a relay and a holder in this process (the holder publishing to the relay over its own
session), and a ``kvsp-quic holder`` process reloaded with SIGHUP."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest

from kvsp_app.reload import reload_now
from kvsp_dev import pki
from kvsp_moqt.holder_tracks import HolderTracks
from kvsp_moqt.relay_policy import kvsp_relay
from kvsp_moqt.relay_rules import RelayRules
from kvsp_moqt.tracks import moqt_record
from kvsp_quic.auth import Policy
from kvsp_quic.roles.holder import Holder, HolderSettings
from moqt.aio import AUDIT, MoqtConnectError, MoqtConnection, connect_moqt, moqt_handlers
from moqt.errors import SessionErrorCode
from moqt.relay import RelayConfig
from quic.crl import Revocation
from quic.listener import QuicListener
from tests.pki import TestPki, make_pki
from tests.support.crl import holder, make_files, write_crl
from tests.support.descriptors import small_descriptor
from tests.support.moqt_relay import HOLDER_URI, RELAY_URI, SCOPE, World, layers

CLIENTS = ("alice", "bob", "carol")


def write_policy(path: Path, clients: tuple[str, ...]) -> None:
    lines = ["[[principal]]", f'identity = "{HOLDER_URI}"', 'roles = ["holder"]', 'scopes = "*"', "",
             "[[principal]]", f'identity = "{RELAY_URI}"', 'roles = ["holder"]', 'scopes = "*"', ""]
    for name in clients:
        lines += ["[[principal]]", f'identity = "urn:kvsp:client:{name}"', 'roles = ["client"]',
                  f'scopes = ["{SCOPE.hex()}"]', ""]
    path.write_text("\n".join(lines))


def make_root(tmp_path: Path, roles: dict[str, str] | None = None) -> TestPki:
    """The test PKI (alice, bob) with carol too; *roles*: the server certificates (default: ``server``)."""
    certs = make_pki(tmp_path / "pki", roles=roles)
    ca_cert, ca_key = pki.load_pair(certs.root, "ca")
    pki.write_pair(certs.root, "carol", *pki.issue(ca_cert, ca_key, pki.client("carol")))
    return certs


async def until_closed(conn: MoqtConnection, seconds: float = 1.0) -> None:
    async with asyncio.timeout(seconds):
        while conn.closed is None:
            await asyncio.sleep(0.01)


async def test_a_reload_closes_the_moqt_sessions_of_revoked_and_removed_peers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    certs = make_root(tmp_path, {"holder": HOLDER_URI, "relay": RELAY_URI})
    root = certs.root
    policy_file, crl = tmp_path / "policy.toml", tmp_path / "ca.crl"
    write_policy(policy_file, CLIENTS)
    write_crl(root, [], crl)
    policy = Policy.load(policy_file)
    revocation = Revocation(crl, (root / "ca.pem").read_bytes())
    files = {name: dataclasses.replace(make_files(root, name), crl=revocation) for name in ("relay", "holder")}
    d = small_descriptor(layers=32)
    store = Holder(HolderSettings(HOLDER_URI, (d,)))
    tracks = HolderTracks(store, policy)
    relay = kvsp_relay(RelayRules(policy), RelayConfig())
    relay_listener = QuicListener(files["relay"], moqt_handlers(relay, data_streams=8))
    holder_listener = QuicListener(files["holder"], moqt_handlers(tracks))
    await relay_listener.start("127.0.0.1", 0)
    await holder_listener.start("127.0.0.1", 0)
    w = World(relay, relay_listener, store, tracks, d, certs)
    conns: list[MoqtConnection] = []

    async def connect(name: str, port: int) -> MoqtConnection:
        conn = await connect_moqt("127.0.0.1", port, make_files(root, name), timeout=5)
        conns.append(conn)
        return conn

    try:
        publisher = await w.publisher("moqt-18")  # the holder's own session to the relay
        record = w.store(1)
        twin = w.twin(record)
        direct = moqt_record(record, f"moqt://127.0.0.1:{holder_listener.port}/")
        sessions = {name: (await connect(name, relay_listener.port), await connect(name, holder_listener.port))
                    for name in CLIENTS}
        for name, (at_relay, at_holder) in sessions.items():
            assert await layers(at_relay, twin, d) == list(range(32)), name
            assert await layers(at_holder, direct, d) == list(range(32)), name
        unauthorized = AUDIT.snapshot()[0].get(("us", "moqt-18", "unauthorized"), 0)

        # 1. alice's certificate is revoked: her sessions to the relay and to the holder end within a second
        write_crl(root, ["alice"], crl)
        assert reload_now(policy, policy_file, files["relay"])
        for conn in sessions["alice"]:
            await until_closed(conn)
            assert conn.closed is not None and conn.closed.error_code == SessionErrorCode.UNAUTHORIZED
        for port in (relay_listener.port, holder_listener.port):  # and a new connection is refused
            with pytest.raises(MoqtConnectError):
                await connect_moqt("127.0.0.1", port, make_files(root, "alice"), timeout=5)
        assert relay.metrics["sessions_revoked"] == 1
        assert AUDIT.snapshot()[0].get(("us", "moqt-18", "unauthorized"), 0) == unauthorized + 2
        assert "the peer's certificate is revoked" in caplog.text
        assert "reloaded policy (5 principals) and CRL (1 revoked); 2 MOQT session(s) closed" in caplog.text

        # 2. carol is removed from the policy: she lost every right she used, at the relay and at the holder
        write_policy(policy_file, ("alice", "bob"))
        assert reload_now(policy, policy_file, files["relay"])
        for conn in sessions["carol"]:
            await until_closed(conn)
            assert conn.closed is not None and conn.closed.error_code == SessionErrorCode.UNAUTHORIZED
        assert relay.metrics["sessions_revoked"] == 2

        # bob's sessions, and the holder's publishing session, were untouched: bob is still served through both
        await asyncio.sleep(0.2)
        assert all(conn.closed is None for conn in (*sessions["bob"], publisher))
        twin2 = w.twin(w.store(2))
        assert await layers(sessions["bob"][0], twin2, d) == list(range(32))
        assert await layers(sessions["bob"][1], moqt_record(w.store(3), direct.holder), d) == list(range(32))
    finally:
        for conn in [*conns, *w.conns]:
            await conn.aclose()
        await relay.aclose()
        await relay_listener.close()
        await holder_listener.close()


async def test_sighup_closes_the_moqt_session_of_a_revoked_client_of_a_holder_process(tmp_path: Path) -> None:
    """``kvsp-quic holder --crl``: SIGHUP after the CRL revokes carol ends her established MOQT session."""
    from tests.support.crl import write_policy as write_client_policy

    root = make_root(tmp_path).root
    policy, crl = tmp_path / "policy.toml", tmp_path / "ca.crl"
    write_client_policy(policy, ["bob", "carol"])
    write_crl(root, [], crl)
    with holder(tmp_path, root, policy, crl, 1) as server:
        host, port = server.ready["moqt"].removeprefix("moqt://").rstrip("/").rsplit(":", 1)
        carol = await connect_moqt(host, int(port), make_files(root, "carol"), timeout=10)
        bob = await connect_moqt(host, int(port), make_files(root, "bob"), timeout=10)
        try:
            write_crl(root, ["carol"], crl)
            await asyncio.to_thread(server.reload, "reloaded policy (2 principals) and CRL (1 revoked)")
            await until_closed(carol, 5.0)
            assert carol.closed is not None and carol.closed.error_code == SessionErrorCode.UNAUTHORIZED
            with pytest.raises((MoqtConnectError, ConnectionError)):
                await connect_moqt(host, int(port), make_files(root, "carol"), timeout=10)
            await asyncio.sleep(0.2)
            assert bob.closed is None
        finally:
            await carol.aclose()
            await bob.aclose()
        log = server.log.read_text()
    assert "closed after the reload: the peer's certificate is revoked" in log
    assert "1 MOQT session(s) closed" in log
