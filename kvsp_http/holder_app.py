"""The Holder's HTTP resources (spec: "KVSP Resources", Holder rows) as a starlette app.

    GET, PUT  blocks/{compat}/{scope}/{block_key}   [?layers=a-b][&codec=n]
    POST      leases
    PUT, DELETE leases/{id}

This module only translates: HTTP in, :class:`kvsp_quic.roles.holder.Holder` calls, HTTP out. Every request is
authorized by :class:`kvsp_http.authz.Authorization` with :data:`RULES` (roles) and by the holder (scopes); every
error is rendered by :mod:`kvsp_http.problem_response`. Block bodies are never joined: a GET streams the header and
the section views of the stored container, a PUT feeds each received chunk into the holder's incremental
decoder, which copies it once into the replica's buffer.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.asgi_types import ASGIApp, Message, Receive, Scope, Send
from http3.immediate import IMMEDIATE_MAX, Immediate
from kvsp_http.app_kit import (
    BLOCK_MEDIA_TYPE,
    NO_STORE,
    kvsp_json,
    read_json_body,
    role_app,
)
from kvsp_http.authz import Rule, principal_of
from kvsp_http.metrics_app import TransferMetrics, audit_metrics, mount_metrics
from kvsp_http.problem_response import INTERNAL_ERROR_DETAIL, install, problem_parts, send_problem
from kvsp_quic import fields as f
from kvsp_quic.auth import Policy, Principal, Role
from kvsp_quic.metrics import Registry, holder_collectors
from kvsp_quic.problems import ContentTooLarge, NotFound, Problem, UnsupportedMediaType
from kvsp_quic.records import LeaseRenewal, LeaseRequest
from kvsp_quic.roles.holder import Fetched, Holder
from kvsp_quic.roles.holder_requests import parse_codec, parse_layers, parse_position
from kvsp_quic.roles.holder_worker import HolderWorker
from quic.tls import scope_identity

ServedHolder = Holder | HolderWorker  # the holder, or one of its worker processes (--workers N)

log = logging.getLogger("kvsp.holder")

MAX_JSON_BYTES = 64 << 10
_COALESCE = 64 << 10  # sections smaller than this are sent together
_PIECE = 1 << 20  # a container served whole goes out in views of this many octets (the TCP path's FLUSH_AT)

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


def _block_head(fetched: Fetched) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", _BLOCK_TYPE), (b"content-length", b"%d" % fetched.size),
            (b"repr-digest", fetched.repr_digest_field.encode("ascii")),
            (b"cache-control", b"private, immutable, max-age=%d" % fetched.max_age_s)]


async def serve_block_get(holder: ServedHolder, principal: Principal, path: tuple[str, str, str], query_string: bytes,
                          method: str, send: Send) -> int:
    """``GET`` (or ``HEAD``) ``blocks/{compat}/{scope}/{block_key}[?layers=a-b][&codec=n]``: 200 with the
    container streamed from its parts (the header octets, then each K and V section view; a HEAD gets the headers
    of the GET with no content). Returns the body octets sent."""
    compat, scope_id, key = _block_ids(path)
    layers = codec = None
    if query_string:
        query = dict(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
        layers = parse_layers(query["layers"]) if "layers" in query else None
        codec = parse_codec(query["codec"]) if "codec" in query else None
    fetched = holder.fetch(principal, compat, scope_id, key, layers=layers, codec=codec)
    await send({"type": "http.response.start", "status": 200, "headers": _block_head(fetched)})
    if method == "HEAD":
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return 0
    await _send_sections(fetched, send)
    return fetched.size


async def serve_block_put(holder: ServedHolder, principal: Principal, path: tuple[str, str, str], scope: Scope,
                          receive: Receive, send: Send) -> tuple[int, int]:
    """``PUT blocks/{compat}/{scope}/{block_key}[?layers=a-b][&chain=<hex32>&position=<i>]``: the body fed chunk by
    chunk into the holder's incremental decoder; 201 with the Replica Record. Returns (octets received, octets
    sent); (n, 0) when the client left. The container may hold a layer range of the block (its header names it;
    ``layers``, optional, must then name the same range). ``chain`` and ``position`` declare where the block sits
    in its token sequence (K[0] and i), for prefix-aware eviction (docs/wire.md, "Holder"). Where the server offers
    ``kvsp.receive_into`` (ours does, on every transport), the body goes straight into the replica's buffer as it
    arrives (over HTTP/1.1 TLS decrypts into it), with no chunk queued or copied on the way."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    query_string: bytes = scope.get("query_string", b"")
    compat, scope_id, key = _block_ids(path)
    position = layers = None
    if query_string:
        query = dict(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
        position = parse_position(query, key)
        layers = parse_layers(query["layers"]) if "layers" in query else None
    content_type = declared = if_none_match = None
    for name, value in headers:
        if name == b"content-type" and content_type is None:
            content_type = value.decode("latin-1").split(";", 1)[0].strip().lower()
        elif name == b"content-length" and declared is None:
            declared = value.decode("latin-1")
        elif name == b"if-none-match" and if_none_match is None:
            if_none_match = value.decode("latin-1")
    if content_type != BLOCK_MEDIA_TYPE:
        raise UnsupportedMediaType(f"the request body must be {BLOCK_MEDIA_TYPE}, not {content_type or 'unlabelled'}")
    limit = holder.settings.max_block_bytes
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ContentTooLarge(f"the request body of {declared} octets exceeds the limit of {limit}")
    upload = holder.begin_store(principal, compat, scope_id, key, if_none_match)
    upload.position = position
    upload.layers = layers
    receive_into = scope.get("extensions", {}).get("kvsp.receive_into")
    received = 0
    if receive_into is not None:
        try:
            got = await receive_into(upload)
        except BaseException:
            upload.abort()
            raise
        if got is None:
            upload.abort()
            return upload.received, 0  # the client left: nothing to answer, the partial upload is dropped
        received = got
    else:
        while True:
            message = await receive()
            if message["type"] != "http.request":
                upload.abort()
                return received, 0  # the client left: nothing to answer, the partial upload is dropped
            body = message.get("body", b"")
            if body:
                received += len(body)
                upload.feed(body)
            if not message.get("more_body", False):
                break
    record = upload.finish()
    out = json.dumps(record.to_json(), separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    await send({"type": "http.response.start", "status": 201,
                "headers": [*_JSON_HEADERS, (b"content-length", b"%d" % len(out)), _JSON_TYPE]})
    await send({"type": "http.response.body", "body": out, "more_body": False})
    return received, len(out)


class _BlockEndpoint:
    """The block resource as a raw ASGI endpoint of the starlette app (behind :class:`kvsp_http.authz.Authorization`):
    the same :func:`serve_block_get` / :func:`serve_block_put` as :class:`BlockHotPath`."""

    def __init__(self, holder: ServedHolder) -> None:
        self.holder = holder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        p = scope["path_params"]
        path = (p["compat"], p["scope"], p["block_key"])
        if scope["method"] == "PUT":
            await serve_block_put(self.holder, principal_of(scope), path, scope, receive, send)
        else:
            await serve_block_get(self.holder, principal_of(scope), path, scope["query_string"], scope["method"],
                                  send)


# -- request helpers ---------------------------------------------------------------------------------------------


def _block_ids(path: tuple[str, str, str]) -> tuple[bytes, bytes, bytes]:
    compat, scope, key = path
    return f.compat_id(compat, "compat"), f.scope_id(scope, "scope"), f.block_key(key, "block_key")


def _lease_id(request: Request) -> uuid.UUID:
    try:
        return f.uuid_string(request.path_params["lease_id"], "lease")
    except f.RecordError:
        raise NotFound(f"no lease {request.path_params['lease_id']!r}") from None


# -- the block hot path ------------------------------------------------------------------------------------------


_TRANSPORTS = {"3": "HTTP/3", "2": "HTTP/2", "1.1": "HTTP/1.1", "1.0": "HTTP/1.0"}
_BLOCK_TYPE = BLOCK_MEDIA_TYPE.encode("ascii")
_JSON_HEADERS = ((b"cache-control", b"no-store"),)
_JSON_TYPE = (b"content-type", b"application/kvsp+json")
_MAX_IDENTITIES = 4096


class BlockHotPath:
    """ASGI: block ``GET`` and ``PUT`` served straight from the holder, everything else by *app*.

    The same answers as the full app (:class:`_BlockEndpoint` behind :class:`kvsp_http.authz.Authorization`,
    :class:`kvsp_http.app_kit.BasePath` and :class:`kvsp_http.metrics_app.TransferMetrics`: the same
    :func:`serve_block_get` / :func:`serve_block_put`) without its per-request layers: the block resource's rule
    is a role-set lookup, no scope is copied, no router runs, and transferred octets are counted once per request,
    not per message. A request the hot path would refuse (no identity, a role the rules deny) goes to *app*, which
    renders the refusal exactly as before; so do HEAD and every other resource."""

    def __init__(self, app: ASGIApp, holder: ServedHolder, policy: Policy, base_path: str,
                 transfer: TransferMetrics | None = None) -> None:
        self.app = app
        self.holder = holder
        self.policy = policy
        self.prefix = base_path.rstrip("/") + "/blocks/"
        self.readers = frozenset(_READERS)
        self.producers = frozenset(_PRODUCERS)
        self._transfer = transfer
        self._counters: dict[tuple[str, str], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        path: str = scope["path"]
        if (method != "GET" and method != "PUT") or not path.startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        parts = path[len(self.prefix):].split("/")
        principal = self._principal(scope)
        if (len(parts) != 3 or not all(parts) or principal is None
                or principal.roles.isdisjoint(self.readers if method == "GET" else self.producers)):
            await self.app(scope, receive, send)  # renders the refusal (or the 404) as it always did
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        block = (parts[0], parts[1], parts[2])
        try:
            if method == "GET":
                out = await serve_block_get(self.holder, principal, block, scope["query_string"], method,
                                            tracking_send)
                self._count(scope, "out", out)
            else:
                received, out = await serve_block_put(self.holder, principal, block, scope, receive, tracking_send)
                self._count(scope, "in", received)
                self._count(scope, "out", out)
        except Problem as problem:
            if started:
                raise
            await send_problem(send, problem)
        except Exception:
            if started:
                raise
            await send_problem(send, Problem(INTERNAL_ERROR_DETAIL, status=500))
            raise  # the server logs it, as starlette's handler lets it do

    def respond_now(self, method: str, path: str, query: bytes, scope: Scope) -> Immediate | None:
        """The HTTP/1.1 server's hook (:mod:`http3.immediate`): a GET of a whole block of at most
        :data:`~http3.immediate.IMMEDIATE_MAX` octets, answered at once from the stored buffer with the response
        of :func:`serve_block_get`, octet for octet (or its problem). Anything else -- a layer range or codec, a
        larger block, a block not held in memory, a request the rules refuse -- is None: the ASGI path serves it."""
        if method != "GET" or query or not path.startswith(self.prefix):
            return None
        parts = path[len(self.prefix):].split("/")
        principal = self._principal(scope)
        if (len(parts) != 3 or not all(parts) or principal is None
                or principal.roles.isdisjoint(self.readers)):
            return None
        try:
            compat, scope_id, key = _block_ids((parts[0], parts[1], parts[2]))
        except Problem:
            return None
        size = self.holder.served_size(compat, scope_id, key)
        if size is None or size > IMMEDIATE_MAX:
            return None
        try:
            fetched = self.holder.fetch(principal, compat, scope_id, key)
        except Problem as problem:
            status, headers, body = problem_parts(problem)
            return Immediate(status, headers, (body,))
        except Exception:
            log.exception("the holder failed to serve GET %s", path)
            status, headers, body = problem_parts(Problem(INTERNAL_ERROR_DETAIL, status=500))
            return Immediate(status, headers, (body,))
        whole = fetched.container.whole
        self._count(scope, "out", fetched.size)
        return Immediate(200, _block_head(fetched),
                         (whole,) if whole is not None else tuple(fetched.container.chunks()))

    def _principal(self, scope: Scope) -> Principal | None:
        try:
            identity = scope_identity(scope)  # quic.tls caches the parse of each certificate
        except ValueError:
            return None
        return self.policy.principal(identity) if identity is not None else None

    def _count(self, scope: Scope, direction: str, n: int) -> None:
        if self._transfer is None or not n:
            return
        version = str(scope.get("http_version"))
        counter = self._counters.get((version, direction))
        if counter is None:
            transport = _TRANSPORTS.get(version, f"HTTP/{version}")
            counter = self._transfer.counter.labels(component=self._transfer.component, transport=transport,
                                                    direction=direction)
            self._counters[(version, direction)] = counter
        counter.inc(n)


async def _send_sections(fetched: Fetched, send: Send) -> None:
    """The container as body messages: a container served whole in views of up to :data:`_PIECE` octets of the
    stored buffer (nothing copied; one message for a block up to 1 MiB); a layer range as its header and section
    views, sections under :data:`_COALESCE` together."""
    whole = fetched.container.whole
    if whole is not None:
        end = len(whole)
        for start in range(0, end, _PIECE):
            await send({"type": "http.response.body", "body": whole[start:start + _PIECE],
                        "more_body": start + _PIECE < end})
        return
    small = bytearray()
    for chunk in fetched.container.chunks():
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


# -- the app -----------------------------------------------------------------------------------------------------


def holder_routes(holder: ServedHolder, *, max_json_bytes: int = MAX_JSON_BYTES) -> Starlette:
    """The starlette app of the holder's resources, without authorization (see :func:`holder_app`)."""

    block = _BlockEndpoint(holder)

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
        Route("/blocks/{compat}/{scope}/{block_key}", block, methods=["GET", "PUT"]),
        Route("/leases", post_lease, methods=["POST"]),
        Route("/leases/{lease_id}", put_lease, methods=["PUT"]),
        Route("/leases/{lease_id}", delete_lease, methods=["DELETE"]),
    ])
    install(app)
    return app


def holder_app(holder: ServedHolder, policy: Policy, *, base_path: str | None = None,
               max_json_bytes: int = MAX_JSON_BYTES, metrics: Registry | None = None,
               hot_path: bool = True) -> ASGIApp:
    """The holder's ASGI app: authorization by certificate identity and :data:`RULES`, served below *base_path*
    (default: the path of the holder's base URI, e.g. ``"/kvsp/"``). With *metrics*, ``GET metrics`` (any
    principal) serves it, with the holder's counters and the body octets it moved by transport. Block GET and PUT
    take :class:`BlockHotPath` (same answers, less work per request) unless *hot_path* is false."""
    routes = holder_routes(holder, max_json_bytes=max_json_bytes)
    path = urlsplit(holder.base_uri).path if base_path is None else base_path
    app: ASGIApp
    transfer: TransferMetrics | None = None
    if metrics is None:
        app = role_app(routes, policy, RULES, path)
    else:
        holder_collectors(metrics, holder.metrics)
        audit_metrics(metrics)
        rules = mount_metrics(routes, metrics, RULES)
        app = transfer = TransferMetrics(role_app(routes, policy, rules, path), metrics, component="holder")
    return BlockHotPath(app, holder, policy, path, transfer) if hot_path else app
