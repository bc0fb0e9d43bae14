"""The retrieval client (kvsp_client/retrieval.py, kvsp_quic/retrieval_plan.py) against real servers on 127.0.0.1.

One RoleServer (HTTP/3 and HTTP/1.1 + HTTP/2 over mutual TLS) serves, below separate base paths, the Index Service
(``/is/``), two real holders (``/h1/``, ``/h2/``) and fake holders that misbehave on purpose (``/bad/``,
``/bad2/``: flipped bytes, wrong or missing Repr-Digest, another block, slow bodies, lease refusals). Replica
Records are published straight into the Index Service, except in the first test, where the holder's own
ReplicaPublisher publishes them over HTTP/3.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import socket
from collections.abc import Sequence
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic import container as c
from kvsp_quic.keys import holder_id
from kvsp_quic.problems import ScopeDenied
from kvsp_quic.records import (
    Link,
    ReplicaRecord,
    ResidencyEntry,
    encode_moqt_namespace,
    kvsp_track_namespace,
)
from kvsp_quic.retrieval_plan import (
    DefaultRanking,
    Failure,
    FailureMemory,
    ReprDigestError,
    RetrievalMetrics,
    covers,
    failure_for_status,
    format_repr_digest,
    parse_repr_digest,
)
from kvsp_runtime.publisher import ReplicaPublisher
from tests.pki import TestPki
from tests.support.retrieval import (
    LAYERS,
    SCOPE,
    Net,
    assert_block,
    block,
    key,
    one_match,
    sections,
)

# -- the servers ---------------------------------------------------------------------------------------------------


async def gated(net: Net, fake: str, stream: Any) -> list[int]:
    """The layer indexes of *stream*, opening the fake holder's gate after each one."""
    net.fakes[fake].gate = gate = asyncio.Event()
    out = []
    async with asyncio.timeout(5):
        async for layer in stream:
            out.append(layer.index)
            gate.set()
    return out


# -- publish, lookup, streamed and whole retrieval -----------------------------------------------------------------


