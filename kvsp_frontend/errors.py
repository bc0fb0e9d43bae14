"""The front end's errors in OpenAI's shape, so that OpenAI's clients show them.

Every error of the front end is ``application/json``::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null,
               "kvsp_type": "about:blank"}}

``message`` is the problem's detail (the SDK's exception text), ``type`` OpenAI's class of error by status, and
``kvsp_type`` the KVSP problem type URI (RFC 9457, docs/wire.md) kept as an extra member. 429 and 503 carry
``Retry-After`` (seconds). The KVSP roles behind the front end keep ``application/problem+json``.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from http3.asgi_bridge import ClientDisconnected
from http3.asgi_types import Send
from kvsp_quic.problems import BadRequest, NotFound, Problem, TooManyRequests, Unavailable

log = logging.getLogger("kvsp.frontend")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}
DEFAULT_RETRY_AFTER = 1


class InvalidParameter(BadRequest):
    """400 naming the request parameter at fault (OpenAI's ``param``)."""

    def __init__(self, param: str, detail: str, *, code: str | None = None) -> None:
        super().__init__(f"{param}: {detail}" if not detail.startswith(param) else detail)
        self.param = param
        self.code = code


class ModelNotFound(NotFound):
    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"The model {model!r} does not exist: this server serves {served!r}")
        self.param = "model"
        self.code = "model_not_found"


class Unauthenticated(Problem):
    status = 401

    def __init__(self, detail: str, *, code: str = "invalid_api_key") -> None:
        super().__init__(detail)
        self.code = code


class RateLimited(TooManyRequests):
    def __init__(self, detail: str, retry_after: float, *, code: str = "rate_limit_exceeded") -> None:
        super().__init__(detail)
        self.retry_after = retry_after
        self.code = code


class Overloaded(Unavailable):
    """503 with ``Retry-After``: no capacity now, try again."""

    def __init__(self, detail: str, retry_after: float = DEFAULT_RETRY_AFTER) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


def error_json(problem: Problem) -> dict[str, Any]:
    """``{"error": {...}}`` of *problem*."""
    status = problem.status
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": problem.detail or HTTPStatus(status).phrase, "type": kind,
                      "param": getattr(problem, "param", None), "code": getattr(problem, "code", None),
                      "kvsp_type": problem.type_uri}}


def error_headers(problem: Problem) -> dict[str, str]:
    headers = {"cache-control": "no-store"}
    if problem.status in (429, 503):
        retry = getattr(problem, "retry_after", None) or DEFAULT_RETRY_AFTER
        headers["retry-after"] = str(max(1, int(-(-float(retry) // 1))))  # whole seconds, rounded up
    if problem.status == 401:
        headers["www-authenticate"] = 'Bearer realm="kvsp-quic"'
    return headers


def error_response(problem: Problem) -> Response:
    return Response(json.dumps(error_json(problem)), status_code=problem.status, media_type="application/json",
                    headers=error_headers(problem))


async def send_error(send: Send, problem: Problem) -> None:
    """*problem* as the whole response of a raw ASGI request (middleware)."""
    body = json.dumps(error_json(problem)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error_headers(problem).items()]
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def install_errors(app: Starlette) -> None:
    """Render every error of the front end's app in OpenAI's shape."""

    async def on_problem(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, Problem):
            return await on_other(request, exc)
        return error_response(exc)

    async def on_http(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, HTTPException):
            return await on_other(request, exc)
        detail = exc.detail if exc.detail != HTTPStatus(exc.status_code).phrase else ""
        if exc.status_code == 404:
            detail = detail or f"no resource {request.method} {request.url.path}"
        response = error_response(Problem(detail, status=exc.status_code))
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    async def on_other(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientDisconnect | ClientDisconnected):  # the client went away: nobody to answer
            log.info("%s %s: the client went away", request.method, request.url.path)
            return Response(status_code=499)
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(Problem("the server failed to complete the request", status=500))

    app.add_exception_handler(Problem, on_problem)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(ClientDisconnect, on_other)
    app.add_exception_handler(ClientDisconnected, on_other)  # else the catch-all's middleware re-raises it
    app.add_exception_handler(Exception, on_other)
