"""Replicated Index Service + Placement Controller on one real redis-server (issue 12, points 1 and 3).

Two controller apps (two replicas, each its own RoleServer, certificate and role) share a
:class:`~kvsp_quic.storage.redis_control.RedisControlStore`; the instances are the real HTTP/3 servers of
tests/support/pc_app.py's :class:`FakeInstance`. Also: the atomic epoch increment against real Redis, and
``kvsp-quic index`` refusing a wrong Redis URL or mode with one line and exit 1.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvsp_quic.auth import ALL, Principal, Role
from kvsp_quic.metrics import Registry
from kvsp_quic.problems import TooManyRequests
from kvsp_quic.roles.controller import ControllerConfig, PlacementController
from kvsp_quic.roles.controller_lifecycle import SessionEvent
from kvsp_quic.roles.controller_records import SessionRequest, SessionState
from kvsp_quic.roles.controller_sessions import Admitted
from kvsp_quic.roles.index import IndexService
from kvsp_quic.storage.memory_index import MemoryIndexStore
from kvsp_quic.storage.redis_control import RedisControlStore
from kvsp_runtime.controller_link import HttpInstanceLink
from kvsp_runtime.controller_service import ControllerService, Superseded
from tests.redis_server import needs_redis
from tests.support.pc_app import checkpoint, session_body
from tests.support.replicated_pc import replica_policy, replicas

pytestmark = needs_redis


async def test_two_replicas_share_statuses_sessions_and_failover(tmp_path: Path, redis_url: str) -> None:
    async with replicas(tmp_path, redis_url) as r:
        # the instances report to replica 1 only; replica 2 sees them
        assert (await r.report("pc1", "ia")).json() == {"state": "active"}
        assert (await r.report("pc1", "ic")).status == 200
        listed = await r.call("pc2", "alice", "GET", "instances")
        assert {i["instance"] for i in listed.json()["instances"]} == {r.uris["ia"], r.uris["ic"]}
        stale = await r.report("pc2", "ic", epoch=0)  # the epoch check spans replicas
        assert stale.status == 409 and stale.json()["type"].endswith("#kvsp-stale-epoch")

        # a session requested at replica 2 is placed on an instance that reported to replica 1
        body = session_body()
        created = await r.call("pc2", "alice", "POST", "sessions", body)
        assert created.status == 201, created.content
        first = created.json()["instance"]
        assert first in (r.uris["ia"], r.uris["ic"]) and created.json()["epoch"] == 1
        again = await r.call("pc1", "alice", "POST", "sessions", body)  # a retry at the other replica
        assert again.status == 200 and again.json()["instance"] == first
        serving = "ia" if first == r.uris["ia"] else "ic"
        other = "ic" if serving == "ia" else "ia"

        # checkpoints through replica 1, the highest wins; the session is readable at both
        path = f"sessions/{body['session']}/checkpoint"
        ack = await r.call("pc1", serving, "PUT", path, checkpoint(body, 1, [1, 2, 3]))
        assert ack.json()["output_offset"] == 3, ack.content
        older = await r.call("pc2", serving, "PUT", path, checkpoint(body, 1, [1, 2]))
        assert older.json()["output_offset"] == 3
        for pc in ("pc1", "pc2"):
            got = await r.call(pc, "alice", "GET", f"sessions/{body['session']}")
            assert got.json()["output_offset"] == 3 and got.json()["instance"] == first

        # the replica that created the session goes away; the serving instance falls silent: replica 1 migrates.
        # Both statuses are renewed first: on a loaded machine this test has taken over a minute, longer than the
        # 60 s TTL of the first reports (a lapse while replica 2 lived let it begin the migration and die in it).
        assert (await r.report("pc1", serving)).status == 200 and (await r.report("pc1", other)).status == 200
        await r.servers["pc2"].close()
        # only now does the serving instance's status start to run out (were it to lapse while replica 2 lived,
        # replica 2 could begin the migration and die in it: replica 1 would then take it over at epoch 3)
        await r.report("pc1", serving, ttl_ms=800)
        deadline = time.monotonic() + 20
        while True:
            await r.report("pc1", other)
            # a closed replica starts no migration, even when asked to tick while one is due (it did while its close
            # waited on its lifespan: its ticker ran until the lifespan ended, and began this one at epoch 2)
            assert await r.controllers["pc2"].tick() == []
            got = (await r.call("pc1", "alice", "GET", f"sessions/{body['session']}")).json()
            if got["epoch"] == 2 and got.get("instance") == r.uris[other]:
                break
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.2)
        resume, = r.instances[other].of("resume")
        assert resume.epoch == 2 and resume.checkpoint.generated == (1, 2, 3)
        assert len(r.instances[other].of("resume")) == 1 and r.instances[serving].of("resume") == []
        late = await r.call("pc1", serving, "PUT", path, checkpoint(body, 1, [1, 2, 3, 4]))
        assert late.status == 409 and late.json()["type"].endswith("#kvsp-stale-epoch")
        ok = await r.call("pc1", other, "PUT", path, checkpoint(body, 2, [1, 2, 3, 4]))
        assert ok.json()["output_offset"] == 4


async def test_a_retry_takes_over_a_placement_its_replica_abandoned(tmp_path: Path, redis_url: str) -> None:
    """kvsp-quic chaos, fault is-kill: replica 2 admitted a session (stored, being placed) and died before it placed
    it; the client's retry at replica 1 found the stored session and answered it as a repeat, with no instance
    (the front end: 503 "placed nowhere"). Now replica 1 waits for the placement lease to lapse and places the
    session itself, at a new epoch (fencing whatever replica 2 may have started)."""
    async with replicas(tmp_path, redis_url) as r:
        assert (await r.report("pc1", "ia")).status == 200
        body = session_body()
        alice = replica_policy(r.uris).principal("urn:kvsp:client:alice")
        assert alice is not None
        admitted = await r.controllers["pc2"]._admit(alice, SessionRequest.from_json(body))
        assert isinstance(admitted, Admitted)  # stored as placing; replica 2 "dies" here (no lease, no placement)
        await r.servers["pc2"].close()
        retry = await r.call("pc1", "alice", "POST", "sessions", body)
        assert retry.status == 200, retry.content
        assert retry.json()["instance"] == r.uris["ia"] and retry.json()["epoch"] == 2
        start, = r.instances["ia"].of("start")
        assert start.epoch == 2
        got = await r.call("pc1", "alice", "GET", f"sessions/{body['session']}")
        assert got.json()["state"] == "running" and got.json()["instance"] == r.uris["ia"]


async def test_two_replicas_migrating_at_once_make_one_epoch(redis_url: str) -> None:
    """The epoch increment is a compare-and-set on the stored session: of two replicas that read the same
    version and both decide to migrate, one writes epoch 2 and the other stands down."""
    stores = [RedisControlStore.from_url(redis_url) for _ in range(2)]
    pcs = []
    try:
        for i, store in enumerate(stores):
            service = IndexService(MemoryIndexStore(), clock=time.monotonic)
            role = PlacementController(service, clock=time.monotonic, metrics=Registry(),
                                       identity=f"https://pc{i}.example/")
            # nothing is sent to an instance here: the link is never used
            pcs.append(ControllerService(role, HttpInstanceLink(None), store=store))  # type: ignore[arg-type]
        request = SessionRequest.from_json(session_body(7))
        alice = Principal("urn:kvsp:client:alice", frozenset({Role.CLIENT}), ALL)
        admitted = await pcs[0]._admit(alice, request)
        assert isinstance(admitted, Admitted)
        session = admitted.session
        session.instance, session.instance_epoch, session.state = "https://ia.example/", 1, SessionState.RUNNING
        pcs[0]._based[session.id] = 1
        await pcs[0]._persist(session)

        copies = [await pc._fetch(session.id) for pc in pcs]  # both read the same version
        assert copies[0] is not None and copies[1] is not None and copies[0].version == copies[1].version

        async def migrate(pc: ControllerService, copy: Any) -> str:
            pc._based[copy.id] = copy.epoch
            pc.role.begin_migration(copy)
            try:
                await pc._persist(copy, strict=True)
            except Superseded:
                return "stood down"
            return "migrated"

        results = await asyncio.gather(*(migrate(pc, copy) for pc, copy in zip(pcs, copies, strict=True)))
        assert sorted(results) == ["migrated", "stood down"]
        stored = await pcs[1]._fetch(session.id)
        assert stored is not None and stored.epoch == 2 and stored.state is SessionState.MIGRATING
        # the session waits for a migration: every replica's tick finds it
        assert await stores[0].candidates(lambda i, e: False) == [session.id]
    finally:
        for store in stores:
            await store.aclose()


async def test_a_client_at_its_limit_is_counted_again_from_the_store(redis_url: str) -> None:
    """Each replica counts the sessions it holds; one that ended at another replica (its last checkpoint went there)
    is read again before a client at its ``client_max_sessions`` is refused, so it does not count any more."""
    stores = [RedisControlStore.from_url(redis_url) for _ in range(2)]
    try:
        pcs = []
        for i, store in enumerate(stores):
            role = PlacementController(IndexService(MemoryIndexStore(), clock=time.monotonic), clock=time.monotonic,
                                       config=ControllerConfig(client_max_sessions=1), identity=f"https://pc{i}/")
            pcs.append(ControllerService(role, HttpInstanceLink(None), store=store))  # type: ignore[arg-type]
        alice = Principal("urn:kvsp:client:alice", frozenset({Role.CLIENT}), ALL)
        first, second = (SessionRequest.from_json(session_body(n)) for n in (1, 2))
        admitted = await pcs[0]._admit(alice, first)
        assert isinstance(admitted, Admitted)
        pcs[0].role.placed(admitted.session, 0.01)  # running, as replica 1 holds it
        await pcs[0]._persist(admitted.session)
        with pytest.raises(TooManyRequests, match="max_sessions 1"):
            await pcs[0]._admit(alice, second)
        ended = await pcs[1]._fetch(first.session)  # its last checkpoint reached replica 2: done there
        assert ended is not None
        ended.apply(SessionEvent.FINISHED)
        await pcs[1]._persist(ended)
        pcs[0]._read_again_at.clear()  # (read again at most once per client_retry_ms)
        assert isinstance(await pcs[0]._admit(alice, second), Admitted)
        assert pcs[0].role.sessions[first.session].state is SessionState.DONE
    finally:
        for store in stores:
            await store.aclose()


def test_a_wrong_redis_url_or_mode_is_one_line_and_exit_1(tmp_path: Path, redis_url: str) -> None:
    dev = str(tmp_path / "dev")
    for extra, expected in ((["--redis", "redis://127.0.0.1:1/0"], "does not answer"),
                            (["--redis", redis_url, "--redis-cluster"], "drop --redis-cluster")):
        done = subprocess.run([sys.executable, "-m", "kvsp_app", "index", "--dev", dev, *extra,
                               "--log-level", "WARNING"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], done.stderr


def test_stored_sessions_round_trip() -> None:
    from kvsp_quic.roles.controller_sessions import PlacedSession
    from kvsp_quic.roles.controller_store import placed_session, stored_session

    request = SessionRequest.from_json(session_body(3))
    session = PlacedSession(request, "urn:kvsp:client:alice", 1.0, 1.0, epoch=3, served=2,
                            state=SessionState.RUNNING, instance="https://ia.example/", instance_epoch=9,
                            migrations=2, version=5)
    stored = stored_session(session)
    assert stored.run == "9|https://ia.example/" and not stored.migrating and stored.version == 5
    back = placed_session(stored, 7.0)
    assert (back.request, back.epoch, back.served, back.state, back.instance, back.instance_epoch,
            back.migrations, back.version) == (request, 3, 2, SessionState.RUNNING, "https://ia.example/", 9, 2, 5)
    assert uuid.UUID(int=3) == back.id
