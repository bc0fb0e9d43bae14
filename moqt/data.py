"""The data plane's wire formats: stream headers, object headers on subgroup and fetch streams, datagrams.

Only headers are built here; payloads are sent as the application's own buffers right after them (no copy).

Draft differences:

* SUBGROUP_HEADER types: draft 14 uses 0x10-0x15 and 0x18-0x1D (bits: 0x01 extensions, 0x06 subgroup id mode,
  0x08 end of group); draft 18 adds 0x20 DEFAULT_PRIORITY (no priority octet) and 0x40 FIRST_OBJECT (0b0XX1XXXX).
  Mode 0b11 is invalid in both.
* Fetch objects: draft 14 writes every field (group, subgroup, object, priority, extensions length, payload length,
  status when empty); draft 18 starts each object with Serialization Flags and writes group / object ids as deltas
  from the previous object (direction by group order), may omit the subgroup and priority, and has End of Range
  markers (0x8C: objects do not exist; 0x10C: unknown status).
* Datagrams: draft 14 types 0x00-0x07 (payload) and 0x20-0x21 (status); draft 18 types 0b00X0XXXX with
  DEFAULT_PRIORITY 0x08 and STATUS 0x20 bits (STATUS together with END_OF_GROUP is invalid), and padding datagrams.
* Object status: draft 14 has DOES_NOT_EXIST (0x1), which may carry no extensions; draft 18 drops it and allows
  properties only on NORMAL objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from moqt.errors import protocol_violation
from moqt.types import (
    OBJECT_STATUSES,
    Draft,
    GroupOrder,
    KeyValuePairs,
    Location,
    ObjectStatus,
    check_kvps,
    decode_kvp_block,
    encode_kvp_block,
)
from moqt.varint import Reader, Writer, varint_max

FETCH_HEADER: Final = 0x05
SETUP_STREAM: Final = 0x2F00  # draft 18: a control stream begins with its SETUP message
PADDING_STREAM: Final = 0x132B3E28  # draft 18
PADDING_DATAGRAM: Final = 0x132B3E29  # draft 18
MAX_EXTENSIONS: Final = 1 << 20  # refuse an object extension block larger than this (octets)

END_OF_NONEXISTENT_RANGE: Final = 0x8C
END_OF_UNKNOWN_RANGE: Final = 0x10C


class SubgroupIdMode(IntEnum):
    ZERO = 0  # no field; the subgroup id is 0
    FIRST_OBJECT = 1  # no field; the subgroup id is the first object's id
    EXPLICIT = 2  # the field is present


def is_subgroup_type(draft: Draft, t: int) -> bool:
    if draft is Draft.D14:
        return 0x10 <= t <= 0x1D and (t >> 1) & 3 != 3
    return t < 0x80 and t & 0x10 == 0x10 and (t >> 1) & 3 != 3


@dataclass(frozen=True)
class SubgroupHeader:
    track_alias: int
    group: int
    subgroup: int | None = 0  # None only when decoding FIRST_OBJECT mode (known once the first object arrives)
    priority: int | None = 128  # None: draft 18 DEFAULT_PRIORITY (the subscription's publisher priority)
    extensions: bool = False  # every object carries an extensions length
    end_of_group: bool = False  # the last object before FIN is the last of the group
    mode: SubgroupIdMode | None = None  # None: ZERO for subgroup 0, EXPLICIT otherwise
    first_object: bool = False  # draft 18: the stream starts with the subgroup's first object

    @property
    def id_mode(self) -> SubgroupIdMode:
        if self.mode is not None:
            return self.mode
        return SubgroupIdMode.ZERO if self.subgroup == 0 else SubgroupIdMode.EXPLICIT

    def type_code(self, draft: Draft) -> int:
        t = 0x10 | (self.id_mode << 1)
        if self.extensions:
            t |= 0x01
        if self.end_of_group:
            t |= 0x08
        if self.priority is None or self.first_object:
            if draft is Draft.D14:
                raise ValueError("draft 14 subgroup headers always carry a priority and have no FIRST_OBJECT bit")
            t |= (0x20 if self.priority is None else 0) | (0x40 if self.first_object else 0)
        return t

    def encode(self, draft: Draft) -> bytes:
        w = Writer(draft.vi64)
        w.varint(self.type_code(draft))
        w.varint(self.track_alias)
        w.varint(self.group)
        if self.id_mode is SubgroupIdMode.EXPLICIT:
            if self.subgroup is None:
                raise ValueError("an explicit subgroup id is needed")
            w.varint(self.subgroup)
        if self.priority is not None:
            w.uint8(self.priority)
        return w.getvalue()

    @classmethod
    def decode_after_type(cls, r: Reader, t: int) -> SubgroupHeader:
        alias, group = r.varint(), r.varint()
        mode = SubgroupIdMode((t >> 1) & 3)
        subgroup: int | None = 0
        if mode is SubgroupIdMode.EXPLICIT:
            subgroup = r.varint()
        elif mode is SubgroupIdMode.FIRST_OBJECT:
            subgroup = None
        priority = None if t & 0x20 else r.uint8()
        return cls(alias, group, subgroup, priority, bool(t & 0x01), bool(t & 0x08), mode, bool(t & 0x40))


def encode_fetch_header(draft: Draft, request_id: int) -> bytes:
    w = Writer(draft.vi64)
    w.varint(FETCH_HEADER)
    w.varint(request_id)
    return w.getvalue()


def check_status(draft: Draft, status: int, has_extensions: bool) -> ObjectStatus:
    """A received object's status; extensions are allowed on NORMAL objects (draft 18) or all but DOES_NOT_EXIST
    (draft 14). Raises PROTOCOL_VIOLATION."""
    if status not in OBJECT_STATUSES[draft]:
        raise protocol_violation(f"object status 0x{status:x} is not defined in draft {draft.value}")
    st = ObjectStatus(status)
    if has_extensions and (st is ObjectStatus.DOES_NOT_EXIST or (draft is Draft.D18 and st is not ObjectStatus.NORMAL)):
        raise protocol_violation(f"an object with status {st.name} cannot carry extensions")
    return st


def _check_object(draft: Draft, length: int, status: ObjectStatus, extensions: KeyValuePairs) -> None:
    if status not in OBJECT_STATUSES[draft]:
        raise ValueError(f"status {status.name} does not exist in draft {draft.value}")
    if status is not ObjectStatus.NORMAL and length:
        raise ValueError("only NORMAL objects have a payload")
    if extensions:
        check_kvps(extensions)
        if status is ObjectStatus.DOES_NOT_EXIST or (draft is Draft.D18 and status is not ObjectStatus.NORMAL):
            raise ValueError(f"an object with status {status.name} cannot carry extensions")


def _put_length_status(w: Writer, length: int, status: ObjectStatus) -> None:
    w.varint(length)
    if length == 0:
        w.varint(status)


# -- Subgroup objects -------------------------------------------------------------------------------------------


class SubgroupObjectEncoder:
    """Object headers of one subgroup stream (ids ascend; each is written as a delta from the previous one)."""

    def __init__(self, draft: Draft, extensions: bool) -> None:
        self.draft = draft
        self.extensions = extensions
        self.last_object_id: int | None = None

    def encode(self, object_id: int, length: int, *, status: ObjectStatus = ObjectStatus.NORMAL,
               extensions: KeyValuePairs = ()) -> bytes:
        _check_object(self.draft, length, status, extensions)
        if extensions and not self.extensions:
            raise ValueError("this subgroup stream's header has no extensions bit")
        prev = self.last_object_id
        if prev is not None and object_id <= prev:
            raise ValueError(f"object {object_id} does not follow object {prev} on this subgroup stream")
        w = Writer(self.draft.vi64)
        w.varint(object_id if prev is None else object_id - prev - 1)
        if self.extensions:
            encode_kvp_block(w, extensions, delta=self.draft.vi64)
        _put_length_status(w, length, status)
        self.last_object_id = object_id
        return w.getvalue()


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    """A decoded object header (any stream kind); the payload of ``length`` octets follows."""

    group: int
    subgroup: int | None
    object_id: int
    priority: int | None
    status: ObjectStatus
    extensions: KeyValuePairs
    length: int


def decode_subgroup_object(r: Reader, draft: Draft, header: SubgroupHeader, prev: int | None) -> ObjectHeader:
    delta = r.varint()
    object_id = delta if prev is None else prev + delta + 1
    if object_id > varint_max(draft.vi64):
        raise protocol_violation("object id delta runs past the largest object id")
    extensions = decode_kvp_block(r, delta=draft.vi64, limit=MAX_EXTENSIONS) if header.extensions else ()
    length = r.varint()
    status = check_status(draft, r.varint() if length == 0 else 0, bool(extensions))
    subgroup = header.subgroup if header.subgroup is not None else object_id
    return ObjectHeader(header.group, subgroup, object_id, header.priority, status, extensions, length)


# -- Fetch objects --------------------------------------------------------------------------------------------------


class FetchObjectEncoder:
    """Object headers of one fetch stream. Draft 18 writes each object relative to the previous one, so the
    encoder remembers it; ``group_order`` is the order the fetch delivers groups in (the FETCH's, ascending if it
    left the choice to the publisher). ``empty_status``: see ``SessionConfig.fetch_empty_object_status``."""

    def __init__(self, draft: Draft, group_order: GroupOrder = GroupOrder.ASCENDING, *,
                 empty_status: bool = True) -> None:
        self.draft = draft
        self.descending = group_order is GroupOrder.DESCENDING
        self.empty_status = empty_status
        self._group: int | None = None
        self._object: int | None = None
        self._subgroup: int | None = None
        self._priority: int | None = None

    def encode(self, group: int, object_id: int, length: int, *, subgroup: int | None = 0, priority: int = 128,
               status: ObjectStatus = ObjectStatus.NORMAL, extensions: KeyValuePairs = ()) -> bytes:
        """``subgroup`` None: an object whose forwarding preference is Datagram."""
        _check_object(self.draft, length, status, extensions)
        self._check_order(group, object_id)
        w = Writer(self.draft.vi64)
        if self.draft is Draft.D14:
            w.varint(group)
            w.varint(object_id if subgroup is None else subgroup)
            w.varint(object_id)
            w.uint8(priority)
            encode_kvp_block(w, extensions, delta=False)
            _put_length_status(w, length, status)
        else:
            self._encode18(w, group, object_id, length, subgroup, priority, status, extensions)
        self._group, self._object = group, object_id
        return w.getvalue()

    def end_of_range(self, location: Location, *, unknown: bool = False) -> bytes:
        """Draft 18: the objects after the previous one up to *location* do not exist (or are unknown)."""
        if self.draft is Draft.D14:
            raise ValueError("End of Range markers exist in draft 18 only")
        self._check_order(location.group, location.object)
        w = Writer(True)
        w.varint(END_OF_UNKNOWN_RANGE if unknown else END_OF_NONEXISTENT_RANGE)
        location.encode(w)
        self._group, self._object = location.group, location.object
        return w.getvalue()

    def _check_order(self, group: int, object_id: int) -> None:
        if self._group is None or self._object is None:
            return
        if group == self._group:
            if object_id <= self._object:
                raise ValueError(f"object {group}/{object_id} does not follow {self._group}/{self._object}")
        elif (group < self._group) != self.descending:
            raise ValueError(f"group {group} is out of the fetch's group order after {self._group}")

    def _encode18(self, w: Writer, group: int, object_id: int, length: int, subgroup: int | None, priority: int,
                  status: ObjectStatus, extensions: KeyValuePairs) -> None:
        flags = 0
        fields = Writer(True)
        new_group = self._group is None or group != self._group
        if new_group:
            flags |= 0x08
            if self._group is None:
                fields.varint(group)
            else:
                fields.varint((self._group - group if self.descending else group - self._group) - 1)
        if subgroup is None:
            flags |= 0x40
        elif subgroup == 0:
            pass
        elif self._subgroup is not None and subgroup == self._subgroup:
            flags |= 0x01
        elif self._subgroup is not None and subgroup == self._subgroup + 1:
            flags |= 0x02
        else:
            flags |= 0x03
            fields.varint(subgroup)
        if new_group or self._object is None:
            flags |= 0x04
            fields.varint(object_id)
        elif object_id != self._object + 1:
            flags |= 0x04
            fields.varint(object_id - self._object)
        if self._priority is None or priority != self._priority:
            flags |= 0x10
            fields.uint8(priority)
        if extensions:
            flags |= 0x20
            encode_kvp_block(fields, extensions, delta=True)
        w.varint(flags)
        w.octets(fields.buf)
        w.varint(length)
        if length == 0 and self.empty_status:
            w.varint(status)
        elif length == 0 and status is not ObjectStatus.NORMAL:
            raise ValueError("without empty_status a draft 18 fetch object cannot carry a status")
        if subgroup is not None:
            self._subgroup = subgroup
        self._priority = priority


class FetchObjectDecoder:
    """Decodes the objects of one fetch stream (the mirror of :class:`FetchObjectEncoder`)."""

    def __init__(self, draft: Draft, group_order: GroupOrder = GroupOrder.ASCENDING, *,
                 empty_status: bool = True) -> None:
        self.draft = draft
        self.descending = group_order is GroupOrder.DESCENDING
        self.empty_status = empty_status
        self.group: int | None = None
        self.object: int | None = None
        self.subgroup: int | None = None
        self.priority: int | None = None

    def decode(self, r: Reader) -> ObjectHeader | tuple[Location, bool]:
        """One object header, or an End of Range (location, unknown). Commits state only on success."""
        if self.draft is Draft.D14:
            group, subgroup, object_id, priority = r.varint(), r.varint(), r.varint(), r.uint8()
            extensions = decode_kvp_block(r, delta=False, limit=MAX_EXTENSIONS)
            length = r.varint()
            status = check_status(self.draft, r.varint() if length == 0 else 0, bool(extensions))
            return ObjectHeader(group, subgroup, object_id, priority, status, extensions, length)
        flags = r.varint()
        if flags in (END_OF_NONEXISTENT_RANGE, END_OF_UNKNOWN_RANGE):
            loc = Location.decode(r)
            self.group, self.object = loc.group, loc.object
            return loc, flags == END_OF_UNKNOWN_RANGE
        if flags >= 0x80:
            raise protocol_violation(f"fetch serialization flags 0x{flags:x} are not defined")
        return self._decode18(r, flags)

    def _decode18(self, r: Reader, flags: int) -> ObjectHeader:
        top = varint_max(True)
        group = self.group
        if flags & 0x08:
            delta = r.varint()
            if group is None:
                group = delta
            else:
                group = group - delta - 1 if self.descending else group + delta + 1
                if not 0 <= group <= top:
                    raise protocol_violation("the group id delta leaves the range of group ids")
        elif group is None:
            raise protocol_violation("the first fetch object refers to a previous object's group")
        subgroup: int | None = None
        if not flags & 0x40:
            mode = flags & 0x03
            if mode == 3:
                subgroup = r.varint()
            elif mode == 0:
                subgroup = 0
            elif self.subgroup is None:
                raise protocol_violation("a fetch object refers to a previous object's subgroup")
            else:
                subgroup = self.subgroup + mode - 1
        if flags & 0x04:
            delta = r.varint()
            object_id = delta if (flags & 0x08 or self.object is None) else self.object + delta
        elif self.object is None:
            raise protocol_violation("the first fetch object refers to a previous object's id")
        else:
            object_id = self.object + 1
        if object_id > top:
            raise protocol_violation("the object id leaves the range of object ids")
        if flags & 0x10:
            priority = r.uint8()
        elif self.priority is None:
            raise protocol_violation("a fetch object refers to a previous object's priority")
        else:
            priority = self.priority
        extensions = decode_kvp_block(r, delta=True, limit=MAX_EXTENSIONS) if flags & 0x20 else ()
        length = r.varint()
        status = 0
        if length == 0 and self.empty_status:
            status = r.varint()
        st = check_status(self.draft, status, bool(extensions))
        self.group, self.object, self.priority = group, object_id, priority
        if subgroup is not None:
            self.subgroup = subgroup
        return ObjectHeader(group, subgroup, object_id, priority, st, extensions, length)


# -- Datagrams ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectDatagram:
    track_alias: int
    group: int
    object_id: int
    payload: bytes | memoryview = b""
    priority: int | None = 128  # None: draft 18 DEFAULT_PRIORITY
    status: ObjectStatus | None = None  # None: a payload datagram; otherwise a status datagram (no payload)
    extensions: KeyValuePairs = ()
    end_of_group: bool = False

    def encode(self, draft: Draft) -> bytes:
        if self.status is not None:
            if self.payload or self.end_of_group:
                raise ValueError("a status datagram carries neither payload nor END_OF_GROUP")
            _check_object(draft, 0, self.status, self.extensions)
        elif self.extensions:
            check_kvps(self.extensions)
        t = 0x01 if self.extensions else 0
        if self.status is not None:
            t |= 0x20
        elif self.end_of_group:
            t |= 0x02
        omit_id = self.object_id == 0 and (self.status is None or draft is Draft.D18)
        if omit_id:
            t |= 0x04
        if self.priority is None:
            if draft is Draft.D14:
                raise ValueError("draft 14 datagrams always carry a priority")
            t |= 0x08
        w = Writer(draft.vi64)
        w.varint(t)
        w.varint(self.track_alias)
        w.varint(self.group)
        if not omit_id:
            w.varint(self.object_id)
        if self.priority is not None:
            w.uint8(self.priority)
        if self.extensions:
            encode_kvp_block(w, self.extensions, delta=draft.vi64)
        if self.status is not None:
            w.varint(self.status)
        else:
            w.octets(self.payload)
        return w.getvalue()


_DATAGRAM_TYPE_VALID: Final = {
    Draft.D14: lambda t: t <= 0x07 or t in (0x20, 0x21),
    Draft.D18: lambda t: t & ~0x2F == 0 and not (t & 0x20 and t & 0x02),  # STATUS with END_OF_GROUP is invalid
}


def decode_datagram(draft: Draft, data: bytes | memoryview) -> ObjectDatagram | None:
    """A whole datagram; None for a draft 18 padding datagram. Raises MoqtError (NeedMore if truncated)."""
    r = Reader(data, draft.vi64)
    t = r.varint()
    if draft is Draft.D18 and t == PADDING_DATAGRAM:
        return None
    if not _DATAGRAM_TYPE_VALID[draft](t):
        raise protocol_violation(f"datagram type 0x{t:x} is not defined in draft {draft.value}")
    is_status = bool(t & 0x20)
    alias, group = r.varint(), r.varint()
    object_id = 0 if t & 0x04 else r.varint()
    priority = None if t & 0x08 else r.uint8()
    extensions: KeyValuePairs = ()
    if t & 0x01:
        extensions = decode_kvp_block(r, delta=draft.vi64, limit=MAX_EXTENSIONS)
        if not extensions:
            raise protocol_violation("a datagram with the extensions bit has an empty extension block")
    if is_status:
        status = check_status(draft, r.varint(), bool(extensions))
        if not r.at_end():
            raise protocol_violation("octets after a status datagram's status")
        return ObjectDatagram(alias, group, object_id, b"", priority, status, extensions)
    check_status(draft, 0, bool(extensions))
    return ObjectDatagram(alias, group, object_id, r.view(r.remaining), priority, None, extensions, bool(t & 0x02))
