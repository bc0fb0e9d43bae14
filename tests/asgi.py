"""ASGI helpers of the tests: drive an app directly with a hand-built scope and collect what it sends (no server,
no sockets), and :class:`Router`, several role apps below their base paths on one test server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from quic.tls import tls_extension

Message = MutableMapping[str, Any]
App = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
               Awaitable[None]]


@dataclass
class Sent:
    messages: list[Message] = field(default_factory=list)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode("latin-1"): v.decode("latin-1") for k, v in self.messages[0]["headers"]}

    def header_list(self, name: str) -> list[str]:
        return [v.decode("latin-1") for k, v in self.messages[0]["headers"] if k.decode("latin-1").lower() == name]

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:] if m["type"] == "http.response.body")

    def json(self) -> Any:
        return json.loads(self.body)


def tls_for(pem: str | None) -> dict[str, Any]:
    """The ASGI TLS extension as the servers build it, for a client certificate given as PEM text."""
    ext = tls_extension([], server_cert_pem=None, tls_version=0x0304, cipher_suite=0x1301)
    if pem is not None:
        ext["client_cert_chain"] = [pem]
    return ext


def http_scope(method: str = "GET", path: str = "/", *, pem: str | None = None, tls: bool = True,
               root_path: str = "", query: bytes = b"", state: dict[str, Any] | None = None) -> dict[str, Any]:
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "2",
        "method": method, "scheme": "https", "path": root_path + path, "raw_path": (root_path + path).encode(),
        "query_string": query, "root_path": root_path, "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 443), "extensions": {},
    }
    if tls:
        scope["extensions"]["tls"] = tls_for(pem)
    if state is not None:
        scope["state"] = state
    return scope


async def read_body(receive: Callable[[], Awaitable[Message]]) -> bytes:
    """The whole request body, as an app under test reads it from *receive*."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def call(app: App, scope: MutableMapping[str, Any], body: bytes = b"") -> Sent:
    sent = Sent()
    requests = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        return requests.pop(0) if requests else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.messages.append(message)

    await app(scope, receive, send)
    return sent


class Router:
    """Serves several role apps below their base paths (``apps["/is/"]``, ``apps["/h1/"]``, ...) on one server and
    answers the lifespan itself; a path under no base path gets 404. It logs every request, counts block GETs (in
    all and concurrent per base path) and can slow them down by *block_delay* seconds, and lookups (``POST
    .../lookup``) by *lookup_delay* seconds."""

    def __init__(self) -> None:
        self.apps: dict[str, Any] = {}
        self.log: list[tuple[str, str, str]] = []  # (method, path, query)
        self.block_gets = 0
        self.block_delay = 0.0
        self.lookup_delay = 0.0
        self.inflight: dict[str, int] = {}  # block GETs in progress, by base path
        self.max_inflight: dict[str, int] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        prefix = "/" + path.split("/")[1] + "/"
        app = self.apps.get(prefix)
        self.log.append((scope["method"], path, scope["query_string"].decode()))
        if app is None:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        block_get = scope["method"] == "GET" and "/blocks/" in path
        if block_get:
            self.block_gets += 1
            self.inflight[prefix] = self.inflight.get(prefix, 0) + 1
            self.max_inflight[prefix] = max(self.max_inflight.get(prefix, 0), self.inflight[prefix])
        try:
            if block_get and self.block_delay:
                await asyncio.sleep(self.block_delay)
            if self.lookup_delay and scope["method"] == "POST" and path.endswith("/lookup"):
                await asyncio.sleep(self.lookup_delay)
            await app(scope, receive, send)
        finally:
            if block_get:
                self.inflight[prefix] -= 1

    def requests(self, prefix: str) -> list[tuple[str, str, str]]:
        """The logged requests below the base path *prefix*."""
        return [entry for entry in self.log if entry[1].startswith(prefix)]
