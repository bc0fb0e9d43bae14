"""Drive an ASGI app directly with a hand-built scope and collect what it sends (no server, no sockets)."""

from __future__ import annotations

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


async def call(app: App, scope: MutableMapping[str, Any], body: bytes = b"") -> Sent:
    sent = Sent()
    requests = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        return requests.pop(0) if requests else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.messages.append(message)

    await app(scope, receive, send)
    return sent
