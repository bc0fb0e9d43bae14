"""The Placement Controller's HTTP edge: its resources on the Index Service's app (routes only, translating).

The Index Service and the PC run as one process under one base URI (docs/wire.md, "Placement Controller"):

    status = StatusTable(clock, policy=LifecyclePolicy(SleepPolicy()), max_ttl_ms=60_000)
    service = IndexService(store, clock=clock, config=config, status=status)
    role = PlacementController(service, clock=clock, metrics=registry)
    pc = ControllerService(role, HttpInstanceLink(client))
    app = controller_app(service, pc, policy, base_path="/kvsp/")

Resources, relative to the base URI (the Index Service's, :mod:`kvsp_http.index_app`, plus these; roles in
:data:`CONTROLLER_RULES`):

* ``PUT instances/{instance_id}/status`` (instance): the status report, through the PC (sleep requests, failures);
* ``POST sessions`` (client) -> 201 :class:`~kvsp_quic.roles.controller_records.SessionInfo` with ``Location``
  (200 for a retry of the same request); 429 with ``Retry-After`` beyond the client's limits, which the role
  applies (:mod:`kvsp_quic.roles.controller_admission`, ``[controller] client_max_sessions``,
  ``client_max_in_flight``, ``client_retry_ms``);
* ``GET sessions/{session}`` (client, the session's creator) -> 200 ``SessionInfo``;
* ``DELETE sessions/{session}`` (client, the session's creator; extension) -> 204: the session is cancelled at its
  instance and forgotten (docs/wire.md, "Cancelling a session");
* ``POST sessions/{session}/suspect`` (client, the session's creator; extension) with ``{"epoch", "reason"}`` -> 200
  ``SessionInfo`` plus ``"verdict"``: the PC probes the session's instance and migrates the session at once when
  the instance does not answer (docs/wire.md, "Suspect reports");
* ``PUT sessions/{session}/checkpoint`` (instance, the session's current one) -> 200 ``{"session", "epoch",
  "output_offset"}``; an optional ``"done": true`` member (extension) says the session produced its last token;
* ``GET instances`` (controller, client) -> ``{"instances": [...]}``: held state, epoch and load of each (a
  client sees only the instances of its scopes);
* ``PUT instances/{instance_id}/state`` (controller: operators) -> forwards ``PUT state`` to the instance;
* ``GET maps/{map}`` (controller) -> the authoritative Shard Map; ``PUT maps/{map}`` (controller) with a Shard Map
  (and optionally ``deadline_ms``): 201 registers a new map, otherwise the reshard to that version runs and the
  answer is 200 ``{"map", "version", "outcome": "committed" | "aborted", "acknowledged", "failed",
  "undelivered"}``;
* ``GET metrics`` (any principal).

Every one of these resources reads and writes the PC's state in the service's control store; with a shared one
(``ControllerService(..., store=RedisControlStore)``, ``--store redis``) any number of these apps sharing it are
interchangeable (docs/operations.md, "Replicated Index Service and Placement Controller").

The rules are the role's (:class:`~kvsp_quic.roles.controller.PlacementController`), the I/O its adapter's
(:class:`~kvsp_runtime.controller_service.ControllerService`); the PC's requests to instances go through
:class:`~kvsp_runtime.controller_link.HttpInstanceLink`.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.asgi_types import ASGIApp
from kvsp_http.app_kit import kvsp_json, read_json_body, role_app
from kvsp_http.authz import Rule, principal_of
from kvsp_http.index_app import DEFAULT_MAX_BODY_BYTES, INDEX_RULES, index_routes, liveness_sync, running, sweeper
from kvsp_http.metrics_app import TransferMetrics, mount_metrics
from kvsp_http.problem_response import install
from kvsp_quic import fields as f
from kvsp_quic import keys as k
from kvsp_quic.auth import Policy
from kvsp_quic.metrics import Registry
from kvsp_quic.problems import BadRequest, NotFound
from kvsp_quic.records import SessionCheckpoint, ShardMap, StateMessage
from kvsp_quic.roles.controller_records import SessionRequest, SuspectReport
from kvsp_quic.roles.controller_reshard import ReshardContext
from kvsp_quic.roles.index import IndexService
from kvsp_runtime.controller_service import ControllerService

DEFAULT_MAX_SESSION_BYTES = 4 << 20  # a 131072-token prompt and its 8192 Block Keys are ~1.5 MB of JSON
_MAP_RE = re.compile(r"[A-Za-z0-9._~-]{1,128}")

CONTROLLER_RULES: tuple[Rule, ...] = (
    Rule("POST", "sessions", ["client"]),
    Rule("GET", "sessions/{session}", ["client"]),
    Rule("DELETE", "sessions/{session}", ["client"]),
    Rule("POST", "sessions/{session}/suspect", ["client"]),
    Rule("PUT", "sessions/{session}/checkpoint", ["instance"]),
    Rule("GET", "instances", ["controller", "client"]),
    Rule("PUT", "instances/{instance_id}/state", ["controller"]),
    Rule("GET", "maps/{map}", ["controller"]),
    Rule("PUT", "maps/{map}", ["controller"]),
)


# -- the PC's resources -----------------------------------------------------------------------------------------


def _session_id(request: Request) -> uuid.UUID:
    try:
        return f.uuid_string(request.path_params["session"], "session")
    except f.RecordError:
        raise NotFound(f"no session {request.path_params['session']!r}") from None


def _map_id(request: Request) -> str:
    value = str(request.path_params["map"])
    if not _MAP_RE.fullmatch(value):
        raise NotFound(f"no shard map {value!r}")
    return value


def controller_routes(pc: ControllerService, *, max_body_bytes: int = DEFAULT_MAX_SESSION_BYTES) -> list[Route]:
    role = pc.role

    async def post_session(request: Request) -> Response:
        # The role admits or refuses (a client's limits: 429 with the problem's retry_after_s as Retry-After).
        body = SessionRequest.loads(await read_json_body(request, max_body_bytes))
        info, created = await pc.create_session(principal_of(request), body)
        return kvsp_json(info.to_json(), 201 if created else 200, {"location": f"sessions/{info.session}"})

    async def get_session(request: Request) -> Response:
        return kvsp_json((await pc.session_info(principal_of(request), _session_id(request))).to_json())

    async def delete_session(request: Request) -> Response:
        await pc.cancel_session(principal_of(request), _session_id(request))
        return Response(status_code=204, headers={"cache-control": "no-store"})

    async def post_suspect(request: Request) -> Response:
        report = SuspectReport.loads(await read_json_body(request, 64 << 10))
        return kvsp_json((await pc.suspect(principal_of(request), _session_id(request), report)).to_json())

    async def put_checkpoint(request: Request) -> Response:
        session_id = _session_id(request)
        obj = f.loads_object(await read_json_body(request, max_body_bytes))
        checkpoint = SessionCheckpoint.from_json(obj)
        done = f.boolean(obj["done"], "done") if obj.get("done") is not None else False
        ack = await pc.checkpoint(principal_of(request), session_id, checkpoint, done=done)
        return kvsp_json(ack.to_json())

    async def get_instances(request: Request) -> Response:
        return kvsp_json({"instances": await pc.instances(principal_of(request))})

    async def put_state(request: Request) -> Response:
        wanted = str(request.path_params["instance_id"])
        message = StateMessage.loads(await read_json_body(request, 64 << 10))
        await pc.refresh()
        instance = next((i for i in role.known_instances() if k.uri_id(i) == wanted), None)
        if instance is None:
            raise NotFound(f"no instance with instance-id {wanted!r}")
        return kvsp_json(StateMessage(await pc.set_instance_state(instance, message.state)).to_json())

    async def get_map(request: Request) -> Response:
        return kvsp_json((await pc.get_map(_map_id(request))).to_json())

    async def put_map(request: Request) -> Response:
        map_id = _map_id(request)
        obj = f.loads_object(await read_json_body(request, max_body_bytes))
        new = ShardMap.from_json(obj)
        if new.map != map_id:
            raise BadRequest(f"map: the body names {new.map!r}, the path {map_id!r}")
        deadline = f.positive(obj["deadline_ms"], "deadline_ms") if obj.get("deadline_ms") is not None else None
        context = ReshardContext.read(obj["context"], "context") if obj.get("context") is not None else None
        if not await pc.has_map(map_id):
            return kvsp_json((await pc.put_map(new, context)).to_json(), 201)
        return kvsp_json((await pc.reshard(new, deadline, context)).to_json())

    return [
        Route("/sessions", post_session, methods=["POST"]),
        Route("/sessions/{session}", get_session, methods=["GET"]),
        Route("/sessions/{session}", delete_session, methods=["DELETE"]),
        Route("/sessions/{session}/suspect", post_suspect, methods=["POST"]),
        Route("/sessions/{session}/checkpoint", put_checkpoint, methods=["PUT"]),
        Route("/instances", get_instances, methods=["GET"]),
        Route("/instances/{instance_id}/state", put_state, methods=["PUT"]),
        Route("/maps/{map}", get_map, methods=["GET"]),
        Route("/maps/{map}", put_map, methods=["PUT"]),
    ]


def controller_app(service: IndexService, pc: ControllerService, policy: Policy, *,
                   base_path: str = "/", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                   max_session_bytes: int = DEFAULT_MAX_SESSION_BYTES, sweep_interval: float | None = 1.0,
                   sweep_limit: int = 65536, tick_interval: float = 0.1, metrics: Registry | None = None,
                   rules: Sequence[Rule] = INDEX_RULES + CONTROLLER_RULES) -> ASGIApp:
    """The Index Service and the Placement Controller as one ASGI app (see the module docstring). While the
    lifespan runs, expired index entries are swept every *sweep_interval* seconds and the controller ticks every
    *tick_interval* seconds (failovers). *metrics* defaults to the controller's registry."""
    registry = metrics or pc.role.registry

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            async with running(sweeper(service, sweep_interval, sweep_limit) if sweep_interval else None,
                               pc.run(tick_interval), liveness_sync(service)):
                yield
        finally:  # the ticker is stopped first: a replica going away starts no migration while it closes
            await pc.aclose()

    routes = index_routes(service, max_body_bytes=max_body_bytes, report_status=pc.report_status, metrics=registry)
    app = Starlette(routes=routes + controller_routes(pc, max_body_bytes=max_session_bytes), lifespan=lifespan)
    install(app)
    all_rules = mount_metrics(app, registry, rules)
    return TransferMetrics(role_app(app, policy, all_rules, base_path), registry, component="index")


__all__ = ["CONTROLLER_RULES", "DEFAULT_MAX_SESSION_BYTES", "controller_app", "controller_routes"]
