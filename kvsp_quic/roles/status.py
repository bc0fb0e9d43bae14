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
  Controller uses :class:`LifecyclePolicy`: a :class:`SleepPolicy` accepts a sleep request (``draining``) or
  refuses it (``active``), and the states the PC decided (draining after an accepted request, sleeping, a state
  it set with ``PUT state`` on the instance: :meth:`StatusTable.set_state`) hold until the PC changes them or the
  instance restarts.

The table is in-process. With a shared control store (``--store redis``), the Placement Controller's adapter writes
every accepted report through to the store and refreshes the table from it (:meth:`StatusTable.replace`), so
every Index Service process sees the statuses reported to any of them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import StaleEpoch
from kvsp_quic.records import InstanceStatusRecord

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


# -- the Placement Controller's lifecycle policy ------------------------------------------------------------------

_ORDER = {InstanceState.ACTIVE: 3, InstanceState.DRAINING: 2, InstanceState.SLEEPING: 1, InstanceState.FAILED: 0}


def least_active(a: InstanceState, b: InstanceState) -> InstanceState:
    """The less active of two states (active > draining > sleeping > failed)."""
    return a if _ORDER[a] <= _ORDER[b] else b


class SleepMode(enum.Enum):
    LOAD = "load"  # accept when the other active instances can take the requester's load
    ALWAYS = "always"  # accept while at least min_active other instances stay active
    NEVER = "never"


@dataclass(frozen=True)
class SleepPolicy:
    """When the PC accepts ``requested_state: "sleeping"`` (spec: "An instance whose load has stayed below a
    configured threshold for a configured time MAY ask to sleep").

    ``load`` (default) accepts when at least ``min_active`` *other* instances are alive and active, and their spare
    capacity -- the sum of ``batch_size - running - queued`` over those whose ``kv_utilization`` is at most
    ``max_kv_utilization`` (an instance that reports no ``batch_size`` has none) -- is at least the requester's
    ``running + queued`` plus ``min_spare``. ``always`` checks only ``min_active``; ``never`` refuses."""

    mode: SleepMode = SleepMode.LOAD
    min_active: int = 1
    min_spare: int = 1
    max_kv_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.min_active < 0 or self.min_spare < 0 or not 0.0 <= self.max_kv_utilization <= 1.0:
            raise ValueError("min_active and min_spare must not be negative; max_kv_utilization is in [0, 1]")

    def accepts(self, record: InstanceStatusRecord, peers: Iterable[InstanceStatus]) -> bool:
        """Whether *record*'s sleep request is accepted, given the other alive active instances *peers*."""
        if self.mode is SleepMode.NEVER:
            return False
        others = [p for p in peers if p.instance != record.instance and p.state is InstanceState.ACTIVE]
        if len(others) < self.min_active:
            return False
        if self.mode is SleepMode.ALWAYS:
            return True
        spare = 0
        for peer in others:
            r = peer.record
            if r.batch_size is None or (r.kv_utilization is not None and r.kv_utilization > self.max_kv_utilization):
                continue
            spare += max(0, r.batch_size - r.running - r.queued)
        return spare >= record.running + record.queued + self.min_spare


