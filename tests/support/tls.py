"""Role identities as ``--dev`` issues them: co-located roles with certificates naming their base URIs, and an ASGI
app that counts the requests reaching it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

from http3.server import bind_pair
from kvsp_dev import pki
from quic.tls import TlsFiles

DEV_HOSTS = ["127.0.0.1", "localhost"]


class Counting:
    """An ASGI app that answers 200 and counts the requests that reached it."""

    def __init__(self) -> None:
        self.requests = 0

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        self.requests += 1
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def dev_roles(tmp_path: Path) -> AsyncIterator[tuple[dict[str, Any], TlsFiles]]:
    """Two co-located roles as ``--dev`` makes them: each binds its port, then gets a certificate naming its base
    URI (port included) and 127.0.0.1 / localhost. Yields {name: (socket pair, base URI, files)} and the client's
    files."""
    roles: dict[str, Any] = {}
    for name, path in (("holder", "/kvsp/"), ("index", "/is/")):
        pair = bind_pair("127.0.0.1", 0, 1 << 20)
        port = pair[0].getsockname()[1]
        roles[name] = (pair, f"https://127.0.0.1:{port}{path}", f"{name}-{port}")
    pki.init(tmp_path, [pki.role(n, base) for _, base, n in roles.values()] + [pki.client("dev")],
             extra_hosts=DEV_HOSTS)
    out = {name: (pair, base, TlsFiles.in_dir(tmp_path, n)) for name, (pair, base, n) in roles.items()}
    try:
        yield out, TlsFiles.in_dir(tmp_path, "dev")
    finally:
        for pair, _, _ in out.values():
            for sock in pair:
                if sock is not None:
                    sock.close()
