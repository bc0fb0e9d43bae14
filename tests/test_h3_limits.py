"""HTTP/3 field sections as an attacker sends them (issue 13): a raw aioquic client against our server on 127.0.0.1.

The attacker holds a certificate of the CA (the handshake succeeds) and writes HTTP/3 frames by hand on a request
stream: a HEADERS frame that declares 1 TiB and is then streamed, octet after octet. The server must refuse the
stream as soon as the frame length is read (431 and STOP_SENDING with H3_EXCESSIVE_LOAD), grant no stream credit
beyond its initial window for it, keep what it buffers bounded, and keep serving the connection's other requests.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration

from http3.asgi_types import Receive, Scope, Send
from http3.h3_server import H3_EXCESSIVE_LOAD, H3AsgiHandler, h3_handler
from quic.listener import QuicListener
from quic.tls import TransportSettings
from tests.pki import TestPki

WINDOW = 1 << 20
SETTINGS = TransportSettings(stream_window=WINDOW, connection_window=4 << 20, send_buffer=1 << 20,
                             max_header_bytes=64 << 10, shutdown_grace=2.0)
HEADERS = 0x01


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


class Attacker(QuicConnectionProtocol):
    """aioquic's own protocol with aioquic's H3Connection for the control streams and well-formed requests; the
    attack frames are written straight onto QUIC streams."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.stopped: dict[int, int] = {}  # stream -> STOP_SENDING error code
        self.reset: dict[int, int] = {}
        self.status: dict[int, bytes] = {}
        self.body: dict[int, bytes] = {}
        self.credits: dict[int, int] = {}  # stream -> the last credit seen (:meth:`credit`)
        self.changed = asyncio.Event()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StopSendingReceived):
            self.stopped[event.stream_id] = event.error_code
        elif isinstance(event, events.StreamReset):
            self.reset[event.stream_id] = event.error_code
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                self.status[h3_event.stream_id] = dict(h3_event.headers)[b":status"]
            elif isinstance(h3_event, DataReceived):
                self.body[h3_event.stream_id] = self.body.get(h3_event.stream_id, b"") + h3_event.data
        self.changed.set()

    def credit(self, stream_id: int) -> int:
        """The stream credit the server has granted (MAX_STREAM_DATA as the client holds it): the last value seen
        while aioquic kept the stream (it discards a stream once both directions are done)."""
        stream = self._quic._streams.get(stream_id)
        if stream is not None:
            self.credits[stream_id] = int(stream.max_stream_data_remote)
        return self.credits[stream_id]

    def sent(self, stream_id: int) -> int | None:
        """Octets sent on the stream; None once aioquic has discarded it."""
        stream = self._quic._streams.get(stream_id)
        return int(stream.sender.highest_offset) if stream is not None else None

    async def wait(self, predicate: Any, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


def varint(value: int) -> bytes:
    """A QUIC variable-length integer (RFC 9000, 16)."""
    for prefix, size in ((0, 1), (1, 2), (2, 4), (3, 8)):
        if value < 1 << (8 * size - 2):
            return (value | prefix << (8 * size - 2)).to_bytes(size, "big")
    raise ValueError("too large for a varint")


def frame_header(frame_type: int, length: int) -> bytes:
    return varint(frame_type) + varint(length)


@pytest.fixture
async def listener(fresh_certs: TestPki) -> AsyncIterator[QuicListener]:
    server = QuicListener(fresh_certs.files("server"), {"h3": h3_handler(hello)}, settings=SETTINGS)
    await server.start("127.0.0.1", 0)
    yield server
    await server.close()


def attacker_config(certs: TestPki) -> QuicConfiguration:
    config = QuicConfiguration(is_client=True, alpn_protocols=["h3"], server_name="localhost",
                               max_stream_data=WINDOW, max_data=4 << 20)
    config.load_cert_chain(certs.files("alice").cert, certs.files("alice").key)  # a certificate of the CA
    config.verify_mode = ssl.CERT_NONE  # the attacker does not care who the server is
    return config


def handlers(server: QuicListener) -> list[H3AsgiHandler]:
    return [c._handler for c in server._connections if isinstance(c._handler, H3AsgiHandler)]


def server_buffered(server: QuicListener) -> int:
    """Octets the server's HTTP/3 layer buffers on request streams (aioquic's per-stream buffers)."""
    return sum(len(s.buffer) for h in handlers(server) for s in h.h3._stream.values())


async def request(client: Attacker, path: bytes) -> int:
    stream_id = client._quic.get_next_available_stream_id()
    client.h3.send_headers(stream_id, [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"localhost"),
                                       (b":path", path)], end_stream=True)
    client.transmit()
    return stream_id


