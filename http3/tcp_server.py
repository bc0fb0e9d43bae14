"""An ASGI server for HTTP/1.1 and HTTP/2 over TLS 1.3 over TCP, with mutual TLS.

    server = TcpServer(app, TlsFiles.in_dir("certs", "holder"), alt_svc_port=4433)
    await server.start("127.0.0.1", 4433)        # or start(sock=an_already_bound_socket)
    ...
    await server.close()                         # graceful: in-flight requests get settings.shutdown_grace

TLS comes from :func:`quic.tls.ssl_server_context`: TLS 1.3 only and a client certificate from the configured
CA required, so a peer without one (or with an expired, not yet valid or foreign one) fails in the handshake and
never reaches the app. ALPN picks the protocol: ``h2`` runs :class:`http3.tcp_h2.H2Connection`, anything else
:class:`http3.tcp_h1.H1Connection`. Every request scope carries the ASGI TLS extension with the client's
certificate, so :func:`quic.tls.scope_identity` names the peer; every response advertises HTTP/3 with
``alt-svc: h3=":PORT"``. The app's lifespan protocol runs around the server's life when the app supports it.

Slow and idle peers (issue 13): the TLS handshake must finish within :data:`HANDSHAKE_TIMEOUT`; a request head
must finish within ``settings.header_timeout`` once begun (slowloris; the protocols enforce it); an idle
connection is closed after ``settings.idle_timeout``. A handshaken connection beyond ``settings.max_connections``
(all peers) or ``settings.max_connections_per_address`` (one peer IP address) is closed at once (TLS
close_notify, then FIN), counted in :attr:`TcpServer.refused`: the TLS handshake is the only work it costs.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from typing import Any, cast

from http3.asgi_bridge import AsgiContext, Lifespan, address, alt_svc_h3, tls_cipher_code
from http3.asgi_types import ASGIApp
from http3.tcp_h1 import H1Connection
from http3.tcp_h2 import H2Connection
from quic.tls import TLS_1_3, TlsFiles, TransportSettings, ssl_server_context, tls_extension

log = logging.getLogger("http3.tcp")

Connection = H1Connection | H2Connection

HANDSHAKE_TIMEOUT = 10.0


class TcpServer:
    """HTTP/1.1 + HTTP/2 over mutual TLS for one ASGI app.

    *alt_svc_port*: the UDP port advertised for HTTP/3 (default: this server's own TCP port). *lifespan*: run the
    app's lifespan protocol (pass False when another server, e.g. the HTTP/3 one, runs it for the same app).
    ``ctx.peak_body_buffered`` is the most request body any one request ever held unread (for tests and metrics).
    :attr:`refused` counts connections closed because a connection limit was reached.
    """

    def __init__(self, app: ASGIApp, files: TlsFiles, *, settings: TransportSettings = TransportSettings(),
                 alt_svc_port: int | None = None, lifespan: bool = True) -> None:
        self.app = app
        self.files = files
        self.settings = settings
        self.alt_svc_port = alt_svc_port
        self.ctx = AsgiContext(app, settings, alt_svc=None, respond_now=getattr(app, "respond_now", None))
        self._ssl = ssl_server_context(files, client_cert_optional=settings.client_cert_optional)
        self._lifespan = Lifespan(app) if lifespan else None
        self._server: asyncio.Server | None = None
        self._connections: set[Connection] = set()
        self._per_address: Counter[str] = Counter()  # open connections per peer IP address
        self.refused = 0
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the server is not started")
        return self._port

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def start(self, host: str | None = None, port: int = 0, *, sock: socket.socket | None = None) -> None:
        """Listen on *host*:*port* (0: a free port; host None: every interface), or on *sock*, an already bound
        socket (listening or not; the server owns it from then on and closes it in :meth:`close`)."""
        if self._server is not None:
            raise RuntimeError("the server is already started")
        if self._lifespan is not None:
            await self._lifespan.startup()
            self.ctx.state = self._lifespan.state
        loop = asyncio.get_running_loop()
        try:
            if sock is not None:
                self._server = await loop.create_server(self._connection_made, sock=sock, ssl=self._ssl,
                                                        ssl_handshake_timeout=HANDSHAKE_TIMEOUT, backlog=1024)
            else:
                self._server = await loop.create_server(self._connection_made, host, port, ssl=self._ssl,
                                                        ssl_handshake_timeout=HANDSHAKE_TIMEOUT, backlog=1024,
                                                        reuse_address=True)
        except BaseException:
            if self._lifespan is not None:
                await self._lifespan.shutdown()
            raise
        self._port = int(self._server.sockets[0].getsockname()[1])
        self.ctx.alt_svc = alt_svc_h3(self.alt_svc_port if self.alt_svc_port is not None else self._port)

    def _connection_made(self) -> asyncio.Protocol:
        return _Handshake(self)

    def _accept(self, transport: asyncio.Transport) -> Connection | _Refused:
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if peer else ""
        if (len(self._connections) >= self.settings.max_connections
                or self._per_address[host] >= self.settings.max_connections_per_address):
            self.refused += 1
            log.debug("connection limit reached: closing a new connection from %s", host or "-")
            return _Refused(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        leaf = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        cipher = ssl_object.cipher() if ssl_object is not None else None
        info: dict[str, Any] = {
            "client": address(transport.get_extra_info("peername")),
            "server": address(transport.get_extra_info("sockname")),
            "tls": tls_extension([leaf] if leaf else [], server_cert_pem=self.files.cert_pem, tls_version=TLS_1_3,
                                 cipher_suite=tls_cipher_code(cipher[0] if cipher else None)),
        }
        alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        conn: Connection = (H2Connection if alpn == "h2" else H1Connection)(self.ctx, transport, info)
        self._connections.add(conn)
        self._per_address[host] += 1
        conn.done.add_done_callback(lambda _: self._forget(conn, host))
        if self._server is None or not self._server.is_serving():
            conn.shutdown()
        return conn

    def _forget(self, conn: Connection, host: str) -> None:
        if conn in self._connections:
            self._connections.discard(conn)
            self._per_address[host] -= 1
            if not self._per_address[host]:
                del self._per_address[host]

    async def close(self) -> None:
        """Stop accepting; let requests in flight finish within ``settings.shutdown_grace``; close everything.

        A connection is done once its last response is written and its TLS close_notify sent: the server then
        waits for what is written to leave, not for the peer's close_notify (idle pooled clients such as httpx
        answer it only when they next read).
        """
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.shutdown_grace
        conns = list(self._connections)
        for conn in conns:
            conn.shutdown()
        pending = [c.quiet for c in conns if not c.quiet.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=self.settings.shutdown_grace)
            if still:
                log.info("closing %d connection(s) with requests still in flight", len(still))
        while loop.time() < deadline and any(_unsent(c.transport) for c in conns if c.quiet.done() and not c.closed):
            await asyncio.sleep(0.01)
        for conn in list(self._connections):
            conn.abort()
        tasks = [t for c in conns for t in c.tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        pending = [c.done for c in conns if not c.done.done()]
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        await server.wait_closed()
        if self._lifespan is not None:
            await self._lifespan.shutdown()


def _unsent(transport: asyncio.Transport) -> int:
    """Octets a TLS transport still holds: its own and those of the socket transport below it, which asyncio
    keeps private (0 for that part if it ever moves)."""
    size = transport.get_write_buffer_size()
    inner = getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)
    if isinstance(inner, asyncio.WriteTransport):
        size += inner.get_write_buffer_size()
    return size


class _Refused(asyncio.Protocol):
    """A connection over a connection limit: closed as it is accepted, whatever it sends dropped."""

    def __init__(self, transport: asyncio.Transport) -> None:
        transport.close()

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        pass


class _Handshake(asyncio.Protocol):
    """The protocol during the TLS handshake; once it is done it hands the transport to the ALPN's handler."""

    def __init__(self, server: TcpServer) -> None:
        self.server = server

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        # a stream transport: asyncio's, or uvloop's (which does not register with asyncio's ABCs)
        transport = cast(asyncio.Transport, base)
        transport.set_protocol(self.server._accept(transport))

    def connection_lost(self, exc: Exception | None) -> None:  # pragma: no cover - replaced before any I/O
        pass
