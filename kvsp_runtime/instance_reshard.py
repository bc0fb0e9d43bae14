"""The asyncio side of resharding at an instance (spec, "Sequence-Sharded Caches and Resharding"): the role's
:class:`~kvsp_quic.roles.instance_reshard.ReshardBook` says which blocks of a plan to retain, fetch and drop;
:class:`Resharding` pins them in the engine's cache, fetches them from the instance named for each range, and lets
them go on commit or abort."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, Generic

from kvsp_quic.auth import Principal
from kvsp_quic.engine import P, PageCache, PrefixUnavailable
from kvsp_quic.problems import PlanConflict, Unavailable
from kvsp_quic.records import ReshardAbort, ReshardCommit, ReshardPlan
from kvsp_quic.roles.instance import InstanceRole, MapState, ReshardContext
from kvsp_runtime.instance_blocks import BlockFinder, BlockLoads, restrict


class Resharding(Generic[P]):
    """Pins of the blocks this instance keeps for its maps (``pins[(map, block index)]``, one cache reference
    each) and the fetches of plans. *finder*: None when the instance has no Index Service (plans that fetch fail)."""

    def __init__(self, role: InstanceRole, cache: PageCache[P], loads: BlockLoads[P],
                 finder: BlockFinder | None) -> None:
        self.role = role
        self.cache = cache
        self.loads = loads
        self.finder = finder
        self.pins: dict[tuple[str, int], P] = {}

    async def handle(self, principal: Principal, msg: ReshardPlan | ReshardCommit | ReshardAbort,
                     context: ReshardContext | None) -> dict[str, Any]:
        """``POST reshard``: a plan (answered once its fetches are in), a commit or an abort; the JSON answer."""
        book = self.role.reshard
        if isinstance(msg, ReshardCommit):
            state, drop = book.commit(msg)
            self.unpin(state.map, drop)
            return {"map": state.map, "version": state.version}
        if isinstance(msg, ReshardAbort):
            state_or_none, discard = book.abort(msg)
            if state_or_none is None:
                return {"map": msg.map, "aborted": msg.abort}
            self.unpin(state_or_none.map, discard)
            return {"map": state_or_none.map, "version": state_or_none.version}
        steps = self.role.plan_reshard(principal, msg, context)
        state = steps.state
        answer = {"map": state.map, "from": msg.from_version, "to": msg.to_version, "acknowledged": True}
        if not steps.new:
            return answer  # the same plan again, its fetches in
        ctx = state.context
        retained = {i: self.cache.lookup(ctx.block_keys[i]) if ctx is not None else None for i in steps.retain
                    if (state.map, i) not in self.pins}
        lost = [i for i, page in retained.items() if page is None]
        if lost:
            book.abort(ReshardAbort(msg.map, msg.to_version))
            raise PlanConflict(f"map {state.map}: block(s) {lost} of the retained ranges are not held here")
        for i, page in retained.items():  # retained ranges keep their memory in place: never transferred
            assert page is not None
            self.pins[(state.map, i)] = self.cache.acquire(page)
        book.retained(state, steps.retain)
        try:
            async with asyncio.timeout(msg.deadline_ms / 1000):
                await self._fetch(state, steps.fetch)
        except (TimeoutError, PrefixUnavailable) as exc:
            detail = "the deadline passed" if isinstance(exc, TimeoutError) else str(exc)
            raise Unavailable(f"map {state.map}: the ranges of version {msg.to_version} are not loaded ({detail}); "
                              f"version {msg.from_version} stays authoritative until a commit or an abort") from None
        book.acknowledge(state)
        return answer

    async def _fetch(self, state: MapState, fetch: Sequence[tuple[int, str]]) -> None:
        ctx = state.context
        if not fetch or ctx is None:
            return
        cache = self.cache
        want = [(i, src) for i, src in fetch if (state.map, i) not in self.pins]
        for i, _src in want:  # resident already
            page = cache.lookup(ctx.block_keys[i])
            if page is not None:
                self.pins[(state.map, i)] = cache.acquire(page)
                self.role.reshard.fetched(state, [i])
        todo = [(i, src) for i, src in want if (state.map, i) not in self.pins]
        if not todo:
            return
        if self.finder is None:
            raise Unavailable("this instance has no Index Service (--index): it cannot load blocks")
        matches = await self.finder.lookup(ctx.compat_id, ctx.scope_id, [ctx.block_keys[i] for i, _ in todo],
                                           skip_gaps=True)
        fetcher = self.finder.fetcher
        waits = []
        for i, src in todo:
            key = bytes(ctx.block_keys[i])
            match = matches.get(key)
            match = restrict(match, [src]) if match is not None else None
            if match is None:
                raise PrefixUnavailable(f"block {i} ({key.hex()}) is not published by {src}")
            load = self.loads.get(key)
            if load is None:
                load = self.loads.start(key, fetcher.fetch_layers(match, lease_ms=None), ctx.scope_id)
            load.interest += 1
            waits.append((i, key, load))
        try:
            for i, key, load in waits:
                await load.wait()
                page = cache.lookup(key)
                if page is None:
                    raise PrefixUnavailable(f"block {i} ({key.hex()}) could not be loaded from its instance")
                self.pins[(state.map, i)] = cache.acquire(page)
                self.role.reshard.fetched(state, [i])
        finally:
            for _i, _key, load in waits:
                load.interest -= 1

    def unpin(self, map_id: str, blocks: Iterable[int]) -> None:
        for i in blocks:
            page = self.pins.pop((map_id, i), None)
            if page is not None:
                self.cache.release(page)

    def release_all(self) -> None:
        """Let every pin go (the service stops)."""
        for page in self.pins.values():
            with contextlib.suppress(ValueError):
                self.cache.release(page)
        self.pins.clear()


__all__ = ["Resharding"]
