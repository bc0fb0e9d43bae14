"""The test cases of the interop matrix: each drives one client implementation against our servers (HTTP cases an
HTTP driver, MOQT cases a MOQT driver of interop/moqt_drivers.py; each kind is "unsupported" for the other).

A case gets the :class:`Env` (the running servers, the principals' certificates, a setup client) and a
:class:`~interop.drivers.Driver`; it passes by returning, fails by raising AssertionError, and is unsupported by
raising :class:`~interop.drivers.Unsupported`. Setup steps that are not what the case tests (storing the block a
GET case reads) go through ``env.setup``, our own client, so a peer is judged only on the exchange under test.

The inference cases (prefetch, instance-state, checkpoint-resume, reshard-commit-abort) run against a real
``kvsp-quic instance --device cpu`` (a tiny random model, blocks of 4 tokens; interop/servers.py), which reports to
the index process's Placement Controller, once per engine: the plain names against ``--engine reference``, the
names ending in ``@transformers`` against ``--engine transformers`` (the instance is the implementation parameter
of those rows). Their resources need the controller role: the driver sends them with the PC's own certificate
(principal ``controller``, the identity the PC itself uses towards instances); checkpoints go to the PC with the
instance's own certificate (principal ``ii``, ``ii-transformers``), since the PC takes them only from the instance
serving the session. The cross-engine cases compute a prompt on one engine's instance and load its blocks on the
other engine's, both ways, over HTTP/3 (instances started with ``--no-moqt``) or over MOQT, and check that the
loading instance's greedy tokens are the computing one's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from http3.client import KvspClient
from interop.drivers import NO_HEADERS, Driver, Refused, Reply, Request, Unsupported
from interop.moqrs_drivers import NEEDS_ANNOUNCEMENT
from interop.moqt_drivers import ALPN, MoqtDriver, OursMoqt
from interop.servers import DEV_IDENTITY, INSTANCES
from kvsp_client.api import KvspApi
from kvsp_client.retrieval import BlockFetcher, HttpSource
from kvsp_moqt.source import MoqtSource, PreferMoqt
from kvsp_moqt.tracks import moqt_record, track_name, track_namespace
from kvsp_quic import container
from kvsp_quic.compat import CompatDescriptor, InstanceState
from kvsp_quic.fields import BlockKey, CompatId
from kvsp_quic.keys import BlockKeyer, holder_id, instance_id
from kvsp_quic.records import (
    CheckpointAck,
    InstanceStatusRecord,
    LeaseRenewal,
    LeaseRequest,
    LeaseResponse,
    Link,
    LookupMatch,
    LookupRequest,
    LookupResponse,
    PrefetchBlock,
    PrefetchDirective,
    PrefetchState,
    PrefetchStatus,
    ReplicaRecord,
    ResidencyEntry,
    Sampler,
    SessionCheckpoint,
    StateMessage,
)
from kvsp_quic.roles.controller_records import (
    SessionInfo,
    SessionRequest,
    SessionResume,
    SessionStart,
    SessionState,
    TokenLine,
)
from kvsp_quic.samples import random_sections
from moqt.aio import MoqtPool
from quic.tls import TlsFiles

JSON = {"content-type": "application/kvsp+json"}
BLOCK = {"content-type": "application/kvsp-block", "if-none-match": "*"}
KVSP = "https://iana.org/assignments/kvsp#"


@dataclass(frozen=True)
class Inference:
    """An inference instance of the run (``kvsp-quic instance --device cpu``), as the cases see it."""

    uri: str  # its base URI, which is also its identity (principal "ii" for the reference instance)
    instance_id: str
    descriptor: CompatDescriptor  # its cache (the holder serves it too)
    keyer: BlockKeyer  # the cases' scope (the instance holds its key), the instance's compat_id and block size
    name: str = "reference"  # in interop.servers.INSTANCES
    principal: str = "ii"  # the name of its own certificate (Env.tls)
    moqt: str = ""  # moqt://host:port/ of its replicas' twins


@dataclass
class Env:
    index: str  # base URIs of our servers (the index process is the Placement Controller too)
    holder: str
    # principal name -> its files: "dev", "expired", "foreign", "instance" (a fake instance: a certificate, no
    # server), "controller" (the PC's own certificate) and "ii" (the inference instance's own certificate)
    tls: Callable[[str], TlsFiles]
    instance_uri: str  # the base URI in the "instance" certificate
    setup: KvspClient  # our client, as the dev principal
    instance_client: KvspClient  # our client, as the instance principal
    descriptor: CompatDescriptor
    keyer: BlockKeyer
    counter: int = 0
    holder_moqt: str = ""  # moqt://host:port/ of the holder (same UDP port as its HTTP/3)
    relay: str = ""  # base URI of the relay (GET status)
    relay_moqt: str = ""  # moqt://host:port/ of the relay
    instances: dict[str, Inference] = dataclasses.field(default_factory=dict)  # the ones the run started, by name
    instance_missing: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> why not (unsupported)
    instance_error: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> why it did not start (fail)
    current: str = "reference"  # the instance of the case being run (set by the case's wrapper: on_instance)

    @property
    def api(self) -> KvspApi:
        """The typed client over ``setup`` (setup steps: not what a case tests)."""
        return KvspApi(self.setup)

    async def report_status(self, record: InstanceStatusRecord) -> InstanceState:
        """A status report to the PC as the (fake) instance principal."""
        return await KvspApi(self.instance_client).put_status(self.index, record)

    def fresh(self) -> int:
        """A number no other cell has used: every cell works on its own keys."""
        self.counter += 1
        return self.counter


Case = Callable[[Env, Driver], Awaitable[None]]


@dataclass(frozen=True)
class CaseInfo:
    name: str
    resource: str  # the spec resource (or MOQT feature) it covers
    run: Case | None  # None: no server of ours implements it yet
    why_not: str = ""
    instances: tuple[str, ...] = ()  # the inference instances it needs: the runner starts only those

    @property
    def needs_instance(self) -> bool:
        return bool(self.instances)


def expect(reply: Reply | Refused, status: int, what: str) -> Reply:
    assert isinstance(reply, Reply), f"{what}: no HTTP exchange ({reply.reason if isinstance(reply, Refused) else ''})"
    assert reply.status == status, f"{what}: status {reply.status}, expected {status}: {reply.body[:300]!r}"
    return reply


def expect_problem(reply: Reply | Refused, status: int, suffix: str | None, what: str) -> None:
    r = expect(reply, status, what)
    assert r.headers.get("content-type", "").startswith("application/problem+json"), f"{what}: not problem+json"
    if suffix is not None:
        assert json.loads(r.body)["type"] == KVSP + suffix, f"{what}: problem type {json.loads(r.body)['type']}"


def block_of(env: Env, n: int) -> tuple[bytes, bytes, Any]:
    """Block *n* of a prompt of its own: key, container octets, encoded container."""
    tokens = list(range(n * 1000, n * 1000 + env.descriptor.block_tokens))
    key = env.keyer.keys(tokens)[-1]
    enc = container.encode(random_sections(env.descriptor, env.descriptor.block_tokens, 0,
                                           env.descriptor.layers - 1, seed=n),
                           first_layer=0, token_count=env.descriptor.block_tokens, descriptor=env.descriptor)
    return key, enc.tobytes(), enc


def block_url(env: Env, key: bytes, query: str = "", compat_id: bytes | None = None) -> str:
    compat = (compat_id or env.descriptor.compat_id).hex()
    return f"{env.holder}blocks/{compat}/{env.keyer.scope_id.hex()}/{key.hex()}" + (f"?{query}" if query else "")


def replica_record(env: Env, key: bytes, holder: str, ttl_ms: int = 60_000) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(key + bytes([i])).digest() for i in range(env.descriptor.layers))
    return ReplicaRecord(BlockKey(key), env.descriptor.compat_id, env.keyer.scope_id, holder, 1, 1 << 20,
                         hashlib.sha256(b"".join(digests)).digest(),
                         (ResidencyEntry("host", (0, env.descriptor.layers - 1)),), ttl_ms, digests)


async def stored(env: Env, n: int) -> tuple[bytes, bytes, Any]:
    key, body, enc = block_of(env, n)
    record = await env.api.put_block(env.holder, env.descriptor.compat_id, env.keyer.scope_id, key, body)
    assert record.block_key == key, f"setup: storing block {n} gave the record of {record.block_key.hex()}"
    return key, body, enc


def send(driver: Driver, env: Env, who: str = "dev") -> Callable[..., Awaitable[Reply | Refused]]:
    async def call(method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None,
                   log: list[str] | None = None) -> Reply | Refused:
        request = Request(method, url, body, headers or {})
        return await driver.send(request, env.tls(who), log if log is not None else [])
    return call


# -- the cases ---------------------------------------------------------------------------------------------------


async def mtls_refused(env: Env, driver: Driver) -> None:
    for who in ("expired", "foreign"):
        reply = await send(driver, env, who)("GET", f"{env.holder}blocks/00/00/00")
        assert isinstance(reply, Refused), f"a client with the {who} certificate got HTTP status {reply.status}"


async def replica_publish_refresh_withdraw(env: Env, driver: Driver) -> None:
    call = send(driver, env)
    key = hashlib.sha256(b"replica %d" % env.fresh()).digest()
    holder = "https://h-interop.example/kvsp/"
    url = f"{env.index}replicas/{holder_id(holder)}/{key.hex()}"
    body = dumps(replica_record(env, key, holder).to_json())
    created = expect(await call("PUT", url, body, JSON), 201, "publish")
    assert ReplicaRecord.loads(created.body).block_key == key
    expect(await call("PUT", url, body, JSON), 200, "refresh")
    expect(await call("DELETE", url), 204, "withdraw")
    expect_problem(await call("DELETE", url), 404, "kvsp-not-found", "withdraw again")


async def lookup_with_estimates(env: Env, driver: Driver) -> None:
    call = send(driver, env)
    n = env.fresh()
    key, _, _ = await stored(env, 10_000 + n)  # the holder publishes it to the index
    status = InstanceStatusRecord(env.instance_uri, 1000 + n, InstanceState.ACTIVE, 30_000, prefill_tokens_per_s=10_000,
                                  links=(Link(env.holder, 10_000, 50),))
    await env.report_status(status)
    request = LookupRequest(env.keyer.scope_id, env.descriptor.compat_id,
                            (BlockKey(key), BlockKey(hashlib.sha256(b"absent").digest())), (env.instance_uri,))
    for _ in range(100):  # the holder publishes asynchronously
        reply = expect(await call("POST", f"{env.index}lookup", dumps(request.to_json()), JSON), 200, "lookup")
        answer = LookupResponse.loads(reply.body)
        if answer.matched == 1:
            break
        await asyncio.sleep(0.05)
    assert answer.matched == 1 and answer.blocks[0].replicas[0].holder == env.holder, answer
    assert answer.targets, answer
    target = answer.targets[0]
    assert target.instance == env.instance_uri and target.fetch_us > 0 and target.recompute_us > 0, target


async def instance_status(env: Env, driver: Driver) -> None:
    call = send(driver, env, "instance")
    url = f"{env.index}instances/{instance_id(env.instance_uri)}/status"
    epoch = 10**9 + env.fresh() * 10
    record = InstanceStatusRecord(env.instance_uri, epoch, InstanceState.ACTIVE, 30_000)
    reply = expect(await call("PUT", url, dumps(record.to_json()), JSON), 200, "status")
    assert StateMessage.loads(reply.body) == StateMessage(InstanceState.ACTIVE), reply.body
    stale = dataclasses.replace(record, epoch=epoch - 1)
    expect_problem(await call("PUT", url, dumps(stale.to_json()), JSON), 409, "kvsp-stale-epoch", "stale epoch")


async def block_put_and_412(env: Env, driver: Driver) -> None:
    call = send(driver, env)
    key, body, _ = block_of(env, 20_000 + env.fresh())
    created = expect(await call("PUT", block_url(env, key), body, BLOCK), 201, "store")
    assert ReplicaRecord.loads(created.body).block_key == key
    expect(await call("PUT", block_url(env, key), body, BLOCK), 412, "store again")


def _check_repr_digest(reply: Reply) -> None:
    field_ = reply.headers.get("repr-digest", "")
    assert field_.startswith("sha-256=:") and field_.endswith(":"), f"Repr-Digest {field_!r}"
    assert base64.b64decode(field_[9:-1]) == hashlib.sha256(reply.body).digest(), "Repr-Digest does not match"


async def block_get_whole(env: Env, driver: Driver) -> None:
    key, body, _ = await stored(env, 30_000 + env.fresh())
    reply = expect(await send(driver, env)("GET", block_url(env, key)), 200, "GET")
    assert reply.body == body, "the container differs from the one stored"
    _check_repr_digest(reply)
    assert reply.headers.get("cache-control", "").startswith("private, immutable"), reply.headers


async def block_get_layers(env: Env, driver: Driver) -> None:
    key, _, enc = await stored(env, 40_000 + env.fresh())
    reply = expect(await send(driver, env)("GET", block_url(env, key, "layers=3-5")), 200, "GET layers")
    _check_repr_digest(reply)
    header, layers = container.decode(reply.body, env.descriptor,
                                      expected_layer_digests=enc.layer_digests)  # verified layer by layer
    assert [layer.index for layer in layers] == [3, 4, 5] and header.first_layer == 3


async def block_not_found(env: Env, driver: Driver) -> None:
    key = hashlib.sha256(b"never stored %d" % env.fresh()).digest()
    expect_problem(await send(driver, env)("GET", block_url(env, key)), 404, "kvsp-not-found", "GET unknown")


async def lease_lifecycle(env: Env, driver: Driver) -> None:
    call = send(driver, env)
    key, _, _ = await stored(env, 50_000 + env.fresh())
    request = LeaseRequest(env.descriptor.compat_id, env.keyer.scope_id, (BlockKey(key),), 5000)
    created = expect(await call("POST", f"{env.holder}leases", dumps(request.to_json()), JSON), 201, "lease")
    lease = LeaseResponse.loads(created.body)
    assert created.headers.get("location") == f"leases/{lease.lease}" and lease.block_keys == (key,)
    url = f"{env.holder}leases/{lease.lease}"
    renewed = expect(await call("PUT", url, dumps(LeaseRenewal(4000).to_json()), JSON), 200, "renew")
    assert LeaseResponse.loads(renewed.body).ttl_ms == 4000
    expect(await call("DELETE", url), 204, "release")
    expect_problem(await call("DELETE", url), 404, "kvsp-not-found", "release again")


async def lease_quota(env: Env, driver: Driver) -> None:
    key, _, _ = await stored(env, 60_000 + env.fresh())
    request = LeaseRequest(env.descriptor.compat_id, env.keyer.scope_id, (BlockKey(key),),
                           10**9)  # far above the holder's maximum lease TTL
    reply = await send(driver, env)("POST", f"{env.holder}leases", dumps(request.to_json()), JSON)
    expect_problem(reply, 429, "kvsp-lease-quota", "lease over quota")


# -- MOQT (issue #5) ----------------------------------------------------------------------------------------------


def moqt_driver(driver: Driver) -> MoqtDriver:
    if not isinstance(driver, MoqtDriver):
        raise Unsupported("an HTTP client: the case is a MOQT exchange")
    return driver


def block_track(env: Env, key: bytes, holder: str) -> tuple[tuple[bytes, ...], bytes]:
    return track_namespace(env.descriptor.compat_id, env.keyer.scope_id, holder, 1), track_name(key)


async def lookup(env: Env, key: bytes, compat_id: bytes | None = None) -> list[ReplicaRecord]:
    request = LookupRequest(env.keyer.scope_id, CompatId(compat_id or env.descriptor.compat_id), (BlockKey(key),))
    answer = await env.api.lookup(env.index, request)
    return [rec for block in answer.blocks for rec in block.replicas]


async def until_published(env: Env, key: bytes, holder: str, compat_id: bytes | None = None) -> ReplicaRecord:
    """The record of *key* with *holder* at the Index Service (holders and relays publish asynchronously)."""
    for _ in range(200):
        for record in await lookup(env, key, compat_id):
            if record.holder == holder:
                return record
        await asyncio.sleep(0.05)
    raise AssertionError(f"no record of {key.hex()[:16]}... with holder {holder} at the Index Service")


async def moqt_setup(env: Env, driver: Driver) -> None:
    d = moqt_driver(driver)
    for uri in (env.holder_moqt, env.relay_moqt):
        draft = await d.setup(uri, env.tls("dev"))
        assert draft == d.draft, f"SETUP with {uri} negotiated draft {draft}, not {d.draft}"


async def moqt_publish_namespace(env: Env, driver: Driver) -> None:
    d = moqt_driver(driver)
    scope = env.keyer.scope_id.hex().encode()
    own = (b"kvsp-1", env.descriptor.compat_id.hex().encode(), scope, holder_id(DEV_IDENTITY).encode())
    code = await d.publish_namespace(env.relay_moqt, env.tls("dev"), own)
    assert code is None, f"PUBLISH_NAMESPACE of the identity's own holder-id refused with 0x{code or 0:x}"
    other = (*own[:3], holder_id("https://h-other.example/kvsp/").encode())
    code = await d.publish_namespace(env.relay_moqt, env.tls("dev"), other)
    assert code == 0x1, f"PUBLISH_NAMESPACE of another holder's namespace: {code!r}, expected UNAUTHORIZED (0x1)"


async def moqt_fetch_block(env: Env, driver: Driver) -> None:
    d = moqt_driver(driver)
    if d.needs_announcement:  # moq-rs; diagnosed in interop/moqrs_drivers.py
        raise Unsupported(NEEDS_ANNOUNCEMENT.format(where="our holder (it answers SUBSCRIBE_NAMESPACE with "
                                                          "NOT_SUPPORTED)"))
    key, _, enc = await stored(env, 70_000 + env.fresh())
    namespace, name = block_track(env, key, env.holder)
    got = await d.fetch(env.holder_moqt, env.tls("dev"), namespace, name)
    assert got == [list(enc.layer_digests)], "the objects are not the block's layers (SHA-256 per object)"


async def moqt_relay_fan_out(env: Env, driver: Driver) -> None:
    d = moqt_driver(driver)
    if d.needs_announcement:  # moq-rs: moqt-kvsp-announced is this case with the namespace published
        raise Unsupported(NEEDS_ANNOUNCEMENT.format(where="the relay, for a block it finds through the Index "
                                                          "Service,"))
    key, _, enc = await stored(env, 80_000 + env.fresh())
    await until_published(env, key, env.holder_moqt)  # the relay finds the holder through the Index Service
    before = await relay_metrics(env)
    namespace, name = block_track(env, key, env.holder)
    got = await d.fetch(env.relay_moqt, env.tls("dev"), namespace, name, clients=4)
    assert got == [list(enc.layer_digests)] * 4, "a subscriber did not get the block's layers through the relay"
    after = await relay_metrics(env)
    upstream = after.get("upstream_fetches", 0) - before.get("upstream_fetches", 0)
    assert upstream == 1, f"4 concurrent FETCHes made {upstream} upstream FETCHes (expected 1: coalesced)"
    record = await until_published(env, key, env.relay_moqt)  # and the relay advertises its copy
    assert record.layer_digests == tuple(enc.layer_digests), "the relay's record differs"


async def relay_metrics(env: Env) -> dict[str, int]:
    r = await env.setup.request("GET", f"{env.relay}status")
    assert r.status == 200, f"relay status: {r.status}"
    metrics: dict[str, int] = json.loads(r.content or b"{}")["metrics"]
    return metrics


async def moqt_http_fallback(env: Env, driver: Driver) -> None:
    d = moqt_driver(driver)
    if not isinstance(d, OursMoqt):
        raise Unsupported(f"{d.name.rsplit('-moqt', 1)[0]} is a MOQT library: it has no HTTP fallback")
    key, body, _ = await stored(env, 90_000 + env.fresh())
    https = await until_published(env, key, env.holder)
    async with MoqtPool(env.tls("dev"), alpn=ALPN[d.draft], connect_timeout=3) as pool:

        async def fetch(twin: ReplicaRecord) -> tuple[Any, BlockFetcher]:
            fetcher = BlockFetcher(env.setup, env.index, descriptors=[env.descriptor], ranking=PreferMoqt(),
                                   sources=[MoqtSource(pool, [env.descriptor], accept_timeout=3, stall_timeout=3),
                                            HttpSource(env.setup)], withdraw_corrupt=False)
            return await fetcher.fetch_block(LookupMatch(https.block_key, (https, twin))), fetcher

        result, _ = await fetch(moqt_record(https, env.holder_moqt))  # MOQT works: it is used
        assert result is not None and result.transports == (f"MOQT/{d.draft}",), result and result.transports
        no_moqt = "moqt://" + env.index.split("://", 1)[1].split("/", 1)[0] + "/"  # the index offers h3 only
        result, fetcher = await fetch(moqt_record(https, no_moqt))
        assert result is not None and result.tobytes() == body, "no verified block after the fallback"
        assert not any(t.startswith("MOQT") for t in result.transports), result.transports
        assert fetcher.metrics.transport_errors == 1, "the MOQT attempt should have failed in the handshake"


# -- the inference instance and the Placement Controller (issues #6, #7) ------------------------------------------

GREEDY = Sampler("greedy", 0, 0, True)
WAIT_S = 10.0  # how long a case waits for something asynchronous (a load, a session's end) before failing


def inference(env: Env, driver: Driver, name: str | None = None) -> Inference:
    """Instance *name* (default: the case's), for a driver that can play an inference case; checked before any setup
    is spent on the cell."""
    if isinstance(driver, MoqtDriver):
        raise Unsupported("a MOQT client: the case is an HTTP exchange")
    if not driver.sets_headers:
        raise Unsupported(NO_HEADERS)  # every request of these cases carries Content-Type: application/kvsp+json
    name = name or env.current
    ii = env.instances.get(name)
    if ii is None:
        if name in env.instance_error:
            raise AssertionError(env.instance_error[name])
        raise Unsupported(env.instance_missing.get(name, f"the {name} instance was not started for this run"))
    return ii


def on_instance(name: str, case: Case) -> Case:
    """*case* against instance *name*: the matrix's rows per engine."""
    async def run(env: Env, driver: Driver) -> None:
        env.current = name
        try:
            await case(env, driver)
        finally:
            env.current = "reference"

    return run


@contextlib.asynccontextmanager
async def alone_at_pc(env: Env, ii: Inference) -> AsyncIterator[None]:
    """The other inference instances sleep (through the PC) while the block runs, so that the PC places sessions on
    *ii*; they are active again at the PC afterwards."""
    others = [x for x in env.instances.values() if x.uri != ii.uri]
    try:
        for other in others:
            await setup_call(env, "PUT", f"{env.index}instances/{other.instance_id}/state",
                             StateMessage(InstanceState.SLEEPING).to_json())
        yield
    finally:
        for other in others:
            await until_active_at_pc(env, other)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def body_of(reply: Reply) -> Any:
    return json.loads(reply.body)


async def setup_call(env: Env, method: str, url: str, obj: Any = None) -> Any:
    """A setup request (our client, as dev) that must succeed; its JSON answer."""
    r = await env.setup.request(method, url, content=dumps(obj) if obj is not None else None,
                                headers=JSON if obj is not None else None)
    assert 200 <= r.status < 300, f"setup: {method} {url} gave {r.status}: {(r.content or b'')[:300]!r}"
    return json.loads(r.content) if r.content else None


async def stored_context(env: Env, ii: Inference, n: int, count: int) -> list[bytes]:
    """The first *count* blocks of a context of its own, stored at the holder as blocks of the instance's cache
    (random K and V: nothing computes them) and published by it: their Block Keys."""
    d = ii.descriptor
    keys = [bytes(k) for k in ii.keyer.keys(list(range(n * 1000, n * 1000 + count * d.block_tokens)))]
    for i, key in enumerate(keys):
        enc = container.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, seed=n * 64 + i), first_layer=0,
                               token_count=d.block_tokens, descriptor=d)
        await env.api.put_block(env.holder, d.compat_id, ii.keyer.scope_id, key, enc.tobytes())
    for key in keys:
        await until_published(env, key, env.holder, d.compat_id)
    return keys


