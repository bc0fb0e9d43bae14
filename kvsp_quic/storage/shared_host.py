"""The ``host`` tier shared by a holder's worker processes: one file per block in a memory-backed directory.

With ``kvsp-quic holder --workers N`` (N > 1) every worker serves every block (issue 16, "every core"). The
block octets live in files in a tmpfs directory (``/dev/shm`` by default), in the local-storage file format
(``kvsp_quic.storage.tiers``: a header naming the block and its layer digests, then the container), mapped into
each process that serves them: nothing is copied between processes, and a worker reads exactly the octets the
primary's bookkeeping holds.

* :class:`SharedHostTier` is the primary's tier (bookkeeping, capacity and eviction as for
  :class:`~kvsp_quic.storage.tiers.HostTier`). Uploads are received into :class:`Allocation` s: an unnamed file
  (``O_TMPFILE``) in the directory, mapped, so the incremental decoder writes each octet once, into the octets
  that will be served; storing the block gives the file its name (``link``: never replacing a file). A worker
  *stages* its upload under a temporary name (:meth:`Allocation.stage`) and the primary adopts it
  (:meth:`SharedHostTier.adopt`).
* :class:`SharedHostReader` is a worker's view: a block's file opened and mapped on first use, kept while its
  file still has a name (an evicted or demoted block's file is unlinked by the primary; the reader notices
  with one ``fstat`` per read and looks again).

Files are created 0600 in a 0700 directory the primary creates fresh at start and removes at exit.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvsp_quic.container import ContainerError, parse_header
from kvsp_quic.storage.tiers import (
    HOST,
    BlockId,
    BlockMeta,
    EvictionPolicy,
    LruPolicy,
    Tier,
    TierFault,
    block_file_name,
    file_header_size,
    pack_file_header,
    unpack_file_header,
)

STAGED_PREFIX = ".staged-"


def default_directory(name: str) -> Path:
    """Where a holder's shared host tier lives: ``/dev/shm/NAME`` (memory), else the temporary directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / name


class Allocation:
    """A block being received: an unnamed file of (file header + container) octets in the tier directory, mapped.

    :attr:`container` is the writable view the container goes into. The file gets a name only when the block is
    stored (:meth:`link`) or staged for the primary (:meth:`stage`); an abandoned allocation leaves nothing (its
    descriptor is closed when it is garbage)."""

    def __init__(self, directory: Path, layers: int, container_size: int) -> None:
        self.directory = directory
        self.head_size = file_header_size(layers)
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.head_size + container_size)
            self.map = mmap.mmap(fd, self.head_size + container_size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._closer = weakref.finalize(self, _close_quietly, fd)
        self.container = memoryview(self.map)[self.head_size:]
        self.staged: Path | None = None

    def _write_head(self, meta: BlockMeta) -> None:
        head = pack_file_header(meta)
        if len(head) != self.head_size or meta.size != len(self.container):
            raise ValueError(f"block {meta.id}: the allocation does not fit its header")
        self.map[:self.head_size] = head

    def link(self, meta: BlockMeta, final: Path) -> None:
        """Name the file *final* (FileExistsError if that exists: blocks are never replaced)."""
        self._write_head(meta)
        if self.staged is not None:
            os.link(self.staged, final)
            os.unlink(self.staged)
            self.staged = None
        else:
            _link_unnamed(self.fd, final)

    def stage(self, meta: BlockMeta) -> str:
        """Give the complete upload a temporary name for the primary to adopt; returns that name."""
        self._write_head(meta)
        name = f"{STAGED_PREFIX}{secrets.token_hex(8)}"
        _link_unnamed(self.fd, self.directory / name)
        self.staged = self.directory / name
        return name

    def discard(self) -> None:
        """Give the allocation up: a staged name is removed, the descriptor closed (views stay valid)."""
        if self.staged is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.staged)
            self.staged = None
        self._closer()


