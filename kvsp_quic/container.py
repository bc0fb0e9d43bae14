"""The KV Block Container "KVB1" (spec: "KV Block Container").

    Magic "KVB1" (32) | Version (8) | Flags (8) | Codec (16) | First Layer (32) | Layer Count (32)
    | Token Count (32) | Layer Count x { K Length (64), V Length (64) } | per layer, ascending: K octets, V octets

Integers are big-endian. The layer digest of layer l is SHA-256(K || V); the replica digest is SHA-256 over the
raw 32-octet layer digests of all layers in ascending order.

The data path never copies a section it does not have to: :func:`encode` and :func:`cut` return an
:class:`EncodedContainer` whose sections are views of the caller's buffers (write it with :meth:`chunks`), and
:func:`decode` returns views of the input. :class:`ContainerDecoder` is the sans-I/O incremental decoder: it
takes bytes as they arrive (``feed``, or ``get_buffer`` / ``buffer_updated`` to receive straight into its
buffer), hashes them once, and yields each layer, verified, as soon as its K and V are complete.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from kvsp_quic.compat import Codec, CompatDescriptor, codec_known
from kvsp_quic.problems import BadRequest, DigestMismatch, LayersUnavailable

MAGIC = b"KVB1"
VERSION = 1
FIXED_HEADER = struct.Struct(">4sBBHIII")  # 20 octets
ENTRY = struct.Struct(">QQ")  # 16 octets per layer
DEFAULT_MAX_DATA = 1 << 32  # refuse to allocate more than this for one container unless told otherwise
ANY_TOKEN_COUNT = -1  # token_count argument: accept the container's own token count (tools, not the data path)
MAX_LAYERS = 1 << 16  # layer count accepted by the incremental decoder when no descriptor bounds it
CODEC_SECTION_SLACK = 4096  # octets a section of a codec other than raw may have beyond the bound below


def max_section_length(descriptor: CompatDescriptor, tokens: int) -> int:
    """The largest K or V section accepted for a codec other than raw (private codecs 0xFF00-0xFFFF included):
    the raw section of the same tokens plus an eighth, plus ``CODEC_SECTION_SLACK`` octets of codec metadata. The
    spec lets other codecs "define their own section encoding" but says nothing of size; a bound derived from the
    descriptor keeps a 20 + 16 x L octet header from declaring (and making a receiver allocate) gigabytes
    (docs/wire.md, "KV Block Container")."""
    raw = descriptor.section_length(tokens)
    return raw + raw // 8 + CODEC_SECTION_SLACK


# -- Errors ----------------------------------------------------------------------------------------------------


class ContainerError(BadRequest):
    """The octets are not a valid KV Block Container (for the descriptor, when one is given)."""


class BadMagic(ContainerError):
    pass


class UnsupportedVersion(ContainerError):
    pass


class ReservedFlags(ContainerError):
    pass


class UnknownCodec(ContainerError):
    pass


class GeometryMismatch(ContainerError):
    """Layer range, token count or section lengths disagree with the descriptor or with codec "raw"."""


class Truncated(ContainerError):
    pass


class TrailingBytes(ContainerError):
    pass


class LayerDigestMismatch(DigestMismatch):
    pass


# -- Digests ---------------------------------------------------------------------------------------------------


def layer_digest(k: Any, v: Any) -> bytes:
    h = hashlib.sha256(k)
    h.update(v)
    return h.digest()


def replica_digest(layer_digests: Sequence[bytes]) -> bytes:
    return hashlib.sha256(b"".join(layer_digests)).digest()


# -- Header ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerHeader:
    codec: int
    first_layer: int
    token_count: int
    lengths: tuple[tuple[int, int], ...]  # (K length, V length) per layer
    version: int = VERSION
    flags: int = 0

    @property
    def layer_count(self) -> int:
        return len(self.lengths)

    @property
    def last_layer(self) -> int:
        return self.first_layer + self.layer_count - 1

    @property
    def size(self) -> int:
        """Octets of the header itself."""
        return FIXED_HEADER.size + ENTRY.size * self.layer_count

    @property
    def data_length(self) -> int:
        return sum(k + v for k, v in self.lengths)

    @property
    def total_length(self) -> int:
        return self.size + self.data_length

    def layer_offsets(self) -> list[int]:
        """Offset of each layer's K section from the start of the data, plus the end of the data."""
        offsets = [0]
        for k, v in self.lengths:
            offsets.append(offsets[-1] + k + v)
        return offsets

    def pack(self) -> bytes:
        out = bytearray(FIXED_HEADER.pack(MAGIC, self.version, self.flags, self.codec, self.first_layer,
                                          self.layer_count, self.token_count))
        for k, v in self.lengths:
            out += ENTRY.pack(k, v)
        return bytes(out)

    def validate(self, descriptor: CompatDescriptor | None = None, *, token_count: int | None = None) -> None:
        """Check the header against codec "raw" and, when given, the descriptor's geometry.

        With a descriptor, the token count must be *token_count* (default: the descriptor's block size;
        ``ANY_TOKEN_COUNT`` accepts any).
        """
        if self.layer_count == 0:
            raise GeometryMismatch("a container holds at least one layer")
        if self.first_layer + self.layer_count > 1 << 32:
            raise GeometryMismatch("first layer + layer count exceeds the 32-bit layer space")
        if descriptor is not None:
            if self.last_layer >= descriptor.layers:
                raise GeometryMismatch(f"layers {self.first_layer}-{self.last_layer} are outside the "
                                       f"descriptor's {descriptor.layers} layers")
            expected_tokens = descriptor.block_tokens if token_count is None else token_count
            if expected_tokens != ANY_TOKEN_COUNT and self.token_count != expected_tokens:
                raise GeometryMismatch(f"token count {self.token_count}, expected {expected_tokens}")
        if self.codec != Codec.RAW:
            if descriptor is not None:
                bound = max_section_length(descriptor, self.token_count)
                for i, (k, v) in enumerate(self.lengths):
                    if k > bound or v > bound:
                        raise GeometryMismatch(
                            f"layer {self.first_layer + i}: K/V lengths {k}/{v} exceed {bound}, the most a section "
                            f"of codec 0x{self.codec:04x} may hold for {self.token_count} tokens of this cache")
            return
        if descriptor is not None:
            want = descriptor.section_length(self.token_count)
            for i, (k, v) in enumerate(self.lengths):
                if k != want or v != want:
                    raise GeometryMismatch(
                        f"layer {self.first_layer + i}: K/V lengths {k}/{v}, codec raw with "
                        f"{self.token_count} tokens x {descriptor.kv_heads} heads x {descriptor.head_dim} x "
                        f"{descriptor.element.size} octets needs {want}")
        else:
            for i, (k, v) in enumerate(self.lengths):
                if k != v or (self.token_count and k % self.token_count) or (not self.token_count and k):
                    raise GeometryMismatch(f"layer {self.first_layer + i}: K/V lengths {k}/{v} are not "
                                           f"{self.token_count} equal rows, as codec raw requires")


