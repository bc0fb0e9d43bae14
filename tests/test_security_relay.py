"""Relay poisoning (issue 13, docs/security.md): a ``moqt://`` Replica Record is authorized at the Index Service by
the publisher its ``moqt_namespace`` names (spec, "Records"), and the relay caches and advertises a block only
once its layers match a record from the Index Service. Real servers on 127.0.0.1: an Index Service, a relay, a
holder's MOQT session."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_http.index_app import index_app
from kvsp_moqt.index_link import IndexLink
from kvsp_moqt.tracks import moqt_record, track_namespace
from kvsp_quic.auth import Policy
from kvsp_quic.keys import holder_id
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.index import IndexService
from kvsp_quic.storage.memory_index import MemoryIndexStore
from moqt.aio import MoqtPool, MoqtRequestError
from moqt.relay import RelayConfig
from tests.pki import TestPki, make_pki
from tests.support.descriptors import small_descriptor
from tests.support.moqt_relay import (
    ALICE,
    HOLDER_POLICY,
    HOLDER_URI,
    INDEX_URI,
    RELAY_URI,
    SCOPE,
    WRITER,
    block,
    key,
    layers,
    world,
)

MALLORY_URI = "https://127.0.0.1/mallory/"  # a holder of the same CA and scope, trusted for its own blocks only
MALLORY_MOQT = "moqt://127.0.0.1:9/"
RELAY_MOQT = "moqt://127.0.0.1:7/"
JSON = {"content-type": "application/kvsp+json"}


# Its own PKI: relay_certs' roles and mallory, a holder of the same CA trusted for its own blocks only.
@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"), roles={"holder": HOLDER_URI, "relay": RELAY_URI,
                                                           "index": INDEX_URI, "mallory": MALLORY_URI})


def index_policy(relay_publish_for: list[str] | str) -> Policy:
    return Policy.from_dict({"principal": [
        {"identity": HOLDER_URI, "roles": ["holder"], "scopes": "*"},
        {"identity": MALLORY_URI, "roles": ["holder"], "scopes": "*", "publish_for": [MALLORY_MOQT]},
        {"identity": RELAY_URI, "roles": ["holder"], "scopes": "*", "publish_for": relay_publish_for},
        {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
    ]})


async def put(client: KvspClient, index_uri: str, record: ReplicaRecord) -> int:
    url = f"{index_uri}replicas/{holder_id(record.holder)}/{record.block_key.hex()}"
    r = await client.request("PUT", url, content=json.dumps(record.to_json()).encode(), headers=JSON)
    return r.status


async def lookup(client: KvspClient, index_uri: str, d: Any, n: int) -> list[dict[str, Any]]:
    body = {"scope_id": SCOPE.hex(), "compat_id": d.compat_id.hex(), "block_keys": [key(n).hex()]}
    answer = (await client.request("POST", f"{index_uri}lookup", content=json.dumps(body).encode(),
                                   headers=JSON)).json()
    return [r for b in answer["blocks"] for r in b["replicas"]]


async def test_the_index_authorizes_moqt_records_by_the_namespaces_publisher(certs: TestPki) -> None:
    index = IndexService(MemoryIndexStore(), clock=asyncio.get_running_loop().time)
    server = RoleServer(index_app(index, index_policy([RELAY_MOQT]), base_path="/is/"), certs.files("index"))
    await server.start("127.0.0.1", 0)
    index_uri = server.base_uri("/is/")
    d = small_descriptor(layers=4)
    honest = Holder(HolderSettings(HOLDER_URI, (d,)))
    record = honest.store(WRITER, d.compat_id, SCOPE, key(1), block(d, 1), "*")
    forged_octets = Holder(HolderSettings(HOLDER_URI, (d,))).store(WRITER, d.compat_id, SCOPE, key(1), block(d, 2),
                                                                   "*")
    forged_octets = dataclasses.replace(forged_octets, block_key=record.block_key)
    try:
        async with KvspClient(certs.files("mallory")) as mallory, KvspClient(certs.files("relay")) as relay, \
                KvspClient(certs.files("holder")) as holder, KvspClient(certs.files("alice")) as alice:
            # Mallory may publish for its own MOQT address, but not in the honest holder's namespace: its record
            # would send consumers (and relays) to Mallory's octets under the honest holder's name.
            poisoned = moqt_record(forged_octets, MALLORY_MOQT)
            assert poisoned.publisher_id == holder_id(HOLDER_URI)
            assert await put(mallory, index_uri, poisoned) == 403
            own = moqt_record(dataclasses.replace(forged_octets, holder=MALLORY_URI), MALLORY_MOQT)  # its namespace
            assert await put(mallory, index_uri, own) == 201
            # A relay (which may publish for its own address only) advertises a copy: accepted only when the
            # publisher's own record of the block carries the same digests.
            copy = moqt_record(record, RELAY_MOQT)
            assert await put(relay, index_uri, copy) == 403  # the publisher has published nothing yet
            assert await put(holder, index_uri, record) == 201
            assert await put(relay, index_uri, moqt_record(forged_octets, RELAY_MOQT)) == 403  # other octets
            assert await put(relay, index_uri, copy) == 201
            holders = sorted(r["holder"] for r in await lookup(alice, index_uri, d, 1))
            assert holders == sorted([HOLDER_URI, RELAY_MOQT, MALLORY_MOQT])
            mine = [r for r in await lookup(alice, index_uri, d, 1) if r["holder"] == MALLORY_MOQT]
            assert ReplicaRecord.from_json(mine[0]).publisher_id == holder_id(MALLORY_URI)
    finally:
        await server.close()


async def settle(w: Any, link: IndexLink) -> None:
    """Until the relay's upstream fetches have been admitted (or not) and its records published."""
    async with asyncio.timeout(10):
        while w.relay.fetches.inflight:
            await asyncio.sleep(0.01)
    await link.drain()


