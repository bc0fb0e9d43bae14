"""Placement policies of the Placement Controller (spec: "Placement Inputs"): which active instance takes a session.

A :class:`PlacementPolicy` orders the candidate instances of one session, best first, as :class:`Choice` records;
the controller (:mod:`kvsp_quic.roles.controller`) tries them in that order. Policies are chosen by name from
:data:`PLACEMENT_POLICIES` (``ControllerConfig.placement_policy``), like the tiers' eviction policies;
:func:`register_placement_policy` adds one. The default, ``"cost"`` (:class:`CostPolicy`), ranks by the spec's
cost (:func:`rank`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvsp_quic import cost
from kvsp_quic.policy_registry import PolicyRegistry
from kvsp_quic.records import LookupResponse
from kvsp_quic.roles.status import InstanceStatus


@dataclass(frozen=True)
class Choice:
    """One candidate instance as a policy saw it. ``cost_us`` is None when the instance reports no prefill rate
    (the cost policy ranks it after every instance with a cost)."""

    instance: str
    cost_us: float | None
    use_cache: bool  # loading the matched blocks beats recomputing them (or nothing tells otherwise)
    has_capacity: bool  # running + queued (+ assigned since its last report) < batch_size, or no batch_size
    load: int
    fetch_us: float | None = None
    recompute_us: float | None = None  # of all tokens


@dataclass(frozen=True)
class PlacementInput:
    """What a policy ranks for one session: the alive active *candidates*, the Index Service's *lookup* of the
    prompt's Block Keys with them as targets (None: no keys), the tokens to prefill and to decode, the block size
    of the compat_id (None: no geometry known), and *pending*: sessions assigned per instance since its last
    status report."""

    candidates: tuple[InstanceStatus, ...]
    lookup: LookupResponse | None
    tokens: int
    max_tokens: int
    block_tokens: int | None
    pending: Mapping[str, int]


class PlacementPolicy(Protocol):
    """Orders the candidates of one placement, the best first. Pure: no I/O, no clock."""

    def rank(self, placement: PlacementInput) -> list[Choice]: ...


def rank(candidates: Iterable[InstanceStatus], lookup: LookupResponse | None, tokens: int, max_tokens: int,
         block_tokens: int | None, pending: Mapping[str, int] | None = None) -> list[Choice]:
    """The candidates by the spec's cost, cheapest first (ties: lower load, then base URI).

    ``cost = wait_us + min(fetch_us + recompute_us_of_unmatched, recompute_us_of_all)`` with ``fetch_us`` from the
    lookup's estimate for the instance, ``recompute_us`` at its ``prefill_tokens_per_s``, and ``wait_us = queued *
    mean service time``, where *queued* counts the sessions the PC assigned since the instance's last report too
    (*pending*), and the mean service time is taken to be this request's: prefilling *tokens* plus decoding
    *max_tokens* at ``decode_tokens_per_s``. Without an estimate for the instance (no geometry known for the
    compat_id, nothing matched) the cost is ``wait_us + recompute_us_of_all``.
    """
    pending = pending or {}
    estimates = {t.instance: t for t in (lookup.targets or ())} if lookup is not None else {}
    matched = lookup.matched if lookup is not None else 0
    matched_tokens = min(tokens, matched * block_tokens) if block_tokens is not None else None
    out: list[Choice] = []
    for entry in candidates:
        r = entry.record
        queued = r.queued + pending.get(entry.instance, 0)
        load = r.running + queued
        capacity = r.batch_size is None or load < r.batch_size
        rate = r.prefill_tokens_per_s
        if not rate:
            out.append(Choice(entry.instance, None, matched > 0, capacity, load))
            continue
        recompute_all = cost.recompute_us(tokens, rate)
        decode = 1e6 * max_tokens / r.decode_tokens_per_s if r.decode_tokens_per_s else 0.0
        wait = cost.wait_us(queued, recompute_all + decode)
        est = estimates.get(entry.instance)
        if est is None or matched_tokens is None:
            out.append(Choice(entry.instance, wait + recompute_all, matched > 0, capacity, load, None,
                              recompute_all))
            continue
        unmatched = cost.recompute_us(tokens - matched_tokens, rate)
        total = cost.cost_us(wait, est.fetch_us, unmatched, recompute_all)
        use_cache = matched > 0 and est.fetch_us + unmatched < recompute_all
        out.append(Choice(entry.instance, total, use_cache, capacity, load, float(est.fetch_us), recompute_all))
    out.sort(key=lambda c: (c.cost_us is None, c.cost_us or 0.0, c.load, c.instance))
    return out


class CostPolicy:
    """The default policy: the spec's cost, cheapest first (:func:`rank`)."""

    def rank(self, placement: PlacementInput) -> list[Choice]:
        return rank(placement.candidates, placement.lookup, placement.tokens, placement.max_tokens,
                    placement.block_tokens, placement.pending)


PLACEMENT_POLICIES: dict[str, Callable[[], PlacementPolicy]] = {"cost": CostPolicy}


_PLACEMENT = PolicyRegistry("placement", PLACEMENT_POLICIES)


def register_placement_policy(name: str, factory: Callable[[], PlacementPolicy]) -> None:
    """Make a policy available by *name* (lowercase) to configurations."""
    _PLACEMENT.register(name, factory)


def placement_policy(name: str) -> PlacementPolicy:
    """A new instance of the policy registered as *name*; ``ValueError`` naming the known ones otherwise."""
    return _PLACEMENT.create(name)


__all__ = ["PLACEMENT_POLICIES", "Choice", "CostPolicy", "PlacementInput", "PlacementPolicy", "placement_policy",
           "rank", "register_placement_policy"]
