"""Round-trip times per peer host, and the timeouts that follow from them (issue 12, point 5): pure, no I/O.

A connect has no path yet, so it cannot ask its own connection for the RTT (:meth:`quic.connection.
KvspQuicConnection.path_timeout` does that for waits on an open connection). :class:`RttTable` remembers the
smoothed RTT and its variance (RFC 9002 5.3) of this process's recent client connections per remote host -- QUIC's
(HTTP/3 and MOQT pools record a connection when it joins the pool, when it is dropped, and before each dial from the
connections still open) and TCP's (``tcpi_rtt`` of HTTP/1.1 connections, :func:`tcp_info_rtt`) -- bounded in size
(least recently recorded first out) and forgetting a host whose last sample is older than ``ttl`` seconds. A pool
uses a table only when it is given one (``rtts=``): the instance gives its HTTP and MOQT pools the process's
:data:`PEER_RTTS`, so what one transport measured serves the connects of the others; other clients keep fixed
connect timeouts.

:func:`connect_timeout` is the connect timeout of a dial::

    handshake = HANDSHAKE_RTTS x smoothed_rtt + PTO        PTO = smoothed_rtt + max(4 x rttvar, 1 ms) + max_ack_delay
    timeout   = clamp(CONNECT_MULTIPLIER x handshake, CONNECT_FLOOR, the configured connect timeout)

when the host's RTT is known, and the configured connect timeout (5 s HTTP, 10 s MOQT) when it is not. Three round
trips cover QUIC's handshake up to HANDSHAKE_DONE (1.5 RTT) plus MOQT's SETUP (1 RTT), the PTO one lost packet
(RFC 9002 6.2.1), and the multiplier a busy path. On loopback or a LAN the floor decides: a handshake costs the two
ends' CPU (TLS signatures, certificate checks; measured on this 2-core machine at load 5: HTTP/3 27 ms median, 110 ms
at most one at a time, 200-230 ms for 8 at once; MOQT 33 ms, 160 ms for 8 at once), so :data:`CONNECT_FLOOR` is
1 s, four times the worst; a host that answers nothing (a dead host, a firewall that drops ICMP) costs about that
instead of 5-10 s. :func:`path_timeout` is the wait for a peer's next octets on a path with a known RTT (multiples
of the PTO plus the transfer time of *octets* at a slow rate).
"""

from __future__ import annotations

import collections
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

GRANULARITY = 0.001  # s: RFC 9002's kGranularity
MAX_ACK_DELAY = 0.025  # s: RFC 9000's default max_ack_delay (TCP samples carry no ack delay of their own)
HANDSHAKE_RTTS = 3  # round trips of a connect: QUIC handshake and confirmation (1.5), MOQT SETUP (1), rounded up
CONNECT_MULTIPLIER = 3.0
CONNECT_FLOOR = 1.0  # s: the shortest connect timeout (CPU of a TLS handshake on a loaded machine: module docs)
MIN_PATH_RATE = 50e6  # octets/s: the slowest transfer rate path_timeout allows for
STALL_FLOOR = 1.0  # s: the shortest wait for a peer's next octets (a busy peer on a loaded machine, not a dead one)


@dataclass(frozen=True)
class RttSample:
    """A path's round-trip estimate (seconds): RFC 9002's smoothed_rtt and rttvar, the peer's max_ack_delay, and
    when it was recorded (the table's clock)."""

    smoothed: float
    variance: float
    max_ack_delay: float = MAX_ACK_DELAY
    at: float = 0.0

    def __post_init__(self) -> None:
        if not (self.smoothed >= 0 and self.variance >= 0 and self.max_ack_delay >= 0):
            raise ValueError("an RTT sample is made of non-negative durations")

    @property
    def pto(self) -> float:
        """RFC 9002 6.2.1: ``smoothed_rtt + max(4 * rttvar, kGranularity) + max_ack_delay``."""
        return self.smoothed + max(4 * self.variance, GRANULARITY) + self.max_ack_delay


def connect_timeout(sample: RttSample | None, *, ceiling: float, floor: float = CONNECT_FLOOR,
                    multiplier: float = CONNECT_MULTIPLIER, rtts: int = HANDSHAKE_RTTS) -> float:
    """The connect timeout to a host whose path is *sample* (the module docstring); *ceiling*, the configured
    timeout, when the RTT is unknown. Never more than *ceiling*, never less than *floor* unless *ceiling* is."""
    if sample is None:
        return ceiling
    return min(ceiling, max(floor, multiplier * (rtts * sample.smoothed + sample.pto)))


