"""The fixtures several test modules share, found by name (no test module imports another: tests/test_layering.py).

The builders behind them are tests/support/'s. By area:

* the whole suite: ``spec_descriptor``, ``redis_url`` (a redis-server of the test's own), ``procs``;
* the test PKI (tests/pki.py): ``certs`` (role ``server``, per module), ``fresh_certs`` (the same, per test),
  ``server_holder_certs``, ``holder_certs`` (tests/support/holder_app.py), ``relay_certs``
  (tests/support/moqt_relay.py), ``pki_dir`` (tests/support/index_app.py);
* the Index Service (tests/support/index.py): ``env`` (memory store, then Redis), ``redis_server``;
* real ``kvsp-quic`` processes (tests/support/cluster.py): ``index_store``, ``dev_cluster`` and ``dev_client``,
  ``index`` and ``index_client``, ``two_holder_cluster``;
* the instance cluster (tests/support/instance.py, the gpu extra): ``model_dir``, ``reference``, ``instance_cluster``;
* the retrieval client's servers (tests/support/retrieval.py): ``net``.

A module may override one by defining a fixture of the same name (test_security_owner's ``certs`` adds a PC).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_http.holder_app import holder_app
from kvsp_http.index_app import index_app
from kvsp_quic.auth import Policy
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.index import IndexService
from kvsp_quic.roles.leases import LeaseLimits
from kvsp_quic.storage.index_store import IndexStore
from kvsp_quic.storage.memory_index import MemoryIndexStore
from quic.tls import TlsFiles
from tests import vectors
from tests.asgi import Router
from tests.helpers import Clock, Process
from tests.peers import missing_peer
from tests.pki import SERVER_URI, TestPki, make_pki
from tests.redis_server import REDIS_SERVER, SKIP_REASON, RedisServer
from tests.support import holder_app as holder_ids
from tests.support import index_app as index_ids
from tests.support import moqt_relay as relay_ids
from tests.support.cluster import CONTAINER_SIZE
from tests.support.descriptors import small_descriptor
from tests.support.index import Env, make_config
from tests.support.retrieval import ALICE, LAYERS, SCOPE, FakeHolder, Net, block

if TYPE_CHECKING:
    from gpu.model import LlamaModel
    from tests.support.instance import Cluster


# -- the whole suite ---------------------------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs_peer"):  # tests/peers.py
        if mark.args and mark.args[0] is not None:
            missing_peer(mark.args[0])


@pytest.fixture
def spec_descriptor() -> CompatDescriptor:
    return CompatDescriptor.from_json(vectors.DESCRIPTOR)


if os.environ.get("KVSP_TEST_LOOP") == "uvloop":  # the in-process tests on uvloop, as the servers run by default
    def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
        import uvloop
        return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A redis-server of the test's own (skipped where it is not installed)."""
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
    with RedisServer.start(tmp_path / "redis") as server:
        yield server.url


@pytest.fixture
def procs() -> Iterator[list[Process]]:
    """The ``kvsp-quic`` processes a test started: stopped at its end (a frozen one woken first), none with a
    traceback on stderr."""
    started: list[Process] = []
    yield started
    for proc in reversed(started):
        if proc.proc.stderr is not None and proc.proc.stderr.closed:
            continue  # the test stopped it itself
        if proc.proc.poll() is None:
            os.kill(proc.proc.pid, signal.SIGCONT)
        err = proc.stop()
        assert "Traceback" not in err, err


# -- the test PKI (tests/pki.py's make_pki): one fixture per set of roles that several modules use -------------------
# A module that needs roles of its own (a certificate naming its port, a role no other module has) keeps its own
# fixture and says why.


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    """The test PKI for the module: role ``server`` at https://127.0.0.1/ (it answers on any port and base path),
    clients alice and bob, and the certificates every transport must refuse."""
    return make_pki(tmp_path_factory.mktemp("pki"), roles={"server": SERVER_URI})


@pytest.fixture
def fresh_certs(tmp_path: Path) -> TestPki:
    """The same PKI as :func:`certs`, made for each test in its tmp_path."""
    return make_pki(tmp_path)


