"""The front end's doubles: a byte tokenizer, and a PC that places every session on one instance streaming TEXT's
octets."""

from __future__ import annotations

import json

from http3.asgi_types import Receive, Scope, Send
from kvsp_quic.roles.controller_records import SessionInfo, SessionRequest, SessionState, TokenLine
from kvsp_quic.samples import example_descriptor
from tests.asgi import read_body

DESCRIPTOR = example_descriptor()
TEXT = "é€ ok"  # two- and three-octet characters: one token per octet


class Utf8:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class OneInstance:
    """A PC that places every session on one instance, which sends TEXT's octets as tokens."""

    def __init__(self) -> None:
        self.instance = ""
        self.fail = False  # the instance fails the session before its first token

    async def pc(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = SessionRequest.loads(await read_body(receive))
        answer = SessionInfo(request.session, 1, 0, SessionState.RUNNING, self.instance)
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"application/kvsp+json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer.to_json()).encode()})

    async def tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})
        if self.fail:
            line = TokenLine(0, 1, done=True, reason="error", detail="the cache is full")
            await send({"type": "http.response.body", "body": line.encode()})
            return
        octets = TEXT.encode()
        lines = [TokenLine(i, 1, t) for i, t in enumerate(octets)] + [TokenLine(len(octets), 1, done=True,
                                                                                reason="stop")]
        await send({"type": "http.response.body", "body": b"".join(line.encode() for line in lines)})


KEY = "kvsp-carols-key"
