"""The front end's protocol logic, free of I/O: exactly-once token delivery across instance failures.

Spec, Session Checkpoints and Migration: "Every output token carries its index and the session epoch, and front
ends MUST discard tokens that carry a lower epoch than one they have already seen for the session", and a
resumed instance may regenerate tokens the client already has (deterministic samplers), "and the front end
discards the duplicates by index". :class:`TokenRelay` is that rule; docs/inference.md is the whole exchange.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvsp_quic.problems import BadRequest
from kvsp_quic.records import Sampler


@dataclass(frozen=True)
class FrontendOptions:
    """What a front end's operator sets: the ``[frontend]`` section of ``kvsp-quic frontend``'s file is these
    fields (plus the controller, model and scope key the composition root resolves:
    ``kvsp_app.config.FrontendSection``). Durations in milliseconds; the asyncio side reads seconds."""

    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    failover_timeout_ms: int = 30_000  # how long a session may take to resume elsewhere after its instance failed
    read_timeout_ms: int = 60_000  # of the token stream's reads
    poll_interval_ms: int = 100  # between questions to the PC while a session is being moved
    stall_check_ms: int = 1000  # without a token this long: ask the PC whether the session moved

    def __post_init__(self) -> None:
        for name in ("max_tokens", "failover_timeout_ms", "read_timeout_ms", "poll_interval_ms", "stall_check_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive")

    @property
    def failover_timeout_s(self) -> float:
        return self.failover_timeout_ms / 1000

    @property
    def read_timeout_s(self) -> float:
        return self.read_timeout_ms / 1000

    @property
    def poll_interval_s(self) -> float:
        return self.poll_interval_ms / 1000

    @property
    def stall_check_s(self) -> float:
        return self.stall_check_ms / 1000


class TokenGap(BadRequest):
    """An instance skipped an index: what the client received would not be one consistent sample."""


@dataclass
class TokenRelay:
    """Decides which labelled tokens reach the client: each index once, in order, never from a lower epoch."""

    next_index: int = 0  # the next index the client lacks
    epoch: int = 0  # the highest epoch seen
    duplicates: int = 0  # tokens dropped because their index was already delivered
    stale: int = 0  # tokens dropped because of a lower epoch

    def offer(self, index: int, epoch: int, token: int) -> bool:
        """True when *token* at *index* is to be delivered now; False when it must be discarded."""
        if epoch < self.epoch:
            self.stale += 1
            return False
        self.epoch = epoch
        if index < self.next_index:
            self.duplicates += 1
            return False
        if index > self.next_index:
            raise TokenGap(f"token index {index} arrived while {self.next_index} is still missing (epoch {epoch})")
        self.next_index += 1
        return True

    def new_epoch(self, epoch: int) -> None:
        """The PC moved the session: tokens of older epochs are from now on refused."""
        self.epoch = max(self.epoch, epoch)


GREEDY_NEUTRAL = ("top_k", "min_p")  # argmax-invariant: dropped from a greedy sampler's parameters


@dataclass(frozen=True)
class SamplingRequest:
    """An OpenAI-style request's sampling fields as the Session Checkpoint's sampler. *extra*: the sampler's further
    parameters (gpu/sampling.py: ``top_k``, ``min_p``, the penalties, ``logit_bias``, ``logprobs``,
    ``stop_token_ids``), checked by the front end; ``top_k`` and ``min_p`` do not change a greedy choice and are
    left out of a greedy sampler."""

    method: str
    params: dict[str, Any]
    seed: int
    deterministic: bool

    @classmethod
    def from_openai(cls, temperature: float | None, top_p: float | None, seed: int | None,
                    default_seed: int, extra: Mapping[str, Any] | None = None) -> SamplingRequest:
        if temperature is not None and (temperature < 0 or temperature > 2):
            raise BadRequest("temperature must be in [0, 2]")
        if top_p is not None and not 0 < top_p <= 1:
            raise BadRequest("top_p must be in (0, 1]")
        extra = dict(extra or {})
        if temperature == 0 or (temperature is None and top_p is None and not set(extra) & set(GREEDY_NEUTRAL)):
            params = {k: v for k, v in extra.items() if k not in GREEDY_NEUTRAL}
            return cls("greedy", params, seed if seed is not None else default_seed, True)
        params = {"p": top_p if top_p is not None else 1.0, "temperature": temperature if temperature is not None
                  else 1.0, **extra}
        return cls("top-p", params, seed if seed is not None else default_seed, False)

    def sampler(self) -> Sampler:
        """The sampler record at step 0."""
        return Sampler(self.method, self.seed, 0, self.deterministic, dict(self.params))

    def to_json(self) -> dict[str, object]:
        return self.sampler().to_json()
