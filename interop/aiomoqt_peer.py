"""aiomoqt (PyPI, picoquic) as a peer of our MOQT tests, benchmarks and interop matrix. Run it with the Python of
the aiomoqt environment (``.venv-aiomoqt``: aiomoqt needs Python >= 3.12), never the project's: it imports only
aiomoqt and the standard library.

    python interop/aiomoqt_peer.py publish  --url moqt://127.0.0.1:PORT --namespace '["kvsp-1", ...]' --track NAME
    python interop/aiomoqt_peer.py fetch    --url moqt://127.0.0.1:PORT --namespace ... --track NAME [--clients 8]
    python interop/aiomoqt_peer.py conformance --cert C --key K -- -r moqt://127.0.0.1:PORT --draft 14 ...

Every subcommand takes ``--cert/--key`` (a client certificate: aiomoqt's ``MOQTClient`` has no option for one, but
its ``configuration=`` takes an aiopquic ``QuicConfiguration`` whose ``load_cert_chain`` makes picoquic present
it when the server asks -- which every KVSP server does), ``--ca`` (verify the server against it; without it,
no verification) and ``--draft`` (14 or 18).

* ``publish``: connect, PUBLISH_NAMESPACE, and serve FETCHes of one track whose objects are group 0, object i =
  SHAKE-256(seed:i) of ``--size`` octets (a KVSP block's layers, for our relay's tests); prints one JSON line
  ``{"ready": true, "digests": [SHA-256 hex of each object]}`` and serves until killed.
* ``setup``: connect and complete SETUP; prints ``{"draft": n}``. ``announce``: PUBLISH_NAMESPACE of
  ``--namespace``; prints ``{"ok": true}`` or ``{"error": code}``.
* ``fetch``: FETCH group 0 (objects ``--start`` to ``--end``, exclusive; 0: all), ``--clients`` sessions at once,
  ``--reps`` times; prints one JSON line per repetition: per client the objects' SHA-256, the time to the first
  object and to the last (seconds).
* ``conformance``: aiomoqt's conformance client (``aiomoqt.tools.moq_interop_client``, TAP output) with the
  client certificate injected into every ``MOQTClient`` it makes; everything after ``--`` is its command line
  (``--skip a,b`` leaves standard cases out).
"""

# mypy: ignore-errors
# (checked by mypy with the project, where aiomoqt is not installed: this file runs only in .venv-aiomoqt)

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import sys
import time
from urllib.parse import urlsplit


def configuration(host, cert, key):
    from aiopquic.quic.configuration import QuicConfiguration

    cfg = QuicConfiguration(is_client=True, max_data=2**25, max_stream_data=2**24,
                            max_datagram_frame_size=64 * 1024, server_name=host)
    if cert:
        cfg.load_cert_chain(cert, key)
    return cfg


def make_client(url, draft, cert, key, ca):
    from aiomoqt.client import MOQTClient

    parts = urlsplit(url)
    return MOQTClient(parts.hostname, parts.port, use_quic=True, verify_tls=ca is not None, ca_file=ca,
                      configuration=configuration(parts.hostname, cert, key), supported_drafts=draft)


def payload(seed, index, size):
    return hashlib.shake_256(f"{seed}:{index}".encode()).digest(size)


def fields(text):
    return tuple(f.encode() for f in json.loads(text))


# -- publish ----------------------------------------------------------------------------------------------------


async def publish(args):
    from aiomoqt.messages import FetchObject
    from aiomoqt.types import MOQTMessageType

    namespace, track = fields(args.namespace), args.track.encode()
    objects = [payload(args.seed, i, args.size) for i in range(args.objects)]
    served = {"fetches": 0}
    others = {}  # with --any-track: the objects of other tracks (seeded by their name), made on first use

    async def on_fetch(session, msg):
        ns = tuple(f if isinstance(f, bytes) else f.encode() for f in msg.namespace)
        name = msg.track_name if isinstance(msg.track_name, bytes) else msg.track_name.encode()
        if ns != namespace or (name != track and not args.any_track) or (msg.start_group or 0) != 0:
            session.fetch_error(request_id=msg.request_id, error_code=0x4, reason="no such track")
            return
        objs = objects
        if name != track:
            if name not in others:
                others[name] = [payload(name.decode(), i, args.size) for i in range(args.objects)]
            objs = others[name]
        first = msg.start_object or 0
        end = len(objs) if not msg.end_object or (msg.end_group or 0) > 0 else min(msg.end_object, len(objs))
        if first >= end:
            session.fetch_error(request_id=msg.request_id, error_code=0x5, reason="invalid range")
            return
        session.fetch_ok(request_id=msg.request_id, end_of_track=int(end == len(objs)), largest_group_id=0,
                         largest_object_id=end)
        served["fetches"] += 1
        await session.serve_fetch(msg.request_id, (
            FetchObject(group_id=0, subgroup_id=0, object_id=i, publisher_priority=128, payload=objs[i])
            for i in range(first, end)))

    client = make_client(args.url, args.draft, args.cert, args.key, args.ca)
    client.register_handler(MOQTMessageType.FETCH, on_fetch)
    async with client.connect() as session:
        await session.client_session_init()
        await session.publish_namespace(namespace=tuple(namespace), wait_response=True)
        print(json.dumps({"ready": True, "draft": session.negotiated_draft,
                          "digests": [hashlib.sha256(o).hexdigest() for o in objects]}), flush=True)
        while True:
            await asyncio.sleep(3600)


