"""Several URIs for every service (issue 12, point 2), with real processes on 127.0.0.1: ``--index`` and
``--controller`` repeatable and lists in TOML, one URI per value; the typed client failing over to the next URI of
the Index Service or the Placement Controller; QUIC PINGs noticing a dead or frozen peer in about a second."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from http3.client import KvspClient, TransportError
from http3.h3_client import KeepAlive
from kvsp_app.config import ConfigError, FrontendFile, HolderFile, InstanceFile, RelayFile, build
from kvsp_client.api import KvspApi, RetryElsewhere, ServiceEndpoints
from kvsp_quic import container
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.records import LookupRequest
from kvsp_quic.samples import example_descriptor, random_sections
from quic.tls import TlsFiles
from tests.helpers import Process, run_cli
from tests.support.waits import until

DESCRIPTOR = example_descriptor()
KEYER = BlockKeyer(bytes(range(32)), DESCRIPTOR.compat_id, DESCRIPTOR.block_tokens)
A, B = "https://127.0.0.1:7001/", "https://127.0.0.1:7002/kvsp/"


# -- configuration ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "section", "key"), [
    (HolderFile, "holder", "index"), (RelayFile, "relay", "index"), (InstanceFile, "instance", "index"),
    (InstanceFile, "instance", "controller"), (FrontendFile, "frontend", "controller"),
])
def test_toml_takes_a_list_or_one_string(cls: Any, section: str, key: str) -> None:
    cfg = build(cls, {section: {key: [A, B]}})
    assert getattr(getattr(cfg, section), key) == [A, B]
    cfg = build(cls, {section: {key: A}})  # as earlier releases wrote it
    assert getattr(getattr(cfg, section), key) == [A]
    assert getattr(getattr(build(cls, {}), section), key) == []
    with pytest.raises(ConfigError) as info:
        build(cls, {section: {key: f"{A},{B}"}}, source="config 'x.toml'")
    message = str(info.value)
    assert message.startswith(f"config 'x.toml': {section}.{key}: ") and "not exactly one base URI" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match=rf"{section}\.{key}\[1\]: scheme must be https"):
        build(cls, {section: {key: [A, "http://127.0.0.1/"]}})
    with pytest.raises(ConfigError, match=rf"{section}\.{key}\[1\]: .* listed twice"):
        build(cls, {section: {key: [A, A]}})
    with pytest.raises(ConfigError, match=rf"{section}\.{key}\[0\]: must be a string"):
        build(cls, {section: {key: [7]}})


@pytest.mark.parametrize("argv", [
    ["holder", "--index", f"{A},{B}"],
    ["holder", "--index", A, "--index", f"{A} {B}"],
    ["relay", "--index", f"{A},{B}"],
    ["frontend", "--controller", f"{A},{B}"],
    ["instance", "--model", "m", "--controller", A, "--controller", f"{A},{B}"],
])
def test_a_value_that_is_not_one_uri_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                            argv: list[str]) -> None:
    code, out, err = run_cli(capsys, *argv, "--dev", str(tmp_path / "dev"))
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "not exactly one base URI" in err, err


def test_service_endpoints_order_and_backoff() -> None:
    now = [100.0]
    eps = ServiceEndpoints([A, B], "index", start=1, clock=lambda: now[0])
    assert eps.order() == [B, A] and eps.primary == B and str(eps) == f"{A}, {B}"
    eps.failed(B)
    assert eps.order() == [A, B] and eps.is_down(B) and eps.probes_due() == []
    now[0] += 2.0
    assert eps.probes_due() == [B]
    eps.failed(B)  # the probe failed: twice the backoff
    now[0] += 2.0
    assert eps.probes_due() == []
    now[0] += 2.0
    assert eps.probes_due() == [B]
    eps.answered(B)
    assert eps.order() == [B, A]
    spread = ServiceEndpoints([A, B], rotate=True, start=0)
    assert [spread.order()[0] for _ in range(4)] == [A, B, A, B]
    assert {ServiceEndpoints([A, B]).primary for _ in range(64)} == {A, B}  # clients spread over the replicas
    with pytest.raises(ValueError, match="not exactly one base URI"):
        ServiceEndpoints(f"{A},{B}")
    with pytest.raises(ValueError, match="at least one"):
        ServiceEndpoints([])
    one = ServiceEndpoints(A)
    one.failed(A)  # one URI: nothing to reorder, nothing to probe
    assert not one.is_down(A) and one.order() == [A]


# -- real processes -----------------------------------------------------------------------------------------------


def dead_uri() -> str:
    """A base URI on a port nobody listens on (UDP and TCP)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"https://127.0.0.1:{port}/"


def files_of(ready: dict[str, Any]) -> TlsFiles:
    return TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))


def block(i: int) -> tuple[bytes, bytes]:
    tokens = list(range(1000, 1000 + 4 * (i + 1)))
    key = KEYER.keys(tokens)[-1]
    enc = container.encode(random_sections(DESCRIPTOR, 4, 0, 31, seed=i), first_layer=0, token_count=4,
                           descriptor=DESCRIPTOR)
    return key, enc.tobytes()


def lookup_of(key: bytes) -> LookupRequest:
    return LookupRequest(ScopeId(KEYER.scope_id), CompatId(DESCRIPTOR.compat_id), (BlockKey(key),))


