"""The relay's object store: one :class:`TrackFetch` per upstream FETCH, shared by every downstream FETCH it covers
while it runs (coalescing) and kept afterwards in the byte-budgeted LRU :class:`RelayCache`.

A :class:`TrackFetch` is the :class:`~moqt.aio.FetchSink` of the upstream FETCH: each piece of each object is
appended as it is dispatched (a view of the received octets, not copied) and the downstream writers -- one task
per downstream FETCH, each at its own pace -- are woken once per event-loop turn. So the first octet of layer 0
goes downstream as soon as it arrives (cut-through), never after the whole block (store-and-forward), and a slow
subscriber holds back nobody but itself.

Locations are compared as keys: ``(group, object)``, with :data:`WHOLE` as the object of an End Location whose
object is 0 ("the entire group", in FETCH and FETCH_OK alike).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moqt import events as ev
from moqt.types import KeyValuePairs, Location, Namespace, ObjectStatus

if TYPE_CHECKING:
    from moqt.aio import FetchStream
    from moqt.types import Draft

WHOLE = 1 << 64  # the object of an end key meaning "to the end of the group"
Key = tuple[int, int]
TrackKey = tuple[Namespace, bytes]


class MalformedFetch(ValueError):
    """The upstream's objects are not in order (a relay forwards no malformed track)."""


def start_key(location: Location) -> Key:
    return (location.group, location.object)


def end_key(location: Location) -> Key:
    """The exclusive end of a FETCH / FETCH_OK End Location (object 0: the entire group)."""
    return (location.group, WHOLE) if location.object == 0 else (location.group, location.object)


def end_location(key: Key) -> Location:
    return Location(key[0], 0) if key[1] == WHOLE else Location(key[0], key[1])


@dataclass
class RelayObject:
    """One object of a fetch, as its pieces arrive."""

    group: int
    object_id: int
    subgroup: int | None
    priority: int | None
    status: ObjectStatus
    extensions: KeyValuePairs
    length: int
    base: int = 0  # payload octets of the fetch before this object
    parts: list[memoryview | bytes] = field(default_factory=list)
    received: int = 0

    @property
    def complete(self) -> bool:
        return self.received >= self.length

    @property
    def key(self) -> Key:
        return (self.group, self.object_id)


