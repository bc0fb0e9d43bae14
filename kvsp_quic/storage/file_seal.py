"""Block files: the header of a tier file, and the seal that authenticates an unencrypted one (issue 13).

A block file (local storage, ``kvsp_quic.storage.tiers.LocalStorageTier``; the shared host tier,
``kvsp_quic.storage.shared_host``) is a fixed header, the block's raw 32-octet layer digests, then the KV Block
Container (or, encrypted at rest, nonce || AES-256-GCM(container)). The fixed header (version 2)::

    magic "KVSPTIER" | version (1) | flags (1) | 2 zero octets | key id (8) | compat id (32) | scope id (16)
    | block key (32) | layer count (4, big-endian) | MAC (32)

Flags: ``FLAG_ENCRYPTED`` (AES-GCM; the whole header, MAC slot included, is its associated data) or ``FLAG_MAC``
(plain container, authenticated by the MAC). The key id names the key (:func:`key_id`) so that a file under
another key is recognised as not ours (left alone) rather than mistaken for tampering; it is a hint only, never
trusted: the MAC or the AES-GCM tag decides.

The MAC (:func:`compute_mac`) is HMAC-SHA-256 under the holder's secret *MAC key* over a label, the file header
without its MAC slot, the layer digests and the container's own header (20 + 16 x its layers octets: codec,
first layer, layer count, token count, K and V lengths). It does not cover the K and V sections: every read of a
file (restart scan, GET, a worker's read) checks the MAC first and then decodes the container against the
header's layer digests (``kvsp_quic.container.decode``), which requires the container to be exactly its header
followed by sections of the lengths it declares, each layer's SHA-256(K || V) equal to its digest. Every octet
served is therefore either under the MAC (block identity, digests, container header) or bound by SHA-256 to a
digest that is: forging a file means forging HMAC-SHA-256 or finding a SHA-256 second preimage. The body is
hashed once per read (the digest check that already happened), not twice.

Key files (:func:`read_key_file`, :func:`load_or_create_key`) hold 32 octets, raw or as 64 hex characters. The
default MAC key of a directory (:func:`default_key_file`) sits beside it, outside it: whoever can only drop files
into the directory cannot read or replace it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import struct
from pathlib import Path
from typing import NamedTuple

from kvsp_quic.container import ENTRY, FIXED_HEADER
from kvsp_quic.storage.eviction import BlockId

FILE_MAGIC = b"KVSPTIER"
FILE_VERSION = 2  # 1: files written before the MAC (refused; docs/security.md)
FLAG_ENCRYPTED = 0x01
FLAG_MAC = 0x02
MAC_SIZE = 32
KEY_SIZE = 32
# magic, version, flags, key id, compat, scope, key, layers, MAC
_FILE_HEADER = struct.Struct(">8sBB2x8s32s16s32sI32s")
_MAC_AT = _FILE_HEADER.size - MAC_SIZE
_KEY_ID_LABEL = b"KVSP-TIER-KEY-ID\x00"
_MAC_LABEL = b"KVSP-TIER-MAC-2\x00"
DEFAULT_KEY_SUFFIX = ".mac-key"


class FileFormatError(Exception):
    """A file that is not a (readable) block file of the expected block; *reason* says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class KeyFileError(Exception):
    """A key file that cannot be used (unreadable, malformed, or writable by others)."""


class FileHead(NamedTuple):
    flags: int
    key_id: bytes
    block: BlockId
    layer_digests: tuple[bytes, ...]
    size: int  # octets of the header with its digests: where the container (or its encryption) starts
    mac: bytes = bytes(MAC_SIZE)


def file_header_size(layers: int) -> int:
    """Octets of a block file's header (MAC slot and layer digests included) for a block of *layers* layers."""
    return _FILE_HEADER.size + 32 * layers


def pack_head(block: BlockId, layer_digests: tuple[bytes, ...], flags: int = 0, kid: bytes = bytes(8),
              mac: bytes = bytes(MAC_SIZE)) -> bytes:
    """A block file's header: fixed part, then the layer digests."""
    head = _FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION, flags, kid, block.compat_id, block.scope_id,
                             block.block_key, len(layer_digests), mac)
    return head + b"".join(layer_digests)


def unpack_head(view: memoryview, block: BlockId) -> FileHead:
    """The header of a file expected to hold *block*; :class:`FileFormatError` when it is not one."""
    if len(view) >= 9 and bytes(view[:8]) == FILE_MAGIC and view[8] == 1:
        raise FileFormatError("file format version 1, written before block files were authenticated: refused "
                              "(local storage is a cache; the block is fetched or computed again)")
    if len(view) < _FILE_HEADER.size:
        raise FileFormatError(f"file of {len(view)} octets is shorter than its header")
    magic, version, flags, kid, compat, scope, key, count, mac = _FILE_HEADER.unpack_from(view)
    if magic != FILE_MAGIC or version != FILE_VERSION:
        raise FileFormatError("not a block file (magic or version)")
    if BlockId(compat, scope, key) != block:
        raise FileFormatError("the file names another block")
    head_len = file_header_size(count)
    if len(view) < head_len:
        raise FileFormatError("file is shorter than its layer digests")
    digests = tuple(bytes(view[i:i + 32]) for i in range(_FILE_HEADER.size, head_len, 32))
    return FileHead(flags, bytes(kid), block, digests, head_len, bytes(mac))


