"""The holder over real sockets: RoleServer + holder_app, KvspClient with mutual TLS; the replica publisher
against a fake Index Service."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from http3.client import KvspClient, Response
from http3.server import RoleServer
from kvsp_http.holder_app import holder_app
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.keys import uri_id
from kvsp_quic.records import LeaseRequest, LeaseResponse, ReplicaRecord
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.leases import LeaseLimits
from kvsp_runtime.publisher import ReplicaPublisher
from quic.tls import scope_identity
from tests.asgi import read_body
from tests.pki import TestPki
from tests.support.descriptors import small_descriptor
from tests.support.holder_app import (
    ALICE,
    BLOCK,
    BOB,
    HOLDER_URI,
    JSON,
    OTHER_SCOPE,
    SCOPE,
    Setup,
    body,
    key,
    problem_type,
)

POLICY = Policy.from_dict({"principal": [
    {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE]},
    {"identity": BOB, "roles": ["client"], "scopes": [SCOPE, OTHER_SCOPE]},
    {"identity": HOLDER_URI, "roles": ["holder"], "scopes": "*"},
]})


@pytest.fixture
def d() -> CompatDescriptor:
    return small_descriptor(layers=32)


@pytest.fixture
async def setup(holder_certs: TestPki, d: CompatDescriptor) -> AsyncIterator[Setup]:
    size = len(body(d, 1))
    holder = Holder(HolderSettings(HOLDER_URI, (d,), host_capacity=3 * size, replica_ttl_ms=60_000,
                                   leases=LeaseLimits(max_ttl_ms=30_000, max_octets_per_client=2 * size)))
    server = RoleServer(holder_app(holder, POLICY), holder_certs.files("holder"))
    await server.start("127.0.0.1", 0)
    alice, bob = KvspClient(holder_certs.files("alice")), KvspClient(holder_certs.files("bob"))
    try:
        yield Setup(server, holder, d, alice, bob)
    finally:
        await alice.aclose()
        await bob.aclose()
        await server.close()


def verify_repr_digest(response: Response) -> None:
    """What a client MUST do (spec, Block Retrieval): check Repr-Digest against the octets received."""
    value = response.headers["repr-digest"]
    assert value.startswith("sha-256=:") and value.endswith(":")
    assert base64.b64decode(value[len("sha-256=:"):-1]) == hashlib.sha256(response.content or b"").digest()


# -- blocks ----------------------------------------------------------------------------------------------------------


async def test_put_then_get_over_http3_with_digests(setup: Setup) -> None:
    stored = await setup.put(1)
    assert stored.status == 201 and stored.http_version == "HTTP/3"
    assert stored.headers["content-type"] == JSON and stored.headers["cache-control"] == "no-store"
    record = ReplicaRecord.from_json(stored.json())
    assert record.holder == HOLDER_URI and record.size == len(body(setup.d, 1))

    got = await setup.alice.request("GET", setup.block_url(1))
    assert got.status == 200 and got.content == body(setup.d, 1)
    assert got.headers["content-type"] == BLOCK
    assert got.headers["cache-control"] == "private, immutable, max-age=59"
    verify_repr_digest(got)
    c.decode(got.content, setup.d, expected_layer_digests=record.layer_digests,  # the replica's digests
             expected_replica_digest=record.digest)


async def test_layer_range_get(setup: Setup) -> None:
    record = ReplicaRecord.from_json((await setup.put(1)).json())
    got = await setup.bob.request("GET", setup.block_url(1, "layers=8-15&codec=1"))
    assert got.status == 200
    verify_repr_digest(got)
    assert got.content is not None
    header, layers = c.decode(got.content, setup.d, expected_layer_digests=record.layer_digests)
    assert (header.first_layer, header.layer_count) == (8, 8) and [x.index for x in layers] == list(range(8, 16))
    assert len(got.content) == header.total_length < record.size
    head = await setup.bob.request("HEAD", setup.block_url(1, "layers=8-15"))
    assert head.status == 200 and head.content == b"" and head.headers["repr-digest"] == got.headers["repr-digest"]


async def test_streamed_put_body(setup: Setup) -> None:
    data = body(setup.d, 2)

    async def chunks() -> AsyncIterator[bytes]:
        for offset in range(0, len(data), 1000):  # splits headers and sections at odd places
            yield data[offset:offset + 1000]

    stored = await setup.put(2, content=chunks())
    assert stored.status == 201
    assert (await setup.alice.request("GET", setup.block_url(2))).content == data


async def test_block_errors_are_problems(setup: Setup) -> None:
    assert (await setup.put(1)).status == 201
    cases = [
        (await setup.put(1), 412, "about:blank"),
        (await setup.put(2, headers={"content-type": BLOCK}), 428, "about:blank"),
        (await setup.put(2, headers={"content-type": "application/octet-stream", "if-none-match": "*"}), 415,
         "about:blank"),
        (await setup.put(2, content=body(setup.d, 2)[:-7]), 400, "about:blank"),
        (await setup.put(2, client=setup.bob), 403, "about:blank"),  # a client does not store blocks
        (await setup.bob.request("GET", setup.block_url(1, scope="ff" * 16)), 403, "kvsp-scope-denied"),
        (await setup.alice.request("GET", setup.block_url(1, scope=OTHER_SCOPE)), 403, "kvsp-scope-denied"),
        (await setup.alice.request("GET", setup.block_url(9)), 404, "kvsp-not-found"),
        (await setup.alice.request("GET", setup.block_url(1, "layers=30-32")), 404, "kvsp-layers-unavailable"),
        (await setup.alice.request("GET", setup.block_url(1, "layers=3")), 400, "about:blank"),
        (await setup.alice.request("GET", setup.block_url(1, "codec=65281")), 406, "about:blank"),
        (await setup.alice.request("GET", setup.block_url(1, compat="ab" * 32)), 409, "kvsp-incompatible"),
        (await setup.alice.request("GET", setup.block_url(1, compat="AB" * 32)), 400, "about:blank"),
        (await setup.alice.request("GET", setup.server.base_uri("/other/blocks")), 404, "about:blank"),
        (await setup.alice.request("POST", setup.url("blocks")), 404, "about:blank"),
    ]
    for response, status, type_ in cases:
        assert (response.status, problem_type(response)) == (status, type_), response.content
    assert setup.holder.blocks() and len(setup.holder.blocks()) == 1


async def test_blocks_over_tcp_too(setup: Setup, holder_certs: TestPki) -> None:
    async with KvspClient(holder_certs.files("alice"), h3=False) as tcp:  # HTTP/2 or HTTP/1.1, whatever ALPN picks
        stored = await setup.put(3, client=tcp)
        assert stored.status == 201 and stored.http_version in ("HTTP/2", "HTTP/1.1")
        got = await tcp.request("GET", setup.block_url(3, "layers=0-0"))
        assert got.status == 200 and got.http_version == stored.http_version
        verify_repr_digest(got)
        whole = await tcp.request("GET", setup.block_url(3))
        assert whole.content == body(setup.d, 3)
        verify_repr_digest(whole)


# -- leases ----------------------------------------------------------------------------------------------------------


async def lease_request(setup: Setup, client: KvspClient, keys: list[str], ttl_ms: int = 10_000) -> Response:
    payload = LeaseRequest(setup.d.compat_id, bytes.fromhex(SCOPE), tuple(bytes.fromhex(k) for k in keys),
                           ttl_ms).to_json()
    return await client.request("POST", setup.url("leases"), headers={"content-type": JSON},
                                content=json.dumps(payload).encode())


async def test_lease_lifecycle(setup: Setup) -> None:
    await setup.put(1)
    await setup.put(2)
    created = await lease_request(setup, setup.bob, [key(1), key(2)])
    assert created.status == 201 and created.headers["cache-control"] == "no-store"
    granted = LeaseResponse.from_json(created.json())
    assert created.headers["location"] == f"leases/{granted.lease}" and granted.ttl_ms == 10_000
    assert setup.holder.leases.protects(next(iter(setup.holder.blocks())))
    lease_url = setup.url(f"leases/{granted.lease}")
    renewal = json.dumps({"ttl_ms": 20_000}).encode()
    renewed = await setup.bob.request("PUT", lease_url, headers={"content-type": JSON}, content=renewal)
    assert renewed.status == 200 and LeaseResponse.from_json(renewed.json()).ttl_ms == 20_000
    other = await setup.alice.request("PUT", lease_url, headers={"content-type": JSON}, content=renewal)
    assert (other.status, problem_type(other)) == (404, "kvsp-not-found")
    assert (await setup.alice.request("DELETE", lease_url)).status == 404
    released = await setup.bob.request("DELETE", lease_url)
    assert released.status == 204 and released.headers["cache-control"] == "no-store"
    gone = await setup.bob.request("DELETE", lease_url)
    assert (gone.status, problem_type(gone)) == (404, "kvsp-not-found")
    bogus = await setup.bob.request("DELETE", setup.url("leases/not-a-uuid"))
    assert (bogus.status, problem_type(bogus)) == (404, "kvsp-not-found")


async def test_lease_errors(setup: Setup) -> None:
    await setup.put(1)
    await setup.put(2)
    await setup.put(3)
    missing = await lease_request(setup, setup.bob, [key(1), key(9)])
    assert (missing.status, problem_type(missing)) == (404, "kvsp-not-found") and len(setup.holder.leases) == 0
    too_long = await lease_request(setup, setup.bob, [key(1)], ttl_ms=30_001)
    assert (too_long.status, problem_type(too_long)) == (429, "kvsp-lease-quota")
    too_much = await lease_request(setup, setup.bob, [key(1), key(2), key(3)])  # quota: two blocks' octets
    assert (too_much.status, problem_type(too_much)) == (429, "kvsp-lease-quota")
    bad = await setup.bob.request("POST", setup.url("leases"), headers={"content-type": JSON}, content=b"{}")
    assert (bad.status, problem_type(bad)) == (400, "about:blank")
    plain = await setup.bob.request("POST", setup.url("leases"), headers={"content-type": "application/json"},
                                    content=b"{}")
    assert plain.status == 415
    huge = await setup.bob.request("POST", setup.url("leases"), headers={"content-type": JSON},
                                   content=b" " * (65 << 10))
    assert huge.status == 413


async def test_a_full_holder_refuses_to_evict_leased_blocks(setup: Setup) -> None:
    for n in (1, 2, 3):
        await setup.put(n)
    assert (await lease_request(setup, setup.alice, [key(1), key(2)])).status == 201
    assert (await lease_request(setup, setup.bob, [key(3)])).status == 201
    full = await setup.put(4)
    assert full.status == 507 and problem_type(full) == "about:blank"
    assert (await setup.alice.request("GET", setup.block_url(1, "layers=0-0"))).status == 200


# -- the publisher against a fake Index Service ---------------------------------------------------------------------


class FakeIndex:
    """Records PUT/DELETE replicas/{holder-id}/{block_key}; answers 503 to the first *fail* requests."""

    def __init__(self, fail: int = 0) -> None:
        self.calls: list[tuple[str, str, str | None, dict[str, Any] | None]] = []
        self.fail = fail
        self.changed = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = await read_body(receive)
        record = json.loads(raw) if raw else None
        if record is not None:
            ReplicaRecord.from_json(record)  # a valid record, as the IS would check
        self.calls.append((scope["method"], scope["path"], scope_identity(scope), record))
        self.changed.set()
        status = 503 if self.fail > 0 else (200 if scope["method"] == "PUT" else 204)
        self.fail -= 1
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/problem+json" if status == 503 else JSON.encode())]})
        await send({"type": "http.response.body", "body": b"{}"})

    async def wait_for(self, count: int, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.calls) < count:
                self.changed.clear()
                await self.changed.wait()


async def test_publisher_publishes_refreshes_retries_and_withdraws(holder_certs: TestPki, d: CompatDescriptor) -> None:
    index = FakeIndex(fail=1)
    server = RoleServer(index, holder_certs.files("index"))
    await server.start("127.0.0.1", 0)
    size = len(body(d, 1))
    holder = Holder(HolderSettings(HOLDER_URI, (d,), host_capacity=size, replica_ttl_ms=900,
                                   publish_backoff_ms=(50, 200)))
    client = KvspClient(holder_certs.files("holder"))
    publisher = ReplicaPublisher(holder, client, server.base_uri("/is/"))
    principal = POLICY.principal(ALICE)
    assert principal is not None
    try:
        publisher.start()
        holder.store(principal, d.compat_id, bytes.fromhex(SCOPE), bytes.fromhex(key(1)), body(d, 1), "*")
        await index.wait_for(2)  # a 503, then the retry
        path = f"/is/replicas/{uri_id(HOLDER_URI)}/{key(1)}"
        assert [(m, p, who) for m, p, who, _ in index.calls] == [("PUT", path, HOLDER_URI)] * 2
        record = ReplicaRecord.from_json(index.calls[1][3])
        assert record.block_key.hex() == key(1) and record.ttl_ms == 900 and record.holder == HOLDER_URI
        await index.wait_for(3)  # the refresh, a third of the TTL later
        assert index.calls[2][:2] == ("PUT", path)
        holder.store(principal, d.compat_id, bytes.fromhex(SCOPE), bytes.fromhex(key(2)), body(d, 2), "*")
        # 1 evicted (withdrawn), 2 published, in either order (on a loaded machine a refresh may come between)
        wanted = {("DELETE", key(1)), ("PUT", key(2))}
        while not wanted <= {(m, p.rsplit("/", 1)[1]) for m, p, _, _ in index.calls[3:]}:
            assert len(index.calls) < 12, index.calls[3:]
            await index.wait_for(len(index.calls) + 1)
        seen = [(m, p.rsplit("/", 1)[1]) for m, p, _, _ in index.calls]
        assert ("PUT", key(1)) not in seen[seen.index(("DELETE", key(1))):]  # never published again once withdrawn
        await publisher.stop(withdraw=True)
        assert index.calls[-1][:2] == ("DELETE", f"/is/replicas/{uri_id(HOLDER_URI)}/{key(2)}")
        assert len(holder.outbox) == 0 and not publisher.running
    finally:
        await publisher.stop()
        await client.aclose()
        await server.close()


async def test_publisher_stops_cleanly_while_the_index_is_unreachable(holder_certs: TestPki,
                                                                      d: CompatDescriptor) -> None:
    holder = Holder(HolderSettings(HOLDER_URI, (d,), publish_backoff_ms=(50, 100)))
    client = KvspClient(holder_certs.files("holder"), connect_timeout=0.2, retries=0)
    publisher = ReplicaPublisher(holder, client, "https://127.0.0.1:9/is/", timeout=0.5)  # nothing listens
    principal = POLICY.principal(ALICE)
    assert principal is not None
    publisher.start()
    holder.store(principal, d.compat_id, bytes.fromhex(SCOPE), bytes.fromhex(key(1)), body(d, 1), "*")
    got = await setup_get(holder, principal, d)
    assert got == body(d, 1)  # request handling does not wait for the Index Service
    await asyncio.sleep(0.3)
    await publisher.stop(withdraw=True, timeout=0.2)
    await client.aclose()
    assert not publisher.running and holder.outbox.state(next(iter(holder.blocks())))[0].value == "withdraw"


async def setup_get(holder: Holder, principal: Any, d: CompatDescriptor) -> bytes:
    return holder.fetch(principal, d.compat_id, bytes.fromhex(SCOPE), bytes.fromhex(key(1))).container.tobytes()
