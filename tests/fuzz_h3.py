"""HTTP/3 request streams as our server reads them, for the fuzz harness (tests/fuzz_targets.py, ``h3:server``).

One input is the octets a client writes on request stream 0 (optionally after a prefix for its QPACK encoder
stream). They are handed, as one STREAM frame's worth, to the real :class:`http3.h3_server.H3AsgiHandler` of a
real :class:`quic.listener.ServerConnectionProtocol` on our :class:`quic.connection.KvspQuicConnection` (no
handshake: the handler reads stream events, and what it sends is only queued; the deferred transmits, which
cannot build packets without keys, fail and are ignored), with a small ASGI app that reads the body and answers.
The event loop then runs until the handler is idle (or 50 ms: a request then waits for its peer, e.g. a HEADERS
frame blocked on QPACK encoder instructions that never come). What must hold: nothing escapes the
handler, no task of it ends in an exception, and the outcome is one of: a response from the app, a refusal by the
server (400, 413, 431: the field-section bounds of issue 13), or the connection closed with an HTTP/3 or QPACK
error code.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

from aioquic.buffer import Buffer, BufferReadError  # type: ignore[attr-defined]  # re-exported from aioquic._buffer
from aioquic.h3.connection import ErrorCode, FrameType
from aioquic.quic import events as qe
from aioquic.quic.connection import QuicNetworkPath
from aioquic.quic.packet import QuicFrameType
from pylsqpack import Decoder

from http3.asgi_types import Receive, Scope, Send
from http3.h3_server import H3AsgiHandler, h3_handler
from quic.connection import KvspQuicConnection
from quic.listener import QuicConnectionContext, QuicListener, ServerConnectionProtocol
from quic.tls import TransportSettings

SETTINGS = TransportSettings(max_header_bytes=4096, max_body_bytes=1 << 16)


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the whole body, answers 200 with its length and the path."""
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = f"{scope['method']} {scope['path']} {size}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


class H3Server:
    """The server side of one fresh connection per input, on one event loop for the whole run."""

    def __init__(self) -> None:
        from tests.pki import make_pki

        root = Path(tempfile.mkdtemp(prefix="kvsp-fuzz-h3-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        pki = make_pki(root)
        self.factory = h3_handler(echo)
        self.listener = QuicListener(pki.files("server"), {"h3": self.factory}, settings=SETTINGS)
        self.loop = asyncio.new_event_loop()
        atexit.register(self.loop.close)
        self.tasks: list[asyncio.Task[Any]] = []
        self.loop.set_task_factory(self._task)
        self.loop.set_exception_handler(self._exception)
        self.errors: list[BaseException] = []

    def _exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Without a handshake the connection has no keys to build packets with: the protocol's deferred
        transmits fail (in aioquic's ``datagrams_to_send``), and only those are ignored."""
        handle = context.get("handle")
        if "_deferred_transmit" in repr(handle):
            return
        self.errors.append(context.get("exception") or RuntimeError(context.get("message", "?")))

    def _task(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        self.tasks.append(task)
        return task

    def request(self, encoder_stream: bytes, request: bytes) -> tuple[Any, ...]:
        return self.loop.run_until_complete(self._request(encoder_stream, request))

    async def _request(self, encoder_stream: bytes, request: bytes) -> tuple[Any, ...]:
        quic = KvspQuicConnection(configuration=self.listener._configuration,
                                  original_destination_connection_id=b"\x01" * 8)
        quic._network_paths = [QuicNetworkPath(("127.0.0.1", 40000), is_validated=True)]  # as a datagram would
        protocol = ServerConnectionProtocol(quic, server=self.listener)
        ctx = QuicConnectionContext(protocol, quic, "h3", {}, ("127.0.0.1", 40000), ("127.0.0.1", 8443), SETTINGS)
        handler = self.factory(ctx)
        assert isinstance(handler, H3AsgiHandler)
        self.tasks.clear()
        events = [qe.StreamDataReceived(data=request, end_stream=True, stream_id=0)]
        if encoder_stream:
            events.insert(0, qe.StreamDataReceived(data=b"\x02" + encoder_stream, end_stream=False, stream_id=2))
        for event in events:
            quic._get_or_create_stream(QuicFrameType.STREAM_BASE, event.stream_id)  # as a STREAM frame would
            handler.quic_event_received(event)
        try:  # no I/O here: a request not answered within a few loop turns waits for the peer (a blocked stream)
            await asyncio.wait_for(handler.drain(), 0.05)
            hung = False
        except TimeoutError:
            hung = True
            handler.connection_terminated()
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        for task in self.tasks:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            elif not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if self.errors:
            error, self.errors = self.errors[0], []
            raise error
        close = quic._close_event
        sent = quic._streams.get(0)
        return (handler.refusals, hung, None if close is None else close.error_code,
                None if sent is None else bytes(sent.sender._buffer))


def label(value: tuple[Any, ...]) -> str | None:
    refusals, hung, code, sent = value
    if hung:
        return "waits-for-peer"
    if code is not None:
        try:
            return f"close:{ErrorCode(code).name}"
        except ValueError:
            return f"close:0x{code:x}"
    status = _status(sent or b"")
    if refusals:
        return f"refused:{status}"
    return f"status:{status}"


def _status(sent: bytes) -> str | None:
    """The ``:status`` of the first HEADERS frame the server queued on the request stream."""
    buf = Buffer(data=sent)
    try:
        while not buf.eof():
            frame_type, length = buf.pull_uint_var(), buf.pull_uint_var()
            payload = buf.pull_bytes(length)
            if frame_type == FrameType.HEADERS:
                _, headers = Decoder(4096, 16).feed_header(0, payload)
                return dict(headers)[b":status"].decode()
    except BufferReadError:
        return "cut"
    return None


__all__ = ["H3Server", "echo", "label"]
