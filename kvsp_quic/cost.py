"""The spec's Placement Inputs as pure functions (no I/O, no clock).

Spec, "Placement Inputs"::

    fetch_us(i)     = max over sources s of ( rtt_us(i,s) + 8 * bytes_from(s) / mbit_per_s(i,s) )
                      for blocks not already resident at i
    recompute_us(i) = 1e6 * tokens / prefill_tokens_per_s(i)
    wait_us(i)      = queued(i) * mean service time at i
    cost(i)         = wait_us(i) + min( fetch_us(i) + recompute_us_of_unmatched(i), recompute_us_of_all(i) )

``mbit_per_s(i,s)`` is the link rate instance *i* reports for holder *s*, reduced, for layers the source holds in
a storage tier, to that tier's ``read_mbit_per_s`` in the Replica Record. One megabit per second is one bit per
microsecond, so ``8 * bytes / mbit_per_s`` is in microseconds.

How the inputs are read (docs/wire.md, "Index Service", records these decisions):

* **Resident layers.** A replica whose ``holder`` is the target instance's base URI (exactly) is resident at
  the target, in whatever tier; its layers are not fetched.
* **Layers of a block.** ``layers`` from the Compatibility Descriptor when the caller knows it; otherwise the
  largest of the replicas' ``len(layer_digests)`` (which lists every layer of the block) and their last resident
  layer + 1.
* **Bytes.** ``size`` is the octets of the layers a replica holds, spread evenly over them: fetching layers
  *L* from a replica costs ``size * |L| / (layers it holds)`` octets.
* **Rates.** Per residency entry, ``min(link rate, read_mbit_per_s)`` when the entry states a read rate (a storage
  tier usually does; any tier that states a lower rate than the link is limited the same way), else the link
  rate. A source's transfers are serial: its time is its RTT once plus the sum of its parts' transfer times.
* **Sources.** Only holders the target reports a link to are usable. Blocks are assigned in prefix order,
  each to the usable source that finishes it earliest given what that source already carries (greedy list
  scheduling: sources work in parallel, the slowest one bounds ``fetch_us``). A block whose needed layers no
  single source has is split over several sources, most layers first. A block no usable source can complete
  ends the fetchable prefix: it and every later matched block are recomputed instead, and :func:`estimate`
  adds that recomputation to ``fetch_us`` -- so ``fetch_us + recompute_us_of_unmatched`` stays the cost of the
  "use the cache" branch of ``cost``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvsp_quic.records import InstanceStatusRecord, Link, ReplicaRecord, ResidencyEntry, TargetEstimate

# -- the four formulas ----------------------------------------------------------------------------------------


def transfer_us(octets: float, mbit_per_s: float) -> float:
    """Microseconds to move *octets* at *mbit_per_s* (1 Mbit/s = 1 bit/us)."""
    if mbit_per_s <= 0:
        raise ValueError("a rate must be positive")
    return 8.0 * octets / mbit_per_s


def recompute_us(tokens: int, prefill_tokens_per_s: float) -> float:
    """``1e6 * tokens / prefill_tokens_per_s``."""
    if prefill_tokens_per_s <= 0:
        raise ValueError("prefill_tokens_per_s must be positive")
    return 1e6 * tokens / prefill_tokens_per_s


def wait_us(queued: int, mean_service_us: float) -> float:
    """``queued * mean service time``."""
    return queued * mean_service_us


def cost_us(wait: float, fetch: float, recompute_unmatched: float, recompute_all: float) -> float:
    """``wait + min(fetch + recompute_unmatched, recompute_all)``."""
    return wait + min(fetch + recompute_unmatched, recompute_all)


# -- inputs read from records ---------------------------------------------------------------------------------


def entry_rate(entry: ResidencyEntry, link_mbit_per_s: float) -> float:
    """The rate for layers in *entry*: the link rate, reduced to the tier's read rate when that is lower."""
    read = entry.read_mbit_per_s
    return link_mbit_per_s if read is None else min(link_mbit_per_s, float(read))


def held_layers(replica: ReplicaRecord) -> int:
    return sum(r.layers[1] - r.layers[0] + 1 for r in replica.residency)


def block_layer_count(replicas: Iterable[ReplicaRecord], layers: int | None = None) -> int:
    """The number of layers of a block: *layers* if known, else what its replicas tell."""
    if layers is not None:
        return layers
    n = 0
    for r in replicas:
        n = max(n, len(r.layer_digests) if r.layer_digests is not None else 0,
                max(e.layers[1] for e in r.residency) + 1)
    return n


