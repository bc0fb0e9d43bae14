"""The one typed KVSP API client: every KVSP resource as a method that takes records and returns records.

Built on :class:`http3.client.KvspClient` (HTTP/3 first, HTTP/1.1 or HTTP/2 over TLS when QUIC cannot reach an
origin; mutual TLS) and on the records of :mod:`kvsp_quic.records` and :mod:`kvsp_quic.roles.controller_records`,
so that both sides of every exchange read and write the same dataclasses::

    api = KvspApi(client)
    found = await api.lookup(index, LookupRequest(scope_id, compat_id, keys))       # LookupResponse
    lease = await api.create_lease(holder, LeaseRequest(compat_id, scope_id, [key], 2000))   # Lease | Miss
    block = await api.get_block(record.holder, record.compat_id, record.scope_id, key)      # BlockBody | Miss
    outcome = await api.checkpoint(controller, checkpoint)                # Acknowledged | Stale | Unknown

Operations, by service (each takes the service's base URI first: an ``https://.../`` ending with "/"; for the
Index Service and the Placement Controller also a :class:`ServiceEndpoints`, several URIs of one service):

* Index Service: :meth:`~KvspApi.lookup`, :meth:`~KvspApi.publish` (= refresh), :meth:`~KvspApi.withdraw`,
  :meth:`~KvspApi.put_status` (also the Placement Controller's);
* holders: :meth:`~KvspApi.get_block` (streamed), :meth:`~KvspApi.put_block`, :meth:`~KvspApi.create_lease`,
  :meth:`~KvspApi.renew_lease`, :meth:`~KvspApi.release_lease`;
* Placement Controller: :meth:`~KvspApi.create_session`, :meth:`~KvspApi.session_info`,
  :meth:`~KvspApi.checkpoint`;
* instances: :meth:`~KvspApi.start_session`, :meth:`~KvspApi.resume_session`, :meth:`~KvspApi.tokens`,
  :meth:`~KvspApi.session_run`, :meth:`~KvspApi.prefetch`, :meth:`~KvspApi.prefetch_status`,
  :meth:`~KvspApi.reshard`, :meth:`~KvspApi.set_state`, :meth:`~KvspApi.instance_status`.

Failure semantics -- written here once, for every caller:

* **Timeouts.** Every request has one (*timeout*, else the client's); it covers the wait for the response head,
  and, for a streamed body, each wait for more data.
* **Retry elsewhere** -- :class:`RetryElsewhere` (a :class:`~http3.client.TransportError`, so a ``ConnectionError``):
  the service did not answer usefully, another replica, instance or URI of the service may: a transport failure
  (connection refused or reset, TLS failure, QUIC handshake failure, timeout), a 5xx answer (503 above all), a
  429 (a quota: busy, not wrong), and :class:`BadResponse`, a success answer that breaks the protocol (a record
  that does not parse, a block without ``Repr-Digest``). ``status`` and ``problem`` say which.
* **Miss** -- :class:`Miss`, returned, never raised: the service is fine but lacks the thing. A block GET that
  answers 404 (``kvsp-not-found``, ``kvsp-layers-unavailable``), 406 (no such codec) or 410; a lease on a key
  the holder lacks (404); a lease renewal or release of a lease that expired (404). A lookup has no miss: it
  answers ``matched = 0``; a withdrawal of a record that is already gone answers ``False``.
* **Refused** -- any other 4xx raises its :class:`~kvsp_quic.problems.Problem` (``except ScopeDenied``,
  ``except StaleEpoch``...): the request was wrong or not allowed, and asking elsewhere would not change that.
  :meth:`~KvspApi.checkpoint` turns ``kvsp-stale-epoch`` and 403 (the PC fenced this run: it no longer takes
  this instance's checkpoints) into :class:`Stale`, and a 404 into :class:`Unknown` -- after asking every URI of
  the PC: one replica's 404 (say, one restarted with an empty memory store) is not a fence, the run goes on and
  the checkpoint is sent again; :meth:`~KvspApi.tokens` reports every non-200 as :class:`RetryElsewhere`
  (its reader asks the PC where the session went).
* **Retries.** Only idempotent requests are retried, only after a transport failure, never after an answer, and
  only with a replayable body: GET, PUT, DELETE, plus two POSTs that are idempotent by construction -- a lookup
  (a query) and a session creation (the client names the session; the PC answers 200 for one it has). Lease
  creation, prefetch, session start and resume, and reshard messages are sent once. Every retry is made in one
  place, :meth:`KvspApi._at` (at the same URI, or at the next URI of a :class:`ServiceEndpoints`); the HTTP
  client is asked to send each request once.
* **Pooled connections.** A QUIC connection on which a request timed out or that broke is dropped from the pool
  (:meth:`http3.h3_client.H3Pool.discard`): the next request opens a fresh one, which fails fast when the peer is
  gone, instead of waiting on a dead peer until QUIC's idle timeout.

* **Several URIs of one service** -- :class:`ServiceEndpoints` (``--index A --index B``; the Index Service and
  the Placement Controller): each client prefers one URI (chosen at random: clients spread over the replicas, one
  client's requests stay on one while it answers); a request safe to retry (the rule above) that meets a
  transport failure, a timeout, a 5xx or a 429 is sent to the next URI at once (up to the client's retries, at
  least once per URI); a URI that failed at the transport level goes to the back of the order and is probed again in the
  background after a backoff (2 s, doubling to 30 s), its dead pooled connection already dropped. Connections to
  these URIs keep themselves alive (:class:`~http3.h3_client.KeepAlive`: QUIC PINGs), so a dead or frozen replica
  is noticed in about a second, not at QUIC's 60 s idle timeout. A plain ``str`` is one URI, as before.

Base URIs are checked and joined with resource paths in one place, :meth:`KvspApi.url`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urljoin

from http3.client import Body, ConnectTimeout, KvspClient, Response, TransportError
from http3.h3_client import CONTROL_KEEPALIVE, KeepAlive
from kvsp_quic import fields as f
from kvsp_quic.compat import InstanceState
from kvsp_quic.keys import uri_id
from kvsp_quic.problems import Problem, StaleEpoch, problem_from_json
from kvsp_quic.records import (
    CheckpointAck,
    InstanceStatusRecord,
    LeaseRenewal,
    LeaseRequest,
    LeaseResponse,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    PrefetchStatus,
    Record,
    ReplicaRecord,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    SessionCheckpoint,
    StateMessage,
)
from kvsp_quic.retrieval_plan import LayerRange, ReprDigestError, parse_repr_digest
from kvsp_quic.roles.controller_records import (
    SessionInfo,
    SessionRequest,
    SessionResume,
    SessionStart,
    SuspectAnswer,
    SuspectReport,
    TokenLine,
)

JSON_MEDIA_TYPE = "application/kvsp+json"
BLOCK_MEDIA_TYPE = "application/kvsp-block"
ERROR_BODY_LIMIT = 64 << 10  # octets of an error body read for its problem document

MISS_STATUSES = frozenset({404, 406, 410})
ReshardMessage = ReshardPlan | ReshardCommit | ReshardAbort
R = TypeVar("R", bound=Record)
T = TypeVar("T")
log = logging.getLogger("kvsp.api")


# -- several URIs of one service ------------------------------------------------------------------------------------


class ServiceEndpoints:
    """The base URIs of one service -- the Index Service, or the Placement Controller, and their replicas -- and
    what this client has learnt of them (the module docstring, "Several URIs of one service"). Pass it wherever
    :class:`KvspApi` takes the service's URI; keep one per service for the client's lifetime.

    *uris*: one base URI or several (each exactly one: ``"A,B"`` is a ValueError); *start*: the index of the URI
    this client prefers (default: one at random, so that clients spread over the replicas); *rotate*: spread
    every request instead (round robin: for replicas that share all their state); *backoff* / *max_backoff*:
    seconds before a failed URI is probed again, doubling per failed probe; *keepalive*: the PINGs of the
    client's connections to these URIs (None: none)."""

    def __init__(self, uris: str | Sequence[str], what: str = "service", *, start: int | None = None,
                 rotate: bool = False, backoff: float = 2.0, max_backoff: float = 30.0,
                 keepalive: KeepAlive | None = CONTROL_KEEPALIVE, clock: Callable[[], float] = time.monotonic) -> None:
        try:
            self.uris = tuple(f.base_uris(uris, what))
        except f.RecordError as exc:
            raise ValueError(exc.detail) from None
        if not self.uris:
            raise ValueError(f"{what}: at least one base URI")
        self.what = what
        self.rotate = rotate
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.keepalive = keepalive
        self._clock = clock
        self._next = random.randrange(len(self.uris)) if start is None else start % len(self.uris)
        self._down: dict[str, tuple[float, float]] = {}  # uri -> (probe it after, the backoff that led there)
        self._probes: dict[str, asyncio.Task[None]] = {}

    @classmethod
    def of(cls, service: str | Sequence[str] | ServiceEndpoints, what: str = "service") -> ServiceEndpoints:
        """*service* as a :class:`ServiceEndpoints` (itself when it is one)."""
        return service if isinstance(service, ServiceEndpoints) else cls(service, what)

    def __str__(self) -> str:
        return ", ".join(self.uris)

    def __repr__(self) -> str:
        return f"ServiceEndpoints({list(self.uris)!r}, down={sorted(self._down)!r})"

    @property
    def primary(self) -> str:
        """The URI the next request goes to first (also what logs name)."""
        return self.order(advance=False)[0]

    def order(self, *, advance: bool = True) -> list[str]:
        """The URIs in the order the next request tries them: those that answer, from this client's preferred one
        (the next one in turn with *rotate*), then those that failed, soonest probe first."""
        n = len(self.uris)
        start = self._next
        if self.rotate and advance:
            self._next = (self._next + 1) % n
        ring = [self.uris[(start + i) % n] for i in range(n)]
        up = [u for u in ring if u not in self._down]
        return up + sorted((u for u in ring if u in self._down), key=lambda u: self._down[u][0])

    def is_down(self, uri: str) -> bool:
        return uri in self._down

    def failed(self, uri: str) -> None:
        """*uri* did not answer (transport failure, timeout): tried last until a probe finds it back (with one URI
        there is nothing to order: it stays as it is)."""
        if len(self.uris) == 1:
            return
        previous = self._down.get(uri)
        backoff = self.backoff if previous is None else min(previous[1] * 2, self.max_backoff)
        self._down[uri] = (self._clock() + backoff, backoff)

    def answered(self, uri: str) -> None:
        """*uri* answered (any HTTP status): it is up."""
        self._down.pop(uri, None)

    def probes_due(self) -> list[str]:
        """The failed URIs whose backoff is over and that no probe is checking now."""
        now = self._clock()
        return [u for u, (at, _) in self._down.items() if at <= now and u not in self._probes]


