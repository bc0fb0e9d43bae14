"""The KVSP mapping of a replica onto MOQT (DESIGN.md section 3), sans I/O.

A holder publishes each replica it stores as one track:

* Track Namespace: five fields, ``"kvsp-1"``, compat_id hex, scope_id hex, the publisher's holder-id (of its
  ``https`` base URI), the codec in decimal (:func:`kvsp_quic.records.kvsp_track_namespace`);
* Track Name: the Block Key in lowercase hex (64 ASCII octets);
* group 0; object id = layer index; object payload = the layer's K section followed by its V section, so that
  SHA-256(payload) is the layer digest of the Replica Record.

A complete block, or an inclusive layer range ``a..b``, is retrieved with a standalone FETCH of group 0 from
``Location(0, a)`` to ``Location(0, b + 1)`` (End Location: the last object plus one). Next to each ``https``
Replica Record the holder publishes one whose ``holder`` is its ``moqt://host:port/`` URI and whose
``moqt_namespace`` encodes the five fields (:func:`moqt_record`).

This module has no I/O: names, ranges, request-error codes of both drafts, and :class:`LayerAssembler`, which
turns the pieces of a fetch's objects (:class:`moqt.events.ObjectReceived`) into verified
:class:`~kvsp_quic.container.DecodedLayer` views. The asyncio parts (serving a holder, the fetching client) are in
:mod:`kvsp_moqt.holder_tracks`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from kvsp_quic.compat import Codec, CompatDescriptor
from kvsp_quic.container import ContainerError, DecodedLayer, LayerDigestMismatch, Truncated
from kvsp_quic.keys import holder_id as uri_holder_id
from kvsp_quic.records import (
    KvspNamespace,
    ReplicaRecord,
    decode_moqt_namespace,
    kvsp_track_namespace,
    moqt_record,
)
from moqt.errors import FetchErrorCode14, RequestErrorCode14, RequestErrorCode18
from moqt.events import ObjectReceived
from moqt.types import Draft, Location, Namespace, ObjectStatus, StandaloneFetch

GROUP: Final = 0  # a block's layers are the objects of group 0
MOQT_SCHEME: Final = "moqt"
_HEX64 = re.compile(rb"[0-9a-f]{64}")


class MalformedTrack(ContainerError):
    """The objects of a fetch are not the layers asked for (wrong group, order, length or status; missing)."""


# -- names ---------------------------------------------------------------------------------------------------------


def track_namespace(compat_id: bytes, scope_id: bytes, holder_base_uri: str, codec: int) -> Namespace:
    """The Track Namespace of a replica published by the holder whose ``https`` base URI is *holder_base_uri*."""
    return kvsp_track_namespace(bytes(compat_id), bytes(scope_id), uri_holder_id(holder_base_uri), codec)


def track_name(block_key: bytes) -> bytes:
    """The Track Name of a block: its key in lowercase hex (DESIGN.md section 3)."""
    if len(block_key) != 32:
        raise ValueError("a Block Key has 32 octets")
    return bytes(block_key).hex().encode("ascii")


@dataclass(frozen=True)
class KvspTrack:
    """A track name parsed back into the replica it names."""

    compat_id: bytes
    scope_id: bytes
    holder_id: str
    codec: int
    block_key: bytes


def parse_track(namespace: Namespace, name: bytes) -> KvspTrack | None:
    """The replica a (namespace, track name) names, or None when it is not a KVSP track name."""
    fields = KvspNamespace.parse(namespace)
    if fields is None or not _HEX64.fullmatch(name):
        return None
    compat, scope, holder, codec = fields.compat_id, fields.scope_id, fields.holder_id, fields.codec
    if compat is None or scope is None or holder is None or codec is None or codec > 0xFFFF:
        return None
    return KvspTrack(compat, scope, holder, codec, bytes.fromhex(name.decode()))


def moqt_uri_for(base_uri: str) -> str:
    """``moqt://host:port/`` of a role whose UDP port (that of *base_uri*) serves MOQT next to HTTP/3."""
    parts = urlsplit(base_uri)
    if parts.scheme != "https" or not parts.netloc:
        raise ValueError(f"{base_uri!r} is not an https base URI")
    return f"{MOQT_SCHEME}://{parts.netloc}/"


def moqt_address(uri: str) -> tuple[str, int]:
    """(host, port) of a ``moqt://host:port/`` URI (IPv6 hosts without brackets)."""
    parts = urlsplit(uri)
    if parts.scheme != MOQT_SCHEME or parts.hostname is None:
        raise ValueError(f"{uri!r} is not a moqt:// URI")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{uri!r} has an invalid port") from None
    if port is None:
        raise ValueError(f"{uri!r} names no port (MOQT has no default port)")
    return parts.hostname, port