def key_id(key: bytes) -> bytes:
    """8 octets naming a key in file headers (so a file under another key is recognised, not mistaken for
    tampering)."""
    return hashlib.sha256(_KEY_ID_LABEL + key).digest()[:8]


# -- the seal ---------------------------------------------------------------------------------------------------


def compute_mac(key: bytes, head: bytes | memoryview, container: bytes | memoryview) -> bytes | None:
    """HMAC-SHA-256 under *key* of a file's header *head* (its MAC slot excluded) and the container header at the
    start of *container* (its fixed part, then one entry per layer it says it holds: a replica of a layer range
    holds fewer layers than the block's digests list); None when *container* is shorter than that header."""
    if len(head) < _FILE_HEADER.size or len(container) < FIXED_HEADER.size:
        return None
    layers = FIXED_HEADER.unpack_from(container)[5]
    container_head = FIXED_HEADER.size + ENTRY.size * layers
    if len(container) < container_head:
        return None
    mac = hmac.new(key, _MAC_LABEL, hashlib.sha256)
    mac.update(head[:_MAC_AT])
    mac.update(head[_FILE_HEADER.size:])
    mac.update(container[:container_head])
    return mac.digest()


def seal(key: bytes, head: bytes, container: bytes | memoryview) -> bytes:
    """*head* (from :func:`pack_head`, with ``FLAG_MAC``) with its MAC slot filled in for *container*."""
    mac = compute_mac(key, head, container)
    if mac is None:
        raise ValueError("the container is shorter than its header")
    return head[:_MAC_AT] + mac + head[_MAC_AT + MAC_SIZE:]


def seal_holds(key: bytes, head: memoryview, container: memoryview) -> bool:
    """Whether the MAC slot of *head* (a whole file header, digests included) authenticates *container*."""
    mac = compute_mac(key, head, container)
    return mac is not None and hmac.compare_digest(mac, bytes(head[_MAC_AT:_MAC_AT + MAC_SIZE]))


# -- key files --------------------------------------------------------------------------------------------------


def default_key_file(directory: Path) -> Path:
    """Where the MAC key of a local-storage *directory* lives when none is configured: beside it, outside it."""
    directory = Path(directory)
    if not directory.name:
        raise KeyFileError(f"{os.fspath(directory)!r} has no parent to keep a MAC key in: set mac_key_file")
    return directory.parent / f"{directory.name}{DEFAULT_KEY_SUFFIX}"


def read_key_file(path: Path) -> bytes:
    """The 32-octet key in *path* (32 raw octets, or 64 hex characters and optional white space). Refused when the
    file is not a regular file, or is owned by another user than this one or root, or is writable by its group or
    others (whoever could replace the key could make planted block files verify)."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            raw = fh.read(4096)
    except OSError as exc:
        raise KeyFileError(f"cannot read the key {os.fspath(path)!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"key {os.fspath(path)!r} is not a regular file")
    if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022:
        raise KeyFileError(f"key {os.fspath(path)!r} may be replaced by another user (owner uid {st.st_uid}, "
                           f"mode {stat.S_IMODE(st.st_mode):04o}): make it the holder's own, 0600")
    text = raw.strip()
    if len(text) == 2 * KEY_SIZE:
        with contextlib.suppress(ValueError):
            return bytes.fromhex(text.decode("ascii"))
    if len(raw) == KEY_SIZE:
        return raw
    raise KeyFileError(f"key {os.fspath(path)!r}: expected {KEY_SIZE} raw octets or {2 * KEY_SIZE} hex characters")


def load_or_create_key(path: Path, *, fsync: bool = True) -> tuple[bytes, bool]:
    """(the key in *path*, whether it was created now). A missing file is created with a fresh random key as hex
    text, 0600, atomically and without replacing a file another process created meanwhile (its key is then
    used); its directory is created 0700 when missing."""
    path = Path(path)
    if path.exists():
        return read_key_file(path), False
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with open(fd, "wb") as fh:
                fh.write(secrets.token_bytes(KEY_SIZE).hex().encode("ascii") + b"\n")
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())
            try:
                os.link(tmp, path)  # never replaces: a key another process created first wins
                created = True
            except FileExistsError:
                created = False
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if created and fsync:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except OSError as exc:
        raise KeyFileError(f"cannot create the key {os.fspath(path)!r}: {exc.strerror or exc}") from None
    return read_key_file(path), created
