"""vLLM for the connector's tests: the tiny model vLLM's CPU kernels take, and the driver script run in
``.venv-vllm`` (tests/peers.py's VLLM_PYTHON; vLLM is never imported in the test process)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.peers import ROOT, VLLM_PYTHON

DRIVER = ROOT / "tests" / "support" / "vllm_driver.py"
BLOCK = 32  # vLLM's CPU attention takes block sizes that are multiples of 32


def write_vllm_model(root: Path) -> Path:
    """A tiny random-weights Llama written by transformers: hidden 256, 4 layers, 4 heads / 2 KV heads of 64 (a head
    size vLLM's CPU kernels take), room for 2048 positions."""
    from tests.support.hf_model import write_hf_model

    return write_hf_model(root, layers=4, heads=4, kv_heads=2, hidden_size=256, intermediate_size=512, head_dim=64,
                          max_position_embeddings=2048)


def run_driver(command: str, args: dict[str, Any], *, timeout: float = 240) -> dict[str, Any]:
    """``vllm_driver.py COMMAND JSON`` in .venv-vllm: the JSON object of its last output line."""
    env = dict(os.environ, PYTHONPATH=os.fspath(ROOT), HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
               TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([os.fspath(VLLM_PYTHON), os.fspath(DRIVER), command, json.dumps(args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"vllm_driver {command}: rc {done.returncode}\n{done.stderr[-30000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result
