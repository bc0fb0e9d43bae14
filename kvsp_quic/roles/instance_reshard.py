"""The instance's side of sequence-sharded caches (spec, "Sequence-Sharded Caches and Resharding"): the map
versions and plans of the contexts it holds shards of, with commit / abort exactly as the spec orders them. Which
blocks to keep, fetch and drop is returned to the caller (the instance's asyncio service pins, loads and unpins
them). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvsp_quic import fields as f
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.problems import BadRequest, PlanConflict
from kvsp_quic.records import Record, ReshardAbort, ReshardCommit, ReshardPlan, TokenRange, wire


@dataclass(frozen=True)
class ReshardContext(Record):
    """*(extension)* ``"context"`` of a reshard plan: the blocks of the map's context, so that the instance can
    name the token ranges it fetches (block i covers tokens [i*B, (i+1)*B)). KVSP plans carry token ranges only."""

    compat_id: CompatId = wire(f.compat_id)
    scope_id: ScopeId = wire(f.scope_id)
    block_keys: tuple[BlockKey, ...] = wire(lambda v, p: f.array(v, p, f.block_key, nonempty=True))

    def extends(self, other: ReshardContext) -> bool:
        """Whether this is *other*'s context, grown or the same (its Block Keys start with *other*'s)."""
        n = len(other.block_keys)
        return ((self.compat_id, self.scope_id) == (other.compat_id, other.scope_id)
                and len(self.block_keys) >= n and self.block_keys[:n] == other.block_keys)


@dataclass
class MapState:
    map: str
    version: int  # the version authoritative at this instance
    context: ReshardContext | None = None
    held: set[int] = field(default_factory=set)  # block indexes this instance keeps for the map (pinned)
    plan: ReshardPlan | None = None  # the plan of version + 1 being prepared
    fetched: set[int] = field(default_factory=set)  # blocks loaded for the plan (discarded on abort)
    acknowledged: bool = False  # every fetch of the plan is in


@dataclass(frozen=True)
class PlanSteps:
    """What the caller does for a plan: make *retain* blocks resident and keep them (they must not move),
    fetch *fetch* blocks from their instance."""

    state: MapState
    retain: tuple[int, ...]
    fetch: tuple[tuple[int, str], ...]  # (block index, the instance to fetch it from)
    new: bool  # False: the same plan again (idempotent), nothing to do


class ReshardBook:
    """Map versions and plans of the contexts this instance holds shards of (spec, "Sequence-Sharded Caches and
    Resharding"). Token ranges are handled as the complete blocks they cover: a range must start on a block
    boundary and end on one (or at the end of the context, whose partial last block has no key)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.maps: dict[str, MapState] = {}

    def blocks_of(self, tokens: TokenRange, context: ReshardContext | None, what: str) -> range:
        a, b = tokens
        bt = self.block_tokens
        total = len(context.block_keys) * bt if context is not None else None
        if a % bt:
            raise BadRequest(f"{what} [{a}, {b}): ranges start on a block boundary (block_tokens {bt})")
        if b % bt and (total is None or b < total):
            raise BadRequest(f"{what} [{a}, {b}): ranges end on a block boundary (block_tokens {bt})")
        last = b // bt if total is None else min(b // bt, len(context.block_keys)) if context else b // bt
        return range(a // bt, last)

    def plan(self, plan: ReshardPlan, context: ReshardContext | None) -> PlanSteps:
        state = self.maps.get(plan.map)
        if state is None:
            state = MapState(plan.map, plan.from_version, context)
            self.maps[plan.map] = state
        if context is not None and (state.context is None or context.extends(state.context)):
            state.context = context  # the first, or the context grew (a longer one is never cut back)
        elif context is not None and state.context is not None and not state.context.extends(context):
            raise PlanConflict(f"map {plan.map}: the plan names another context than before (a context may only "
                               "grow)")
        if state.plan is not None:
            if state.plan == plan:
                return PlanSteps(state, (), (), False)
            raise PlanConflict(f"map {plan.map}: a plan to version {state.plan.to_version} is in progress")
        if state.version != plan.from_version:
            raise PlanConflict(f"map {plan.map}: this instance holds version {state.version}, the plan moves from "
                               f"{plan.from_version}")
        if (plan.fetch or plan.retain) and state.context is None:
            what = "fetch" if plan.fetch else "retain"
            raise BadRequest(f"{what}: this instance needs the plan's context (extension member 'context': "
                             "compat_id, scope_id, block_keys) to name the blocks of the ranges it retains and "
                             "fetches")
        retain = tuple(i for r in plan.retain for i in self.blocks_of(r, state.context, "retain"))
        fetch = tuple((i, x.source) for x in plan.fetch for i in self.blocks_of(x.tokens, state.context, "fetch"))
        for r in plan.release:
            self.blocks_of(r, state.context, "release")
        state.plan = plan
        state.fetched = set()
        state.acknowledged = False
        return PlanSteps(state, retain, fetch, True)

    def retained(self, state: MapState, blocks: Iterable[int]) -> None:
        state.held.update(blocks)

    def fetched(self, state: MapState, blocks: Iterable[int]) -> None:
        state.fetched.update(blocks)

    def acknowledge(self, state: MapState) -> None:
        state.acknowledged = True

    def commit(self, msg: ReshardCommit) -> tuple[MapState, set[int]]:
        """Version ``commit`` becomes authoritative; returns the blocks to let go (``release`` of the plan)."""
        state = self.maps.get(msg.map)
        if state is None:
            raise PlanConflict(f"no plan for map {msg.map} at this instance")
        if state.plan is None:
            if state.version == msg.commit:
                return state, set()  # committed already
            raise PlanConflict(f"map {msg.map}: no plan to version {msg.commit} (version {state.version} holds)")
        if state.plan.to_version != msg.commit:
            raise PlanConflict(f"map {msg.map}: the plan in progress moves to {state.plan.to_version}, not "
                               f"{msg.commit}")
        if not state.acknowledged:
            raise PlanConflict(f"map {msg.map}: the fetches of version {msg.commit} are not complete here")
        plan = state.plan
        state.held |= state.fetched
        drop: set[int] = set()
        for r in plan.release:
            drop.update(self.blocks_of(r, state.context, "release"))
        keep = {i for r in plan.retain for i in self.blocks_of(r, state.context, "retain")}
        keep |= {i for x in plan.fetch for i in self.blocks_of(x.tokens, state.context, "fetch")}
        drop -= keep
        state.held -= drop
        state.version = msg.commit
        state.plan = None
        state.fetched = set()
        return state, drop

    def abort(self, msg: ReshardAbort) -> tuple[MapState | None, set[int]]:
        """Version ``abort`` is abandoned; returns the blocks fetched for it (to discard). Version v stays."""
        state = self.maps.get(msg.map)
        if state is None:
            return None, set()
        if state.plan is None:
            if state.version == msg.abort:
                raise PlanConflict(f"map {msg.map}: version {msg.abort} was committed here")
            return state, set()  # nothing in progress: aborted already
        if state.plan.to_version != msg.abort:
            raise PlanConflict(f"map {msg.map}: the plan in progress moves to {state.plan.to_version}, not "
                               f"{msg.abort}")
        discard = state.fetched - state.held
        state.plan = None
        state.fetched = set()
        state.acknowledged = False
        return state, discard


__all__ = ["MapState", "PlanSteps", "ReshardBook", "ReshardContext"]
