"""The one place where exceptions become ``application/problem+json`` responses (RFC 9457).

* :func:`send_problem` answers a raw ASGI request with a :class:`~kvsp_quic.problems.Problem` (used by
  middleware such as :mod:`kvsp_http.authz`, which runs before any framework);
* :func:`install` registers handlers on a starlette application so that a ``Problem`` raised by a handler,
  starlette's own ``HTTPException`` (404 from the router, 405 with ``Allow``), a store that cannot be reached
  (Redis down: 503 with ``Retry-After``, one warning line, no traceback) and any unexpected exception (500,
  without internals) are rendered the same way.

Every problem response carries ``Content-Type: application/problem+json`` and ``Cache-Control: no-store``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from http import HTTPStatus

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from http3.asgi_types import Send
from kvsp_quic.problems import PROBLEM_MEDIA_TYPE, Problem, to_problem_json

HeaderItems = Iterable[tuple[str | bytes, str | bytes]]

log = logging.getLogger("kvsp.http")

INTERNAL_ERROR_DETAIL = "the server failed to complete the request"
STORE_RETRY_AFTER_S = 1
_BASE_HEADERS = ((b"content-type", PROBLEM_MEDIA_TYPE.encode("ascii")), (b"cache-control", b"no-store"))


def _raw(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")


def problem_parts(problem: Problem, headers: HeaderItems = ()) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, raw headers and body of *problem* as a complete response; *headers* are added, and ``Retry-After``
    of the problem's ``retry_after_s`` unless *headers* name one. Every problem answer is made here."""
    status, body = to_problem_json(problem)
    raw_headers = [*_BASE_HEADERS, (b"content-length", str(len(body)).encode("ascii"))]
    extra = [(_raw(name).lower(), _raw(value)) for name, value in headers]
    if problem.retry_after_s is not None and not any(name == b"retry-after" for name, _ in extra):
        raw_headers.append((b"retry-after", str(problem.retry_after_s).encode("ascii")))
    return status, raw_headers + extra, body


async def send_problem(send: Send, problem: Problem, headers: HeaderItems = ()) -> None:
    """Send *problem* as the complete response of a raw ASGI ``http`` request; *headers* are added."""
    status, raw_headers, body = problem_parts(problem, headers)
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def problem_response(problem: Problem, headers: HeaderItems = ()) -> Response:
    """:func:`problem_parts` as a starlette response."""
    status, raw_headers, body = problem_parts(problem, headers)
    response = Response(body, status_code=status)
    response.raw_headers = raw_headers
    return response


async def problem_handler(request: Request, exc: Exception) -> Response:
    """starlette exception handler for :class:`Problem`."""
    if not isinstance(exc, Problem):  # registered for Problem only; anything else is a server error
        return await internal_error_handler(request, exc)
    return problem_response(exc)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """starlette's ``HTTPException`` (router 404/405, or raised by a handler) as an ``about:blank`` problem."""
    if not isinstance(exc, HTTPException):
        return await internal_error_handler(request, exc)
    headers = list((exc.headers or {}).items())
    if exc.status_code < 400:  # not an error (e.g. 304): no body
        return Response(status_code=exc.status_code, headers=dict(headers))
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = ""
    detail = "" if exc.detail in (None, phrase) else str(exc.detail)
    return problem_response(Problem(detail, status=exc.status_code), headers)


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    """Any unexpected exception: 500 with a fixed detail. starlette re-raises the exception afterwards, so
    the server still logs it with its traceback; nothing of it reaches the peer."""
    return problem_response(Problem(INTERNAL_ERROR_DETAIL, status=500))


async def store_unavailable_handler(request: Request, exc: Exception) -> Response:
    """The shared store (Redis) did not answer: the request may succeed later, here or at another replica."""
    log.warning("%s %s: the store is unreachable: %s", request.method, request.url.path, exc)
    return problem_response(Problem("the service's store is unreachable; try again", status=503),
                            [("retry-after", str(STORE_RETRY_AFTER_S))])


def _store_errors() -> tuple[type[Exception], ...]:
    try:  # redis is an optional dependency (the [redis] extra)
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
    except ImportError:
        return ()
    return (RedisConnectionError, RedisTimeoutError)


def install(app: Starlette) -> None:
    """Render every error of *app* as problem+json (call once, when the app is built)."""
    app.add_exception_handler(Problem, problem_handler)
    app.add_exception_handler(HTTPException, http_exception_handler)
    for error in _store_errors():
        app.add_exception_handler(error, store_unavailable_handler)
    app.add_exception_handler(Exception, internal_error_handler)