async def test_publish_lookup_and_layer_range_verified_layer_by_layer(net: Net) -> None:
    d = net.d
    async with KvspClient(net.holder_files("h1")) as h1_client:  # h1 publishes its replica itself
        publisher = ReplicaPublisher(net.holders["h1"], h1_client, net.uri("is"))
        publisher.start()
        try:
            url = f"{net.uri('h1')}blocks/{d.compat_id.hex()}/{SCOPE.hex()}/{key(1).hex()}"
            put = await net.client.request("PUT", url, content=block(d, 1),
                                           headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            assert put.status == 201
            fetcher = net.fetcher()
            async with asyncio.timeout(5):
                while (found := await fetcher.lookup(d.compat_id, SCOPE, [key(1), key(2)])).matched == 0:
                    await asyncio.sleep(0.02)
        finally:
            await publisher.stop()
    assert found.matched == 1 and [r.holder for r in found.blocks[0].replicas] == [net.uri("h1")]

    got = []
    async with fetcher.fetch_layers(found.blocks[0], layers=(1, 2)) as stream:
        async for layer in stream:
            got.append(layer)
    assert stream.complete and [layer.index for layer in got] == [1, 2]
    original = sections(d, 1)
    for layer in got:
        k, v = original[layer.index]
        assert bytes(layer.k) == k.tobytes() and bytes(layer.v) == v.tobytes()
        assert layer.digest == c.layer_digest(k, v)
    assert net.router.requests("/h1/blocks/")[-1][2] == "layers=1-2"
    m = fetcher.metrics
    assert (m.hits, m.misses, m.layers, m.digest_failures) == (1, 0, 2, 0)
    assert set(m.bytes_by_transport) == {"HTTP/3"} and m.bytes_by_transport["HTTP/3"] > 2 * 128
    assert (m.lookups, m.lookup_keys) == (m.lookups, 2 * m.lookups) and m.lookup_matched == 1


async def test_layers_are_handed_over_while_later_ones_still_arrive(net: Net) -> None:
    genuine = await net.store("h1", 1)
    await net.fake("bad", 1, genuine)  # device tier: tried first
    fetcher = net.fetcher()
    match = await one_match(fetcher, 1)
    seen = await gated(net, "bad", fetcher.fetch_layers(match))  # deadlocks if a layer is held back
    assert seen == [0, 1, 2, 3]
    assert [r for r in net.router.requests("/h1/") if r[0] == "GET"] == []  # all from the (slow) first replica


async def test_over_the_tcp_path_layers_are_handed_over_while_later_ones_still_arrive(net: Net) -> None:
    """Layer streaming on every transport (issue 16, goal 6): over HTTP/1.1 too, each layer is verified and handed
    over as soon as it is in, before the holder sends the next."""
    genuine = await net.store("h1", 1)
    await net.fake("bad", 1, genuine)
    async with KvspClient(net.certs.files("alice"), timeout=10.0, prefer="tcp") as tcp:
        fetcher = BlockFetcher(tcp, net.uri("is"), descriptors=[net.d])
        match = await one_match(fetcher, 1)
        seen = await gated(net, "bad", fetcher.fetch_layers(match))  # deadlocks if a layer is held back
        assert seen == [0, 1, 2, 3]
        assert set(fetcher.metrics.bytes_by_transport) == {"HTTP/1.1"}


async def test_whole_block_verifies_the_replica_digest(net: Net) -> None:
    genuine = await net.store("h1", 1)
    fetcher = net.fetcher()
    result = assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    assert result.record.holder == net.uri("h1") and result.http_version == "HTTP/3"
    assert (result.codec, result.token_count) == (1, net.d.block_tokens)
    assert net.router.requests("/h1/blocks/")[-1][2] == ""  # no layers=: the whole block
    assert c.replica_digest([layer.digest for layer in result.layers if layer.digest]) == genuine.digest

    # A replica whose record lists no layer digests can only be checked as a whole (replica digest at the end):
    # this one serves another block (with a correct Repr-Digest), so nothing is handed over from it.
    net.fakes["bad"].blocks[key(1).hex()] = block(net.d, 5)
    await net.publish(dataclasses.replace(genuine, holder=net.uri("bad"), layer_digests=None,
                                          residency=(ResidencyEntry("device", (0, LAYERS - 1)),)))
    fetcher = net.fetcher()
    match = await one_match(fetcher, 1)
    assert [r.holder for r in fetcher.ranking(match.replicas, (0, 3))] == [net.uri("bad"), net.uri("h1")]
    result = assert_block(await fetcher.fetch_block(match), net.d, 1)
    assert [r.holder for r in result.records] == [net.uri("h1")]
    m = fetcher.metrics
    assert (m.digest_failures, m.withdrawals, m.hits) == (1, 1, 1)
    assert [r.holder for r in (await one_match(fetcher, 1)).replicas] == [net.uri("h1")]  # withdrawn


# -- bad replicas ----------------------------------------------------------------------------------------------------


async def test_corrupt_layer_is_detected_withdrawn_and_the_rest_comes_from_the_next_replica(net: Net) -> None:
    genuine = await net.store("h1", 1)
    net.fakes["bad"].mode = "flip"  # layer 2 has a flipped bit; Repr-Digest matches what is sent
    await net.fake("bad", 1, genuine)
    fetcher = net.fetcher()
    stream = fetcher.fetch_layers(await one_match(fetcher, 1))
    assert await gated(net, "bad", stream) == [0, 1, 2, 3] and stream.complete
    assert [r.holder for r in stream.records] == [net.uri("bad"), net.uri("h1")]  # layers 0-1, then 2-3
    assert net.router.requests("/h1/blocks/")[-1][2] == "layers=2-3"
    m = fetcher.metrics
    assert (m.digest_failures, m.withdrawals, m.withdrawals_denied, m.hits, m.misses) == (1, 1, 0, 1, 0)
    assert ("DELETE", f"/is/replicas/{holder_id(net.uri('bad'))}/{key(1).hex()}", "") in net.router.log
    assert [r.holder for r in (await one_match(fetcher, 1)).replicas] == [net.uri("h1")]
    # fetch_block of the same: whole and correct, and the bad holder is skipped (remembered) -- it is gone anyway
    assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)


