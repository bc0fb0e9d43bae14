"""The front end's generation endpoints in OpenAI's shapes: ``/v1/completions`` and ``/v1/chat/completions``, whole
and streamed (server-sent events).

A request's choices (prompts x ``n``) are sessions placed before anything is answered, so that a failure to place
one is the response's HTTP status; a streamed response also waits for the first event before it starts (a session
that fails before its first token is an HTTP status too, never a 200 with an error inside). Once streaming, a
failure is reported as OpenAI's servers do: ``data: {"error": {...}}`` and ``data: [DONE]``.

Streamed text is detokenized incrementally (:class:`~kvsp_frontend.text.IncrementalText`): a chunk never holds
part of a character. Every token's chunk carries ``"kvsp"``, its :class:`TokenLine` label (index, epoch, token),
even when its text is still empty. With ``stream_options.include_usage`` the last chunk before ``[DONE]`` has
``"choices": []`` and the usage.

``echo`` with ``logprobs`` answers the prompt's tokens with their log probabilities before the output's (the first
prompt token's are null): each session's sampler asks its instance for ``prompt_logprobs``, and once the first event
is in they are read from ``GET {instance}sessions/{id}`` (:func:`prompt_logprobs_of`; docs/wire.md, "Prompt log
probabilities"). With ``max_tokens: 0`` (echo only) the one token each session samples is not answered.

A client that goes away (its connection or stream closed: the server's ``http.disconnect``, watched while the
response is made, or a failed send) stops the reading here, and :func:`cancel_unfinished` asks the PC to end every
session not finished (``DELETE sessions/{id}``, docs/wire.md "Cancelling a session"), at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from http3.client import TransportError
from kvsp_frontend.auth import charge
from kvsp_frontend.errors import Overloaded, error_json
from kvsp_frontend.params import Params
from kvsp_frontend.session import Completion, Frontend, Logprobs, Tokenizer
from kvsp_frontend.text import StopText
from kvsp_quic.problems import Problem
from kvsp_quic.roles.controller_records import TokenLine

log = logging.getLogger("kvsp.frontend")

Canceller = Callable[[Completion], Awaitable[None]]


@dataclass
class Choice:
    """A choice's state while it is answered."""

    index: int
    run: Completion
    text: StopText
    prefix: str = ""  # echo: the prompt's text
    out: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)  # the released text (whole answers)
    logprobs: list[Logprobs | None] = field(default_factory=list)  # per output token, when asked for
    chars: int = 0  # streamed completions with logprobs: the length of the tokens' texts so far (text_offset)
    prompt_lps: list[Logprobs | None] | None = None  # echo with logprobs: per prompt token (the first: None)
    echo_only: bool = False  # max_tokens 0: the output is not answered

    @property
    def offset(self) -> int:
        """``text_offset`` of the first output token: after the prompt's tokens' texts when they are rendered too,
        else after the echoed prompt."""
        return self.chars if self.prompt_lps is not None else len(self.prefix) + self.chars

    def render(self, lps: LogprobShape | None) -> dict[str, Any] | None:
        """The whole answer's log probabilities: the prompt's and the output's (echo), or the output's."""
        if lps is None:
            return None
        if self.prompt_lps is not None:
            return lps.render([*self.run.prompt, *self.out], [*self.prompt_lps, *self.logprobs], 0)
        return lps.render(self.out, self.logprobs, len(self.prefix))

    @property
    def cumulative(self) -> float:
        """The sum of the output's log probabilities (best_of ranks candidates by it)."""
        return sum(lp[0] if lp is not None else -math.inf for lp in self.logprobs) if self.logprobs else -math.inf

    @property
    def reason(self) -> str:
        if self.echo_only:
            return "length"
        return "stop" if self.text.stopped is not None else self.run.reason or "length"


