"""The shared QUIC connection class (quic/connection.py, :class:`KvspQuicConnection`), directly: two real aioquic
connections, a client and a server with mutual TLS, exchanging their datagrams in memory on a simulated clock.

What is checked is what the class adds to aioquic: receive windows that slide with what the application
*consumed* (``hold`` / ``release``), not with what arrived; the budget of peer unidirectional streams; the peer's
``max_udp_payload_size`` respected; the client certificate asked for and verified.
"""

from __future__ import annotations

import pytest
from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from aioquic._buffer
from aioquic.quic import events as qe
from aioquic.quic.packet import pull_quic_transport_parameters, push_quic_transport_parameters
from cryptography.hazmat.primitives.serialization import Encoding

from quic.connection import KvspQuicConnection
from quic.tls import TransportSettings, quic_configuration
from tests.pki import SERVER_URI, TestPki, make_pki

CLIENT_ADDR = ("127.0.0.1", 40000)
SERVER_ADDR = ("127.0.0.1", 4433)
KIB = 1 << 10


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"), roles={"server": SERVER_URI})


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