# -- outcomes -----------------------------------------------------------------------------------------------------


class RetryElsewhere(TransportError):
    """The service gave no useful answer; another replica, instance or URI may: a transport failure (``status``
    None; ``unreachable`` when nothing listens at its port), a 5xx or 429 answer (``status``, ``problem``), or a
    :class:`BadResponse`."""

    def __init__(self, detail: str, *, status: int | None = None, problem: Problem | None = None,
                 unreachable: bool = False) -> None:
        super().__init__(detail, unreachable=unreachable)
        self.status = status
        self.problem = problem


class BadResponse(RetryElsewhere):
    """A success answer that breaks the protocol: an unreadable record, a wrong media type, a bad Repr-Digest."""


@dataclass(frozen=True)
class Miss:
    """The service lacks what was asked for (404, 406, 410 where the operation says so)."""

    url: str
    status: int
    problem: Problem | None

    def __str__(self) -> str:
        return f"{self.url}: {self.problem or self.status}"


@dataclass(frozen=True)
class Acknowledged:
    """The PC took the checkpoint."""

    ack: CheckpointAck


@dataclass(frozen=True)
class Stale:
    """The PC holds a newer epoch of the session (or no longer takes this instance's checkpoints): stop."""

    detail: str


@dataclass(frozen=True)
class Unknown:
    """No URI of the PC knows the session (404 everywhere asked): not a fence -- a replica that lost its memory,
    or the session's record not yet visible -- so the instance keeps its run and sends the checkpoint again."""

    detail: str