async def test_the_relay_caches_and_advertises_only_verified_blocks(certs: TestPki) -> None:
    index = IndexService(MemoryIndexStore(), clock=asyncio.get_running_loop().time)
    server = RoleServer(index_app(index, index_policy("*"), base_path="/is/"), certs.files("index"))
    await server.start("127.0.0.1", 0)
    index_uri = server.base_uri("/is/")
    try:
        async with KvspClient(certs.files("relay")) as as_relay, KvspClient(certs.files("holder")) as as_holder, \
                KvspClient(certs.files("alice")) as alice, MoqtPool(certs.files("relay")) as pool:
            link = IndexLink(as_relay, index_uri, pool, moqt_uri="moqt://127.0.0.1:1/", ttl_ms=30_000)
            async with world(certs, RelayConfig(), link=link) as w:
                link.moqt_uri = w.uri
                link.holder_id = holder_id(w.uri)
                await w.publisher("moqt-18")  # the holder's own session publishes its namespace to the relay
                sub = await w.connect("alice", "moqt-18")
                m = w.relay.metrics
                # 1. a block the Index Service has no record of: forwarded, never cached, never advertised
                twin = w.twin(w.store(1))
                for _ in range(2):
                    assert await layers(sub, twin, w.d) == list(range(32))
                    await settle(w, link)
                assert (m["upstream_fetches"], m["cache_hits"], len(w.relay.cache)) == (2, 0, 0)
                assert link.unverified == 2 and await lookup(alice, index_uri, w.d, 1) == []
                # 2. the record at the Index Service describes other octets than the session serves
                served = w.store(2)
                other = Holder(HolderSettings(HOLDER_URI, (w.d,))).store(WRITER, w.d.compat_id, SCOPE, key(2),
                                                                         block(w.d, 3), "*")
                assert await put(as_holder, index_uri, other) == 201
                assert await layers(sub, w.twin(served), w.d) == list(range(32))
                await settle(w, link)
                assert (len(w.relay.cache), link.failures) == (0, 1)
                assert [r["holder"] for r in await lookup(alice, index_uri, w.d, 2)] == [HOLDER_URI]
                # 3. the publisher's record matches: cached, then served from the cache, and advertised
                record = w.store(4)
                assert await put(as_holder, index_uri, record) == 201
                assert await layers(sub, w.twin(record), w.d) == list(range(32))
                await settle(w, link)
                assert await layers(sub, w.twin(record), w.d) == list(range(32))
                assert (len(w.relay.cache), m["cache_hits"]) == (1, 1)
                assert sorted(r["holder"] for r in await lookup(alice, index_uri, w.d, 4)) == \
                    sorted([HOLDER_URI, w.uri])
                await link.aclose()
    finally:
        await server.close()


async def test_a_holder_cannot_publish_another_holders_namespace_to_the_relay(certs: TestPki) -> None:
    async with world(certs) as w:
        conn = await w.connect("holder", "moqt-18")
        await conn.publish_namespace(w.namespace)  # its own: accepted
        stranger = track_namespace(w.d.compat_id, SCOPE, MALLORY_URI, 1)
        with pytest.raises(MoqtRequestError):
            await conn.publish_namespace(stranger)
    assert HOLDER_POLICY.principal(RELAY_URI) is not None
