"""HTTP/2 over TLS: an asyncio protocol around the sans-I/O h2 state machine, one ASGI exchange per stream.

Backpressure is HTTP/2 flow control: received DATA is acknowledged (WINDOW_UPDATE) only as the app takes it, so
a stream never holds more unread body than its receive window and a connection never more than the connection
window; responses wait for the peer's send window and for the transport to drain. Large windows and frames
(our SETTINGS) keep a single stream fast on fat pipes. Graceful shutdown lets the streams in flight finish, refuses
new ones, and says GOAWAY when the last one is done.

Slow peers (issue 13): a header block (the connection preface, a HEADERS frame and its CONTINUATIONs up to
END_HEADERS, any frame header) begun and not finished within ``settings.header_timeout`` ends the connection
with GOAWAY ENHANCE_YOUR_CALM (RFC 9113, 7: the peer "might be generating excessive load"; a header block cannot
be abandoned alone, its field compression state is the connection's, RFC 9113, 4.3); a connection without
streams is closed after ``settings.idle_timeout``, whatever it sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from h2.frame_buffer import FrameBuffer
from hyperframe.frame import DataFrame, Frame

from http3.asgi_bridge import (
    AsgiContext,
    Buffer,
    ClientDisconnected,
    Exchange,
    Headers,
    RequestBody,
    http_scope,
)
from http3.tcp_flow import WriteFlow

log = logging.getLogger("http3.tcp")

# The largest frame we accept (SETTINGS_MAX_FRAME_SIZE). Measured on loopback, 64 MiB uploads with 16 MiB windows:
# 64-128 KiB frames ~430 MB/s, 256 KiB ~900 MB/s, 512 KiB-1 MiB ~640 MB/s (256 KiB is also what the TLS transport
# hands over per read, so a frame rarely waits in the buffer).
MAX_FRAME_SIZE = 256 << 10
WRITE_BATCH = 1 << 20  # octets serialized per transport write before waiting for it to drain
_MAX_WINDOW = 2**31 - 1
_CONNECTION_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                                 b"upgrade"})


_FRAME_HEADER = struct.Struct(">HBBBL")  # hyperframe's: 24-bit length, type, flags, stream id


class _QuietDataFrame(DataFrame):
    """A received DATA frame whose repr does not hex-dump its payload.

    h2 evaluates ``repr(frame)`` for every frame it receives, logging or not, and hyperframe's DATA frame repr
    serializes and hex-encodes the whole payload: three passes over every octet, more than half of the CPU a
    1 MiB frame costs.
    """

    def _body_repr(self) -> str:
        return f"<{len(self.data)} octets>"


class _FrameBuffer(FrameBuffer):
    """h2's frame buffer with a short path for plain DATA frames: the payload is copied once, straight out of the
    buffer, rather than sliced, viewed and copied again; anything else goes the general way. Frame lengths are
    checked as soon as the header is in (h2 checks them only once the whole frame is buffered)."""

    def __next__(self) -> Frame:
        data = self._data
        if len(data) < 9:
            raise StopIteration
        length = (data[0] << 16) | (data[1] << 8) | data[2]
        self._validate_frame_length(length)  # before buffering a frame that is too large, not after
        if data[3] == 0 and not data[4] & 0x08 and not self._headers_buffer:
            stream_id = int.from_bytes(data[5:9], "big") & 0x7FFFFFFF
            if stream_id:
                if len(data) < 9 + length:
                    raise StopIteration
                frame = _QuietDataFrame(stream_id)
                if data[4] & 0x01:
                    frame.flags.add("END_STREAM")
                with memoryview(data) as view:
                    frame.data = view[9:9 + length].tobytes()
                frame.body_len = length
                del data[:9 + length]
                return frame
        return super().__next__()


class _Chunk:
    """A slice of a response body that h2 takes for bytes: h2 only measures it (a memoryview it would copy), and
    :class:`H2Core` writes the view itself."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __len__(self) -> int:
        return len(self.view)


