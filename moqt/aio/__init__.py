"""The asyncio adapter: a sans-I/O :class:`~moqt.session.MoqtSession` on an aioquic connection.

Server side: :func:`moqt_handlers` gives :class:`quic.listener.QuicListener` (and so
:class:`http3.server.RoleServer`) a handler per MOQT ALPN (``moq-00``: draft 14, ``moqt-18``: draft 18), so a
role's one UDP port serves HTTP/3 and MOQT with the same mutual TLS; each connection's session knows the peer's
verified identity (:attr:`MoqtConnection.peer_identity`, the certificate's SAN URI) for authorization::

    server = RoleServer(app, files, quic_handlers=moqt_handlers(MyApp()))

Client side: :func:`connect_moqt` (:func:`quic.protocol.connect_quic`, like
:func:`http3.h3_client.connect_h3`: batched UDP, mutual TLS, waits for HANDSHAKE_DONE, then for the peer's SETUP)
returns the :class:`MoqtConnection`::

    conn = await connect_moqt("127.0.0.1", port, files)                  # offers both drafts
    async with conn.fetch(namespace, track, Location(0, 0), Location(0, 32)) as fetch:
        await fetch.wait_accepted()
        async for piece in fetch.pieces():                                # or fetch.objects()
            ...
    await conn.aclose()

What the adapter does, and nothing more (the session holds every protocol rule):

* executes the session's actions on the aioquic connection; stream ids pass through unchanged (the session
  numbers its streams as QUIC does);
* feeds stream data, resets, STOP_SENDING, datagrams and the connection's end into the session and routes the
  events: replies and objects to the :class:`FetchStream` of our request, the peer's requests to the
  :class:`MoqtApp`;
* flow control: object payload octets handed to a :class:`FetchStream` are held (``KvspQuicConnection.hold``) and
  credited back to the peer only as the consumer takes them (``release``); everything else (control and request
  streams, object headers) is credited at once, so control streams are never blocked by their own windows. On
  the client, peer unidirectional streams (MOQT data streams) are admitted with MAX_STREAMS only while fewer than
  ``data_streams`` + 1 are open or unread, and the connection window exceeds what they can hold unread by
  :data:`CONTROL_RESERVE`: however slowly the consumer reads, credit for control messages remains;
* send backpressure: :class:`ServedFetch` writes object payloads in slices of half the send buffer, each after
  ``wait_writable`` (QUIC's unsent + unacknowledged octets of the stream below the send buffer; both sides'
  connections are :class:`quic.protocol.KvspQuicProtocol`).

Priorities (``OpenStream.priority``) are not applied: aioquic has no stream priorities.

The modules: :mod:`moqt.aio.errors` (exceptions), :mod:`moqt.aio.fetches` (:class:`FetchStream`,
:class:`ServedFetch`, :class:`FetchSink`), :mod:`moqt.aio.connection` (:class:`MoqtApp` and
:class:`MoqtConnection` with its event table), :mod:`moqt.aio.endpoints` (:func:`moqt_handlers`,
:func:`connect_moqt`, :class:`MoqtPool`), :mod:`moqt.aio.limits` (per-principal request bounds,
:class:`PeerLimits`), :mod:`moqt.aio.revocation` (sessions closed after a reload, :func:`recheck_sessions`).
The QUIC mechanisms they rely on (held octets, the data-stream budget, the peer's UDP payload limit) are
:class:`quic.connection.KvspQuicConnection`'s.
"""

from moqt.aio.audit import AUDIT, SessionAudit, reason_label
from moqt.aio.connection import MoqtApp, MoqtConnection, QuicTransport, internal_error_code, not_supported_code
from moqt.aio.endpoints import (
    CONTROL_RESERVE,
    DEFAULT_DATA_STREAMS,
    MoqtPool,
    MoqtServerHandler,
    connect_moqt,
    moqt_handlers,
)
from moqt.aio.errors import (
    FetchCancelled,
    MoqtConnectError,
    MoqtRequestError,
    MoqtSessionClosed,
    MoqtStalled,
    MoqtStreamError,
)
from moqt.aio.fetches import FetchSink, FetchStream, MoqtObject, ServedFetch
from moqt.aio.limits import PeerLimits, Slot, excessive_load_code, principal_of
from moqt.aio.revocation import recheck_sessions

__all__ = [
    "AUDIT",
    "CONTROL_RESERVE",
    "DEFAULT_DATA_STREAMS",
    "FetchCancelled",
    "FetchSink",
    "FetchStream",
    "MoqtApp",
    "MoqtConnectError",
    "MoqtConnection",
    "MoqtObject",
    "MoqtPool",
    "MoqtRequestError",
    "MoqtServerHandler",
    "MoqtSessionClosed",
    "MoqtStalled",
    "MoqtStreamError",
    "PeerLimits",
    "QuicTransport",
    "ServedFetch",
    "SessionAudit",
    "Slot",
    "connect_moqt",
    "excessive_load_code",
    "internal_error_code",
    "moqt_handlers",
    "not_supported_code",
    "principal_of",
    "reason_label",
    "recheck_sessions",
]
