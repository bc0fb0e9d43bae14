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

from http3.app_kit import check_declared_length, role_app
from http3.asgi_types import ASGIApp
from http3.authz import Rule
from http3.client import KvspClient, TransportError
from http3.metrics_app import mount_metrics
from http3.problem_response import install
from kvsp_quic.auth import Policy
from kvsp_quic.frontend import SamplingRequest, TokenRelay
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.metrics import Registry
from kvsp_quic.problems import BadRequest, Problem, Unavailable

log = logging.getLogger("kvsp.frontend")

JSON = {"content-type": "application/kvsp+json"}
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
        body = {"session": str(self.session), "scope_id": fe.keyer.scope_id.hex(),
                "compat_id": fe.keyer.compat_id.hex(), "prompt": self.prompt, "block_keys": [k.hex() for k in keys],
                "max_tokens": self.max_tokens, "sampler": self.sampling.to_json()}
        r = await fe.client.request("POST", f"{fe.pc}sessions", content=json.dumps(body).encode(), headers=JSON)
        r.raise_for_problem()
        assigned = r.json()
        self.instance, epoch = assigned["instance"], int(assigned["epoch"])
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
                        kind, value = await asyncio.wait_for(queue.get(), fe.stall_check)
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
                deadline = deadline or time.monotonic() + fe.failover_timeout
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
        url = f"{instance}sessions/{self.session}/tokens?from={self.relay.next_index}"
        async with fe.client.stream("GET", url, timeout=fe.read_timeout) as response:
            if response.status != 200:
                await response.aread()
                problem = response.problem()
                raise TransportError(f"GET tokens: {problem or response.status}")
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if item.get("done"):
                        if int(item["epoch"]) < self.relay.epoch:
                            continue
                        if item.get("reason") == "error":
                            raise Unavailable(f"the instance could not complete the session: "
                                              f"{item.get('detail', 'no detail')}")
                        yield int(item["index"]), -1, str(item.get("reason", "length"))
                        return
                    if self.relay.offer(int(item["index"]), int(item["epoch"]), int(item["token"])):
                        fe.stats.tokens += 1
                        yield int(item["index"]), int(item["token"]), None

    async def _peek(self) -> str | None:
        """The session's new instance when the PC has moved it to a newer epoch, else None."""
        try:
            r = await self.frontend.client.request("GET", f"{self.frontend.pc}sessions/{self.session}")
        except TransportError:
            return None
        if r.status != 200:
            return None
        state = r.json()
        if int(state["epoch"]) > self.relay.epoch and state.get("instance"):
            self.relay.new_epoch(int(state["epoch"]))
            return str(state["instance"])
        return None

    async def _moved(self, deadline: float) -> str:
        """Wait for the PC to move the session to a new epoch; its new instance."""
        fe = self.frontend
        while time.monotonic() < deadline:
            try:
                r = await fe.client.request("GET", f"{fe.pc}sessions/{self.session}")
            except TransportError as exc:
                log.warning("session %s: the PC is unreachable (%s)", self.session, exc)
            else:
                if r.status == 200:
                    state = r.json()
                    if int(state["epoch"]) > self.relay.epoch or state.get("done"):
                        self.relay.new_epoch(int(state["epoch"]))
                        return str(state["instance"])
                elif r.status >= 400:
                    r.raise_for_problem()
            await asyncio.sleep(fe.poll_interval)
        raise Unavailable(f"session {self.session} was not resumed within {fe.failover_timeout} s")


@dataclass
class Frontend:
    client: KvspClient
    pc: str
    keyer: BlockKeyer
    tokenizer: Tokenizer
    model_name: str
    max_tokens_limit: int = 4096
    failover_timeout: float = 30.0
    read_timeout: float = 60.0
    poll_interval: float = 0.1
    stall_check: float = 1.0  # seconds without a token before asking the PC whether the session moved
    random_seed: Callable[[], int] = lambda: secrets.randbelow(1 << 63)
    stats: FrontendStats = field(default_factory=FrontendStats)

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
                self.max_tokens_limit:
            raise BadRequest(f"max_tokens: an integer in [1, {self.max_tokens_limit}]")
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
                     "kvsp": {"index": index, "epoch": run.relay.epoch, "token": token}}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        final = {"id": ident, "object": "text_completion", "created": created, "model": frontend.model_name,
                 "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": run.reason or "length"}]}
        yield b"data: " + json.dumps(final).encode() + b"\n\n"
    except Problem as exc:  # the response has started: report in-band, as OpenAI-compatible servers do
        yield b"data: " + json.dumps({"error": exc.to_json()}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