class H2Core(h2.connection.H2Connection):
    """h2's connection with a copy-free data path (h2 is pinned: this relies on three of its internals).

    * received DATA frames are parsed with one copy (:class:`_FrameBuffer`) and get
      :class:`_QuietDataFrame`'s cheap repr;
    * outgoing frames are kept as a list of chunks for ``writelines``: a DATA frame becomes its 9-octet header
      and the app's body buffer itself, instead of being copied four times (serialize, join, the bytearray
      buffer, ``data_to_send``). ``_prepare_for_sending`` is where h2 queues every frame it sends.
    """

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        self.incoming_buffer = _FrameBuffer(server=not config.client_side)
        self._out: list[Buffer] = []
        self._frame_dispatch_table[_QuietDataFrame] = self._receive_data_frame

    def _receive_frame(self, frame: Frame) -> list[h2.events.Event]:
        if frame.__class__ is DataFrame:
            frame.__class__ = _QuietDataFrame
        return super()._receive_frame(frame)

    def _prepare_for_sending(self, frames: list[Frame]) -> None:
        out = self._out
        if self._data_to_send:  # written directly by initiate_connection(): keep the order
            out.append(bytes(self._data_to_send))
            self._data_to_send = bytearray()
        for frame in frames:
            if frame.__class__ is DataFrame and not frame.pad_length:
                data: Any = frame.data  # bytes, or a _Chunk from send_chunk()
                if isinstance(data, _Chunk):
                    data = data.view
                n = len(data)
                out.append(_FRAME_HEADER.pack((n >> 8) & 0xFFFF, n & 0xFF, 0, 1 if "END_STREAM" in frame.flags else 0,
                                              frame.stream_id & 0x7FFFFFFF))
                if n:
                    out.append(data)
            else:
                out.append(frame.serialize())

    def send_chunk(self, stream_id: int, view: memoryview, end_stream: bool = False) -> None:
        """``send_data`` of a body slice without copying it (the caller keeps it unchanged until it is written)."""
        self.send_data(stream_id, _Chunk(view), end_stream=end_stream)  # type: ignore[arg-type]

    def output(self) -> list[Buffer]:
        """Everything queued for the peer since the last call, as chunks for ``writelines``."""
        self._prepare_for_sending([])
        out, self._out = self._out, []
        return out

    def data_to_send(self, amount: int | None = None) -> bytes:
        if amount is not None:
            raise NotImplementedError("use output()")
        return b"".join(self.output())


