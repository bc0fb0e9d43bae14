"""The Index Service over real sockets: kvsp_http.index_app served by RoleServer (HTTP/3, and HTTP/2 over TLS),
called with KvspClient and mutual TLS. Covers every status and problem type the Index Service emits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvsp_http.app_kit import JSON_MEDIA_TYPE as MEDIA_TYPE
from kvsp_http.index_app import index_app, lookup_json
from kvsp_quic import keys as k
from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import (
    KVSP_TYPE_BASE,
    BadRequest,
    ContentTooLarge,
    Forbidden,
    NotFound,
    ScopeDenied,
    StaleEpoch,
    UnsupportedMediaType,
)
from kvsp_quic.records import (
    InstanceStatusRecord,
    Link,
    LookupMatch,
    LookupRequest,
    LookupResponse,
    Record,
    ReplicaRecord,
    TargetEstimate,
)
from kvsp_quic.roles.index import IndexService
from kvsp_quic.storage.memory_index import MemoryIndexStore
from tests.support.index import C1, S1, S2, SHAPES, bk, replica
from tests.support.index_app import (
    H1,
    H2,
    II7,
    MAX_KEYS,
    NOW,
    POLICY,
    Harness,
    manual_clock,
    problem,
    replica_path,
    serve,
)


@pytest.fixture
async def h(pki_dir: Path) -> AsyncIterator[Harness]:
    NOW[0] = 0.0
    async with serve(pki_dir) as harness:
        yield harness


# -- replicas -----------------------------------------------------------------------------------------------------


async def test_publish_refresh_withdraw(h: Harness) -> None:
    record = replica(0, holder=H1, ttl_ms=900_000)
    created = await h.publish("h1", record)
    assert created.status == 201 and created.http_version == "HTTP/3"
    assert created.headers["content-type"] == MEDIA_TYPE
    assert ReplicaRecord.loads(created.content or b"") == replace(record, ttl_ms=600_000)  # the granted TTL
    refreshed = await h.publish("h1", record)
    assert refreshed.status == 200 and ReplicaRecord.loads(refreshed.content or b"").ttl_ms == 600_000
    gone = await h.call("h1", "DELETE", replica_path(record))
    assert gone.status == 204 and gone.content == b""
    again = await h.call("h1", "DELETE", replica_path(record))
    assert again.status == 404 and isinstance(problem(again), NotFound)
    assert problem(again).type_uri == KVSP_TYPE_BASE + "kvsp-not-found"


async def test_publish_problems(h: Harness) -> None:
    record = replica(0, holder=H1)
    mismatch = await h.call("h1", "PUT", replica_path(record, H2), record.to_json())
    assert mismatch.status == 400 and isinstance(problem(mismatch), BadRequest)
    other_key = await h.call("h1", "PUT", f"replicas/{k.holder_id(H1)}/{bk(9).hex()}", record.to_json())
    assert other_key.status == 400
    bad_key = await h.call("h1", "PUT", f"replicas/{k.holder_id(H1)}/XYZ", record.to_json())
    assert bad_key.status == 400 and "block_key" in problem(bad_key).detail
    bad_id = await h.call("h1", "PUT", f"replicas/short/{bk(0).hex()}", record.to_json())
    assert bad_id.status == 400 and "holder_id" in problem(bad_id).detail
    malformed = await h.call("h1", "PUT", replica_path(record), raw=b'{"block_key": ')
    assert malformed.status == 400 and "JSON" in problem(malformed).detail
    invalid = await h.call("h1", "PUT", replica_path(record), {**record.to_json(), "size": -1})
    assert invalid.status == 400 and "size" in problem(invalid).detail
    wrong_type = await h.call("h1", "PUT", replica_path(record), record.to_json(), content_type="application/json")
    assert wrong_type.status == 415 and isinstance(problem(wrong_type), UnsupportedMediaType)
    denied = await h.publish("h1", replica(0, holder=H1, scope=S2))
    assert denied.status == 403 and isinstance(problem(denied), ScopeDenied)
    others = await h.publish("h1", replica(0, holder=H2))
    assert others.status == 403 and isinstance(problem(others), Forbidden)
    assert problem(others).type_uri == "about:blank"
    on_behalf = await h.publish("h2", record)
    assert on_behalf.status == 201


async def test_roles_and_identities(h: Harness) -> None:
    record = replica(0, holder=H1)
    client_publish = await h.call("alice", "PUT", replica_path(record), record.to_json())
    assert client_publish.status == 403 and "holder" in problem(client_publish).detail  # the rule: holders only
    stranger = await h.call("bob", "POST", "lookup", {"scope_id": S1.hex(), "compat_id": C1.hex(),
                                                       "block_keys": []})
    assert stranger.status == 403 and "not in the authorization policy" in problem(stranger).detail
    holder_status = await h.call("h1", "PUT", f"instances/{k.instance_id(H1)}/status", status_json(H1))
    assert holder_status.status == 403 and isinstance(problem(holder_status), Forbidden)
    unknown = await h.call("h1", "GET", "lookup")
    assert unknown.status == 404 and problem(unknown).type_uri == "about:blank"  # no rule: deny by default
    outside = await h.clients["h1"].request("GET", h.server.base_uri("/other/lookup"))
    assert outside.status == 404 and outside.headers.get("cache-control") == "no-store"


async def test_body_limit(h: Harness) -> None:
    big = {"scope_id": S1.hex(), "compat_id": C1.hex(), "block_keys": [bk(0).hex()] * 400}  # ~27 KB
    too_big = await h.call("alice", "POST", "lookup", big)
    assert too_big.status == 413 and isinstance(problem(too_big), ContentTooLarge)


# -- lookup -------------------------------------------------------------------------------------------------------


async def test_lookup(h: Harness) -> None:
    for i in range(3):
        assert (await h.publish("h1", replica(i, holder=H1))).status == 201
    assert (await h.publish("ii7", replica(0, holder=II7))).status == 201
    assert (await h.call("ii7", "PUT", f"instances/{k.instance_id(II7)}/status", status_json(II7))).status == 200
    body = LookupRequest(S1, C1, tuple(bk(i) for i in range(5)),
                         targets=(II7, "https://ii9.example/kvsp/")).to_json()
    response = await h.call("alice", "POST", "lookup", body)
    assert response.status == 200 and response.headers["content-type"] == MEDIA_TYPE
    result = LookupResponse.loads(response.content or b"")
    assert result.matched == 3 and [m.block_key for m in result.blocks] == [bk(0), bk(1), bk(2)]
    assert sorted(r.holder for r in result.blocks[0].replicas) == [H1, II7]
    assert all(r.ttl_ms == 60_000 for m in result.blocks for r in m.replicas)  # remaining TTL (clock stands still)
    # II7 holds block 0 itself; blocks 1 and 2 from H1: 10 + 2 * (2 + 2) = 18 us; 48 tokens at 40000/s = 1200 us
    assert result.targets is not None and [t.to_json() for t in result.targets] == [
        {"instance": II7, "fetch_us": 18, "recompute_us": 1200}]


async def test_lookup_problems(h: Harness) -> None:
    denied = await h.call("alice", "POST", "lookup", {"scope_id": S2.hex(), "compat_id": C1.hex(),
                                                      "block_keys": [bk(0).hex()]})
    assert denied.status == 403 and isinstance(problem(denied), ScopeDenied)
    assert problem(denied).type_uri == KVSP_TYPE_BASE + "kvsp-scope-denied"
    over = await h.call("alice", "POST", "lookup", {"scope_id": S1.hex(), "compat_id": C1.hex(),
                                                    "block_keys": [bk(i).hex() for i in range(MAX_KEYS + 1)]})
    assert over.status == 413 and f"at most {MAX_KEYS} block keys" in problem(over).detail
    missing = await h.call("alice", "POST", "lookup", {"scope_id": S1.hex(), "block_keys": []})
    assert missing.status == 400 and "compat_id" in problem(missing).detail


def test_fast_json_matches_the_records() -> None:
    for record in SHAPES:
        assert record.to_json() == Record.to_json(record)  # the written-out writer agrees with the generic one
    record = SHAPES[2]
    response = LookupResponse(1, (LookupMatch(record.block_key, (record,)),), (TargetEstimate(II7, 1, 2),))
    assert lookup_json(response) == response.to_json()
    assert lookup_json(replace(response, targets=None)) == replace(response, targets=None).to_json()


# -- status -------------------------------------------------------------------------------------------------------


def status_json(instance: str, epoch: int = 3, **changes: Any) -> dict[str, Any]:
    record = InstanceStatusRecord(instance, epoch, InstanceState.ACTIVE, 3000, prefill_tokens_per_s=40_000,
                                  links=(Link(H1, 8_000, 10),))
    return {**record.to_json(), **changes}


async def test_status(h: Harness) -> None:
    path = f"instances/{k.instance_id(II7)}/status"
    ok = await h.call("ii7", "PUT", path, status_json(II7, requested_state="sleeping"))
    assert ok.status == 200 and ok.json() == {"state": "active"}
    assert ok.headers["content-type"] == MEDIA_TYPE
    stale = await h.call("ii7", "PUT", path, status_json(II7, epoch=2))
    assert stale.status == 409 and isinstance(problem(stale), StaleEpoch)
    assert problem(stale).type_uri == KVSP_TYPE_BASE + "kvsp-stale-epoch"
    not_mine = await h.call("ii7", "PUT", f"instances/{k.instance_id(H1)}/status", status_json(H1))
    assert not_mine.status == 403
    wrong_body = await h.call("ii7", "PUT", path, status_json(H1))
    assert wrong_body.status == 400
    assert h.service.status.state(II7) is InstanceState.ACTIVE


async def test_expired_entries_are_swept_while_serving(h: Harness) -> None:
    assert (await h.publish("h1", replica(0, holder=H1, ttl_ms=1000))).status == 201
    NOW[0] = 5.0
    for _ in range(100):
        if await h.service.store.count() == 0:
            break
        await asyncio.sleep(0.02)
    assert await h.service.store.count() == 0


async def test_over_tcp(pki_dir: Path) -> None:
    async with serve(pki_dir, h3=False) as harness:  # HTTP/2 or HTTP/1.1, whatever the TCP side negotiates
        created = await harness.publish("h1", replica(0, holder=H1))
        assert created.status == 201 and created.http_version in ("HTTP/2", "HTTP/1.1")
        denied = await harness.call("alice", "POST", "lookup", {"scope_id": S2.hex(), "compat_id": C1.hex(),
                                                                "block_keys": []})
        assert denied.status == 403 and isinstance(problem(denied), ScopeDenied)
        found = await harness.call("alice", "POST", "lookup", {"scope_id": S1.hex(), "compat_id": C1.hex(),
                                                               "block_keys": [bk(0).hex()]})
        assert found.status == 200 and found.json()["matched"] == 1


def test_base_path_must_be_a_directory() -> None:
    service = IndexService(MemoryIndexStore(), clock=manual_clock)
    with pytest.raises(ValueError, match="base path"):
        index_app(service, POLICY, base_path="/kvsp")