def path_timeout(sample: RttSample | None, *, floor: float, ceiling: float, multiplier: float = 4.0,
                 octets: int = 0, rate: float = MIN_PATH_RATE) -> float:
    """*multiplier* PTOs of the path plus the time *octets* take at *rate* octets/s, within [*floor*, *ceiling*];
    *ceiling* when the RTT is unknown. What a wait for a peer's next octets should allow."""
    if sample is None:
        return ceiling
    return min(ceiling, max(floor, multiplier * sample.pto + octets / rate))


def slowest(samples: Iterable[RttSample | None]) -> RttSample | None:
    """The sample with the longest smoothed RTT among *samples* (None when none has one): the safe estimate of a
    host from the connections open to it, where no table is kept."""
    return max((x for x in samples if x is not None), key=lambda x: x.smoothed, default=None)


class RttTable:
    """The RTT of recent client connections per remote host (the module docstring). *capacity* hosts at most;
    a host's estimate lapses *ttl* seconds after its last sample. The clock is injected (monotonic seconds)."""

    def __init__(self, *, capacity: int = 1024, ttl: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1 or not ttl > 0:
            raise ValueError("an RTT table holds at least one host for a positive time")
        self.capacity = capacity
        self.ttl = ttl
        self._clock = clock
        self._hosts: collections.OrderedDict[str, RttSample] = collections.OrderedDict()

    def record(self, host: str, smoothed: float, variance: float, max_ack_delay: float = MAX_ACK_DELAY) -> RttSample:
        """A connection to *host* measured this path. A path that got slower is taken at once (a longer timeout is
        the safe side); one that got faster is blended in with RFC 6298's weights (1/8 of the change), and the
        variation grows with the change (1/4), never below what this connection saw."""
        now = self._clock()
        old = self.get(host)
        if old is not None:
            blended = old.smoothed + (smoothed - old.smoothed) / 8
            variance = max(variance, old.variance + (abs(smoothed - old.smoothed) - old.variance) / 4)
            smoothed = smoothed if smoothed >= old.smoothed else blended
        sample = RttSample(smoothed, variance, max_ack_delay, now)
        self._hosts[host] = sample
        self._hosts.move_to_end(host)
        while len(self._hosts) > self.capacity:
            self._hosts.popitem(last=False)
        return sample

    def get(self, host: str) -> RttSample | None:
        """*host*'s estimate, None when there is none or it lapsed (then it is forgotten)."""
        sample = self._hosts.get(host)
        if sample is not None and self._clock() - sample.at > self.ttl:
            del self._hosts[host]
            return None
        return sample

    def connect_timeout(self, host: str, ceiling: float, *, floor: float = CONNECT_FLOOR) -> float:
        """:func:`connect_timeout` of *host*'s estimate."""
        return connect_timeout(self.get(host), ceiling=ceiling, floor=floor)

    def observe(self, host: str, samples: Iterable[RttSample | None]) -> None:
        """Record the estimates of connections to *host* (those without a sample yet are skipped)."""
        for sample in samples:
            if sample is not None:
                self.record(host, sample.smoothed, sample.variance, sample.max_ack_delay)

    def forget(self, host: str) -> None:
        self._hosts.pop(host, None)

    def __len__(self) -> int:
        return len(self._hosts)

    def __contains__(self, host: object) -> bool:
        return isinstance(host, str) and self.get(host) is not None


# struct tcp_info (linux/tcp.h): 8 one-octet fields, then u32 tcpi_rto, ato, snd_mss, rcv_mss, unacked, sacked,
# lost, retrans, fackets, last_data_sent, last_ack_sent, last_data_recv, last_ack_recv, pmtu, rcv_ssthresh,
# rtt, rttvar (microseconds) -- the fields up to rttvar have been there since Linux 2.6.
_TCPI_RTT_OFFSET = 8 + 15 * 4
TCP_INFO_SIZE = _TCPI_RTT_OFFSET + 8  # the octets to ask getsockopt(TCP_INFO) for: up to tcpi_rttvar


def tcp_info_rtt(raw: bytes) -> tuple[float, float] | None:
    """(smoothed RTT, variance) in seconds from a Linux ``getsockopt(IPPROTO_TCP, TCP_INFO)`` answer; None when it
    is too short or the kernel has no sample yet (tcpi_rtt 0)."""
    if len(raw) < TCP_INFO_SIZE:
        return None
    rtt, rttvar = struct.unpack_from("=II", raw, _TCPI_RTT_OFFSET)
    if rtt == 0:
        return None
    return rtt / 1e6, rttvar / 1e6


PEER_RTTS = RttTable()  # the process's table: the composition root hands it to the retrieval path's pools (HTTP/3,
# MOQT and HTTP/1.1 share it); a pool without a table keeps its fixed connect timeout

__all__ = ["CONNECT_FLOOR", "PEER_RTTS", "STALL_FLOOR", "RttSample", "RttTable", "connect_timeout", "path_timeout",
           "slowest", "tcp_info_rtt"]
