"""The shared QUIC connection class (quic/connection.py, :class:`KvspQuicConnection`), directly: two real aioquic
connections, a client and a server with mutual TLS, exchanging their datagrams in memory on a simulated clock.

What is checked is what the class adds to aioquic: receive windows that slide with what the application
*consumed* (``hold`` / ``release``), not with what arrived; the budget of peer unidirectional streams; the peer's
``max_udp_payload_size`` respected; the client certificate asked for and verified; and the per-packet work at
real datagram sizes: pacing bursts in octets, ACKs per batch, merged stream events, segmentation offload (the
last over real UDP sockets).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import pytest
from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from aioquic._buffer
from aioquic.quic import events as qe
from aioquic.quic.packet import pull_quic_transport_parameters, push_quic_transport_parameters
from cryptography.hazmat.primitives.serialization import Encoding

from quic.connection import KvspQuicConnection
from quic.protocol import coalesce_stream_data
from quic.tls import TransportSettings, quic_configuration
from quic.udp import BatchedUdpTransport, bind_udp
from tests.pki import TestPki

CLIENT_ADDR = ("127.0.0.1", 40000)
SERVER_ADDR = ("127.0.0.1", 4433)
KIB = 1 << 10


class SmallDatagramPeer(KvspQuicConnection):
    """A server that states ``max_udp_payload_size`` in its transport parameters, as picoquic does (aioquic
    never sends the parameter)."""

    udp_payload_limit = 1400

    def _serialize_transport_parameters(self) -> bytes:
        params = pull_quic_transport_parameters(Buffer(data=super()._serialize_transport_parameters()))
        params.max_udp_payload_size = self.udp_payload_limit
        buf = Buffer(capacity=4096)
        push_quic_transport_parameters(buf, params)
        return bytes(buf.data)


class Pair:
    """A connected client and server; :meth:`exchange` carries datagrams both ways until both are quiet. The sides
    named in *holding* have an application that holds every octet it receives, as a transport reports it
    (:meth:`KvspQuicConnection.hold`), until the test releases it."""

    def __init__(self, certs: TestPki, *, settings: TransportSettings = TransportSettings(),
                 server_class: type[KvspQuicConnection] = KvspQuicConnection, uni_streams: int | None = None,
                 client_certificate: bool = True, holding: tuple[str, ...] = ()) -> None:
        self.now = 1000.0
        self.holding = holding
        client_config = quic_configuration(certs.files("alice"), is_client=True, alpn=["test"],
                                           settings=settings, server_name="127.0.0.1")
        if not client_certificate:
            client_config.certificate, client_config.private_key = None, None
        self.client = KvspQuicConnection(configuration=client_config, stream_window=settings.stream_window,
                                         connection_window=settings.connection_window, uni_streams=uni_streams)
        server_config = quic_configuration(certs.files("server"), is_client=False, alpn=["test"], settings=settings)
        self.server = server_class(configuration=server_config,
                                   original_destination_connection_id=self.client.original_destination_connection_id,
                                   stream_window=settings.stream_window,
                                   connection_window=settings.connection_window)
        self.events: dict[str, list[qe.QuicEvent]] = {"client": [], "server": []}
        self.sizes: dict[str, list[int]] = {"client": [], "server": []}  # datagram sizes sent
        self.client.connect(SERVER_ADDR, now=self.now)
        self.exchange()

    def exchange(self, rounds: int = 5000) -> None:
        quiet = 0
        for _ in range(rounds):
            moved = 0
            for name, src, peer, dst, addr in (("client", self.client, "server", self.server, CLIENT_ADDR),
                                               ("server", self.server, "client", self.client, SERVER_ADDR)):
                for data, _ in src.datagrams_to_send(now=self.now):
                    self.sizes[name].append(len(data))
                    dst.receive_datagram(data, addr, now=self.now)
                    moved += 1
                self._collect(peer, dst)  # as a transport does: events are handled before the receiver sends
            self.now += 0.002
            quiet = 0 if moved else quiet + 1
            if quiet >= 30:  # longer than any pacing delay or delayed ACK
                return
        raise AssertionError("the connections never went quiet")

    def _collect(self, name: str, conn: KvspQuicConnection) -> None:
        while (event := conn.next_event()) is not None:
            self.events[name].append(event)
            if name in self.holding and isinstance(event, qe.StreamDataReceived) and event.data:
                conn.hold(event.stream_id, len(event.data))

    def expire(self, who: str) -> None:
        """Let *who*'s next timer fire (a closing connection ends when its draining period is over)."""
        conn = self.client if who == "client" else self.server
        timer = conn.get_timer()
        assert timer is not None
        self.now = max(self.now, timer)
        conn.handle_timer(now=self.now)
        self._collect(who, conn)

    def received(self, who: str, stream_id: int) -> bytes:
        return b"".join(e.data for e in self.events[who]
                        if isinstance(e, qe.StreamDataReceived) and e.stream_id == stream_id)

    def ended(self, who: str, stream_id: int) -> bool:
        return any(isinstance(e, qe.StreamDataReceived) and e.stream_id == stream_id and e.end_stream
                   for e in self.events[who])


