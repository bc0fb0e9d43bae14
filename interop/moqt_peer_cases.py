"""MOQT cases of the matrix with another stack on the far side (moq-rs, issue 17 point 4): each column's driver is
the subscriber; the publisher is ours or moq-rs's, our relay between them where the case says so.

    moqt-kvsp-announced      our holder's KVSP track (a ``HolderTracks`` over a ``Holder``, in the runner's process,
                             publishing as the dev principal) PUBLISH_NAMESPACEd to the relay -> the driver FETCHes
                             the block through the relay; layers by SHA-256 (moq-rs checks them on its side too)
    moqt-open-prefix         a moq-rs publisher under the relay's open prefix ``moq-test`` -> the driver FETCHes its
                             group through the relay (moq-rs: SUBSCRIBEs, 3 live groups); objects by SHA-256
    moqt-moq-server          ``moq.Server`` (moq-rs's listener) publishing a track -> the driver FETCHes from it
    moqt-moq-server-upstream ``moq.Server`` serving a KVSP block, named at the Index Service by a ``moqt://`` Replica
                             Record -> the driver FETCHes it through the relay, which finds the upstream through the
                             index (no session published the namespace)

Without moq-rs installed the cases that need it as the publisher are "unsupported" for every column, saying so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import tempfile
from pathlib import Path

from interop.cases import CASES, CaseInfo, Env, block_of, moqt_driver, relay_metrics
from interop.drivers import Driver, PeerMissing, Unsupported
from interop.moqrs_drivers import (
    NEEDS_ANNOUNCEMENT,
    MoqrsMoqt,
    live_payload,
    moqrs_missing,
    moqrs_process,
    path_of,
    tls_args,
)
from interop.servers import DEV_IDENTITY
from kvsp_dev import pki
from kvsp_moqt.holder_tracks import HolderTracks
from kvsp_moqt.tracks import moqt_address, track_name
from kvsp_quic.auth import Policy, Principal, Role
from kvsp_quic.keys import holder_id
from kvsp_quic.records import ReplicaRecord, encode_moqt_namespace, kvsp_track_namespace, moqt_record
from kvsp_quic.roles.holder import Holder, HolderSettings
from moqt.aio import connect_moqt
from quic.tls import TlsFiles

# the in-process holder's base URI; it serves the namespaces of the dev principal's holder-id, the only ones the
# matrix's relay policy lets dev publish (interop/servers.py RELAY_POLICY)
ANNOUNCING_HOLDER = "https://127.0.0.1:1/interop-announcing-holder/"
# its record's holder (it serves no listener: the relay FETCHes from the session that published the namespace)
ANNOUNCING_MOQT = "moqt://127.0.0.1:1/"
MOQ_SERVER_URI = "https://127.0.0.1:1/interop-moq-server/"


def _needs_moqrs(role: str) -> None:
    missing = moqrs_missing()
    if missing is not None:
        raise PeerMissing(f"the {role} of this case is moq-rs: {missing}")


def _digests(payloads: list[bytes]) -> list[bytes]:
    return [hashlib.sha256(p).digest() for p in payloads]


async def moqt_kvsp_announced(env: Env, driver: Driver) -> None:
    d = moqt_driver(driver)
    n = env.fresh()
    key, body, enc = block_of(env, 110_000 + n)
    holder = Holder(HolderSettings(ANNOUNCING_HOLDER, (env.descriptor,)))
    writer = Principal("urn:interop:writer", frozenset({Role.INSTANCE}), frozenset({env.keyer.scope_id}))
    record = holder.store(writer, env.descriptor.compat_id, env.keyer.scope_id, key, body, "*")
    assert record.layer_digests == tuple(enc.layer_digests)
    # the relay FETCHes from this publisher with its own certificate (identity: its base URI)
    tracks = HolderTracks(holder, Policy.from_dict({"principal": [
        {"identity": env.relay, "roles": ["holder"], "scopes": "*"}]}))
    tracks.holder_id = holder_id(DEV_IDENTITY)  # publishing as dev: the namespaces of dev's holder-id
    namespace = kvsp_track_namespace(bytes(env.descriptor.compat_id), bytes(env.keyer.scope_id), tracks.holder_id,
                                     enc.header.codec)
    # its record at the Index Service, as a holder publishes one: a moqt:// record of the namespace (its publisher
    # field is dev's holder-id, not an https holder's), which the relay checks the layers against before it caches
    # the block (kvsp_moqt/index_link.py, "Records")
    twin = dataclasses.replace(moqt_record(record, ANNOUNCING_MOQT), moqt_namespace=encode_moqt_namespace(namespace))
    await put_record(env, twin)
    host, port = moqt_address(env.relay_moqt)
    pub = await connect_moqt(host, port, env.tls("dev"), app=tracks, timeout=10)
    try:
        await pub.publish_namespace(namespace)
        d.lines.append(f"published {namespace} to the relay on {pub.alpn}")
        got = await d.fetch(env.relay_moqt, env.tls("dev"), namespace, track_name(key),
                            expected=list(enc.layer_digests))
    finally:
        await pub.aclose()
    assert got == [list(enc.layer_digests)], "the objects are not the block's layers (SHA-256 per object)"
    assert tracks.metrics["fetches"] >= 1, "the block did not come from the announcing holder"


async def moqt_open_prefix(env: Env, driver: Driver) -> None:
    """A FETCH of the publisher's group for our client and aiomoqt; for moq-rs a live SUBSCRIBE: its FETCH of a
    past group of a live track (``fetch_group``) drops the group it is filling when its own internal subscription
    ends, in ~1 of 2 tries here (Internal 'dropped'; docs/moqt.md, moq-rs), so moq-rs reads live groups instead."""
    d = moqt_driver(driver)
    _needs_moqrs("publisher")
    n = env.fresh()
    namespace = (b"moq-test", b"interop-%d" % n)
    common = ["--url", _url(env.relay_moqt), *tls_args(env.tls("dev")), "--path", path_of(namespace), "--track",
              "data", "--objects", "5", "--size", "6000", "--hold", "90"]
    if isinstance(d, MoqrsMoqt):
        async with moqrs_process(["publish", *common, "--groups", "400", "--every", "0.1"], d.lines) as publisher:
            assert publisher.ready.get("ready") == "publish", publisher.ready
            got = await d.subscribe(env.relay_moqt, env.tls("dev"), namespace, b"data", groups=3)
        assert len(got) == 3, f"moq-rs got groups {sorted(got)}"
        for g, digests in got.items():
            assert digests == _digests([live_payload(g, i, 6000) for i in range(5)]), f"group {g} differs"
        return
    async with moqrs_process(["publish", *common, "--groups", "1"], d.lines) as publisher:
        assert publisher.ready.get("ready") == "publish", publisher.ready
        published = await publisher.line()
        expected = [bytes.fromhex(h) for h in published["digests"][0]]
        got_fetch = await d.fetch(env.relay_moqt, env.tls("dev"), namespace, b"data", expected=expected)
    assert got_fetch == [expected], "the objects are not the moq-rs publisher's (SHA-256 per object)"


async def put_record(env: Env, record: ReplicaRecord) -> None:
    url = f"{env.index}replicas/{holder_id(record.holder)}/{bytes(record.block_key).hex()}"
    reply = await env.setup.request("PUT", url, content=json.dumps(record.to_json()).encode(),
                                    headers={"content-type": "application/kvsp+json"})
    assert reply.status in (200, 201), f"setup: the Index Service refused the {record.holder} record: " \
                                       f"{reply.status} {(reply.content or b'')[:300]!r}"


def _url(uri: str) -> str:
    host, port = moqt_address(uri)
    return f"moqt://{host}:{port}/"


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_files(env: Env, work: Path) -> TlsFiles:
    """A certificate for ``moq.Server`` from the matrix's CA (identity MOQ_SERVER_URI, host 127.0.0.1)."""
    dev = env.tls("dev").ca.parent
    ca_cert, ca_key = pki.load_pair(dev, "ca")
    cert, key = pki.issue(ca_cert, ca_key, pki.role("moqserver", MOQ_SERVER_URI), extra_hosts=["127.0.0.1"])
    pki.write_pair(work, "moqserver", cert, key)
    return TlsFiles(dev / "ca.pem", work / "moqserver.pem", work / "moqserver.key")


