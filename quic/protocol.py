"""One QUIC connection on asyncio, either side: what HTTP/3 and MOQT, servers and clients, share.

:class:`KvspQuicProtocol` is aioquic's ``QuicConnectionProtocol`` on a :class:`~quic.connection.KvspQuicConnection`,
with

* batched datagrams (:class:`~quic.udp.BatchedUdpTransport`): :meth:`~KvspQuicProtocol.datagram_received` only
  takes a datagram in; :meth:`~KvspQuicProtocol.datagrams_done`, once per batch, processes the events and
  transmits once (one ACK for many packets);
* per batch, too: adjacent STREAM data events of one stream merged into one (:func:`coalesce_stream_data`), and
  an ACK at once when the batch held two or more datagrams (:meth:`~quic.connection.KvspQuicConnection.ack_now`);
* :meth:`~KvspQuicProtocol.transmit` hands all the datagrams of a transmit to the transport together, which sends
  runs of them with UDP segmentation offload (:meth:`~quic.udp.BatchedUdpTransport.send_datagrams`); pacing bursts
  are counted in octets (``TransportSettings.pacing_burst``);
* :meth:`~KvspQuicProtocol.transmit_soon`: one transmit per event-loop iteration however many callers ask;
* send backpressure: :meth:`~KvspQuicProtocol.wait_writable` waits while QUIC's unsent + unacknowledged octets of
  a stream (:meth:`~KvspQuicProtocol.buffered`) exceed ``TransportSettings.send_buffer``, or those of all the
  connection's streams (:meth:`~KvspQuicProtocol.connection_buffered`) exceed
  ``TransportSettings.connection_send_buffer`` -- else a peer that opens many streams and reads none (a MOQT
  FETCH flood, issue 13) makes the sender hold a send buffer per stream. A stream the peer has granted credit
  beyond what is queued on it (it reads it) is not held back by the connection's limit, so a peer that reads
  one stream at a time is not deadlocked by streams it reads later. A waiting writer is woken after a transmit
  once its stream, and the connection (or that credit), are down to half of their limit; it fails when the
  connection ends;
* :attr:`~KvspQuicProtocol.confirmed`, resolved on HANDSHAKE_DONE: TLS 1.3 lets a client finish its side of the
  handshake before the server has judged the client's certificate, so a client knows it was accepted only then.
  It fails with the close reason if the connection ends first;
* :attr:`~KvspQuicProtocol.closed`, :attr:`~KvspQuicProtocol.close_reason` and a graceful
  :meth:`~KvspQuicProtocol.aclose`.

A client connection owns its UDP socket (closed with the connection), connected to the peer so that ICMP port
unreachable ends the connection at once (:meth:`KvspQuicProtocol.error_received`); a server connection shares
its listener's.
:func:`connect_quic` opens a client connection: resolve, bind a tuned socket (DF set), size datagrams to the route's
MTU, handshake, confirmation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.connection import END_STATES
from aioquic.quic.packet import QuicErrorCode

from quic.connection import KvspQuicConnection
from quic.tls import TlsFiles, TransportSettings, quic_configuration
from quic.udp import BatchedUdpTransport, bind_udp, connect_udp, route_mtu

PEER_UNREACHABLE = "peer unreachable (ICMP port unreachable: nothing listens at its port)"


class QuicConnectError(ConnectionError):
    """The QUIC handshake failed or timed out (UDP blocked, ALPN refused, certificate rejected)."""


class PeerUnreachable(ConnectionError):
    """ICMP port unreachable ended the connection: nothing listens at the peer's port any more. It is the cause
    (``__cause__``) of the error a failed handshake or a closed connection raises; :func:`peer_unreachable` finds
    it, however the error was named on the way."""

    def __init__(self) -> None:
        super().__init__(PEER_UNREACHABLE)


def peer_unreachable(exc: BaseException | None) -> bool:
    """Whether *exc*, or an error it was raised from, is :class:`PeerUnreachable`."""
    while exc is not None:
        if isinstance(exc, PeerUnreachable):
            return True
        exc = exc.__cause__
    return False


class KvspQuicProtocol(QuicConnectionProtocol):
    """A QUIC connection with batched receiving, deferred transmits, send backpressure and confirmation."""

    closed_error: ClassVar[type[ConnectionError]] = ConnectionError
    """What writers get when the connection is gone (:meth:`connection_closed_error`)."""
    no_error_code: ClassVar[int] = 0x0
    """The application's NO_ERROR, sent by :meth:`aclose`."""
    close_reason_format: ClassVar[str] = "QUIC error 0x{code:x}: {reason}"

    def __init__(self, quic: KvspQuicConnection, *, settings: TransportSettings, **kwargs: Any) -> None:
        super().__init__(quic, **kwargs)
        self.quic = quic
        self.settings = settings
        quic.set_pacing_burst(settings.pacing_burst)
        self.closed = False
        self.close_reason = ""
        self.peer_unreachable = False  # ICMP port unreachable ended it (error_received)
        self.confirmed: asyncio.Future[None] = self._loop.create_future()
        self._writers: dict[int, asyncio.Future[None]] = {}
        self._buffered_total = 0  # every stream's buffered octets as of the last transmit
        self._transmit_pending = False
        self._batch = 0  # datagrams received in this batch

    # -- receiving ---------------------------------------------------------------------------------------------

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        """Take in a datagram; events and replies wait for the end of the batch (:meth:`datagrams_done`)."""
        self._quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
        self._batch += 1

    def datagrams_done(self) -> None:
        if self._batch >= 2:  # acknowledge a batch at once (RFC 9000 13.2.2); a lone packet waits for the ACK timer
            self.quic.ack_now(self._loop.time())  # and usually rides on the answer
        self._batch = 0
        coalesce_stream_data(self.quic)
        self._process_events()
        self.transmit()
        if not self.confirmed.done() and self._quic._handshake_confirmed:
            self.confirmed.set_result(None)

    def quic_event_received(self, event: events.QuicEvent) -> None:
        """Subclasses handle their events after calling this (aioquic's stream readers are not used)."""
        if isinstance(event, events.ConnectionTerminated):
            self.closed = True
            self.close_reason = self.close_reason_format.format(code=event.error_code, reason=event.reason_phrase)
            err = self.connection_closed_error()
            for waiter in self._writers.values():
                if not waiter.done():
                    waiter.set_exception(err)
            self._writers.clear()
            if not self.confirmed.done():
                self.confirmed.set_exception(ConnectionError(self.close_reason))
                self.confirmed.exception()  # retrieved: whoever waits for it reports close_reason
            if self._quic.configuration.is_client and self._transport is not None:
                self._loop.call_soon(self._transport.close)  # the socket is of no further use

    def error_received(self, exc: Exception) -> None:
        """The client's connected socket got ``ECONNREFUSED`` (:mod:`quic.udp`): ICMP port unreachable, nothing
        listens at the peer's port any more (a crashed or killed process). The connection ends now, as if the idle
        timeout had fired, with the reason :data:`PEER_UNREACHABLE`: a handshake fails in milliseconds instead of
        waiting out its timeout, and requests on an established connection fail instead of stalling. A server's
        socket is unconnected and never reports this."""
        quic = self.quic
        if not isinstance(exc, ConnectionRefusedError) or self.closed or not quic.configuration.is_client:
            return
        if quic._state in END_STATES:
            return
        self.peer_unreachable = True
        quic.close(error_code=QuicErrorCode.INTERNAL_ERROR, reason_phrase=PEER_UNREACHABLE)
        quic.end_now()  # no closing period: the peer is gone, there is nobody to send CONNECTION_CLOSE to
        self._process_events()
        if self._timer is not None:  # nothing left to time (aioquic's timer would compare against no close time)
            self._timer.cancel()
            self._timer = None
            self._timer_at = None

    def datagram_too_large(self, addr: Any, size: int, mtu: int | None) -> None:
        """The transport's kernel refused a *size*-octet datagram as larger than the path (of *mtu* octets now)
        carries (:mod:`quic.udp`): smaller datagrams from now on (:meth:`~quic.connection.KvspQuicConnection.
        shrink_datagrams`); loss recovery resends what was dropped."""
        if not self.closed:
            self.quic.shrink_datagrams(size, mtu)

    def connection_closed_error(self) -> ConnectionError:
        """What writers and readers get once the connection is gone (caused by :class:`PeerUnreachable` when ICMP
        port unreachable ended it)."""
        error = self.closed_error(f"connection closed ({self.close_reason})")
        if self.peer_unreachable:
            error.__cause__ = PeerUnreachable()
        return error

    # -- sending -----------------------------------------------------------------------------------------------

    def transmit_soon(self) -> None:
        if not self._transmit_pending:
            self._transmit_pending = True
            self._loop.call_soon(self._deferred_transmit)

    def _deferred_transmit(self) -> None:
        self._transmit_pending = False
        if not self.closed:
            self.transmit()

    def transmit(self) -> None:
        """aioquic's transmit (pinned 1.7.2), with the datagrams of one call handed to the transport together
        (:meth:`~quic.udp.BatchedUdpTransport.send_datagrams`: segmentation offload), then writers woken."""
        self._transmit_task = None
        datagrams = self._quic.datagrams_to_send(now=self._loop.time())
        if datagrams:
            transport = self._transport
            if isinstance(transport, BatchedUdpTransport):
                transport.send_datagrams(datagrams)
            elif transport is not None:
                for data, addr in datagrams:
                    transport.sendto(data, addr)
        timer_at = self._quic.get_timer()
        if self._timer is not None and self._timer_at != timer_at:
            self._timer.cancel()
            self._timer = None
        if self._timer is None and timer_at is not None:
            self._timer = self._loop.call_at(timer_at, self._handle_timer)
        self._timer_at = timer_at
        self._count_buffered()
        if self._writers:
            self._wake_writers()

    def _count_buffered(self) -> None:
        self._buffered_total = sum(len(s.sender._buffer) for s in self._quic._streams.values())
        self.quic.queued_since_count = 0

    def connection_buffered(self) -> int:
        """Octets of every stream queued in QUIC and not yet acknowledged (as of the last transmit, plus what
        was queued since)."""
        return self._buffered_total + self.quic.queued_since_count

    def buffered(self, stream_id: int) -> int:
        """Octets of *stream_id* queued in QUIC and not yet acknowledged by the peer."""
        stream = self._quic._streams.get(stream_id)
        return len(stream.sender._buffer) if stream is not None else 0

    async def wait_writable(self, stream_id: int) -> None:
        """Wait until the stream's send buffer is below the high-water mark (or the stream is gone), and the
        connection's below its own."""
        if self.closed:
            raise self.connection_closed_error()
        limit = self.settings.send_buffer
        total = self.settings.connection_send_buffer
        while self.buffered(stream_id) > limit or (self.connection_buffered() > total and not self._wanted(stream_id)):
            waiter = self._writers.get(stream_id)
            if waiter is None or waiter.done():
                waiter = self._writers[stream_id] = self._loop.create_future()
            await waiter

    def _wanted(self, stream_id: int) -> bool:
        """The peer's credit for *stream_id* goes beyond what is queued on it: the peer is reading it."""
        stream = self._quic._streams.get(stream_id)
        return stream is not None and stream.sender._buffer_stop < stream.max_stream_data_remote

    def _wake_writers(self) -> None:
        low = self.settings.send_buffer // 2
        roomy = self.connection_buffered() <= self.settings.connection_send_buffer // 2
        for stream_id, waiter in list(self._writers.items()):
            if self.buffered(stream_id) <= low and (roomy or self._wanted(stream_id)):
                del self._writers[stream_id]
                if not waiter.done():
                    waiter.set_result(None)

    # -- opening and closing -----------------------------------------------------------------------------------

    async def application_ready(self) -> None:
        """What :func:`connect_quic` waits for after the confirmation (MOQT: the SETUP exchange); nothing here."""

    def failure_reason(self, exc: BaseException, timeout: float) -> str:
        """Why :func:`connect_quic` failed: the peer's close reason when it gave one."""
        if self.close_reason:
            return self.close_reason
        if isinstance(exc, TimeoutError):
            return f"no answer within {timeout:.1f} s" + ("" if self._connected else " (UDP blocked?)")
        return str(exc) or type(exc).__name__

    async def aclose(self) -> None:
        """Close with the application's NO_ERROR, wait (a second at most) for the closing period, let go of the
        socket."""
        if not self.closed:
            self.close(error_code=self.no_error_code, reason_phrase="")
            self.closed = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.wait_closed(), 1.0)
        if self._quic.configuration.is_client and self._transport is not None:
            self._transport.close()


