"""gpu/hf_engine.py: the transformers engine on model directories written by transformers itself (save_pretrained,
safetensors, a trained tokenizer.json), one descriptor whichever engine loads a directory, and refusals of what the
descriptor's registry cannot describe."""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the test extra (transformers) is not installed")

from gpu.engine import Engine  # noqa: E402
from gpu.hf_engine import HfModel, blocks_from_dynamic_cache, dynamic_cache_from_blocks  # noqa: E402
from gpu.kvcache import PagedKVCache  # noqa: E402
from gpu.modelfiles import ModelError, derive_descriptor  # noqa: E402
from gpu.prefill import prefill, prefill_sync, preloaded  # noqa: E402
from kvsp_quic.compat import CompatDescriptor  # noqa: E402
from kvsp_quic.container import DecodedLayer  # noqa: E402
from tests.support.hf_model import VOCAB, write_hf_model  # noqa: E402

B = 4
PROMPT = [(7 * i + 3) % VOCAB for i in range(6 * B + 3)]  # six complete blocks and three tokens


def hf_logits(root: Path, tokens: list[int], dtype: Any = None) -> Any:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype or torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def full_and_loaded(engine: Engine, tokens: list[int], blocks: int) -> tuple[Any, Any]:
    """The engine's last-token logits computing everything, then with its first *blocks* blocks loaded from a
    copy of its own pages (streamed layer by layer)."""
    async def run() -> tuple[Any, Any]:
        full = await engine.prefill(tokens)
        sections = [engine.page_sections(p) for p in full.sequence.pages[:blocks]]
        logits = full.logits
        full.sequence.release()
        sources = [preloaded(DecodedLayer(i, (memoryview(k),), (memoryview(v),), None) for i, (k, v) in enumerate(s))
                   for s in sections]
        loaded = await engine.prefill(tokens, sources)
        assert loaded.loaded_blocks == list(range(blocks)) and loaded.computed_from == blocks * B
        out = loaded.logits
        loaded.sequence.release()
        return logits, out

    return asyncio.run(run())


# -- one descriptor -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_engines_and_the_cli_derive_one_descriptor(tmp_path: Path, dtype: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from kvsp_app.cli import main

    root = write_hf_model(tmp_path / "m", dtype=dtype, tie_word_embeddings=True)
    ref = Engine.load(str(root), block_tokens=B, device_pages=16)
    hf = Engine.load(str(root), block_tokens=B, device_pages=16, engine="transformers")
    try:
        assert ref.name == "reference" and hf.name == "transformers"
        assert ref.descriptor == hf.descriptor == derive_descriptor(root, B)
        assert hf.descriptor.kv_dtype == {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        assert hf.build.startswith(f"transformers/{transformers.__version__} ") and ref.build.startswith("reference/")
        assert main(["model", "descriptor", str(root), "--block-tokens", str(B)]) == 0
        assert CompatDescriptor.from_json(json.loads(capsys.readouterr().out)) == hf.descriptor
    finally:
        ref.close()
        hf.close()


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_families_get_their_descriptor_and_the_reference_engine_refuses_in_one_line(
        tmp_path: Path, family: str) -> None:
    root = write_hf_model(tmp_path / family, family)
    hf = Engine.load(str(root), block_tokens=B, device_pages=16, engine="transformers")
    try:
        assert hf.descriptor == derive_descriptor(root, B) and hf.descriptor.kv_heads == 2
    finally:
        hf.close()
    with pytest.raises(ModelError, match=f"model_type '{family}' is not supported by the reference engine.*"
                                         "--engine transformers") as info:
        Engine.load(str(root), block_tokens=B)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("change", "match"), [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not in the descriptor's registry"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 10000.0}}, "longrope"),
    ({"dtype": "float64"}, "dtype 'float64'"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_what_the_registry_cannot_describe_is_refused_by_both_engines_in_one_line(
        tmp_path: Path, change: dict[str, Any], match: str) -> None:
    root = write_hf_model(tmp_path / "m")
    path = root / "config.json"
    config = json.loads(path.read_text())
    config.update(change)
    path.write_text(json.dumps(config))
    for engine in ("reference", "transformers"):
        with pytest.raises(ModelError, match=match) as info:
            Engine.load(str(root), block_tokens=B, engine=engine)
        assert "\n" not in str(info.value)
    with pytest.raises(ModelError, match=match):
        derive_descriptor(root, B)


def test_an_unknown_engine_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="engine 'vllm' is not one of reference, transformers"):
        Engine.load(str(tmp_path), engine="vllm")


# -- the engine's computation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "extra"), [
    ("llama", {}),
    ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    ("llama", {"num_key_value_heads": 4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 16}}),
    ("mistral", {"sliding_window": 10}),
    ("qwen2", {}),
])
def test_the_engine_matches_transformers_and_a_loaded_prefix_is_bit_identical(
        tmp_path: Path, family: str, extra: dict[str, Any]) -> None:
    kv_heads = extra.pop("num_key_value_heads", 2)
    root = write_hf_model(tmp_path / "m", family, kv_heads=kv_heads, **extra)
    engine = Engine.load(str(root), block_tokens=B, device_pages=64, engine="transformers")
    try:
        model = engine.model
        assert isinstance(model, HfModel) and model.tokenizer is not None
        assert model.tokenizer.convert_tokens_to_ids("cat") < VOCAB
        got = prefill_sync(model, PagedKVCache.for_descriptor(engine.descriptor, device_pages=64), PROMPT,
                           all_logits=True).logits
        want = hf_logits(root, PROMPT)
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
        full, loaded = full_and_loaded(engine, PROMPT, 6)
        assert torch.equal(full, loaded)  # the same layer steps on the same operands
    finally:
        engine.close()