class TrackFetch:
    """One upstream FETCH of ``[start, end)`` of a track and what it has brought so far (see the module docstring).
    The relay creates it, resolves its upstream and starts the FETCH with this object as the sink."""

    def __init__(self, namespace: Namespace, track_name: bytes, start: Key, end: Key) -> None:
        self.namespace = namespace
        self.track_name = track_name
        self.start = start
        self.end = end
        self.objects: list[RelayObject] = []
        self.accepted: ev.FetchAccepted | None = None
        self.ended = False  # the upstream data stream ended with FIN
        self.error: BaseException | None = None
        self.size = 0  # payload octets held
        self.origin: object = None  # what the upstream directory said of its upstream (moqt.relay.Upstream.origin)
        self.stream: FetchStream | None = None
        self.upstream = ""  # who serves it, for logs and status
        self.upstream_draft: Draft | None = None
        self.owner: str | None = None  # the principal whose request started it (its octets count against it)
        self.created = time.monotonic()
        self.last_activity = self.created
        self.first_piece_at: float | None = None
        self.downstreams = 0  # downstream FETCHes served from it (while in flight and from the cache)
        self.active = 0  # downstream FETCHes being written from it now
        self.pacing = True  # credit the upstream as the fastest downstream takes the octets (see progress)
        self.held = 0  # upstream payload octets not yet credited back
        self.taken = 0  # the most payload octets one downstream has taken
        self._waiter: asyncio.Future[None] | None = None
        self._notify_pending = False

    @property
    def key(self) -> TrackKey:
        return (self.namespace, self.track_name)

    @property
    def complete(self) -> bool:
        """Every object of the upstream range arrived whole (FIN after FETCH_OK) and nothing failed."""
        return self.ended and self.accepted is not None and self.error is None and \
            all(o.complete for o in self.objects[-1:])

    @property
    def finished(self) -> bool:
        return self.complete or self.error is not None

    def covers(self, start: Key, end: Key) -> bool:
        return self.start <= start and end <= self.end

    # -- the FetchSink side ---------------------------------------------------------------------------------------

    def fetch_accepted(self, event: ev.FetchAccepted) -> None:
        self.accepted = event
        self._touch()

    def fetch_piece(self, piece: ev.ObjectReceived) -> bool:
        if self.error is not None:
            return False
        last = self.objects[-1] if self.objects else None
        if piece.offset == 0 and (last is None or last.complete):
            if last is not None and (piece.group, piece.object_id) <= last.key:
                self.fetch_failed(MalformedFetch(f"object ({piece.group}, {piece.object_id}) after "
                                                 f"({last.group}, {last.object_id})"))
                return False
            last = RelayObject(piece.group, piece.object_id, piece.subgroup, piece.priority, piece.status,
                               piece.extensions, piece.length, self.size)
            self.objects.append(last)
        elif last is None or last.complete or piece.object_id != last.object_id or piece.offset != last.received:
            self.fetch_failed(MalformedFetch(f"piece of object ({piece.group}, {piece.object_id}) at offset "
                                             f"{piece.offset} out of order"))
            return False
        n = len(piece.data)
        if n:
            last.parts.append(piece.data)
            last.received += n
            self.size += n
        if self.first_piece_at is None:
            self.first_piece_at = time.monotonic()
        self._touch()
        if self.active and self.pacing and n:  # credit goes back as the fastest downstream takes the octets
            self.held += n
            return True
        return False

    def fetch_ended(self) -> None:
        self.ended = True
        self._touch()

    def fetch_failed(self, error: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self._touch()

    # -- pacing the upstream by the fastest downstream -----------------------------------------------------------

    def attach(self) -> None:
        """A downstream FETCH starts taking objects from this fetch."""
        self.active += 1

    def progress(self, position: int) -> None:
        """A downstream has taken the fetch's payload up to octet *position*: what no downstream had taken before
        is credited back to the upstream (so the upstream runs at most a stream window ahead of the fastest
        downstream, and the relay's time goes to forwarding, not to ingesting far ahead)."""
        if position > self.taken:
            self._release(position - self.taken)
            self.taken = position

    def detach(self) -> None:
        self.active -= 1
        if self.active <= 0:  # nobody is reading: let the upstream finish (into the cache) at full speed
            self._release(self.held)

    def stop_pacing(self) -> None:
        """Credit everything held and hold nothing more (the downstreams have stopped taking octets)."""
        self.pacing = False
        self._release(self.held)

    def _release(self, n: int) -> None:
        n = min(n, self.held)
        if n:
            self.held -= n
            if self.stream is not None:
                self.stream.release(n)

    # -- waking the writers ---------------------------------------------------------------------------------------

    def _touch(self) -> None:
        self.last_activity = time.monotonic()
        if not self._notify_pending and self._waiter is not None:
            self._notify_pending = True
            self._waiter.get_loop().call_soon(self._notify)

    def _notify(self) -> None:
        self._notify_pending = False
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def changed(self) -> None:
        """Until something arrives (a piece, FETCH_OK, the end, a failure). Cancelling one waiter leaves the
        others waiting."""
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        await asyncio.wait((self._waiter,))


class RelayCache:
    """Completed upstream fetches by track, least recently used first, within *budget* payload octets. A newer
    fetch of a track replaces the older; *on_evict* hears of every entry that leaves (evicted or replaced)."""

    def __init__(self, budget: int, *, on_evict: Callable[[TrackFetch], None] | None = None) -> None:
        if budget < 0:
            raise ValueError("the cache budget cannot be negative")
        self.budget = budget
        self.size = 0
        self.on_evict = on_evict
        self._entries: collections.OrderedDict[TrackKey, TrackFetch] = collections.OrderedDict()
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: TrackKey, start: Key, end: Key) -> TrackFetch | None:
        """The cached fetch of *key* covering ``[start, end)`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None or not entry.covers(start, end):
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def peek(self, key: TrackKey) -> TrackFetch | None:
        return self._entries.get(key)

    def put(self, fetch: TrackFetch) -> bool:
        """Keep a completed fetch (evicting the least recently used as needed); False when it exceeds the budget
        alone (it is not kept)."""
        if not fetch.complete:
            raise ValueError("only complete fetches are cached")
        old = self._entries.pop(fetch.key, None)
        if old is not None:
            self.size -= old.size
            if old is not fetch and self.on_evict is not None:
                self.on_evict(old)
        if fetch.size > self.budget:
            return False
        while self._entries and self.size + fetch.size > self.budget:
            _, victim = self._entries.popitem(last=False)
            self.size -= victim.size
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim)
        self._entries[fetch.key] = fetch
        self.size += fetch.size
        return True

    def remove(self, key: TrackKey) -> TrackFetch | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.size -= entry.size
        return entry

    def entries(self) -> list[TrackFetch]:
        return list(self._entries.values())


__all__ = ["WHOLE", "Key", "MalformedFetch", "RelayCache", "RelayObject", "TrackFetch", "TrackKey", "end_key",
           "end_location", "start_key"]
