"""Index records and principals: the scopes, compatibility IDs and holders of the Index Service tests, their
policy, Replica Records by number, and :class:`Env` (an Index Service over a store, on a manual clock)."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any

from kvsp_quic import keys as k
from kvsp_quic.auth import Policy, Principal
from kvsp_quic.fields import BlockKey
from kvsp_quic.records import (
    LookupRequest,
    ReplicaRecord,
    ResidencyEntry,
    encode_moqt_namespace,
    kvsp_track_namespace,
)
from kvsp_quic.roles.index import Geometry, IndexConfig, IndexService
from kvsp_quic.storage.index_store import IndexStore
from tests.helpers import Clock

S1, S2 = bytes([1]) * 16, bytes([2]) * 16
C1, C2 = bytes([0xC1]) * 32, bytes([0xC2]) * 32
H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example/kvsp/"
H3 = "https://h3.example/kvsp/"
II7 = "https://ii7.example/kvsp/"
II9 = "https://ii9.example/kvsp/"
PC = "https://pc.example/kvsp/"
RELAY = "moqt://relay.example:4443/"
MAX_TTL = 600_000

POLICY = Policy.from_dict({"principal": [
    {"identity": H1, "roles": ["holder"], "scopes": [S1.hex()]},
    {"identity": H2, "roles": ["holder"], "scopes": [S1.hex(), S2.hex()], "publish_for": [H1, RELAY]},
    {"identity": H3, "roles": ["holder"], "scopes": [S2.hex()]},
    {"identity": II7, "roles": ["instance", "holder"], "scopes": [S1.hex()]},
    {"identity": II9, "roles": ["instance"], "scopes": [S1.hex()]},
    {"identity": PC, "roles": ["controller"], "scopes": "*"},
    {"identity": "urn:kvsp:client:bob", "roles": ["client"], "scopes": [S2.hex()]},
]})


def who(identity: str) -> Principal:
    principal = POLICY.principal(identity)
    assert principal is not None
    return principal


def bk(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"block %d" % i).digest())


def replica(i: int, holder: str = H1, *, scope: bytes = S1, compat: bytes = C1, ttl_ms: int = 60_000,
            layers: int = 4, digests: bool = True, **changes: Any) -> ReplicaRecord:
    layer_digests = tuple(hashlib.sha256(bk(i) + bytes([n])).digest() for n in range(layers)) if digests else None
    digest = hashlib.sha256(b"".join(layer_digests)).digest() if layer_digests else hashlib.sha256(bk(i)).digest()
    half = layers // 2
    fields: dict[str, Any] = dict(
        block_key=bk(i), compat_id=compat, scope_id=scope, holder=holder, codec=1, size=1000 * layers,
        digest=digest, residency=(ResidencyEntry("device", (0, half - 1)),
                                  ResidencyEntry("host", (half, layers - 1), 400_000)),
        ttl_ms=ttl_ms, layer_digests=layer_digests)
    fields.update(changes)
    return ReplicaRecord(**fields)


def hid(uri: str) -> str:
    return k.holder_id(uri)


@dataclass
class Env:
    service: IndexService
    store: IndexStore
    clock: Clock
    realtime: bool  # the store expires on real time (Redis)

    async def advance(self, ms: float) -> None:
        self.clock.now += ms / 1000.0
        if self.realtime:
            await asyncio.sleep(ms / 1000.0)

    async def publish(self, record: ReplicaRecord, principal: str | None = None) -> bool:
        result = await self.service.publish(who(principal or record.holder), hid(record.holder), record.block_key,
                                            record)
        return result.created

    async def lookup(self, n: int, *, scope: bytes = S1, compat: bytes = C1, principal: str = PC,
                     targets: tuple[str, ...] | None = None) -> list[list[ReplicaRecord]]:
        response = await self.service.lookup(who(principal), LookupRequest(scope, compat,  # type: ignore[arg-type]
                                                                           tuple(bk(i) for i in range(n)), targets))
        assert response.matched == len(response.blocks)
        return [list(m.replicas) for m in response.blocks]


def make_config(**changes: Any) -> IndexConfig:
    base: dict[str, Any] = dict(max_ttl_ms=MAX_TTL, max_lookup_keys=64, max_lookup_targets=4,
                                geometry={C1: Geometry(block_tokens=16, layers=4)})
    base.update(changes)
    return IndexConfig(**base)


SHAPES = [
    replica(0),
    replica(1, digests=False),
    replica(2, layers=32),
    replica(3, codec=0xFF01, size=0, residency=(ResidencyEntry("remote-storage", (0, 0)),), layer_digests=None),
    replica(4, holder=RELAY, moqt_namespace=encode_moqt_namespace(kvsp_track_namespace(C1, S1, hid(H2), 1))),
    replica(5, residency=(ResidencyEntry("local-storage", (2, 3), 1), ResidencyEntry("remote-memory", (0, 1))),
            size=2**40),
]
