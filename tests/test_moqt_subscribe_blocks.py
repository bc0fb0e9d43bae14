"""SUBSCRIBE to a KVSP track (a block: immutable, complete, group 0), over real sockets on 127.0.0.1, both drafts:
the holder (kvsp_moqt/holder_tracks.py) and the stock relay (moqt/relay/complete.py) answer SUBSCRIBE_OK with the
Largest Location (0, last layer) and deliver no object -- one subgroup stream carrying only the End of Group status
at (0, layers) -- and the subscription's Largest Location anchors a joining FETCH, which delivers the layers (what
moq-rs does: tests/test_moq_rs.py). An AbsoluteRange filter is INVALID_RANGE; a reader without the scope is
UNAUTHORIZED, as for FETCH. docs/moqt.md, "SUBSCRIBE to a KVSP track"."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvsp_moqt.holder_tracks import HolderTracks
from kvsp_moqt.relay_policy import kvsp_relay
from kvsp_moqt.relay_rules import RelayRules
from kvsp_moqt.tracks import invalid_range, track_name, track_namespace, unauthorized
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.roles.holder import Holder, HolderSettings
from moqt import events as ev
from moqt.aio import MoqtApp, MoqtConnection, connect_moqt, moqt_handlers
from moqt.relay import RelayConfig
from moqt.types import FilterType, Location, ObjectStatus, SubscriptionFilter
from quic.listener import QuicListener
from tests.pki import TestPki, make_pki
from tests.support.descriptors import small_descriptor
from tests.support.moqt_relay import ALICE, HOLDER_URI, SCOPE, WRITER, block, key

ALPNS = ["moqt-18", "moq-00"]
DRAFTS = pytest.mark.parametrize("alpn", ALPNS)
RELAY_URI = "https://127.0.0.1/relay/"
LAYERS = 32


class Subscriber(MoqtApp):
    """Records what arrives for our subscriptions."""

    def __init__(self) -> None:
        self.events: list[ev.Event] = []
        self.changed = asyncio.Event()

    def event(self, conn: MoqtConnection, event: ev.Event) -> None:
        self.events.append(event)
        self.changed.set()

    async def reply(self, rid: int, timeout: float = 5.0) -> ev.Event:
        async with asyncio.timeout(timeout):
            while True:
                for e in self.events:
                    if isinstance(e, ev.SubscribeAccepted | ev.RequestRejected) and e.request_id == rid:
                        return e
                self.changed.clear()
                await self.changed.wait()

    async def until(self, cls: type, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not any(isinstance(e, cls) for e in self.events):
                self.changed.clear()
                await self.changed.wait()


# Its own PKI: a holder and a relay, no index (tests/conftest.py's relay_certs has an index too).
@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"), roles={"holder": HOLDER_URI, "relay": RELAY_URI})


def holder_with_block() -> tuple[Holder, tuple[bytes, ...], bytes, list[c.DecodedLayer]]:
    d = small_descriptor(layers=LAYERS)
    holder = Holder(HolderSettings(HOLDER_URI, (d,)))
    data = block(d, 7)
    holder.store(WRITER, d.compat_id, SCOPE, key(7), data, "*")
    return holder, track_namespace(d.compat_id, SCOPE, HOLDER_URI, 1), track_name(key(7)), c.decode(data, d)[1]


async def subscribe_and_join(conn: MoqtConnection, app: Subscriber, namespace: tuple[bytes, ...],
                             name: bytes, layers: list[c.DecodedLayer]) -> None:
    """SUBSCRIBE (Largest Object filter): SUBSCRIBE_OK with Largest (0, 31), only the End of Group marker; then a
    joining FETCH from group 0 delivers the 32 layers."""
    rid = conn.session.subscribe(namespace, name, filter=SubscriptionFilter(FilterType.LARGEST_OBJECT))
    conn.flush()
    reply = await app.reply(rid)
    assert isinstance(reply, ev.SubscribeAccepted), reply
    assert reply.largest == Location(0, LAYERS - 1)
    await app.until(ev.StreamEnded)
    objects = [e for e in app.events if isinstance(e, ev.ObjectReceived)]
    assert [(o.group, o.object_id, o.status, o.length) for o in objects] == [
        (0, LAYERS, ObjectStatus.END_OF_GROUP, 0)]  # no object, only where the group ends
    async with conn.joining_fetch(rid, 0, absolute=True, stall_timeout=5) as fetch:
        got = [o async for o in fetch.objects()]
    assert [o.object_id for o in got] == list(range(LAYERS))
    for o in got:
        want = layers[o.object_id]
        assert o.payload == bytes(want.k) + bytes(want.v)
    await asyncio.sleep(0.1)
    assert conn.closed is None and not any(isinstance(e, ev.PublishDone) for e in app.events)  # still open


@DRAFTS
async def test_the_holder_accepts_a_subscribe_with_the_largest_location(certs: TestPki, alpn: str) -> None:
    holder, namespace, name, layers = holder_with_block()
    policy = Policy.from_dict({"principal": [{"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
                                             {"identity": "urn:kvsp:client:bob", "roles": ["client"], "scopes": []}]})
    tracks = HolderTracks(holder, policy)
    listener = QuicListener(certs.files("holder"), moqt_handlers(tracks))
    await listener.start("127.0.0.1", 0)
    try:
        app = Subscriber()
        conn = await connect_moqt("127.0.0.1", listener.port, certs.files("alice"), alpn=alpn, app=app, timeout=5)
        try:
            await subscribe_and_join(conn, app, namespace, name, layers)
            assert tracks.metrics["subscriptions"] == 1
            # a range can never be satisfied: the whole group is in the past
            rid = conn.session.subscribe(namespace, name, filter=SubscriptionFilter(
                FilterType.ABSOLUTE_RANGE, Location(0, 0), 0))
            conn.flush()
            refused = await app.reply(rid)
            assert isinstance(refused, ev.RequestRejected) and refused.error_code == invalid_range(conn.draft)
        finally:
            await conn.aclose()
        bob_app = Subscriber()
        bob = await connect_moqt("127.0.0.1", listener.port, certs.files("bob"), alpn=alpn, app=bob_app, timeout=5)
        try:
            rid = bob.session.subscribe(namespace, name)
            bob.flush()
            refused = await bob_app.reply(rid)
            assert isinstance(refused, ev.RequestRejected) and refused.error_code == unauthorized(bob.draft)
        finally:
            await bob.aclose()
    finally:
        await listener.close()


@DRAFTS
async def test_the_relay_answers_a_subscribe_to_a_block_from_its_fetch_side(certs: TestPki, alpn: str,
                                                                           tmp_path: Path) -> None:
    holder, namespace, name, layers = holder_with_block()
    tracks = HolderTracks(holder, Policy.from_dict({"principal": [
        {"identity": RELAY_URI, "roles": ["holder"], "scopes": "*"}]}))
    policy = Policy.from_dict({"principal": [
        {"identity": HOLDER_URI, "roles": ["holder"], "scopes": "*"},
        {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]}]})
    relay = kvsp_relay(RelayRules.of(policy, []), RelayConfig())
    listener = QuicListener(certs.files("relay"), moqt_handlers(relay, data_streams=8))
    await listener.start("127.0.0.1", 0)
    try:
        pub = await connect_moqt("127.0.0.1", listener.port, certs.files("holder"), alpn=alpn, app=tracks, timeout=5)
        try:
            await pub.publish_namespace(namespace)
            for other in ALPNS:  # subscribers on both drafts, whatever the publisher's
                app = Subscriber()
                conn = await connect_moqt("127.0.0.1", listener.port, certs.files("alice"), alpn=other, app=app,
                                          timeout=5)
                try:
                    await subscribe_and_join(conn, app, namespace, name, layers)
                finally:
                    await conn.aclose()
        finally:
            await pub.aclose()
    finally:
        await relay.aclose()
        await listener.close()
    assert relay.metrics["complete_subscriptions"] == 2 and relay.metrics["upstream_subscriptions"] == 0
    assert relay.metrics["upstream_fetches"] == 1 and tracks.metrics["fetches"] == 1  # then from the cache
    assert tracks.metrics["subscriptions"] == 0  # the relay answered SUBSCRIBE itself
