from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvsp_quic import container as c
from kvsp_quic.compat import CompatDescriptor
from tests import vectors
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
SPEC_DESCRIPTOR = ROOT / "examples" / "descriptor.json"


SPEC_ANSWER = {"compat_id": vectors.COMPAT_ID, "scope_id": vectors.SCOPE_ID, "block_keys": [vectors.K0, vectors.K1]}
SPEC_TOKENS = ",".join(map(str, vectors.TOKENS))


@pytest.mark.parametrize("content", [vectors.SCOPE_KEY.hex() + "\n", vectors.SCOPE_KEY.hex()[:32] + "\n  " +
                                     vectors.SCOPE_KEY.hex()[32:], vectors.SCOPE_KEY])
def test_keys_prints_the_spec_vectors_with_the_key_from_a_file(capsys, tmp_path: Path,
                                                                 content: str | bytes) -> None:
    key = tmp_path / "scope.key"
    key.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, out, err = run_cli(capsys, "keys", "--descriptor", str(SPEC_DESCRIPTOR), "--scope-key-file", str(key),
                             "--tokens", SPEC_TOKENS)
    assert code == 0, err
    assert json.loads(out) == SPEC_ANSWER and err == ""


def test_keys_reads_the_scope_key_from_stdin(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(vectors.SCOPE_KEY.hex().encode() + b"\n")))
    code, out, err = run_cli(capsys, "keys", "--descriptor", str(SPEC_DESCRIPTOR), "--scope-key-file", "-",
                             "--tokens", SPEC_TOKENS)
    assert code == 0 and json.loads(out) == SPEC_ANSWER and err == ""


def test_a_scope_key_on_the_command_line_works_with_a_warning(capsys) -> None:
    code, out, err = run_cli(capsys, "keys", "--descriptor", str(SPEC_DESCRIPTOR), "--scope-key",
                             vectors.SCOPE_KEY.hex(), "--tokens", SPEC_TOKENS)
    assert code == 0
    assert json.loads(out) == SPEC_ANSWER
    assert "warning" in err and "--scope-key-file" in err and err.count("\n") == 1
    assert vectors.SCOPE_KEY.hex() not in err  # the warning does not repeat the secret


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--scope-key-file", "-", "--tokens-file", "-"], 1, "only one of them can read stdin"),
    (["--scope-key-file", "/nonexistent/k", "--tokens", "1"], 1, "No such file"),
    (["--scope-key", "00" * 32, "--scope-key-file", "k", "--tokens", "1"], 2, "not allowed with"),
    (["--tokens", "1"], 2, "one of the arguments --scope-key-file --scope-key is required"),
])
def test_scope_key_file_errors(capsys, args: list[str], code: int, message: str) -> None:
    answer, out, err = run_cli(capsys, "keys", "--descriptor", str(SPEC_DESCRIPTOR), *args)
    assert (answer, out) == (code, "") and message in err


def test_a_short_scope_key_file_is_one_line(capsys, tmp_path: Path) -> None:
    key = tmp_path / "scope.key"
    key.write_text("00" * 8)
    code, out, err = run_cli(capsys, "keys", "--descriptor", str(SPEC_DESCRIPTOR), "--scope-key-file", str(key),
                             "--tokens", "1")
    assert code == 1 and out == "" and "at least 32 octets" in err and str(key) in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("text", ["[128000, 791, 6460, 374, 264, 1296, 315, 279, 9]",
                                  "128000 791\n6460,374 264, 1296 315 279 9\n"])
def test_keys_from_a_tokens_file(capsys, tmp_path: Path, text: str) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(text)
    key = tmp_path / "scope.key"
    key.write_text(vectors.SCOPE_KEY.hex())
    code, out, _ = run_cli(capsys, "keys", "--descriptor", str(SPEC_DESCRIPTOR), "--scope-key-file", str(key),
                           "--tokens-file", str(tokens))
    assert code == 0 and json.loads(out)["block_keys"] == [vectors.K0, vectors.K1]


@pytest.mark.parametrize(("args", "message"), [
    (["--scope-key", "00" * 8, "--tokens", "1"], "at least 32 octets"),
    (["--scope-key", "xyz", "--tokens", "1"], "must be hex"),
    (["--scope-key", "00" * 32, "--tokens", "1,a"], "'a' is not a token id"),
    (["--scope-key", "00" * 32, "--tokens", "-1"], "uint32"),
    (["--scope-key", "00" * 32, "--tokens-file", "/nonexistent/t"], "No such file"),
])
def test_keys_errors_are_one_line(capsys, args: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, "keys", "--descriptor", str(SPEC_DESCRIPTOR), *args)
    assert code == 1 and out == ""
    error = [line for line in err.splitlines() if "warning: --scope-key" not in line]  # one line besides it
    assert len(error) == 1 and message in error[0] and "Traceback" not in err