def coalesce_stream_data(quic: KvspQuicConnection) -> None:
    """Merge the adjacent STREAM data events of one stream that a batch of datagrams produced into one event.

    aioquic raises one event per STREAM frame, so one per datagram of a bulk transfer, and every event costs a trip
    through the application's stream code (HTTP/3 frame parsing, MOQT object parsing, window accounting). Joined,
    a batch of 64 datagrams of one stream costs one trip. Order is kept: only events next to each other in the
    queue merge, so what the application sees is the same octets in the same order, in fewer, larger pieces."""
    queue = quic._events
    if len(queue) < 2:
        return
    merged: collections.deque[events.QuicEvent] = collections.deque()
    last: events.StreamDataReceived | None = None
    parts: list[bytes] | None = None
    for event in queue:
        if type(event) is events.StreamDataReceived:
            if last is not None and event.stream_id == last.stream_id and not last.end_stream:
                if parts is None:
                    parts = [last.data]
                parts.append(event.data)
                last.end_stream = event.end_stream
                continue
            if parts is not None:
                assert last is not None
                last.data, parts = b"".join(parts), None
            last = event
        else:
            if parts is not None:
                assert last is not None
                last.data, parts = b"".join(parts), None
            last = None
        merged.append(event)
    if parts is not None:
        assert last is not None
        last.data = b"".join(parts)
    quic._events = merged