def record_track(record: ReplicaRecord) -> tuple[Namespace, bytes]:
    """(namespace, track name) of a ``moqt://`` Replica Record."""
    if record.moqt_namespace is None:
        raise ValueError(f"the record of {record.block_key.hex()} at {record.holder} has no moqt_namespace")
    return decode_moqt_namespace(record.moqt_namespace), track_name(record.block_key)


# -- ranges ---------------------------------------------------------------------------------------------------------


def fetch_range(first: int, last: int) -> tuple[Location, Location]:
    """Start and End Location of a FETCH of layers *first*..*last* (inclusive)."""
    if not 0 <= first <= last:
        raise ValueError(f"layers {first}-{last}: need 0 <= first <= last")
    return Location(GROUP, first), Location(GROUP, last + 1)


class InvalidRange(ValueError):
    """A FETCH asks for objects the block does not have."""


def served_range(target: StandaloneFetch, layer_count: int) -> tuple[int, int]:
    """The inclusive layers a holder sends for a standalone FETCH of a block of *layer_count* layers: the requested
    range clipped to group 0 (End Location object 0 means "the whole group"; a later End Location is clipped to the
    last layer, as FETCH_OK's End Location then says). InvalidRange when no layer is in it."""
    start, end = target.start, target.end
    if start.group != GROUP or start.object >= layer_count:
        raise InvalidRange(f"the track has group 0 with objects 0-{layer_count - 1}; the fetch starts at "
                           f"({start.group}, {start.object})")
    whole = end.group > GROUP or end.object == 0
    last = layer_count - 1 if whole else min(end.object - 1, layer_count - 1)
    if last < start.object:
        raise InvalidRange(f"the fetch ends at ({end.group}, {end.object}), before its start")
    return start.object, last


# -- request errors of both drafts ------------------------------------------------------------------------------


def does_not_exist(draft: Draft) -> int:
    """FETCH_ERROR TRACK_DOES_NOT_EXIST (draft 14) / REQUEST_ERROR DOES_NOT_EXIST (draft 18)."""
    return int(FetchErrorCode14.TRACK_DOES_NOT_EXIST if draft is Draft.D14 else RequestErrorCode18.DOES_NOT_EXIST)


def unauthorized(draft: Draft) -> int:
    return int(RequestErrorCode14.UNAUTHORIZED if draft is Draft.D14 else RequestErrorCode18.UNAUTHORIZED)


def invalid_range(draft: Draft) -> int:
    return int(FetchErrorCode14.INVALID_RANGE if draft is Draft.D14 else RequestErrorCode18.INVALID_RANGE)


def not_supported(draft: Draft) -> int:
    return int(RequestErrorCode14.NOT_SUPPORTED if draft is Draft.D14 else RequestErrorCode18.NOT_SUPPORTED)


def internal_error(draft: Draft) -> int:
    return int(RequestErrorCode14.INTERNAL_ERROR if draft is Draft.D14 else RequestErrorCode18.INTERNAL_ERROR)


# -- the receiving side ---------------------------------------------------------------------------------------------


def section_length(record: ReplicaRecord, descriptor: CompatDescriptor | None, payload_length: int) -> int:
    """The K section length of a layer of *record* whose object payload has *payload_length* octets: the
    descriptor's section length for a complete block, or half the payload for codec raw without a descriptor."""
    if descriptor is not None and record.codec == Codec.RAW:
        return descriptor.section_length(descriptor.block_tokens)
    if record.codec == Codec.RAW:
        if payload_length % 2:
            raise MalformedTrack(f"a codec raw layer of {payload_length} octets cannot be K and V of equal length")
        return payload_length // 2
    raise MalformedTrack(f"codec {record.codec}: the K / V split of its objects is unknown")


