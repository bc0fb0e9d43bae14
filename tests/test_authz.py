from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvsp_http import problem_response
from kvsp_http.authz import PRINCIPAL_KEY, Authorization, Rule, principal_of, route_path
from kvsp_quic import auth, fields
from kvsp_quic.auth import Policy
from kvsp_quic.problems import NotFound
from tests import pki as test_pki
from tests.asgi import Sent, call, http_scope, tls_for

SERVER = test_pki.SERVER_URI  # https://127.0.0.1/ -- a holder here
ALICE = "urn:kvsp:client:alice"  # a client; bob has a certificate of the same CA but is not in the policy
S1 = "00112233445566778899aabbccddeeff"
S2 = "ffeeddccbbaa99887766554433221100"
SCOPE_DENIED = "https://iana.org/assignments/kvsp#kvsp-scope-denied"

POLICY = Policy.from_dict({"principal": [
    {"identity": SERVER, "roles": ["holder"], "scopes": "*"},
    {"identity": ALICE, "roles": ["client"], "scopes": [S1]},
]})

RULES = [
    Rule("GET", "replicas/{holder_id}/{block_key}", ["client", "instance"]),
    Rule("PUT", "replicas/{holder_id}/{block_key}", ["holder"]),
    Rule("GET", "scopes/{scope_id}", "*"),
    Rule("GET", "unrouted", "*"),  # a rule without a route: the app's own 404
]


@pytest.fixture(scope="module")
def pems(certs: test_pki.TestPki) -> dict[str, str]:
    return {name: (certs.root / f"{name}.pem").read_text() for name in ("server", "alice", "bob", "nouri")}


class Recorder:
    """A starlette app (with problem_response installed) that records the scopes it was called with."""

    def __init__(self) -> None:
        self.scopes: list[MutableMapping[str, Any]] = []

        async def replica(request: Request) -> Response:
            p = principal_of(request)
            return JSONResponse({"identity": p.identity, **request.path_params})

        async def put_replica(request: Request) -> Response:
            auth.require_publish_for(principal_of(request), request.query_params.get("holder", ""))
            return Response(status_code=204)

        async def scope(request: Request) -> Response:
            scope_id = fields.scope_id(request.path_params["scope_id"], "scope_id")
            auth.require_scope(principal_of(request), scope_id)
            return JSONResponse({"scope": scope_id.hex()})

        self.app = Starlette(routes=[
            Route("/replicas/{holder_id}/{block_key}", replica, methods=["GET"]),
            Route("/replicas/{holder_id}/{block_key}", put_replica, methods=["PUT"]),
            Route("/scopes/{scope_id}", scope, methods=["GET"]),
        ])
        problem_response.install(self.app)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        await self.app(scope, receive, send)


@pytest.fixture
def inner() -> Recorder:
    return Recorder()


@pytest.fixture
def app(inner: Recorder) -> Authorization:
    return Authorization(inner, POLICY, RULES)


def assert_problem(sent: Sent, status: int, type_uri: str = "about:blank", detail: str | None = None) -> None:
    assert sent.status == status
    assert sent.headers["content-type"] == "application/problem+json"
    assert sent.headers["cache-control"] == "no-store"
    assert int(sent.headers["content-length"]) == len(sent.body)
    doc = sent.json()
    assert doc["type"] == type_uri and doc["status"] == status and doc["title"]
    if detail is not None:
        assert detail in doc["detail"]


async def test_no_tls_extension_is_refused_before_the_app(app: Authorization, inner: Recorder) -> None:
    sent = await call(app, http_scope("GET", "/replicas/h/k", tls=False))
    assert_problem(sent, 403, detail="no verified client certificate")
    assert inner.scopes == []


async def test_no_or_unusable_certificate_is_refused(app: Authorization, inner: Recorder,
                                                     pems: dict[str, str]) -> None:
    assert_problem(await call(app, http_scope("GET", "/replicas/h/k", pem=None)), 403)  # empty chain
    errored = http_scope("GET", "/replicas/h/k", pem=pems["alice"])
    errored["extensions"]["tls"]["client_cert_error"] = "certificate has expired"
    assert_problem(await call(app, errored), 403)
    assert_problem(await call(app, http_scope("GET", "/replicas/h/k", pem=pems["nouri"])), 403)  # no SAN URI
    assert_problem(await call(app, http_scope("GET", "/replicas/h/k", pem="not a pem")), 403)
    assert inner.scopes == []


async def test_unknown_identity_is_refused(app: Authorization, inner: Recorder, pems: dict[str, str]) -> None:
    sent = await call(app, http_scope("GET", "/replicas/h/k", pem=pems["bob"]))
    assert_problem(sent, 403, detail="identity 'urn:kvsp:client:bob' is not in the authorization policy")
    assert inner.scopes == []


