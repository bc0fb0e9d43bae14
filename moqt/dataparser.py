"""Sans-I/O incremental parser of one unidirectional data stream (subgroup or fetch), both drafts.

Headers (the stream header, each object header) are parsed atomically: when one is cut by a read boundary, the
parser keeps its first octets (never more than a header's worth plus a small slice of what follows) and resumes on
the next ``feed``. Payload octets are never copied: each ``ObjectReceived`` holds a view of the buffer given to
``feed``, with the offset of that piece in the object, so a 512 KiB object arriving in 64 KiB reads yields eight
views and the application copies each once, into its final place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from enum import Enum

from moqt.data import (
    FETCH_HEADER,
    PADDING_STREAM,
    FetchObjectDecoder,
    ObjectHeader,
    SubgroupHeader,
    decode_subgroup_object,
    is_subgroup_type,
)
from moqt.errors import protocol_violation
from moqt.events import DataStreamOpened, Event, FetchRangeEnded, ObjectReceived, StreamEnded
from moqt.types import Draft, GroupOrder, Location
from moqt.varint import NeedMore, Reader

_SLICE = 4096  # octets of new data appended to a cut header per attempt


class _State(Enum):
    HEADER = 1
    OBJECT = 2
    PAYLOAD = 3
    PADDING = 4
    ENDED = 5


class DataStreamParser:
    """Feed it the octets of a unidirectional stream as they arrive; it returns events.

    *resolve_alias* maps a subgroup stream's track alias to the subscription's request id (None if unknown);
    *fetch_group_order* gives the group order of a fetch we made (draft 18 decodes group ids relative to it);
    *known_fetch* says whether a FETCH_HEADER's request id is one of our fetches (else PROTOCOL_VIOLATION).
    """

    def __init__(self, draft: Draft, stream_id: int, *,
                 resolve_alias: Callable[[int], int | None] | None = None,
                 fetch_group_order: Callable[[int], GroupOrder] | None = None,
                 known_fetch: Callable[[int], bool] | None = None,
                 empty_fetch_status: bool = True) -> None:
        self.draft = draft
        self.stream_id = stream_id
        self._resolve_alias = resolve_alias
        self._fetch_group_order = fetch_group_order
        self._known_fetch = known_fetch
        self._empty_fetch_status = empty_fetch_status
        self._state = _State.HEADER
        self._pending = bytearray()
        self.request_id: int | None = None
        self.track_alias: int | None = None
        self.fetch = False
        self.subgroup_header: SubgroupHeader | None = None
        self._fetch_decoder: FetchObjectDecoder | None = None
        self._last_object: int | None = None
        self._current: ObjectHeader | None = None
        self._offset = 0
        self.objects = 0  # complete objects so far

    @property
    def started(self) -> bool:
        """The stream header has been parsed."""
        return self._state is not _State.HEADER

    @property
    def mid_object(self) -> bool:
        return self._state is _State.PAYLOAD or bool(self._pending)

    def feed(self, data: bytes | bytearray | memoryview, fin: bool = False) -> list[Event]:
        """Parse *data*; with *fin* the stream ends after it. Raises MoqtError on malformed input."""
        if self._state is _State.ENDED:
            if len(data):
                raise protocol_violation("data after the end of a data stream")
            return []
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        out: list[Event] = []
        pos, end = 0, len(view)
        while True:
            state = self._state
            if state is _State.PAYLOAD:
                if pos == end:
                    break
                pos = self._payload(view, pos, out)
            elif state is _State.PADDING:
                pos = end
                break
            else:
                if pos == end and not self._pending:
                    break
                new_pos = self._header_step(view, pos, out)
                if new_pos is None:
                    break
                pos = new_pos
        if fin:
            self._finish(out)
        return out

    # -- payload ----------------------------------------------------------------------------------------------

    def _payload(self, view: memoryview, pos: int, out: list[Event]) -> int:
        obj = self._current
        assert obj is not None
        n = min(obj.length - self._offset, len(view) - pos)
        out.append(self._event(obj, self._offset, view[pos:pos + n]))
        self._offset += n
        if self._offset == obj.length:
            self._object_done()
        return pos + n

    def _event(self, obj: ObjectHeader, offset: int, data: memoryview | bytes) -> ObjectReceived:
        return ObjectReceived(self.stream_id, self.request_id, self.track_alias, obj.group, obj.subgroup,
                              obj.object_id, obj.priority, obj.status, obj.extensions, obj.length, offset, data)

    def _object_done(self) -> None:
        self._current = None
        self._offset = 0
        self.objects += 1
        self._state = _State.OBJECT

    # -- headers ----------------------------------------------------------------------------------------------

    def _header_step(self, view: memoryview, pos: int, out: list[Event]) -> int | None:
        """Parse one header; the position after it in *view*, or None when *view* is used up without one."""
        if not self._pending:
            r = Reader(view, self.draft.vi64, pos)
            try:
                self._parse(r, out)
            except NeedMore:
                self._pending += view[pos:]
                return None
            return r.pos
        while True:
            base = len(self._pending)
            take = min(_SLICE, len(view) - pos)
            self._pending += view[pos:pos + take]
            snapshot = bytes(self._pending)
            r = Reader(snapshot, self.draft.vi64)
            try:
                self._parse(r, out)
            except NeedMore:
                pos += take
                if pos == len(view):
                    return None
                continue
            self._pending.clear()
            return pos + (r.pos - base)

    def _parse(self, r: Reader, out: list[Event]) -> None:
        if self._state is _State.HEADER:
            self._parse_stream_header(r, out)
        else:
            self._parse_object(r, out)

    def _parse_stream_header(self, r: Reader, out: list[Event]) -> None:
        t = r.varint()
        if t == FETCH_HEADER:
            request_id = r.varint()
            if self._known_fetch is not None and not self._known_fetch(request_id):
                raise protocol_violation(f"fetch stream for request {request_id}, which is not one of our fetches")
            order = self._fetch_group_order(request_id) if self._fetch_group_order else GroupOrder.ASCENDING
            self.fetch = True
            self.request_id = request_id
            self._fetch_decoder = FetchObjectDecoder(self.draft, order, empty_status=self._empty_fetch_status)
            self._state = _State.OBJECT
            out.append(DataStreamOpened(self.stream_id, True, request_id))
        elif is_subgroup_type(self.draft, t):
            header = SubgroupHeader.decode_after_type(r, t)
            self.subgroup_header = header
            self.track_alias = header.track_alias
            self.request_id = self._resolve_alias(header.track_alias) if self._resolve_alias else None
            self._state = _State.OBJECT
            out.append(DataStreamOpened(self.stream_id, False, self.request_id, header.track_alias, header.group,
                                        header.subgroup, header.priority, header.end_of_group))
        elif self.draft is Draft.D18 and t == PADDING_STREAM:
            self._state = _State.PADDING
        else:
            raise protocol_violation(f"unknown unidirectional stream type 0x{t:x}")

    def _parse_object(self, r: Reader, out: list[Event]) -> None:
        if self._fetch_decoder is not None:
            item = self._fetch_decoder.decode(r)  # commits its state only on success
            if isinstance(item, tuple):
                loc, unknown = item
                assert self.request_id is not None
                out.append(FetchRangeEnded(self.stream_id, self.request_id, Location(loc.group, loc.object), unknown))
                return
            obj = item
        else:
            header = self.subgroup_header
            assert header is not None
            obj = decode_subgroup_object(r, self.draft, header, self._last_object)
            self._last_object = obj.object_id
            if header.subgroup is None:  # FIRST_OBJECT mode: the subgroup id is this first object's id
                self.subgroup_header = replace(header, subgroup=obj.object_id)
        self._current = obj
        self._offset = 0
        if obj.length == 0:
            out.append(self._event(obj, 0, b""))
            self._object_done()
        else:
            self._state = _State.PAYLOAD

    def _finish(self, out: list[Event]) -> None:
        if self._state is _State.PAYLOAD or self._pending:
            raise protocol_violation("a data stream ended (FIN) in the middle of an object or header")
        if self._state is _State.HEADER:
            self._state = _State.ENDED  # an empty stream: nothing to report
            return
        self._state = _State.ENDED
        out.append(StreamEnded(self.stream_id, self.request_id, self.track_alias))
