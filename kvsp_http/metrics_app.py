"""``GET {base}metrics`` for every role's app, and transfer byte counting by transport.

    registry = Registry()
    app = Starlette(routes=[...]); install(app)
    rules = mount_metrics(app, registry, RULES)            # adds the route and its rule (any principal)
    asgi = TransferMetrics(role_app(app, policy, rules, "/kvsp/"), registry, component="holder")

The scrape is authorized like every other request (mutual TLS, a principal of the policy) with the ``"*"`` role
rule, so any principal may read it: a Prometheus server gets a client certificate and an entry in the policy. The
answer is ``prometheus_client``'s ``generate_latest``: the text exposition format 0.0.4 (``text/plain;
version=0.0.4``), or OpenMetrics 1.0.0 (``application/openmetrics-text; version=1.0.0``) when the ``Accept`` header
prefers it (:func:`negotiate`, as Prometheus does by default), with ``Cache-Control: no-store`` and ``Vary: Accept``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.asgi_types import ASGIApp, Message, Receive, Scope, Send
from kvsp_http.app_kit import NO_STORE
from kvsp_http.authz import ANY_ROLE, Rule
from kvsp_quic.metrics import CONTENT_TYPE, KvspMetrics, Registry
from moqt.aio.audit import AUDIT, SessionAudit

METRICS_PATH = "metrics"
METRICS_RULE = Rule("GET", METRICS_PATH, ANY_ROLE)
_TRANSPORTS = {"3": "HTTP/3", "2": "HTTP/2", "1.1": "HTTP/1.1", "1.0": "HTTP/1.0"}


Encoder = Callable[[CollectorRegistry], bytes]


def _quality(params: list[str]) -> float:
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "q":
            try:
                return float(value)
            except ValueError:
                return 0.0
    return 1.0


def negotiate(accept: str | None) -> tuple[Encoder, str]:
    """The exposition for an ``Accept`` header: OpenMetrics when ``application/openmetrics-text`` (any version: the
    answer is 1.0.0) has a quality above zero and no lower than the best of ``text/plain``, ``text/*`` and
    ``*/*``; else the text format 0.0.4 (also without an ``Accept`` header). Returns the encoder and its
    content type."""
    openmetrics = text = 0.0
    for item in (accept or "").split(","):
        media, *params = item.split(";")
        media = media.strip().lower()
        if media == "application/openmetrics-text":
            openmetrics = max(openmetrics, _quality(params))
        elif media in ("text/plain", "text/*", "*/*"):
            text = max(text, _quality(params))
    if openmetrics > 0 and openmetrics >= text:
        return generate_openmetrics, OPENMETRICS_CONTENT_TYPE
    return generate_latest, CONTENT_TYPE


def metrics_route(registry: Registry) -> Route:
    async def scrape(request: Request) -> Response:
        encode, content_type = negotiate(request.headers.get("accept"))
        return Response(encode(registry), headers={**NO_STORE, "content-type": content_type, "vary": "Accept"})

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


__all__ = [
    "METRICS_PATH", "METRICS_RULE", "OPENMETRICS_CONTENT_TYPE", "TransferMetrics", "metrics_route", "mount_metrics",
    "negotiate",
]


def audit_metrics(registry: Registry, audit: SessionAudit = AUDIT) -> None:
    """The process's MOQT session closes and refused handshakes by reason (moqt/aio/audit.py), as counters."""
    closed = registry.counter("kvsp_moqt_sessions_closed_total",
                              "MOQT sessions ended, by who closed them, draft and reason (no_error: clean)",
                              ("by", "draft", "reason"))
    closed.collect(lambda: [({"by": by, "draft": draft, "reason": reason}, n)
                            for (by, draft, reason), n in audit.snapshot()[0].items()])
    refused = registry.counter("kvsp_moqt_handshakes_refused_total",
                               "MOQT handshakes (QUIC/TLS or SETUP) that did not become a session, by side and reason",
                               ("side", "reason"))
    refused.collect(lambda: [({"side": side, "reason": reason}, n)
                             for (side, reason), n in audit.snapshot()[1].items()])
