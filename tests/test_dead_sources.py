"""Dead holders cost little (issue 12, point 5), with real processes: ``kvsp-quic index --dev`` and two
``kvsp-quic holder --dev`` on 127.0.0.1, both holding the same blocks, fetched the way an instance fetches them
(MOQT first, HTTP/3 next, :class:`kvsp_client.retrieval.BlockFetcher`). The preferred holder is killed with SIGKILL
after the fetcher has a connection to it: the rest of the prefix comes from the other holder at once (no connect
or stall timeout), the dead holder is reported to the Index Service, which tries it last at once and leaves it out
of lookups once its liveness record lapses."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher, HttpSource
from kvsp_moqt.source import MoqtSource, PreferMoqt
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.retrieval_plan import FailureMemory, LayerRange, endpoint_key
from kvsp_quic.roles.status import endpoint
from moqt.aio import MoqtPool
from quic.tls import TlsFiles
from tests.support.cluster import DESCRIPTOR, KEYER, block, block_url
from tests.support.waits import until

BLOCKS = 6


class Prefer:
    """PreferMoqt, with the replicas at *best*'s host and port first."""

    def __init__(self, best: str) -> None:
        self.best = endpoint(best)
        self.inner = PreferMoqt()

    def __call__(self, replicas: Sequence[ReplicaRecord], layers: LayerRange) -> list[ReplicaRecord]:
        return sorted(self.inner(replicas, layers), key=lambda r: 0 if endpoint(r.holder) == self.best else 1)


async def replicas(fetcher: BlockFetcher, count: int) -> list[set[str]]:
    found = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(i)[0] for i in range(count)])
    return [{r.holder for r in m.replicas} for m in found.blocks]


async def test_a_holder_killed_mid_load_costs_little(two_holder_cluster: dict[str, Any]) -> None:
    ready = two_holder_cluster["index"]
    files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
    dead, alive = two_holder_cluster["holders"]
    async with KvspClient(files, timeout=20) as client, MoqtPool(files) as pool:
        for holder in (dead, alive):
            for i in range(BLOCKS):
                key, body = block(i)
                r = await client.request("PUT", block_url(holder["base_uri"], key), content=body,
                                         headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
                assert r.status == 201, await r.aread()
        fetcher = BlockFetcher(client, ready["base_uri"], descriptors=[DESCRIPTOR], ranking=Prefer(dead["base_uri"]),
                               sources=[MoqtSource(pool, [DESCRIPTOR]), HttpSource(client)])
        everyone = {dead["base_uri"], dead["moqt"], alive["base_uri"], alive["moqt"]}
        await until(lambda: _all(fetcher, everyone), 15, "every holder's replicas of every block")

        first = await fetcher.load_prefix(DESCRIPTOR.compat_id, KEYER.scope_id, [block(0)[0]])
        assert first[0] is not None and first[0].record.holder == dead["moqt"]  # a MOQT connection to it is open

        two_holder_cluster["procs"][1].proc.send_signal(signal.SIGKILL)
        two_holder_cluster["procs"][1].proc.wait(10)
        start = time.monotonic()
        results = await fetcher.load_prefix(DESCRIPTOR.compat_id, KEYER.scope_id, [block(i)[0] for i in range(BLOCKS)])
        elapsed = time.monotonic() - start
        assert all(r is not None for r in results)
        assert [r.tobytes() for r in results if r is not None] == [block(i)[1] for i in range(BLOCKS)]
        assert {r.record.holder for r in results if r is not None} == {alive["moqt"]}
        assert elapsed < 2.0, f"{elapsed:.2f} s (the MOQT stall and connect timeouts were 5 and 10 s)"
        assert fetcher.metrics.unreachable >= 1
        # the blocks under way at the dead holder (load_prefix's concurrency: 4) failed once each; its https twin
        # was skipped, not tried: nothing came over HTTP
        assert fetcher.metrics.transport_errors <= 4, fetcher.metrics.snapshot()
        assert all(t.startswith("MOQT/") for t in fetcher.metrics.bytes_by_transport)

        await asyncio.gather(*list(fetcher._reports))  # the report to the Index Service (in the background)
        assert fetcher.metrics.failures_reported == 1
        order = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(0)[0]])
        assert {r.holder for r in order.blocks[0].replicas[:2]} == {alive["base_uri"], alive["moqt"]}  # tried last

        # its liveness record (4 s by default) lapses: its replicas leave the lookups, 56 s before their TTL ends
        await until(lambda: _exactly(fetcher, {alive["base_uri"], alive["moqt"]}), 10, "only the live holder")


async def _all(fetcher: BlockFetcher, holders: set[str]) -> bool:
    return (await replicas(fetcher, BLOCKS)) == [holders] * BLOCKS


async def _exactly(fetcher: BlockFetcher, holders: set[str]) -> bool:
    return (await replicas(fetcher, BLOCKS)) == [holders] * BLOCKS


def test_failure_memory_skips_the_endpoint_of_a_holder_that_is_gone() -> None:
    now = [0.0]
    memory = FailureMemory(10.0, clock=lambda: now[0])
    memory.note("moqt://127.0.0.1:4433/")  # a transport failure that says nothing of the port (a refused ALPN)
    assert memory.recent("moqt://127.0.0.1:4433/") and not memory.recent("https://127.0.0.1:4433/")
    memory.note("moqt://127.0.0.1:4434/", unreachable=True)  # nothing listens there: its https twin is skipped too
    assert memory.recent("https://127.0.0.1:4434/") and memory.recent("moqt://127.0.0.1:4434/")
    assert endpoint_key("https://h.example/kvsp/") == "h.example:443"
    now[0] = 10.5
    assert not memory.recent("https://127.0.0.1:4434/")
