"""The front end: an OpenAI-compatible ``POST /v1/completions`` (streaming and not) over the Placement
Controller and the inference instances (docs/inference.md).

For each request it tokenizes the prompt, computes its Block Keys (the front end is a principal of the scope and
holds the scope key), asks the PC for a session, reads the labelled tokens from the instance, and relays each
output index exactly once (:class:`kvsp_quic.frontend.TokenRelay`). When the token stream breaks it asks the PC
where the session went, waits for the new epoch, and resumes reading at the first index it lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from http3.api import KvspApi, RetryElsewhere
from http3.app_kit import check_declared_length, role_app
from http3.asgi_types import ASGIApp
from http3.authz import Rule
from http3.client import KvspClient, TransportError
from http3.metrics_app import mount_metrics
from http3.problem_response import install
from kvsp_quic.auth import Policy
from kvsp_quic.frontend import FrontendOptions, SamplingRequest, TokenRelay
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.metrics import Registry
from kvsp_quic.problems import BadRequest, Problem, Unavailable
from kvsp_quic.roles.controller_records import SessionRequest, SessionState, TokenLine

log = logging.getLogger("kvsp.frontend")

RULES = (Rule("POST", "v1/completions", ["client"]), Rule("GET", "v1/models", ["client"]))


class Tokenizer(Protocol):  # the part of gpu.modelfiles.TextTokenizer the front end needs
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class FrontendStats:
    sessions: int = 0
    failovers: int = 0
    duplicates: int = 0
    stale: int = 0
    tokens: int = 0


@dataclass
class Completion:
    """One request's run: yields (index, token) as they are released; ``reason`` once it ends."""

    frontend: Frontend
    prompt: list[int]
    max_tokens: int
    sampling: SamplingRequest
    session: uuid.UUID = field(default_factory=uuid.uuid4)
    relay: TokenRelay = field(default_factory=TokenRelay)
    reason: str = ""
    instance: str = ""

    async def tokens(self) -> AsyncIterator[tuple[int, int]]:
        fe = self.frontend
        keys = fe.keyer.keys(self.prompt)
        request = SessionRequest(self.session, fe.keyer.scope_id, fe.keyer.compat_id, tuple(self.prompt),
                                 self.max_tokens, self.sampling.sampler(), tuple(keys))
        try:
            assigned = await fe.api.create_session(fe.pc, request)
        except RetryElsewhere as exc:  # the PC is unreachable or busy: the client may try again
            raise exc.problem or Unavailable(f"the Placement Controller: {exc}") from None
        if assigned.instance is None:
            raise Unavailable(f"the Placement Controller placed session {self.session} nowhere")
        self.instance, epoch = assigned.instance, assigned.epoch
        self.relay.new_epoch(epoch)
        fe.stats.sessions += 1
        try:
            async for item in self._follow():
                yield item
        finally:
            fe.stats.duplicates += self.relay.duplicates
            fe.stats.stale += self.relay.stale

    async def _follow(self) -> AsyncIterator[tuple[int, int]]:
        """Read the current instance's tokens; when they stop (the stream broke, or nothing came for
        ``stall_check`` seconds and the PC says the session moved), continue at its new instance."""
        fe = self.frontend
        deadline: float | None = None
        while True:
            queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
            reader = asyncio.create_task(self._pump(self.instance, queue))
            moved: str | None = None
            try:
                while moved is None:
                    try:
                        kind, value = await asyncio.wait_for(queue.get(), fe.options.stall_check_s)
                    except TimeoutError:
                        moved = await self._peek()  # silence: has the PC moved the session meanwhile?
                        continue
                    if kind == "token":
                        deadline = None
                        yield value
                    elif kind == "done":
                        self.reason = value
                        return
                    elif isinstance(value, Problem) and not isinstance(value, TransportError):
                        raise value
                    else:
                        log.info("session %s: token stream from %s broke (%s); asking the PC", self.session,
                                 self.instance, value)
                        break
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
            if moved is None:
                deadline = deadline or time.monotonic() + fe.options.failover_timeout_s
                moved = await self._moved(deadline)
            self.instance = moved
            fe.stats.failovers += 1

    async def _pump(self, instance: str, queue: asyncio.Queue[tuple[str, Any]]) -> None:
        try:
            async for index, token, done in self._read(instance):
                if done is not None:
                    await queue.put(("done", done))
                    return
                await queue.put(("token", (index, token)))
            await queue.put(("broken", TransportError("the token stream ended without a final line")))
        except (TransportError, ValueError, Problem) as exc:
            await queue.put(("broken", exc))

    async def _read(self, instance: str) -> AsyncIterator[tuple[int, int, str | None]]:
        fe = self.frontend
        async with fe.api.tokens(instance, self.session, self.relay.next_index,
                                 timeout=fe.options.read_timeout_s) as lines:
            async for line in lines:
                if line.done:
                    if line.epoch < self.relay.epoch:
                        continue
                    if line.failed:
                        raise Unavailable(f"the instance could not complete the session: "
                                          f"{line.detail or 'no detail'}")
                    yield line.index, -1, line.reason or "length"
                    return
                assert line.token is not None
                if self.relay.offer(line.index, line.epoch, line.token):
                    fe.stats.tokens += 1
                    yield line.index, line.token, None

    async def _peek(self) -> str | None:
        """The session's new instance when the PC has moved it to a newer epoch, else None."""
        try:
            info = await self.frontend.api.session_info(self.frontend.pc, self.session)
        except (TransportError, Problem):
            return None
        if info.epoch > self.relay.epoch and info.instance:
            self.relay.new_epoch(info.epoch)
            return info.instance
        return None

    async def _moved(self, deadline: float) -> str:
        """Wait for the PC to move the session to a new epoch; its new instance."""
        fe = self.frontend
        while time.monotonic() < deadline:
            try:
                info = await fe.api.session_info(fe.pc, self.session)
            except TransportError as exc:  # RetryElsewhere: unreachable, 5xx
                log.warning("session %s: the PC is unreachable (%s)", self.session, exc)
            else:
                if info.epoch > self.relay.epoch or info.state is SessionState.DONE:
                    self.relay.new_epoch(info.epoch)
                    return info.instance or self.instance
            await asyncio.sleep(fe.options.poll_interval_s)
        raise Unavailable(f"session {self.session} was not resumed within {fe.options.failover_timeout_s} s")


