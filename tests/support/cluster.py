"""Blocks for the tests that run real ``kvsp-quic index --dev`` and ``kvsp-quic holder --dev`` processes: the example
descriptor's blocks by number, their URLs at a holder, PUTs (plain and in a chain) and waits on the index."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic import container
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.samples import example_descriptor, random_sections

DESCRIPTOR = example_descriptor()  # 32 layers, 4-token blocks, 8 heads x 128 bf16: 512 KiB of K and V a block
SCOPE_KEY = bytes(range(32))
KEYER = BlockKeyer(SCOPE_KEY, DESCRIPTOR.compat_id, DESCRIPTOR.block_tokens)
CONTAINER_SIZE = len(container.encode(random_sections(DESCRIPTOR, 4, 0, 31, 0), first_layer=0, token_count=4,
                                      descriptor=DESCRIPTOR, digests=False))


def block(i: int) -> tuple[bytes, bytes]:
    """Block *i* of a prompt: its key and its container (seeded, so the test can compare octets)."""
    tokens = list(range(1000, 1000 + 4 * (i + 1)))
    key = KEYER.keys(tokens)[-1]
    enc = container.encode(random_sections(DESCRIPTOR, 4, 0, 31, seed=i), first_layer=0, token_count=4,
                           descriptor=DESCRIPTOR)
    return key, enc.tobytes()


def block_url(holder: str, key: bytes) -> str:
    return f"{holder}blocks/{DESCRIPTOR.compat_id.hex()}/{KEYER.scope_id.hex()}/{key.hex()}"


async def put(client: KvspClient, holder: str, i: int) -> Any:
    key, body = block(i)
    return await client.request("PUT", block_url(holder, key), content=body,
                                headers={"content-type": "application/kvsp-block", "if-none-match": "*"})


async def matched(fetcher: BlockFetcher, i: int) -> bool:
    response = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(i)[0]])
    return response.matched == 1


async def eventually(fetcher: BlockFetcher, i: int, present: bool, timeout: float = 10.0) -> None:
    """The publisher works asynchronously: wait for the index to say what we expect."""
    deadline = time.monotonic() + timeout
    while await matched(fetcher, i) != present:
        assert time.monotonic() < deadline, f"block {i} {'never appeared in' if present else 'stayed in'} the index"
        await asyncio.sleep(0.05)


async def put_in_chain(client: KvspClient, holder: str, i: int) -> None:
    key, body = block(i)
    chain = block(0)[0].hex()
    r = await client.request("PUT", f"{block_url(holder, key)}?chain={chain}&position={i}", content=body,
                             headers={"content-type": "application/kvsp-block", "if-none-match": "*"})
    assert r.status == 201, await r.aread()


async def matched_run(fetcher: BlockFetcher, count: int) -> int:
    found = await fetcher.lookup(DESCRIPTOR.compat_id, KEYER.scope_id, [block(i)[0] for i in range(count)])
    return found.matched


async def settle(fetcher: BlockFetcher, count: int, want: Any, timeout: float = 15.0) -> int:
    """The publisher works asynchronously: wait until the matched run satisfies *want*, return it."""
    deadline = time.monotonic() + timeout
    while True:
        run = await matched_run(fetcher, count)
        if want(run) or time.monotonic() > deadline:
            return run
        await asyncio.sleep(0.1)
