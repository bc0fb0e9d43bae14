"""The Holder's HTTP resources (spec: "KVSP Resources", Holder rows) as a starlette app.

    GET, PUT  blocks/{compat}/{scope}/{block_key}   [?layers=a-b][&codec=n]
    POST      leases
    PUT, DELETE leases/{id}

This module only translates: HTTP in, :class:`kvsp_quic.roles.holder.Holder` calls, HTTP out. Every request is
authorized by :class:`http3.authz.Authorization` with :data:`RULES` (roles) and by the holder (scopes); every
error is rendered by :mod:`http3.problem_response`. Block bodies are never joined: a GET streams the header and
the section views of the stored container, a PUT feeds each received chunk into the holder's incremental
decoder, which copies it once into the replica's buffer.
"""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.app_kit import (
    BLOCK_MEDIA_TYPE,
    NO_STORE,
    check_declared_length,
    kvsp_json,
    read_json_body,
    require_media_type,
    role_app,
)
from http3.asgi_types import ASGIApp, Receive, Scope, Send
from http3.authz import Rule, principal_of
from http3.metrics_app import TransferMetrics, mount_metrics
from http3.problem_response import install
from kvsp_quic import fields as f
from kvsp_quic.auth import Policy, Role
from kvsp_quic.metrics import Registry, holder_collectors
from kvsp_quic.problems import NotFound
from kvsp_quic.records import LeaseRenewal, LeaseRequest
from kvsp_quic.roles.holder import Fetched, Holder, parse_codec, parse_layers

MAX_JSON_BYTES = 64 << 10
_COALESCE = 64 << 10  # sections smaller than this are sent together

_READERS = (Role.CLIENT, Role.INSTANCE, Role.HOLDER)
_PRODUCERS = (Role.INSTANCE, Role.HOLDER)
RULES = (
    # Blocks are read by whoever loads caches: clients, inference instances, other holders (replication).
    Rule("GET", "blocks/{compat}/{scope}/{block_key}", _READERS),
    # Only producers of KV data store blocks (cache poisoning: spec, Security Considerations).
    Rule("PUT", "blocks/{compat}/{scope}/{block_key}", _PRODUCERS),
    Rule("POST", "leases", _READERS),
    Rule("PUT", "leases/{lease_id}", _READERS),
    Rule("DELETE", "leases/{lease_id}", _READERS),
)


# -- responses ---------------------------------------------------------------------------------------------------


class BlockResponse(Response):
    """200 with the container streamed from its parts: the header octets, then each K and V section view."""

    media_type = BLOCK_MEDIA_TYPE

    def __init__(self, fetched: Fetched) -> None:
        self.fetched = fetched
        self.status_code = 200
        self.background = None
        self.init_headers({
            "content-type": BLOCK_MEDIA_TYPE,
            "content-length": str(fetched.size),
            "repr-digest": fetched.repr_digest_field,
            "cache-control": f"private, immutable, max-age={fetched.max_age_s}",
        })

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("method") == "HEAD":  # the headers of a GET, with its Content-Length, and no content
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        small = bytearray()
        for chunk in self.fetched.container.chunks():
            if len(chunk) < _COALESCE:
                small += chunk
                if len(small) < _COALESCE:
                    continue
                chunk, small = bytes(small), bytearray()
            elif small:
                await send({"type": "http.response.body", "body": bytes(small), "more_body": True})
                small = bytearray()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": bytes(small), "more_body": False})


# -- request helpers ---------------------------------------------------------------------------------------------


def _block_path(request: Request) -> tuple[bytes, bytes, bytes]:
    p = request.path_params
    return (f.compat_id(p["compat"], "compat"), f.scope_id(p["scope"], "scope"),
            f.block_key(p["block_key"], "block_key"))


def _lease_id(request: Request) -> uuid.UUID:
    try:
        return f.uuid_string(request.path_params["lease_id"], "lease")
    except f.RecordError:
        raise NotFound(f"no lease {request.path_params['lease_id']!r}") from None


# -- the app -----------------------------------------------------------------------------------------------------


def holder_routes(holder: Holder, *, max_json_bytes: int = MAX_JSON_BYTES) -> Starlette:
    """The starlette app of the holder's resources, without authorization (see :func:`holder_app`)."""

    async def get_block(request: Request) -> Response:
        compat, scope, key = _block_path(request)
        query = request.query_params
        layers = parse_layers(query["layers"]) if "layers" in query else None
        codec = parse_codec(query["codec"]) if "codec" in query else None
        fetched = holder.fetch(principal_of(request), compat, scope, key, layers=layers, codec=codec)
        return BlockResponse(fetched)

    async def put_block(request: Request) -> Response:
        compat, scope, key = _block_path(request)
        require_media_type(request, BLOCK_MEDIA_TYPE)
        check_declared_length(request, holder.settings.max_block_bytes)
        upload = holder.begin_store(principal_of(request), compat, scope, key, request.headers.get("if-none-match"))
        async for chunk in request.stream():
            if chunk:
                upload.feed(chunk)
        record = upload.finish()
        return kvsp_json(record.to_json(), 201)

    async def post_lease(request: Request) -> Response:
        lease_request = LeaseRequest.loads(await read_json_body(request, max_json_bytes))
        granted = holder.create_lease(principal_of(request), lease_request)
        return kvsp_json(granted.to_json(), 201, {"location": f"leases/{granted.lease}"})

    async def put_lease(request: Request) -> Response:
        lease_id = _lease_id(request)
        renewal = LeaseRenewal.loads(await read_json_body(request, max_json_bytes))
        return kvsp_json(holder.renew_lease(principal_of(request), lease_id, renewal).to_json())

    async def delete_lease(request: Request) -> Response:
        holder.release_lease(principal_of(request), _lease_id(request))
        return Response(status_code=204, headers=NO_STORE)

    app = Starlette(routes=[
        Route("/blocks/{compat}/{scope}/{block_key}", get_block, methods=["GET"]),
        Route("/blocks/{compat}/{scope}/{block_key}", put_block, methods=["PUT"]),
        Route("/leases", post_lease, methods=["POST"]),
        Route("/leases/{lease_id}", put_lease, methods=["PUT"]),
        Route("/leases/{lease_id}", delete_lease, methods=["DELETE"]),
    ])
    install(app)
    return app


def holder_app(holder: Holder, policy: Policy, *, base_path: str | None = None,
               max_json_bytes: int = MAX_JSON_BYTES, metrics: Registry | None = None) -> ASGIApp:
    """The holder's ASGI app: authorization by certificate identity and :data:`RULES`, served below *base_path*
    (default: the path of the holder's base URI, e.g. ``"/kvsp/"``). With *metrics*, ``GET metrics`` (any
    principal) serves it, with the holder's counters and the body octets it moved by transport."""
    routes = holder_routes(holder, max_json_bytes=max_json_bytes)
    path = urlsplit(holder.base_uri).path if base_path is None else base_path
    if metrics is None:
        return role_app(routes, policy, RULES, path)
    holder_collectors(metrics, holder.metrics)
    rules = mount_metrics(routes, metrics, RULES)
    return TransferMetrics(role_app(routes, policy, rules, path), metrics, component="holder")
