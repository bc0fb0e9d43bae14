"""Pre-touched replica buffers for the in-process host tier (:class:`~kvsp_quic.storage.tiers.HostTier`).

Receiving a block into a fresh ``bytearray`` pays the first touch of memory the process has not used yet (on the
reference VM ~11-13 ms per 16 MiB, against ~1.3 ms to fill a buffer touched before; docs/performance.md, "Block
data path"). A :class:`BufferPool` keeps the buffers of blocks the host tier gave up (evicted, demoted, dropped)
and hands them to the next upload of the same size. No zero fill is needed: an upload writes every octet of its
buffer (the decoder completes only when every data octet arrived, and the header is written over the rest).

A buffer is reused only once nothing else can see it. A GET serves views of the stored buffer
(``kvsp_quic.container.cut``), and a response may still hold them, queued in a transport, when the block leaves the
tier. Every live view of a ``bytearray`` -- a ``memoryview`` and any slice of one, a NumPy array, a ctypes array --
is an *export* of it, and CPython refuses to resize a ``bytearray`` that has exports (``BufferError``). So
:func:`exported` asks with a one-octet resize that changes nothing (``pop`` of the last octet, which never
reallocates, and ``append`` of it back): O(1), no copy. A given-back buffer waits in its size's free list, and
:meth:`BufferPool.take` hands out the oldest one that is no longer exported.

Only :class:`PoolBuffer` s (the buffers this pool allocated) come back: a caller's own ``bytearray`` that it
may still read is never recycled. The pool is bounded by the tier's room: when a buffer comes back, the pool keeps
at most the tier's free octets (capacity minus what it holds), and an allocation trims the pool to what the new
buffer leaves of that room, oldest buffers of other sizes first. So the tier's blocks plus its pooled buffers stay
within its capacity (in-flight uploads apart, which hold their buffers as they would without a pool).
"""

from __future__ import annotations

from collections import deque


class PoolBuffer(bytearray):
    """A replica buffer allocated by a :class:`BufferPool`: the only kind it takes back."""

    __slots__ = ()


def exported(buf: bytearray) -> bool:
    """Whether a view of *buf* is alive (a ``memoryview`` or any other buffer export), without copying it."""
    if not buf:
        return False
    try:
        last = buf.pop()  # shrinking by one octet never reallocates (CPython's PyByteArray_Resize)
    except BufferError:
        return True
    buf.append(last)  # back into the octet it freed: no reallocation either
    return False


class BufferPool:
    """Free lists of :class:`PoolBuffer` s keyed by size; see the module docstring."""

    def __init__(self) -> None:
        self._free: dict[int, deque[PoolBuffer]] = {}  # size -> buffers, oldest first (some may still be exported)
        self.octets = 0  # octets of the buffers held
        self.reused = 0  # buffers handed out again
        self.allocated = 0  # buffers allocated (a miss)
        self.released = 0  # buffers let go (no room, or clear())

    def __len__(self) -> int:
        return sum(len(q) for q in self._free.values())

    def take(self, size: int, room: int) -> PoolBuffer:
        """A buffer of exactly *size* octets (contents unspecified), reused when one is free, else new. *room* is
        the tier's free octets now: a new buffer first trims the pool to ``room - size``."""
        queue = self._free.get(size)
        if queue:
            for i, buf in enumerate(queue):  # oldest first: the likeliest to have no views left
                if not exported(buf):
                    del queue[i]
                    self._forget(size, queue)
                    self.reused += 1
                    return buf
        self._trim(room - size, keep=size)
        self.allocated += 1
        return PoolBuffer(size)

    def give(self, buf: bytearray, room: int) -> bool:
        """Take back *buf*, the buffer of a block the tier no longer holds; *room* is the tier's free octets now
        (the block's included). Returns whether the pool keeps it (only :class:`PoolBuffer` s, within *room*)."""
        if not isinstance(buf, PoolBuffer) or not buf:
            return False
        size = len(buf)
        if size > room:
            self.released += 1
            return False
        self._trim(room - size, keep=size)
        self._free.setdefault(size, deque()).append(buf)
        self.octets += size
        return True

    def clear(self) -> None:
        """Let every buffer go (their memory returns to the allocator once their last views are gone)."""
        self.released += len(self)
        self._free.clear()
        self.octets = 0

    def _forget(self, size: int, queue: deque[PoolBuffer]) -> None:
        self.octets -= size
        if not queue:
            del self._free[size]

    def _trim(self, limit: int, keep: int) -> None:
        """Let the oldest buffers go until the pool holds at most *limit* octets, buffers of size *keep* last."""
        for size in sorted(self._free, key=lambda s: s == keep):
            queue = self._free[size]
            while queue and self.octets > limit:
                queue.popleft()
                self.released += 1
                self.octets -= size
            if not queue:
                del self._free[size]
            if self.octets <= limit:
                return
