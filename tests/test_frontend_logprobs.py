"""OpenAI's log probability objects from the instance's token lines (kvsp_frontend/openai_routes.py, no I/O)."""

from __future__ import annotations

from kvsp_frontend.openai_routes import LogprobShape


class Utf8:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_completions_shape() -> None:
    shape = LogprobShape(Utf8(), chat=False, top=1)
    lines = [(-0.25, ((104, -0.25), (105, -1.5))), (-2.0, ((120, -0.5),)), None]  # the last: from a checkpoint
    assert shape.render([104, 105, 33], lines, offset=3) == {
        "tokens": ["h", "i", "!"], "token_logprobs": [-0.25, -2.0, None],
        "top_logprobs": [{"h": -0.25}, {"x": -0.5, "i": -2.0}, None],  # the chosen token is always there
        "text_offset": [3, 4, 5]}
    # tokens whose texts are equal (here two partial characters) show the likeliest
    assert shape.render([0xC3], [(-1.0, ((0xC3, -1.0), (0xC4, -0.5)))])["top_logprobs"] == [{"\ufffd": -1.0}]


def test_chat_shape() -> None:
    shape = LogprobShape(Utf8(), chat=True, top=2)
    out = shape.render([104, 105], [(-0.25, ((104, -0.25), (105, -1.5), (106, -3.0))), None])
    assert out == {"content": [
        {"token": "h", "logprob": -0.25, "bytes": [104],
         "top_logprobs": [{"token": "h", "logprob": -0.25, "bytes": [104]},
                          {"token": "i", "logprob": -1.5, "bytes": [105]}]},
        {"token": "i", "logprob": None, "bytes": [105], "top_logprobs": []}]}
