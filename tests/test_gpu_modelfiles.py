"""gpu/modelfiles.py (no torch): config.json, the random model writer, the descriptor, the byte-level tokenizer."""

from __future__ import annotations

import itertools
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from gpu.modelfiles import (
    ByteTokenizer,
    ModelConfig,
    ModelError,
    byte_level_tokenizer_json,
    derive_descriptor,
    load_tokenizer,
    write_random_model,
)
from kvsp_quic.compat import CompatDescriptor, DescriptorError, model_digest, tokenizer_digest

LLAMA31 = {  # the members of Llama 3.1 8B's config.json that matter here
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def tiny(**changes: Any) -> ModelConfig:
    base: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256, head_dim=8)
    base.update(changes)
    return ModelConfig(**base)


def test_a_hugging_face_llama_config() -> None:
    config = ModelConfig.from_json(LLAMA31)
    assert (config.head_dim, config.kv_groups, config.dtype) == (128, 4, "bfloat16")
    assert config.scaling_type == "llama3" and config.eos_token_id == (128001, 128008, 128009)
    assert config.positional() == "rope;theta=500000,scaling=llama3"
    assert ModelConfig.from_json(config.to_json()) == config  # our config.json reads back the same
    plain = ModelConfig.from_json({**LLAMA31, "rope_scaling": None, "rope_theta": 10000})
    assert plain.positional() == "rope;theta=10000" and plain.scaling_type is None
    # transformers >= 5 writes theta and scaling under "rope_parameters"
    v5 = {k: v for k, v in LLAMA31.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA31["rope_scaling"]}
    assert ModelConfig.from_json(v5).positional() == "rope;theta=500000,scaling=llama3"
    v5["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    assert ModelConfig.from_json(v5).positional() == "rope;theta=10000"
    assert ModelConfig.from_json({**LLAMA31, "rope_scaling": {"type": "linear", "factor": 2}}).scaling_type == "linear"


@pytest.mark.parametrize(("changes", "match"), [
    ({"model_type": "mistral"}, "model_type"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 5}, "multiple"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"hidden_size": "4096"}, "integer"),
    ({"torch_dtype": "int8"}, "dtype"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_configs_are_refused(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        ModelConfig.from_json({**LLAMA31, **changes})
    assert issubclass(ModelError, DescriptorError)


def test_theta_must_be_an_integer_for_the_registry() -> None:
    with pytest.raises(ModelError, match="integer"):
        tiny(rope_theta=10000.5).positional()


def test_random_models_are_reproducible(tmp_path: Path) -> None:
    a = write_random_model(tmp_path / "a", tiny(), seed=3)
    b = write_random_model(tmp_path / "b", tiny(), seed=3)
    c = write_random_model(tmp_path / "c", tiny(), seed=4)
    assert sorted(p.name for p in a.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert model_digest(a) == model_digest(b) != model_digest(c)
    with pytest.raises(ModelError, match="vocab_size >= 256"):
        write_random_model(tmp_path / "d", tiny(vocab_size=100))


def test_the_safetensors_layout(tmp_path: Path) -> None:
    root = write_random_model(tmp_path / "m", tiny(dtype="bfloat16", tie_word_embeddings=True), seed=1)
    data = (root / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    assert size % 8 == 0
    header = json.loads(data[8:8 + size])
    assert header.pop("__metadata__") == {"format": "pt"}
    assert "lm_head.weight" not in header  # tied
    spans = sorted(tuple(entry["data_offsets"]) for entry in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] == len(data) - 8 - size
    k_proj = header["model.layers.1.self_attn.k_proj.weight"]
    assert (k_proj["dtype"], k_proj["shape"]) == ("BF16", [16, 32])  # (kv_heads x head_dim, hidden)
    assert k_proj["data_offsets"][1] - k_proj["data_offsets"][0] == 16 * 32 * 2


def test_the_descriptor_of_a_model_directory(tmp_path: Path) -> None:
    config = tiny(rope_theta=500000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0}, dtype="bfloat16")
    root = write_random_model(tmp_path / "tiny-llama", config, seed=2)
    d = derive_descriptor(root, 16)
    assert d.to_json() == {
        "model": "tiny-llama", "model_digest": model_digest(root),
        "tokenizer_digest": tokenizer_digest(root / "tokenizer.json"), "layers": 2, "kv_heads": 2, "head_dim": 8,
        "kv_dtype": "bf16", "positional": "rope;theta=500000,scaling=yarn", "block_tokens": 16,
        "layout": "kvsp-layout-1"}
    assert CompatDescriptor.from_json(d.to_json()).compat_id == d.compat_id
    assert derive_descriptor(root, 16, name="org/tiny", kv_dtype="fp8-e4m3").kv_dtype == "fp8-e4m3"
    assert derive_descriptor(root, 16, name="org/tiny").model == "org/tiny"
    assert derive_descriptor(root, 32).compat_id != d.compat_id
    with pytest.raises(ModelError, match="Element Types"):
        derive_descriptor(root, 16, kv_dtype="int8")
    (root / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"tokenizer\.json"):
        derive_descriptor(root, 16)
    with pytest.raises(ModelError, match="cannot read"):
        derive_descriptor(tmp_path / "nowhere", 16)


TEXTS = ["", "hello world", "héllo wörld\n\x00\t  spaces  ", "日本語のテキスト 🙂", "".join(map(chr, range(1, 300)))]


def test_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode()) and tok.decode(ids) == text


def test_the_tokenizer_json_loads_in_tokenizers_and_agrees_with_the_fallback(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="the gpu extra (tokenizers) is not installed")
    root = write_random_model(tmp_path / "m", tiny())
    hf = load_tokenizer(root)
    assert type(hf).__name__ == "HfTokenizer" and hf.vocab_size == 256
    for text in TEXTS:
        ids = hf.encode(text)
        assert ids == ByteTokenizer().encode(text)
        assert hf.decode(ids) == text


def test_without_tokenizers_our_definition_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_random_model(tmp_path / "m", tiny())
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    assert isinstance(load_tokenizer(root), ByteTokenizer)
    (root / "tokenizer.json").write_text(byte_level_tokenizer_json().replace('"merges": []', '"merges": ["a b"]'))
    with pytest.raises(ModelError, match="tokenizers"):
        load_tokenizer(root)
    (root / "tokenizer.json").unlink()
    assert isinstance(load_tokenizer(root), ByteTokenizer)
