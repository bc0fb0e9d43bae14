"""A resumed session whose generated block cannot be loaded (issue 26, point 1).

A resume loads the checkpoint's prompt blocks and the *generated* blocks published before, and recomputes the
rest exactly as the first instance computed it: the prompt's tail as the prefill chunk that computed it, each
generated token as a decode step (docs/inference.md, "Resume"). A generated block whose source fails during the
resume's prefill (its holder or relay dies: "block 26: its source ended after 0 of 2 layers; it is recomputed")
used to be recomputed as one chunk of 16 rows -- but its K and V were first computed by a prefill chunk of the
prompt's tail and then one decode step per token, and a matrix product's rows depend on how many rows it has on
the CPU. The K and V, and every later logit, then differed by ~1e-6 from the first run's: a seeded top-p or greedy
choice near a tie picks another token, and the resumed stream differs from the one the client already holds.

The model is the chaos suite's (2 layers, hidden 128, 2 query heads over 1 KV head of 64, vocabulary 512, blocks of
16), the prompt the chaos suite's shape (a 384-token prefix and a question, 421 tokens: the tail is block 26).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the gpu extra (safetensors) is not installed")

from gpu.engine import Engine  # noqa: E402
from gpu.generate import decode_step  # noqa: E402
from gpu.kvcache import Page, PagedKVCache  # noqa: E402
from gpu.model import LlamaModel  # noqa: E402
from gpu.modelfiles import ModelConfig, write_random_model  # noqa: E402
from gpu.prefill import PrefillTrace, prefill  # noqa: E402
from gpu.sampling import Pick, TokenSampler  # noqa: E402
from kvsp_quic.container import DecodedLayer  # noqa: E402
from kvsp_quic.engine import RunPlan  # noqa: E402

B = 16
PROMPT_LEN = 384 + 37  # the prompt's tail (37 % 16 = 5 tokens) is in block 26
MAX_NEW = 96
CHECKPOINT = 64  # the checkpoint covers this many output tokens
TAIL_BLOCK = PROMPT_LEN // B

SAMPLERS = {
    "greedy": lambda: TokenSampler("greedy"),
    "top-p": lambda: TokenSampler("top-p", params={"p": 0.95, "temperature": 0.9}, seed=1001),
}

Block = list[tuple[bytes, bytes]]


class First:
    """The first run: the prompt prefilled, MAX_NEW tokens sampled and decoded; its blocks and logits kept."""

    def __init__(self, model: LlamaModel, method: str) -> None:
        self.model = model
        self.method = method
        prompt = [(i * 7919 + 13) % 512 for i in range(PROMPT_LEN)]
        cache = new_cache(model)
        result = asyncio.run(prefill(model, cache, prompt))
        sampler = SAMPLERS[method]()
        logits = result.logits
        self.logits: list[Any] = []  # before each output token
        self.output: list[int] = []
        for i in range(MAX_NEW):
            self.logits.append(logits)
            token = sampler.sample(logits)
            self.output.append(token)
            if i + 1 < MAX_NEW:
                logits = decode_step(model, result.sequence, token)
        self.seq = prompt + self.output
        self.blocks: list[Block] = [[(bytes(k), bytes(v)) for k, v in cache.export_block(p)]
                                    for p in result.sequence.pages if p.tokens == B]
        result.sequence.release()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    directory = tmp_path_factory.mktemp("model")
    write_random_model(directory, ModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                                              head_dim=64, name="kvsp-chaos"), seed=1)
    return LlamaModel.load(directory)


@pytest.fixture(scope="module", params=sorted(SAMPLERS))
def first(request: pytest.FixtureRequest, model: LlamaModel) -> First:
    return First(model, request.param)


def new_cache(model: LlamaModel) -> PagedKVCache:
    return PagedKVCache.for_descriptor(model.descriptor(B), device=model.device, device_pages=256)


class Steps(PrefillTrace):
    """A prefill trace that says when each layer step starts (a partly loaded block's source waits for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: dict[int, asyncio.Event] = {}

    def add(self, kind: str, layer: int | None = None, block: int | None = None) -> None:
        super().add(kind, layer, block)
        if kind == "start" and layer is not None:
            self.step(layer).set()

    def step(self, layer: int) -> asyncio.Event:
        return self.started.setdefault(layer, asyncio.Event())


async def source(block: Block, *, stop_at: int | None = None, steps: Steps | None = None
                 ) -> AsyncIterator[DecodedLayer]:
    """The block's layers; with *stop_at* the source ends before that layer -- at once for layer 0 (nothing of the
    block arrives), else once the prefill has started the layer before it (a partly loaded block, caught up)."""
    for index, (k, v) in enumerate(block):
        if index == stop_at:
            if index > 0 and steps is not None:
                await asyncio.wait_for(steps.step(index - 1).wait(), 60)
            return
        yield DecodedLayer(index, (memoryview(k),), (memoryview(v),), None)


def resume_inputs(first: First, failed: int, layers_in: int, steps: Steps | None = None
                  ) -> tuple[list[int], list[Any], list[int]]:
    """A resume at the checkpoint, as kvsp_runtime/instance_runs.py plans it: every complete block loaded (the
    prompt's and the generated ones), the token after them computed, the rest replayed; block *failed*'s source
    ends after *layers_in* layers."""
    known = PROMPT_LEN + CHECKPOINT - 1  # the K and V the first run had computed at the checkpoint
    usable = known // B
    end = usable * B + 1
    blocks: list[Any] = [source(first.blocks[i], stop_at=layers_in if i == failed else None, steps=steps)
                         for i in range(usable)]
    return first.seq[:end], blocks, first.seq[end:PROMPT_LEN + CHECKPOINT]


@pytest.mark.parametrize("failed", [TAIL_BLOCK - 1, TAIL_BLOCK, TAIL_BLOCK + 2])
@pytest.mark.parametrize("layers_in", [0, 1])
async def test_a_generated_block_recomputed_in_a_resume_is_computed_as_it_first_was(
        model: LlamaModel, first: First, failed: int, layers_in: int) -> None:
    steps = Steps()
    tokens, blocks, replay = resume_inputs(first, failed, layers_in, steps)
    result = await prefill(model, new_cache(model), tokens, blocks, trace=steps, decoded_from=PROMPT_LEN)
    assert result.recomputed_blocks == [failed]
    logits = result.logits
    for token in replay:
        logits = decode_step(model, result.sequence, token)
    assert torch.equal(logits, first.logits[CHECKPOINT])
    page = result.sequence.pages[failed]
    cache = result.sequence.cache
    assert [(bytes(k), bytes(v)) for k, v in cache.export_block(page)] == first.blocks[failed]
    result.sequence.release()


class Recording(Engine):
    """The engine, with the logits of every sampled token kept."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[Any] = []

    async def sample(self, sampler: TokenSampler, logits: Any) -> Pick:
        self.seen.append(logits.clone())
        return await super().sample(sampler, logits)


class Hooks:
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def prefilled(self, result: Any) -> None:
        pass

    def token(self, token: int, logprobs: Any = None) -> bool:
        self.tokens.append(token)
        return True

    def page_complete(self, page: Page, key: bytes) -> None:
        pass


@pytest.mark.parametrize("failed", [TAIL_BLOCK, TAIL_BLOCK + 1])
async def test_a_resumed_run_whose_generated_block_fails_goes_on_with_the_first_runs_tokens_and_logits(
        model: LlamaModel, first: First, failed: int) -> None:
    engine = Recording(model, new_cache(model), model.descriptor(B))
    try:
        tokens, blocks, replay = resume_inputs(first, failed, 0)
        sampler = SAMPLERS[first.method]()
        sampler.step = CHECKPOINT
        plan: RunPlan[Page] = RunPlan(tokens=tokens, blocks=blocks, keys=[], chain=None, sampler=sampler.record(),
                                      max_new=MAX_NEW - CHECKPOINT, replay=replay,
                                      output=first.output[:CHECKPOINT])
        hooks = Hooks()
        await engine.run(plan, hooks)
    finally:
        engine.close()
    assert hooks.tokens == first.output[CHECKPOINT:]
    assert len(engine.seen) == MAX_NEW - CHECKPOINT
    assert all(torch.equal(a, b) for a, b in zip(engine.seen, first.logits[CHECKPOINT:], strict=True))
