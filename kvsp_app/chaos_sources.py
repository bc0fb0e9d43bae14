"""The source faults of ``kvsp-quic chaos`` (``holder-kill``, ``relay-kill``, ``holder-restart``): a kill that cuts a
block load from that very source, and the evidence that it did (docs/chaos.md, "Source faults").

Each such fault run has a prefix of its own, computed and placed so that at the kill the instances are loading it
from the victim and from nowhere else:

1. **fresh prefix**: a system prompt nobody has seen (``source_prefix_tokens`` tokens, a random tag first: 128 blocks
   of 16 tokens by default, of which the first 127 are placed), run once through the front end without a fault --
   its tokens are the row's reference, and the instances that served it now hold its blocks (they publish them,
   ``https`` and ``moqt://``);
2. **the victim gets the blocks**: a holder by ``PUT blocks`` (the octets as GET from an instance that holds them;
   the holder publishes its records and their ``moqt://`` twins), the relay by a FETCH through it of each block's
   ``moqt://`` record (the relay fetches from the instance the Index Service names, verifies the layer digests,
   caches the block and advertises it with its own ``moqt://`` record);
3. **no other source**: every instance that holds the blocks is stopped with
   SIGTERM (it withdraws its records) and started again on its port, with an empty cache; a lookup of the prefix
   then names the victim's records only, so the victim is the instances' preferred source -- it is the only one;
4. **the kill on an observable event**: the workload runs with this prefix, and the victim's own counter of blocks
   served (``kvsp_holder_events_total{event="fetched"}`` of a holder, ``kvsp_relay{counter="metrics_fetches"}`` of
   the relay), polled every few milliseconds, fires the kill at its first increase: a load from the victim has
   started, and the other blocks of the prefix (loaded concurrently) are still on their way.

The row reports ``served`` (blocks the victim had been asked for when it was killed) and ``cut`` (attempts at a
replica that failed at the surviving instances during the run: ``kvsp_retrieval_failed_attempts_total
{failure="transport"}``, as the instance's fetcher counts a connection that broke off or went silent). A row with
``served`` or ``cut`` 0 did not cut a load from the victim: it says so in its errors and is not ok.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvsp_app.chaos_cluster import INSTANCES, ChaosCluster
from kvsp_app.demo import SYSTEM_PROMPT

SOURCE_FAULTS = {"holder-kill": "holder-b", "relay-kill": "relay", "holder-restart": "holder-a"}
SERVED = {"holder": 'kvsp_holder_events_total{event="fetched"}', "relay": 'kvsp_relay{counter="metrics_fetches"}'}
FAILED = 'kvsp_retrieval_failed_attempts_total{component="retrieval",failure="transport"}'


@dataclass
class Seeded:
    """A source fault's own prefix, placed at its victim only."""

    victim: str
    prefix: str
    keys: tuple[bytes, ...] = ()  # the Block Keys of the prefix's complete blocks
    reference: list[list[int]] = field(default_factory=list)  # the tokens of the fault-free run of this prefix
    purged: list[str] = field(default_factory=list)  # the instances restarted so that they hold none of it