def _parse_fixed(buf: Any) -> tuple[int, int, int, int, int, int]:
    magic, version, flags, codec, first, count, tokens = FIXED_HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise BadMagic(f"magic is {bytes(magic)!r}, not 'KVB1': not a KV Block Container")
    if version != VERSION:
        raise UnsupportedVersion(f"container version {version} is not supported (only {VERSION})")
    if flags != 0:
        raise ReservedFlags(f"flags are reserved and must be zero, got 0x{flags:02x}")
    if not codec_known(codec):
        raise UnknownCodec(f"codec 0x{codec:04x} is not in the KVSP Codecs registry")
    return version, flags, codec, first, count, tokens


def _check_magic_prefix(buf: Any) -> None:
    n = min(len(buf), 4)
    if bytes(buf[:n]) != MAGIC[:n]:
        raise BadMagic(f"magic is {bytes(buf[:n])!r}, not 'KVB1': not a KV Block Container")


def parse_header(buf: Any) -> ContainerHeader:
    """Parse the header at the start of *buf* (which may hold more). Raises :class:`Truncated` if short."""
    view = memoryview(buf).cast("B")
    _check_magic_prefix(view)
    if len(view) < FIXED_HEADER.size:
        raise Truncated(f"container header needs {FIXED_HEADER.size} octets, got {len(view)}")
    version, flags, codec, first, count, tokens = _parse_fixed(view)
    need = FIXED_HEADER.size + ENTRY.size * count
    if len(view) < need:
        raise Truncated(f"container header with {count} layers needs {need} octets, got {len(view)}")
    lengths = tuple(ENTRY.iter_unpack(view[FIXED_HEADER.size:need]))
    return ContainerHeader(codec=codec, first_layer=first, token_count=tokens, lengths=lengths,
                           version=version, flags=flags)