@dataclass
class Shape:
    """OpenAI's object names and choice members of one endpoint."""

    chat: bool
    model: str
    ident: str
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = {"id": self.ident, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, **extra}
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def delta(self, index: int, text: str | None, reason: str | None, *, role: bool = False,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}

    def whole(self, index: int, text: str, reason: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


@dataclass
class LogprobShape:
    """OpenAI's log probability objects: completions' ``{tokens, token_logprobs, top_logprobs, text_offset}`` and
    chat's ``{content: [{token, logprob, bytes, top_logprobs}]}``. Token strings are each token decoded alone; *top*
    alternatives are shown (completions' ``top_logprobs`` also hold the chosen token, as vLLM's do). A token without
    log probabilities (taken by a resumed run from its checkpoint) has null ones."""

    tokenizer: Tokenizer
    chat: bool
    top: int

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def render(self, tokens: Sequence[int], logprobs: Sequence[Logprobs | None], offset: int = 0) -> dict[str, Any]:
        """The object of *tokens*, the first at character *offset* of the choice's text (completions)."""
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in zip(tokens, logprobs, strict=True):
            text = self.text(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(lp[0])
            alternatives: dict[str, float] = {}
            for t, v in lp[1][:self.top]:  # best first: of tokens with equal texts the likeliest is shown
                alternatives.setdefault(self.text(t), v)
            alternatives.setdefault(text, lp[0])
            out["top_logprobs"].append(alternatives)
        return out

    def _chat_entry(self, token: int, lp: Logprobs | None) -> dict[str, Any]:
        text = self.text(token)
        return {"token": text, "logprob": None if lp is None else lp[0], "bytes": list(text.encode()),
                "top_logprobs": [] if lp is None else [
                    {"token": (alt := self.text(t)), "logprob": v, "bytes": list(alt.encode())}
                    for t, v in lp[1][:self.top]]}


async def prompt_logprobs_of(run: Completion) -> list[Logprobs | None]:
    """The prompt's log probabilities that *run*'s instance computed (``prompt_logprobs`` of ``GET {instance}sessions/
    {id}``, docs/wire.md "Prompt log probabilities"), asked again until ``failover_timeout_ms`` while they are not
    there (a run resumed elsewhere computes them again). 503 when they do not come."""
    fe = run.frontend
    loop = asyncio.get_running_loop()
    deadline = loop.time() + fe.options.failover_timeout_s
    why = "not computed"
    while True:
        try:
            info = await fe.api.session_run(run.instance, run.session, timeout=fe.options.read_timeout_s)
        except (TransportError, Problem) as exc:  # e.g. the instance failed: the session is resumed elsewhere
            why = str(exc)
        else:
            values = info.get("prompt_logprobs")
            if values is not None:
                return parse_prompt_logprobs(values, len(run.prompt))
            if info.get("state") in ("done", "failed") and info.get("epoch") == run.relay.epoch:
                why = f"the run ended without them (state {info.get('state')})"  # a resume that lacked the prompt
                break
        if loop.time() >= deadline:
            break
        await asyncio.sleep(fe.options.poll_interval_s)
    log.warning("session %s: no prompt log probabilities from %s: %s", run.session, run.instance, why)
    raise Overloaded(f"the prompt's log probabilities of session {run.session} are not available; try again")


def parse_prompt_logprobs(values: Any, count: int) -> list[Logprobs | None]:
    """``prompt_logprobs`` of an instance's session: *count* items, null first, then ``[logprob, [[token, logprob],
    ...]]``."""
    try:
        if not isinstance(values, list) or len(values) != count or values[0] is not None:
            raise ValueError(f"{count} items, the first null")
        out: list[Logprobs | None] = [None]
        for value in values[1:]:
            lp, top = value
            out.append((float(lp), tuple((int(t), float(v)) for t, v in top)))
        return out
    except (TypeError, ValueError) as exc:
        raise Overloaded(f"the instance's prompt log probabilities do not parse: {exc}") from None


def usage(params: Params, choices: Sequence[Choice]) -> dict[str, int]:
    out = sum(len(c.out) for c in choices)
    return {"prompt_tokens": params.prompt_tokens, "completion_tokens": out, "total_tokens": params.prompt_tokens + out}


async def place_all(runs: list[Completion], cancel: Canceller) -> None:
    """Place every session; when one fails, cancel those placed and raise its problem."""
    results = await asyncio.gather(*(r.place() for r in runs), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        await cancel_unfinished(runs, cancel)
        raise failed


async def cancel_unfinished(runs: Sequence[Completion], cancel: Canceller) -> None:
    """Ask the PC to end every placed session that has not finished (the client went away, or a sibling failed)."""
    pending = [r for r in runs if r.placed and not r.finished]
    if pending:
        await asyncio.gather(*(cancel(r) for r in pending), return_exceptions=True)


class EventStream(StreamingResponse):
    """Server-sent events; a client that went away mid-stream is the normal end of it, not an error."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            log.info("the client of a stream went away")


class ClientGone(Exception):
    """The client closed its connection or reset its stream before the response was complete."""


async def disconnected(request: Request) -> None:
    """Return when the client has gone (the body was read already: the next ASGI message is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Merge:
    """The events of several choices' token streams as they come: ("token", i, (index, token)), ("end", i, None),
    ("error", i, Problem)."""

    def __init__(self, runs: Sequence[Completion]) -> None:
        self.queue: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(runs)]
        self.open = len(runs)
        self.stopped: set[int] = set()

    def stop(self, i: int) -> None:
        """Choice *i* is complete (a stop string): no more of its events; its session is cancelled (it is not
        ``finished``) when the response ends."""
        if i not in self.stopped:
            self.stopped.add(i)
            self.open -= 1
            self.tasks[i].cancel()

    async def _pump(self, i: int, run: Completion) -> None:
        try:
            async for item in run.tokens():
                await self.queue.put(("token", i, item))
            await self.queue.put(("end", i, None))
        except Problem as exc:
            await self.queue.put(("error", i, exc))
        except Exception as exc:
            log.exception("session %s failed", run.session)
            await self.queue.put(("error", i, Problem(f"the session failed: {type(exc).__name__}", status=500)))

    async def next(self, gone: asyncio.Task[None] | None = None) -> tuple[str, int, Any] | None:
        """The next event; None once every choice ended. :class:`ClientGone` when *gone* (a watch of the client's
        connection) ends first."""
        while True:
            if not self.open:
                return None
            if gone is not None:
                getter = asyncio.ensure_future(self.queue.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    raise ClientGone
                event = getter.result()
            else:
                event = await self.queue.get()
            if event[1] in self.stopped:  # queued before its choice stopped
                continue
            if event[0] != "token":
                self.open -= 1
            return event

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def aclose(self) -> None:
        self.close()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def generate(request: Request, frontend: Frontend, params: Params, *, chat: bool,
                   cancel: Canceller) -> Response:
    """Answer one generation request (whole or streamed)."""
    runs = frontend.completions(params)
    for run, choice in zip(runs, params.choices, strict=True):
        log.info("session %s: choice %d, %d prompt tokens, max_tokens %d%s", run.session, choice.index,
                 len(run.prompt), run.max_tokens, f", user {params.user!r}" if params.user else "")
    await place_all(runs, cancel)
    charge(request, params.prompt_tokens)
    shape = Shape(chat, frontend.model_name, f"{'chatcmpl' if chat else 'cmpl'}-{runs[0].session}")
    choices = [Choice(c.index, run, StopText(frontend.tokenizer, params.stop, params.include_stop),
                      (c.prompt_text if c.prompt_text is not None else frontend.tokenizer.decode(list(c.prompt)))
                      if params.echo else "", echo_only=params.echo_only)
               for c, run in zip(params.choices, runs, strict=True)]
    merge = Merge(runs)
    gone = asyncio.create_task(disconnected(request))
    try:
        first = await merge.next(gone)
        if first is not None and first[0] == "error":
            raise first[2]
        if params.prompt_logprobs:  # computed before the first token: there now (or soon, at the other choices)
            found = await asyncio.gather(*(prompt_logprobs_of(c.run) for c in choices))
            for c, values in zip(choices, found, strict=True):
                c.prompt_lps = values
    except BaseException as exc:
        gone.cancel()
        await merge.aclose()
        background(cancel_unfinished(runs, cancel))
        if isinstance(exc, ClientGone):
            log.info("session %s: the client went away before the first token", runs[0].session)
            return Response(status_code=499)  # nobody reads it
        raise
    if params.stream:
        return EventStream(_stream(request, shape, params, choices, merge, first, cancel, gone),
                           media_type="text/event-stream", headers={"cache-control": "no-store"})
    try:
        event = first
        while event is not None:
            kind, i, value = event
            c = choices[i]
            if kind == "token" and c.echo_only:
                pass  # max_tokens 0: the token sampled is not answered
            elif kind == "token":
                c.out.append(value[1])
                c.logprobs.append(value[2])
                c.parts.append(c.text.add(value[1]))
                charge(request, 1)
                if c.text.stopped is not None:  # a stop string: this choice is complete
                    merge.stop(i)
                    c.parts.append(c.text.flush())
            elif kind == "end":
                c.parts.append(c.text.flush())
            elif kind == "error":
                raise value
            event = await merge.next(gone)
    except ClientGone:
        log.info("session %s: the client went away", runs[0].session)
        return Response(status_code=499)
    finally:
        gone.cancel()
        merge.close()
        background(cancel_unfinished(runs, cancel))
    answered = best(choices, params)
    lps = None if params.logprobs is None else LogprobShape(frontend.tokenizer, chat, params.logprobs)
    body: dict[str, Any] = {
        "id": shape.ident, "object": "chat.completion" if chat else "text_completion", "created": shape.created,
        "model": frontend.model_name,
        "choices": [shape.whole(c.index, c.prefix + "".join(c.parts), c.reason, c.render(lps)) for c in answered],
        "usage": usage(params, choices),
    }
    if len(answered) == 1:
        c = answered[0]
        body["kvsp"] = {"session": str(c.run.session), "epoch": c.run.relay.epoch, "tokens": c.out}
    else:
        body["kvsp"] = {"choices": [{"session": str(c.run.session), "epoch": c.run.relay.epoch, "tokens": c.out}
                                    for c in answered]}
    return Response(json.dumps(body, ensure_ascii=False), media_type="application/json",
                    headers={"cache-control": "no-store"})


async def _stream(request: Request, shape: Shape, params: Params, choices: list[Choice], merge: Merge,
                  first: tuple[str, int, Any] | None, cancel: Canceller,
                  gone: asyncio.Task[None]) -> AsyncIterator[bytes]:
    runs = [c.run for c in choices]
    extra: dict[str, Any] = {"usage": None} if params.include_usage else {}
    lps = None if params.logprobs is None else LogprobShape(choices[0].run.frontend.tokenizer, shape.chat,
                                                            params.logprobs)
    try:
        for c in choices:  # the role (chat) or the echoed prompt first (with its log probabilities)
            if shape.chat or c.prefix or c.prompt_lps is not None:
                echoed = None
                if lps is not None and c.prompt_lps is not None:
                    echoed = lps.render(c.run.prompt, c.prompt_lps, 0)
                    c.chars = sum(len(t) for t in echoed["tokens"])
                yield shape.chunk([shape.delta(c.index, c.prefix if not shape.chat else "", None, role=True,
                                               logprobs=echoed)], **extra)
        event = first
        while event is not None:
            kind, i, value = event
            c = choices[i]
            if kind == "token" and c.echo_only:  # max_tokens 0: the token sampled is not answered
                event = await merge.next(gone)
                continue
            if kind == "token":
                index, token, logprobs = value
                c.out.append(token)
                c.logprobs.append(logprobs)
                charge(request, 1)
                rendered = None if lps is None else lps.render([token], [logprobs], c.offset)
                if rendered is not None and not shape.chat:
                    c.chars += len(rendered["tokens"][0])
                yield shape.chunk([shape.delta(c.index, c.text.add(token), None, logprobs=rendered)],
                                  kvsp=TokenLine(index, c.run.relay.epoch, token).to_json(), **extra)
                if c.text.stopped is not None:  # a stop string: this choice is complete
                    merge.stop(i)
                    kind = "end"
            if kind == "end":
                rest = c.text.flush()
                yield shape.chunk([shape.delta(c.index, rest if not shape.chat or rest else None, c.reason)],
                                  **extra)
            elif kind == "error":
                yield b"data: " + json.dumps(error_json(value), ensure_ascii=False).encode() + b"\n\n"
                break
            event = await merge.next(gone)
        else:
            if params.include_usage:
                yield shape.chunk([], usage=usage(params, choices))
        yield b"data: [DONE]\n\n"
    except ClientGone:
        log.info("session %s: the client went away", runs[0].session)
    finally:  # also when the client went away (a send failed and this generator is closed): nothing may wait
        gone.cancel()
        merge.close()
        background(cancel_unfinished(runs, cancel))


def best(choices: Sequence[Choice], params: Params) -> list[Choice]:
    """The choices answered: all of them, or with ``best_of`` > ``n`` the *n* candidates of each prompt with the
    highest cumulative log probability (numbered again: prompt x n + rank)."""
    if params.best_of <= params.n:
        return list(choices)
    out = []
    for p in range(params.prompts):
        group = list(choices[p * params.best_of:(p + 1) * params.best_of])
        ranked = sorted(group, key=lambda c: c.cumulative, reverse=True)[:params.n]
        for rank, c in enumerate(ranked):
            c.index = p * params.n + rank
            out.append(c)
    return out


_BACKGROUND: set[asyncio.Task[None]] = set()


def background(work: Awaitable[None]) -> None:
    """Run *work* to its end even when the request that started it is cancelled."""
    async def run() -> None:
        try:
            await work
        except Exception:
            log.exception("background work of the front end failed")

    task = asyncio.get_running_loop().create_task(run())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