def open_uni(conn: KvspQuicConnection, data: bytes) -> int:
    sid = conn.get_next_available_stream_id(is_unidirectional=True)
    conn.send_stream_data(sid, data, end_stream=True)
    return sid


def completed(pair: Pair, who: str) -> bool:
    return any(isinstance(e, qe.HandshakeCompleted) for e in pair.events[who])


def test_mutual_tls_handshake_knows_the_client(certs: TestPki) -> None:
    pair = Pair(certs)
    assert completed(pair, "client") and completed(pair, "server")
    cert = pair.server.peer_certificate
    assert cert is not None and cert.public_bytes(Encoding.DER) == pair.server.peer_chain_der[0]
    assert pair.client.peer_chain_der  # the server's chain, verified by the client


def test_a_client_without_a_certificate_is_refused(certs: TestPki) -> None:
    pair = Pair(certs, client_certificate=False)
    assert not completed(pair, "server") and pair.server.peer_certificate is None
    pair.expire("client")
    closes = [e for e in pair.events["client"] if isinstance(e, qe.ConnectionTerminated)]
    assert closes and closes[0].error_code == 0x100 + 116  # TLS alert certificate_required


def test_a_stream_window_slides_with_what_the_application_consumed(certs: TestPki) -> None:
    """The server's application holds everything it receives: the client can send one window and no more, however
    long it waits; each release lets as much again in. aioquic alone would double the window as data arrived."""
    window = 64 * KIB
    pair = Pair(certs, settings=TransportSettings(stream_window=window, connection_window=16 * window),
                holding=("server",))
    sid = pair.client.get_next_available_stream_id()
    body = bytes(range(256)) * (4 * KIB)  # 1 MiB
    pair.client.send_stream_data(sid, body, end_stream=True)
    pair.exchange()
    got = pair.received("server", sid)
    pair.now += 30  # waiting changes nothing
    pair.exchange()
    assert len(got) == window and pair.received("server", sid) == got  # nothing more arrived
    assert pair.server.unread(sid) == window and pair.server._kvsp_unread_total == window

    assert not pair.server.release(sid, 8 * KIB)  # a small release: no window update due yet
    assert pair.server.release(sid, 24 * KIB)  # a quarter of the window or more: due
    pair.exchange()
    assert len(pair.received("server", sid)) == window + 32 * KIB  # exactly what was consumed came in again

    while not pair.ended("server", sid):  # now the application reads everything as it comes
        pair.server.release(sid, pair.server.unread(sid))
        pair.exchange()
    assert pair.received("server", sid) == body
    pair.server.forget(sid)
    assert pair.server._kvsp_unread_total == 0