class _NotHere(RetryElsewhere):
    """A 404 to a checkpoint at one URI of the PC: the next URI may know the session (internal to
    :meth:`KvspApi.checkpoint`)."""


@dataclass(frozen=True)
class Lease:
    """A lease taken at a holder (spec: "Leases"); ``url`` is where it is renewed and released."""

    lease: str
    url: str
    ttl_ms: int


@dataclass(frozen=True)
class Published:
    """The Index Service's answer to a publish or refresh: the stored record; ``created`` unless refreshed."""

    record: ReplicaRecord
    created: bool


class BlockBody:
    """A block GET answered 200: the container streams in through :meth:`aiter_bytes`; close it (``async with``)."""

    def __init__(self, url: str, response: Response, repr_digest: bytes | None) -> None:
        self.url = url
        self.response = response
        self.repr_digest = repr_digest  # SHA-256 of the whole body as the holder states it
        self.http_version = response.http_version

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return self.response.aiter_bytes()

    async def aread(self) -> bytes:
        return await self.response.aread()

    async def aclose(self) -> None:
        await self.response.aclose()

    async def __aenter__(self) -> BlockBody:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# -- the client ---------------------------------------------------------------------------------------------------


class KvspApi:
    """Typed KVSP operations over one :class:`~http3.client.KvspClient` (see the module docstring for the
    failure semantics). *timeout*: the default per-request timeout (None: the client's)."""

    def __init__(self, client: KvspClient, *, timeout: float | None = None) -> None:
        self.client = client
        self.timeout = timeout

    # -- base URIs and the one request path ---------------------------------------------------------------------

    @staticmethod
    def base(uri: str, what: str = "base URI", *, schemes: tuple[str, ...] = ("https",)) -> str:
        """*uri* checked as a KVSP base URI (``https://host[:port]/path/``); ValueError otherwise."""
        try:
            return f.base_uri(uri, what, schemes=schemes)
        except f.RecordError as exc:
            raise ValueError(exc.detail) from None

    @staticmethod
    def url(base: str | ServiceEndpoints, path: str, query: Mapping[str, str] | None = None) -> str:
        """The resource *path* (relative, no leading "/") below the base URI *base* (of a :class:`ServiceEndpoints`:
        below its :attr:`~ServiceEndpoints.primary`)."""
        if isinstance(base, ServiceEndpoints):
            base = base.primary
        if not base.endswith("/"):
            raise ValueError(f"a base URI ends with '/': {base!r}")
        out = base + path
        if query:
            out += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        return out

    async def _send(self, method: str, url: str, *, body: Record | Mapping[str, Any] | None = None,
                    content: Body = None, headers: Mapping[str, str] | None = None, idempotent: bool | None = None,
                    timeout: float | None = None) -> Response:
        """Send once (retries are :meth:`_at`'s); the response head is in, the body unread. Transport failures
        become :class:`RetryElsewhere`."""
        fields = dict(headers or {})
        if body is not None:
            obj = body.to_json() if isinstance(body, Record) else body
            content = json.dumps(obj, separators=(",", ":")).encode()
            fields.setdefault("content-type", JSON_MEDIA_TYPE)
        try:
            return await self.client.send(method, url, headers=fields, content=content,
                                          timeout=self.timeout if timeout is None else timeout,
                                          idempotent=idempotent, retries=0)  # every retry is _at's
        except TransportError as exc:
            if isinstance(exc, RetryElsewhere):
                raise
            raise RetryElsewhere(f"{method} {url}: {exc}", unreachable=exc.unreachable) from exc

    async def _call(self, method: str, url: str, *, ok: tuple[int, ...] = (200,), miss: bool = False,
                    body: Record | Mapping[str, Any] | None = None, idempotent: bool | None = None,
                    timeout: float | None = None) -> Response | Miss:
        """One JSON exchange, read whole: the answer when its status is in *ok*; else classified (the module
        docstring): :class:`Miss` (when *miss*), :class:`RetryElsewhere`, or the 4xx's Problem raised."""
        response = await self._send(method, url, body=body, idempotent=idempotent, timeout=timeout)
        if response.status in ok:
            try:
                await response.aread()
            except TransportError as exc:
                raise RetryElsewhere(f"{method} {url}: {exc}", unreachable=exc.unreachable) from exc
            return response
        return await self._failed(method, url, response, miss=miss)

    async def _failed(self, method: str, url: str, response: Response, *, miss: bool) -> Miss:
        """Classify a response whose status the operation does not expect (the body is read, up to a limit)."""
        status = response.status
        body = await read_limited(response)
        await response.aclose()
        problem = problem_from_json(status, body) if status >= 400 else None
        if miss and status in MISS_STATUSES:
            return Miss(url, status, problem)
        if status >= 500 or status == 429:
            raise RetryElsewhere(f"{method} {url}: {problem}", status=status, problem=problem)
        if problem is not None:
            raise problem
        raise BadResponse(f"{method} {url}: unexpected status {status}", status=status)

    async def _at(self, service: str | ServiceEndpoints, call: Callable[[str], Awaitable[T]], *, safe: bool) -> T:
        """``call(base)`` at the service, with every retry this client makes (the HTTP client is asked for none):

        * one URI (a ``str``: a service, a holder, an instance, a lease): a request *safe* to retry is sent again
          there after a failure without an answer (a transport failure or timeout, but not a connect timeout:
          nothing answers there), up to the client's ``retries`` times, 50 ms more apart each time;
        * a :class:`ServiceEndpoints`: a request *safe* to retry goes to the next URI after any
          :class:`RetryElsewhere` (the module docstring, "Several URIs of one service").

        A request not *safe* to retry is sent once. Answers and refusals come back as they are."""
        if isinstance(service, str):
            return await self._at_one(service, call, safe=safe)
        for uri in service.probes_due():
            self._probe(service, uri)
        order = service.order()
        attempts = max(len(order), 1 + self.client.retries) if safe else 1
        error: RetryElsewhere | None = None
        for attempt in range(attempts):
            uri = order[attempt % len(order)]
            if attempt and attempt % len(order) == 0:
                await asyncio.sleep(0.05 * (attempt // len(order)))  # every URI failed: a breath before the next round
            self.client.keep_alive(uri, service.keepalive)
            try:
                result = await call(uri)
            except RetryElsewhere as exc:
                error = exc
                if exc.status is None and not isinstance(exc, BadResponse):  # no answer at all: the URI is down
                    service.failed(uri)
                else:
                    service.answered(uri)
                if attempt + 1 < attempts:
                    log.info("%s at %s failed (%s); trying %s", service.what, uri, exc,
                             order[(attempt + 1) % len(order)])
                continue
            except Problem:
                service.answered(uri)
                raise
            service.answered(uri)
            return result
        assert error is not None
        raise error

    async def _at_one(self, uri: str, call: Callable[[str], Awaitable[T]], *, safe: bool) -> T:
        tries = 1 + self.client.retries if safe else 1
        for attempt in range(tries - 1):
            try:
                return await call(uri)
            except RetryElsewhere as exc:
                if exc.status is not None or isinstance(exc, BadResponse) or isinstance(exc.__cause__, ConnectTimeout):
                    raise  # an answer, or nothing answers there at all: not worth asking again
                log.info("%s; retrying", exc)
                await asyncio.sleep(0.05 * (attempt + 1))
        return await call(uri)

    def _probe(self, service: ServiceEndpoints, uri: str) -> None:
        """Check in the background whether the failed *uri* answers again (any HTTP answer to ``GET {uri}``)."""
        async def probe() -> None:
            try:
                self.client.keep_alive(uri, service.keepalive)
                response = await self.client.send("GET", uri, timeout=self.client.timeout, retries=0)
                await response.aclose()
            except (TransportError, OSError) as exc:
                log.info("%s at %s still does not answer: %s", service.what, uri, exc)
                service.failed(uri)
            else:
                log.info("%s at %s answers again", service.what, uri)
                service.answered(uri)
            finally:
                service._probes.pop(uri, None)

        task = asyncio.get_running_loop().create_task(probe(), name=f"kvsp-probe-{uri}")
        service._probes[uri] = task

    @staticmethod
    def _record(kind: type[R], response: Response, what: str) -> R:
        try:
            return kind.loads(response.content or b"")
        except Problem as exc:
            raise BadResponse(f"{what}: unreadable {kind.__name__}: {exc}", status=response.status) from None

    async def _json(self, method: str, url: str, kind: type[R], *, ok: tuple[int, ...] = (200,),
                    body: Record | Mapping[str, Any] | None = None, idempotent: bool | None = None,
                    timeout: float | None = None) -> R:
        response = await self._call(method, url, ok=ok, body=body, idempotent=idempotent, timeout=timeout)
        assert isinstance(response, Response)
        return self._record(kind, response, f"{method} {url}")

    # -- Index Service ------------------------------------------------------------------------------------------

    async def lookup(self, index: str | ServiceEndpoints, request: LookupRequest, *,
                     timeout: float | None = None) -> LookupResponse:
        """``POST {index}lookup``: the matched prefix of the request's keys with their replicas (retried: a
        query)."""
        return await self._at(index, lambda base: self._json(
            "POST", self.url(base, "lookup"), LookupResponse, body=request, idempotent=True, timeout=timeout),
            safe=True)

    def replica_url(self, index: str | ServiceEndpoints, holder: str, block_key: bytes) -> str:
        """``{index}replicas/{holder-id}/{block_key}``: where *holder*'s record of *block_key* lives."""
        return self.url(index, f"replicas/{uri_id(holder)}/{block_key.hex()}")

    async def publish(self, index: str | ServiceEndpoints, record: ReplicaRecord, *,
                      timeout: float | None = None) -> Published:
        """``PUT {index}replicas/{holder-id}/{key}``: publish *record* for its holder, or refresh it (the same PUT
        again before ``ttl_ms`` runs out)."""
        async def at(base: str) -> Published:
            url = self.replica_url(base, record.holder, record.block_key)
            response = await self._call("PUT", url, ok=(200, 201), body=record, timeout=timeout)
            assert isinstance(response, Response)
            return Published(self._record(ReplicaRecord, response, f"PUT {url}"), response.status == 201)
        return await self._at(index, at, safe=True)

    refresh = publish

    async def withdraw(self, index: str | ServiceEndpoints, holder: str, block_key: bytes, *,
                       timeout: float | None = None) -> bool:
        """``DELETE {index}replicas/{holder-id}/{key}``: True when withdrawn, False when it was already gone."""
        async def at(base: str) -> bool:
            url = self.replica_url(base, holder, block_key)
            response = await self._call("DELETE", url, ok=(200, 202, 204), miss=True, timeout=timeout)
            return not isinstance(response, Miss)
        return await self._at(index, at, safe=True)

    async def put_status(self, service: str | ServiceEndpoints, record: InstanceStatusRecord, *,
                         timeout: float | None = None) -> InstanceState:
        """``PUT {service}instances/{instance-id}/status`` (Index Service or Placement Controller): the state the
        service holds for the instance."""
        path = f"instances/{uri_id(record.instance)}/status"
        message = await self._at(service, lambda base: self._json(
            "PUT", self.url(base, path), StateMessage, body=record, timeout=timeout), safe=True)
        return message.state

    async def put_liveness(self, index: str | ServiceEndpoints, holder: str, ttl_ms: int, *,
                           timeout: float | None = None) -> int:
        """``PUT {index}holders/{holder-id}/liveness`` (docs/wire.md, "Holder liveness and failure reports"): the
        holder is alive for *ttl_ms*; returns the TTL the Index Service granted."""
        async def at(base: str) -> int:
            response = await self._call("PUT", self.url(base, f"holders/{uri_id(holder)}/liveness"),
                                        body={"holder": holder, "ttl_ms": ttl_ms}, timeout=timeout)
            assert isinstance(response, Response)
            return f.member(_json_object(response, "liveness"), "ttl_ms", f.positive)
        return await self._at(index, at, safe=True)

    async def report_failure(self, index: str | ServiceEndpoints, holder: str, scope_id: bytes, *,
                             timeout: float | None = None) -> None:
        """``POST {index}holders/{holder-id}/failures``: this client (of *scope_id*) could not fetch from *holder*."""
        await self._at(index, lambda base: self._call(
            "POST", self.url(base, f"holders/{uri_id(holder)}/failures"), ok=(202,), idempotent=True,
            body={"holder": holder, "scope_id": bytes(scope_id).hex()}, timeout=timeout), safe=True)

    # -- holders ------------------------------------------------------------------------------------------------

    def block_url(self, holder: str, compat_id: bytes, scope_id: bytes, block_key: bytes,
                  layers: LayerRange | None = None, codec: int | None = None) -> str:
        query = {}
        if layers is not None:
            query["layers"] = f"{layers[0]}-{layers[1]}"
        if codec is not None:
            query["codec"] = str(codec)
        return self.url(holder, f"blocks/{compat_id.hex()}/{scope_id.hex()}/{block_key.hex()}", query)

    async def get_block(self, holder: str, compat_id: bytes, scope_id: bytes, block_key: bytes, *,
                        layers: LayerRange | None = None, codec: int | None = None,
                        timeout: float | None = None) -> BlockBody | Miss:
        """``GET {holder}blocks/{compat}/{scope}/{key}[?layers=a-b][&codec=n]``, streamed: a :class:`BlockBody`
        (the caller verifies the octets against the record and ``repr_digest``), or a :class:`Miss`."""
        url = self.block_url(holder, compat_id, scope_id, block_key, layers, codec)
        response = await self._at(url, lambda u: self._send("GET", u, timeout=timeout), safe=True)
        try:
            if response.status != 200:
                return await self._failed("GET", url, response, miss=True)
            media = (response.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
            if media != BLOCK_MEDIA_TYPE:
                raise BadResponse(f"GET {url}: content-type {media or 'missing'!r}", status=200)
            try:
                digest = parse_repr_digest(response.headers.get("repr-digest"))
            except ReprDigestError as exc:
                raise BadResponse(f"GET {url}: {exc}", status=200) from None
        except BaseException:
            await response.aclose()
            raise
        return BlockBody(url, response, digest)

    async def put_block(self, holder: str, compat_id: bytes, scope_id: bytes, block_key: bytes, container: Body,
                        *, create_only: bool = True, timeout: float | None = None) -> ReplicaRecord:
        """``PUT {holder}blocks/...`` with the container (``If-None-Match: *`` when *create_only*: a block the
        holder has answers 412 PreconditionFailed): the holder's Replica Record of it."""
        url = self.block_url(holder, compat_id, scope_id, block_key)
        headers = {"content-type": BLOCK_MEDIA_TYPE}
        if create_only:
            headers["if-none-match"] = "*"
        response = await self._at(url, lambda u: self._send("PUT", u, content=container, headers=headers,
                                                            timeout=timeout),
                                  safe=self.client.may_retry("PUT", container, None))
        if response.status not in (200, 201):
            await self._failed("PUT", url, response, miss=False)
        try:
            await response.aread()
        except TransportError as exc:
            raise RetryElsewhere(f"PUT {url}: {exc}", unreachable=exc.unreachable) from exc
        return self._record(ReplicaRecord, response, f"PUT {url}")

    async def create_lease(self, holder: str, request: LeaseRequest, *,
                           timeout: float | None = None) -> Lease | Miss:
        """``POST {holder}leases`` (never retried): the lease, or a :class:`Miss` when the holder lacks a key.
        A quota (429 ``kvsp-lease-quota``) is :class:`RetryElsewhere`; a refusal (403...) raises its Problem."""
        url = self.url(holder, "leases")
        response = await self._call("POST", url, ok=(201,), miss=True, body=request, idempotent=False,
                                    timeout=timeout)
        if isinstance(response, Miss):
            return response
        granted = self._record(LeaseResponse, response, f"POST {url}")
        location = urljoin(url, response.headers.get("location") or "")
        if not location.startswith(holder + "leases/"):  # never renew or release elsewhere
            location = self.url(holder, f"leases/{granted.lease}")
        return Lease(str(granted.lease), location, granted.ttl_ms)

    async def renew_lease(self, lease: Lease, ttl_ms: int, *, timeout: float | None = None) -> Lease | Miss:
        """``PUT {lease.url}`` with the new TTL: the renewed lease, or a :class:`Miss` when it had expired."""
        response = await self._at(lease.url, lambda u: self._call("PUT", u, miss=True, body=LeaseRenewal(ttl_ms),
                                                                  timeout=timeout), safe=True)
        if isinstance(response, Miss):
            return response
        granted = self._record(LeaseResponse, response, f"PUT {lease.url}")
        return Lease(lease.lease, lease.url, granted.ttl_ms)

    async def release_lease(self, lease: Lease, *, timeout: float | None = None) -> bool:
        """``DELETE {lease.url}``: True when released, False when it had expired meanwhile."""
        response = await self._at(lease.url, lambda u: self._call("DELETE", u, ok=(200, 204), miss=True,
                                                                  timeout=timeout), safe=True)
        return not isinstance(response, Miss)

    # -- Placement Controller -----------------------------------------------------------------------------------

    async def create_session(self, controller: str | ServiceEndpoints, request: SessionRequest, *,
                             timeout: float | None = None) -> SessionInfo:
        """``POST {controller}sessions``: where the session runs (retried: the client names the session)."""
        return await self._at(controller, lambda base: self._json(
            "POST", self.url(base, "sessions"), SessionInfo, ok=(200, 201), body=request, idempotent=True,
            timeout=timeout), safe=True)

    async def session_info(self, controller: str | ServiceEndpoints, session: uuid.UUID, *,
                           timeout: float | None = None) -> SessionInfo:
        """``GET {controller}sessions/{id}``: the PC's view of the session."""
        return await self._at(controller, lambda base: self._json(
            "GET", self.url(base, f"sessions/{session}"), SessionInfo, timeout=timeout), safe=True)

    async def suspect_session(self, controller: str | ServiceEndpoints, session: uuid.UUID, report: SuspectReport, *,
                              timeout: float | None = None) -> SuspectAnswer:
        """``POST {controller}sessions/{id}/suspect`` (extension, docs/wire.md "Suspect reports"): the PC's verdict
        on the session's run, and where the session runs now (retried elsewhere: a report may arrive twice)."""
        return await self._at(controller, lambda base: self._json(
            "POST", self.url(base, f"sessions/{session}/suspect"), SuspectAnswer, body=report, idempotent=True,
            timeout=timeout), safe=True)

    async def cancel_session(self, controller: str | ServiceEndpoints, session: uuid.UUID, *,
                             timeout: float | None = None) -> bool:
        """``DELETE {controller}sessions/{id}`` (docs/wire.md, "Cancelling a session"): True when the PC ended
        the session, False when it has no such session (404)."""
        async def at(base: str) -> bool:
            response = await self._call("DELETE", self.url(base, f"sessions/{session}"), ok=(200, 202, 204),
                                        miss=True, timeout=timeout)
            return not isinstance(response, Miss)
        return await self._at(controller, at, safe=True)

    async def checkpoint(self, controller: str | ServiceEndpoints, checkpoint: SessionCheckpoint, *,
                         done: bool = False, timeout: float | None = None) -> Acknowledged | Stale | Unknown:
        """``PUT {controller}sessions/{id}/checkpoint`` (*done*: the extension member saying the session ended).

        :class:`Stale` -- stop the run -- when the PC answers ``kvsp-stale-epoch`` or 403 (an explicit fence: this
        instance does not serve the session's epoch), or acknowledges a newer epoch; :class:`Unknown` -- keep
        the run, send again -- when every URI of the PC asked answers 404; raises :class:`RetryElsewhere` (try
        again later) and, for another 4xx, its Problem."""
        path = f"sessions/{checkpoint.session}/checkpoint"
        body = checkpoint.to_json()
        if done:
            body["done"] = True

        async def at(base: str) -> CheckpointAck:
            url = self.url(base, path)
            try:
                return await self._json("PUT", url, CheckpointAck, body=body, timeout=timeout)
            except Problem as exc:
                if exc.status == 404 and not isinstance(exc, StaleEpoch):  # this replica lacks it: ask the next
                    raise _NotHere(f"PUT {url}: {exc}", status=404, problem=exc) from None
                raise

        try:
            ack = await self._at(controller, at, safe=True)
        except _NotHere as exc:
            return Unknown(str(exc))
        except Problem as exc:
            if isinstance(exc, StaleEpoch) or exc.status == 403:
                return Stale(str(exc))
            raise
        if ack.epoch > checkpoint.epoch:
            return Stale(f"the PC acknowledged epoch {ack.epoch} for a checkpoint of epoch {checkpoint.epoch}")
        return Acknowledged(ack)

    # -- instances ----------------------------------------------------------------------------------------------

    async def start_session(self, instance: str, start: SessionStart, *,
                            timeout: float | None = None) -> CheckpointAck:
        """``POST {instance}sessions/{id}/start``: the instance's ``{"session", "epoch", "output_offset"}``."""
        url = self.url(instance, f"sessions/{start.session}/start")
        return await self._json("POST", url, CheckpointAck, ok=(200, 201), body=start, idempotent=False,
                                timeout=timeout)

    async def resume_session(self, instance: str, session: uuid.UUID, resume: SessionResume, *,
                             timeout: float | None = None) -> CheckpointAck:
        """``POST {instance}sessions/{id}/resume``: the instance's ``{"session", "epoch", "output_offset"}``."""
        url = self.url(instance, f"sessions/{session}/resume")
        return await self._json("POST", url, CheckpointAck, body=resume, idempotent=False, timeout=timeout)

    @contextlib.asynccontextmanager
    async def tokens(self, instance: str, session: uuid.UUID, start: int = 0, *,
                     timeout: float | None = None) -> AsyncIterator[AsyncIterator[TokenLine]]:
        """``GET {instance}sessions/{id}/tokens?from=start``: its lines as they arrive::

            async with api.tokens(instance, session, 0) as lines:
                async for line in lines: ...          # TokenLine; a final line has done=True

        Any answer but 200, a broken stream and a line that does not parse are :class:`RetryElsewhere` (the
        reader asks the PC where the session went); the stream ending without a final line is the caller's to
        notice."""
        url = self.url(instance, f"sessions/{session}/tokens", {"from": str(start)})
        response = await self._at(url, lambda u: self._send("GET", u, timeout=timeout), safe=True)
        try:
            if response.status != 200:
                body = await read_limited(response)
                problem = problem_from_json(response.status, body) if response.status >= 400 else None
                raise RetryElsewhere(f"GET {url}: {problem or response.status}", status=response.status,
                                     problem=problem)
            lines = _token_lines(url, response)
            try:
                yield lines
            finally:
                await lines.aclose()  # type: ignore[attr-defined]  # an async generator
        finally:
            await response.aclose()

    async def session_run(self, instance: str, session: uuid.UUID, *,
                          timeout: float | None = None) -> dict[str, Any]:
        """``GET {instance}sessions/{id}`` (extension): the run's figures (state, loaded blocks, TTFT)."""
        response = await self._at(self.url(instance, f"sessions/{session}"),
                                  lambda u: self._call("GET", u, timeout=timeout), safe=True)
        assert isinstance(response, Response)
        return _json_object(response, "session run")

    async def prefetch(self, instance: str, directive: PrefetchDirective, *,
                       timeout: float | None = None) -> PrefetchStatus:
        """``POST {instance}prefetch`` (202; never retried): the directive's first status."""
        return await self._json("POST", self.url(instance, "prefetch"), PrefetchStatus, ok=(200, 201, 202),
                                body=directive, idempotent=False, timeout=timeout)

    async def prefetch_status(self, instance: str, directive: uuid.UUID, *,
                              timeout: float | None = None) -> PrefetchStatus:
        """``GET {instance}prefetch/{directive}``."""
        return await self._at(self.url(instance, f"prefetch/{directive}"),
                              lambda u: self._json("GET", u, PrefetchStatus, timeout=timeout), safe=True)

    async def reshard(self, instance: str, message: ReshardMessage, *,
                      timeout: float | None = None) -> dict[str, Any]:
        """``POST {instance}reshard`` with a plan, commit or abort (never retried): the instance's answer."""
        response = await self._call("POST", self.url(instance, "reshard"), body=message, idempotent=False,
                                    timeout=timeout)
        assert isinstance(response, Response)
        return _json_object(response, "reshard answer")

    async def set_state(self, instance: str, state: InstanceState, *, timeout: float | None = None) -> InstanceState:
        """``PUT {instance}state``: the state the instance holds afterwards."""
        return (await self._at(self.url(instance, "state"), lambda u: self._json(
            "PUT", u, StateMessage, body=StateMessage(state), timeout=timeout), safe=True)).state

    async def instance_status(self, instance: str, *, timeout: float | None = None) -> InstanceStatusRecord:
        """``GET {instance}status`` (extension): its Instance Status Record."""
        return await self._at(self.url(instance, "status"),
                              lambda u: self._json("GET", u, InstanceStatusRecord, timeout=timeout), safe=True)


# -- helpers ------------------------------------------------------------------------------------------------------


async def _token_lines(url: str, response: Response) -> AsyncIterator[TokenLine]:
    buffer = b""
    try:
        async for chunk in response.aiter_bytes():
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                try:
                    item = TokenLine.decode(line)
                except f.RecordError as exc:
                    raise BadResponse(f"GET {url}: {exc.detail}", status=200) from None
                yield item
    except RetryElsewhere:
        raise
    except TransportError as exc:
        raise RetryElsewhere(f"GET {url}: {exc}", unreachable=exc.unreachable) from exc


def _json_object(response: Response, what: str) -> dict[str, Any]:
    try:
        return f.loads_object(response.content or b"", what)
    except f.RecordError as exc:
        raise BadResponse(exc.detail, status=response.status) from None


async def read_limited(response: Response, limit: int = ERROR_BODY_LIMIT) -> bytes:
    """Up to *limit* octets of a (problem) body; the rest is not read, and a broken body gives what came."""
    body = bytearray()
    chunks = response.aiter_bytes()
    try:
        async for chunk in chunks:
            body += chunk
            if len(body) >= limit:
                break
    except TransportError:
        pass
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]  # an async generator
    return bytes(body[:limit])


__all__ = [
    "Acknowledged", "BadResponse", "BlockBody", "KvspApi", "Lease", "Miss", "Published", "RetryElsewhere",
    "ServiceEndpoints", "Stale", "read_limited",
]
