"""Tiny random-weights models written by transformers itself (needs torch and transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the test extra (transformers) is not installed")

VOCAB = 300
CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}


def write_hf_model(root: Path, family: str = "llama", *, heads: int = 4, kv_heads: int = 2, layers: int = 3,
                   dtype: str = "float32", seed: int = 0, **extra: Any) -> Path:
    """A tiny random-weights model written by transformers (``save_pretrained``: config.json, model.safetensors)
    with a real tokenizer (a WordLevel ``tokenizers`` model trained here, saved by ``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    settings: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=VOCAB,
                                    head_dim=16, max_position_embeddings=256, rope_theta=500000.0)
    if family == "mistral":
        settings["sliding_window"] = None
    settings.update(extra)
    config = getattr(transformers, CONFIGS[family])(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, CONFIGS[family].replace("Config", "ForCausalLM"))(config)
    with torch.no_grad():  # larger than the default init: logits that differ between tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif p.dim() == 1 and p.shape[0] != config.hidden_size:
                p.normal_(0.0, 0.05)  # biases
    model.to(getattr(torch, dtype)).save_pretrained(root, safe_serialization=True)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran to the cat"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(root)
    return root