def test_the_connection_window_bounds_all_streams_together(certs: TestPki) -> None:
    stream_window, connection_window = 64 * KIB, 128 * KIB
    pair = Pair(certs, settings=TransportSettings(stream_window=stream_window, connection_window=connection_window),
                holding=("server",))
    sids = []
    for _ in range(4):
        sid = pair.client.get_next_available_stream_id()
        pair.client.send_stream_data(sid, bytes(256 * KIB), end_stream=True)
        sids.append(sid)
    pair.exchange()
    total = sum(len(pair.received("server", sid)) for sid in sids)
    assert total == connection_window == pair.server._kvsp_unread_total
    first = sids[0]
    pair.server.release(first, pair.server.unread(first))  # one stream read: credit for the connection again
    pair.exchange()
    assert sum(len(pair.received("server", sid)) for sid in sids) > total


def test_peer_unidirectional_streams_are_admitted_as_they_are_read(certs: TestPki) -> None:
    """A client with a budget of 2 (as MOQT clients have: data streams + 1): the server's third unidirectional
    stream waits until the client has read one of the first two, however finished they are."""
    pair = Pair(certs, uni_streams=2, holding=("client",))
    sids = [open_uni(pair.server, b"x" * 1000) for _ in range(3)]
    pair.exchange()
    assert [pair.ended("client", sid) for sid in sids] == [True, True, False]
    pair.now += 30
    pair.exchange()
    assert not pair.ended("client", sids[2])  # finished streams alone free nothing while they are unread

    pair.client.release(sids[0], 1000)
    assert pair.client.uni_stream_done()  # a budget is in force: MAX_STREAMS may be due
    pair.exchange()
    assert pair.ended("client", sids[2]) and pair.received("client", sids[2]) == b"x" * 1000


def test_without_a_budget_finished_streams_free_their_slots(certs: TestPki) -> None:
    pair = Pair(certs)
    assert not pair.client.uni_stream_done()  # no budget: nothing for the caller to transmit
    sids = [open_uni(pair.server, b"y") for _ in range(3)]
    pair.exchange()
    assert all(pair.ended("client", sid) for sid in sids)


def test_the_peer_udp_payload_limit_is_respected(certs: TestPki) -> None:
    pair = Pair(certs, server_class=SmallDatagramPeer)
    limit = SmallDatagramPeer.udp_payload_limit
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_stream_data(sid, bytes(64 * KIB))
    pair.sizes["client"].clear()
    pair.exchange()
    assert max(pair.sizes["client"]) > limit  # aioquic alone ignores the parameter

    assert pair.client.respect_peer_udp_payload() == limit
    pair.client.send_stream_data(sid, bytes(256 * KIB), end_stream=True)
    pair.sizes["client"].clear()
    pair.exchange()
    assert pair.sizes["client"] and max(pair.sizes["client"]) <= limit
    assert len(pair.received("server", sid)) == 320 * KIB


def test_a_peer_that_states_no_limit_changes_nothing(certs: TestPki) -> None:
    pair = Pair(certs)
    before = pair.client._max_datagram_size
    assert pair.client.respect_peer_udp_payload() is None
    assert pair.client._max_datagram_size == before == TransportSettings().max_datagram_size


# -- real packet sizes: the pacer's burst, batched sends, merged stream events ---------------------------------------


def transfer_time(certs: TestPki, settings: TransportSettings, burst: int | None, size: int,
                  ack_now: bool = False) -> float:
    """Simulated seconds for *size* octets from client to server (one stream) at *settings*' datagram size."""
    pair = Pair(certs, settings=settings)
    if burst is not None:
        pair.client.set_pacing_burst(burst)
        pair.server.set_pacing_burst(burst)
    sid = pair.client.get_next_available_stream_id()
    start = pair.now
    pair.client.send_stream_data(sid, bytes(size), end_stream=True)
    while not pair.ended("server", sid):
        for data, _ in pair.client.datagrams_to_send(now=pair.now):
            pair.sizes["client"].append(len(data))
            pair.server.receive_datagram(data, CLIENT_ADDR, now=pair.now)
        if ack_now:  # as KvspQuicProtocol does at the end of a batch of datagrams
            pair.server.ack_now(pair.now)
        pair._collect("server", pair.server)
        for data, _ in pair.server.datagrams_to_send(now=pair.now):
            pair.client.receive_datagram(data, SERVER_ADDR, now=pair.now)
        pair._collect("client", pair.client)
        pair.now += 0.001  # an event loop's timer tick
        assert pair.now - start < 60, "the transfer stalled"
    assert pair.received("server", sid) == bytes(size)
    assert max(pair.sizes["client"]) <= settings.max_datagram_size
    return pair.now - start


