"""Issue 13: per-principal bounds at the MOQT relay (moqt/relay/fetching.py, complete.py, fanout.py;
moqt/aio/limits.py) and at a holder's MOQT endpoint (kvsp_moqt/holder_tracks.py). One principal's FETCHes and
SUBSCRIBEs that go upstream, and the octets buffered for them, are bounded (``[relay] client_max_in_flight``,
``client_max_buffered_bytes``); the excess is refused with EXCESSIVE_LOAD and a Retry Interval (draft 18) or
INTERNAL_ERROR with the hint in the reason (draft 14), while other principals -- and cache hits -- are served.
Real servers on 127.0.0.1: a relay, a holder publishing its blocks to it over its own MOQT session."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from kvsp_app.config import ConfigError, RelayFile, build
from kvsp_moqt.holder_tracks import HolderTracks, fetch_layers
from kvsp_moqt.relay_policy import kvsp_relay
from kvsp_moqt.relay_rules import RelayRules
from kvsp_moqt.tracks import moqt_record, parse_track, track_name
from kvsp_quic.auth import Policy
from kvsp_quic.roles.holder import Holder, HolderSettings
from moqt import events as ev
from moqt.aio import MoqtConnection, MoqtRequestError, connect_moqt, excessive_load_code, moqt_handlers
from moqt.errors import RequestErrorCode14, RequestErrorCode18
from moqt.relay import RelayConfig, request_code
from moqt.types import Draft, GroupOrder, Location
from quic.listener import QuicListener
from tests.pki import TestPki
from tests.support.descriptors import small_descriptor
from tests.support.moqt_relay import (
    ALICE,
    ALPNS,
    BOB,
    HOLDER_POLICY,
    HOLDER_URI,
    OPEN,
    SCOPE,
    WRITER,
    Collector,
    LivePublisher,
    World,
    block,
    key,
    layers,
)
from tests.support.waits import until

POLICY = Policy.from_dict({"principal": [  # alice and bob read the same scope
    {"identity": HOLDER_URI, "roles": ["holder"], "scopes": "*"},
    {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
    {"identity": BOB, "roles": ["client"], "scopes": [SCOPE.hex()]},
]})


class HeldTracks(HolderTracks):
    """A holder that sends layer 0 of the blocks in *held* and then waits for *go* before the rest (so that those
    FETCHes stay in flight); other blocks are served at once. Its own limits apply to every FETCH."""

    def __init__(self, holder: Holder, go: asyncio.Event, held: set[bytes], policy: Policy = HOLDER_POLICY,
                 max_in_flight: int = 256) -> None:
        super().__init__(holder, policy, max_in_flight=max_in_flight)
        self.go = go
        self.held = held

    async def _fetch(self, conn: MoqtConnection, request: ev.FetchRequested) -> None:
        track = parse_track(request.namespace, request.track_name)
        if track is None or track.block_key not in self.held:
            await super()._fetch(conn, request)
            return
        container = self.holder.read(WRITER, track.compat_id, track.scope_id, track.block_key)
        served = conn.accept_fetch(request.request_id, Location(0, 32), end_of_track=True)
        sections = container.sections
        for layer in range(32):
            if layer == 1:
                await self.go.wait()
            await served.write_object(layer, (sections[2 * layer], sections[2 * layer + 1]))
        served.finish()


@contextlib.asynccontextmanager
async def relay_world(relay_certs: TestPki, config: RelayConfig, go: asyncio.Event,
                      held: set[bytes]) -> AsyncIterator[World]:
    d = small_descriptor(layers=32)
    holder = Holder(HolderSettings(HOLDER_URI, (d,)))
    relay = kvsp_relay(RelayRules(POLICY, (OPEN,)), config)
    listener = QuicListener(relay_certs.files("relay"), moqt_handlers(relay, data_streams=8))
    await listener.start("127.0.0.1", 0)
    w = World(relay, listener, holder, HeldTracks(holder, go, held), d, relay_certs)
    try:
        await w.publisher("moqt-18")
        yield w
    finally:
        go.set()
        for conn in w.conns:
            await conn.aclose()
        await relay.aclose()
        await listener.close()


def check_refusal(exc: MoqtRequestError, draft: Draft, retry_ms: int) -> None:
    assert exc.error_code == excessive_load_code(draft)
    if draft is Draft.D18:  # REQUEST_ERROR EXCESSIVE_LOAD with a Retry Interval (milliseconds plus one)
        assert exc.error_code == RequestErrorCode18.EXCESSIVE_LOAD and exc.retry_interval == retry_ms + 1
    else:  # FETCH_ERROR / SUBSCRIBE_ERROR have no such code or field: INTERNAL_ERROR, the hint in the reason
        assert exc.error_code == RequestErrorCode14.INTERNAL_ERROR and exc.retry_interval == 0
    assert b"excessive load" in exc.reason and f"retry after {retry_ms} ms".encode() in exc.reason


@pytest.mark.parametrize("alpn", ALPNS)
async def test_in_flight_fetches_and_subscribes_are_bounded_per_client(relay_certs: TestPki, alpn: str) -> None:
    draft = Draft.from_alpn(alpn)
    go = asyncio.Event()
    config = RelayConfig(client_max_in_flight=2, client_retry_ms=750)
    async with relay_world(relay_certs, config, go, {key(n) for n in (1, 2, 3, 4)}) as w:
        m = w.relay.metrics
        twins = {n: w.twin(w.store(n)) for n in range(1, 8)}
        alice = await w.connect("alice", alpn)
        assert await layers(alice, twins[6], w.d) == list(range(32))  # cached from now on
        # alice's two FETCHes that go upstream stay in flight (the holder holds them after layer 0) ...
        its = [fetch_layers(alice, twins[n], descriptor=w.d, stall_timeout=20) for n in (1, 2)]
        assert [(await anext(it)).index for it in its] == [0, 0]
        # ... so her third is refused, on any session of hers
        for conn in (alice, await w.connect("alice", ALPNS[1 - ALPNS.index(alpn)])):
            with pytest.raises(MoqtRequestError) as err:
                await layers(conn, twins[3], w.d)
            check_refusal(err.value, conn.draft, 750)
        assert m["limit_refused"] == 2 and w.tracks.metrics["fetches"] == 1  # nothing went upstream for them
        # a SUBSCRIBE to a block the cache lacks is refused the same way; one the cache has is answered
        app = Collector()
        sub = await w.connect("alice", alpn, app)
        refused = sub.session.subscribe(w.namespace, track_name(key(4)), group_order=GroupOrder.ASCENDING)
        served = sub.session.subscribe(w.namespace, track_name(key(6)), group_order=GroupOrder.ASCENDING)
        sub.flush()
        await app.until(lambda: any(isinstance(e, ev.RequestRejected) and e.request_id == refused
                                    for e in app.events)
                        and any(isinstance(e, ev.SubscribeAccepted) and e.request_id == served for e in app.events))
        rejection = next(e for e in app.events if isinstance(e, ev.RequestRejected))
        check_refusal(MoqtRequestError(refused, rejection.error_code, rejection.reason,
                                       retry_interval=rejection.retry_interval), draft, 750)
        # cache hits are never refused, and another principal is served meanwhile (upstream too)
        assert await layers(alice, twins[6], w.d, (3, 9)) == list(range(3, 10))
        bob = await w.connect("bob", alpn)
        assert await layers(bob, twins[5], w.d) == list(range(32))
        assert await layers(bob, twins[7], w.d) == list(range(32))
        assert w.relay.status()["limits"]["in_flight"] == 2
        # the held fetches complete, every layer verified; alice's slots come back and her next ones are served
        go.set()
        assert [[layer.index async for layer in it] for it in its] == [list(range(1, 32))] * 2
        await until(lambda: w.relay.fetches.limits.in_flight(ALICE) == 0)
        assert await layers(alice, twins[3], w.d) == list(range(32))
        assert await layers(alice, twins[4], w.d) == list(range(32))
        assert m["limit_refused"] == 3
        assert w.relay.status()["limits"] == {"principals": 0, "in_flight": 0, "refused_in_flight": 3,
                                              "refused_buffered": 0}


async def test_octets_buffered_for_one_client_are_bounded(relay_certs: TestPki) -> None:
    go = asyncio.Event()
    # one layer of this block is 256 octets: once layer 0 of alice's first fetch is buffered, she is at the limit
    config = RelayConfig(client_max_buffered_bytes=200, client_retry_ms=10)
    async with relay_world(relay_certs, config, go, {key(1)}) as w:
        twins = {n: w.twin(w.store(n)) for n in range(1, 4)}
        alice = await w.connect("alice", "moqt-18")
        held = fetch_layers(alice, twins[1], descriptor=w.d, stall_timeout=20)
        assert (await anext(held)).index == 0
        assert w.relay.fetches.limits.buffered(ALICE) >= 200
        with pytest.raises(MoqtRequestError) as err:
            await layers(alice, twins[2], w.d)
        check_refusal(err.value, Draft.D18, 10)
        assert b"octets are buffered" in err.value.reason
        bob = await w.connect("bob", "moq-00")
        assert await layers(bob, twins[2], w.d) == list(range(32))  # bob's own budget
        go.set()
        assert [layer.index async for layer in held] == list(range(1, 32))
        await until(lambda: w.relay.fetches.limits.buffered(ALICE) == 0)  # cached: not buffered for her any more
        assert await layers(alice, twins[3], w.d) == list(range(32))
        assert w.relay.status()["limits"]["refused_buffered"] == 1


@pytest.mark.parametrize("alpn", ALPNS)
async def test_subscribes_that_subscribe_upstream_are_bounded(relay_certs: TestPki, alpn: str) -> None:
    """Fan-out: a SUBSCRIBE that makes the relay subscribe upstream holds a slot while its subscriber stays."""
    async with relay_world(relay_certs, RelayConfig(client_max_in_flight=1), asyncio.Event(), set()) as w:
        ns = (b"moq-test", b"live")
        publisher = LivePublisher()
        pub = await w.connect("holder", alpn, publisher)
        await pub.publish_namespace(ns)
        apps = [Collector(), Collector()]
        alice, bob = [await w.connect(who, alpn, app) for who, app in zip(("alice", "bob"), apps, strict=True)]
        first = alice.session.subscribe((*ns, b"t"), b"one", group_order=GroupOrder.ASCENDING)
        alice.flush()
        await apps[0].until(lambda: any(isinstance(e, ev.SubscribeAccepted) for e in apps[0].events))
        second = alice.session.subscribe((*ns, b"t"), b"two", group_order=GroupOrder.ASCENDING)
        alice.flush()
        await apps[0].until(lambda: any(isinstance(e, ev.RequestRejected) for e in apps[0].events))
        rejection = next(e for e in apps[0].events if isinstance(e, ev.RequestRejected))
        assert rejection.request_id == second
        check_refusal(MoqtRequestError(second, rejection.error_code, rejection.reason,
                                       retry_interval=rejection.retry_interval), Draft.from_alpn(alpn), 1000)
        # bob joins alice's track (no new upstream subscription) and subscribes to another one: both served
        for name in (b"one", b"two"):
            bob.session.subscribe((*ns, b"t"), name, group_order=GroupOrder.ASCENDING)
        bob.flush()
        await apps[1].until(lambda: sum(isinstance(e, ev.SubscribeAccepted) for e in apps[1].events) == 2)
        # alice ends her subscription: her slot comes back
        alice.session.unsubscribe(first)
        alice.flush()
        await until(lambda: w.relay.fetches.limits.in_flight(ALICE) == 0)
        third = alice.session.subscribe((*ns, b"t"), b"three", group_order=GroupOrder.ASCENDING)
        alice.flush()
        await apps[0].until(lambda: any(isinstance(e, ev.SubscribeAccepted) and e.request_id == third
                                        for e in apps[0].events))
        assert w.relay.metrics["limit_refused"] == 1


async def test_a_holder_bounds_the_fetches_of_one_client(relay_certs: TestPki) -> None:
    """A holder's MOQT endpoint serves at most ``max_in_flight`` FETCHes of one principal at once."""
    d = small_descriptor(layers=32)
    holder = Holder(HolderSettings(HOLDER_URI, (d,)))
    go = asyncio.Event()
    tracks = HeldTracks(holder, go, {key(1)}, POLICY, max_in_flight=1)
    listener = QuicListener(relay_certs.files("holder"), moqt_handlers(tracks))
    await listener.start("127.0.0.1", 0)
    conns: list[MoqtConnection] = []
    try:
        uri = f"moqt://127.0.0.1:{listener.port}/"
        records = {n: moqt_record(holder.store(WRITER, d.compat_id, SCOPE, key(n), block(d, n), "*"), uri)
                   for n in (1, 2)}
        for who in ("alice", "bob"):
            conns.append(await connect_moqt("127.0.0.1", listener.port, relay_certs.files(who), timeout=5))
        alice, bob = conns
        held = fetch_layers(alice, records[1], descriptor=d, stall_timeout=20)
        assert (await anext(held)).index == 0
        with pytest.raises(MoqtRequestError) as err:
            await layers(alice, records[2], d)
        check_refusal(err.value, alice.draft, 1000)
        assert await layers(bob, records[2], d) == list(range(32))
        go.set()
        assert [layer.index async for layer in held] == list(range(1, 32))
        await until(lambda: tracks.limits.in_flight(ALICE) == 0)
        assert await layers(alice, records[2], d) == list(range(32))
        assert tracks.metrics["limit_refused"] == 1
    finally:
        go.set()
        for conn in conns:
            await conn.aclose()
        await listener.close()


def test_the_relay_section_takes_the_limits() -> None:
    cfg = build(RelayFile, {"relay": {"client_max_in_flight": 8, "client_max_buffered_bytes": 1 << 20,
                                      "client_retry_ms": 250}})
    assert (cfg.relay.client_max_in_flight, cfg.relay.client_max_buffered_bytes, cfg.relay.client_retry_ms) == \
        (8, 1 << 20, 250)
    assert request_code(Draft.D18, "excessive-load") == 0x9 and request_code(Draft.D14, "excessive-load") == 0x0
    assert RelayConfig().client_max_in_flight == 64 and RelayConfig().client_max_buffered_bytes == 256 << 20
    for bad in ({"client_max_in_flight": 0}, {"client_max_buffered_bytes": 0}, {"client_retry_ms": -1}):
        with pytest.raises(ConfigError):
            build(RelayFile, {"relay": bad})
