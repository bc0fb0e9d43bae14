"""PUBLISH (drafts 14 and 18) and SUBSCRIBE_TRACKS (draft 18) through a real relay process (``kvsp-quic relay --dev
--open-prefix moq-test``) with our client: a publisher on either draft PUBLISHes a track without any SUBSCRIBE,
subscribers on both drafts SUBSCRIBE to it and get its objects and its PUBLISH_DONE; a SUBSCRIBE_TRACKS subscriber
(and a draft 14 SUBSCRIBE_NAMESPACE subscriber) is sent a PUBLISH for the tracks published before and after it (not
for its own); refusals carry the draft's codes. aiomoqt's client plays
the same cases in its conformance run (tests/test_moqt_peers.py: namespace-discovery, publish-track-only,
publish-track-subscribe)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from http3.client import KvspClient
from moqt import events as ev
from moqt.aio import MoqtApp, MoqtConnection, MoqtRequestError, connect_moqt
from moqt.errors import MoqtUsageError, PublishDoneCode18, RequestErrorCode18
from moqt.types import Namespace
from quic.tls import TlsFiles

ROOM: Namespace = (b"moq-test", b"room")


class Recorder(MoqtApp):
    """Records events; accepts every PUBLISH (draft 18) it is sent."""

    def __init__(self) -> None:
        self.events: list[ev.Event] = []
        self.changed = asyncio.Event()

    def event(self, conn: MoqtConnection, event: ev.Event) -> None:
        self.events.append(event)
        self.changed.set()

    def request(self, conn: MoqtConnection, request: ev.Event) -> None:
        if isinstance(request, ev.PublishRequested):
            conn.session.accept_publish(request.request_id)
            conn.flush()
            self.event(conn, request)
        else:
            super().request(conn, request)

    def of(self, cls: type[ev.Event]) -> list[ev.Event]:
        return [e for e in self.events if isinstance(e, cls)]

    def has(self, cls: type[ev.Event]) -> Callable[[], bool]:
        return lambda: bool(self.of(cls))

    def objects(self, request_id: int) -> list[tuple[int, int, bytes]]:
        return [(e.group, e.object_id, bytes(e.data)) for e in self.events
                if isinstance(e, ev.ObjectReceived) and e.request_id == request_id and e.complete]

    async def until(self, check: Callable[[], bool], timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while not check():
                self.changed.clear()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def relay_process(tmp_path: Path) -> AsyncIterator[tuple[int, TlsFiles, str]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvsp_app", "relay", "--dev", str(tmp_path / "dev"), "--open-prefix", "moq-test",
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        ready = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        files = TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))
        yield int(ready["moqt"].rsplit(":", 1)[1].strip("/")), files, ready["base_uri"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def payload(group: int, obj: int) -> bytes:
    return b"%d.%d|" % (group, obj) * 8


def write_group(conn: MoqtConnection, rid: int, group: int, objects: int = 3) -> None:
    writer = conn.session.open_subgroup(rid, group)
    for o in range(objects):
        writer.write_object(o, payload(group, o))
    writer.finish()
    conn.flush()


@pytest.mark.parametrize("pub_alpn", ["moqt-18", "moq-00"])
async def test_publish_without_subscribe_reaches_subscribers_on_both_drafts(tmp_path: Path, pub_alpn: str) -> None:
    async with relay_process(tmp_path) as (port, files, base_uri):
        pub = await connect_moqt("127.0.0.1", port, files, alpn=pub_alpn, timeout=10)
        ok = await pub.publish(ROOM, b"video")  # PUBLISH, no SUBSCRIBE before it: PUBLISH_OK
        assert ok.forward
        apps = {alpn: Recorder() for alpn in ("moqt-18", "moq-00")}
        subs = {alpn: await connect_moqt("127.0.0.1", port, files, alpn=alpn, app=app, timeout=10)
                for alpn, app in apps.items()}
        rids = {}
        for alpn, conn in subs.items():
            rids[alpn] = conn.session.subscribe(ROOM, b"video")
            conn.flush()
        for app in apps.values():
            await app.until(app.has(ev.SubscribeAccepted))  # joined the published track
        for group in range(2):
            write_group(pub, ok.request_id, group)
        pub.session.publish_done(ok.request_id, int(PublishDoneCode18.TRACK_ENDED), b"the end")
        pub.flush()
        for alpn, app in apps.items():
            await app.until(app.has(ev.PublishDone))
            assert app.objects(rids[alpn]) == [(g, o, payload(g, o)) for g in range(2) for o in range(3)], alpn
            done = app.of(ev.PublishDone)[0]
            assert isinstance(done, ev.PublishDone) and (done.status_code, done.stream_count) == (0x2, 2)
        async with KvspClient(files) as client:
            status = (await client.request("GET", f"{base_uri}status")).json()
        assert status["metrics"]["tracks_published"] == 1 and status["metrics"]["subscriptions_joined"] == 2
        for conn in (pub, *subs.values()):
            await conn.aclose()


async def test_subscribe_tracks_is_sent_a_publish_for_earlier_and_later_tracks(tmp_path: Path) -> None:
    async with relay_process(tmp_path) as (port, files, _):
        pub_app = Recorder()
        pub = await connect_moqt("127.0.0.1", port, files, alpn="moqt-18", app=pub_app, timeout=10)
        early = await pub.publish(ROOM, b"early")
        await pub.subscribe_tracks(ROOM)  # the publisher's own tracks are not PUBLISHed back to it
        app = Recorder()
        sub = await connect_moqt("127.0.0.1", port, files, alpn="moqt-18", app=app, timeout=10)
        await sub.subscribe_tracks((b"moq-test",))
        app14 = Recorder()  # draft 14: SUBSCRIBE_NAMESPACE is answered with PUBLISHes too
        sub14 = await connect_moqt("127.0.0.1", port, files, alpn="moq-00", app=app14, timeout=10)
        await sub14.subscribe_namespace((b"moq-test",))
        await app.until(lambda: len(app.of(ev.PublishRequested)) == 1)
        await app14.until(lambda: len(app14.of(ev.PublishRequested)) == 1)
        late = await pub.publish((*ROOM, b"sub"), b"late")
        await app.until(lambda: len(app.of(ev.PublishRequested)) == 2)
        await app14.until(lambda: len(app14.of(ev.PublishRequested)) == 2)
        got = {e.track_name: e for e in app.of(ev.PublishRequested) if isinstance(e, ev.PublishRequested)}
        assert sorted(got) == [b"early", b"late"] and got[b"late"].namespace == (*ROOM, b"sub")
        # the relay forwards once PUBLISH_OK reached it: the publisher writes a group at a time until objects arrive
        rid = got[b"late"].request_id
        rid14 = next(e.request_id for e in app14.of(ev.PublishRequested)
                     if isinstance(e, ev.PublishRequested) and e.track_name == b"late")
        group = 0
        async with asyncio.timeout(20):
            while not app.objects(rid) or not app14.objects(rid14):
                write_group(pub, late.request_id, group)
                group += 1
                await asyncio.sleep(0.05)
        first = app.objects(rid)[0][0]
        await app.until(lambda: len(app.objects(rid)) == 3 * (group - first))
        assert app.objects(rid) == [(g, o, payload(g, o)) for g in range(first, group) for o in range(3)]
        first14 = app14.objects(rid14)[0][0]
        await app14.until(lambda: len(app14.objects(rid14)) == 3 * (group - first14))
        pub.session.publish_done(late.request_id, int(PublishDoneCode18.TRACK_ENDED))
        pub.flush()
        await app.until(lambda: any(isinstance(e, ev.PublishDone) and e.request_id == rid for e in app.events))
        await app14.until(lambda: any(isinstance(e, ev.PublishDone) and e.request_id == rid14 for e in app14.events))
        assert app14.objects(rid14) == [(g, o, payload(g, o)) for g in range(first14, group) for o in range(3)]
        assert not pub_app.of(ev.PublishRequested)  # "excluding tracks published by the subscriber"
        assert early.request_id in pub.session.requests  # the other track goes on
        for conn in (pub, sub, sub14):
            await conn.aclose()


async def test_refusals(tmp_path: Path) -> None:
    async with relay_process(tmp_path) as (port, files, _):
        pub = await connect_moqt("127.0.0.1", port, files, alpn="moqt-18", timeout=10)
        other = await connect_moqt("127.0.0.1", port, files, alpn="moqt-18", timeout=10)
        d14 = await connect_moqt("127.0.0.1", port, files, alpn="moq-00", timeout=10)
        try:
            with pytest.raises(MoqtRequestError) as refused:
                await pub.publish((b"elsewhere",), b"t")  # outside every namespace the relay carries
            assert refused.value.error_code == RequestErrorCode18.UNAUTHORIZED
            await pub.publish(ROOM, b"t")
            with pytest.raises(MoqtRequestError) as refused:
                await other.publish(ROOM, b"t")  # another session publishes that track
            assert refused.value.error_code == RequestErrorCode18.DUPLICATE_SUBSCRIPTION
            await other.subscribe_tracks(ROOM)
            with pytest.raises(MoqtRequestError) as refused:
                await other.subscribe_tracks((*ROOM, b"x"))
            assert refused.value.error_code == RequestErrorCode18.PREFIX_OVERLAP
            with pytest.raises(MoqtUsageError):  # draft 14 has no SUBSCRIBE_TRACKS
                await d14.subscribe_tracks(ROOM)
            with pytest.raises(MoqtRequestError) as refused:
                await d14.publish(ROOM, b"t")  # draft 14 PUBLISH_ERROR has no DUPLICATE_SUBSCRIPTION: UNINTERESTED
            assert refused.value.error_code == 0x4
            with pytest.raises(MoqtRequestError) as refused:
                await d14.publish((b"elsewhere",), b"t")
            assert refused.value.error_code == 0x1  # UNAUTHORIZED
            assert pub.closed is None and other.closed is None and d14.closed is None
        finally:
            for conn in (pub, other, d14):
                await conn.aclose()
