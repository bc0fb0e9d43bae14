"""The front end's API keys, limits and streamed text, over real sockets: a fake Placement Controller and a fake
instance (raw ASGI apps on RoleServers), the real front end app on a listener that takes clients without a
certificate, and httpx with nothing but the CA and a bearer key."""

from __future__ import annotations

import dataclasses
import json
import os
import ssl
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_frontend.app import Frontend, frontend_app
from kvsp_frontend.auth import PrincipalLimits, dev_api_key, with_dev_key
from kvsp_frontend.errors import RateLimited
from kvsp_frontend.text import IncrementalText, StopText, load_chat_template
from kvsp_quic.auth import Policy, PolicyError, Principal, Role, api_key_hash
from kvsp_quic.keys import BlockKeyer
from quic.tls import TransportSettings
from tests.pki import TestPki, make_pki
from tests.support.frontend import DESCRIPTOR, KEY, TEXT, OneInstance, Utf8


def test_incremental_text_never_splits_a_character() -> None:
    text = IncrementalText(Utf8())
    deltas = [text.add(t) for t in TEXT.encode()]
    assert "".join(deltas) + text.flush() == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[:5] == ["", "é", "", "", "€"]
    cut = IncrementalText(Utf8())  # an incomplete character at the very end: as the whole text decodes it
    assert "".join(cut.add(t) for t in "aé".encode()[:-1]) + cut.flush() == "a\ufffd"


def test_stop_strings_straddling_tokens() -> None:
    for stops, include, expected in ((("€ o",), False, "é"), (("€ o",), True, "é€ o"), (("x", "é"), False, ""),
                                     (("zz",), False, TEXT)):
        text = StopText(Utf8(), stops, include)
        deltas = [text.add(t) for t in TEXT.encode()]
        assert "".join(deltas) + text.flush() == expected
        assert text.stopped == (None if expected == TEXT else next(s for s in stops if s in TEXT))
        if stops == ("€ o",) and not include:  # nothing of the stop string was sent before it was recognized
            assert all("€" not in d for d in deltas)


def test_policy_api_keys(tmp_path: Path) -> None:
    key = "kvsp-secret"
    policy = Policy.from_dict({"principal": [
        {"identity": "urn:kvsp:user:carol", "roles": ["client"], "scopes": "*", "api_keys": [api_key_hash(key)],
         "max_concurrent": 2, "tokens_per_minute": 100}]})
    carol = policy.by_api_key(key)
    assert carol is not None and (carol.max_concurrent, carol.tokens_per_minute) == (2, 100)
    assert policy.by_api_key("kvsp-other") is None
    for entry, words in (({"api_keys": [key]}, "never the key itself"),
                         ({"api_keys": [api_key_hash(key).upper()]}, r"api_keys\[0\]"),
                         ({"max_concurrent": 0}, "max_concurrent: must be positive"),
                         ({"tokens_per_minute": "5"}, "tokens_per_minute: must be an integer")):
        with pytest.raises(PolicyError, match=words):
            Policy.from_dict({"principal": [{"identity": "urn:kvsp:user:x", "roles": ["client"], **entry}]})
    twice = {"identity": "urn:kvsp:user:y", "roles": ["client"], "api_keys": [api_key_hash(key)]}
    with pytest.raises(PolicyError, match=r"principal\[1\].api_keys: the hash .* already listed at principal\[0\]"):
        Policy.from_dict({"principal": [{**twice, "identity": "urn:kvsp:user:x"}, twice]})


def test_limits_concurrency_and_tokens_per_minute() -> None:
    now = [1000.0]
    limits = PrincipalLimits(lambda: now[0])
    p = Principal("urn:kvsp:user:d", frozenset({Role.CLIENT}), max_concurrent=2, tokens_per_minute=100)
    a, b = limits.admit(p), limits.admit(p)
    with pytest.raises(RateLimited, match="max_concurrent 2"):
        limits.admit(p)
    a.charge(60)
    a.release()
    a.release()  # once only
    assert limits.in_flight(p) == 1
    now[0] += 20
    b.charge(50)
    b.release()
    with pytest.raises(RateLimited, match="tokens_per_minute 100") as info:
        limits.admit(p)
    assert info.value.retry_after == pytest.approx(40)  # when the first 60 tokens leave the window
    now[0] += 40
    limits.admit(p).release()


def test_dev_api_key_file(tmp_path: Path) -> None:
    key = dev_api_key(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / "api.key").st_mode) == 0o600
    assert dev_api_key(tmp_path) == key and key.startswith("kvsp-")
    policy = with_dev_key(Policy.dev_ca(), key)
    principal = policy.by_api_key(key)
    assert principal is not None and principal.has_role("client")