def test_dynamic_cache_conversion_both_ways(tmp_path: Path) -> None:
    """transformers' own forward and DynamicCache: its cache as kvsp-layout-1 blocks equals what the engines
    publish (within rounding), and blocks the reference engine computed, loaded into a DynamicCache, continue
    transformers' forward to the logits of a full run."""
    root = write_hf_model(tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32).eval()
    ref = Engine.load(str(root), block_tokens=B, device_pages=64)
    d = ref.descriptor
    try:
        with torch.no_grad():
            out = hf(torch.tensor([PROMPT]), use_cache=True)
        cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        ours = blocks_from_dynamic_cache(getattr(out, cache_kw), d)
        assert len(ours) == len(PROMPT) // B and all(len(b) == d.layers for b in ours)
        result = asyncio.run(ref.prefill(PROMPT))
        theirs = [ref.page_sections(p) for p in result.sequence.pages[:6]]
        result.sequence.release()
        for a, b in zip(ours, theirs, strict=False):
            for (ka, va), (kb, vb) in zip(a, b, strict=True):
                for x, y in ((ka, kb), (va, vb)):
                    tx = torch.frombuffer(bytearray(x), dtype=torch.float32)
                    ty = torch.frombuffer(bytearray(y), dtype=torch.float32)
                    assert torch.allclose(tx, ty, atol=1e-5), (tx - ty).abs().max()
        cache = dynamic_cache_from_blocks(theirs, d)
        assert cache.get_seq_length() == 6 * B
        with torch.no_grad():
            rest = hf(torch.tensor([PROMPT[6 * B:]]), **{cache_kw: cache},
                      position_ids=torch.arange(6 * B, len(PROMPT)).unsqueeze(0)).logits[0]
        full = out.logits[0, 6 * B:]
        assert torch.allclose(rest, full, atol=1e-5, rtol=0), (rest - full).abs().max()
    finally:
        ref.close()


def test_kv_dtype_rounding_is_what_attention_uses(tmp_path: Path) -> None:
    root = write_hf_model(tmp_path / "m")
    engine = Engine.load(str(root), block_tokens=B, device_pages=64, engine="transformers", kv_dtype="bf16")
    try:
        assert engine.descriptor.kv_dtype == "bf16" and engine.descriptor != derive_descriptor(root, B)
        full, loaded = full_and_loaded(engine, PROMPT, 6)
        assert torch.equal(full, loaded)
        want = hf_logits(root, PROMPT)[-1]
        assert (full - want).abs().max() < 0.05  # bf16 K/V: close to the fp32 run, not equal
    finally:
        engine.close()


def test_a_streamed_prefill_starts_layer_l_once_layer_l_of_every_block_arrived(tmp_path: Path) -> None:
    """Layer streaming: the first layer step runs before the last layer of the loaded blocks arrives."""
    root = write_hf_model(tmp_path / "m", layers=4)
    engine = Engine.load(str(root), block_tokens=B, device_pages=64, engine="transformers")

    async def run() -> list[tuple[str, int | None, int | None]]:
        full = await engine.prefill(PROMPT)
        sections = engine.page_sections(full.sequence.pages[0])
        full.sequence.release()
        gate = asyncio.Event()

        async def source() -> Any:
            for i, (k, v) in enumerate(sections):
                if i == 2:
                    await gate.wait()
                yield DecodedLayer(i, (memoryview(k),), (memoryview(v),), None)

        from gpu.prefill import PrefillTrace

        trace = PrefillTrace()
        task = asyncio.create_task(prefill(engine.model, engine.cache, PROMPT[:B + 2], [source()], trace=trace,
                                           executor=engine.executor))
        while not any(e.kind == "end" and e.layer == 1 for e in trace.events):
            await asyncio.sleep(0.01)
        gate.set()
        result = await task
        result.sequence.release()
        return trace.order()

    try:
        order = asyncio.run(run())
        assert order.index(("end", 1, None)) < order.index(("arrive", 2, 0))
    finally:
        engine.close()
