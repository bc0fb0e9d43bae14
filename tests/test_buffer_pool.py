"""The host tier's pool of pre-touched replica buffers (kvsp_quic/storage/buffer_pool.py): a buffer is reused only
once no view of it is left, only by an upload of its exact size, and the pool stays within the tier's room."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_http.holder_app import holder_app
from kvsp_quic import container as c
from kvsp_quic.auth import ALL, Policy, Principal, Role
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.samples import random_sections
from kvsp_quic.storage.buffer_pool import BufferPool, PoolBuffer, exported
from kvsp_quic.storage.tiers import BlockId, BlockMeta, HostTier, LruPolicy
from tests.pki import TestPki, make_pki
from tests.support.descriptors import small_descriptor

HOLDER_URI = "https://127.0.0.1/kvsp/"
SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
ALICE = Principal("urn:kvsp:client:alice", frozenset({Role.INSTANCE}), ALL)


def key(n: int) -> bytes:
    return hashlib.sha256(b"key%d" % n).digest()


def body(d: CompatDescriptor, n: int) -> bytes:
    return c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, n), first_layer=0,
                    token_count=d.block_tokens, descriptor=d).tobytes()


def stored_buffer(h: Holder, d: CompatDescriptor, n: int) -> Any:
    """The object whose memory the block's replica is (what a GET's views are views of)."""
    return h.fetch(ALICE, d.compat_id, SCOPE, key(n)).container.sections[0].obj


# -- the probe and the free lists ---------------------------------------------------------------------------------


def test_exported_sees_every_view_and_changes_nothing() -> None:
    buf = bytearray(b"abcdefgh")
    assert not exported(buf)
    whole = memoryview(buf).toreadonly()
    part = whole[2:4]  # a slice of a read-only view: what a GET hands out
    del whole
    assert exported(buf) and buf == b"abcdefgh"
    del part
    assert not exported(buf) and buf == b"abcdefgh" and len(buf) == 8
    view = memoryview(buf)
    view.release()
    assert not exported(buf)


def test_pool_reuses_only_its_own_buffers_of_the_exact_size() -> None:
    pool = BufferPool()
    a = pool.take(100, room=1000)
    assert isinstance(a, PoolBuffer) and len(a) == 100 and pool.allocated == 1
    assert not pool.give(bytearray(100), room=1000)  # a caller's own bytearray: it may still read it
    assert pool.give(a, room=1000) and pool.octets == 100
    b = pool.take(200, room=1000)  # another size: a new buffer
    assert b is not a and len(b) == 200 and pool.octets == 100
    assert pool.take(100, room=1000) is a and pool.reused == 1 and pool.octets == 0


def test_pool_stays_within_the_tiers_room() -> None:
    pool = BufferPool()
    bufs = [pool.take(100, room=1000) for _ in range(3)]
    assert pool.give(bufs[0], room=250) and pool.give(bufs[1], room=250)
    assert pool.give(bufs[2], room=250) and pool.octets == 200 and pool.released == 1  # the oldest made room
    assert not pool.give(PoolBuffer(300), room=250) and pool.octets == 200  # larger than the room
    other = pool.take(50, room=200)  # 50 new octets leave 150 of the room: one 100-octet buffer goes
    assert len(other) == 50 and pool.octets == 100 and len(pool) == 1
    assert pool.give(other, room=100)  # the newest size is kept, the older buffer goes
    assert pool.octets == 50 and all(pool.take(100, room=1000) is not b for b in bufs)
    pool.clear()
    assert pool.octets == 0 and len(pool) == 0


def test_a_buffer_with_a_live_view_waits_in_the_host_tier_and_is_reused_once_released() -> None:
    d = small_descriptor()
    octets = body(d, 1)
    size = len(octets)
    tier = HostTier(4 * size, LruPolicy())
    header, layers = c.decode(octets, d)
    block = BlockId(d.compat_id, SCOPE, key(1))
    buf = tier.take_buffer(size)
    buf[:] = octets
    tier.store(BlockMeta(block, header, tuple(bytes(layer.digest or b"") for layer in layers), size), buf)
    first = buf.obj
    del buf
    held = c.cut(tier.read(block), 0, d.layers - 1)  # a response's views
    tier.discard(block)
    assert tier.used == 0 and len(tier.pool) == 1  # given back, still exported
    other = tier.take_buffer(size)
    assert other.obj is not first and tier.pool.allocated == 2 and len(tier.pool) == 1  # not reused; still kept
    other[:] = bytes(size)
    assert held.header_bytes + b"".join(held.sections) == octets
    del held
    again = tier.take_buffer(size)
    assert again.obj is first and tier.pool.reused == 1  # the views are gone: reused, no fill


# -- the holder ----------------------------------------------------------------------------------------------------


def holder(d: CompatDescriptor, blocks: int) -> Holder:
    return Holder(HolderSettings(HOLDER_URI, (d,), host_capacity=blocks * len(body(d, 1)), replica_ttl_ms=60_000,
                                 eviction="lru"))


def put(h: Holder, d: CompatDescriptor, n: int) -> None:
    h.store(ALICE, d.compat_id, SCOPE, key(n), body(d, n), "*")


def test_a_view_held_across_an_eviction_and_new_puts_stays_intact() -> None:
    d = small_descriptor()
    h = holder(d, 2)
    put(h, d, 1)
    fetched = h.fetch(ALICE, d.compat_id, SCOPE, key(1))  # a GET response still sending
    first = fetched.container.sections[0].obj
    put(h, d, 2)
    put(h, d, 3)  # evicts 1: its buffer goes back to the pool with the response's views alive
    assert sorted(b.block_key for b in h.blocks()) == sorted([key(2), key(3)])
    for n in (4, 5, 6):  # new PUTs of the same size arrive while the views are held
        put(h, d, n)
        assert stored_buffer(h, d, n) is not first
    tier = h.storage.tiers[0]
    assert isinstance(tier, HostTier) and tier.pool.reused >= 2  # the buffers nobody views are reused
    assert fetched.container.header_bytes + b"".join(fetched.container.sections) == body(d, 1)
    for n in (5, 6):
        assert bytes(h.fetch(ALICE, d.compat_id, SCOPE, key(n)).container.tobytes()) == body(d, n)


def test_a_reused_buffer_holds_exactly_the_new_block() -> None:
    d = small_descriptor()
    h = holder(d, 1)
    for n in range(1, 6):
        put(h, d, n)
        fetched = h.fetch(ALICE, d.compat_id, SCOPE, key(n))
        assert bytes(fetched.container.tobytes()) == body(d, n)
        c.decode(fetched.container.tobytes(), d)  # parses, every layer as recorded
        del fetched
    tier = h.storage.tiers[0]
    assert isinstance(tier, HostTier) and tier.pool.reused >= 3 and tier.pool.octets <= tier.free + len(body(d, 1))


# -- over real sockets ----------------------------------------------------------------------------------------------


# Its own PKI, one per test: a holder only, at HOLDER_URI (no fixture of tests/conftest.py has exactly these roles).
@pytest.fixture
def certs(tmp_path: Path) -> TestPki:
    return make_pki(tmp_path / "pki", roles={"holder": HOLDER_URI})


@pytest.fixture
async def served(certs: TestPki) -> AsyncIterator[tuple[RoleServer, Holder, CompatDescriptor]]:
    d = small_descriptor(layers=32)
    h = holder(d, 2)
    policy = Policy.from_dict({"principal": [
        {"identity": ALICE.identity, "roles": ["instance"], "scopes": [SCOPE.hex()]},
        {"identity": HOLDER_URI, "roles": ["holder"], "scopes": "*"},
    ]})
    server = RoleServer(holder_app(h, policy), certs.files("holder"))
    await server.start("127.0.0.1", 0)
    try:
        yield server, h, d
    finally:
        await server.close()


@pytest.mark.parametrize("h3", [False, True])
async def test_puts_that_evict_serve_their_own_octets_over_the_network(
        served: tuple[RoleServer, Holder, CompatDescriptor], certs: TestPki, h3: bool) -> None:
    server, h, d = served
    async with KvspClient(certs.files("alice"), h3=h3) as client:
        for n in range(1, 9):
            url = server.base_uri("/kvsp/") + f"blocks/{d.compat_id.hex()}/{SCOPE.hex()}/{key(n).hex()}"
            put_ = await client.request("PUT", url, content=body(d, n),
                                        headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
            assert put_.status == 201, put_.content
            got = await client.request("GET", url)
            assert got.status == 200 and got.content == body(d, n)
    tier = h.storage.tiers[0]
    assert isinstance(tier, HostTier) and len(h.blocks()) == 2 and tier.pool.reused >= 1
