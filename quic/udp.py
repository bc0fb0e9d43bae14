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

Datagrams sized to the path (RFC 9000, 14: "UDP datagrams MUST NOT be fragmented at the IP layer"; 14.3, 14.4):
every socket :func:`bind_udp` makes sets DF (:func:`set_dont_fragment`: ``IP_MTU_DISCOVER = IP_PMTUDISC_DO`` on
IPv4, ``IPV6_MTU_DISCOVER = IPV6_PMTUDISC_DO`` and ``IPV6_DONTFRAG`` on IPv6), so the kernel never cuts a QUIC
datagram into IP fragments: one larger than the path's MTU fails with ``EMSGSIZE`` instead. A connection builds
datagrams of :func:`datagram_size` octets: the route's MTU less :data:`PATH_OVERHEAD` (IPv6's header and UDP's,
reserved on IPv4 too: 1452 on a 1500-octet link, 8952 on 9000, 16 KiB on loopback, whose route MTU is 65536),
never more than the configured ``max_datagram_size``; :data:`DEFAULT_DATAGRAM` (1452) where the route says
nothing. The route MTU is read with ``IP_MTU`` from a connected socket (a client's, :func:`route_mtu`), and for an
unconnected server socket from a throwaway socket connected to the peer (:func:`path_mtu`: a route lookup, no
packet is sent). A send the kernel refuses as too large for the path (``EMSGSIZE``; ``EINVAL`` for a
segmentation-offload send whose segments exceed it) is dropped -- QUIC's loss recovery resends its frames -- and
the protocol's ``datagram_too_large(addr, size, mtu)`` is called with the route's MTU as the kernel knows it now, so
the connection shrinks its datagrams (:meth:`quic.connection.KvspQuicConnection.shrink_datagrams`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
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

# Linux's values (include/uapi/linux/in.h, in6.h): Python 3.11's socket module names only some of them
IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)  # set DF, never fragment locally; too large: EMSGSIZE
IP_MTU = getattr(socket, "IP_MTU", 14)  # the path MTU of a connected socket
IPV6_MTU_DISCOVER = getattr(socket, "IPV6_MTU_DISCOVER", 23)
IPV6_PMTUDISC_DO = getattr(socket, "IPV6_PMTUDISC_DO", 2)
IPV6_MTU = getattr(socket, "IPV6_MTU", 24)
IPV6_DONTFRAG = getattr(socket, "IPV6_DONTFRAG", 62)
_LINUX = sys.platform.startswith("linux")

PATH_OVERHEAD = 48  # an IPv6 header (40) and a UDP header (8): reserved whatever the family
DEFAULT_DATAGRAM = 1452  # QUIC datagram size where the path's MTU is unknown: what a 1500-octet link carries
MIN_DATAGRAM = 1200  # RFC 9000, 14: a QUIC path carries at least 1200-octet datagrams


class BatchProtocol(Protocol):
    def connection_made(self, transport: Any) -> None: ...

    def datagram_received(self, data: bytes, addr: Any) -> None: ...

    def datagrams_done(self) -> None: ...

    # optional: datagram_too_large(addr, size, mtu) (EMSGSIZE, see the module docstring); error_received(exc)


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
        self.too_large = 0  # datagrams the kernel refused as larger than the path's MTU (EMSGSIZE)
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
                if exc.errno == errno.EMSGSIZE:
                    self._too_large(addr, len(data))
                else:
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
                if exc.errno == errno.EMSGSIZE or (exc.errno == errno.EINVAL and self._exceeds_path(addr, size)):
                    self._too_large(addr, size)  # segments larger than the path carries: dropped, QUIC resends
                    i = j
                    continue
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
                if exc.errno == errno.EMSGSIZE:
                    self._too_large(addr, len(data))
                else:
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

    def path_mtu(self, addr: Any) -> int | None:
        """The MTU of the route to *addr* as the kernel knows it now (a PMTU it learnt from ICMP included)."""
        if self._connected():
            return route_mtu(self._sock)
        return path_mtu(addr, self._sock)

    def _connected(self) -> bool:
        try:
            self._sock.getpeername()
        except OSError:
            return False
        return True

    def _exceeds_path(self, addr: Any, size: int) -> bool:
        mtu = self.path_mtu(addr)
        return mtu is not None and size + PATH_OVERHEAD > mtu

    def _too_large(self, addr: Any, size: int) -> None:
        """The kernel refused a *size*-octet datagram to *addr* as larger than the path carries (DF is set: it does
        not fragment). The datagram is dropped; the protocol hears the path's MTU, outside the transmit under way."""
        self.too_large += 1
        if addr is None:
            with contextlib.suppress(OSError):
                addr = self._sock.getpeername()
        mtu = self.path_mtu(addr) if addr is not None else None
        log.debug("UDP datagram of %d octets too large for the path to %s (route MTU %s)", size, addr, mtu)
        handler = getattr(self._protocol, "datagram_too_large", None)
        if handler is not None and not self._closing:
            self._loop.call_soon(handler, addr, size, mtu)

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
        set_dont_fragment(sock)
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


_DF_WARNED = False


def set_dont_fragment(sock: socket.socket) -> bool:
    """Set DF on *sock*'s datagrams and never let the kernel fragment them (module docstring): IPv4
    ``IP_PMTUDISC_DO``; on an IPv6 socket ``IPV6_PMTUDISC_DO`` and ``IPV6_DONTFRAG``, and IPv4's too (for the
    IPv4-mapped peers of a dual-stack socket). False where the system has no such option (said once in the log)."""
    global _DF_WARNED
    done = False
    if _LINUX:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
            done = sock.family == socket.AF_INET
        if sock.family == socket.AF_INET6:
            try:
                sock.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, IPV6_PMTUDISC_DO)
                sock.setsockopt(socket.IPPROTO_IPV6, IPV6_DONTFRAG, 1)
                done = True
            except OSError:
                done = False
    if not done and not _DF_WARNED:
        _DF_WARNED = True
        log.warning("cannot set DF on UDP sockets here: QUIC datagrams larger than a path's MTU may be fragmented")
    return done


