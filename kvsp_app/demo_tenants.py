"""``kvsp-quic demo --tenants N``: tenants who distrust each other, end to end (issue 13, point 2).

Each tenant has its own scope key, its own policy principals (a client, its front end, its inference instance),
its own front end and instance; every tenant shares one Index Service + Placement Controller, one holder and one
relay. Every process is a real process on 127.0.0.1, started the production way -- a configuration file naming
its certificate and one policy file (no ``--dev`` policy that trusts every certificate of the CA, no dev API key):

    index+PC, holder, relay           roles index+controller / holder / holder (the relay), every scope
    instance-tK                       roles instance+holder+client, scope K only
    frontend-tK                       role client, scope K only
    urn:kvsp:client:tenant-K          role client, scope K only (the tenant's user)

The same prompts, with a shared prefix, go through every tenant's front end, one tenant after the other: each
tenant must get its own cache hits, and a later tenant's first request must not hit the blocks an earlier tenant
cached for the same text. Then, for every ordered pair (owner, other), what the other tenant's principals can see
of the owner's data is inspected; anything they can see is a leak:

* lookups at the Index Service, with the other tenant's certificate, of the owner's block keys (in the owner's
  scope: refused or no match; in the other's own scope: no match) -- while the owner's lookup matches;
* every replica of the owner's blocks the owner can find (its instance, the shared holder): a GET with the other
  tenant's certificate is refused;
* the owner's sessions at the PC: placed on the owner's instances only, and unreadable for the other tenant's
  front end; their token streams at the instance: unreadable for the other tenant's front end and client;
* the relay's ``status``: no namespace of the owner's scope is listed to the other tenant (each tenant's instance
  first announces its namespace to the relay over MOQT; the owner's own view is reported as ``relay_namespaces``).

The report (``--json``) has, per tenant, the requests, the prompt tokens fetched from the cache / recomputed, the
cache hits of its first request (a later tenant's must be 0: anything else is a leak too), its namespaces the relay
shows it, the checks made and the leaks found; ``kvsp-quic`` exits 1 when any leak is found.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsp_app.demo import QUESTIONS, SYSTEM_PROMPT, Cluster, _metrics, _stream

SHARED = ("index", "holder", "relay")
BLOCK_TOKENS = 16


@dataclass
class TenantsOptions:
    tenants: int = 2
    workdir: Path | None = None
    keep: bool = False
    requests: int = 3  # requests per tenant after its first one, sharing the prefix
    prefix_tokens: int = 512
    max_tokens: int = 8
    layers: int = 4
    hidden: int = 256
    timeout: float = 120.0


@dataclass
class Tenant:
    name: str  # "t1", "t2", ...
    key_file: Path
    scope_id: bytes
    keyer: Any  # kvsp_quic.keys.BlockKeyer
    instance: str = ""  # base URIs
    frontend: str = ""
    client: Any = None  # KvspClient with the tenant's user certificate
    as_frontend: Any = None  # KvspClient with the front end's certificate
    sessions: tuple[uuid.UUID, ...] = ()


def _free_port() -> int:
    """A port free on both TCP and UDP (the role serves HTTP/3 and MOQT on UDP, HTTP/1.1 and HTTP/2 on TCP)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port: int = tcp.getsockname()[1]
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                    udp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(text)