# -- Encoded containers (scatter/gather) ---------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedContainer:
    """A container as its header octets plus views of its sections, K0, V0, K1, V1, ... (nothing copied).
    *whole*, when set, is the same octets as one contiguous view (a stored container served whole, :func:`cut`):
    a writer sends it in a few large writes instead of one per section."""

    header: ContainerHeader
    header_bytes: bytes
    sections: tuple[memoryview, ...]
    layer_digests: tuple[bytes, ...] | None = None
    whole: memoryview | None = None

    def __len__(self) -> int:
        return self.header.total_length

    def chunks(self) -> Iterator[memoryview | bytes]:
        """The container's octets in order, as buffers to write (``writelines``, ``sendmsg``, a stream)."""
        yield self.header_bytes
        yield from self.sections

    def tobytes(self) -> bytes:
        return b"".join(self.chunks())

    def repr_digest(self) -> bytes:
        """SHA-256 of the whole container (the value of Repr-Digest); one pass over the data."""
        h = hashlib.sha256(self.header_bytes)
        for section in self.sections:
            h.update(section)
        return h.digest()

    def replica_digest(self, descriptor: CompatDescriptor) -> bytes | None:
        """The replica digest, when the container holds every layer of the descriptor and its digests."""
        if self.layer_digests is None or self.header.first_layer != 0:
            return None
        if self.header.layer_count != descriptor.layers:
            return None
        return replica_digest(self.layer_digests)


def as_section(obj: Any, kv_dtype: str | None = None) -> memoryview:
    """A K or V section as a flat octet view. numpy arrays must be C-contiguous and of the element type
    (float16 / float32, or uint16 / uint8 bit patterns for bf16 / fp8; uint8 octets for any type); big-endian
    arrays are converted to the little-endian octet order of kvsp-layout-1 (the only case that copies)."""
    if hasattr(obj, "dtype") and hasattr(obj, "flags"):
        arr = obj
        if kv_dtype is not None:
            _check_array_dtype(arr, kv_dtype)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if not arr.flags.c_contiguous:
            raise BadRequest("section arrays must be C-contiguous (tokens, kv_heads, head_dim)")
        obj = arr
    try:
        view = memoryview(obj)
    except TypeError:
        raise BadRequest(f"a section must be a bytes-like object or a numpy array, not {type(obj).__name__}") \
            from None
    if not view.c_contiguous:
        raise BadRequest("sections must be contiguous buffers")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


_ARRAY_KINDS = {"fp16": ("f", 2), "fp32": ("f", 4), "bf16": ("u", 2), "fp8-e4m3": ("u", 1), "fp8-e5m2": ("u", 1)}


def _check_array_dtype(arr: Any, kv_dtype: str) -> None:
    kind, size = _ARRAY_KINDS[kv_dtype]
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 1:
        return  # raw octets are acceptable for every element type
    if arr.dtype.kind != kind or arr.dtype.itemsize != size:
        hint = " (bit patterns as uint16/uint8 arrays)" if kind == "u" else ""
        raise BadRequest(f"array of {arr.dtype} cannot be a {kv_dtype} section{hint}")


def encode(layers: Sequence[tuple[Any, Any]], *, first_layer: int, token_count: int,
           codec: int = Codec.RAW, descriptor: CompatDescriptor | None = None, digests: bool = True,
           executor: Executor | None = None) -> EncodedContainer:
    """Build a container from per-layer (K, V) sections (bytes-like or numpy arrays); nothing is copied.

    With *digests* the layer digests are computed (one SHA-256 pass over the data; spread over *executor*'s
    threads when one is given: hashlib releases the GIL on large buffers).
    """
    kv_dtype = descriptor.kv_dtype if descriptor is not None else None
    views = [(as_section(k, kv_dtype), as_section(v, kv_dtype)) for k, v in layers]
    header = ContainerHeader(codec=int(codec), first_layer=first_layer, token_count=token_count,
                             lengths=tuple((k.nbytes, v.nbytes) for k, v in views))
    if not codec_known(header.codec):
        raise UnknownCodec(f"codec 0x{header.codec:04x} is not in the KVSP Codecs registry")
    if not 0 <= first_layer < 1 << 32 or not 0 <= token_count < 1 << 32:
        raise GeometryMismatch("first layer and token count are 32-bit unsigned integers")
    header.validate(descriptor, token_count=token_count)
    layer_digests: tuple[bytes, ...] | None = None
    if digests:
        if executor is not None:
            layer_digests = tuple(executor.map(lambda kv: layer_digest(*kv), views))
        else:
            layer_digests = tuple(layer_digest(k, v) for k, v in views)
    return EncodedContainer(header, header.pack(), tuple(s for kv in views for s in kv), layer_digests)