def test_the_pacer_counts_its_burst_in_octets(certs: TestPki) -> None:
    conn = Pair(certs, settings=TransportSettings(max_datagram_size=1452)).client
    pacer = conn._loss._pacer
    pacer.update_rate(congestion_window=8 << 20, smoothed_rtt=0.01)
    rate = (8 << 20) / 0.01
    assert round(pacer.bucket_max * rate) == 16 * 1452  # aioquic's: 16 packets, whatever their size
    conn.set_pacing_burst(256 * KIB)
    pacer.update_rate(congestion_window=8 << 20, smoothed_rtt=0.01)
    assert round(pacer.bucket_max * rate) == 256 * KIB
    pacer.update_rate(congestion_window=64 * KIB, smoothed_rtt=0.01)  # never more than a quarter of the window
    assert round(pacer.bucket_max * (64 * KIB) / 0.01) == 16 * KIB


def test_octet_bursts_make_small_datagrams_as_fast_as_large_ones(certs: TestPki) -> None:
    """On a clock that ticks every millisecond, as an event loop's timers do, aioquic's 16-packet bursts hold a
    1452-octet connection to a fraction of the rate a 16 KiB one gets; counted in octets, the burst does not."""
    size = 8 << 20
    small = TransportSettings(max_datagram_size=1452)
    packets = transfer_time(certs, small, None, size)
    octets = transfer_time(certs, small, 256 * KIB, size)
    large = transfer_time(certs, TransportSettings(max_datagram_size=16384), None, size)
    assert octets < packets / 3  # in octets: ~0.11 s for 8 MiB; in packets ~0.36 s (16 KiB datagrams: ~0.04 s)
    assert large < packets / 3


def test_ack_now_acknowledges_at_once(certs: TestPki) -> None:
    pair = Pair(certs)
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_stream_data(sid, bytes(3000), end_stream=False)
    for data, _ in pair.client.datagrams_to_send(now=pair.now):
        pair.server.receive_datagram(data, CLIENT_ADDR, now=pair.now)
    assert pair.server.datagrams_to_send(now=pair.now) == []  # aioquic waits for its ACK timer
    pair.server.ack_now(pair.now)
    acks = pair.server.datagrams_to_send(now=pair.now)
    assert len(acks) == 1
    for data, _ in acks:
        pair.client.receive_datagram(data, SERVER_ADDR, now=pair.now)
    assert pair.client._loss.bytes_in_flight == 0  # everything the client sent is acknowledged


def test_adjacent_stream_events_merge_in_order(certs: TestPki) -> None:
    conn = Pair(certs).client
    conn._events.clear()
    ping = qe.PingAcknowledged(uid=7)
    conn._events.extend([qe.StreamDataReceived(b"a", False, 0), qe.StreamDataReceived(b"b", False, 0),
                         qe.StreamDataReceived(b"c", False, 4), ping, qe.StreamDataReceived(b"d", False, 4),
                         qe.StreamDataReceived(b"e", True, 4), qe.StreamDataReceived(b"f", True, 8),
                         qe.StreamDataReceived(b"g", False, 0)])
    coalesce_stream_data(conn)
    got: list[Any] = []
    while (event := conn.next_event()) is not None:
        got.append((event.stream_id, event.data, event.end_stream) if isinstance(event, qe.StreamDataReceived)
                   else event)
    assert got == [(0, b"ab", False), (4, b"c", False), ping, (4, b"de", True), (8, b"f", True), (0, b"g", False)]
    coalesce_stream_data(conn)  # an empty queue stays empty
    assert conn.next_event() is None


