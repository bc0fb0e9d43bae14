"""kvsp_vllm.layouts against vLLM's own kernel and transformers' KV (issue 27 point 2): vLLM's
``cpu_attn_reshape_and_cache`` writes the KV that transformers computes for a prompt into its paged CPU cache (fp32,
bf16 and fp16 with the vec ISA, bf16 with AMX's packing); every block read back is the kvsp-layout-1 section of
transformers' cache, octet for octet, and every block written from those sections rebuilds vLLM's cache exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.peers import needs_peer, vllm_missing
from tests.support.vllm_runs import BLOCK, run_driver, write_vllm_model

pytestmark = needs_peer(vllm_missing())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vllm_model(tmp_path_factory.mktemp("vllm-model"))


def test_paged_cpu_layouts_round_trip_transformers_kv_exactly(model: Path) -> None:
    result = run_driver("layouts", {"model": str(model), "block": BLOCK})
    assert result == {name: {"read": True, "written": True} for name in ("fp32-vec", "bf16-vec", "bf16-amx",
                                                                          "fp16-vec")}
