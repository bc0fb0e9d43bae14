"""The Index Service's HTTP edge: a starlette app that translates requests to :class:`IndexService` calls.

    service = IndexService(MemoryIndexStore(), clock=time.monotonic, config=IndexConfig(...))
    app = index_app(service, policy, base_path="/kvsp/")
    server = RoleServer(app, files); await server.start("0.0.0.0", 8443)

Resources, relative to the base URI's path (docs/wire.md, "Index Service"), with the roles of :data:`INDEX_RULES`:

* ``PUT replicas/{holder_id}/{block_key}`` (holder): 201 + the stored record when created, 200 + it when refreshed
  (a ``moqt://`` record is authorized by its namespace's publisher as well: :meth:`IndexService.publish`);
* ``DELETE replicas/{holder_id}/{block_key}`` (holder): 204;
* ``POST lookup`` (controller, instance, client, holder): 200 + the lookup response;
* ``PUT instances/{instance_id}/status`` (instance): 200 + ``{"state": s}``;
* ``PUT holders/{holder_id}/liveness`` (holder) ``{"holder": uri, "ttl_ms": n}``: 200 + ``{"holder", "ttl_ms"}``
  (granted); ``POST holders/{holder_id}/failures`` (controller, instance, client, holder) ``{"holder": uri,
  "scope_id": hex}``: 202 (docs/wire.md, "Holder liveness and failure reports"); with a shared liveness store
  (``IndexService(shared_liveness=...)``, ``--store redis``) both are written there first (Redis down: 503) and
  :func:`liveness_syncer` reloads the shared tables every 250 ms while the app's lifespan runs;
* ``POST producer-digests`` (instance) ``{"digests": [...]}``: 200 + the records as stored; ``POST
  producer-digests/lookup`` (controller, instance, client, holder) ``{"compat_id", "scope_id", "block_keys"}``: 200 +
  ``{"digests": [...]}`` (docs/wire.md, "Producer digests"; :mod:`kvsp_quic.roles.producer_digests`);
* with ``metrics``: ``GET metrics`` (any principal), the Prometheus text format (:mod:`kvsp_http.metrics_app`).

The Placement Controller's resources are added to the same app by :func:`kvsp_http.controller_app.controller_app`
(the Index Service and the PC run as one process); :func:`index_routes` is what both share.

Request bodies must be ``application/kvsp+json`` (else 415) and at most ``max_body_bytes`` (else 413); they are
parsed with the records' strict readers (400). Every response carries ``Cache-Control: no-store``; bodies are
``application/kvsp+json``, errors ``application/problem+json`` (:mod:`kvsp_http.problem_response`). The app is
wrapped in :class:`kvsp_http.authz.Authorization` with :data:`INDEX_RULES`; requests outside the base path get 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.asgi_types import ASGIApp
from kvsp_http.app_kit import NO_STORE, kvsp_json, kvsp_json_body, read_json_body, role_app
from kvsp_http.authz import Rule, principal_of
from kvsp_http.metrics_app import TransferMetrics, mount_metrics
from kvsp_http.problem_response import install
from kvsp_quic import fields as f
from kvsp_quic.auth import Policy, Principal
from kvsp_quic.metrics import KvspMetrics, Registry
from kvsp_quic.problems import BadRequest
from kvsp_quic.producer_digests import ProducerDigestQuery, ProducerDigests
from kvsp_quic.records import InstanceStatusRecord, LookupRequest, LookupResponse, ReplicaRecord, StateMessage
from kvsp_quic.roles.index import IndexService

log = logging.getLogger("kvsp.index")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # a lookup of 8192 keys is ~560 KB; a 32-layer Replica Record ~3 KB
LIVENESS_SYNC_S = 0.25  # period of the shared liveness tables' reload: another process's news is this (+ RTT) late

INDEX_RULES: tuple[Rule, ...] = (
    Rule("PUT", "replicas/{holder_id}/{block_key}", ["holder"]),
    Rule("DELETE", "replicas/{holder_id}/{block_key}", ["holder"]),
    Rule("POST", "lookup", ["controller", "instance", "client", "holder"]),
    Rule("PUT", "instances/{instance_id}/status", ["instance"]),
    Rule("PUT", "holders/{holder_id}/liveness", ["holder"]),
    Rule("POST", "holders/{holder_id}/failures", ["controller", "instance", "client", "holder"]),
    # producer digests (extension, issue 13): published by instances only, looked up like replicas
    Rule("POST", "producer-digests", ["instance"]),
    Rule("POST", "producer-digests/lookup", ["controller", "instance", "client", "holder"]),
)



def lookup_body(response: LookupResponse) -> bytes:
    """The body of a lookup answer: ``dumps(lookup_json(response))``, byte for byte
    (:meth:`LookupResponse.to_json_bytes`)."""
    return response.to_json_bytes()


def lookup_json(response: LookupResponse) -> dict[str, Any]:
    """The lookup answer as JSON values (:func:`lookup_body` writes the same, faster)."""
    out: dict[str, Any] = {
        "matched": response.matched,
        "blocks": [{"block_key": m.block_key.hex(), "replicas": [r.to_json() for r in m.replicas]}
                   for m in response.blocks],
    }
    if response.targets is not None:
        out["targets"] = [t.to_json() for t in response.targets]
    return out


def _block_key(request: Request) -> bytes:
    return f.block_key(request.path_params["block_key"], "block_key (path)")


_URI_ID_RE = re.compile(r"[A-Za-z0-9_-]{43}")


def _uri_id(request: Request, name: str) -> str:
    value = str(request.path_params[name])
    if not _URI_ID_RE.fullmatch(value):
        raise BadRequest(f"{name} (path): must be 43 base64url characters (SHA-256 of a base URI)")
    return value


def _holder_uri(value: Any, path: str) -> str:
    return f.base_uri(value, path, schemes=("https", "moqt"))


# The status handler answers at once, or (a Placement Controller with a shared store) after awaiting it.
StatusHandler = Callable[[Principal, str, InstanceStatusRecord], StateMessage | Awaitable[StateMessage]]


def index_routes(service: IndexService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 report_status: StatusHandler | None = None, metrics: Registry | None = None) -> list[Route]:
    """The Index Service's routes (relative to the base path). *report_status* replaces
    ``service.report_status`` (the Placement Controller wraps it); *metrics* counts lookups
    (``kvsp_lookup*{component="index"}``)."""
    kvsp = KvspMetrics(metrics) if metrics is not None else None
    on_status = report_status or service.report_status

    async def put_replica(request: Request) -> Response:
        principal = principal_of(request)
        block_key = _block_key(request)
        holder_id = _uri_id(request, "holder_id")
        record = ReplicaRecord.loads(await read_json_body(request, max_body_bytes))
        result = await service.publish(principal, holder_id, block_key, record)
        return kvsp_json_body(result.record.to_json_bytes(), 201 if result.created else 200)

    async def delete_replica(request: Request) -> Response:
        principal = principal_of(request)
        block_key = _block_key(request)
        await service.withdraw(principal, _uri_id(request, "holder_id"), block_key)
        return Response(status_code=204, headers=NO_STORE)

    async def lookup(request: Request) -> Response:
        principal = principal_of(request)
        body = LookupRequest.loads(await read_json_body(request, max_body_bytes))
        matched, answer = await service.lookup_json(principal, body)
        if kvsp is not None:
            kvsp.lookup("index", len(body.block_keys), matched)
        return kvsp_json_body(answer)

    async def put_status(request: Request) -> Response:
        principal = principal_of(request)
        instance_id = _uri_id(request, "instance_id")
        record = InstanceStatusRecord.loads(await read_json_body(request, max_body_bytes))
        answer = on_status(principal, instance_id, record)
        if not isinstance(answer, StateMessage):
            answer = await answer
        return kvsp_json(answer.to_json())

    async def put_liveness(request: Request) -> Response:
        principal = principal_of(request)
        holder_id = _uri_id(request, "holder_id")
        obj = f.loads_object(await read_json_body(request, max_body_bytes), "liveness")  # RecordError: 400
        holder = f.member(obj, "holder", _holder_uri)
        ttl_ms = f.member(obj, "ttl_ms", f.positive)
        granted = await service.report_liveness_shared(principal, holder_id, holder, ttl_ms)
        return kvsp_json({"holder": holder, "ttl_ms": granted})

    async def post_failure(request: Request) -> Response:
        principal = principal_of(request)
        holder_id = _uri_id(request, "holder_id")
        obj = f.loads_object(await read_json_body(request, max_body_bytes), "failure report")
        holder = f.member(obj, "holder", _holder_uri)
        scope = f.member(obj, "scope_id", f.scope_id)
        await service.report_failure_shared(principal, holder_id, holder, scope)
        return Response(status_code=202, headers=NO_STORE)

    async def post_producer_digests(request: Request) -> Response:
        body = ProducerDigests.loads(await read_json_body(request, max_body_bytes))
        stored = await service.producers.publish(principal_of(request), body)
        return kvsp_json(stored.to_json())

    async def lookup_producer_digests(request: Request) -> Response:
        query = ProducerDigestQuery.loads(await read_json_body(request, max_body_bytes))
        found = await service.producers.lookup(principal_of(request), query)
        return kvsp_json(found.to_json())

    return [
        Route("/replicas/{holder_id}/{block_key}", put_replica, methods=["PUT"]),
        Route("/replicas/{holder_id}/{block_key}", delete_replica, methods=["DELETE"]),
        Route("/lookup", lookup, methods=["POST"]),
        Route("/instances/{instance_id}/status", put_status, methods=["PUT"]),
        Route("/holders/{holder_id}/liveness", put_liveness, methods=["PUT"]),
        Route("/holders/{holder_id}/failures", post_failure, methods=["POST"]),
        Route("/producer-digests", post_producer_digests, methods=["POST"]),
        Route("/producer-digests/lookup", lookup_producer_digests, methods=["POST"]),
    ]


def index_app(service: IndexService, policy: Policy, *, base_path: str = "/",
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, rules: Sequence[Rule] = INDEX_RULES,
              sweep_interval: float | None = 1.0, sweep_limit: int = 65536,
              metrics: Registry | None = None, liveness_interval: float = LIVENESS_SYNC_S) -> ASGIApp:
    """The Index Service as an ASGI app (see the module docstring). *sweep_interval* seconds between removals
    of expired entries while the app's lifespan runs (None: never; lookups skip expired entries anyway); with a
    shared liveness store, its tables are reloaded every *liveness_interval* seconds. With *metrics*, ``GET
    metrics`` serves it (any principal) and lookups and transfer octets are counted."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with running(sweeper(service, sweep_interval, sweep_limit) if sweep_interval else None,
                           liveness_sync(service, liveness_interval)):
            yield

    app = Starlette(routes=index_routes(service, max_body_bytes=max_body_bytes, metrics=metrics),
                    lifespan=lifespan)
    install(app)
    if metrics is None:
        return role_app(app, policy, rules, base_path)
    rules = mount_metrics(app, metrics, rules)
    return TransferMetrics(role_app(app, policy, rules, base_path), metrics, component="index")


