"""A UDP endpoint that reads datagrams in batches, for QUIC.

asyncio's datagram transport reads one datagram per event-loop iteration, and aioquic's protocol answers each
one at once (decrypt, handle, then build and send an ACK). At QUIC speeds that is one loop iteration and one
outgoing packet per 16 KiB received. This endpoint drains up to ``batch`` datagrams whenever the socket is
readable, hands each to the protocol's ``datagram_received`` and then calls its ``datagrams_done`` once, so a
connection processes the whole batch before it transmits (one ACK for many packets, as RFC 9000 13.2.1 allows).

It is an ``asyncio.DatagramTransport`` for aioquic's protocols: ``sendto``, ``close``, ``get_extra_info``.
:func:`bind_udp` makes the socket, with the buffer sizes of ``TransportSettings.socket_buffer``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from typing import Any, Protocol

log = logging.getLogger("kvsp.udp")

_MAX_DATAGRAM = 65536
_MAX_QUEUED = 4096  # datagrams waiting for the socket to accept writes; beyond that they are dropped (QUIC recovers)


class BatchProtocol(Protocol):
    def connection_made(self, transport: Any) -> None: ...

    def datagram_received(self, data: bytes, addr: Any) -> None: ...

    def datagrams_done(self) -> None: ...


class BatchedUdpTransport(asyncio.DatagramTransport):
    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: BatchProtocol,
                 batch: int = 64) -> None:
        super().__init__()
        self._loop = loop
        self._sock = sock
        self._protocol = protocol
        self._batch = batch
        self._queue: collections.deque[tuple[bytes, Any]] = collections.deque()
        self._closing = False
        self._writing = False
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._read_ready)
        protocol.connection_made(self)

    def _read_ready(self) -> None:
        recv = self._sock.recvfrom
        handle = self._protocol.datagram_received
        got = 0
        for _ in range(self._batch):
            try:
                data, addr = recv(_MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.debug("UDP receive error: %s", exc)
                break
            got += 1
            handle(data, addr)
        if got:
            self._protocol.datagrams_done()

    def sendto(self, data: Any, addr: Any = None) -> None:
        if self._closing:
            return
        if not self._queue:
            try:
                self._sock.sendto(data, addr)
                return
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:  # e.g. ECONNREFUSED from a previous ICMP: QUIC will retransmit
                log.debug("UDP send error: %s", exc)
                return
        if len(self._queue) < _MAX_QUEUED:
            self._queue.append((bytes(data), addr))
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._sock.fileno(), self._write_ready)

    def _write_ready(self) -> None:
        while self._queue:
            data, addr = self._queue[0]
            try:
                self._sock.sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("UDP send error: %s", exc)
            self._queue.popleft()
        self._loop.remove_writer(self._sock.fileno())
        self._writing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return self._sock
        if name == "sockname":
            return self._sock.getsockname()
        return default

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self._sock.fileno())
        if self._writing:
            self._loop.remove_writer(self._sock.fileno())
        self._queue.clear()
        self._sock.close()

    def abort(self) -> None:
        self.close()

    def get_write_buffer_size(self) -> int:
        return len(self._queue)


def bind_udp(host: str, port: int, buffer: int) -> socket.socket:
    """A non-blocking UDP socket bound to *host*:*port*, asking for *buffer* octets of receive and send buffer."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer)
        sock.bind((host, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
