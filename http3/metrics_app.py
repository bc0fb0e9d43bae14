"""``GET {base}metrics`` for every role's app, and transfer byte counting by transport.

    registry = Registry()
    app = Starlette(routes=[...]); install(app)
    rules = mount_metrics(app, registry, RULES)            # adds the route and its rule (any principal)
    asgi = TransferMetrics(role_app(app, policy, rules, "/kvsp/"), registry, component="holder")

The scrape is authorized like every other request (mutual TLS, a principal of the policy) with the ``"*"`` role
rule, so any principal may read it: a Prometheus server gets a client certificate and an entry in the policy. The
answer is the text exposition format 0.0.4 (``text/plain; version=0.0.4``) with ``Cache-Control: no-store``.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.app_kit import NO_STORE
from http3.asgi_types import ASGIApp, Message, Receive, Scope, Send
from http3.authz import ANY_ROLE, Rule
from kvsp_quic.metrics import CONTENT_TYPE, KvspMetrics, Registry

METRICS_PATH = "metrics"
METRICS_RULE = Rule("GET", METRICS_PATH, ANY_ROLE)
_TRANSPORTS = {"3": "HTTP/3", "2": "HTTP/2", "1.1": "HTTP/1.1", "1.0": "HTTP/1.0"}


def metrics_route(registry: Registry) -> Route:
    async def scrape(request: Request) -> Response:
        return Response(registry.render().encode("utf-8"), headers={**NO_STORE, "content-type": CONTENT_TYPE})

    return Route("/" + METRICS_PATH, scrape, methods=["GET"])


def mount_metrics(app: Starlette, registry: Registry, rules: Sequence[Rule]) -> tuple[Rule, ...]:
    """Add ``GET metrics`` to *app*; the rules to authorize it with (*rules* plus the any-principal rule)."""
    app.router.routes.append(metrics_route(registry))
    return (*rules, METRICS_RULE)


class TransferMetrics:
    """ASGI middleware: request and response body octets into ``kvsp_transfer_bytes_total{component, transport,
    direction}`` (direction ``in`` for request bodies, ``out`` for response bodies; transport from the scope's
    ``http_version``)."""

    def __init__(self, app: ASGIApp, registry: Registry, *, component: str) -> None:
        self.app = app
        self.counter = KvspMetrics(registry).transfer_bytes
        self.component = component

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        transport = _TRANSPORTS.get(str(scope.get("http_version")), f"HTTP/{scope.get('http_version')}")
        inbound = self.counter.labels(component=self.component, transport=transport, direction="in")
        outbound = self.counter.labels(component=self.component, transport=transport, direction="out")

        async def counting_receive() -> Message:
            message = await receive()
            body = message.get("body")
            if body:
                inbound.inc(body.nbytes if isinstance(body, memoryview) else len(body))
            return message

        async def counting_send(message: Message) -> None:
            body = message.get("body")
            if body and message["type"] == "http.response.body":
                outbound.inc(body.nbytes if isinstance(body, memoryview) else len(body))
            await send(message)

        await self.app(scope, counting_receive, counting_send)


__all__ = ["METRICS_PATH", "METRICS_RULE", "TransferMetrics", "metrics_route", "mount_metrics"]