def _link_unnamed(fd: int, path: Path) -> None:
    """Give the O_TMPFILE file *fd* the name *path*: linkat("/proc/self/fd/N", AT_SYMLINK_FOLLOW) (os.link uses
    linkat, and honours follow_symlinks, only when given a directory descriptor)."""
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class _Staged(Allocation):
    """A worker's staged upload of *block*, opened by the primary to adopt it."""

    def __init__(self, directory: Path, name: str, block: BlockId) -> None:
        if not name.startswith(STAGED_PREFIX) or "/" in name:
            raise ValueError(f"{name!r} is not a staged upload")
        self.directory = directory
        fd = os.open(directory / name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self.map = mmap.mmap(fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._closer = weakref.finalize(self, _close_quietly, fd)
        self.staged = directory / name
        view = memoryview(self.map)
        head = unpack_file_header(view, block)
        self.head_size = head.size
        self.layer_digests = head.layer_digests
        self.container = view[self.head_size:]

    def _write_head(self, meta: BlockMeta) -> None:
        if bytes(self.map[:self.head_size]) != pack_file_header(meta):
            raise ValueError(f"block {meta.id}: the staged file's header does not match the block")


class SharedHostTier(Tier):
    """Host memory as files in *directory* (tmpfs), shared with the holder's workers; reads are views of maps."""

    def __init__(self, directory: Path, capacity: int, policy: EvictionPolicy | None = None) -> None:
        super().__init__(HOST, capacity, policy or LruPolicy())
        self.directory = Path(directory)
        self._views: dict[BlockId, memoryview] = {}
        # id(map) -> its allocation, while someone holds it (an upload in progress, a staged file being adopted)
        self._pending: weakref.WeakValueDictionary[int, Allocation] = weakref.WeakValueDictionary()

    def path_of(self, block: BlockId) -> Path:
        return self.directory / block_file_name(block)

    def allocate(self, layers: int, container_size: int) -> Allocation:
        """A mapped buffer for an upload of a block with *layers* layers (see :class:`Allocation`): the file header
        lists that many layer digests, the container may hold all of them or a layer range (issue 13)."""
        alloc = Allocation(self.directory, layers, container_size)
        self._pending[id(alloc.map)] = alloc
        return alloc

    def adopt(self, staged_name: str, block: BlockId) -> Allocation:
        """A worker's staged upload of *block*: store its :attr:`~Allocation.container` through the holder's
        placement, then :meth:`Allocation.discard` it (a no-op once stored here)."""
        alloc = _Staged(self.directory, staged_name, block)
        self._pending[id(alloc.map)] = alloc
        return alloc

    def _keep(self, meta: BlockMeta, data: memoryview) -> None:
        if len(data) != meta.size:
            raise ValueError(f"block {meta.id}: {len(data)} octets, its header says {meta.size}")
        alloc = self._pending.get(id(data.obj))
        if alloc is None or data.obj is not alloc.map:  # octets from elsewhere: a file of their own
            alloc = Allocation(self.directory, len(meta.layer_digests), meta.size)
            alloc.container[:] = data
        alloc.link(meta, self.path_of(meta.id))
        self._pending.pop(id(alloc.map), None)
        alloc.discard()
        self._views[meta.id] = alloc.container.toreadonly()

    def _read(self, meta: BlockMeta) -> memoryview:
        return self._views[meta.id]

    def _forget(self, meta: BlockMeta) -> None:
        del self._views[meta.id]  # views in use keep the map alive until they are done
        with contextlib.suppress(FileNotFoundError):
            self.path_of(meta.id).unlink()


@dataclass
class _Mapped:
    meta: BlockMeta
    container: memoryview
    fd: int
    repr_digest: bytes | None = None  # SHA-256 of the container, once a GET needed it
    stored_at: float = 0.0  # wall clock (the file's modification time)


class SharedHostReader:
    """A worker's view of the shared host tier: blocks by name, mapped on first use (at most *max_open* kept)."""

    def __init__(self, directory: Path, max_open: int = 4096) -> None:
        self.directory = Path(directory)
        self.max_open = max_open
        self._open: OrderedDict[BlockId, _Mapped] = OrderedDict()

    def exists(self, block: BlockId) -> bool:
        return os.path.exists(self.directory / block_file_name(block))

    def get(self, block: BlockId) -> _Mapped | None:
        """The mapped block, or None when the tier does not hold it (never stored, evicted or demoted)."""
        entry = self._open.get(block)
        if entry is not None:
            if os.fstat(entry.fd).st_nlink > 0:
                self._open.move_to_end(block)
                return entry
            self._drop(block)
        try:
            fd = os.open(self.directory / block_file_name(block), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            data = memoryview(mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ))
            head = unpack_file_header(data, block)
            if head.flags:
                raise TierFault(block, f"unexpected flags 0x{head.flags:02x} in the shared host tier")
            container = data[head.size:]
            header = parse_header(container)
        except (TierFault, ContainerError, ValueError, OSError):
            os.close(fd)
            raise
        entry = _Mapped(BlockMeta(block, header, head.layer_digests, len(container)), container, fd,
                        stored_at=st.st_mtime)
        self._open[block] = entry
        while len(self._open) > self.max_open:
            self._drop(next(iter(self._open)))
        return entry

    def _drop(self, block: BlockId) -> None:
        entry = self._open.pop(block)
        with contextlib.suppress(OSError):
            os.close(entry.fd)

    def close(self) -> None:
        for block in list(self._open):
            self._drop(block)
