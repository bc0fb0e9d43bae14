"""The request parameters of the front end's OpenAI-compatible endpoints: what is implemented, checked strictly.

A parameter this server does not implement is refused with 400 naming it, never ignored; a parameter that is
implemented only at its neutral value (``suffix: ""``, ``tools: []``) is accepted at that value, because clients such
as LangChain send the defaults explicitly. docs: README, "The front end".

The sampler's parameters (``top_k``, ``min_p``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias``, ``stop_token_ids``, and ``logprobs``: completions' integer, chat's boolean
with ``top_logprobs``) travel in the session's sampler record to the instance (gpu/sampling.py). ``best_of``
candidates (at least ``n``, not streamed) are sessions too; the ``n`` with the highest cumulative log probability
are answered.

``echo`` with ``logprobs`` (completions) also asks for the prompt's log probabilities: the sampler parameter
``prompt_logprobs`` (vLLM's), which the instance answers in ``GET sessions/{id}`` (docs/wire.md, "Prompt log
probabilities"); the first prompt token has none (null), as in vLLM and OpenAI's legacy completions. ``max_tokens: 0``
is allowed with ``echo`` only (the "score this text" call): the session samples one token, which is not answered (as
vLLM does: KVSP's sessions generate at least one token).

``stop`` strings are matched in the detokenized text (a match ends the choice with ``finish_reason: "stop"`` and
cancels its session). ``max_tokens`` absent is 16 (``/v1/completions``) or up to the context (chat); ``null`` is up
to the context: the model's ``max_position_embeddings`` less the prompt, at most the operator's ``max_tokens``. A
prompt that leaves no room, or a request for more, is 400 naming the limit (as vLLM words it). ``temperature``
defaults to 1.0 (OpenAI, vLLM); 0 is greedy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvsp_frontend.errors import InvalidParameter, ModelNotFound

COMPLETION_DEFAULT_MAX_TOKENS = 16
SEED_MODULUS = 1 << 64  # the sampler's seed is a 64-bit unsigned integer; a negative seed is taken modulo

# Accepted only at these (neutral) values; None always means "not set".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": ("",), "tool_choice": ("none",), "tools": ([],),
    "response_format": ({"type": "text"},), "functions": ([],), "function_call": ("none",),
}
_NOT_IMPLEMENTED = {
    "suffix": "insertion (suffix) is not supported",
    "tool_choice": "tools are not supported", "tools": "tools are not supported",
    "response_format": "only the text response format is supported",
    "functions": "functions are not supported", "function_call": "functions are not supported",
}
_COMMON = ("model", "max_tokens", "n", "best_of", "temperature", "top_p", "seed", "stream", "stream_options", "user",
           "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_k", "min_p",
           "stop", "stop_token_ids", "include_stop_str_in_output")
MAX_LOGPROBS = 20  # vLLM's max_logprobs
MAX_STOPS = 16
COMPLETION_KEYS = frozenset((*_COMMON, "prompt", "echo", "suffix"))
CHAT_KEYS = frozenset((*_COMMON, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                       "response_format", "functions", "function_call", "chat_template_kwargs"))


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Limits:
    """The model's and the operator's limits a request is checked against."""

    model: str  # the served model name
    context: int  # max_position_embeddings: prompt + output tokens
    vocab_size: int  # token ids are below it
    max_tokens: int  # the operator's largest max_tokens
    max_choices: int = 16  # prompts x n per request


@dataclass(frozen=True)
class Choice:
    """One sequence to generate: choice ``index`` of the response."""

    index: int
    prompt: tuple[int, ...]
    prompt_text: str | None  # for echo
    max_tokens: int
    seed: int | None


@dataclass(frozen=True)
class Params:
    choices: tuple[Choice, ...]
    prompts: int  # distinct prompts (usage counts each prompt once)
    prompt_tokens: int
    temperature: float
    top_p: float | None
    stream: bool
    include_usage: bool
    echo: bool
    user: str | None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first (finish_reason "stop")
    include_stop: bool = False  # include_stop_str_in_output (vLLM): the text ends after it
    sampling: Mapping[str, Any] = field(default_factory=dict)  # the sampler's further parameters (sampling())
    logprobs: int | None = None  # alternatives per token (completions' logprobs, chat's top_logprobs); None: none
    best_of: int = 1  # candidates per prompt; the n of them with the highest cumulative logprob are answered
    n: int = 1  # choices per prompt
    echo_only: bool = False  # max_tokens 0 with echo: the prompt is answered, the one token sampled is not
    prompt_logprobs: bool = False  # echo with logprobs: the prompt tokens' log probabilities are answered too


def check_keys(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for name in body:
        if name not in allowed:
            raise InvalidParameter(name, f"unrecognized request parameter {name!r} (this server implements: "
                                         f"{', '.join(sorted(allowed))})", code="unsupported_parameter")
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and name in allowed and not any(_same(value, n) for n in neutral):
            raise InvalidParameter(name, _NOT_IMPLEMENTED[name], code="unsupported_parameter")


def _same(value: Any, neutral: Any) -> bool:
    if isinstance(value, bool) != isinstance(neutral, bool):
        return False
    return bool(value == neutral)


def check_model(body: Mapping[str, Any], limits: Limits) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise InvalidParameter("model", "must be a string")
    if model != limits.model:
        raise ModelNotFound(model, limits.model)


def number(body: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidParameter(name, "must be a number")
    if value > high or value < low or (low_open and value == low):
        raise InvalidParameter(name, f"must be in {'(' if low_open else '['}{low:g}, {high:g}]")
    return float(value)


def integer(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(name, "must be an integer")
    if not low <= value <= high:
        raise InvalidParameter(name, f"must be in [{low}, {high}]")
    return value


def boolean(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidParameter(name, f"must be a boolean (true or false), not {type(value).__name__}")
    return value


def _token_ids(value: Any, param: str, limits: Limits) -> tuple[int, ...]:
    if not value:
        raise InvalidParameter(param, "must not be empty")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise InvalidParameter(param, "token ids must be integers")
    bad = next((t for t in value if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidParameter(param, f"token id {bad} is out of the vocabulary (ids are in [0, "
                                      f"{limits.vocab_size - 1}])", code="invalid_token_id")
    return tuple(value)


def prompts_of(value: Any, tokenizer: Tokenizer, limits: Limits) -> list[tuple[tuple[int, ...], str | None]]:
    """``prompt`` of ``/v1/completions``: a string, token ids, or a list of either (a batch)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) for t in value):  # (booleans refused below)
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise InvalidParameter("prompt", "a non-empty string, array of token ids, or array of either is required")
    out: list[tuple[tuple[int, ...], str | None]] = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise InvalidParameter(where, "must not be empty")
            out.append((tuple(tokenizer.encode(item)), item))
        elif isinstance(item, list):
            out.append((_token_ids(item, where, limits), None))
        else:
            raise InvalidParameter(where, "must be a string or an array of token ids")
    return out


