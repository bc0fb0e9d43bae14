"""Text of the front end: incremental detokenization for streams, and the model's chat template.

:class:`IncrementalText` turns tokens into text deltas without ever splitting a character: it decodes a short
window of tokens (from the last boundary where the text was known to be complete) and releases new text only
when it does not end in U+FFFD, the mark a decoder leaves for an incomplete UTF-8 sequence (the method of
Hugging Face's text-generation-inference and vLLM). :meth:`IncrementalText.flush` releases what is left at the end,
so the concatenated deltas equal ``decode(all tokens)``. :class:`StopText` adds stop strings on top, holding back
what could be the beginning of one, so that a stop string that straddles tokens is found and never partly sent.

:func:`load_chat_template` reads ``chat_template`` from the model's ``tokenizer_config.json`` and renders it as
Hugging Face's ``apply_chat_template`` does, in ``jinja2.sandbox.ImmutableSandboxedEnvironment`` (templates come
with downloaded models: they may not touch attributes or methods outside the sandbox's allow-list).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalText:
    """Text deltas of a growing token sequence (see the module docstring)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # the window starts here: a token boundary where the text was complete
        self._read = 0  # the text of ids[_prefix:_read] has been released

    def add(self, token: int) -> str:
        """The text *token* completes ('' while a character is still incomplete)."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        if len(text) > len(before) and not text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """What is left (an incomplete character at the very end decodes as U+FFFD, as in the whole text)."""
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(before):] if text.startswith(before) else text


class ChatTemplateError(ValueError):
    """The model's chat template is missing, malformed or failed to render; one line."""


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": ..., ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


def load_chat_template(model_dir: str | os.PathLike[str]) -> Callable[[list[dict[str, Any]]], str] | None:
    """The renderer of *model_dir*'s chat template (messages -> prompt text with the generation prompt), or None
    when ``tokenizer_config.json`` has none. Raises :class:`ChatTemplateError` for a template that does not parse
    or when jinja2 is not installed."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"{os.fspath(path)!r}: not readable JSON ({exc})") from None
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ChatTemplateError(f"{os.fspath(path)!r}: chat_template must be a string")
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("the chat template needs jinja2: pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                   ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"{os.fspath(path)!r}: the chat template does not parse: {exc}") from None
    tokens = {"bos_token": _token_text(config.get("bos_token")), "eos_token": _token_text(config.get("eos_token"))}

    def render(messages: list[dict[str, Any]]) -> str:
        try:
            return template.render(messages=messages, add_generation_prompt=True, **tokens)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None

    return render


class StopText:
    """:class:`IncrementalText` with stop strings: the text up to the first stop string (with it when *include*),
    released so that a stop string straddling tokens is never partly sent: the last ``len(longest stop) - 1``
    characters are held back until the next token shows they do not begin a stop string. ``stopped`` once one
    matched (the caller ends the session then, with finish_reason ``stop``)."""

    def __init__(self, tokenizer: Decoder, stops: tuple[str, ...] = (), include: bool = False) -> None:
        self.text = IncrementalText(tokenizer)
        self.stops = stops
        self.include = include
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped: str | None = None  # the stop string that matched

    def add(self, token: int) -> str:
        if self.stopped is not None:
            return ""
        self.pending += self.text.add(token)
        return self._release(final=False)

    def flush(self) -> str:
        if self.stopped is None:
            self.pending += self.text.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.stopped is None and self.stops:
            hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
            if hits:
                at, stop = min(hits)
                out, self.pending, self.stopped = self.pending[:at + (len(stop) if self.include else 0)], "", stop
                return out
        cut = len(self.pending) if final else max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out