P = TypeVar("P", bound=KvspQuicProtocol)


async def connect_quic(host: str, port: int, files: TlsFiles, *, alpn: Sequence[str], settings: TransportSettings,
                       protocol_factory: Callable[..., P], server_name: str | None = None, timeout: float = 10.0,
                       quic_factory: Callable[..., KvspQuicConnection] = KvspQuicConnection,
                       error: Callable[[str], Exception] = QuicConnectError) -> P:
    """A client connection to *host*:*port* with mutual TLS, offering *alpn*, on its own tuned UDP socket.

    ``protocol_factory(quic, settings=settings)`` makes the protocol of a connection ``quic_factory(configuration=,
    stream_window=, connection_window=)`` makes (our windows from *settings*). Returns once the handshake is
    complete, the server has confirmed it (so accepted our certificate) and the protocol's
    :meth:`~KvspQuicProtocol.application_ready` has returned, all within *timeout*; otherwise raises
    ``error(reason)``, the reason being the server's when it closed the connection.
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    if not infos:
        raise error(f"cannot resolve {host}")
    family, _, _, _, addr = infos[0]
    config = quic_configuration(files, is_client=True, alpn=alpn, settings=settings, server_name=server_name or host)
    quic = quic_factory(configuration=config, stream_window=settings.stream_window,
                        connection_window=settings.connection_window)
    sock = bind_udp("::" if family == socket.AF_INET6 else "0.0.0.0", 0, settings.socket_buffer)
    protocol = protocol_factory(quic, settings=settings)
    transport = BatchedUdpTransport(loop, sock, protocol)
    try:
        connect_udp(sock, addr)  # a dead port answers ICMP port unreachable: the connection fails at once
    except OSError as exc:  # no route to the peer
        transport.close()
        raise error(f"cannot reach {host}:{port}: {exc.strerror or exc}") from None
    quic.fit_datagrams(route_mtu(sock))  # datagrams the route to the peer carries unfragmented (quic.udp)
    try:
        protocol.connect(addr)
        async with asyncio.timeout(timeout):
            await protocol.wait_connected()
            await protocol.confirmed
            await protocol.application_ready()
    except (TimeoutError, ConnectionError) as exc:
        transport.close()
        cause = PeerUnreachable() if protocol.peer_unreachable else None
        raise error(protocol.failure_reason(exc, timeout)) from cause
    except BaseException:  # cancelled mid-handshake (a caller's timeout, a pool closing): no socket left behind
        transport.close()
        raise
    return protocol
