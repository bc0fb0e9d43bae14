"""Issue 13: per-client session limits at the Placement Controller (``[controller] client_max_sessions``,
``client_max_in_flight``, ``client_retry_ms``: the role's admission, kvsp_quic/roles/controller_admission.py).

A real PC (``controller_app`` behind a RoleServer, mutual TLS, 127.0.0.1) and a recording instance: one client may
own at most ``max_sessions`` sessions that are not done, and place at most ``max_in_flight`` at once; beyond
either it gets 429 with ``Retry-After``, while another client of the same scope is still served and a retry of a
session it already created is still answered. Before the limits, one client could hold all of the PC's 100 000."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvsp_quic.auth import ALL, Policy, Principal, Role
from kvsp_quic.problems import TooManyRequests, Unavailable
from kvsp_quic.roles.controller import ControllerConfig, PlacementController
from kvsp_quic.roles.controller_records import SessionRequest
from kvsp_quic.roles.controller_sessions import Admitted, Repeated
from kvsp_quic.roles.index import IndexService
from kvsp_quic.roles.status import LifecyclePolicy, SleepPolicy, StatusTable
from kvsp_quic.storage.memory_index import MemoryIndexStore
from tests.helpers import Clock
from tests.support.index import S1
from tests.support.pc_app import Cluster, checkpoint, cluster, session_body


def one_instance(uris: dict[str, str]) -> Policy:
    return Policy.from_dict({"principal": [
        {"identity": uris["pc"], "roles": ["controller"], "scopes": "*"},
        {"identity": uris["ia"], "roles": ["instance", "holder"], "scopes": [S1.hex()]},
        {"identity": "urn:kvsp:client:alice", "roles": ["client"], "scopes": [S1.hex()]},
        {"identity": "urn:kvsp:client:bob", "roles": ["client"], "scopes": [S1.hex()]}]})


@contextlib.asynccontextmanager
async def limited_pc(root: Path, limits: ControllerConfig,
                     hold: tuple[asyncio.Event, asyncio.Event] | None = None) -> AsyncIterator[Cluster]:
    """The PC and its instance; with *hold* = (arrived, release), the instance's first session start sets
    *arrived* and waits for *release* before it answers."""

    def slowed(_name: str, inner: Any) -> Any:
        async def slow(scope: Any, receive: Any, send: Any) -> None:
            if hold is not None and scope["type"] == "http" and scope["method"] == "POST" \
                    and scope["path"].endswith("/start") and not hold[0].is_set():
                hold[0].set()
                await hold[1].wait()  # the instance takes its time to start this session
            await inner(scope, receive, send)
        return slow

    async with cluster(root, one_instance, ("ia",), ("h1",), ("alice", "bob"), config=limits, wrap=slowed,
                       client_retries=0, client_timeout=10.0) as found:
        yield found


def _body(n: int) -> dict[str, Any]:
    return session_body(n, blocks=0) | {"block_keys": []}


async def test_a_client_owns_at_most_max_sessions_live_sessions(tmp_path: Path) -> None:
    async with limited_pc(tmp_path, ControllerConfig(client_max_sessions=2, client_retry_ms=2500)) as c:
        assert (await c.report("ia")).status == 200
        for n in (1, 2):
            created = await c.call("alice", "POST", "sessions", _body(n))
            assert created.status == 201, created.content
        refused = await c.call("alice", "POST", "sessions", _body(3))
        assert refused.status == 429, refused.content
        assert refused.headers["retry-after"] == "3"
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert "max_sessions 2" in refused.json()["detail"]
        again = await c.call("alice", "POST", "sessions", _body(1))  # a retry of one it owns: answered, not 429
        assert again.status == 200, again.content
        other = await c.call("bob", "POST", "sessions", _body(4))  # another client of the scope is served
        assert other.status == 201, other.content
        # session 1 ends (its instance's last checkpoint says done): alice has room for one more
        body = _body(1)
        done = checkpoint(body, 1, [5, 6]) | {"done": True}
        acked = await c.call("ia", "PUT", f"sessions/{uuid.UUID(body['session'])}/checkpoint", done)
        assert acked.status == 200, acked.content
        created = await c.call("alice", "POST", "sessions", _body(3))
        assert created.status == 201, created.content


async def test_a_client_places_at_most_max_in_flight_sessions_at_once(tmp_path: Path) -> None:
    arrived, release = asyncio.Event(), asyncio.Event()
    async with limited_pc(tmp_path, ControllerConfig(client_max_in_flight=1), (arrived, release)) as c:
        assert (await c.report("ia")).status == 200
        first = asyncio.ensure_future(c.call("alice", "POST", "sessions", _body(1)))
        await asyncio.wait_for(arrived.wait(), 30)  # the first one is being placed: its start is at the instance
        second = await c.call("alice", "POST", "sessions", _body(2))
        assert second.status == 429 and int(second.headers["retry-after"]) >= 1, second.content
        assert "max_in_flight 1" in second.json()["detail"]
        release.set()
        bob = await c.call("bob", "POST", "sessions", _body(3))
        assert bob.status == 201, bob.content
        assert (await first).status == 201
        third = await c.call("alice", "POST", "sessions", _body(2))  # nothing of alice's under way now
        assert third.status == 201, third.content


def test_the_limits_are_controller_settings() -> None:
    from kvsp_app.config import IndexFile, build

    cfg = build(IndexFile, {"controller": {"client_max_sessions": 7, "client_max_in_flight": 2,
                                           "client_retry_ms": 1001}})
    assert (cfg.controller.client_max_sessions, cfg.controller.client_max_in_flight) == (7, 2)
    assert cfg.controller.client_retry_after_s == 2  # whole seconds, rounded up
    assert ControllerConfig().client_retry_after_s == 1
    for key in ("client_max_sessions", "client_max_in_flight", "client_retry_ms"):
        with pytest.raises(ValueError, match=f"{key}: must be positive"):
            ControllerConfig(**{key: 0})


def test_admission_is_the_roles() -> None:
    """The role decides without any HTTP: a retry is never refused, a client's limit is 429 carrying
    retry_after_s (the edge's Retry-After), the PC's own limit 503, and a placement that ended frees its slot."""
    session_request = SessionRequest.from_json
    clock = Clock()
    status = StatusTable(clock, policy=LifecyclePolicy(SleepPolicy()), max_ttl_ms=60_000)
    role = PlacementController(IndexService(MemoryIndexStore(), clock=clock, status=status), clock=clock,
                               config=ControllerConfig(client_max_in_flight=1, client_max_sessions=2,
                                                       client_retry_ms=3000, max_sessions=3))
    alice, bob = (Principal(f"urn:kvsp:client:{n}", frozenset({Role.CLIENT}), ALL) for n in ("alice", "bob"))
    first = role.admit(alice, session_request(_body(1)))
    assert isinstance(first, Admitted) and role.admission.in_flight(alice.identity) == 1
    assert isinstance(role.admit(alice, session_request(_body(1))), Repeated)  # a retry: answered
    with pytest.raises(TooManyRequests, match="max_in_flight 1") as busy:
        role.admit(alice, session_request(_body(2)))
    assert busy.value.retry_after_s == 3
    role.placed(first.session, 0.01)
    assert role.admission.in_flight(alice.identity) == 0
    second = role.admit(alice, session_request(_body(2)))
    assert isinstance(second, Admitted)
    role.abandon(second.session)
    second = role.admit(alice, session_request(_body(2)))
    assert isinstance(second, Admitted)
    role.placed(second.session, 0.01)
    third = role.admit(bob, session_request(_body(3)))
    assert isinstance(third, Admitted)
    role.placed(third.session, 0.01)
    with pytest.raises(Unavailable, match="its maximum"):  # the PC's max_sessions
        role.admit(bob, session_request(_body(4)))
    role.sessions.pop(session_request(_body(3)).session)
    with pytest.raises(TooManyRequests, match="max_sessions 2") as full:
        role.admit(alice, session_request(_body(5)))
    assert full.value.retry_after_s == 3