# -- Whole decode and layer-range cut ------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodedLayer:
    """One verified layer. Its K and V sections are views, possibly in several parts (see ContainerDecoder)."""

    index: int  # absolute layer number
    k_parts: tuple[memoryview, ...]
    v_parts: tuple[memoryview, ...]
    digest: bytes | None

    @property
    def k(self) -> memoryview:
        """The K section, contiguous (joined, that is copied, only when it arrived in several parts)."""
        return _joined(self.k_parts)

    @property
    def v(self) -> memoryview:
        return _joined(self.v_parts)

    @property
    def k_length(self) -> int:
        return sum(len(p) for p in self.k_parts)

    @property
    def v_length(self) -> int:
        return sum(len(p) for p in self.v_parts)


def _joined(parts: tuple[memoryview, ...]) -> memoryview:
    if len(parts) == 1:
        return parts[0]
    return memoryview(b"".join(parts))


def _split(lengths: Sequence[tuple[int, int]], body: memoryview) -> list[memoryview]:
    """Views K0, V0, K1, V1, ... of a body that starts with K0."""
    out: list[memoryview] = []
    offset = 0
    for k, v in lengths:
        out.append(body[offset:offset + k])
        out.append(body[offset + k:offset + k + v])
        offset += k + v
    return out


def _check_length(header: ContainerHeader, available: int) -> None:
    if available < header.total_length:
        raise Truncated(f"container is truncated: {available} of {header.total_length} octets")
    if available > header.total_length:
        raise TrailingBytes(f"{available - header.total_length} octets follow the container's last section")


def decode(data: Any, descriptor: CompatDescriptor | None = None, *,
           expected_layer_digests: Sequence[bytes] | None = None, expected_replica_digest: bytes | None = None,
           token_count: int | None = None) -> tuple[ContainerHeader, list[DecodedLayer]]:
    """Decode a whole container held in memory; the layers are views of *data*."""
    view = memoryview(data).cast("B")
    header = parse_header(view)
    header.validate(descriptor, token_count=token_count)
    _check_length(header, len(view))
    secs = _split(header.lengths, view[header.size:])
    verifier = _Verifier(header, expected_layer_digests, expected_replica_digest)
    layers = []
    for i in range(header.layer_count):
        k, v = secs[2 * i], secs[2 * i + 1]
        layers.append(DecodedLayer(header.first_layer + i, (k,), (v,), verifier.check(i, layer_digest(k, v))))
    verifier.finish()
    return header, layers


def cut(data: Any, first: int, last: int, *, layer_digests: Sequence[bytes] | None = None) -> EncodedContainer:
    """The container for layers *first*..*last* (inclusive, absolute numbers) of the container in *data*.

    Only the header is read and rewritten; the sections of the result are views of *data*. *layer_digests*
    (indexed by absolute layer, as in a Replica Record) are carried over when given.
    """
    view = memoryview(data).cast("B")
    header = parse_header(view)
    _check_length(header, len(view))
    if first > last or first < header.first_layer or last > header.last_layer:
        raise LayersUnavailable(f"layers {first}-{last} are not in this container "
                                f"(it holds {header.first_layer}-{header.last_layer})")
    lo, hi = first - header.first_layer, last - header.first_layer + 1
    offsets = header.layer_offsets()
    new = ContainerHeader(codec=header.codec, first_layer=first, token_count=header.token_count,
                          lengths=header.lengths[lo:hi])
    body = view[header.size + offsets[lo]:header.size + offsets[hi]]
    digests = tuple(layer_digests[first:last + 1]) if layer_digests is not None else None
    packed = new.pack()
    whole = None
    if lo == 0 and hi == header.layer_count and view[:header.size] == packed:  # all of it, as stored
        whole = view[:header.size + offsets[hi]]
    return EncodedContainer(new, packed, tuple(_split(new.lengths, body)), digests, whole)


