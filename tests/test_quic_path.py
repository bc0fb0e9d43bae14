"""QUIC datagrams sized to the path, never IP-fragmented (issue 28, point 4; RFC 9000, 14).

On loopback: every socket of ours sets DF, the route MTU is read, and a connection keeps loopback's 16 KiB
because the route says so. Across a real MTU (tests/support/netns.py: two namespaces the test makes, a veth pair of
1500 or 9000 octets): a ``kvsp-quic holder`` in one namespace, a client in the other (tests/support/path_client.py)
that PUTs a block over HTTP/3, GETs it back and FETCHes it over MOQT; every transfer is exact, the holder's
datagrams are the path's size (1452 / 8952), and no namespace made a single IP fragment (``FragCreates``).
ngtcp2's gtlsclient, an independent client, gets the same from a holder across the 1500-octet pair. When the route's
MTU shrinks under a live connection, the holder's sends fail with EMSGSIZE (DF: the kernel does not fragment) and
the connection shrinks its datagrams and completes.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvsp_dev.processes import RoleProcess
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.samples import example_descriptor
from quic.listener import QuicListener
from quic.protocol import KvspQuicProtocol, connect_quic
from quic.tls import TransportSettings
from quic.udp import (
    IP_MTU_DISCOVER,
    IP_PMTUDISC_DO,
    PATH_OVERHEAD,
    bind_udp,
    datagram_size,
    path_mtu,
    route_mtu,
)
from tests.peers import needs_peer
from tests.pki import TestPki
from tests.support.netns import VethPair, veth_pair
from tests.support.path_client import BLOCK_KEY, SCOPE

ROOT = Path(__file__).resolve().parent.parent
GTLSCLIENT = shutil.which("gtlsclient")
BLOCK_TOKENS = 32  # 4 MiB blocks: ~2,900 datagrams of 1452 octets per transfer


def descriptor_file(tmp_path: Path) -> tuple[Path, CompatDescriptor]:
    d = CompatDescriptor.from_json({**example_descriptor().to_json(), "block_tokens": BLOCK_TOKENS})
    path = tmp_path / "descriptor.json"
    path.write_text(json.dumps(d.to_json()))
    return path, d


def start_holder(pair: VethPair, tmp_path: Path, descriptor: Path) -> RoleProcess:
    holder = RoleProcess("holder", "holder", "--dev", str(tmp_path / "dev"), "--listen", f"{pair.a_ip}:0",
                         "--workers", "1", "--descriptor", str(descriptor), stderr="pipe",
                         launcher=pair.exec(pair.a))
    holder.wait_ready(60)
    return holder


def fragments(pair: VethPair) -> dict[str, int]:
    return {ns: pair.ip_counters(ns)["FragCreates"] for ns in (pair.a, pair.b)}


# -- on loopback -------------------------------------------------------------------------------------------------


def test_every_socket_sets_df_and_reads_its_route() -> None:
    sock = bind_udp("127.0.0.1", 0, 1 << 20)
    try:
        assert sock.getsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER) == IP_PMTUDISC_DO
        assert route_mtu(sock) is None  # not connected: no route yet
        loopback = path_mtu(("127.0.0.1", 9), sock)  # loopback's route: 64 KiB (65535 as IP_MTU says it)
        assert loopback is not None and loopback >= 65535
        sock.connect(("127.0.0.1", 9))
        assert route_mtu(sock) == loopback
    finally:
        sock.close()
    assert datagram_size(65536, 16384) == 16384  # loopback keeps 16 KiB: its route says so
    assert datagram_size(1500, 16384) == 1500 - PATH_OVERHEAD == 1452
    assert datagram_size(9000, 16384) == 8952 and datagram_size(9000, 4096) == 4096  # never above the maximum
    assert datagram_size(None, 16384) == 1452  # the route says nothing: the 1500-octet size
    assert datagram_size(1280, 16384) == 1232 and datagram_size(576, 16384) == 1200  # QUIC's floor


async def test_loopback_connections_keep_16_kib(fresh_certs: TestPki) -> None:
    listener = QuicListener(fresh_certs.files("server"), {"h3": lambda ctx: _Idle()})
    await listener.start("127.0.0.1", 0)
    try:
        for maximum in (16384, 4000):
            settings = TransportSettings(max_datagram_size=maximum)
            client = await connect_quic("127.0.0.1", listener.port, fresh_certs.files("alice"), alpn=["h3"],
                                        settings=settings, protocol_factory=KvspQuicProtocol)
            assert client.quic.datagram_size == maximum
            await client.aclose()
        assert all(p.quic.datagram_size == 16384 for p in listener._connections)  # the listener's own maximum
    finally:
        await listener.close()


class _Idle:
    def quic_event_received(self, event: object) -> None:
        pass

    def connection_terminated(self) -> None:
        pass

    async def drain(self) -> None:
        pass


# -- across a real MTU ------------------------------------------------------------------------------------------


def run_client(pair: VethPair, ready: dict[str, object], descriptor: Path) -> dict[str, dict[str, int]]:
    done = subprocess.run([*pair.exec(pair.b), sys.executable, "-m", "tests.support.path_client", json.dumps(ready),
                           str(descriptor)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("mtu", [1500, 9000])
def test_http3_and_moqt_across_a_real_mtu_make_no_fragments(tmp_path: Path, mtu: int) -> None:
    path, _ = descriptor_file(tmp_path)
    with veth_pair(mtu) as pair:
        holder = start_holder(pair, tmp_path, path)
        try:
            before = fragments(pair)
            report = run_client(pair, holder.ready, path)
            after = fragments(pair)
        finally:
            err = holder.stop()
        assert "Traceback" not in err, err
    size = mtu - PATH_OVERHEAD  # 1452 / 8952
    assert report["octets"] > 4 << 20  # a 4 MiB block and its container framing
    for transfer in ("h3", "moqt"):
        got = report[transfer]
        assert got["exact"], transfer
        assert got["largest_received"] == size, transfer  # the holder's datagrams: the path's size, no more
        assert got["datagram_size"] == size, transfer  # the client's own (it PUT the block at that size)
    assert after == before, f"IP fragments made: {before} -> {after}"


def test_a_route_that_shrinks_under_a_connection_shrinks_its_datagrams(tmp_path: Path) -> None:
    """EMSGSIZE: the route's MTU drops to 1280 after the handshake; the holder's 1452-octet sends fail (DF set, so
    nothing is fragmented), its connection shrinks to 1232 and the GET and FETCH complete."""
    path, _ = descriptor_file(tmp_path)
    with veth_pair(1500) as pair:
        holder = start_holder(pair, tmp_path, path)
        try:
            before = fragments(pair)
            client = subprocess.Popen([*pair.exec(pair.b), sys.executable, "-m", "tests.support.path_client",
                                       json.dumps(holder.ready), str(path), "--pause"], cwd=ROOT, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert client.stdout is not None and client.stdin is not None
            try:
                assert json.loads(client.stdout.readline()) == {"paused": True}
                subprocess.run([*pair.exec(pair.a), "ip", "route", "replace", f"{pair.b_ip}/32", "dev",
                                _device(pair), "mtu", "1280"], check=True, timeout=10)
                client.stdin.write("go\n")
                client.stdin.flush()
                out, err = client.communicate(timeout=240)
            finally:
                if client.poll() is None:
                    client.kill()
                    client.wait()
            assert client.returncode == 0, err[-3000:]
            report = json.loads(out.splitlines()[-1])
            after = fragments(pair)
        finally:
            holder_err = holder.stop()
        assert "Traceback" not in holder_err, holder_err
    for transfer in ("h3", "moqt"):
        assert report[transfer]["exact"], transfer
        assert report[transfer]["largest_received"] == 1280 - PATH_OVERHEAD, transfer
    assert after == before, f"IP fragments made: {before} -> {after}"


def _device(pair: VethPair) -> str:
    out = subprocess.run([*pair.exec(pair.a), "ip", "-o", "addr", "show", "to", pair.a_ip], check=True,
                         capture_output=True, text=True, timeout=10).stdout
    return out.split()[1]


# -- an independent client: ngtcp2's gtlsclient -------------------------------------------------------------------


@needs_peer("ngtcp2's gtlsclient is not installed (apt-get install ngtcp2-client; .ci/run does)"
            if GTLSCLIENT is None else None)
def test_gtlsclient_gets_a_block_across_1500_octets_without_fragments(tmp_path: Path) -> None:
    assert GTLSCLIENT is not None
    path, d = descriptor_file(tmp_path)
    with veth_pair(1500) as pair:
        holder = start_holder(pair, tmp_path, path)
        try:
            report = run_client(pair, holder.ready, path)  # stores the block (and reads it back)
            before = fragments(pair)
            ready = holder.ready
            url = f"{ready['base_uri']}blocks/{d.compat_id.hex()}/{SCOPE.hex()}/{BLOCK_KEY.hex()}"
            port = url.split(":")[2].split("/")[0]
            download = tmp_path / "download"
            download.mkdir()
            got = subprocess.run([*pair.exec(pair.b), GTLSCLIENT, "--no-quic-dump", "--no-http-dump",
                                  "--exit-on-all-streams-close", "--timeout=30s", f"--download={download}",
                                  f"--key={ready['client_key']}", f"--cert={ready['client_cert']}",
                                  pair.a_ip, port, url], capture_output=True, text=True, timeout=120)
            after = fragments(pair)
        finally:
            holder.stop()
    files = list(download.iterdir())
    assert len(files) == 1 and files[0].stat().st_size == report["octets"], got.stdout[-2000:] + got.stderr[-2000:]
    assert after == before, f"IP fragments made: {before} -> {after}"
