"""``kvsp-quic model``: init and descriptor work without torch; generate needs it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.modelfiles import derive_descriptor
from kvsp_app import cli_model
from kvsp_quic.compat import CompatDescriptor

ROOT = Path(__file__).resolve().parent.parent


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The commands through kvsp-quic's parser when it has them, else through cli_model's own."""
    from kvsp_app import cli

    registered = any(isinstance(action, argparse._SubParsersAction) and "model" in action.choices
                     for action in cli.build_parser()._actions)
    try:
        code = cli.main(list(argv)) if registered else cli_model.main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_init_writes_a_loadable_model_and_the_descriptor_matches(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    code, out, err = run(capsys, "model", "init", str(target), "--layers", "4", "--kv-heads", "2", "--head-dim", "16",
                         "--hidden", "64", "--vocab", "256", "--dtype", "bf16", "--seed", "3",
                         "--rope-scaling", '{"rope_type": "linear", "factor": 2.0}', "--name", "kvsp/tiny")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["files"] == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert summary["positional"] == "rope;theta=10000,scaling=linear"
    config = json.loads((target / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"], config["hidden_size"],
            config["num_attention_heads"], config["torch_dtype"]) == (4, 2, 16, 64, 4, "bfloat16")
    assert summary["parameters"] == sum(
        n for n in [256 * 64 * 2, 64] + [2 * 64 + 64 * (64 + 64) + 64 * 64 + 3 * 64 * 128] * 4)
    code, out, err = run(capsys, "model", "descriptor", str(target), "--block-tokens", "16")
    assert code == 0, err
    d = CompatDescriptor.loads(out)
    assert d == derive_descriptor(target, 16) and d.model == "kvsp/tiny" and d.kv_dtype == "bf16"
    code, out, err = run(capsys, "model", "descriptor", str(target), "--block-tokens", "16", "--kv-dtype",
                         "fp8-e5m2", "-o", str(tmp_path / "d.json"))
    assert code == 0 and json.loads(out)["compat_id"] == CompatDescriptor.load(tmp_path / "d.json").compat_id.hex()
    # the same arguments write the same model
    code, out2, err = run(capsys, "model", "init", str(target), "--layers", "4", "--kv-heads", "2", "--head-dim", "16",
                          "--hidden", "64", "--vocab", "256", "--dtype", "bf16", "--seed", "3", "--force",
                          "--rope-scaling", '{"rope_type": "linear", "factor": 2.0}', "--name", "kvsp/tiny")
    assert code == 0 and json.loads(out2)["model_digest"] == summary["model_digest"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--heads", "3"], "not a multiple"),
    (["--vocab", "100"], "vocab_size >= 256"),
    (["--rope-scaling", "{"], "not JSON"),
    (["--rope-scaling", '{"rope_type": "dynamic", "factor": 2}'], "dynamic"),
])
def test_init_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str],
                                  message: str) -> None:
    code, _out, err = run(capsys, "model", "init", str(tmp_path / "m"), "--layers", "1", "--kv-heads", "2",
                          "--head-dim", "8", *argv)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1


def test_init_refuses_to_overwrite_and_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["model", "init", str(tmp_path / "m"), "--layers", "1", "--kv-heads", "1", "--head-dim", "8"]
    assert run(capsys, *args)[0] == 0
    code, _out, err = run(capsys, *args)
    assert code == 1 and "--force" in err
    assert run(capsys, "model", "init", str(tmp_path / "x"), "--layers", "1", "--kv-heads", "1",
               "--head-dim", "7")[0] == 2
    code, _out, err = run(capsys, "model", "descriptor", str(tmp_path / "none"), "--block-tokens", "4")
    assert code == 1 and ("does not exist" in err or "cannot read" in err)


def test_add_commands_hooks_into_any_parser() -> None:
    parser = argparse.ArgumentParser(prog="kvsp-quic")
    cli_model.add_commands(parser.add_subparsers())
    args = parser.parse_args(["model", "descriptor", "DIR", "--block-tokens", "8"])
    assert args.handler is cli_model.cmd_model_descriptor and args.block_tokens == 8


def test_init_and_descriptor_work_without_torch(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.modules['safetensors'] = None; "
            "sys.modules['tokenizers'] = None\n"
            "from kvsp_app.cli_model import main\n"
            f"assert main(['model', 'init', {str(tmp_path / 'm')!r}, '--layers', '1', '--kv-heads', '1', "
            "'--head-dim', '8']) == 0\n"
            f"assert main(['model', 'descriptor', {str(tmp_path / 'm')!r}, '--block-tokens', '4']) == 0\n"
            f"assert main(['model', 'generate', {str(tmp_path / 'm')!r}, '--prompt', 'x']) == 1\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "needs torch" in done.stderr


def test_generate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
    pytest.importorskip("safetensors", reason="the gpu extra (safetensors) is not installed")
    assert run(capsys, "model", "init", str(tmp_path / "m"), "--layers", "2", "--kv-heads", "2",
               "--head-dim", "16")[0] == 0
    outs = []
    for _ in range(2):
        code, out, err = run(capsys, "model", "generate", str(tmp_path / "m"), "--prompt", "Hello, KVSP!",
                             "--max-tokens", "5", "--method", "top-p", "--p", "0.9", "--seed", "4",
                             "--block-tokens", "4")
        assert code == 0, err
        outs.append(json.loads(out))
    assert outs[0] == outs[1] and outs[0]["prompt_tokens"] == 12 and len(outs[0]["tokens"]) == 5
    assert outs[0]["sampler"] == {"method": "top-p", "seed": 4, "step": 5, "deterministic": False,
                                  "params": {"p": 0.9, "temperature": 1.0}}
    code, _out, err = run(capsys, "model", "generate", str(tmp_path / "m"), "--prompt", "x", "--device", "cuda:7")
    assert code == 1 and ("use --device cpu" in err or "CUDA device" in err)
