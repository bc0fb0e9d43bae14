"""The front end against a fake Placement Controller and fake instances over real sockets: every output index
reaches the client exactly once, through an instance failure, with duplicates and stale epochs discarded."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_frontend.app import Frontend, frontend_app
from kvsp_quic.auth import Policy
from kvsp_quic.frontend import FrontendOptions, SamplingRequest, TokenGap, TokenRelay
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.problems import BadRequest
from kvsp_quic.roles.controller_records import SessionInfo, SessionRequest, SessionState, TokenLine
from kvsp_quic.samples import example_descriptor
from tests.asgi import read_body
from tests.pki import TestPki

DESCRIPTOR = example_descriptor()
OUTPUT = [100 + i for i in range(10)]


def test_relay_rules() -> None:
    relay = TokenRelay()
    relay.new_epoch(1)
    assert [relay.offer(i, 1, t) for i, t in enumerate([5, 6, 7])] == [True, True, True]
    relay.new_epoch(2)
    assert not relay.offer(3, 1, 9)  # a stale epoch, even for the missing index
    assert not relay.offer(1, 2, 6)  # a duplicate of a delivered index
    assert relay.offer(3, 2, 8) and relay.next_index == 4
    assert (relay.stale, relay.duplicates) == (1, 1)
    with pytest.raises(TokenGap):
        relay.offer(7, 2, 1)


def test_sampling_from_openai_fields() -> None:
    assert SamplingRequest.from_openai(None, None, None, 5).method == "greedy"
    assert SamplingRequest.from_openai(0, 0.9, 3, 5).deterministic
    top_p = SamplingRequest.from_openai(0.7, 0.9, None, 5)
    assert (top_p.method, top_p.params, top_p.seed, top_p.deterministic) == ("top-p", {"p": 0.9, "temperature": 0.7},
                                                                             5, False)
    for t, p in ((3.0, None), (None, 0.0), (None, 1.5)):
        with pytest.raises(BadRequest):
            SamplingRequest.from_openai(t, p, None, 5)


class Fakes:
    """A PC and two instances. Instance 1 dies after sending 4 tokens (some may be lost with the stream); the PC
    then moves the session to instance 2 (epoch 2), which serves from the first index the front end lacks."""

    def __init__(self) -> None:
        self.instances: list[str] = []
        self.moved = False
        self.resumed_from = -1
        self.requests: list[dict[str, Any]] = []
        self.session = uuid.uuid4()

    async def pc(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_body(receive)
        if scope["method"] == "POST":
            request = SessionRequest.loads(body)
            self.requests.append(json.loads(body))
            self.session = request.session
            answer = SessionInfo(request.session, 1, 0, SessionState.RUNNING, self.instances[0])
            status = 201
        else:
            answer = SessionInfo(self.session, 2 if self.moved else 1, 0, SessionState.RUNNING,
                                 self.instances[1 if self.moved else 0])
            status = 200
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/kvsp+json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer.to_json()).encode()})

    def instance(self, number: int) -> Any:
        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            start = int(scope["query_string"].decode().split("from=")[1])
            if number == 2:
                self.resumed_from = start
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson")]})
            if number == 1:
                for i in range(start, 4):
                    await send({"type": "http.response.body", "body": TokenLine(i, 1, OUTPUT[i]).encode(),
                                "more_body": True})
                self.moved = True
                raise RuntimeError("instance 1 dies mid-stream")
            lines = [TokenLine(start, 1, 0)]  # a late token of the old epoch
            # The new instance serves from the index asked for, but one regenerated token before it slips in.
            lines += [TokenLine(i, 2, OUTPUT[i]) for i in range(max(start - 1, 0), 10)]
            lines.append(TokenLine(10, 2, done=True, reason="length"))
            body = b"".join(line.encode() for line in lines)
            await send({"type": "http.response.body", "body": body})
        return app


@pytest.fixture
async def system(fresh_certs: TestPki):
    certs = fresh_certs
    fakes = Fakes()
    servers = [RoleServer(app, certs.files("server")) for app in (fakes.pc, fakes.instance(1), fakes.instance(2))]
    for server in servers:
        await server.start("127.0.0.1", 0)
    fakes.instances = [servers[1].base_uri(), servers[2].base_uri()]
    client = KvspClient(certs.files("alice"), retries=0)
    keyer = BlockKeyer(bytes(range(32)), DESCRIPTOR.compat_id, DESCRIPTOR.block_tokens)

    class Bytes:
        def encode(self, text: str) -> list[int]:
            return list(text.encode())

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(i) for i in ids)

    frontend = Frontend(client, servers[0].base_uri(), keyer, Bytes(), "tiny",
                        options=FrontendOptions(poll_interval_ms=10))
    app = frontend_app(frontend, Policy.from_dict({"principal": [{"identity": "urn:kvsp:client:bob",
                                                                  "roles": ["client"], "scopes": "*"}]}))
    edge = RoleServer(app, certs.files("server"))
    await edge.start("127.0.0.1", 0)
    yield certs, fakes, frontend, edge
    await client.aclose()
    for server in [edge, *servers]:
        await server.close()


async def test_every_index_exactly_once_through_a_failover(system) -> None:
    certs, fakes, frontend, edge = system
    async with KvspClient(certs.files("bob"), retries=0) as user:
        r = await user.request("POST", edge.base_uri("/v1/completions"),
                               content=json.dumps({"prompt": "hello world!", "max_tokens": 10, "seed": 1,
                                                   "temperature": 0}).encode(),
                               headers={"content-type": "application/json"})
    assert r.status == 200, r.content
    answer = r.json()
    assert answer["kvsp"]["tokens"] == OUTPUT and answer["kvsp"]["epoch"] == 2
    assert answer["choices"][0]["text"] == "".join(chr(t) for t in OUTPUT)
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 10
    assert frontend.stats.failovers == 1 and frontend.stats.stale == 1
    assert frontend.stats.duplicates == (1 if fakes.resumed_from > 0 else 0)
    sent = fakes.requests[0]
    assert sent["prompt"] == list(b"hello world!") and uuid.UUID(sent["session"])
    assert sent["block_keys"] == [k.hex() for k in frontend.keyer.keys(list(b"hello world!"))]
    assert sent["sampler"]["method"] == "greedy"


async def test_streaming_server_sent_events(system) -> None:
    certs, _, _, edge = system
    from quic.tls import ssl_client_context

    ctx = ssl_client_context(certs.files("bob"), alpn=["h2"])
    async with httpx.AsyncClient(verify=ctx, http2=True) as user, user.stream(
            "POST", edge.base_uri("/v1/completions"), json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 10,
                                                            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["kvsp"]["index"] for c in chunks[:-1]] == list(range(10))
    assert [c["kvsp"]["token"] for c in chunks[:-1]] == OUTPUT
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("body", "message"), [({"prompt": ""}, "prompt"), ({"prompt": "x", "max_tokens": 0},
                                                                              "max_tokens"),
                                               ({"prompt": "x", "top_p": 2}, "top_p")])
async def test_bad_requests(system, body: dict[str, Any], message: str) -> None:
    certs, _, _, edge = system
    async with KvspClient(certs.files("bob"), retries=0) as user:
        r = await user.request("POST", edge.base_uri("/v1/completions"), content=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
    assert r.status == 400 and message in r.json()["error"]["message"] and r.json()["error"]["param"] == message


async def test_metrics(system) -> None:
    certs, _, frontend, edge = system
    frontend.stats.failovers = 3
    async with KvspClient(certs.files("bob"), retries=0) as user:
        r = await user.request("GET", edge.base_uri("/metrics"))
    assert r.status == 200 and 'kvsp_frontend_events_total{event="failovers"} 3' in (r.content or b"").decode()
