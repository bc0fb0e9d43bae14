"""The authorization matrix (issue 13 point 3): every route of every role app x every kind of principal x every
transport, the expected answer derived from the rules, the actual one requested from a real server.

* **Routes** come from the rule tables the role apps install (deny by default: a route without a rule answers 404 to
  everyone, so the rules are the whole authorizable surface): the Index Service with the Placement Controller
  (``controller_app``'s default rules, :data:`kvsp_http.index_app.INDEX_RULES` + :data:`kvsp_http.controller_app.
  CONTROLLER_RULES`), the holder (:data:`kvsp_http.holder_app.RULES`), the instance
  (:data:`kvsp_http.instance_app.RULES`), the relay (:data:`kvsp_http.relay_app.RULES`), each with ``GET metrics``
  (:data:`kvsp_http.metrics_app.METRICS_RULE`, added by ``mount_metrics``), and the front end, which has no rule table:
  its routes are read from its starlette app (:func:`frontend_routes`) and its requirement is
  :mod:`kvsp_frontend.auth`'s (the ``client`` role and the front end's scope; ``GET`` of
  :data:`~kvsp_frontend.auth.OPEN_PATHS` open to anyone).
* **Principals** (:data:`KINDS`): index and controller (every scope), holder and instance (the dev scope), a
  client with the dev scope, a client with another scope, an identity of the CA that is not in the policy, a
  certificate from a foreign CA, no certificate.
* **Targets**: a route whose path names a scope (``{scope}``) or whose body carries one (lookup, leases, sessions,
  replica records: a minimal valid body, so that the request reaches the handler's scope check) is probed in scope
  and out of scope; a route bound to an identity (:data:`IDENTITY_BOUND`) for the holder's or the instance
  principal's own identity and for another's. Other requests carry an empty body: a 400 or 415 then says the
  request passed authorization.
* **Expected** (:func:`expect`): allowed when the principal is in the policy, has one of the rule's roles, has the
  target's scope and is (or, for a holder, may publish for) the target identity; anything else refused. A
  certificate from a foreign CA is refused by TLS everywhere; no certificate is refused by TLS by every KVSP role
  (the front end answers 401).
* **Actual**: refused is a 401 or 403, or a TLS handshake refusal (the connection fails); any other status
  (200, 201, 204, 400, 404, 409, 422, 503, ...) means the request passed authorization.

The servers are the ``kvsp-quic`` subcommands, started as processes with ``--dev DIR --policy FILE`` (the dev CA,
plus certificates this module issues from it for the principals). MOQT (SUBSCRIBE_NAMESPACE and FETCH against the
relay and the holder's MOQT endpoint) is :mod:`tests.authz_matrix_moqt`.

``python -m tests.authz_matrix`` prints the matrix as Markdown (docs/security.md, "Authorization matrix").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvsp_dev import pki
from kvsp_frontend.auth import OPEN_PATHS
from kvsp_http.app_kit import BLOCK_MEDIA_TYPE, JSON_MEDIA_TYPE
from kvsp_http.authz import Rule
from kvsp_quic.auth import ALL, Policy, Principal, Role
from kvsp_quic.compat import Codec, InstanceState
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.keys import scope_id, uri_id
from kvsp_quic.producer_digests import ProducerDigest, ProducerDigestQuery, ProducerDigests
from kvsp_quic.records import (
    InstanceStatusRecord,
    LeaseRequest,
    LookupRequest,
    ReplicaRecord,
    ResidencyEntry,
    Sampler,
)
from kvsp_quic.roles.controller_records import SessionRequest
from kvsp_quic.samples import example_descriptor
from quic.tls import TlsFiles, TransportSettings, ssl_client_context

TRANSPORTS = ("HTTP/1.1", "HTTP/2", "HTTP/3")
# the kinds of principal, in the order of the table's columns
KINDS = ("index", "holder", "controller", "instance", "client", "client-other", "unlisted", "foreign", "none")
APPS = ("index", "holder", "instance", "relay", "frontend")  # one server process each (the index serves the PC)
OTHER_SCOPE = ScopeId(bytes.fromhex("0f" * 16))  # nobody's scope but the "*" principals'
OTHER_HOLDER = "https://other-holder.example/kvsp/"
BLOCK_KEY = BlockKey(bytes.fromhex("ab" * 32))
REFUSED = (401, 403)
# Routes whose handler authorizes by the identity the request is about: a replica's holder (``publish_for``; the
# Index Service's publish and withdraw) and the instance that reports its status (only itself). Probed for the
# principal's own identity and for another's. Other routes with a {holder_id} (failure and liveness reports) are
# probed by their rule's roles only.
IDENTITY_BOUND = {("PUT", "replicas/{holder_id}/{block_key}"): "holder",
                  ("DELETE", "replicas/{holder_id}/{block_key}"): "holder",
                  ("PUT", "instances/{instance_id}/status"): "instance"}
OTHER_INSTANCE = "https://other-instance.example/"
TLS = "tls"  # the actual answer of a request whose connection the server refused
REQUEST_TIMEOUT_S = 60.0  # per request: generous, for a loaded machine


# -- the principals ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Principals:
    """The files of each kind of principal (None: no certificate) and the policy that names them."""

    dev: Path
    files: dict[str, TlsFiles | None]
    policy: Policy
    policy_file: Path
    scope: ScopeId  # the dev scope (instances' and front end's)

    def principal(self, kind: str) -> Principal | None:
        if kind in ("foreign", "none"):
            return None
        return self.policy.principal(IDENTITIES[kind])


NAMES = {"index": "matrix-index", "holder": "matrix-holder", "controller": "matrix-controller",
         "instance": "matrix-instance", "client": "matrix-client", "client-other": "matrix-other",
         "unlisted": "matrix-unlisted"}
ROLE_URIS = {"index": "https://index.matrix.example/", "holder": "https://holder.matrix.example/kvsp/",
             "controller": "https://controller.matrix.example/", "instance": "https://instance.matrix.example/"}
IDENTITIES = {kind: (ROLE_URIS[kind] if kind in ROLE_URIS else pki.client(name).uri) for kind, name in NAMES.items()}
ANOTHER_SCOPE = ScopeId(bytes.fromhex("0e" * 16))  # client-other's scope


def make_principals(dev: Path) -> Principals:
    """The dev CA of *dev* (as ``--dev DIR`` makes it), a certificate for each kind of principal, a foreign CA's
    client, and the policy file: the index and the controller have every scope, the holder, the instance and
    the client the dev scope, the other client another scope."""
    from kvsp_app.serve import dev_scope_key, read_scope_key

    scope = scope_id(read_scope_key(dev_scope_key(dev)))
    pki.init(dev, [pki.role(NAMES[k], ROLE_URIS[k]) if k in ROLE_URIS else pki.client(NAMES[k]) for k in NAMES])
    files: dict[str, TlsFiles | None] = {k: TlsFiles.in_dir(dev, name) for k, name in NAMES.items()}
    foreign = dev / "foreign"
    pki.init(foreign, [pki.client("mallory")])
    files["foreign"] = TlsFiles(dev / "ca.pem", foreign / "mallory.pem", foreign / "mallory.key")
    files["none"] = None
    listed: list[tuple[str, list[str], str | list[str]]] = [("index", ["index"], "*"),
                                                            ("controller", ["controller"], "*")]
    listed += [("holder", ["holder"], [scope.hex()]), ("instance", ["instance"], [scope.hex()]),
               ("client", ["client"], [scope.hex()]),
               ("client-other", ["client"], [ANOTHER_SCOPE.hex()])]
    lines = []
    for kind, roles, scopes in listed:
        lines += ["[[principal]]", f"identity = {json.dumps(IDENTITIES[kind])}", f"roles = {json.dumps(roles)}",
                  f"scopes = {json.dumps(scopes)}"]
    policy_file = dev / "matrix-policy.toml"
    policy_file.write_text("\n".join(lines) + "\n")
    return Principals(dev, files, Policy.load(policy_file), policy_file, scope)


# -- the routes and their probes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """One request of a route: the rule it exercises, its concrete path and body, and what it targets."""

    app: str
    rule: Rule
    path: str  # relative to the base URI
    body: bytes | None
    variant: str  # "" or e.g. "in scope", "other holder"
    scope: ScopeId | None = None  # the scope the request is about (None: not scope-bound)
    subject: str | None = None  # the holder or instance the request is about (None: not identity-bound)
    publish_for: bool = False  # a holder subject: a principal that may publish for it qualifies too
    open: bool = False  # front end: open to anyone (OPEN_PATHS)
    frontend: bool = False  # the requirement is the front end's: client role and its scope

    @property
    def headers(self) -> dict[str, str]:
        if self.frontend:
            return {"content-type": "application/json"} if self.body is not None else {}
        if self.rule.method == "PUT" and self.rule.path.startswith("blocks/"):
            # an empty container, which only a principal that passed the scope check gets to send (400)
            return {"content-type": BLOCK_MEDIA_TYPE, "if-none-match": "*"}
        return {"content-type": JSON_MEDIA_TYPE} if self.body is not None else {}


def app_rules(app: str) -> tuple[Rule, ...]:
    """The rules of *app* exactly as the server installs them (plus ``GET metrics``, as ``mount_metrics`` adds)."""
    from kvsp_http import controller_app, holder_app, instance_app, relay_app
    from kvsp_http.metrics_app import METRICS_RULE

    if app == "index":  # run_index passes no rules: controller_app's default, the index's and the PC's
        default = inspect.signature(controller_app.controller_app).parameters["rules"].default
        return (*default, METRICS_RULE)
    if app == "relay":  # relay_app mounts the metrics rule itself
        return (*relay_app.RULES, METRICS_RULE)
    module = {"holder": holder_app, "instance": instance_app}[app]
    return (*module.RULES, METRICS_RULE)


def frontend_routes(files: TlsFiles) -> list[tuple[str, str]]:
    """(method, path) of every route of the front end's starlette app, read from the app ``frontend_app`` builds
    for a real :class:`~kvsp_frontend.session.Frontend` (never used: its client connects lazily)."""
    from starlette.routing import Route

    from gpu.modelfiles import ByteTokenizer
    from http3.client import KvspClient
    from kvsp_frontend.app import Frontend, frontend_app
    from kvsp_quic.keys import BlockKeyer

    frontend = Frontend(KvspClient(files), "https://127.0.0.1:9/",
                        BlockKeyer(os.urandom(32), example_descriptor().compat_id, 4), ByteTokenizer(), "model")
    app: Any = frontend_app(frontend, Policy())
    while not hasattr(app, "routes"):  # BasePath -> ApiAuthentication -> the starlette app
        app = app.app
    out = []
    for route in app.routes:
        assert isinstance(route, Route), route
        path = route.path.removeprefix("/").replace("{model:path}", "{model}")
        out += [(m, path) for m in sorted(route.methods or ()) if m != "HEAD"]
    return out


def _value(name: str, *, compat: CompatId, scope: ScopeId, subject: str) -> str:
    if name == "compat":
        return compat.hex()
    if name == "scope":
        return bytes(scope).hex()
    if name == "block_key":
        return bytes(BLOCK_KEY).hex()
    if name in ("holder_id", "instance_id"):
        return uri_id(subject)
    if name == "map":
        return "matrix-map"
    if name == "model":
        return "model"
    return str(uuid.UUID(int=1))  # session, lease_id, directive


def _concrete(rule: Rule, **values: Any) -> str:
    parts = []
    for seg in rule.segments:
        parts.append(_value(seg[1:-1], **values) if seg.startswith("{") else seg)
    return "/".join(parts)


def _body(app: str, rule: Rule, *, compat: CompatId, scope: ScopeId, subject: str) -> tuple[bytes | None, bool]:
    """A minimal valid body for the routes whose body names a scope (True), else an empty one (False)."""
    key = (rule.method, rule.path)
    obj: Any
    if key == ("POST", "lookup"):
        obj = LookupRequest(scope, compat, (BLOCK_KEY,)).to_json()
    elif key == ("POST", "leases"):
        obj = LeaseRequest(compat, scope, (BLOCK_KEY,), 1000).to_json()
    elif key == ("POST", "sessions") and app == "index":
        obj = SessionRequest(uuid.UUID(int=2), scope, compat, (1, 2, 3, 4), 1,
                             Sampler("greedy", 0, 0, True)).to_json()
    elif key == ("PUT", "replicas/{holder_id}/{block_key}"):
        layers = example_descriptor().layers
        obj = ReplicaRecord(BLOCK_KEY, compat, scope, subject, Codec.RAW, 100, bytes(32),
                            (ResidencyEntry("host", (0, layers - 1)),), 60_000).to_json()
    elif key == ("POST", "producer-digests"):  # one Producer Digest record of the scope (issue 13)
        layer_digests = tuple(hashlib.sha256(b"layer %d" % i).digest() for i in range(example_descriptor().layers))
        digest = hashlib.sha256(b"".join(layer_digests)).digest()
        obj = ProducerDigests((ProducerDigest(BLOCK_KEY, compat, scope, digest, layer_digests, 60_000),)).to_json()
    elif key == ("POST", "producer-digests/lookup"):
        obj = ProducerDigestQuery(compat, scope, (BLOCK_KEY,)).to_json()
    elif key == ("PUT", "instances/{instance_id}/status"):  # draining: never a placement candidate
        obj = InstanceStatusRecord(subject, 1, InstanceState.DRAINING, 1000).to_json()
        return json.dumps(obj).encode(), False
    else:
        return None, False
    return json.dumps(obj).encode(), True


def probes(app: str, principals: Principals, compat: bytes) -> list[Probe]:
    """Every request of the matrix against *app*: each route, with its in/out-of-scope and own/other-holder
    variants."""
    compat_id = CompatId(bytes(compat))
    out: list[Probe] = []
    if app == "frontend":
        client = principals.files["client"]
        assert client is not None
        for method, path in frontend_routes(client):
            rule = Rule(method, path, ["client"])
            body = b"{}" if method == "POST" else None
            out.append(Probe(app, rule, _concrete(rule, compat=compat_id, scope=principals.scope, subject=OTHER_HOLDER),
                             body, "", open=method == "GET" and path in OPEN_PATHS, frontend=True))
        return out
    for rule in app_rules(app):
        names = {seg[1:-1] for seg in rule.segments if seg.startswith("{")}
        _, scoped = _body(app, rule, compat=compat_id, scope=principals.scope, subject=OTHER_HOLDER)
        scopes: list[tuple[str, ScopeId | None]] = [("", None)]
        if "scope" in names or scoped:
            scopes = [("in scope", principals.scope), ("out of scope", OTHER_SCOPE)]
        bound = IDENTITY_BOUND.get((rule.method, rule.path)) if app == "index" else None
        subjects: list[tuple[str, str | None]] = [("", None)]
        if bound is not None:
            other = OTHER_HOLDER if bound == "holder" else OTHER_INSTANCE
            subjects = [(f"own {bound}", IDENTITIES[bound]), (f"other {bound}", other)]
        for scope_label, scope in scopes:
            for subject_label, subject in subjects:
                target = scope or principals.scope
                body, _ = _body(app, rule, compat=compat_id, scope=target, subject=subject or OTHER_HOLDER)
                path = _concrete(rule, compat=compat_id, scope=target, subject=subject or OTHER_HOLDER)
                variant = ", ".join(v for v in (scope_label, subject_label) if v)
                out.append(Probe(app, rule, path, body, variant, scope, subject, bound == "holder"))
    return out


def expect(probe: Probe, kind: str, principals: Principals) -> bool:
    """True when the rules allow *kind* the request of *probe*."""
    if kind == "foreign":
        return False  # TLS refuses a certificate of another CA
    if probe.open:
        return True
    principal = principals.principal(kind)
    if principal is None:
        return False
    if probe.frontend:
        return Role.CLIENT in principal.roles and principal.has_scope(principals.scope)
    allowed = probe.rule.allowed
    if allowed is not None and principal.roles.isdisjoint(allowed):
        return False
    if probe.scope is not None and not principal.has_scope(probe.scope):
        return False
    if probe.subject is not None and principal.identity != probe.subject:
        return probe.publish_for and (principal.publish_for is ALL or probe.subject in principal.publish_for)
    return True


# -- the servers -------------------------------------------------------------------------------------------------


def model_dir(root: Path) -> Path:
    """A tiny random-weights model for the instance and the front end (``kvsp-quic model init``)."""
    path = root / "model"
    subprocess.run([sys.executable, "-m", "kvsp_app", "model", "init", os.fspath(path), "--layers", "2",
                    "--kv-heads", "1", "--head-dim", "16", "--hidden", "32"], check=True, capture_output=True)
    return path


def server_args(app: str, principals: Principals, model: Path) -> list[str]:
    common = ["--dev", os.fspath(principals.dev), "--policy", os.fspath(principals.policy_file)]
    if app in ("index", "relay"):
        return [app, *common]
    if app == "holder":
        return ["holder", *common, "--workers", "1"]
    if app == "instance":
        return ["instance", *common, "--device", "cpu", "--model", os.fspath(model), "--block-tokens", "4",
                "--warmup-tokens", "8"]
    # the PC is never reached: the matrix's requests stop at authorization or at the body's validation
    return ["frontend", *common, "--controller", "https://127.0.0.1:9/", "--model", os.fspath(model)]


@contextlib.contextmanager
def servers(apps: Sequence[str], principals: Principals, model: Path) -> Iterator[dict[str, dict[str, Any]]]:
    """Start the servers of *apps* (in parallel); yield {app: its ready line}; stop them."""
    from tests.helpers import Process

    started: dict[str, Process] = {}
    errors: list[BaseException] = []

    def start(app: str) -> None:
        try:
            started[app] = Process(*server_args(app, principals, model))
        except BaseException as exc:  # reported below, once every start has returned
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(a,)) for a in apps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        yield {app: p.ready for app, p in started.items()}
    finally:
        for p in started.values():
            p.stop()


# -- the requests ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    probe: Probe
    kind: str
    transport: str
    expected: bool  # allowed
    actual: int | str  # a status, or TLS

    @property
    def refused(self) -> bool:
        return self.actual == TLS or self.actual in REFUSED

    @property
    def unauthorized_success(self) -> bool:
        return not self.expected and not self.refused

    @property
    def wrongly_refused(self) -> bool:
        return self.expected and self.refused

    def describe(self) -> str:
        p = self.probe
        where = f"{p.rule.method} {p.path}" + (f" ({p.variant})" if p.variant else "")
        return (f"{p.app}: {where} as {self.kind} over {self.transport}: expected "
                f"{'allowed' if self.expected else 'refused'}, got {self.actual}")


def _no_cert_context(ca: Path, alpn: Sequence[str]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=os.fspath(ca))
    ctx.set_alpn_protocols(list(alpn))
    return ctx


class Requester:
    """Sends one principal's requests to one server over one transport (one connection, opened on first use and
    again after the server refused or closed it)."""

    def __init__(self, base_uri: str, files: TlsFiles | None, ca: Path, transport: str,
                 anonymous: TlsFiles | None = None) -> None:
        self.base = base_uri
        self.files = files
        self.anonymous = anonymous  # no certificate over QUIC: files to load, dropped before the handshake
        self.ca = ca
        self.transport = transport
        self._httpx: httpx.AsyncClient | None = None
        self._h3: Any = None

    async def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> int | str:
        """The status of the answer, or :data:`TLS` when the connection failed twice, each time on a fresh
        connection (a refused handshake fails every time; a pooled connection the server closed fails once)."""
        for attempt in (1, 2):
            try:
                send = self._request_h3 if self.transport == "HTTP/3" else self._request_tcp
                return await asyncio.wait_for(send(method, path, body, headers), REQUEST_TIMEOUT_S)
            except (httpx.TransportError, ConnectionError, ssl.SSLError) as exc:
                await self.aclose()
                if isinstance(exc, httpx.TimeoutException):
                    raise
            except TimeoutError:
                raise TimeoutError(f"{method} {self.base}{path} over {self.transport}: no answer in "
                                   f"{REQUEST_TIMEOUT_S} s (attempt {attempt})") from None
        return TLS

    async def _request_tcp(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> int:
        if self._httpx is None:
            h2 = self.transport == "HTTP/2"
            alpn = ("h2",) if h2 else ("http/1.1",)
            ctx = (ssl_client_context(self.files, alpn) if self.files is not None
                   else _no_cert_context(self.ca, alpn))
            self._httpx = httpx.AsyncClient(verify=ctx, http1=not h2, http2=h2, timeout=REQUEST_TIMEOUT_S)
        r = await self._httpx.request(method, self.base + path, content=body, headers=headers)
        expected_version = "HTTP/2" if self.transport == "HTTP/2" else "HTTP/1.1"
        if r.http_version != expected_version:
            raise AssertionError(f"asked for {expected_version}, got {r.http_version}")
        return r.status_code

    async def _request_h3(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> int:
        from urllib.parse import urlsplit

        from http3.h3_client import H3ClientConnection
        from quic.connection import KvspQuicConnection
        from quic.protocol import connect_quic

        url = urlsplit(self.base)
        assert url.hostname is not None and url.port is not None
        if self._h3 is None:
            files = self.files

            def anonymous(**kwargs: Any) -> KvspQuicConnection:  # QUIC's handshake sends an empty Certificate
                kwargs["configuration"].certificate = kwargs["configuration"].private_key = None
                return KvspQuicConnection(**kwargs)

            factory: Callable[..., KvspQuicConnection] = KvspQuicConnection
            if files is None:
                assert self.anonymous is not None
                files, factory = self.anonymous, anonymous
            self._h3 = await connect_quic(url.hostname, url.port, files, alpn=["h3"], settings=TransportSettings(),
                                          protocol_factory=H3ClientConnection, quic_factory=factory,
                                          timeout=REQUEST_TIMEOUT_S / 2)
        fields = [(k.encode(), v.encode()) for k, v in headers.items()]
        response = await self._h3.request(method, url.netloc, url.path + path, fields, body)
        async for _ in response.aiter_bytes():
            pass
        return int(response.status)

    async def aclose(self) -> None:
        if self._httpx is not None:
            with contextlib.suppress(Exception):
                await self._httpx.aclose()
            self._httpx = None
        if self._h3 is not None:
            with contextlib.suppress(Exception):
                await self._h3.aclose()
            self._h3 = None


async def run_app(app: str, ready: dict[str, Any], principals: Principals,
                  transports: Sequence[str] = TRANSPORTS) -> list[Cell]:
    """Every cell of *app*: its probes x :data:`KINDS` x *transports*, each kind's requests in sequence, the
    kinds concurrently."""
    compat = bytes.fromhex(ready["compat_id"]) if "compat_id" in ready else example_descriptor().compat_id
    app_probes = probes(app, principals, compat)
    ca = principals.dev / "ca.pem"

    async def one(kind: str, transport: str) -> list[Cell]:
        requester = Requester(ready["base_uri"], principals.files[kind], ca, transport, principals.files["client"])
        cells = []
        try:
            for probe in app_probes:
                actual = await requester.request(probe.rule.method, probe.path, probe.body, probe.headers)
                cells.append(Cell(probe, kind, transport, expect(probe, kind, principals), actual))
        finally:
            await requester.aclose()
        return cells

    results = await asyncio.gather(*(one(k, t) for t in transports for k in KINDS))
    return [cell for cells in results for cell in cells]


@contextlib.asynccontextmanager
async def matrix_servers(root: Path, apps: Sequence[str] = APPS) -> AsyncIterator[tuple[Principals,
                                                                                      dict[str, dict[str, Any]]]]:
    principals = make_principals(root / "dev")
    model = model_dir(root)
    cm = servers(apps, principals, model)
    ready = await asyncio.to_thread(cm.__enter__)
    try:
        yield principals, ready
    finally:
        await asyncio.to_thread(cm.__exit__, None, None, None)


# -- the table ---------------------------------------------------------------------------------------------------


def _mark(cells: list[Cell]) -> str:
    """One table entry: the kind's answers over the transports ("200" when all agree, else "h1/h2/h3")."""
    answers = [str(c.actual) for c in sorted(cells, key=lambda c: TRANSPORTS.index(c.transport))]
    text = answers[0] if len(set(answers)) == 1 else "/".join(answers)
    if any(c.unauthorized_success for c in cells):
        return f"**{text} UNAUTHORIZED**"
    if any(c.wrongly_refused for c in cells):
        return f"**{text} (expected allowed)**"
    return text


