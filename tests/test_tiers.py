"""Storage tiers: capacity, eviction policies, demotion, encryption at rest, checked reads, restart, atomic writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.storage import tiers as t
from kvsp_quic.storage.tiers import BlockMeta, HostTier, LocalStorageConfig, LocalStorageTier, TieredStore
from tests.support.descriptors import small_descriptor
from tests.support.tiers import block, never

KEY = bytes(range(32))


@pytest.fixture
def d() -> CompatDescriptor:
    return small_descriptor()


def local(tmp_path: Path, capacity: int, **kw: object) -> LocalStorageTier:
    config = LocalStorageConfig(tmp_path / "blocks", capacity, **kw)  # type: ignore[arg-type]
    return LocalStorageTier(config)


def fill(store: TieredStore, d: CompatDescriptor, numbers: range) -> dict[int, BlockMeta]:
    out = {}
    for n in numbers:
        meta, data = block(d, n)
        store.put(meta, data, never)
        out[n] = meta
    return out


def test_host_tier_keeps_the_buffer_and_honours_capacity(d: CompatDescriptor) -> None:
    meta, data = block(d, 1)
    host = HostTier(3 * meta.size)
    store = TieredStore([host])
    store.put(meta, data, never)
    tier, view = store.read(meta.id)
    assert tier is host and view.obj is data.obj and view.readonly  # the same buffer, not a copy
    fill(store, d, range(2, 4))
    assert host.used == 3 * meta.size and len(host) == 3
    outcome = store.put(*block(d, 4), never)
    assert [m.id.block_key[-1] for m in outcome.evicted] == [1] and host.used == 3 * meta.size
    assert meta.id not in store


@pytest.mark.parametrize(("policy", "victim"), [("lru", 2), ("fifo", 1), ("lfu", 2)])
def test_eviction_policies_pick_the_victim(d: CompatDescriptor, policy: str, victim: int) -> None:
    size = block(d, 1)[0].size
    store = TieredStore([HostTier(3 * size, t.eviction_policy(policy))])
    metas = fill(store, d, range(1, 4))
    store.read(metas[1].id)  # block 1 is read: LRU and LFU keep it, FIFO does not care
    store.read(metas[3].id)
    outcome = store.put(*block(d, 4), never)
    assert [m.id for m in outcome.evicted] == [metas[victim].id]


def test_policy_registry() -> None:
    with pytest.raises(ValueError, match=r"unknown eviction policy 'mru'.*fifo, lfu, lru"):
        t.eviction_policy("mru")
    with pytest.raises(ValueError):
        t.register_eviction_policy("Bad Name", t.LruPolicy)

    class Newest(t.LruPolicy):
        def victims(self):  # type: ignore[no-untyped-def]
            return reversed(list(super().victims()))

    t.register_eviction_policy("newest-first", Newest)
    try:
        assert isinstance(t.eviction_policy("newest-first"), Newest)
    finally:
        del t.EVICTION_POLICIES["newest-first"]


def test_protected_blocks_are_never_evicted(d: CompatDescriptor) -> None:
    size = block(d, 1)[0].size
    host = HostTier(2 * size)
    store = TieredStore([host])
    metas = fill(store, d, range(1, 3))
    leased = {metas[1].id}
    outcome = store.put(*block(d, 3), lambda b: b in leased)
    assert [m.id for m in outcome.evicted] == [metas[2].id] and metas[1].id in store
    leased.add(block(d, 3)[0].id)
    with pytest.raises(t.NoRoom, match="leased"):
        store.put(*block(d, 4), lambda b: b in leased)
    assert set(host.blocks()) == leased and host.used == 2 * size  # nothing changed


def test_a_block_larger_than_every_tier_is_refused(d: CompatDescriptor, tmp_path: Path) -> None:
    meta, data = block(d, 1)
    store = TieredStore([HostTier(meta.size - 1), local(tmp_path, meta.size, fsync=False)])
    with pytest.raises(t.NoRoom, match="larger than every tier"):
        store.put(meta, data, never)


def test_full_host_demotes_to_local_storage(d: CompatDescriptor, tmp_path: Path) -> None:
    meta1, data1 = block(d, 1)
    host = HostTier(2 * meta1.size)
    disk = local(tmp_path, 1 << 20, fsync=False)
    disk.capacity = disk.footprint(meta1)
    store = TieredStore([host, disk])
    store.put(meta1, data1, never)
    fill(store, d, range(2, 4))
    assert host.blocks() == [block(d, 2)[0].id, block(d, 3)[0].id] and disk.blocks() == [meta1.id]
    assert disk.path_of(meta1.id).is_file() and disk.used == disk.footprint(meta1) > meta1.size
    tier, view = store.read(meta1.id)
    assert tier is disk and bytes(view) == bytes(data1)
    # Both full: the host's victim moves down, the disk's LRU block (block 1) is dropped.
    outcome = store.put(*block(d, 4), never)
    assert outcome.demoted == [(block(d, 2)[0].id, "local-storage")]
    assert [m.id for m in outcome.evicted] == [meta1.id] and not disk.path_of(meta1.id).exists()
    assert outcome.tier == "host"


def test_leased_blocks_move_down_but_are_never_dropped(d: CompatDescriptor, tmp_path: Path) -> None:
    size = block(d, 1)[0].size
    disk = local(tmp_path, 1 << 20, fsync=False)
    disk.capacity = disk.footprint(block(d, 1)[0])  # room for one block
    store = TieredStore([HostTier(size), disk])
    metas = fill(store, d, range(1, 3))  # 1 on disk, 2 in host
    leased = {metas[1].id, metas[2].id}
    with pytest.raises(t.NoRoom):  # 2 may go down, but 1 (leased) would have to be dropped
        store.put(*block(d, 3), lambda b: b in leased)
    assert metas[1].id in store.tiers[1] and metas[2].id in store.tiers[0]
    leased = {metas[2].id}
    outcome = store.put(*block(d, 3), lambda b: b in leased)  # 1 dropped, leased 2 demoted
    assert [m.id for m in outcome.evicted] == [metas[1].id]
    assert outcome.demoted == [(metas[2].id, "local-storage")]


def test_local_storage_reads_are_checked(d: CompatDescriptor, tmp_path: Path) -> None:
    disk = local(tmp_path, 1 << 20, fsync=False)
    meta, data = block(d, 1)
    disk.store(meta, data)
    path = disk.path_of(meta.id)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1  # a bit flip in the last layer's V section
    path.write_bytes(raw)
    with pytest.raises(t.TierFault, match="layer 3"):
        disk.read(meta.id)
    path.unlink()
    with pytest.raises(t.TierFault, match="cannot read"):
        disk.read(meta.id)


def test_encryption_at_rest_round_trip_and_tamper_detection(d: CompatDescriptor, tmp_path: Path) -> None:
    disk = local(tmp_path, 1 << 20, encryption_key=KEY, fsync=False)
    meta, data = block(d, 1)
    disk.store(meta, data)
    raw = disk.path_of(meta.id).read_bytes()
    assert bytes(data[200:264]) not in raw  # the K/V octets are not on disk in the clear
    assert len(raw) == disk.footprint(meta)
    assert bytes(disk.read(meta.id)) == bytes(data)
    head = t._FILE_HEADER.size + 32 * len(meta.layer_digests)  # authenticated as associated data
    for offset in (head + 3, len(raw) - 1, head - 5, head + 40):  # nonce, tag, a layer digest, ciphertext
        tampered = bytearray(raw)
        tampered[offset] ^= 0x80
        disk.path_of(meta.id).write_bytes(tampered)
        with pytest.raises(t.TierFault):
            disk.read(meta.id)
    # Another block's file copied over this one: authenticated, but it names another block.
    disk.path_of(meta.id).write_bytes(raw)
    other, other_data = block(d, 2)
    disk.store(other, other_data)
    disk.path_of(meta.id).write_bytes(disk.path_of(other.id).read_bytes())
    with pytest.raises(t.TierFault, match="names another block"):
        disk.read(meta.id)


def test_two_writes_of_one_block_use_different_nonces(d: CompatDescriptor, tmp_path: Path) -> None:
    disk = local(tmp_path, 1 << 20, encryption_key=KEY, fsync=False)
    meta, data = block(d, 1)
    disk.store(meta, data)
    first = disk.path_of(meta.id).read_bytes()
    disk.discard(meta.id)
    disk.store(meta, data)
    assert disk.path_of(meta.id).read_bytes() != first


def test_restart_recovers_verified_blocks(d: CompatDescriptor, tmp_path: Path) -> None:
    disk = local(tmp_path, 1 << 20, encryption_key=KEY, fsync=False)
    metas = {}
    for n in range(1, 5):
        meta, data = block(d, n)
        disk.store(meta, data)
        metas[n] = meta
        os.utime(disk.path_of(meta.id), (1000 + n, 1000 + n))
    corrupt = disk.path_of(metas[2].id)
    raw = bytearray(corrupt.read_bytes())
    raw[-20] ^= 1
    corrupt.write_bytes(raw)
    (disk.directory / f".{corrupt.name}.tmp-deadbeef").write_bytes(b"partial")  # an interrupted write
    (disk.directory / "notes.txt").write_text("not ours")
    foreign = local(tmp_path / "other", 1 << 20, encryption_key=bytes(32), fsync=False)
    meta5, data5 = block(d, 5)
    foreign.store(meta5, data5)
    os.replace(foreign.path_of(meta5.id), disk.path_of(meta5.id))  # written under another key

    again = local(tmp_path, 1 << 20, encryption_key=KEY, fsync=False)
    result = again.scan(accept=lambda m: "refused" if m.id == metas[4].id else None)
    assert [m.id for m in result.recovered] == [metas[1].id, metas[3].id]  # oldest first
    assert result.recovered[0] == metas[1]
    assert [name for name, _ in result.dropped] == [corrupt.name] and not corrupt.exists()
    assert sorted(r for _, r in result.ignored) == ["encrypted under another key", "refused"]
    assert disk.path_of(meta5.id).exists() and disk.path_of(metas[4].id).exists()  # left alone
    assert sorted(p.name for p in again.directory.iterdir() if p.name.startswith(".")) == []
    assert again.used == again.footprint(metas[1]) + again.footprint(metas[3])
    assert bytes(again.read(metas[3].id)) == bytes(block(d, 3)[1])
    plain = local(tmp_path, 1 << 20, fsync=False)  # no key: encrypted files are not ours to read
    assert plain.scan().recovered == []


def test_atomic_write_leaves_no_partial_file(d: CompatDescriptor, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    disk = local(tmp_path, 1 << 20, fsync=True)
    meta, data = block(d, 1)

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(t.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space"):
        disk.store(meta, data)
    assert list(disk.directory.iterdir()) == [] and disk.used == 0 and meta.id not in disk
    monkeypatch.undo()
    disk.store(meta, data)
    assert [p.name for p in disk.directory.iterdir()] == [disk.path_of(meta.id).name]


def test_failed_demotion_drops_an_unleased_victim(d: CompatDescriptor, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    size = block(d, 1)[0].size
    disk = local(tmp_path, 1 << 20, fsync=False)
    store = TieredStore([HostTier(size), disk])
    metas = fill(store, d, range(1, 2))

    def broken(meta: BlockMeta, data: memoryview) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(disk, "_keep", broken)
    outcome = store.put(*block(d, 2), never)
    assert [m.id for m in outcome.evicted] == [metas[1].id] and outcome.demoted == []
    with pytest.raises(t.NoRoom, match="leased") as info:  # a leased victim is kept, the new block refused
        store.put(*block(d, 3), lambda b: True)
    assert info.value.outcome is not None and block(d, 2)[0].id in store.tiers[0]


# -- prefix-aware eviction -----------------------------------------------------------------------------------------

CHAIN_A = bytes([0xA]) * 32
CHAIN_B = bytes([0xB]) * 32


def test_prefix_eviction_keeps_a_leading_run_of_one_long_chain(d: CompatDescriptor) -> None:
    size = block(d, 1)[0].size
    store = TieredStore([HostTier(4 * size, t.eviction_policy("prefix"))])
    lru = TieredStore([HostTier(4 * size, t.eviction_policy("lru"))])
    for i in range(10):  # one chain of 10 blocks, stored in order, into room for 4
        meta, data = block(d, i)
        store.put(meta, data, never, t.ChainPosition(CHAIN_A, i))
        lru.put(meta, data, never)
    held = sorted(n for n in range(10) if block(d, n)[0].id in store)
    assert held[:3] == [0, 1, 2] and len(held) == 4  # a leading run (and the newest block)
    assert sorted(n for n in range(10) if block(d, n)[0].id in lru) == [6, 7, 8, 9]  # LRU keeps the tail


def test_prefix_eviction_takes_the_deepest_blocks_of_the_coldest_chain(d: CompatDescriptor) -> None:
    size = block(d, 1)[0].size
    host = HostTier(6 * size, t.PrefixPolicy())
    store = TieredStore([host])
    metas = {}
    for n, (chain, i) in enumerate([(CHAIN_A, 0), (CHAIN_B, 0), (CHAIN_A, 1), (CHAIN_B, 1), (CHAIN_A, 2),
                                    (CHAIN_B, 2)]):
        meta, data = block(d, n)
        store.put(meta, data, never, t.ChainPosition(chain, i))
        metas[chain, i] = meta
    store.read(metas[CHAIN_A, 0].id)  # chain A is read: B is now the coldest
    order = list(host.policy.victims())
    assert order == [metas[c, i].id for c, i in [(CHAIN_B, 2), (CHAIN_B, 1), (CHAIN_B, 0), (CHAIN_A, 2),
                                                 (CHAIN_A, 1), (CHAIN_A, 0)]]
    # out-of-order arrival does not matter: the declared position does
    meta, data = block(d, 20)
    outcome = store.put(meta, data, never, t.ChainPosition(CHAIN_A, 3))
    assert [m.id for m in outcome.evicted] == [metas[CHAIN_B, 2].id]
    metas[CHAIN_A, 3] = meta
    # blocks without a position are chains of their own: least recently used first
    store.remove(metas[CHAIN_B, 1].id)
    store.remove(metas[CHAIN_B, 0].id)
    solo1, solo2 = block(d, 30), block(d, 31)
    store.put(*solo1, never)
    store.put(*solo2, never)
    store.read(solo1[0].id)
    assert next(iter(host.policy.victims())) == metas[CHAIN_A, 3].id  # chain A (read before the solos) is colder
    assert list(host.policy.victims())[4:] == [solo2[0].id, solo1[0].id]


def test_prefix_eviction_across_tiers_demotes_the_deep_end(d: CompatDescriptor, tmp_path: Path) -> None:
    size = block(d, 1)[0].size
    disk = LocalStorageTier(LocalStorageConfig(tmp_path / "blocks", 100 * size, fsync=False), t.PrefixPolicy())
    store = TieredStore([HostTier(3 * size, t.PrefixPolicy()), disk])
    for i in range(8):
        store.put(*block(d, i), never, t.ChainPosition(CHAIN_A, i))
    in_host = sorted(n for n in range(8) if block(d, n)[0].id in store.tiers[0])
    assert in_host[:2] == [0, 1] and len(in_host) == 3  # the head stays in memory, the deep end went to disk
    assert all(block(d, n)[0].id in store for n in range(8))
    assert store.position(block(d, 5)[0].id) == t.ChainPosition(CHAIN_A, 5)  # kept across the demotion


# -- write-through ---------------------------------------------------------------------------------------------------


def test_write_through_files_every_host_block_and_a_restart_recovers_them(d: CompatDescriptor,
                                                                         tmp_path: Path) -> None:
    meta1 = block(d, 1)[0]
    size, on_disk = meta1.size, t.file_header_size(len(meta1.layer_digests)) + meta1.size
    disk = local(tmp_path, 2 * on_disk, fsync=False)
    store = TieredStore([HostTier(2 * size), disk])
    assert store.enable_write_through()
    for n in range(4):
        store.put(*block(d, n), never)
    assert sorted(n for n in range(4) if block(d, n)[0].id in store.tiers[0]) == [2, 3]
    files = {p.name for p in disk.directory.glob("*.kvb")}
    assert files == {disk.path_of(block(d, n)[0].id).name for n in range(4)}  # host blocks have files too
    assert disk.used == 2 * disk.footprint(block(d, 0)[0])  # ... not counted against local storage
    inode = disk.path_of(block(d, 2)[0].id).stat().st_ino
    store.put(*block(d, 4), never)  # demotes block 2 (its file was written already), drops block 0
    assert not disk.path_of(block(d, 0)[0].id).exists()
    assert block(d, 2)[0].id in disk and disk.path_of(block(d, 2)[0].id).stat().st_ino == inode
    store.remove(block(d, 3)[0].id)  # gone from memory: its file goes too
    assert not disk.path_of(block(d, 3)[0].id).exists()

    # restart: every file is found; what local storage cannot hold goes back to memory
    again_disk = local(tmp_path, 2 * on_disk, fsync=False)
    again = TieredStore([HostTier(2 * size), again_disk])
    again.enable_write_through()
    recovered, dropped, evicted = again.recover()
    assert sorted(m.id.block_key[-1] for m in recovered) == [1, 2, 4] and dropped == [] and evicted == []
    assert again_disk.used <= again_disk.capacity and len(again.tiers[0]) == 1  # (0 was evicted before)
    assert again_disk.has_shadow(next(iter(again.tiers[0].blocks())))  # its file stays, written through
    for n in (1, 2, 4):
        assert bytes(again.read(block(d, n)[0].id)[1]) == bytes(block(d, n)[1])


def test_a_failed_write_through_keeps_nothing(d: CompatDescriptor, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    disk = local(tmp_path, 1 << 20, fsync=False)
    store = TieredStore([HostTier(1 << 20), disk])
    store.enable_write_through()

    def broken(meta: BlockMeta, data: memoryview) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "_keep", broken)
    meta, data = block(d, 1)
    with pytest.raises(t.NoRoom, match="through"):
        store.put(meta, data, never)
    assert meta.id not in store and store.tiers[0].used == 0


# -- file modes, what a restart adopts -------------------------------------------------------------------------------


def test_block_files_are_private_and_a_restart_adopts_only_verified_files(d: CompatDescriptor,
                                                                           tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        disk = local(tmp_path, 1 << 20, fsync=False)
        for n in range(3):
            disk.store(*block(d, n))
    finally:
        os.umask(old)
    assert disk.directory.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in disk.directory.iterdir()} == {0o600}
    one, two = disk.path_of(block(d, 1)[0].id), disk.path_of(block(d, 2)[0].id)
    os.replace(one, two)  # a file stored under another block's name: its header names block 1
    (disk.directory / disk.path_of(block(d, 5)[0].id).name).symlink_to(disk.path_of(block(d, 0)[0].id))
    zero = disk.path_of(block(d, 0)[0].id)
    zero.chmod(0o644)
    again = local(tmp_path, 1 << 20, fsync=False)
    result = again.scan()
    assert [m.id for m in result.recovered] == [block(d, 0)[0].id]
    assert [(name, reason) for name, reason in result.dropped] == [(two.name, "the file names another block")]
    assert zero.stat().st_mode & 0o777 == 0o600  # adopted, and made private


def test_shared_host_tier_files_are_private(d: CompatDescriptor, tmp_path: Path) -> None:
    from kvsp_quic.storage.shared_host import SharedHostTier

    old = os.umask(0o000)
    try:
        tier = SharedHostTier(tmp_path, 10 << 20)
        store = TieredStore([tier])
        meta, data = block(d, 1)
        alloc = tier.allocate(d.layers, len(data))
        alloc.container[:] = data
        store.put(meta, alloc.container, never)
        store.put(*block(d, 2), never)  # octets from elsewhere: a file of their own
    finally:
        os.umask(old)
    assert {p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {0o600}
