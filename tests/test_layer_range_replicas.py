"""Replicas of a layer range of a block (issue 13; spec, "Block Retrieval and Storage", the container's First Layer
and Layer Count, "Records": residency with inclusive layer ranges, ``layer_digests`` REQUIRED for replicas served
by layer range), stored and served by real holders on 127.0.0.1.

One RoleServer serves the Index Service (``/is/``) and two holders (``/h1/``, ``/h2/``) over HTTP/3 and HTTP/1.1 +
HTTP/2 with mutual TLS; each holder publishes its own records with its ReplicaPublisher. Layers 0-15 of a 32-layer
block go to h1, 16-31 to h2; the BlockFetcher (kvsp_client/retrieval.py) loads the block from the two, verifying every
layer against each replica's record. Also: the answers of GET and PUT for ranges outside, bad ranges, a second
range of a key, a restart from local storage, MOQT (only the layers held are objects), a worker process's
upload path (the shared host tier)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from http3.client import KvspClient
from http3.server import RoleServer, bind_pair
from kvsp_client.retrieval import BlockFetcher, HttpSource
from kvsp_dev import pki
from kvsp_http.holder_app import holder_app
from kvsp_http.index_app import index_app
from kvsp_moqt.holder_tracks import fetch_replica, holder_moqt_handlers
from kvsp_moqt.source import MoqtSource, PreferMoqt
from kvsp_moqt.tracks import invalid_range, moqt_record
from kvsp_quic import container as c
from kvsp_quic.auth import ALL, Policy, Principal, Role
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.cost import plan_fetch
from kvsp_quic.fields import BlockKey
from kvsp_quic.keys import holder_id
from kvsp_quic.problems import BadRequest, LayersUnavailable, PreconditionFailed, problem_from_json
from kvsp_quic.records import Link, LookupMatch, ReplicaRecord, ResidencyEntry
from kvsp_quic.repr_digest import parse_repr_digest
from kvsp_quic.retrieval_plan import DefaultRanking, LayerRange, held_through, next_parts
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.holder_worker import HolderWorker
from kvsp_quic.roles.index import IndexService
from kvsp_quic.samples import random_sections
from kvsp_quic.storage.memory_index import MemoryIndexStore
from kvsp_quic.storage.shared_host import SharedHostTier
from kvsp_quic.storage.tiers import (
    UNKNOWN_DIGEST,
    BlockId,
    LocalStorageConfig,
    TieredStore,
    eviction_policy,
)
from kvsp_runtime.publisher import ReplicaPublisher
from moqt.aio import MoqtPool, MoqtRequestError
from moqt.types import Draft
from quic.tls import TlsFiles
from tests.asgi import Router
from tests.pki import TestPki
from tests.support.descriptors import small_descriptor

SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
ALICE = "urn:kvsp:client:alice"  # stores (instance) and loads blocks
LAYERS = 32
HALF = LAYERS // 2
KEY = hashlib.sha256(b"a block kept in two halves").digest()
JSON = "application/kvsp+json"
PUBLISHER = Principal("urn:test:publisher", frozenset({Role.HOLDER}), ALL, ALL)  # publishes for every holder


@pytest.fixture(scope="module")
def d() -> CompatDescriptor:
    return small_descriptor(layers=LAYERS)


def sections(d: CompatDescriptor, first: int = 0, last: int = LAYERS - 1) -> list[tuple[Any, Any]]:
    return list(random_sections(d, d.block_tokens, 0, LAYERS - 1, 7))[first:last + 1]


def container(d: CompatDescriptor, first: int, last: int) -> bytes:
    """Layers *first*..*last* of the test block, as a container (the same octets as the whole block has)."""
    return c.encode(sections(d, first, last), first_layer=first, token_count=d.block_tokens, descriptor=d).tobytes()


def digests(d: CompatDescriptor) -> list[bytes]:
    return [c.layer_digest(k, v) for k, v in sections(d)]


def check_record(record: ReplicaRecord, d: CompatDescriptor, holder: str, first: int, last: int) -> None:
    """A partial replica's record: its residency is the range stored; its layer_digests list every layer of the block
    (indexed by layer), the held ones' SHA-256 and 32 zero octets for the others; its digest is SHA-256 over them."""
    assert record.holder == holder and record.residency == (ResidencyEntry("host", (first, last)),)
    want = [digest if first <= i <= last else UNKNOWN_DIGEST for i, digest in enumerate(digests(d))]
    assert record.layer_digests is not None and list(record.layer_digests) == want
    assert record.digest == hashlib.sha256(b"".join(want)).digest() != c.replica_digest(digests(d))
    assert record.size == len(container(d, first, last))


