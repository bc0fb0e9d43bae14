"""The start hook with a replicated PC (issue 12, point 1: replicas are interchangeable, instances report to any of
them): a request waits for the instance the hook starts even when that instance reports its status to another
replica. Two controller apps on one real redis-server (tests/support/replicated_pc.py's harness).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from tests.redis_server import needs_redis
from tests.support.pc_app import session_body
from tests.support.replicated_pc import Replicas, replicas

pytestmark = needs_redis


class ReportsTo:
    """A start hook whose instance (*name*, a real HTTP/3 instance server) reports its status to replica *pc*."""

    def __init__(self, r: Replicas, pc: str, name: str) -> None:
        self.r, self.pc, self.name = r, pc, name
        self.reasons: list[str] = []
        self.tasks: set[asyncio.Task[object]] = set()

    async def start(self, reason: str) -> None:
        self.reasons.append(reason)

        async def boot() -> None:
            await asyncio.sleep(0.3)
            await self.r.report(self.pc, self.name)

        task = asyncio.create_task(boot())
        self.tasks.add(task)


async def test_a_hook_instance_reporting_to_another_replica_takes_the_request(tmp_path: Path, redis_url: str) -> None:
    async with replicas(tmp_path, redis_url) as r:
        pc1 = r.controllers["pc1"]
        pc1.role.config = dataclasses.replace(pc1.role.config, start_timeout_ms=20_000)
        hook = ReportsTo(r, "pc2", "ic")
        pc1.starter = hook
        started = time.monotonic()
        created = await r.call("pc1", "alice", "POST", "sessions", session_body())  # no instance is active yet
        waited = time.monotonic() - started
        assert created.status == 201, created.content
        assert created.json()["instance"] == r.uris["ic"] and len(hook.reasons) == 1
        assert waited < 10, f"the request waited {waited:.1f} s: the activation at replica 2 went unseen"
        assert [str(s.session) for s in r.instances["ic"].of("start")] == [created.json()["session"]]
        await asyncio.gather(*hook.tasks)
