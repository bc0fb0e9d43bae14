"""A holder against tenants who distrust each other (issue 13), over real sockets (RoleServer + holder_app,
KvspClient with mutual TLS): uploads allocate only what the descriptor allows, per-principal storage quotas, and
lease quotas that protect capacity (a global leased fraction, limited renewals)."""

from __future__ import annotations

import asyncio
import json
import resource
from collections.abc import AsyncIterator

import pytest

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_http.holder_app import holder_app
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.fields import BlockKey, ScopeId
from kvsp_quic.records import LeaseRequest, LeaseResponse
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.leases import LeaseLimits
from tests.support.holder_app import ALICE, BOB, HOLDER_URI, JSON, SCOPE, Setup, body, key, problem_type

PRIVATE_CODEC = 0xFF00
POLICY = Policy.from_dict({"principal": [  # two producers of one scope (quotas are per principal)
    {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE]},
    {"identity": BOB, "roles": ["instance"], "scopes": [SCOPE]},
    {"identity": HOLDER_URI, "roles": ["holder"], "scopes": "*"},
]})


def private_header(d: CompatDescriptor, section: int) -> bytes:
    """A complete block's header with codec 0xFF00 and *section* octets per K and V section."""
    return c.ContainerHeader(PRIVATE_CODEC, 0, d.block_tokens, ((section, section),) * d.layers).pack()


async def holder_server(holder_certs, d: CompatDescriptor, **options: object) -> AsyncIterator[Setup]:  # type: ignore[no-untyped-def]
    holder = Holder(HolderSettings(HOLDER_URI, (d,), replica_ttl_ms=60_000, **options))  # type: ignore[arg-type]
    server = RoleServer(holder_app(holder, POLICY), holder_certs.files("holder"))
    await server.start("127.0.0.1", 0)
    alice, bob = KvspClient(holder_certs.files("alice")), KvspClient(holder_certs.files("bob"))
    try:
        yield Setup(server, holder, d, alice, bob)
    finally:
        await alice.aclose()
        await bob.aclose()
        await server.close()


async def stalled(head: bytes, gate: asyncio.Event) -> AsyncIterator[bytes]:
    """A body that sends its container header, then nothing until *gate* opens (declared but never sent)."""
    yield head
    await gate.wait()


def lease_body(d: CompatDescriptor, ns: tuple[int, ...], ttl_ms: int = 10_000) -> bytes:
    request = LeaseRequest(d.compat_id, ScopeId(bytes.fromhex(SCOPE)),
                           tuple(BlockKey(bytes.fromhex(key(n))) for n in ns), ttl_ms)
    return json.dumps(request.to_json()).encode()


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- uploads allocate what the descriptor allows -------------------------------------------------------------------