def route_mtu(sock: socket.socket) -> int | None:
    """The path MTU of connected socket *sock* (``IP_MTU`` / ``IPV6_MTU``: the route's MTU, or a smaller one the
    kernel learnt from ICMP); None where the system cannot say or *sock* is not connected."""
    if not _LINUX:
        return None
    try:
        if sock.family == socket.AF_INET6:
            return int(sock.getsockopt(socket.IPPROTO_IPV6, IPV6_MTU))
        return int(sock.getsockopt(socket.IPPROTO_IP, IP_MTU))
    except OSError:
        return None


def path_mtu(addr: Any, sock: socket.socket | None = None) -> int | None:
    """The path MTU towards *addr* from an unconnected socket (*sock*, a server's): a throwaway socket of its
    family, bound to its address when that is not the wildcard (the route can depend on the source), is connected
    to *addr* -- a route lookup, nothing is sent -- and asked :func:`route_mtu`. None where it cannot say."""
    if not _LINUX or addr is None:
        return None
    family = sock.family if sock is not None else (socket.AF_INET6 if ":" in str(addr[0]) else socket.AF_INET)
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            if sock is not None:
                local = sock.getsockname()[0]
                if local not in ("0.0.0.0", "::"):
                    probe.bind((local, 0))
            probe.connect(addr)
            return route_mtu(probe)
    except OSError:
        return None


def datagram_size(mtu: int | None, max_datagram_size: int) -> int:
    """The QUIC datagram size a path of *mtu* octets carries unfragmented, at most *max_datagram_size* (the
    configured maximum) and at least :data:`MIN_DATAGRAM`; :data:`DEFAULT_DATAGRAM` where *mtu* is unknown."""
    fits = DEFAULT_DATAGRAM if mtu is None else mtu - PATH_OVERHEAD
    return max(MIN_DATAGRAM, min(max_datagram_size, fits))