class Recorder:
    def connection_made(self, transport: Any) -> None: ...

    def datagram_received(self, data: bytes, addr: Any) -> None: ...

    def datagrams_done(self) -> None: ...


def receive_all(sock: socket.socket) -> list[bytes]:
    got = []
    with contextlib.suppress(BlockingIOError):
        while True:
            got.append(sock.recv(65536))
    return got


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
async def test_runs_of_datagrams_go_out_in_one_system_call_each(host: str) -> None:
    receiver = bind_udp(host, 0, 1 << 20)
    other = bind_udp(host, 0, 1 << 20)
    sender = BatchedUdpTransport(asyncio.get_running_loop(), bind_udp(host, 0, 1 << 20), Recorder())
    try:
        to, elsewhere = receiver.getsockname(), other.getsockname()
        datagrams = [(bytes([i]) * 1452, to) for i in range(5)] + [(b"s" * 700, to)]  # one run, a short end
        datagrams += [(b"x" * 1452, to), (b"y" * 1452, to)]  # a second run
        datagrams += [(b"z" * 1452, elsewhere)]  # another address: a run of its own
        datagrams += [(bytes([i % 256]) * 1452, to) for i in range(100)]  # more than one call can carry
        sender.send_datagrams(datagrams)
        assert receive_all(receiver) == [d for d, a in datagrams if a == to]
        assert receive_all(other) == [b"z" * 1452]
        assert sender.datagrams_sent == len(datagrams)
        if sender.gso:  # this kernel segments: 44 datagrams of 1452 octets fit one 64 KiB send
            assert sender.system_calls == 1 + 1 + 1 + 3
        sender.gso = False  # as after the kernel refused: one call per datagram, same octets
        sender.send_datagrams(datagrams)
        assert receive_all(receiver) == [d for d, a in datagrams if a == to]
        assert sender.datagrams_sent == 2 * len(datagrams)
    finally:
        sender.close()
        receiver.close()
        other.close()


class Collector(Recorder):
    def __init__(self) -> None:
        self.datagrams: list[bytes] = []
        self.batches = 0

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.datagrams.append(data)

    def datagrams_done(self) -> None:
        self.batches += 1


async def test_runs_of_datagrams_are_received_as_sent() -> None:
    loop = asyncio.get_running_loop()
    collector = Collector()
    receiver = BatchedUdpTransport(loop, bind_udp("127.0.0.1", 0, 4 << 20), collector)
    sender = BatchedUdpTransport(loop, bind_udp("127.0.0.1", 0, 4 << 20), Recorder())
    try:
        to = receiver.get_extra_info("sockname")
        datagrams = [(bytes([i % 256]) * 1452, to) for i in range(150)] + [(b"end" * 100, to)]
        sender.send_datagrams(datagrams)
        async with asyncio.timeout(5):
            while len(collector.datagrams) < len(datagrams):
                await asyncio.sleep(0.01)
        assert collector.datagrams == [d for d, _ in datagrams]  # cut back into datagrams, in order
        assert collector.batches >= len(datagrams) // 64  # a batch is still at most 64 datagrams
        if receiver.gro and sender.gso:  # the kernel kept the runs together: a few calls, not 151
            assert receiver.receive_calls < len(datagrams) // 4
        receiver.stop_receive_offload()
        collector.datagrams.clear()
        sender.send_datagrams(datagrams)
        async with asyncio.timeout(5):
            while len(collector.datagrams) < len(datagrams):
                await asyncio.sleep(0.01)
        assert collector.datagrams == [d for d, _ in datagrams]
    finally:
        sender.close()
        receiver.close()