def markdown(cells: list[Cell]) -> str:
    """The matrix as Markdown: one row per app, route and variant; one column per kind of principal."""
    rows: dict[tuple[str, str, str, str], dict[str, list[Cell]]] = {}
    for c in cells:
        key = (c.probe.app, c.probe.rule.method, c.probe.path if c.probe.frontend else c.probe.rule.path,
               c.probe.variant)
        rows.setdefault(key, {}).setdefault(c.kind, []).append(c)
    lines = ["| app | route | variant | " + " | ".join(KINDS) + " |",
             "|---|---|---|" + "---|" * len(KINDS)]
    for (app, method, path, variant), by_kind in rows.items():
        entries = [_mark(by_kind[k]) if k in by_kind else "" for k in KINDS]
        lines.append(f"| {app} | `{method} {path}` | {variant} | " + " | ".join(entries) + " |")
    bad = [c for c in cells if c.unauthorized_success]
    wrong = [c for c in cells if c.wrongly_refused]
    lines.append("")
    lines.append(f"{len(cells)} HTTP cells ({len(rows)} routes and variants x {len(KINDS)} principals x "
                 f"{len(TRANSPORTS)} transports): {len(bad)} unauthorized successes, {len(wrong)} refusals of "
                 f"allowed requests.")
    return "\n".join(lines)