def test_chat_template_is_sandboxed(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}",
        "bos_token": {"content": "<s>"}}))
    render = load_chat_template(tmp_path)
    assert render is not None and render([{"role": "user", "content": "hi"}]) == "<s>[user] hi"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ messages.append(1) }}{{ ''.__class__.__mro__ }}"}))
    render = load_chat_template(tmp_path)
    assert render is not None
    with pytest.raises(ValueError, match="chat template"):
        render([{"role": "user", "content": "hi"}])


fakes: dict[str, OneInstance] = {}  # by the front end's base URI


@pytest.fixture
async def edge(fresh_certs: TestPki) -> AsyncIterator[tuple[str, ssl.SSLContext]]:
    certs = fresh_certs
    fake = OneInstance()
    pc, instance = RoleServer(fake.pc, certs.files("server")), RoleServer(fake.tokens, certs.files("server"))
    for server in (pc, instance):
        await server.start("127.0.0.1", 0)
    fake.instance = instance.base_uri()
    client = KvspClient(certs.files("alice"), retries=0)
    keyer = BlockKeyer(bytes(range(32)), DESCRIPTOR.compat_id, DESCRIPTOR.block_tokens)
    frontend = Frontend(client, pc.base_uri(), keyer, Utf8(), "tiny", vocab_size=256)
    policy = Policy.from_dict({"principal": [
        {"identity": "urn:kvsp:user:carol", "roles": ["client"], "scopes": "*", "api_keys": [api_key_hash(KEY)],
         "tokens_per_minute": 2 * len(TEXT.encode()) + 4},
        {"identity": "urn:kvsp:user:noscope", "roles": ["client"], "api_keys": [api_key_hash("kvsp-noscope")]},
        {"identity": "urn:kvsp:user:holder", "roles": ["holder"], "scopes": "*",
         "api_keys": [api_key_hash("kvsp-holder")]}]})
    server = RoleServer(frontend_app(frontend, policy), certs.files("server"),
                        settings=dataclasses.replace(TransportSettings(), client_cert_optional=True))
    await server.start("127.0.0.1", 0)
    fakes[server.base_uri()] = fake
    yield server.base_uri(), ssl.create_default_context(cafile=certs.files("server").ca)
    await client.aclose()
    for s in (server, pc, instance):
        await s.close()


async def test_streamed_utf8_usage_and_tokens_per_minute(edge: tuple[str, ssl.SSLContext]) -> None:
    base, ctx = edge
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"prompt": "ab", "max_tokens": 20, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(verify=ctx) as http:
        async with http.stream("POST", base + "v1/completions", headers=auth, json=body) as r:
            assert r.status_code == 200
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert "".join(texts) == TEXT and not any("\ufffd" in t for t in texts)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": 2, "completion_tokens": len(TEXT.encode()), "total_tokens": 2 + len(TEXT.encode())}
        assert all(c["usage"] is None for c in chunks[:-1])
        whole = await http.post(base + "v1/completions", headers=auth, json={"prompt": "ab", "max_tokens": 20})
        assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == TEXT
        limited = await http.post(base + "v1/completions", headers=auth, json={"prompt": "ab", "max_tokens": 20})
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert limited.json()["error"]["type"] == "rate_limit_error"
        assert limited.json()["error"]["code"] == "tokens_per_minute_exceeded"
        assert (await http.get(base + "v1/models", headers=auth)).status_code == 200  # not limited


@pytest.mark.parametrize(("key", "status", "kind"), [(None, 401, "authentication_error"),
                                                      ("kvsp-unknown", 401, "authentication_error"),
                                                      ("kvsp-noscope", 403, "permission_error"),
                                                      ("kvsp-holder", 403, "permission_error")])
async def test_refusals(edge: tuple[str, ssl.SSLContext], key: str | None, status: int, kind: str) -> None:
    base, ctx = edge
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(verify=ctx) as http:
        r = await http.post(base + "v1/completions", headers=headers, json={"prompt": "ab"})
        assert (await http.get(base + "health")).status_code == 200
    assert r.status_code == status and r.json()["error"]["type"] == kind and r.json()["error"]["message"]


