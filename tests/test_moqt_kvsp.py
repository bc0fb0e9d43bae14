"""KVSP over MOQT (kvsp_moqt/tracks.py, kvsp_moqt/holder_tracks.py, kvsp_moqt/source.py) over real sockets on
127.0.0.1: an in-process
Holder served by one RoleServer (holder_app over HTTP/3 + its tracks over MOQT, one UDP port), FETCHes of group 0
with every layer verified as it arrives, refusals with the drafts' codes, the replica publisher's MOQT twins at a
real Index Service, and BlockFetcher preferring the moqt:// replica and falling back to HTTP for each way MOQT
fails."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from http3.server import RoleServer, bind_pair
from kvsp_client.retrieval import BlockFetcher, HttpSource
from kvsp_http.holder_app import holder_app
from kvsp_http.index_app import index_app
from kvsp_moqt.holder_tracks import HolderTracks, fetch_layers, fetch_replica, holder_moqt_handlers
from kvsp_moqt.source import MoqtSource, PreferMoqt
from kvsp_moqt.tracks import (
    LayerAssembler,
    MalformedTrack,
    does_not_exist,
    invalid_range,
    moqt_record,
    moqt_uri_for,
    parse_track,
    served_range,
    track_name,
    track_namespace,
    unauthorized,
)
from kvsp_quic import container as c
from kvsp_quic.auth import Policy, Principal, Role
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import LayerDigestMismatch
from kvsp_quic.keys import holder_id
from kvsp_quic.records import LookupMatch, ReplicaRecord, encode_moqt_namespace, kvsp_track_namespace
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.index import IndexService
from kvsp_quic.samples import random_sections
from kvsp_quic.storage.memory_index import MemoryIndexStore
from kvsp_quic.storage.tiers import BlockId
from kvsp_runtime.publisher import ReplicaPublisher
from moqt import Location
from moqt.aio import MoqtApp, MoqtConnection, MoqtPool, MoqtRequestError, moqt_handlers
from moqt.events import FetchRequested, ObjectReceived
from moqt.types import Draft, ObjectStatus, StandaloneFetch
from quic.tls import TlsFiles
from tests.helpers import Process
from tests.pki import TestPki, make_pki
from tests.support.descriptors import small_descriptor

SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
OTHER_SCOPE = bytes.fromhex("00112233445566778899aabbccddeeff")
ALICE = "urn:kvsp:client:alice"
BOB = "urn:kvsp:client:bob"
HOLDER_CERT_URI = "https://127.0.0.1/kvsp/"
POLICY = Policy.from_dict({"principal": [
    {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
    {"identity": BOB, "roles": ["client"], "scopes": [OTHER_SCOPE.hex()]},
]})
WRITER = Principal("urn:test:writer", frozenset({Role.INSTANCE}), frozenset({SCOPE}))  # stores blocks in-process
ALPNS = ["moq-00", "moqt-18"]
DRAFTS = pytest.mark.parametrize("alpn", ALPNS)


def key(n: int) -> bytes:
    return hashlib.sha256(b"block %d" % n).digest()


def block(d: CompatDescriptor, n: int) -> bytes:
    return c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, n), first_layer=0,
                    token_count=d.block_tokens, descriptor=d).tobytes()


# Its own PKI, one per module (tests/conftest.py's holder_certs has these roles, but one PKI per test).
@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"), roles={"holder": HOLDER_CERT_URI, "index": "https://127.0.0.1/is/"})


@dataclasses.dataclass
class Net:
    server: RoleServer
    holder: Holder
    d: CompatDescriptor
    certs: TestPki
    extra: list[RoleServer]

    @property
    def moqt_uri(self) -> str:
        return f"moqt://127.0.0.1:{self.server.port}/"

    def store(self, n: int) -> ReplicaRecord:
        return self.holder.store(WRITER, self.d.compat_id, SCOPE, key(n), block(self.d, n), "*")

    def twin(self, record: ReplicaRecord, uri: str | None = None) -> ReplicaRecord:
        return moqt_record(record, uri or self.moqt_uri)

    def layers(self, n: int) -> list[c.DecodedLayer]:
        return c.decode(block(self.d, n), self.d)[1]

    async def serve(self, app: MoqtApp | None) -> str:
        """Another server on its own port: HTTP/3 of the same holder, and MOQT served by *app* (None: no MOQT)."""
        server = RoleServer(holder_app(self.holder, POLICY, base_path="/kvsp/"), self.certs.files("holder"),
                            quic_handlers=moqt_handlers(app) if app is not None else None)
        await server.start("127.0.0.1", 0)
        self.extra.append(server)
        return f"moqt://127.0.0.1:{server.port}/"


@pytest.fixture
async def net(certs: TestPki) -> AsyncIterator[Net]:
    d = small_descriptor(layers=32)
    tcp, udp = bind_pair("127.0.0.1", 0, 1 << 20)
    base = f"https://127.0.0.1:{tcp.getsockname()[1]}/kvsp/"
    holder = Holder(HolderSettings(base, (d,), replica_ttl_ms=60_000))
    server = RoleServer(holder_app(holder, POLICY), certs.files("holder"),
                        quic_handlers=holder_moqt_handlers(holder, POLICY))
    await server.start(sockets=(tcp, udp))
    net = Net(server, holder, d, certs, [])
    try:
        yield net
    finally:
        for extra in net.extra:
            await extra.close()
        await server.close()


@pytest.fixture
async def pool(certs: TestPki, request: pytest.FixtureRequest) -> AsyncIterator[MoqtPool]:
    alpn = getattr(request, "param", ALPNS)
    async with MoqtPool(certs.files("alice"), alpn=alpn, connect_timeout=3) as pool:
        yield pool


def draft_pool(alpn: str) -> Any:
    return pytest.mark.parametrize("pool", [alpn], indirect=True)


# -- the mapping, sans I/O ----------------------------------------------------------------------------------------


def test_names_records_and_ranges(spec_descriptor: CompatDescriptor) -> None:
    d = spec_descriptor
    record = ReplicaRecord.from_json({
        "block_key": key(1).hex(), "compat_id": d.compat_id.hex(), "scope_id": SCOPE.hex(),
        "holder": "https://h1.example:4443/kvsp/", "codec": 1, "size": 100,
        "digest": "sha-256:" + hashlib.sha256(b"".join([bytes(32)] * 2)).hexdigest(),
        "residency": [{"tier": "host", "layers": [0, 1]}], "ttl_ms": 1000, "layer_digests": [bytes(32).hex()] * 2})
    assert moqt_uri_for(record.holder) == "moqt://h1.example:4443/"
    twin = moqt_record(record, "moqt://h1.example:4443/")
    namespace = (b"kvsp-1", d.compat_id.hex().encode(), SCOPE.hex().encode(),
                 holder_id("https://h1.example:4443/kvsp/").encode(), b"1")
    assert twin.namespace == namespace == track_namespace(d.compat_id, SCOPE, record.holder, 1)
    assert twin.holder == "moqt://h1.example:4443/" and twin.layer_digests == record.layer_digests
    assert ReplicaRecord.from_json(twin.to_json()) == twin  # the Index Service accepts it as is
    assert track_name(key(1)) == key(1).hex().encode()
    parsed = parse_track(namespace, track_name(key(1)))
    assert parsed is not None and (parsed.compat_id, parsed.scope_id, parsed.block_key, parsed.codec) == (
        bytes(d.compat_id), SCOPE, key(1), 1)
    assert parse_track(namespace, key(1)) is None  # raw octets are not a KVSP track name: hex is
    assert parse_track(namespace[:4], track_name(key(1))) is None
    assert parse_track((b"kvsp-1", *namespace[1:4], b"01"), track_name(key(1))) is None
    fetch = StandaloneFetch(namespace, b"", Location(0, 0), Location(0, 0))
    assert served_range(fetch, 32) == (0, 31)  # End Location object 0: the whole group
    assert served_range(dataclasses.replace(fetch, start=Location(0, 8), end=Location(0, 16)), 32) == (8, 15)
    assert served_range(dataclasses.replace(fetch, end=Location(5, 3)), 32) == (0, 31)


# -- fetching a holder's tracks ----------------------------------------------------------------------------------


@DRAFTS
async def test_fetch_of_group_0_delivers_32_verified_layers_in_order(net: Net, certs: TestPki, alpn: str) -> None:
    record = net.store(1)
    twin = net.twin(record)
    expected = net.layers(1)
    async with MoqtPool(certs.files("alice"), alpn=alpn) as pool:
        for descriptor in (net.d, None):  # K / V split by the descriptor, or in halves (codec raw)
            got = [layer async for layer in fetch_replica(pool, twin, descriptor=descriptor)]
            assert [layer.index for layer in got] == list(range(32))
            for layer in got:
                assert layer.digest == record.layer_digests[layer.index]  # type: ignore[index]
                assert bytes(layer.k) == bytes(expected[layer.index].k)
                assert bytes(layer.v) == bytes(expected[layer.index].v)
        conn = await pool.get(twin.holder)
        assert conn.alpn == alpn and conn.peer_identity == HOLDER_CERT_URI
        # A layer range: objects 8..15 of group 0.
        got = [layer async for layer in fetch_layers(conn, twin, (8, 15), descriptor=net.d)]
        assert [layer.index for layer in got] == list(range(8, 16))
        assert all(bytes(g.k) == bytes(expected[g.index].k) for g in got)
        assert conn.quic._kvsp_unread_total == 0
    tracks = _tracks(net)
    assert tracks.metrics["fetches"] == 3 and tracks.metrics["layers"] == 72


def _tracks(net: Net) -> HolderTracks:
    assert net.server.quic is not None
    factory: Any = net.server.quic.handlers["moqt-18"]
    return factory.__closure__[0].cell_contents  # type: ignore[no-any-return]


@DRAFTS
async def test_a_corrupted_object_is_detected_and_the_fetch_cancelled(net: Net, certs: TestPki, alpn: str) -> None:
    record = net.store(1)
    net.store(2)
    _tier, data = net.holder.storage.read(BlockId(bytes(net.d.compat_id), SCOPE, key(1)))
    header = c.parse_header(data)
    stored = data.obj  # the host tier's buffer behind its read-only view
    assert isinstance(stored, bytearray)
    stored[header.size + header.layer_offsets()[5] + 3] ^= 0x01  # the stored K section of layer 5 rots
    delivered = []
    async with MoqtPool(certs.files("alice"), alpn=alpn) as pool:
        with pytest.raises(LayerDigestMismatch, match="layer 5"):
            async for layer in fetch_replica(pool, net.twin(record), descriptor=net.d):
                delivered.append(layer.index)
        assert delivered == [0, 1, 2, 3, 4]  # the good layers arrived at once; nothing after the bad one
        conn = await pool.get(net.moqt_uri)
        assert conn.closed is None  # the session survives; the next block comes through
        other = net.holder.record(BlockId(bytes(net.d.compat_id), SCOPE, key(2)))
        assert len([x async for x in fetch_layers(conn, net.twin(other))]) == 32


@DRAFTS
async def test_refusals_carry_the_drafts_codes(net: Net, certs: TestPki, alpn: str) -> None:
    record = net.store(1)
    twin = net.twin(record)

    async def refused(name: str, rec: ReplicaRecord, layers: tuple[int, int] | None = None) -> int:
        async with MoqtPool(certs.files(name), alpn=alpn) as pool:
            with pytest.raises(MoqtRequestError) as info:
                async for _ in fetch_replica(pool, rec, layers):
                    pass
            return info.value.error_code

    draft = Draft.from_alpn(alpn)
    assert await refused("bob", twin) == unauthorized(draft)  # a reader, but not of this scope
    assert await refused("nouri", twin) == unauthorized(draft)  # no identity in the policy
    missing = dataclasses.replace(twin, block_key=key(9))
    assert await refused("alice", missing) == does_not_exist(draft)
    elsewhere = dataclasses.replace(twin, moqt_namespace=encode_moqt_namespace(kvsp_track_namespace(
        net.d.compat_id, SCOPE, holder_id("https://other.example/"), 1)))
    assert await refused("alice", elsewhere) == does_not_exist(draft)  # another publisher's track
    async with MoqtPool(certs.files("alice"), alpn=alpn) as pool:
        conn = await pool.get(twin.holder)
        assert twin.namespace is not None
        async with conn.fetch(twin.namespace, track_name(key(1)), Location(0, 40), Location(0, 41)) as fetch:
            with pytest.raises(MoqtRequestError) as info:
                await fetch.wait_accepted(2)
        assert info.value.error_code == invalid_range(draft)
    assert _tracks(net).metrics["unauthorized"] == 2


# -- publishing the MOQT twins ----------------------------------------------------------------------------------


async def test_the_publisher_publishes_moqt_twins(net: Net, certs: TestPki) -> None:
    index = IndexService(MemoryIndexStore(), clock=asyncio.get_running_loop().time)
    holder_uri = net.holder.base_uri
    index_policy = Policy.from_dict({"principal": [
        {"identity": HOLDER_CERT_URI, "roles": ["holder"], "scopes": "*", "publish_for": [holder_uri, net.moqt_uri]},
        {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
    ]})
    index_server = RoleServer(index_app(index, index_policy, base_path="/is/"), certs.files("index"))
    await index_server.start("127.0.0.1", 0)
    index_uri = index_server.base_uri("/is/")
    async with KvspClient(certs.files("holder")) as as_holder, KvspClient(certs.files("alice")) as alice:
        publisher = ReplicaPublisher(net.holder, as_holder, index_uri, moqt_uri=net.moqt_uri)
        publisher.start()
        try:
            record = net.store(1)
            fetcher = BlockFetcher(alice, index_uri, descriptors=[net.d])
            for _ in range(200):
                found = await fetcher.lookup(net.d.compat_id, SCOPE, [key(1)])
                if found.matched and len(found.blocks[0].replicas) == 2:
                    break
                await asyncio.sleep(0.02)
            replicas = {r.holder: r for r in found.blocks[0].replicas}
            assert set(replicas) == {holder_uri, net.moqt_uri}
            twin = replicas[net.moqt_uri]
            assert twin.namespace == track_namespace(net.d.compat_id, SCOPE, holder_uri, 1)
            assert twin.layer_digests == record.layer_digests and twin.digest == record.digest
            await publisher.stop(withdraw=True)
            assert (await fetcher.lookup(net.d.compat_id, SCOPE, [key(1)])).matched == 0  # both withdrawn
        finally:
            await publisher.stop()
            await index_server.close()


# -- BlockFetcher: MOQT first, HTTP when MOQT is not possible ------------------------------------------------------


class Misbehaving(MoqtApp):
    """Serves the holder's blocks over MOQT, badly: ``stall`` stops after two layers; ``flip`` corrupts layer 3."""

    def __init__(self, holder: Holder, mode: str) -> None:
        self.holder, self.mode = holder, mode

    async def fetch(self, conn: MoqtConnection, request: FetchRequested) -> None:
        track = parse_track(request.namespace, request.track_name)
        assert track is not None and isinstance(request.target, StandaloneFetch)
        principal = POLICY.principal(conn.peer_identity)
        assert principal is not None
        sections = self.holder.read(principal, track.compat_id, track.scope_id, track.block_key).sections
        first, last = served_range(request.target, len(sections) // 2)
        served = conn.accept_fetch(request.request_id, Location(0, last + 1))
        for layer in range(first, last + 1):
            if self.mode == "stall" and layer == first + 2:
                await asyncio.Event().wait()
            k, v = bytes(sections[2 * layer]), bytearray(sections[2 * layer + 1])
            if self.mode == "flip" and layer == 3:
                v[0] ^= 0x80
            await served.write_object(layer, (k, v))
        served.finish()


def fetcher_for(net: Net, client: KvspClient, pool: MoqtPool) -> BlockFetcher:
    return BlockFetcher(client, "https://127.0.0.1:9/is/", descriptors=[net.d], ranking=PreferMoqt(),
                        sources=[MoqtSource(pool, [net.d], accept_timeout=2, stall_timeout=0.3), HttpSource(client)],
                        withdraw_corrupt=False)


@DRAFTS
async def test_block_fetcher_prefers_moqt_and_falls_back_to_http(net: Net, certs: TestPki, alpn: str) -> None:
    record = net.store(1)
    whole = block(net.d, 1)
    label = f"MOQT/{alpn[-2:]}" if alpn == "moqt-18" else "MOQT/14"
    async with KvspClient(certs.files("alice")) as client, \
            MoqtPool(certs.files("alice"), alpn=alpn, connect_timeout=2) as pool:

        async def fetch(twin: ReplicaRecord, layers: tuple[int, int] | None = None) -> tuple[Any, BlockFetcher]:
            fetcher = fetcher_for(net, client, pool)
            match = LookupMatch(record.block_key, (record, twin))  # the Index Service's order: https first
            return await fetcher.fetch_block(match, layers), fetcher

        result, fetcher = await fetch(net.twin(record))  # MOQT works: it is used, and nothing else
        assert result is not None and result.transports == (label,) and result.tobytes() == whole
        assert fetcher.metrics.attempts == 1 and fetcher.metrics.bytes_by_transport.keys() == {label}
        result, fetcher = await fetch(net.twin(record), (4, 9))
        assert result is not None and [x.index for x in result.layers] == list(range(4, 10))
        assert result.tobytes() == c.cut(whole, 4, 9).tobytes()

        no_moqt = await net.serve(None)  # the holder's port offers h3 only: ALPN refused
        result, fetcher = await fetch(net.twin(record, no_moqt))
        assert result is not None and result.transports == ("HTTP/3",) and result.tobytes() == whole
        assert fetcher.metrics.transport_errors == 1

        elsewhere = dataclasses.replace(net.twin(record), moqt_namespace=encode_moqt_namespace(kvsp_track_namespace(
            net.d.compat_id, SCOPE, holder_id("https://other.example/"), 1)))
        result, fetcher = await fetch(elsewhere)  # FETCH_ERROR / REQUEST_ERROR DOES_NOT_EXIST
        assert result is not None and result.transports == ("HTTP/3",) and fetcher.metrics.replica_misses == 1

        stalling = await net.serve(Misbehaving(net.holder, "stall"))
        result, fetcher = await fetch(net.twin(record, stalling))  # two layers, then nothing past the deadline
        assert result is not None and result.transports == (label, "HTTP/3") and result.tobytes() == whole
        assert fetcher.metrics.transport_errors == 1 and fetcher.metrics.layers == 32

        flipping = await net.serve(Misbehaving(net.holder, "flip"))
        result, fetcher = await fetch(net.twin(record, flipping))  # layer 3 corrupt: layers 3.. over HTTP
        assert result is not None and result.transports == (label, "HTTP/3") and result.tobytes() == whole
        assert fetcher.metrics.digest_failures == 1


def test_layer_assembler_checks_structure() -> None:
    d = small_descriptor(layers=4)
    body = c.encode(random_sections(d, d.block_tokens, 0, 3, 1), first_layer=0, token_count=d.block_tokens,
                    descriptor=d)
    assert body.layer_digests is not None
    record = moqt_record(ReplicaRecord.from_json({
        "block_key": key(1).hex(), "compat_id": d.compat_id.hex(), "scope_id": SCOPE.hex(),
        "holder": "https://h.example/", "codec": 1, "size": len(body),
        "digest": "sha-256:" + hashlib.sha256(b"".join(body.layer_digests)).hexdigest(),
        "residency": [{"tier": "host", "layers": [0, 3]}], "ttl_ms": 1000,
        "layer_digests": [x.hex() for x in body.layer_digests]}), "moqt://h.example:1/")

    def piece(obj: int, data: bytes, offset: int = 0, length: int | None = None, group: int = 0) -> ObjectReceived:
        return ObjectReceived(None, 0, None, group, 0, obj, None, ObjectStatus.NORMAL, (), length or len(data),
                              offset, memoryview(data))

    payloads = [bytes(body.sections[2 * i]) + bytes(body.sections[2 * i + 1]) for i in range(4)]
    asm = LayerAssembler(record, 0, 3, descriptor=d)
    half = len(payloads[0]) // 2 + 3  # a piece boundary inside V
    assert asm.feed(piece(0, payloads[0][:half], 0, len(payloads[0]))) == []
    [layer] = asm.feed(piece(0, payloads[0][half:], half, len(payloads[0])))
    assert layer.index == 0 and bytes(layer.k) == bytes(body.sections[0]) and bytes(layer.v) == bytes(body.sections[1])
    assert len(layer.v_parts) == 2  # views of the two pieces, not a copy
    with pytest.raises(MalformedTrack):
        LayerAssembler(record, 0, 3, descriptor=d).feed(piece(1, payloads[1]))  # layer 0 skipped
    with pytest.raises(MalformedTrack):
        LayerAssembler(record, 0, 3, descriptor=d).feed(piece(0, payloads[0], group=1))
    with pytest.raises(MalformedTrack):
        LayerAssembler(record, 0, 3, descriptor=d).feed(piece(0, payloads[0][:-2]))  # not the block's length
    with pytest.raises(LayerDigestMismatch):
        LayerAssembler(record, 0, 3).feed(piece(0, payloads[1]))
    asm = LayerAssembler(record, 2, 3)
    asm.feed(piece(2, payloads[2]))
    with pytest.raises(c.Truncated):
        asm.finish()


# -- the real processes: `kvsp-quic holder --dev` serves and publishes MOQT next to HTTP ------------------------


async def test_dev_holder_serves_moqt_and_publishes_twins(tmp_path: Path) -> None:
    from kvsp_quic.keys import BlockKeyer
    from kvsp_quic.samples import example_descriptor

    d = example_descriptor()
    keyer = BlockKeyer(bytes(range(32)), d.compat_id, d.block_tokens)
    dev = tmp_path / "dev"
    procs = [Process("index", "--dev", str(dev))]
    try:
        procs.append(Process("holder", "--dev", str(dev), "--index", procs[0].ready["base_uri"]))
        index_uri, ready = procs[0].ready["base_uri"], procs[1].ready
        assert ready["moqt"] == moqt_uri_for(ready["base_uri"])
        files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
        key_ = keyer.keys(list(range(d.block_tokens)))[0]
        body = c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, 7), first_layer=0,
                        token_count=d.block_tokens, descriptor=d).tobytes()
        async with KvspClient(files) as client, MoqtPool(files) as pool:
            url = f"{ready['base_uri']}blocks/{d.compat_id.hex()}/{keyer.scope_id.hex()}/{key_.hex()}"
            stored = await client.request("PUT", url, content=body,
                                          headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            assert stored.status == 201
            fetcher = BlockFetcher(client, index_uri, descriptors=[d], ranking=PreferMoqt(),
                                   sources=[MoqtSource(pool, [d]), HttpSource(client)])
            for _ in range(200):
                found = await fetcher.lookup(d.compat_id, keyer.scope_id, [key_])
                if found.matched and len(found.blocks[0].replicas) == 2:
                    break
                await asyncio.sleep(0.05)
            assert {r.holder for r in found.blocks[0].replicas} == {ready["base_uri"], ready["moqt"]}
            result = await fetcher.fetch_block(found.blocks[0])
            assert result is not None and result.transports[0].startswith("MOQT/") and result.tobytes() == body
    finally:
        for proc in reversed(procs):
            assert "Traceback" not in proc.stop()
