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
from collections.abc import Sequence
from dataclasses import dataclass
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
from kvsp_http.authz import Rule, authenticate, no_such_resource, principal_of
from kvsp_http.metrics_app import TransferMetrics, audit_metrics, mount_metrics
from kvsp_http.problem_response import INTERNAL_ERROR_DETAIL, install, problem_parts, send_problem
from kvsp_quic import fields as f
from kvsp_quic.auth import Policy, Principal, Role, require_role
from kvsp_quic.metrics import Registry, holder_collectors
from kvsp_quic.problems import ContentTooLarge, NotFound, Problem, UnsupportedMediaType
from kvsp_quic.records import LeaseRenewal, LeaseRequest
from kvsp_quic.roles.holder import Fetched, Holder
from kvsp_quic.roles.holder_requests import parse_codec, parse_layers, parse_position
from kvsp_quic.roles.holder_worker import HolderWorker

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


async def serve_block_get(holder: ServedHolder, request: BlockRequest, send: Send) -> int:
    """``GET`` (or ``HEAD``) ``blocks/{compat}/{scope}/{block_key}[?layers=a-b][&codec=n]``: 200 with the
    container streamed from its parts (the header octets, then each K and V section view; a HEAD gets the headers
    of the GET with no content). Returns the body octets sent."""
    layers = codec = None
    if request.query:
        query = dict(parse_qsl(request.query.decode("latin-1"), keep_blank_values=True))
        layers = parse_layers(query["layers"]) if "layers" in query else None
        codec = parse_codec(query["codec"]) if "codec" in query else None
    fetched = holder.fetch(request.principal, request.compat, request.scope_id, request.key, layers=layers, codec=codec)
    await send({"type": "http.response.start", "status": 200, "headers": _block_head(fetched)})
    if request.method == "HEAD":
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return 0
    await _send_sections(fetched, send)
    return fetched.size


