"""A dead peer costs milliseconds, not a timeout (issue 12, point 5): a client's UDP socket is connected to its
peer, so ICMP port unreachable ends a QUIC handshake at once (quic.protocol.KvspQuicProtocol.error_received),
and an established connection whose server process went away fails its next request instead of stalling.
Real servers on 127.0.0.1: a port nothing listens on, and a ``kvsp-quic index`` process killed with SIGKILL."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from http3.client import KvspClient, TransportError
from http3.h3_client import H3ConnectError, connect_h3
from kvsp_client.api import KvspApi, RetryElsewhere
from kvsp_quic.fields import BlockKey, ScopeId
from kvsp_quic.records import LookupRequest
from kvsp_quic.samples import example_descriptor
from moqt.aio import MoqtConnectError, MoqtPool
from quic.protocol import PEER_UNREACHABLE, PeerUnreachable, peer_unreachable
from quic.tls import TlsFiles, TransportSettings
from tests.helpers import Process
from tests.pki import TestPki


def dead_port() -> int:
    """A UDP (and TCP) port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_quic_handshake_to_a_dead_port_fails_at_once(certs: TestPki) -> None:
    port = dead_port()
    start = time.monotonic()
    with pytest.raises(H3ConnectError) as caught:
        await connect_h3("127.0.0.1", port, certs.files("alice"), settings=TransportSettings(), timeout=10.0)
    elapsed = time.monotonic() - start
    assert PEER_UNREACHABLE in str(caught.value)
    assert peer_unreachable(caught.value) and isinstance(caught.value.__cause__, PeerUnreachable)  # typed
    assert elapsed < 1.0, f"{elapsed:.3f} s for a dead port (the handshake timeout was 10 s)"


async def test_a_moqt_connect_to_a_dead_port_fails_at_once(certs: TestPki) -> None:
    pool = MoqtPool(certs.files("alice"))
    try:
        start = time.monotonic()
        with pytest.raises((MoqtConnectError, OSError)) as caught:
            await pool.get(f"moqt://127.0.0.1:{dead_port()}/")
        assert time.monotonic() - start < 1.0
        assert isinstance(caught.value, OSError) or peer_unreachable(caught.value)
    finally:
        await pool.aclose()


async def test_unreachable_is_typed_from_quic_to_the_api(certs: TestPki) -> None:
    """Issue 25 point 2: "nothing listens there" reaches the KVSP client as a typed field, not as text to match:
    quic.protocol.PeerUnreachable -> http3.client.TransportError.unreachable -> kvsp_client.api.RetryElsewhere."""
    async with KvspClient(certs.files("alice"), connect_timeout=5.0, timeout=10.0, retries=0,
                          fallback=False) as client:
        port = dead_port()
        with pytest.raises(TransportError) as caught:
            await client.request("GET", f"https://127.0.0.1:{port}/")
        assert caught.value.unreachable
        with pytest.raises(RetryElsewhere) as elsewhere:
            request = LookupRequest(ScopeId(bytes(16)), example_descriptor().compat_id, (BlockKey(bytes(32)),))
            await KvspApi(client).lookup(f"https://127.0.0.1:{port}/", request)
        assert elsewhere.value.unreachable and elsewhere.value.status is None


async def test_a_request_to_a_dead_port_fails_at_once(certs: TestPki) -> None:
    async with KvspClient(certs.files("alice"), connect_timeout=5.0, timeout=10.0, retries=0) as client:
        start = time.monotonic()
        with pytest.raises(TransportError):  # HTTP/3 refused at once, then HTTP/1.1 over TCP refused at once
            await client.request("GET", f"https://127.0.0.1:{dead_port()}/")
        assert time.monotonic() - start < 1.0


async def test_a_pooled_connection_to_a_process_killed_fails_fast(tmp_path: Path) -> None:
    proc = Process("index", "--dev", str(tmp_path / "dev"))
    try:
        ready = proc.ready
        files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
        async with KvspClient(files, connect_timeout=5.0, timeout=10.0, retries=0) as client:
            r = await client.request("GET", ready["base_uri"] + "metrics")
            assert r.http_version == "HTTP/3"
            await r.aread()
            proc.proc.send_signal(signal.SIGKILL)
            proc.proc.wait(10)
            start = time.monotonic()
            with pytest.raises(TransportError):  # the pooled HTTP/3 connection hears ICMP; TCP is refused
                await client.request("GET", ready["base_uri"] + "metrics")
            assert time.monotonic() - start < 2.0
    finally:
        proc.stop()