@pytest.fixture(scope="module")
def server_holder_certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    """:func:`certs` with a holder too, at https://127.0.0.1/kvsp/ (tests/support/holder_app.py's HOLDER_URI)."""
    return make_pki(tmp_path_factory.mktemp("pki"), roles={"server": SERVER_URI, "holder": holder_ids.HOLDER_URI})


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of a PKI for the module with the Index Service and holders h1, h2 and ii7 of
    tests/support/index_app.py (:func:`tests.support.index_app.serve` takes it)."""
    root = tmp_path_factory.mktemp("pki")
    make_pki(root, roles={"index": index_ids.INDEX, "h1": index_ids.H1, "h2": index_ids.H2, "ii7": index_ids.II7})
    return root


@pytest.fixture
def holder_certs(tmp_path: Path) -> TestPki:
    """A PKI of the test's own with a holder at tests/support/holder_app.py's HOLDER_URI and an index at INDEX_URI."""
    return make_pki(tmp_path / "pki", roles={"holder": holder_ids.HOLDER_URI, "index": holder_ids.INDEX_URI})


@pytest.fixture(scope="module")
def relay_certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    """A PKI for the module with the holder, relay and index of tests/support/moqt_relay.py (its :func:`world`)."""
    return make_pki(tmp_path_factory.mktemp("pki"), roles={
        "holder": relay_ids.HOLDER_URI, "relay": relay_ids.RELAY_URI, "index": relay_ids.INDEX_URI})


# -- the Index Service (tests/support/index.py) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server for the module (skipped where it, or the redis package, is not installed)."""
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
    pytest.importorskip("redis", reason="the redis extra is not installed (pip install -e '.[redis]')")
    with RedisServer.start(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    """The Index Service over the memory store, then over a real Redis (the module's :func:`redis_server`)."""
    clock = Clock()
    if request.param == "memory":
        store: IndexStore = MemoryIndexStore()
        yield Env(IndexService(store, clock=clock, config=make_config()), store, clock, False)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    from redis.asyncio import Redis

    from kvsp_quic.storage.redis_index import RedisIndexStore

    client = Redis(host="127.0.0.1", port=server.port)
    store = RedisIndexStore(client, prefix=f"t{uuid.uuid4().hex[:8]}:", first_chunk=4)
    try:
        yield Env(IndexService(store, clock=clock, config=make_config()), store, clock, True)
    finally:
        await client.aclose()


# -- real kvsp-quic processes (tests/support/cluster.py) -------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
def index_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[str]]:
    """The index's store as ``kvsp-quic index`` arguments: the memory store, then a redis-server of the test's own."""
    if request.param == "memory":
        yield []
        return
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
    with RedisServer.start(tmp_path / "redis") as server:
        yield ["--redis", server.url]


