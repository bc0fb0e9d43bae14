"""Tenants who distrust each other (issue 13): scope-aware placement, over real sockets.

The Index Service + Placement Controller (kvsp_http.controller_app behind RoleServer, mutual TLS) with two tenants:
tenant A's instance ``ia`` and client ``alice`` hold scope S1, tenant B's instance ``ib`` and client ``bob`` hold
S2. The instances are the recording instance apps of ``tests.support.pc_app`` behind their own RoleServers:
whatever the PC sends them arrives over HTTP/3 and is recorded, so "tenant B received nothing of tenant A" is an
observation of the wire, not of the PC's internals.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsp_quic import keys as k
from kvsp_quic.auth import ALL, Policy, Principal, Role
from kvsp_quic.compat import InstanceState
from kvsp_quic.roles.controller_records import SessionInfo
from tests.support.index import S1, S2, bk, replica
from tests.support.pc_app import Cluster, FakeInstance, cluster, session_body
from tests.support.waits import until


def two_tenants(uris: dict[str, str]) -> Policy:
    return Policy.from_dict({"principal": [
        {"identity": uris["pc"], "roles": ["controller"], "scopes": "*"},
        {"identity": uris["h1"], "roles": ["holder"], "scopes": [S1.hex()]},
        {"identity": uris["h2"], "roles": ["holder"], "scopes": [S2.hex()]},
        {"identity": uris["ia"], "roles": ["instance", "holder"], "scopes": [S1.hex()]},
        {"identity": uris["ib"], "roles": ["instance", "holder"], "scopes": [S2.hex()]},
        {"identity": "urn:kvsp:client:alice", "roles": ["client"], "scopes": [S1.hex()]},
        {"identity": "urn:kvsp:client:bob", "roles": ["client"], "scopes": [S2.hex()]},
    ]})


@pytest.fixture
async def t(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with cluster(tmp_path, two_tenants, ("ia", "ib"), ("h1", "h2"), ("alice", "bob")) as found:
        yield found


def leaked(instance: FakeInstance, scope: bytes) -> list[object]:
    """Everything *instance* received that carries *scope* (prefetch directives, starts, resumes)."""
    out: list[object] = []
    for _kind, body in instance.calls:
        carried = getattr(body, "scope_id", None)
        if carried is None and hasattr(body, "checkpoint"):
            carried = body.checkpoint.scope_id
        if carried is not None and bytes(carried) == scope:
            out.append(body)
    return out


async def test_placement_never_crosses_tenants(t: Cluster) -> None:
    h1 = t.uri("h1")
    for i in range(4):  # tenant A's cached prefix, at A's holder
        await t.service.publish(Principal(h1, frozenset({Role.HOLDER}), ALL), k.holder_id(h1), bk(i),
                                replica(i, holder=h1))
    ia, ib = t.instances["ia"], t.instances["ib"]
    # tenant B's instance reports the most attractive figures there are: idle, fast, a fat link to A's holder
    assert (await t.report("ib", prefill_tokens_per_s=1e9, decode_tokens_per_s=1e9, batch_size=1024)).status == 200
    # tenant A's own instance is busy and slow
    assert (await t.report("ia", queued=6, prefill_tokens_per_s=10.0, decode_tokens_per_s=1.0)).status == 200

    body = session_body(1)
    created = await t.call("alice", "POST", "sessions", body)
    assert created.status == 201, created.content
    assert SessionInfo.from_json(created.json()).instance == t.uri("ia")
    assert [kind for kind, _ in ia.calls] == ["prefetch", "start"]
    assert ib.calls == []  # not even the prefetch directive naming A's block keys

    # tenant B's own session goes to B's instance (B still gets service)
    created_b = await t.call("bob", "POST", "sessions", session_body(2) | {"scope_id": S2.hex()})
    assert created_b.status == 201, created_b.content
    assert SessionInfo.from_json(created_b.json()).instance == t.uri("ib")
    assert leaked(ib, S1) == [] and leaked(ia, S2) == []

    # A's instance fails (reports failed): A's running session is not resumed on B's instance, and new sessions of
    # A fail with the typed 503 while B's idle instance is live
    assert (await t.report("ia", state=InstanceState.FAILED)).status == 200
    async def migrating() -> bool:
        got = (await t.call("alice", "GET", f"sessions/{body['session']}")).json()
        return bool(got["state"] == "migrating" and "instance" not in got)

    await until(migrating, 5.0, "the failed instance's session, migrating")  # the migration loop has run
    refused = await t.call("alice", "POST", "sessions", session_body(3))
    assert refused.status == 503, refused.content
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert refused.json()["status"] == 503 and S1.hex() in refused.json()["detail"]
    assert leaked(ib, S1) == []
    assert [kind for kind, _ in ib.calls] == ["prefetch", "start"] or [kind for kind, _ in ib.calls] == ["start"]
    assert await migrating()  # with nowhere else of its scope to go, it stays migrating

    # A's instance comes back (a new run): the migrating session resumes there, not anywhere else
    assert (await t.report("ia", epoch=2)).status == 200

    async def resumed() -> bool:
        got = await t.call("alice", "GET", f"sessions/{body['session']}")
        return bool(got.json().get("instance") == t.uri("ia"))

    await until(resumed, 5.0, "the session, resumed on tenant A's instance")
    assert leaked(ib, S1) == []


async def test_sleeping_instance_of_another_scope_is_not_woken(t: Cluster) -> None:
    ib = t.instances["ib"]
    await t.report("ia")
    await t.report("ib")
    # B's instance may sleep (A's is active and idle), then A's instance leaves
    assert (await t.report("ib", requested_state=InstanceState.SLEEPING)).json() == {"state": "draining"}
    assert (await t.report("ib", state=InstanceState.SLEEPING)).json() == {"state": "sleeping"}
    assert (await t.report("ia", state=InstanceState.FAILED)).status == 200
    refused = await t.call("alice", "POST", "sessions", session_body(4, blocks=0) | {"block_keys": []})
    assert refused.status == 503
    assert ib.calls == []  # no wake-up (PUT state) for a session it may not serve, no start


async def test_a_tenant_b_session_with_only_tenant_a_instances_is_refused(t: Cluster) -> None:
    await t.report("ia")
    denied = await t.call("alice", "POST", "sessions", session_body(5) | {"scope_id": S2.hex()})
    assert denied.status == 403 and denied.json()["type"].endswith("#kvsp-scope-denied")  # alice lacks S2
    refused = await t.call("bob", "POST", "sessions", session_body(6) | {"scope_id": S2.hex()})
    assert refused.status == 503
    assert t.instances["ia"].calls == []


async def test_get_instances_lists_only_the_callers_scopes(t: Cluster) -> None:
    assert (await t.report("ia")).status == 200
    assert (await t.report("ib")).status == 200

    async def listed(who: str) -> set[str]:
        got = await t.call(who, "GET", "instances")
        assert got.status == 200, got.content
        return {i["instance"] for i in got.json()["instances"]}

    assert await listed("alice") == {t.uri("ia")}  # before the fix: both tenants' instances with their load
    assert await listed("bob") == {t.uri("ib")}
    assert await listed("pc") == {t.uri("ia"), t.uri("ib")}  # a controller (an operator) sees every instance
