"""One role's HTTP endpoint: the same ASGI app over HTTP/3 on UDP and HTTP/2 + HTTP/1.1 on TCP, same port number.

    server = RoleServer(app, TlsFiles.in_dir("certs", "holder"), quic_handlers={"moqt-18": moqt_factory})
    await server.start("127.0.0.1", 0)      # 0: a port number free on both UDP and TCP
    print(server.base_uri("/kvsp/"))         # https://127.0.0.1:PORT/kvsp/
    await server.close()

The UDP port also carries whatever other ALPN handlers are given (MOQT), so a role has one port for everything.
The TCP side advertises the UDP side with ``alt-svc: h3``. The app's lifespan runs once, with the TCP server.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable

from http3.asgi_types import ASGIApp
from http3.h3_server import h3_handler
from http3.tcp_server import TcpServer
from quic.listener import HandlerFactory, QuicListener, RefusedHandshake
from quic.tls import ALPN_H3, TlsFiles, TransportSettings
from quic.udp import bind_udp

log = logging.getLogger("kvsp.server")

_PORT_ATTEMPTS = 50


class RoleServer:
    def __init__(self, app: ASGIApp, files: TlsFiles, *, settings: TransportSettings = TransportSettings(),
                 quic_handlers: dict[str, HandlerFactory] | None = None, http3: bool = True,
                 on_refused: Callable[[RefusedHandshake], None] | None = None) -> None:
        self.app = app
        self.on_refused = on_refused  # QUIC handshakes refused (quic.listener.QuicListener.refused)
        self.files = files
        self.settings = settings
        self._http3 = http3
        self._handlers: dict[str, HandlerFactory] = dict(quic_handlers or {})
        self.tcp: TcpServer | None = None
        self.quic: QuicListener | None = None
        self.host = ""
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the server is not started")
        return self._port

    def base_uri(self, path: str = "/") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}{path}"

    async def start(self, host: str = "127.0.0.1", port: int = 0, *,
                    sockets: tuple[socket.socket, socket.socket | None] | None = None) -> None:
        """Listen on *host*:*port*, or on *sockets* from :func:`bind_pair` (a role that must know its port
        before it starts, to issue its certificate, binds first)."""
        if sockets is not None:
            tcp_sock, udp_sock = sockets
            host = tcp_sock.getsockname()[0]
        else:
            tcp_sock, udp_sock = bind_pair(host, port, self.settings.socket_buffer,
                                           want_udp=self._http3 or bool(self._handlers))
        self.host = host
        self._port = tcp_sock.getsockname()[1]
        try:
            self.tcp = TcpServer(self.app, self.files, settings=self.settings,
                                 alt_svc_port=self._port if self._http3 else None)
            await self.tcp.start(sock=tcp_sock)  # runs the app's lifespan; HTTP/3 shares its context and state
            if udp_sock is not None:
                handlers = dict(self._handlers)
                if self._http3:
                    handlers[ALPN_H3] = h3_handler(asgi=self.tcp.ctx)
                self.quic = QuicListener(self.files, handlers, settings=self.settings, on_refused=self.on_refused)
                await self.quic.start(sock=udp_sock)
        except BaseException:
            await self.close()
            tcp_sock.close()
            if udp_sock is not None:
                udp_sock.close()
            raise
        udp = ", ".join(self.quic.handlers) if self.quic is not None else "-"
        log.info("serving on %s (TCP: h2, http/1.1; UDP: %s)", self.base_uri(), udp)

    async def close(self) -> None:
        """Graceful: both sides stop taking new work and let in-flight requests finish (settings.shutdown_grace)."""
        quic, tcp = self.quic, self.tcp
        self.quic = self.tcp = None
        if quic is not None:
            await quic.close()
        if tcp is not None:
            await tcp.close()


def bind_pair(host: str, port: int, udp_buffer: int, *, want_udp: bool = True,
              reuse_port: bool = False) -> tuple[socket.socket, socket.socket | None]:
    """A listening TCP socket and a UDP socket bound to the same port number (a free one when *port* is 0).

    *reuse_port*: ``SO_REUSEPORT`` on both, so that the worker processes of one server (``--workers N``) bind the
    same port and the kernel spreads connections over them by address hash (TCP connections, QUIC datagrams)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    attempts = _PORT_ATTEMPTS if port == 0 else 1
    last: OSError | None = None
    for _ in range(attempts):
        tcp = socket.socket(family, socket.SOCK_STREAM)
        try:
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            tcp.bind((host, port))
            tcp.listen(128)
            tcp.setblocking(False)
            if not want_udp:
                return tcp, None
            udp = bind_udp(host, tcp.getsockname()[1], udp_buffer, reuse_port=reuse_port)
            return tcp, udp
        except OSError as exc:
            last = exc
            with contextlib.suppress(OSError):
                tcp.close()
    raise OSError(f"cannot bind TCP and UDP port {port or '(any)'} on {host}: {last}") from last