async def test_a_huge_headers_frame_is_refused_as_it_is_declared(listener: QuicListener, fresh_certs: TestPki) -> None:
    async with connect("127.0.0.1", listener.port, configuration=attacker_config(fresh_certs),
                       create_protocol=Attacker) as client:
        assert isinstance(client, Attacker)
        ok = await request(client, b"/before")
        await client.wait(lambda: ok in client.body)
        assert client.status[ok] == b"200"

        attack = client._quic.get_next_available_stream_id()
        client._quic.send_stream_data(attack, frame_header(HEADERS, 1 << 40))  # 1 TiB of field section
        filler = b"\x00" * 16384
        peak = 0
        for _ in range(512):  # up to 8 MiB, as fast as the server lets it through
            sent = client.sent(attack)
            if attack in client.stopped or sent is None:
                break
            if sent + len(filler) <= client.credit(attack):
                client._quic.send_stream_data(attack, filler)
            client.transmit()
            await asyncio.sleep(0.002)
            peak = max(peak, server_buffered(listener))
        await client.wait(lambda: attack in client.stopped and attack in client.status)

        assert client.stopped[attack] == H3_EXCESSIVE_LOAD  # RFC 9114, 8.1
        assert client.status[attack] == b"431"  # RFC 9114, 4.2.2
        assert client.credit(attack) <= WINDOW  # no credit was granted again for the buffered octets
        assert peak <= WINDOW and server_buffered(listener) == 0  # bounded while it lasted, dropped after
        assert sum(h.refusals for h in handlers(listener)) == 1

        # aioquic's client answers STOP_SENDING with RESET_STREAM; the connection serves other requests
        after = await request(client, b"/after")
        await client.wait(lambda: after in client.body)
        assert client.status[after] == b"200" and client.body[after] == b"hello"
        assert server_buffered(listener) == 0


async def test_an_unfinished_headers_frame_counts_against_flow_control(listener: QuicListener,
                                                                        fresh_certs: TestPki) -> None:
    """Within the limit, a slowly sent HEADERS frame is held as unread: the credit granted for the stream stays
    at the initial window until the field section is complete and decoded."""
    async with connect("127.0.0.1", listener.port, configuration=attacker_config(fresh_certs),
                       create_protocol=Attacker) as client:
        assert isinstance(client, Attacker)
        slow = client._quic.get_next_available_stream_id()
        client._quic.send_stream_data(slow, frame_header(HEADERS, 60_000))
        client._quic.send_stream_data(slow, b"\x00" * 40_000)
        client.transmit()

        def held() -> int:
            return sum(h.ctx.quic.unread(slow) for h in handlers(listener))

        async with asyncio.timeout(5):
            while held() < 40_000:
                await asyncio.sleep(0.01)
        assert held() == server_buffered(listener) >= 40_000
        assert client.credit(slow) == WINDOW
        assert sum(h.refusals for h in handlers(listener)) == 0


async def test_a_headers_frame_just_over_the_limit_is_refused(listener: QuicListener, fresh_certs: TestPki) -> None:
    async with connect("127.0.0.1", listener.port, configuration=attacker_config(fresh_certs),
                       create_protocol=Attacker) as client:
        assert isinstance(client, Attacker)
        stream = client._quic.get_next_available_stream_id()
        client._quic.send_stream_data(stream, frame_header(HEADERS, SETTINGS.max_header_bytes + 1) + b"\x00" * 100)
        client.transmit()
        await client.wait(lambda: stream in client.stopped)
        assert client.stopped[stream] == H3_EXCESSIVE_LOAD


def test_settings_are_what_the_tests_assume() -> None:
    assert replace(SETTINGS).max_header_bytes == 64 << 10 < WINDOW
