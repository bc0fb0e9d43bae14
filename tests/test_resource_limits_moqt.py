"""MOQT FETCH floods against real server processes (issue 13, point 4): the holder's MOQT endpoint and the relay's.
The measuring and the legitimate client are tests/support/resource_limits.py's (tests/test_resource_limits.py's
docstring says how they work); this module only attacks over MOQT.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvsp_moqt.tracks import track_name, track_namespace
from kvsp_quic import container
from moqt.aio import MoqtConnectError, MoqtRequestError, MoqtSessionClosed, MoqtStalled, connect_moqt
from moqt.types import Location
from quic.tls import TlsFiles, TransportSettings
from tests.helpers import Process
from tests.support.cluster import DESCRIPTOR, KEYER, block
from tests.support.resource_limits import (
    BLOCKS,
    Legit,
    MiB,
    RssProbe,
    client_files,
    issue_client,
    legit_during,
    report,
    slow,
    start_holder,
    upload_blocks,
)

CODEC_RAW = 1


# -- MOQT FETCH floods -------------------------------------------------------------------------------------------


@dataclass
class FetchFlood:
    accepted: int = 0
    refused: dict[int, int] = field(default_factory=dict)  # error code -> count
    held_back: int = 0  # never sent: the server's request credit (draft 18: request streams) stayed closed
    not_connected: list[str] = field(default_factory=list)  # attacker sessions that could not be set up
    other: list[str] = field(default_factory=list)
    session_closed: list[str] = field(default_factory=list)


def moqt_address(ready: dict[str, Any]) -> tuple[str, int]:
    host, port = ready["moqt"].removeprefix("moqt://").rstrip("/").rsplit(":", 1)
    return host, int(port)


def block_track(ready: dict[str, Any], i: int) -> tuple[tuple[bytes, ...], bytes]:
    return (track_namespace(DESCRIPTOR.compat_id, KEYER.scope_id, ready["base_uri"], CODEC_RAW),
            track_name(block(i)[0]))


async def flood_fetches(ready: dict[str, Any], sessions: int, fetches: int, alpn: str) -> FetchFlood:
    """*sessions* MOQT sessions each sending *fetches* FETCHes of the blocks, reading nothing: small receive windows
    and many data streams admitted, so that the server holds what it cannot send."""
    result = FetchFlood()
    host, port = moqt_address(ready)
    tight = TransportSettings(stream_window=64 << 10, connection_window=1 << 20)

    async def one_session() -> None:
        try:
            conn = await connect_moqt(host, port, client_files(ready), alpn=alpn, settings=tight,
                                      data_streams=1024, timeout=30)
        except MoqtConnectError as exc:  # an attacker's session not set up in time: recorded
            result.not_connected.append(str(exc))
            return
        streams = []
        try:
            for n in range(fetches):
                namespace, name = block_track(ready, n % BLOCKS)
                streams.append(conn.fetch(namespace, name, Location(0, 0), Location(1, 0)))
            wait = 10.0
            for stream in streams:
                try:
                    await stream.wait_accepted(wait)
                    result.accepted += 1
                except MoqtRequestError as exc:
                    result.refused[exc.error_code] = result.refused.get(exc.error_code, 0) + 1
                except MoqtStalled:
                    result.held_back += 1
                    wait = 0.1  # the ones after it are held back too
                except MoqtSessionClosed as exc:
                    result.session_closed.append(str(exc))
                    break
                except Exception as exc:
                    result.other.append(repr(exc))
            await asyncio.sleep(2.0)  # the server holds what it could not send
        finally:
            for stream in streams:
                with contextlib.suppress(Exception):
                    await stream.aclose()
            with contextlib.suppress(Exception):
                await conn.aclose()

    await asyncio.gather(*(one_session() for _ in range(sessions)))
    return result


async def legit_moqt_fetch(ready: dict[str, Any], files: TlsFiles, alpn: str) -> float:
    """FETCH block 0 over MOQT and verify every object against the layers uploaded; the seconds it took."""
    host, port = moqt_address(ready)
    _header, layers = container.decode(block(0)[1], DESCRIPTOR)
    started = time.monotonic()
    conn = await connect_moqt(host, port, files, alpn=alpn, timeout=30)
    try:
        namespace, name = block_track(ready, 0)
        async with conn.fetch(namespace, name, Location(0, 0), Location(1, 0), stall_timeout=30) as stream:
            got = {o.object_id: bytes(o.payload) async for o in stream.objects() if o.payload}
    finally:
        await conn.aclose()
    assert got == {i: bytes(layer.k) + bytes(layer.v) for i, layer in enumerate(layers)}
    return time.monotonic() - started


async def run_fetch_flood(tmp_path: Path, procs: list[Process], *, sessions: int, fetches: int, alpn: str,
                          rss_bound: int) -> None:
    holder = start_holder(tmp_path, procs)
    ready = holder.ready
    await upload_blocks(ready)
    reader = issue_client(ready, "moqt-reader")  # another principal than the flooder's (limits are per principal)
    legit = Legit()
    with RssProbe(holder.proc.pid) as probe:
        async with legit_during(ready, legit, prefer="h3"):
            started = time.monotonic()
            flood_task = asyncio.create_task(flood_fetches(ready, sessions, fetches, alpn))
            await asyncio.sleep(1.0)
            # a legitimate MOQT FETCH during the flood, from a loop of its own (as legit_during's GETs)
            moqt_latency = await asyncio.to_thread(asyncio.run, legit_moqt_fetch(ready, reader, alpn))
            flood = await flood_task
            took = time.monotonic() - started
        await asyncio.sleep(1.0)
    probe.settle()
    report("moqt-fetch-flood", alpn=alpn, sessions=sessions, fetches_per_session=fetches, seconds=f"{took:.1f}",
           accepted=flood.accepted, refused=flood.refused, held_back=flood.held_back,
           closed=flood.session_closed[:2], other=flood.other[:2], not_connected=len(flood.not_connected),
           legit_moqt_fetch_ms=f"{moqt_latency * 1000:.0f}", rss=probe.text(), bound_MiB=rss_bound // MiB,
           legit=legit.text())
    assert flood.other == [] and flood.session_closed == []
    assert sum(flood.refused.values()) > 0  # the holder's per-principal bound (HolderTracks' max_in_flight)
    assert probe.growth < rss_bound, probe.text()
    assert moqt_latency < 10.0
    legit.check(max_latency=5.0)


@slow
async def test_a_moqt_fetch_flood_on_the_holder_at_scale(tmp_path: Path, procs: list[Process]) -> None:
    """8 sessions of 300 FETCHes each (draft 18): 2,400 FETCHes, one principal."""
    await run_fetch_flood(tmp_path, procs, sessions=8, fetches=300, alpn="moqt-18", rss_bound=320 * MiB)


@pytest.mark.parametrize("alpn", ["moq-00", "moqt-18"])
async def test_a_moqt_fetch_flood_on_the_holder(tmp_path: Path, procs: list[Process], alpn: str) -> None:
    """4 sessions of 150 FETCHes each, reading nothing (64 KiB receive windows, 1,024 data streams admitted):
    the holder serves at most 256 of one principal at once (the rest EXCESSIVE_LOAD / draft 14 INTERNAL_ERROR, or
    held back by draft 18's request streams), holds at most ``connection_send_buffer`` (16 MiB) unsent per
    connection, plus what a stream's own credit asks for): RSS grows by < 128 MiB (measured 55-90 MiB; it grew by
    305 MiB when each stream could buffer its 4 MiB whatever the connection held); another
    principal's MOQT FETCH (verified) takes < 10 s, verified HTTP/3 GETs < 5 s."""
    await run_fetch_flood(tmp_path, procs, sessions=4, fetches=150, alpn=alpn, rss_bound=128 * MiB)


