"""Who may use the front end: a policy-listed client certificate *or* ``Authorization: Bearer KEY``, and per-principal
limits.

The front end's listener asks for a client certificate but does not require one
(``TransportSettings.client_cert_optional``). :class:`ApiAuthentication` decides for every request:

1. a verified client certificate whose identity is in the policy authenticates the request (as for every KVSP role);
2. otherwise ``Authorization: Bearer KEY``: the policy maps the SHA-256 of the key to a principal
   (:meth:`kvsp_quic.auth.Policy.by_api_key`); a key the policy does not list is 401;
3. neither: 401 (403 when a certificate was verified but its identity is not in the policy).

The principal needs the ``client`` role and the scope of the front end's sessions (403). ``GET /health`` and
``GET /version`` are open. Errors are OpenAI's shape (:mod:`kvsp_frontend.errors`).

:class:`PrincipalLimits` holds each principal's ``max_concurrent`` requests in flight and ``tokens_per_minute``
(prompt + completion tokens in the last 60 s; a request is admitted while the principal has used fewer): beyond
either, 429 with ``Retry-After``. The app charges tokens with :func:`charge` as it delivers them.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from http3.asgi_types import ASGIApp, Receive, Scope, Send
from kvsp_frontend.errors import RateLimited, Unauthenticated, send_error
from kvsp_http.authz import PRINCIPAL_KEY, route_path
from kvsp_quic.auth import ALL, Policy, Principal, Role, api_key_hash, new_api_key, require_role, require_scope
from kvsp_quic.problems import Forbidden, Problem
from quic.tls import scope_identity

TICKET_KEY = "kvsp.ticket"
WINDOW_S = 60.0
OPEN_PATHS = frozenset({"health", "version"})  # GET without authentication (load balancers, probes)
LIMITED_PATHS = frozenset({"v1/completions", "v1/chat/completions"})  # what counts against the limits


@dataclass
class _Usage:
    in_flight: int = 0
    tokens: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    total: int = 0  # the sum of ``tokens``

    def prune(self, now: float) -> None:
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.total -= self.tokens.popleft()[1]


@dataclass
class Ticket:
    """One admitted request of a principal: tokens are charged to it, and it is released once."""

    limits: PrincipalLimits
    principal: Principal
    charged: int = 0
    released: bool = False

    def charge(self, tokens: int) -> None:
        if tokens > 0:
            self.charged += tokens
            self.limits.charge(self.principal, tokens)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limits.release(self.principal)


class PrincipalLimits:
    """Requests in flight and tokens per sliding minute of each principal (no I/O; *clock* in seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._usage: dict[str, _Usage] = {}

    def admit(self, principal: Principal) -> Ticket:
        """A ticket for one more request, or :class:`RateLimited` (429) with the seconds to wait."""
        usage = self._usage.setdefault(principal.identity, _Usage())
        now = self.clock()
        usage.prune(now)
        if principal.max_concurrent is not None and usage.in_flight >= principal.max_concurrent:
            raise RateLimited(f"{principal.identity!r} has {usage.in_flight} requests in flight, its limit "
                              f"(max_concurrent {principal.max_concurrent})", 1, code="concurrency_limit_exceeded")
        limit = principal.tokens_per_minute
        if limit is not None and usage.total >= limit:
            excess, wait = usage.total - limit, 1.0
            for t, n in usage.tokens:  # the window must drop more than the excess before there is room
                excess -= n
                if excess < 0:
                    wait = t + WINDOW_S - now
                    break
            raise RateLimited(f"{principal.identity!r} used {usage.total} tokens in the last minute, its limit "
                              f"(tokens_per_minute {limit})", max(wait, 1.0), code="tokens_per_minute_exceeded")
        usage.in_flight += 1
        return Ticket(self, principal)

    def charge(self, principal: Principal, tokens: int) -> None:
        if principal.tokens_per_minute is None:
            return
        usage = self._usage.setdefault(principal.identity, _Usage())
        usage.tokens.append((self.clock(), tokens))
        usage.total += tokens

    def release(self, principal: Principal) -> None:
        usage = self._usage.get(principal.identity)
        if usage is not None:
            usage.in_flight -= 1
            usage.prune(self.clock())
            if not usage.in_flight and not usage.tokens:
                del self._usage[principal.identity]

    def in_flight(self, principal: Principal) -> int:
        usage = self._usage.get(principal.identity)
        return usage.in_flight if usage else 0


def bearer_key(scope: Mapping[str, Any]) -> str | None:
    """The key of ``Authorization: Bearer KEY`` (None when absent or another scheme)."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            text: str = value.decode("latin-1")
            scheme, _, key = text.strip().partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                return key.strip()
            return None
    return None


def ticket_of(scope: Mapping[str, Any]) -> Ticket | None:
    """The request's ticket (None for a request that does not count against the limits)."""
    ticket = (scope.get("state") or {}).get(TICKET_KEY)
    return ticket if isinstance(ticket, Ticket) else None


def charge(scope: Mapping[str, Any], tokens: int) -> None:
    """Charge *tokens* to the principal of the request (a starlette ``Request`` is a mapping of its scope)."""
    ticket = ticket_of(scope)
    if ticket is not None:
        ticket.charge(tokens)


class ApiAuthentication:
    """ASGI middleware: certificate or API key, role and scope, limits (see the module docstring)."""

    def __init__(self, app: ASGIApp, policy: Policy, scope_id: bytes, limits: PrincipalLimits | None = None) -> None:
        self.app = app
        self.policy = policy
        self.scope_id = scope_id
        self.limits = limits or PrincipalLimits()

    def authenticate(self, scope: Mapping[str, Any]) -> Principal:
        try:
            identity = scope_identity(scope)
        except ValueError:
            identity = None
        principal = self.policy.principal(identity)
        if principal is None:
            key = bearer_key(scope)
            if key is not None:
                principal = self.policy.by_api_key(key)
                if principal is None:
                    raise Unauthenticated("Incorrect API key provided")
            elif identity is not None:
                raise Forbidden(f"identity {identity!r} is not in the authorization policy; send an API key")
            else:
                raise Unauthenticated("You didn't provide an API key: send 'Authorization: Bearer KEY' (or a "
                                      "client certificate the policy lists)", code="missing_api_key")
        require_role(principal, Role.CLIENT)
        require_scope(principal, self.scope_id)
        return principal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self.app(scope, receive, send)
            elif scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        path = route_path(scope)
        if path in OPEN_PATHS and scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        ticket: Ticket | None = None
        try:
            principal = self.authenticate(scope)
            if path in LIMITED_PATHS:
                ticket = self.limits.admit(principal)
        except Problem as problem:
            await send_error(send, problem)
            return
        state = dict(scope.get("state") or {})
        state[PRINCIPAL_KEY] = principal
        if ticket is not None:
            state[TICKET_KEY] = ticket
        scope = dict(scope)
        scope["state"] = state
        try:
            await self.app(scope, receive, send)
        finally:
            if ticket is not None:
                ticket.release()


DEV_API_KEY_FILE = "api.key"
DEV_KEY_IDENTITY = "urn:kvsp:dev:api-key"


def dev_api_key(directory: str | os.PathLike[str]) -> str:
    """``--dev DIR``'s API key: DIR/api.key, created with mode 0600 (never readable by others, not even for an
    instant) when it does not exist, else read."""
    path = Path(directory) / DEV_API_KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_text(encoding="ascii").strip()
        if not key:
            raise ValueError(f"{os.fspath(path)!r} is empty: remove it to have a new key made") from None
        return key
    key = new_api_key()
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(key + "\n")
    return key


def with_dev_key(policy: Policy, key: str) -> Policy:
    """*policy* and the ``--dev`` key's principal: the client role, every scope."""
    return policy.with_principal(Principal(DEV_KEY_IDENTITY, frozenset({Role.CLIENT}), ALL,
                                           api_keys=frozenset({api_key_hash(key)})))