@contextlib.asynccontextmanager
async def running(*coros: Coroutine[Any, Any, None] | None) -> AsyncIterator[None]:
    """Run *coros* (None entries are skipped) as tasks for the duration of the block; cancel them after."""
    tasks = [asyncio.create_task(c) for c in coros if c is not None]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def sweeper(service: IndexService, interval: float, limit: int) -> None:
    """Remove expired entries every *interval* seconds (until cancelled)."""
    while True:
        await asyncio.sleep(interval)
        try:
            await service.sweep(limit)
        except Exception:  # a store outage must not end the sweeper
            log.exception("sweeping expired index entries failed")


def liveness_sync(service: IndexService, interval: float = LIVENESS_SYNC_S) -> Coroutine[Any, Any, None] | None:
    """The task that keeps *service*'s liveness tables synced with its shared store, or None without one (the
    memory store: one process, its own tables)."""
    return liveness_syncer(service, interval) if service.shared_liveness is not None else None


async def liveness_syncer(service: IndexService, interval: float = LIVENESS_SYNC_S) -> None:
    """Reload the shared liveness records and failure reports at once, then every *interval* seconds (until
    cancelled): lookups see another process's reports at most *interval* plus one round trip late. While the
    store cannot be read, lookups keep the last view (one warning when it fails, one line when it is back)."""
    failing = False
    while True:
        try:
            await service.sync_liveness()
        except Exception as exc:  # an outage must not end the task, nor fail lookups
            if not failing:
                log.warning("the shared liveness records cannot be read (%s: %s); lookups use the last view until "
                            "they can", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            failing = True
        else:
            if failing:
                log.info("the shared liveness records can be read again")
            failing = False
        await asyncio.sleep(interval)


__all__ = ["DEFAULT_MAX_BODY_BYTES", "INDEX_RULES", "LIVENESS_SYNC_S", "index_app", "index_routes", "liveness_sync",
           "liveness_syncer", "lookup_body", "lookup_json", "running", "sweeper"]
