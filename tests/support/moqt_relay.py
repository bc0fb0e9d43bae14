"""The MOQT relay over real sockets: the identities and policies of its tests, blocks by number, and
:func:`world` (a stock KVSP relay on 127.0.0.1 with a holder whose tracks it can publish there)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from typing import Any

from kvsp_moqt.holder_tracks import HolderTracks, fetch_layers
from kvsp_moqt.relay_policy import kvsp_relay
from kvsp_moqt.relay_rules import RelayRules
from kvsp_moqt.tracks import moqt_record, track_namespace
from kvsp_quic import container as c
from kvsp_quic.auth import Policy, Principal, Role
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.samples import random_sections
from moqt import events as ev
from moqt.aio import (
    MoqtApp,
    MoqtConnection,
    connect_moqt,
    moqt_handlers,
)
from moqt.errors import PublishDoneCode14
from moqt.relay import (
    Relay,
    RelayConfig,
)
from moqt.types import Location
from quic.listener import QuicListener
from tests.pki import TestPki
from tests.support.descriptors import small_descriptor

SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
OTHER_SCOPE = bytes.fromhex("00112233445566778899aabbccddeeff")
HOLDER_URI = "https://127.0.0.1/kvsp/"  # the publishing holder's identity and base URI
RELAY_URI = "https://127.0.0.1/relay/"
INDEX_URI = "https://127.0.0.1/is/"
ALICE = "urn:kvsp:client:alice"
BOB = "urn:kvsp:client:bob"
RELAY_POLICY = Policy.from_dict({"principal": [
    {"identity": HOLDER_URI, "roles": ["holder"], "scopes": "*"},
    {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
    {"identity": BOB, "roles": ["client"], "scopes": [OTHER_SCOPE.hex()]},
]})
HOLDER_POLICY = Policy.from_dict({"principal": [  # who may FETCH from the holder: the relay
    {"identity": RELAY_URI, "roles": ["holder"], "scopes": "*"}]})
WRITER = Principal("urn:test:writer", frozenset({Role.INSTANCE}), frozenset({SCOPE}))
ALPNS = ("moq-00", "moqt-18")


OPEN = (b"moq-test",)
DEFAULTS = RelayConfig()


def key(n: int) -> bytes:
    return hashlib.sha256(b"relay block %d" % n).digest()


def block(d: CompatDescriptor, n: int) -> bytes:
    return c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, n), first_layer=0,
                    token_count=d.block_tokens, descriptor=d).tobytes()


@dataclasses.dataclass
class World:
    relay: Relay
    listener: QuicListener
    holder: Holder
    tracks: HolderTracks
    d: CompatDescriptor
    certs: TestPki
    conns: list[MoqtConnection] = dataclasses.field(default_factory=list)

    @property
    def uri(self) -> str:
        return f"moqt://127.0.0.1:{self.listener.port}/"

    @property
    def namespace(self) -> tuple[bytes, ...]:
        return track_namespace(self.d.compat_id, SCOPE, HOLDER_URI, 1)

    def store(self, n: int) -> ReplicaRecord:
        return self.holder.store(WRITER, self.d.compat_id, SCOPE, key(n), block(self.d, n), "*")

    def twin(self, record: ReplicaRecord) -> ReplicaRecord:
        return moqt_record(record, self.uri)

    async def connect(self, who: str, alpn: str, app: MoqtApp | None = None) -> MoqtConnection:
        conn = await connect_moqt("127.0.0.1", self.listener.port, self.certs.files(who), alpn=alpn, app=app,
                                  timeout=5)
        self.conns.append(conn)
        return conn

    async def publisher(self, alpn: str, app: MoqtApp | None = None) -> MoqtConnection:
        conn = await self.connect("holder", alpn, app or self.tracks)
        await conn.publish_namespace(self.namespace)
        return conn


async def start_relay(certs: TestPki, config: RelayConfig = DEFAULTS, **kw: Any) -> tuple[Relay, QuicListener]:
    relay = kvsp_relay(RelayRules(RELAY_POLICY, (OPEN,)), config, **kw)
    listener = QuicListener(certs.files("relay"), moqt_handlers(relay, data_streams=8))
    await listener.start("127.0.0.1", 0)
    return relay, listener


@contextlib.asynccontextmanager
async def world(certs: TestPki, config: RelayConfig = DEFAULTS, **kw: Any) -> AsyncIterator[World]:
    d = small_descriptor(layers=32)
    holder = Holder(HolderSettings(HOLDER_URI, (d,)))
    relay, listener = await start_relay(certs, config, **kw)
    w = World(relay, listener, holder, HolderTracks(holder, HOLDER_POLICY), d, certs)
    try:
        yield w
    finally:
        for conn in w.conns:
            await conn.aclose()
        await relay.aclose()
        await listener.close()


async def layers(conn: MoqtConnection, record: ReplicaRecord, d: CompatDescriptor,
                 rng: tuple[int, int] | None = None) -> list[int]:
    return [layer.index async for layer in fetch_layers(conn, record, rng, descriptor=d, stall_timeout=5)]


class Collector(MoqtApp):
    def __init__(self) -> None:
        self.events: list[ev.Event] = []
        self.changed = asyncio.Event()

    def event(self, conn: MoqtConnection, event: ev.Event) -> None:
        self.events.append(event)
        self.changed.set()

    def request(self, conn: MoqtConnection, request: ev.Event) -> None:
        if isinstance(request, ev.PublishNamespaceRequested):  # draft 14 announces namespaces so
            conn.session.accept_publish_namespace(request.request_id)
            conn.flush()
            self.event(conn, request)
        else:
            super().request(conn, request)

    async def until(self, check: Any) -> None:
        async with asyncio.timeout(5):
            while not check():
                self.changed.clear()
                await self.changed.wait()


class LivePublisher(MoqtApp):
    """Accepts SUBSCRIBEs of any track; ``send`` writes groups of objects to every subscription, then
    PUBLISH_DONE."""

    def __init__(self) -> None:
        self.subs: list[tuple[MoqtConnection, int]] = []
        self.subscribed = asyncio.Event()

    def request(self, conn: MoqtConnection, request: ev.Event) -> None:
        if isinstance(request, ev.SubscribeRequested):
            conn.session.accept_subscribe(request.request_id, largest=Location(0, 0))
            conn.flush()
            self.subs.append((conn, request.request_id))
            self.subscribed.set()
        else:
            super().request(conn, request)

    def send(self, groups: int, objects: int) -> None:
        for conn, rid in self.subs:
            for g in range(groups):
                writer = conn.session.open_subgroup(rid, g, 0, priority=128)
                for o in range(objects):
                    writer.write_object(o, b"%d.%d" % (g, o) * 10)
                writer.finish()
            conn.session.publish_done(rid, int(PublishDoneCode14.TRACK_ENDED), b"track ended")
            conn.flush()
