"""Authorization of every request by the authenticated identity: one plain ASGI middleware.

:class:`Authorization` wraps any ASGI app (starlette or not) and decides before the app sees a request:

1. the identity is the single SAN URI of the verified client certificate (:func:`quic.tls.scope_identity`); a
   request without one, or whose identity is not in the policy, gets 403 (``about:blank``);
2. the first :class:`Rule` whose method and path pattern match decides: a principal that has none of the rule's
   roles gets 403 (:class:`~kvsp_quic.problems.Forbidden`); a request that matches no rule gets 404 -- deny by
   default, so a route added to an app without a rule is unreachable;
3. otherwise the app is called with the :class:`~kvsp_quic.auth.Principal` in ``scope["state"]["kvsp.principal"]``
   (read it with :func:`principal_of`). Scope checks happen in the handlers, which know where the scope_id is
   (path or body), with :func:`kvsp_quic.auth.require_scope`.

A :class:`~kvsp_quic.problems.Problem` that escapes the app before the response started is rendered too, so a raw
ASGI app may raise one; starlette apps render their own with :func:`kvsp_http.problem_response.install`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from http3.asgi_types import ASGIApp, Message, Receive, Scope, Send
from kvsp_http.problem_response import send_problem
from kvsp_quic.auth import Policy, Principal, Role, parse_roles, require_role
from kvsp_quic.problems import Forbidden, NoSuchResource, Problem
from quic.tls import scope_identity

PRINCIPAL_KEY = "kvsp.principal"
ANY_ROLE = "*"  # Rule roles: any principal of the policy
_PARAM_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_METHOD_RE = re.compile(r"[A-Z]+|\*")


@dataclass(frozen=True)
class Rule:
    """``Rule("GET", "replicas/{holder_id}/{block_key}", ["client", "instance"])``.

    *path* is relative to the app's root (no leading ``/``) and is matched segment by segment: a literal segment
    matches itself, ``{name}`` and ``*`` match one non-empty segment, and a final ``**`` matches the rest (zero or
    more segments). *method* is an HTTP method or ``*``; a ``GET`` rule also covers ``HEAD``. *roles* lists the
    roles of which the principal needs at least one, or is ``"*"`` for any principal of the policy.
    """

    method: str
    path: str
    roles: Iterable[Role | str] | str
    allowed: frozenset[Role] | None = field(init=False, repr=False)  # None: any principal
    segments: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        method = self.method.upper()
        if not _METHOD_RE.fullmatch(method):
            raise ValueError(f"rule {self.path!r}: bad method {self.method!r}")
        path = self.path.removeprefix("/")
        segments = tuple(path.split("/"))
        for i, seg in enumerate(segments):
            if seg == "**" and i != len(segments) - 1:
                raise ValueError(f"rule {self.path!r}: '**' must be the last segment")
            if seg not in ("*", "**") and not _PARAM_RE.fullmatch(seg) and any(c in seg for c in "{}*"):
                raise ValueError(f"rule {self.path!r}: segment {seg!r} mixes a pattern with literal text")
        allowed: frozenset[Role] | None
        if self.roles == ANY_ROLE:
            allowed = None
        else:
            names = [self.roles] if isinstance(self.roles, str) else list(self.roles)
            try:
                allowed = frozenset(parse_roles(names))
            except ValueError as exc:
                raise ValueError(f"rule {self.path!r}: {exc} (or {ANY_ROLE!r} for any principal)") from None
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "roles", ANY_ROLE if allowed is None else tuple(r for r in Role if r in allowed))
        object.__setattr__(self, "allowed", allowed)
        object.__setattr__(self, "segments", segments)

    def match(self, method: str, path: str) -> dict[str, str] | None:
        """The path parameters when this rule covers *method* on *path* (relative, no leading /), else None."""
        if self.method != "*" and method != self.method and not (method == "HEAD" and self.method == "GET"):
            return None
        parts = path.split("/")
        params: dict[str, str] = {}
        for i, seg in enumerate(self.segments):
            if seg == "**":
                return params
            if i >= len(parts):
                return None
            part = parts[i]
            if seg == "*" or seg.startswith("{"):
                if not part:
                    return None
                if seg != "*":
                    params[seg[1:-1]] = part
            elif seg != part:
                return None
        return params if len(parts) == len(self.segments) else None


class Authorization:
    """ASGI middleware: authenticate by certificate identity, authorize by *rules*, deny by default."""

    def __init__(self, app: ASGIApp, policy: Policy, rules: Sequence[Rule]) -> None:
        self.app = app
        self.policy = policy
        self.rules = tuple(rules)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self.app(scope, receive, send)
            return
        if kind != "http":  # no other protocol is served; refuse (a websocket handshake gets 403)
            if kind == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        try:
            principal = self.authorize(scope)
        except Problem as problem:
            await send_problem(send, problem)
            return
        scope = dict(scope)
        state = dict(scope.get("state") or {})
        state[PRINCIPAL_KEY] = principal
        scope["state"] = state
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Problem as problem:  # a raw ASGI app raised one; starlette apps render their own
            if started:
                raise
            await send_problem(send, problem)

    def authorize(self, scope: Mapping[str, Any]) -> Principal:
        """The principal of the request if the policy and the rules allow it, else raise the Problem to send."""
        principal = authenticate(self.policy, scope)
        method = scope["method"]
        path = route_path(scope)
        for rule in self.rules:
            if rule.match(method, path) is not None:
                if rule.allowed is not None:
                    require_role(principal, *rule.allowed)
                return principal
        raise no_such_resource(method, path)


def authenticate(policy: Policy, scope: Mapping[str, Any]) -> Principal:
    """The principal of the request's verified client certificate, else raise the 403 to send."""
    try:
        identity = scope_identity(scope)  # quic.tls caches the parse of each certificate
    except ValueError:  # a chain the server passed but we cannot parse
        identity = None
    if identity is None:
        raise Forbidden("the request carries no verified client certificate with a single SAN URI")
    principal = policy.principal(identity)
    if principal is None:
        raise Forbidden(f"identity {identity!r} is not in the authorization policy")
    return principal


def no_such_resource(method: str, path: str) -> NoSuchResource:
    """The 404 of a request no rule covers (*path* relative to the app's root, without the leading ``/``)."""
    return NoSuchResource(f"no resource {'/' + path!r} for {method}")


def route_path(scope: Mapping[str, Any]) -> str:
    """The request path relative to the app's root (``root_path`` removed), without the leading ``/``."""
    path: str = scope["path"]
    root = scope.get("root_path") or ""
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        path = path[len(root):]
    return path.removeprefix("/")


def principal_of(scope: Mapping[str, Any]) -> Principal:
    """The principal the middleware authorized; *scope* may be a starlette ``Request`` (a mapping of its scope).

    Raises ``RuntimeError`` (a server error) when the app runs without :class:`Authorization`.
    """
    principal = (scope.get("state") or {}).get(PRINCIPAL_KEY)
    if not isinstance(principal, Principal):
        raise RuntimeError("no authorized principal in the request: the app must run inside kvsp_http.authz")
    return principal
