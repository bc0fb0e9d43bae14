"""The producer-digest mode (issue 13; spec, Security Considerations, "Cache poisoning": "the producing instance can
publish the digest itself, and consumers accept only replicas whose digest matches that of the producer"):
kvsp_quic/producer_digests.py, kvsp_quic/roles/producer_digests.py, kvsp_quic/storage/*producer_digests.py,
kvsp_client/producer_digests.py, the fetcher's ``require_producer_digest`` (kvsp_client/retrieval.py) and the instance's
``publish_producer_digests`` / ``require_producer_digest`` (kvsp_runtime/instance_service.py).

Real servers on 127.0.0.1: one RoleServer (HTTP/3 + HTTP/1.1/2, mutual TLS) serves the Index Service (``/is/``, a
strict policy), an honest holder (``/h1/``) and a malicious one (``/h2/``) whose Replica Records and octets agree
with each other but not with what the producer computed. The last test runs inference instances (tests/
support/instance.py's cluster) and checks the tokens are exactly those of a run without a cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_client.producer_digests import ProducerDigestApi, ProducerDigestPublisher
from kvsp_client.retrieval import BlockFetcher
from kvsp_dev import pki
from kvsp_http.holder_app import holder_app
from kvsp_http.index_app import INDEX_RULES, index_app
from kvsp_quic.auth import Policy
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.keys import holder_id
from kvsp_quic.problems import Forbidden, ScopeDenied
from kvsp_quic.producer_digests import ProducerDigest, ProducerDigests, screen
from kvsp_quic.records import LookupMatch, ReplicaRecord, ResidencyEntry
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.index import IndexService
from kvsp_quic.storage.memory_index import MemoryIndexStore
from kvsp_quic.storage.producer_digests import MemoryProducerDigests
from quic.tls import TlsFiles
from tests.asgi import Router
from tests.pki import TestPki, make_pki
from tests.support.descriptors import small_descriptor
from tests.support.retrieval import block, key
from tests.support.waits import until

SCOPE = ScopeId(bytes.fromhex("6d1c6481cd428737da312c089db3832a"))
OTHER_SCOPE = ScopeId(bytes.fromhex("0f" * 16))
INSTANCE = "https://instance.example/"
INSTANCE_OTHER = "https://instance-other.example/"  # an instance of another scope
ALICE = "urn:kvsp:client:alice"
LAYERS = 4
N = 3  # blocks


HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("safetensors") is not None


# Its own PKI: the producing instances of two scopes (inst, inst-other) besides the server.
@pytest.fixture(scope="module")
def pd_certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"), roles={"server": "https://127.0.0.1/", "inst": INSTANCE,
                                                           "inst-other": INSTANCE_OTHER})


@dataclasses.dataclass
class Net:
    server: RoleServer
    index: IndexService
    holders: dict[str, Holder]
    d: CompatDescriptor
    clients: dict[str, KvspClient]  # alice (a client of the scope), inst, inst-other, h2 (the malicious holder)

    def uri(self, name: str) -> str:
        return self.server.base_uri(f"/{name}/")

    def api(self, who: str) -> ProducerDigestApi:
        return ProducerDigestApi(self.clients[who], timeout=10.0)

    async def store(self, name: str, n: int, data: int) -> ReplicaRecord:
        """Block *n* at holder *name* holding the octets of block *data* (another block's: wrong for key n, but the
        record and the octets agree), its record published by the holder itself over HTTP."""
        record = self.holders[name].store(ADMIN_HOLDER, self.d.compat_id, SCOPE, key(n), block(self.d, data), "*")
        url = f"{self.uri('is')}replicas/{holder_id(record.holder)}/{key(n).hex()}"
        client = self.clients[name]
        r = await client.request("PUT", url, content=json.dumps(record.to_json()).encode(),
                                 headers={"content-type": "application/kvsp+json"})
        assert r.status == 201, r.content
        return record

    def fetcher(self, **kwargs: Any) -> BlockFetcher:
        return BlockFetcher(self.clients["alice"], self.uri("is"), descriptors=[self.d], **kwargs)


def _holder_files(certs: TestPki, server: RoleServer, name: str) -> TlsFiles:
    ca_cert, ca_key = pki.load_pair(certs.root, "ca")
    file_name = f"pd-{name}-{server.port}"
    cert, private = pki.issue(ca_cert, ca_key, pki.role(file_name, server.base_uri(f"/{name}/")),
                              extra_hosts=["127.0.0.1"])
    pki.write_pair(certs.root, file_name, cert, private)
    return certs.files(file_name)


ADMIN_HOLDER: Any = None  # the principal that stores blocks at the holders in-process (set by the fixture)


@pytest.fixture
async def net(pd_certs: TestPki) -> AsyncIterator[Net]:
    certs = pd_certs
    global ADMIN_HOLDER
    d = small_descriptor(layers=LAYERS)
    router = Router()
    server = RoleServer(router, certs.files("server"))  # type: ignore[arg-type]
    await server.start("127.0.0.1", 0)
    uri = server.base_uri
    policy = Policy.from_dict({"principal": [
        {"identity": ALICE, "roles": ["client"], "scopes": [SCOPE.hex()]},
        {"identity": INSTANCE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
        {"identity": INSTANCE_OTHER, "roles": ["instance"], "scopes": [OTHER_SCOPE.hex()]},
        {"identity": uri("/h1/"), "roles": ["holder"], "scopes": [SCOPE.hex()]},
        {"identity": uri("/h2/"), "roles": ["holder"], "scopes": [SCOPE.hex()]},
    ]})
    ADMIN_HOLDER = policy.principal(uri("/h1/"))
    index = IndexService(MemoryIndexStore(), clock=time.monotonic)
    holders = {name: Holder(HolderSettings(uri(f"/{name}/"), (d,), replica_ttl_ms=60_000)) for name in ("h1", "h2")}
    router.apps["/is/"] = index_app(index, policy, base_path="/is/", sweep_interval=None)
    # the same Index Service as one without the extension would answer (its resources 404)
    router.apps["/old/"] = index_app(index, policy, base_path="/old/", sweep_interval=None,
                                     rules=tuple(r for r in INDEX_RULES if not r.path.startswith("producer-")))
    for name, holder in holders.items():
        router.apps[f"/{name}/"] = holder_app(holder, policy)
    clients = {"alice": KvspClient(certs.files("alice"), timeout=10.0),
               "inst": KvspClient(certs.files("inst"), timeout=10.0),
               "inst-other": KvspClient(certs.files("inst-other"), timeout=10.0)}
    for name in holders:
        clients[name] = KvspClient(_holder_files(certs, server, name), timeout=10.0)
    try:
        yield Net(server, index, holders, d, clients)
    finally:
        for client in clients.values():
            await client.aclose()
        await server.close()


def produced(record: ReplicaRecord, **changes: Any) -> ProducerDigest:
    return dataclasses.replace(ProducerDigest.of_replica(record), **changes)


# -- who may publish -----------------------------------------------------------------------------------------------


async def test_only_an_instance_of_the_scope_publishes_producer_digests_in_its_own_name(net: Net) -> None:
    honest = await net.store("h1", 0, 0)
    record = produced(honest, ttl_ms=10_000_000)
    index = net.uri("is")
    # a holder -- even the one whose record it is -- and a client are refused by the route's rule
    for who in ("h1", "h2", "alice"):
        with pytest.raises(Forbidden):
            await net.api(who).publish_producer_digests(index, [record])
    # an instance of another scope: kvsp-scope-denied, nothing stored
    with pytest.raises(ScopeDenied):
        await net.api("inst-other").publish_producer_digests(index, [record])
    # an instance may not publish in another's name
    with pytest.raises(Forbidden):
        await net.api("inst").publish_producer_digests(index, [produced(honest, producer=INSTANCE_OTHER)])
    assert await net.api("alice").lookup_producer_digests(index, net.d.compat_id, SCOPE, [key(0)]) == ()
    # the instance of the scope: stored under its identity, the TTL capped at the Index Service's maximum
    stored = await net.api("inst").publish_producer_digests(index, [record])
    assert [(r.producer, r.ttl_ms) for r in stored.digests] == [(INSTANCE, net.index.config.max_ttl_ms)]
    found = await net.api("alice").lookup_producer_digests(index, net.d.compat_id, SCOPE, [key(0), key(1)])
    assert [(r.block_key, r.producer, r.digest, r.layer_digests) for r in found] == \
        [(key(0), INSTANCE, honest.digest, honest.layer_digests)]
    assert 0 < found[0].ttl_ms <= net.index.config.max_ttl_ms
    # looking producer digests up needs the scope too
    with pytest.raises(ScopeDenied):
        await net.api("inst-other").lookup_producer_digests(index, net.d.compat_id, SCOPE, [key(0)])


async def test_a_malformed_publish_is_400_and_a_wrong_digest_is_refused(net: Net) -> None:
    honest = await net.store("h1", 0, 0)
    body = produced(honest).to_json()
    body["digest"] = "sha-256:" + "00" * 32  # not the SHA-256 of its layer digests
    r = await net.clients["inst"].request("POST", f"{net.uri('is')}producer-digests",
                                          content=json.dumps({"digests": [body]}).encode(),
                                          headers={"content-type": "application/kvsp+json"})
    assert r.status == 400 and "digest" in r.json()["detail"]


# -- consumers -------------------------------------------------------------------------------------------------------


async def _poisoned(net: Net) -> list[ReplicaRecord]:
    """Blocks 0..N-1 at the honest h1 and at the malicious h2 (another block's octets under each key), and the
    producer's digests of the honest octets, published by the instance."""
    honest = [await net.store("h1", n, n) for n in range(N)]
    for n in range(N):
        await net.store("h2", n, 100 + n)
    await net.api("inst").publish_producer_digests(net.uri("is"), [produced(r) for r in honest])
    return honest


async def test_with_the_mode_on_the_malicious_replica_is_refused_and_the_honest_one_loaded(net: Net) -> None:
    honest = await _poisoned(net)
    fetcher = net.fetcher(require_producer_digest=True)
    found = await fetcher.lookup(net.d.compat_id, SCOPE, [key(n) for n in range(N)])
    assert [[r.holder for r in m.replicas] for m in found.blocks] == [[net.uri("h1")]] * N
    results = await fetcher.load_prefix(net.d.compat_id, SCOPE, [key(n) for n in range(N)])
    assert [r.record.holder if r else None for r in results] == [net.uri("h1")] * N
    assert [r.tobytes() if r else None for r in results] == [block(net.d, n) for n in range(N)]
    assert [r.record.digest for r in results if r] == [r.digest for r in honest]
    assert fetcher.metrics.producer_mismatches == 2 * N  # h2's replicas, in both lookups
    assert fetcher.metrics.producer_unverified == 0 and fetcher.metrics.digest_failures == 0


async def test_with_only_the_malicious_replica_the_mode_recomputes_and_without_it_loads_the_poison(
        net: Net) -> None:
    await _poisoned(net)
    keys = [key(n) for n in range(N)]
    for k in keys:  # the honest holder's replicas are gone (evicted, withdrawn): only the malicious ones are left
        r = await net.clients["h1"].request("DELETE", f"{net.uri('is')}replicas/{holder_id(net.uri('h1'))}/{k.hex()}")
        assert r.status == 204, r.content
    # mode off (as today): h2's record and octets agree, so every check passes and the wrong block is loaded
    off = net.fetcher()
    results = await off.load_prefix(net.d.compat_id, SCOPE, keys)
    assert [r.record.holder if r else None for r in results] == [net.uri("h2")] * N
    assert [r.tobytes() if r else None for r in results] == [block(net.d, 100 + n) for n in range(N)]
    assert off.metrics.digest_failures == 0
    # mode on: no replica it may use matches the producer's digests: every block is recomputed
    on = net.fetcher(require_producer_digest=True)
    assert await on.load_prefix(net.d.compat_id, SCOPE, keys) == [None] * N
    assert on.metrics.producer_unverified == N and on.metrics.misses == N and on.metrics.attempts == 0
    assert on.metrics.producer_mismatches == 1  # the prefix ends at the first block: later ones are not screened


async def test_a_block_without_a_producer_digest_ends_the_usable_prefix(net: Net) -> None:
    honest = [await net.store("h1", n, n) for n in range(N)]
    await net.api("inst").publish_producer_digests(net.uri("is"), [produced(honest[0]), produced(honest[2])])
    keys = [key(n) for n in range(N)]
    on = net.fetcher(require_producer_digest=True)
    results = await on.load_prefix(net.d.compat_id, SCOPE, keys)
    assert [r is not None for r in results] == [True, False, False]  # block 2 depends on block 1: recomputed
    assert on.metrics.producer_unverified == 2 and on.metrics.producer_mismatches == 1
    # without the mode nothing changes: all three are loaded
    assert all(r is not None for r in await net.fetcher().load_prefix(net.d.compat_id, SCOPE, keys))


async def test_against_an_index_service_without_the_extension_the_mode_recomputes_and_nothing_breaks(
        net: Net, caplog: pytest.LogCaptureFixture) -> None:
    honest = [await net.store("h1", n, n) for n in range(N)]
    keys = [key(n) for n in range(N)]
    old = net.uri("old")
    # the producer's digests cannot be published there: dropped, said once
    publisher = ProducerDigestPublisher(net.clients["inst"], old, timeout=10.0, batch=2)
    publisher.start()
    try:
        for r in honest:
            publisher.add(produced(r))
        for _ in range(500):
            if publisher.dropped == N:
                break
            await asyncio.sleep(0.01)
    finally:
        await publisher.stop()
    assert publisher.dropped == N and publisher.published == 0
    assert sum("no producer-digest resource" in m for m in caplog.messages) == 1
    # a consumer in the mode finds nothing vouched for: every matched block is recomputed
    on = BlockFetcher(net.clients["alice"], old, descriptors=[net.d], require_producer_digest=True)
    assert await on.load_prefix(net.d.compat_id, SCOPE, keys) == [None] * N
    assert on.metrics.producer_lookup_errors == 1 and on.metrics.producer_unverified == N
    # without the mode, the same Index Service serves as before
    off = BlockFetcher(net.clients["alice"], old, descriptors=[net.d])
    assert all(r is not None for r in await off.load_prefix(net.d.compat_id, SCOPE, keys))


# -- the pure rule and the stores -------------------------------------------------------------------------------


def _record(n: int, data: int, holder: str) -> ReplicaRecord:
    d = small_descriptor(layers=LAYERS)
    h = Holder(HolderSettings(holder, (d,)))
    from kvsp_quic.auth import ALL, Principal, Role
    return h.store(Principal("urn:t", frozenset({Role.HOLDER}), ALL, ALL), d.compat_id, SCOPE, key(n),
                   block(d, data), "*")


def test_screen_keeps_vouched_replicas_and_stops_at_the_first_block_without_one() -> None:
    a0, b0 = _record(0, 0, "https://a.example/"), _record(0, 50, "https://b.example/")
    a1, b1 = _record(1, 1, "https://a.example/"), _record(1, 51, "https://b.example/")
    matches = [LookupMatch(BlockKey(key(0)), (b0, a0)), LookupMatch(BlockKey(key(1)), (b1,))]
    vouched = {key(0): [produced(a0, producer=INSTANCE)], key(1): [produced(a1, producer=INSTANCE)]}
    out = screen(matches, vouched)
    assert [m.replicas for m in out.blocks] == [(a0,)] and out.ended_at == key(1) and not out.unvouched
    assert out.refused == 2
    out = screen(matches, {key(0): vouched[key(0)]})
    assert out.ended_at == key(1) and out.unvouched
    # another block's digests, or the same block in another scope, are not vouched for
    assert produced(a0).vouches_for(a0) and not produced(a0).vouches_for(b0)
    assert not dataclasses.replace(produced(a0), scope_id=OTHER_SCOPE).vouches_for(a0)
    # a partial (layer-range) replica is vouched for by its held layers' digests; zero placeholders elsewhere
    assert LAYERS >= 2
    held = LAYERS // 2

    def partial(of: ReplicaRecord, digests: list[bytes]) -> ReplicaRecord:
        return dataclasses.replace(of, layer_digests=tuple(digests), digest=hashlib.sha256(b"".join(digests)).digest(),
                                   residency=(ResidencyEntry("host", (0, held - 1)),))

    first_half = [bytes(d) for d in a0.layer_digests or ()][:held] + [bytes(32)] * (LAYERS - held)
    assert produced(a0).vouches_for(partial(a0, first_half))
    assert not produced(a0).vouches_for(partial(b0, [bytes(d) for d in b0.layer_digests or ()][:held]
                                                + [bytes(32)] * (LAYERS - held)))
    tampered = list(first_half)
    tampered[-1] = b"\x01" * 32  # a layer it does not hold must be the placeholder
    assert not produced(a0).vouches_for(partial(a0, tampered))
    # the wire form round-trips; producer is optional
    body = ProducerDigests((produced(a0), produced(a1, producer=INSTANCE)))
    assert ProducerDigests.loads(json.dumps(body.to_json())) == body
    assert "producer" not in body.to_json()["digests"][0]


async def test_the_memory_store_keeps_one_record_per_producer_until_its_ttl() -> None:
    store = MemoryProducerDigests()
    a0 = _record(0, 0, "https://a.example/")
    first = produced(a0, producer=INSTANCE, ttl_ms=1000)
    assert await store.put(first, 0.0)
    assert not await store.put(first, 0.5)  # refreshed
    assert await store.put(produced(a0, producer=INSTANCE_OTHER, ttl_ms=3000), 0.5)
    got = await store.get(SCOPE, a0.compat_id, [key(0)], 1.0)
    assert sorted((r.producer, r.ttl_ms) for r in got) == sorted([(INSTANCE, 500), (INSTANCE_OTHER, 2500)])
    assert await store.get(OTHER_SCOPE, a0.compat_id, [key(0)], 1.0) == []
    assert await store.get(SCOPE, CompatId(b"\1" * 32), [key(0)], 1.0) == []
    assert [r.producer for r in await store.get(SCOPE, a0.compat_id, [key(0)], 2.0)] == [INSTANCE_OTHER]
    assert await store.expire(2.0) == 1 and len(store) == 1
    assert await store.expire(4.0) == 1 and len(store) == 0


async def test_the_redis_store_keeps_producer_digests_beside_the_replicas(redis_url: str) -> None:
    from kvsp_quic.storage.redis_index import RedisIndexStore
    from kvsp_quic.storage.redis_producer_digests import RedisProducerDigests

    replicas = RedisIndexStore.from_url(redis_url, prefix="pd-test:")
    try:
        index = IndexService(replicas, clock=time.monotonic)
        assert isinstance(index.producers.store, RedisProducerDigests)
        a0 = _record(0, 0, "https://a.example/")
        stored = await index.producers.publish(
            Policy.from_dict({"principal": [{"identity": INSTANCE, "roles": ["instance"], "scopes": "*"}]})
            .principal(INSTANCE), ProducerDigests((produced(a0, ttl_ms=200),)))  # type: ignore[arg-type]
        assert stored.digests[0].producer == INSTANCE
        store = index.producers.store
        got = await store.get(SCOPE, a0.compat_id, [key(0), key(1)], 0.0)
        assert [(r.producer, r.digest, r.layer_digests) for r in got] == [(INSTANCE, a0.digest, a0.layer_digests)]
        assert 0 < got[0].ttl_ms <= 200
        assert await store.get(OTHER_SCOPE, a0.compat_id, [key(0)], 0.0) == []
        time.sleep(0.3)
        assert await store.get(SCOPE, a0.compat_id, [key(0)], 0.0) == []
    finally:
        await replicas.aclose()


# -- inference instances, end to end: the exact tokens ---------------------------------------------------------------


async def instance(cl: Any, **service: Any) -> Any:
    """An instance of tests/support/instance.py's cluster (as ``Cluster.instance``) with these service options."""
    from gpu.engine import Engine
    from http3.server import bind_pair
    from kvsp_app.instance import build_instance
    from kvsp_runtime.instance_service import ServiceOptions

    ia = _instances()
    engine = Engine.load(str(cl.model_dir), block_tokens=ia.B, device_pages=256)
    tcp, udp = bind_pair("127.0.0.1", 0, 1 << 20)
    base = f"https://127.0.0.1:{tcp.getsockname()[1]}/"
    node = build_instance(engine, base_uri=base, files=cl.certs.files("server"), policy=ia.instance_policy(),
                          scope_keys=[ia.SCOPE_KEY], index=cl.uri("is"),
                          service=ServiceOptions(controller=cl.uri("pc"), request_timeout_ms=5000, **service))
    node.service.publisher.max_sleep = 0.05  # type: ignore[union-attr]
    server = RoleServer(node.app, cl.certs.files("server"), quic_handlers=node.quic_handlers)
    await server.start(sockets=(tcp, udp))
    await node.start()
    cl.nodes.append((node, server, engine))
    return node


def _instances() -> Any:
    if not HAVE_TORCH:
        pytest.skip("the gpu extra (torch) is not installed")
    import tests.support.instance as ia
    return ia


async def test_instances_in_the_mode_refuse_a_poisoned_replica_and_still_produce_the_exact_tokens(
        instance_cluster: Any) -> None:
    ia = _instances()
    from gpu.kvcache import PagedKVCache
    from gpu.model import LlamaModel
    from gpu.prefill import prefill
    from gpu.sampling import TokenSampler

    cl = instance_cluster
    reference = LlamaModel.load(cl.model_dir)
    d = reference.descriptor(ia.B)
    keys = ia.keys_of(ia.PROMPT, d)
    expected = await ia.expected_tokens(reference, ia.PROMPT, 6, TokenSampler("greedy"))

    async def run(node: Any, sources: list[str] | None) -> tuple[list[int], Any]:
        base = node.role.settings.base_uri
        sid = uuid.uuid4()
        blocks = None if sources is None else [{"block_key": k.hex(), "sources": sources} for k in keys]
        r = await ia.post(cl.alice, f"{base}sessions/{sid}/start",
                          ia.start_body(sid, ia.PROMPT, max_tokens=6, d=d, blocks=blocks))
        assert r.status == 201, r.content
        lines = await ia.read_stream(cl.alice, f"{base}sessions/{sid}/tokens?from=0")
        return ia.tokens_of(lines), node.role.sessions.get(sid)

    # the producer computes the prompt; it publishes its replicas and its producer digests
    producer = await instance(cl, publish_producer_digests=True)
    p_base = producer.role.settings.base_uri
    tokens, _ = await run(producer, None)
    assert tokens == expected
    await until(lambda: producer.service.producer_digests.published >= len(keys), 20.0)
    vouched = await cl.index.producers.store.get(ia.SCOPE, d.compat_id, keys, time.monotonic())
    assert len(vouched) == len(keys) and {r.producer for r in vouched} == {ia.SERVER_IDENTITY}
    # a malicious holder (/h1/ here): the KV of another prompt under this prompt's keys, record and octets agreeing
    other = [(11 * i + 5) % 256 for i in range(len(ia.PROMPT))]
    cache = PagedKVCache.for_descriptor(d, device_pages=64)
    result = await prefill(reference, cache, other)
    for i, k in enumerate(keys):
        await cl.store(d, k, [(bytes(a), bytes(b)) for a, b in cache.export_block(result.sequence.pages[i])])
    result.sequence.release()
    h1 = cl.uri("h1")

    # mode on, the producer's honest replicas beside the poisoned ones: the honest ones are loaded
    consumer = await instance(cl, require_producer_digest=True)
    tokens, session = await run(consumer, [h1, p_base])
    assert tokens == expected
    assert session.loaded_blocks == len(keys)
    metrics = consumer.service.retrieval
    assert metrics.producer_mismatches >= len(keys) and metrics.digest_failures == 0

    # mode on, only the poisoned replicas named: refused, every block recomputed, the tokens still exact
    recompute = await instance(cl, require_producer_digest=True)
    tokens, session = await run(recompute, [h1])
    assert tokens == expected
    assert session.loaded_blocks == 0 and recompute.service.retrieval.producer_mismatches >= len(keys)

    # mode off (as today): the poisoned replicas pass every digest check and are loaded
    today = await instance(cl)
    tokens, session = await run(today, [h1])
    assert session.loaded_blocks == len(keys) and today.service.retrieval.digest_failures == 0
    assert today.service.producer_digests is None


def test_the_instance_section_takes_the_mode() -> None:
    from kvsp_app.config import ConfigError, InstanceFile, build

    section = build(InstanceFile, {"instance": {"require_producer_digest": True,
                                                "publish_producer_digests": True}}).instance
    assert section.require_producer_digest and section.publish_producer_digests
    default = build(InstanceFile, {}).instance
    assert not default.require_producer_digest and not default.publish_producer_digests
    with pytest.raises(ConfigError):
        build(InstanceFile, {"instance": {"require_producer_digest": "yes"}})
