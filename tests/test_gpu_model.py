"""gpu/model.py and gpu/rope.py: loading, the layer step, grouped-query attention, RoPE scaling."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the gpu extra (safetensors) is not installed")

import torch.nn.functional as F  # noqa: E402

from gpu.kvcache import PagedKVCache  # noqa: E402
from gpu.model import LlamaModel, chunk_bounds  # noqa: E402
from gpu.modelfiles import ModelConfig, ModelError, write_random_model  # noqa: E402
from gpu.prefill import prefill_sync  # noqa: E402
from gpu.rope import SEGMENT, RotaryTable, inv_freq_and_scale  # noqa: E402

PROMPT = [(5 * i + 1) % 256 for i in range(40)]


def config(**changes: Any) -> ModelConfig:
    base: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256, head_dim=16, max_position_embeddings=64)
    base.update(changes)
    return ModelConfig(**base)


def cache_for(model: LlamaModel, block_tokens: int = 8) -> PagedKVCache:
    return PagedKVCache(layers=model.num_layers, kv_heads=model.kv_heads, head_dim=model.head_dim,
                        block_tokens=block_tokens, kv_dtype=model.kv_dtype_name, device=model.device,
                        device_pages=16)


def logits(model: LlamaModel, tokens: list[int], chunk: int = 8) -> Any:
    return prefill_sync(model, cache_for(model), tokens, all_logits=True, chunk_tokens=chunk).logits


def test_loading_and_weights(tmp_path: Path) -> None:
    root = write_random_model(tmp_path / "m", config(), seed=1)
    model = LlamaModel.load(root)
    assert (model.num_layers, model.heads, model.kv_heads, model.n_rep) == (3, 4, 2, 2)
    assert model.dtype is torch.float32 and model.kv_dtype_name == "fp32" and model.lm_head is not model.embed_tokens
    assert model.layers[0].qkv.shape == (64 + 2 * 32, 64) and model.layers[0].gate_up.shape == (256, 64)
    assert model.descriptor(8).layers == 3 and model.tokenizer.encode("ab") == [97, 98]
    bf = LlamaModel.load(root, dtype="bf16")
    assert bf.dtype is torch.bfloat16 and bf.kv_dtype_name == "bf16"
    tied = LlamaModel.load(write_random_model(tmp_path / "t", config(tie_word_embeddings=True)))
    assert tied.lm_head is tied.embed_tokens
    with pytest.raises(ModelError, match="compute dtype"):
        LlamaModel.load(root, dtype="int8")
    with pytest.raises(ModelError, match="does not exist"):
        LlamaModel.load(tmp_path / "none")


def test_missing_or_misshapen_weights_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    root = write_random_model(tmp_path / "m", config(), seed=1)
    weights = load_file(str(root / "model.safetensors"))
    c = ModelConfig.load(root)
    broken = dict(weights)
    del broken["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ModelError, match=r"model\.layers\.2\.mlp\.up_proj\.weight.*missing"):
        LlamaModel(c, broken)
    broken = dict(weights, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ModelError, match="shape"):
        LlamaModel(c, broken)
    del weights["lm_head.weight"]
    with pytest.raises(ModelError, match="lm_head"):
        LlamaModel(c, weights)


def test_chunking_changes_only_rounding_and_identical_chunks_are_identical(tmp_path: Path) -> None:
    model = LlamaModel.load(write_random_model(tmp_path / "m", config(), seed=2))
    a = logits(model, PROMPT, chunk=8)
    assert torch.equal(a, logits(model, PROMPT, chunk=8))
    for chunk in (1, 5, 40):
        assert torch.allclose(a, logits(model, PROMPT, chunk=chunk), atol=1e-4, rtol=1e-4)
    assert chunk_bounds(5, 21, 8) == [(5, 8), (8, 16), (16, 21)] and chunk_bounds(0, 0, 8) == []


def test_grouped_query_attention_equals_repeated_heads(tmp_path: Path) -> None:
    model = LlamaModel.load(write_random_model(tmp_path / "m", config(num_attention_heads=8), seed=3))
    g = torch.Generator().manual_seed(0)
    n, start = 5, 7
    q = torch.randn(n, 8, 16, generator=g)
    k = torch.randn(start + n, 2, 16, generator=g)
    v = torch.randn(start + n, 2, 16, generator=g)
    out = model.attention(q, k, v, start)
    # the textbook form: K and V repeated per query head, causal softmax over [0, position]
    kr = k.repeat_interleave(4, dim=1).permute(1, 0, 2)
    vr = v.repeat_interleave(4, dim=1).permute(1, 0, 2)
    scores = q.permute(1, 0, 2) @ kr.transpose(1, 2) / math.sqrt(16)
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    want = (F.softmax(scores, dim=-1) @ vr).permute(1, 0, 2).reshape(n, 8 * 16)
    assert torch.allclose(out, want, atol=1e-5)


def test_rope_table_values_do_not_depend_on_how_it_grew() -> None:
    c = config(max_position_embeddings=64)
    small, big = RotaryTable(c, torch.device("cpu"), torch.float32), RotaryTable(c, torch.device("cpu"), torch.float32)
    cos_a, sin_a = small.get(10, 12)
    cos_b, sin_b = big.get(SEGMENT + 5, SEGMENT + 6)  # grows two segments at once
    assert torch.equal(cos_a, big.get(10, 12)[0]) and torch.equal(sin_a, big.get(10, 12)[1])
    assert torch.equal(small.get(SEGMENT + 5, SEGMENT + 6)[0], cos_b) and sin_b.shape == (1, 16)
    pos = torch.tensor(10.0)
    assert torch.allclose(cos_a[0, :8], torch.cos(pos * small.inv_freq)) and torch.equal(cos_a[0, :8], cos_a[0, 8:])


def test_rope_scaling_methods() -> None:
    base, _ = inv_freq_and_scale(config(rope_theta=10000.0))
    assert torch.allclose(base, 1 / 10000 ** (torch.arange(0, 16, 2) / 16))
    linear, scale = inv_freq_and_scale(config(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert torch.equal(linear, base / 2) and scale == 1.0
    llama3, _ = inv_freq_and_scale(config(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}))
    wavelen = 2 * math.pi / base
    high = wavelen < 64 / 4  # short wavelengths are kept, long ones divided by the factor
    low = wavelen > 64 / 1
    assert torch.equal(llama3[high], base[high]) and torch.allclose(llama3[low], base[low] / 8)
    assert bool(((llama3 <= base) & (llama3 >= base / 8)).all())
    yarn, attention = inv_freq_and_scale(config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 16}))
    assert attention == pytest.approx(0.1 * math.log(4.0) + 1)
    assert torch.allclose(yarn[0], base[0]) and torch.allclose(yarn[-1], base[-1] / 4)
    _, given = inv_freq_and_scale(config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5}))
    assert given == 1.5


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tmp_path: Path, scaling: dict[str, Any] | None, tied: bool) -> None:
    """Against transformers' LlamaForCausalLM on the same files (runs where transformers is installed)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    root = write_random_model(tmp_path / "m", config(rope_theta=500000.0, rope_scaling=scaling,
                                                     tie_word_embeddings=tied), seed=5)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(root), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    got = logits(LlamaModel.load(root), PROMPT, chunk=len(PROMPT))
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