async def serve_block_put(holder: ServedHolder, request: BlockRequest, scope: Scope, receive: Receive,
                          send: Send) -> tuple[int, int]:
    """``PUT blocks/{compat}/{scope}/{block_key}[?layers=a-b][&chain=<hex32>&position=<i>]``: the body fed chunk by
    chunk into the holder's incremental decoder; 201 with the Replica Record. Returns (octets received, octets
    sent); (n, 0) when the client left. The container may hold a layer range of the block (its header names it;
    ``layers``, optional, must then name the same range). ``chain`` and ``position`` declare where the block sits
    in its token sequence (K[0] and i), for prefix-aware eviction (docs/wire.md, "Holder"). Where the server offers
    ``kvsp.receive_into`` (ours does, on every transport), the body goes straight into the replica's buffer as it
    arrives (over HTTP/1.1 TLS decrypts into it), with no chunk queued or copied on the way."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    position = layers = None
    if request.query:
        query = dict(parse_qsl(request.query.decode("latin-1"), keep_blank_values=True))
        position = parse_position(query, request.key)
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
    upload = holder.begin_store(request.principal, request.compat, request.scope_id, request.key, if_none_match)
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


# -- request helpers ---------------------------------------------------------------------------------------------


def _block_ids(path: tuple[str, str, str]) -> tuple[bytes, bytes, bytes]:
    compat, scope, key = path
    return f.compat_id(compat, "compat"), f.scope_id(scope, "scope"), f.block_key(key, "block_key")


def _lease_id(request: Request) -> uuid.UUID:
    try:
        return f.uuid_string(request.path_params["lease_id"], "lease")
    except f.RecordError:
        raise NotFound(f"no lease {request.path_params['lease_id']!r}") from None


# -- the block resource ------------------------------------------------------------------------------------------


_TRANSPORTS = {"3": "HTTP/3", "2": "HTTP/2", "1.1": "HTTP/1.1", "1.0": "HTTP/1.0"}
_BLOCK_TYPE = BLOCK_MEDIA_TYPE.encode("ascii")
_JSON_HEADERS = ((b"cache-control", b"no-store"),)
_JSON_TYPE = (b"content-type", b"application/kvsp+json")
_MAX_IDENTITIES = 4096


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """A request of the block resource, parsed and authorized: what the serving functions take."""

    method: str  # GET, HEAD or PUT
    principal: Principal
    compat: bytes
    scope_id: bytes
    key: bytes
    query: bytes  # the raw query string (its parameters are checked by the operation)


class BlockResource:
    """ASGI: ``blocks/{compat}/{scope}/{block_key}`` below *base_path*, the one serving path of a holder's (or an
    instance's) block resource; every other request goes to *app*.

    Each request is parsed and authorized once, here (:meth:`request`: the identity as
    :class:`kvsp_http.authz.Authorization` checks it, the roles of the *rules* that cover the block path, then the
    path's identifiers), answered by :func:`serve_block_get` / :func:`serve_block_put`, and a refusal or an error
    rendered by :func:`kvsp_http.problem_response.problem_parts` (``Retry-After`` included): on every transport
    through ASGI, and for a keep-alive HTTP/1.1 GET of a whole block held in memory through the server's
    ``respond_now`` hook (:meth:`respond_now`, :mod:`http3.immediate`), with the same answers. No router, no scope
    copy; transferred octets are counted once per request (*transfer*)."""

    def __init__(self, app: ASGIApp, holder: ServedHolder, policy: Policy, rules: Sequence[Rule], base_path: str,
                 transfer: TransferMetrics | None = None) -> None:
        self.app = app
        self.holder = holder
        self.policy = policy
        self.root = base_path.rstrip("/")
        self.prefix = self.root + "/blocks/"
        self.allowed: dict[str, frozenset[Role] | None] = {}  # method -> roles (None: any principal)
        for method in ("GET", "HEAD", "PUT"):
            rule = next((r for r in rules if r.match(method, "blocks/c/s/k") is not None), None)
            if rule is not None:
                self.allowed[method] = rule.allowed
        self._transfer = transfer
        self._counters: dict[tuple[str, str], Any] = {}

    def request(self, method: str, path: str, query: bytes, scope: Scope) -> BlockRequest:
        """The request of *method* on *path* (below :attr:`prefix`) parsed and authorized, else raise its Problem."""
        principal = authenticate(self.policy, scope)
        parts = path[len(self.prefix):].split("/")
        if method not in self.allowed or len(parts) != 3 or not all(parts):
            raise no_such_resource(method, path[len(self.root) + 1:])
        roles = self.allowed[method]
        if roles is not None and principal.roles.isdisjoint(roles):
            require_role(principal, *roles)  # raises the 403, worded as the middleware words it
        compat, scope_id, key = _block_ids((parts[0], parts[1], parts[2]))
        return BlockRequest(method, principal, compat, scope_id, key, query)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            request = self.request(scope["method"], scope["path"], scope.get("query_string", b""), scope)
            if request.method == "PUT":
                received, out = await serve_block_put(self.holder, request, scope, receive, tracking_send)
                self._count(scope, "in", received)
            else:
                out = await serve_block_get(self.holder, request, tracking_send)
            self._count(scope, "out", out)
        except Problem as problem:
            if started:
                raise
            await send_problem(send, problem)
        except Exception:
            if started:
                raise
            await send_problem(send, Problem(INTERNAL_ERROR_DETAIL, status=500))
            raise  # the server logs it

    def respond_now(self, method: str, path: str, query: bytes, scope: Scope) -> Immediate | None:
        """The HTTP/1.1 server's hook (:mod:`http3.immediate`): a GET of a whole block of at most
        :data:`~http3.immediate.IMMEDIATE_MAX` octets answered at once from the stored buffer, or its refusal, with
        the answer :meth:`__call__` gives, octet for octet. Anything else -- a layer range or codec, a larger block,
        a block not held in memory -- is None: the ASGI path serves it."""
        if method != "GET" or query or not path.startswith(self.prefix):
            return None
        try:
            request = self.request(method, path, query, scope)
            size = self.holder.served_size(request.compat, request.scope_id, request.key)
            if size is None or size > IMMEDIATE_MAX:
                return None
            fetched = self.holder.fetch(request.principal, request.compat, request.scope_id, request.key)
        except Problem as problem:
            return _immediate_problem(problem)
        except Exception:
            log.exception("the holder failed to serve GET %s", path)
            return _immediate_problem(Problem(INTERNAL_ERROR_DETAIL, status=500))
        whole = fetched.container.whole
        self._count(scope, "out", fetched.size)
        return Immediate(200, _block_head(fetched),
                         (whole,) if whole is not None else tuple(fetched.container.chunks()))

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


def _immediate_problem(problem: Problem) -> Immediate:
    status, headers, body = problem_parts(problem)
    return Immediate(status, headers, (body,))


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
    """The starlette app of the holder's lease resources, without authorization (see :func:`holder_app`; the block
    resource is :class:`BlockResource`, in front of it)."""

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
        Route("/leases", post_lease, methods=["POST"]),
        Route("/leases/{lease_id}", put_lease, methods=["PUT"]),
        Route("/leases/{lease_id}", delete_lease, methods=["DELETE"]),
    ])
    install(app)
    return app


def holder_app(holder: ServedHolder, policy: Policy, *, base_path: str | None = None,
               max_json_bytes: int = MAX_JSON_BYTES, metrics: Registry | None = None) -> ASGIApp:
    """The holder's ASGI app: authorization by certificate identity and :data:`RULES`, served below *base_path*
    (default: the path of the holder's base URI, e.g. ``"/kvsp/"``): the block resource (:class:`BlockResource`)
    in front of the lease routes. With *metrics*, ``GET metrics`` (any principal) serves it, with the holder's
    counters and the body octets it moved by transport."""
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
    return BlockResource(app, holder, policy, RULES, path, transfer)
