"""The Inference Instance's asyncio service: it connects the role (:mod:`kvsp_quic.roles.instance`, the rules) to
the engine (a :class:`kvsp_quic.engine.InstanceEngine`, injected by the composition root) and to the network.

* admissions: prefetch directives and session starts and resumes, checked by the role, run here;
* block loads: lookups at the Index Service and fetches from the replicas it lists
  (:mod:`kvsp_runtime.instance_blocks`), the plans of session runs (:mod:`kvsp_runtime.instance_runs`), reshard fetches
  and pins (:mod:`kvsp_runtime.instance_reshard`);
* what the instance computes and loads is published: the engine's cache is a holder of its own
  (a :class:`kvsp_quic.engine.PageHolder`), its records go to the Index Service through a
  :class:`kvsp_runtime.publisher.ReplicaPublisher`;
* towards the Placement Controller: ``PUT {pc}instances/{instance-id}/status`` every third of the status TTL (and
  at once after a state change), ``PUT {pc}sessions/{id}/checkpoint`` when a checkpoint is made;
* the token stream of a session (``application/x-ndjson``, one :class:`~kvsp_quic.roles.controller_records.
  TokenLine` per line).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic

from http3.client import KvspClient, TransportError
from kvsp_client.api import Acknowledged, KvspApi, ServiceEndpoints, Stale, Unknown
from kvsp_client.producer_digests import PRODUCER_DIGEST_TTL_MS, ProducerDigestPublisher
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic.auth import Principal, Role, require_scope
from kvsp_quic.compat import InstanceState
from kvsp_quic.engine import InstanceEngine, P, PageHolder, PrefixUnavailable, RunEnd
from kvsp_quic.keys import uri_id
from kvsp_quic.metrics import KvspMetrics, Registry
from kvsp_quic.problems import NotFound, Problem, Unavailable
from kvsp_quic.producer_digests import ProducerDigest
from kvsp_quic.records import (
    LookupMatch,
    PrefetchDirective,
    PrefetchState,
    ReplicaRecord,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    SessionCheckpoint,
)
from kvsp_quic.retrieval_plan import RetrievalMetrics
from kvsp_quic.roles.controller_records import SessionResume, SessionStart, TokenLine
from kvsp_quic.roles.instance import (
    Directive,
    EngineFigures,
    InstanceRole,
    InstanceSession,
    Phase,
    ReshardContext,
    ServiceOptions,
)
from kvsp_runtime.instance_blocks import BlockFinder, BlockLoad, BlockLoads, restrict
from kvsp_runtime.instance_reshard import Resharding
from kvsp_runtime.instance_runs import PlanMaker, RunHooks, RunPlanner
from kvsp_runtime.publisher import ReplicaPublisher

log = logging.getLogger("kvsp.instance")


TIMERS_MIN_WAIT = 0.05  # s: the timers run at most this often
TIMERS_MAX_WAIT = 2.0  # s: and at least this often


class Signal:
    """A level-free wake-up: ``await signal.wait()`` returns after the next ``fire()``."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def waiter(self) -> asyncio.Event:
        """The event the next ``fire()`` sets (take it before checking the condition you wait for)."""
        return self._event


@dataclass(frozen=True)
class RetryLater:
    """A checkpoint the PC did not answer usefully (a transport failure, a 5xx, another refusal, or a 404 from
    every URI of the PC asked: :class:`~kvsp_client.api.Unknown`): sent again, at the next URI that answers; the run
    goes on. Only ``kvsp-stale-epoch`` or an explicit fence (403) -- :class:`~kvsp_client.api.Stale` -- stops it."""

    detail: str


CheckpointOutcome = Acknowledged | Stale | RetryLater


def token_line(session: InstanceSession, index: int) -> bytes:
    """The NDJSON line of output token *index* of *session*."""
    lp = session.logprobs.get(index)
    if lp is None:
        return TokenLine(index, session.epoch, session.output[index]).encode()
    return TokenLine(index, session.epoch, session.output[index], logprob=lp[0], top_logprobs=lp[1]).encode()