# -- Verification ----------------------------------------------------------------------------------------------


class _Verifier:
    def __init__(self, header: ContainerHeader, expected: Sequence[bytes] | None,
                 expected_replica: bytes | None) -> None:
        self._header = header
        self._expected = expected
        self._replica = expected_replica
        self.digests: list[bytes] = []
        if expected is not None and len(expected) <= header.last_layer:
            raise GeometryMismatch(f"the record lists {len(expected)} layer digests; the container holds "
                                   f"layers up to {header.last_layer}")

    def check(self, i: int, digest: bytes) -> bytes:
        layer = self._header.first_layer + i
        if self._expected is not None and self._expected[layer] != digest:
            raise LayerDigestMismatch(f"layer {layer}: SHA-256 {digest.hex()} does not match the record's "
                                      f"{bytes(self._expected[layer]).hex()}")
        self.digests.append(digest)
        return digest

    def finish(self) -> None:
        if self._replica is None:
            return
        if self._header.first_layer != 0:
            raise GeometryMismatch("a replica digest can only be checked over all layers from layer 0")
        got = replica_digest(self.digests)
        if got != self._replica:
            raise LayerDigestMismatch(f"replica digest {got.hex()} does not match the record's "
                                      f"{self._replica.hex()}")


# -- Incremental decoder ----------------------------------------------------------------------------------


