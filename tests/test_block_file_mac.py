"""Issue 13: block files are authenticated, so a planted file is refused (``kvsp_quic.storage.file_seal``).

Without an encryption key, a holder's local-storage files carry an HMAC-SHA-256 under a per-holder key
(``[holder.local_storage] mac_key_file``, by default ``<dir>.mac-key`` beside the directory, created 0600). Before,
any file whose digests matched itself was adopted on restart and served: whoever could drop a file into the
directory planted a block for any key. Here: the seal itself (every header octet counts, the key counts), key files,
the tier's restart scan and reads, the configuration, and a real ``kvsp-quic holder`` restarted on a directory
with planted, foreign, tampered and honest files.
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_app.config import ConfigError, HolderFile, build
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic import container as c
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.storage import file_seal as fs
from kvsp_quic.storage import tiers as t
from kvsp_quic.storage.tiers import BlockMeta, LocalStorageConfig, LocalStorageTier, TierFault
from tests.helpers import Process
from tests.support.cluster import CONTAINER_SIZE, DESCRIPTOR, KEYER, block_url, put_in_chain, settle
from tests.support.cluster import block as cluster_block
from tests.support.descriptors import small_descriptor
from tests.support.tiers import block

KEY = bytes(range(32))
OTHER_KEY = bytes(range(100, 132))


@pytest.fixture
def d() -> CompatDescriptor:
    return small_descriptor()


def tier(directory: Path, **kw: Any) -> LocalStorageTier:
    return LocalStorageTier(LocalStorageConfig(directory, 1 << 20, fsync=False, **kw))


def forged(meta: BlockMeta, data: memoryview | bytes, *, flags: int = 0, kid: bytes = bytes(8),
           mac: bytes = bytes(32)) -> bytes:
    """A self-consistent block file as an attacker writes it: the header format, digests that match the container,
    and whatever flags, key id and MAC they choose."""
    return fs.pack_head(meta.id, meta.layer_digests, flags, kid, mac) + bytes(data)


def impostor(d: CompatDescriptor, victim: int, source: int) -> tuple[BlockMeta, memoryview]:
    """Block *source*'s container under block *victim*'s name (its own digests: it verifies against itself)."""
    meta, data = block(d, source)
    return BlockMeta(block(d, victim)[0].id, meta.header, meta.layer_digests, meta.size), data


# -- the seal ---------------------------------------------------------------------------------------------------


def test_the_seal_authenticates_every_header_octet_and_the_container_header(d: CompatDescriptor) -> None:
    meta, data = block(d, 1)
    head = fs.seal(KEY, fs.pack_head(meta.id, meta.layer_digests, fs.FLAG_MAC, fs.key_id(KEY)), data)
    assert len(head) == fs.file_header_size(len(meta.layer_digests))
    assert fs.seal_holds(KEY, memoryview(head), data)
    assert not fs.seal_holds(OTHER_KEY, memoryview(head), data)  # another holder's key
    for i in range(len(head)):  # magic, version, flags, key id, block identity, layer count, MAC, every digest
        bad = bytearray(head)
        bad[i] ^= 0x01
        assert not fs.seal_holds(KEY, memoryview(bad), data), i
    for i in range(meta.header.size):  # codec, first layer, token count, every K and V length
        bad = bytearray(data)
        bad[i] ^= 0x01
        assert not fs.seal_holds(KEY, memoryview(head), memoryview(bad)), i
    assert not fs.seal_holds(KEY, memoryview(head), data[:meta.header.size - 1])  # truncated
    # The sections are not under the MAC: the layer digests (which are) bind them, checked on every read.
    assert fs.seal_holds(KEY, memoryview(head), memoryview(bytes(data[:-1]) + b"\x00"))
    unsealed = fs.pack_head(meta.id, meta.layer_digests, fs.FLAG_MAC, fs.key_id(KEY))
    assert not fs.seal_holds(KEY, memoryview(unsealed), data)  # a zero MAC slot


def test_the_seal_of_a_layer_range_covers_the_header_of_the_container_it_holds(d: CompatDescriptor) -> None:
    meta, data = block(d, 1)
    part = memoryview(c.cut(data, 1, 2).tobytes())  # a replica of layers 1-2: fewer entries than digests
    digests = tuple(bytes(32) if i not in (1, 2) else meta.layer_digests[i] for i in range(len(meta.layer_digests)))
    head = fs.seal(KEY, fs.pack_head(meta.id, digests, fs.FLAG_MAC, fs.key_id(KEY)), part)
    assert fs.seal_holds(KEY, memoryview(head), part)
    header_size = c.FIXED_HEADER.size + 2 * c.ENTRY.size
    for i in range(header_size):
        bad = bytearray(part)
        bad[i] ^= 0x01
        assert not fs.seal_holds(KEY, memoryview(head), memoryview(bad)), i
    assert fs.seal_holds(KEY, memoryview(head), memoryview(bytes(part[:header_size]) + bytes(len(part) - header_size)))
    assert not fs.seal_holds(KEY, memoryview(head), part[:header_size - 1])


def test_key_files(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "blocks.mac-key"
    key, created = fs.load_or_create_key(path, fsync=False)
    assert created and len(key) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "secrets").stat().st_mode & 0o777 == 0o700
    assert path.read_text().strip() == key.hex()
    assert fs.load_or_create_key(path, fsync=False) == (key, False)  # the same key at the next start
    assert fs.load_or_create_key(tmp_path / "other.key", fsync=False)[0] != key
    assert [p.name for p in (tmp_path / "secrets").iterdir()] == ["blocks.mac-key"]  # no temporary file left
    raw = tmp_path / "raw.key"
    raw.write_bytes(KEY)
    raw.chmod(0o600)
    assert fs.read_key_file(raw) == KEY
    raw.chmod(0o620)  # another user could replace it, and make planted files verify
    with pytest.raises(fs.KeyFileError, match="may be replaced by another user"):
        fs.read_key_file(raw)
    raw.write_bytes(KEY[:31])
    raw.chmod(0o600)
    with pytest.raises(fs.KeyFileError, match="expected 32 raw octets"):
        fs.read_key_file(raw)
    assert fs.default_key_file(tmp_path / "blocks") == tmp_path / "blocks.mac-key"  # beside, not inside


# -- the tier ---------------------------------------------------------------------------------------------------


def test_a_restart_adopts_only_files_sealed_under_its_key(d: CompatDescriptor, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "blocks"
    disk = tier(directory, mac_key=KEY)
    honest = {n: block(d, n) for n in (1, 2, 3)}
    for meta, data in honest.values():
        disk.store(meta, data)
    kid = disk.path_of(honest[1][0].id).read_bytes()[12:20]  # an honest file's key id, as an attacker may read it
    assert kid == fs.key_id(KEY)
    planted = {
        4: forged(*block(d, 4)),  # a new key, no MAC at all
        5: forged(*block(d, 5), flags=fs.FLAG_MAC, kid=kid, mac=os.urandom(32)),  # our key id, a guessed MAC
    }
    for n, raw in planted.items():
        disk.path_of(block(d, n)[0].id).write_bytes(raw)
    disk.path_of(honest[2][0].id).write_bytes(forged(*impostor(d, 2, 7)))  # an honest block's file replaced
    other = tier(tmp_path / "elsewhere", mac_key=OTHER_KEY)  # another holder, another key
    other.store(*block(d, 6))
    os.replace(other.path_of(block(d, 6)[0].id), disk.path_of(block(d, 6)[0].id))

    caplog.set_level(logging.WARNING, logger="kvsp.tiers")
    again = tier(directory, mac_key=KEY)
    result = again.scan()
    assert {m.id: m for m in result.recovered} == {honest[n][0].id: honest[n][0] for n in (1, 3)}
    reasons = dict(result.dropped)
    assert reasons == {
        t.block_file_name(block(d, 4)[0].id): "no MAC: not written by this holder (planted, or by another "
                                              "program); refused",
        t.block_file_name(block(d, 5)[0].id): "MAC check failed (planted, tampered or corrupted): refused",
        t.block_file_name(honest[2][0].id): "no MAC: not written by this holder (planted, or by another "
                                            "program); refused"}
    assert dict(result.ignored) == {t.block_file_name(block(d, 6)[0].id): "sealed under another MAC key (another "
                                    "holder's, or before a key change)"}
    assert again.path_of(block(d, 6)[0].id).exists()  # another key's file is left alone; refused ones deleted
    assert not any(again.path_of(block(d, n)[0].id).exists() for n in (2, 4, 5))
    for name in [*reasons, *dict(result.ignored)]:  # each refusal logged once, at WARNING
        assert sum(name in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1
    for n in (1, 3):
        assert bytes(again.read(honest[n][0].id)) == bytes(honest[n][1])
    with pytest.raises(TierFault, match="no MAC"):
        disk.path_of(block(d, 4)[0].id).write_bytes(planted[4])
        again.read_file(block(d, 4)[0].id)  # what a worker process serves: refused too


@pytest.mark.parametrize("edit", ["mac", "layer_count", "digest", "scope", "token_count", "kv_split"])
def test_one_flipped_octet_of_the_mac_or_an_edited_header_is_refused(d: CompatDescriptor, tmp_path: Path,
                                                                     edit: str) -> None:
    meta, data = block(d, 1)
    disk = tier(tmp_path / "blocks", mac_key=KEY)
    disk.store(meta, data)
    head = fs.file_header_size(len(meta.layer_digests))
    path = disk.path_of(meta.id)
    raw = bytearray(path.read_bytes())
    flips = {"mac": fs._MAC_AT + 7, "layer_count": fs._MAC_AT - 1, "scope": 8 + 1 + 1 + 2 + 8 + 32 + 3,
             "digest": head - 1}
    if edit in flips:
        raw[flips[edit]] ^= 0x01
    elif edit == "token_count":  # 1 token: K/V lengths still divisible, every digest still holds
        struct.pack_into(">I", raw, head + 16, 1)
    else:  # a private codec (no geometry rule) and 8 octets moved from V to K in layer 0: K || V unchanged
        k, v = meta.header.lengths[0]
        struct.pack_into(">H", raw, head + 6, 0xFF00)
        struct.pack_into(">QQ", raw, head + c.FIXED_HEADER.size, k + 8, v - 8)
    path.write_bytes(raw)
    with pytest.raises(TierFault):
        disk.read(meta.id)
    again = tier(tmp_path / "blocks", mac_key=KEY)
    result = again.scan()
    assert result.recovered == [] and len(result.dropped) == 1 and not path.exists()


def test_files_of_format_version_1_are_refused_with_a_reason(d: CompatDescriptor, tmp_path: Path) -> None:
    meta, data = block(d, 1)
    directory = tmp_path / "blocks"
    disk = tier(directory, mac_key=KEY)
    legacy = fs._FILE_HEADER.pack(fs.FILE_MAGIC, 1, 0, bytes(8), meta.id.compat_id, meta.id.scope_id,
                                  meta.id.block_key, len(meta.layer_digests), bytes(32))[:-32]
    disk.path_of(meta.id).write_bytes(legacy + b"".join(meta.layer_digests) + bytes(data))
    (reason,) = dict(tier(directory, mac_key=KEY).scan().dropped).values()
    assert reason.startswith("file format version 1, written before block files were authenticated: refused")


def test_without_a_configured_key_the_key_beside_the_directory_is_used(d: CompatDescriptor, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvsp.tiers")
    directory = tmp_path / "blocks"
    disk = tier(directory)
    key_file = tmp_path / "blocks.mac-key"
    assert key_file.stat().st_mode & 0o777 == 0o600 and "created" in caplog.text and str(key_file) in caplog.text
    meta, data = block(d, 1)
    disk.store(meta, data)
    disk.path_of(block(d, 2)[0].id).write_bytes(forged(*block(d, 2)))
    result = tier(directory).scan()  # the next start: the same key
    assert [m.id for m in result.recovered] == [meta.id] and len(result.dropped) == 1
    assert {p.name for p in directory.iterdir()} == {t.block_file_name(meta.id)}  # the key is not in there
    key_file.unlink()  # a lost key: nothing is adopted (a new key is made)
    assert tier(directory).scan().recovered == []


def test_encrypted_tiers_need_no_mac_key(d: CompatDescriptor, tmp_path: Path) -> None:
    disk = tier(tmp_path / "blocks", encryption_key=KEY)
    meta, data = block(d, 1)
    disk.store(meta, data)
    assert not (tmp_path / "blocks.mac-key").exists()
    assert disk.path_of(meta.id).read_bytes()[9] == fs.FLAG_ENCRYPTED
    assert bytes(tier(tmp_path / "blocks", encryption_key=KEY).read_file(meta.id)[1]) == bytes(data)
    # a sealed plain file is not read by an encrypting tier (left alone), nor an encrypted one by a sealing tier
    sealed = tier(tmp_path / "plain", mac_key=KEY)
    sealed.store(*block(d, 2))
    os.replace(sealed.path_of(block(d, 2)[0].id), disk.path_of(block(d, 2)[0].id))
    result = tier(tmp_path / "blocks", encryption_key=KEY).scan()
    assert [m.id for m in result.recovered] == [meta.id]
    assert dict(result.ignored) == {t.block_file_name(block(d, 2)[0].id):
                                    "stored in plain text, but encryption at rest is configured"}
    with pytest.raises(ValueError, match="mac_key must be 32 octets"):
        LocalStorageConfig(tmp_path, 1, mac_key=b"short")


def test_the_configuration(tmp_path: Path) -> None:
    cfg = build(HolderFile, {"holder": {"local_storage": {"path": "blocks", "capacity": 1 << 20,
                                                          "mac_key_file": "keys/blocks.key"}}}, root=tmp_path)
    assert cfg.holder.local_storage is not None
    assert cfg.holder.local_storage.mac_key_file == tmp_path / "keys" / "blocks.key"
    for options, message in [
            ({"mac_key_file": "blocks/mac.key"}, "mac_key_file: must lie outside the storage directory"),
            ({"mac_key_file": "k", "encryption_key_file": "e"}, "mac_key_file: not with encryption_key_file")]:
        with pytest.raises(ConfigError, match=message):
            build(HolderFile, {"holder": {"local_storage": {"path": "blocks", "capacity": 1, **options}}},
                  root=tmp_path)


# -- a real holder -------------------------------------------------------------------------------------------------


def holder_file(storage: Path, i: int) -> Path:
    return storage / f"{DESCRIPTOR.compat_id.hex()}.{KEYER.scope_id.hex()}.{cluster_block(i)[0].hex()}.kvb"


def cluster_meta(i: int, name: int | None = None) -> tuple[BlockMeta, memoryview]:
    """Cluster block *i* with its meta, under block *name*'s key when given (an impostor)."""
    raw = cluster_block(i)[1]
    header, layers = c.decode(raw)
    block_id = t.BlockId(DESCRIPTOR.compat_id, KEYER.scope_id, cluster_block(name if name is not None else i)[0])
    digests = tuple(c.layer_digest(layer.k, layer.v) for layer in layers)
    return BlockMeta(block_id, header, digests, len(raw)), memoryview(raw)