async def test_wrong_repr_digest_fails_the_replica_and_a_denied_withdrawal_is_only_noted(net: Net) -> None:
    genuine = await net.store("h1", 1)
    fake = net.fakes["bad2"]  # alice may not publish (so not withdraw) for bad2
    fake.mode, fake.chunked = "repr", False  # right octets, wrong Repr-Digest, in one piece
    await net.fake("bad2", 1, genuine)
    fetcher = net.fetcher()
    result = assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    assert [r.holder for r in result.records] == [net.uri("h1")]  # nothing was handed over from bad2
    m = fetcher.metrics
    assert (m.digest_failures, m.withdrawals, m.withdrawals_denied) == (1, 0, 1)
    assert {r.holder for r in (await one_match(fetcher, 1)).replicas} == {net.uri("h1"), net.uri("bad2")}

    # Sent layer by layer, the layers before the last are verified by their layer digests and handed over;
    # the last waits for Repr-Digest, fails with it, and comes from the next replica.
    fake.chunked = True
    fetcher = net.fetcher()
    stream = fetcher.fetch_layers(await one_match(fetcher, 1))
    assert await gated(net, "bad2", stream) == [0, 1, 2, 3]
    assert [r.holder for r in stream.records] == [net.uri("bad2"), net.uri("h1")]
    assert net.router.requests("/h1/blocks/")[-1][2] == "layers=3-3"


@pytest.mark.parametrize("mode", ["norepr", "badrepr"])
async def test_missing_or_malformed_repr_digest_fails_the_replica(net: Net, mode: str) -> None:
    genuine = await net.store("h1", 1)
    net.fakes["bad"].mode = mode
    await net.fake("bad", 1, genuine)
    fetcher = net.fetcher()
    assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    m = fetcher.metrics
    assert (m.bad_responses, m.digest_failures, m.withdrawals, m.layers) == (1, 0, 0, LAYERS)
    gets = len(net.router.requests("/bad/blocks/"))
    assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    assert len(net.router.requests("/bad/blocks/")) == gets and m.skipped_recent_failures == 1  # remembered


async def test_a_404_is_a_miss_and_the_next_replica_is_used(net: Net) -> None:
    genuine = await net.store("h1", 1)
    await net.publish(dataclasses.replace(genuine, holder=net.uri("h2"),  # advertised, but h2 does not have it
                                          residency=(ResidencyEntry("device", (0, LAYERS - 1)),)))
    fetcher = net.fetcher()
    result = assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    assert result.record.holder == net.uri("h1")
    m = fetcher.metrics
    assert (m.replica_misses, m.attempts, m.withdrawals, m.hits) == (1, 2, 0, 1)
    assert len(fetcher.failures) == 0  # a miss says nothing bad about the holder
    # link information (this client's measured links) comes before tiers; excluded holders are never asked
    linked = net.fetcher(links=[Link(net.uri("h1"), 100_000, 20)])
    for fetcher in (linked, net.fetcher(exclude_holders=[net.uri("h2")])):
        assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
        assert (fetcher.metrics.attempts, fetcher.metrics.replica_misses) == (1, 0)


