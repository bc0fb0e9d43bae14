"""The asyncio adapter that keeps a holder's replicas published at the Index Service.

:class:`ReplicaPublisher` drains the holder's sans-I/O outbox (:meth:`Holder.take_intents`) with
:class:`http3.client.KvspClient` (spec: "Publishing and Withdrawing Replicas"):

    PUT    {index-base}replicas/{holder-id}/{block_key}   body: the Replica Record (application/kvsp+json)
    DELETE {index-base}replicas/{holder-id}/{block_key}

The requests are :class:`kvsp_client.api.KvspApi`'s (its failure semantics): a publish is done when the Index Service
stores the record; a withdrawal when the record is gone (withdrawn, or already gone). A refusal, a 5xx and every
transport failure are reported as failed, and the holder retries with backoff. Requests run in their
own tasks, at most *concurrency* at a time, so request handling never waits for the Index Service. The loop
also drives the holder's timers (:meth:`Holder.tick`). The ``ttl_ms`` of the record the Index Service answers a
publish with (it caps TTLs) goes back to the holder: refreshes are due a third of it after the request, and
``Cache-Control: max-age`` of the block never outlives it.

With *moqt_uri* (the holder's ``moqt://host:port/``, whose UDP port serves MOQT next to HTTP/3) every record is
also published as its MOQT twin (:func:`kvsp_quic.records.moqt_record`: ``holder`` = *moqt_uri*, ``moqt_namespace``) at
``replicas/{holder-id of moqt_uri}/{block_key}``, and withdrawn with it. The Index Service accepts the twin only
from a holder whose policy entry lists *moqt_uri* in ``publish_for``; a 403 for it is logged once and not retried
(the ``https`` record is what counts).

The publisher also keeps the holder's liveness record fresh (:class:`LivenessReporter`, ``PUT {index-base}holders/
{holder-id}/liveness`` every third of its TTL; docs/wire.md, "Holder liveness and failure reports"): once it
lapses -- the holder was killed, or froze -- lookups leave out the holder's replicas instead of advertising them
until their TTL runs out.

    publisher = ReplicaPublisher(holder, client, "https://is.example/kvsp/")
    publisher.start()
    ...
    await publisher.stop()                 # or stop(withdraw=True) when the holder leaves for good
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from http3.client import KvspClient, TransportError
from kvsp_client.api import KvspApi, ServiceEndpoints
from kvsp_quic.keys import uri_id
from kvsp_quic.problems import Problem
from kvsp_quic.records import ReplicaRecord, moqt_record
from kvsp_quic.roles.holder import Holder
from kvsp_quic.roles.holder_outbox import Intent, IntentKind

log = logging.getLogger("kvsp.publisher")

DEFAULT_LIVENESS_TTL_MS = 4000  # refreshed every third: a holder that died drops out of lookups within ~4 s


class LivenessReporter:
    """Keeps *holder*'s liveness record fresh at the Index Service: ``PUT holders/{holder-id}/liveness`` now and
    every third of the granted TTL (sooner after a transport failure). An Index Service without the extension
    (404, 405) or a refusal (403) is logged once and asked again every 30 s."""

    def __init__(self, api: KvspApi, index: ServiceEndpoints, holder: str, *,
                 ttl_ms: int = DEFAULT_LIVENESS_TTL_MS, timeout: float = 10.0) -> None:
        if ttl_ms < 3:
            raise ValueError("ttl_ms must be at least 3")
        self.api = api
        self.index = index
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.timeout = timeout
        self.reported = 0  # records the Index Service accepted
        self._refused = False
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kvsp-liveness-{self.holder}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            interval = self.ttl_ms / 3000
            try:
                granted = await self.api.put_liveness(self.index, self.holder, self.ttl_ms,
                                                      timeout=min(self.timeout, interval * 2))
                self.reported += 1
                interval = granted / 3000
            except Problem as exc:
                if not self._refused:
                    self._refused = True
                    log.warning("the Index Service does not take liveness records of %s: %s", self.holder, exc)
                interval = 30.0
            except (TransportError, OSError) as exc:
                log.info("liveness of %s: %s", self.holder, exc)
                interval = min(interval, 0.5)
            await asyncio.sleep(interval)


class ReplicaPublisher:
    def __init__(self, holder: Holder, client: KvspClient, index_base: str | Sequence[str] | ServiceEndpoints, *,
                 concurrency: int = 8,
                 max_sleep: float = 1.0, timeout: float = 10.0, moqt_uri: str | None = None,
                 liveness_ttl_ms: int | None = DEFAULT_LIVENESS_TTL_MS) -> None:
        self.holder = holder
        self.client = client
        self.api = KvspApi(client)
        self.index_base = ServiceEndpoints.of(index_base, "index base URI")  # one URI or several (failover)
        self.holder_id = uri_id(holder.base_uri)
        self.moqt_uri = KvspApi.base(moqt_uri, "moqt URI", schemes=("moqt",)) if moqt_uri is not None else None
        self._moqt_refused = False  # the Index Service answered 403 for a MOQT twin (logged once)
        self.concurrency = concurrency
        self.max_sleep = max_sleep
        self.timeout = timeout
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.liveness = LivenessReporter(self.api, self.index_base, holder.base_uri, ttl_ms=liveness_ttl_ms,
                                         timeout=timeout) if liveness_ttl_ms is not None else None

    def url(self, block_key_hex: str, holder: str | None = None) -> str:
        return self.api.replica_url(self.index_base, holder or self.holder.base_uri, bytes.fromhex(block_key_hex))

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("the publisher is already started")
        self._stopping = False
        self.holder.outbox.wakeup = self._wake.set
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvsp-replica-publisher")
        if self.liveness is not None:
            self.liveness.start()

    async def stop(self, *, withdraw: bool = False, timeout: float = 5.0) -> None:
        """Stop the loop and cancel what is in flight. With *withdraw*, first withdraw every replica (waiting
        up to *timeout* seconds for the Index Service)."""
        if self._task is None:
            return
        if self.liveness is not None:
            await self.liveness.stop()
        if withdraw and self.running:
            self.holder.withdraw_all()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    while len(self.holder.outbox):
                        await asyncio.sleep(0.01)
        self._stopping = True
        self._wake.set()
        task, self._task = self._task, None
        await task
        pending = list(self._inflight)
        for request in pending:
            request.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self.holder.outbox.wakeup == self._wake.set:
            self.holder.outbox.wakeup = None

    async def _run(self) -> None:
        clock = self.holder.clock
        while not self._stopping:
            self._wake.clear()
            try:
                self.holder.tick()
                free = self.concurrency - len(self._inflight)
                if free > 0:
                    for intent in self.holder.take_intents(free):
                        task = asyncio.get_running_loop().create_task(self._send(intent))
                        self._inflight.add(task)
                        task.add_done_callback(self._inflight.discard)
                due = self.holder.next_due()
            except Exception:  # a bug must not end publishing for good
                log.exception("replica publisher iteration failed")
                due = None
            sleep = self.max_sleep
            if due is not None and len(self._inflight) < self.concurrency:
                sleep = min(max(due - clock(), 0.001), self.max_sleep)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(sleep):
                    await self._wake.wait()

    async def _send(self, intent: Intent) -> None:
        url = self.url(intent.block_key)
        ok = False
        granted: list[int] = []  # the TTL the Index Service granted the https record (it caps TTLs)
        try:
            ok = await self._one(intent, url, intent.record, granted=granted)
            if ok and self.moqt_uri is not None:
                twin = moqt_record(intent.record, self.moqt_uri) if intent.record is not None else None
                ok = await self._one(intent, self.url(intent.block_key, self.moqt_uri), twin, twin=True)
        except asyncio.CancelledError:
            self.holder.intent_done(intent, False)
            raise
        except OSError as exc:  # http3.client.TransportError and friends
            log.info("%s %s failed: %s", intent.kind.value, url, exc)
        except Exception:
            log.exception("%s %s failed", intent.kind.value, url)
        self.holder.intent_done(intent, ok, granted[0] if ok and granted else None)
        self._wake.set()

    async def _one(self, intent: Intent, url: str, record: ReplicaRecord | None, *, twin: bool = False,
                   granted: list[int] | None = None) -> bool:
        """One publish or withdrawal through :class:`~kvsp_client.api.KvspApi`: True when done (a withdrawal of a record
        already gone is done too); the ``ttl_ms`` the Index Service granted a publish is appended to *granted*.
        A 4xx refusal is False (retried with backoff), except a 403 for a MOQT twin (the policy lacks publish_for:
        not worth retrying); a transport failure or 5xx raises (retried too)."""
        try:
            if intent.kind is IntentKind.PUBLISH:
                assert record is not None
                published = await self.api.publish(self.index_base, record, timeout=self.timeout)
                if granted is not None:
                    granted.append(published.record.ttl_ms)
            else:
                holder = self.holder.base_uri if not twin else self.moqt_uri
                assert holder is not None
                await self.api.withdraw(self.index_base, holder, bytes.fromhex(intent.block_key),
                                        timeout=self.timeout)
            return True
        except Problem as problem:
            if twin and problem.status == 403:
                if not self._moqt_refused:
                    self._moqt_refused = True
                    log.warning("the Index Service refuses MOQT records for %s (add it to this holder's "
                                "publish_for): %s", self.moqt_uri, problem)
                return True
            log.warning("%s %s: %s", intent.kind.value, url, problem)
            return False
