"""Retrieval over the TCP path (issue 16, goals 2 and 6): the lean HTTP/1.1 client delivers a block body straight
into the attempt's decoder (``Response.receive_into`` with a sink around it: no scratch buffer, no ``bytes`` chunk),
and layers still stream as they are verified; every failure maps as over HTTP/3.

The servers are tests/support/retrieval.py's (one RoleServer with the Index Service, real holders and misbehaving
fake holders on 127.0.0.1); here the client prefers the TCP path.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any

import pytest

from http3.client import KvspClient
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic import container as c
from kvsp_quic.container import DecodedLayer
from kvsp_quic.records import ReplicaRecord, ResidencyEntry
from kvsp_quic.retrieval_plan import DefaultRanking, LayerRange, Ranking
from tests.support.retrieval import (
    LAYERS,
    Net,
    assert_block,
    block,
    key,
    one_match,
)


@pytest.fixture
async def tcp(net: Net) -> AsyncIterator[KvspClient]:
    async with KvspClient(net.certs.files("alice"), timeout=10.0, prefer="tcp") as client:
        yield client


def fetcher_of(net: Net, client: KvspClient, **kwargs: Any) -> BlockFetcher:
    return BlockFetcher(client, net.uri("is"), descriptors=[net.d], **kwargs)


async def gated_layers(net: Net, fake: str, stream: AsyncIterable[DecodedLayer]) -> list[DecodedLayer]:
    """The layers of *stream*, opening the fake holder's gate after each one (so the holder sends layer l + 1 only
    once the caller has layer l: a layer held back until the body ends deadlocks, caught by the timeout)."""
    net.fakes[fake].gate = gate = asyncio.Event()
    out = []
    async with asyncio.timeout(5):
        async for layer in stream:
            out.append(layer)
            gate.set()
    return out


async def test_the_body_lands_in_the_decoders_own_buffer_while_layers_stream(net: Net, tcp: KvspClient) -> None:
    """Zero-copy mode: TLS decrypts the body into the decoder's buffer (one for the block's data), so each layer's
    K and V are single views of that one buffer -- not views of the transport's ``bytes`` chunks -- and each layer
    is handed over before the holder sends the next."""
    genuine = await net.store("h1", 1)
    await net.fake("bad", 1, genuine)  # device tier: tried first; sends each layer only after the previous is taken
    fetcher = fetcher_of(net, tcp)
    stream = fetcher.fetch_layers(await one_match(fetcher, 1))
    layers = await gated_layers(net, "bad", stream)
    assert [layer.index for layer in layers] == list(range(LAYERS)) and stream.complete
    assert stream.transports == ["HTTP/1.1"] and [r.holder for r in stream.records] == [net.uri("bad")]
    parts = [part for layer in layers for part in layer.k_parts + layer.v_parts]
    assert len(parts) == 2 * LAYERS  # one part per section: nothing arrived as separate chunks
    owners = {id(part.obj) for part in parts}
    assert len(owners) == 1 and all(type(part.obj) is bytearray for part in parts)  # the decoder's one buffer
    assert b"".join(bytes(layer.k) + bytes(layer.v) for layer in layers) == \
        block(net.d, 1)[c.parse_header(block(net.d, 1)).size:]
    assert fetcher.metrics.bytes_by_transport == {"HTTP/1.1": len(block(net.d, 1))}


async def test_assembled_into_the_callers_buffer(net: Net, tcp: KvspClient) -> None:
    await net.store("h1", 1)
    arena = bytearray(1 << 16)
    fetcher = fetcher_of(net, tcp, assemble=True, allocate=lambda n: memoryview(arena)[:n])
    result = assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    assert result.http_version == "HTTP/1.1"
    assert all(part.obj is arena for layer in result.layers for part in layer.k_parts + layer.v_parts)


async def test_one_layer_and_a_range_of_layers(net: Net, tcp: KvspClient) -> None:
    await net.store("h1", 1)
    fetcher = fetcher_of(net, tcp)
    match = await one_match(fetcher, 1)
    original = c.decode(block(net.d, 1))[1]
    for wanted in ((2, 2), (1, 3)):
        result = await fetcher.fetch_block(match, wanted)
        assert result is not None and result.http_version == "HTTP/1.1"
        assert [layer.index for layer in result.layers] == list(range(wanted[0], wanted[1] + 1))
        for layer in result.layers:
            assert (bytes(layer.k), bytes(layer.v)) == (bytes(original[layer.index].k), bytes(original[layer.index].v))
    assert [r[2] for r in net.router.requests("/h1/blocks/")] == ["layers=2-2", "layers=1-3"]


async def test_a_corrupt_layer_is_caught_mid_body_and_the_rest_comes_from_the_next_replica(
        net: Net, tcp: KvspClient) -> None:
    genuine = await net.store("h1", 1)
    net.fakes["bad"].mode = "flip"  # layer 2 has a flipped bit; Repr-Digest matches what is sent
    await net.fake("bad", 1, genuine)
    fetcher = fetcher_of(net, tcp)
    stream = fetcher.fetch_layers(await one_match(fetcher, 1))
    assert [layer.index for layer in await gated_layers(net, "bad", stream)] == [0, 1, 2, 3] and stream.complete
    assert [r.holder for r in stream.records] == [net.uri("bad"), net.uri("h1")]  # layers 0-1, then 2-3
    assert net.router.requests("/h1/blocks/")[-1][2] == "layers=2-3"
    m = fetcher.metrics
    assert (m.digest_failures, m.withdrawals, m.hits, m.misses) == (1, 1, 1, 0)


@pytest.mark.parametrize("mode", ["repr", "norepr-nolayers"])
async def test_the_layers_that_end_the_body_wait_for_repr_digest(net: Net, tcp: KvspClient, mode: str) -> None:
    """A wrong Repr-Digest fails the replica before its last layer is handed over (the spec: clients MUST verify
    it), even though every layer digest matched; the block then comes whole from the next replica."""
    genuine = await net.store("h1", 1)
    fake = net.fakes["bad2"]  # alice may not withdraw for bad2: only noted
    if mode == "repr":
        fake.mode = "repr"  # right octets, wrong Repr-Digest
        await net.fake("bad2", 1, genuine)
        fetcher = fetcher_of(net, tcp, ranking=_prefer(net.uri("bad2")))
        stream = fetcher.fetch_layers(await one_match(fetcher, 1))
        layers = await gated_layers(net, "bad2", stream)
        # layers 0-2 streamed from bad2; layer 3 ends its body, was held back and dropped with it
        assert [r.holder for r in stream.records] == [net.uri("bad2"), net.uri("h1")]
        assert net.router.requests("/h1/blocks/")[-1][2] == "layers=3-3"
        assert fetcher.metrics.digest_failures == 1
    else:  # without layer digests every layer waits for the end of the body; another block's octets fail it
        fake.mode = "ok"
        fake.blocks[key(1).hex()] = block(net.d, 5)
        await net.publish(dataclasses.replace(_moved(genuine, net.uri("bad2")), layer_digests=None))
        fetcher = fetcher_of(net, tcp, ranking=_prefer(net.uri("bad2")))
        stream = fetcher.fetch_layers(await one_match(fetcher, 1))
        async with asyncio.timeout(5), stream:
            layers = [layer async for layer in stream]
        assert [r.holder for r in stream.records] == [net.uri("h1")]  # nothing was handed over from bad2
        assert fetcher.metrics.digest_failures == 1
    assert [layer.index for layer in layers] == [0, 1, 2, 3] and stream.complete
    original = block(net.d, 1)
    assert b"".join(bytes(layer.k) + bytes(layer.v) for layer in layers) == original[c.parse_header(original).size:]


async def test_a_container_other_than_asked_is_malformed(net: Net, tcp: KvspClient) -> None:
    genuine = await net.store("h1", 1)
    net.fakes["bad"].blocks[key(1).hex()] = c.cut(block(net.d, 1), 0, 2).tobytes()  # layers 0-2 for 0-3
    await net.publish(_moved(genuine, net.uri("bad")))
    fetcher = fetcher_of(net, tcp, ranking=_prefer(net.uri("bad")))
    result = assert_block(await fetcher.fetch_block(await one_match(fetcher, 1)), net.d, 1)
    assert [r.holder for r in result.records] == [net.uri("h1")]
    assert fetcher.metrics.malformed == 1


@pytest.mark.parametrize("streamed", [True, False])
async def test_a_body_that_stalls_is_a_transport_failure(net: Net, streamed: bool) -> None:
    """A holder that goes silent mid-body fails the attempt after the stall timeout (``HttpSource``: a few RTTs plus
    the block at a slow rate, at most the request timeout); the layers it delivered stay, the rest come from the
    next replica. Streamed: layers are handed over as they come (the delivery runs in a task of its own); else
    (no layer digests to check) the delivery runs in the attempt's task, watched by a timer."""
    genuine = await net.store("h1", 1)
    await net.fake("bad", 1, genuine, **({} if streamed else {"layer_digests": None}))
    net.fakes["bad"].gate = asyncio.Event()  # never set: only layer 0 is sent
    async with KvspClient(net.certs.files("alice"), timeout=3.0, prefer="tcp") as client:
        fetcher = fetcher_of(net, client, report_failures=False)
        stream = fetcher.fetch_layers(await one_match(fetcher, 1))
        async with asyncio.timeout(20), stream:
            layers = [layer async for layer in stream]
    assert [layer.index for layer in layers] == [0, 1, 2, 3] and stream.complete
    assert [r.holder for r in stream.records] == ([net.uri("bad"), net.uri("h1")] if streamed else [net.uri("h1")])
    assert set(stream.transports) == {"HTTP/1.1"} and fetcher.metrics.transport_errors == 1


def _moved(record: ReplicaRecord, holder: str) -> ReplicaRecord:
    """*record* as published by the fake *holder* (every layer, device tier)."""
    return dataclasses.replace(record, holder=holder, residency=(ResidencyEntry("device", (0, LAYERS - 1)),))


def _prefer(first: str) -> Ranking:
    """The default ranking, with *first*'s replicas tried first."""
    default = DefaultRanking()

    def ranking(replicas: Sequence[ReplicaRecord], layers: LayerRange) -> list[ReplicaRecord]:
        return sorted(default(replicas, layers), key=lambda r: r.holder != first)

    return ranking