async def test_a_holder_publishes_to_the_index_that_answers(tmp_path: Path, procs: list[Process]) -> None:
    dev = tmp_path / "dev"
    index = Process("index", "--dev", str(dev))
    procs.append(index)
    live, dead = index.ready["base_uri"], dead_uri()
    holder = Process("holder", "--dev", str(dev), "--index", dead, "--index", live, "--replica-ttl-ms", "30000")
    procs.append(holder)
    assert holder.ready["index"] == dead and holder.ready["indexes"] == [dead, live]  # `index`: the first, as before
    key, body = block(0)
    async with KvspClient(files_of(holder.ready), timeout=10) as client:
        url = f"{holder.ready['base_uri']}blocks/{DESCRIPTOR.compat_id.hex()}/{KEYER.scope_id.hex()}/{key.hex()}"
        put = await client.request("PUT", url, content=body, headers={"content-type": "application/kvsp-block",
                                                                                  "if-none-match": "*"})
        assert put.status == 201, put.content
        api = KvspApi(client)

        async def published() -> bool:
            return (await api.lookup(live, lookup_of(key))).matched == 1

        # The first publish may go to the dead URI first (each holder prefers one at random): an HTTP/3 connect
        # that times out (5 s: UDP gives no refusal) and a refused TCP connect later, it goes to the live one.
        await until(published, 20.0, "the holder's replica at the live Index Service")


async def test_the_client_fails_over_and_probes_the_failed_uri_again(tmp_path: Path, procs: list[Process]) -> None:
    index = Process("index", "--dev", str(tmp_path / "dev"))
    procs.append(index)
    live, dead = index.ready["base_uri"], dead_uri()
    async with KvspClient(files_of(index.ready), timeout=10, connect_timeout=1.0) as client:
        api = KvspApi(client)
        eps = ServiceEndpoints([dead, live], "index", start=0, backoff=0.5)
        found = await api.lookup(eps, lookup_of(block(0)[0]))  # the dead URI first: no answer, then the live one
        assert found.matched == 0 and eps.is_down(dead) and eps.primary == live
        started = time.monotonic()
        await api.lookup(eps, lookup_of(block(0)[0]))  # straight to the live URI now
        assert time.monotonic() - started < 0.5
        await asyncio.sleep(0.6)
        assert eps.probes_due() == [dead]
        await api.lookup(eps, lookup_of(block(0)[0]))  # starts a probe of the dead URI in the background
        await until(lambda: not eps._probes, 10.0, "the probe")
        assert eps.is_down(dead) and eps.probes_due() == []  # still dead: the next probe is later (1 s)
        with pytest.raises(RetryElsewhere):  # a plain str is one URI, as before
            await api.lookup(dead, lookup_of(block(0)[0]), timeout=3)


async def test_the_keepalive_notices_a_stopped_peer_within_two_seconds(tmp_path: Path,
                                                                      procs: list[Process]) -> None:
    index = Process("index", "--dev", str(tmp_path / "dev"))
    procs.append(index)
    uri = index.ready["base_uri"]
    async with KvspClient(files_of(index.ready), timeout=30) as client:
        client.keep_alive(uri, KeepAlive(interval=0.4, missed=3))
        api = KvspApi(client)
        await api.lookup(uri, lookup_of(block(0)[0]))
        assert client.pooled(uri) == 1
        await asyncio.sleep(1.5)  # an idle connection answers its PINGs: it stays
        assert client.pooled(uri) == 1
        os.kill(index.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            in_flight = asyncio.ensure_future(client.send("GET", f"{uri}instances", retries=0))
            elapsed = await until(lambda: client.pooled(uri) == 0, 5.0, "the pooled connection")
            assert elapsed < 2.5, elapsed
            with pytest.raises(TransportError):  # the request on it failed with it, not after 30 s
                await asyncio.wait_for(in_flight, 10)
            assert time.monotonic() - started < 10
        finally:
            os.kill(index.proc.pid, signal.SIGCONT)
        assert (await api.lookup(uri, lookup_of(block(0)[0]))).matched == 0  # a fresh connection


async def test_an_instance_reports_to_the_second_controller_when_the_first_dies(tmp_path: Path,
                                                                               procs: list[Process]) -> None:
    pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
    from gpu.modelfiles import ModelConfig, write_random_model

    config = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256, head_dim=16)
    model = write_random_model(tmp_path / "tiny", config, seed=1)
    dev = str(tmp_path / "dev")
    pcs = [Process("index", "--dev", dev), Process("index", "--dev", dev)]
    procs.extend(pcs)
    uris = [pc.ready["base_uri"] for pc in pcs]
    instance = Process("instance", "--dev", dev, "--device", "cpu", "--model", str(model), "--block-tokens", "4",
                       "--warmup-tokens", "8", "--controller", uris[0], "--controller", uris[1],
                       "--status-ttl-ms", "1500")
    procs.append(instance)
    assert instance.ready["controller"] == uris[0] and instance.ready["controllers"] == uris
    me = instance.ready["base_uri"]
    async with KvspClient(files_of(pcs[0].ready), timeout=5) as client:
        async def live_at(uri: str) -> bool:
            try:
                response = await client.request("GET", f"{uri}instances")
            except TransportError:
                return False
            return any(i["instance"] == me and "ttl_ms" in i for i in response.json()["instances"])

        async def anywhere() -> bool:
            return any([await live_at(u) for u in uris])

        await until(anywhere, 20.0, "the instance's status at a controller")
        first = 0 if await live_at(uris[0]) else 1  # the instance prefers one of them (at random)
        os.kill(pcs[first].proc.pid, signal.SIGKILL)
        other = uris[1 - first]
        assert not await live_at(other)  # it reported to the one it prefers only
        elapsed = await until(lambda: live_at(other), 10.0, "the status at the surviving controller")
        assert elapsed < 3.5, f"{elapsed:.2f} s from the SIGKILL to a status at the other controller"