def fresh_prefix(tokens: int) -> str:
    """A system prompt nobody has seen: a random tag, then the demo's system prompt repeated to *tokens* bytes."""
    head = f"[source fault {uuid.uuid4().hex[:12]}] "
    return (head + SYSTEM_PROMPT * (tokens // len(SYSTEM_PROMPT) + 1))[:tokens]


class Sources:
    """What a source fault needs of the cluster: keys, lookups, copies to the victim, counters."""

    def __init__(self, cluster: ChaosCluster) -> None:
        from kvsp_app.serve import read_scope_key
        from kvsp_client.api import KvspApi, ServiceEndpoints
        from kvsp_quic.compat import CompatDescriptor
        from kvsp_quic.keys import BlockKeyer

        self.cluster = cluster
        self.api = KvspApi(cluster.client)
        self.index = ServiceEndpoints.of([cluster.uris[n] for n in ("index-a", "index-b")], "index")
        self.descriptor = CompatDescriptor.from_json(cluster.descriptor)
        self.keyer = BlockKeyer(read_scope_key(cluster.root / "dev" / "scope.key"), bytes(self.descriptor.compat_id),
                                self.descriptor.block_tokens)

    async def keys_of(self, prefix: str) -> tuple[bytes, ...]:
        """The Block Keys of *prefix*'s complete blocks but the last (a tokenizer may join it to what follows), as the
        front end computes them: its own tokenizer (``POST tokenize``), the dev scope key, the instances' descriptor."""
        url = self.cluster.completions.split("v1/", 1)[0] + "tokenize"
        r = await self.cluster.client.request("POST", url, content=json.dumps({"prompt": prefix}).encode(),
                                              headers={"content-type": "application/json"})
        if r.status != 200:
            raise RuntimeError(f"POST tokenize answered {r.status}: {(r.content or b'')[:200]!r}")
        keys = self.keyer.keys(json.loads(r.content)["tokens"])
        return tuple(bytes(k) for k in keys[:-1])

    async def replicas(self, keys: tuple[bytes, ...]) -> list[tuple[Any, ...]]:
        """Each key's replicas at the Index Service (an empty tuple for a key past the matched prefix)."""
        from kvsp_quic.fields import BlockKey
        from kvsp_quic.records import LookupRequest

        found = await self.api.lookup(self.index, LookupRequest(
            scope_id=self.keyer.scope_id, compat_id=self.keyer.compat_id, block_keys=tuple(BlockKey(k) for k in keys)))
        out: list[tuple[Any, ...]] = [m.replicas for m in found.blocks]
        return out + [()] * (len(keys) - len(out))

    def owner(self, holder: str) -> str | None:
        """The process name of a record's holder (``https`` or ``moqt://`` at the same host and port)."""
        from kvsp_quic.retrieval_plan import endpoint_key

        endpoint = endpoint_key(holder)
        for name, uri in list(self.cluster.uris.items()) + list(self.cluster.moqt.items()):
            if endpoint_key(uri) == endpoint:
                return name
        return None

    async def holders(self, keys: tuple[bytes, ...]) -> list[set[str]]:
        return [{self.owner(r.holder) or r.holder for r in found} for found in await self.replicas(keys)]

    async def copy_to(self, victim: str, keys: tuple[bytes, ...]) -> None:
        """Give *victim* (a holder or the relay) every block of *keys*, from the instances that hold them."""
        matches = await self.replicas(keys)
        missing = [i for i, found in enumerate(matches) if not found]
        if missing:
            raise RuntimeError(f"{len(missing)} of the {len(keys)} prefix blocks are held nowhere after its run")
        sem = asyncio.Semaphore(8)
        pool = None
        if victim == "relay":
            from moqt.aio import MoqtPool
            from quic.tls import TlsFiles

            fe = self.cluster.procs["frontend"].ready
            root = self.cluster.root
            pool = MoqtPool(TlsFiles(root / fe["ca"], root / fe["client_cert"], root / fe["client_key"]))

        from kvsp_client.api import Miss

        async def one(key: bytes, found: tuple[Any, ...]) -> None:
            async with sem:
                if pool is not None:
                    from kvsp_moqt.holder_tracks import fetch_replica

                    twin = next(r for r in found if r.holder.startswith("moqt://") and r.moqt_namespace)
                    through = dataclasses.replace(twin, holder=self.cluster.moqt["relay"])
                    async for _layer in fetch_replica(pool, through, descriptor=self.descriptor):
                        pass
                    return
                record = next(r for r in found if r.holder.startswith("https://"))
                body = await self.api.get_block(record.holder, bytes(record.compat_id), bytes(record.scope_id), key)
                if isinstance(body, Miss):
                    raise RuntimeError(f"GET of block {key.hex()[:12]} at {record.holder}: {body}")
                octets = await body.aread()
                await self.api.put_block(self.cluster.uris[victim], bytes(record.compat_id),
                                         bytes(record.scope_id), key, octets)

        try:
            await asyncio.gather(*(one(k, found) for k, found in zip(keys, matches, strict=True)))
        finally:
            if pool is not None:
                await pool.aclose()

    async def wait_for(self, keys: tuple[bytes, ...], test: Callable[[list[set[str]]], bool], what: str,
                       timeout: float = 30.0) -> list[set[str]]:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            with contextlib.suppress(Exception):
                held = await self.holders(keys)
                if test(held):
                    return held
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"after {timeout:.0f} s, {what}")
            await asyncio.sleep(0.25)

    async def counter(self, name: str, metric: str) -> float | None:
        """One counter of process *name* (``GET metrics``), or None when it does not answer."""
        from kvsp_app.demo import _metrics

        with contextlib.suppress(Exception):
            values = await asyncio.wait_for(_metrics(self.cluster.client, self.cluster.uris[name]), 5)
            return values.get(metric, 0.0)
        return None

    async def served(self, victim: str) -> float | None:
        return await self.counter(victim, SERVED["relay" if victim == "relay" else "holder"])

    async def failed_attempts(self) -> dict[str, float]:
        """Failed transfer attempts per running instance (``kvsp_retrieval_failed_attempts_total`` transport)."""
        out = {}
        for name in INSTANCES:
            if self.cluster.procs[name].proc.poll() is None and name not in self.cluster.stopped:
                value = await self.counter(name, FAILED)
                if value is not None:
                    out[name] = value
        return out


async def seed(cluster: ChaosCluster, sources: Sources, victim: str, tokens: int,
               run: Callable[[str], Awaitable[list[list[int]]]], progress: Callable[[str], None]) -> Seeded:
    """Steps 1-3 of the module docstring: a fresh prefix, its reference tokens, placed at *victim* only."""
    seeded = Seeded(victim, fresh_prefix(tokens))
    seeded.reference = await run(seeded.prefix)
    seeded.keys = await sources.keys_of(seeded.prefix)
    held = await sources.wait_for(seeded.keys, lambda h: all(h), "the prefix's blocks are not all published")
    holding = sorted({n for names in held for n in names if n in INSTANCES})
    await sources.copy_to(victim, seeded.keys)
    await sources.wait_for(seeded.keys, lambda h: all(victim in names for names in h),
                           f"{victim} does not advertise every block of the prefix")
    seeded.purged = holding
    progress(f"      {victim} holds the {len(seeded.keys)} blocks of a fresh {tokens}-token prefix; restarting "
             f"{', '.join(holding)} (SIGTERM: their records withdrawn, their caches empty)")
    await asyncio.gather(*(asyncio.to_thread(cluster.restart, name, graceful=True) for name in holding))
    await sources.wait_for(seeded.keys, lambda h: all(names == {victim} for names in h),
                           f"the prefix is still advertised by another source than {victim}")
    return seeded


async def kill_on_first_load(sources: Sources, victim: str, before: float, fire: Callable[[], Awaitable[None]],
                             done: asyncio.Event, state: dict[str, Any], interval: float = 0.003) -> None:
    """Step 4: poll *victim*'s counter of blocks served; at its first increase over *before*, *fire* the kill. When
    the workload ends first, fire anyway (the cluster is restored the same way) and record ``served`` 0."""
    while not done.is_set():
        now = await sources.served(victim)
        if now is not None and now > before:
            state["served"] = now - before
            await fire()
            return
        await asyncio.sleep(interval)
    state["served"] = 0.0
    await fire()


__all__ = ["FAILED", "SERVED", "SOURCE_FAULTS", "Seeded", "Sources", "fresh_prefix", "kill_on_first_load", "seed"]
