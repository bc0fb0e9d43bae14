"""Writing HTTP/3 DATA frames without the copies of ``H3Connection.send_data``.

aioquic's ``send_data`` builds each frame by copying the payload twice (into a Buffer, then out of it) before
QUIC copies it a third time into the stream's send buffer. Here the frame header and the payload go to QUIC as
two writes, so the payload is copied once. The frame that ends the stream still goes through ``send_data`` so
that aioquic's HTTP/3 state sees the end of the stream.
"""

from __future__ import annotations

from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from aioquic._buffer
from aioquic.h3.connection import FrameType, H3Connection


def data_frame_header(length: int) -> bytes:
    buf = Buffer(capacity=16)
    buf.push_uint_var(FrameType.DATA)
    buf.push_uint_var(length)
    return buf.data


def send_data(h3: H3Connection, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
    if end_stream or not data:
        h3.send_data(stream_id, bytes(data), end_stream)
        return
    quic = h3._quic
    quic.send_stream_data(stream_id, data_frame_header(len(data)))
    quic.send_stream_data(stream_id, data)  # type: ignore[arg-type]  # aioquic appends any buffer
