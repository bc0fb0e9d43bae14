"""What every role's HTTP app shares: the media types, JSON responses with ``Cache-Control: no-store``, bounded
JSON request bodies, and serving an app below its base path behind the authorization middleware.

    app = Starlette(routes=[...]); install(app)           # kvsp_http.problem_response: problems -> problem+json
    asgi = role_app(app, policy, RULES, "/kvsp/")          # 404 outside /kvsp/, authorization inside
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from http3.asgi_types import ASGIApp, Receive, Scope, Send
from kvsp_http.authz import Authorization, Rule
from kvsp_http.problem_response import send_problem
from kvsp_quic.auth import Policy
from kvsp_quic.problems import ContentTooLarge, NoSuchResource, UnsupportedMediaType

JSON_MEDIA_TYPE = "application/kvsp+json"
BLOCK_MEDIA_TYPE = "application/kvsp-block"
NO_STORE = {"cache-control": "no-store"}



def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON, as ``json.dumps(obj, separators=(",", ":"), ensure_ascii=False)`` writes it, by orjson
    (20-30 times faster on records); what orjson refuses (integers beyond 64 bits, non-string keys) goes through
    the standard library."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def kvsp_json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A KVSP JSON response; every non-block response carries ``Cache-Control: no-store`` (spec, HTTP Usage)."""
    return kvsp_json_body(dumps(obj), status, headers)


def kvsp_json_body(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """:func:`kvsp_json` for a body already serialized."""
    return Response(body, status_code=status, media_type=JSON_MEDIA_TYPE, headers={**NO_STORE, **(headers or {})})


def media_type(request: Request) -> str | None:
    value = request.headers.get("content-type")
    return value.split(";", 1)[0].strip().lower() if value is not None else None


def require_media_type(request: Request, wanted: str) -> None:
    got = media_type(request)
    if got != wanted:
        raise UnsupportedMediaType(f"the request body must be {wanted}, not {got or 'unlabelled'}")


def check_declared_length(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ContentTooLarge(f"the request body of {declared} octets exceeds the limit of {limit}")


async def read_body_within(request: Request, limit: int) -> bytes:
    """The request body, at most *limit* octets: a larger declared ``Content-Length`` is refused before anything is
    read, and an undeclared body (HTTP/1.1 chunks, HTTP/2 or HTTP/3 DATA frames) as soon as the octets received pass
    *limit* (413): the app stops reading there, so the transport's flow control holds the rest back."""
    check_declared_length(request, limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ContentTooLarge(f"the request body exceeds the limit of {limit} octets")
    return bytes(body)


async def read_json_body(request: Request, limit: int) -> bytes:
    """The request body, which must be ``application/kvsp+json`` and at most *limit* octets (415, 413)."""
    require_media_type(request, JSON_MEDIA_TYPE)
    return await read_body_within(request, limit)


class BasePath:
    """Serve *app* below *base_path* (the path of the role's base URI): requests elsewhere get 404; inside, the
    app sees ``root_path`` = the base path, so its routes and authorization rules are relative to the base URI."""

    def __init__(self, app: ASGIApp, base_path: str) -> None:
        if not base_path.startswith("/") or not base_path.endswith("/"):
            raise ValueError(f"a base path starts and ends with '/', got {base_path!r}")
        self.app = app
        self.root = base_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.root:
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if not path.startswith(self.root + "/"):
            await send_problem(send, NoSuchResource(f"no resource {path!r}"))
            return
        scope = dict(scope)
        scope["root_path"] = (scope.get("root_path") or "") + self.root
        await self.app(scope, receive, send)


def role_app(app: ASGIApp, policy: Policy, rules: Sequence[Rule], base_path: str = "/") -> BasePath:
    """*app* behind the authorization middleware, served below *base_path*."""
    return BasePath(Authorization(app, policy, rules), base_path)