def part_cost(replica: ReplicaRecord, wanted: set[int], link: Link) -> tuple[float, float, set[int]]:
    """Octets, transfer microseconds (without RTT) and the layers of *wanted* that *replica* provides."""
    per_layer = replica.size / held_layers(replica)
    octets = us = 0.0
    covered: set[int] = set()
    for entry in replica.residency:
        got = wanted.intersection(range(entry.layers[0], entry.layers[1] + 1))
        if got:
            b = per_layer * len(got)
            octets += b
            us += transfer_us(b, entry_rate(entry, link.mbit_per_s))
            covered |= got
    return octets, us, covered


@dataclass
class FetchPlan:
    """What :func:`plan_fetch` decided: ``fetch_us`` (the slowest source's finish time), how many leading
    blocks become resident (already resident or fetched), and per source the octets and finish time."""

    fetch_us: float = 0.0
    blocks: int = 0
    bytes_from: dict[str, float] = field(default_factory=dict)
    finish_us: dict[str, float] = field(default_factory=dict)
    sources: list[list[str]] = field(default_factory=list)  # per block: the sources used (empty: resident)


def plan_fetch(target: str, links: Iterable[Link], blocks: Sequence[Sequence[ReplicaRecord]],
               layers: int | None = None) -> FetchPlan:
    """Assign the matched *blocks* (in prefix order, each a list of replicas) to sources for *target*."""
    by_holder: Mapping[str, Link] = {link.holder: link for link in links}
    plan = FetchPlan()
    finish = plan.finish_us
    for replicas in blocks:
        total = block_layer_count(replicas, layers)
        needed = set(range(total))
        for r in replicas:
            if r.holder == target:
                for entry in r.residency:
                    needed.difference_update(range(entry.layers[0], entry.layers[1] + 1))
        if not needed:
            plan.blocks += 1
            plan.sources.append([])
            continue
        usable = [(r, by_holder[r.holder]) for r in replicas if r.holder != target and r.holder in by_holder]
        assignment = _assign(needed, usable, finish)
        if assignment is None:
            break
        used = []
        for holder, octets, done in assignment:
            finish[holder] = done
            plan.bytes_from[holder] = plan.bytes_from.get(holder, 0.0) + octets
            used.append(holder)
        plan.blocks += 1
        plan.sources.append(used)
    plan.fetch_us = max(finish.values(), default=0.0)
    return plan


def _assign(needed: set[int], usable: list[tuple[ReplicaRecord, Link]],
            finish: Mapping[str, float]) -> list[tuple[str, float, float]] | None:
    """(holder, octets, new finish time) per source for one block, or None when it cannot be completed."""
    best: tuple[float, str, float] | None = None
    for replica, link in usable:  # one source with every needed layer: the one that finishes first
        octets, us, covered = part_cost(replica, needed, link)
        if len(covered) == len(needed):
            done = finish.get(replica.holder, link.rtt_us) + us
            if best is None or done < best[0]:
                best = (done, replica.holder, octets)
    if best is not None:
        return [(best[1], best[2], best[0])]
    remaining = set(needed)
    tentative = dict(finish)
    out: list[tuple[str, float, float]] = []
    while remaining:  # split: the source with the most missing layers, then the earliest finish
        pick: tuple[int, float, str, float, set[int]] | None = None
        for replica, link in usable:
            octets, us, covered = part_cost(replica, remaining, link)
            if not covered:
                continue
            done = tentative.get(replica.holder, link.rtt_us) + us
            if pick is None or (len(covered), -done) > (pick[0], -pick[1]):
                pick = (len(covered), done, replica.holder, octets, covered)
        if pick is None:
            return None
        _, done, holder, octets, covered = pick
        tentative[holder] = done
        out.append((holder, octets, done))
        remaining -= covered
    return out


def estimate(target: str, status: InstanceStatusRecord, blocks: Sequence[Sequence[ReplicaRecord]],
             block_tokens: int, layers: int | None = None) -> TargetEstimate | None:
    """The lookup's per-target estimate: ``fetch_us`` to make the matched blocks resident at *target* (blocks
    past the fetchable prefix counted as recomputed) and ``recompute_us`` to prefill the matched tokens; both
    rounded up to whole microseconds. None when the status has no prefill rate."""
    rate = status.prefill_tokens_per_s
    if not rate:
        return None
    plan = plan_fetch(target, status.links, blocks, layers)
    matched = len(blocks)
    fetch = plan.fetch_us + recompute_us((matched - plan.blocks) * block_tokens, rate)
    return TargetEstimate(target, math.ceil(fetch), math.ceil(recompute_us(matched * block_tokens, rate)))


__all__ = [
    "FetchPlan", "block_layer_count", "cost_us", "entry_rate", "estimate", "held_layers",
    "part_cost", "plan_fetch", "recompute_us", "transfer_us", "wait_us",
]
