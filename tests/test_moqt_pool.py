"""MoqtPool's connections_per_origin against real MOQT servers on 127.0.0.1 (both drafts): concurrent fetches to one
``moqt://`` origin are spread over up to K QUIC connections (each from its own UDP port, as the server sees it),
least loaded first; sequential fetches reuse one; a closed connection is replaced, one after GOAWAY takes no new
fetches and closes once its own are over; a slow connect does not hold up fetches an open connection can take, a
fetch that gives up waiting does not abort the connect the others wait for, a failed connect fails every fetch
waiting for it, and aclose cancels connects in progress. Then a real holder's tracks, fetched all at once, arrive
verified over K connections. The same rules as http3.h3_client.H3Pool (tests/test_h3_pool_connections.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsp_moqt.holder_tracks import HolderTracks, fetch_replica
from kvsp_moqt.tracks import moqt_record
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.samples import random_sections
from moqt import Location
from moqt.aio import AUDIT, MoqtApp, MoqtConnectError, MoqtConnection, MoqtPool, moqt_handlers
from moqt.events import FetchRequested
from quic.listener import QuicListener
from tests.pki import TestPki, make_pki
from tests.support.descriptors import small_descriptor
from tests.support.transport import DelayingRelay
from tests.support.waits import until

ALPNS = ["moqt-18", "moq-00"]
DRAFTS = pytest.mark.parametrize("alpn", ALPNS)
OBJECTS = 4


def payload(name: bytes, i: int) -> bytes:
    """Object *i* of track *name*: 16 KiB that depend on both."""
    return hashlib.sha256(name + b"/%d" % i).digest() * 512


class Gated(MoqtApp):
    """FETCH of any track: notes the peer address it came from, waits until the test opens the gate (or the track
    is listed in *through*), then serves OBJECTS objects of ``payload(track, i)`` in group 0."""

    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []
        self.arrived = 0
        self.changed = asyncio.Event()
        self.gate = asyncio.Event()
        self.through: set[bytes] = set()
        self.conns: list[MoqtConnection] = []

    def session_ready(self, conn: MoqtConnection) -> None:
        self.conns.append(conn)

    async def fetch(self, conn: MoqtConnection, request: FetchRequested) -> None:
        assert conn.peer is not None
        self.peers.append((conn.peer[0], conn.peer[1]))
        self.arrived += 1
        self.changed.set()
        if request.track_name not in self.through:
            await self.gate.wait()
        served = conn.accept_fetch(request.request_id, Location(0, OBJECTS), end_of_track=True)
        for i in range(OBJECTS):
            await served.write_object(i, [payload(request.track_name, i)])
        served.finish()

    async def until(self, arrived: int, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while self.arrived < arrived:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def server(certs: TestPki) -> AsyncIterator[tuple[QuicListener, Gated]]:
    app = Gated()
    listener = QuicListener(certs.files("server"), moqt_handlers(app))
    await listener.start("127.0.0.1", 0)
    yield listener, app
    app.gate.set()
    await listener.close()


def uri(port: int) -> str:
    return f"moqt://127.0.0.1:{port}/"


async def fetch(pool: MoqtPool, port: int, name: str) -> list[bytes]:
    """One track's objects, fetched the way kvsp_moqt's sources do (FETCH sent right after ``get``)."""
    conn = await pool.get(uri(port))
    async with conn.fetch((b"pool", b"test"), name.encode(), Location(0, 0), Location(0, 0),
                          stall_timeout=10) as stream:
        return [obj.payload async for obj in stream.objects()]


def expected(name: str) -> list[bytes]:
    return [payload(name.encode(), i) for i in range(OBJECTS)]


async def burst(pool: MoqtPool, port: int, app: Gated, names: list[str]) -> None:
    """*names* fetched at once, served only once all of them reached the server; every object checked."""
    before = app.arrived
    app.gate.clear()
    tasks = [asyncio.create_task(fetch(pool, port, name)) for name in names]
    try:
        await app.until(before + len(names))
    finally:
        app.gate.set()
    assert await asyncio.gather(*tasks) == [expected(name) for name in names]


def client_ports(pool: MoqtPool, port: int) -> set[int]:
    return {conn.transport._transport.get_extra_info("sockname")[1]  # type: ignore[attr-defined]
            for conn in pool.connections(uri(port))}


@DRAFTS
async def test_concurrent_fetches_spread_over_k_connections(server: tuple[QuicListener, Gated], certs: TestPki,
                                                            alpn: str) -> None:
    listener, app = server
    async with MoqtPool(certs.files("alice"), alpn=alpn, connections_per_origin=3) as pool:
        await burst(pool, listener.port, app, [f"r{i}" for i in range(6)])
        per_port = Counter(app.peers)
        assert len(per_port) == 3 and all(addr[0] == "127.0.0.1" for addr in per_port)
        assert sorted(per_port.values()) == [2, 2, 2]  # least loaded first: two fetches on each
        assert pool.connects == 3 and len(pool.connections(uri(listener.port))) == 3
        assert listener.connections == 3 and {conn.alpn for conn in app.conns} == {alpn}
        assert client_ports(pool, listener.port) == {port for _, port in per_port}
        assert all(conn.open_fetches == 0 for conn in pool.connections(uri(listener.port)))

        await burst(pool, listener.port, app, [f"s{i}" for i in range(6)])  # the same three again
        assert pool.connects == 3 and len(set(app.peers)) == 3
        assert sorted(Counter(app.peers).values()) == [4, 4, 4]


async def test_one_connection_per_origin_by_default(server: tuple[QuicListener, Gated], certs: TestPki) -> None:
    listener, app = server
    async with MoqtPool(certs.files("alice")) as pool:
        assert pool.connections_per_origin == 1
        await burst(pool, listener.port, app, [f"r{i}" for i in range(6)])
        assert len(set(app.peers)) == 1 and len(app.peers) == 6
        assert pool.connects == 1 and listener.connections == 1


async def test_sequential_fetches_reuse_one_connection(server: tuple[QuicListener, Gated], certs: TestPki) -> None:
    listener, app = server
    app.gate.set()
    async with MoqtPool(certs.files("alice"), connections_per_origin=3) as pool:
        for i in range(5):
            assert await fetch(pool, listener.port, f"q{i}") == expected(f"q{i}")
        conn = await pool.get(uri(listener.port))
        stream = conn.fetch((b"pool", b"test"), b"read-later", Location(0, 0), Location(0, 0))
        assert conn.open_fetches == 1
        assert [o.payload async for o in stream.objects()] == expected("read-later")
        assert conn.open_fetches == 0  # every object taken: no longer load, though not closed yet
        await stream.aclose()
    assert len(set(app.peers)) == 1 and len(app.peers) == 6
    assert pool.connects == 1


async def test_a_closed_connection_is_replaced(server: tuple[QuicListener, Gated], certs: TestPki) -> None:
    listener, app = server
    async with MoqtPool(certs.files("alice"), connections_per_origin=3) as pool:
        await burst(pool, listener.port, app, [f"a{i}" for i in range(6)])
        first = set(app.peers)
        dropped = pool.connections(uri(listener.port))[0]
        await dropped.aclose()
        assert len(pool.connections(uri(listener.port))) == 2

        app.peers.clear()
        await burst(pool, listener.port, app, [f"b{i}" for i in range(6)])
        second = Counter(app.peers)
        assert len(second) == 3 and sorted(second.values()) == [2, 2, 2]
        assert len(set(second) - first) == 1  # one new connection took the closed one's place
        assert pool.connects == 4 and dropped not in pool.connections(uri(listener.port))


async def test_after_goaway_a_connection_takes_no_new_fetches_and_closes_when_done(
        server: tuple[QuicListener, Gated], certs: TestPki) -> None:
    listener, app = server
    async with MoqtPool(certs.files("alice")) as pool:
        app.gate.clear()
        held = asyncio.create_task(fetch(pool, listener.port, "held"))
        await app.until(1)
        old = pool.connections(uri(listener.port))[0]
        served_side = app.conns[0]
        served_side.session.goaway()
        served_side.flush()
        await until(lambda: old.goaway is not None)
        app.through.add(b"fresh")
        assert await fetch(pool, listener.port, "fresh") == expected("fresh")  # on a new connection
        assert pool.connects == 2 and old.closed is None  # its fetch is still under way
        app.gate.set()
        assert await held == expected("held")
        app.through.add(b"next")
        assert await fetch(pool, listener.port, "next") == expected("next")  # the pool sweeps the old one
        await until(lambda: old.closed is not None)
        assert len(set(app.peers)) == 2 and pool.connects == 2


async def test_a_slow_connect_does_not_hold_up_fetches_an_open_connection_takes(
        server: tuple[QuicListener, Gated], certs: TestPki) -> None:
    listener, app = server
    loop = asyncio.get_running_loop()
    relay = DelayingRelay(("127.0.0.1", listener.port), delay=1.0, slow_for=1.5)
    transport, _ = await loop.create_datagram_endpoint(lambda: relay, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    try:
        async with MoqtPool(certs.files("alice"), connect_timeout=10, connections_per_origin=2) as pool:
            app.through.add(b"warm")
            assert await fetch(pool, port, "warm") == expected("warm")  # the first connection, at full speed
            app.gate.clear()
            held = asyncio.create_task(fetch(pool, port, "held"))  # in flight on it...
            await app.until(2)
            second = asyncio.create_task(fetch(pool, port, "second"))  # ...so this one opens a second, slowly
            await asyncio.sleep(0.05)
            assert len(pool._connecting[("127.0.0.1", port)]) == 1
            app.through.add(b"third")
            start = loop.time()
            third = await fetch(pool, port, "third")  # the first connection takes it meanwhile (a tie: 1 and 1)
            assert third == expected("third") and loop.time() - start < 0.5
            assert not second.done()
            app.gate.set()
            assert await held == expected("held") and await second == expected("second")
            assert pool.connects == 2 and len(set(app.peers)) == 2
            assert Counter(app.peers).most_common(1)[0][1] == 3  # warm, held and third on the first
    finally:
        relay.close()


async def test_a_fetch_that_gives_up_waiting_does_not_abort_the_connect(server: tuple[QuicListener, Gated],
                                                                        certs: TestPki) -> None:
    listener, app = server
    loop = asyncio.get_running_loop()
    relay = DelayingRelay(("127.0.0.1", listener.port), delay=0.5, slow_for=2.0)
    transport, _ = await loop.create_datagram_endpoint(lambda: relay, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    first_flow, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, remote_addr=("127.0.0.1", port))
    first_flow.sendto(b"\x00")  # takes the relay's one fast flow: the pool's connect is slow
    try:
        async with MoqtPool(certs.files("alice"), connect_timeout=10) as pool:
            async with asyncio.timeout(5):
                while len(relay.flows) < 1:
                    await asyncio.sleep(0.01)
            impatient = asyncio.create_task(pool.get(uri(port)))
            patient = asyncio.create_task(pool.get(uri(port)))
            await asyncio.sleep(0.1)
            assert len(pool._connecting[("127.0.0.1", port)]) == 1  # one connect, two waiting for it
            impatient.cancel()  # what a fetch's timeout does
            with pytest.raises(asyncio.CancelledError):
                await impatient
            conn = await patient
            assert conn.closed is None and pool.connects == 1
            app.gate.set()
            assert await fetch(pool, port, "after") == expected("after")
            assert pool.connects == 1
    finally:
        first_flow.close()
        relay.close()


@DRAFTS
async def test_a_failed_connect_fails_every_fetch_waiting_for_it(certs: TestPki, alpn: str) -> None:
    other = "moq-00" if alpn == "moqt-18" else "moqt-18"
    listener = QuicListener(certs.files("server"), moqt_handlers(Gated(), alpns=[other]))
    await listener.start("127.0.0.1", 0)
    before = AUDIT.snapshot()[1].get(("client", "no_application_protocol"), 0)
    try:
        async with MoqtPool(certs.files("alice"), alpn=alpn, connect_timeout=3) as pool:
            results = await asyncio.gather(*(pool.get(uri(listener.port)) for _ in range(5)), return_exceptions=True)
            assert all(isinstance(r, MoqtConnectError) for r in results), results
            # one connect, refused once: every waiter got its error
            assert AUDIT.snapshot()[1][("client", "no_application_protocol")] == before + 1
            assert pool.connects == 0 and not pool.connections(uri(listener.port))
            assert not pool._connecting.get(("127.0.0.1", listener.port))
    finally:
        await listener.close()


async def test_aclose_cancels_the_connects_in_progress(server: tuple[QuicListener, Gated], certs: TestPki) -> None:
    listener, _ = server
    loop = asyncio.get_running_loop()
    relay = DelayingRelay(("127.0.0.1", listener.port), delay=2.0, slow_for=5.0)
    transport, _ = await loop.create_datagram_endpoint(lambda: relay, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    first_flow, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, remote_addr=("127.0.0.1", port))
    first_flow.sendto(b"\x00")
    try:
        pool = MoqtPool(certs.files("alice"), connect_timeout=10, connections_per_origin=2)
        async with asyncio.timeout(5):
            while len(relay.flows) < 1:
                await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(pool.get(uri(port))) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert len(pool._connecting[("127.0.0.1", port)]) == 2
        start = loop.time()
        await pool.aclose()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, MoqtConnectError) and "closed" in str(r) for r in results), results
        assert loop.time() - start < 1.0 and pool.connects == 0
        with pytest.raises(MoqtConnectError, match="closed"):
            await pool.get(uri(port))
    finally:
        first_flow.close()
        relay.close()


def test_connections_per_origin_is_validated(certs: TestPki) -> None:
    for bad in (0, -1, True):
        with pytest.raises(ValueError):
            MoqtPool(certs.files("alice"), connections_per_origin=bad)


# -- a holder's tracks, all fetched at once ---------------------------------------------------------------------

SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")


class WatchedTracks(HolderTracks):
    """The real holder's tracks; notes the peer of every FETCH and holds each until *hold* are in flight at once
    (or a second passed), so that the test sees how many connections concurrent fetches use."""

    def __init__(self, *args: object, hold: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hold = hold
        self.peers: list[tuple[str, int]] = []
        self.all_in = asyncio.Event()

    async def fetch(self, conn: MoqtConnection, request: FetchRequested) -> None:
        assert conn.peer is not None
        self.peers.append((conn.peer[0], conn.peer[1]))
        if len(self.peers) >= self.hold:
            self.all_in.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self.all_in.wait()
        await super().fetch(conn, request)


@DRAFTS
async def test_concurrent_block_fetches_from_one_holder_use_k_connections(tmp_path: Path, alpn: str) -> None:
    certs = make_pki(tmp_path, roles={"holder": "https://127.0.0.1/kvsp/"})
    d = small_descriptor(layers=4)
    blocks = 8
    policy = Policy.from_dict({"principal": [
        {"identity": "urn:kvsp:client:alice", "roles": ["instance"], "scopes": [SCOPE.hex()]}]})
    holder = Holder(HolderSettings("https://127.0.0.1:4433/kvsp/", (d,), replica_ttl_ms=60_000))
    tracks = WatchedTracks(holder, policy, hold=blocks)
    listener = QuicListener(certs.files("holder"), moqt_handlers(tracks))
    await listener.start("127.0.0.1", 0)
    alice = policy.principal("urn:kvsp:client:alice")
    assert alice is not None
    records, bodies = [], []
    for n in range(blocks):
        key = hashlib.sha256(b"block %d" % n).digest()
        bodies.append(c.encode(list(random_sections(d, d.block_tokens, 0, d.layers - 1, n)), first_layer=0,
                               token_count=d.block_tokens, descriptor=d).tobytes())
        record = holder.store(alice, d.compat_id, SCOPE, key, bodies[-1], "*")
        records.append(moqt_record(record, uri(listener.port)))

    async def load(n: int) -> list[c.DecodedLayer]:
        return [layer async for layer in fetch_replica(pool, records[n], descriptor=d)]

    try:
        async with MoqtPool(certs.files("alice"), alpn=alpn, connections_per_origin=3) as pool:
            results = await asyncio.gather(*(load(n) for n in range(blocks)))  # as a prefill does: all at once
            assert tracks.all_in.is_set()  # all eight were in flight together
            for n, layers in enumerate(results):
                want = c.decode(bodies[n], d)[1]
                assert [layer.index for layer in layers] == list(range(d.layers))
                for layer in layers:  # verified against the record's digests as they arrived, and equal
                    assert layer.digest == records[n].layer_digests[layer.index]  # type: ignore[index]
                    assert bytes(layer.k) == bytes(want[layer.index].k)
                    assert bytes(layer.v) == bytes(want[layer.index].v)
            per_port = Counter(tracks.peers)
            assert len(per_port) == 3 and sorted(per_port.values()) == [2, 3, 3]
            assert pool.connects == 3 and listener.connections == 3
            assert tracks.metrics["fetches"] == blocks
    finally:
        await listener.close()
