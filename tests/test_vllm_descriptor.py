"""One descriptor for one model, whichever engine (issue 27 point 2): ``kvsp-quic vllm descriptor`` prints what the
vLLM connector derives (kvsp_vllm.descriptor) and what the transformers and reference engines derive for the same
files, block size and KV element type."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpu.modelfiles import derive_descriptor
from kvsp_quic.compat import CompatDescriptor
from tests.support.vllm_runs import BLOCK, write_vllm_model

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vllm_model(tmp_path_factory.mktemp("vllm-model"))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvsp_app", "vllm", "descriptor", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_cli_prints_what_every_engine_derives(model: Path, dtype: str) -> None:
    from gpu.hf_engine import HfModel
    from kvsp_vllm.descriptor import descriptor_of, kv_dtype_of

    done = cli("--model", str(model), "--block-tokens", str(BLOCK), "--dtype", dtype)
    assert done.returncode == 0, done.stderr
    printed = CompatDescriptor.loads(done.stdout)
    connector = descriptor_of(model, BLOCK, kv_dtype_of({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]))
    transformers_engine = HfModel.load(model, kv_dtype=dtype).descriptor(BLOCK)
    assert printed == connector == transformers_engine == derive_descriptor(model, BLOCK, kv_dtype=dtype)
    assert (printed.kv_dtype, printed.block_tokens, printed.layers, printed.kv_heads, printed.head_dim) == \
        (dtype, BLOCK, 4, 2, 64)


def test_bad_input_is_one_line(model: Path, tmp_path: Path) -> None:
    from kvsp_vllm.descriptor import UnsupportedConfig, descriptor_of, kv_dtype_of

    done = cli("--model", str(model), "--block-tokens", "24")
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0 and "multiples of 16" in done.stderr
    done = cli("--model", str(tmp_path / "none"), "--block-tokens", "32")
    assert done.returncode == 1 and "config.json" in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(UnsupportedConfig, match="fp8"):
        kv_dtype_of(torch.float32, "fp8")
    with pytest.raises(UnsupportedConfig, match="not a local directory"):
        descriptor_of("meta-llama/Llama-3-8B", BLOCK, "fp32")