@pytest.fixture
def dev_cluster(tmp_path: Path, index_store: list[str]) -> Iterator[dict[str, Any]]:
    """``kvsp-quic index --dev`` (on each :func:`index_store`) and one ``kvsp-quic holder --dev`` with room for two
    and a half blocks in memory: their ready lines (``index``, ``holder``) and the dev directory (``dev``)."""
    dev = tmp_path / "dev"
    procs: list[Process] = []
    try:
        index = Process("index", "--dev", str(dev), *index_store)
        procs.append(index)
        # Room for two blocks in memory: a third one forces an eviction.
        holder = Process("holder", "--dev", str(dev), "--index", index.ready["base_uri"],
                         "--host-capacity", str(2 * CONTAINER_SIZE + CONTAINER_SIZE // 2), "--replica-ttl-ms", "30000")
        procs.append(holder)
        yield {"index": index.ready, "holder": holder.ready, "dev": dev}
    finally:
        for proc in reversed(procs):
            err = proc.stop()
            assert "Traceback" not in err, err


@pytest.fixture
async def dev_client(dev_cluster: dict[str, Any]) -> AsyncIterator[KvspClient]:
    """A client of :func:`dev_cluster` with its dev client certificate."""
    ready = dev_cluster["holder"]
    async with KvspClient(TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"])),
                          timeout=20) as c:
        yield c


@pytest.fixture
def index(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """``kvsp-quic index --dev`` alone (the test starts its holders in the same dev directory): its ready line."""
    proc = Process("index", "--dev", str(tmp_path / "dev"))
    try:
        yield proc.ready
    finally:
        err = proc.stop()
        assert "Traceback" not in err, err


@pytest.fixture
async def index_client(index: dict[str, Any]) -> AsyncIterator[KvspClient]:
    """A client of :func:`index`'s dev directory, with its dev client certificate."""
    async with KvspClient(TlsFiles(Path(index["ca"]), Path(index["client_cert"]), Path(index["client_key"])),
                          timeout=20) as c:
        yield c


@pytest.fixture
def two_holder_cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """``kvsp-quic index`` and two holders, one process each (SIGKILL kills, SIGSTOP freezes, all of a holder): the
    ready lines (``index``, ``holders``) and the processes (``procs``)."""
    dev = tmp_path / "dev"
    procs: list[Process] = []
    try:
        procs.append(Process("index", "--dev", str(dev)))
        index = procs[0].ready["base_uri"]
        for _ in range(2):
            procs.append(Process("holder", "--dev", str(dev), "--index", index, "--replica-ttl-ms", "60000",
                                 "--workers", "1"))
        yield {"index": procs[0].ready, "holders": [p.ready for p in procs[1:]], "procs": procs}
    finally:
        for proc in reversed(procs):
            if proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGCONT)  # a frozen one must hear the stop
            err = proc.stop()
            assert "Traceback" not in err, err


# -- the instance cluster (tests/support/instance.py; skipped without the gpu extra) ---------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weights model for the module (tests/support/instance.py's tiny_config); the fixtures of the
    instance cluster all stand on it, so without the gpu extra they skip here."""
    pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
    from gpu.modelfiles import write_random_model
    from tests.support.instance import tiny_config

    return write_random_model(tmp_path_factory.mktemp("model") / "tiny", tiny_config(), seed=5)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LlamaModel:
    """:func:`model_dir`'s model, loaded: the reference the tests compare tokens with."""
    from gpu.model import LlamaModel

    return LlamaModel.load(model_dir)


@pytest.fixture
async def instance_cluster(certs: TestPki, model_dir: Path) -> AsyncIterator[Cluster]:
    """The Index Service, a holder and a fake PC on one RoleServer (:class:`tests.support.instance.Cluster`), with
    :func:`certs` (a module may override it) and :func:`model_dir`; ``cl.instance()`` adds instances."""
    from gpu.model import LlamaModel
    from tests.support.instance import B, Cluster, FakePC

    router = Router()
    server = RoleServer(router, certs.files("server"))
    await server.start("127.0.0.1", 0)
    d = LlamaModel.load(model_dir).descriptor(B)
    policy = Policy.dev_ca()
    index = IndexService(MemoryIndexStore(), clock=time.monotonic)
    holder = Holder(HolderSettings(server.base_uri("/h1/"), (d,), replica_ttl_ms=60_000))
    pc = FakePC()
    router.apps["/is/"] = index_app(index, policy, base_path="/is/", sweep_interval=None)
    router.apps["/h1/"] = holder_app(holder, policy)
    router.apps["/pc/"] = pc
    alice = KvspClient(certs.files("alice"), timeout=10.0)
    bob = KvspClient(certs.files("bob"), timeout=10.0)
    cl = Cluster(certs, model_dir, server, router, index, holder, pc, alice, bob)
    try:
        yield cl
    finally:
        for node, srv, engine in reversed(cl.nodes):
            await node.aclose()
            await srv.close()
            engine.close()
        await alice.aclose()
        await bob.aclose()
        await server.close()


# -- the retrieval client's servers (tests/support/retrieval.py) ------------------------------------------------------


@pytest.fixture
async def net(certs: TestPki) -> AsyncIterator[Net]:
    """The Index Service, real holders h1 and h2 and the misbehaving fakes bad and bad2 on one RoleServer, with
    alice's client (:class:`tests.support.retrieval.Net`)."""
    d = small_descriptor(layers=LAYERS)
    router = Router()
    server = RoleServer(router, certs.files("server"))
    await server.start("127.0.0.1", 0)

    def uri(name: str) -> str:
        return server.base_uri(f"/{name}/")

    policy = Policy.from_dict({"principal": [
        # alice loads blocks, stores them (instance) and may withdraw for the fake "bad" holder (not "bad2")
        {"identity": ALICE, "roles": ["client", "instance", "holder"], "scopes": [SCOPE.hex()],
         "publish_for": [uri("bad")]},
        {"identity": uri("h1"), "roles": ["holder"], "scopes": "*"},
        {"identity": uri("h2"), "roles": ["holder"], "scopes": "*"},
    ]})
    index = IndexService(MemoryIndexStore(), clock=time.monotonic)
    size = len(block(d, 0))
    holders = {
        "h1": Holder(HolderSettings(uri("h1"), (d,), replica_ttl_ms=60_000)),
        # h2 grants no lease of a whole block: its quota is one replica's octets minus one
        "h2": Holder(HolderSettings(uri("h2"), (d,), replica_ttl_ms=60_000,
                                    leases=LeaseLimits(max_octets_per_client=size - 1))),
    }
    fakes = {"bad": FakeHolder(), "bad2": FakeHolder()}
    router.apps["/is/"] = index_app(index, policy, base_path="/is/", sweep_interval=None)
    for name, holder in holders.items():
        router.apps[f"/{name}/"] = holder_app(holder, policy)
    for name, fake in fakes.items():
        router.apps[f"/{name}/"] = fake
    client = KvspClient(certs.files("alice"), timeout=10.0)
    alice = policy.principal(ALICE)
    assert alice is not None
    try:
        yield Net(server, router, index, holders, fakes, client, d, certs, alice)
    finally:
        await client.aclose()
        await server.close()
