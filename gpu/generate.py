"""Decoding after the prefill: one token at a time against the paged cache, greedy or top-p.

    result = await prefill(model, cache, prompt, blocks)
    out = generate_tokens(model, result, TokenSampler("greedy"), max_new_tokens=16)
    result.sequence.release()

A decode step is the prefill's layer step for a chunk of one token at position N, attending over the
sequence's pages gathered per layer; two sequences with equal cache contents therefore decode identically.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from gpu.kvcache import SequenceKV
from gpu.model import StepModel
from gpu.prefill import Chunk, PrefillResult, run_layer
from gpu.sampling import TokenSampler


def decode_step(model: StepModel, seq: SequenceKV, token: int) -> torch.Tensor:
    """Append *token* to *seq* (its K and V go to the cache) and return the float32 logits (vocab,) for the
    position after it."""
    cache = seq.cache
    b = cache.block_tokens
    n = seq.tokens
    seq.reserve(n + 1)
    for page in seq.pages:
        if page.complete:  # a page of another request may have been moved to the host meanwhile
            cache.ensure_device(page)
    k_ctx, v_ctx = model.new_context(len(seq.pages) * b)
    chunk = Chunk(n, n + 1, model.embed([token]))
    earlier = list(range(-(-n // b)))  # pages holding tokens [0, n)
    for layer in range(model.num_layers):
        run_layer(model, seq, layer, [chunk], k_ctx, v_ctx, earlier)
    seq.tokens = n + 1
    return model.logits(chunk.hidden)[0]


@dataclass
class Generation:
    tokens: list[int]  # the generated tokens
    logits: torch.Tensor | None  # the logits after the last token, when it was decoded
    stopped: bool  # a stop token ended it


def generate_tokens(model: StepModel, prefilled: PrefillResult, sampler: TokenSampler, *, max_new_tokens: int,
                    stop_tokens: Collection[int] = (),
                    on_token: Callable[[int], None] | None = None) -> Generation:
    """Sample up to *max_new_tokens* tokens after a prefill (its sequence grows; release it afterwards).

    *stop_tokens* and the sampler's ``stop_token_ids`` end it (the stop token is the last one).
    The token after the last one is not decoded (nothing needs its logits), so a later continuation starts
    with :func:`decode_step` of the last generated token.
    """
    if prefilled.logits.dim() != 1:
        raise ValueError("generation needs the prefill's last-token logits (all_logits=False)")
    logits: torch.Tensor | None = prefilled.logits
    out: list[int] = []
    stopped = False
    for i in range(max_new_tokens):
        assert logits is not None
        token = sampler.sample(logits)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token in stop_tokens or token in sampler.stop_token_ids:
            stopped = True
            logits = None
            break
        logits = decode_step(model, prefilled.sequence, token) if i + 1 < max_new_tokens else None
    return Generation(out, logits, stopped)