def final_line(session: InstanceSession, index: int) -> bytes | None:
    """The last line of a finished *session*'s stream at *index*: done with its reason (at the end of the output),
    or the error; None for a superseded run (its stream ends without one: the front end asks the PC where the
    session went)."""
    if session.phase is Phase.DONE:
        return TokenLine(len(session.output), session.epoch, done=True, reason=session.reason or "length").encode()
    if session.phase is Phase.FAILED:
        return TokenLine(index, session.epoch, done=True, reason="error", detail=session.detail).encode()
    return None


class InstanceService(Generic[P]):
    """The instance's asyncio side: admissions, block loads, session runs, checkpoints, status reports. *finder*:
    lookups and fetches at the Index Service (None: the instance loads no blocks); *publisher*: publishes the
    records of *holder* (None: nothing is published)."""

    def __init__(self, role: InstanceRole, engine: InstanceEngine[P], holder: PageHolder[P], client: KvspClient, *,
                 finder: BlockFinder | None = None, options: ServiceOptions | None = None,
                 publisher: ReplicaPublisher | None = None, metrics: Registry | None = None) -> None:
        options = options if options is not None else ServiceOptions()
        self.role = role
        self.engine = engine
        role.engine_identity = (engine.name, engine.build)  # the "engine" status extension (docs/wire.md)
        self.holder = holder
        self.client = client
        self.api = KvspApi(client, timeout=options.request_timeout_s)
        self.finder = finder
        self.options = options
        # the PC's URIs, one view of them for status reports and checkpoints (failover: ServiceEndpoints)
        self.controller = ServiceEndpoints.of(options.controller, "controller") if options.controller else None
        self.publisher = publisher
        # the producer-digest mode (docs/wire.md, "Producer digests"): the digests of the blocks this instance computes
        # go to the Index Service; with require_producer_digest its fetcher keeps only replicas a producer vouches for
        self.producer_digests: ProducerDigestPublisher | None = None
        if finder is not None:
            finder.fetcher.require_producer_digest(options.require_producer_digest)
            if options.publish_producer_digests or options.require_producer_digest:
                self.producer_digests = ProducerDigestPublisher(client, finder.fetcher.index_uri,
                                                                timeout=options.request_timeout_s)
        self.instance_id = uri_id(role.settings.base_uri)
        self.loads: BlockLoads[P] = BlockLoads(engine.cache, on_loaded=self._loaded, on_finished=self._load_finished)
        self.planner = RunPlanner(engine, self.loads, finder, session_lease_ms=options.session_lease_ms,
                                  load_timeout_s=options.load_timeout_s)
        self.resharding = Resharding(role, engine.cache, self.loads, finder)
        self._slots = asyncio.Semaphore(role.settings.max_running)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runs: dict[uuid.UUID, asyncio.Task[None]] = {}
        self._signals: weakref.WeakKeyDictionary[InstanceSession, Signal] = weakref.WeakKeyDictionary()
        self._adopting: set[bytes] = set()
        self._state_signal = Signal()
        self.role.lifecycle.on_change = self._state_signal.fire  # a change of state is reported at once
        self._timers_signal = Signal()  # a new deadline: the timers look again
        self._background: list[asyncio.Task[None]] = []
        self.checkpoints_sent = 0
        self.reports_failed = 0
        self.retrieval = finder.metrics if finder is not None else RetrievalMetrics()
        self.metrics = metrics if metrics is not None else Registry()
        self.kvsp = KvspMetrics(self.metrics)

    # -- lifecycle of the service ------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.holder.attach(loop.call_soon_threadsafe)
        if self.publisher is not None:
            self.publisher.start()
        if self.producer_digests is not None:
            self.producer_digests.start()
        self._background.append(loop.create_task(self._timers(), name="instance-timers"))
        if self.controller is not None:
            self._background.append(loop.create_task(self._status_loop(), name="instance-status"))

    async def aclose(self) -> None:
        for task in list(self._runs.values()) + list(self._tasks) + self._background:
            task.cancel()
        await asyncio.gather(*self._runs.values(), *self._tasks, *self._background, return_exceptions=True)
        await self.loads.aclose()
        if self.producer_digests is not None:
            await self.producer_digests.stop()
        if self.publisher is not None:
            await self.publisher.stop(withdraw=True)
        self.resharding.release_all()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- helpers -----------------------------------------------------------------------------------------------

    @property
    def block_tokens(self) -> int:
        return self.engine.block_tokens

    def figures(self) -> EngineFigures:
        return self.engine.figures()

    def _finder(self) -> BlockFinder:
        if self.finder is None:
            raise Unavailable("this instance has no Index Service (--index): it cannot load blocks")
        return self.finder

    @property
    def fetcher(self) -> BlockFetcher:
        """The instance's :class:`~kvsp_client.retrieval.BlockFetcher` (leases per call)."""
        return self._finder().fetcher

    async def lookup(self, compat_id: bytes, scope_id: bytes, keys: Sequence[bytes], *,
                     skip_gaps: bool = False) -> dict[bytes, LookupMatch]:
        return await self._finder().lookup(compat_id, scope_id, keys, skip_gaps=skip_gaps)

    def _loaded(self, load: BlockLoad, page: P, digests: tuple[bytes, ...] | None) -> None:
        if load.scope_id is not None:
            self._adopt(load.scope_id, load.key, page, digests)

    def _load_finished(self, load: BlockLoad, stream: Any) -> None:
        records = getattr(stream, "records", None)
        if load.ok and records and load.first_layer_at is not None:
            self.role.links.observe(records[0].holder, load.octets, time.perf_counter() - load.first_layer_at,
                                    load.first_layer_at - load.started)

    def _computed(self, scope_id: bytes, key: bytes, page: P) -> None:
        """A page this instance computed (the run's hooks): published, with its producer digest in the mode."""
        self._adopt(scope_id, key, page, produced=True)

    def _adopt(self, scope_id: bytes, key: bytes, page: P, digests: tuple[bytes, ...] | None = None, *,
               produced: bool = False) -> None:
        """Publish the named complete *page* (digests computed on the engine thread when not known); *produced*:
        this instance computed it (its producer digest is published too, in the producer-digest mode)."""
        key = bytes(key)
        if self.holder.adopted(key) or key in self._adopting:
            return
        if digests is not None:
            self._vouch(self.holder.adopt(scope_id, key, page, digests), produced)
            return
        cache = self.engine.cache
        try:
            cache.acquire(page)
        except KeyError:
            return
        self._adopting.add(key)

        async def run() -> None:
            try:
                layer_digests = await self.engine.digests(page)
                self._vouch(self.holder.adopt(scope_id, key, page, layer_digests), produced)
            finally:
                self._adopting.discard(key)
                cache.release(page)

        self._spawn(run(), f"adopt-{key.hex()[:8]}")

    def _vouch(self, record: ReplicaRecord | None, produced: bool) -> None:
        if produced and record is not None and self.producer_digests is not None:
            self.producer_digests.add(ProducerDigest.of_replica(record, ttl_ms=PRODUCER_DIGEST_TTL_MS))

    def _signal(self, session: InstanceSession) -> Signal:
        signal = self._signals.get(session)
        if signal is None:
            signal = self._signals[session] = Signal()
            session.listeners.append(signal.fire)
        return signal

    # -- prefetch directives ---------------------------------------------------------------------------------

    def prefetch(self, principal: Principal, record: PrefetchDirective) -> Directive:
        require_scope(principal, record.scope_id)
        d, new = self.role.admit_directive(record, self.holder.holds)
        if new and d.state is PrefetchState.PENDING:
            self._spawn(self._run_directive(d), f"directive-{d.id}")
        self._timers_signal.fire()
        return d

    async def _run_directive(self, d: Directive) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, d.deadline - self.role.clock())
        directives = self.role.directives
        mine: list[BlockLoad] = []
        reserved: dict[bytes, BlockLoad] = {}
        try:
            async with asyncio.timeout_at(deadline):
                waits = []
                todo = []
                for key in d.pending:
                    if self.holder.holds(key):
                        directives.block_loaded(d, key)
                    elif (load := self.loads.get(key)) is not None:
                        load.interest += 1
                        mine.append(load)
                        waits.append((key, load))
                    else:
                        todo.append(key)
                for key in todo:  # announced before the lookup: a session start arriving now follows them
                    load = reserved[key] = self.loads.reserve(key)
                    load.interest += 1
                    mine.append(load)
                matches = await self.lookup(d.record.compat_id, d.record.scope_id, todo, skip_gaps=True) \
                    if todo else {}
                fetcher = self.fetcher
                for key in todo:
                    match = matches.get(key)
                    match = restrict(match, d.sources(key)) if match is not None else None
                    if match is None:
                        self.loads.abandon(reserved[key])
                        directives.block_failed(d, key)
                        continue
                    stream = fetcher.fetch_layers(match, lease_ms=d.record.lease_ms)
                    waits.append((key, self.loads.begin(reserved[key], stream, d.record.scope_id)))
                for key, load in waits:
                    if await load.wait() or self.holder.holds(key):
                        directives.block_loaded(d, key)
                    else:
                        directives.block_failed(d, key)
        except TimeoutError:
            pass
        except Problem as exc:  # the Index Service refused the lookup (a scope this instance lacks)
            log.warning("directive %s: %s", d.id, exc)
            for key in d.pending:
                directives.block_failed(d, key)
        finally:
            for load in mine:
                load.interest -= 1
                if load.task is None and reserved.get(load.key) is load:
                    # reserved here and never begun (the deadline passed during the lookup): nobody will begin
                    # it, so a prefill following it must not wait for it -- it recomputes the block
                    self.loads.abandon(load)
                elif load.interest <= 0 and not load.done:
                    self.loads.cancel(load.key)  # the deadline passed and nobody else wants it
            directives.expire()
            log.info("directive %s: %s, %d of %d blocks loaded", d.id, d.state.value, len(d.loaded), len(d.keys))

    # -- sessions ---------------------------------------------------------------------------------------------

    def start_session(self, principal: Principal, sid: uuid.UUID, body: SessionStart) -> InstanceSession:
        admitted = self.role.start_session(principal, sid, body)
        if admitted.new:
            admitted.session.owner = body.owner
            self._supersede(admitted.superseded)
            listed = {bytes(x.block_key): x.sources for x in body.blocks} if body.blocks else None
            self._begin(admitted.session, self.planner.start(admitted.session, body.prompt, admitted.keyer, listed))
        return admitted.session

    def resume_session(self, principal: Principal, sid: uuid.UUID, body: SessionResume) -> InstanceSession:
        admitted = self.role.resume_session(principal, sid, body)
        if admitted.new:
            admitted.session.owner = body.owner
            self._supersede(admitted.superseded)
            self.kvsp.migrations.labels(component="instance").inc()
            self._begin(admitted.session, self.planner.resume(admitted.session, body.prompt, admitted.keyer))
        return admitted.session

    def readable_session(self, principal: Principal, sid: uuid.UUID) -> InstanceSession:
        """The run of *sid* for ``GET sessions/{id}`` and its token stream: a principal of its scope (403
        kvsp-scope-denied otherwise) that is the PC or the session's owner named by the PC's start or resume
        (docs/wire.md, "Session owner"); anyone else gets the 404 of an unknown session, as at the PC."""
        session = self.role.sessions.get(sid)
        require_scope(principal, session.scope_id)
        if not session.readable_by(principal.identity, controller=principal.has_role(Role.CONTROLLER)):
            raise NotFound(f"no session {sid} at this instance")
        return session

    def cancel_session(self, sid: uuid.UUID) -> None:
        """``DELETE sessions/{id}`` from the PC (extension, docs/wire.md "Cancelling a session"): the run stops (its
        slot and pages are freed; its token stream ends without a final line). 404 for an unknown session."""
        session = self.role.sessions.get(sid)
        task = self._runs.get(sid)
        if task is not None and not task.done():
            log.info("session %s epoch %d cancelled by the PC", sid, session.epoch)
            task.cancel()

    def _supersede(self, old: InstanceSession | None) -> None:
        if old is None:
            return
        task = self._runs.get(old.id)
        if task is not None and not task.done():
            task.cancel()

    def _begin(self, session: InstanceSession, plan: PlanMaker[P]) -> None:
        task = asyncio.get_running_loop().create_task(self._run(session, plan), name=f"session-{session.id}")
        self._runs[session.id] = task
        self._spawn(self._checkpoints(session), f"checkpoints-{session.id}")

    async def _run(self, session: InstanceSession, make_plan: PlanMaker[P]) -> None:
        held: list[P] = []
        cache = self.engine.cache
        try:
            async with self._slots:
                if session.phase.finished:
                    return
                session.phase = Phase.PREFILL
                self.role.sessions_changed()
                plan = await make_plan(held)
                if session.remaining == 0:
                    self.role.finish_session(session, Phase.DONE, RunEnd.LENGTH.value)
                    return
                hooks = RunHooks(session, plan, held, cache=cache, block_tokens=self.block_tokens,
                                 metrics=self.kvsp, clock=self.role.clock, adopt=self._computed)
                end = await self.engine.run(plan, hooks)
                if end is not RunEnd.FENCED:
                    self.role.finish_session(session, Phase.DONE, end.value)
        except asyncio.CancelledError:
            self.role.finish_session(session, Phase.SUPERSEDED, None, "cancelled")
            raise
        except (PrefixUnavailable, Problem, ValueError, RuntimeError) as exc:  # RuntimeError: the cache is full
            log.warning("session %s epoch %d failed: %s", session.id, session.epoch, exc)
            self.role.finish_session(session, Phase.FAILED, "error", str(exc))
        except Exception:  # an internal fault: its text stays in the log (it can name paths, peers, other data)
            ref = uuid.uuid4().hex[:12]
            log.exception("session %s epoch %d failed (ref %s)", session.id, session.epoch, ref)
            self.role.finish_session(session, Phase.FAILED, "error", f"internal error (ref {ref} in the log)")
        finally:
            for page in held:
                with contextlib.suppress(ValueError):
                    cache.release(page)
            held.clear()
            if self._runs.get(session.id) is asyncio.current_task():
                del self._runs[session.id]
            session.notify()

    # -- checkpoints ----------------------------------------------------------------------------------------

    async def _checkpoints(self, session: InstanceSession) -> None:
        """Send the session's checkpoints to the PC, the latest first; retry failures; stop when fenced."""
        controller = self.controller
        signal = self._signal(session)
        while True:
            wake = signal.waiter()
            if controller is None:
                session.pending = None
                if session.phase.finished:
                    return
                await wake.wait()
                continue
            cp = session.take_checkpoint()
            if cp is None:
                if session.phase.finished and session.checkpoints_settled:
                    return
                await wake.wait()
                continue
            done = session.phase is Phase.DONE and cp.output_offset == len(session.output)
            outcome = await self._put_checkpoint(controller, cp, done)
            if isinstance(outcome, Stale):
                session.checkpoint_done(cp.output_offset, False)
                self.role.sessions.fence(session, "the PC holds a newer epoch (kvsp-stale-epoch)")
                self.role.sessions_changed()
                task = self._runs.get(session.id)
                if task is not None and self.role.sessions.sessions.get(session.id) is session:
                    task.cancel()
                return
            session.checkpoint_done(cp.output_offset, isinstance(outcome, Acknowledged))
            if isinstance(outcome, RetryLater):
                if session.phase.finished and self.role.sessions.sessions.get(session.id) is not session:
                    log.warning("checkpoint %s at %d: never taken; the finished run was retired", cp.session,
                                cp.output_offset)
                    return  # retired after session_retention_ms: nobody reads it any more
                await asyncio.sleep(self.options.checkpoint_retry_s)

    async def _put_checkpoint(self, controller: str | ServiceEndpoints, cp: SessionCheckpoint,
                              done: bool) -> CheckpointOutcome:
        """``PUT {pc}sessions/{id}/checkpoint`` (with the extension member ``"done"`` once the session ended: the PC
        never migrates it)."""
        try:
            outcome = await self.api.checkpoint(controller, cp, done=done, timeout=self.options.request_timeout_s)
        except (TransportError, Problem) as exc:
            log.info("checkpoint %s at %d: %s", cp.session, cp.output_offset, exc)
            return RetryLater(str(exc))
        self.checkpoints_sent += 1
        if isinstance(outcome, Unknown):
            # not a fence: a PC replica that lost its memory (a restart on an empty memory store), or the session's
            # record not yet visible there; the next attempt asks the PC's URIs again (kvsp_client.api.ServiceEndpoints)
            log.warning("checkpoint %s at %d: %s; sent again", cp.session, cp.output_offset, outcome.detail)
            return RetryLater(outcome.detail)
        if isinstance(outcome, Stale):
            # a newer epoch, or the PC does not (or no longer) take this instance's checkpoints for the session
            log.warning("checkpoint %s at %d: %s; this run stops", cp.session, cp.output_offset, outcome.detail)
        return outcome

    # -- the token stream ------------------------------------------------------------------------------------

    async def tokens(self, session: InstanceSession, start: int) -> AsyncIterator[bytes]:
        """The NDJSON lines of *session*'s released output from index *start*, as they are released, then its
        final line."""
        signal = self._signal(session)
        pos = start
        while True:
            wake = signal.waiter()
            upto = session.releasable()
            if pos < upto:
                yield b"".join(token_line(session, i) for i in range(pos, upto))
                pos = upto
            if session.stream_done(pos):
                last = final_line(session, pos)
                if last is not None:
                    yield last
                return
            await wake.wait()

    # -- lifecycle ----------------------------------------------------------------------------------------

    def put_state(self, state: InstanceState) -> InstanceState:
        held = self.role.lifecycle.set_by_controller(state)
        self._state_signal.fire()  # report now, changed or not (a change fires it too: lifecycle.on_change)
        return held

    async def _status_loop(self) -> None:
        controller = self.controller
        assert controller is not None
        while True:
            delay = self.role.report_due()
            if delay > 0:
                wake = self._state_signal.waiter()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await wake.wait()
                continue
            record = self.role.status_record(self.figures())
            answer: InstanceState | None = None
            try:
                answer = await self.api.put_status(controller, record, timeout=self.options.request_timeout_s)
            except (TransportError, Problem) as exc:
                self.reports_failed += 1
                log.info("status report to %s failed: %s", controller, exc)
            before = self.role.lifecycle.state
            self.role.reported(answer)
            if self.role.lifecycle.state is not before:
                log.info("the PC accepted the sleep request: %s", self.role.lifecycle.state.value)

    async def _timers(self) -> None:
        """The role's and the holder's timers, run when they are due (their ``next_due()``), at least every
        :data:`TIMERS_MAX_WAIT` s (work that became due without a new deadline: a session settled after its
        retention) and at most every :data:`TIMERS_MIN_WAIT` s; a new directive wakes it at once."""
        while True:
            due = [t for t in (self.role.next_due(), self.holder.next_due() if self.publisher is None else None)
                   if t is not None]
            wait = TIMERS_MAX_WAIT if not due else min(TIMERS_MAX_WAIT,
                                                       max(TIMERS_MIN_WAIT, min(due) - self.role.clock()))
            wake = self._timers_signal.waiter()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await wake.wait()
            self.role.sweep()
            if self.publisher is None:
                self.holder.tick()

    # -- resharding -----------------------------------------------------------------------------------------

    async def reshard(self, principal: Principal, msg: ReshardPlan | ReshardCommit | ReshardAbort,
                      context: ReshardContext | None) -> Mapping[str, Any]:
        return await self.resharding.handle(principal, msg, context)


__all__ = ["CheckpointOutcome", "InstanceService", "RetryLater", "ServiceOptions", "Signal", "final_line",
           "token_line"]
