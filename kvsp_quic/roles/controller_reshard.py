"""Resharding plans (spec, "Sequence-Sharded Caches and Resharding"): pure functions, no I/O.

:func:`plan_reshard` turns a Shard Map change from version v to v+1 into one ``POST reshard`` plan per instance
of either version:

* ``retain``: the parts of the instance's new ranges that it already held in version v. A token range assigned
  to the same instance in both versions is always retained, never fetched ("Retained ranges keep their memory in
  place, so a change of parallelism costs no transfer for them");
* ``fetch``: the parts of its new ranges that another instance held in version v, each ``from`` that instance;
* ``release``: the ranges it held in version v and does not hold in v+1 (released after the commit).

Parts of a new range that no instance held in version v (the context grew) are in neither list: the instance
computes them. Adjacent ranges are merged (fetches only when they come from the same instance). An instance only
in version v gets a plan with ``release`` only, so that every member hears of the change and of its outcome.

Plans name token ranges only; an instance names the blocks of the ranges it retains and fetches from the map's
context (*(extension)* ``"context"``: Compatibility ID, scope and the context's Block Keys, docs/wire.md
"Resharding"). The PC learns it with the map (``PUT maps/{map}``) and sends it with every plan: a
:class:`ContextPlan`. With a shared control store it is stored with the map (:func:`context_bytes`,
:func:`context_of`), so that every replica of the PC sends it.

A reshard in progress is a :class:`ReshardRound` (the plans, who must acknowledge by when); what it came to is a
:class:`ReshardOutcome` with a :class:`ReshardResult`. The fan-out itself is the adapter's
(``kvsp_runtime.controller_service.ControllerService.reshard``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from kvsp_quic.problems import PlanConflict
from kvsp_quic.records import ReshardAbort, ReshardCommit, ReshardFetch, ReshardPlan, ShardMap, TokenRange, wire
from kvsp_quic.roles.instance_reshard import ReshardContext

ReshardMessage = ReshardPlan | ReshardCommit | ReshardAbort


@dataclass(frozen=True)
class ContextPlan(ReshardPlan):
    """A reshard plan with the extension member ``"context"`` (the map's context, whose Block Keys name the blocks
    of its token ranges: block i covers tokens [i*B, (i+1)*B)); without it an instance refuses a plan that fetches
    (400) and cannot find the blocks of the ranges it retains."""

    context: ReshardContext | None = wire(ReshardContext.read, default=None)


def with_context(plans: Mapping[str, ReshardPlan], context: ReshardContext | None) -> dict[str, ReshardPlan]:
    """*plans* carrying *context* (as they are when the PC does not know the map's context)."""
    if context is None:
        return dict(plans)
    return {i: ContextPlan(p.map, p.from_version, p.to_version, p.deadline_ms, p.retain, p.fetch, p.release,
                           context) for i, p in plans.items()}


def context_bytes(context: ReshardContext) -> bytes:
    """A map's context as a shared control store keeps it (its JSON, as the plans carry it)."""
    return orjson.dumps(context.to_json())


def context_of(data: bytes) -> ReshardContext:
    """The context :func:`context_bytes` encoded."""
    return ReshardContext.from_json(orjson.loads(data), "context")


def owners(shard_map: ShardMap, tokens: TokenRange) -> list[tuple[TokenRange, str | None]]:
    """*tokens* split by the instance holding each part in *shard_map* (None: outside the map)."""
    a, b = tokens
    out: list[tuple[TokenRange, str | None]] = []
    cursor = a
    for shard in shard_map.shards:
        s0, s1 = shard.tokens
        lo, hi = max(cursor, s0), min(b, s1)
        if lo >= hi:
            continue
        if lo > cursor:
            out.append(((cursor, lo), None))
        out.append(((lo, hi), shard.instance))
        cursor = hi
    if cursor < b:
        out.append(((cursor, b), None))
    return out


def subtract(ranges: Iterable[TokenRange], minus: Iterable[TokenRange]) -> list[TokenRange]:
    """The parts of *ranges* outside every range of *minus* (half-open ranges)."""
    cut = sorted(minus)
    out: list[TokenRange] = []
    for a, b in sorted(ranges):
        cursor = a
        for c, d in cut:
            if d <= cursor or c >= b:
                continue
            if c > cursor:
                out.append((cursor, c))
            cursor = max(cursor, d)
        if cursor < b:
            out.append((cursor, b))
    return merge(out)


def merge(ranges: Iterable[TokenRange]) -> list[TokenRange]:
    out: list[TokenRange] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _merge_fetches(fetches: list[ReshardFetch]) -> list[ReshardFetch]:
    out: list[ReshardFetch] = []
    for fetch in sorted(fetches, key=lambda x: x.tokens):
        if out and out[-1].tokens[1] == fetch.tokens[0] and out[-1].source == fetch.source:
            out[-1] = ReshardFetch((out[-1].tokens[0], fetch.tokens[1]), fetch.source)
        else:
            out.append(fetch)
    return out


def members(*maps: ShardMap) -> list[str]:
    """The instances of the maps, in order of first appearance."""
    return list(dict.fromkeys(s.instance for m in maps for s in m.shards))


def plan_reshard(old: ShardMap, new: ShardMap, deadline_ms: int) -> dict[str, ReshardPlan]:
    """The plan of every instance in *old* or *new* (by instance base URI, in order of first appearance).

    Raises :class:`~kvsp_quic.problems.PlanConflict` unless *new* is the same map at version ``old.version + 1``.
    """
    if new.map != old.map:
        raise PlanConflict(f"map {new.map!r} is not map {old.map!r}")
    if new.version != old.version + 1:
        raise PlanConflict(f"map {old.map!r} is at version {old.version}; a plan moves it to {old.version + 1}, "
                           f"not {new.version}")
    plans: dict[str, ReshardPlan] = {}
    for instance in members(old, new):
        retain: list[TokenRange] = []
        fetch: list[ReshardFetch] = []
        mine = new.instance_ranges(instance)
        for tokens in mine:
            for part, owner in owners(old, tokens):
                if owner == instance:
                    retain.append(part)
                elif owner is not None:
                    fetch.append(ReshardFetch(part, owner))
        release = subtract(old.instance_ranges(instance), mine)
        plans[instance] = ReshardPlan(old.map, old.version, new.version, deadline_ms, tuple(merge(retain)),
                                      tuple(_merge_fetches(fetch)), tuple(release))
    return plans


class ReshardResult(enum.Enum):
    """What ``PUT maps/{map}`` came to (the value is the ``outcome`` member of its answer and the metric label)."""

    REGISTERED = "registered"  # a new map, at its version
    COMMITTED = "committed"  # every member acknowledged: v+1 is authoritative
    ABORTED = "aborted"  # a member did not acknowledge by the deadline: v stays


@dataclass(frozen=True)
class ReshardRound:
    """A reshard of ``old`` (version v) to ``new`` (v+1) under way: every member's plan, in order of first
    appearance, to be acknowledged within ``deadline_ms``."""

    old: ShardMap
    new: ShardMap
    deadline_ms: int
    plans: Mapping[str, ReshardPlan]

    @property
    def members(self) -> list[str]:
        return list(self.plans)

    @property
    def deadline_s(self) -> float:
        return self.deadline_ms / 1000

    def decision(self, failed: Mapping[str, str]) -> ReshardCommit | ReshardAbort:
        """Commit when no member failed to acknowledge, abort otherwise."""
        if failed:
            return ReshardAbort(self.new.map, self.new.version)
        return ReshardCommit(self.new.map, self.new.version)


@dataclass(frozen=True)
class ReshardOutcome:
    """What a reshard did. ``version`` is the authoritative version afterwards; ``failed`` says why each member that
    did not acknowledge did not, ``undelivered`` the members the commit / abort did not reach."""

    map: str
    version: int
    result: ReshardResult
    acknowledged: tuple[str, ...] = ()
    failed: Mapping[str, str] | None = None
    undelivered: Mapping[str, str] | None = None

    @property
    def committed(self) -> bool:
        return self.result is ReshardResult.COMMITTED

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"map": self.map, "version": self.version, "outcome": self.result.value}
        if self.result is not ReshardResult.REGISTERED:
            out.update(acknowledged=list(self.acknowledged), failed=dict(self.failed or {}),
                       undelivered=dict(self.undelivered or {}))
        return out


__all__ = ["ContextPlan", "ReshardContext", "ReshardMessage", "ReshardOutcome", "ReshardResult", "ReshardRound",
           "context_bytes", "context_of", "members", "merge", "owners", "plan_reshard", "subtract", "with_context"]