def test_keys_with_a_bad_descriptor(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "d.json"
    bad.write_text(json.dumps(dict(vectors.DESCRIPTOR, kv_dtype="int4")))
    code, _, err = run_cli(capsys, "keys", "--descriptor", str(bad), "--scope-key", "00" * 32, "--tokens", "1")
    assert code == 1 and "Element Types registry" in err and str(bad) in err


def test_pack_then_inspect(capsys, tmp_path: Path) -> None:
    out_file = tmp_path / "block.kvb"
    code, _, err = run_cli(capsys, "container", "pack", "--descriptor", str(SPEC_DESCRIPTOR), "--tokens", "4",
                       "--layers", "0-31", "--random", "7", "-o", str(out_file))
    assert code == 0, err
    code, out, err = run_cli(capsys, "container", "inspect", str(out_file), "--descriptor", str(SPEC_DESCRIPTOR))
    assert code == 0, err
    report = json.loads(out)
    _header, layers = c.decode(out_file.read_bytes(), CompatDescriptor.load(SPEC_DESCRIPTOR))
    assert {k: report[k] for k in ("version", "flags", "codec", "first_layer", "layer_count", "token_count")} == {
        "version": 1, "flags": 0, "codec": 1, "first_layer": 0, "layer_count": 32, "token_count": 4}
    assert report["layers"][3] == {"layer": 3, "k_length": 8192, "v_length": 8192, "digest": layers[3].digest.hex()}
    assert report["replica_digest"] == "sha-256:" + c.replica_digest([x.digest for x in layers]).hex()
    assert report["complete_block"] is True
    # The same seed gives the same octets; without a descriptor there is no replica digest.
    again = tmp_path / "again.kvb"
    run_cli(capsys, "container", "pack", "--descriptor", str(SPEC_DESCRIPTOR), "--tokens", "4", "--layers", "0-31",
        "--random", "7", "-o", str(again))
    assert again.read_bytes() == out_file.read_bytes()
    code, out, _ = run_cli(capsys, "container", "inspect", str(out_file))
    assert code == 0 and "replica_digest" not in json.loads(out)


def test_pack_from_npy(capsys, tmp_path: Path) -> None:
    d = CompatDescriptor.load(SPEC_DESCRIPTOR)
    values = np.random.default_rng(1).standard_normal((2, 2, 4, d.kv_heads, d.head_dim), dtype=np.float32)
    src = tmp_path / "kv.npy"
    np.save(src, values)
    out_file = tmp_path / "b.kvb"
    code, _, err = run_cli(capsys, "container", "pack", "--descriptor", str(SPEC_DESCRIPTOR), "--tokens", "4",
                       "--layers", "5-6", "--npy", str(src), "-o", str(out_file))
    assert code == 0, err
    header, layers = c.decode(out_file.read_bytes(), d)
    assert header.first_layer == 5
    k5 = np.frombuffer(layers[0].k, dtype="<u2").view(np.uint16)
    expected = (values[0, 0].view(np.uint32) + 0x7FFF + ((values[0, 0].view(np.uint32) >> 16) & 1)) >> 16
    assert np.array_equal(k5, expected.astype(np.uint16).ravel())
    code, _, err = run_cli(capsys, "container", "pack", "--descriptor", str(SPEC_DESCRIPTOR), "--tokens", "4",
                       "--layers", "5-7", "--npy", str(src), "-o", str(out_file))
    assert code == 1 and "holds 2 layers" in err
    code, _, err = run_cli(capsys, "container", "pack", "--descriptor", str(SPEC_DESCRIPTOR), "--tokens", "8",
                       "--layers", "5-6", "--npy", str(src), "-o", str(out_file))
    assert code == 1 and "expected (layers, 2, 8, 8, 128)" in err


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda b: b"JUNK" + b[4:], "not a KV Block Container"),
    (lambda b: b[:-10], "truncated"),
    (lambda b: b + b"x", "follow the container"),
    (lambda b: b[:5] + b"\x01" + b[6:], "flags are reserved"),
    (lambda b: b"", "empty"),
])
def test_inspect_malformed_is_one_line(capsys, tmp_path: Path, mutate, message: str) -> None:
    good = tmp_path / "good.kvb"
    run_cli(capsys, "container", "pack", "--descriptor", str(SPEC_DESCRIPTOR), "--tokens", "4", "--layers", "0-1",
        "--random", "1", "-o", str(good))
    bad = tmp_path / "bad.kvb"
    bad.write_bytes(mutate(good.read_bytes()))
    code, out, err = run_cli(capsys, "container", "inspect", str(bad))
    assert code == 1 and out == "" and message in err and err.count("\n") == 1


def test_inspect_checks_geometry_against_the_descriptor(capsys, tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(vectors.DESCRIPTOR, head_dim=64)))
    blob = tmp_path / "b.kvb"
    run_cli(capsys, "container", "pack", "--descriptor", str(SPEC_DESCRIPTOR), "--tokens", "4", "--layers", "0-1",
        "--random", "1", "-o", str(blob))
    code, _, err = run_cli(capsys, "container", "inspect", str(blob), "--descriptor", str(other))
    assert code == 1 and "K/V lengths 8192/8192" in err


def test_usage_errors_and_help(capsys) -> None:
    code, _, err = run_cli(capsys, "container", "pack", "--descriptor", "x", "--tokens", "0", "--layers", "0-1",
                       "--random", "1", "-o", "y")
    assert code == 2 and "must be positive" in err
    code, _, err = run_cli(capsys, "container", "pack", "--descriptor", "x", "--tokens", "1", "--layers", "3-1",
                       "--random", "1", "-o", "y")
    assert code == 2 and "empty layer range" in err
    for cmd in (["keys"], ["container", "inspect"], ["container", "pack"], ["container"], []):
        code, out, _ = run_cli(capsys, *cmd, "--help")
        assert code == 0 and "usage:" in out
    code, _, err = run_cli(capsys)
    assert code == 2 and "usage:" in err


def test_the_installed_console_script(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("kvsp-quic")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvsp_app"]
    version = subprocess.run([*cmd, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("kvsp-quic ")
    bad = subprocess.run([*cmd, "container", "inspect", str(tmp_path / "missing.kvb")], capture_output=True,
                         text=True)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1
