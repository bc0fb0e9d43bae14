"""The cluster of ``kvsp-quic chaos``: a redis-server (or a 3-node Redis Cluster), two IS+PC replicas, two holders, a
relay, three instances and the front end as real processes on 127.0.0.1 (dev certificates), each restartable on its
port after a fault. Holders and the relay run one process each (``--workers 1``): the victim of a source fault then
is one process whose ``GET metrics`` counts every block it served, and a block cached by the relay is in the one
cache every FETCH reaches."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from kvsp_app.demo import Cluster, _metrics, checkpointing_replica
from kvsp_app.redis_cluster import RedisClusterServers, RedisServer, free_port
from kvsp_quic.problems import Unavailable

REDIS_MISSING = ("kvsp-quic chaos: redis-server is not on PATH; the chaos suite starts its own "
                 "(Debian/Ubuntu: apt-get install -y redis-server)")
INSTANCES = ("instance-a", "instance-b", "instance-c")
REPLICAS = ("index-a", "index-b")
BLOCK_TOKENS = 16  # the instances' and the front end's default


class ChaosCluster(Cluster):
    def __init__(self, root: Path, progress: Callable[[str], None], *, redis_cluster: bool = False) -> None:
        if shutil.which("redis-server") is None:
            raise Unavailable(REDIS_MISSING)
        super().__init__(root, progress)
        self.redis_cluster = redis_cluster  # a 3-node Redis Cluster (primaries only) instead of one redis-server
        self.redis: RedisServer | RedisClusterServers | None = None
        self.descriptor: dict[str, Any] = {}  # the instances' Compatibility Descriptor (JSON)
        self.uris: dict[str, str] = {}  # process name -> base URI
        self.completions = ""
        self.client: Any = None
        self.as_frontend: Any = None
        self._fe: dict[str, Any] = {}
        self.stopped: set[str] = set()  # processes under SIGSTOP: not asked anything
        self.moqt: dict[str, str] = {}  # process name -> moqt:// URI (the relay's)

    def start_named(self, name: str, *args: str) -> str:
        ready = self.start(name, *args)
        self.uris[name] = ready["base_uri"]
        return str(ready["base_uri"])

    async def start_all(self, *, layers: int, hidden: int) -> None:
        from gpu.modelfiles import ModelConfig, derive_descriptor, write_random_model

        progress = self.progress
        what = "a 3-node Redis Cluster" if self.redis_cluster else "redis-server"
        progress(f"[1/7] a random-weights model ({layers} layers, hidden {hidden}) and {what} in {self.root}")
        heads = max(hidden // 64, 1)
        write_random_model(self.root / "model", ModelConfig(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=max(heads // 4, 1), vocab_size=512, head_dim=64, name="kvsp-chaos"), seed=1)
        if self.redis_cluster:
            self.redis = await asyncio.to_thread(RedisClusterServers.start, self.root / "redis-cluster", nodes=3)
            redis: tuple[str, ...] = ("--redis", self.redis.url, "--redis-cluster")
        else:
            self.redis = await asyncio.to_thread(RedisServer.start, self.root / "redis")
            redis = ("--redis", self.redis.url)
        dev = ("--dev", "dev")
        progress(f"[2/7] two IS+PC replicas on {'the Redis Cluster' if self.redis_cluster else 'one Redis'}")
        for name in REPLICAS:
            self.start_named(name, "index", *dev, "--listen", f"127.0.0.1:{free_port()}", *redis)
        index_args: list[str] = []
        controller_args: list[str] = []
        for name in REPLICAS:
            index_args += ["--index", self.uris[name]]
            controller_args += ["--controller", self.uris[name]]
        # the holders store the instances' blocks (a source fault seeds them): the model's descriptor, as the
        # instances derive it (checked against their ready lines below)
        descriptor = derive_descriptor(self.root / "model", BLOCK_TOKENS)
        self.descriptor = descriptor.to_json()
        (self.root / "descriptor.json").write_text(json.dumps(self.descriptor))
        progress("[3/7] two holders (holder-a with local storage) and a relay, one process each")
        (self.root / "holder-a-storage").mkdir(exist_ok=True)
        one = ("--workers", "1", "--descriptor", "descriptor.json")
        self.start_named("holder-a", "holder", *dev, "--listen", f"127.0.0.1:{free_port()}", *index_args, *one,
                         "--local-storage", "holder-a-storage")
        self.start_named("holder-b", "holder", *dev, "--listen", f"127.0.0.1:{free_port()}", *index_args, *one)
        ready = self.start("relay", "relay", *dev, "--listen", f"127.0.0.1:{free_port()}", *index_args,
                           "--workers", "1")
        self.uris["relay"] = ready["base_uri"]
        self.moqt["relay"] = ready["moqt"]
        progress("[4/7] three inference instances (CPU)")
        for name in INSTANCES:
            ready = self.start(name, "instance", *dev, "--listen", f"127.0.0.1:{free_port()}", "--device", "cpu",
                               "--model", "model", *index_args, *controller_args, "--status-ttl-ms", "1500",
                               "--warmup-tokens", "16", "--checkpoint-tokens", "8")
            self.uris[name] = ready["base_uri"]
            if ready.get("compat_id") != descriptor.compat_id.hex():
                raise Unavailable(f"{name} serves compat_id {ready.get('compat_id')}, the holders were given "
                                  f"{descriptor.compat_id.hex()}")
        progress("[5/7] the front end")
        self._fe = self.start("frontend", "frontend", *dev, *controller_args, "--model", "model")
        self.completions = self._fe["completions"]
        await asyncio.sleep(0)

    @contextlib.asynccontextmanager
    async def clients(self) -> AsyncIterator[None]:
        from http3.client import KvspClient
        from quic.tls import TlsFiles

        fe, root = self._fe, self.root
        files = TlsFiles(root / fe["ca"], root / fe["client_cert"], root / fe["client_key"])
        port = fe["base_uri"].rstrip("/").rsplit(":", 1)[1]
        fe_files = TlsFiles(root / fe["ca"], root / "dev" / f"frontend-{port}.pem",
                            root / "dev" / f"frontend-{port}.key")
        async with KvspClient(files, timeout=30) as client, KvspClient(fe_files, timeout=10) as as_frontend:
            self.client, self.as_frontend = client, as_frontend
            yield

    def freeze(self, name: str) -> None:
        """SIGSTOP *name*: it is asked nothing until :meth:`resume`."""
        self.procs[name].freeze()
        self.stopped.add(name)

    def resume(self, name: str) -> None:
        self.procs[name].resume()
        self.stopped.discard(name)

    def restart(self, name: str, *, graceful: bool = False) -> None:
        """Start *name* again with its arguments (its port, its storage), after a fault; *graceful*: stop it with
        SIGTERM first (a holder or an instance withdraws its records), SIGKILL after 15 s."""
        old = self.procs[name]
        if not graceful:
            old.kill()
        old.stop(15)
        for attempt in range(20):  # the port of a process just killed can take a moment to be free
            try:
                self.start(name, *old.args)
                return
            except Unavailable:
                if attempt == 19:
                    raise
                time.sleep(0.25)

    async def serving_instance(self, session: uuid.UUID) -> str | None:
        """The process name of the instance that runs *session*, per the PC (any replica that answers)."""
        from kvsp_client.api import KvspApi

        by_uri = {uri: name for name, uri in self.uris.items() if name in INSTANCES}
        for replica in REPLICAS:
            if self.procs[replica].proc.poll() is not None:
                continue
            with contextlib.suppress(Exception):
                state = await KvspApi(self.as_frontend).session_info(self.uris[replica], session)
                return by_uri.get(str(state.instance))
        return None

    async def checkpointing_replica(self) -> str:
        """The PC replica receiving checkpoints now: the one whose accepted-checkpoint counter grows."""
        return await checkpointing_replica(self.client, {name: self.uris[name] for name in REPLICAS})

    async def fetched_tokens(self) -> dict[str, float]:
        """Prompt tokens loaded rather than computed, per running instance (by process name)."""
        out = {}
        for name in INSTANCES:
            if self.procs[name].proc.poll() is None and name not in self.stopped:
                with contextlib.suppress(Exception):
                    values = await asyncio.wait_for(_metrics(self.client, self.uris[name]), 5)
                    out[name] = values.get('kvsp_fetched_tokens_total{component="instance"}', 0.0)
        return out

    def stop(self) -> None:
        try:
            super().stop()  # (one under SIGSTOP is sent SIGCONT before its SIGTERM)
        finally:
            if self.redis is not None:
                self.redis.stop()
