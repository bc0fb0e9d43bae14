"""Bodies delivered without a copy: the ``BufferSink`` shape (``asyncio.BufferedProtocol``'s ``get_buffer`` /
``buffer_updated``) shared by the server's ``kvsp.receive_into`` (:mod:`http3.asgi_bridge`), the lean HTTP/1.1
client's ``receive_into`` (:mod:`http3.h1_client`) and what they deliver into (:class:`kvsp_quic.container.
ContainerDecoder`, a holder's upload)."""

from __future__ import annotations

from typing import Any, Protocol


class BufferSink(Protocol):
    """Where a body goes without a copy: ``get_buffer(sizehint)`` says where the next octets go,
    ``buffer_updated(n)`` that *n* landed there; an exception from either refuses the body."""

    def get_buffer(self, sizehint: int) -> memoryview: ...

    def buffer_updated(self, nbytes: int) -> Any: ...


def copy_into(sink: BufferSink, data: bytes | bytearray | memoryview) -> int:
    """Deliver *data* to *sink* (one copy) for a transport that cannot read into it; returns its length. A sink
    that takes no octet is a ValueError."""
    src = memoryview(data)
    n = len(src)
    while len(src):
        room = sink.get_buffer(len(src))
        take = min(len(room), len(src))
        if not take:
            raise ValueError("the body sink took no octets")
        room[:take] = src[:take]
        src = src[take:]
        sink.buffer_updated(take)
    return n
