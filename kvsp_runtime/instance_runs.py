"""What an instance computes for a session run: the engine's :class:`~kvsp_quic.engine.RunPlan` (which blocks
are resident, followed as they arrive, fetched now, or recomputed) and the hooks through which the run reports.

* :class:`RunPlanner` -- the plan of a start (the prompt's blocks) and of a resume (the checkpoint's prompt and
  generated blocks; the rest recomputed exactly as the first instance computed it, docs/inference.md "Resume").
* :class:`RunHooks` -- the engine's :class:`~kvsp_quic.engine.SessionHooks` for one run: loaded and computed
  tokens, output tokens into the session, completed pages to publish.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping, Sequence
from typing import Generic

from kvsp_quic.engine import (
    BlockInput,
    InstanceEngine,
    Logprobs,
    P,
    PageCache,
    PrefillOutcome,
    PrefixUnavailable,
    RunPlan,
)
from kvsp_quic.keys import BlockKeyChain, BlockKeyer
from kvsp_quic.metrics import KvspMetrics
from kvsp_quic.problems import Problem
from kvsp_quic.roles.instance import InstanceSession, Phase
from kvsp_runtime.instance_blocks import BlockFinder, BlockLoads, close_all, nothing, restrict

log = logging.getLogger("kvsp.instance")

PlanMaker = Callable[[list[P]], Awaitable[RunPlan[P]]]  # given the list that keeps the pages it references


class RunPlanner(Generic[P]):
    """Plans of session runs on *engine*: resident pages first, then blocks *loads* are loading, then blocks found
    by *finder* (None: no Index Service, nothing is fetched), leased for *session_lease_ms* when set."""

    def __init__(self, engine: InstanceEngine[P], loads: BlockLoads[P], finder: BlockFinder | None, *,
                 session_lease_ms: int | None = None, load_timeout_s: float | None = 30.0) -> None:
        self.engine = engine
        self.loads = loads
        self.finder = finder
        self.session_lease_ms = session_lease_ms
        self.load_timeout_s = load_timeout_s

    async def block_inputs(self, session: InstanceSession, keys: Sequence[bytes], count: int,
                           listed: Mapping[bytes, Sequence[str]] | None, held: list[P]) -> list[BlockInput[P] | None]:
        """The inputs of the prefill's first *count* blocks: resident pages (referenced into *held* until the
        prefill takes its own references), blocks being loaded (followed as they arrive), blocks fetched now
        (streamed), and None for the blocks no one has. *listed*: only these keys are looked up, at these sources
        (the PC's lookup); None: every key, anywhere."""
        cache = self.engine.cache
        inputs: list[BlockInput[P] | None] = [None] * count
        need: list[int] = []
        for i in range(count):
            page = cache.lookup(keys[i])
            if page is not None:
                with contextlib.suppress(KeyError):
                    held.append(cache.acquire(page))
                    inputs[i] = page
                    continue
            load = self.loads.get(keys[i])
            if load is not None:
                inputs[i] = load.follow()
            elif listed is None or bytes(keys[i]) in listed:
                need.append(i)
        if need and self.finder is not None:
            try:
                matches = await self.finder.lookup(session.compat_id, session.scope_id, [keys[i] for i in need])
            except Problem as exc:
                log.warning("session %s: lookup refused: %s", session.id, exc)
                matches = {}
            for i in need:
                match = matches.get(bytes(keys[i]))
                if match is not None:
                    match = restrict(match, listed.get(bytes(keys[i])) if listed is not None else None)
                if match is not None:
                    inputs[i] = self.finder.fetcher.fetch_layers(match, lease_ms=self.session_lease_ms)
        return inputs

    def start(self, session: InstanceSession, prompt: Sequence[int], keyer: BlockKeyer,
              listed: Mapping[bytes, Sequence[str]] | None) -> PlanMaker[P]:
        """The plan of a start: the prompt's blocks up to the last one found (gaps are recomputed). A session whose
        sampler asks for ``prompt_logprobs`` loads nothing: every prompt position is computed (docs/wire.md,
        "Prompt log probabilities"); the blocks it computes are published as any run's."""
        keys = [bytes(k) for k in session.prompt_blocks]
        tokens = list(prompt)
        scored = session.prompt_logprobs_asked

        async def make(held: list[P]) -> RunPlan[P]:
            b = self.engine.block_tokens
            usable = 0 if scored is not None else min(len(keys), (len(tokens) - 1) // b)
            inputs = await self.block_inputs(session, keys, usable, listed, held)
            last = max((i for i, x in enumerate(inputs) if x is not None), default=-1)
            blocks = [x if x is not None else nothing() for x in inputs[:last + 1]]
            return RunPlan(tokens=tokens, blocks=blocks, keys=keys, chain=BlockKeyChain(keyer, tokens),
                           chain_first_block=0, sampler=session.sampler(), max_new=session.remaining,
                           stop=session.stop, load_timeout=self.load_timeout_s, output=list(session.output),
                           prompt_logprobs=scored)

        return make

    def resume(self, session: InstanceSession, prompt: Sequence[int] | None, keyer: BlockKeyer) -> PlanMaker[P]:
        """Load the prompt blocks and the generated blocks published before, recompute the rest exactly as the
        first instance computed it (docs/inference.md, "Resume"): the prompt's tail as a prefill chunk, each
        generated token not covered by a loaded block as a decode step. A session that asks for
        ``prompt_logprobs`` and whose resume carries the prompt computes the whole prompt again (and has them
        again), then decodes its output; without the prompt it goes on without them."""
        async def make(held: list[P]) -> RunPlan[P]:
            b = self.engine.block_tokens
            p = len(session.prompt_blocks)
            tail = list(session.prompt_tail)
            n_prompt = session.prompt_len
            scored = session.prompt_logprobs_asked if prompt is not None else None
            # without the prompt its complete blocks' tokens are unknown: placeholders, never computed
            seq = (list(prompt) if prompt is not None else [0] * (p * b) + tail) + list(session.output)
            previous = bytes(session.prompt_blocks[-1]) if p else bytes(32)
            generated_keys = BlockKeyChain(keyer, tail + list(session.output), previous=previous).keys
            keys = [bytes(k) for k in session.prompt_blocks] + [bytes(k) for k in generated_keys]
            limit = min(len(keys), (len(seq) - 1) // b)
            inputs = await self.block_inputs(session, keys, 0 if scored is not None else limit, None, held)
            inputs += [None] * (limit - len(inputs))
            for i in range(min(p, limit)):
                if inputs[i] is None:
                    if prompt is None:
                        await close_all(inputs)
                        raise PrefixUnavailable(f"prompt block {i} is held nowhere and its tokens are unknown "
                                                f"(the resume carries no prompt)")
                    if scored is None:
                        inputs[i] = nothing()  # recomputed from the prompt
            usable = 0 if scored is not None else min(p, limit)
            while usable < limit and inputs[usable] is not None:
                usable += 1  # generated blocks up to the first one nobody holds
            await close_all(inputs[usable:])
            end = n_prompt if usable * b < n_prompt else usable * b + 1
            first = end // b
            chain = BlockKeyChain(keyer, seq[first * b:end], previous=keys[first - 1] if first else bytes(32))
            return RunPlan(tokens=seq[:end], blocks=[x for x in inputs[:usable] if x is not None], keys=keys[:first],
                           chain=chain, chain_first_block=first, replay=seq[end:],
                           must_load=0 if prompt is not None else p, sampler=session.sampler(),
                           max_new=session.remaining, stop=session.stop, load_timeout=self.load_timeout_s,
                           output=list(session.output), prompt_logprobs=scored)

        return make


class RunHooks(Generic[P]):
    """The :class:`~kvsp_quic.engine.SessionHooks` of one run of *session* on *plan*. *held*: the pages the plan
    references until the prefill takes its own references; *adopt(scope_id, key, page)*: publish a completed page."""

    def __init__(self, session: InstanceSession, plan: RunPlan[P], held: list[P], *, cache: PageCache[P],
                 block_tokens: int, metrics: KvspMetrics, clock: Callable[[], float],
                 adopt: Callable[[bytes, bytes, P], None]) -> None:
        self.session = session
        self.plan = plan
        self.held = held
        self.cache = cache
        self.block_tokens = block_tokens
        self.metrics = metrics
        self.clock = clock
        self.adopt = adopt

    def prefilled(self, result: PrefillOutcome) -> None:
        s = self.session
        b = self.block_tokens
        s.loaded_blocks = len(result.loaded_blocks)
        s.recomputed_tokens = len(self.plan.tokens) - result.computed_from + len(result.recomputed_blocks) * b
        self.metrics.fetched_tokens.labels(component="instance").inc(len(result.loaded_blocks) * b)
        self.metrics.recomputed_tokens.labels(component="instance").inc(s.recomputed_tokens)
        for i in result.loaded_blocks:
            item = self.plan.blocks[i]
            where = "resident" if not isinstance(item, AsyncIterable) else \
                (getattr(item, "transports", None) or ["prefetch"])[0]
            s.block_sources[where] = s.block_sources.get(where, 0) + 1
        if result.prompt_logprobs is not None:
            s.prompt_logprobs = list(result.prompt_logprobs)[:s.prompt_len]
        s.phase = Phase.DECODE
        for page in self.held:  # the prefill holds its own references now
            with contextlib.suppress(ValueError):
                self.cache.release(page)
        self.held.clear()

    def token(self, token: int, logprobs: Logprobs | None = None) -> bool:
        s = self.session
        if s.phase.finished:
            return False
        s.append(token, self.clock(), logprobs)
        return True

    def page_complete(self, page: P, key: bytes) -> None:
        self.adopt(self.session.scope_id, key, page)


__all__ = ["PlanMaker", "RunHooks", "RunPlanner"]
