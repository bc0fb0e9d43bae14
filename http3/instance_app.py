"""The Inference Instance over HTTP: its KVSP resources, the extension resources of docs/inference.md, and the
asyncio service that connects them to the role (:mod:`kvsp_quic.roles.instance`) and the engine
(:mod:`gpu.engine`).

    POST prefetch                       controller   202, Location: prefetch/<id>        (KVSP)
    GET  prefetch/{id}                  controller   {"directive", "state", "loaded"}    (KVSP)
    POST sessions/{id}/resume           controller   {"session", "epoch", "output_offset"}  (KVSP)
    POST reshard                        controller   plan -> 200 once fetched; commit; abort  (KVSP)
    PUT  state                          controller   {"state"}                            (KVSP)
    POST sessions/{id}/start            controller   201 {"session", "epoch", "output_offset"}  (extension)
    GET  sessions/{id}/tokens?from=N    client       application/x-ndjson                 (extension)
    GET  status                         controller, client   the Instance Status Record  (extension)
    GET  sessions/{id}                  controller, client   the run: state, loaded blocks, TTFT (extension)
    GET  blocks/{compat}/{scope}/{key}  client, instance, holder   its own replicas (holder resources)
    POST leases, PUT/DELETE leases/{id} client, instance, holder

The instance is a holder of its own tiers: :class:`gpu.engine.CacheHolder` is a
:class:`~kvsp_quic.roles.holder.Holder`, so the block and lease routes are :func:`http3.holder_app.holder_routes`,
its records go to the Index Service through :class:`http3.publisher.ReplicaPublisher` (with ``moqt://`` twins),
and :func:`kvsp_moqt.holder_tracks.holder_moqt_handlers` serves them over MOQT on the same UDP port.
``PUT blocks`` is not offered.

Towards the Placement Controller the service sends ``PUT {pc}instances/{instance-id}/status`` every third of the
status TTL (and at once after a state change) and ``PUT {pc}sessions/{id}/checkpoint`` when a checkpoint is made;
blocks are looked up at the Index Service and fetched with :class:`http3.retrieval.BlockFetcher` (MOQT first when
a ``moqt://`` twin exists, falling back to HTTP; leases are HTTP resources, taken at the ``https`` twin).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gpu.engine import BlockLoads, CacheHolder, Engine, PrefixUnavailable, RunPlan, run_session
from gpu.kvcache import CacheFull, Page
from gpu.prefill import BlockInput, PrefillResult
from gpu.sampling import TokenSampler
from http3.app_kit import JSON_MEDIA_TYPE, NO_STORE, kvsp_json, read_json_body, role_app
from http3.asgi_types import ASGIApp
from http3.authz import Rule, principal_of
from http3.client import KvspClient, TransportError
from http3.holder_app import holder_routes
from http3.metrics_app import TransferMetrics, mount_metrics
from http3.problem_response import install
from http3.publisher import ReplicaPublisher
from http3.retrieval import BlockFetcher, BlockSource, HttpSource, Lease
from kvsp_moqt.source import MoqtSource, PreferMoqt
from kvsp_quic import fields as f
from kvsp_quic.auth import Policy, Principal, Role, require_scope
from kvsp_quic.compat import InstanceState
from kvsp_quic.container import DecodedLayer
from kvsp_quic.keys import BlockKeyChain, BlockKeyer, uri_id
from kvsp_quic.metrics import KvspMetrics, Registry, holder_collectors, retrieval_collectors
from kvsp_quic.problems import (
    BadRequest,
    Incompatible,
    NotFound,
    PlanConflict,
    Problem,
    ScopeDenied,
    StaleEpoch,
    Unavailable,
)
from kvsp_quic.records import (
    CheckpointAck,
    LookupMatch,
    PrefetchDirective,
    PrefetchState,
    ReplicaRecord,
    ReshardAbort,
    ReshardCommit,
    Sampler,
    SessionCheckpoint,
    StateMessage,
    parse_reshard,
)
from kvsp_quic.retrieval_plan import RetrievalMetrics
from kvsp_quic.roles.controller_records import SessionResume, SessionStart
from kvsp_quic.roles.instance import (
    Directive,
    EngineFigures,
    InstanceRole,
    MapState,
    Phase,
    ReshardContext,
    Session,
)

log = logging.getLogger("kvsp.instance")

NDJSON = "application/x-ndjson"
MAX_JSON_BYTES = 16 << 20  # prompts of long contexts

_PC = (Role.CONTROLLER,)
_READERS = (Role.CLIENT, Role.INSTANCE, Role.HOLDER)
RULES = (
    Rule("POST", "prefetch", _PC),
    Rule("GET", "prefetch/{directive}", _PC),
    Rule("POST", "sessions/{session}/resume", _PC),
    Rule("POST", "sessions/{session}/start", _PC),
    Rule("POST", "reshard", _PC),
    Rule("PUT", "state", _PC),
    Rule("GET", "sessions/{session}/tokens", (Role.CLIENT,)),
    Rule("GET", "status", (Role.CONTROLLER, Role.CLIENT)),
    Rule("GET", "sessions/{session}", (Role.CONTROLLER, Role.CLIENT)),
    # the instance as a holder of its own tiers (http3/holder_app.py RULES, without PUT blocks)
    Rule("GET", "blocks/{compat}/{scope}/{block_key}", _READERS),
    Rule("POST", "leases", _READERS),
    Rule("PUT", "leases/{lease_id}", _READERS),
    Rule("DELETE", "leases/{lease_id}", _READERS),
)


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


class LeasingMoqtSource(MoqtSource):
    """MOQT has no leases (KVSP leases are HTTP resources): lease a ``moqt://`` replica at its publisher's
    ``https`` base URI, learnt from the lookups that listed both twins."""

    def __init__(self, pool: Any, descriptors: Iterable[Any], http: HttpSource, https_of: Mapping[str, str]) -> None:
        super().__init__(pool, descriptors)
        self.http = http
        self.https_of = https_of

    async def lease(self, record: ReplicaRecord, ttl_ms: int) -> Lease | None:
        namespace = record.namespace
        https = self.https_of.get(namespace[3].decode("ascii")) if namespace else None
        if https is None:
            return None
        twin = dataclasses.replace(record, holder=https, moqt_namespace=None)
        return await self.http.lease(twin, ttl_ms)

    async def release(self, lease: Lease) -> bool:
        return await self.http.release(lease)


def restrict(match: LookupMatch, sources: Sequence[str] | None) -> LookupMatch | None:
    """*match* with only the replicas at *sources* (base URIs; a ``moqt://`` twin published by a listed holder
    counts as that holder's), or None when none is left. *sources* None: every replica."""
    if sources is None:
        return match
    ids = {uri_id(s) for s in sources}
    keep = tuple(r for r in match.replicas
                 if r.holder in sources or (r.namespace is not None and r.namespace[3].decode("ascii") in ids))
    if not keep:
        return None
    return match if len(keep) == len(match.replicas) else LookupMatch(match.block_key, keep)


async def _nothing() -> AsyncIterator[DecodedLayer]:
    """A block source that delivers no layer: the prefill recomputes that block."""
    none: tuple[DecodedLayer, ...] = ()
    for layer in none:
        yield layer


PlanMaker = Callable[[list[Page]], Awaitable[RunPlan]]


def _json_line(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


@dataclass(frozen=True)
class ServiceOptions:
    index: str | None = None  # the Index Service: lookups, and where replicas are published
    controller: str | None = None  # the Placement Controller: status reports, checkpoints
    session_lease_ms: int | None = None  # leases for blocks a session start loads itself (None: none)
    moqt: bool = True  # fetch moqt:// replicas (first), falling back to https
    request_timeout: float = 10.0
    checkpoint_retry_s: float = 0.5
    load_timeout_s: float | None = 30.0  # a block still arriving after this long is recomputed


class InstanceService:
    """The instance's asyncio side: admissions, block loads, session runs, checkpoints, status reports."""

    def __init__(self, role: InstanceRole, engine: Engine, holder: CacheHolder, client: KvspClient, *,
                 keyers: Mapping[bytes, BlockKeyer], options: ServiceOptions = ServiceOptions(),
                 sources: Sequence[BlockSource] | None = None, https_of: dict[str, str] | None = None,
                 publisher: ReplicaPublisher | None = None, metrics: Registry | None = None) -> None:
        self.role = role
        self.engine = engine
        self.holder = holder
        self.client = client
        self.keyers = dict(keyers)
        self.options = options
        self.publisher = publisher
        self.instance_id = uri_id(role.settings.base_uri)
        self.https_of = https_of if https_of is not None else {}
        self.sources: list[BlockSource] = list(sources) if sources is not None else [
            HttpSource(client, timeout=options.request_timeout)]
        self._fetchers: dict[int | None, BlockFetcher] = {}
        self.loads = BlockLoads(engine.cache, on_loaded=self._loaded, on_finished=self._load_finished)
        self._load_scope: dict[bytes, bytes] = {}
        self._slots = asyncio.Semaphore(role.settings.max_running)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runs: dict[uuid.UUID, asyncio.Task[None]] = {}
        self._signals: weakref.WeakKeyDictionary[Session, Signal] = weakref.WeakKeyDictionary()
        self._adopting: set[bytes] = set()
        self._map_pins: dict[tuple[str, int], Page] = {}
        self._state_signal = Signal()
        self._stopping = False
        self._background: list[asyncio.Task[None]] = []
        self.checkpoints_sent = 0
        self.reports_failed = 0
        self.retrieval = RetrievalMetrics()  # every fetcher's
        self.metrics = metrics if metrics is not None else Registry()
        self.kvsp = KvspMetrics(self.metrics)

    # -- lifecycle of the service ------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.holder.attach(loop)
        if self.publisher is not None:
            self.publisher.start()
        self._background.append(loop.create_task(self._timers(), name="instance-timers"))
        if self.options.controller is not None:
            self._background.append(loop.create_task(self._status_loop(), name="instance-status"))

    async def aclose(self) -> None:
        self._stopping = True
        for task in list(self._runs.values()) + list(self._tasks) + self._background:
            task.cancel()
        await asyncio.gather(*self._runs.values(), *self._tasks, *self._background, return_exceptions=True)
        await self.loads.aclose()
        if self.publisher is not None:
            await self.publisher.stop(withdraw=True)
        for page in self._map_pins.values():
            with contextlib.suppress(ValueError):
                self.engine.cache.release(page)
        self._map_pins.clear()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- helpers -----------------------------------------------------------------------------------------------

    @property
    def block_tokens(self) -> int:
        return self.engine.block_tokens

    def figures(self) -> EngineFigures:
        e = self.engine
        return EngineFigures(kv_utilization=e.cache.utilization(), prefill_tokens_per_s=e.prefill_rate.value,
                             decode_tokens_per_s=e.decode_rate.value)

    def keyer(self, scope_id: bytes) -> BlockKeyer:
        keyer = self.keyers.get(bytes(scope_id))
        if keyer is None:
            raise ScopeDenied(f"this instance holds no scope key for scope {bytes(scope_id).hex()} (configure it "
                              f"with --scope-key)")
        return keyer

    def fetcher(self, lease_ms: int | None) -> BlockFetcher:
        if self.options.index is None:
            raise Unavailable("this instance has no Index Service (--index): it cannot load blocks")
        fetcher = self._fetchers.get(lease_ms)
        if fetcher is None:
            shared = next(iter(self._fetchers.values()), None)
            own = [self.role.settings.base_uri]
            if self.publisher is not None and self.publisher.moqt_uri is not None:
                own.append(self.publisher.moqt_uri)
            fetcher = BlockFetcher(
                self.client, self.options.index, lease_ms=lease_ms, descriptors=[self.engine.descriptor],
                exclude_holders=own, sources=self.sources, timeout=self.options.request_timeout,
                ranking=PreferMoqt() if self.options.moqt else None,
                metrics=self.retrieval, failures=shared.failures if shared is not None else None)
            if len(self._fetchers) >= 16:  # one per lease TTL in use; a PC uses one or two
                self._fetchers.pop(next(k for k in self._fetchers if k is not None), None)
            self._fetchers[lease_ms] = fetcher
        return fetcher

    async def lookup(self, compat_id: bytes, scope_id: bytes, keys: Sequence[bytes], *,
                     skip_gaps: bool = False) -> dict[bytes, LookupMatch]:
        """The replicas of *keys* at the Index Service. A lookup stops at the first key without a replica; with
        *skip_gaps* the keys after it are looked up again (a directive's keys need not be a prefix)."""
        out: dict[bytes, LookupMatch] = {}
        fetcher = self.fetcher(None)
        start = 0
        while start < len(keys):
            errors = fetcher.metrics.lookup_errors
            found = await fetcher.lookup(compat_id, scope_id, keys[start:])
            if fetcher.metrics.lookup_errors > errors:
                break  # the Index Service failed: the rest would fail too
            for match in found.blocks:
                out[bytes(match.block_key)] = match
                for r in match.replicas:
                    if r.holder.startswith("https://"):
                        self.https_of[uri_id(r.holder)] = r.holder
            start += found.matched + 1
            if not skip_gaps:
                break
        return out

    def _loaded(self, key: bytes, page: Page, digests: tuple[bytes, ...] | None) -> None:
        scope = self._load_scope.get(key)
        if scope is not None:
            self._adopt(scope, key, page, digests)

    def _load_finished(self, load: Any, stream: Any) -> None:
        self._load_scope.pop(load.key, None)
        records = getattr(stream, "records", None)
        if load.ok and records and load.first_layer_at is not None:
            octets = sum(x.k_length + x.v_length for x in load.layers)
            now = time.perf_counter()
            self.role.links.observe(records[0].holder, octets, now - load.first_layer_at,
                                    load.first_layer_at - load.started)

    def _adopt(self, scope_id: bytes, key: bytes, page: Page, digests: tuple[bytes, ...] | None) -> None:
        """Publish the named complete *page* (digests computed on the engine thread when not known)."""
        key = bytes(key)
        if self.holder.adopted(key) or key in self._adopting:
            return
        if digests is not None:
            self.holder.adopt(scope_id, key, page, digests)
            return
        try:
            self.engine.cache.acquire(page)
        except KeyError:
            return
        self._adopting.add(key)

        async def run() -> None:
            try:
                layer_digests = await self.engine.digests(page)
                self.holder.adopt(scope_id, key, page, layer_digests)
            finally:
                self._adopting.discard(key)
                self.engine.cache.release(page)

        self._spawn(run(), f"adopt-{key.hex()[:8]}")

    def _signal(self, session: Session) -> Signal:
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
        return d

    async def _run_directive(self, d: Directive) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, d.deadline - self.role.clock())
        mine: list[Any] = []
        try:
            async with asyncio.timeout_at(deadline):
                waits = []
                todo = []
                for key in d.pending:
                    if self.holder.holds(key):
                        self.role.directives.block_loaded(d, key)
                    elif (load := self.loads.get(key)) is not None:
                        load.interest += 1
                        mine.append(load)
                        waits.append((key, load))
                    else:
                        todo.append(key)
                reserved = {}
                for key in todo:  # announced before the lookup: a session start arriving now follows them
                    load = reserved[key] = self.loads.reserve(key)
                    load.interest += 1
                    mine.append(load)
                matches = await self.lookup(d.record.compat_id, d.record.scope_id, todo, skip_gaps=True) \
                    if todo else {}
                fetcher = self.fetcher(d.record.lease_ms)
                for key in todo:
                    match = matches.get(key)
                    match = restrict(match, d.sources(key)) if match is not None else None
                    if match is None:
                        self.loads.abandon(reserved[key])
                        self.role.directives.block_failed(d, key)
                        continue
                    self._load_scope[key] = bytes(d.record.scope_id)
                    waits.append((key, self.loads.begin(reserved[key], fetcher.fetch_layers(match))))
                for key, load in waits:
                    if await load.wait() or self.holder.holds(key):
                        self.role.directives.block_loaded(d, key)
                    else:
                        self.role.directives.block_failed(d, key)
        except TimeoutError:
            pass
        except Problem as exc:  # the Index Service refused the lookup (a scope this instance lacks)
            log.warning("directive %s: %s", d.id, exc)
            for key in d.pending:
                self.role.directives.block_failed(d, key)
        finally:
            for load in mine:
                load.interest -= 1
                if load.interest <= 0 and not load.done:
                    self.loads.cancel(load.key)  # the deadline passed and nobody else wants it
            self.role.directives.expire()
            log.info("directive %s: %s, %d of %d blocks loaded", d.id, d.state.value, len(d.loaded), len(d.keys))

    # -- sessions ---------------------------------------------------------------------------------------------

    def _sampler(self, sampler: Sampler) -> TokenSampler:
        try:
            return TokenSampler(sampler.method, params=sampler.params, seed=sampler.seed, step=sampler.step)
        except ValueError as exc:
            raise BadRequest(f"sampler: {exc}") from None

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        vocab = self.engine.model.config.vocab_size
        if tokens and max(tokens) >= vocab:
            raise BadRequest(f"{what}: token ids are below the model's vocabulary size {vocab}")

    def _max_tokens(self, requested: int | None) -> int:
        limit = self.role.settings.max_tokens
        if requested is None:
            return limit
        if requested > limit:
            raise BadRequest(f"max_tokens: at most {limit} at this instance")
        return requested

    def start_session(self, principal: Principal, sid: uuid.UUID, body: SessionStart) -> Session:
        if body.session != sid:
            raise BadRequest(f"session: {body.session} in a request for {sid}")
        require_scope(principal, body.scope_id)
        keyer = self.keyer(body.scope_id)
        if bytes(body.compat_id) != bytes(self.engine.descriptor.compat_id):
            raise Incompatible(f"this instance runs Compatibility ID {self.engine.descriptor.compat_id.hex()}")
        self._check_tokens(body.prompt, "prompt")
        keys = keyer.keys(body.prompt)
        if body.block_keys and tuple(bytes(k) for k in body.block_keys) != tuple(keys[:len(body.block_keys)]):
            raise BadRequest("block_keys: they are not the Block Keys of the prompt in this scope")
        self._sampler(body.sampler)
        b = self.block_tokens
        session, old, new = self.role.new_session(
            session=sid, epoch=body.epoch, compat_id=body.compat_id, scope_id=body.scope_id,
            prompt_len=len(body.prompt), prompt_blocks=keys, prompt_tail=body.prompt[len(keys) * b:],
            max_tokens=self._max_tokens(body.max_tokens), sampler=body.sampler)
        if new:
            self._supersede(old)
            listed = {bytes(x.block_key): x.sources for x in body.blocks} if body.blocks else None
            self._begin(session, self._start_plan(session, list(body.prompt), keys, keyer, listed))
        return session

    def resume_session(self, principal: Principal, sid: uuid.UUID, body: SessionResume) -> Session:
        cp = body.checkpoint
        if cp.session != sid:
            raise BadRequest(f"checkpoint.session: {cp.session} in a request for {sid}")
        require_scope(principal, cp.scope_id)
        keyer = self.keyer(cp.scope_id)
        if bytes(cp.compat_id) != bytes(self.engine.descriptor.compat_id):
            raise Incompatible(f"this instance runs Compatibility ID {self.engine.descriptor.compat_id.hex()}")
        b = self.block_tokens
        self._check_tokens([*cp.prompt_tail, *cp.generated, *(body.prompt or ())], "checkpoint")
        prompt_len = len(cp.prompt_blocks) * b + len(cp.prompt_tail)
        if len(cp.prompt_tail) >= b:
            raise BadRequest(f"checkpoint.prompt_tail: {len(cp.prompt_tail)} tokens; a tail is shorter than a block")
        if body.prompt is not None and (
                len(body.prompt) != prompt_len or tuple(keyer.keys(body.prompt)) != tuple(cp.prompt_blocks)
                or tuple(body.prompt[len(cp.prompt_blocks) * b:]) != tuple(cp.prompt_tail)):
            raise BadRequest("prompt: it is not the prompt of the checkpoint's blocks and tail")
        offset = cp.output_offset
        if offset == 0 and not cp.prompt_tail and body.prompt is None and cp.prompt_blocks:
            raise BadRequest("a checkpoint at output_offset 0 whose prompt ends on a block boundary cannot be "
                             "resumed without the prompt (the last prompt token's logits need its token): send "
                             "'prompt', or start the session again")
        generated = cp.generated[:offset]
        extra = len(cp.generated) - offset  # tokens after the offset are not covered: they are generated again
        sampler = dataclasses.replace(cp.sampler, step=max(0, cp.sampler.step - extra))
        self._sampler(sampler)
        session, old, new = self.role.new_session(
            session=sid, epoch=body.epoch, compat_id=cp.compat_id, scope_id=cp.scope_id, prompt_len=prompt_len,
            prompt_blocks=cp.prompt_blocks, prompt_tail=cp.prompt_tail,
            max_tokens=self._max_tokens(body.max_tokens), sampler=sampler, output=generated)
        if new:
            self._supersede(old)
            self.kvsp.migrations.labels(component="instance").inc()
            self._begin(session, self._resume_plan(session, body.prompt, keyer))
        return session

    def _supersede(self, old: Session | None) -> None:
        if old is None:
            return
        task = self._runs.get(old.id)
        if task is not None and not task.done():
            task.cancel()

    def _begin(self, session: Session, plan: PlanMaker) -> None:
        task = asyncio.get_running_loop().create_task(self._run(session, plan), name=f"session-{session.id}")
        self._runs[session.id] = task
        self._spawn(self._checkpoints(session), f"checkpoints-{session.id}")

    async def _block_inputs(self, session: Session, keys: Sequence[bytes], count: int,
                            listed: Mapping[bytes, Sequence[str]] | None, held: list[Page]) -> list[BlockInput | None]:
        """The inputs of the prefill's first *count* blocks: resident pages (referenced into *held* until the
        prefill takes its own references), blocks a directive is loading (followed as they arrive), blocks
        fetched now (streamed), and None for the blocks no one has. *listed*: only these keys are looked up,
        at these sources (the PC's lookup); None: every key, anywhere."""
        cache = self.engine.cache
        inputs: list[BlockInput | None] = [None] * count
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
        if need and self.options.index is not None:
            try:
                matches = await self.lookup(session.compat_id, session.scope_id, [keys[i] for i in need])
            except Problem as exc:
                log.warning("session %s: lookup refused: %s", session.id, exc)
                matches = {}
            fetcher = self.fetcher(self.options.session_lease_ms)
            for i in need:
                match = matches.get(bytes(keys[i]))
                if match is not None:
                    match = restrict(match, listed.get(bytes(keys[i])) if listed is not None else None)
                if match is not None:
                    inputs[i] = fetcher.fetch_layers(match)
        return inputs

    def _start_plan(self, session: Session, prompt: list[int], keys: list[Any], keyer: BlockKeyer,
                    listed: Mapping[bytes, Sequence[str]] | None) -> PlanMaker:
        async def make(held: list[Page]) -> RunPlan:
            b = self.block_tokens
            usable = min(len(keys), (len(prompt) - 1) // b)
            inputs = await self._block_inputs(session, keys, usable, listed, held)
            last = max((i for i, x in enumerate(inputs) if x is not None), default=-1)
            blocks = [x if x is not None else _nothing() for x in inputs[:last + 1]]  # gaps are recomputed
            return RunPlan(tokens=prompt, blocks=blocks, keys=[bytes(k) for k in keys],
                           chain=BlockKeyChain(keyer, prompt), chain_first_block=0,
                           sampler=self._sampler(session.sampler()), max_new=session.remaining, stop=session.stop,
                           load_timeout=self.options.load_timeout_s)

        return make

    def _resume_plan(self, session: Session, prompt: Sequence[int] | None, keyer: BlockKeyer) -> PlanMaker:
        """Load the prompt blocks and the generated blocks published before, recompute the rest exactly as the
        first instance computed it (docs/inference.md, "Resume"): the prompt's tail as a prefill chunk, each
        generated token not covered by a loaded block as a decode step."""
        async def make(held: list[Page]) -> RunPlan:
            b = self.block_tokens
            p = len(session.prompt_blocks)
            tail = list(session.prompt_tail)
            n_prompt = session.prompt_len
            # without the prompt its complete blocks' tokens are unknown: placeholders, never computed
            seq = (list(prompt) if prompt is not None else [0] * (p * b) + tail) + list(session.output)
            previous = bytes(session.prompt_blocks[-1]) if p else bytes(32)
            generated_keys = BlockKeyChain(keyer, tail + list(session.output), previous=previous).keys
            keys = [bytes(k) for k in session.prompt_blocks] + [bytes(k) for k in generated_keys]
            limit = min(len(keys), (len(seq) - 1) // b)
            inputs = await self._block_inputs(session, keys, limit, None, held)
            for i in range(min(p, limit)):
                if inputs[i] is None:
                    if prompt is None:
                        await _close_all(inputs)
                        raise PrefixUnavailable(f"prompt block {i} is held nowhere and its tokens are unknown "
                                                f"(the resume carries no prompt)")
                    inputs[i] = _nothing()  # recomputed from the prompt
            usable = min(p, limit)
            while usable < limit and inputs[usable] is not None:
                usable += 1  # generated blocks up to the first one nobody holds
            await _close_all(inputs[usable:])
            end = n_prompt if usable * b < n_prompt else usable * b + 1
            first = end // b
            chain = BlockKeyChain(keyer, seq[first * b:end], previous=keys[first - 1] if first else bytes(32))
            return RunPlan(tokens=seq[:end], blocks=[x for x in inputs[:usable] if x is not None], keys=keys[:first],
                           chain=chain, chain_first_block=first, replay=seq[end:],
                           must_load=0 if prompt is not None else p, sampler=self._sampler(session.sampler()),
                           max_new=session.remaining, stop=session.stop, load_timeout=self.options.load_timeout_s)

        return make

    async def _run(self, session: Session, make_plan: PlanMaker) -> None:
        held: list[Page] = []
        try:
            async with self._slots:
                if session.phase.finished:
                    return
                session.phase = Phase.PREFILL
                self.role.sessions_changed()
                plan = await make_plan(held)
                if session.remaining == 0:
                    self.role.finish_session(session, Phase.DONE, "length")
                    return
                hooks = _Hooks(self, session, held, plan)
                reason = await run_session(self.engine, plan, hooks)
                if reason != "fenced":
                    self.role.finish_session(session, Phase.DONE, reason)
        except asyncio.CancelledError:
            self.role.finish_session(session, Phase.SUPERSEDED, None, "cancelled")
            raise
        except (PrefixUnavailable, CacheFull, Problem, ValueError, RuntimeError) as exc:
            log.warning("session %s epoch %d failed: %s", session.id, session.epoch, exc)
            self.role.finish_session(session, Phase.FAILED, "error", str(exc))
        except Exception as exc:
            log.exception("session %s epoch %d failed", session.id, session.epoch)
            self.role.finish_session(session, Phase.FAILED, "error", repr(exc))
        finally:
            for page in held:
                with contextlib.suppress(ValueError):
                    self.engine.cache.release(page)
            held.clear()
            if self._runs.get(session.id) is asyncio.current_task():
                del self._runs[session.id]
            session.notify()

    # -- checkpoints ----------------------------------------------------------------------------------------

    async def _checkpoints(self, session: Session) -> None:
        """Send the session's checkpoints to the PC, the latest first; retry failures; stop when fenced."""
        controller = self.options.controller
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
            if outcome == "stale":
                session.checkpoint_done(cp.output_offset, False)
                self.role.sessions.fence(session, "the PC holds a newer epoch (kvsp-stale-epoch)")
                self.role.sessions_changed()
                task = self._runs.get(session.id)
                if task is not None and self.role.sessions.sessions.get(session.id) is session:
                    task.cancel()
                return
            session.checkpoint_done(cp.output_offset, outcome == "ok")
            if outcome != "ok":
                await asyncio.sleep(self.options.checkpoint_retry_s)

    async def _put_checkpoint(self, controller: str, cp: SessionCheckpoint, done: bool) -> str:
        url = f"{controller}sessions/{cp.session}/checkpoint"
        obj = cp.to_json()
        if done:
            obj["done"] = True  # extension member: the session ended (the PC never migrates it)
        body = json.dumps(obj, separators=(",", ":")).encode()
        try:
            response = await self.client.request("PUT", url, headers={"content-type": JSON_MEDIA_TYPE},
                                                 content=body, timeout=self.options.request_timeout)
        except TransportError as exc:
            log.info("checkpoint %s at %d: %s", cp.session, cp.output_offset, exc)
            return "retry"
        if response.status == 200:
            self.checkpoints_sent += 1
            with contextlib.suppress(Problem, ValueError):
                ack = CheckpointAck.loads(response.content or b"")
                if ack.epoch > cp.epoch:
                    return "stale"
            return "ok"
        problem = response.problem()
        if isinstance(problem, StaleEpoch) or response.status in (403, 404):
            # a newer epoch, or the PC does not (or no longer) take this instance's checkpoints for the session
            log.warning("checkpoint %s at %d: %s; this run stops", cp.session, cp.output_offset,
                        problem or response.status)
            return "stale"
        log.warning("checkpoint %s at %d: %s", cp.session, cp.output_offset, problem or response.status)
        return "retry"

    # -- the token stream ------------------------------------------------------------------------------------

    async def tokens(self, session: Session, start: int) -> AsyncIterator[bytes]:
        signal = self._signal(session)
        pos = start
        while True:
            wake = signal.waiter()
            upto = session.releasable()
            if pos < upto:
                yield b"".join(_json_line({"index": i, "epoch": session.epoch, "token": session.output[i]})
                               for i in range(pos, upto))
                pos = upto
            if session.stream_done(pos):
                if session.phase is Phase.DONE:
                    yield _json_line({"index": len(session.output), "epoch": session.epoch, "done": True,
                                      "reason": session.reason or "length"})
                elif session.phase is Phase.FAILED:
                    yield _json_line({"index": pos, "epoch": session.epoch, "done": True, "reason": "error",
                                      "detail": session.detail})
                return  # superseded: no final line (the front end asks the PC where the session went)
            await wake.wait()

    # -- lifecycle ----------------------------------------------------------------------------------------

    def put_state(self, state: InstanceState) -> InstanceState:
        held = self.role.lifecycle.set_by_controller(state)
        self._state_signal.fire()
        return held

    async def _status_loop(self) -> None:
        controller = self.options.controller
        assert controller is not None
        url = f"{controller}instances/{self.instance_id}/status"
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
                response = await self.client.request(
                    "PUT", url, headers={"content-type": JSON_MEDIA_TYPE},
                    content=json.dumps(record.to_json(), separators=(",", ":")).encode(),
                    timeout=self.options.request_timeout)
                if response.status == 200:
                    answer = StateMessage.loads(response.content or b"").state
                else:
                    self.reports_failed += 1
                    log.warning("status report: %s", response.problem() or response.status)
            except (TransportError, Problem) as exc:
                self.reports_failed += 1
                log.info("status report to %s failed: %s", url, exc)
            before = self.role.lifecycle.state
            self.role.reported(answer)
            if self.role.lifecycle.state is not before:
                log.info("the PC accepted the sleep request: %s", self.role.lifecycle.state.value)

    async def _timers(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.role.sweep()
            if self.publisher is None:
                self.holder.tick()
            if self.role.lifecycle.changed:
                self._state_signal.fire()

    # -- resharding -----------------------------------------------------------------------------------------

    async def reshard(self, principal: Principal, body: Mapping[str, Any]) -> dict[str, Any]:
        msg = parse_reshard(body)
        if isinstance(msg, ReshardCommit):
            state, drop = self.role.reshard.commit(msg)
            self._unpin(state.map, drop)
            return {"map": state.map, "version": state.version}
        if isinstance(msg, ReshardAbort):
            state_or_none, discard = self.role.reshard.abort(msg)
            if state_or_none is None:
                return {"map": msg.map, "aborted": msg.abort}
            self._unpin(state_or_none.map, discard)
            return {"map": state_or_none.map, "version": state_or_none.version}
        context = ReshardContext.from_json(body["context"], "context") if "context" in body else None
        if context is not None:
            require_scope(principal, context.scope_id)
            if bytes(context.compat_id) != bytes(self.engine.descriptor.compat_id):
                raise Incompatible("context.compat_id: not this instance's cache")
        steps = self.role.reshard.plan(msg, context)
        state = steps.state
        if not steps.new:
            if state.acknowledged:
                return {"map": state.map, "from": msg.from_version, "to": msg.to_version, "acknowledged": True}
            raise PlanConflict(f"map {state.map}: the plan to version {msg.to_version} is still loading")
        cache = self.engine.cache
        ctx = state.context
        retained = {i: cache.lookup(ctx.block_keys[i]) if ctx is not None else None for i in steps.retain
                    if (state.map, i) not in self._map_pins}
        lost = [i for i, page in retained.items() if page is None]
        if lost:
            self.role.reshard.abort(ReshardAbort(msg.map, msg.to_version))
            raise PlanConflict(f"map {state.map}: block(s) {lost} of the retained ranges are not held here")
        for i, page in retained.items():  # retained ranges keep their memory in place: never transferred
            assert page is not None
            self._map_pins[(state.map, i)] = cache.acquire(page)
        self.role.reshard.retained(state, steps.retain)
        try:
            async with asyncio.timeout(msg.deadline_ms / 1000):
                await self._reshard_fetch(state, steps.fetch)
        except (TimeoutError, PrefixUnavailable) as exc:
            detail = "the deadline passed" if isinstance(exc, TimeoutError) else str(exc)
            raise Unavailable(f"map {state.map}: the ranges of version {msg.to_version} are not loaded ({detail}); "
                              f"version {msg.from_version} stays authoritative until a commit or an abort") from None
        self.role.reshard.acknowledge(state)
        return {"map": state.map, "from": msg.from_version, "to": msg.to_version, "acknowledged": True}

    async def _reshard_fetch(self, state: MapState, fetch: Sequence[tuple[int, str]]) -> None:
        ctx = state.context
        if not fetch or ctx is None:
            return
        cache = self.engine.cache
        want = [(i, src) for i, src in fetch if (state.map, i) not in self._map_pins]
        resident = [(i, src) for i, src in want if cache.lookup(ctx.block_keys[i]) is not None]
        for i, _src in resident:
            page = cache.lookup(ctx.block_keys[i])
            if page is not None:
                self._map_pins[(state.map, i)] = cache.acquire(page)
                self.role.reshard.fetched(state, [i])
        todo = [(i, src) for i, src in want if (state.map, i) not in self._map_pins]
        if not todo:
            return
        matches = await self.lookup(ctx.compat_id, ctx.scope_id, [ctx.block_keys[i] for i, _ in todo],
                                    skip_gaps=True)
        fetcher = self.fetcher(None)
        waits = []
        for i, src in todo:
            key = bytes(ctx.block_keys[i])
            match = matches.get(key)
            match = restrict(match, [src]) if match is not None else None
            if match is None:
                raise PrefixUnavailable(f"block {i} ({key.hex()}) is not published by {src}")
            load = self.loads.get(key)
            if load is None:
                self._load_scope[key] = bytes(ctx.scope_id)
                load = self.loads.start(key, fetcher.fetch_layers(match))
            load.interest += 1
            waits.append((i, key, load))
        try:
            for i, key, load in waits:
                await load.wait()
                page = cache.lookup(key)
                if page is None:
                    raise PrefixUnavailable(f"block {i} ({key.hex()}) could not be loaded from its instance")
                self._map_pins[(state.map, i)] = cache.acquire(page)
                self.role.reshard.fetched(state, [i])
        finally:
            for _i, _key, load in waits:
                load.interest -= 1

    def _unpin(self, map_id: str, blocks: Iterable[int]) -> None:
        for i in blocks:
            page = self._map_pins.pop((map_id, i), None)
            if page is not None:
                self.engine.cache.release(page)


async def _close_all(items: Iterable[Any]) -> None:
    for item in items:
        closer = getattr(item, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()


class _Hooks:
    """:class:`gpu.engine.SessionHooks` of one run."""

    def __init__(self, service: InstanceService, session: Session, held: list[Page], plan: RunPlan) -> None:
        self.service = service
        self.session = session
        self.held = held
        self.plan = plan

    def prefilled(self, result: PrefillResult) -> None:
        s = self.session
        s.loaded_blocks = len(result.loaded_blocks)
        s.recomputed_tokens = len(self.plan.tokens) - result.computed_from + \
            len(result.recomputed_blocks) * self.service.block_tokens
        kvsp = self.service.kvsp
        kvsp.fetched_tokens.labels(component="instance").inc(len(result.loaded_blocks) * self.service.block_tokens)
        kvsp.recomputed_tokens.labels(component="instance").inc(s.recomputed_tokens)
        for i in result.loaded_blocks:
            item = self.plan.blocks[i]
            where = "resident" if isinstance(item, Page) else (getattr(item, "transports", None) or ["prefetch"])[0]
            s.block_sources[where] = s.block_sources.get(where, 0) + 1
        s.phase = Phase.DECODE
        for page in self.held:  # the prefill holds its own references now
            with contextlib.suppress(ValueError):
                self.service.engine.cache.release(page)
        self.held.clear()

    def token(self, token: int) -> bool:
        s = self.session
        if s.phase.finished:
            return False
        s.append(token, self.service.role.clock())
        return True

    def page_complete(self, page: Page, key: bytes) -> None:
        self.service._adopt(self.session.scope_id, key, page, None)


# -- the HTTP app -------------------------------------------------------------------------------------------------


def _session_id(request: Request) -> uuid.UUID:
    try:
        return f.uuid_string(request.path_params["session"], "session")
    except f.RecordError:
        raise NotFound(f"no session {request.path_params['session']!r}") from None


def _session_answer(session: Session) -> dict[str, Any]:
    return {"session": str(session.id), "epoch": session.epoch, "output_offset": session.base_offset}


def instance_routes(service: InstanceService, *, max_json_bytes: int = MAX_JSON_BYTES) -> Starlette:
    """The starlette app of the instance's resources, without authorization (see :func:`instance_app`)."""

    async def body_of(request: Request) -> dict[str, Any]:
        return f.loads_object(await read_json_body(request, max_json_bytes))

    async def post_prefetch(request: Request) -> Response:
        record = PrefetchDirective.from_json(await body_of(request))
        d = service.prefetch(principal_of(request), record)
        return kvsp_json(d.status().to_json(), 202, {"location": f"prefetch/{d.id}"})

    async def get_prefetch(request: Request) -> Response:
        try:
            directive = f.uuid_string(request.path_params["directive"], "directive")
        except f.RecordError:
            raise NotFound(f"no directive {request.path_params['directive']!r}") from None
        return kvsp_json(service.role.directives.status(directive).to_json())

    async def post_start(request: Request) -> Response:
        sid = _session_id(request)
        body = SessionStart.from_json(await body_of(request))
        session = service.start_session(principal_of(request), sid, body)
        return kvsp_json(_session_answer(session), 201, {"location": f"sessions/{sid}/tokens"})

    async def post_resume(request: Request) -> Response:
        sid = _session_id(request)
        body = SessionResume.from_json(await body_of(request))
        session = service.resume_session(principal_of(request), sid, body)
        return kvsp_json(_session_answer(session))

    async def get_tokens(request: Request) -> Response:
        sid = _session_id(request)
        session = service.role.sessions.get(sid)
        require_scope(principal_of(request), session.scope_id)
        text = request.query_params.get("from", "0")
        if not text.isascii() or not text.isdigit() or len(text) > 10:
            raise BadRequest(f"from={text!r}: expected a token index")
        return StreamingResponse(service.tokens(session, int(text)), media_type=NDJSON, headers=NO_STORE)

    async def get_session(request: Request) -> Response:
        session = service.role.sessions.get(_session_id(request))
        require_scope(principal_of(request), session.scope_id)
        return kvsp_json(session.info())

    async def post_reshard(request: Request) -> Response:
        return kvsp_json(await service.reshard(principal_of(request), await body_of(request)))

    async def put_state(request: Request) -> Response:
        message = StateMessage.from_json(await body_of(request))
        return kvsp_json(StateMessage(service.put_state(message.state)).to_json())

    async def get_status(request: Request) -> Response:
        return kvsp_json(service.role.status_record(service.figures()).to_json())

    holder = holder_routes(service.holder)
    app = Starlette(routes=[
        Route("/prefetch", post_prefetch, methods=["POST"]),
        Route("/prefetch/{directive}", get_prefetch, methods=["GET"]),
        Route("/sessions/{session}/start", post_start, methods=["POST"]),
        Route("/sessions/{session}/resume", post_resume, methods=["POST"]),
        Route("/sessions/{session}/tokens", get_tokens, methods=["GET"]),
        Route("/sessions/{session}", get_session, methods=["GET"]),
        Route("/reshard", post_reshard, methods=["POST"]),
        Route("/state", put_state, methods=["PUT"]),
        Route("/status", get_status, methods=["GET"]),
        *holder.routes,  # the holder's block and lease routes (no catch-all mount: GET metrics is added later)
    ])
    install(app)
    return app


def instance_app(service: InstanceService, policy: Policy, *, base_path: str | None = None) -> ASGIApp:
    """The instance's ASGI app: authorization by certificate identity and :data:`RULES`, below *base_path*
    (default: the path of the instance's base URI), with ``GET metrics`` (any principal; :mod:`http3.metrics_app`):
    fetched and recomputed tokens, migrations (resumes), its holder's and its fetchers' counters, body octets by
    transport."""
    path = urlsplit(service.role.settings.base_uri).path if base_path is None else base_path
    routes = instance_routes(service)
    registry = service.metrics
    holder_collectors(registry, service.holder.metrics, component="instance")
    retrieval_collectors(registry, service.retrieval, component="retrieval")
    rules = mount_metrics(routes, registry, RULES)
    return TransferMetrics(role_app(routes, policy, rules, path), registry, component="instance")


# -- assembly ------------------------------------------------------------------------------------------------------


@dataclass
class InstanceNode:
    """An assembled instance: its service, its ASGI app and MOQT handlers (for one RoleServer), its clients."""

    service: InstanceService
    app: ASGIApp
    quic_handlers: dict[str, Any]
    moqt_uri: str
    client: KvspClient
    pool: Any | None  # moqt.aio.MoqtPool, when MOQT sources are used

    @property
    def role(self) -> InstanceRole:
        return self.service.role

    async def start(self) -> None:
        await self.service.start()

    async def aclose(self) -> None:
        await self.service.aclose()
        if self.pool is not None:
            await self.pool.aclose()
        await self.client.aclose()


def build_instance(engine: Engine, *, base_uri: str, files: Any, policy: Policy, scope_keys: Iterable[bytes] = (),
                   index: str | None = None, controller: str | None = None, epoch: int | None = None,
                   clock: Callable[[], float] = time.monotonic, settings: Mapping[str, Any] | None = None,
                   links: Iterable[Any] = (), replica_ttl_ms: int = 60_000, lease_limits: Any = None,
                   session_lease_ms: int | None = None, moqt: bool = True, transport: Any = None,
                   request_timeout: float = 10.0, load_timeout_s: float | None = 30.0) -> InstanceNode:
    """Wire an instance around *engine*: the role (*settings*: fields of
    :class:`~kvsp_quic.roles.instance.InstanceSettings`), its holder of its own cache, the client (with *files*,
    the instance's certificate) for the Index Service, the PC and other holders, the publisher, the fetch sources
    (MOQT first when *moqt*), the app. *epoch*: default the time now in ms since the Unix epoch."""
    from kvsp_moqt.holder_tracks import holder_moqt_handlers
    from kvsp_moqt.tracks import moqt_uri_for
    from kvsp_quic.roles.holder import HolderSettings
    from kvsp_quic.roles.instance import InstanceSettings
    from kvsp_quic.roles.leases import LeaseLimits
    from moqt.aio import MoqtPool
    from quic.tls import TransportSettings

    transport = transport if transport is not None else TransportSettings()
    d = engine.descriptor
    role_settings = InstanceSettings(base_uri=base_uri, compat_id=bytes(d.compat_id), block_tokens=d.block_tokens,
                                     controller=controller is not None, **dict(settings or {}))
    role = InstanceRole(role_settings, epoch=epoch if epoch is not None else int(time.time() * 1000), clock=clock,
                        links=links)
    holder = CacheHolder(HolderSettings(base_uri, (d,), replica_ttl_ms=replica_ttl_ms,
                                        leases=lease_limits if lease_limits is not None else LeaseLimits()),
                         engine.cache, clock=clock)
    client = KvspClient(files, settings=transport, timeout=request_timeout)
    moqt_uri = moqt_uri_for(base_uri)
    http = HttpSource(client, timeout=request_timeout)
    https_of: dict[str, str] = {}
    pool = None
    sources: list[BlockSource] = [http]
    if moqt:
        pool = MoqtPool(files, settings=transport)
        sources.insert(0, LeasingMoqtSource(pool, [d], http, https_of))
    publisher = ReplicaPublisher(holder, client, index, moqt_uri=moqt_uri) if index is not None else None
    keyers = {}
    for key in scope_keys:
        keyer = BlockKeyer(key, d.compat_id, d.block_tokens)
        keyers[bytes(keyer.scope_id)] = keyer
    options = ServiceOptions(index=index, controller=controller, session_lease_ms=session_lease_ms, moqt=moqt,
                             request_timeout=request_timeout, load_timeout_s=load_timeout_s)
    service = InstanceService(role, engine, holder, client, keyers=keyers, options=options, sources=sources,
                              https_of=https_of, publisher=publisher)
    return InstanceNode(service, instance_app(service, policy), holder_moqt_handlers(holder, policy), moqt_uri,
                        client, pool)


__all__ = ["RULES", "InstanceNode", "InstanceService", "LeasingMoqtSource", "ServiceOptions", "build_instance",
           "instance_app", "instance_routes", "restrict"]
