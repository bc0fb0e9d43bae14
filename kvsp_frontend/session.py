"""The front end's sessions: one OpenAI choice is one KVSP session, placed by the Placement Controller and read
from its instance (docs/inference.md).

For each choice the front end computes the prompt's Block Keys (it is a principal of the scope and holds the scope
key), asks the PC for a session, reads the labelled tokens from the instance, and relays each output index exactly
once (:class:`kvsp_quic.frontend.TokenRelay`). When the token stream breaks it asks the PC where the session went,
waits for the new epoch, and resumes reading at the first index it lacks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from http3.client import KvspClient, TransportError
from http3.h3_client import KeepAlive
from kvsp_client.api import KvspApi, RetryElsewhere, ServiceEndpoints
from kvsp_frontend.errors import Overloaded, RateLimited
from kvsp_frontend.params import Limits, Params
from kvsp_quic.frontend import FrontendOptions, SamplingRequest, TokenRelay
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.problems import Problem
from kvsp_quic.roles.controller_records import SessionRequest, SessionState, SuspectAnswer, SuspectReport, Verdict

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
    suspects: int = 0  # suspect reports the PC answered


@dataclass
class StallWatch:
    """When a token stream that flows has gone silent for too long: ``factor`` times the 99th percentile of the
    recent gaps between tokens (the last ``window``), at least ``floor_s``, doubled per false alarm in a row.
    Until ``min_gaps`` gaps were seen, and on each new stream until its first token (a resume computes first),
    the caller's own bound applies (:attr:`flowing` is False)."""

    floor_s: float = 0.12
    factor: float = 2.0
    window: int = 64
    min_gaps: int = 8
    gaps: collections.deque[float] = field(default_factory=collections.deque)
    _last: float | None = None
    _alarms: int = 0
    _clock: Callable[[], float] = time.monotonic

    @property
    def flowing(self) -> bool:
        return self._last is not None and len(self.gaps) >= self.min_gaps

    def new_stream(self) -> None:
        self._last = None

    def token(self) -> None:
        now = self._clock()
        if self._last is not None:
            self.gaps.append(now - self._last)
            if len(self.gaps) > self.window:
                self.gaps.popleft()
        self._last = now
        self._alarms = 0

    def false_alarm(self) -> None:
        self._alarms += 1

    def bound(self, otherwise: float) -> float:
        """Seconds of silence after which the stream is suspect (*otherwise* while it is not :attr:`flowing`)."""
        if not self.flowing:
            return otherwise
        ordered = sorted(self.gaps)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return max(self.floor_s, self.factor * p99) * (1 << min(self._alarms, 6))


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
    watch: StallWatch = field(default_factory=lambda: StallWatch())

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
        """Read the current instance's tokens; when they stop, continue at the session's new instance.

        A stream that breaks, or that stalls past the :class:`StallWatch`'s bound once tokens flow, is reported to
        the PC (``POST sessions/{id}/suspect``, docs/wire.md "Suspect reports"), which probes the instance and
        migrates the session at once if it does not answer; its answer names the new instance. A stall report
        does not stop the reading: a false alarm (``healthy``) only lengthens the bound. Without reports
        (``Frontend.suspect`` False), or while no token came yet, silence of ``stall_check`` seconds asks the PC
        whether the session moved, and a broken stream polls it until it did."""
        fe = self.frontend
        deadline: float | None = None
        while True:
            queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
            reader = asyncio.create_task(self._pump(self.instance, queue))
            getter: asyncio.Future[tuple[str, Any]] | None = None
            report: asyncio.Task[SuspectAnswer | None] | None = None
            self.watch.new_stream()
            reading = self.instance, self.relay.epoch
            moved: str | None = None
            read: list[tuple[str, Any]] = []  # what the reader had queued when the stream was left
            try:
                while moved is None:
                    getter = getter or asyncio.ensure_future(queue.get())
                    waits: set[asyncio.Future[Any]] = {getter} if report is None else {getter, report}
                    bound = self.watch.bound(fe.options.stall_check_s) if fe.suspect else fe.options.stall_check_s
                    done, _ = await asyncio.wait(waits, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
                    if report is not None and report in done:
                        answer, report = report.result(), None
                        moved = self._answered(answer)
                        if moved is None:
                            self.watch.false_alarm()
                        continue
                    if getter not in done:  # silence
                        if fe.suspect and self.watch.flowing:
                            if report is None:
                                log.info("session %s: no token from %s for %.0f ms; reporting it", self.session,
                                         self.instance, bound * 1000)
                                report = asyncio.create_task(self._report("stall"))
                        else:
                            moved = await self._peek()  # has the PC moved the session meanwhile?
                        continue
                    kind, value = getter.result()
                    getter = None
                    if kind == "token":
                        deadline = None
                        self.watch.token()
                        yield value
                    elif kind == "done":
                        self.reason = value
                        return
                    elif isinstance(value, Problem) and not isinstance(value, TransportError):
                        raise value
                    else:
                        log.info("session %s: token stream from %s broke (%s)", self.session, self.instance, value)
                        break
            finally:
                for task in (reader, getter, report):
                    if task is not None:
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await task
                read = self._unread(getter, queue)
            # a ``moved`` answer may come while tokens read from this stream wait in the queue: each was offered to
            # the relay (it counts them delivered, and the next read starts after them), so they go out now
            for kind, value in read:
                if kind == "token":
                    self.watch.token()
                    yield value
                elif kind == "done":
                    self.reason = value
                    return
                else:
                    break
            deadline = deadline or time.monotonic() + fe.options.failover_timeout_s
            if moved is None and fe.suspect:
                answer = await self._report("broken")
                moved = self._answered(answer)
                if moved is None and answer is not None and answer.verdict is Verdict.HEALTHY:
                    if time.monotonic() >= deadline:
                        raise Overloaded(f"session {self.session}: its instance answers but its token stream "
                                         f"broke for {fe.options.failover_timeout_s} s")
                    await asyncio.sleep(fe.options.poll_interval_s)
                    moved = self.instance  # the instance is alive: read it again
            if moved is None:
                moved = await self._moved(deadline)
            if (moved, self.relay.epoch) != reading:
                fe.stats.failovers += 1
            self.instance = moved

    @staticmethod
    def _unread(getter: asyncio.Future[tuple[str, Any]] | None, queue: asyncio.Queue[tuple[str, Any]]
                ) -> list[tuple[str, Any]]:
        """The items the (stopped) reader queued that were not taken: the getter's, if it got one, then the queue's."""
        out = [getter.result()] if getter is not None and getter.done() and not getter.cancelled() else []
        while not queue.empty():
            out.append(queue.get_nowait())
        return out

    async def _report(self, reason: str) -> SuspectAnswer | None:
        """``POST sessions/{id}/suspect`` for the epoch being read; None when the PC did not answer it (or does not
        know the extension): the caller falls back to asking where the session went."""
        fe = self.frontend
        started = time.perf_counter()
        try:
            answer = await fe.api.suspect_session(fe.pc, self.session, SuspectReport(self.relay.epoch, reason),
                                                  timeout=fe.suspect_timeout_s)
        except (TransportError, Problem) as exc:
            log.info("session %s: the suspect report found no answer (%s)", self.session, exc)
            return None
        fe.stats.suspects += 1
        log.info("session %s: suspect report (%s) answered %s in %.0f ms: epoch %d at %s", self.session, reason,
                 answer.verdict.value, (time.perf_counter() - started) * 1000, answer.epoch, answer.instance)
        return answer

    def _answered(self, answer: SuspectAnswer | None) -> str | None:
        """The instance to read from when *answer* says the session moved past the epoch being read, else None."""
        if answer is None or answer.verdict is not Verdict.MOVED:
            return None
        if answer.epoch > self.relay.epoch or answer.state is SessionState.DONE:
            self.relay.new_epoch(answer.epoch)
            return answer.instance or self.instance
        return None

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
        if fe.suspect and fe.stream_keepalive is not None:
            fe.client.keep_alive(instance, fe.stream_keepalive)
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
    # Suspect reports (docs/wire.md, "Suspect reports"): a broken or stalled token stream is reported to the PC,
    # which verifies it and migrates at once; False: only ask the PC where the session went (the path before).
    suspect: bool = True
    suspect_timeout_s: float = 15.0  # of a report (the PC's answer waits up to its suspect_wait_ms for a new owner)
    # QUIC PINGs on the connections to instances whose tokens are read (with suspect reports): a peer that died is
    # noticed at the next PING (an ICMP error ends the connection) or after `missed` silent intervals (frozen).
    stream_keepalive: KeepAlive | None = field(default_factory=lambda: KeepAlive(interval=0.1, missed=10))
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
