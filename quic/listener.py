"""The UDP side of a role: one QUIC listener whose connections are handed, by ALPN, to an application handler.

HTTP/3 (``h3``) is one handler (:mod:`http3.h3_server`); MOQT (``moq-00``, ``moqt-18``) plugs in the same way, so
one UDP port serves both. Every connection is a :class:`~quic.connection.KvspQuicConnection`: mutual TLS is
enforced before a handler is created, and receive windows follow what the handler has consumed.

A handler is created once the handshake has completed (so the client certificate has been verified) and gets a
:class:`QuicConnectionContext`: the connection, the peer's TLS extension for ASGI scopes, addresses, settings,
and ``wait_writable`` for send-side backpressure. Receiving in batches, transmits and backpressure are
:class:`~quic.protocol.KvspQuicProtocol`'s, shared with the clients.

Connection limits (issue 13): at most ``settings.max_connections`` connections (handshakes included) and
``settings.max_connections_per_address`` from one peer IP address. An Initial packet that would open one more is
answered, statelessly, by an Initial packet carrying CONNECTION_CLOSE with CONNECTION_REFUSED (RFC 9000, 20.1:
"The server refused to accept a new connection"; 10.2.3: a server may close in an Initial packet before the
handshake) and no connection state is created: the client fails at once rather than after its handshake timeout,
and the reply is smaller than the 1200-octet datagram that asked (no amplification, RFC 9000, 8). Idle
connections end after ``settings.idle_timeout`` (QUIC's max_idle_timeout).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aioquic.asyncio.server import QuicServer as AioquicServer
from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from aioquic._buffer
from aioquic.quic import events
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE
from aioquic.quic.connection import TRANSPORT_CLOSE_FRAME_CAPACITY, QuicConnection
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.packet import QuicErrorCode, QuicFrameType, QuicPacketType, pull_quic_header
from aioquic.quic.packet_builder import QuicPacketBuilder

from quic.connection import KvspQuicConnection
from quic.protocol import KvspQuicProtocol
from quic.tls import TLS_1_3, TlsFiles, TransportSettings, quic_configuration, tls_extension
from quic.udp import BatchedUdpTransport, bind_udp

log = logging.getLogger("kvsp.quic")

H3_NO_ERROR = 0x100


class ConnectionHandler(Protocol):
    def quic_event_received(self, event: events.QuicEvent) -> None: ...

    def connection_terminated(self) -> None: ...

    async def drain(self) -> None:
        """Resolve when the handler has no in-flight work (graceful shutdown)."""


HandlerFactory = Callable[["QuicConnectionContext"], ConnectionHandler]


@dataclass
class QuicConnectionContext:
    protocol: ServerConnectionProtocol
    quic: KvspQuicConnection
    alpn: str
    tls: dict[str, Any]  # scope["extensions"]["tls"]
    client: tuple[str, int] | None
    server: tuple[str, int] | None
    settings: TransportSettings

    def transmit(self) -> None:
        self.protocol.transmit_soon()

    async def wait_writable(self, stream_id: int) -> None:
        await self.protocol.wait_writable(stream_id)


class ServerConnectionProtocol(KvspQuicProtocol):
    """One server connection: dispatches events to the handler of the negotiated ALPN."""

    def __init__(self, quic: KvspQuicConnection, *, server: QuicListener, **kwargs: Any) -> None:
        super().__init__(quic, settings=server.settings, **kwargs)
        self._listener = server
        self._handler: ConnectionHandler | None = None
        self.peer_addr: tuple[str, int] | None = None

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        if self.peer_addr is None:
            self.peer_addr = (addr[0], addr[1])
        super().datagram_received(data, addr)
        self._listener.dirty.add(self)

    def quic_event_received(self, event: events.QuicEvent) -> None:
        super().quic_event_received(event)
        if isinstance(event, events.HandshakeCompleted):
            self._start_handler(event.alpn_protocol)
        elif isinstance(event, events.ConnectionTerminated):
            self._listener.forget(self)
            if self._handler is not None:
                self._handler.connection_terminated()
            elif not self._listener.closing:
                self._listener.refused(self, event)
            return
        if self._handler is not None:
            self._handler.quic_event_received(event)

    def _start_handler(self, alpn: str | None) -> None:
        factory = self._listener.handlers.get(alpn or "")
        if factory is None:  # TLS only offers configured ALPNs, so this is a configuration error
            self._quic.close(error_code=0x178, reason_phrase="no application protocol")  # TLS no_application_protocol
            self.transmit()
            return
        ctx = QuicConnectionContext(
            protocol=self,
            quic=self.quic,
            alpn=alpn or "",
            tls=tls_extension(self.quic.peer_chain_der, server_cert_pem=self._listener.files.cert_pem,
                              tls_version=TLS_1_3, cipher_suite=int(self.quic.tls.key_schedule.cipher_suite)
                              if self.quic.tls.key_schedule else None),
            client=self.peer_addr,
            server=self._listener.address,
            settings=self._listener.settings,
        )
        self._handler = factory(ctx)

    async def drain(self) -> None:
        if self._handler is not None:
            await self._handler.drain()


@dataclass(frozen=True)
class RefusedHandshake:
    """A connection that ended during its handshake (see :meth:`QuicListener.refused`)."""

    peer: tuple[str, int] | None
    alpn: str | None
    error_code: int  # the QUIC CONNECTION_CLOSE code (0x100 + TLS alert for a refused certificate)
    reason: str


class QuicListener:
    """A UDP socket serving QUIC for the ALPN handlers given; mutual TLS on every connection."""

    def __init__(self, files: TlsFiles, handlers: dict[str, HandlerFactory], *,
                 settings: TransportSettings = TransportSettings(),
                 on_refused: Callable[[RefusedHandshake], None] | None = None) -> None:
        if not handlers:
            raise ValueError("at least one ALPN handler is needed")
        self.files = files
        self.handlers = dict(handlers)
        self.settings = settings
        self.on_refused = on_refused
        self._configuration = quic_configuration(files, is_client=False, alpn=list(handlers), settings=settings)
        self._server: AioquicServer | None = None
        self._transport: BatchedUdpTransport | None = None
        self._connections: set[ServerConnectionProtocol] = set()
        self._per_address: Counter[str] = Counter()  # connections per peer IP address
        self._arriving: tuple[str, int] | None = None  # the sender of the datagram being handed to aioquic
        self.refused_over_limit = 0  # Initials answered with CONNECTION_REFUSED (connection limits)
        self.dirty: set[ServerConnectionProtocol] = set()  # connections that received datagrams in this batch
        self._closing = False
        self.address: tuple[str, int] | None = None

    @property
    def port(self) -> int:
        assert self.address is not None, "not started"
        return self.address[1]

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
        if sock is None:
            sock = bind_udp(host, port, self.settings.socket_buffer)
        self.address = sock.getsockname()[:2]
        self._server = AioquicServer(configuration=self._configuration, create_protocol=self._create_protocol)
        self._transport = BatchedUdpTransport(loop, sock, self)
        log.info("QUIC listening on %s:%d (ALPN %s)", *self.address, ", ".join(self.handlers))

    def _create_protocol(self, connection: QuicConnection, **kwargs: Any) -> ServerConnectionProtocol:
        quic = KvspQuicConnection.adopt(connection, stream_window=self.settings.stream_window,
                                        connection_window=self.settings.connection_window,
                                        max_streams=self.settings.max_streams,
                                        client_cert_optional=self.settings.client_cert_optional)
        if self._arriving is not None and self._transport is not None:  # datagrams the route to the peer carries
            quic.fit_datagrams(self._transport.path_mtu(self._arriving))
        protocol = ServerConnectionProtocol(quic, server=self, **kwargs)
        if self._closing:
            quic.close(error_code=0x0, reason_phrase="server shutting down")  # NO_ERROR: refuse politely
        else:
            self._connections.add(protocol)
            if self._arriving is not None:
                protocol.peer_addr = self._arriving
                self._per_address[self._arriving[0]] += 1
        return protocol

    # the BatchedUdpTransport's protocol: datagrams go to aioquic's server, which routes them by connection ID

    def connection_made(self, transport: Any) -> None:
        assert self._server is not None
        self._server.connection_made(transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self._server is None:
            return
        if ((len(self._connections) >= self.settings.max_connections
             or self._per_address[addr[0]] >= self.settings.max_connections_per_address)
                and self._refuse_new(data, addr)):
            return
        self._arriving = (addr[0], addr[1])
        try:
            self._server.datagram_received(data, addr)
        finally:
            self._arriving = None

    def _refuse_new(self, data: bytes, addr: Any) -> bool:
        """At a limit: a datagram that would open a connection is answered with CONNECTION_REFUSED (True); any
        other is left to aioquic (False)."""
        assert self._server is not None and self._transport is not None
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=self._configuration.connection_id_length)
        except ValueError:
            return False
        if (header.packet_type != QuicPacketType.INITIAL or len(data) < SMALLEST_MAX_DATAGRAM_SIZE
                or header.version not in self._configuration.supported_versions
                or header.destination_cid in self._server._protocols):
            return False
        self.refused_over_limit += 1
        log.debug("QUIC connection limit reached: refusing a connection from %s", addr[0])
        self._transport.sendto(refusal(header.version, header.destination_cid, header.source_cid), addr)
        return True

    def datagram_too_large(self, addr: Any, size: int, mtu: int | None) -> None:
        """The kernel refused a datagram to *addr* as too large for the path (:mod:`quic.udp`): the connections
        of that peer shrink theirs."""
        peer = (addr[0], addr[1])
        for protocol in list(self._connections):
            if protocol.peer_addr == peer:
                protocol.datagram_too_large(addr, size, mtu)

    def datagrams_done(self) -> None:
        dirty, self.dirty = self.dirty, set()
        for protocol in dirty:
            protocol.datagrams_done()

    def forget(self, protocol: ServerConnectionProtocol) -> None:
        if protocol in self._connections:
            self._connections.discard(protocol)
            if protocol.peer_addr is not None:
                host = protocol.peer_addr[0]
                self._per_address[host] -= 1
                if self._per_address[host] <= 0:
                    del self._per_address[host]

    @property
    def closing(self) -> bool:
        return self._closing

    def refused(self, protocol: ServerConnectionProtocol, event: events.ConnectionTerminated) -> None:
        """A connection that ended before any handler took it: a refused or failed handshake (no or a bad client
        certificate, no common ALPN, a timeout). One INFO line, and *on_refused* (counters) when given."""
        tls = protocol.quic.tls
        alpn = getattr(tls, "alpn_negotiated", None)
        refusal = RefusedHandshake(protocol.peer_addr, alpn, event.error_code, event.reason_phrase or "")
        peer = protocol.peer_addr
        if self.on_refused is None:  # (otherwise on_refused logs it, with its own labels)
            log.info("QUIC handshake refused or failed: peer %s ALPN %s: error %#x %s",
                     f"{peer[0]}:{peer[1]}" if peer else "-", alpn or "-", event.error_code, refusal.reason or "-")
        else:
            try:
                self.on_refused(refusal)
            except Exception:  # a counter must not take the listener down
                log.exception("on_refused failed")

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def close(self) -> None:
        """Refuse new connections, let in-flight work finish (up to shutdown_grace), then close everything."""
        if self._server is None:
            return
        self._closing = True
        pending = [asyncio.ensure_future(p.drain()) for p in list(self._connections)]
        if pending:
            _done, not_done = await asyncio.wait(pending, timeout=self.settings.shutdown_grace)
            for task in not_done:
                task.cancel()
        for protocol in list(self._connections):
            protocol.close(error_code=H3_NO_ERROR, reason_phrase="server shutting down")
        await asyncio.sleep(0)  # let the CONNECTION_CLOSE datagrams out
        self._server.close()  # closes the transport too
        self._server = None
        self._connections.clear()
        self._per_address.clear()


def refusal(version: int, client_dcid: bytes, client_scid: bytes) -> bytes:
    """A server Initial packet closing a connection attempt with CONNECTION_REFUSED (0x2), protected with the
    Initial keys derived from the client's Destination Connection ID (RFC 9001, 5.2), as aioquic's own stateless
    INVALID_TOKEN close is built."""
    crypto = CryptoPair()
    crypto.setup_initial(cid=client_dcid, is_client=False, version=version)
    builder = QuicPacketBuilder(host_cid=client_dcid, is_client=False, max_datagram_size=SMALLEST_MAX_DATAGRAM_SIZE,
                                peer_cid=client_scid, version=version)
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    buf = builder.start_frame(QuicFrameType.TRANSPORT_CLOSE, capacity=TRANSPORT_CLOSE_FRAME_CAPACITY)
    buf.push_uint_var(QuicErrorCode.CONNECTION_REFUSED)
    buf.push_uint_var(QuicFrameType.PADDING)  # the frame type that caused it: none
    buf.push_uint_var(0)  # no reason phrase
    datagrams, _ = builder.flush()
    return datagrams[0]