# -- two holders over HTTP, the retrieval client -------------------------------------------------------------------


class Net:
    def __init__(self, server: RoleServer, router: Router, holders: dict[str, Holder], client: KvspClient,
                 d: CompatDescriptor, certs: TestPki, index: IndexService, policy: Policy) -> None:
        self.server, self.router, self.holders, self.client, self.d, self.certs = \
            server, router, holders, client, d, certs
        self.index, self.policy = index, policy

    def uri(self, name: str) -> str:
        return self.server.base_uri(f"/{name}/")

    def url(self, name: str, query: str = "", key: bytes = KEY) -> str:
        path = f"{self.uri(name)}blocks/{self.d.compat_id.hex()}/{SCOPE.hex()}/{key.hex()}"
        return f"{path}?{query}" if query else path

    async def put(self, name: str, body: bytes, query: str = "", key: bytes = KEY) -> Any:
        return await self.client.request("PUT", self.url(name, query, key), content=body,
                                         headers={"content-type": "application/kvsp-block", "if-none-match": "*"})

    async def publish(self, name: str, first: int, last: int, key: bytes = KEY) -> ReplicaRecord:
        """Layers *first*..*last* of the test block stored at holder *name* (PUT) and its record published."""
        answer = await self.put(name, container(self.d, first, last), key=key)
        assert answer.status == 201, answer.content
        record = ReplicaRecord.loads(answer.content or b"")
        await self.index.publish(PUBLISHER, holder_id(record.holder), key, record)
        return record

    def holder_files(self, name: str) -> TlsFiles:
        """A certificate naming holder *name*'s base URI (its publisher's identity at the Index Service)."""
        root = self.certs.root
        ca_cert, ca_key = pki.load_pair(root, "ca")
        file_name = f"{name}-{self.server.port}"
        cert, private = pki.issue(ca_cert, ca_key, pki.role(file_name, self.uri(name)), extra_hosts=["127.0.0.1"])
        pki.write_pair(root, file_name, cert, private)
        return self.certs.files(file_name)


@pytest.fixture
async def net(server_holder_certs: TestPki, d: CompatDescriptor) -> AsyncIterator[Net]:
    router = Router()
    server = RoleServer(router, server_holder_certs.files("server"))
    await server.start("127.0.0.1", 0)
    uri = server.base_uri
    policy = Policy.from_dict({"principal": [
        {"identity": ALICE, "roles": ["client", "instance"], "scopes": [SCOPE.hex()]},
        {"identity": uri("/h1/"), "roles": ["holder"], "scopes": "*"},
        {"identity": uri("/h2/"), "roles": ["holder"], "scopes": "*"},
        {"identity": uri("/h3/"), "roles": ["holder"], "scopes": "*"},
    ]})
    holders = {name: Holder(HolderSettings(uri(f"/{name}/"), (d,), replica_ttl_ms=60_000))
               for name in ("h1", "h2", "h3")}
    index = IndexService(MemoryIndexStore(), clock=time.monotonic)
    router.apps["/is/"] = index_app(index, policy, base_path="/is/", sweep_interval=None)
    for name, holder in holders.items():
        router.apps[f"/{name}/"] = holder_app(holder, policy)
    client = KvspClient(server_holder_certs.files("alice"), timeout=10.0)
    try:
        yield Net(server, router, holders, client, d, server_holder_certs, index, policy)
    finally:
        await client.aclose()
        await server.close()


