from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp_http import problem_response
from kvsp_quic.problems import LeaseQuota, Problem, problem_from_json
from tests.asgi import Sent, call, http_scope


def assert_problem_headers(sent: Sent) -> None:
    assert sent.headers["content-type"] == "application/problem+json"
    assert sent.headers["cache-control"] == "no-store"
    assert int(sent.headers["content-length"]) == len(sent.body)


async def test_send_problem_raw_asgi() -> None:
    messages: list[Any] = []

    async def send(message: Any) -> None:
        messages.append(message)

    await problem_response.send_problem(send, LeaseQuota("2 GiB leased"), [("Retry-After", "5"), (b"x-a", b"b")])
    sent = Sent(messages)
    assert sent.status == 429
    assert_problem_headers(sent)
    assert sent.headers["retry-after"] == "5" and sent.headers["x-a"] == "b"
    assert messages[1]["more_body"] is False
    assert isinstance(problem_from_json(429, sent.body), LeaseQuota)
    assert sent.json() == {"type": "https://iana.org/assignments/kvsp#kvsp-lease-quota",
                           "title": "Lease quota exceeded", "status": 429, "detail": "2 GiB leased"}


def make_app() -> Starlette:
    async def quota(request: Request) -> Response:
        raise LeaseQuota("too many leases")

    async def teapot(request: Request) -> Response:
        raise HTTPException(418, "short and stout", headers={"X-Kettle": "1"})

    async def not_modified(request: Request) -> Response:
        raise HTTPException(304)

    async def boom(request: Request) -> Response:
        raise RuntimeError("secret internals /etc/kvsp/key")

    app = Starlette(routes=[Route("/quota", quota, methods=["POST"]), Route("/teapot", teapot),
                            Route("/nm", not_modified), Route("/boom", boom)])
    problem_response.install(app)
    return app


async def test_problem_from_a_handler() -> None:
    sent = await call(make_app(), http_scope("POST", "/quota"))
    assert sent.status == 429
    assert_problem_headers(sent)
    assert sent.json()["detail"] == "too many leases"


async def test_router_errors_are_problems() -> None:
    app = make_app()
    sent = await call(app, http_scope("GET", "/nowhere"))
    assert sent.status == 404
    assert_problem_headers(sent)
    assert sent.json() == {"type": "about:blank", "title": "Not Found", "status": 404}
    sent = await call(app, http_scope("GET", "/quota"))
    assert sent.status == 405 and sent.headers["allow"] == "POST"
    assert_problem_headers(sent)


async def test_http_exception_keeps_detail_and_headers() -> None:
    app = make_app()
    sent = await call(app, http_scope("GET", "/teapot"))
    assert sent.status == 418 and sent.headers["x-kettle"] == "1"
    assert_problem_headers(sent)
    assert sent.json() == {"type": "about:blank", "title": "I'm a Teapot", "status": 418, "detail": "short and stout"}
    sent = await call(app, http_scope("GET", "/nm"))
    assert sent.status == 304 and sent.body == b""


async def test_unexpected_exception_is_a_500_without_internals() -> None:
    messages: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        messages.append(message)

    with pytest.raises(RuntimeError):  # starlette re-raises after responding, so that the server logs it
        await make_app()(http_scope("GET", "/boom"), receive, send)
    sent = Sent(messages)
    assert sent.status == 500
    assert_problem_headers(sent)
    assert sent.json() == {"type": "about:blank", "title": "Internal Server Error", "status": 500,
                           "detail": problem_response.INTERNAL_ERROR_DETAIL}
    assert b"secret" not in sent.body and b"RuntimeError" not in sent.body


async def test_handlers_given_another_exception_answer_500() -> None:
    request = Request(http_scope("GET", "/"))
    for handler in (problem_response.problem_handler, problem_response.http_exception_handler):
        response = await handler(request, ValueError("x"))
        assert response.status_code == 500 and json.loads(bytes(response.body))["status"] == 500
    response = await problem_response.problem_handler(request, Problem("odd", status=599))
    assert response.status_code == 599 and json.loads(bytes(response.body))["title"] == "Error"


async def test_every_problem_answer_honours_retry_after() -> None:
    """Issue 25 point 3: a problem's retry_after_s is its Retry-After on every path -- the raw ASGI answer (the
    middlewares, the block resource), the immediate HTTP/1.1 answer (problem_parts) and starlette's handlers --
    and a Retry-After the caller names wins."""
    problem = LeaseQuota("at the quota", retry_after_s=7)
    status, headers, body = problem_response.problem_parts(problem)
    assert status == 429 and dict(headers)[b"retry-after"] == b"7"
    assert [name for name, _ in headers].count(b"retry-after") == 1
    _, named, _ = problem_response.problem_parts(problem, [("Retry-After", "3")])
    assert [v for n, v in named if n == b"retry-after"] == [b"3"]
    messages: list[Any] = []

    async def send(message: Any) -> None:
        messages.append(message)

    await problem_response.send_problem(send, problem)
    assert Sent(messages).headers["retry-after"] == "7"
    response = problem_response.problem_response(problem)
    assert response.status_code == 429 and response.headers["retry-after"] == "7"
    assert response.headers["content-type"] == "application/problem+json"
    assert int(response.headers["content-length"]) == len(response.body) == len(body)
    assert problem_response.problem_parts(Problem("no hint", status=503))[1] == problem_response.problem_parts(
        Problem("no hint", status=503), [])[1]
    assert b"retry-after" not in dict(problem_response.problem_parts(Problem("no hint", status=503))[1])