class LifecyclePolicy:
    """The Placement Controller's :class:`StatePolicy` (spec, "Instance Status and Lifecycle").

    The state held is the *less active* of the reported state and the state the PC decided for this run (epoch)
    of the instance, so the PC never holds an instance more active than it says it is:

    * a report of ``active`` with ``requested_state: "sleeping"``, while the PC has decided nothing else, asks the
      :class:`SleepPolicy`: accepted -> the PC decides ``draining`` (answered ``{"state": "draining"}``), refused
      -> ``active``;
    * a draining instance completes its sessions and reports ``sleeping``: held ``sleeping`` from then on, and a
      later ``active`` report does not wake it -- "a sleeping instance becomes active only on a state change from
      the PC" (:meth:`StatusTable.set_state` after ``PUT state``);
    * ``failed`` reported is failed; a restart (a higher epoch) forgets what the PC decided.
    """

    def __init__(self, sleep: SleepPolicy | None = None) -> None:
        self.sleep = sleep or SleepPolicy()
        self._decided: dict[str, tuple[int, InstanceState]] = {}  # instance -> (epoch, state the PC decided)
        self._peers: Callable[[], Iterable[InstanceStatus]] = lambda: ()
        self.sleep_accepted = 0
        self.sleep_refused = 0

    def attach(self, table: StatusTable) -> None:
        self._peers = table.live

    def decided(self, instance: str, epoch: int) -> InstanceState | None:
        found = self._decided.get(instance)
        return found[1] if found is not None and found[0] == epoch else None

    def forget(self, instance: str) -> None:
        """Drop what the PC decided for *instance* (a shared store's snapshot says nothing was)."""
        self._decided.pop(instance, None)

    def hold(self, instance: str, epoch: int, state: InstanceState) -> None:
        """The PC decided *state* for this run of *instance* (``PUT state`` on it was answered so)."""
        self._decided[instance] = (epoch, state)

    def decide(self, record: InstanceStatusRecord, previous: InstanceStatus | None, now: float) -> InstanceState:
        reported = record.state
        if reported is InstanceState.FAILED:
            return reported
        pc = self.decided(record.instance, record.epoch)
        if pc is None or pc is InstanceState.ACTIVE:
            if reported is InstanceState.ACTIVE and record.requested_state is InstanceState.SLEEPING:
                if self.sleep.accepts(record, self._peers()):
                    self.sleep_accepted += 1
                    self.hold(record.instance, record.epoch, InstanceState.DRAINING)
                    return InstanceState.DRAINING
                self.sleep_refused += 1
                return InstanceState.ACTIVE
            state: InstanceState = reported
        else:
            state = least_active(reported, pc)
        if state is InstanceState.SLEEPING:
            self.hold(record.instance, record.epoch, state)  # only the PC wakes it
        return state


def endpoint(uri: str) -> tuple[str, int]:
    """(host, port) of an https or moqt URI (443 when absent)."""
    parts = urlsplit(uri)
    return parts.hostname or "", parts.port or 443


class StatusTable:
    def __init__(self, clock: Clock, *, policy: StatePolicy | None = None, max_ttl_ms: int | None = None) -> None:
        if max_ttl_ms is not None and max_ttl_ms < 1:
            raise ValueError("max_ttl_ms must be positive")
        self.clock = clock
        self.policy: StatePolicy = policy or EchoPolicy()
        self.max_ttl_ms = max_ttl_ms
        self._entries: dict[str, InstanceStatus] = {}
        self._epochs: dict[str, int] = {}
        attach = getattr(self.policy, "attach", None)
        if attach is not None:
            attach(self)

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

    def set_state(self, instance: str, state: InstanceState) -> InstanceStatus | None:
        """The PC changed the state of *instance* (``PUT state`` answered *state*): hold it for the instance's
        current run (a :class:`LifecyclePolicy` keeps it across reports). None when the instance has no live
        entry."""
        entry = self.get(instance)
        if entry is None:
            return None
        hold = getattr(self.policy, "hold", None)
        if hold is not None:
            hold(instance, entry.record.epoch, state)
        entry = dataclasses.replace(entry, state=state)
        self._entries[instance] = entry
        return entry

    def replace(self, entries: Iterable[InstanceStatus], epochs: dict[str, int]) -> None:
        """Hold exactly *entries* and *epochs* (a shared store's snapshot: every replica of the PC reads the
        statuses reported to any of them; docs/operations.md, "Replicated Index Service and Placement
        Controller")."""
        self._entries = {e.instance: e for e in entries}
        self._epochs = dict(epochs)

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

    def failed_endpoints(self) -> frozenset[tuple[str, int]]:
        """(host, port) of every instance whose record has expired: its replicas, https or moqt, are unreachable
        until it reports again (a restart reports a newer epoch)."""
        now = self.clock()
        out = set()
        for instance in self._epochs:
            entry = self._entries.get(instance)
            if entry is None or not entry.alive(now):
                out.add(endpoint(instance))
        return frozenset(out)

    def highest_epoch(self, instance: str) -> int | None:
        return self._epochs.get(instance)

    def instances(self) -> list[str]:
        """Every instance that ever reported (alive or not), in order of first report."""
        return list(self._epochs)

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


__all__ = ["EchoPolicy", "InstanceStatus", "LifecyclePolicy", "SleepMode", "SleepPolicy", "StatePolicy", "StatusTable",
           "least_active"]
