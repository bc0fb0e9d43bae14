"""Publisher-side writers of one data stream: objects in order, each announced with its total length and then its
payload in as many chunks as the application likes (views of its buffers; nothing is copied here).

A writer only emits transport actions through its session; it is obtained from ``accept_fetch`` or
``open_subgroup`` and is done after ``finish()`` (FIN) or ``reset()``.
"""

from __future__ import annotations

from typing import Protocol

from moqt.data import FetchObjectEncoder, SubgroupObjectEncoder
from moqt.errors import MoqtUsageError, StreamResetCode
from moqt.types import KeyValuePairs, Location, ObjectStatus


class _Sink(Protocol):
    def _send(self, stream_id: int, data: bytes | memoryview, fin: bool = False) -> None: ...

    def _reset_stream(self, stream_id: int, error_code: int) -> None: ...

    def _data_stream_closed(self, writer: StreamWriter) -> None: ...


class StreamWriter:
    """The common part: payload accounting, FIN and reset."""

    def __init__(self, sink: _Sink, request_id: int, stream_id: int) -> None:
        self._sink = sink
        self.request_id = request_id
        self.stream_id = stream_id
        self.remaining = 0  # payload octets the current object still needs
        self.objects = 0  # objects begun
        self.closed = False
        self.stopped: int | None = None  # the peer's STOP_SENDING code, if it sent one

    def _check_open(self) -> None:
        if self.stopped is not None:
            raise MoqtUsageError(f"the peer stopped stream {self.stream_id} (code {self.stopped}); reset it")
        if self.closed:
            raise MoqtUsageError(f"stream {self.stream_id} is closed")

    def _begin(self, header: bytes, length: int) -> None:
        self._check_open()
        if self.remaining:
            raise MoqtUsageError(f"the previous object still needs {self.remaining} payload octets")
        self._sink._send(self.stream_id, header)
        self.remaining = length
        self.objects += 1

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Payload octets of the current object (sent as given: keep *chunk* unchanged until sent)."""
        self._check_open()
        n = len(chunk) if not isinstance(chunk, memoryview) else chunk.nbytes
        if n > self.remaining:
            raise MoqtUsageError(f"{n} payload octets, but the object needs only {self.remaining} more")
        if n:
            self.remaining -= n
            self._sink._send(self.stream_id, chunk if not isinstance(chunk, bytearray) else memoryview(chunk))

    def finish(self) -> None:
        """FIN: every object is complete."""
        self._check_open()
        if self.remaining:
            raise MoqtUsageError(f"the last object still needs {self.remaining} payload octets")
        self._sink._send(self.stream_id, b"", True)
        self.closed = True
        self._sink._data_stream_closed(self)

    def reset(self, error_code: int = StreamResetCode.CANCELLED) -> None:
        if self.closed:
            return
        self.closed = True
        self._sink._reset_stream(self.stream_id, error_code)
        self._sink._data_stream_closed(self)


class FetchStreamWriter(StreamWriter):
    """Objects of a fetch response, in the fetch's order (group by group, object ids ascending in a group)."""

    def __init__(self, sink: _Sink, request_id: int, stream_id: int, encoder: FetchObjectEncoder) -> None:
        super().__init__(sink, request_id, stream_id)
        self._encoder = encoder

    def begin_object(self, group: int, object_id: int, length: int, *, subgroup: int | None = 0,
                     priority: int = 128, status: ObjectStatus = ObjectStatus.NORMAL,
                     extensions: KeyValuePairs = ()) -> None:
        """Announce an object of *length* payload octets; send them with ``write``. ``subgroup`` None: an object
        whose forwarding preference is Datagram."""
        self._check_open()
        if self.remaining:
            raise MoqtUsageError(f"the previous object still needs {self.remaining} payload octets")
        try:
            header = self._encoder.encode(group, object_id, length, subgroup=subgroup, priority=priority,
                                          status=status, extensions=extensions)
        except ValueError as exc:
            raise MoqtUsageError(str(exc)) from None
        self._begin(header, length)

    def write_object(self, group: int, object_id: int, payload: bytes | bytearray | memoryview, *,
                     subgroup: int | None = 0, priority: int = 128, extensions: KeyValuePairs = ()) -> None:
        n = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        self.begin_object(group, object_id, n, subgroup=subgroup, priority=priority, extensions=extensions)
        self.write(payload)

    def end_of_range(self, location: Location, *, unknown: bool = False) -> None:
        """Draft 18: objects after the previous one up to *location* do not exist (or have an unknown status)."""
        self._check_open()
        if self.remaining:
            raise MoqtUsageError(f"the previous object still needs {self.remaining} payload octets")
        try:
            marker = self._encoder.end_of_range(location, unknown=unknown)
        except ValueError as exc:
            raise MoqtUsageError(str(exc)) from None
        self._sink._send(self.stream_id, marker)


class SubgroupWriter(StreamWriter):
    """Objects of one subgroup of a subscription we serve, object ids ascending."""

    def __init__(self, sink: _Sink, request_id: int, stream_id: int, encoder: SubgroupObjectEncoder) -> None:
        super().__init__(sink, request_id, stream_id)
        self._encoder = encoder

    def begin_object(self, object_id: int, length: int, *, status: ObjectStatus = ObjectStatus.NORMAL,
                     extensions: KeyValuePairs = ()) -> None:
        self._check_open()
        if self.remaining:
            raise MoqtUsageError(f"the previous object still needs {self.remaining} payload octets")
        try:
            header = self._encoder.encode(object_id, length, status=status, extensions=extensions)
        except ValueError as exc:
            raise MoqtUsageError(str(exc)) from None
        self._begin(header, length)

    def write_object(self, object_id: int, payload: bytes | bytearray | memoryview, *,
                     extensions: KeyValuePairs = ()) -> None:
        n = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        self.begin_object(object_id, n, extensions=extensions)
        self.write(payload)
