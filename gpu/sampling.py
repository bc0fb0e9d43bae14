"""Token samplers: greedy and top-p (nucleus), seeded, with a state that can be checkpointed and restored.

The state is exactly the Session Checkpoint's ``sampler`` member (spec: "method", "params", "seed", "step",
"deterministic"; :class:`kvsp_quic.records.Sampler`). The random number of step *s* is a pure function of
(seed, s) -- SHA-256 of both, 53 bits -- so a sampler restored at step s on another instance draws what the
original would have drawn, and the choice itself is computed in float64 on the CPU: equal logits give equal
tokens on every machine.

    sampler = TokenSampler("top-p", params={"p": 0.9}, seed=7)
    token = sampler.sample(logits)          # step 0 -> 1
    record = sampler.record()               # kvsp_quic.records.Sampler(method="top-p", step=1, ...)
    again = TokenSampler.from_record(record)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import torch

from kvsp_quic.records import Sampler

METHODS = ("greedy", "top-p")
_LABEL = b"kvsp-quic sampler\x00"


def uniform(seed: int, step: int) -> float:
    """A number in [0, 1) that depends on (seed, step) only."""
    digest = hashlib.sha256(_LABEL + seed.to_bytes(8, "big") + step.to_bytes(8, "big")).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) / float(1 << 53)


class TokenSampler:
    """Greedy (``params`` {}) or top-p (``params`` {"p": 0 < p <= 1, "temperature": > 0, default 1})."""

    def __init__(self, method: str = "greedy", *, params: Mapping[str, Any] | None = None, seed: int = 0,
                 step: int = 0) -> None:
        if method not in METHODS:
            raise ValueError(f"sampling method {method!r} is not one of {', '.join(METHODS)}")
        if not 0 <= seed < 1 << 64:
            raise ValueError("the seed is a 64-bit unsigned integer")
        if step < 0:
            raise ValueError("the step is not negative")
        params = dict(params or {})
        if method == "top-p":
            p = params.get("p", 1.0)
            temperature = params.get("temperature", 1.0)
            if not isinstance(p, int | float) or isinstance(p, bool) or not 0 < p <= 1:
                raise ValueError(f"top-p needs 0 < p <= 1, got {p!r}")
            if not isinstance(temperature, int | float) or isinstance(temperature, bool) or \
                    not (temperature > 0 and math.isfinite(temperature)):
                raise ValueError(f"top-p needs a positive temperature, got {temperature!r}")
            unknown = set(params) - {"p", "temperature"}
        else:
            unknown = set(params)
        if unknown:
            raise ValueError(f"unknown {method} parameters: {', '.join(sorted(unknown))}")
        self.method = method
        self.params = params
        self.seed = seed
        self.step = step

    def sample(self, logits: torch.Tensor) -> int:
        """The next token for *logits* (vocab,); advances the step."""
        if logits.dim() != 1:
            raise ValueError("sample() takes the logits of one position, shape (vocab,)")
        token = int(torch.argmax(logits)) if self.method == "greedy" else self._top_p(logits)
        self.step += 1
        return token

    def _top_p(self, logits: torch.Tensor) -> int:
        x = logits.detach().to("cpu", torch.float64) / float(self.params.get("temperature", 1.0))
        probs = torch.softmax(x, dim=0)
        ordered, index = torch.sort(probs, descending=True, stable=True)
        cumulative = torch.cumsum(ordered, dim=0)
        keep = (cumulative - ordered) < float(self.params.get("p", 1.0))  # the first always stays
        kept = ordered[keep]
        target = uniform(self.seed, self.step) * float(kept.sum())
        j = int(torch.searchsorted(torch.cumsum(kept, dim=0), torch.tensor([target], dtype=torch.float64),
                                   right=True)[0])
        return int(index[min(j, kept.numel() - 1)])

    def record(self, *, deterministic: bool = False) -> Sampler:
        """The checkpointable state. *deterministic*: whether every instance eligible to resume produces
        bit-identical tokens (the instance knows; spec, Session Checkpoint)."""
        return Sampler(method=self.method, seed=self.seed, step=self.step, deterministic=deterministic,
                       params=dict(self.params))

    @classmethod
    def from_record(cls, record: Sampler) -> TokenSampler:
        return cls(record.method, params=record.params, seed=record.seed, step=record.step)

    def __repr__(self) -> str:
        return f"TokenSampler({self.method!r}, params={self.params!r}, seed={self.seed}, step={self.step})"
