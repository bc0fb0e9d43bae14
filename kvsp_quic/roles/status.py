"""Instance status as the Placement Controller holds it (spec, "Instance Status and Lifecycle").

:class:`StatusTable` keeps the latest Instance Status Record of each instance:

* **epochs**: a record with a lower epoch than the highest seen for that instance is discarded
  (:class:`~kvsp_quic.problems.StaleEpoch`, 409 ``kvsp-stale-epoch``); the highest epoch is remembered after the
  record expires, so a restarted instance's predecessor cannot come back;
* **expiry**: a record expires ``ttl_ms`` (capped at ``max_ttl_ms``) after it was received, on the injected
  monotonic clock; an instance whose record has expired counts as failed (:meth:`StatusTable.state` answers
  ``failed``) and gives no estimates;
* **the answer**: the status PUT is answered with ``{"state": s}``, the state the table holds for the instance.
  A :class:`StatePolicy` decides it; the default :class:`EchoPolicy` holds the reported state, which refuses every
  sleep request (``requested_state: "sleeping"`` is answered with the current, active, state). The Placement
  Controller's lifecycle policy (accepting sleep requests with ``draining``, states set by ``PUT state``) plugs in
  here.

The table is in-process: in a deployment with several Index Service processes each holds the statuses reported
to it (docs/wire.md, "Index Service").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ..compat import InstanceState
from ..problems import StaleEpoch
from ..records import InstanceStatusRecord

Clock = Callable[[], float]


@dataclass(frozen=True)
class InstanceStatus:
    """One instance's entry: the last accepted record, the state the table holds, and when it expires."""

    record: InstanceStatusRecord
    state: InstanceState
    received_at: float
    expires_at: float

    @property
    def instance(self) -> str:
        return self.record.instance

    def alive(self, now: float) -> bool:
        return now < self.expires_at


class StatePolicy(Protocol):
    """Decides the state the table holds, and answers, for an accepted status record."""

    def decide(self, record: InstanceStatusRecord, previous: InstanceStatus | None, now: float) -> InstanceState:
        ...


class EchoPolicy:
    """Hold the state the instance reports (no lifecycle policy yet: sleep requests are refused)."""

    def decide(self, record: InstanceStatusRecord, previous: InstanceStatus | None, now: float) -> InstanceState:
        return record.state


class StatusTable:
    def __init__(self, clock: Clock, *, policy: StatePolicy | None = None, max_ttl_ms: int | None = None) -> None:
        if max_ttl_ms is not None and max_ttl_ms < 1:
            raise ValueError("max_ttl_ms must be positive")
        self.clock = clock
        self.policy: StatePolicy = policy or EchoPolicy()
        self.max_ttl_ms = max_ttl_ms
        self._entries: dict[str, InstanceStatus] = {}
        self._epochs: dict[str, int] = {}

    def report(self, record: InstanceStatusRecord) -> InstanceStatus:
        """Accept *record* (or raise StaleEpoch) and return the entry now held."""
        now = self.clock()
        highest = self._epochs.get(record.instance)
        if highest is not None and record.epoch < highest:
            raise StaleEpoch(f"instance {record.instance!r}: epoch {record.epoch} is older than {highest}")
        previous = self.get(record.instance)
        if previous is not None and previous.record.epoch != record.epoch:
            previous = None  # a restarted instance starts afresh
        ttl_ms = record.ttl_ms if self.max_ttl_ms is None else min(record.ttl_ms, self.max_ttl_ms)
        state = self.policy.decide(record, previous, now)
        entry = InstanceStatus(record, state, now, now + ttl_ms / 1000.0)
        self._epochs[record.instance] = record.epoch
        self._entries[record.instance] = entry
        return entry

    def get(self, instance: str) -> InstanceStatus | None:
        """The unexpired entry of *instance*, or None."""
        entry = self._entries.get(instance)
        return entry if entry is not None and entry.alive(self.clock()) else None

    def state(self, instance: str) -> InstanceState | None:
        """The state held for *instance*: ``failed`` once its record has expired, None if never seen."""
        entry = self._entries.get(instance)
        if entry is None:
            return InstanceState.FAILED if instance in self._epochs else None
        return entry.state if entry.alive(self.clock()) else InstanceState.FAILED

    def highest_epoch(self, instance: str) -> int | None:
        return self._epochs.get(instance)

    def live(self) -> Iterator[InstanceStatus]:
        now = self.clock()
        return (e for e in list(self._entries.values()) if e.alive(now))

    def expire(self) -> int:
        """Drop expired entries (their epochs are kept); the number dropped."""
        now = self.clock()
        dead = [i for i, e in self._entries.items() if not e.alive(now)]
        for instance in dead:
            del self._entries[instance]
        return len(dead)

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["EchoPolicy", "InstanceStatus", "StatePolicy", "StatusTable"]
