"""The Inference Instance over HTTP: its KVSP resources and the extension resources of docs/inference.md, as
routes that translate requests to the asyncio service (:mod:`kvsp_runtime.instance_service`) and the role's records
back.

    POST prefetch                       controller   202, Location: prefetch/<id>        (KVSP)
    GET  prefetch/{id}                  controller   {"directive", "state", "loaded"}    (KVSP)
    POST sessions/{id}/resume           controller   {"session", "epoch", "output_offset"}  (KVSP)
    POST reshard                        controller   plan -> 200 once fetched; commit; abort  (KVSP)
    PUT  state                          controller   {"state"}                            (KVSP)
    POST sessions/{id}/start            controller   201 {"session", "epoch", "output_offset"}  (extension)
    GET  sessions/{id}/tokens?from=N    client       application/x-ndjson                 (extension)
    GET  status                         controller, client   the Instance Status Record  (extension)
    GET  sessions/{id}                  controller, client   the run: state, loaded blocks, TTFT (extension)
    DELETE sessions/{id}                controller   cancel the run                       (extension)

A session's token stream and ``GET sessions/{id}`` answer only the PC and the session's owner (the identity the
PC names in the start or resume; docs/wire.md, "Session owner"): another client of the same scope gets 404.
    GET  blocks/{compat}/{scope}/{key}  client, instance, holder   its own replicas (holder resources)
    POST leases, PUT/DELETE leases/{id} client, instance, holder

The instance is a holder of its own tiers (:class:`kvsp_quic.engine.PageHolder`), so its block resource is the holder's
(:class:`kvsp_http.holder_app.BlockResource`, GET only: ``PUT blocks`` is not offered) and its lease routes are
:func:`kvsp_http.holder_app.holder_routes`. The instance is assembled by the composition
root (:func:`kvsp_app.instance.build_instance`).
"""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from http3.asgi_types import ASGIApp
from kvsp_http.app_kit import NO_STORE, kvsp_json, read_json_body, role_app
from kvsp_http.authz import Rule, principal_of
from kvsp_http.holder_app import BlockResource, holder_routes
from kvsp_http.metrics_app import TransferMetrics, mount_metrics
from kvsp_http.problem_response import install
from kvsp_quic import fields as f
from kvsp_quic.auth import Policy, Role
from kvsp_quic.metrics import holder_collectors, retrieval_collectors
from kvsp_quic.problems import BadRequest, NotFound
from kvsp_quic.records import CheckpointAck, PrefetchDirective, ReshardPlan, StateMessage, parse_reshard
from kvsp_quic.roles.controller_records import SessionResume, SessionStart
from kvsp_quic.roles.instance import InstanceSession, ReshardContext
from kvsp_runtime.instance_service import InstanceService

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
    Rule("DELETE", "sessions/{session}", _PC),
    # the instance as a holder of its own tiers (kvsp_http/holder_app.py RULES, without PUT blocks)
    Rule("GET", "blocks/{compat}/{scope}/{block_key}", _READERS),
    Rule("POST", "leases", _READERS),
    Rule("PUT", "leases/{lease_id}", _READERS),
    Rule("DELETE", "leases/{lease_id}", _READERS),
)


def _session_id(request: Request) -> uuid.UUID:
    try:
        return f.uuid_string(request.path_params["session"], "session")
    except f.RecordError:
        raise NotFound(f"no session {request.path_params['session']!r}") from None


def _session_answer(session: InstanceSession) -> dict[str, Any]:
    """The answer to a start or resume: the run's session, epoch and the output offset it continues from."""
    return CheckpointAck(session.id, session.epoch, session.base_offset).to_json()


def instance_routes(service: InstanceService[Any], *, max_json_bytes: int = MAX_JSON_BYTES) -> Starlette:
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
        session = service.readable_session(principal_of(request), sid)  # the session's owner or the PC
        text = request.query_params.get("from", "0")
        if not text.isascii() or not text.isdigit() or len(text) > 10:
            raise BadRequest(f"from={text!r}: expected a token index")
        return StreamingResponse(service.tokens(session, int(text)), media_type=NDJSON, headers=NO_STORE)

    async def get_session(request: Request) -> Response:
        session = service.readable_session(principal_of(request), _session_id(request))
        return kvsp_json(session.info())

    async def delete_session(request: Request) -> Response:
        service.cancel_session(_session_id(request))
        return Response(status_code=204, headers=NO_STORE)

    async def post_reshard(request: Request) -> Response:
        body = await body_of(request)
        msg = parse_reshard(body)
        context = ReshardContext.from_json(body["context"], "context") \
            if isinstance(msg, ReshardPlan) and "context" in body else None
        return kvsp_json(dict(await service.reshard(principal_of(request), msg, context)))

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
        Route("/sessions/{session}", delete_session, methods=["DELETE"]),
        Route("/reshard", post_reshard, methods=["POST"]),
        Route("/state", put_state, methods=["PUT"]),
        Route("/status", get_status, methods=["GET"]),
        *holder.routes,  # the holder's lease routes (no catch-all mount: GET metrics is added later)
    ])
    install(app)
    return app


def instance_app(service: InstanceService[Any], policy: Policy, *, base_path: str | None = None) -> ASGIApp:
    """The instance's ASGI app: authorization by certificate identity and :data:`RULES`, below *base_path*
    (default: the path of the instance's base URI), with ``GET metrics`` (any principal; :mod:`kvsp_http.metrics_app`):
    fetched and recomputed tokens, migrations (resumes), its holder's and its fetchers' counters, body octets by
    transport."""
    path = urlsplit(service.role.settings.base_uri).path if base_path is None else base_path
    routes = instance_routes(service)
    registry = service.metrics
    holder_collectors(registry, service.holder.metrics, component="instance")
    retrieval_collectors(registry, service.retrieval, component="retrieval")
    rules = mount_metrics(routes, registry, RULES)
    transfer = TransferMetrics(role_app(routes, policy, rules, path), registry, component="instance")
    return BlockResource(transfer, service.holder, policy, RULES, path, transfer)


__all__ = ["MAX_JSON_BYTES", "NDJSON", "RULES", "instance_app", "instance_routes"]
