"""A PUT body on its way into a holder (spec, "Block Retrieval and Storage": storing a block or a layer range of it):
:class:`BlockUpload` feeds the octets into the incremental decoder, which checks them against the Compatibility
Descriptor and copies each octet once, into the buffer the replica will be served from, then hands the container to
its holder's commit. Used by :class:`kvsp_quic.roles.holder.Holder` and by a worker process's
:class:`kvsp_quic.roles.holder_worker.HolderWorker` (the same ``_allocate_upload`` and ``_commit``:
:class:`UploadHost`). Moved out of ``holder.py`` unchanged (issue 13, module size).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol, cast

from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import ENTRY, FIXED_HEADER, ContainerDecoder
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.roles.holder_requests import check_stored_range
from kvsp_quic.storage.tiers import BlockId, ChainPosition, block_layer_digests


class _Limits(Protocol):
    @property
    def max_block_bytes(self) -> int: ...


class UploadHost(Protocol):
    """What an upload needs of its holder: the size limit, a buffer for the container, the commit."""

    @property
    def settings(self) -> _Limits: ...

    def _allocate_upload(self, layers: int, size: int) -> tuple[memoryview, Any]: ...

    def _commit(self, *args: Any, **kwargs: Any) -> ReplicaRecord: ...


class BlockUpload:
    """One PUT body on its way in: fed chunk by chunk into the incremental decoder, which copies each octet
    once, into the buffer the replica will be served from (the container header is written in front of it)."""

    def __init__(self, holder: UploadHost | Any, block: BlockId, descriptor: CompatDescriptor, *,
                 owner: str | None = None, position: ChainPosition | None = None) -> None:
        self._holder = holder  # a Holder, or a worker's HolderWorker (the same _allocate_upload and _commit)
        self.block = block
        self.position = position  # where the block sits in its chain, as the client declared it
        self.owner = owner  # the principal whose storage quota the upload counts against (None: none)
        self.layers: tuple[int, int] | None = None  # the layer range the PUT named (``?layers=a-b``), if it did
        self._release: Callable[[], Any] | None = None  # returns the quota reserved for the upload
        self._descriptor = descriptor
        self._prefix = bytearray()  # the container's fixed header as it arrives: its Layer Count sizes the header
        self._head_size = 0  # the container header's octets, once known
        self._buffer: memoryview | None = None
        self._allocation: Any = None  # a shared host tier's Allocation, when the octets go there
        me = weakref.ref(self)  # not self._allocate: a cycle would keep the buffer exported until a full collection
        self._decoder = ContainerDecoder(descriptor, allocate=lambda size: cast(BlockUpload, me())._allocate(size),
                                         max_data=holder.settings.max_block_bytes - FIXED_HEADER.size
                                         - ENTRY.size * descriptor.layers)
        self.received = 0
        self._view = memoryview(b"")  # the view get_buffer() handed out last

    def _allocate(self, size: int) -> memoryview:
        # the decoder has the whole header (checked against the descriptor: the layers are within its layers and
        # the sections of its geometry); the layer range stored is any inclusive range of the block (issue 13)
        first, count = FIXED_HEADER.unpack(self._prefix)[4:6]
        check_stored_range((first, first + count - 1), self.layers)
        self._head_size = FIXED_HEADER.size + ENTRY.size * count
        reserve = getattr(self._holder, "reserve_upload", None)
        if reserve is not None and self.owner is not None:  # before a single octet is allocated (507 if over)
            self._release = reserve(self, self.owner, self._head_size + size)
        self._buffer, self._allocation = self._holder._allocate_upload(self._descriptor.layers,
                                                                       self._head_size + size)
        return self._buffer[self._head_size:]

    def feed(self, data: Any) -> None:
        """More body octets; raises ContainerError (400) as soon as they cannot be a valid block."""
        self.received += len(data)
        try:
            if len(self._prefix) < FIXED_HEADER.size:
                self._prefix += memoryview(data).cast("B")[:FIXED_HEADER.size - len(self._prefix)]
            self._decoder.feed(data)
        except BaseException:
            self.abort()
            raise

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the next body octets go (the ``BufferSink`` shape): the container header's room while it is
        read, then the replica's own buffer -- a transport that reads into it copies nothing."""
        try:
            self._view = self._decoder.get_buffer(sizehint)
        except BaseException:
            self.abort()
            raise
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        """*nbytes* octets landed in the view :meth:`get_buffer` returned; raises as :meth:`feed` does."""
        self.received += nbytes
        try:
            if len(self._prefix) < FIXED_HEADER.size:
                self._prefix += self._view[:min(nbytes, FIXED_HEADER.size - len(self._prefix))]
            self._decoder.buffer_updated(nbytes)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """The upload will not complete: give back the quota it reserved now (otherwise, when it is collected)."""
        if self._release is not None:
            self._release()

    def finish(self) -> ReplicaRecord:
        """The body is complete: store the block and return its Replica Record (as published)."""
        try:
            header = self._decoder.finish()
        except BaseException:
            self.abort()
            raise
        assert self._buffer is not None and header.size == self._head_size
        self._buffer[:self._head_size] = header.pack()
        digests = block_layer_digests(self._descriptor.layers, header.first_layer, self._decoder.layer_digests)
        try:
            if self._release is not None:
                self._release()  # the replica itself counts from now on
            extra: dict[str, Any] = {"owner": self.owner} if self.owner is not None else {}
            if self.position is not None:
                extra["position"] = self.position
            return self._holder._commit(self.block, header, digests, self._buffer, self._allocation, **extra)
        finally:
            if self._allocation is not None:
                self._allocation.discard()


__all__ = ["BlockUpload", "UploadHost"]
