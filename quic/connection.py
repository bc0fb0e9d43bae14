"""Our QUIC connection: aioquic's, plus mutual TLS on the server side and receive windows that slide.

The gaps of aioquic 1.7.2 (pinned; FACTS.md) are closed here, and nowhere else:

1. A server never asks for a client certificate and would not verify one. :class:`MutualTlsContext` asks for
   it, refuses a handshake without one (TLS alert certificate_required), and verifies the chain against the
   configured CA, the validity period, and the key usage (clientAuth) before the handshake completes. A client
   that fails any check never gets a 1-RTT key, so no request reaches an application.
2. aioquic doubles a receive window whenever half of it has *arrived*, so a peer can push without limit while
   the application reads nothing. :class:`KvspQuicConnection` instead grants credit for what the application
   has *consumed*: a stream may be at most ``stream_window`` octets ahead of its reader and a connection at most
   ``connection_window`` ahead of all its readers. Transports report unread octets with :meth:`hold` and
   :meth:`release`.
3. aioquic grants the peer one more unidirectional stream for every one that *finished*, however much of it is
   still unread. With a budget (``uni_streams``, :meth:`KvspQuicConnection.budget_uni_streams`) a peer may have at
   most that many unidirectional streams open or holding octets the application has not read; the application
   reports each one it is done with (:meth:`KvspQuicConnection.uni_stream_done`).
4. aioquic parses the peer's ``max_udp_payload_size`` transport parameter and then ignores it
   (:meth:`KvspQuicConnection.respect_peer_udp_payload`).
5. aioquic's pacer lets a burst of at most 16 *packets* out before it waits for a timer, so the rate it allows
   falls with the datagram size: 16 x 1452 octets per event-loop timer tick (about a millisecond) is ~20 MB/s.
   :class:`OctetBurstPacer` counts the burst in octets (:meth:`KvspQuicConnection.set_pacing_burst`; the default,
   ``TransportSettings.pacing_burst``, is what 16 packets of loopback's 16 KiB datagrams allowed), so a
   connection paces the same octets per tick whatever its datagram size (RFC 9002 7.7: a sender that knows the
   path absorbs larger bursts MAY use a larger limit).
6. aioquic acknowledges 1-RTT packets only when its ACK timer (1 ms) fires, however many arrived, so a sender
   whose congestion window is a few small packets waits a timer tick for every window. :meth:`KvspQuicConnection.
   ack_now` lets the transport acknowledge at the end of a batch of datagrams (RFC 9000 13.2.2: a receiver
   SHOULD acknowledge after two ack-eliciting packets; one ACK per batch is what :mod:`quic.udp` is for).
7. aioquic builds every datagram of a connection at the configured ``max_datagram_size``, whatever the path: 16
   KiB datagrams on a 1500-octet link became IP fragments (RFC 9000, 14: QUIC datagrams must not be fragmented).
   :meth:`KvspQuicConnection.fit_datagrams` sizes them to the path (:func:`quic.udp.datagram_size` of the route's
   MTU, at most the configured maximum and the peer's ``max_udp_payload_size``) before the first packet, with the
   initial congestion window of that size (RFC 9002, 7.2); :meth:`KvspQuicConnection.shrink_datagrams` shrinks
   them when the kernel refuses one as too large for the path (``EMSGSIZE``: the sockets set DF).
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import ssl
from typing import Any, cast

from aioquic import tls
from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from aioquic._buffer
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE
from aioquic.quic.congestion.base import K_INITIAL_WINDOW
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.packet import pull_quic_transport_parameters
from aioquic.quic.recovery import QuicPacketPacer
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID

from quic import rtt
from quic.crl import Revocation
from quic.tls import check_server_auth
from quic.udp import DEFAULT_DATAGRAM, datagram_size

log = logging.getLogger("kvsp.quic")

MIN_PATH_RATE = rtt.MIN_PATH_RATE  # octets/s: the slowest transfer rate :meth:`KvspQuicConnection.path_timeout` allows
_PROBE_UIDS = itertools.count(1 << 62)  # PING uids of probes (aioquic's own pings use id() of a future)


class AlertCertificateRequired(tls.Alert):
    description = tls.AlertDescription.certificate_required


class AlertCertificateRevoked(tls.Alert):
    description = tls.AlertDescription.certificate_revoked


class MutualTlsContext(tls.Context):
    """A server TLS context that requires and verifies a client certificate (RFC 8446 4.3.2, 4.4.2.4)."""

    def _server_handle_certificate(self, input_buf: Buffer) -> None:
        super()._server_handle_certificate(input_buf)
        if self._peer_certificate is None:
            raise AlertCertificateRequired("a client certificate is required")

    def _server_handle_certificate_verify(self, input_buf: Buffer) -> None:
        super()._server_handle_certificate_verify(input_buf)  # checks the signature with the certificate's key
        verify_client_certificate(self._peer_certificate, self._peer_certificate_chain, cadata=self._cadata,
                                  revocation=getattr(self, "_kvsp_revocation", None),
                                  cafile=self._cafile)


class OptionalClientCertContext(MutualTlsContext):
    """:class:`MutualTlsContext` for a listener whose clients may send no certificate
    (``TransportSettings.client_cert_optional``: the front end only). A certificate that is sent is verified as
    strictly; an empty Certificate message continues the handshake unauthenticated (RFC 8446 4.4.2.4)."""

    def _server_handle_certificate(self, input_buf: Buffer) -> None:
        tls.Context._server_handle_certificate(self, input_buf)


class ServerCheckingContext(tls.Context):
    """A client TLS context that checks the server's name itself.

    aioquic delegates the name check to service_identity, which fails ("Certificate extensions could not be
    parsed") on any certificate whose subjectAltName holds a URI with a port -- and every KVSP role certificate
    carries its base URI, port included. So the chain and dates are verified by aioquic with no name, and the
    name (an IP address or a DNS name, RFC 6125 rules: exact, or one leftmost wildcard label) here.
    """

    def _client_handle_certificate_verify(self, input_buf: Buffer) -> None:
        name, self._server_name = self._server_name, None
        try:
            super()._client_handle_certificate_verify(input_buf)
        finally:
            self._server_name = name
        if self._verify_mode != ssl.CERT_NONE and name is not None:
            check_server_name(self._peer_certificate, name)
        if self._verify_mode != ssl.CERT_NONE and self._peer_certificate is not None:
            try:  # a client's certificate (clientAuth only) never authenticates a server (issue 13)
                check_server_auth(self._peer_certificate)
            except ValueError as exc:
                raise tls.AlertUnsupportedCertificate(str(exc)) from None


def check_server_name(cert: x509.Certificate | None, name: str) -> None:
    if cert is None:
        raise tls.AlertBadCertificate("the server sent no certificate")
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise tls.AlertBadCertificate(f"the server certificate has no subjectAltName for {name!r}") from None
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        address = None
    if address is not None:
        if address in sans.get_values_for_type(x509.IPAddress):
            return
    else:
        wanted = name.lower().rstrip(".")
        for pattern in sans.get_values_for_type(x509.DNSName):
            pattern = pattern.lower().rstrip(".")
            if pattern == wanted:
                return
            if pattern.startswith("*.") and "." in wanted and wanted.split(".", 1)[1] == pattern[2:]:
                return
    raise tls.AlertBadCertificate(f"the server certificate is not valid for {name!r}")


def verify_client_certificate(cert: x509.Certificate | None, chain: list[x509.Certificate], *,
                              cadata: bytes | None, cafile: str | None, revocation: Revocation | None = None) -> None:
    if cert is None:
        raise AlertCertificateRequired("a client certificate is required")
    if cadata is None and cafile is None:  # never fall back to a public trust store for client identities
        raise tls.AlertBadCertificate("no CA configured for client certificates")
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        eku = None
    except ValueError as exc:
        raise tls.AlertBadCertificate("certificate extensions could not be parsed") from exc
    if eku is not None and ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
        raise tls.AlertUnsupportedCertificate("certificate is not valid for client authentication")
    # Dates and the chain up to the CA (aioquic's verifier; with no server name it checks no name).
    tls.verify_certificate(certificate=cert, chain=chain, cadata=cadata, cafile=cafile)
    refusal = revocation.refusal(cert) if revocation is not None else None  # [tls] crl (quic.crl)
    if refusal is not None:
        raise AlertCertificateRevoked(refusal)


class OctetBurstPacer(QuicPacketPacer):
    """aioquic's pacer with its burst allowance in octets (``burst``) rather than 16 packets (module docstring,
    point 5). The pacing *rate* is aioquic's: the congestion window per smoothed RTT."""

    burst: int = 256 << 10

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        super().update_rate(congestion_window, smoothed_rtt)
        rate = congestion_window / max(smoothed_rtt, 1e-6)
        self.bucket_max = max(2 * self._max_datagram_size, min(congestion_window // 4, self.burst)) / rate


class KvspQuicConnection(QuicConnection):
    """aioquic's connection with mutual TLS (server side), consumption-based receive windows, an optional budget
    of peer unidirectional streams, and the peer's UDP payload limit respected (see the module docstring)."""

    _kvsp_stream_window: int
    _kvsp_connection_window: int
    _kvsp_unread: dict[int, int]
    _kvsp_unread_total: int
    _kvsp_uni_budget: int | None
    _kvsp_uni_done: int
    _kvsp_client_cert_optional: bool = False
    queued_since_count: int = 0  # stream octets queued since quic.protocol last counted what is buffered

    def __init__(self, *args: Any, stream_window: int | None = None, connection_window: int | None = None,
                 max_streams: int | None = None, uni_streams: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kvsp_setup(stream_window, connection_window, max_streams)
        if uni_streams is not None:  # before the handshake: the transport parameter grants this many too
            self.budget_uni_streams(uni_streams)
            self._local_max_streams_uni.value = self._local_max_streams_uni.sent = uni_streams

    @classmethod
    def adopt(cls, connection: QuicConnection, *, stream_window: int | None = None,
              connection_window: int | None = None, max_streams: int | None = None,
              client_cert_optional: bool = False) -> KvspQuicConnection:
        """Turn a connection aioquic's server created into ours, before it has processed any packet
        (*client_cert_optional*: :class:`OptionalClientCertContext`, the front end's listener only)."""
        connection.__class__ = cls
        conn: KvspQuicConnection = connection  # type: ignore[assignment]
        conn.kvsp_setup(stream_window, connection_window, max_streams)
        conn._kvsp_client_cert_optional = client_cert_optional
        return conn

    def kvsp_setup(self, stream_window: int | None, connection_window: int | None, max_streams: int | None) -> None:
        self._kvsp_stream_window = stream_window or self._local_max_stream_data_bidi_remote
        self._kvsp_connection_window = connection_window or self._local_max_data.value
        self._kvsp_unread = {}
        self._kvsp_unread_total = 0
        self._kvsp_uni_budget = None
        self._kvsp_uni_done = 0
        self.queued_since_count = 0
        if max_streams is not None:
            self._local_max_streams_bidi.value = self._local_max_streams_bidi.sent = max_streams

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """aioquic's, counting the octets queued (the connection's send budget, :mod:`quic.protocol`)."""
        super().send_stream_data(stream_id, data, end_stream)
        self.queued_since_count += len(data)

    # -- mutual TLS -------------------------------------------------------------------------------------------

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if self._is_client:
            self.tls.__class__ = ServerCheckingContext
        else:
            self.tls.__class__ = OptionalClientCertContext if self._kvsp_client_cert_optional else MutualTlsContext
            self.tls._request_client_certificate = True
            self.tls._verify_mode = ssl.CERT_REQUIRED
            self.tls._kvsp_revocation = getattr(self._configuration, "revocation", None)  # type: ignore[attr-defined]

    @property
    def peer_chain_der(self) -> list[bytes]:
        """The verified peer certificate chain, leaf first (empty before the handshake completes)."""
        peer = getattr(self.tls, "_peer_certificate", None)
        if peer is None:
            return []
        return [c.public_bytes(Encoding.DER) for c in [peer, *self.tls._peer_certificate_chain]]

    @property
    def peer_certificate(self) -> x509.Certificate | None:
        return getattr(self.tls, "_peer_certificate", None)

    # -- receive windows -----------------------------------------------------------------------------------------

    def hold(self, stream_id: int, n: int) -> None:
        """*n* received octets of *stream_id* wait, unread, for the application."""
        self._kvsp_unread[stream_id] = self._kvsp_unread.get(stream_id, 0) + n
        self._kvsp_unread_total += n

    def release(self, stream_id: int, n: int) -> bool:
        """The application has read *n* held octets (or they were discarded); their credit can be granted.

        Returns True when that makes a window update due, that is when the caller should transmit now.
        """
        left = self._kvsp_unread.get(stream_id, 0)
        n = min(n, left)
        if left - n:
            self._kvsp_unread[stream_id] = left - n
        else:
            self._kvsp_unread.pop(stream_id, None)
        self._kvsp_unread_total -= n
        limit = self._local_max_data
        if limit.used - self._kvsp_unread_total + self._kvsp_connection_window - limit.value >= \
                self._kvsp_connection_window // 4:
            return True
        stream = self._streams.get(stream_id)
        if stream is None or not stream.max_stream_data_local:
            return False
        window = self._kvsp_stream_window
        consumed = stream.receiver.starting_offset() - (left - n)
        return consumed + window - stream.max_stream_data_local >= window // 4

    def forget(self, stream_id: int) -> None:
        """Drop the accounting of a stream that is gone."""
        self.release(stream_id, self._kvsp_unread.get(stream_id, 0))

    def unread(self, stream_id: int) -> int:
        """Octets of *stream_id* held (:meth:`hold`) and not yet released."""
        return self._kvsp_unread.get(stream_id, 0)

    # -- peer unidirectional streams ------------------------------------------------------------------------------

    def budget_uni_streams(self, uni_streams: int) -> None:
        """Admit peer unidirectional streams only while fewer than *uni_streams* are open or unread (MAX_STREAMS
        grows by one per :meth:`uni_stream_done`, not aioquic's one per finished stream). On an accepted (server)
        connection the handshake has already granted the listener's initial MAX_STREAMS (aioquic: 128), so the
        budget bounds what is granted beyond that."""
        if uni_streams < 1:
            raise ValueError("the unidirectional stream budget is at least 1")
        self._kvsp_uni_budget = uni_streams
        self._kvsp_uni_done = 0

    def uni_stream_done(self) -> bool:
        """A peer unidirectional stream has ended and every octet of it was read: the peer may open another.
        True when a budget is in force (then MAX_STREAMS may be due: the caller should transmit soon)."""
        self._kvsp_uni_done += 1
        return self._kvsp_uni_budget is not None

    # -- acknowledgements ------------------------------------------------------------------------------------------

    def ack_now(self, now: float) -> None:
        """Acknowledge the 1-RTT packets received so far in the next transmit, not when the ACK timer fires."""
        space = self._spaces.get(tls.Epoch.ONE_RTT)
        if space is not None and space.ack_at is not None and space.ack_at > now:
            space.ack_at = now

    # -- keep-alive ---------------------------------------------------------------------------------------------

    def end_now(self) -> None:
        """End a connection that :meth:`close` is closing without waiting out its closing period: the peer has
        gone silent (keep-alive PINGs unacknowledged), which RFC 9000 10.1 treats like an idle timeout: "the
        connection is silently closed and its state is discarded". The ConnectionTerminated event follows."""
        if self._close_event is not None and self._state is not QuicConnectionState.TERMINATED:
            self._close_end()

    # -- the path's pace: timeouts that scale with the measured RTT ----------------------------------------------

    def path_timeout(self, *, floor: float, ceiling: float, multiplier: float = 4.0, octets: int = 0,
                     rate: float = MIN_PATH_RATE) -> float:
        """*multiplier* probe timeouts of this path (RFC 9002 6.2.1: ``smoothed_rtt + max(4 * rttvar, 1 ms) +
        max_ack_delay``) plus the time *octets* take at *rate* octets/s, kept within [*floor*, *ceiling*];
        *ceiling* before the first RTT sample. What a wait for a peer's next octets should allow: a few round
        trips and the transfer, not a fixed number of seconds."""
        return rtt.path_timeout(self.rtt_sample(), floor=floor, ceiling=ceiling, multiplier=multiplier,
                                octets=octets, rate=rate)

    def rtt_sample(self) -> rtt.RttSample | None:
        """This path's RTT estimate (RFC 9002 5.3: smoothed_rtt, rttvar, the peer's max_ack_delay), None before
        the first sample: what :class:`quic.rtt.RttTable` keeps per host for the connects that follow."""
        loss = self._loss
        if not loss._rtt_initialized:
            return None
        return rtt.RttSample(loss._rtt_smoothed, loss._rtt_variance, loss.max_ack_delay)

    def probe(self) -> None:
        """Queue a PING for the next transmit (the caller transmits): an ack-eliciting packet on a quiet
        connection. A live peer acknowledges it; at a dead one the kernel answers ICMP port unreachable and the
        client's connected socket ends the connection (:meth:`quic.protocol.KvspQuicProtocol.error_received`)."""
        self.send_ping(next(_PROBE_UIDS))

    # -- pacing ---------------------------------------------------------------------------------------------------

    def set_pacing_burst(self, burst: int) -> None:
        """Let the pacer send up to *burst* octets (at least two datagrams, at most a quarter of the congestion
        window) before it waits, whatever the datagram size (:class:`OctetBurstPacer`)."""
        pacer = self._loss._pacer
        pacer.__class__ = OctetBurstPacer
        cast(OctetBurstPacer, pacer).burst = burst

    # -- datagrams sized to the path and to the peer ------------------------------------------------------------

    _kvsp_peer_udp_limit: int | None = None

    def fit_datagrams(self, mtu: int | None) -> int:
        """Build datagrams that a path of *mtu* octets carries (:func:`quic.udp.datagram_size`; 1452 where *mtu* is
        None), never more than the configured ``max_datagram_size`` nor the peer's ``max_udp_payload_size``. Called
        before the first packet (a client once its socket is connected, a server for each new peer) it also sets
        the initial congestion window to that of the size (RFC 9002, 7.2: ten datagrams). Returns the size."""
        size = datagram_size(mtu, self._configuration.max_datagram_size)
        loss = self._loss
        fresh = self._packet_number == 0 and not loss.bytes_in_flight
        size = self._set_datagram_size(size)
        if fresh:
            loss._cc.congestion_window = K_INITIAL_WINDOW * size
        return size

    def shrink_datagrams(self, refused: int, mtu: int | None) -> int:
        """The kernel refused a datagram of *refused* octets as larger than the path carries (``EMSGSIZE``; DF is
        set, so it was dropped, not fragmented, and loss recovery resends its frames): build datagrams for *mtu*
        (the route's MTU as the kernel knows it now), and when that is no smaller, 1452 octets, then 1200. A
        refused datagram larger than today's size was built before an earlier shrink: nothing changes. Returns
        the size."""
        current = self._max_datagram_size
        if refused > current:
            return current
        size = datagram_size(mtu, self._configuration.max_datagram_size)
        if size >= current:
            size = DEFAULT_DATAGRAM if current > DEFAULT_DATAGRAM else SMALLEST_MAX_DATAGRAM_SIZE
        size = self._set_datagram_size(min(size, current))
        log.debug("datagrams shrunk to %d octets (path MTU %s)", size, mtu)
        return size

    @property
    def datagram_size(self) -> int:
        """The largest datagram this connection builds now."""
        return self._max_datagram_size

    def _set_datagram_size(self, size: int) -> int:
        if self._kvsp_peer_udp_limit is not None:
            size = min(size, self._kvsp_peer_udp_limit)
        size = max(size, SMALLEST_MAX_DATAGRAM_SIZE)
        self._max_datagram_size = size
        loss = self._loss
        loss._pacer._max_datagram_size = size
        cc = loss._cc
        if hasattr(cc, "_max_datagram_size"):
            cc._max_datagram_size = size
        if hasattr(cc, "additive_increase_factor"):  # cubic's Reno-friendly growth: one datagram per window
            cc.additive_increase_factor = size
        return size

    def respect_peer_udp_payload(self) -> int | None:
        """Send no datagram larger than the peer's ``max_udp_payload_size`` transport parameter (RFC 9000, 18.2).

        aioquic 1.7.2 (pinned) parses the parameter but then ignores it, sending datagrams of the configured size
        (16 KiB on loopback, FACTS.md): peers that take the parameter at its word (picoquic, so aiomoqt, advertises
        1500 or so) drop them all and the connection stalls once packets grow past it. Call once the handshake is
        complete; returns the peer's limit (None when it stated none)."""
        extensions = getattr(self.tls, "received_extensions", None) or []
        for ext_type, data in extensions:
            if ext_type != tls.ExtensionType.QUIC_TRANSPORT_PARAMETERS:
                continue
            try:
                params = pull_quic_transport_parameters(Buffer(data=data))
            except Exception:  # aioquic already accepted these; be lenient here
                return None
            limit = params.max_udp_payload_size
            if limit is not None:
                self._kvsp_peer_udp_limit = limit
                if limit < self._max_datagram_size:
                    self._set_datagram_size(limit)
                    log.debug("peer limits UDP payloads to %d octets", limit)
            return limit
        return None

    # -- writing the limits ----------------------------------------------------------------------------------------

    def _write_connection_limits(self, builder: Any, space: Any) -> None:
        budget = self._kvsp_uni_budget
        if budget is not None:  # not aioquic's one more per finished stream: one more per stream ended and read
            uni = self._local_max_streams_uni
            uni.value = max(uni.sent, self._kvsp_uni_done + budget)
        limit = self._local_max_data
        window = self._kvsp_connection_window
        target = limit.used - self._kvsp_unread_total + window
        if target - limit.value >= window // 4:
            limit.value = target
        used, limit.used = limit.used, 0  # keep aioquic from doubling the window; it then just writes frames
        try:
            super()._write_connection_limits(builder, space)
        finally:
            limit.used = used

    def _write_stream_limits(self, builder: Any, space: Any, stream: Any) -> None:
        # Called for every stream in every packet aioquic builds: return at once when no frame is due.
        local = stream.max_stream_data_local
        if not local:  # a stream of ours that receives nothing
            return
        window = self._kvsp_stream_window
        if stream.max_stream_data_local_sent == local and \
                stream.receiver.highest_offset + window - local < window >> 2:  # consumed <= highest: none due
            return
        target = stream.receiver.starting_offset() - self._kvsp_unread.get(stream.stream_id, 0) + window
        if target - local >= window >> 2:
            stream.max_stream_data_local = target
        elif stream.max_stream_data_local_sent == local:
            return
        highest, stream.receiver.highest_offset = stream.receiver.highest_offset, 0  # no doubling either
        try:
            super()._write_stream_limits(builder, space, stream)
        finally:
            stream.receiver.highest_offset = highest