async def run_all(ready: dict[str, dict[str, Any]], principals: Principals) -> tuple[list[Cell], list[Any]]:
    """Every HTTP cell of the servers of *ready* and every MOQT cell, all servers at once (most of the time goes
    to refused QUIC handshakes, which wait on the network, not the CPU)."""
    from tests.authz_matrix_moqt import moqt_cells

    apps = [a for a in APPS if a in ready]
    moqt = asyncio.ensure_future(moqt_cells(ready, principals))
    try:
        http = await asyncio.gather(*(run_app(a, ready[a], principals) for a in apps))
    except BaseException:
        moqt.cancel()
        raise
    return [c for cells in http for c in cells], await moqt


async def _main(apps: Sequence[str]) -> int:
    from tests.authz_matrix_moqt import moqt_markdown

    with tempfile.TemporaryDirectory(prefix="kvsp-authz-") as tmp:
        async with matrix_servers(Path(tmp), apps) as (principals, ready):
            cells, moqt = await run_all(ready, principals)
    print(markdown(cells))
    if moqt:
        print()
        print(moqt_markdown(moqt))
    bad = [c for c in cells if c.unauthorized_success or c.wrongly_refused]
    bad_moqt = [m for m in moqt if not m.ok]
    for c in bad:
        print("MISMATCH:", c.describe(), file=sys.stderr)
    for m in bad_moqt:
        print("MISMATCH:", m.describe(), file=sys.stderr)
    return 1 if bad or bad_moqt else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1:] or APPS)))
