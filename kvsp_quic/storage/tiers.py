"""A holder's storage tiers: ``host`` (memory) and ``local-storage`` (a directory), with pluggable eviction.

Mechanism apart from policy (DESIGN.md section 2.6): a :class:`Tier` does bookkeeping (what it holds, how many
octets, where the octets are); an :class:`EvictionPolicy`, chosen by name from :data:`EVICTION_POLICIES`, only
orders a tier's blocks as eviction candidates; :class:`TieredStore` plans and carries out placements: a block
goes to the fastest tier with room, victims of a full tier are demoted to the next tier (host -> local-storage)
instead of dropped, and only the last tier drops. Protected blocks (leased, see ``roles/leases.py``) are never
dropped; they may be demoted, since a demoted block is still held.

Eviction is prefix-aware by default (``kvsp_quic.storage.eviction``, :class:`PrefixPolicy`): the deepest blocks of
the coldest chains go first, so what remains of a chain is always a leading run.

With *write-through* (:meth:`TieredStore.enable_write_through`), every block a faster tier holds also has its file
in the local-storage directory (a *shadow*, not counted against that tier's capacity), so a restart loses nothing
that was acknowledged; demoting such a block writes nothing.

Data path: a block is one KV Block Container stored once -- in memory as the buffer it was received into, on
disk as one file -- and served as views of it (``kvsp_quic.container.cut``). Its layer digests, replica digest
and header are kept alongside (:class:`BlockMeta`).

Local storage writes each block atomically (a temporary file in the same directory, flushed and fsync'd, then
renamed over the final name) and checks every read: the file's header must name the block, the container must
parse to the recorded header and every layer must match its recorded digest; anything else is a
:class:`TierFault` (the caller drops the block). With an AES-256-GCM key the container is encrypted at rest
with a random 96-bit nonce per file and the file header (block identity and layer digests) as associated data;
without one, every file carries an HMAC-SHA-256 under the holder's MAC key (``kvsp_quic.storage.file_seal``), so
a file planted in the directory, or copied from another holder, is never adopted or served. On restart
:meth:`LocalStorageTier.scan` verifies every file and returns the blocks that can be served again.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvsp_quic.container import ContainerError, ContainerHeader, decode, replica_digest
from kvsp_quic.problems import DigestMismatch
from kvsp_quic.storage.buffer_pool import BufferPool
from kvsp_quic.storage.eviction import EVICTION_POLICIES as EVICTION_POLICIES
from kvsp_quic.storage.eviction import BlockId as BlockId
from kvsp_quic.storage.eviction import ChainPosition as ChainPosition
from kvsp_quic.storage.eviction import EvictionPolicy as EvictionPolicy
from kvsp_quic.storage.eviction import FifoPolicy as FifoPolicy
from kvsp_quic.storage.eviction import LfuPolicy as LfuPolicy
from kvsp_quic.storage.eviction import LruPolicy as LruPolicy
from kvsp_quic.storage.eviction import PrefixPolicy as PrefixPolicy
from kvsp_quic.storage.eviction import eviction_policy as eviction_policy
from kvsp_quic.storage.eviction import register_eviction_policy as register_eviction_policy
from kvsp_quic.storage.file_seal import _FILE_HEADER as _FILE_HEADER
from kvsp_quic.storage.file_seal import FLAG_ENCRYPTED as FLAG_ENCRYPTED
from kvsp_quic.storage.file_seal import FLAG_MAC as FLAG_MAC
from kvsp_quic.storage.file_seal import (
    FileFormatError,
    KeyFileError,
    default_key_file,
    load_or_create_key,
    pack_head,
    seal,
    seal_holds,
    unpack_head,
)
from kvsp_quic.storage.file_seal import FileHead as FileHead
from kvsp_quic.storage.file_seal import file_header_size as file_header_size
from kvsp_quic.storage.file_seal import key_id as key_id

log = logging.getLogger("kvsp.tiers")

HOST = "host"
LOCAL_STORAGE = "local-storage"


UNKNOWN_DIGEST = bytes(32)  # the layer digest of a layer a partial replica does not hold (issue 13)


def block_layer_digests(layers: int, first_layer: int, held: Sequence[bytes]) -> tuple[bytes, ...]:
    """The layer digests of a block of *layers* layers, by absolute layer, as a replica holding *held* (the digests
    of layers *first_layer*, *first_layer* + 1, ...) knows them: :data:`UNKNOWN_DIGEST` for every other layer."""
    if first_layer < 0 or first_layer + len(held) > layers:
        raise ValueError(f"layers {first_layer}-{first_layer + len(held) - 1} are not within 0-{layers - 1}")
    return (UNKNOWN_DIGEST,) * first_layer + tuple(held) + (UNKNOWN_DIGEST,) * (layers - first_layer - len(held))


def digests_fit(header: ContainerHeader, digests: Sequence[bytes]) -> bool:
    """Whether *digests* (by absolute layer) are those of a replica whose container has *header*: they reach its
    last layer, and every layer outside it is :data:`UNKNOWN_DIGEST`."""
    if header.last_layer >= len(digests):
        return False
    return all(d == UNKNOWN_DIGEST for i, d in enumerate(digests)
               if not header.first_layer <= i <= header.last_layer)


@dataclass(frozen=True)
class BlockMeta:
    """What a tier keeps beside a block's octets. A replica of a layer range (``header.first_layer`` /
    ``layer_count`` not the whole block) keeps the digests of the block's other layers as :data:`UNKNOWN_DIGEST`
    (:func:`block_layer_digests`), so that ``layer_digests`` is always indexed by absolute layer and lists every
    layer of the block, as a Replica Record's does."""

    id: BlockId
    header: ContainerHeader
    layer_digests: tuple[bytes, ...]  # raw 32-octet layer digests, by absolute layer, one per layer of the block
    size: int  # octets of the container

    @property
    def digest(self) -> bytes:
        """The replica digest: SHA-256 over the concatenated layer digests (for a layer range, with the unknown
        ones as 32 zero octets: the digest of the replica as stored, docs/wire.md "Holder")."""
        return replica_digest(self.layer_digests)

    @property
    def complete(self) -> bool:
        """Whether the container holds every layer of the block."""
        return self.header.first_layer == 0 and self.header.layer_count == len(self.layer_digests)


