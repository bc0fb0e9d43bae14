"""A shared store that goes away is an outage, not a bug: the Index Service answers 503 with Retry-After (one
warning line, no traceback) while its Redis is down, and serves again when it is back."""

from __future__ import annotations

import json
from pathlib import Path

from http3.client import KvspClient
from kvsp_quic.problems import problem_from_json
from quic.tls import TlsFiles
from tests.helpers import Process
from tests.peers import missing_peer
from tests.redis_server import REDIS_SERVER, SKIP_REASON, RedisServer
from tests.support.cluster import DESCRIPTOR, KEYER, block


async def test_a_lookup_while_redis_is_down_is_a_503(tmp_path: Path) -> None:
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
    redis = RedisServer.start(tmp_path / "redis")
    index = Process("index", "--dev", str(tmp_path / "dev"), "--store", "redis", "--redis", redis.url)
    err = ""
    try:
        ready = index.ready
        files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
        body = json.dumps({"scope_id": KEYER.scope_id.hex(), "compat_id": DESCRIPTOR.compat_id.hex(),
                           "block_keys": [block(0)[0].hex()]}).encode()
        async with KvspClient(files, timeout=20) as client:
            url = f"{ready['base_uri']}lookup"
            headers = {"content-type": "application/kvsp+json"}
            assert (await client.request("POST", url, content=body, headers=headers)).status == 200
            redis.stop()
            down = await client.request("POST", url, content=body, headers=headers)
            assert down.status == 503 and down.headers.get("retry-after") == "1"
            assert "store is unreachable" in (problem_from_json(down.status, down.content or b"").detail or "")
    finally:
        err = index.stop()
        redis.stop()
    assert "Traceback" not in err and "the store is unreachable" in err