# -- setup, announce ------------------------------------------------------------------------------------------


async def setup(args):
    client = make_client(args.url, args.draft, args.cert, args.key, args.ca)
    async with client.connect() as session:
        await session.client_session_init()
        print(json.dumps({"draft": session.negotiated_draft}), flush=True)
        session.close()


async def announce(args):
    """PUBLISH_NAMESPACE of --namespace; prints {"ok": true} or {"error": code}."""
    from aiomoqt.types import MOQTRequestError

    client = make_client(args.url, args.draft, args.cert, args.key, args.ca)
    async with client.connect() as session:
        await session.client_session_init()
        try:
            await session.publish_namespace(namespace=fields(args.namespace), wait_response=True)
            print(json.dumps({"ok": True}), flush=True)
        except MOQTRequestError as exc:
            print(json.dumps({"error": int(exc.error_code)}), flush=True)
        session.close()


# -- fetch ------------------------------------------------------------------------------------------------------


async def fetch_once(client, namespace, track, start, end, timeout):
    got = []
    t0 = time.perf_counter()
    first = [0.0]

    def on_object(msg, *_):
        if not first[0]:
            first[0] = time.perf_counter() - t0
        got.append((msg.object_id, bytes(msg.payload or b"")))

    session = client
    ok = await session.fetch(namespace=tuple(namespace), track_name=track, start_group=0, start_object=start,
                             end_group=0, end_object=end, wait_response=True, on_object=on_object)
    clean = await session.await_fetch_done(ok.request_id, timeout=timeout)
    total = time.perf_counter() - t0
    return {"clean": clean, "objects": [i for i, _ in got], "digests": [hashlib.sha256(p).hexdigest() for _, p in got],
            "octets": sum(len(p) for _, p in got), "first_s": first[0], "seconds": total}


async def fetch(args):
    namespace, track = fields(args.namespace), args.track.encode()
    clients = [make_client(args.url, args.draft, args.cert, args.key, args.ca) for _ in range(args.clients)]
    stack = []
    sessions = []
    try:
        for c in clients:
            cm = c.connect()
            session = await cm.__aenter__()
            stack.append(cm)
            await session.client_session_init()
            sessions.append(session)
        for _ in range(args.reps):
            t0 = time.perf_counter()
            results = await asyncio.gather(*(fetch_once(s, namespace, track, args.start, args.end, args.timeout)
                                             for s in sessions), return_exceptions=True)
            out = []
            for r in results:
                out.append({"error": f"{type(r).__name__}: {r}"} if isinstance(r, BaseException) else r)
            print(json.dumps({"wall_s": time.perf_counter() - t0, "draft": sessions[0].negotiated_draft,
                              "results": out}), flush=True)
    finally:
        for cm in reversed(stack):
            with contextlib.suppress(Exception):
                await cm.__aexit__(None, None, None)


# -- the conformance client -----------------------------------------------------------------------------------


def conformance(args, rest):
    import aiomoqt.tools.moq_interop_client as conf

    base = conf.MOQTClient

    class WithCertificate(base):
        def __init__(self, host, port, *a, **kw):
            if kw.get("configuration") is None:
                kw["configuration"] = configuration(host, args.cert, args.key)
            super().__init__(host, port, *a, **kw)

    conf.MOQTClient = WithCertificate
    if args.skip:  # cases left out of the standard run (e.g. one known to wait for its timeout)
        conf.STANDARD_TESTS[:] = [t for t in conf.STANDARD_TESTS if t not in args.skip.split(",")]
    sys.argv = ["moq_interop_client", *rest]
    conf.cli()


def main():
    argv = sys.argv[1:]
    rest = []
    if "--" in argv:
        at = argv.index("--")
        argv, rest = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["publish", "fetch", "conformance", "setup", "announce"])
    parser.add_argument("--url")
    parser.add_argument("--draft", type=int, default=14)
    parser.add_argument("--cert")
    parser.add_argument("--key")
    parser.add_argument("--ca")
    parser.add_argument("--namespace")
    parser.add_argument("--track")
    parser.add_argument("--objects", type=int, default=32)
    parser.add_argument("--size", type=int, default=512 << 10)
    parser.add_argument("--seed", default="kvsp")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--end", type=int, default=0)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--any-track", action="store_true", help="publish: serve every track name of the namespace")
    parser.add_argument("--skip", default="", help="conformance: standard cases to leave out (comma-separated)")
    args = parser.parse_args(argv)
    if args.command == "conformance":
        conformance(args, rest)
    elif args.command == "publish":
        asyncio.run(publish(args))
    elif args.command == "setup":
        asyncio.run(setup(args))
    elif args.command == "announce":
        asyncio.run(announce(args))
    else:
        asyncio.run(fetch(args))


if __name__ == "__main__":
    main()
