"""The MOQT relay (moqt/relay/, kvsp_moqt/relay_policy.py, kvsp_moqt/index_link.py, kvsp_moqt/relay_rules.py): its rules
sans I/O, then real sockets on 127.0.0.1 -- a Holder's tracks published to the relay by the holder's own session,
subscribers fetching through it with every layer verified, across drafts; the cache, coalescing and cut-through;
refusals; upstream failures; index-guided upstreams and the relay's Replica Records; SUBSCRIBE fan-out; and
``kvsp-quic relay --dev`` as a process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_app.config import ConfigError, RelayFile, RelaySection, build
from kvsp_http.index_app import index_app
from kvsp_moqt.holder_tracks import HolderTracks, fetch_layers
from kvsp_moqt.index_link import IndexLink
from kvsp_moqt.relay_policy import kvsp_relay
from kvsp_moqt.relay_rules import RelayRules, Verdict, parse_prefix
from kvsp_moqt.tracks import does_not_exist, invalid_range, moqt_record, track_name, track_namespace, unauthorized
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.keys import holder_id
from kvsp_quic.records import ReplicaRecord, decode_moqt_namespace
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.index import IndexService
from kvsp_quic.storage.memory_index import MemoryIndexStore
from moqt import events as ev
from moqt.aio import (
    MoqtApp,
    MoqtConnection,
    MoqtPool,
    MoqtRequestError,
    MoqtSessionClosed,
    MoqtStreamError,
    connect_moqt,
    moqt_handlers,
)
from moqt.errors import PublishDoneCode14
from moqt.relay import (
    WHOLE,
    RelayCache,
    RelayConfig,
    TrackFetch,
    end_key,
    end_location,
    publish_done_code,
    request_code,
)
from moqt.types import Draft, GroupOrder, Location, ObjectStatus
from quic.listener import QuicListener
from quic.tls import TransportSettings
from tests.pki import TestPki
from tests.support.descriptors import small_descriptor
from tests.support.moqt_relay import (
    ALICE,
    ALPNS,
    HOLDER_POLICY,
    HOLDER_URI,
    OTHER_SCOPE,
    RELAY_POLICY,
    RELAY_URI,
    SCOPE,
    WRITER,
    Collector,
    LivePublisher,
    block,
    key,
    layers,
    world,
)

CROSS = pytest.mark.parametrize(("pub_alpn", "sub_alpn"), [("moq-00", "moqt-18"), ("moqt-18", "moq-00")])


# -- the rules, sans I/O -----------------------------------------------------------------------------------------


def kvsp_ns(holder: str = HOLDER_URI, scope: bytes = SCOPE, codec: int | None = 1) -> tuple[bytes, ...]:
    ns = track_namespace(bytes(32), scope, holder, 1)
    return ns if codec is not None else ns[:4]


def test_rules_for_publishing_reading_and_discovering() -> None:
    policy = Policy.from_dict({"principal": [
        {"identity": HOLDER_URI, "roles": ["holder"], "scopes": "*"},
        {"identity": "https://h2.example/", "roles": ["holder"], "scopes": [SCOPE.hex()],
         "publish_for": ["https://h3.example/"]},
        {"identity": "https://any.example/", "roles": ["holder"], "scopes": "*", "publish_for": "*"},
        {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
        {"identity": "urn:x:ctl", "roles": ["controller"], "scopes": "*"},
    ]})
    rules = RelayRules.of(policy, ["moq-test", "a/b"])
    ok = Verdict.OK
    # KVSP: the fourth field is the publisher's holder-id -- its own, one it may publish for, or any with "*"
    assert rules.publish(HOLDER_URI, kvsp_ns()).verdict is ok
    assert rules.publish(HOLDER_URI, kvsp_ns(codec=None)).verdict is ok  # the four fields that name the holder
    assert rules.publish(HOLDER_URI, kvsp_ns()[:3]).verdict is Verdict.UNAUTHORIZED  # names no holder
    assert rules.publish(HOLDER_URI, kvsp_ns("https://other.example/")).verdict is Verdict.UNAUTHORIZED
    assert rules.publish("https://h2.example/", kvsp_ns("https://h3.example/")).verdict is ok
    assert rules.publish("https://h2.example/", kvsp_ns("https://h3.example/", OTHER_SCOPE)).verdict \
        is Verdict.UNAUTHORIZED  # the publisher's own scopes bound what it publishes
    assert rules.publish("https://any.example/", kvsp_ns("https://whoever.example/")).verdict is ok
    assert rules.publish(ALICE, kvsp_ns(holder=ALICE)).verdict is Verdict.UNAUTHORIZED  # not a holder
    assert rules.publish("urn:unknown", kvsp_ns()).verdict is Verdict.UNAUTHORIZED
    assert rules.publish(HOLDER_URI, (b"kvsp-1", b"zz", SCOPE.hex().encode(), b"x")).verdict is Verdict.UNAUTHORIZED
    # open prefixes: anyone in the policy; everything else is refused
    assert rules.publish(ALICE, (b"moq-test", b"x")).verdict is ok
    assert rules.publish(ALICE, (b"a", b"b", b"c")).verdict is ok
    assert rules.publish(ALICE, (b"a", b"c")).verdict is Verdict.UNAUTHORIZED
    # reading: a reader role and the namespace's scope; a KVSP track namespace has all five fields
    assert rules.read(ALICE, kvsp_ns()).verdict is ok
    assert rules.read(ALICE, kvsp_ns(scope=OTHER_SCOPE)).verdict is Verdict.UNAUTHORIZED
    assert rules.read("urn:x:ctl", kvsp_ns()).verdict is Verdict.UNAUTHORIZED  # not a reader role
    assert rules.read(ALICE, kvsp_ns(codec=None)).verdict is Verdict.DOES_NOT_EXIST
    assert rules.read(ALICE, (b"nonexistent", b"namespace")).verdict is Verdict.DOES_NOT_EXIST
    assert rules.read("urn:unknown", (b"moq-test",)).verdict is Verdict.UNAUTHORIZED
    assert rules.read("urn:x:ctl", (b"moq-test", b"y")).verdict is ok
    # discovery: announced only what the subscriber could read
    assert rules.discover(ALICE, (b"kvsp-1",)).ok and not rules.discover("urn:unknown", ()).ok
    assert rules.visible(ALICE, kvsp_ns()) and rules.visible(ALICE, kvsp_ns(codec=None))
    assert not rules.visible(ALICE, kvsp_ns(scope=OTHER_SCOPE)) and not rules.visible(ALICE, (b"zz",))
    assert parse_prefix("a/b") == (b"a", b"b")
    with pytest.raises(ValueError):
        parse_prefix("a//b")


def piece(obj: int, offset: int, data: bytes, length: int, group: int = 0) -> ev.ObjectReceived:
    return ev.ObjectReceived(3, 0, None, group, 0, obj, 128, ObjectStatus.NORMAL, (), length, offset, data)


def filled(name: bytes, objects: int, size: int) -> TrackFetch:
    fetch = TrackFetch((b"moq-test",), name, (0, 0), (0, WHOLE))
    for i in range(objects):
        fetch.fetch_piece(piece(i, 0, bytes(size // 2), size))
        fetch.fetch_piece(piece(i, size // 2, bytes(size - size // 2), size))
    fetch.fetch_accepted(ev.FetchAccepted(0, Location(0, objects), True))
    fetch.fetch_ended()
    return fetch


def test_track_fetch_and_the_lru_cache() -> None:
    assert end_key(Location(0, 0)) == (0, WHOLE) and end_key(Location(2, 5)) == (2, 5)
    assert end_location((0, WHOLE)) == Location(0, 0) and end_location((1, 3)) == Location(1, 3)
    one = filled(b"one", 4, 100)
    assert one.complete and one.size == 400 and [o.key for o in one.objects] == [(0, i) for i in range(4)]
    assert one.covers((0, 2), (0, 3)) and one.covers((0, 0), (0, WHOLE)) and not one.covers((1, 0), (1, WHOLE))
    # a piece out of order fails the fetch (a relay forwards no malformed track)
    bad = TrackFetch((b"moq-test",), b"bad", (0, 0), (0, WHOLE))
    bad.fetch_piece(piece(0, 0, b"ab", 4))
    bad.fetch_piece(piece(1, 0, b"ab", 4))
    assert bad.error is not None and not bad.complete
    evicted: list[bytes] = []
    cache = RelayCache(900, on_evict=lambda f: evicted.append(f.track_name))
    assert cache.put(one) and cache.size == 400
    two = filled(b"two", 4, 100)
    assert cache.put(two)
    assert cache.get(one.key, (0, 0), (0, WHOLE)) is one  # one is now the most recent
    three = filled(b"three", 4, 100)
    assert cache.put(three) and evicted == [b"two"] and len(cache) == 2 and cache.size == 800
    assert cache.get(two.key, (0, 0), (0, WHOLE)) is None
    assert not cache.put(filled(b"big", 10, 100))  # larger than the whole budget: not kept
    assert cache.remove(one.key) is one and cache.size == 400


def test_codes_across_drafts() -> None:
    assert request_code(Draft.D14, "does-not-exist") == does_not_exist(Draft.D14) == 0x4
    assert request_code(Draft.D18, "does-not-exist") == does_not_exist(Draft.D18) == 0x10
    assert request_code(Draft.D18, "invalid-range") == invalid_range(Draft.D18)
    assert request_code(Draft.D14, "unauthorized") == unauthorized(Draft.D14)
    assert request_code(Draft.D18, "timeout") == 0x2 and request_code(Draft.D14, "other") == 0x0
    assert publish_done_code(int(PublishDoneCode14.EXPIRED), Draft.D14, Draft.D18) == 0x6
    assert publish_done_code(int(PublishDoneCode14.MALFORMED_TRACK), Draft.D14, Draft.D18) == 0x12
    assert publish_done_code(0x2, Draft.D18, Draft.D14) == 0x2


def test_relay_configuration(tmp_path: Path) -> None:
    cfg = build(RelayFile, {"relay": {"index": "https://is.example/kvsp/", "cache_bytes": 1 << 20,
                                      "open_prefixes": ["moq-test"]}})
    assert cfg.relay.cache_bytes == 1 << 20 and cfg.relay.open_prefixes == ["moq-test"]
    for bad in ({"open_prefixes": ["kvsp-1"]}, {"open_prefixes": ["a//b"]}, {"record_ttl_ms": 0},
                {"index": "ftp://x/"}, {"cache_bytes": -1}, {"nope": 1}):
        with pytest.raises(ConfigError):
            build(RelayFile, {"relay": bad})
    assert RelaySection().publish_records


# -- over real sockets -------------------------------------------------------------------------------------------


@CROSS
async def test_fetch_through_the_relay_cached_and_coalesced(relay_certs: TestPki, pub_alpn: str, sub_alpn: str) -> None:
    async with world(relay_certs) as w:
        await w.publisher(pub_alpn)
        sub = await w.connect("alice", sub_alpn)
        record = w.store(1)
        twin = w.twin(record)
        assert await layers(sub, twin, w.d) == list(range(32))  # every layer verified against the record
        m = w.relay.metrics
        assert (m["upstream_fetches"], w.tracks.metrics["fetches"]) == (1, 1)
        assert await layers(sub, twin, w.d) == list(range(32))  # from the cache
        assert await layers(sub, twin, w.d, (8, 15)) == list(range(8, 16))
        assert (m["upstream_fetches"], m["cache_hits"], w.tracks.metrics["fetches"]) == (1, 2, 1)
        assert w.relay.cache.size == 32 * w.d.block_layer_length()  # payload octets, held once
        # eight concurrent subscribers of a block nobody fetched yet: one upstream FETCH
        twin2 = w.twin(w.store(2))
        subs = [sub] + [await w.connect("alice", ALPNS[i % 2]) for i in range(3)]
        got = await asyncio.gather(*(layers(subs[i % 4], twin2, w.d) for i in range(8)))
        assert got == [list(range(32))] * 8
        assert (m["upstream_fetches"], m["coalesced"] + m["cache_hits"] - 2, w.tracks.metrics["fetches"]) == (2, 7, 2)
        # a range starting later still goes upstream once, from its first layer to the end of the block
        twin3 = w.twin(w.store(3))
        assert await layers(sub, twin3, w.d, (20, 22)) == [20, 21, 22]
        assert await layers(sub, twin3, w.d, (25, 31)) == list(range(25, 32))  # covered by that fetch
        assert m["upstream_fetches"] == 3


async def indexes(it: AsyncIterator[c.DecodedLayer]) -> list[int]:
    return [layer.index async for layer in it]


class SlowTracks(HolderTracks):
    """Sends layer 0, then waits for *go* before the rest (or for ever)."""

    def __init__(self, holder: Holder, go: asyncio.Event) -> None:
        super().__init__(holder, HOLDER_POLICY)
        self.go = go

    async def fetch(self, conn: MoqtConnection, request: ev.FetchRequested) -> None:
        from kvsp_moqt.tracks import parse_track

        track = parse_track(request.namespace, request.track_name)
        assert track is not None
        container = self.holder.read(WRITER, track.compat_id, track.scope_id, track.block_key)
        served = conn.accept_fetch(request.request_id, Location(0, 32), end_of_track=True)
        sections = container.sections
        for layer in range(32):
            if layer == 1:
                await self.go.wait()
            await served.write_object(layer, (sections[2 * layer], sections[2 * layer + 1]))
        served.finish()


@pytest.mark.parametrize("alpn", ALPNS)
async def test_cut_through_layer_0_arrives_while_the_publisher_still_holds_the_rest(relay_certs: TestPki,
                                                                                   alpn: str) -> None:
    async with world(relay_certs) as w:
        go = asyncio.Event()
        await w.publisher(alpn, SlowTracks(w.holder, go))
        twin = w.twin(w.store(4))
        subs = [await w.connect("alice", a) for a in ALPNS]
        its = [fetch_layers(s, twin, descriptor=w.d, stall_timeout=5) for s in subs]
        firsts = await asyncio.wait_for(asyncio.gather(*(anext(it) for it in its)), 3)
        assert [f.index for f in firsts] == [0, 0]  # verified layer 0 downstream, layer 1 not even sent upstream
        assert not go.is_set() and w.relay.metrics["upstream_fetches"] == 1
        go.set()
        rests = await asyncio.gather(*(indexes(it) for it in its))
        assert rests == [list(range(1, 32))] * 2


@pytest.mark.parametrize("alpn", ALPNS)
async def test_refusals(relay_certs: TestPki, alpn: str) -> None:
    draft = Draft.from_alpn(alpn)
    async with world(relay_certs) as w:
        # PUBLISH_NAMESPACE: not a holder; another holder's namespace
        alice = await w.connect("alice", alpn)
        with pytest.raises(MoqtRequestError) as err:
            await alice.publish_namespace(w.namespace)
        assert err.value.error_code == unauthorized(draft)
        holder_conn = await w.connect("holder", alpn, w.tracks)
        with pytest.raises(MoqtRequestError) as err:
            await holder_conn.publish_namespace(track_namespace(w.d.compat_id, SCOPE, "https://h9.example/", 1))
        assert err.value.error_code == unauthorized(draft)
        await holder_conn.publish_namespace(w.namespace)
        assert w.relay.metrics["publish_refused"] == 2
        twin = w.twin(w.store(5))
        # FETCH: a reader of another scope; a track nobody publishes; a non-KVSP namespace; past the last layer
        bob = await w.connect("bob", alpn)
        with pytest.raises(MoqtRequestError) as err:
            await layers(bob, twin, w.d)
        assert err.value.error_code == unauthorized(draft)
        nobody = moqt_record(dataclasses.replace(w.store(6), holder="https://h9.example/"), w.uri)
        with pytest.raises(MoqtRequestError) as err:
            await layers(alice, nobody, w.d)
        assert err.value.error_code == does_not_exist(draft)
        async with alice.fetch((b"other", b"ns"), b"t", Location(0, 0), Location(0, 0)) as fetch:
            with pytest.raises(MoqtRequestError) as err:
                await fetch.wait_accepted(3)
        assert err.value.error_code == does_not_exist(draft)
        async with alice.fetch(w.namespace, track_name(key(5)), Location(0, 40), Location(0, 0)) as fetch:
            with pytest.raises(MoqtRequestError) as err:
                await fetch.wait_accepted(3)
        assert err.value.error_code == invalid_range(draft)  # the holder's refusal, in the subscriber's draft
        assert await layers(alice, twin, w.d) == list(range(32))  # and the relay still serves


@CROSS
async def test_upstream_failures_reach_the_subscriber_and_nothing_is_cached(relay_certs: TestPki, pub_alpn: str,
                                                                             sub_alpn: str) -> None:
    async with world(relay_certs) as w:
        go = asyncio.Event()
        pub = await w.publisher(pub_alpn, SlowTracks(w.holder, go))
        sub = await w.connect("alice", sub_alpn)
        twin = w.twin(w.store(7))
        it = fetch_layers(sub, twin, descriptor=w.d, stall_timeout=5)
        assert (await anext(it)).index == 0
        await pub.aclose()  # the publisher goes away in the middle of the block
        with pytest.raises((MoqtStreamError, MoqtRequestError)):
            async for _ in it:
                pass
        assert not w.relay.inflight and len(w.relay.cache) == 0 and not w.relay.announcements
        with pytest.raises(MoqtRequestError) as err:  # no publisher any more
            await layers(sub, twin, w.d)
        assert err.value.error_code == does_not_exist(Draft.from_alpn(sub_alpn))


async def test_a_stuck_subscriber_does_not_hold_the_upstream(relay_certs: TestPki) -> None:
    """Pacing credits the upstream as the fastest subscriber takes the octets; when every subscriber stops, the
    relay stops pacing after upstream_timeout_ms and the block still completes into the cache."""
    d = small_descriptor(layers=32, block_tokens=1024)  # 32 KiB layers, 1 MiB block
    holder = Holder(HolderSettings(HOLDER_URI, (d,)))
    small = TransportSettings(stream_window=64 << 10, send_buffer=64 << 10)
    relay = kvsp_relay(RelayRules(RELAY_POLICY, ()), RelayConfig(upstream_timeout_ms=500))
    listener = QuicListener(relay_certs.files("relay"), moqt_handlers(relay), settings=small)
    await listener.start("127.0.0.1", 0)
    conns: list[MoqtConnection] = []
    try:
        pub = await connect_moqt("127.0.0.1", listener.port, relay_certs.files("holder"), app=HolderTracks(holder,
                                                                                                      HOLDER_POLICY))
        conns.append(pub)
        await pub.publish_namespace(track_namespace(d.compat_id, SCOPE, HOLDER_URI, 1))
        twin = moqt_record(holder.store(WRITER, d.compat_id, SCOPE, key(20), block(d, 20), "*"),
                           f"moqt://127.0.0.1:{listener.port}/")
        stuck = await connect_moqt("127.0.0.1", listener.port, relay_certs.files("alice"), settings=small)
        conns.append(stuck)
        it = fetch_layers(stuck, twin, descriptor=d, stall_timeout=10)
        assert (await anext(it)).index == 0  # ... and then it reads nothing more
        for _ in range(100):
            if len(relay.cache):
                break
            await asyncio.sleep(0.05)
        assert len(relay.cache) == 1 and relay.metrics["pacing_stopped"] == 1
        other = await connect_moqt("127.0.0.1", listener.port, relay_certs.files("alice"))
        conns.append(other)
        assert await layers(other, twin, d) == list(range(32))  # from the cache
        assert relay.metrics["upstream_fetches"] == 1
        await it.aclose()
    finally:
        for conn in conns:
            await conn.aclose()
        await relay.aclose()
        await listener.close()


async def test_the_cache_budget_evicts_the_least_recently_used_block(relay_certs: TestPki) -> None:
    async with world(relay_certs, RelayConfig(cache_bytes=12_000)) as w:  # one 8 KiB block fits, not two
        await w.publisher("moqt-18")
        sub = await w.connect("alice", "moq-00")
        one, two = w.twin(w.store(8)), w.twin(w.store(9))
        await layers(sub, one, w.d)
        await layers(sub, two, w.d)
        assert len(w.relay.cache) == 1 and w.relay.cache.evictions == 1
        await layers(sub, one, w.d)
        assert w.relay.metrics["upstream_fetches"] == 3 and w.relay.metrics["cache_hits"] == 0


async def test_index_guided_upstream_and_the_relays_records(relay_certs: TestPki) -> None:
    index = IndexService(MemoryIndexStore(), clock=asyncio.get_running_loop().time)
    index_policy = Policy.from_dict({"principal": [
        {"identity": HOLDER_URI, "roles": ["holder"], "scopes": "*", "publish_for": "*"},
        {"identity": RELAY_URI, "roles": ["holder"], "scopes": "*", "publish_for": "*"},
        {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
    ]})
    index_server = RoleServer(index_app(index, index_policy, base_path="/is/"), relay_certs.files("index"))
    await index_server.start("127.0.0.1", 0)
    index_uri = index_server.base_uri("/is/")
    d = small_descriptor(layers=32)
    holder = Holder(HolderSettings(HOLDER_URI, (d,)))
    holder_listener = QuicListener(relay_certs.files("holder"), moqt_handlers(HolderTracks(holder, HOLDER_POLICY)))
    await holder_listener.start("127.0.0.1", 0)
    holder_moqt = f"moqt://127.0.0.1:{holder_listener.port}/"
    async with KvspClient(relay_certs.files("holder")) as as_holder, \
            KvspClient(relay_certs.files("relay")) as as_relay, \
            KvspClient(relay_certs.files("alice")) as alice_http, MoqtPool(relay_certs.files("relay")) as pool:
        link = IndexLink(as_relay, index_uri, pool, moqt_uri="moqt://127.0.0.1:1/", ttl_ms=30_000)
        async with world(relay_certs, RelayConfig(cache_bytes=12_000), link=link) as w:
            link.moqt_uri = w.uri  # the relay's port is known now
            link.holder_id = holder_id(w.uri)
            records = [holder.store(WRITER, d.compat_id, SCOPE, key(n), block(d, n), "*") for n in (10, 11)]
            for record in records:  # the holder's MOQT twins at the Index Service (as its publisher does)
                url = f"{index_uri}replicas/{holder_id(holder_moqt)}/{record.block_key.hex()}"
                r = await as_holder.request("PUT", url, content=json.dumps(moqt_record(record, holder_moqt).to_json())
                                            .encode(), headers={"content-type": "application/kvsp+json"})
                assert r.status == 201
            sub = await w.connect("alice", "moqt-18")
            via_relay = moqt_record(records[0], w.uri)
            assert await layers(sub, via_relay, w.d) == list(range(32))  # nobody published it here: the index
            assert w.relay.metrics["index_upstreams"] == 1
            await link.drain()
            lookup = {"scope_id": SCOPE.hex(), "compat_id": d.compat_id.hex(), "block_keys": [key(10).hex()]}
            answer = (await alice_http.request("POST", f"{index_uri}lookup", content=json.dumps(lookup).encode(),
                                               headers={"content-type": "application/kvsp+json"})).json()
            mine = [r for r in answer["blocks"][0]["replicas"] if r["holder"] == w.uri]
            assert len(mine) == 1
            relay_record = ReplicaRecord.from_json(mine[0])
            assert relay_record.layer_digests == records[0].layer_digests and relay_record.digest == records[0].digest
            assert decode_moqt_namespace(relay_record.moqt_namespace or "") == w.namespace
            assert [(e.tier, e.layers) for e in relay_record.residency] == [("host", (0, 31))]
            # the second block evicts the first: its record is withdrawn
            assert await layers(sub, moqt_record(records[1], w.uri), w.d) == list(range(32))
            await link.drain()
            answer = (await alice_http.request("POST", f"{index_uri}lookup", content=json.dumps(lookup).encode(),
                                               headers={"content-type": "application/kvsp+json"})).json()
            assert [r["holder"] for r in answer["blocks"][0]["replicas"]] == [holder_moqt]
            await link.aclose()
    await holder_listener.close()
    await index_server.close()


@CROSS
async def test_subscribe_fan_out_and_namespace_discovery(relay_certs: TestPki, pub_alpn: str, sub_alpn: str) -> None:
    async with world(relay_certs) as w:
        ns = (b"moq-test", b"live")
        watcher_app = Collector()
        watcher = await w.connect("bob", sub_alpn, watcher_app)
        await watcher.subscribe_namespace((b"moq-test",))
        publisher = LivePublisher()
        pub = await w.connect("alice", pub_alpn, publisher)
        await pub.publish_namespace(ns)
        announced = ev.NamespaceReceived if sub_alpn == "moqt-18" else ev.PublishNamespaceRequested
        await watcher_app.until(lambda: any(isinstance(e, announced) and e.namespace == ns
                                            for e in watcher_app.events))
        apps = [Collector(), Collector()]
        subs = [await w.connect(who, sub_alpn, app) for who, app in zip(("alice", "bob"), apps, strict=True)]
        for s in subs:
            s.session.subscribe((*ns, b"t1"), b"video", group_order=GroupOrder.ASCENDING)
            s.flush()
        for app in apps:
            await app.until(lambda a=app: any(isinstance(e, ev.SubscribeAccepted) for e in a.events))
        assert len(publisher.subs) == 1 and w.relay.metrics["upstream_subscriptions"] == 1  # one upstream
        publisher.send(3, 4)
        for app in apps:
            await app.until(lambda a=app: any(isinstance(e, ev.PublishDone) for e in a.events))
            objects = [(e.group, e.object_id, bytes(e.data)) for e in app.events
                       if isinstance(e, ev.ObjectReceived) and e.complete]
            assert objects == [(g, o, b"%d.%d" % (g, o) * 10) for g in range(3) for o in range(4)]
            done = next(e for e in app.events if isinstance(e, ev.PublishDone))
            assert done.status_code == 0x2 and done.stream_count == 3
        # a SUBSCRIBE for a track of a namespace nobody publishes: DOES_NOT_EXIST
        subs[0].session.subscribe((b"moq-test", b"nobody"), b"x")
        subs[0].flush()
        await apps[0].until(lambda: any(isinstance(e, ev.RequestRejected) for e in apps[0].events))
        rejected = next(e for e in apps[0].events if isinstance(e, ev.RequestRejected))
        assert rejected.error_code == does_not_exist(Draft.from_alpn(sub_alpn))
        await pub.aclose()
        withdrawn = ev.NamespaceReceived if sub_alpn == "moqt-18" else ev.PublishNamespaceDone
        await watcher_app.until(lambda: any(isinstance(e, withdrawn) and getattr(e, "active", False) is False
                                            for e in watcher_app.events))


class SilentPublisher(MoqtApp):
    """Takes SUBSCRIBEs and never answers them."""

    def __init__(self) -> None:
        self.subscribed = asyncio.Event()

    def request(self, conn: MoqtConnection, request: ev.Event) -> None:
        if isinstance(request, ev.SubscribeRequested):
            self.subscribed.set()
        else:
            super().request(conn, request)


@CROSS
async def test_a_publisher_gone_before_subscribe_ok_is_does_not_exist(relay_certs: TestPki, pub_alpn: str,
                                                                      sub_alpn: str) -> None:
    """The publisher's session ends while the relay's SUBSCRIBE waits for its answer: the pending subscriber is
    refused with DOES_NOT_EXIST (benign: as if it had come before the publisher), never INTERNAL_ERROR (found by
    aiomoqt's subscribe-before-announce case on a loaded machine)."""
    async with world(relay_certs) as w:
        ns = (b"moq-test", b"gone")
        publisher = SilentPublisher()
        pub = await w.connect("alice", pub_alpn, publisher)
        await pub.publish_namespace(ns)
        app = Collector()
        sub = await w.connect("bob", sub_alpn, app)
        sub.session.subscribe(ns, b"video")
        sub.flush()
        async with asyncio.timeout(5):
            await publisher.subscribed.wait()
        await pub.aclose()
        await app.until(lambda: any(isinstance(e, ev.RequestRejected) for e in app.events))
        rejected = next(e for e in app.events if isinstance(e, ev.RequestRejected))
        assert rejected.error_code == does_not_exist(Draft.from_alpn(sub_alpn)), rejected


async def test_kvsp_quic_relay_dev_process(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvsp_app", "relay", "--dev", str(tmp_path / "dev"), "--open-prefix", "moq-test",
        "--cache-size", "64MiB", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        ready = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        assert ready["ready"] == "relay" and ready["moqt"].startswith("moqt://127.0.0.1:")
        assert ready["cache_bytes"] == 64 << 20 and ready["open_prefixes"] == ["moq-test"]
        files = c_files(ready)
        conn = await connect_moqt("127.0.0.1", int(ready["moqt"].rsplit(":", 1)[1].strip("/")), files, timeout=5)
        try:
            await conn.publish_namespace((b"moq-test", b"x"))
            with pytest.raises((MoqtRequestError, MoqtSessionClosed)):
                await conn.publish_namespace((b"elsewhere",))
        finally:
            await conn.aclose()
        async with KvspClient(files) as client:
            for _ in range(100):  # the relay learns of the closed session asynchronously
                status = (await client.request("GET", f"{ready['base_uri']}status")).json()
                if not status["namespaces"]:
                    break
                await asyncio.sleep(0.02)
            scraped = (await client.request("GET", f"{ready['base_uri']}metrics")).content or b""
            assert b'kvsp_relay{counter="metrics_publish_refused"} 1' in scraped
        assert status["namespaces"] == [] and status["metrics"]["namespaces_published"] == 1
        assert status["metrics"]["publish_refused"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0


def c_files(ready: dict[str, Any]) -> Any:
    from quic.tls import TlsFiles

    return TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))

