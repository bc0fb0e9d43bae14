"""The relay's HTTP side (same port as its MOQT, TCP and HTTP/3): ``GET status`` (its counters as JSON) and
``GET metrics`` (Prometheus), for any principal of the policy, like every role's app."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.app_kit import kvsp_json, role_app
from http3.asgi_types import ASGIApp
from http3.authz import ANY_ROLE, Rule
from http3.metrics_app import mount_metrics
from http3.problem_response import install
from kvsp_quic.auth import Policy
from kvsp_quic.metrics import Registry
from moqt.aio.audit import AUDIT, SessionAudit

RULES = (Rule("GET", "status", ANY_ROLE),)


class RelayStatus(Protocol):
    """What the app reads of the relay (:class:`moqt.relay.Relay`): its counters as a JSON object."""

    def status(self) -> dict[str, Any]: ...


def _flat(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield prefix, float(value)
    elif isinstance(value, dict):
        for key, inner in value.items():
            yield from _flat(f"{prefix}_{key}" if prefix else str(key), inner)


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


def relay_app(relay: RelayStatus, policy: Policy, *, base_path: str = "/") -> ASGIApp:
    registry = Registry()
    gauge = registry.gauge("kvsp_relay", "The relay's counters (connections, cache, fetches, ...)", ("counter",))
    gauge.collect(lambda: [({"counter": name}, value) for name, value in _flat("", relay.status())])
    audit_metrics(registry)

    async def status(request: Request) -> Response:
        return kvsp_json(relay.status())

    app = Starlette(routes=[Route("/status", status, methods=["GET"])])
    install(app)
    return role_app(app, policy, mount_metrics(app, registry, RULES), base_path)