class H2Connection(WriteFlow, asyncio.Protocol):
    """One HTTP/2 connection; installed by :class:`http3.tcp_server.TcpServer` once ALPN chose it."""

    protocol_name = "HTTP/2"

    def __init__(self, ctx: AsgiContext, transport: asyncio.Transport, conn_info: dict[str, Any]) -> None:
        super().__init__(ctx, transport, conn_info)
        settings = self.settings
        self.streams: dict[int, _Stream] = {}

        conn = H2Core(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: settings.max_streams,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: min(settings.stream_window, _MAX_WINDOW),
            h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME_SIZE,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: settings.max_header_bytes,
        })
        # Settings given as initial values are never "acknowledged" inside h2: apply their inbound effects here.
        conn.max_inbound_frame_size = MAX_FRAME_SIZE
        conn.decoder.max_header_list_size = settings.max_header_bytes
        conn.initiate_connection()
        extra = min(settings.connection_window, _MAX_WINDOW) - 65535
        if extra > 0:
            conn.increment_flow_control_window(extra)
        self.h2 = conn
        self._head_timer: asyncio.TimerHandle | None = None  # a header block is under way (header_timeout)
        self.flush()
        self._arm_timer(settings.idle_timeout)

    # -- asyncio.Protocol -----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._last_rx = self.loop.time()
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.debug("HTTP/2 protocol error from %s: %s", self.info["client"], exc)
            self.flush()  # h2 queued a GOAWAY
            self._close()
            return
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                self._on_data(event)
            elif isinstance(event, h2.events.RequestReceived):
                self._on_request(event)
            elif isinstance(event, h2.events.StreamEnded):
                self._on_stream_ended(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                self._on_stream_reset(event.stream_id)
            elif isinstance(event, h2.events.WindowUpdated):
                self._wake_windows(event.stream_id)
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                self._wake_windows(0)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self._on_goaway(event)
        self.flush()
        self._watch_head()

    def eof_received(self) -> bool | None:
        for stream in list(self.streams.values()):
            stream.lost()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        for stream in list(self.streams.values()):
            stream.lost()
        self.streams.clear()
        self._lost()

    # -- server API ------------------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.streams

    def shutdown(self) -> None:
        """Graceful: refuse new streams, finish those in flight, then GOAWAY and close.

        The GOAWAY waits for the streams in flight because httpx (httpcore 1.0) fails every open stream on any
        GOAWAY, even a NO_ERROR one naming them as still served; REFUSED_STREAM tells a client that a request it
        sends meanwhile was not processed and can be retried (RFC 9113 section 8.7).
        """
        if self.closing or self.closed:
            return
        self.closing = True
        if not self.streams:
            self._close()

    def abort(self) -> None:
        if not self.closed:
            self.transport.abort()

    # -- events ----------------------------------------------------------------------------------------------

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        if self.closing:
            self.h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        self._cancel_timer()
        method = path = authority = b""
        headers: Headers = []
        for name, value in event.headers or ():
            name, value = bytes(name), bytes(value)
            if name[:1] == b":":
                if name == b":method":
                    method = value
                elif name == b":path":
                    path = value
                elif name == b":authority":
                    authority = value
            else:
                headers.append((name, value))
        if authority and not any(name == b"host" for name, _ in headers):
            headers.insert(0, (b"host", authority))
        stream = _Stream(self, sid)
        self.streams[sid] = stream
        body = RequestBody(self.ctx, stream.consumed)
        scope = http_scope(self.ctx, http_version="2", method=method.decode("ascii", "replace"),
                           target=path or b"/", headers=headers, client=self.info["client"],
                           server=self.info["server"], tls=self.info["tls"])
        exchange = Exchange(self.ctx, scope, body, stream)
        stream.exchange = exchange
        declared = next((v for k, v in headers if k == b"content-length"), None)
        if not path or not method or method == b"CONNECT":
            self._track(exchange.reject(400))
        elif declared is not None and declared.isdigit() and int(declared) > self.settings.max_body_bytes:
            self._track(exchange.reject(413, "Content Too Large"))
        else:
            self._track(self.loop.create_task(exchange.run()))
        self._arm_timer(self.settings.idle_timeout)  # watches for stalled request bodies

    def _on_data(self, event: h2.events.DataReceived) -> None:
        stream = self.streams.get(event.stream_id)
        credit = event.flow_controlled_length or 0
        if stream is None or stream.exchange is None:
            if credit:
                self.h2.acknowledge_received_data(credit, event.stream_id)
            return
        body = stream.exchange.body
        body.feed(event.data or b"", credit)
        if body.received > self.settings.max_body_bytes:
            self._track(stream.exchange.reject(413, "Content Too Large"))

    def _on_stream_ended(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is not None:
            stream.ended_remote = True
            if stream.exchange is not None:
                stream.exchange.body.finish()
            self._maybe_forget(stream)

    def _on_stream_reset(self, sid: int) -> None:
        stream = self.streams.pop(sid, None)
        if stream is not None:
            stream.lost()
        self._after_stream()

    def _on_goaway(self, event: h2.events.ConnectionTerminated) -> None:
        last = event.last_stream_id if event.last_stream_id is not None else 0
        for sid, stream in list(self.streams.items()):
            if sid > last:
                self.streams.pop(sid, None)
                stream.lost()
        self.closing = True
        self._after_stream()

    def _wake_windows(self, sid: int) -> None:
        if sid:
            stream = self.streams.get(sid)
            if stream is not None:
                stream.wake()
        else:
            for stream in self.streams.values():
                stream.wake()

    def _maybe_forget(self, stream: _Stream) -> None:
        if stream.reset_sent or (stream.ended_local and stream.ended_remote):
            self.streams.pop(stream.id, None)
            self._after_stream()

    def _after_stream(self) -> None:
        if not self.streams:
            if self.closing:
                self._close()
            else:
                self._arm_timer(self.settings.idle_timeout)

    # -- output --------------------------------------------------------------------------------------------

    def flush(self) -> None:
        chunks = self.h2.output()
        if chunks and not self.closed and not self.transport.is_closing():
            self.transport.writelines(chunks)


    def _close(self) -> None:
        if self.closed or self.transport.is_closing():
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.close_connection()
        self.flush()
        self.transport.close()
        if not self.quiet.done():
            self.quiet.set_result(None)

    # -- timers --------------------------------------------------------------------------------------------

    def _head_pending(self) -> bool:
        """The peer has begun a header block (or the preface, or any frame header) and not finished it."""
        frames = self.h2.incoming_buffer
        partial = frames._data
        preface_left = frames._preamble_len
        return bool(frames._headers_buffer or 0 < preface_left < 24
                    or (partial and (len(partial) < 9 or partial[3] in (0x1, 0x5, 0x9))))

    def _watch_head(self) -> None:
        if self.closed:
            return
        if not self._head_pending():
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.settings.header_timeout, self._head_too_slow)

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.closed or self.transport.is_closing():
            return
        log.debug("HTTP/2 peer %s did not finish a header block in %gs: closing", self.info["client"],
                  self.settings.header_timeout)
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.close_connection(error_code=ErrorCodes.ENHANCE_YOUR_CALM)
        self.flush()
        self.transport.close()
        if not self.quiet.done():
            self.quiet.set_result(None)

    def _on_timer(self) -> None:
        self._timer = None
        if not self.streams:
            self._close()
            return
        timeout = self.settings.idle_timeout
        idle_for = self.loop.time() - self._last_rx
        if idle_for < timeout:
            self._arm_timer(timeout - idle_for)
            return
        for stream in list(self.streams.values()):  # peer silent: reset streams it owes body octets
            body = stream.exchange.body if stream.exchange is not None else None
            if body is not None and not body.complete and not body.disconnected and not body.buffered:
                log.debug("HTTP/2 peer %s stalled sending a request body on stream %d", self.info["client"],
                          stream.id)
                stream.reset(ErrorCodes.CANCEL)
        self.flush()
        if self.streams:
            self._arm_timer(timeout)

    def _track(self, task: asyncio.Task[None] | None) -> None:
        if task is not None:
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


class _Stream:
    """One request stream; the :class:`~http3.asgi_bridge.ResponseSink` of its exchange."""

    def __init__(self, conn: H2Connection, stream_id: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.exchange: Exchange | None = None
        self.ended_remote = False
        self.ended_local = False
        self.reset_sent = False
        self.gone = False  # reset by the peer or the connection is lost
        self._window: asyncio.Future[None] | None = None

    @property
    def closed(self) -> bool:
        return self.gone or self.reset_sent or self.conn.closed

    def consumed(self, credit: int) -> None:
        conn = self.conn
        if conn.closed:
            return
        conn.h2.acknowledge_received_data(credit, self.id)
        conn.flush()

    def wake(self) -> None:
        if self._window is not None and not self._window.done():
            self._window.set_result(None)

    def lost(self) -> None:
        self.gone = True
        if self.exchange is not None:
            self.exchange.body.disconnect()
        self.wake()

    async def send_head(self, status: int, headers: Headers, body: Buffer, end: bool) -> None:
        conn = self.conn
        if self.closed:
            raise ClientDisconnected("stream closed")
        fields = [(b":status", b"%d" % status)]
        fields += [(k, v) for k, v in headers if k not in _CONNECTION_HEADERS]
        try:
            conn.h2.send_headers(self.id, fields, end_stream=end and not body)
        except h2.exceptions.StreamClosedError:
            self.gone = True
            raise ClientDisconnected("stream closed") from None
        except h2.exceptions.ProtocolError as exc:
            self.reset()
            raise RuntimeError(f"ASGI app sent an invalid response head: {exc}") from None
        if body or not end:
            await self.send_data(body, end)
            return
        self._ended()
        conn.flush()
        await conn.drain()

    async def send_data(self, data: Buffer, end: bool) -> None:
        conn = self.conn
        h2c = conn.h2
        view = memoryview(data)
        total, sent = len(view), 0
        while True:
            if self.closed:
                raise ClientDisconnected("stream closed")
            try:
                window = h2c.local_flow_control_window(self.id)
            except h2.exceptions.StreamClosedError:
                self.gone = True
                raise ClientDisconnected("stream closed") from None
            if sent < total and window <= 0:
                await self._wait_window()
                continue
            if sent < total and conn.write_paused:  # other streams filled the transport: wait for it to drain
                await conn.writable()
                continue
            batch = min(total - sent, window, WRITE_BATCH)
            frame = h2c.max_outbound_frame_size
            stop = sent + batch
            while sent < stop:
                size = min(frame, stop - sent)
                h2c.send_chunk(self.id, view[sent:sent + size], end_stream=end and sent + size == total)
                sent += size
            if end and total == 0:
                h2c.end_stream(self.id)
            conn.flush()
            if sent >= total:
                break
            await conn.drain()
        if end:
            self._ended()
        await conn.drain()

    def _ended(self) -> None:
        self.ended_local = True
        if not self.ended_remote and not self.gone:
            # The response is complete before the request (RFC 9113 section 8.1): ask the peer to stop sending.
            self.reset(ErrorCodes.NO_ERROR)
        self.conn._maybe_forget(self)

    async def _wait_window(self) -> None:
        self._window = self.conn.loop.create_future()
        try:
            async with asyncio.timeout(self.conn.settings.idle_timeout):
                await self._window
        except TimeoutError:
            log.debug("HTTP/2 peer %s kept stream %d's send window closed: reset", self.conn.info["client"], self.id)
            self.reset(ErrorCodes.CANCEL)
            raise ClientDisconnected("the peer stopped reading") from None
        finally:
            self._window = None

    def reset(self, code: ErrorCodes = ErrorCodes.INTERNAL_ERROR) -> None:
        conn = self.conn
        if self.closed:
            return
        self.reset_sent = True
        with contextlib.suppress(h2.exceptions.ProtocolError):
            conn.h2.reset_stream(self.id, code)
        if self.exchange is not None:
            self.exchange.body.disconnect()
        conn.flush()
        conn.streams.pop(self.id, None)
        conn._after_stream()
        self.wake()
