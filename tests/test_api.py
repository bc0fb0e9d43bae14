"""The typed KVSP API client (kvsp_client/api.py) against real role servers on 127.0.0.1.

The Index Service and a holder are the real apps (``index_app``, ``holder_app``) on RoleServers with mutual TLS.
The Placement Controller and instance resources are served by :class:`ControlPlane`, a small app that reads and
writes the real records (so a contract drift between the client and the records fails here), plus resources that
misbehave on purpose (slow, busy, garbled). The dead-peer test kills a real ``kvsp-quic index`` process.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from http3.client import KvspClient
from http3.server import RoleServer, bind_pair
from kvsp_client.api import Acknowledged, BadResponse, BlockBody, KvspApi, Lease, Miss, RetryElsewhere, Stale
from kvsp_http.app_kit import kvsp_json
from kvsp_http.holder_app import holder_app
from kvsp_http.index_app import index_app
from kvsp_http.problem_response import install
from kvsp_quic import container as c
from kvsp_quic.auth import Policy
from kvsp_quic.compat import CompatDescriptor, InstanceState
from kvsp_quic.fields import BlockKey, RecordError
from kvsp_quic.problems import ScopeDenied, StaleEpoch, Unavailable
from kvsp_quic.records import (
    CheckpointAck,
    InstanceStatusRecord,
    LeaseRequest,
    LookupRequest,
    PrefetchBlock,
    PrefetchDirective,
    PrefetchState,
    PrefetchStatus,
    ReshardCommit,
    Sampler,
    SessionCheckpoint,
    StateMessage,
    parse_reshard,
)
from kvsp_quic.roles.controller_records import (
    SessionInfo,
    SessionRequest,
    SessionResume,
    SessionStart,
    SessionState,
    TokenLine,
)
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.index import IndexService
from kvsp_quic.roles.leases import LeaseLimits
from kvsp_quic.samples import random_sections
from kvsp_quic.storage.memory_index import MemoryIndexStore
from quic.tls import TlsFiles
from tests.helpers import Process
from tests.pki import TestPki, make_pki
from tests.support.descriptors import small_descriptor

SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
OTHER_SCOPE = bytes.fromhex("00112233445566778899aabbccddeeff")
ALICE = "urn:kvsp:client:alice"
INSTANCE_URI = "https://127.0.0.1/ii/"  # a status-reporting instance (a certificate, no server)
GREEDY = Sampler("greedy", 0, 0, True)
D: CompatDescriptor = small_descriptor(layers=4)


def key(n: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"api %d" % n).digest())


def block(n: int) -> bytes:
    return c.encode(list(random_sections(D, D.block_tokens, 0, D.layers - 1, n)), first_layer=0,
                    token_count=D.block_tokens, descriptor=D).tobytes()


# -- the control plane: PC and instance resources from the real records ---------------------------------------------


@dataclass
class ControlPlane:
    """``/pc/`` and ``/ii/`` resources answering with the real records; ``/slow/``, ``/busy/``, ``/garbled/``
    misbehave. ``calls`` counts requests per (method, path)."""

    instance: str = ""
    epoch: int = 1
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    checkpoints: list[tuple[SessionCheckpoint, bool]] = field(default_factory=list)

    def app(self) -> Starlette:
        async def count(request: Request) -> None:
            where = (request.method, request.url.path)
            self.calls[where] = self.calls.get(where, 0) + 1

        async def create_session(request: Request) -> Response:
            await count(request)
            body = SessionRequest.loads(await request.body())
            return kvsp_json(SessionInfo(body.session, self.epoch, 0, SessionState.RUNNING, self.instance).to_json(),
                             201)

        async def session_info(request: Request) -> Response:
            sid = uuid.UUID(request.path_params["session"])
            return kvsp_json(SessionInfo(sid, self.epoch, 3, SessionState.DONE, self.instance).to_json())

        async def checkpoint(request: Request) -> Response:
            obj = json.loads(await request.body())
            cp = SessionCheckpoint.from_json(obj)
            self.checkpoints.append((cp, obj.get("done") is True))
            if cp.epoch < self.epoch:
                raise StaleEpoch(f"the session is at epoch {self.epoch}")
            return kvsp_json(CheckpointAck(cp.session, self.epoch, cp.output_offset).to_json())

        async def start(request: Request) -> Response:
            body = SessionStart.loads(await request.body())
            return kvsp_json(CheckpointAck(body.session, body.epoch, 0).to_json(), 201)

        async def resume(request: Request) -> Response:
            body = SessionResume.loads(await request.body())
            return kvsp_json(CheckpointAck(uuid.UUID(request.path_params["session"]), body.epoch,
                                           body.checkpoint.output_offset).to_json())

        async def tokens(request: Request) -> Response:
            start_at = int(request.query_params["from"])

            async def lines() -> AsyncIterator[bytes]:
                for i in range(start_at, 3):
                    yield TokenLine(i, self.epoch, 100 + i).encode()
                yield TokenLine(3, self.epoch, done=True, reason="length").encode()
            return StreamingResponse(lines(), media_type="application/x-ndjson")

        async def run_info(request: Request) -> Response:
            return kvsp_json({"state": "done", "loaded_blocks": 2})

        async def prefetch(request: Request) -> Response:
            await count(request)
            directive = PrefetchDirective.loads(await request.body())
            return kvsp_json(PrefetchStatus(directive.directive, PrefetchState.PENDING).to_json(), 202,
                             {"location": f"prefetch/{directive.directive}"})

        async def prefetch_status(request: Request) -> Response:
            return kvsp_json(PrefetchStatus(uuid.UUID(request.path_params["directive"]), PrefetchState.COMPLETE,
                                            (key(1),)).to_json())

        async def reshard(request: Request) -> Response:
            message = parse_reshard(json.loads(await request.body()))
            assert isinstance(message, ReshardCommit)
            return kvsp_json({"map": message.map, "version": message.commit})

        async def state(request: Request) -> Response:
            return kvsp_json(StateMessage.loads(await request.body()).to_json())

        async def status(request: Request) -> Response:
            return kvsp_json(InstanceStatusRecord(self.instance, 7, InstanceState.ACTIVE, 2000).to_json())

        async def slow(request: Request) -> Response:
            await count(request)
            await asyncio.sleep(3)
            return kvsp_json({})

        async def busy(request: Request) -> Response:
            raise Unavailable("try another")

        async def garbled(request: Request) -> Response:
            return kvsp_json({"matched": "many"})

        app = Starlette(routes=[
            Route("/pc/sessions", create_session, methods=["POST"]),
            Route("/pc/sessions/{session}", session_info, methods=["GET"]),
            Route("/pc/sessions/{session}/checkpoint", checkpoint, methods=["PUT"]),
            Route("/ii/sessions/{session}/start", start, methods=["POST"]),
            Route("/ii/sessions/{session}/resume", resume, methods=["POST"]),
            Route("/ii/sessions/{session}/tokens", tokens, methods=["GET"]),
            Route("/ii/sessions/{session}", run_info, methods=["GET"]),
            Route("/ii/prefetch", prefetch, methods=["POST"]),
            Route("/ii/prefetch/{directive}", prefetch_status, methods=["GET"]),
            Route("/ii/reshard", reshard, methods=["POST"]),
            Route("/ii/state", state, methods=["PUT"]),
            Route("/ii/status", status, methods=["GET"]),
            Route("/slow/{rest:path}", slow, methods=["GET", "POST", "PUT"]),
            Route("/busy/{rest:path}", busy, methods=["GET", "POST", "PUT", "DELETE"]),
            Route("/garbled/{rest:path}", garbled, methods=["GET", "POST", "PUT"]),
        ])
        install(app)
        return app


@dataclass
class Cluster:
    index: str
    holder: str
    pc: str
    ii: str
    base: str  # the control plane's origin
    plane: ControlPlane
    certs: TestPki
    holder_service: Holder


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    sockets = [bind_pair("127.0.0.1", 0, 1 << 20) for _ in range(3)]
    ports = [tcp.getsockname()[1] for tcp, _ in sockets]
    index_uri, holder_uri = f"https://127.0.0.1:{ports[0]}/is/", f"https://127.0.0.1:{ports[1]}/kvsp/"
    base = f"https://127.0.0.1:{ports[2]}/"
    certs = make_pki(tmp_path, roles={"server": "https://127.0.0.1/", "holder": holder_uri,
                                      "instance": INSTANCE_URI})
    policy = Policy.from_dict({"principal": [
        {"identity": ALICE, "roles": ["client", "instance"], "scopes": [SCOPE.hex()]},
        {"identity": holder_uri, "roles": ["holder"], "scopes": "*"},
        {"identity": INSTANCE_URI, "roles": ["instance"], "scopes": "*"},
    ]})
    holder = Holder(HolderSettings(holder_uri, (D,), leases=LeaseLimits(max_ttl_ms=10_000)))
    plane = ControlPlane(instance=base + "ii/")
    servers = [RoleServer(index_app(IndexService(MemoryIndexStore(), clock=time.monotonic), policy,
                                    base_path="/is/"), certs.files("server")),
               RoleServer(holder_app(holder, policy), certs.files("holder")),
               RoleServer(plane.app(), certs.files("server"))]
    for server, pair in zip(servers, sockets, strict=True):
        await server.start(sockets=pair)
    try:
        yield Cluster(index_uri, holder_uri, base + "pc/", base + "ii/", base, plane, certs, holder)
    finally:
        for server in servers:
            await server.close()


@pytest.fixture
async def api(cluster: Cluster) -> AsyncIterator[KvspApi]:
    async with KvspClient(cluster.certs.files("alice"), fallback=False, timeout=5) as client:
        yield KvspApi(client)


# -- round trips ---------------------------------------------------------------------------------------------------


async def test_index_publish_refresh_lookup_withdraw(cluster: Cluster, api: KvspApi) -> None:
    async with KvspClient(cluster.certs.files("holder"), fallback=False) as as_holder:
        holder_api = KvspApi(as_holder)
        record = await api.put_block(cluster.holder, D.compat_id, SCOPE, key(1), block(1))
        assert record.holder == cluster.holder and record.block_key == key(1)
        first = await holder_api.publish(cluster.index, record)
        again = await holder_api.refresh(cluster.index, record)
        assert (first.created, again.created) == (True, False) and first.record == record
        found = await api.lookup(cluster.index, LookupRequest(SCOPE, D.compat_id, (key(1), key(2))))
        assert found.matched == 1 and [(r.holder, r.digest) for r in found.blocks[0].replicas] == [
            (record.holder, record.digest)]
        assert await holder_api.withdraw(cluster.index, cluster.holder, key(1)) is True
        assert await holder_api.withdraw(cluster.index, cluster.holder, key(1)) is False  # already gone
        assert (await api.lookup(cluster.index, LookupRequest(SCOPE, D.compat_id, (key(1),)))).matched == 0
    with pytest.raises(ScopeDenied):  # a refusal raises its problem: asking elsewhere would not help
        await api.lookup(cluster.index, LookupRequest(OTHER_SCOPE, D.compat_id, (key(1),)))


async def test_status_report_answers_the_state(cluster: Cluster, api: KvspApi) -> None:
    record = InstanceStatusRecord(INSTANCE_URI, 1, InstanceState.ACTIVE, 5000)
    async with KvspClient(cluster.certs.files("instance"), fallback=False) as client:
        assert await KvspApi(client).put_status(cluster.index, record) is InstanceState.ACTIVE


async def test_block_get_is_streamed_and_a_404_is_a_miss(cluster: Cluster, api: KvspApi) -> None:
    await api.put_block(cluster.holder, D.compat_id, SCOPE, key(3), block(3))
    got = await api.get_block(cluster.holder, D.compat_id, SCOPE, key(3))
    assert isinstance(got, BlockBody)
    async with got:
        data = b"".join([chunk async for chunk in got.aiter_bytes()])
    assert data == block(3) and got.repr_digest == hashlib.sha256(data).digest() and got.http_version == "HTTP/3"
    layers = await api.get_block(cluster.holder, D.compat_id, SCOPE, key(3), layers=(1, 2))
    assert isinstance(layers, BlockBody) and c.parse_header(await layers.aread()).first_layer == 1
    missing = await api.get_block(cluster.holder, D.compat_id, SCOPE, key(4))
    assert isinstance(missing, Miss) and missing.status == 404 and missing.problem is not None
    unavailable = await api.get_block(cluster.holder, D.compat_id, SCOPE, key(3), layers=(2, 9))
    assert isinstance(unavailable, Miss)  # kvsp-layers-unavailable


async def test_lease_create_renew_release_and_misses(cluster: Cluster, api: KvspApi) -> None:
    await api.put_block(cluster.holder, D.compat_id, SCOPE, key(5), block(5))
    lease = await api.create_lease(cluster.holder, LeaseRequest(D.compat_id, SCOPE, (key(5),), 2000))
    assert isinstance(lease, Lease) and lease.ttl_ms == 2000 and lease.url == f"{cluster.holder}leases/{lease.lease}"
    renewed = await api.renew_lease(lease, 3000)
    assert isinstance(renewed, Lease) and renewed.ttl_ms == 3000
    assert await api.release_lease(lease) is True
    assert await api.release_lease(lease) is False  # gone: released, or expired meanwhile
    assert isinstance(await api.renew_lease(lease, 3000), Miss)
    absent = await api.create_lease(cluster.holder, LeaseRequest(D.compat_id, SCOPE, (key(6),), 2000))
    assert isinstance(absent, Miss) and absent.status == 404
    with pytest.raises(RetryElsewhere) as quota:  # kvsp-lease-quota: busy, not wrong
        await api.create_lease(cluster.holder, LeaseRequest(D.compat_id, SCOPE, (key(5),), 10**9))
    assert quota.value.status == 429


async def test_sessions_checkpoints_and_tokens(cluster: Cluster, api: KvspApi) -> None:
    sid = uuid.uuid4()
    info = await api.create_session(cluster.pc, SessionRequest(sid, SCOPE, D.compat_id, (1, 2, 3), 3, GREEDY))
    assert info == SessionInfo(sid, 1, 0, SessionState.RUNNING, cluster.ii)
    assert (await api.session_info(cluster.pc, sid)).state is SessionState.DONE
    cp = SessionCheckpoint(sid, 1, D.compat_id, SCOPE, (), (1, 2, 3), (100, 101), 2, GREEDY)
    assert await api.checkpoint(cluster.pc, cp, done=True) == Acknowledged(CheckpointAck(sid, 1, 2))
    assert cluster.plane.checkpoints[-1] == (cp, True)
    cluster.plane.epoch = 2  # the PC moved the session: this instance's checkpoints are stale
    assert isinstance(await api.checkpoint(cluster.pc, cp), Stale)
    started = await api.start_session(cluster.ii, SessionStart(sid, 2, SCOPE, D.compat_id, (1, 2, 3), 3, GREEDY))
    assert started == CheckpointAck(sid, 2, 0)
    resumed = await api.resume_session(cluster.ii, sid, SessionResume(3, dataclass_replace(cp, epoch=2)))
    assert resumed == CheckpointAck(sid, 3, 2)
    async with api.tokens(cluster.ii, sid, 1) as lines:
        got = [line async for line in lines]
    assert got == [TokenLine(1, 2, 101), TokenLine(2, 2, 102), TokenLine(3, 2, done=True, reason="length")]
    assert (await api.session_run(cluster.ii, sid))["loaded_blocks"] == 2


async def test_prefetch_reshard_state_status(cluster: Cluster, api: KvspApi) -> None:
    directive = PrefetchDirective(uuid.uuid4(), SCOPE, D.compat_id, (PrefetchBlock(key(1), (cluster.holder,)),),
                                  5000, 5000)
    first = await api.prefetch(cluster.ii, directive)
    assert first == PrefetchStatus(directive.directive, PrefetchState.PENDING)
    done = await api.prefetch_status(cluster.ii, directive.directive)
    assert done.state is PrefetchState.COMPLETE and done.loaded == (key(1),)
    assert await api.reshard(cluster.ii, ReshardCommit("m", 4)) == {"map": "m", "version": 4}
    assert await api.set_state(cluster.ii, InstanceState.DRAINING) is InstanceState.DRAINING
    assert (await api.instance_status(cluster.ii)).epoch == 7


def dataclass_replace(cp: SessionCheckpoint, **changes: Any) -> SessionCheckpoint:
    import dataclasses

    return dataclasses.replace(cp, **changes)


# -- failure classes -------------------------------------------------------------------------------------------


async def test_503_and_refused_connections_mean_retry_elsewhere(cluster: Cluster, api: KvspApi) -> None:
    with pytest.raises(RetryElsewhere) as busy:
        await api.lookup(cluster.base + "busy/", LookupRequest(SCOPE, D.compat_id, (key(1),)))
    assert busy.value.status == 503 and isinstance(busy.value.problem, Unavailable)
    with pytest.raises(RetryElsewhere) as unreadable:
        await api.lookup(cluster.base + "garbled/", LookupRequest(SCOPE, D.compat_id, (key(1),)))
    assert isinstance(unreadable.value, BadResponse)
    with pytest.raises(RetryElsewhere) as busy_cp:  # a checkpoint the PC could not take: try again later
        await api.checkpoint(cluster.base + "busy/", SessionCheckpoint(uuid.uuid4(), 1, D.compat_id, SCOPE, (),
                                                                      (1,), (), 0, GREEDY))
    assert busy_cp.value.status == 503
    async with KvspClient(cluster.certs.files("alice"), connect_timeout=0.5, retries=0) as client:
        start = time.monotonic()
        with pytest.raises(RetryElsewhere) as refused:  # nothing listens: QUIC gets no answer, TCP is refused
            await KvspApi(client).lookup("https://127.0.0.1:9/is/", LookupRequest(SCOPE, D.compat_id, (key(1),)))
        assert refused.value.status is None and time.monotonic() - start < 3


async def test_only_idempotent_requests_are_retried(cluster: Cluster) -> None:
    plane = cluster.plane
    slow = cluster.base + "slow/"
    async with KvspClient(cluster.certs.files("alice"), fallback=False, retries=2) as client:
        asked: list[int | None] = []  # the retries KvspApi asks of the HTTP client: none, it retries itself
        send = client.send

        async def recording_send(*args: Any, **kwargs: Any) -> Any:
            asked.append(kwargs.get("retries"))
            return await send(*args, **kwargs)

        client.send = recording_send  # type: ignore[method-assign]
        api = KvspApi(client, timeout=0.3)
        with pytest.raises(RetryElsewhere):  # a lease is created once: never sent twice
            await api.create_lease(slow, LeaseRequest(D.compat_id, SCOPE, (key(1),), 1000))
        with pytest.raises(RetryElsewhere):
            await api.prefetch(slow, PrefetchDirective(uuid.uuid4(), SCOPE, D.compat_id,
                                                       (PrefetchBlock(key(1), (cluster.holder,)),), 5000, 5000))
        with pytest.raises(RetryElsewhere):  # a lookup is a query: retried
            await api.lookup(slow, LookupRequest(SCOPE, D.compat_id, (key(1),)))
        with pytest.raises(RetryElsewhere):  # a GET: retried
            await api.session_run(slow, uuid.uuid4())
    await asyncio.sleep(0.1)
    calls = {path.rsplit("/", 1)[-1] if "sessions" not in path else "session": n
             for (_m, path), n in plane.calls.items() if path.startswith("/slow/")}
    assert calls == {"leases": 1, "prefetch": 1, "lookup": 3, "session": 3}, plane.calls
    assert asked == [0] * 8  # every retry is KvspApi's (one layer: kvsp_client.api.KvspApi._at)


# -- a dead peer is dropped from the pool ------------------------------------------------------------------------


def index_process(dev: Path, port: int = 0) -> Process:
    """``kvsp-quic index --dev DIR [--listen 127.0.0.1:PORT]``, a real server process."""
    return Process("index", "--dev", str(dev), "--listen", f"127.0.0.1:{port}", "--log-level", "ERROR")


async def test_a_dead_peer_is_dropped_from_the_pool_after_a_timeout(tmp_path: Path) -> None:
    first = index_process(tmp_path / "dev")
    second: Process | None = None
    try:
        ready = first.ready
        files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
        index = ready["base_uri"]
        request = LookupRequest(SCOPE, D.compat_id, (key(1),))
        async with KvspClient(files, fallback=False, retries=0, connect_timeout=2, timeout=1) as client:
            api = KvspApi(client)
            assert (await api.lookup(index, request)).matched == 0
            assert client.pooled(index) == 1
            first.kill()  # no CONNECTION_CLOSE: a dead peer
            with pytest.raises(RetryElsewhere):  # the peer is silent: the request times out...
                await api.lookup(index, request)
            assert client.pooled(index) == 0  # ...and its connection is not handed out again
            port = int(index.rstrip("/").rsplit(":", 1)[1])
            second = index_process(tmp_path / "dev", port)  # the service is back on the same port
            start = time.monotonic()
            assert (await api.lookup(index, request)).matched == 0  # a fresh connection at once
            assert time.monotonic() - start < 1 and client.pooled(index) == 1
    finally:
        first.stop()
        if second is not None:
            second.stop()


# -- the token line codec ----------------------------------------------------------------------------------------


def test_token_line_round_trips_and_rejects_bad_lines() -> None:
    for line in (TokenLine(0, 1, 42), TokenLine(5, 2, done=True, reason="length"),
                 TokenLine(3, 2, done=True, reason="error", detail="engine failed")):
        wire = line.encode()
        assert wire.endswith(b"\n") and wire.count(b"\n") == 1
        assert TokenLine.decode(wire) == line
    assert TokenLine(7, 1, 9).encode() == b'{"index":7,"epoch":1,"token":9}\n'
    for bad in (b"", b"[1]", b'{"index":1,"epoch":1}', b'{"index":-1,"epoch":1,"token":2}',
                b'{"index":1,"epoch":1,"token":2,"done":true,"reason":"length"}', b'{"index":1,"epoch":1,"done":true}',
                b'{"index":1,"epoch":1,"token":2,"reason":"stop"}', b'{"index":1,"epoch":1,"token":1e3}'):
        with pytest.raises(RecordError, match="token line"):
            TokenLine.decode(bad)