class TierFault(Exception):
    """A stored block cannot be read back intact (verification failed, file missing or unreadable).
    *integrity*: the octets were read and are not what was stored (False: they could not be read at all)."""

    def __init__(self, block: BlockId, reason: str, *, integrity: bool = True) -> None:
        super().__init__(f"block {block}: {reason}")
        self.block = block
        self.reason = reason
        self.integrity = integrity


class NoRoom(Exception):
    """No placement exists: every candidate victim is protected, or the block is larger than every tier.

    When raised part-way through a placement (an I/O error), *outcome* says what was already moved or dropped.
    """

    def __init__(self, message: str, outcome: PutOutcome | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome


# -- Tiers ----------------------------------------------------------------------------------------------------------


class Tier(abc.ABC):
    """Bookkeeping of one tier: the blocks it holds, their footprint against its capacity, its policy."""

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy) -> None:
        if capacity <= 0:
            raise ValueError(f"tier {name}: capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.used = 0
        self._metas: dict[BlockId, BlockMeta] = {}
        self._footprints: dict[BlockId, int] = {}

    def __contains__(self, block: object) -> bool:
        return block in self._metas

    def __len__(self) -> int:
        return len(self._metas)

    def meta(self, block: BlockId) -> BlockMeta:
        return self._metas[block]

    def blocks(self) -> list[BlockId]:
        return list(self._metas)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def footprint(self, meta: BlockMeta) -> int:
        """Octets *meta*'s block takes in this tier."""
        return meta.size

    def store(self, meta: BlockMeta, data: memoryview, position: ChainPosition | None = None) -> None:
        """Keep the container *data* (the caller made room). May raise OSError (nothing is then kept)."""
        if meta.id in self._metas:
            raise ValueError(f"tier {self.name} already holds {meta.id}")
        self._keep(meta, data)
        self._account(meta, self.footprint(meta), position)

    def _account(self, meta: BlockMeta, footprint: int, position: ChainPosition | None = None) -> None:
        self._metas[meta.id] = meta
        self._footprints[meta.id] = footprint
        self.used += footprint
        if position is None:
            self.policy.inserted(meta.id)
        else:
            self.policy.inserted(meta.id, position)

    def read(self, block: BlockId) -> memoryview:
        """The block's container octets; counts as an access. Raises KeyError or :class:`TierFault`."""
        meta = self._metas[block]
        data = self._read(meta)
        self.policy.accessed(block)
        return data

    def discard(self, block: BlockId) -> BlockMeta | None:
        meta = self._unaccount(block)
        if meta is not None:
            self._forget(meta)
        return meta

    def _unaccount(self, block: BlockId) -> BlockMeta | None:
        meta = self._metas.pop(block, None)
        if meta is None:
            return None
        self.used -= self._footprints.pop(block)
        self.policy.removed(block)
        return meta

    @abc.abstractmethod
    def _keep(self, meta: BlockMeta, data: memoryview) -> None: ...

    @abc.abstractmethod
    def _read(self, meta: BlockMeta) -> memoryview: ...

    @abc.abstractmethod
    def _forget(self, meta: BlockMeta) -> None: ...


class HostTier(Tier):
    """Host memory: the container buffer itself, never copied (reads are views of it).

    Uploads take their buffers from :meth:`take_buffer`: the buffers of blocks this tier gave up, once no view of
    them is left, are handed out again (pre-touched memory, ``kvsp_quic.storage.buffer_pool``)."""

    def __init__(self, capacity: int, policy: EvictionPolicy | None = None) -> None:
        super().__init__(HOST, capacity, policy or LruPolicy())
        self._data: dict[BlockId, memoryview] = {}
        self.pool = BufferPool()

    def take_buffer(self, size: int) -> memoryview:
        """A writable buffer of *size* octets for an upload, to be stored here once complete; its contents are
        unspecified (a recycled block's): the upload writes every octet."""
        return memoryview(self.pool.take(size, self.free))

    def _keep(self, meta: BlockMeta, data: memoryview) -> None:
        if len(data) != meta.size:
            raise ValueError(f"block {meta.id}: {len(data)} octets, its header says {meta.size}")
        self._data[meta.id] = data.toreadonly()

    def _read(self, meta: BlockMeta) -> memoryview:
        return self._data[meta.id]

    def _forget(self, meta: BlockMeta) -> None:
        buf = self._data.pop(meta.id).obj
        if isinstance(buf, bytearray) and len(buf) == meta.size:  # the whole buffer (only a PoolBuffer is kept)
            self.pool.give(buf, self.free)


# Local-storage file (``kvsp_quic.storage.file_seal``): header (MAC slot included), layer digests, then the
# container (plain, sealed by the MAC) or nonce || AES-GCM(container).
NONCE_SIZE = 12
TAG_SIZE = 16
SUFFIX = ".kvb"
_NAME_RE = re.compile(r"([0-9a-f]{64})\.([0-9a-f]{32})\.([0-9a-f]{64})\.kvb")
_TMP_MARK = ".tmp-"


def block_file_name(block: BlockId) -> str:
    """The file name of *block* in a tier directory (local storage, the shared host tier)."""
    return f"{block.compat_id.hex()}.{block.scope_id.hex()}.{block.block_key.hex()}{SUFFIX}"


def pack_file_header(meta: BlockMeta, flags: int = 0, kid: bytes = bytes(8)) -> bytes:
    """A block file's header: fixed part (MAC slot zero), then the layer digests (what follows is the container,
    or its encryption); ``file_seal.seal`` fills the MAC slot in."""
    return pack_head(meta.id, meta.layer_digests, flags, kid)


def unpack_file_header(view: memoryview, block: BlockId) -> FileHead:
    """The header of a block file expected to hold *block*; :class:`TierFault` when it is not one."""
    try:
        return unpack_head(view, block)
    except FileFormatError as exc:
        raise TierFault(block, exc.reason) from None


@dataclass(frozen=True)
class LocalStorageOptions:
    """The ``local-storage`` tier of a holder as its operator sets it (``[holder.local_storage]``; the key file is
    read by the composition root into :attr:`LocalStorageConfig.encryption_key`)."""

    path: Path  # the directory
    capacity: int  # octets of files (container plus a small header)
    read_mbit_per_s: int | None = None  # advertised in Replica Records
    fsync: bool = True  # fsync each file and the directory before a write counts as done

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError("capacity: must be positive")
        if self.read_mbit_per_s is not None and self.read_mbit_per_s <= 0:
            raise ValueError("read_mbit_per_s: must be positive")


@dataclass(frozen=True)
class LocalStorageConfig(LocalStorageOptions):
    """The ``local-storage`` tier of a holder: its options and its key. With an *encryption_key* files are
    AES-256-GCM sealed; otherwise each file carries an HMAC-SHA-256 under *mac_key* (``file_seal``), and when
    that is None too, under the key in the file beside the directory (``file_seal.default_key_file``, created
    0600 on first use): a file that does not verify under the key is never adopted or served."""

    encryption_key: bytes | None = field(default=None, repr=False)  # 32 octets: AES-256-GCM at rest
    mac_key: bytes | None = field(default=None, repr=False)  # 32 octets: HMAC-SHA-256 of unencrypted files

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.encryption_key is not None and len(self.encryption_key) != 32:
            raise ValueError("local-storage encryption_key must be 32 octets (AES-256-GCM)")
        if self.mac_key is not None and len(self.mac_key) != 32:
            raise ValueError("local-storage mac_key must be 32 octets (HMAC-SHA-256)")


@dataclass(frozen=True)
class ScanResult:
    recovered: list[BlockMeta]  # verified blocks, oldest file first
    dropped: list[tuple[str, str]]  # (file name, reason): failed verification, deleted
    ignored: list[tuple[str, str]]  # (file name, reason): not ours to read (other key, other mode), left alone


class LocalStorageTier(Tier):
    """A directory of one file per block, written atomically, verified on every read, optionally encrypted."""

    def __init__(self, config: LocalStorageConfig, policy: EvictionPolicy | None = None, *,
                 random: Callable[[int], bytes] = os.urandom) -> None:
        super().__init__(LOCAL_STORAGE, config.capacity, policy or LruPolicy())
        self.config = config
        self.directory = Path(config.path)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # block files are 0600 in a 0700 directory (docs/wire.md, "Holder")
            if self.directory.stat().st_uid == os.getuid():
                self.directory.chmod(0o700)
        self._random = random
        self._shadows: set[BlockId] = set()  # files of blocks a faster tier holds (write-through), not counted
        self._aead = AESGCM(config.encryption_key) if config.encryption_key is not None else None
        self._mac_key = None if self._aead is not None else config.mac_key or self._default_mac_key()
        self._key_id = key_id(config.encryption_key or self._mac_key or b"")

    def _default_mac_key(self) -> bytes:
        """The key in the file beside the directory, created on first use (no key configured)."""
        try:
            path = default_key_file(self.directory)
            key, created = load_or_create_key(path, fsync=self.config.fsync)
        except KeyFileError as exc:
            raise ValueError(f"local-storage: no MAC key configured, and the default one fails: {exc}") from None
        if created:
            log.warning("local-storage: no MAC key configured (mac_key_file): created %s; block files are sealed "
                        "under it, and files not sealed under it are never adopted", path)
        return key

    # -- layout ---------------------------------------------------------------------------------------------------

    def path_of(self, block: BlockId) -> Path:
        return self.directory / block_file_name(block)

    def _file_header(self, meta: BlockMeta) -> bytes:
        return pack_file_header(meta, FLAG_ENCRYPTED if self._aead is not None else FLAG_MAC, self._key_id)

    def footprint(self, meta: BlockMeta) -> int:
        extra = NONCE_SIZE + TAG_SIZE if self._aead is not None else 0
        return file_header_size(len(meta.layer_digests)) + extra + meta.size

    # -- writing --------------------------------------------------------------------------------------------------

    def _keep(self, meta: BlockMeta, data: memoryview) -> None:
        if meta.id in self._shadows:  # written through when it was stored: the file is already there
            self._shadows.discard(meta.id)
            return
        head = self._file_header(meta)
        if self._aead is not None:
            nonce = self._random(NONCE_SIZE)
            payload: list[bytes | memoryview] = [nonce, self._aead.encrypt(nonce, data, head)]
        else:
            assert self._mac_key is not None
            head = seal(self._mac_key, head, data)
            payload = [data]
        self._write_atomically(self.path_of(meta.id), [head, *payload])

    def _write_atomically(self, final: Path, parts: Sequence[bytes | memoryview]) -> None:
        tmp = final.with_name(f".{final.name}{_TMP_MARK}{self._random(4).hex()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)  # 0600, whatever umask
            with open(fd, "wb") as fh:
                for part in parts:
                    fh.write(part)
                fh.flush()
                if self.config.fsync:
                    os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        if self.config.fsync:
            self._fsync_directory()

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _forget(self, meta: BlockMeta) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path_of(meta.id).unlink()

    # -- write-through shadows ------------------------------------------------------------------------------------

    def write_shadow(self, meta: BlockMeta, data: memoryview) -> None:
        """Write the file of a block a faster tier holds (not counted here); a later :meth:`store` of it (its
        demotion) writes nothing. May raise OSError (no file is then left)."""
        if meta.id in self._metas or meta.id in self._shadows:
            return
        self._keep(meta, data)
        self._shadows.add(meta.id)

    def drop_shadow(self, block: BlockId) -> None:
        """The faster tier let *block* go (not to this tier): its file goes too."""
        if block in self._shadows:
            self._shadows.discard(block)
            with contextlib.suppress(FileNotFoundError):
                self.path_of(block).unlink()

    def shadow(self, block: BlockId) -> BlockMeta | None:
        """Stop counting *block* here but keep its file, as the shadow of a copy a faster tier now holds."""
        meta = self._unaccount(block)
        if meta is not None:
            self._shadows.add(block)
        return meta

    def has_shadow(self, block: BlockId) -> bool:
        return block in self._shadows

    # -- reading --------------------------------------------------------------------------------------------------

    def _read(self, meta: BlockMeta) -> memoryview:
        try:
            data = self._load(self.path_of(meta.id), meta.id)
        except OSError as exc:
            raise TierFault(meta.id, f"cannot read its file: {exc.strerror or exc}", integrity=False) from None
        return self._verify(meta.id, data, meta)[1]

    def _load(self, path: Path, block: BlockId) -> tuple[tuple[bytes, ...], memoryview]:
        """(layer digests, container octets) of the file at *path*, decrypted; raises TierFault or OSError."""
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < _FILE_HEADER.size:
                raise TierFault(block, f"file of {size} octets is shorter than its header")
            raw = bytearray(size)
            view = memoryview(raw)
            got = 0
            while got < size:
                n = fh.readinto(view[got:])
                if not n:
                    raise TierFault(block, f"file ended after {got} of {size} octets")
                got += n
        head = unpack_file_header(view, block)
        flags, kid, digests, head_len = head.flags, head.key_id, head.layer_digests, head.size
        body = view[head_len:]
        if flags & FLAG_ENCRYPTED:
            if self._aead is None or kid != self._key_id:
                raise _Foreign("encrypted under another key" if self._aead is not None
                               else "encrypted, and no key is configured")
            if len(body) < NONCE_SIZE + TAG_SIZE:
                raise TierFault(block, "encrypted payload is truncated")
            try:
                plain = self._aead.decrypt(body[:NONCE_SIZE], body[NONCE_SIZE:], view[:head_len])
            except InvalidTag:
                raise TierFault(block, "AES-GCM authentication failed (tampered or corrupted)") from None
            return digests, memoryview(plain)
        if flags & ~FLAG_MAC:
            raise TierFault(block, f"unknown flags 0x{flags:02x}")
        if self._aead is not None:
            raise _Foreign("stored in plain text, but encryption at rest is configured")
        # The MAC covers the headers; the layer digests it covers are checked against the body by _verify, which
        # every caller runs next (file_seal's docstring: why that is sound).
        if not flags & FLAG_MAC:
            raise TierFault(block, "no MAC: not written by this holder (planted, or by another program); refused")
        if kid != self._key_id:
            raise _Foreign("sealed under another MAC key (another holder's, or before a key change)")
        assert self._mac_key is not None
        if not seal_holds(self._mac_key, view[:head_len], body):
            raise TierFault(block, "MAC check failed (planted, tampered or corrupted): refused")
        return digests, body

    def read_file(self, block: BlockId) -> tuple[BlockMeta, memoryview]:
        """*block*'s file read and verified without this tier's bookkeeping: what another process of the same
        holder (a worker, ``kvsp_quic.roles.holder_worker``) serves. Raises TierFault or OSError (no file)."""
        data = self._load(self.path_of(block), block)
        header, container = self._verify(block, data, None)
        return BlockMeta(block, header, data[0], len(container)), container

    def _verify(self, block: BlockId, data: tuple[tuple[bytes, ...], memoryview],
                meta: BlockMeta | None) -> tuple[ContainerHeader, memoryview]:
        digests, container = data
        if meta is not None and digests != meta.layer_digests:
            raise TierFault(block, "the file's layer digests differ from the recorded ones")
        try:
            header, _layers = decode(container, expected_layer_digests=digests)
        except (ContainerError, DigestMismatch) as exc:
            raise TierFault(block, f"verification failed: {exc.detail}") from None
        if not digests_fit(header, digests):  # (a layer range: the other layers' digests are UNKNOWN_DIGEST)
            raise TierFault(block, "the container does not hold the layers its digests list")
        if meta is not None and header != meta.header:
            raise TierFault(block, "the container header differs from the recorded one")
        return header, container

    # -- restart ------------------------------------------------------------------------------------------------

    def scan(self, accept: Callable[[BlockMeta], str | None] = lambda meta: None,
             positions: Callable[[BlockId], ChainPosition | None] = lambda block: None) -> ScanResult:
        """Verify every block file; register the good ones (oldest first), delete the bad ones and leftovers of
        interrupted writes, leave files this configuration cannot read (another key) alone. *accept* may refuse
        a verified block by returning a reason: its file is then left alone too (ignored). *positions* tells the
        eviction policy where each recovered block sits in its chain, when known.

        A file is adopted only when it is a regular file owned by this process's user (made 0600 if it was not),
        its header names the block its file name names, it is authenticated under this tier's key (the MAC of
        ``file_seal``, or AES-GCM, which authenticates the header too), and its container verifies against the
        layer digests of its header. A file without a MAC, with a wrong one or of format version 1 is deleted
        (logged at WARNING, listed in *dropped*); one under another key is left alone (logged, *ignored*)."""
        recovered: list[tuple[float, BlockMeta]] = []
        dropped: list[tuple[str, str]] = []
        ignored: list[tuple[str, str]] = []
        for path in sorted(self.directory.iterdir()):
            name = path.name
            if _TMP_MARK in name and name.startswith("."):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            match = _NAME_RE.fullmatch(name)
            if match is None:
                continue
            block = BlockId(*(bytes.fromhex(g) for g in match.groups()))
            if block in self._metas or block in self._shadows:
                continue
            try:
                st = path.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_uid != os.getuid():
                ignored.append((name, "owned by another user"))
                continue
            if st.st_mode & 0o077:
                with contextlib.suppress(OSError):
                    path.chmod(0o600)
            try:
                data = self._load(path, block)
                header, container = self._verify(block, data, None)
                meta = BlockMeta(block, header, data[0], len(container))
                mtime = path.stat().st_mtime
            except _Foreign as exc:
                log.warning("local-storage: not adopting %s (left alone): %s", name, exc)
                ignored.append((name, str(exc)))
                continue
            except (TierFault, OSError) as exc:
                reason = exc.reason if isinstance(exc, TierFault) else str(exc)
                log.warning("local-storage: dropping %s (deleted): %s", name, reason)
                with contextlib.suppress(OSError):
                    path.unlink()
                dropped.append((name, reason))
                continue
            refusal = accept(meta)
            if refusal is not None:
                ignored.append((name, refusal))
                continue
            recovered.append((mtime, meta))
        recovered.sort(key=lambda item: item[0])
        for _mtime, meta in recovered:
            self._account(meta, self.footprint(meta), positions(meta.id))
        return ScanResult([m for _t, m in recovered], dropped, ignored)


class _Foreign(Exception):
    """A block file that this configuration cannot read but that is not corrupt (another key or mode)."""


# -- The tiered store -----------------------------------------------------------------------------------------------


@dataclass
class PutOutcome:
    """What a placement did besides storing the new block."""

    tier: str
    demoted: list[tuple[BlockId, str]] = field(default_factory=list)  # (block, tier it went to)
    evicted: list[BlockMeta] = field(default_factory=list)  # dropped to make room
    faulted: list[TierFault] = field(default_factory=list)  # victims that could not be read back to demote


@dataclass(frozen=True)
class _Move:
    meta: BlockMeta
    source: int | None  # tier index it leaves (None: the new block)
    target: int | None  # tier index it goes to (None: dropped)


class TieredStore:
    """Tiers from fastest to slowest, e.g. ``[HostTier(...), LocalStorageTier(...)]``."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names repeat: {names}")
        self.tiers = list(tiers)
        self._positions: dict[BlockId, ChainPosition] = {}  # declared chain positions of the blocks held
        self.shadows: LocalStorageTier | None = None  # write-through target (see enable_write_through)

    def enable_write_through(self) -> bool:
        """Write every block a faster tier takes through to the last tier's directory, when that is local
        storage (True), so a restart recovers it; a demotion then writes nothing."""
        last = self.tiers[-1]
        if len(self.tiers) > 1 and isinstance(last, LocalStorageTier):
            self.shadows = last
        return self.shadows is not None

    def position(self, block: BlockId) -> ChainPosition | None:
        return self._positions.get(block)

    def _gone(self, block: BlockId) -> None:
        """*block* is no longer held by any tier: forget its position and its write-through file."""
        self._positions.pop(block, None)
        if self.shadows is not None:
            self.shadows.drop_shadow(block)

    def tier_of(self, block: BlockId) -> Tier | None:
        return next((t for t in self.tiers if block in t), None)

    def __contains__(self, block: object) -> bool:
        return any(block in t for t in self.tiers)

    def meta(self, block: BlockId) -> BlockMeta:
        tier = self.tier_of(block)
        if tier is None:
            raise KeyError(block)
        return tier.meta(block)

    def read(self, block: BlockId) -> tuple[Tier, memoryview]:
        tier = self.tier_of(block)
        if tier is None:
            raise KeyError(block)
        return tier, tier.read(block)

    def remove(self, block: BlockId) -> BlockMeta | None:
        tier = self.tier_of(block)
        meta = tier.discard(block) if tier is not None else None
        self._gone(block)
        return meta

    def put(self, meta: BlockMeta, data: memoryview, protected: Callable[[BlockId], bool],
            position: ChainPosition | None = None) -> PutOutcome:
        """Store a new block in the fastest tier that can make room, demoting or dropping unprotected victims.
        *position* is where the block sits in its chain (for prefix-aware eviction), when its producer said.

        Raises :class:`NoRoom` (nothing changed) when no tier can take it without dropping a protected block.
        With write-through, a block a faster tier takes is also written to local storage before this returns;
        when that write fails the block is not kept (:class:`NoRoom`, with what was already moved).
        """
        if meta.id in self:
            raise ValueError(f"block {meta.id} is already stored")
        for i in range(len(self.tiers)):
            plan = self._plan(i, [(meta, None)], protected)
            if plan is not None:
                if position is not None:
                    self._positions[meta.id] = position
                try:
                    return self._execute(plan, meta, data, protected)
                finally:
                    if meta.id not in self:
                        self._positions.pop(meta.id, None)
        if all(t.footprint(meta) > t.capacity for t in self.tiers):
            biggest = max(t.capacity for t in self.tiers)
            raise NoRoom(f"a block of {meta.size} octets is larger than every tier (largest: {biggest})")
        raise NoRoom("no tier can make room: the candidates for eviction are leased")

    def _plan(self, i: int, incoming: list[tuple[BlockMeta, int | None]],
              protected: Callable[[BlockId], bool]) -> list[_Move] | None:
        """Moves that place *incoming* in tier *i*, in execution order (room is made below first)."""
        tier = self.tiers[i]
        sizes = [tier.footprint(m) for m, _ in incoming]
        if any(s > tier.capacity for s in sizes):
            return None
        need = tier.used + sum(sizes) - tier.capacity
        victims: list[BlockMeta] = []
        if need > 0:
            lower = i + 1 < len(self.tiers)
            freed = 0
            chosen: set[BlockId] = set()
            # Unprotected blocks first; protected ones may only move down a tier, never be dropped.
            for allow_protected in ((False, True) if lower else (False,)):
                if freed >= need:
                    break
                for block in tier.policy.victims():  # lazily: usually only the first few are looked at
                    if freed >= need:
                        break
                    if block in chosen or protected(block) != allow_protected:
                        continue
                    chosen.add(block)
                    victims.append(tier.meta(block))
                    freed += tier.footprint(tier.meta(block))
            if freed < need:
                return None
        moves: list[_Move] = []
        if victims:
            below = self._plan(i + 1, [(v, i) for v in victims], protected) if i + 1 < len(self.tiers) else None
            if below is not None:
                moves += below
            elif any(protected(v.id) for v in victims):
                return None
            else:
                moves += [_Move(v, i, None) for v in victims]
        moves += [_Move(m, source, i) for m, source in incoming]
        return moves

    def _execute(self, plan: list[_Move], new: BlockMeta, data: memoryview,
                 protected: Callable[[BlockId], bool]) -> PutOutcome:
        """Carry out *plan*. A failure part-way leaves every block either where it was or where it moved to."""
        outcome = PutOutcome(tier="")
        for move in plan:
            if move.source is None:  # the new block
                assert move.target is not None
                target = self.tiers[move.target]
                try:
                    target.store(new, data, self._positions.get(new.id))
                except OSError as exc:
                    raise NoRoom(f"tier {target.name} could not store the block: {exc.strerror or exc}",
                                 outcome) from None
                if self.shadows is not None and target is not self.shadows:
                    try:
                        self.shadows.write_shadow(new, data)
                    except OSError as exc:
                        target.discard(new.id)
                        raise NoRoom(f"writing the block through to {self.shadows.name} failed: "
                                     f"{exc.strerror or exc}", outcome) from None
                outcome.tier = target.name
                continue
            source = self.tiers[move.source]
            block = move.meta.id
            if block not in source:
                continue  # already dropped by an earlier failure
            if move.target is None:
                source.discard(block)
                self._gone(block)
                outcome.evicted.append(move.meta)
                continue
            target = self.tiers[move.target]
            try:
                octets = source.read(block)
                target.store(move.meta, octets, self._positions.get(block))
            except TierFault as fault:  # (only a verified tier faults; the caller withdraws the replica)
                source.discard(block)
                self._gone(block)
                outcome.faulted.append(fault)
                continue
            except OSError as exc:
                if protected(block):
                    raise NoRoom(f"demoting a leased block to {target.name} failed: {exc.strerror or exc}",
                                 outcome) from None
                log.warning("demoting %s to %s failed (%s): dropping it", block, target.name, exc)
                source.discard(block)
                self._gone(block)
                outcome.evicted.append(move.meta)
                continue
            source.discard(move.meta.id)
            outcome.demoted.append((move.meta.id, target.name))
        return outcome

    # -- restart --------------------------------------------------------------------------------------------------

    def recover(self, accept: Callable[[BlockMeta], str | None] = lambda meta: None,
                positions: Callable[[BlockId], ChainPosition | None] = lambda block: None,
                ) -> tuple[list[BlockMeta], list[tuple[str, str]], list[BlockMeta]]:
        """Scan every local-storage tier (:meth:`LocalStorageTier.scan`) and settle what it found: written-through
        files of blocks that a faster tier held before the restart may exceed local storage's capacity; the
        blocks the policy would keep longest then move back up into faster tiers with free room, and only what
        still does not fit is dropped. Returns (blocks held, files dropped as corrupt, blocks dropped for room)."""
        recovered: list[BlockMeta] = []
        dropped: list[tuple[str, str]] = []
        for tier in self.tiers:
            if isinstance(tier, LocalStorageTier):
                result = tier.scan(accept, positions)
                recovered += result.recovered
                dropped += result.dropped
        for meta in recovered:
            position = positions(meta.id)
            if position is not None:
                self._positions[meta.id] = position
        evicted = self._settle()
        gone = {m.id for m in evicted}
        return [m for m in recovered if m.id not in gone], dropped, evicted

    def _settle(self) -> list[BlockMeta]:
        evicted: list[BlockMeta] = []
        for i, tier in enumerate(self.tiers):
            if tier.used <= tier.capacity or not isinstance(tier, LocalStorageTier):
                continue
            for block in reversed(list(tier.policy.victims())):  # the blocks it would keep longest first
                if tier.used <= tier.capacity:
                    break
                meta = tier.meta(block)
                upper = next((t for t in self.tiers[:i] if t.footprint(meta) <= t.free), None)
                if upper is None:
                    continue
                try:
                    octets = bytearray(tier.read(block))
                    upper.store(meta, memoryview(octets), self._positions.get(block))
                except (TierFault, OSError) as exc:
                    log.warning("restart: %s stays in %s (%s)", block, tier.name, exc)
                    continue
                if tier is self.shadows:
                    tier.shadow(block)  # its file stays, as the write-through copy
                else:
                    tier.discard(block)
            for block in list(tier.policy.victims()):
                if tier.used <= tier.capacity:
                    break
                meta = tier.meta(block)
                tier.discard(block)
                self._gone(block)
                evicted.append(meta)
        return evicted
