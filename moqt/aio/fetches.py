"""Fetches on a :class:`~moqt.aio.connection.MoqtConnection`: :class:`FetchStream` (one FETCH of ours, read as
pieces or objects, or handed to a :class:`FetchSink`) and :class:`ServedFetch` (one FETCH of the peer that we
serve, written with backpressure).

Flow control: object payload octets handed to a :class:`FetchStream` are held
(:meth:`quic.connection.KvspQuicConnection.hold`) and credited back to the peer only as the consumer takes them
(``release``). Send backpressure: :class:`ServedFetch` writes object payloads in slices of half the send buffer,
each after ``wait_writable`` (QUIC's unsent + unacknowledged octets of the stream below the send buffer).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from moqt import events as ev
from moqt.aio.errors import FetchCancelled, MoqtSessionClosed, MoqtStalled
from moqt.errors import MoqtUsageError, StreamResetCode
from moqt.session import MoqtSession
from moqt.types import KeyValuePairs, Location, ObjectStatus
from moqt.writers import FetchStreamWriter


class _Writable(Protocol):
    async def wait_writable(self, stream_id: int) -> None: ...


class FetchHost(Protocol):
    """What a fetch needs from its connection (:class:`~moqt.aio.connection.MoqtConnection`): the session, send
    backpressure, and the flow-control and bookkeeping calls the connection exposes to its fetches."""

    @property
    def session(self) -> MoqtSession: ...

    @property
    def transport(self) -> _Writable: ...

    @property
    def send_buffer(self) -> int: ...

    @property
    def closed(self) -> ev.SessionClosed | None: ...

    def flush(self) -> None: ...

    def _release(self, stream_id: int, n: int) -> None: ...

    def _forget_fetch(self, fetch: FetchStream) -> None: ...

    def _forget_served(self, served: ServedFetch) -> None: ...


class FetchSink(Protocol):
    """Takes a fetch's replies and pieces synchronously, as they are dispatched (``MoqtConnection.fetch(...,
    sink=)``): nothing is queued or held for flow control, so the sink owns the pieces' memory (a relay's cache)."""

    def fetch_accepted(self, event: ev.FetchAccepted) -> None: ...

    def fetch_piece(self, piece: ev.ObjectReceived) -> bool:
        """Take a piece; True to hold its octets against flow control until :meth:`FetchStream.release`."""
        ...

    def fetch_ended(self) -> None:
        """The data stream ended with FIN after a whole number of objects."""

    def fetch_failed(self, error: BaseException) -> None: ...



@dataclass(frozen=True)
class MoqtObject:
    """A complete object of a fetch; ``parts`` are views of the received octets (joined only by ``payload``)."""

    group: int
    object_id: int
    subgroup: int | None
    status: ObjectStatus
    extensions: KeyValuePairs
    length: int
    parts: tuple[memoryview | bytes, ...]

    @property
    def payload(self) -> bytes:
        return b"".join(self.parts)


class FetchStream:
    """One FETCH of ours: its reply, then its objects as they arrive. Use it as an async context manager (or call
    :meth:`aclose`), so that an unfinished fetch is cancelled and its unread octets are credited back."""

    def __init__(self, conn: FetchHost, request_id: int, stall_timeout: float | None,
                 sink: FetchSink | None = None) -> None:
        self.conn = conn
        self.request_id = request_id
        self.stall_timeout = stall_timeout
        self.sink = sink
        self.accepted: ev.FetchAccepted | None = None
        self.stream_id: int | None = None
        self.range_ends: list[ev.FetchRangeEnded] = []
        self.received = 0  # payload octets taken by the consumer
        self._pieces: collections.deque[ev.ObjectReceived] = collections.deque()
        self._ended = False  # the data stream ended with FIN
        self._error: BaseException | None = None
        self._changed = asyncio.Event()
        self._closed = False
        self._sink_held = 0  # payload octets the sink holds (not yet credited back to the peer)

    # from the connection

    def _wake(self) -> None:
        self._changed.set()

    def _on_piece(self, piece: ev.ObjectReceived) -> bool:
        """Take a piece; True when it is held for the consumer (its octets count against flow control)."""
        if self._closed or self._error is not None:
            return False
        if self.sink is not None:
            n = len(piece.data)
            self.received += n
            if self.sink.fetch_piece(piece) and n:
                self._sink_held += n
                return True
            return False
        self._pieces.append(piece)
        self._wake()
        return True

    def _on_accepted(self, event: ev.FetchAccepted) -> None:
        self.accepted = event
        if self.sink is not None and not self._closed:
            self.sink.fetch_accepted(event)
        self._wake()

    def _on_end(self) -> None:
        self._ended = True
        if self.sink is not None and not self._closed and self._error is None:
            self.sink.fetch_ended()
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not (self._ended and self.accepted is not None):
            self._error = error
            if self.sink is not None and not self._closed:
                self.sink.fetch_failed(error)
        self._wake()

    # API

    @property
    def done(self) -> bool:
        """Every object arrived (the data stream ended) and was taken, or the fetch failed or was closed."""
        return self._closed or self._error is not None or (self._ended and not self._pieces)

    async def _wait(self, timeout: float | None) -> None:
        self._changed.clear()
        if timeout is None:
            await self._changed.wait()
            return
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            raise MoqtStalled(f"fetch {self.request_id}: nothing arrived for {timeout:.3g} s") from None

    async def wait_accepted(self, timeout: float | None = None) -> ev.FetchAccepted:
        """FETCH_OK; raises MoqtRequestError (refused), MoqtSessionClosed, MoqtStalled (after *timeout*)."""
        while self.accepted is None:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise MoqtUsageError("the fetch is closed")
            await self._wait(timeout)
        return self.accepted

    async def next_piece(self, timeout: float | None = -1.0) -> ev.ObjectReceived | None:
        """The next piece of an object (``ObjectReceived``), or None after the last one. *timeout*: the longest
        wait for the next piece (default: the fetch's ``stall_timeout``; None: no limit)."""
        limit = self.stall_timeout if timeout == -1.0 else timeout
        while True:
            if self._pieces:
                piece = self._pieces.popleft()
                n = len(piece.data)
                if n:
                    self.received += n
                    assert piece.stream_id is not None
                    self.conn._release(piece.stream_id, n)
                return piece
            if self._error is not None:
                raise self._error
            if self._ended or self._closed:
                return None
            await self._wait(limit)

    async def pieces(self) -> AsyncIterator[ev.ObjectReceived]:
        while (piece := await self.next_piece()) is not None:
            yield piece

    async def objects(self) -> AsyncIterator[MoqtObject]:
        """Complete objects, in the order they arrive."""
        parts: list[memoryview | bytes] = []
        while (piece := await self.next_piece()) is not None:
            if piece.data:
                parts.append(piece.data)
            if piece.complete:
                yield MoqtObject(piece.group, piece.object_id, piece.subgroup, piece.status, piece.extensions,
                                 piece.length, tuple(parts))
                parts = []

    def release(self, n: int) -> None:
        """Sink mode: the sink is done with *n* of the octets it held; credit them back to the peer."""
        n = min(n, self._sink_held)
        if n and self.stream_id is not None:
            self._sink_held -= n
            self.conn._release(self.stream_id, n)

    async def aclose(self) -> None:
        """Stop: an unfinished fetch is cancelled (FETCH_CANCEL / stream cancellation); unread octets are
        credited back."""
        if self._closed:
            return
        self.release(self._sink_held)
        self._closed = True
        conn = self.conn
        if not (self._ended or self._error is not None) and not conn.session.closed:
            with contextlib.suppress(MoqtUsageError):  # already over in the session
                conn.session.cancel_fetch(self.request_id)
            conn.flush()
        while self._pieces:
            piece = self._pieces.popleft()
            if piece.data and piece.stream_id is not None:
                conn._release(piece.stream_id, len(piece.data))
        conn._forget_fetch(self)
        self._wake()

    async def __aenter__(self) -> FetchStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class ServedFetch:
    """A fetch we serve, after FETCH_OK: write its objects with backpressure, then :meth:`finish`."""

    def __init__(self, conn: FetchHost, request_id: int, writer: FetchStreamWriter) -> None:
        self.conn = conn
        self.request_id = request_id
        self.writer = writer
        self.cancelled = False
        self._step = max(conn.send_buffer // 2, 16384)

    @property
    def stream_id(self) -> int:
        return self.writer.stream_id

    def _check(self) -> None:
        if self.conn.closed is not None:
            raise MoqtSessionClosed(self.conn.closed.error_code, self.conn.closed.reason)
        if self.cancelled or self.writer.stopped is not None or self.writer.closed:
            raise FetchCancelled(f"fetch {self.request_id} was cancelled by the peer")

    async def write_object(self, object_id: int, parts: Sequence[bytes | bytearray | memoryview], *,
                           group: int = 0) -> None:
        """One object whose payload is *parts* in order (views; nothing is joined here): the header, then the
        parts in slices of half the send buffer, each once QUIC has room for it."""
        views = [p if isinstance(p, memoryview) else memoryview(p) for p in parts]
        views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        self._check()
        self.writer.begin_object(group, object_id, sum(len(v) for v in views))
        step = self._step
        for view in views:
            for offset in range(0, len(view), step):
                await self.conn.transport.wait_writable(self.stream_id)
                self._check()
                self.writer.write(view[offset:offset + step])
                self.conn.flush()
        self.conn.flush()

    def begin_object(self, object_id: int, length: int, *, group: int = 0, subgroup: int | None = 0,
                     priority: int = 128, status: ObjectStatus = ObjectStatus.NORMAL,
                     extensions: KeyValuePairs = ()) -> None:
        """Announce an object of *length* payload octets whose payload follows with :meth:`write` (a relay that
        forwards each piece as it arrives)."""
        self._check()
        self.writer.begin_object(group, object_id, length, subgroup=subgroup, priority=priority, status=status,
                                 extensions=extensions)

    async def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Payload octets of the current object (a view is kept, not copied), in slices of half the send buffer,
        each once QUIC has room for it."""
        view = chunk if isinstance(chunk, memoryview) else memoryview(chunk)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        step = self._step
        for offset in range(0, len(view), step):
            await self.conn.transport.wait_writable(self.stream_id)
            self._check()
            self.writer.write(view[offset:offset + step] if len(view) > step else view)
        self.conn.flush()

    def send_ok(self, end_location: Location, *, end_of_track: bool = False) -> None:
        """The FETCH_OK deferred by ``accept_fetch(request_id, None)`` (objects may already be on their way)."""
        if self.conn.closed is not None:
            raise MoqtSessionClosed(self.conn.closed.error_code, self.conn.closed.reason)
        try:
            self.conn.session.send_fetch_ok(self.request_id, end_location, end_of_track=end_of_track)
        except MoqtUsageError as exc:
            raise FetchCancelled(str(exc)) from None
        self.conn.flush()

    def finish(self) -> None:
        self._check()
        self.writer.finish()
        self.conn._forget_served(self)
        self.conn.flush()

    def reset(self, error_code: int = StreamResetCode.INTERNAL_ERROR) -> None:
        if not self.writer.closed:
            self.writer.reset(error_code)
        self.conn._forget_served(self)
        self.conn.flush()

    def _on_cancel(self) -> None:
        self.cancelled = True
        if not self.writer.closed:
            self.writer.reset(StreamResetCode.CANCELLED)


__all__ = ["FetchSink", "FetchStream", "MoqtObject", "ServedFetch"]
