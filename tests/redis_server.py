"""A real redis-server for tests and benchmarks: 127.0.0.1, a free port, a temporary directory, no persistence.

    with RedisServer.start(tmp_path) as server:      # or: server = RedisServer.start(dir); ...; server.stop()
        client = redis.asyncio.Redis(port=server.port)

    with RedisClusterServers.start(tmp_path, nodes=3) as cluster:   # primaries only, slots split evenly
        client = redis.asyncio.RedisCluster(host="127.0.0.1", port=cluster.ports[0])

Tests skip with :data:`SKIP_REASON` when ``redis-server`` is not on PATH (``needs_redis``; they fail instead under
``KVSP_REQUIRE_PEERS=1``: tests/peers.py) (Debian: ``apt-get install -y
redis-server``; it does not start a service by itself in a container). The ``redis`` Python package is the
``redis`` extra of the project (``pip install -e '.[test,redis]'``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# One copy of the starters: the product's (``kvsp-quic chaos --redis-cluster`` starts its cluster with it).
from kvsp_app.redis_cluster import REDIS_SERVER, RedisClusterServers, RedisServer, command, free_port
from tests.peers import needs_peer

SKIP_REASON = ("redis-server is not installed (Debian/Ubuntu: apt-get install -y redis-server); "
               "the Redis index tests need a real server")
needs_redis = needs_peer(SKIP_REASON if REDIS_SERVER is None else None)


@contextlib.contextmanager
def running(directory: str | os.PathLike[str]) -> Iterator[RedisServer]:
    server = RedisServer.start(directory)
    try:
        yield server
    finally:
        server.stop()


__all__ = ["REDIS_SERVER", "SKIP_REASON", "RedisClusterServers", "RedisServer", "command", "free_port", "needs_redis",
           "running"]