async def test_two_partial_replicas_published_and_assembled_into_the_block(net: Net, d: CompatDescriptor) -> None:
    clients = [KvspClient(net.holder_files(name)) for name in ("h1", "h2")]
    publishers = [ReplicaPublisher(net.holders[name], client, net.uri("is"))
                  for name, client in zip(("h1", "h2"), clients, strict=True)]
    for publisher in publishers:
        publisher.start()
    fetcher = BlockFetcher(net.client, net.uri("is"), descriptors=[d])
    try:
        first = await net.put("h1", container(d, 0, HALF - 1), f"layers=0-{HALF - 1}")  # names its range too
        second = await net.put("h2", container(d, HALF, LAYERS - 1))  # the container header alone names it
        assert (first.status, second.status) == (201, 201), (first.content, second.content)
        check_record(ReplicaRecord.loads(first.content or b""), d, net.uri("h1"), 0, HALF - 1)
        check_record(ReplicaRecord.loads(second.content or b""), d, net.uri("h2"), HALF, LAYERS - 1)
        async with asyncio.timeout(10):  # both published by their holders, with their residency
            while True:
                found = await fetcher.lookup(d.compat_id, SCOPE, [KEY])
                if found.matched and len(found.blocks[0].replicas) == 2:
                    break
                await asyncio.sleep(0.05)
    finally:
        for publisher in publishers:
            await publisher.stop()
        for client in clients:
            await client.aclose()
    match = found.blocks[0]
    by_holder = {r.holder: r for r in match.replicas}
    check_record(by_holder[net.uri("h1")], d, net.uri("h1"), 0, HALF - 1)
    check_record(by_holder[net.uri("h2")], d, net.uri("h2"), HALF, LAYERS - 1)

    # the block from its two halves, each layer verified against the record of the replica it came from
    layers: list[c.DecodedLayer] = []
    for part in ((0, HALF - 1), (HALF, LAYERS - 1)):
        async with fetcher.fetch_layers(match, layers=part) as stream:
            layers += [layer async for layer in stream]
        assert stream.complete and [r.holder for r in stream.records] == [net.uri("h1" if part[0] == 0 else "h2")]
    assert [layer.index for layer in layers] == list(range(LAYERS))
    assert [layer.digest for layer in layers] == digests(d)
    rehashed = [c.layer_digest(bytes(layer.k), bytes(layer.v)) for layer in layers]
    assert c.replica_digest(rehashed) == c.replica_digest(digests(d))  # the block's own replica digest
    whole = c.encode([(bytes(layer.k), bytes(layer.v)) for layer in layers], first_layer=0,
                     token_count=d.block_tokens, descriptor=d).tobytes()
    assert whole == container(d, 0, LAYERS - 1)
    m = fetcher.metrics
    assert (m.hits, m.misses, m.layers, m.digest_failures, m.malformed) == (2, 0, LAYERS, 0, 0)
    # h1 was asked for its layers by range (a GET without layers= would answer the container it holds, too)
    assert [r[2] for r in net.router.requests("/h1/blocks/") if r[0] == "GET"] == [f"layers=0-{HALF - 1}"]


