"""The sink of a block body that its transport delivers into (issue 16): the lean HTTP/1.1 path's TLS decrypts
straight into the attempt's :class:`~kvsp_quic.container.ContainerDecoder` buffers through :class:`LayerSink`,
which feeds Repr-Digest's SHA-256 from the same views and hands completed layers to the attempt as they complete
(kvsp_client/retrieval.py, ``LayerStream``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from http3.body_sink import BufferSink
from http3.client import RequestTimeout
from kvsp_quic.container import ContainerDecoder, ContainerHeader, DecodedLayer


class LayerSink:
    """The :class:`~http3.body_sink.BufferSink` an attempt gives a transport that delivers into one (the lean
    HTTP/1.1 path): TLS decrypts the body straight into *decoder*'s buffers (its assembly buffer, or fresh chunk
    buffers in the zero-copy mode, whose views the layers keep), and from the same views this sink feeds *whole*
    (SHA-256 of the body, for Repr-Digest), counts the octets (*count*) and sorts the layers each delivery
    completes exactly as the chunk path does: onto ``ready`` (handed over at once, waking the attempt) while
    *streaming* and the container has not ended, else onto *held* (they wait for the end of the body and
    Repr-Digest). *check_header* sees the header once it is parsed. An exception raised here ends the exchange
    and comes out of the transport's ``receive_into``."""

    __slots__ = ("_check_header", "_count", "_decoder", "_loop", "_streaming", "_view", "_waiter", "_whole", "held",
                 "last", "ready")

    def __init__(self, decoder: ContainerDecoder, whole: Any, streaming: bool, held: list[DecodedLayer],
                 check_header: Callable[[ContainerHeader], None], count: Callable[[int], None]) -> None:
        self._decoder = decoder
        self._whole = whole
        self._streaming = streaming
        self.held = held
        self.ready: list[DecodedLayer] = []
        self._check_header: Callable[[ContainerHeader], None] | None = check_header
        self._count = count
        self._view = memoryview(b"")
        self._loop = asyncio.get_running_loop()
        self.last = self._loop.time()  # when octets last arrived (the stall timeout runs from here)
        self._waiter: asyncio.Future[None] | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        self._view = view = self._decoder.get_buffer(sizehint)
        return view

    def buffer_updated(self, nbytes: int) -> None:
        self.last = self._loop.time()
        self._count(nbytes)
        if self._whole is not None:
            self._whole.update(self._view[:nbytes])
        decoder = self._decoder
        layers = decoder.buffer_updated(nbytes)
        if self._check_header is not None and decoder.header is not None:
            check, self._check_header = self._check_header, None
            check(decoder.header)
        if layers:
            if self._streaming and not decoder.done:
                self.ready += layers
                self.wake()
            else:
                self.held += layers

    async def receive(self, receive_into: Callable[[BufferSink], Coroutine[Any, Any, int]]) -> int:
        """The delivery, as the attempt's task: the attempt is woken as it ends (in the same loop iteration, not
        one later as a done callback would)."""
        try:
            return await receive_into(self)
        finally:
            self.wake()

    def wake(self, _: object = None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, stall: float | None) -> None:
        """Until a layer is ready or the delivery ended -- or a while has passed (the caller looks again); raises
        :class:`~http3.client.RequestTimeout` once no octets came for *stall* seconds."""
        waiter = self._waiter = self._loop.create_future()
        timer = None
        if stall is not None:
            left = self.last + stall - self._loop.time()
            if left <= 0:
                raise RequestTimeout(f"no response data for {stall} s")
            timer = self._loop.call_later(left, self.wake)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


async def receive_inline(receive_into: Callable[[BufferSink], Coroutine[Any, Any, int]], sink: LayerSink,
                          stall: float | None) -> int:
    """The delivery in the attempt's own task, where no layer could be handed over before its end (a part of one
    layer, or nothing to check a layer against): no task to start and wake (~0.1-0.2 ms per block here). Fails
    with :class:`~http3.client.RequestTimeout` once no octets came for *stall* seconds."""
    if stall is None:
        return await receive_into(sink)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    stalled = False
    timer: asyncio.TimerHandle | None = None

    def check() -> None:
        nonlocal timer, stalled
        due = sink.last + stall
        if loop.time() < due:
            timer = loop.call_at(due, check)
        else:
            stalled = True
            task.cancel()

    timer = loop.call_at(sink.last + stall, check)
    try:
        return await receive_into(sink)
    except asyncio.CancelledError:
        if stalled and task.uncancel() == 0:  # our cancellation, and nobody else's
            raise RequestTimeout(f"no response data for {stall} s") from None
        raise
    finally:
        if timer is not None:
            timer.cancel()


async def stop_delivery(task: asyncio.Task[int]) -> None:
    """Cancel a delivery that is still under way (the transport closes its connection) and wait for it."""
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))
    if not task.cancelled():
        task.exception()  # retrieved (raised by the caller already, or moot after an earlier failure)


__all__ = ["LayerSink", "receive_inline", "stop_delivery"]
