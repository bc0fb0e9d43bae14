"""Interop with moq-rs (moq-dev's Rust MOQT stack, PyPI ``moq-rs`` 0.5.1 / ``moq-ffi`` 0.4.18), on each draft it
speaks with us (``moq-00`` = draft 14, ``moqt-18``), over real sockets on 127.0.0.1, through the stock relay
(``kvsp_relay`` + ``moqt_handlers`` as `kvsp-quic relay` builds them: newest draft first):

* a moq-rs publisher (open prefix ``moq-test``) -> our relay -> a moq-rs subscriber (live groups, then a FETCH of
  the latest group), our client (FETCH, both drafts whatever the publisher's) and aiomoqt's FETCH client;
* a holder's KVSP tracks -> our relay -> a moq-rs fetcher that checks every layer's SHA-256 against the Replica
  Record's ``layer_digests`` itself (moq-rs SUBSCRIBEs before it FETCHes: the relay answers SUBSCRIBE to a block
  itself, moqt/relay/complete.py);
* ``moq.Server`` as a publisher our client fetches from.

moq-rs needs Python >= 3.12: it runs in ``.venv-moqrs`` (``.ci/run`` makes it from interop/requirements-moqrs.txt;
``KVSP_MOQRS_PYTHON`` names another interpreter), driven by interop/moqrs_peer.py. The tests are skipped, saying
why, only when that environment does not exist. What moq-rs cannot play is listed in docs/moqt.md ("moq-rs").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvsp_moqt.holder_tracks import HolderTracks
from kvsp_moqt.relay_policy import kvsp_relay
from kvsp_moqt.relay_rules import RelayRules
from kvsp_moqt.tracks import track_name, track_namespace
from kvsp_quic.auth import Policy
from kvsp_quic.roles.holder import Holder, HolderSettings
from moqt.aio import AUDIT, connect_moqt, moqt_handlers
from moqt.relay import Relay, RelayConfig
from moqt.types import Location
from quic.listener import QuicListener
from tests.peers import needs_peer
from tests.pki import TestPki, make_pki
from tests.support.descriptors import small_descriptor
from tests.support.moqt_relay import ALICE, HOLDER_URI, SCOPE, WRITER, block, key

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "interop" / "moqrs_peer.py"
MOQRS = Path(os.environ.get("KVSP_MOQRS_PYTHON", ROOT / ".venv-moqrs" / "bin" / "python"))
AIOMOQT = Path(os.environ.get("KVSP_AIOMOQT_PYTHON", ROOT / ".venv-aiomoqt" / "bin" / "python"))
RELAY_URI = "https://127.0.0.1/relay/"
SERVER_URI = "https://127.0.0.1/moq-server/"
ALPN = {14: "moq-00", 18: "moqt-18"}
DRAFTS = pytest.mark.parametrize("draft", [14, 18])


def _missing() -> str | None:
    if not MOQRS.exists():
        return (f"moq-rs is not installed: no {MOQRS} (moq-rs needs Python >= 3.12; .ci/run makes .venv-moqrs from "
                f"interop/requirements-moqrs.txt, or set KVSP_MOQRS_PYTHON)")
    probe = subprocess.run([str(MOQRS), "-c", "import moq"], capture_output=True, timeout=60)
    if probe.returncode:
        return f"{MOQRS} cannot import moq: {probe.stderr.decode()[-300:]}"
    return None


MISSING = _missing()
pytestmark = needs_peer(MISSING)


# Its own PKI: the moq-rs server's certificate (moqserver) besides the holder's and the relay's.
@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"),
                    roles={"holder": HOLDER_URI, "relay": RELAY_URI, "moqserver": SERVER_URI})


def peer_args(certs: TestPki, who: str) -> list[str]:
    files = certs.files(who)
    return ["--cert", str(files.cert), "--key", str(files.key), "--ca", str(files.ca)]


def payload(group: int, obj: int, size: int) -> bytes:  # interop/moqrs_peer.py's
    seed = hashlib.sha256(b"moq-rs interop %d/%d" % (group, obj)).digest()
    return (seed * (size // len(seed) + 1))[:size]


@contextlib.asynccontextmanager
async def process(*args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    stderr = None if os.environ.get("MOQRS_LOG") else subprocess.PIPE  # MOQRS_LOG=debug: moq-rs's tracing shown
    proc = await asyncio.create_subprocess_exec(*args, stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def json_line(proc: asyncio.subprocess.Process, timeout: float = 30) -> dict[str, Any]:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not line:
        assert proc.stderr is not None
        raise AssertionError(f"the moq-rs peer printed nothing: {(await proc.stderr.read()).decode()[-2000:]}")
    result: dict[str, Any] = json.loads(line)
    assert "error" not in result, result
    return result


@contextlib.asynccontextmanager
async def our_relay(certs: TestPki, draft: int) -> AsyncIterator[tuple[Relay, int]]:
    """The stock relay. moq-rs offers both drafts and our relay prefers 18: for draft 14 it offers only moq-00."""
    policy = Policy.from_dict({"principal": [
        {"identity": HOLDER_URI, "roles": ["holder"], "scopes": "*"},
        {"identity": ALICE, "roles": ["instance"], "scopes": [SCOPE.hex()]},
        {"identity": "urn:kvsp:client:bob", "roles": ["client"], "scopes": []},
    ]})
    relay = kvsp_relay(RelayRules.of(policy, ["moq-test"]), RelayConfig())
    alpns = ("moq-00",) if draft == 14 else ("moqt-18", "moq-00")
    listener = QuicListener(certs.files("relay"), moqt_handlers(relay, alpns=alpns, data_streams=8))
    await listener.start("127.0.0.1", 0)
    try:
        yield relay, listener.port
    finally:
        await relay.aclose()
        await listener.close()


async def fetch_ours(port: int, certs: TestPki, alpn: str, namespace: tuple[bytes, ...], track: bytes,
                     group: int) -> list[bytes]:
    conn = await connect_moqt("127.0.0.1", port, certs.files("alice"), alpn=alpn, timeout=5)
    try:
        assert conn.alpn == alpn
        async with conn.fetch(namespace, track, Location(group, 0), Location(group, 0), stall_timeout=10) as fetch:
            objects = [o async for o in fetch.objects()]
        assert {o.group for o in objects} == {group}
        return [o.payload for o in objects]
    finally:
        await conn.aclose()


# -- moq-rs publisher -> our relay -> moq-rs, our client, aiomoqt -----------------------------------------------


@DRAFTS
async def test_moqrs_publisher_through_our_relay(certs: TestPki, draft: int) -> None:
    closes = dict(AUDIT.snapshot()[0])
    async with our_relay(certs, draft) as (relay, port):
        url = f"moqt://127.0.0.1:{port}/"
        common = ["--url", url, "--path", "moq-test/rs", "--track", "data"]
        async with process(str(MOQRS), str(PEER), "publish", *common, *peer_args(certs, "alice"), "--groups", "200",
                           "--objects", "4", "--size", "3000", "--every", "0.1") as publisher:
            await json_line(publisher)
            async with process(str(MOQRS), str(PEER), "subscribe", *common, *peer_args(certs, "bob"), "--groups",
                               "3", "--fetch-last") as subscriber:
                got = await json_line(subscriber)  # {"announced": ...}
                assert got == {"announced": "moq-test/rs"} or "ready" in got
                while "groups" not in got:
                    got = await json_line(subscriber)
            # every object of every live group and of the fetched group, checked against the publisher's payloads
            for kind in ("groups", "fetched"):
                for g, digests in got[kind].items():
                    assert digests == [hashlib.sha256(payload(int(g), i, 3000)).hexdigest() for i in range(4)], \
                        (kind, g, got.get("fetch_attempts"))
            assert relay.metrics["upstream_subscriptions"] >= 1
            # our client: FETCH of a group the publisher still holds (moq-rs keeps the latest one), on both drafts
            # (the cross-draft case, our client on draft 14 under a draft 18 publisher, is the next test)
            latest = int(max(got["groups"], key=int)) + 3  # ~0.3 s later: the publisher is past it
            await asyncio.sleep(0.35)
            objects = await fetch_ours(port, certs, ALPN[draft], (b"moq-test", b"rs"), b"data", latest)
            assert objects == [payload(latest, i, 3000) for i in range(4)]
    # no session of the run closed with an error (moq-rs's empty SUBSCRIBE_NAMESPACE prefix included)
    errors = {k: n - closes.get(k, 0) for k, n in AUDIT.snapshot()[0].items()
              if k[2] != "no_error" and n > closes.get(k, 0)}
    assert not errors, errors


async def test_moqrs_publisher_on_draft18_our_client_on_draft14(certs: TestPki) -> None:
    async with our_relay(certs, 18) as (_relay, port):
        url = f"moqt://127.0.0.1:{port}/"
        async with process(str(MOQRS), str(PEER), "publish", "--url", url, "--path", "moq-test/x", "--track", "t",
                           *peer_args(certs, "alice"), "--groups", "1", "--objects", "8", "--size",
                           "20000") as publisher:
            await json_line(publisher)
            await json_line(publisher)  # published
            objects = await fetch_ours(port, certs, "moq-00", (b"moq-test", b"x"), b"t", 0)
            assert objects == [payload(0, i, 20000) for i in range(8)]


@needs_peer(None if AIOMOQT.exists() else f"aiomoqt is not installed: no {AIOMOQT}")
@DRAFTS
async def test_moqrs_publisher_through_our_relay_to_aiomoqt(certs: TestPki, draft: int) -> None:
    async with our_relay(certs, draft) as (_relay, port):
        url = f"moqt://127.0.0.1:{port}/"
        async with process(str(MOQRS), str(PEER), "publish", "--url", url, "--path", "moq-test/a", "--track", "t",
                           *peer_args(certs, "alice"), "--groups", "1", "--objects", "6", "--size",
                           "5000") as publisher:
            await json_line(publisher)
            await json_line(publisher)
            files = certs.files("alice")
            async with process(str(AIOMOQT), str(ROOT / "interop" / "aiomoqt_peer.py"), "fetch", "--url", url,
                               "--draft", str(draft), "--cert", str(files.cert), "--key", str(files.key), "--ca",
                               str(files.ca), "--namespace", json.dumps(["moq-test", "a"]), "--track",
                               "t") as fetcher:
                result = await json_line(fetcher)
    one = result["results"][0]
    assert "error" not in one, one
    assert one["objects"] == list(range(6))
    assert one["digests"] == [hashlib.sha256(payload(0, i, 5000)).hexdigest() for i in range(6)]


# -- our holder's KVSP tracks -> our relay -> moq-rs FETCH ------------------------------------------------------


@DRAFTS
async def test_kvsp_block_through_our_relay_to_moqrs(certs: TestPki, draft: int) -> None:
    d = small_descriptor(layers=32)
    holder = Holder(HolderSettings(HOLDER_URI, (d,)))
    record = holder.store(WRITER, d.compat_id, SCOPE, key(7), block(d, 7), "*")
    assert record.layer_digests is not None
    namespace = track_namespace(d.compat_id, SCOPE, HOLDER_URI, 1)
    tracks = HolderTracks(holder, Policy.from_dict({"principal": [
        {"identity": RELAY_URI, "roles": ["holder"], "scopes": "*"}]}))
    async with our_relay(certs, draft) as (relay, port):
        pub = await connect_moqt("127.0.0.1", port, certs.files("holder"), alpn=ALPN[draft], app=tracks, timeout=5)
        try:
            await pub.publish_namespace(namespace)
            args = ["--url", f"moqt://127.0.0.1:{port}/", *peer_args(certs, "alice"),
                    "--path", "/".join(f.decode() for f in namespace), "--track", track_name(key(7)).decode(),
                    "--group", "0", "--digests", ",".join(h.hex() for h in record.layer_digests)]
            async with process(str(MOQRS), str(PEER), "fetch", *args) as fetcher:
                result = await json_line(fetcher)
        finally:
            await pub.aclose()
    # moq-rs SUBSCRIBEs (the relay answers: SUBSCRIBE_OK with Largest (0, 31), the End of Group marker at (0, 32)),
    # fills the group with a joining FETCH and FETCHes it: every layer checked by moq-rs's side against the record
    assert result["objects"] == 32 and result["verified"] is True and result["mismatch"] == [], result
    assert relay.metrics["complete_subscriptions"] == 1 and relay.metrics["joining_fetches"] == 1
    assert relay.metrics["upstream_fetches"] == 1  # one FETCH reached the holder; the rest came from the relay
    assert relay.metrics["upstream_subscriptions"] == 0 and tracks.metrics["fetches"] == 1


# -- moq.Server as a publisher our client fetches from -----------------------------------------------------------


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("offer", [("moqt-18", "moq-00"), ("moq-00",), ("moqt-18",)])
async def test_our_client_fetches_from_moq_server(certs: TestPki, offer: tuple[str, ...]) -> None:
    port = free_udp_port()
    files = certs.files("moqserver")
    async with process(str(MOQRS), str(PEER), "serve", "--bind", f"127.0.0.1:{port}", "--cert", str(files.cert),
                       "--key", str(files.key), "--path", "moq-test/srv", "--track", "data", "--groups", "3",
                       "--objects", "5", "--size", "7000") as server:
        ready = await json_line(server)
        conn = await connect_moqt("127.0.0.1", port, certs.files("alice"), alpn=offer, timeout=5)
        try:
            assert conn.alpn == offer[0]  # offered both, moq.Server chooses moqt-18
            assert conn.peer_identity == SERVER_URI
            async with conn.fetch((b"moq-test", b"srv"), b"data", Location(2, 0), Location(2, 0),
                                  stall_timeout=10) as fetch:
                objects = [o async for o in fetch.objects()]
            assert [hashlib.sha256(o.payload).hexdigest() for o in objects] == ready["digests"][2]
            await asyncio.sleep(0.3)
            assert conn.closed is None  # its empty SUBSCRIBE_NAMESPACE prefix on draft 14 no longer closes it
        finally:
            await conn.aclose()