async def test_a_transport_error_moves_on_and_the_holder_is_skipped_for_a_while(net: Net) -> None:
    genuine = await net.store("h1", 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"https://127.0.0.1:{s.getsockname()[1]}/kvsp/"  # nothing listens there once closed
    await net.publish(dataclasses.replace(genuine, holder=dead,
                                          residency=(ResidencyEntry("device", (0, LAYERS - 1)),)))
    now = [0.0]
    async with KvspClient(net.certs.files("alice"), connect_timeout=0.3, retries=0) as client:
        fetcher = BlockFetcher(client, net.uri("is"), failures=FailureMemory(10.0, clock=lambda: now[0]))
        match = await one_match(fetcher, 1)
        assert_block(await fetcher.fetch_block(match), net.d, 1)
        assert (fetcher.metrics.transport_errors, fetcher.metrics.attempts) == (1, 2)
        assert_block(await fetcher.fetch_block(match), net.d, 1)
        assert (fetcher.metrics.skipped_recent_failures, fetcher.metrics.attempts) == (1, 3)
        now[0] = 11.0  # forgotten: tried again
        assert_block(await fetcher.fetch_block(match), net.d, 1)
        assert (fetcher.metrics.transport_errors, fetcher.metrics.attempts) == (2, 5)


async def test_no_replica_is_none_and_counted_as_a_miss(net: Net) -> None:
    fetcher = net.fetcher()
    assert await fetcher.load_prefix(net.d.compat_id, SCOPE, [key(1), key(2)]) == [None, None]
    m = fetcher.metrics
    assert (m.hits, m.misses, m.lookup_matched, m.attempts) == (0, 2, 0, 0)
    # matched, but the only replica is gone from its holder: None, a miss, no exception
    genuine = net.holders["h1"].store(net.alice, net.d.compat_id, SCOPE, key(3), block(net.d, 3), "*")
    await net.publish(dataclasses.replace(genuine, holder=net.uri("h2")))
    assert await fetcher.fetch_block(await one_match(fetcher, 3)) is None
    stream = fetcher.fetch_layers(await one_match(fetcher, 3), (1, 2))
    assert [layer async for layer in stream] == [] and not stream.complete and stream.next_layer == 1
    assert (m.misses, m.replica_misses) == (4, 2)


async def test_load_prefix_stops_at_the_first_missing_block(net: Net) -> None:
    for n in (0, 1, 3, 4):
        await net.store("h1", n)
    genuine = net.holders["h1"].store(net.alice, net.d.compat_id, SCOPE, key(9), block(net.d, 2), "*")
    await net.publish(dataclasses.replace(genuine, holder=net.uri("h2"), block_key=key(2)))  # h2: 404
    fetcher = net.fetcher()
    results = await fetcher.load_prefix(net.d.compat_id, SCOPE, [key(n) for n in range(5)], concurrency=1)
    assert [r is not None for r in results] == [True, True, False, False, False]
    for n in (0, 1):
        assert_block(results[n], net.d, n)
    m = fetcher.metrics
    assert (m.lookup_matched, m.hits, m.misses, m.replica_misses) == (5, 2, 3, 1)
    assert not any(key(n).hex() in path for n in (3, 4) for _, path, _ in net.router.requests("/h1/blocks/"))


async def test_load_prefix_is_concurrent_within_its_bound_and_in_order(net: Net) -> None:
    for n in range(6):
        await net.store("h1", n)
    fetcher = net.fetcher()
    results = await fetcher.load_prefix(net.d.compat_id, SCOPE, [key(n) for n in range(6)], concurrency=2)
    for n, result in enumerate(results):
        assert_block(result, net.d, n)
    assert 1 <= net.router.max_inflight["/h1/"] <= 2
    assert (fetcher.metrics.hits, fetcher.metrics.misses) == (6, 0)


# -- leases ----------------------------------------------------------------------------------------------------------


async def test_a_lease_is_taken_and_released_around_the_transfer(net: Net) -> None:
    await net.store("h1", 1)
    fetcher = net.fetcher(lease_ms=5000)
    assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    calls = [(method, path.removeprefix("/h1/").split("/")[0]) for method, path, _ in net.router.requests("/h1/")]
    assert calls == [("POST", "leases"), ("GET", "blocks"), ("DELETE", "leases")]
    assert len(net.holders["h1"].leases) == 0
    m = fetcher.metrics
    assert (m.leases_taken, m.leases_released, m.leases_refused) == (1, 1, 0)


async def test_lease_quota_moves_on_to_the_next_replica(net: Net) -> None:
    await net.store("h1", 1)
    await net.store("h2", 1)  # h2's lease quota is smaller than the block

    def h2_first(replicas: Sequence[ReplicaRecord], layers: tuple[int, int]) -> list[ReplicaRecord]:
        return sorted(replicas, key=lambda r: r.holder != net.uri("h2"))

    fetcher = net.fetcher(lease_ms=5000, ranking=h2_first)
    result = assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    assert result.record.holder == net.uri("h1")
    m = fetcher.metrics
    assert (m.leases_refused, m.leases_taken, m.leases_released) == (1, 1, 1)
    assert [method for method, _, _ in net.router.requests("/h2/")] == ["POST"]  # no GET without the lease
    assert len(fetcher.failures) == 0


async def test_a_lease_404_is_a_miss_and_a_refusal_moves_on(net: Net) -> None:
    genuine = await net.store("h1", 1)
    await net.publish(dataclasses.replace(genuine, holder=net.uri("h2"),  # advertised, but h2 does not have it
                                          residency=(ResidencyEntry("device", (0, LAYERS - 1)),)))
    net.fakes["bad"].lease_status = 429
    await net.fake("bad", 1, genuine, tier="host")
    order = [net.uri("h2"), net.uri("bad"), net.uri("h1")]

    def ranking(replicas: Sequence[ReplicaRecord], layers: tuple[int, int]) -> list[ReplicaRecord]:
        return sorted(replicas, key=lambda r: order.index(r.holder))

    fetcher = net.fetcher(lease_ms=1000, ranking=ranking)
    result = assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    assert result.record.holder == net.uri("h1")
    m = fetcher.metrics
    assert (m.replica_misses, m.leases_refused, m.leases_taken, m.leases_released) == (1, 1, 1, 1)
    assert [method for method, _, _ in net.router.requests("/bad/")] == ["POST"]


# -- transports, links, misuse ---------------------------------------------------------------------------------------


async def test_over_http11_the_bytes_are_counted_by_transport(net: Net) -> None:
    await net.store("h1", 1)
    async with KvspClient(net.certs.files("alice"), h3=False) as tcp:
        fetcher = BlockFetcher(tcp, net.uri("is"), assemble=True)
        result = assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    assert result.http_version == "HTTP/1.1"
    assert set(fetcher.metrics.bytes_by_transport) == {"HTTP/1.1"}
    assert fetcher.metrics.bytes_by_transport["HTTP/1.1"] == len(block(net.d, 1))
    assert all(len(layer.k_parts) == 1 for layer in result.layers)  # assembled: one buffer


async def test_misuse_raises(net: Net) -> None:
    await net.store("h1", 1)
    fetcher = net.fetcher()
    match = await one_match(fetcher, 1)
    with pytest.raises(ValueError):
        fetcher.fetch_layers(match, (2, 1))
    with pytest.raises(ValueError):
        fetcher.fetch_layers(match, (0, LAYERS))
    with pytest.raises(ValueError):
        await fetcher.lookup(net.d.compat_id, SCOPE, [b"short"])
    with pytest.raises(ValueError):
        await fetcher.load_prefix(net.d.compat_id, SCOPE, [key(1)], concurrency=0)
    with pytest.raises(ValueError):
        BlockFetcher(net.client, "https://127.0.0.1/no-slash")
    stream = fetcher.fetch_layers(match)
    assert [layer.index async for layer in stream] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError):
        stream.__aiter__()
    with pytest.raises(ScopeDenied):  # a misconfigured client learns it
        await fetcher.lookup(net.d.compat_id, bytes(16), [key(1)])