def max_tokens_for(body: Mapping[str, Any], name: str, prompt_len: int, default: int | None,
                   limits: Limits, *, minimum: int = 1) -> int:
    """The output limit of one prompt (see the module docstring); *minimum* 0: ``max_tokens: 0`` (echo only)."""
    room = limits.context - prompt_len
    if room < 1:
        raise InvalidParameter("prompt" if "prompt" in body else "messages",
                               f"This model's maximum context length is {limits.context} tokens. However, your "
                               f"prompt has {prompt_len} tokens, which leaves no room for output. Please reduce the "
                               f"length of the prompt.", code="context_length_exceeded")
    if name not in body or body[name] is None:
        if name in body or default is None:  # null: up to the context
            return min(room, limits.max_tokens)
        wanted = default
    else:
        value = integer(body, name, minimum, limits.max_tokens)
        assert value is not None
        wanted = value
    if prompt_len + wanted > limits.context:
        raise InvalidParameter(name, f"This model's maximum context length is {limits.context} tokens. However, "
                                     f"you requested {prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted}"
                                     f" in the completion). Please reduce the length of the prompt or completion.",
                               code="context_length_exceeded")
    return wanted


def common(body: Mapping[str, Any], prompts: Sequence[tuple[tuple[int, ...], str | None]], limits: Limits, *,
           max_tokens_name: str, default_max_tokens: int | None, echo: bool = False, chat: bool = False) -> Params:
    n = integer(body, "n", 1, limits.max_choices) or 1
    best_of = integer(body, "best_of", 1, limits.max_choices) or n
    if best_of < n:
        raise InvalidParameter("best_of", f"best_of ({best_of}) must be at least n ({n})")
    if best_of > n and boolean(body, "stream"):
        raise InvalidParameter("best_of", "best_of greater than n cannot be streamed (the best are known at the end)")
    if len(prompts) * best_of > limits.max_choices:
        raise InvalidParameter("n", f"{len(prompts)} prompts x {'best_of' if best_of > n else 'n'} = "
                                    f"{len(prompts) * best_of} choices; at most {limits.max_choices} per request")
    temperature = number(body, "temperature", 0, 2)
    top_p = number(body, "top_p", 0, 1, low_open=True)
    seed = integer(body, "seed", -(1 << 63), SEED_MODULUS - 1)
    stream = boolean(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidParameter("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise InvalidParameter("stream_options", "an object with only 'include_usage' is supported")
        include_usage = boolean(options, "include_usage")
    stop = stop_strings(body.get("stop"))
    include_stop = boolean(body, "include_stop_str_in_output")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidParameter("user", "must be a string")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else max_tokens_name
    if name == "max_completion_tokens" and body.get("max_tokens") is not None:
        raise InvalidParameter("max_tokens", "give max_tokens or max_completion_tokens, not both")
    choices = []
    echo_only = False
    for p, (tokens, text) in enumerate(prompts):
        limit = max_tokens_for(body, name, len(tokens), default_max_tokens, limits, minimum=0 if echo else 1)
        if limit == 0:  # echo only: KVSP's sessions generate at least one token; it is not answered (vLLM's way)
            echo_only, limit = True, 1
        for j in range(best_of):  # candidates j >= n compete for the n choices (their index: p * n + rank)
            choices.append(Choice(p * best_of + j, tokens, text, limit,
                                  None if seed is None else (seed + j) % SEED_MODULUS))
    logprobs = logprobs_of(body, chat=chat)
    extra = sampling(body, limits)
    if logprobs is not None or best_of > n:
        extra["logprobs"] = logprobs or 0
    if echo and logprobs is not None:  # the echoed prompt's log probabilities (docs/wire.md)
        extra["prompt_logprobs"] = logprobs
    return Params(tuple(choices), len(prompts), sum(len(t) for t, _ in prompts),
                  1.0 if temperature is None else temperature, top_p, stream, include_usage, echo, user, stop,
                  include_stop, extra, logprobs, best_of, n, echo_only, echo and logprobs is not None)


def logprobs_of(body: Mapping[str, Any], *, chat: bool) -> int | None:
    """The alternatives per token asked for: completions' ``logprobs`` (an integer), chat's ``logprobs`` (true) and
    ``top_logprobs``; None when no log probabilities are wanted."""
    if not chat:
        if body.get("logprobs") is False:  # sent by some clients as "off"
            return None
        return integer(body, "logprobs", 0, MAX_LOGPROBS)
    wanted = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top and not wanted:
        raise InvalidParameter("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


def sampling(body: Mapping[str, Any], limits: Limits) -> dict[str, Any]:
    """The sampler's parameters besides temperature and top_p (gpu/sampling.py), at their non-neutral values:
    ``top_k`` (-1 or 0: all tokens), ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``
    (vLLM), ``logit_bias`` ({"token id": -100..100}), ``stop_token_ids`` (vLLM)."""
    out: dict[str, Any] = {}
    top_k = integer(body, "top_k", -1, limits.vocab_size)
    if top_k is not None and top_k > 0:
        out["top_k"] = top_k
    min_p = number(body, "min_p", 0, 1)
    if min_p:
        out["min_p"] = min_p
    for name in ("presence_penalty", "frequency_penalty"):
        value = number(body, name, -2, 2)
        if value:
            out[name] = value
    repetition = number(body, "repetition_penalty", 0, 100, low_open=True)
    if repetition is not None and repetition != 1:
        out["repetition_penalty"] = repetition
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise InvalidParameter("logit_bias", "an object mapping token ids to biases in [-100, 100]")
        checked: dict[str, float] = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isdigit()) or not int(key) < limits.vocab_size:
                raise InvalidParameter("logit_bias", f"{key!r} is not a token id of the vocabulary (ids are in [0, "
                                                     f"{limits.vocab_size - 1}])", code="invalid_token_id")
            if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
                raise InvalidParameter("logit_bias", f"the bias of token {key} must be a number in [-100, 100]")
            if value:
                checked[str(int(key))] = float(value)
        if checked:
            out["logit_bias"] = checked
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise InvalidParameter("stop_token_ids", "an array of token ids")
        if stop_ids:
            out["stop_token_ids"] = sorted(set(_token_ids(stop_ids, "stop_token_ids", limits)))
    return out


def stop_strings(value: Any) -> tuple[str, ...]:
    """``stop``: null, a string, or an array of at most MAX_STOPS non-empty strings."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidParameter("stop", "a string or an array of strings (token ids: stop_token_ids)")
    if len(items) > MAX_STOPS:
        raise InvalidParameter("stop", f"at most {MAX_STOPS} stop strings")
    if any(not s for s in items):
        raise InvalidParameter("stop", "stop strings must not be empty")
    return tuple(dict.fromkeys(items))


def completion_params(body: Mapping[str, Any], tokenizer: Tokenizer, limits: Limits) -> Params:
    """``POST /v1/completions``."""
    check_keys(body, COMPLETION_KEYS)
    check_model(body, limits)
    if "prompt" not in body:
        raise InvalidParameter("prompt", "is required")
    prompts = prompts_of(body["prompt"], tokenizer, limits)
    echo = boolean(body, "echo")
    return common(body, prompts, limits, max_tokens_name="max_tokens",
                  default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS, echo=echo)


def chat_params(body: Mapping[str, Any], tokenizer: Tokenizer, limits: Limits,
                render: Callable[[list[dict[str, Any]]], str] | None) -> Params:
    """``POST /v1/chat/completions``: *render* is the model's chat template (None: the model has none)."""
    check_keys(body, CHAT_KEYS)
    check_model(body, limits)
    if body.get("chat_template_kwargs") not in (None, {}):
        raise InvalidParameter("chat_template_kwargs", "is not supported", code="unsupported_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidParameter("messages", "a non-empty array of messages is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidParameter(f"messages[{i}]", "must be an object with a 'role'")
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise InvalidParameter(f"messages[{i}].role", f"{m['role']!r} is not supported (system, developer, "
                                                          f"user, assistant)")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise InvalidParameter(f"messages[{i}].{sorted(extra)[0]}", "is not supported",
                                   code="unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content):
                raise InvalidParameter(f"messages[{i}].content", "only text content parts are supported")
        elif not isinstance(content, str):
            raise InvalidParameter(f"messages[{i}].content", "must be a string or an array of text parts")
    if render is None:
        raise InvalidParameter("messages", "this model has no chat template (tokenizer_config.json "
                                           "'chat_template'): use /v1/completions", code="no_chat_template")
    normalized = [{**m, "content": m["content"] if isinstance(m["content"], str)
                   else "".join(part["text"] for part in m["content"])} for m in messages]
    text = render(normalized)
    prompt = tuple(tokenizer.encode(text))
    if not prompt:
        raise InvalidParameter("messages", "the rendered prompt is empty")
    return common(body, [(prompt, text)], limits, max_tokens_name="max_tokens", default_max_tokens=None, chat=True)
