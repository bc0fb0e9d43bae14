"""QUIC helpers: small flow-control windows, a handshake without a client certificate, a UDP relay that slows
handshakes down."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aioquic.quic.configuration import QuicConfiguration

from http3.h3_client import H3ClientConnection
from quic.connection import KvspQuicConnection
from quic.tls import TransportSettings
from quic.udp import BatchedUdpTransport, bind_udp

SMALL_WINDOWS = TransportSettings(stream_window=1 << 20, connection_window=2 << 20, send_buffer=1 << 20,
                                  max_body_bytes=96 << 20, shutdown_grace=5.0)


async def connect_without_certificate(ca: Path, port: int) -> str:
    """Connect over QUIC with no client certificate; return why the server closed the connection."""
    config = QuicConfiguration(is_client=True, alpn_protocols=["h3"], server_name="127.0.0.1")
    config.load_verify_locations(cadata=ca.read_bytes())  # verifies the server, but has no certificate
    loop = asyncio.get_running_loop()
    protocol = H3ClientConnection(KvspQuicConnection(configuration=config), settings=SMALL_WINDOWS)
    transport = BatchedUdpTransport(loop, bind_udp("127.0.0.1", 0, 1 << 20), protocol)
    try:
        protocol.connect(("127.0.0.1", port))
        await asyncio.wait_for(protocol.wait_connected(), 5)  # the client's side of TLS completes...
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(protocol.confirmed, 5)  # ...but the server never confirms the handshake
        return protocol.close_reason
    finally:
        transport.close()


class DelayingRelay(asyncio.DatagramProtocol):
    """A UDP relay in front of the server: each client flow gets its own upstream socket (so the server still sees
    one 4-tuple per client connection); the datagrams of every flow after the first are held back *delay* seconds
    for the first *slow_for* seconds of the flow (a slow handshake)."""

    def __init__(self, target: tuple[str, int], delay: float, slow_for: float) -> None:
        self.target = target
        self.delay = delay
        self.slow_for = slow_for
        self.transport: asyncio.DatagramTransport | None = None
        self.flows: dict[tuple[str, int], tuple[asyncio.DatagramTransport, float | None]] = {}  # upstream, slow until
        self._pending: dict[tuple[str, int], list[bytes]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        loop = asyncio.get_running_loop()
        flow = self.flows.get(addr)
        if flow is None:
            if addr in self._pending:
                self._pending[addr].append(data)
                return
            self._pending[addr] = [data]
            task = loop.create_task(self._open(addr))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        upstream, slow_until = flow
        if slow_until is not None and loop.time() < slow_until:
            loop.call_later(self.delay, upstream.sendto, data)
        else:
            upstream.sendto(data)

    async def _open(self, addr: tuple[str, int]) -> None:
        loop = asyncio.get_running_loop()
        relay = self

        class Back(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, _: Any) -> None:
                assert relay.transport is not None
                relay.transport.sendto(data, addr)

        upstream, _ = await loop.create_datagram_endpoint(Back, remote_addr=self.target)
        self.flows[addr] = (upstream, loop.time() + self.slow_for if self.flows else None)
        for data in self._pending.pop(addr):
            self.datagram_received(data, addr)

    def close(self) -> None:
        for upstream, _ in self.flows.values():
            upstream.close()
        if self.transport is not None:
            self.transport.close()
