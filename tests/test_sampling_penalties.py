"""gpu/sampling.py's parameters beyond greedy and top-p (vLLM's order: logit bias, penalties, temperature, min_p,
top_k, top_p), each against a hand-computed expectation; their state restored from a checkpoint; log probabilities
and their token line (kvsp_quic/roles/controller_records.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")

from gpu.sampling import TokenSampler, uniform  # noqa: E402
from kvsp_quic.fields import RecordError  # noqa: E402
from kvsp_quic.records import Sampler  # noqa: E402
from kvsp_quic.roles.controller_records import TokenLine  # noqa: E402
from kvsp_quic.roles.instance import with_prompt_tokens  # noqa: E402


def t(*values: float) -> Any:
    return torch.tensor(values, dtype=torch.float32)


def test_logit_bias_is_added_before_the_choice() -> None:
    assert TokenSampler(params={"logit_bias": {"0": 5}}).sample(t(1, 2, 3)) == 0
    assert TokenSampler(params={"logit_bias": {"2": -100}}).sample(t(1, 2, 3)) == 1
    x = TokenSampler(params={"logit_bias": {"1": 0.5, "2": -1}}).processed(t(1, 2, 3))
    assert x.tolist() == [1.0, 2.5, 2.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    s = TokenSampler(params={"repetition_penalty": 2.0, "prompt_tokens": [0]}, output=[2])
    assert s.processed(t(2.0, 1.8, -1.0, -1.1)).tolist() == pytest.approx([1.0, 1.8, -2.0, -1.1])
    assert s.sample(t(2.0, 1.8, -1.0, -1.1)) == 1  # 2.0 -> 1.0 (in the prompt), below 1.8
    assert s.counts == {2: 1, 1: 1}
    assert s.processed(t(2.0, 1.8, -1.0, -1.1)).tolist() == pytest.approx([1.0, 0.9, -2.0, -1.1])  # 1 now seen


def test_frequency_and_presence_penalties_count_the_output() -> None:
    s = TokenSampler(params={"frequency_penalty": 0.1, "presence_penalty": 0.05}, output=[0, 0, 2])
    # token 0: 1.0 - 2 * 0.1 - 0.05; token 2: 0.0 - 0.1 - 0.05; token 1 never came
    assert s.processed(t(1.0, 0.9, 0.0)).tolist() == pytest.approx([0.75, 0.9, -0.15])
    assert s.sample(t(1.0, 0.9, 0.0)) == 1
    negative = TokenSampler(params={"presence_penalty": -2.0}, output=[2])  # a negative one favours repeats
    assert negative.sample(t(1.0, 0.9, 0.0)) == 2


def test_the_bias_comes_before_the_penalties() -> None:
    s = TokenSampler(params={"logit_bias": {"0": 1.0}, "repetition_penalty": 2.0, "prompt_tokens": [0]})
    assert s.processed(t(1.0, 0.0)).tolist() == [1.0, 0.0]  # (1 + 1) / 2; penalty first would be 1.5


def test_top_k_and_min_p_mask_before_the_nucleus() -> None:
    probs = [0.6, 0.3, 0.1]
    x = torch.tensor([math.log(p) for p in probs])
    for seed in range(40):
        u = uniform(seed, 0)
        # top_k 2: [0.6, 0.3] renormalized to [2/3, 1/3]; the draw takes token 0 when u < 2/3
        assert TokenSampler("top-p", params={"top_k": 2}, seed=seed).sample(x) == (0 if u < 2 / 3 else 1)
        # min_p 0.4: tokens below 0.4 * 0.6 = 0.24 go (token 2 at 0.1): the same two
        assert TokenSampler("top-p", params={"min_p": 0.4}, seed=seed).sample(x) == (0 if u < 2 / 3 else 1)
        # no mask: token 2 when u >= 0.9
        assert TokenSampler("top-p", seed=seed).sample(x) == (0 if u < 0.6 else 1 if u < 0.9 else 2)
        assert TokenSampler("top-p", params={"top_k": 1, "temperature": 2.0}, seed=seed).sample(x) == 0
    # the temperature divides before min_p: at 0.5 the probabilities are [0.783, 0.196, 0.022]; min_p 0.1 masks 2
    cold = torch.softmax(x / 0.5, dim=0)
    assert float(cold[2]) < 0.1 * float(cold[0]) < float(cold[1])
    seen = {TokenSampler("top-p", params={"temperature": 0.5, "min_p": 0.1}, seed=s).sample(x) for s in range(300)}
    assert seen == {0, 1}


def test_greedy_ignores_nothing_it_cannot_use_and_refuses_what_it_cannot() -> None:
    with pytest.raises(ValueError, match="unknown greedy parameters: top_k"):
        TokenSampler("greedy", params={"top_k": 3})
    for params, words in (({"logit_bias": {"1": 101}}, r"\[-100, 100\]"), ({"logit_bias": {"x": 1}}, "token id"),
                          ({"presence_penalty": 2.5}, r"\[-2, 2\]"), ({"repetition_penalty": 0}, "positive"),
                          ({"logprobs": 21}, r"\[0, 20\]"), ({"logprobs": True}, "integer"),
                          ({"stop_token_ids": [-1]}, "token ids"), ({"prompt_tokens": "abc"}, "token ids")):
        with pytest.raises(ValueError, match=words):
            TokenSampler("greedy", params=params)
    for params, words in (({"top_k": -1}, "top_k"), ({"min_p": 1.5}, "min_p")):
        with pytest.raises(ValueError, match=words):
            TokenSampler("top-p", params=params)
    s = TokenSampler(params={"logit_bias": {"7": 1}, "stop_token_ids": [3]})
    s.check_vocab(8)
    with pytest.raises(ValueError, match="logit_bias: token id 7"):
        s.check_vocab(7)


def test_log_probabilities_are_the_models_before_bias_and_penalties() -> None:
    x = t(0.0, math.log(3.0))  # probabilities 1/4 and 3/4
    pick = TokenSampler(params={"logprobs": 2}).choose(x)
    assert pick.token == 1 and pick.logprobs is not None
    assert pick.logprobs[0] == pytest.approx(math.log(0.75))
    assert [tok for tok, _ in pick.logprobs[1]] == [1, 0]
    assert [v for _, v in pick.logprobs[1]] == pytest.approx([math.log(0.75), math.log(0.25)])
    biased = TokenSampler(params={"logprobs": 0, "logit_bias": {"0": 100}}).choose(x)
    assert biased.token == 0 and biased.logprobs is not None
    assert biased.logprobs[0] == pytest.approx(math.log(0.25)) and biased.logprobs[1] == ()
    assert TokenSampler().choose(x).logprobs is None  # not asked for


def logits_for(step: int, vocab: int = 50) -> Any:
    g = torch.Generator().manual_seed(step)
    return torch.randn(vocab, generator=g) * 2


def test_a_restored_sampler_continues_exactly_with_its_penalties() -> None:
    params = {"p": 0.95, "temperature": 0.9, "top_k": 30, "min_p": 0.02, "presence_penalty": 0.7,
              "frequency_penalty": 0.4, "repetition_penalty": 1.4, "logit_bias": {"3": 1.5, "4": -2},
              "prompt_tokens": [1, 3, 5], "logprobs": 1}
    a = TokenSampler("top-p", params=params, seed=99)
    tokens = [a.sample(logits_for(i)) for i in range(24)]
    plain = TokenSampler("top-p", params={"p": 0.95, "temperature": 0.9}, seed=99)
    assert [plain.sample(logits_for(i)) for i in range(24)] != tokens  # the parameters matter
    record = Sampler.from_json(TokenSampler("top-p", params=params, seed=99, step=12,
                                            output=tokens[:12]).record().to_json())
    resumed = TokenSampler.from_record(record, tokens[:12])
    assert [resumed.sample(logits_for(i)) for i in range(12, 24)] == tokens[12:]


def test_the_instance_adds_the_prompts_tokens_for_a_repetition_penalty() -> None:
    plain = Sampler("greedy", 0, 0, True, {"presence_penalty": 1.0})
    assert with_prompt_tokens(plain, [5, 1, 5]) is plain
    rep = with_prompt_tokens(Sampler("greedy", 0, 0, True, {"repetition_penalty": 1.2}), [5, 1, 5])
    assert rep.params == {"repetition_penalty": 1.2, "prompt_tokens": [1, 5]}


def test_token_lines_carry_log_probabilities() -> None:
    line = TokenLine(3, 1, 42, logprob=-0.5, top_logprobs=((42, -0.5), (7, -1.25)))
    assert line.encode() == b'{"index":3,"epoch":1,"token":42,"logprob":-0.5,"top_logprobs":[[42,-0.5],[7,-1.25]]}\n'
    assert TokenLine.decode(line.encode()) == line
    assert TokenLine.decode(b'{"index":3,"epoch":1,"token":42}').logprob is None  # none asked for
    for bad in (b'{"index":3,"epoch":1,"token":42,"logprob":0.5}',
                b'{"index":3,"epoch":1,"token":42,"top_logprobs":[[1,-1]]}',
                b'{"index":3,"epoch":1,"token":42,"logprob":-1,"top_logprobs":[[1]]}',
                b'{"index":3,"epoch":1,"done":true,"reason":"stop","logprob":-1}'):
        with pytest.raises(RecordError):
            TokenLine.decode(bad)