@dataclass
class Frontend:
    client: KvspClient
    pc: str
    keyer: BlockKeyer
    tokenizer: Tokenizer
    model_name: str
    options: FrontendOptions = field(default_factory=FrontendOptions)
    random_seed: Callable[[], int] = lambda: secrets.randbelow(1 << 63)
    stats: FrontendStats = field(default_factory=FrontendStats)
    api: KvspApi = field(init=False)

    def __post_init__(self) -> None:
        self.api = KvspApi(self.client)

    def completion(self, body: dict[str, Any]) -> Completion:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                        for t in prompt):
            tokens = list(prompt)
        elif isinstance(prompt, str) and prompt:
            tokens = self.tokenizer.encode(prompt)
        else:
            raise BadRequest("prompt: a non-empty string or array of token ids is required")
        max_tokens = body.get("max_tokens", 16)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= \
                self.options.max_tokens:
            raise BadRequest(f"max_tokens: an integer in [1, {self.options.max_tokens}]")
        sampling = SamplingRequest.from_openai(_number(body, "temperature"), _number(body, "top_p"),
                                               _integer(body, "seed"), self.random_seed())
        return Completion(self, tokens, max_tokens, sampling)


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name}: must be a number")
    return float(value)


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{name}: must be a non-negative integer")
    return value


def frontend_app(frontend: Frontend, policy: Policy, *, base_path: str = "/") -> ASGIApp:
    async def completions(request: Request) -> Response:
        check_declared_length(request, 1 << 20)
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise BadRequest("the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        run = frontend.completion(body)
        created = int(time.time())
        ident = f"cmpl-{run.session}"
        if body.get("stream"):
            return StreamingResponse(_sse(run, frontend, ident, created), media_type="text/event-stream",
                                     headers={"cache-control": "no-store"})
        ids = [token async for _, token in run.tokens()]
        return Response(json.dumps({
            "id": ident, "object": "text_completion", "created": created, "model": frontend.model_name,
            "choices": [{"text": frontend.tokenizer.decode(ids), "index": 0, "logprobs": None,
                         "finish_reason": run.reason or "length"}],
            "usage": {"prompt_tokens": len(run.prompt), "completion_tokens": len(ids),
                      "total_tokens": len(run.prompt) + len(ids)},
            "kvsp": {"session": str(run.session), "epoch": run.relay.epoch, "tokens": ids},
        }), media_type="application/json", headers={"cache-control": "no-store"})

    async def models(request: Request) -> Response:
        return Response(json.dumps({"object": "list", "data": [{"id": frontend.model_name, "object": "model",
                                                                 "owned_by": "kvsp-quic"}]}),
                        media_type="application/json", headers={"cache-control": "no-store"})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"])])
    install(app)
    registry = Registry()
    registry.counter("kvsp_frontend_events_total", "Sessions, failovers, tokens delivered and tokens discarded",
                     ("event",)).collect(lambda: [({"event": name}, float(value))
                                                  for name, value in vars(frontend.stats).items()])
    return role_app(app, policy, mount_metrics(app, registry, RULES), base_path)


async def _sse(run: Completion, frontend: Frontend, ident: str, created: int) -> AsyncIterator[bytes]:
    try:
        async for index, token in run.tokens():
            chunk = {"id": ident, "object": "text_completion", "created": created, "model": frontend.model_name,
                     "choices": [{"text": frontend.tokenizer.decode([token]), "index": 0, "logprobs": None,
                                  "finish_reason": None}],
                     "kvsp": TokenLine(index, run.relay.epoch, token).to_json()}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        final = {"id": ident, "object": "text_completion", "created": created, "model": frontend.model_name,
                 "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": run.reason or "length"}]}
        yield b"data: " + json.dumps(final).encode() + b"\n\n"
    except Problem as exc:  # the response has started: report in-band, as OpenAI-compatible servers do
        yield b"data: " + json.dumps({"error": exc.to_json()}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
