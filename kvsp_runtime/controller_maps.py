"""The Placement Controller's shard maps and their resharding, the asyncio side (split from
:mod:`kvsp_runtime.controller_service`, which delegates ``get_map``, ``has_map``, ``put_map`` and ``reshard`` here).

The rules are the role's (:mod:`kvsp_quic.roles.controller_reshard`: plans, the decision, the outcome); this
fans the plans out to the members with their deadline, then the commit or abort, and keeps the maps in the control
store (a lock per map, across replicas when it is shared; the role's ``maps`` are the copies read from it before
each decision). Plans carry each map's ``context`` (extension, docs/wire.md "Resharding"), kept with the map in the
store (so a reshard asked of any replica sends the context given to another). A ``PUT maps/{map}`` that registers
the map or runs a reshard with a context makes it the map's from then on, whether the reshard commits or aborts
(instances keep a grown context either way); a refused one (409) changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from kvsp_quic.problems import PlanConflict
from kvsp_quic.records import ReshardCommit, ShardMap
from kvsp_quic.roles.controller import PlacementController
from kvsp_quic.roles.controller_reshard import (
    ReshardContext,
    ReshardMessage,
    ReshardOutcome,
    context_bytes,
    context_of,
    with_context,
)
from kvsp_quic.storage.control_store import ControlStore


class ReshardLink(Protocol):
    """The part of :class:`kvsp_runtime.controller_link.InstanceLink` resharding uses."""

    async def reshard(self, instance: str, message: ReshardMessage, timeout: float | None = None) -> None: ...


def why(exc: BaseException) -> str:
    """An exception as one line for a report: its type and message."""
    return f"{type(exc).__name__}: {exc}"


class ShardMaps:
    """The shard maps of one PC replica (see the module docstring)."""

    def __init__(self, role: PlacementController, link: ReshardLink, store: ControlStore, replica: str) -> None:
        self.role = role
        self.link = link
        self.store = store
        self.replica = replica

    async def _pull_map(self, map_id: str) -> None:
        found = await self.store.get_map(map_id)
        if found is not None:
            self.role.maps[map_id] = found
        else:
            self.role.maps.pop(map_id, None)

    async def get_map(self, map_id: str) -> ShardMap:
        await self._pull_map(map_id)
        return self.role.shard_map(map_id)

    async def has_map(self, map_id: str) -> bool:
        await self._pull_map(map_id)
        return map_id in self.role.maps

    async def put_map(self, shard_map: ShardMap, context: ReshardContext | None = None) -> ReshardOutcome:
        """Register a new map with its *context* (409 when the map exists: nothing changes)."""
        existing = await self.store.add_map(shard_map, context_bytes(context) if context is not None else None)
        if existing is not None:
            self.role.maps[shard_map.map] = existing
        else:
            self.role.maps.pop(shard_map.map, None)
        return self.role.register_map(shard_map)

    async def context(self, map_id: str, given: ReshardContext | None) -> ReshardContext | None:
        """The context the plans of a reshard of *map_id* carry: *given* with the PUT (it becomes the map's, in the
        store), else the map's."""
        if given is not None:
            await self.store.set_map_context(map_id, context_bytes(given))
            return given
        stored = await self.store.map_context(map_id)
        return context_of(stored) if stored is not None else None

    async def reshard(self, new: ShardMap, deadline_ms: int | None = None,
                      context: ReshardContext | None = None) -> ReshardOutcome:
        """Move a map from version v to v+1 = ``new.version``: send every member its plan; when all acknowledged
        (200, after loading their fetch ranges) within the deadline, commit to all members, otherwise abort to
        all members (the role decides, and keeps the authoritative version). Plans carry *context* when the PUT
        gave one, else the map's (:meth:`context`): docs/wire.md "Resharding"."""
        deadline = deadline_ms or self.role.config.reshard_deadline_ms
        if not await self.store.lock_map(new.map, self.replica, 3 * deadline + 5000):
            raise PlanConflict(f"a reshard of map {new.map!r} is in progress")
        try:
            await self._pull_map(new.map)
            return await self._reshard(new, deadline_ms, context)
        finally:
            with contextlib.suppress(Exception):
                await self.store.unlock_map(new.map, self.replica)

    async def _reshard(self, new: ShardMap, deadline_ms: int | None,
                       context: ReshardContext | None) -> ReshardOutcome:
        round_ = self.role.begin_reshard(new, deadline_ms)  # PlanConflict (409) or NotFound: nothing changed
        everyone = round_.members
        acknowledged: list[str] = []
        failed: dict[str, str] = {}
        undelivered: dict[str, str] = {}
        try:
            deadline = round_.deadline_s
            plans = with_context(round_.plans, await self.context(new.map, context))
            tasks = {asyncio.create_task(self.link.reshard(i, plans[i], deadline)): i for i in everyone}
            done, pending = await asyncio.wait(tasks, timeout=deadline, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:
                task.cancel()
                failed[tasks[task]] = f"no acknowledgement within {round_.deadline_ms} ms"
            for task in done:
                exc = task.exception()
                if exc is None:
                    acknowledged.append(tasks[task])
                else:
                    failed[tasks[task]] = why(exc)
            if pending:
                await asyncio.wait(pending)
                for task in pending:
                    if not task.cancelled():
                        task.exception()  # retrieved: it is reported in failed already
            message = self.role.decide_reshard(round_, failed)
            if isinstance(message, ReshardCommit) and not await self.store.commit_map(round_.old.version, round_.new):
                failed["controller"] = "the map changed at another replica of the PC"
                self.role.maps[new.map] = round_.old
                message = self.role.decide_reshard(round_, failed)
            results = await asyncio.gather(*(self.link.reshard(i, message) for i in everyone),
                                           return_exceptions=True)
            for instance, result in zip(everyone, results, strict=True):
                if isinstance(result, BaseException):
                    undelivered[instance] = why(result)
        finally:
            self.role.end_reshard(round_)
        return self.role.reshard_outcome(round_, acknowledged, failed, undelivered)


__all__ = ["ShardMaps", "why"]
