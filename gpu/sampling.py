"""Token samplers: greedy and top-p (nucleus), seeded, with a state that can be checkpointed and restored.

The state is exactly the Session Checkpoint's ``sampler`` member (spec: "method", "params", "seed", "step",
"deterministic"; :class:`kvsp_quic.records.Sampler`) together with the session's output so far (the checkpoint's
``generated``: the penalties count its tokens). The random number of step *s* is a pure function of (seed, s) --
SHA-256 of both, 53 bits -- so a sampler restored at step s on another instance draws what the original would have
drawn, and the choice itself is computed in float64 on the CPU: equal logits give equal tokens on every machine.

    sampler = TokenSampler("top-p", params={"p": 0.9, "top_k": 40, "presence_penalty": 0.5}, seed=7)
    token = sampler.sample(logits)          # step 0 -> 1
    record = sampler.record()               # kvsp_quic.records.Sampler(method="top-p", step=1, ...)
    again = TokenSampler.from_record(record, output=tokens_so_far)

Parameters (docs/inference.md, "Samplers"), applied in vLLM's order: ``logit_bias`` ({"token id": -100..100},
added to the logits), then the penalties -- ``repetition_penalty`` (> 0; a logit of a token seen in the prompt or
the output is divided by it when positive, multiplied when not), ``frequency_penalty`` (-2..2, times the token's
count in the output) and ``presence_penalty`` (-2..2, once per token present in the output), subtracted -- then
greedy takes the argmax; top-p divides by ``temperature``, masks tokens below ``min_p`` times the most likely
one's probability, keeps the ``top_k`` largest logits (ties at the k-th kept), then the nucleus ``p``, and draws.

``prompt_tokens`` (the prompt's distinct token ids, added by the instance when a repetition penalty is asked for)
and ``stop_token_ids`` are state the checkpoint carries; ``logprobs`` (0..20) asks for each chosen token's log
probability and that many most likely alternatives: the model's own (log-softmax of the raw logits, before bias,
penalties and temperature: vLLM's default ``raw_logprobs``). ``prompt_logprobs`` (0..20, vLLM's sampling parameter of
that name) asks the run for the log probability of every prompt token after the tokens before it, with that many
alternatives (:func:`position_logprobs`; the first prompt token has none); it does not change sampling.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from kvsp_quic.records import Sampler

METHODS = ("greedy", "top-p")
_LABEL = b"kvsp-quic sampler\x00"
MAX_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0  # a log probability of -inf as JSON carries it (vLLM's)
_COMMON = frozenset({"logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                     "prompt_tokens", "stop_token_ids", "prompt_logprobs"})
_TOP_P = frozenset({"p", "temperature", "top_k", "min_p"})


def uniform(seed: int, step: int) -> float:
    """A number in [0, 1) that depends on (seed, step) only."""
    digest = hashlib.sha256(_LABEL + seed.to_bytes(8, "big") + step.to_bytes(8, "big")).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) / float(1 << 53)


class Pick(NamedTuple):
    """A sampled token; ``logprobs`` (when asked for): its log probability and the most likely alternatives."""

    token: int
    logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None


def _num(params: Mapping[str, Any], name: str, default: float, ok: Any, what: str) -> float:
    value = params.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}: {what}, got {value!r}")
    return float(value)


def _ids(params: Mapping[str, Any], name: str) -> tuple[int, ...]:
    value = params.get(name, [])
    if not isinstance(value, list | tuple) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 32
                                                   for t in value):
        raise ValueError(f"{name}: a list of token ids")
    return tuple(value)


def _bias(value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise ValueError("logit_bias: an object of token id -> bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        text = str(key)
        if not text.isdigit() or int(text) >= 1 << 32:
            raise ValueError(f"logit_bias: {key!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias[{key}]: a number in [-100, 100], got {bias!r}")
        out[int(text)] = float(bias)
    return out


class TokenSampler:
    """Greedy or top-p (``params`` {"p": 0 < p <= 1, "temperature": > 0, default 1, "top_k", "min_p"}), both with
    the module's common parameters. *output*: the session's output tokens so far (a restored sampler's penalties
    count them)."""

    def __init__(self, method: str = "greedy", *, params: Mapping[str, Any] | None = None, seed: int = 0,
                 step: int = 0, output: Iterable[int] = ()) -> None:
        if method not in METHODS:
            raise ValueError(f"sampling method {method!r} is not one of {', '.join(METHODS)}")
        if not 0 <= seed < 1 << 64:
            raise ValueError("the seed is a 64-bit unsigned integer")
        if step < 0:
            raise ValueError("the step is not negative")
        params = dict(params or {})
        unknown = set(params) - _COMMON - (_TOP_P if method == "top-p" else frozenset())
        if unknown:
            raise ValueError(f"unknown {method} parameters: {', '.join(sorted(unknown))}")
        if method == "top-p":
            p = params.get("p", 1.0)
            if not isinstance(p, int | float) or isinstance(p, bool) or not 0 < p <= 1:
                raise ValueError(f"top-p needs 0 < p <= 1, got {p!r}")
            temperature = params.get("temperature", 1.0)
            if not isinstance(temperature, int | float) or isinstance(temperature, bool) or \
                    not (temperature > 0 and math.isfinite(temperature)):
                raise ValueError(f"top-p needs a positive temperature, got {temperature!r}")
            self.min_p = _num(params, "min_p", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")
            top_k = params.get("top_k", 0)
            if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
                raise ValueError(f"top_k: a positive integer (0: all tokens), got {top_k!r}")
            self.top_k = top_k
        else:
            self.min_p, self.top_k = 0.0, 0
        self.presence = _num(params, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]")
        self.frequency = _num(params, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]")
        self.repetition = _num(params, "repetition_penalty", 1.0, lambda v: v > 0, "a positive number")
        self.bias = _bias(params.get("logit_bias", {}))
        logprobs = params.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
        self.logprobs: int | None = logprobs
        self.prompt_logprobs = prompt_logprobs_of(params)
        self.prompt_tokens = frozenset(_ids(params, "prompt_tokens"))
        self.stop_token_ids = frozenset(_ids(params, "stop_token_ids"))
        self.method = method
        self.params = params
        self.seed = seed
        self.step = step
        self.counts: Counter[int] = Counter(output)

    @property
    def shapes_logits(self) -> bool:
        """Whether bias or penalties change the logits before the choice."""
        return bool(self.bias) or self.presence != 0 or self.frequency != 0 or self.repetition != 1

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError when a token id of the parameters is not below *vocab_size*."""
        for name, ids in (("logit_bias", self.bias.keys()), ("prompt_tokens", self.prompt_tokens),
                          ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name}: token id {min(bad)} is not below the vocabulary size {vocab_size}")

    def sample(self, logits: torch.Tensor) -> int:
        """The next token for *logits* (vocab,); advances the step."""
        return self.choose(logits).token

    def choose(self, logits: torch.Tensor) -> Pick:
        """The next token for *logits* (vocab,) and, when asked for, its log probabilities; advances the step."""
        if logits.dim() != 1:
            raise ValueError("sample() takes the logits of one position, shape (vocab,)")
        if self.method == "greedy" and not self.shapes_logits:
            token = int(torch.argmax(logits))
        else:
            x = self.processed(logits)
            token = int(torch.argmax(x)) if self.method == "greedy" else self._draw(x)
        pick = Pick(token, None if self.logprobs is None else self._logprobs(logits, token))
        self.step += 1
        self.counts[token] += 1
        return pick

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """float64 logits after the bias and the penalties (vLLM's order), before the temperature."""
        x = logits.detach().to("cpu", torch.float64).clone()
        if self.bias:
            ids = torch.tensor(list(self.bias), dtype=torch.long)
            x[ids] += torch.tensor(list(self.bias.values()), dtype=torch.float64)
        if self.repetition != 1:
            seen = sorted(self.prompt_tokens | set(self.counts))
            if seen:
                ids = torch.tensor(seen, dtype=torch.long)
                v = x[ids]
                x[ids] = torch.where(v > 0, v / self.repetition, v * self.repetition)
        if (self.frequency or self.presence) and self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            n = torch.tensor(list(self.counts.values()), dtype=torch.float64)
            x[ids] -= self.frequency * n + self.presence
        return x

    def _draw(self, x: torch.Tensor) -> int:
        x = x / float(self.params.get("temperature", 1.0))
        if self.min_p > 0:
            probs = torch.softmax(x, dim=0)
            x = x.masked_fill(probs < self.min_p * float(probs.max()), -math.inf)
        if 0 < self.top_k < x.numel():
            kth = torch.topk(x, self.top_k).values[-1]
            x = x.masked_fill(x < kth, -math.inf)
        probs = torch.softmax(x, dim=0)
        ordered, index = torch.sort(probs, descending=True, stable=True)
        cumulative = torch.cumsum(ordered, dim=0)
        keep = (cumulative - ordered) < float(self.params.get("p", 1.0))  # the first always stays
        kept = ordered[keep]
        target = uniform(self.seed, self.step) * float(kept.sum())
        j = int(torch.searchsorted(torch.cumsum(kept, dim=0), torch.tensor([target], dtype=torch.float64),
                                   right=True)[0])
        return int(index[min(j, kept.numel() - 1)])

    def _logprobs(self, logits: torch.Tensor, token: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        lp = torch.log_softmax(logits.detach().to("cpu", torch.float64), dim=0)
        top: tuple[tuple[int, float], ...] = ()
        if self.logprobs:
            values, index = torch.sort(lp, descending=True, stable=True)
            top = tuple((int(i), _finite(float(v))) for i, v in zip(index[:self.logprobs], values[:self.logprobs],
                                                                     strict=True))
        return _finite(float(lp[token])), top

    def record(self, *, deterministic: bool = False) -> Sampler:
        """The checkpointable state. *deterministic*: whether every instance eligible to resume produces
        bit-identical tokens (the instance knows; spec, Session Checkpoint)."""
        return Sampler(method=self.method, seed=self.seed, step=self.step, deterministic=deterministic,
                       params=dict(self.params))

    @classmethod
    def from_record(cls, record: Sampler, output: Sequence[int] = ()) -> TokenSampler:
        """The sampler of *record* after the session's *output* (the checkpoint's covered ``generated`` tokens)."""
        return cls(record.method, params=record.params, seed=record.seed, step=record.step, output=output)

    def __repr__(self) -> str:
        return f"TokenSampler({self.method!r}, params={self.params!r}, seed={self.seed}, step={self.step})"


def prompt_logprobs_of(params: Mapping[str, Any]) -> int | None:
    """The sampler parameter ``prompt_logprobs`` (alternatives per prompt position, 0..20), None when absent."""
    value = params.get("prompt_logprobs")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
        raise ValueError(f"prompt_logprobs: an integer in [0, {MAX_LOGPROBS}], got {value!r}")
    return value


def position_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int
                      ) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """For row i of *logits* (positions, vocab), the log probability of ``tokens[i]`` (the token that followed that
    position) and the *top* most likely tokens, best first: as :meth:`TokenSampler.choose` gives a sampled token's
    (log-softmax of the raw logits in float64, ties in token order, -inf as :data:`LOGPROB_FLOOR`)."""
    if logits.dim() != 2 or logits.shape[0] != len(tokens):
        raise ValueError(f"{len(tokens)} tokens for logits of shape {tuple(logits.shape)}")
    lp = torch.log_softmax(logits.detach().to("cpu", torch.float64), dim=1)
    chosen = lp.gather(1, torch.tensor(list(tokens), dtype=torch.long)[:, None])[:, 0].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if top:  # what a stable descending sort of each row starts with, without sorting the vocabulary
        kth = torch.topk(lp, min(top, lp.shape[1]), dim=1).values[:, -1]
        for i in range(len(tokens)):
            index = torch.nonzero(lp[i] >= kth[i], as_tuple=True)[0]  # ascending ids: ties stay in id order
            values = lp[i, index]
            order = torch.sort(values, descending=True, stable=True).indices[:top].tolist()
            tops[i] = tuple((int(index[j]), _finite(float(values[j]))) for j in order)
    return [(_finite(c), tops[i]) for i, c in enumerate(chosen)]


def _finite(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR
