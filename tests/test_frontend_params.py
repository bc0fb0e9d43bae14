"""The front end's request parameters (no I/O): what is implemented is honoured, everything else is refused with
400 naming the parameter, never ignored."""

from __future__ import annotations

from typing import Any

import pytest

from kvsp_frontend.errors import InvalidParameter, ModelNotFound, error_headers, error_json
from kvsp_frontend.params import Limits, chat_params, completion_params
from kvsp_quic.problems import Unavailable

LIMITS = Limits(model="tiny", context=64, vocab_size=300, max_tokens=40, max_choices=8)


class Utf8:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def params(body: dict[str, Any]) -> Any:
    return completion_params(body, Utf8(), LIMITS)


def test_defaults_and_accepted_neutral_values() -> None:
    p = params({"model": "tiny", "prompt": "hi", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                "stop": None, "logprobs": None, "suffix": None, "n": 1, "best_of": 1, "user": "u1", "stream": False})
    assert p.temperature == 1.0 and p.top_p is None and not p.stream and p.user == "u1"
    assert [(c.index, c.prompt, c.max_tokens, c.seed) for c in p.choices] == [(0, (104, 105), 16, None)]
    assert params({"prompt": "hi", "stop": []}).stop == ()  # an empty stop list is no stop
    assert params({"prompt": "hi", "stop": "\n"}).stop == ("\n",)
    stops = params({"prompt": "hi", "stop": ["a", "bc", "a"], "include_stop_str_in_output": True})
    assert (stops.stop, stops.include_stop) == (("a", "bc"), True)
    assert params({"prompt": "hi", "max_tokens": None}).choices[0].max_tokens == 40  # the operator's limit
    assert params({"prompt": "y" * 50, "max_tokens": None}).choices[0].max_tokens == 14  # the context's room


def test_sampler_parameters_travel_in_the_sampler() -> None:
    p = params({"prompt": "x", "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.25,
                "repetition_penalty": 1.3, "logit_bias": {"7": 100, "9": -5, "11": 0}, "stop_token_ids": [4, 2, 4],
                "logprobs": 3})
    assert p.sampling == {"top_k": 5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.25,
                          "repetition_penalty": 1.3, "logit_bias": {"7": 100.0, "9": -5.0}, "stop_token_ids": [2, 4],
                          "logprobs": 3}
    assert p.logprobs == 3
    # neutral values are left out; top_k -1 and 0 mean all tokens (vLLM)
    neutral = params({"prompt": "x", "top_k": -1, "min_p": 0, "presence_penalty": 0, "repetition_penalty": 1,
                      "logit_bias": {}, "stop_token_ids": [], "logprobs": False})
    assert neutral.sampling == {} and neutral.logprobs is None
    assert params({"prompt": "x", "logprobs": 0}).sampling == {"logprobs": 0}  # the chosen token's only
    best = params({"prompt": ["a", "b"], "n": 2, "best_of": 3, "seed": 1})
    assert (best.n, best.best_of, len(best.choices), best.logprobs) == (2, 3, 6, None)
    assert best.sampling == {"logprobs": 0}  # candidates are ranked by their cumulative log probability


def test_chat_logprobs() -> None:
    def render(messages: list[dict[str, Any]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    base = {"messages": [{"role": "user", "content": "x"}]}
    assert chat_params({**base, "logprobs": True, "top_logprobs": 4}, Utf8(), LIMITS, render).logprobs == 4
    assert chat_params({**base, "logprobs": True}, Utf8(), LIMITS, render).logprobs == 0
    assert chat_params({**base, "logprobs": False, "top_logprobs": 0}, Utf8(), LIMITS, render).logprobs is None
    for body, param in (({**base, "top_logprobs": 2}, "top_logprobs"), ({**base, "logprobs": 2}, "logprobs"),
                        ({**base, "logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        with pytest.raises(InvalidParameter) as info:
            chat_params(body, Utf8(), LIMITS, render)
        assert info.value.param == param


def test_batches_and_n() -> None:
    p = params({"prompt": ["ab", [1, 2, 3]], "n": 2, "seed": 5, "temperature": 0})
    assert [c.index for c in p.choices] == [0, 1, 2, 3] and p.prompts == 2 and p.prompt_tokens == 5
    assert [c.seed for c in p.choices] == [5, 6, 5, 6] and p.temperature == 0
    assert params({"prompt": "x", "seed": -1}).choices[0].seed == (1 << 64) - 1


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "x", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options", ""),
    ({"prompt": "x", "top_k": -2}, "top_k", "[-1, 300]"),
    ({"prompt": "x", "min_p": 1.1}, "min_p", "[0, 1]"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "(0, 100]"),
    ({"prompt": "x", "frequency_penalty": 2.1}, "frequency_penalty", "[-2, 2]"),
    ({"prompt": "x", "presence_penalty": "1"}, "presence_penalty", "number"),
    ({"prompt": "x", "logit_bias": {"300": 1}}, "logit_bias", "not a token id"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "not a token id"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "x", "logit_bias": [5]}, "logit_bias", "object"),
    ({"prompt": "x", "stop_token_ids": [1, 300]}, "stop_token_ids", "out of the vocabulary"),
    ({"prompt": "x", "stop_token_ids": 5}, "stop_token_ids", "array"),
    ({"prompt": "x", "stop": [1, 2]}, "stop", "stop_token_ids"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt": "x", "logprobs": 1, "echo": True, "max_tokens": -1}, "max_tokens", "[0, 40]"),  # 0: echo only
    ({"prompt": "x", "best_of": 2, "n": 3}, "best_of", "at least n"),
    ({"prompt": "x", "best_of": 2, "stream": True}, "best_of", "streamed"),
    ({"prompt": ["a", "b"], "best_of": 5}, "n", "best_of = 10"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop", "must not be empty"),
    ({"prompt": "x", "stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output", "boolean"),
    ({"prompt": "x", "suffix": "end"}, "suffix", "suffix"),
    ({"prompt": "x", "n": 9}, "n", "[1, 8]"),
    ({"prompt": ["a", "b", "c"], "n": 3}, "n", "at most 8"),
    ({"prompt": "x", "temperature": 2.5}, "temperature", "[0, 2]"),
    ({"prompt": "x", "temperature": True}, "temperature", "number"),
    ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "[1, 40]"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "integer"),
    ({"prompt": "y" * 60, "max_tokens": 10}, "max_tokens", "maximum context length is 64 tokens"),
    ({"prompt": "y" * 64}, "prompt", "leaves no room"),
    ({"prompt": [1, 300]}, "prompt", "out of the vocabulary"),
    ({"prompt": [1, True]}, "prompt", "integers"),
    ({"prompt": ["a", ""]}, "prompt[1]", "empty"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": {}}, "prompt", "required"),
    ({"max_tokens": 2}, "prompt", "required"),
    ({"prompt": "x", "user": 5}, "user", "string"),
    ({"prompt": "x", "model": 5}, "model", "string"),
])
def test_refusals_name_the_parameter(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidParameter) as info:
        params(body)
    error = error_json(info.value)["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"


def test_unknown_model_is_404() -> None:
    with pytest.raises(ModelNotFound) as info:
        params({"model": "gpt-4o", "prompt": "x"})
    error = error_json(info.value)["error"]
    assert info.value.status == 404 and error["code"] == "model_not_found" and error["param"] == "model"


def test_retry_after_on_overload() -> None:
    assert error_headers(Unavailable("busy"))["retry-after"] == "1"
    assert error_json(Unavailable("busy"))["error"]["type"] == "server_error"


def test_chat_messages() -> None:
    def render(messages: list[dict[str, Any]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    p = chat_params({"messages": [{"role": "system", "content": "s"},
                                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}],
                     "max_completion_tokens": 3}, Utf8(), LIMITS, render)
    assert bytes(p.choices[0].prompt).decode() == "<system>s<user>ab<assistant>" and p.choices[0].max_tokens == 3
    assert chat_params({"messages": [{"role": "user", "content": "x"}]}, Utf8(), LIMITS,
                       render).choices[0].max_tokens == 40  # absent: up to the context (and the operator's limit)
    for body, param in (({"messages": []}, "messages"),
                        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
                        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
                        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
                        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                          "max_completion_tokens": 2}, "max_tokens")):
        with pytest.raises(InvalidParameter) as info:
            chat_params(body, Utf8(), LIMITS, render)
        assert info.value.param == param
    with pytest.raises(InvalidParameter, match="no chat template"):
        chat_params({"messages": [{"role": "user", "content": "x"}]}, Utf8(), LIMITS, None)


@pytest.mark.parametrize("gone", ["starlette", "bridge"])
async def test_a_client_gone_mid_response_is_no_error(gone: str, caplog: pytest.LogCaptureFixture) -> None:
    """Our ASGI bridge raises ClientDisconnected from ``send`` once the client left (starlette, ClientDisconnect from
    ``receive``): logged as the client going away, never an ERROR with a traceback nor a 500 (kvsp-quic chaos's
    front-end log had one per stream its client gave up on)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.routing import Route

    from http3.asgi_bridge import ClientDisconnected
    from kvsp_frontend.errors import install_errors

    async def endpoint(request: Request) -> None:
        raise ClientDisconnect() if gone == "starlette" else ClientDisconnected("the response can no longer be sent")

    app = Starlette(routes=[Route("/v1/completions", endpoint, methods=["POST"])])
    install_errors(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        with caplog.at_level("INFO", logger="kvsp.frontend"):
            response = await client.post("/v1/completions", json={})
    assert response.status_code == 499
    assert [r.levelname for r in caplog.records if r.name == "kvsp.frontend"] == ["INFO"]
    assert "the client went away" in caplog.text
