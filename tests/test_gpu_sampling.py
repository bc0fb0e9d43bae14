"""gpu/sampling.py: greedy and top-p, seeded, checkpointed as the Session Checkpoint's sampler."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")

from gpu.sampling import TokenSampler, uniform  # noqa: E402
from kvsp_quic.records import Sampler, SessionCheckpoint  # noqa: E402


def logits_for(step: int, vocab: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(vocab, generator=g) * 2


def test_greedy_takes_the_argmax_and_counts_steps() -> None:
    s = TokenSampler()
    x = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert s.sample(x) == 1 and s.sample(x) == 1 and s.step == 2
    record = s.record(deterministic=True)
    assert record == Sampler(method="greedy", seed=0, step=2, deterministic=True, params={})


def test_top_p_is_a_function_of_seed_and_step_and_restores_from_a_checkpoint() -> None:
    a = TokenSampler("top-p", params={"p": 0.9, "temperature": 0.8}, seed=7)
    tokens = [a.sample(logits_for(i)) for i in range(20)]
    b = TokenSampler("top-p", params={"p": 0.9, "temperature": 0.8}, seed=7)
    assert [b.sample(logits_for(i)) for i in range(20)] == tokens  # same seed: same tokens
    c = TokenSampler("top-p", params={"p": 0.9, "temperature": 0.8}, seed=8)
    assert [c.sample(logits_for(i)) for i in range(20)] != tokens  # another seed: other tokens
    # checkpoint after 12 tokens, through the JSON of a Session Checkpoint, and resume
    d = TokenSampler("top-p", params={"p": 0.9, "temperature": 0.8}, seed=7)
    for i in range(12):
        d.sample(logits_for(i))
    checkpoint = SessionCheckpoint.from_json({
        "session": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11", "epoch": 1, "compat_id": "00" * 32,
        "scope_id": "00" * 16, "prompt_blocks": [], "prompt_tail": [1], "generated": tokens[:12],
        "output_offset": 12, "sampler": d.record().to_json()})
    resumed = TokenSampler.from_record(checkpoint.sampler)
    assert resumed.step == 12 and resumed.params == {"p": 0.9, "temperature": 0.8}
    assert [resumed.sample(logits_for(i)) for i in range(12, 20)] == tokens[12:]


def test_top_p_keeps_the_nucleus_only() -> None:
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen = {TokenSampler("top-p", params={"p": 0.8}, seed=s).sample(x) for s in range(200)}
    assert seen == {0, 1}  # 0.5 + 0.3 reach p: tokens 2 and 3 are never drawn
    seen = {TokenSampler("top-p", params={"p": 1.0}, seed=s).sample(x) for s in range(400)}
    assert seen == {0, 1, 2, 3}
    assert {TokenSampler("top-p", params={"p": 0.01}, seed=s).sample(x) for s in range(50)} == {0}
    # frequencies follow the renormalised nucleus (0.5 / 0.8 = 0.625)
    draws = [TokenSampler("top-p", params={"p": 0.8}, seed=s).sample(x) for s in range(2000)]
    assert abs(draws.count(0) / 2000 - 0.625) < 0.04


def test_uniform_is_stable_and_in_range() -> None:
    values = [uniform(7, step) for step in range(1000)]
    assert all(0 <= v < 1 for v in values) and len(set(values)) == 1000
    assert uniform(7, 3) == uniform(7, 3) != uniform(8, 3)
    assert abs(sum(values) / 1000 - 0.5) < 0.05


def test_ties_and_dtypes() -> None:
    x = torch.zeros(8, dtype=torch.bfloat16)
    assert TokenSampler().sample(x) == 0
    assert TokenSampler("top-p", params={"p": 0.5}, seed=1).sample(x) in range(4)


@pytest.mark.parametrize(("method", "params", "match"), [
    ("beam", {}, "not one of"),
    ("top-p", {"p": 0}, "0 < p <= 1"),
    ("top-p", {"p": 1.5}, "0 < p <= 1"),
    ("top-p", {"p": 0.5, "temperature": 0}, "temperature"),
    ("top-p", {"k": 3}, "unknown"),
    ("greedy", {"p": 0.9}, "unknown"),
])
def test_bad_parameters(method: str, params: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TokenSampler(method, params=params)


def test_bad_state() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        TokenSampler(seed=1 << 64)
    with pytest.raises(ValueError, match="one position"):
        TokenSampler().sample(torch.zeros(2, 3))