async def test_wrong_role_is_forbidden(app: Authorization, inner: Recorder, pems: dict[str, str]) -> None:
    sent = await call(app, http_scope("PUT", "/replicas/h/k", pem=pems["alice"]))
    assert_problem(sent, 403, detail=f"identity {ALICE!r} needs the role holder (it has: client)")
    sent = await call(app, http_scope("GET", "/replicas/h/k", pem=pems["server"]))
    assert_problem(sent, 403, detail="needs one of the roles instance, client")
    assert inner.scopes == []


async def test_right_role_reaches_the_app_with_the_principal(app: Authorization, inner: Recorder,
                                                             pems: dict[str, str]) -> None:
    lifespan_state = {"store": "shared"}
    sent = await call(app, http_scope("GET", "/replicas/h1/k1", pem=pems["alice"], state=lifespan_state))
    assert sent.status == 200 and sent.json() == {"identity": ALICE, "holder_id": "h1", "block_key": "k1"}
    (scope,) = inner.scopes
    assert scope["state"][PRINCIPAL_KEY] == POLICY.principal(ALICE)
    assert scope["state"]["store"] == "shared" and PRINCIPAL_KEY not in lifespan_state  # copied, not mutated
    sent = await call(app, http_scope("PUT", "/replicas/h1/k1", pem=pems["server"], query=f"holder={SERVER}".encode()))
    assert sent.status == 204
    assert "state" in inner.scopes[-1]  # created when the server gave none


async def test_handler_checks_publish_for(app: Authorization, pems: dict[str, str]) -> None:
    sent = await call(app, http_scope("PUT", "/replicas/h1/k1", pem=pems["server"],
                                      query=b"holder=https://other.example/"))
    assert_problem(sent, 403, detail="may not publish replicas for holder 'https://other.example/'")


async def test_handler_scope_check(app: Authorization, pems: dict[str, str]) -> None:
    sent = await call(app, http_scope("GET", f"/scopes/{S1}", pem=pems["alice"]))
    assert sent.status == 200 and sent.json() == {"scope": S1}
    sent = await call(app, http_scope("GET", f"/scopes/{S2}", pem=pems["alice"]))
    assert_problem(sent, 403, SCOPE_DENIED, detail=f"not authorized for scope {S2}")
    sent = await call(app, http_scope("GET", f"/scopes/{S2}", pem=pems["server"]))  # scopes = "*"
    assert sent.status == 200
    sent = await call(app, http_scope("GET", "/scopes/XYZ", pem=pems["alice"]))  # a malformed scope_id
    assert_problem(sent, 400, detail="scope_id: must be 32 lowercase hex characters")


async def test_unmatched_routes_are_not_found(app: Authorization, inner: Recorder, pems: dict[str, str]) -> None:
    for method, path in [("GET", "/elsewhere"), ("DELETE", "/replicas/h/k"), ("GET", "/replicas/h"),
                         ("GET", "/replicas/h/k/extra"), ("GET", "/replicas//k"), ("GET", "/")]:
        sent = await call(app, http_scope(method, path, pem=pems["alice"]))
        assert_problem(sent, 404, detail=f"no resource {path!r} for {method}")
    assert inner.scopes == []
    # A rule without a route: the app's own 404, rendered the same way.
    sent = await call(app, http_scope("GET", "/unrouted", pem=pems["alice"]))
    assert_problem(sent, 404)
    assert len(inner.scopes) == 1


async def test_head_follows_get_and_root_path_is_removed(app: Authorization, pems: dict[str, str]) -> None:
    sent = await call(app, http_scope("HEAD", "/replicas/h/k", pem=pems["alice"]))
    assert sent.status == 200
    sent = await call(app, http_scope("GET", "/replicas/h/k", pem=pems["alice"], root_path="/kvsp"))
    assert sent.status == 200 and sent.json()["block_key"] == "k"
    sent = await call(app, http_scope("PUT", "/replicas/h/k", pem=pems["alice"], root_path="/kvsp"))
    assert_problem(sent, 403)


async def test_through_httpx(inner: Recorder, pems: dict[str, str]) -> None:
    """The same through httpx's ASGI transport, with a shim that adds the TLS extension as a server would."""
    guarded = Authorization(inner, POLICY, RULES)

    def with_cert(pem: str | None) -> Any:
        async def shim(scope: Any, receive: Any, send: Any) -> None:
            if pem is not None:
                scope["extensions"] = {**scope.get("extensions", {}), "tls": tls_for(pem)}
            await guarded(scope, receive, send)
        return shim

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_cert(pems["alice"])),
                                 base_url="https://127.0.0.1") as client:
        ok = await client.get("/replicas/h/k")
        assert ok.status_code == 200 and ok.json()["identity"] == ALICE
        denied = await client.put("/replicas/h/k")
        assert denied.status_code == 403 and denied.headers["content-type"] == "application/problem+json"
        assert denied.headers["cache-control"] == "no-store"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_cert(None)),
                                 base_url="https://127.0.0.1") as client:
        anonymous = await client.get("/replicas/h/k")
        assert anonymous.status_code == 403 and anonymous.json()["type"] == "about:blank"


