"""Both ends of a MOQT connection on :mod:`quic`: the server side (:func:`moqt_handlers`, a handler per MOQT ALPN
for :class:`quic.listener.QuicListener`), the client side (:func:`connect_moqt`) and a pool of client connections
by ``moqt://`` URI (:class:`MoqtPool`).

MOQT's flow-control policy lives here (the mechanisms are :class:`quic.connection.KvspQuicConnection`'s): on the
client, peer unidirectional streams (MOQT data streams) are admitted only while fewer than ``data_streams`` + 1 are
open or unread, and the connection window exceeds what they can hold unread by :data:`CONTROL_RESERVE`, so credit
for control messages remains however slowly the consumer reads. A server that also fetches on accepted
connections (a relay) budgets them the same way (``moqt_handlers(data_streams=)``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from aioquic.quic import events as qe

from moqt.aio.audit import AUDIT, reason_label
from moqt.aio.connection import MoqtApp, MoqtConnection
from moqt.aio.errors import MoqtConnectError, MoqtSessionClosed
from moqt.requests import Role, SessionConfig
from moqt.types import PREFERRED_ALPNS, alpn_order
from quic.connection import KvspQuicConnection
from quic.listener import HandlerFactory, QuicConnectionContext
from quic.pool import SpreadPool
from quic.protocol import KvspQuicProtocol, connect_quic
from quic.rtt import RttSample, RttTable
from quic.tls import TLS_1_3, TlsFiles, TransportSettings, serves, tls_extension

CONTROL_RESERVE = 1 << 20  # connection credit kept free of data-stream octets, for control messages
DEFAULT_DATA_STREAMS = 4  # client: peer data streams open (or unread) at once


# -- server side: QuicListener handlers ------------------------------------------------------------------------


class MoqtServerHandler:
    """A :class:`quic.listener.ConnectionHandler` for one MOQT connection."""

    def __init__(self, ctx: QuicConnectionContext, app: MoqtApp, config: SessionConfig | None = None, *,
                 data_streams: int | None = None) -> None:
        ctx.quic.respect_peer_udp_payload()
        if data_streams is not None:  # a relay: the peer's data streams (our upstream fetches) are budgeted
            ctx.quic.budget_uni_streams(data_streams + 1)
        self.conn = MoqtConnection(ctx.protocol, ctx.alpn, Role.SERVER, config=config, tls=ctx.tls, app=app,
                                   peer=ctx.client, send_buffer=ctx.settings.send_buffer)
        self.conn.start()

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        self.conn.quic_event_received(event)

    def connection_terminated(self) -> None:
        self.conn.connection_terminated()

    async def drain(self) -> None:
        await self.conn.drain()


def moqt_handlers(app: MoqtApp, *, config: SessionConfig | None = None, alpns: Sequence[str] = PREFERRED_ALPNS,
                  data_streams: int | None = None) -> dict[str, HandlerFactory]:
    """Handler factories for :class:`~quic.listener.QuicListener` / ``RoleServer(quic_handlers=...)``: every
    MOQT connection gets a session of its ALPN's draft, served by *app*. *data_streams*: for a server that also
    fetches on accepted connections (a relay), the peer data streams admitted at once beyond the handshake's
    grant (see :meth:`quic.connection.KvspQuicConnection.budget_uni_streams`)."""
    order = alpn_order(alpns)
    if data_streams is not None and data_streams < 1:
        raise ValueError("data_streams must be at least 1")

    def factory(ctx: QuicConnectionContext) -> MoqtServerHandler:
        return MoqtServerHandler(ctx, app, config, data_streams=data_streams)

    return {alpn: factory for alpn in order}  # the listener offers its ALPNs in this order


# -- client side ------------------------------------------------------------------------------------------------


class _ClientProtocol(KvspQuicProtocol):
    def __init__(self, quic: KvspQuicConnection, *, settings: TransportSettings,
                 make: Callable[[_ClientProtocol, str], MoqtConnection], **kwargs: Any) -> None:
        super().__init__(quic, settings=settings, **kwargs)
        self._make = make
        self.conn: MoqtConnection | None = None
        self.terminated: qe.ConnectionTerminated | None = None  # the QUIC close, if the connection ended

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        super().quic_event_received(event)
        if isinstance(event, qe.ConnectionTerminated):
            self.terminated = event
        if isinstance(event, qe.HandshakeCompleted):
            self.quic.respect_peer_udp_payload()
            try:
                self.conn = self._make(self, event.alpn_protocol or "")
            except ValueError as exc:  # not a MOQT ALPN: cannot happen with the ALPNs we offer
                self._quic.close(error_code=0x178, reason_phrase=str(exc))
                return
            self.conn.start()
        elif isinstance(event, qe.ConnectionTerminated):
            if self.conn is not None:
                self.conn.connection_terminated(event.error_code, event.reason_phrase)
        elif self.conn is not None:
            self.conn.quic_event_received(event)

    async def application_ready(self) -> None:
        conn = self.conn
        assert conn is not None
        await conn.ready()

    def failure_reason(self, exc: BaseException, timeout: float) -> str:
        return str(exc) if isinstance(exc, MoqtSessionClosed) else super().failure_reason(exc, timeout)


async def connect_moqt(host: str, port: int, files: TlsFiles, *, settings: TransportSettings = TransportSettings(),
                       alpn: str | Sequence[str] = PREFERRED_ALPNS, server_name: str | None = None,
                       timeout: float = 10.0,
                       config: SessionConfig | None = None, app: MoqtApp | None = None,
                       data_streams: int = DEFAULT_DATA_STREAMS, path: bytes = b"/",
                       expect_identity: str | None = None) -> MoqtConnection:
    """A client MOQT session to *host*:*port* with mutual TLS, offering *alpn* (both drafts by default; the server
    picks). Returns once HANDSHAKE_DONE has arrived (the server accepted our certificate) and SETUP is complete;
    raises :class:`MoqtConnectError` otherwise (the server offers no MOQT ALPN, refuses the certificate, does not
    answer within *timeout*). *data_streams*: peer data streams admitted at once (see the module docstring).

    The server is checked as a role (issue 13): its certificate must allow serverAuth (``quic.connection``); a
    certificate with a SAN URI must name a role's ``https`` base URI on *host* (:func:`quic.tls.serves`; MOQT
    peers without one, such as interop servers, are checked by host name only); with *expect_identity*, the SAN
    URI must be exactly that identity. A mismatch closes the session and raises :class:`MoqtConnectError`."""
    alpns = list(alpn_order([alpn] if isinstance(alpn, str) else alpn))
    if data_streams < 1:
        raise ValueError("data_streams must be at least 1")
    window = max(settings.connection_window, (data_streams + 1) * settings.stream_window + CONTROL_RESERVE)
    tuned = dataclasses.replace(settings, connection_window=window)
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    session_config = config or SessionConfig(path=path, authority=authority.encode("ascii"))

    def make(protocol: _ClientProtocol, negotiated: str) -> MoqtConnection:
        tls = tls_extension(protocol.quic.peer_chain_der, server_cert_pem=None, tls_version=TLS_1_3,
                            cipher_suite=None)
        return MoqtConnection(protocol, negotiated, Role.CLIENT, config=session_config, tls=tls, app=app,
                              peer=(host, port), send_buffer=tuned.send_buffer, on_close=protocol.aclose)

    made: list[_ClientProtocol] = []

    def protocol_factory(*args: Any, **kwargs: Any) -> _ClientProtocol:
        made.append(_ClientProtocol(*args, make=make, **kwargs))
        return made[-1]

    try:
        protocol = await connect_quic(
            host, port, files, alpn=alpns, settings=tuned, server_name=server_name, timeout=timeout,
            protocol_factory=protocol_factory,
            quic_factory=functools.partial(KvspQuicConnection, uni_streams=data_streams + 1),
            error=lambda reason: MoqtConnectError(f"MOQT to {host}:{port} ({', '.join(alpns)}) failed: {reason}"))
    except MoqtConnectError as exc:
        _audit_refusal(made[0] if made else None, (host, port), alpns, exc)
        raise
    assert protocol.conn is not None
    identity = protocol.conn.peer_identity
    problem = serves(identity, "moqt", host, port, "/") if identity is not None else None
    if expect_identity is not None and identity != expect_identity:
        problem = f"the server's identity {identity!r} is not {expect_identity!r}"
    if problem is not None:
        await protocol.conn.aclose()
        raise MoqtConnectError(f"MOQT to {host}:{port}: {problem}")
    return protocol.conn


def _audit_refusal(protocol: _ClientProtocol | None, peer: tuple[str, int], alpns: Sequence[str],
                   exc: MoqtConnectError) -> None:
    """One INFO line and one count (side "client") for a handshake or SETUP of ours that failed."""
    conn = protocol.conn if protocol is not None else None
    if conn is not None and conn.closed is not None:  # the QUIC handshake worked, SETUP did not
        reason, alpn = reason_label(conn.closed.error_code), conn.alpn
    elif protocol is not None and protocol.terminated is not None:  # the server (or our TLS) ended the handshake
        reason, alpn = reason_label(protocol.terminated.error_code), None
    else:
        reason, alpn = "timeout", None
    AUDIT.handshake_refused(side="client", reason=reason, peer=peer, alpn=alpn or "/".join(alpns),
                            identity=conn.peer_identity if conn is not None else None, detail=str(exc))


class MoqtPool(SpreadPool[MoqtConnection]):
    """Client MOQT connections by ``moqt://host:port/``, shared by concurrent fetches.

    *connections_per_origin* (K, default 1): concurrent fetches to one origin are spread over up to K connections,
    as :class:`http3.h3_client.H3Pool` spreads requests. :meth:`get` gives the least-loaded connection (load:
    :attr:`MoqtConnection.open_fetches`, plus the fetches waiting for a connect in progress) when that one is idle
    or K are open or opening already; otherwise it opens another one. Sequential fetches therefore reuse one
    connection, and K concurrent ones get K (each on its own UDP socket: a holder whose workers share one port with
    ``SO_REUSEPORT`` sees K 4-tuples, which the kernel spreads over its workers). MOQT has no per-connection cap
    the pool must respect (a draft 14 session queues requests beyond the peer's MAX_REQUEST_ID), so there are
    never more than K.

    Connects run in tasks of their own: a slow handshake never holds up fetches that can use a connection that is
    open already, a fetch that gives up waiting (its timeout cancels :meth:`get`) does not abort the connect for
    the others, and a failed connect fails every fetch waiting for it at once. A closed connection is dropped; one
    whose peer sent GOAWAY takes no new fetches and is closed once its own are over.

    With an RTT table *rtts* (:class:`quic.rtt.RttTable`; the instance passes the process's
    :data:`quic.rtt.PEER_RTTS`, shared with its HTTP/3 and HTTP/1.1 pools) connect timeouts scale with the RTT (issue
    12, point 5): *connect_timeout* is the most a connect (handshake and SETUP) waits, and all it waits for a host
    whose RTT is unknown; to a host the table has an estimate for, a dial waits :func:`quic.rtt.connect_timeout` (a
    few RTTs, at least 1 s). The pool feeds the table with its connections' RTT when they join and before each dial
    from those still open to the host. Without a table every connect waits *connect_timeout*."""

    kind = "moqt"

    def __init__(self, files: TlsFiles, *, settings: TransportSettings = TransportSettings(),
                 alpn: str | Sequence[str] = PREFERRED_ALPNS, connect_timeout: float = 10.0,
                 data_streams: int = DEFAULT_DATA_STREAMS, connections_per_origin: int = 1,
                 rtts: RttTable | None = None) -> None:
        super().__init__(connections_per_origin, connect_timeout=connect_timeout, rtts=rtts)
        self.files = files
        self.settings = settings
        self.alpn = alpn
        self.data_streams = data_streams
        self._retired: set[MoqtConnection] = set()  # GOAWAY received: closed once their fetches are over
        self._closing: set[asyncio.Task[None]] = set()

    @staticmethod
    def origin(uri: str) -> tuple[str, int]:
        parts = urlsplit(uri)
        if parts.scheme != "moqt" or parts.hostname is None or parts.port is None:
            raise ValueError(f"{uri!r} is not a moqt://host:port/ URI")
        return parts.hostname, parts.port

    async def get(self, uri: str) -> MoqtConnection:
        """A connection to *uri*'s origin for one more fetch (connecting if needed: :class:`MoqtConnectError` when
        that fails). The caller sends its FETCH on it before it awaits anything else (that is what makes the fetch
        count as the connection's load)."""
        return await self.get_for(self.origin(uri))

    # -- SpreadPool's hooks

    async def dial(self, key: tuple[str, int]) -> MoqtConnection:
        return await connect_moqt(key[0], key[1], self.files, settings=self.settings, alpn=self.alpn,
                                  timeout=self.dial_timeout(key[0]), data_streams=self.data_streams)

    def rtt_of(self, conn: MoqtConnection) -> RttSample | None:
        return conn.quic.rtt_sample() if conn.closed is None else None

    def adopted(self, key: tuple[str, int], conn: MoqtConnection) -> None:
        if self.rtts is not None:
            self.rtts.observe(key[0], (conn.quic.rtt_sample(),))  # the handshake's and SETUP's samples

    def load_of(self, conn: MoqtConnection) -> int:
        return conn.open_fetches

    def takes_more(self, conn: MoqtConnection) -> bool:
        return conn.usable

    def live(self, key: tuple[str, int]) -> list[MoqtConnection]:
        """The connections to *key* that take new fetches; a closed one is dropped, one after GOAWAY retired."""
        self._sweep()
        conns = []
        for conn in self._conns.get(key, []):
            if conn.usable:
                conns.append(conn)
                continue
            self.forget_joining(conn)
            if conn.closed is None:
                self._retired.add(conn)
        self._conns[key] = conns
        self._sweep()
        return conns

    def closed_error(self, key: tuple[str, int]) -> Exception:
        return MoqtConnectError(f"MOQT to {key[0]}:{key[1]}: the pool is closed")

    async def close_connection(self, conn: MoqtConnection) -> None:
        await conn.aclose()

    # --

    def _sweep(self) -> None:
        """Close the retired connections whose fetches are over."""
        for conn in list(self._retired):
            if conn.closed is not None:
                self._retired.discard(conn)
            elif conn.open_fetches == 0:
                self._retired.discard(conn)
                task = asyncio.get_running_loop().create_task(conn.aclose())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    def connections(self, uri: str) -> list[MoqtConnection]:
        """The pooled connections to *uri*'s origin that take new fetches (tests, metrics)."""
        return [c for c in self._conns.get(self.origin(uri), []) if c.usable]

    async def aclose(self) -> None:
        """Close every connection, and cancel the connects in progress (their waiters get MoqtConnectError)."""
        conns = await self.cancel_connects() + list(self._retired)
        self._retired.clear()
        await asyncio.gather(*(c.aclose() for c in conns), *self._closing, return_exceptions=True)

    async def __aenter__(self) -> MoqtPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["CONTROL_RESERVE", "DEFAULT_DATA_STREAMS", "MoqtPool", "MoqtServerHandler", "connect_moqt",
           "moqt_handlers"]
