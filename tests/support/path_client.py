"""A client for the path tests (tests/test_quic_path.py), run in a network namespace of its own:

    python -m tests.support.path_client READY_JSON DESCRIPTOR_FILE [--pause]

READY_JSON is a holder's ready line (``kvsp-quic holder --dev``: base_uri, moqt, ca, client_cert, client_key).
It stores one block of the descriptor's geometry over HTTP/3 (PUT), reads it back with an HTTP/3 GET and with a
MOQT FETCH of its replica's ``moqt://`` twin, and prints one JSON line: per transfer whether the octets (the GET)
or every layer (the FETCH) came back exact, and the sizes of the datagrams this client received (the holder's)
and built (its own), counted at the connection's real ``receive_datagram``. With ``--pause`` it prints
``{"paused": true}`` after the PUT and waits for a line on standard input before the GET (the test changes the
route meanwhile).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from http3.client import KvspClient
from kvsp_moqt.holder_tracks import fetch_replica
from kvsp_moqt.tracks import moqt_record
from kvsp_quic import container as c
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.samples import random_sections
from moqt.aio import MoqtPool
from quic.connection import KvspQuicConnection
from quic.tls import TlsFiles

SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
BLOCK_KEY = hashlib.sha256(b"path block").digest()


def count_received(quic: KvspQuicConnection, sizes: list[int]) -> None:
    """Note the size of every datagram *quic* receives from now on (the real method is still called)."""
    receive = quic.receive_datagram

    def counting(data: bytes, addr: Any, now: float) -> None:
        sizes.append(len(data))
        receive(data, addr, now=now)

    quic.receive_datagram = counting  # type: ignore[method-assign]


async def main(ready: dict[str, Any], d: CompatDescriptor, pause: bool = False) -> dict[str, Any]:
    files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
    body = c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, 7), first_layer=0,
                    token_count=d.block_tokens, descriptor=d).tobytes()
    url = f"{ready['base_uri']}blocks/{d.compat_id.hex()}/{SCOPE.hex()}/{BLOCK_KEY.hex()}"
    report: dict[str, Any] = {"octets": len(body)}
    async with KvspClient(files, timeout=60) as client:
        stored = await client.request("PUT", url, content=body,
                                      headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
        assert stored.status == 201, stored.content
        record = ReplicaRecord.from_json(stored.json())
        conn = next(c for conns in client._pool._conns.values() for c in conns)
        if pause:
            print(json.dumps({"paused": True}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        sizes: list[int] = []
        count_received(conn.quic, sizes)
        digest = hashlib.sha256()
        async with client.stream("GET", url) as response:
            assert response.status == 200
            async for chunk in response.aiter_bytes():
                digest.update(chunk)
        report["h3"] = {"exact": digest.digest() == hashlib.sha256(body).digest(), "largest_received": max(sizes),
                        "received": len(sizes), "datagram_size": conn.quic.datagram_size}
    expected = c.decode(body, d)[1]
    async with MoqtPool(files) as pool:
        twin = moqt_record(record, ready["moqt"])
        moqt = await pool.get(twin.holder)
        sizes = []
        count_received(moqt.quic, sizes)
        layers = [layer async for layer in fetch_replica(pool, twin, descriptor=d)]
        exact = [layer.index for layer in layers] == list(range(d.layers)) and all(
            bytes(got.k) == bytes(expected[got.index].k) and bytes(got.v) == bytes(expected[got.index].v)
            for got in layers)
        report["moqt"] = {"exact": exact, "largest_received": max(sizes), "received": len(sizes),
                          "datagram_size": moqt.quic.datagram_size}
    return report


if __name__ == "__main__":
    ready_line, descriptor_file = sys.argv[1:3]
    descriptor = CompatDescriptor.load(Path(descriptor_file))
    print(json.dumps(asyncio.run(main(json.loads(ready_line), descriptor, "--pause" in sys.argv[3:]))), flush=True)