class ContainerDecoder:
    """Sans-I/O incremental decoder: bytes in, verified layers out, in ascending order, as soon as complete.

    Give it bytes with ``feed(data)``, or receive straight into it with ``view = get_buffer();
    n = sock.recv_into(view); buffer_updated(n)`` (the ``asyncio.BufferedProtocol`` shape). Both return the
    layers the new bytes complete, each hashed once and checked against *expected_layer_digests* (indexed by
    absolute layer, as in a Replica Record). Call ``finish()`` at the end of the stream: it raises
    :class:`Truncated` if the container is incomplete.

    Two ways to hold the data:

    * ``assemble=True`` (default): the sections land in one buffer of the container's data size, from
      *allocate* (default: a new bytearray; pass one that hands out preallocated, already-touched memory, such
      as a pool or a pinned tensor, to avoid first-touch costs). Each layer's K and V are single views of it.
    * ``assemble=False``: nothing is copied. ``feed`` keeps views of the caller's chunks (which must not be
      modified afterwards) and a layer's K and V come as the parts they arrived in (``k_parts``), ready to be
      copied once into their final place (a KV cache page). ``get_buffer`` hands out fresh chunk buffers of up
      to *chunk_size* octets (what one has left unfilled next); a section received into one of them, in however
      many deliveries, is one view of it.

    With *repr_digest* the decoder also computes SHA-256 of the whole container (``repr_digest``).
    """

    # Per block this runs once per delivery (a TLS read, a fed chunk) and once per layer, so the hot paths read
    # plain attributes: the fixed header is parsed once, the layer count, offsets and ``done`` are kept, not
    # recomputed (issue 16: ~60-100 us of Python per block before).

    def __init__(self, descriptor: CompatDescriptor | None = None, *,
                 expected_layer_digests: Sequence[bytes] | None = None,
                 expected_replica_digest: bytes | None = None, token_count: int | None = None,
                 assemble: bool = True, allocate: Callable[[int], Any] | None = None,
                 max_data: int = DEFAULT_MAX_DATA, repr_digest: bool = False, chunk_size: int = 1 << 16) -> None:
        self._descriptor = descriptor
        self._expected = expected_layer_digests
        self._expected_replica = expected_replica_digest
        self._token_count = token_count
        self._assemble = assemble
        self._allocate = allocate or bytearray
        self._max_data = max_data
        self._chunk_size = chunk_size
        self._whole = hashlib.sha256() if repr_digest else None
        self._head = bytearray(FIXED_HEADER.size)
        self._head_view = memoryview(self._head)
        self._head_filled = 0
        self._fixed: tuple[int, int, int, int, int, int] | None = None  # the fixed header, parsed once
        self.header: ContainerHeader | None = None
        self.done = False  # every layer is in (and verified)
        self._data: memoryview | None = None  # the assembly buffer
        self._pending: memoryview | None = None  # segment mode: the part of a fresh buffer not yet filled
        self._segment = _EMPTY  # segment mode: the fresh buffer get_buffer hands out, whole
        self._segment_filled = 0  # ... and how much of it buffer_updated has been told about
        self._in_segment = False  # the octets being consumed are the segment's, from _segment_at on
        self._segment_at = 0
        self._filled = 0  # data octets received
        self._total = 0
        self._count = 0  # the header's layer count
        self._first = 0  # the header's first layer
        self._offsets: list[int] = []
        self._k_ends: list[int] = []
        self._layer = 0  # next layer (relative) to complete
        self._end = 0  # the data offset where that layer ends
        self._hash: Any = None
        self._k_parts: list[memoryview] = []
        self._v_parts: list[memoryview] = []
        self._verifier: _Verifier | None = None
        self._error: Exception | None = None
        self.repr_digest: bytes | None = None

    @property
    def layer_digests(self) -> list[bytes]:
        return list(self._verifier.digests) if self._verifier else []

    def feed(self, data: Any) -> list[DecodedLayer]:
        if self._error is not None:
            raise self._error
        src = memoryview(data)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        try:
            out: list[DecodedLayer] = []
            while self.header is None and len(src):
                room = self._head_view[self._head_filled:]
                n = min(len(room), len(src))
                room[:n] = src[:n]
                src = src[n:]
                out += self._header_bytes(n)
            if len(src):
                data_buffer = self._data
                if data_buffer is not None:
                    filled = self._filled
                    n = min(len(src), self._total - filled)
                    data_buffer[filled:filled + n] = src[:n]
                    out += self._consume(data_buffer[filled:filled + n])
                    src = src[n:]
                if len(src):
                    out += self._consume(src)
            return out
        except Exception as exc:
            self._error = exc
            raise

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next octets go: never more than the container still needs (except past its end). In segment
        mode (``assemble=False``) a fresh buffer of at most *chunk_size* octets, or what a previous one has left
        unfilled (octets no layer has a view of): a few octets at a time (``copy_into`` small chunks) still fill one
        buffer."""
        if self._error is not None:
            raise self._error
        if self._data is not None and not self.done:
            return self._data[self._filled:]
        if self.header is None:
            return self._head_view[self._head_filled:]
        if self.done:
            return memoryview(bytearray(1))  # anything written here is trailing data
        if self._pending is None:  # (*sizehint* aside: what a buffer has left unfilled is handed out next anyway)
            self._segment = self._pending = memoryview(bytearray(min(self._total - self._filled, self._chunk_size)))
            self._segment_filled = 0
        return self._pending

    def buffer_updated(self, nbytes: int) -> list[DecodedLayer]:
        if self._error is not None:
            raise self._error
        if nbytes <= 0:
            return []
        try:
            data = self._data
            if data is not None and not self.done:
                return self._consume(data[self._filled:self._filled + nbytes])
            if self.header is None:
                return self._header_bytes(nbytes)
            if self.done:
                raise TrailingBytes("octets follow the container's last section")
            pending = self._pending
            if pending is None:
                raise ValueError("buffer_updated() without get_buffer()")
            # what the buffer has left is handed out next (no layer has a view of it); a full one is done with
            self._pending = pending[nbytes:] if nbytes < len(pending) else None
            self._in_segment, self._segment_at = True, self._segment_filled
            self._segment_filled += nbytes
            out = self._consume(pending[:nbytes])
            self._in_segment = False
            return out
        except Exception as exc:
            self._error = exc
            raise

    def finish(self) -> ContainerHeader:
        if self._error is not None:
            raise self._error
        if self.header is None:
            self._error = Truncated("no octets: the container is empty" if not self._head_filled else
                                    f"container ended inside its header ({self._head_filled} octets)")
            raise self._error
        if not self.done:
            self._error = Truncated(f"container is truncated: {self._filled} of {self._total} data octets")
            raise self._error
        return self.header

    def _header_bytes(self, nbytes: int) -> list[DecodedLayer]:
        self._head_filled += nbytes
        _check_magic_prefix(self._head_view[:self._head_filled])
        if self._head_filled < len(self._head):
            return []
        if self._fixed is None:  # the fixed part is in: make room for the entries
            self._fixed = fixed = _parse_fixed(self._head)
            count = fixed[4]
            limit = self._descriptor.layers if self._descriptor is not None else MAX_LAYERS
            if count > limit:
                raise GeometryMismatch(f"layer count {count} exceeds {limit}")
            if count:
                head = bytearray(FIXED_HEADER.size + ENTRY.size * count)
                head[:FIXED_HEADER.size] = self._head
                self._head, self._head_view = head, memoryview(head)
                return []
        self._start_data()
        return self._consume(memoryview(b""))

    def _start_data(self) -> None:
        assert self._fixed is not None
        version, flags, codec, first, count, tokens = self._fixed
        lengths = tuple(ENTRY.iter_unpack(self._head_view[FIXED_HEADER.size:])) if count else ()
        header = ContainerHeader(codec=codec, first_layer=first, token_count=tokens, lengths=lengths,
                                 version=version, flags=flags)
        header.validate(self._descriptor, token_count=self._token_count)
        offsets = [0]
        k_ends = []
        end = 0
        for k, v in lengths:
            k_ends.append(end + k)
            end += k + v
            offsets.append(end)
        if end > self._max_data:
            raise ContainerError(f"container data of {end} octets exceeds the limit of {self._max_data}")
        self._verifier = _Verifier(header, self._expected, self._expected_replica)
        self._offsets, self._k_ends, self._total = offsets, k_ends, end
        self._count, self._first, self._end = count, first, offsets[1] if count else 0
        if self._assemble:
            data = memoryview(self._allocate(end)).cast("B")
            if len(data) < end:
                raise ValueError("allocate() returned a buffer smaller than requested")
            self._data = data[:end]
        if self._whole is not None:
            self._whole.update(self._head)
        self._hash = hashlib.sha256()
        self.header = header

    def _consume(self, view: memoryview) -> list[DecodedLayer]:
        """Account for *view*, the next data octets (already in the assembly buffer when assembling)."""
        if self._whole is not None and len(view):
            self._whole.update(view)
        out: list[DecodedLayer] = []
        while True:
            if self.done:
                if len(view):
                    raise TrailingBytes("octets follow the container's last section")
                return out
            end = self._end
            left = len(view)
            take = end - self._filled
            if left < take:  # the common case: the view ends inside the layer
                take = left
            if take:
                piece = view[:take] if take < left else view
                view = view[take:] if take < left else _EMPTY
                self._hash.update(piece)
                if not self._assemble:
                    self._keep(piece)
                self._filled += take
            if self._filled < end:
                return out
            out.append(self._complete_layer())

    def _keep(self, piece: memoryview) -> None:
        k_end = self._k_ends[self._layer]
        if self._filled >= k_end:
            self._add(self._v_parts, piece)
        elif self._filled + len(piece) <= k_end:
            self._add(self._k_parts, piece)
        else:
            split = k_end - self._filled
            self._add(self._k_parts, piece[:split])
            self._add(self._v_parts, piece[split:])

    def _add(self, parts: list[memoryview], piece: memoryview) -> None:
        """Keep *piece* of a section. Pieces of one fresh buffer (``get_buffer``) are consecutive in it -- it fills
        in order, and a section's octets are consecutive -- so they join its last part into one view: a section
        received into one buffer is one part, however many deliveries it took."""
        if not self._in_segment:
            parts.append(piece)
            return
        start = self._segment_at
        self._segment_at = end = start + len(piece)
        segment = self._segment
        if parts and parts[-1].obj is segment.obj:
            parts[-1] = segment[start - len(parts[-1]):end]
        else:
            parts.append(piece)

    def _complete_layer(self) -> DecodedLayer:
        assert self.header is not None and self._verifier is not None
        i = self._layer
        digest = self._verifier.check(i, self._hash.digest())
        k_parts: tuple[memoryview, ...]
        v_parts: tuple[memoryview, ...]
        if self._data is not None:
            k_end = self._k_ends[i]
            k_parts, v_parts = (self._data[self._offsets[i]:k_end],), (self._data[k_end:self._end],)
        else:
            k_parts, v_parts = tuple(self._k_parts) or (_EMPTY,), tuple(self._v_parts) or (_EMPTY,)
            self._k_parts, self._v_parts = [], []
        layer = DecodedLayer(self._first + i, k_parts, v_parts, digest)
        self._layer = i = i + 1
        self._hash = hashlib.sha256()
        if i == self._count:
            self.done = True
            self._pending = None
            self._verifier.finish()
            if self._whole is not None:
                self.repr_digest = self._whole.digest()
        else:
            self._end = self._offsets[i + 1]
        return layer


_EMPTY = memoryview(b"")