async def test_get_and_put_of_ranges_a_holder_does_not_hold(net: Net, d: CompatDescriptor) -> None:
    assert (await net.put("h2", container(d, HALF, LAYERS - 1), f"layers={HALF}-{LAYERS - 1}")).status == 201

    async def get(query: str = "") -> Any:
        return await net.client.request("GET", net.url("h2", query))

    whole = await get()  # no layers=: the container the replica holds
    assert whole.status == 200 and whole.content == container(d, HALF, LAYERS - 1)
    assert parse_repr_digest(whole.headers["repr-digest"]) == hashlib.sha256(whole.content).digest()
    part = await get("layers=20-22")
    assert part.status == 200 and part.content == container(d, 20, 22)
    assert parse_repr_digest(part.headers["repr-digest"]) == hashlib.sha256(part.content).digest()
    for outside in ("layers=0-15", f"layers={HALF - 1}-{HALF}", "layers=30-32", "layers=40-41"):
        answer = await get(outside)
        problem = problem_from_json(answer.status, answer.content or b"")
        assert answer.status == 404 and problem is not None, outside
        assert problem.type_uri.endswith("#kvsp-layers-unavailable"), outside
    for bad in ("layers=22-20", "layers=a-b", "layers=01-2", "layers=3"):
        assert (await get(bad)).status == 400, bad

    # PUT: a declared range that is not the container's, a malformed one, layers beyond the descriptor -> 400
    other = KEY[::-1]
    for query, body in ((f"layers=0-{HALF}", container(d, 0, HALF - 1)), ("layers=0-", container(d, 0, 3)),
                        ("layers=3-2", container(d, 2, 3)),
                        ("", c.encode(sections(d, 30, 31) * 2, first_layer=30, token_count=d.block_tokens).tobytes())):
        answer = await net.put("h1", body, query, key=other)
        assert answer.status == 400, (query, answer.content)
    assert net.holders["h1"].blocks() == []
    # a second range of a key already held: 412, the replica held is kept (one replica per key and holder)
    again = await net.put("h2", container(d, 0, HALF - 1), f"layers=0-{HALF - 1}")
    assert again.status == 412
    assert (await get()).content == container(d, HALF, LAYERS - 1)
    assert (await get("layers=0-0")).status == 404


# -- a restart from local storage --------------------------------------------------------------------------------


BASE = "https://holder.example/kvsp/"