async def test_a_restarted_holder_refuses_planted_foreign_and_tampered_files(
        index: dict[str, Any], index_client: KvspClient, tmp_path: Path) -> None:
    storage = tmp_path / "local"
    args = ["holder", "--dev", str(tmp_path / "dev"), "--index", index["base_uri"], "--workers", "1",
            "--host-capacity", str(CONTAINER_SIZE + CONTAINER_SIZE // 2), "--local-storage", str(storage),
            "--replica-ttl-ms", "60000", "--log-level", "WARNING"]
    first = Process(*args)
    holder = first.ready["base_uri"]
    fetcher = BlockFetcher(index_client, index["base_uri"])
    try:
        for i in range(4):  # written through: every block has its file
            await put_in_chain(index_client, holder, i)
        assert await settle(fetcher, 4, lambda n: n == 4) == 4
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        first.stop()
    key_file = tmp_path / "local.mac-key"  # the default key: beside the directory, made at the first start
    assert key_file.stat().st_mode & 0o777 == 0o600 and not (storage / key_file.name).exists()

    # (a) planted, self-consistent files: a block the holder never had (5), and an honest block replaced (1)
    holder_file(storage, 5).write_bytes(forged(*cluster_meta(5)))
    kid = holder_file(storage, 0).read_bytes()[12:20]
    holder_file(storage, 1).write_bytes(forged(*cluster_meta(9, name=1), flags=fs.FLAG_MAC, kid=kid))
    # (b) a file sealed by another holder, under its own key
    other = LocalStorageTier(LocalStorageConfig(tmp_path / "other", 1 << 30, fsync=False, mac_key=OTHER_KEY))
    other.store(*cluster_meta(6))
    os.replace(other.path_of(cluster_meta(6)[0].id), holder_file(storage, 6))
    # (d) one octet of block 2's MAC flipped
    raw = bytearray(holder_file(storage, 2).read_bytes())
    raw[fs._MAC_AT] ^= 0x01
    holder_file(storage, 2).write_bytes(raw)

    port = holder.rsplit(":", 1)[1].strip("/")
    again = Process(*args, "--listen", f"127.0.0.1:{port}")
    try:
        # (c) the honest files (0 and 3) are adopted and served with their octets, and advertised again
        for i in (0, 3):
            r = await index_client.request("GET", block_url(holder, cluster_block(i)[0]))
            assert r.status == 200 and await r.aread() == cluster_block(i)[1]
        deadline = time.monotonic() + 15
        refused = (1, 2, 5, 6)
        while True:  # the records of 1 and 2 (published before the restart) are withdrawn
            found = [(await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [cluster_block(i)[0]])).matched
                     for i in range(7)]
            if found == [1, 0, 0, 1, 0, 0, 0] or time.monotonic() > deadline:
                break
        assert found == [1, 0, 0, 1, 0, 0, 0]
        for i in refused:  # never served
            assert (await index_client.request("GET", block_url(holder, cluster_block(i)[0]))).status == 404, i
        assert holder_file(storage, 6).exists()  # another key's file: left alone
        assert not any(holder_file(storage, i).exists() for i in (1, 2, 5))  # refused: deleted
        await put_in_chain(index_client, holder, 1)  # the holder takes block 1 again, sealed under its key
        r = await index_client.request("GET", block_url(holder, cluster_block(1)[0]))
        assert r.status == 200 and await r.aread() == cluster_block(1)[1]
    finally:
        err = again.stop()
        assert "Traceback" not in err, err
    for i in (1, 2, 5):  # each refusal logged at WARNING, naming the file
        assert holder_file(storage, i).name in err, err
    assert "no MAC" in err and "MAC check failed" in err and "another MAC key" in err


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvsp_app.cli import main

    dev = str(tmp_path / "dev")
    storage = tmp_path / "local"
    assert main(["holder", "--dev", dev, "--mac-key-file", str(tmp_path / "k")]) == 1
    assert "--mac-key-file need --local-storage DIR" in capsys.readouterr().err
    assert main(["holder", "--dev", dev, "--local-storage", str(storage), "--mac-key-file",
                 str(storage / "k")]) == 1
    assert "mac_key_file: must lie outside the storage directory" in capsys.readouterr().err
    loose = tmp_path / "loose.key"
    loose.write_text(KEY.hex())
    loose.chmod(0o666)
    assert main(["holder", "--dev", dev, "--local-storage", str(storage), "--mac-key-file", str(loose)]) == 1
    err = capsys.readouterr().err
    assert "holder.local_storage.mac_key_file:" in err and "may be replaced by another user" in err
    assert not (tmp_path / "dev").exists()  # refused before anything was started or written