async def test_an_unreachable_index_is_an_empty_match(certs: TestPki) -> None:
    async with KvspClient(certs.files("alice"), connect_timeout=0.3, retries=0) as client:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            fetcher = BlockFetcher(client, f"https://127.0.0.1:{s.getsockname()[1]}/is/")
        assert await fetcher.load_prefix(bytes(32), SCOPE, [key(1)]) == [None]
        assert (fetcher.metrics.lookup_errors, fetcher.metrics.misses) == (1, 1)


# -- pure logic ------------------------------------------------------------------------------------------------------


def test_repr_digest_is_parsed_strictly() -> None:
    digest = hashlib.sha256(b"x").digest()
    b64 = base64.b64encode(digest).decode()
    assert parse_repr_digest(f"sha-256=:{b64}:") == digest
    assert parse_repr_digest(format_repr_digest(digest)) == digest
    assert parse_repr_digest(f"sha-512=:{base64.b64encode(bytes(64)).decode()}:, sha-256=:{b64}:") == digest
    assert parse_repr_digest(f"  unixsum=:AAAA:;p=1;q=\"s\\\"\" ,\tsha-256=:{b64}:;x=?1") == digest
    assert parse_repr_digest(f"sha-256=:{b64.rstrip('=')}:") == digest  # RFC 8941: padding may be absent
    assert parse_repr_digest(f"sha-256=:AAAA:, sha-256=:{b64}:") == digest  # the last member wins
    bad = [
        None, "", "sha-256", f"sha-256={b64}", f"sha-256=:{b64}", f"SHA-256=:{b64}:", f"sha-256=:{b64}:,",
        f"sha-256=:{b64}: x", "sha-256=:AAAA:", f"sha-256=:{b64[:-2]}=a:", f"sha-256=:{b64.replace('+', '-')}-:",
        f"sha-256=(:{b64}:)", "md5=:AAAA:", f"sha-256=:{b64}:;", f"sha-256=:{b64}:, sha-256=?1",
        f"sha-256=:{b64}:, x=\"\\a\"", f"sha-256=:{b64}:, x=1.2345", f"sha-256=:{b64}:, x=é",
    ]
    for value in bad:
        with pytest.raises(ReprDigestError):
            parse_repr_digest(value)


