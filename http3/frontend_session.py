"""The front end's sessions: one OpenAI choice is one KVSP session, placed by the Placement Controller and read
from its instance (docs/inference.md).

For each choice the front end computes the prompt's Block Keys (it is a principal of the scope and holds the scope
key), asks the PC for a session, reads the labelled tokens from the instance, and relays each output index exactly
once (:class:`kvsp_quic.frontend.TokenRelay`). When the token stream breaks it asks the PC where the session went,
waits for the new epoch, and resumes reading at the first index it lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from http3.api import KvspApi, RetryElsewhere, ServiceEndpoints
from http3.client import KvspClient, TransportError
from http3.frontend_errors import Overloaded, RateLimited
from http3.frontend_params import Limits, Params
from kvsp_quic.frontend import FrontendOptions, SamplingRequest, TokenRelay
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.problems import Problem
from kvsp_quic.roles.controller_records import SessionRequest, SessionState

log = logging.getLogger("kvsp.frontend")
Logprobs = tuple[float, tuple[tuple[int, float], ...]]  # a token's log probability and the best alternatives

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
    cancelled: int = 0


@dataclass
class Completion:
    """One choice's session: yields (index, token, logprobs) as they are released (logprobs: the token line's
    (logprob, ((token, logprob), ...)) when the sampler asks for them, else None); ``reason`` once it ends."""

    frontend: Frontend
    prompt: list[int]
    max_tokens: int
    sampling: SamplingRequest
    session: uuid.UUID = field(default_factory=uuid.uuid4)
    relay: TokenRelay = field(default_factory=TokenRelay)
    reason: str = ""
    instance: str = ""

    placed: bool = False
    finished: bool = False

    async def place(self) -> None:
        """``POST sessions`` at the PC. Every failure is a Problem with the HTTP status the client gets: the PC's
        (an instance's refusal of the prompt is the caller's 400), or 503 with ``Retry-After`` when the PC is
        unreachable, silent or has no capacity."""
        fe = self.frontend
        keys = fe.keyer.keys(self.prompt)
        request = SessionRequest(self.session, fe.keyer.scope_id, fe.keyer.compat_id, tuple(self.prompt),
                                 self.max_tokens, self.sampling.sampler(), tuple(keys))
        try:
            assigned = await fe.api.create_session(fe.pc, request, timeout=fe.placement_timeout_s)
        except RetryElsewhere as exc:  # the PC is unreachable, busy or failed: the client may try again
            problem = exc.problem
            if problem is not None and problem.status == 429:
                raise RateLimited("the Placement Controller is busy; try again later", 1) from None
            what = "has no capacity for the request now" if problem is not None else "is unavailable"
            raise self._unavailable(what, problem.detail if problem is not None and problem.detail else exc) \
                from None
        except (TransportError, OSError, TimeoutError) as exc:
            raise self._unavailable("is unavailable", exc or type(exc).__name__) from None
        if assigned.instance is None:
            raise Overloaded(f"the Placement Controller placed session {self.session} nowhere")
        self.instance, epoch = assigned.instance, assigned.epoch
        self.relay.new_epoch(epoch)
        self.placed = True
        fe.stats.sessions += 1

    def _unavailable(self, what: str, cause: object) -> Overloaded:
        """The 503 of a PC that cannot place the session: its transport error or answer (internal URIs, peer
        errors) goes to the log under a reference id; the client gets a generic message with that id (issue 13)."""
        ref = uuid.uuid4().hex[:12]
        log.warning("session %s: the Placement Controller %s (ref %s): %s", self.session, what, ref, cause)
        return Overloaded(f"the Placement Controller {what}; try again later (ref {ref})")

    async def tokens(self) -> AsyncIterator[tuple[int, int, Logprobs | None]]:
        """(index, token, logprobs) as they are released, exactly once each, across instance failures."""
        if not self.placed:
            await self.place()
        try:
            async for item in self._follow():
                yield item
            self.finished = True
        finally:
            self.frontend.stats.duplicates += self.relay.duplicates
            self.frontend.stats.stale += self.relay.stale
            self.relay.duplicates = self.relay.stale = 0

    async def _follow(self) -> AsyncIterator[tuple[int, int, Logprobs | None]]:
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
            async for index, token, done, logprobs in self._read(instance):
                if done is not None:
                    await queue.put(("done", done))
                    return
                await queue.put(("token", (index, token, logprobs)))
            await queue.put(("broken", TransportError("the token stream ended without a final line")))
        except (TransportError, ValueError, Problem) as exc:
            await queue.put(("broken", exc))

    async def _read(self, instance: str) -> AsyncIterator[tuple[int, int, str | None, Logprobs | None]]:
        fe = self.frontend
        async with fe.api.tokens(instance, self.session, self.relay.next_index,
                                 timeout=fe.options.read_timeout_s) as lines:
            async for line in lines:
                if line.done:
                    if line.epoch < self.relay.epoch:
                        continue
                    if line.failed:
                        raise Overloaded(f"the instance could not complete the session: "
                                         f"{line.detail or 'no detail'}")
                    yield line.index, -1, line.reason or "length", None
                    return
                assert line.token is not None
                if self.relay.offer(line.index, line.epoch, line.token):
                    fe.stats.tokens += 1
                    logprobs = None if line.logprob is None else (line.logprob, line.top_logprobs or ())
                    yield line.index, line.token, None, logprobs

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
        raise Overloaded(f"session {self.session} was not resumed within {fe.options.failover_timeout_s} s")




@dataclass
class Frontend:
    client: KvspClient
    pc: str | ServiceEndpoints  # the Placement Controller's URI, or URIs (failover; made a ServiceEndpoints)
    keyer: BlockKeyer
    tokenizer: Tokenizer
    model_name: str
    options: FrontendOptions = field(default_factory=FrontendOptions)
    random_seed: Callable[[], int] = lambda: secrets.randbelow(1 << 63)
    stats: FrontendStats = field(default_factory=FrontendStats)
    context: int = 8192  # the model's max_position_embeddings: prompt + output
    vocab_size: int = 1 << 31  # the model's: prompt token ids are below it
    chat_template: Callable[[list[dict[str, Any]]], str] | None = None  # frontend_text.load_chat_template
    placement_timeout_s: float = 30.0  # of POST sessions at the PC
    max_choices: int = 16  # prompts x n per request
    api: KvspApi = field(init=False)

    def __post_init__(self) -> None:
        self.api = KvspApi(self.client)
        self.pc = ServiceEndpoints.of(self.pc, "controller")

    @property
    def limits(self) -> Limits:
        return Limits(self.model_name, self.context, self.vocab_size, self.options.max_tokens, self.max_choices)

    def completions(self, params: Params) -> list[Completion]:
        """One session per choice of *params* (each its own seed: the request's plus the choice's number)."""
        return [Completion(self, list(c.prompt), c.max_tokens,
                           SamplingRequest.from_openai(params.temperature, params.top_p, c.seed, self.random_seed(),
                                                       params.sampling))
                for c in params.choices]