class LayerAssembler:
    """The objects of one FETCH of layers *first*..*last* of a replica, piece by piece, as verified layers.

    ``feed`` takes each :class:`~moqt.events.ObjectReceived` piece in arrival order and returns the layers it
    completes. It checks the structure as pieces arrive (group 0, object ids ascending from *first* without gaps,
    status NORMAL, the declared length, and -- when *descriptor* is given -- the block's layer length), hashes the
    payload once and compares each complete object's SHA-256 with ``record.layer_digests`` (when *verify*).
    Mismatches raise :class:`~kvsp_quic.container.LayerDigestMismatch`, structure errors :class:`MalformedTrack`;
    ``finish`` raises :class:`~kvsp_quic.container.Truncated` when layers are missing. A layer's K and V are views
    of the received pieces (``k_parts`` / ``v_parts``), nothing is copied.
    """

    def __init__(self, record: ReplicaRecord, first: int, last: int, *,
                 descriptor: CompatDescriptor | None = None, verify: bool = True) -> None:
        if verify and record.layer_digests is None:
            raise ValueError("the record has no layer_digests to verify the objects against")
        if record.layer_digests is not None and last >= len(record.layer_digests):
            raise ValueError(f"layer {last} is beyond the record's {len(record.layer_digests)} layers")
        self.record = record
        self.first, self.last = first, last
        self.descriptor = descriptor
        self.verify = verify
        self.next_layer = first  # the object expected next
        self._expected_length = descriptor.block_layer_length() if descriptor is not None else None
        self._length = 0  # of the object in progress
        self._received = 0
        self._k_length = 0
        self._hash: Any = None
        self._k_parts: list[memoryview] = []
        self._v_parts: list[memoryview] = []

    @property
    def complete(self) -> bool:
        return self.next_layer > self.last

    @property
    def in_object(self) -> bool:
        return self._hash is not None or self._received > 0

    def feed(self, piece: ObjectReceived) -> list[DecodedLayer]:
        if piece.offset == 0 and not self._received:
            self._begin(piece)
        elif piece.object_id != self.next_layer or piece.offset != self._received or piece.length != self._length:
            raise MalformedTrack(f"object piece ({piece.group}, {piece.object_id}) at offset {piece.offset}: "
                                 f"expected layer {self.next_layer} at offset {self._received}")
        data = piece.data if isinstance(piece.data, memoryview) else memoryview(piece.data)
        n = len(data)
        if n:
            if self._hash is not None:
                self._hash.update(data)
            self._keep(data)
            self._received += n
        if self._received < self._length:
            return []
        return [self._complete()]

    def _begin(self, piece: ObjectReceived) -> None:
        if self.complete:
            raise MalformedTrack(f"object ({piece.group}, {piece.object_id}) after the last layer asked for "
                                 f"({self.last})")
        if piece.group != GROUP or piece.object_id != self.next_layer:
            raise MalformedTrack(f"object ({piece.group}, {piece.object_id}) where layer {self.next_layer} of "
                                 f"group 0 was expected")
        if piece.status is not ObjectStatus.NORMAL:
            raise MalformedTrack(f"layer {piece.object_id} has status {piece.status.name}")
        if not piece.length:
            raise MalformedTrack(f"layer {piece.object_id} is empty")
        if self._expected_length is not None and piece.length != self._expected_length:
            raise MalformedTrack(f"layer {piece.object_id} has {piece.length} octets; the block's layers have "
                                 f"{self._expected_length}")
        self._length = piece.length
        self._k_length = section_length(self.record, self.descriptor, piece.length)
        self._hash = hashlib.sha256() if self.verify else None

    def _keep(self, data: memoryview) -> None:
        k_left = self._k_length - self._received
        if k_left <= 0:
            self._v_parts.append(data)
        elif len(data) <= k_left:
            self._k_parts.append(data)
        else:
            self._k_parts.append(data[:k_left])
            self._v_parts.append(data[k_left:])

    def _complete(self) -> DecodedLayer:
        index = self.next_layer
        digest: bytes | None = None
        if self._hash is not None:
            digest = self._hash.digest()
            assert self.record.layer_digests is not None
            expected = bytes(self.record.layer_digests[index])
            if digest != expected:
                raise LayerDigestMismatch(f"layer {index}: SHA-256 {digest.hex()} does not match the record's "
                                          f"{expected.hex()}")
        layer = DecodedLayer(index, tuple(self._k_parts) or (memoryview(b""),),
                             tuple(self._v_parts) or (memoryview(b""),), digest)
        self.next_layer += 1
        self._length = self._received = self._k_length = 0
        self._hash = None
        self._k_parts, self._v_parts = [], []
        return layer

    def finish(self) -> None:
        """The fetch ended: every layer asked for must have arrived, whole."""
        if not self.complete:
            raise Truncated(f"the fetch ended after {self.next_layer - self.first} of "
                            f"{self.last - self.first + 1} layers" + (" (inside a layer)" if self._received else ""))


def check_record(record: ReplicaRecord, layers: tuple[int, int] | None) -> tuple[int, int]:
    """The inclusive layers to fetch from a ``moqt://`` record (all of them when *layers* is None)."""
    if not record.holder.startswith(f"{MOQT_SCHEME}://"):
        raise ValueError(f"{record.holder!r} is not a moqt:// holder")
    count = len(record.layer_digests) if record.layer_digests is not None else \
        max(r.layers[1] for r in record.residency) + 1
    first, last = layers if layers is not None else (0, count - 1)
    if not 0 <= first <= last < count:
        raise ValueError(f"layers {first}-{last}: the replica has layers 0-{count - 1}")
    return first, last


__all__ = [
    "GROUP", "InvalidRange", "KvspTrack", "LayerAssembler", "MalformedTrack", "check_record", "does_not_exist",
    "fetch_range", "internal_error", "invalid_range", "moqt_address", "moqt_record", "moqt_uri_for",
    "not_supported", "parse_track", "record_track", "section_length", "served_range", "track_name",
    "track_namespace", "unauthorized",
]