async def pc_instances(env: Env) -> list[dict[str, Any]]:
    listing: list[dict[str, Any]] = (await setup_call(env, "GET", f"{env.index}instances"))["instances"]
    return listing


async def until_active_at_pc(env: Env, ii: Inference) -> None:
    """Wait until the PC holds the instance active, setting it active through the PC (``PUT instances/{id}/state``)
    while it holds it sleeping: a sleeping instance stays so at the PC, whatever it reports, until the PC wakes it."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    entry: dict[str, Any] = {}
    while asyncio.get_running_loop().time() < deadline:
        entry = next((x for x in await pc_instances(env) if x["instance"] == ii.uri), {})
        if entry.get("state") == "active" and entry.get("reported_state") == "active":
            return
        if entry.get("state") in ("sleeping", "draining"):
            await setup_call(env, "PUT", f"{env.index}instances/{ii.instance_id}/state",
                             StateMessage(InstanceState.ACTIVE).to_json())
        await asyncio.sleep(0.05)
    raise AssertionError(f"the PC does not hold the instance active: {entry}")


async def retire_fake_instance(env: Env) -> None:
    """The lookup and instance-status cases leave the fake instance (a certificate, no server) active at the PC for
    30 s; the PC would try to place sessions on it. Reported failed at the epoch it last reported, it is no
    candidate."""
    for entry in await pc_instances(env):
        if entry["instance"] == env.instance_uri and entry["state"] != "failed":
            await env.report_status(InstanceStatusRecord(env.instance_uri, entry["epoch"], InstanceState.FAILED, 1000))


def prompt_of(n: int, length: int) -> list[int]:
    return [(n * 31 + 7 * i) % 256 for i in range(length)]  # token ids inside the tiny model's vocabulary


def checkpoint_of(ii: Inference, session: uuid.UUID, epoch: int, prompt: list[int], generated: list[int],
                  offset: int) -> SessionCheckpoint:
    keys = ii.keyer.keys(prompt)
    return SessionCheckpoint(session, epoch, ii.descriptor.compat_id, ii.keyer.scope_id, tuple(keys),
                             tuple(prompt[len(keys) * ii.descriptor.block_tokens:]), tuple(generated[:offset]), offset,
                             dataclasses.replace(GREEDY, step=offset))


async def token_lines(env: Env, ii: Inference, session: uuid.UUID) -> list[TokenLine]:
    """``GET {ii}sessions/{id}/tokens?from=0`` to its end (the run finished, or was fenced: no final line)."""
    async with env.api.tokens(ii.uri, session, 0) as lines:
        return [line async for line in lines]


async def prefetch(env: Env, driver: Driver) -> None:
    ii = inference(env, driver)
    call = send(driver, env, "controller")
    expect_problem(await call("GET", f"{ii.uri}prefetch/{uuid.uuid4()}"), 404, "kvsp-not-found", "unknown directive")
    n = env.fresh()
    keys = await stored_context(env, ii, 100_000 + n, 2)
    directive = uuid.uuid4()
    record = PrefetchDirective(directive, ii.keyer.scope_id, ii.descriptor.compat_id,
                               tuple(PrefetchBlock(BlockKey(k), (env.holder,)) for k in keys), 5000, 5000,
                               request_ref=f"interop-{n}")
    body = record.to_json()
    accepted = expect(await call("POST", f"{ii.uri}prefetch", dumps(body), JSON), 202, "prefetch")
    assert accepted.headers.get("location") == f"prefetch/{directive}", f"Location: {accepted.headers}"
    status = PrefetchStatus.loads(accepted.body)
    running = (PrefetchState.PENDING, PrefetchState.PARTIAL, PrefetchState.COMPLETE)
    assert status.directive == directive and status.state in running, status
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        reply = expect(await call("GET", f"{ii.uri}prefetch/{directive}"), 200, "GET prefetch/{id}")
        status = PrefetchStatus.loads(reply.body)
        assert status.state in running, status
        if status.state is not PrefetchState.PENDING or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert status.state is PrefetchState.COMPLETE and status.loaded == tuple(keys), status
    again = expect(await call("POST", f"{ii.uri}prefetch", dumps(body), JSON), 202, "the same directive again")
    assert PrefetchStatus.loads(again.body) == status, "a re-sent directive is answered with its current status"
    other = dataclasses.replace(record, deadline_ms=4000).to_json()
    expect_problem(await call("POST", f"{ii.uri}prefetch", dumps(other), JSON), 409, None,
                   "the directive's id with other contents")
    await until_published(env, keys[0], ii.uri, ii.descriptor.compat_id)  # a loaded block is the instance's replica


async def instance_state(env: Env, driver: Driver) -> None:
    ii = inference(env, driver)
    call = send(driver, env, "controller")
    await until_active_at_pc(env, ii)
    try:
        asleep = (InstanceState.DRAINING, InstanceState.SLEEPING)
        draining = dumps(StateMessage(InstanceState.DRAINING).to_json())
        drained = expect(await call("PUT", f"{ii.uri}state", draining, JSON), 200, "draining")
        # with no session in flight a draining instance is sleeping at once
        assert StateMessage.loads(drained.body).state in asleep, drained.body
        sid = uuid.uuid4()
        start = SessionStart(sid, 1, ii.keyer.scope_id, ii.descriptor.compat_id, tuple(prompt_of(env.fresh(), 6)),
                             4, GREEDY)
        expect_problem(await call("POST", f"{ii.uri}sessions/{sid}/start", dumps(start.to_json()), JSON), 409,
                       "kvsp-invalid-state", "a session start while draining")
        status = InstanceStatusRecord.loads(expect(await call("GET", f"{ii.uri}status"), 200, "GET status").body)
        assert status.state in asleep and status.instance == ii.uri, status
        active = dumps(StateMessage(InstanceState.ACTIVE).to_json())
        woken = expect(await call("PUT", f"{ii.uri}state", active, JSON), 200, "active")
        assert StateMessage.loads(woken.body) == StateMessage(InstanceState.ACTIVE), woken.body
        failed = dumps(StateMessage(InstanceState.FAILED).to_json())
        expect_problem(await call("PUT", f"{ii.uri}state", failed, JSON), 409, "kvsp-invalid-state",
                       "PUT state failed")
    finally:  # whatever happened, the instance serves again, and the PC knows it
        await env.api.set_state(ii.uri, InstanceState.ACTIVE)
        await until_active_at_pc(env, ii)


async def checkpoint_resume(env: Env, driver: Driver) -> None:
    ii = inference(env, driver)
    n = env.fresh()
    await retire_fake_instance(env)
    await until_active_at_pc(env, ii)
    # setup: a session through the PC (as the front end would), run to its end by the instance
    sid, prompt, max_tokens = uuid.uuid4(), prompt_of(n, 6), 8
    request = SessionRequest(sid, ii.keyer.scope_id, ii.descriptor.compat_id, tuple(prompt), max_tokens, GREEDY)
    async with alone_at_pc(env, ii):
        info = await env.api.create_session(env.index, request)
        assert info.instance == ii.uri, f"setup: the PC placed the session on {info.instance}"
        epoch = info.epoch
        lines = await token_lines(env, ii, sid)
    tokens = [x.token for x in lines if x.token is not None]
    assert len(tokens) == max_tokens and lines[-1].done, f"setup: the session's stream: {lines}"
    session_url = f"{env.index}sessions/{sid}"
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while (await env.api.session_info(env.index, sid)).state is not SessionState.DONE:  # the last checkpoint
        assert asyncio.get_running_loop().time() < deadline, "setup: the PC never saw the session's last checkpoint"
        await asyncio.sleep(0.05)
    # PUT sessions/{id}/checkpoint, as the instance serving the session
    as_ii = send(driver, env, ii.principal)
    url = f"{session_url}/checkpoint"
    cp = checkpoint_of(ii, sid, epoch, prompt, tokens, 4)
    older = dataclasses.replace(cp, epoch=epoch - 1)
    expect_problem(await as_ii("PUT", url, dumps(older.to_json()), JSON), 409, "kvsp-stale-epoch",
                   "a checkpoint of an older epoch")
    ack = CheckpointAck.loads(expect(await as_ii("PUT", url, dumps(cp.to_json()), JSON), 200, "checkpoint").body)
    assert ack == CheckpointAck(sid, epoch, max_tokens), f"the PC keeps the highest offset it acknowledged: {ack}"
    expect_problem(await send(driver, env)("PUT", url, dumps(cp.to_json()), JSON), 403, None,
                   "a checkpoint from a principal that does not serve the session")
    reply = expect(await send(driver, env)("GET", session_url), 200, "GET sessions/{id}")
    seen = SessionInfo.loads(reply.body)
    assert seen.output_offset == max_tokens and seen.state is SessionState.DONE, reply.body
    assert body_of(reply).get("done") is True, reply.body
    # POST sessions/{id}/resume, as the PC, with that checkpoint under a session id the PC does not know: the
    # resumed run's own checkpoints are then refused with 404, which ends it (as for a session moved elsewhere)
    as_pc = send(driver, env, "controller")
    other = uuid.uuid4()
    resume = SessionResume(epoch + 1, checkpoint_of(ii, other, epoch, prompt, tokens, 4), max_tokens, tuple(prompt))
    admitted = expect(await as_pc("POST", f"{ii.uri}sessions/{other}/resume", dumps(resume.to_json()), JSON), 200,
                      "resume")
    assert CheckpointAck.loads(admitted.body) == CheckpointAck(other, epoch + 1, 4), admitted.body
    stale = SessionResume(epoch, dataclasses.replace(resume.checkpoint, epoch=epoch - 1), max_tokens, tuple(prompt))
    expect_problem(await as_pc("POST", f"{ii.uri}sessions/{other}/resume", dumps(stale.to_json()), JSON), 409,
                   "kvsp-stale-epoch", "a resume at an older epoch")
    resumed = await token_lines(env, ii, other)
    got = [x.token for x in resumed if x.token is not None]
    assert not any(x.failed for x in resumed), resumed[-1]
    assert {x.epoch for x in resumed} == {epoch + 1}, resumed
    # the checkpoint's tokens first; greedy decoding continues exactly as the first run did (as far as it got)
    assert len(got) >= 4 and got == tokens[:len(got)], (got, tokens)


async def reshard_commit_abort(env: Env, driver: Driver) -> None:
    ii = inference(env, driver)
    call = send(driver, env, "controller")
    url = f"{ii.uri}reshard"
    n = env.fresh()
    keys = await stored_context(env, ii, 200_000 + n, 2)
    b = ii.descriptor.block_tokens
    m = f"interop-{n}"
    context = {"compat_id": ii.descriptor.compat_id.hex(), "scope_id": ii.keyer.scope_id.hex(),
               "block_keys": [k.hex() for k in keys]}
    # version 1: the instance fetches the whole context from the holder (named as the range's "from")
    plan = {"map": m, "from": 0, "to": 1, "deadline_ms": 5000, "retain": [], "release": [],
            "fetch": [{"tokens": [0, 2 * b], "from": env.holder}], "context": context}
    acked = expect(await call("POST", url, dumps(plan), JSON), 200, "plan 0 -> 1")
    assert body_of(acked) == {"map": m, "from": 0, "to": 1, "acknowledged": True}, acked.body
    committed = expect(await call("POST", url, dumps({"map": m, "commit": 1}), JSON), 200, "commit 1")
    assert body_of(committed) == {"map": m, "version": 1}, committed.body
    # version 2 would keep block 0 in place and let block 1 go; it is aborted, version 1 stays
    plan = {"map": m, "from": 1, "to": 2, "deadline_ms": 5000, "retain": [[0, b]], "release": [[b, 2 * b]]}
    acked = expect(await call("POST", url, dumps(plan), JSON), 200, "plan 1 -> 2")
    assert body_of(acked) == {"map": m, "from": 1, "to": 2, "acknowledged": True}, acked.body
    aborted = expect(await call("POST", url, dumps({"map": m, "abort": 2}), JSON), 200, "abort 2")
    assert body_of(aborted) == {"map": m, "version": 1}, aborted.body
    expect_problem(await call("POST", url, dumps({"map": m, "abort": 1}), JSON), 409, "kvsp-plan-conflict",
                   "abort of a committed version")
    stale = {"map": m, "from": 0, "to": 1, "deadline_ms": 5000}
    expect_problem(await call("POST", url, dumps(stale), JSON), 409, "kvsp-plan-conflict",
                   "a plan from a version the instance does not hold")


CROSS_PROMPT_BLOCKS = 6  # the computing instance publishes these; one more token is the prompt's tail


async def run_direct(env: Env, call: Callable[..., Awaitable[Reply | Refused]], ii: Inference, prompt: list[int],
                     max_tokens: int) -> tuple[list[int], dict[str, Any]]:
    """A greedy session started on *ii* directly (``POST sessions/{id}/start`` as the PC, no blocks named: the
    instance looks the prompt's blocks up itself), its tokens, and its ``GET sessions/{id}`` once done. The PC does
    not know the session and takes none of its checkpoints: *max_tokens* tokens must not complete a block, so that
    the run's only checkpoint is the final one, after its last token."""
    sid = uuid.uuid4()
    start = SessionStart(sid, 1, ii.keyer.scope_id, ii.descriptor.compat_id, tuple(prompt), max_tokens, GREEDY)
    expect(await call("POST", f"{ii.uri}sessions/{sid}/start", dumps(start.to_json()), JSON), 201,
           f"start on the {ii.name} instance")
    lines = await token_lines(env, ii, sid)
    tokens = [x.token for x in lines if x.token is not None]
    assert not any(x.failed for x in lines), f"the {ii.name} instance's run failed: {lines[-1]}"
    assert len(tokens) == max_tokens, f"the {ii.name} instance gave {len(tokens)} tokens: {lines}"
    info = body_of(expect(await call("GET", f"{ii.uri}sessions/{sid}"), 200, "GET sessions/{id}"))
    return tokens, info


def cross_engine(pairs: tuple[tuple[str, str], ...], transport: str) -> Case:
    """For each (A, B) of *pairs*: a prompt computed and published by instance A is loaded by instance B (of the
    other engine) over *transport* ("HTTP/3" or "MOQT"); B's greedy tokens are A's (fp32: the engines agree within
    float rounding, docs/inference.md "Exact across engines")."""
    async def run(env: Env, driver: Driver) -> None:
        for a_name, b_name in pairs:
            for name in (a_name, b_name):
                inference(env, driver, name)  # unsupported, or failed, before any setup
        call = send(driver, env, "controller")
        for a_name, b_name in pairs:
            a, b = env.instances[a_name], env.instances[b_name]
            assert INSTANCES[a_name].engine != INSTANCES[b_name].engine
            assert a.descriptor == b.descriptor, "setup: the engines derived different descriptors"
            d = a.descriptor
            rng = random.Random(f"cross-engine-{env.fresh()}")  # prompt_of's prompts share blocks 12 numbers apart
            prompt = [rng.randrange(256) for _ in range(CROSS_PROMPT_BLOCKS * d.block_tokens + 1)]
            keys = [bytes(k) for k in a.keyer.keys(prompt)]
            assert len(keys) == CROSS_PROMPT_BLOCKS
            a_tokens, a_info = await run_direct(env, call, a, prompt, 2)
            assert a_info["loaded_blocks"] == 0, f"setup: {a_name} loaded blocks of a fresh prompt: {a_info}"
            for key in keys:  # B must see A's records (the MOQT twin too: B prefers it) before it looks them up
                await until_published(env, key, a.uri, d.compat_id)
                if transport == "MOQT":
                    await until_published(env, key, a.moqt, d.compat_id)
            b_tokens, b_info = await run_direct(env, call, b, prompt, 2)
            sources = b_info["block_sources"]
            assert b_info["loaded_blocks"] == CROSS_PROMPT_BLOCKS, f"{b_name} did not load {a_name}'s blocks: {b_info}"
            assert set(sources) and all(where.startswith(transport) for where in sources), \
                f"{b_name} loaded {a_name}'s blocks over {sources}, not {transport}"
            assert b_tokens == a_tokens, f"{b_name} (loaded) gave {b_tokens}, {a_name} (computed) {a_tokens}"

    return run


# the inference cases: each runs once per engine (the instance is the implementation parameter of its rows)
INFERENCE_CASES: list[tuple[str, str, Case]] = [
    ("prefetch", "II POST prefetch; GET prefetch/{id} (blocks loaded from the holder)", prefetch),
    ("instance-state", "II PUT state (draining: starts refused; active), GET status", instance_state),
    ("checkpoint-resume", "PC PUT sessions/{id}/checkpoint (stale epoch, highest offset); II POST "
     "sessions/{id}/resume", checkpoint_resume),
    ("reshard-commit-abort", "II POST reshard (plan with fetch, commit; plan with retain, abort; conflicts)",
     reshard_commit_abort),
]

CASES: list[CaseInfo] = [
    CaseInfo("mtls-refused", "mutual TLS (every resource)", mtls_refused),
    CaseInfo("replica-publish-refresh-withdraw", "IS PUT, DELETE replicas/{holder-id}/{block_key}",
             replica_publish_refresh_withdraw),
    CaseInfo("lookup-with-estimates", "IS POST lookup (with targets)", lookup_with_estimates),
    CaseInfo("instance-status", "PC PUT instances/{instance-id}/status (served by the index process)",
             instance_status),
    CaseInfo("block-put-412", "Holder PUT blocks/{compat}/{scope}/{block_key}", block_put_and_412),
    CaseInfo("block-get-whole", "Holder GET blocks/... (Repr-Digest)", block_get_whole),
    CaseInfo("block-get-layers", "Holder GET blocks/...?layers=a-b", block_get_layers),
    CaseInfo("block-not-found", "Holder GET blocks/... unknown (problem+json)", block_not_found),
    CaseInfo("lease-lifecycle", "Holder POST leases; PUT, DELETE leases/{id}", lease_lifecycle),
    CaseInfo("lease-quota", "Holder POST leases over quota (kvsp-lease-quota)", lease_quota),
    *(CaseInfo(name + suffix, resource + note, on_instance(instance, run), instances=(instance,))
      for instance, suffix, note in (("reference", "", ""),
                                     ("transformers", "@transformers", " -- kvsp-quic instance --engine transformers"))
      for name, resource, run in INFERENCE_CASES),
    CaseInfo("cross-engine-http3", "II POST sessions/{id}/start: a prompt computed by one engine's instance, its "
             "blocks loaded by the other's over HTTP/3, both ways; the same greedy tokens",
             cross_engine((("reference-h3", "transformers-h3"), ("transformers-h3", "reference-h3")), "HTTP/3"),
             instances=("reference-h3", "transformers-h3")),
    CaseInfo("cross-engine-moqt", "II POST sessions/{id}/start: a prompt computed by one engine's instance, its "
             "blocks loaded by the other's over MOQT, both ways; the same greedy tokens",
             cross_engine((("reference", "transformers"), ("transformers", "reference")), "MOQT"),
             instances=("reference", "transformers")),
    CaseInfo("moqt-setup", "MOQT SETUP with the holder and the relay (mutual TLS; the driver's draft)", moqt_setup),
    CaseInfo("moqt-publish-namespace", "MOQT PUBLISH_NAMESPACE to the relay (own holder-id; another's refused)",
             moqt_publish_namespace),
    CaseInfo("moqt-fetch-block", "MOQT FETCH of a block from the holder (an object per layer, SHA-256 checked)",
             moqt_fetch_block),
    CaseInfo("moqt-relay-fan-out", "MOQT FETCH x4 through the relay: one upstream FETCH; the relay's record",
             moqt_relay_fan_out),
    CaseInfo("moqt-http-fallback", "Retrieval client: MOQT first, HTTP when MOQT is refused", moqt_http_fallback),
]  # and the MOQT cases with moq-rs on the far side: interop/moqt_peer_cases.py (ALL_CASES)
