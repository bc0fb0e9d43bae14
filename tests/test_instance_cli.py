"""``kvsp-quic instance``: one line for a missing GPU, the ready line of ``--dev``, configuration."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpu.modelfiles import ModelConfig, write_random_model
from http3.client import KvspClient
from kvsp_app.config import ConfigError, InstanceFile, load
from quic.tls import TlsFiles
from tests.helpers import Process
from tests.helpers import run_cli as run

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256, head_dim=16)
    return write_random_model(tmp_path_factory.mktemp("model") / "tiny", config, seed=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_without_cuda_is_one_line_pointing_to_the_cpu(capsys: pytest.CaptureFixture[str], model_dir: Path,
                                                         tmp_path: Path) -> None:
    code, out, err = run(capsys, "instance", "--gpu", "0", "--model", str(model_dir), "--dev", str(tmp_path))
    assert code == 1 and out == ""
    assert err == "kvsp-quic: error: cuda:0: CUDA is not available on this machine (use --device cpu)\n"
    assert not (tmp_path / "ca.pem").exists()  # nothing was started


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _out, err = run(capsys, "instance", "--device", "cpu", "--dev", str(tmp_path))
    assert code == 1 and "--model DIR" in err and err.count("\n") == 1
    code, _out, err = run(capsys, "instance", "--gpu", "0", "--device", "cpu")
    assert code == 2 and "not allowed with" in err


def test_the_configuration_file(tmp_path: Path) -> None:
    path = tmp_path / "instance.toml"
    path.write_text('[instance]\nmodel = "models/tiny"\ndevice = "cuda:1"\nblock_tokens = 256\n'
                    'scope_keys = ["keys/a.key"]\ncontroller = "https://pc.example/kvsp/"\n'
                    '[[instance.links]]\nholder = "https://h1.example/"\nmbit_per_s = 400000\n')
    cfg = load(InstanceFile, path)
    assert cfg.instance.model == tmp_path / "models/tiny" and cfg.instance.scope_keys == [tmp_path / "keys/a.key"]
    assert cfg.instance.block_tokens == 256 and cfg.instance.links[0].mbit_per_s == 400000.0
    path.write_text('[instance]\ncheckpoint_tokens = 65\n')
    with pytest.raises(ConfigError, match="at most 64"):
        load(InstanceFile, path)
    path.write_text('[instance]\ncontroler = "x"\n')
    with pytest.raises(ConfigError, match="unknown key"):
        load(InstanceFile, path)


async def test_dev_instance_starts_prints_its_ready_line_and_serves(model_dir: Path, tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    proc = await asyncio.to_thread(Process, "instance", "--dev", str(dev), "--device", "cpu", "--model",
                                   str(model_dir), "--block-tokens", "4", "--warmup-tokens", "8")
    try:
        ready = proc.ready
        assert ready["ready"] == "instance" and ready["base_uri"].startswith("https://127.0.0.1:")
        assert ready["device"] == "cpu" and ready["descriptor"]["block_tokens"] == 4
        assert ready["moqt"] == ready["base_uri"].replace("https://", "moqt://")
        assert ready["scope_key"] == str(dev / "scope.key") and len(ready["scope_ids"]) == 1
        assert ready["epoch"] > 1_600_000_000_000  # its start time in ms since the Unix epoch
        files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
        async with KvspClient(files, timeout=10) as client:
            r = await client.request("GET", f"{ready['base_uri']}status")
            assert r.status == 200, r.content
            status = r.json()
            assert status["instance"] == ready["base_uri"] and status["epoch"] == ready["epoch"]
            assert status["state"] == "active" and status["prefill_tokens_per_s"] > 0
    finally:
        err = proc.stop(15)  # (and nothing more on stdout)
    assert proc.proc.returncode == 0, err
    assert "Traceback" not in err
