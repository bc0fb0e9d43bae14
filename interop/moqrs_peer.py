"""Drives moq-rs (moq-dev's Rust MOQT stack, PyPI ``moq-rs`` 0.5.1 on ``moq-ffi`` 0.4.18) for the interop tests
(tests/test_moq_rs.py) and the interop matrix's moq-rs columns (interop/moqrs_drivers.py). It runs in
``.venv-moqrs`` (Python 3.12; interop/requirements-moqrs.txt), not in the project's environment, and prints one
JSON object per line.

    python interop/moqrs_peer.py publish   --url moqt://127.0.0.1:P/ --cert C --key K --ca CA --path moq-test/b \
        --track data --groups 3 --objects 4 --size 1000 [--every 0.2]
    python interop/moqrs_peer.py subscribe --url ... --path moq-test/b --track data --groups 2 [--fetch-last]
    python interop/moqrs_peer.py fetch     --url ... --path kvsp-1/... --track HEX --group 0 [--digests d0,d1,...]
    python interop/moqrs_peer.py serve     --bind 127.0.0.1:P --cert C --key K --path moq-test/b --track data \
        --groups 3 --objects 4 --size 1000 [--objects-file F]
    python interop/moqrs_peer.py setup     --url ... (connect, SETUP, close; MOQRS_LOG=info says the draft)

``fetch --request`` asks for the path (``request_broadcast``) instead of waiting for its announcement (it fails
inside moq-rs when no route covers the path: docs/moqt.md, moq-rs); ``fetch --hold-subscription`` holds a
subscription of its own while ``fetch_group`` runs (see :func:`fetch`); ``serve
--objects-file`` serves group 0 with the payloads of a JSON list of hex strings (a KVSP block's layers).

What moq-rs does that matters here (measured, moq-rs 0.5.1): a broadcast path ``a/b`` is the MOQT namespace
``("a", "b")``; a group is a MOQT group, a frame an object (ids from 0); the client offers ``moq-00`` and
``moqt-18`` (a ``moqt://`` URL: native QUIC; ``https://`` would mean WebTransport), presents the client certificate
it is given and verifies the server against ``tls_roots``; right after SETUP it sends SUBSCRIBE_NAMESPACE with an
empty prefix; a publisher keeps only the latest group of a track for FETCH. ``moq.Server`` checks no client
certificate.

Object payloads (``payload(g, i, size)``) are deterministic, so the receiving side checks each object's SHA-256.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from typing import Any

import moq  # type: ignore[import-not-found]  # only in .venv-moqrs


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def payload(group: int, obj: int, size: int) -> bytes:
    seed = hashlib.sha256(b"moq-rs interop %d/%d" % (group, obj)).digest()
    return (seed * (size // len(seed) + 1))[:size]


def client(args: argparse.Namespace) -> Any:
    return moq.Client(args.url, tls_cert=args.cert, tls_key=args.key, tls_roots=[args.ca], tls_system_roots=False,
                      websocket_enabled=False, reconnect=False)


async def write_groups(track: Any, args: argparse.Namespace) -> list[list[str]]:
    digests: list[list[str]] = []
    for g in range(args.groups):
        group = track.create_group(g)
        digests.append([])
        for i in range(args.objects):
            data = payload(g, i, args.size)
            group.write_frame(data)
            digests[-1].append(hashlib.sha256(data).hexdigest())
        group.finish()
        if args.every:
            await asyncio.sleep(args.every)
    return digests


async def publish(args: argparse.Namespace) -> None:
    async with client(args) as c:
        broadcast = c.create_broadcast(args.path)
        track = broadcast.publish_track(args.track)
        broadcast.announce()
        emit(ready="publish")
        digests = await write_groups(track, args)
        emit(published=args.groups, digests=digests)
        await asyncio.sleep(args.hold)


async def read_group(group: Any) -> list[bytes]:
    return [frame.payload async for frame in group]


async def subscribe(args: argparse.Namespace) -> None:
    async with client(args) as c:
        emit(ready="subscribe")
        broadcast = await asyncio.wait_for(c.announced_broadcast(args.path), args.timeout)
        emit(announced=args.path)
        track = await broadcast.subscribe_track(args.track)
        groups: dict[int, list[str]] = {}
        async with asyncio.timeout(args.timeout):
            async for group in track:
                groups[group.sequence] = [hashlib.sha256(p).hexdigest() for p in await read_group(group)]
                if len(groups) >= args.groups:
                    break
        result: dict[str, Any] = {"groups": {str(g): d for g, d in groups.items()}}
        if args.fetch_last:
            last = max(groups)
            # moq-rs's fetch_group ends its own subscription when it returns, which can drop frames still arriving
            # (see fetch below): a group shorter than the one read live is fetched again, at most twice more, and
            # the attempts are reported
            attempts = 0
            while True:
                attempts += 1
                fetched = await asyncio.wait_for(broadcast.fetch_group(args.track, last), args.timeout)
                digests = [hashlib.sha256(p).hexdigest() for p in await read_group(fetched)]
                if len(digests) >= len(groups[last]) or attempts == 3:
                    break
            result["fetched"] = {str(last): digests}
            result["fetch_attempts"] = attempts
        emit(**result)


async def fetch(args: argparse.Namespace) -> None:
    async with client(args) as c:
        if args.request:  # no announcement to wait for (a holder announces nothing): ask for the path
            broadcast = await asyncio.wait_for(c.request_broadcast(args.path), args.timeout)
        else:
            broadcast = await asyncio.wait_for(c.announced_broadcast(args.path), args.timeout)
        try:
            # fetch_group "does not hold a live subscription": it SUBSCRIBEs, fills the group with a joining FETCH
            # and drops the subscription when it returns, which can drop the frames still arriving (measured:
            # "subscribe cancelled", then Internal 'dropped', in ~1 of 4 fetches of a 32-layer block). Holding a
            # subscription of our own (--hold-subscription) keeps the track alive until the group is read. Only for
            # a complete track (a KVSP block): on a live one, fetch_group then waited on that subscription for a
            # group already in the past (timed out; also with a subscription starting at the next group).
            held = await broadcast.subscribe_track(args.track) if args.hold_subscription else None
            group = await asyncio.wait_for(broadcast.fetch_group(args.track, args.group), args.timeout)
            async with asyncio.timeout(args.timeout):
                payloads = await read_group(group)
            del held
        except moq.Error as exc:
            emit(error=type(exc).__name__, detail=str(exc))
            return
        digests = [hashlib.sha256(p).hexdigest() for p in payloads]
        result: dict[str, Any] = {"objects": len(payloads), "octets": sum(len(p) for p in payloads),
                                  "digests": digests}
        if args.digests:  # verified here, on the receiving side
            expected = args.digests.split(",")
            result["verified"] = digests == expected
            result["mismatch"] = [i for i, (a, b) in enumerate(zip(digests, expected, strict=False)) if a != b]
        emit(**result)


async def serve(args: argparse.Namespace) -> None:
    async with moq.Server(args.bind, tls_cert=[args.cert], tls_key=[args.key]) as server:
        broadcast = server.create_broadcast(args.path)
        track = broadcast.publish_track(args.track)
        broadcast.announce()
        if args.objects_file:  # group 0: the given payloads (a KVSP block: one object per layer)
            with open(args.objects_file) as f:
                payloads = [bytes.fromhex(h) for h in json.load(f)]
            group = track.create_group(0)
            for data in payloads:
                group.write_frame(data)
            group.finish()
            digests = [[hashlib.sha256(p).hexdigest() for p in payloads]]
        else:
            digests = await write_groups(track, args)
        emit(ready="serve", addr=server.local_addr, digests=digests)
        await server.serve()


async def setup(args: argparse.Namespace) -> None:
    async with client(args):
        emit(connected=args.url)


COMMANDS = {"publish": publish, "subscribe": subscribe, "fetch": fetch, "serve": serve, "setup": setup}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moqrs_peer")
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--url", default="")
    parser.add_argument("--bind", default="127.0.0.1:0")
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--ca", default="")
    parser.add_argument("--path", default="")
    parser.add_argument("--track", default="")
    parser.add_argument("--objects-file", default="")
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--objects", type=int, default=4)
    parser.add_argument("--size", type=int, default=1000)
    parser.add_argument("--every", type=float, default=0.0)
    parser.add_argument("--hold", type=float, default=60.0)
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--digests", default="")
    parser.add_argument("--fetch-last", action="store_true")
    parser.add_argument("--hold-subscription", action="store_true", help="fetch: subscribe while fetching")
    parser.add_argument("--request", action="store_true", help="fetch: request_broadcast, not announced_broadcast")
    parser.add_argument("--timeout", type=float, default=15.0)
    args = parser.parse_args(argv)
    if os.environ.get("MOQRS_LOG"):  # moq-rs's own tracing on stderr: error, warn, info, debug, trace
        moq.log_level(os.environ["MOQRS_LOG"])
    try:
        asyncio.run(COMMANDS[args.command](args))
    except Exception as exc:  # reported, so the test says what moq-rs said
        emit(error=type(exc).__name__, detail=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
