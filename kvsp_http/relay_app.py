"""The relay's HTTP side (same port as its MOQT, TCP and HTTP/3): ``GET status`` (its counters as JSON) and
``GET metrics`` (Prometheus), for any principal of the policy, like every role's app.

``status`` lists only the published namespaces the caller could discover over MOQT (the relay's
``rules.visible``: a KVSP namespace to a reader of its scope, an open prefix to anyone in the policy), so a
principal of one tenant learns nothing of another tenant's publishers through it (issue 13); the counters are
aggregates and stay as they are. ``metrics`` carries no namespace."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.asgi_types import ASGIApp
from kvsp_http.app_kit import kvsp_json, role_app
from kvsp_http.authz import ANY_ROLE, Rule, principal_of
from kvsp_http.metrics_app import audit_metrics, mount_metrics
from kvsp_http.problem_response import install
from kvsp_quic.auth import Policy
from kvsp_quic.metrics import Registry
from moqt.relay.namespaces import render
from moqt.types import Namespace

RULES = (Rule("GET", "status", ANY_ROLE),)


class Visibility(Protocol):
    def visible(self, identity: str | None, namespace: Namespace) -> bool: ...


class Published(Protocol):
    @property
    def namespace(self) -> Namespace: ...


class RelayStatus(Protocol):
    """What the app reads of the relay (:class:`moqt.relay.Relay`): its counters as a JSON object, its published
    namespaces and the rules that say who may see them."""

    @property
    def rules(self) -> Visibility: ...

    @property
    def announcements(self) -> list[Any]: ...

    def status(self) -> dict[str, Any]: ...


def _flat(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield prefix, float(value)
    elif isinstance(value, dict):
        for key, inner in value.items():
            yield from _flat(f"{prefix}_{key}" if prefix else str(key), inner)


def relay_app(relay: RelayStatus, policy: Policy, *, base_path: str = "/") -> ASGIApp:
    registry = Registry()
    gauge = registry.gauge("kvsp_relay", "The relay's counters (connections, cache, fetches, ...)", ("counter",))
    gauge.collect(lambda: [({"counter": name}, value) for name, value in _flat("", relay.status())])
    audit_metrics(registry)

    async def status(request: Request) -> Response:
        identity = principal_of(request).identity
        body = relay.status()
        body["namespaces"] = [render(a.namespace) for a in relay.announcements
                              if relay.rules.visible(identity, a.namespace)]
        return kvsp_json(body)

    app = Starlette(routes=[Route("/status", status, methods=["GET"])])
    install(app)
    return role_app(app, policy, mount_metrics(app, registry, RULES), base_path)
