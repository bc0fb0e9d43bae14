"""The ASGI callable types, in one place for every module of the HTTP edge."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BufferSink(Protocol):
    """Where a body goes without a copy (``asyncio.BufferedProtocol``'s shape): ``get_buffer(sizehint)`` says
    where the next octets go, ``buffer_updated(n)`` that *n* landed there. :class:`kvsp_quic.container.
    ContainerDecoder` has this shape; an exception from either refuses the body."""

    def get_buffer(self, sizehint: int) -> memoryview: ...

    def buffer_updated(self, nbytes: int) -> Any: ...


def copy_into(sink: BufferSink, data: bytes | bytearray | memoryview) -> int:
    """Deliver *data* to *sink* (one copy); returns its length. A sink that takes no octet is a ValueError."""
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
