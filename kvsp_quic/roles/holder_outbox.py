"""A holder's outbox of publish / withdraw intents for its Replica Records (spec: "Publishing and Withdrawing
Replicas"): the latest wanted state per replica, due times, retries with backoff. Pure bookkeeping; the holder
(:mod:`kvsp_quic.roles.holder`) fills it, ``kvsp_runtime/publisher.py`` drains it."""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvsp_quic.records import ReplicaRecord
from kvsp_quic.storage.tiers import BlockId


class IntentKind(enum.Enum):
    PUBLISH = "publish"  # PUT {index}replicas/{holder-id}/{block_key} with the record
    WITHDRAW = "withdraw"  # DELETE {index}replicas/{holder-id}/{block_key}


@dataclass(frozen=True)
class Intent:
    """One request the publisher should send to the Index Service, then report with :meth:`Holder.intent_done`."""

    kind: IntentKind
    block: BlockId
    version: int
    taken_at: float
    record: ReplicaRecord | None = None  # for PUBLISH

    @property
    def block_key(self) -> str:
        return self.block.block_key.hex()


@dataclass
class _Entry:
    desired: IntentKind
    due: float
    version: int = 0
    in_flight: bool = False
    sent: bool = False  # something went out: the Index Service may hold a record
    attempts: int = 0


class ReplicaOutbox:
    """The latest wanted state (published / withdrawn) per replica, with due times; newer intents supersede.

    A withdraw of a replica that was never sent is dropped (there is nothing to withdraw). A publish that
    succeeds is due again a third of its TTL after it was taken (refresh); failures are retried with
    exponential backoff; a change while a request is in flight is sent as soon as that request completes.
    """

    def __init__(self, backoff: tuple[float, float] = (0.5, 30.0)) -> None:
        self._entries: dict[BlockId, _Entry] = {}
        self._heap: list[tuple[float, int, BlockId]] = []
        self._seq = itertools.count()
        self._backoff = backoff
        self.wakeup: Callable[[], None] | None = None  # called when something becomes due now

    def __len__(self) -> int:
        return len(self._entries)

    def state(self, block: BlockId) -> tuple[IntentKind, float, bool] | None:
        """(wanted state, due time, in flight) of *block*, for tests and diagnostics."""
        e = self._entries.get(block)
        return (e.desired, e.due, e.in_flight) if e is not None else None

    def _schedule(self, block: BlockId, entry: _Entry, due: float) -> None:
        entry.due = due
        heapq.heappush(self._heap, (due, next(self._seq), block))

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup()

    def _want(self, block: BlockId, kind: IntentKind, now: float) -> None:
        entry = self._entries.get(block)
        if entry is None:
            entry = self._entries[block] = _Entry(kind, now)
        entry.desired = kind
        entry.version += 1
        entry.attempts = 0
        if not entry.in_flight:
            self._schedule(block, entry, now)
        self._wake()

    def publish(self, block: BlockId, now: float) -> None:
        self._want(block, IntentKind.PUBLISH, now)

    def withdraw(self, block: BlockId, now: float) -> bool:
        """Want *block* withdrawn; False when nothing was ever sent for it (nothing to withdraw, entry gone)."""
        entry = self._entries.get(block)
        if entry is None or (not entry.sent and not entry.in_flight):
            self._entries.pop(block, None)
            return False
        self._want(block, IntentKind.WITHDRAW, now)
        return True

    def withdraw_stale(self, block: BlockId, now: float) -> None:
        """Want withdrawn a record this holder may have published before it restarted (it cannot serve it now)."""
        entry = self._entries.get(block)
        if entry is None:
            entry = self._entries[block] = _Entry(IntentKind.WITHDRAW, now)
        entry.sent = True
        self._want(block, IntentKind.WITHDRAW, now)

    def take_due(self, now: float, limit: int) -> list[tuple[IntentKind, BlockId, int]]:
        out: list[tuple[IntentKind, BlockId, int]] = []
        while self._heap and self._heap[0][0] <= now and len(out) < limit:
            due, _seq, block = heapq.heappop(self._heap)
            entry = self._entries.get(block)
            if entry is None or entry.in_flight or entry.due != due:
                continue  # superseded
            entry.in_flight = True
            entry.sent = True
            out.append((entry.desired, block, entry.version))
        return out

    def next_due(self) -> float | None:
        while self._heap:
            due, _seq, block = self._heap[0]
            entry = self._entries.get(block)
            if entry is not None and not entry.in_flight and entry.due == due:
                return due
            heapq.heappop(self._heap)
        return None

    def complete(self, block: BlockId, kind: IntentKind, version: int, ok: bool, now: float,
                 refresh_at: float | None = None) -> bool:
        """Report a taken intent; True when *block* is now withdrawn (its entry is gone)."""
        entry = self._entries.get(block)
        if entry is None or not entry.in_flight:
            return False
        entry.in_flight = False
        if not ok:
            entry.attempts += 1
            delay = min(self._backoff[0] * 2 ** (entry.attempts - 1), self._backoff[1])
            self._schedule(block, entry, now + delay)
            return False
        if entry.version != version:  # changed while in flight: send the new state now
            self._schedule(block, entry, now)
            self._wake()
            return False
        entry.attempts = 0
        if kind is IntentKind.WITHDRAW:
            del self._entries[block]
            return True
        self._schedule(block, entry, refresh_at if refresh_at is not None else now)
        return False


__all__ = ["Intent", "IntentKind", "ReplicaOutbox"]