def test_a_restart_recovers_the_partial_replica_with_its_range(d: CompatDescriptor, tmp_path: Path) -> None:
    config = LocalStorageConfig(tmp_path / "blocks", 1 << 20, fsync=False)
    policy = Policy.from_dict({"principal": [{"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]}]})
    alice = policy.principal(ALICE)
    assert alice is not None
    settings = HolderSettings(BASE, (d,), local_storage=config)
    stored = Holder(settings).store(alice, d.compat_id, SCOPE, KEY, container(d, HALF, LAYERS - 1), "*")
    check_record(stored, d, BASE, HALF, LAYERS - 1)
    again = Holder(settings)  # the process died; its write-through file is on disk
    assert again.recover() == 1
    block = BlockId(bytes(d.compat_id), SCOPE, KEY)
    record = again.record(block)
    assert record.residency[0].layers == (HALF, LAYERS - 1) and record.layer_digests == stored.layer_digests
    assert record.digest == stored.digest
    assert again.fetch(alice, d.compat_id, SCOPE, KEY).container.tobytes() == container(d, HALF, LAYERS - 1)
    assert again.fetch(alice, d.compat_id, SCOPE, KEY, layers=(30, 31)).container.tobytes() == \
        container(d, 30, 31)
    with pytest.raises(LayersUnavailable):
        again.fetch(alice, d.compat_id, SCOPE, KEY, layers=(0, HALF))
    with pytest.raises(PreconditionFailed):  # still one replica per key
        again.store(alice, d.compat_id, SCOPE, KEY, container(d, 0, HALF - 1), "*")


# -- a worker process's upload path: the shared host tier ------------------------------------------------------


class _Primary:
    """The primary side of a worker's requests, in this process: the real Holder's commit of a staged upload."""

    def __init__(self, holder: Holder) -> None:
        self.holder = holder

    def commit(self, block: BlockId, staged: str, reads: list[BlockId], owner: str | None,
               position: Any = None) -> ReplicaRecord:
        self.holder.note_reads(reads)
        return self.holder.commit_staged(block, staged, owner=owner, position=position)

    def fault(self, block: BlockId, reason: str) -> None:
        self.holder.fault(block, reason)

    def reads(self, blocks: list[BlockId]) -> None:
        self.holder.note_reads(blocks)


def test_a_worker_stores_and_serves_a_layer_range(d: CompatDescriptor, tmp_path: Path) -> None:
    policy = Policy.from_dict({"principal": [{"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]}]})
    alice = policy.principal(ALICE)
    assert alice is not None
    directory = tmp_path / "shm"
    directory.mkdir(mode=0o700)
    settings = HolderSettings(BASE, (d,))
    primary = Holder(settings, store=TieredStore([SharedHostTier(directory, 1 << 20, eviction_policy("lru"))]))
    worker = HolderWorker(settings, directory, _Primary(primary))  # type: ignore[arg-type]
    try:
        upload = worker.begin_store(alice, d.compat_id, SCOPE, KEY, "*")
        upload.layers = (4, 9)
        upload.feed(container(d, 4, 9))
        record = upload.finish()
        assert record.residency[0].layers == (4, 9) and record.layer_digests is not None
        assert record.layer_digests[4:10] == tuple(digests(d)[4:10]) and record.layer_digests[3] == UNKNOWN_DIGEST
        assert worker.fetch(alice, d.compat_id, SCOPE, KEY).container.tobytes() == container(d, 4, 9)
        assert worker.fetch(alice, d.compat_id, SCOPE, KEY, layers=(5, 6)).container.tobytes() == container(d, 5, 6)
        with pytest.raises(LayersUnavailable):
            worker.fetch(alice, d.compat_id, SCOPE, KEY, layers=(9, 10))
        with pytest.raises(BadRequest):  # the declared range is checked before the buffer is allocated
            bad = worker.begin_store(alice, d.compat_id, SCOPE, KEY[::-1], "*")
            bad.layers = (4, 8)
            bad.feed(container(d, 4, 9))
    finally:
        worker.close()


# -- MOQT: only the layers held are objects ------------------------------------------------------------------------


@pytest.mark.parametrize("alpn", ["moq-00", "moqt-18"])
async def test_moqt_serves_only_the_layers_held(server_holder_certs: TestPki, d: CompatDescriptor, alpn: str) -> None:
    tcp, udp = bind_pair("127.0.0.1", 0, 1 << 20)
    base = f"https://127.0.0.1:{tcp.getsockname()[1]}/kvsp/"
    policy = Policy.from_dict({"principal": [{"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]}]})
    alice = policy.principal(ALICE)
    assert alice is not None
    holder = Holder(HolderSettings(base, (d,)))
    record = holder.store(alice, d.compat_id, SCOPE, KEY, container(d, HALF, LAYERS - 1), "*")
    server = RoleServer(holder_app(holder, policy), server_holder_certs.files("holder"),
                        quic_handlers=holder_moqt_handlers(holder, policy))
    await server.start(sockets=(tcp, udp))
    try:
        twin = moqt_record(record, f"moqt://127.0.0.1:{server.port}/")
        async with MoqtPool(server_holder_certs.files("alice"), alpn=alpn, connect_timeout=3) as pool:
            got = [layer async for layer in fetch_replica(pool, twin, (HALF, LAYERS - 1), descriptor=d)]
            assert [layer.index for layer in got] == list(range(HALF, LAYERS))
            assert [layer.digest for layer in got] == digests(d)[HALF:]
            got = [layer async for layer in fetch_replica(pool, twin, (20, 21), descriptor=d)]
            assert [(layer.index, bytes(layer.k)) for layer in got] == \
                [(i, bytes(k)) for i, (k, _v) in zip((20, 21), sections(d, 20, 21), strict=True)]
            for outside in ((0, HALF - 1), (HALF - 1, HALF)):  # never a layer it does not have
                with pytest.raises(MoqtRequestError) as info:
                    async for _ in fetch_replica(pool, twin, outside, descriptor=d):
                        pass
                assert info.value.error_code == invalid_range(Draft.from_alpn(alpn))
    finally:
        await server.close()


# -- a block assembled from partial replicas at several holders (kvsp_client/retrieval.py, BlockFetcher) ---------------


class Order:
    """A ranking that tries the replicas of the holders in *first* before the others (the default order after)."""

    def __init__(self, *first: str) -> None:
        self.first = first

    def __call__(self, replicas: Sequence[ReplicaRecord], layers: LayerRange) -> list[ReplicaRecord]:
        ordered = DefaultRanking()(replicas, layers)
        return sorted(ordered, key=lambda r: self.first.index(r.holder) if r.holder in self.first else len(self.first))


def gets(net: Net, name: str) -> list[str]:
    """The queries of the block GETs holder *name* answered."""
    return [r[2] for r in net.router.requests(f"/{name}/blocks/") if r[0] == "GET"]


async def test_fetch_layers_of_a_whole_block_assembles_it_from_partial_replicas_at_two_holders(
        net: Net, d: CompatDescriptor) -> None:
    await net.publish("h1", 0, HALF - 1)
    await net.publish("h2", HALF, LAYERS - 1)
    fetcher = BlockFetcher(net.client, net.uri("is"), descriptors=[d], withdraw_corrupt=False)
    found = await fetcher.lookup(d.compat_id, SCOPE, [KEY])
    assert found.matched == 1 and len(found.blocks[0].replicas) == 2
    match = found.blocks[0]

    layers: list[c.DecodedLayer] = []
    async with fetcher.fetch_layers(match) as stream:  # the whole block, as instances ask for it
        async for layer in stream:
            if layer.index == 0:  # streamed: the first layer arrives before the second holder is even asked
                assert gets(net, "h2") == []
            layers.append(layer)
    assert stream.complete and [r.holder for r in stream.records] == [net.uri("h1"), net.uri("h2")]
    assert [layer.index for layer in layers] == list(range(LAYERS))
    assert [layer.digest for layer in layers] == digests(d)  # each verified against its replica's layer digest
    joined = c.encode([(bytes(x.k), bytes(x.v)) for x in layers], first_layer=0, token_count=d.block_tokens,
                      descriptor=d).tobytes()
    assert joined == container(d, 0, LAYERS - 1)
    assert gets(net, "h1") == [f"layers=0-{HALF - 1}"] and gets(net, "h2") == [f"layers={HALF}-{LAYERS - 1}"]
    m = fetcher.metrics
    assert (m.hits, m.misses, m.attempts, m.layers, m.digest_failures, m.replica_misses) == (1, 0, 2, LAYERS, 0, 0)

    result = await fetcher.fetch_block(match)  # the same through fetch_block; and a range across both halves
    assert result is not None and result.tobytes() == container(d, 0, LAYERS - 1) and len(result.records) == 2
    result = await fetcher.fetch_block(match, (HALF - 2, HALF + 1))
    assert result is not None and result.tobytes() == container(d, HALF - 2, HALF + 1)
    assert gets(net, "h1")[-1] == f"layers={HALF - 2}-{HALF - 1}"
    assert gets(net, "h2")[-1] == f"layers={HALF}-{HALF + 1}"

    # a record whose digest for layer 20 is wrong: that layer fails its check, the block is missing from there on
    by_holder = {r.holder: r for r in match.replicas}
    wrong = list(by_holder[net.uri("h2")].layer_digests or ())
    wrong[20] = hashlib.sha256(b"not layer 20").digest()
    tampered = dataclasses.replace(by_holder[net.uri("h2")], layer_digests=tuple(wrong),
                                   digest=hashlib.sha256(b"".join(wrong)).digest())
    checking = BlockFetcher(net.client, net.uri("is"), descriptors=[d], withdraw_corrupt=False)
    halves = LookupMatch(match.block_key, (by_holder[net.uri("h1")], tampered))
    async with checking.fetch_layers(halves) as stream:
        got = [layer.index async for layer in stream]
    assert not stream.complete and HALF <= stream.next_layer <= 20  # (layers of the failing chunk are not given)
    assert got == list(range(stream.next_layer))
    assert (checking.metrics.digest_failures, checking.metrics.misses) == (1, 1)


async def test_one_replica_of_the_whole_block_is_preferred_and_its_replica_digest_checked(
        net: Net, d: CompatDescriptor) -> None:
    await net.publish("h1", 0, HALF - 1)
    await net.publish("h2", HALF, LAYERS - 1)
    whole = await net.publish("h3", 0, LAYERS - 1)
    assert whole.digest == c.replica_digest(digests(d))
    fetcher = BlockFetcher(net.client, net.uri("is"), descriptors=[d], ranking=Order(net.uri("h1"), net.uri("h2")),
                           withdraw_corrupt=False)
    match = (await fetcher.lookup(d.compat_id, SCOPE, [KEY])).blocks[0]
    result = await fetcher.fetch_block(match)
    assert result is not None and result.tobytes() == container(d, 0, LAYERS - 1)
    assert [r.holder for r in result.records] == [net.uri("h3")] and gets(net, "h3") == [""]  # no layers=
    assert gets(net, "h1") == gets(net, "h2") == []

    # the complete replica's replica digest is checked: a record (without layer digests) whose digest is wrong
    bad = dataclasses.replace(whole, layer_digests=None, digest=hashlib.sha256(b"another block").digest())
    result = await fetcher.fetch_block(LookupMatch(match.block_key, (bad,)))
    assert result is None and fetcher.metrics.digest_failures == 1


async def test_a_dead_holder_of_a_range_falls_back_to_another_replica_of_that_range_else_a_miss(
        net: Net, d: CompatDescriptor) -> None:
    dead_server = RoleServer(Router(), net.certs.files("server"))
    await dead_server.start("127.0.0.1", 0)
    dead = Holder(HolderSettings(dead_server.base_uri("/h9/"), (d,), replica_ttl_ms=60_000))
    cast(Router, dead_server.app).apps["/h9/"] = holder_app(dead, net.policy)
    alice = net.policy.principal(ALICE)
    assert alice is not None
    gone = dead.store(alice, d.compat_id, SCOPE, KEY, container(d, HALF, LAYERS - 1), "*")
    await net.index.publish(PUBLISHER, holder_id(gone.holder), KEY, gone)
    await dead_server.close()  # the holder of layers 16-31 died; its record is still listed
    await net.publish("h1", 0, HALF - 1)
    other = await net.publish("h2", HALF, LAYERS - 1)

    fetcher = BlockFetcher(net.client, net.uri("is"), descriptors=[d], ranking=Order(gone.holder),
                           withdraw_corrupt=False, report_failures=False)
    match = (await fetcher.lookup(d.compat_id, SCOPE, [KEY])).blocks[0]
    assert len(match.replicas) == 3
    result = await fetcher.fetch_block(match)
    assert result is not None and result.tobytes() == container(d, 0, LAYERS - 1)
    assert [r.holder for r in result.records] == [net.uri("h1"), net.uri("h2")]
    assert fetcher.metrics.transport_errors == 1 and fetcher.metrics.attempts == 3

    # no other replica of 16-31: layers 0-15 are delivered, the block is missing from layer 16 on
    lonely = BlockFetcher(net.client, net.uri("is"), descriptors=[d], withdraw_corrupt=False, report_failures=False)
    only = LookupMatch(match.block_key, tuple(r for r in match.replicas if r.holder != other.holder))
    async with lonely.fetch_layers(only) as stream:
        got = [layer.index async for layer in stream]
    assert got == list(range(HALF)) and not stream.complete and stream.next_layer == HALF
    assert (lonely.metrics.misses, lonely.metrics.transport_errors) == (1, 1)
    # and a block whose layers no chain of replicas covers is not fetched at all
    first_half = LookupMatch(match.block_key, tuple(r for r in match.replicas if r.holder == net.uri("h1")))
    before = len(gets(net, "h1"))
    assert await lonely.fetch_block(first_half) is None and len(gets(net, "h1")) == before


def test_next_parts_prefers_one_replica_then_the_fewest_parts(d: CompatDescriptor) -> None:
    policy = Policy.from_dict({"principal": [{"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]}]})
    alice = policy.principal(ALICE)
    assert alice is not None

    def replica(name: str, first: int, last: int) -> ReplicaRecord:
        holder = Holder(HolderSettings(f"https://{name}.example/", (d,)))
        return holder.store(alice, d.compat_id, SCOPE, KEY, container(d, first, last), "*")

    a, b, e, f, whole = replica("a", 0, 7), replica("b", 0, 23), replica("e", 8, 31), replica("f", 24, 31), \
        replica("w", 0, 31)
    rank = DefaultRanking()
    assert held_through(a, 0) == 7 and held_through(a, 8) is None and held_through(e, 8) == 31
    assert next_parts([a, b, e, f, whole], (0, 31), rank) == [(whole, (0, 31))]  # one replica: it alone
    # two parts either way (b then f, a then e): the longer first part first; three-part chains never
    assert next_parts([a, b, e, f], (0, 31), rank) == [(b, (0, 23)), (a, (0, 7))]
    assert next_parts([a, b, e, f], (8, 31), rank) == [(e, (8, 31))]
    assert next_parts([a, b, e, f], (2, 5), rank) == [(a, (2, 5)), (b, (2, 5))]
    assert next_parts([a, f], (0, 31), rank) == []  # layers 8-23 nowhere: nothing to fetch
    # the cost model (kvsp_quic/cost.py) counts a block covered by the union of partial replicas as fetchable, from
    # both sources, each for the octets of its layers
    links = [Link(r.holder, 8000.0, 100.0) for r in (a, e)]
    plan = plan_fetch("https://target.example/", links, [[a, e]])
    assert plan.blocks == 1 and sorted(plan.sources[0]) == [a.holder, e.holder]
    assert plan.bytes_from == {a.holder: float(a.size), e.holder: float(e.size)}
    assert plan_fetch("https://target.example/", links[:1], [[a, e]]).blocks == 0  # e out of reach: recomputed
    # a layer whose digest is the zero placeholder is never asked of that replica, whatever its residency says
    claims = dataclasses.replace(a, residency=(ResidencyEntry("host", (0, 8)),))
    assert held_through(claims, 0) == 7 and held_through(claims, 8) is None


@pytest.mark.parametrize("alpn", ["moq-00", "moqt-18"])
async def test_moqt_partial_replicas_at_two_holders_give_the_whole_block(server_holder_certs: TestPki,
                                                                        d: CompatDescriptor, alpn: str) -> None:
    policy = Policy.from_dict({"principal": [{"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]}]})
    alice = policy.principal(ALICE)
    assert alice is not None
    servers: list[RoleServer] = []
    replicas: list[ReplicaRecord] = []
    try:
        for first, last in ((0, HALF - 1), (HALF, LAYERS - 1)):
            tcp, udp = bind_pair("127.0.0.1", 0, 1 << 20)
            holder = Holder(HolderSettings(f"https://127.0.0.1:{tcp.getsockname()[1]}/kvsp/", (d,)))
            record = holder.store(alice, d.compat_id, SCOPE, KEY, container(d, first, last), "*")
            server = RoleServer(holder_app(holder, policy), server_holder_certs.files("holder"),
                                quic_handlers=holder_moqt_handlers(holder, policy))
            await server.start(sockets=(tcp, udp))
            servers.append(server)
            replicas += [record, moqt_record(record, f"moqt://127.0.0.1:{server.port}/")]
        async with KvspClient(server_holder_certs.files("alice")) as client, \
                MoqtPool(server_holder_certs.files("alice"), alpn=alpn, connect_timeout=3) as pool:
            fetcher = BlockFetcher(client, "https://127.0.0.1:9/is/", descriptors=[d], ranking=PreferMoqt(),
                                   sources=[MoqtSource(pool, [d]), HttpSource(client)], withdraw_corrupt=False,
                                   report_failures=False)
            match = LookupMatch(BlockKey(KEY), tuple(replicas))
            result = await fetcher.fetch_block(match)
            assert result is not None and result.tobytes() == container(d, 0, LAYERS - 1)
            assert [r.holder for r in result.records] == [replicas[1].holder, replicas[3].holder]
            assert all(t.startswith("MOQT/") for t in result.transports) and fetcher.metrics.attempts == 2
            assert [x.digest for x in result.layers] == digests(d)
            result = await fetcher.fetch_block(match, (HALF - 1, HALF))  # a FETCH of one object at each
            assert result is not None and result.tobytes() == container(d, HALF - 1, HALF)
    finally:
        for server in servers:
            await server.close()