def _record(holder: str, residency: Sequence[tuple[str, int, int]], rate: int | None = None) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d" % i).digest() for i in range(LAYERS))
    return ReplicaRecord(block_key=key(1), compat_id=bytes(32), scope_id=SCOPE, holder=holder, codec=1,
                         size=LAYERS * 1_000_000, digest=c.replica_digest(digests), ttl_ms=1000,
                         residency=tuple(ResidencyEntry(t, (a, b), rate) for t, a, b in residency),
                         layer_digests=digests)


def test_default_ranking() -> None:
    storage = _record("https://s.example/", [("local-storage", 0, 3)])
    host = _record("https://h.example/", [("host", 0, 3)])
    split = _record("https://x.example/", [("device", 0, 1), ("remote-storage", 2, 3)])
    device = _record("https://d.example/", [("device", 0, 3)])
    partial = _record("https://p.example/", [("device", 0, 1)])
    replicas = [storage, host, split, device, partial]
    assert [r.holder[8] for r in DefaultRanking()(replicas, (0, 3))] == ["d", "p", "h", "s", "x"]
    # for layers 0-1 the split replica holds them in device memory
    assert [r.holder[8] for r in DefaultRanking()(replicas, (0, 1))] == ["x", "d", "p", "h", "s"]
    assert [covers(r, (0, 3)) for r in replicas] == [True, True, True, True, False]
    # link information first: the fastest estimate wins, whatever the tier
    links = [Link("https://s.example/", 400_000, 10), Link("https://h.example/", 8_000, 10)]
    assert [r.holder[8] for r in DefaultRanking(links)(replicas, (0, 3))] == ["s", "h", "d", "p", "x"]
    slow_read = _record("https://s.example/", [("local-storage", 0, 3)], rate=1_000)  # tier read rate limits
    assert [r.holder[8] for r in DefaultRanking(links)([slow_read, host], (0, 3))] == ["h", "s"]
    namespace = encode_moqt_namespace(kvsp_track_namespace(bytes(32), SCOPE, holder_id("moqt://m.example:443/"), 1))
    moqt = dataclasses.replace(device, holder="moqt://m.example:443/", moqt_namespace=namespace)
    assert DefaultRanking()([moqt, device], (0, 3)) == [device, moqt]  # https before other schemes


def test_failure_memory_and_kinds() -> None:
    now = [0.0]
    memory = FailureMemory(5.0, clock=lambda: now[0], max_entries=2)
    memory.note("https://a/")
    memory.note("https://b/")
    assert memory.recent("https://a/") and len(memory) == 2
    now[0] = 1.0
    memory.note("https://c/")  # full: the oldest failure is forgotten
    assert not memory.recent("https://a/") and memory.recent("https://c/")
    now[0] = 5.5
    assert not memory.recent("https://b/") and memory.recent("https://c/")
    now[0] = 6.0
    assert not memory.recent("https://c/") and len(memory) == 0
    assert not FailureMemory(0.0).recent("x")
    assert [failure_for_status(s) for s in (404, 406, 403, 409, 429, 503, 302)] == [
        Failure.MISS, Failure.MISS, Failure.REFUSED, Failure.REFUSED, Failure.SERVER_ERROR, Failure.SERVER_ERROR,
        Failure.BAD_RESPONSE]
    assert Failure.CORRUPT.withdraws and Failure.MALFORMED.withdraws and not Failure.MISS.withdraws
    assert Failure.TRANSPORT.remembered and not Failure.MISS.remembered and not Failure.LEASE_REFUSED.remembered
    metrics = RetrievalMetrics(hits=3, misses=1)
    metrics.add_bytes("HTTP/3", 10)
    metrics.count_failure(Failure.CORRUPT)
    snap = metrics.snapshot()
    assert snap["digest_failures"] == 1 and snap["bytes_by_transport"] == {"HTTP/3": 10}
    assert metrics.hit_ratio == 0.75 and RetrievalMetrics().hit_ratio is None