def _toml_list(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def _moqt(uri: str) -> str:
    """The MOQT URI of a role's base URI (one port serves HTTP/3 and MOQT): its replicas' ``moqt://`` records."""
    return "moqt://" + uri.removeprefix("https://").split("/", 1)[0] + "/"


def _policy(uris: dict[str, str], tenants: list[Tenant]) -> str:
    every: list[str] = ["*"]  # written as "*", every scope
    entries: list[tuple[str, list[str], list[str], list[str] | None]] = [
        (uris["index"], ["index", "controller"], every, None),
        (uris["holder"], ["holder"], every, [_moqt(uris["holder"])]),
        (uris["relay"], ["holder"], every, [_moqt(uris["relay"])]),
    ]
    for t in tenants:
        scopes = [t.scope_id.hex()]
        entries += [(uris[f"instance-{t.name}"], ["instance", "holder", "client"], scopes,
                     [_moqt(uris[f"instance-{t.name}"])]),
                    (uris[f"frontend-{t.name}"], ["client"], scopes, None),
                    (f"urn:kvsp:client:tenant-{t.name}", ["client"], scopes, None)]
    out = []
    for identity, roles, scopes, publish_for in entries:
        out.append("[[principal]]")
        out.append(f"identity = {json.dumps(identity)}")
        out.append(f"roles = {_toml_list(roles)}")
        out.append(f"scopes = {json.dumps('*') if scopes is every else _toml_list(scopes)}")
        if publish_for:
            out.append(f"publish_for = {_toml_list(publish_for)}")
        out.append("")
    return "\n".join(out)


async def run_tenants(options: TenantsOptions, progress: Callable[[str], None]) -> dict[str, Any]:
    from gpu.modelfiles import ModelConfig, derive_descriptor, load_tokenizer, write_random_model
    from http3.client import KvspClient
    from kvsp_dev import pki
    from kvsp_quic.compat import dumps_descriptor
    from kvsp_quic.keys import BlockKeyer
    from quic.tls import TlsFiles

    if options.tenants < 2:
        raise ValueError("--tenants: at least 2")
    root = options.workdir or Path(tempfile.mkdtemp(prefix="kvsp-tenants-"))
    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root, progress)
    steps = 6
    try:
        progress(f"[1/{steps}] writing a random-weights model, certificates, scope keys and the policy in {root}")
        heads = max(options.hidden // 64, 1)
        write_random_model(root / "model", ModelConfig(
            hidden_size=options.hidden, intermediate_size=2 * options.hidden, num_hidden_layers=options.layers,
            num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), vocab_size=512, head_dim=64,
            name="kvsp-demo"), seed=1)
        descriptor = derive_descriptor(root / "model", BLOCK_TOKENS)
        (root / "descriptor.json").write_text(dumps_descriptor(descriptor))
        tenants = []
        for i in range(1, options.tenants + 1):
            name = f"t{i}"
            key_file = root / f"scope-{name}.key"
            if key_file.exists():  # --workdir of an earlier run: its tenants keep their keys
                key = bytes.fromhex(key_file.read_text().strip())
            else:
                key = secrets.token_bytes(32)
                _write_private(key_file, key.hex() + "\n")
            keyer = BlockKeyer(key, descriptor.compat_id, BLOCK_TOKENS)
            tenants.append(Tenant(name, root / f"scope-{name}.key", keyer.scope_id, keyer))
        names = [*SHARED, *(f"{kind}-{t.name}" for t in tenants for kind in ("instance", "frontend"))]
        ports = {n: _free_port() for n in names}
        uris = {n: f"https://127.0.0.1:{p}/" for n, p in ports.items()}
        certs = root / "pki"
        pki.init(certs, [pki.role(n, uris[n]) for n in names]
                 + [pki.client(f"tenant-{t.name}") for t in tenants], extra_hosts=["127.0.0.1", "localhost"])
        (root / "policy.toml").write_text(_policy(uris, tenants))
        for n in names:
            sections = {"index": f"[index]\ndescriptors = [{json.dumps(os.fspath(root / 'descriptor.json'))}]\n",
                        "holder": f"[holder]\ndescriptors = [{json.dumps(os.fspath(root / 'descriptor.json'))}]\n"}
            (root / f"{n}.toml").write_text(
                f'[server]\nlisten = "127.0.0.1:{ports[n]}"\nbase_uri = "{uris[n]}"\n'
                f'policy = {json.dumps(os.fspath(root / "policy.toml"))}\n\n'
                f'[tls]\nca = {json.dumps(os.fspath(certs / "ca.pem"))}\n'
                f'cert = {json.dumps(os.fspath(certs / f"{n}.pem"))}\n'
                f'key = {json.dumps(os.fspath(certs / f"{n}.key"))}\n\n'
                + sections.get(n, ""))
        index = uris["index"]
        progress(f"[2/{steps}] starting the shared Index Service + Placement Controller, holder and relay")
        cluster.start("index", "index", "--config", "index.toml")
        await _started(
            asyncio.to_thread(cluster.start, "holder", "holder", "--config", "holder.toml", "--index", index,
                              "--workers", "1"),
            asyncio.to_thread(cluster.start, "relay", "relay", "--config", "relay.toml", "--index", index,
                              "--workers", "1"))
        progress(f"[3/{steps}] starting, per tenant, an inference instance and a front end (all at once)")

        async def start_tenant(t: Tenant) -> None:
            scope_key = os.fspath(t.key_file)
            instance, frontend = await _started(
                asyncio.to_thread(cluster.start, f"instance-{t.name}", "instance", "--config",
                                  f"instance-{t.name}.toml", "--device", "cpu", "--model", "model", "--index", index,
                                  "--controller", index, "--scope-key", scope_key, "--block-tokens",
                                  str(BLOCK_TOKENS), "--status-ttl-ms", "1500"),
                asyncio.to_thread(cluster.start, f"frontend-{t.name}", "frontend", "--config",
                                  f"frontend-{t.name}.toml", "--controller", index, "--model", "model",
                                  "--scope-key", scope_key, "--block-tokens", str(BLOCK_TOKENS)))
            t.instance, t.frontend = instance["base_uri"], frontend["base_uri"]

        await _started(*(start_tenant(t) for t in tenants))
        ca = certs / "ca.pem"
        for t in tenants:
            t.client = KvspClient(TlsFiles(ca, certs / f"tenant-{t.name}.pem", certs / f"tenant-{t.name}.key"),
                                  timeout=options.timeout, retries=0)
            t.as_frontend = KvspClient(TlsFiles(ca, certs / f"frontend-{t.name}.pem",
                                                certs / f"frontend-{t.name}.key"), timeout=options.timeout, retries=0)
        prefix = (SYSTEM_PROMPT * (options.prefix_tokens // len(SYSTEM_PROMPT) + 1))[:options.prefix_tokens]
        prompts = [prefix + QUESTIONS[i % len(QUESTIONS)] for i in range(1 + options.requests)]
        publishers: list[Any] = []
        try:
            per_tenant: dict[str, dict[str, Any]] = {}
            for i, t in enumerate(tenants, 1):
                progress(f"[4/{steps}] tenant {t.name} ({i}/{len(tenants)}): {len(prompts)} requests sharing a "
                         f"{options.prefix_tokens}-token prefix through its front end")
                per_tenant[t.name] = await _workload(t, prompts, options)
            progress(f"[5/{steps}] each tenant's instance publishes its namespace to the relay; inspecting what each "
                     "tenant's principals can see of the others'")
            for t in tenants:
                publishers.append(await _publish_namespace(t, certs, ports["relay"], descriptor.compat_id))
            tokenizer = load_tokenizer(root / "model")
            prefix_tokens = list(tokenizer.encode(prefix))
            for owner in tenants:
                leaks: list[str] = []
                checks = 0
                for other in tenants:
                    if other is not owner:
                        found, done = await _inspect(owner, other, tenants, prefix_tokens, uris, descriptor.compat_id)
                        leaks += found
                        checks += done
                if owner is not tenants[0] and per_tenant[owner.name]["first_request_fetched_tokens"]:
                    leaks.append(f"{owner.name}'s first request hit cached blocks of another tenant (the same text "
                                 "was cached only by earlier tenants)")
                per_tenant[owner.name].update(leaks=leaks, leak_checks=checks + 1, relay_namespaces=len(
                    await _relay_namespaces(owner.client, uris["relay"], owner.scope_id)))
        finally:
            for conn in publishers:
                await conn.aclose()
            for t in tenants:
                for c in (t.client, t.as_frontend):
                    if c is not None:
                        await c.aclose()
        progress(f"[6/{steps}] done")
        return {"tenants": per_tenant, "leaks": sum(len(r["leaks"]) for r in per_tenant.values()),
                "prefix_tokens": options.prefix_tokens}
    finally:
        cluster.stop()
        if not options.keep and options.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


async def _started(*starts: Awaitable[Any]) -> list[Any]:
    """Processes started at once (threads waiting for their ready lines); when one fails, the others are still
    waited for (each is then in the cluster, which stops it) before the first failure is raised."""
    results = await asyncio.gather(*starts, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def _workload(t: Tenant, prompts: list[str], options: TenantsOptions) -> dict[str, Any]:
    completions = f"{t.frontend}v1/completions"
    metric_fetched = 'kvsp_fetched_tokens_total{component="instance"}'
    metric_computed = 'kvsp_recomputed_tokens_total{component="instance"}'
    before = await _metrics(t.client, t.instance)
    first = await _stream(t.client, completions, prompts[0], options.max_tokens)
    after_first = await _metrics(t.client, t.instance)
    sessions = [first["session"]]
    for prompt in prompts[1:]:
        sessions.append((await _stream(t.client, completions, prompt, options.max_tokens))["session"])
    after = await _metrics(t.client, t.instance)
    t.sessions = tuple(uuid.UUID(s) for s in sessions)

    def delta(metric: str, a: dict[str, float], b: dict[str, float]) -> float:
        return b.get(metric, 0.0) - a.get(metric, 0.0)

    return {"requests": len(prompts),
            "fetched_tokens": delta(metric_fetched, before, after),
            "recomputed_tokens": delta(metric_computed, before, after),
            "first_request_fetched_tokens": delta(metric_fetched, before, after_first),
            "sessions": [str(s) for s in t.sessions]}


async def _refused(call: Any) -> tuple[bool, str]:
    """Whether *call* (an awaitable of the KVSP client) was refused or found nothing: (True, how) or (False, what
    it got)."""
    from http3.client import TransportError
    from kvsp_client.api import Miss, RetryElsewhere
    from kvsp_quic.problems import Problem

    try:
        result = await call
    except (Problem, RetryElsewhere, TransportError) as exc:
        return True, type(exc).__name__
    if isinstance(result, Miss):
        return True, f"miss {result.status}"
    return False, repr(result)[:120]


async def _inspect(owner: Tenant, other: Tenant, tenants: list[Tenant], prefix_tokens: list[int],
                   uris: dict[str, str], compat_id: bytes) -> tuple[list[str], int]:
    """The leaks of *owner*'s data to *other*'s principals, and the number of checks made."""
    from kvsp_client.api import KvspApi
    from kvsp_quic.fields import CompatId, ScopeId
    from kvsp_quic.records import LookupRequest

    leaks: list[str] = []
    checks = 0
    mine, theirs = KvspApi(owner.client), KvspApi(other.client)
    their_frontend = KvspApi(other.as_frontend)
    index = uris["index"]
    keys = tuple(owner.keyer.keys(prefix_tokens))
    own = await mine.lookup(index, LookupRequest(ScopeId(owner.scope_id), CompatId(compat_id), keys))
    if not own.matched:
        leaks.append(f"check not meaningful: {owner.name}'s own lookup of its prefix matched nothing")
    # 1. lookups at the Index Service with the other tenant's certificate
    for scope in (owner.scope_id, other.scope_id):
        checks += 1
        refused, how = await _refused(theirs.lookup(index, LookupRequest(ScopeId(scope), CompatId(compat_id), keys)))
        if not refused and "matched=0" not in how:
            leaks.append(f"{other.name}'s lookup of {owner.name}'s keys in scope {scope.hex()[:8]} answered {how}")
    # 2. every replica the owner can find: the other tenant's GET is refused
    holders = {r.holder for m in own.blocks for r in m.replicas if r.holder.startswith("https://")}
    holders |= {uris["holder"], owner.instance}
    for holder in sorted(holders):
        for key in keys[:4]:
            checks += 1
            refused, how = await _refused(_read_block(theirs, holder, compat_id, owner.scope_id, key))
            if not refused:
                leaks.append(f"{other.name} read {owner.name}'s block {key.hex()[:8]} at {holder}: {how}")
    # 3. sessions at the PC and token streams at the instance
    instances = {t.instance: t.name for t in tenants}
    owner_pc = KvspApi(owner.as_frontend)
    for session in owner.sessions:
        info = await owner_pc.session_info(index, session)
        checks += 1
        if info.instance is not None and instances.get(info.instance) != owner.name:
            leaks.append(f"{owner.name}'s session {session} was placed on {instances.get(info.instance)}'s "
                         f"instance {info.instance}")
        checks += 1
        refused, how = await _refused(their_frontend.session_info(index, session))
        if not refused:
            leaks.append(f"{other.name}'s front end read {owner.name}'s session {session}: {how}")
        for api in (their_frontend, theirs):
            checks += 1
            refused, how = await _refused(_first_token(api, info.instance or owner.instance, session))
            if not refused:
                leaks.append(f"{other.name} read {owner.name}'s tokens of session {session}: {how}")
    # 4. the relay's status (what the owner itself sees there is reported beside: relay_namespaces)
    checks += 1
    shown = await _relay_namespaces(other.client, uris["relay"], owner.scope_id)
    if shown:
        leaks.append(f"the relay lists {owner.name}'s namespaces to {other.name}: {shown[:2]}")
    return leaks, checks


async def _publish_namespace(t: Tenant, certs: Path, relay_port: int, compat_id: bytes) -> Any:
    """A MOQT session of *t*'s instance (its certificate) to the relay, announcing the namespace of its raw blocks
    (PUBLISH_NAMESPACE): the relay's ``status`` then has a namespace of each tenant to show or hide."""
    from kvsp_quic.keys import uri_id
    from kvsp_quic.records import kvsp_track_namespace
    from moqt.aio.endpoints import connect_moqt
    from quic.tls import TlsFiles

    name = f"instance-{t.name}"
    conn = await connect_moqt("127.0.0.1", relay_port, TlsFiles(certs / "ca.pem", certs / f"{name}.pem",
                                                               certs / f"{name}.key"), timeout=10)
    try:
        await conn.publish_namespace(kvsp_track_namespace(compat_id, t.scope_id, uri_id(t.instance), 0))
    except BaseException:
        await conn.aclose()
        raise
    return conn


async def _relay_namespaces(client: Any, relay: str, scope_id: bytes) -> list[str]:
    """The namespaces of *scope_id* the relay's ``GET status`` lists to *client*'s principal."""
    response = await client.request("GET", f"{relay}status")
    body = json.loads(response.content or b"{}") if response.status == 200 else {}
    return [str(n) for n in body.get("namespaces", []) if scope_id.hex() in str(n)]


async def _read_block(api: Any, holder: str, compat_id: bytes, scope_id: bytes, key: bytes) -> Any:
    from kvsp_client.api import Miss

    got = await api.get_block(holder, compat_id, scope_id, key)
    if isinstance(got, Miss):
        return got
    octets = await got.aread()
    return f"{len(octets)} octets"


async def _first_token(api: Any, instance: str, session: uuid.UUID) -> Any:
    async with api.tokens(instance, session, 0, timeout=10) as lines:
        async for line in lines:
            return line
    return None


def render_tenants(report: dict[str, Any]) -> str:
    lines = [f"kvsp-quic demo --tenants {len(report['tenants'])}: report"]
    for name, r in report["tenants"].items():
        lines += [f"  tenant {name}",
                  f"    requests through its front end       {r['requests']}",
                  f"    prompt tokens fetched / recomputed   {r['fetched_tokens']:.0f} / {r['recomputed_tokens']:.0f}",
                  f"    cache hits of its first request      {r['first_request_fetched_tokens']:.0f} tokens",
                  f"    its namespaces at the relay (to it)  {r['relay_namespaces']}",
                  f"    cross-tenant checks / leaks          {r['leak_checks']} / {len(r['leaks'])}"]
        lines += [f"      LEAK: {leak}" for leak in r["leaks"]]
    lines.append(f"  leaks                                  {report['leaks']}  "
                 f"{'(ok)' if report['leaks'] == 0 else '(NOT OK)'}")
    return "\n".join(lines)
