"""Failover of the retrieval client (kvsp_client/retrieval.py) in memory (issue 25 point 2): the real fetcher and the
real holder role (kvsp_quic.roles.holder.Holder stores the blocks and makes their Replica Records), with a block
source that serves those holders without a network and fails as told -- a holder that dies mid-body, one that
nothing listens at, one that serves a flipped bit. The real-process versions of these cases are
tests/test_dead_sources.py, tests/test_retrieval.py and tests/test_relay_copy_lease.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from http3.client import KvspClient, TransportError
from kvsp_client.api import Lease
from kvsp_client.retrieval import BlockFetcher, SourceBody
from kvsp_quic import container as c
from kvsp_quic.auth import Policy, Principal
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.records import LookupMatch, ReplicaRecord
from kvsp_quic.retrieval_plan import AttemptError, Failure, LayerRange
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.samples import example_descriptor, random_sections
from tests.pki import make_pki

SCOPE = bytes(range(16))
KEY = bytes(range(32))
ALICE = "urn:kvsp:client:alice"


@dataclass
class MemorySource:
    """A :class:`~kvsp_client.retrieval.BlockSource` over in-memory holders: ``cut_after[holder] = n`` ends the body
    after *n* layers with a transport error, ``unreachable`` holders fail as if nothing listened at their port,
    ``flip`` holders serve their container with one bit changed. ``opened`` records each request."""

    holders: dict[str, Holder]
    principal: Principal
    cut_after: dict[str, int] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    flip: set[str] = field(default_factory=set)
    opened: list[tuple[str, LayerRange | None]] = field(default_factory=list)
    kind: str = "memory"

    def handles(self, record: ReplicaRecord) -> bool:
        return record.holder in self.holders

    def note_lookup(self, blocks: Sequence[LookupMatch]) -> None:
        pass

    async def lease(self, record: ReplicaRecord, ttl_ms: int) -> Lease | None:
        return None

    async def release(self, lease: Lease) -> bool:
        return True

    async def open(self, record: ReplicaRecord, layers: LayerRange | None, codec: int | None) -> SourceBody:
        self.opened.append((record.holder, layers))
        if record.holder in self.unreachable:
            raise AttemptError(Failure.TRANSPORT, f"{record.holder}: nothing listens there", unreachable=True)
        fetched = self.holders[record.holder].fetch(self.principal, record.compat_id, record.scope_id,
                                                    record.block_key, layers=layers)
        body = bytearray(fetched.container.tobytes())
        stated = hashlib.sha256(body).digest()  # what the holder's Repr-Digest says: of what it meant to send
        if record.holder in self.flip:
            body[-1] ^= 0x01
        header = fetched.container.header
        cut = self.cut_after.get(record.holder)
        end = len(body) if cut is None else header.size + sum(k + v for k, v in header.lengths[:cut])

        async def chunks() -> AsyncIterator[bytes | memoryview]:
            view = memoryview(bytes(body[:end]))
            for start in range(0, len(view), 4096):
                yield view[start:start + 4096]
            if end < len(body):
                raise TransportError(f"{record.holder}: connection lost mid-body")

        async def close() -> None:
            pass

        return SourceBody(chunks(), stated, "memory", close)


@dataclass
class World:
    d: CompatDescriptor
    source: MemorySource
    records: dict[str, ReplicaRecord]
    fetcher: BlockFetcher

    def match(self, *holders: str) -> LookupMatch:
        return LookupMatch(self.records[holders[0]].block_key, tuple(self.records[h] for h in holders))


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    d = example_descriptor()
    policy = Policy.from_dict({"principal": [{"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]}]})
    alice = policy.principal(ALICE)
    assert alice is not None
    block = c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, seed=5), first_layer=0,
                     token_count=d.block_tokens, descriptor=d).tobytes()
    holders: dict[str, Holder] = {}
    records: dict[str, ReplicaRecord] = {}
    # h1 and h1b share an endpoint (two base URIs of one server: one port); h2 is elsewhere
    for uri in ("https://h1.test:8443/", "https://h1.test:8443/b/", "https://h2.test:8443/"):
        holders[uri] = Holder(HolderSettings(uri, (d,)))
        records[uri] = holders[uri].store(alice, d.compat_id, SCOPE, KEY, block, "*")
    source = MemorySource(holders, alice)
    files = make_pki(tmp_path).files("alice")
    async with KvspClient(files) as client:  # no request leaves: the index is never asked (no lookup, no reports)
        fetcher = BlockFetcher(client, "https://index.test/", descriptors=[d], sources=[source],
                               withdraw_corrupt=False, report_failures=False)
        yield World(d, source, records, fetcher)


async def test_a_holder_dying_mid_body_hands_over_at_the_next_layer(world: World) -> None:
    h1, h2 = "https://h1.test:8443/", "https://h2.test:8443/"
    world.source.cut_after[h1] = 5
    async with world.fetcher.fetch_layers(world.match(h1, h2)) as stream:
        indices = [layer.index async for layer in stream]
    assert indices == list(range(world.d.layers))  # each layer once, in order
    assert stream.complete and stream.records == [world.records[h1], world.records[h2]]
    assert world.source.opened == [(h1, None), (h2, (5, world.d.layers - 1))]  # the rest only
    assert world.fetcher.metrics.transport_errors == 1 and world.fetcher.failures.recent(h1)


async def test_an_unreachable_holder_is_skipped_at_its_endpoint(world: World) -> None:
    h1, h1b, h2 = "https://h1.test:8443/", "https://h1.test:8443/b/", "https://h2.test:8443/"
    world.source.unreachable.add(h1)
    result = await world.fetcher.fetch_block(world.match(h1, h1b, h2))
    assert result is not None and result.records == (world.records[h2],)
    assert [holder for holder, _ in world.source.opened] == [h1, h2]  # h1b shares h1's port: not asked
    metrics = world.fetcher.metrics
    assert (metrics.unreachable, metrics.transport_errors, metrics.skipped_recent_failures) == (1, 1, 1)


async def test_a_holder_that_merely_failed_leaves_its_neighbours_alone(world: World) -> None:
    h1, h1b, h2 = "https://h1.test:8443/", "https://h1.test:8443/b/", "https://h2.test:8443/"
    world.source.cut_after[h1] = 0  # a reset before any layer: a transport failure, not "nothing listens"
    result = await world.fetcher.fetch_block(world.match(h1, h1b, h2))
    assert result is not None and result.records == (world.records[h1b],)
    assert [holder for holder, _ in world.source.opened] == [h1, h1b]
    assert world.fetcher.metrics.unreachable == 0


async def test_a_flipped_bit_fails_the_replica_and_the_next_one_serves(world: World) -> None:
    h1, h2 = "https://h1.test:8443/", "https://h2.test:8443/"
    world.source.flip.add(h1)
    result = await world.fetcher.fetch_block(world.match(h1, h2))
    # every layer but the last verified on its own at h1; the last failed its digest and came from h2
    last = world.d.layers - 1
    assert result is not None and result.records == (world.records[h1], world.records[h2])
    assert world.source.opened == [(h1, None), (h2, (last, last))]
    assert result.tobytes() == world.source.holders[h2].fetch(
        world.source.principal, world.d.compat_id, SCOPE, KEY).container.tobytes()
    assert world.fetcher.metrics.digest_failures == 1


async def test_no_replica_left_is_a_miss_not_an_error(world: World) -> None:
    h1, h2 = "https://h1.test:8443/", "https://h2.test:8443/"
    world.source.cut_after.update({h1: 2, h2: 2})
    async with world.fetcher.fetch_layers(world.match(h1, h2)) as stream:
        indices = [layer.index async for layer in stream]
    # h2 is asked for layers 2.. and dies after two more: what arrived is kept, the rest is missing (recomputed)
    assert indices == [0, 1, 2, 3] and not stream.complete and stream.next_layer == 4
    assert world.fetcher.metrics.misses == 1