async def test_a_private_codec_header_cannot_declare_gigabytes(holder_certs, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    async for s in holder_server(holder_certs, d):
        section = 4 << 20  # 32 layers x 2 x 4 MiB = 256 MiB declared by a 532-octet header
        gate = asyncio.Event()
        before = rss_peak()
        task = asyncio.create_task(s.put(1, content=stalled(private_header(d, section), gate)))
        await asyncio.sleep(1.0)  # the header is in; the body never comes
        peak = rss_peak() - before
        gate.set()
        response = await asyncio.wait_for(task, 10)
        assert response.status == 400, response.content
        assert "exceed" in response.json()["detail"]
        assert peak < 64 << 20  # nothing near the declared size was allocated
        assert s.holder.stored_by(ALICE) == (0, 0)

        # a private-codec block within the bound is stored and served as it came
        bound = c.max_section_length(d, d.block_tokens)
        sections = [bytes([i]) * bound for i in range(2)]
        data = c.encode([(sections[0], sections[1])] * d.layers, first_layer=0, token_count=d.block_tokens,
                        codec=PRIVATE_CODEC).tobytes()
        stored = await s.put(2, content=data)
        assert stored.status == 201, stored.content
        got = await s.alice.request("GET", s.block_url(2))
        assert got.status == 200 and got.content == data
        too_big = c.encode([(sections[0] + b"x", sections[1])] * d.layers, first_layer=0,
                           token_count=d.block_tokens, codec=PRIVATE_CODEC).tobytes()
        assert (await s.put(3, content=too_big)).status == 400


# -- per-principal storage quota ---------------------------------------------------------------------------------


async def test_storage_quota_per_principal(holder_certs, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    size = len(body(d, 1))
    async for s in holder_server(holder_certs, d, host_capacity=8 * size, max_octets_per_principal=2 * size):
        assert (await s.put(1, client=s.bob)).status == 201  # tenant B's block
        for n in (2, 3):
            assert (await s.put(n)).status == 201
        assert s.holder.stored_by(ALICE) == (2 * size, 0)
        # alice at her quota: her oldest unleased replica makes room, never another principal's
        assert (await s.put(4)).status == 201
        assert (await s.alice.request("GET", s.block_url(2))).status == 404
        assert (await s.bob.request("GET", s.block_url(1))).status == 200
        # with her replicas leased, nothing of hers can go: 507, and bob's block stays
        made = await s.alice.request("POST", s.url("leases"), headers={"content-type": JSON},
                                     content=lease_body(d, (3, 4)))
        assert made.status == 201, made.content
        refused = await s.put(5)
        assert refused.status == 507 and problem_type(refused) == "about:blank"
        assert "quota" in refused.json()["detail"]
        assert (await s.bob.request("GET", s.block_url(1))).status == 200
        assert (await s.put(6, client=s.bob)).status == 201  # bob has his own quota


async def test_declared_but_unsent_uploads_count_against_the_quota(holder_certs, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    size = len(body(d, 1))
    async for s in holder_server(holder_certs, d, host_capacity=8 * size, max_octets_per_principal=2 * size):
        gate = asyncio.Event()
        head = body(d, 1)[:c.FIXED_HEADER.size + c.ENTRY.size * d.layers]
        pending = [asyncio.create_task(s.put(n, content=stalled(head, gate))) for n in (1, 2)]
        async with asyncio.timeout(5):
            while s.holder.stored_by(ALICE)[1] < 2 * size:
                await asyncio.sleep(0.01)
        third = asyncio.create_task(s.put(3, content=stalled(head, gate)))
        async with asyncio.timeout(5):  # refused as its header arrived, before any allocation
            while not s.holder.metrics["quota_rejections"]:
                await asyncio.sleep(0.01)
        assert s.holder.stored_by(ALICE) == (0, 2 * size)
        assert (await s.put(4, client=s.bob)).status == 201  # the other tenant is unaffected
        gate.set()
        refused = await asyncio.wait_for(third, 5)
        assert refused.status == 507, refused.content
        for task in pending:
            assert (await task).status == 400  # truncated: the reservation is given back
        async with asyncio.timeout(5):
            while s.holder.stored_by(ALICE) != (0, 0):
                await asyncio.sleep(0.01)
        assert (await s.put(5)).status == 201


# -- lease quotas protect capacity ----------------------------------------------------------------------------------


async def lease_of(s: Setup, client: KvspClient, *ns: int, ttl_ms: int = 10_000) -> tuple[int, dict[str, object]]:
    got = await client.request("POST", s.url("leases"), headers={"content-type": JSON},
                               content=lease_body(s.d, ns, ttl_ms))
    return got.status, got.json()


async def test_leases_never_pin_more_than_the_global_fraction(holder_certs, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    size = len(body(d, 1))
    limits = LeaseLimits(max_ttl_ms=10_000, max_octets_per_client=16 << 30, max_leased_fraction=0.5)
    async for s in holder_server(holder_certs, d, host_capacity=4 * size, leases=limits):
        for n in (1, 2, 3, 4):
            assert (await s.put(n)).status == 201
        status, answer = await lease_of(s, s.alice, 1, 2, 3)  # 3 of 4 blocks: over half the capacity
        assert status == 429 and str(answer["type"]).endswith("#kvsp-lease-quota")
        assert (await lease_of(s, s.alice, 1))[0] == 201
        assert (await lease_of(s, s.bob, 2))[0] == 201
        status, answer = await lease_of(s, s.bob, 3)  # global: alice's and bob's leases together
        assert status == 429 and "all clients together" in str(answer["detail"])
        # half the holder stays evictable: new blocks are still stored
        for n in (5, 6):
            assert (await s.put(n)).status == 201


async def test_one_client_leases_at_most_its_share_of_the_global_cap(holder_certs, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    size = len(body(d, 1))
    limits = LeaseLimits(max_ttl_ms=10_000, max_leased_fraction=1.0, max_client_share=0.5)
    async for s in holder_server(holder_certs, d, host_capacity=4 * size, leases=limits):
        for n in (1, 2, 3, 4):
            assert (await s.put(n)).status == 201
        assert (await lease_of(s, s.alice, 1, 2))[0] == 201  # half the holder: alice's share
        got = await s.alice.request("POST", s.url("leases"), headers={"content-type": JSON},
                                    content=lease_body(s.d, (3,), 10_000))
        assert got.status == 429 and problem_type(got) == "kvsp-lease-quota"
        # retry once alice's soonest lease has expired (10 s from now, in whole seconds)
        assert 1 <= int(got.headers["retry-after"]) <= 10
        assert (await lease_of(s, s.bob, 3, 4))[0] == 201  # bob is not starved


async def test_renewals_are_limited(holder_certs, d: CompatDescriptor) -> None:  # type: ignore[no-untyped-def]
    limits = LeaseLimits(max_ttl_ms=10_000, max_renewals=2, max_lifetime_ms=60_000)
    async for s in holder_server(holder_certs, d, leases=limits):
        assert (await s.put(1)).status == 201
        status, answer = await lease_of(s, s.alice, 1)
        assert status == 201
        lease_id = LeaseResponse.from_json(answer).lease
        renew = s.url(f"leases/{lease_id}")
        for _ in range(2):
            ok = await s.alice.request("PUT", renew, headers={"content-type": JSON}, content=b'{"ttl_ms": 10000}')
            assert ok.status == 200, ok.content
        third = await s.alice.request("PUT", renew, headers={"content-type": JSON}, content=b'{"ttl_ms": 10000}')
        assert third.status == 429 and problem_type(third) == "kvsp-lease-quota"


@pytest.fixture
def d() -> CompatDescriptor:
    from tests.support.descriptors import small_descriptor
    return small_descriptor(layers=32)