async def test_a_raw_asgi_app_may_raise_a_problem(pems: dict[str, str]) -> None:
    async def raw(scope: Any, receive: Any, send: Any) -> None:
        raise NotFound("no such block")

    sent = await call(Authorization(raw, POLICY, [Rule("*", "**", "*")]), http_scope("GET", "/a/b", pem=pems["alice"]))
    assert_problem(sent, 404, "https://iana.org/assignments/kvsp#kvsp-not-found", "no such block")

    async def late(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise NotFound("too late")

    with pytest.raises(NotFound):  # the response started: the server must abort the stream
        await call(Authorization(late, POLICY, [Rule("*", "**", "*")]), http_scope("GET", "/", pem=pems["alice"]))


async def test_lifespan_passes_and_websockets_are_refused(inner: Recorder) -> None:
    seen: list[str] = []

    async def raw(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    app = Authorization(raw, POLICY, RULES)
    await app({"type": "lifespan"}, _never, _never)
    assert seen == ["lifespan"]
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    await app({"type": "websocket", "path": "/replicas/h/k"}, _never, send)
    assert sent == [{"type": "websocket.close", "code": 1008}] and seen == ["lifespan"]


async def _never(*_args: Any) -> Any:
    raise AssertionError("not called")


def test_principal_of_without_the_middleware() -> None:
    with pytest.raises(RuntimeError, match=r"must run inside kvsp_http\.authz"):
        principal_of({"type": "http"})
    with pytest.raises(RuntimeError):
        principal_of({"state": {PRINCIPAL_KEY: "not a principal"}})


# -- rules -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "method", "path", "params"), [
    (Rule("GET", "replicas/{holder_id}/{block_key}", ["client"]), "GET", "replicas/a/b",
     {"holder_id": "a", "block_key": "b"}),
    (Rule("GET", "/replicas/{h}/{k}", "client"), "HEAD", "replicas/a/b", {"h": "a", "k": "b"}),
    (Rule("get", "leases", "holder"), "GET", "leases", {}),
    (Rule("GET", "leases", "holder"), "POST", "leases", None),
    (Rule("GET", "leases", "holder"), "GET", "leases/", None),
    (Rule("POST", "leases/", "holder"), "POST", "leases/", {}),
    (Rule("*", "leases/*", "holder"), "DELETE", "leases/abc", {}),
    (Rule("*", "leases/*", "holder"), "DELETE", "leases/", None),
    (Rule("*", "leases/*", "holder"), "DELETE", "leases/a/b", None),
    (Rule("GET", "blocks/**", "*"), "GET", "blocks", {}),
    (Rule("GET", "blocks/**", "*"), "GET", "blocks/a/b/c", {}),
    (Rule("GET", "blocks/**", "*"), "GET", "blocksx/a", None),
    (Rule("GET", "**", "*"), "GET", "", {}),
    (Rule("GET", "", "*"), "GET", "", {}),
    (Rule("GET", "", "*"), "GET", "a", None),
    (Rule("GET", "{x}", "*"), "GET", "", None),
])
def test_rule_matching(rule: Rule, method: str, path: str, params: dict[str, str] | None) -> None:
    assert rule.match(method, path) == params


def test_rule_normalisation_and_errors() -> None:
    rule = Rule("put", "/a/{b}", ["holder", auth.Role.INDEX, "holder"])
    assert rule.method == "PUT" and rule.path == "a/{b}" and rule.roles == (auth.Role.INDEX, auth.Role.HOLDER)
    assert rule.allowed == {auth.Role.HOLDER, auth.Role.INDEX}
    assert Rule("GET", "x", "*").allowed is None
    for args, message in [(("G T", "x", "*"), "bad method"), (("GET", "**/x", "*"), "'\\*\\*' must be the last"),
                          (("GET", "a{b}", "*"), "mixes a pattern"), (("GET", "a*", "*"), "mixes a pattern"),
                          (("GET", "x", ["root"]), "unknown role"), (("GET", "x", []), "at least one role")]:
        with pytest.raises(ValueError, match=message):
            Rule(*args)


def test_route_path() -> None:
    assert route_path({"path": "/kvsp/leases", "root_path": "/kvsp"}) == "leases"
    assert route_path({"path": "/kvsp", "root_path": "/kvsp"}) == ""
    assert route_path({"path": "/kvspx/leases", "root_path": "/kvsp"}) == "kvspx/leases"
    assert route_path({"path": "/leases"}) == "leases"
