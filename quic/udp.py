"""A UDP endpoint that reads datagrams in batches, for QUIC.

asyncio's datagram transport reads one datagram per event-loop iteration, and aioquic's protocol answers each
one at once (decrypt, handle, then build and send an ACK). At QUIC speeds that is one loop iteration and one
outgoing packet per 16 KiB received. This endpoint drains up to ``batch`` datagrams whenever the socket is
readable, hands each to the protocol's ``datagram_received`` and then calls its ``datagrams_done`` once, so a
connection processes the whole batch before it transmits (one ACK for many packets, as RFC 9000 13.2.1 allows).

It is an ``asyncio.DatagramTransport`` for aioquic's protocols: ``sendto``, ``close``, ``get_extra_info``.
:func:`bind_udp` makes the socket, with the buffer sizes of ``TransportSettings.socket_buffer``.

Sending, :meth:`BatchedUdpTransport.send_datagrams` takes all the datagrams one transmit built and hands runs of
equal-sized ones to the kernel in one ``sendmsg`` with generic segmentation offload (Linux ``UDP_SEGMENT``: the
kernel cuts the buffer into datagrams of the given size, the last one may be shorter): one system call, and one
trip through the socket layer, per up to 64 datagrams instead of one each. Where the kernel refuses it (not Linux,
a kernel before 4.18, a device without checksum offload: ``EIO``) the transport says so once in the log and sends
one datagram per call from then on. Receiving, the socket asks for generic receive offload (``UDP_GRO``) where
the kernel has it: a run of datagrams from one sender (on loopback, a GSO send as it was sent) arrives in one
``recvmsg`` with its segment size, and is cut back into its datagrams here, in order, before the protocol sees
them.

A client's socket is connected to its peer (:func:`connect_udp`), so the kernel reports ICMP port unreachable for
it: the next send or receive fails with ``ECONNREFUSED``, which the transport hands to the protocol's
``error_received`` (a QUIC client then ends the connection at once: nothing listens at the peer's port). An
unconnected socket (a server's) never hears of ICMP errors.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger("kvsp.udp")

_MAX_DATAGRAM = 65536
_MAX_QUEUED = 4096  # datagrams waiting for the socket to accept writes; beyond that they are dropped (QUIC recovers)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)  # Linux 4.18+, include/uapi/linux/udp.h
_GSO_MAX_SEGMENTS = 64  # UDP_MAX_SEGMENTS of Linux before 6.9 (128 since)
UDP_GRO = getattr(socket, "UDP_GRO", 104)  # Linux 5.0+: coalesced runs come with their segment size
_GRO_CMSG_SPACE = socket.CMSG_SPACE(4) if hasattr(socket, "CMSG_SPACE") else 0
_GSO_MAX_OCTETS = 65000  # one UDP datagram's payload before segmentation: at most 65507 octets over IPv4


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
        self.gso = hasattr(socket, "SOL_UDP") and sock.family in (socket.AF_INET, socket.AF_INET6)
        self.system_calls = 0  # sends handed to the kernel (a GSO batch counts once): for tests and benchmarks
        self.datagrams_sent = 0
        self.gro = False
        if self.gso:  # the receiving half of offload: runs of datagrams arrive as one buffer
            try:
                sock.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:
                pass
        self.receive_calls = 0
        self.refusals = 0  # ECONNREFUSED seen on a connected socket (ICMP port unreachable)
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._read_ready)
        protocol.connection_made(self)

    def _read_ready(self) -> None:
        if self.gro:
            self._read_ready_gro()
            return
        recv = self._sock.recvfrom
        handle = self._protocol.datagram_received
        got = 0
        for _ in range(self._batch):
            try:
                data, addr = recv(_MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionRefusedError as exc:  # a connected socket: ICMP port unreachable from the peer
                self._refused(exc)
                break
            except OSError as exc:
                log.debug("UDP receive error: %s", exc)
                break
            got += 1
            handle(data, addr)
        self.receive_calls += got
        if got:
            self._protocol.datagrams_done()

    def _read_ready_gro(self) -> None:
        recv = self._sock.recvmsg
        handle = self._protocol.datagram_received
        got = calls = 0
        while got < self._batch:
            try:
                data, ancillary, _flags, addr = recv(_MAX_DATAGRAM, _GRO_CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionRefusedError as exc:  # a connected socket: ICMP port unreachable from the peer
                self._refused(exc)
                break
            except OSError as exc:
                log.debug("UDP receive error: %s", exc)
                break
            calls += 1
            segment = 0
            for level, kind, value in ancillary:
                if level == socket.SOL_UDP and kind == UDP_GRO:
                    segment = int.from_bytes(value[:4], sys.byteorder)
            if segment and len(data) > segment:
                for offset in range(0, len(data), segment):
                    handle(data[offset:offset + segment], addr)
                    got += 1
            else:
                handle(data, addr)
                got += 1
        self.receive_calls += calls
        if got:
            self._protocol.datagrams_done()

    def stop_receive_offload(self) -> None:
        """Receive one datagram per call from now on (benchmarks compare; a kernel that misbehaves)."""
        if self.gro:
            self._sock.setsockopt(socket.SOL_UDP, UDP_GRO, 0)
            self.gro = False

    def sendto(self, data: Any, addr: Any = None) -> None:
        if self._closing:
            return
        if not self._queue:
            try:
                self._sock.sendto(data, addr)
                self.system_calls += 1
                self.datagrams_sent += 1
                return
            except (BlockingIOError, InterruptedError):
                pass
            except ConnectionRefusedError as exc:  # a connected socket: ICMP port unreachable from the peer
                self._refused(exc)
                return
            except OSError as exc:  # another error: QUIC will retransmit
                log.debug("UDP send error: %s", exc)
                return
        if len(self._queue) < _MAX_QUEUED:
            self._queue.append((bytes(data), addr))
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._sock.fileno(), self._write_ready)

    def send_datagrams(self, datagrams: Sequence[tuple[bytes, Any]]) -> None:
        """Send what one transmit built, in order: runs of equal-sized datagrams to one address (the last of a run
        may be shorter) in one GSO system call each."""
        if not self.gso or self._queue or self._closing or len(datagrams) < 2:
            for data, addr in datagrams:
                self.sendto(data, addr)
            return
        i, n = 0, len(datagrams)
        while i < n:
            data, addr = datagrams[i]
            size = len(data)
            limit = min(n, i + _GSO_MAX_SEGMENTS, i + max(1, _GSO_MAX_OCTETS // size))
            j = i + 1
            while j < limit:
                other, other_addr = datagrams[j]
                if other_addr != addr or len(other) > size:
                    break
                j += 1
                if len(other) < size:  # a shorter one ends the run
                    break
            if j - i == 1 or not self.gso or self._queue:
                self.sendto(data, addr)
                i += 1
                continue
            try:
                self._sock.sendmsg([b"".join([d for d, _ in datagrams[i:j]])],
                                   [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))], 0, addr)
                self.system_calls += 1
                self.datagrams_sent += j - i
            except (BlockingIOError, InterruptedError):
                for k in range(i, j):  # queued one by one: _write_ready sends them when the socket drains
                    self.sendto(*datagrams[k])
            except ConnectionRefusedError as exc:
                self._refused(exc)
                return
            except OSError as exc:
                log.info("UDP segmentation offload refused (%s): sending one datagram per system call", exc)
                self.gso = False
                for k in range(i, j):
                    self.sendto(*datagrams[k])
            i = j

    def _write_ready(self) -> None:
        while self._queue:
            data, addr = self._queue[0]
            try:
                self._sock.sendto(data, addr)
                self.system_calls += 1
                self.datagrams_sent += 1
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionRefusedError as exc:
                self._refused(exc)
            except OSError as exc:
                log.debug("UDP send error: %s", exc)
            self._queue.popleft()
        self._loop.remove_writer(self._sock.fileno())
        self._writing = False

    def _refused(self, exc: ConnectionRefusedError) -> None:
        """The kernel reported ICMP port unreachable for the peer of a connected socket (only connected UDP sockets
        hear of it): tell the protocol, outside the call that found it (a transmit may be under way)."""
        self.refusals += 1
        handler = getattr(self._protocol, "error_received", None)  # asyncio's DatagramProtocol method; optional
        if handler is not None and not self._closing:
            self._loop.call_soon(handler, exc)

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


def bind_udp(host: str, port: int, buffer: int, *, reuse_port: bool = False) -> socket.socket:
    """A non-blocking UDP socket bound to *host*:*port*, asking for *buffer* octets of receive and send buffer
    (*reuse_port*: ``SO_REUSEPORT``, for a port shared by worker processes)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer)
        sock.bind((host, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def connect_udp(sock: socket.socket, addr: Any) -> None:
    """Connect a client's UDP socket to its peer *addr*: datagrams from anyone else are dropped by the kernel, and
    ICMP port unreachable for the peer comes back as ``ECONNREFUSED`` (a dead port fails in milliseconds instead of
    waiting out a handshake timeout; on loopback at once). A non-blocking connect of a UDP socket does not wait."""
    sock.connect(addr)