async def test_a_moqt_fetch_flood_through_the_relay(tmp_path: Path, procs: list[Process]) -> None:
    """The relay (no cache, so that every FETCH goes upstream to the holder) flooded as the holder above: 4 sessions
    of 150 FETCHes reading nothing. Whatever per-principal bound the relay has (``[relay] client_max_in_flight``,
    ``client_max_buffered_bytes``) must keep its RSS growth < 128 MiB and another principal served."""
    dev = str(tmp_path / "dev")
    index = Process("index", "--dev", dev)
    procs.append(index)
    holder = start_holder(tmp_path, procs, "", "--index", index.ready["base_uri"])
    await upload_blocks(holder.ready)
    relay = Process("relay", "--dev", dev, "--workers", "1", "--index", index.ready["base_uri"], "--cache-size", "0")
    procs.append(relay)
    # the relay's address, the holder's namespace (its records at the index lead the relay to it)
    target = dict(holder.ready, moqt=relay.ready["moqt"])
    reader = issue_client(holder.ready, "relay-reader")
    await asyncio.to_thread(asyncio.run, legit_moqt_fetch(target, reader, "moqt-18"))  # the path works
    with RssProbe(relay.proc.pid) as probe:
        started = time.monotonic()
        flood_task = asyncio.create_task(flood_fetches(target, 4, 150, "moqt-18"))
        await asyncio.sleep(1.0)
        moqt_latency = await asyncio.to_thread(asyncio.run, legit_moqt_fetch(target, reader, "moqt-18"))
        flood = await flood_task
        took = time.monotonic() - started
    probe.settle()
    report("relay-fetch-flood", sessions=4, fetches_per_session=150, seconds=f"{took:.1f}", accepted=flood.accepted,
           refused=flood.refused, held_back=flood.held_back, closed=flood.session_closed[:2], other=flood.other[:2],
           legit_moqt_fetch_ms=f"{moqt_latency * 1000:.0f}", rss=probe.text(), bound_MiB=128)
    assert flood.other == [] and flood.session_closed == []
    assert sum(flood.refused.values()) > 0  # the relay's per-principal bound
    assert probe.growth < 128 * MiB, probe.text()
    assert moqt_latency < 10.0