async def _h3_without_certificate(base: str, ca: Path, path: str, key: str | None) -> tuple[int, bytes]:
    """An HTTP/3 request from a client that has no certificate (QUIC's handshake sends an empty Certificate)."""
    from urllib.parse import urlsplit

    from http3.h3_client import H3ClientConnection
    from quic.connection import KvspQuicConnection
    from quic.protocol import connect_quic
    from quic.tls import TlsFiles

    def anonymous(**kwargs: Any) -> KvspQuicConnection:
        kwargs["configuration"].certificate = kwargs["configuration"].private_key = None
        return KvspQuicConnection(**kwargs)

    url = urlsplit(base)
    assert url.hostname is not None and url.port is not None
    files = TlsFiles.in_dir(ca.parent, "alice")  # alice's certificate and key are dropped before the handshake
    conn = await connect_quic(url.hostname, url.port, files, alpn=["h3"], settings=TransportSettings(),
                              protocol_factory=H3ClientConnection, quic_factory=anonymous, timeout=5)
    try:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        response = await conn.request("GET", url.netloc, path, headers, None)
        return response.status, b"".join([chunk async for chunk in response.aiter_bytes()])
    finally:
        await conn.aclose()


async def test_http3_without_a_client_certificate(edge: tuple[str, ssl.SSLContext], tmp_path: Path) -> None:
    base, _ = edge
    ca = tmp_path / "ca.pem"  # the fixture's CA
    assert ca.is_file()
    assert (await _h3_without_certificate(base, ca, "/v1/models", KEY))[0] == 200
    status, body = await _h3_without_certificate(base, ca, "/v1/models", None)
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"


async def test_every_kvsp_role_still_requires_a_certificate(tmp_path: Path) -> None:
    from quic.protocol import QuicConnectError

    certs = make_pki(tmp_path)
    role = RoleServer(OneInstance().tokens, certs.files("server"))  # the default settings: mutual TLS
    await role.start("127.0.0.1", 0)
    try:
        with pytest.raises(QuicConnectError):
            await _h3_without_certificate(role.base_uri(), tmp_path / "ca.pem", "/", None)
        with pytest.raises((httpx.ConnectError, httpx.ReadError)):  # TLS 1.3: the alert comes after the Finished
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=tmp_path / "ca.pem")) as http:
                await http.get(role.base_uri())
    finally:
        await role.close()


async def test_failures_before_the_first_token_are_http_statuses(edge: tuple[str, ssl.SSLContext]) -> None:
    base, ctx = edge
    fakes[base].fail = True
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(verify=ctx) as http:
        for stream in (True, False):
            r = await http.post(base + "v1/completions", headers=auth,
                                json={"prompt": "ab", "max_tokens": 4, "stream": stream})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "the cache is full" in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == "server_error"


async def test_an_unreachable_controller_is_503_with_retry_after(tmp_path: Path) -> None:
    certs = make_pki(tmp_path)
    gone = RoleServer(OneInstance().pc, certs.files("server"))
    await gone.start("127.0.0.1", 0)
    pc = gone.base_uri()
    await gone.close()  # nothing answers there any more
    client = KvspClient(certs.files("alice"), retries=0, connect_timeout=1, h3=False)
    keyer = BlockKeyer(bytes(range(32)), DESCRIPTOR.compat_id, DESCRIPTOR.block_tokens)
    frontend = Frontend(client, pc, keyer, Utf8(), "tiny", vocab_size=256, placement_timeout_s=2)
    server = RoleServer(frontend_app(frontend, with_dev_key(Policy.dev_ca(), KEY)), certs.files("server"),
                        settings=dataclasses.replace(TransportSettings(), client_cert_optional=True))
    await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=tmp_path / "ca.pem")) as http:
            r = await http.post(server.base_uri("/v1/completions"), headers={"authorization": f"Bearer {KEY}"},
                                json={"prompt": "ab", "stream": True})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert "Placement Controller" in r.json()["error"]["message"]
    finally:
        await server.close()
        await client.aclose()


async def test_streamed_choices(edge: tuple[str, ssl.SSLContext]) -> None:
    base, ctx = edge
    body = {"prompt": "ab", "max_tokens": 20, "stream": True, "n": 2, "echo": True}
    async with httpx.AsyncClient(verify=ctx) as http, http.stream(
            "POST", base + "v1/completions", headers={"authorization": f"Bearer {KEY}"}, json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == "ab" + TEXT  # echo: the prompt first
        assert [c["finish_reason"] for c in mine][-1] == "stop" and all(c["finish_reason"] is None
                                                                        for c in mine[:-1])


async def test_a_stop_string_ends_the_choice(edge: tuple[str, ssl.SSLContext]) -> None:
    base, ctx = edge
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(verify=ctx) as http:
        whole = await http.post(base + "v1/completions", headers=auth, json={"prompt": "ab", "stop": ["€"]})
        assert whole.json()["choices"][0]["text"] == "é" and whole.json()["choices"][0]["finish_reason"] == "stop"
        async with http.stream("POST", base + "v1/completions", headers=auth,
                               json={"prompt": "ab", "stop": " o", "stream": True,
                                     "include_stop_str_in_output": True}) as r:
            chunks = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "é€ o"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