async def moqt_moq_server(env: Env, driver: Driver) -> None:
    d = moqt_driver(driver)
    if isinstance(d, MoqrsMoqt):
        raise Unsupported("moq-rs's client against moq-rs's server: not an interop case")
    _needs_moqrs("server")
    port = _free_udp_port()
    with tempfile.TemporaryDirectory() as tmp:
        files = _server_files(env, Path(tmp))
        argv = ["serve", "--bind", f"127.0.0.1:{port}", "--cert", str(files.cert), "--key", str(files.key),
                "--path", "moq-test/srv", "--track", "data", "--groups", "1", "--objects", "6", "--size", "9000"]
        async with moqrs_process(argv, d.lines) as server:
            expected = [bytes.fromhex(h) for h in server.ready["digests"][0]]
            got = await d.fetch(f"moqt://127.0.0.1:{port}/", env.tls("dev"), (b"moq-test", b"srv"), b"data")
    assert got == [expected], "the objects are not moq.Server's (SHA-256 per object)"


async def moqt_moq_server_upstream(env: Env, driver: Driver) -> None:
    d = moqt_driver(driver)
    _needs_moqrs("upstream server")
    if d.needs_announcement:
        raise Unsupported(NEEDS_ANNOUNCEMENT.format(where="the relay, for a block it finds through the Index "
                                                          "Service,"))
    n = env.fresh()
    key, _, enc = block_of(env, 120_000 + n)
    sections = enc.sections
    layers = [bytes(sections[2 * i]) + bytes(sections[2 * i + 1]) for i in range(env.descriptor.layers)]
    assert _digests(layers) == list(enc.layer_digests)
    port = _free_udp_port()
    moqt_uri = f"moqt://127.0.0.1:{port}/"
    # the block's https record as moq.Server's own holder would make it (digest, size, layer digests), and its
    # moqt:// twin: what the Index Service gives the relay
    writer = Principal("urn:interop:writer", frozenset({Role.INSTANCE}), frozenset({env.keyer.scope_id}))
    https = Holder(HolderSettings(MOQ_SERVER_URI, (env.descriptor,))).store(
        writer, env.descriptor.compat_id, env.keyer.scope_id, key, enc.tobytes(), "*")
    twin = moqt_record(https, moqt_uri)
    namespace = kvsp_track_namespace(bytes(env.descriptor.compat_id), bytes(env.keyer.scope_id),
                                     holder_id(MOQ_SERVER_URI), https.codec)
    with tempfile.TemporaryDirectory() as tmp:
        files = _server_files(env, Path(tmp))
        objects = Path(tmp) / "objects.json"
        objects.write_text(json.dumps([p.hex() for p in layers]))
        argv = ["serve", "--bind", f"127.0.0.1:{port}", "--cert", str(files.cert), "--key", str(files.key),
                "--path", path_of(namespace), "--track", track_name(key).decode(), "--objects-file", str(objects)]
        async with moqrs_process(argv, d.lines):
            await put_record(env, twin)
            before = await relay_metrics(env)
            got = await d.fetch(env.relay_moqt, env.tls("dev"), namespace, track_name(key),
                                expected=list(enc.layer_digests))
            after = await relay_metrics(env)
    assert got == [list(enc.layer_digests)], "the objects are not the block's layers (SHA-256 per object)"
    upstream = after.get("upstream_fetches", 0) - before.get("upstream_fetches", 0)
    assert upstream == 1, f"the relay made {upstream} upstream FETCHes (expected 1, to moq.Server)"


MOQT_PEER_CASES = [
    CaseInfo("moqt-kvsp-announced", "MOQT FETCH through the relay of a block whose holder PUBLISH_NAMESPACEd it "
             "there (layers by SHA-256, checked by the receiving side)", moqt_kvsp_announced),
    CaseInfo("moqt-open-prefix", "moq-rs publisher under the relay's open prefix -> MOQT FETCH through the relay "
             "(moq-rs: live SUBSCRIBE; objects by SHA-256)", moqt_open_prefix),
    CaseInfo("moqt-moq-server", "MOQT FETCH from moq-rs's moq.Server (objects by SHA-256)", moqt_moq_server),
    CaseInfo("moqt-moq-server-upstream", "MOQT FETCH through the relay of a block served by moq.Server, found "
             "through a moqt:// Replica Record at the Index Service (one upstream FETCH)", moqt_moq_server_upstream),
]
ALL_CASES: list[CaseInfo] = [*CASES, *MOQT_PEER_CASES]  # what the runner runs
