"""Version negotiation (newest common draft first, order configurable), draft 14's empty SUBSCRIBE_NAMESPACE prefix
(accepted, as from draft 16 on), and what a session close or a refused handshake leaves behind (an INFO line and a
counter by reason, exposed on the relay's /metrics). Sans I/O where the rule lives in the session; real sockets on
127.0.0.1 against the stock relay (moqt_handlers) otherwise. Issue 17, points 1-3; moq-rs: tests/test_moq_rs.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvsp_http.relay_app import audit_metrics
from kvsp_moqt.relay_policy import kvsp_relay
from kvsp_moqt.relay_rules import RelayRules
from kvsp_moqt.tracks import track_namespace
from kvsp_quic.metrics import Registry
from moqt import PREFERRED_ALPNS, alpn_order
from moqt import events as ev
from moqt import messages14 as m14
from moqt import messages18 as m18
from moqt.actions import CloseSession
from moqt.aio import AUDIT, MoqtApp, MoqtConnectError, MoqtConnection, connect_moqt, moqt_handlers
from moqt.control import encode_message
from moqt.errors import SessionErrorCode
from moqt.testing import SessionPair
from moqt.types import Draft
from quic.listener import QuicListener
from tests.pki import TestPki, make_pki
from tests.support.moqt_relay import HOLDER_URI, RELAY_POLICY, SCOPE

ALICE = "urn:kvsp:client:alice"


@contextlib.asynccontextmanager
async def relay(relay_certs: TestPki, alpns: tuple[str, ...] = PREFERRED_ALPNS) -> AsyncIterator[QuicListener]:
    """The stock relay's MOQT side (as `kvsp-quic relay` builds it), offering *alpns* in that order."""
    r = kvsp_relay(RelayRules(RELAY_POLICY, ((b"moq-test",),)))
    listener = QuicListener(relay_certs.files("relay"), moqt_handlers(r, alpns=alpns, data_streams=8))
    await listener.start("127.0.0.1", 0)
    try:
        yield listener
    finally:
        await r.aclose()
        await listener.close()


async def connect(relay_certs: TestPki, listener: QuicListener, alpn: Any = PREFERRED_ALPNS, who: str = "alice",
                  app: MoqtApp | None = None) -> MoqtConnection:
    return await connect_moqt("127.0.0.1", listener.port, relay_certs.files(who), alpn=alpn, app=app, timeout=5)


# -- 1. version negotiation -----------------------------------------------------------------------------------


def test_the_default_order_is_newest_first() -> None:
    assert PREFERRED_ALPNS == ("moqt-18", "moq-00")
    assert list(moqt_handlers(MoqtApp())) == ["moqt-18", "moq-00"]  # the listener's ALPN list, in this order
    assert list(moqt_handlers(MoqtApp(), alpns=["moq-00", "moqt-18"])) == ["moq-00", "moqt-18"]
    for bad in ([], ["moqt-18", "moqt-18"], ["h3"], ["moqt-16"]):
        with pytest.raises(ValueError):
            alpn_order(bad)


@pytest.mark.parametrize(("server", "client", "chosen"), [
    (PREFERRED_ALPNS, PREFERRED_ALPNS, "moqt-18"),                 # both: the newest
    (PREFERRED_ALPNS, ("moq-00", "moqt-18"), "moqt-18"),           # a client listing the old one first still gets 18
    (PREFERRED_ALPNS, ("moq-00",), "moq-00"),                      # a draft 14 only client (aiomoqt --draft 14)
    (PREFERRED_ALPNS, ("moqt-18",), "moqt-18"),
    (("moq-00", "moqt-18"), PREFERRED_ALPNS, "moq-00"),            # the order is the server's to configure
    (("moq-00",), PREFERRED_ALPNS, "moq-00"),                      # a server limited to one draft
    (("moqt-18",), ("moq-00", "moqt-18"), "moqt-18"),
])
async def test_the_newest_common_draft_is_chosen(relay_certs: TestPki, server: tuple[str, ...], client: tuple[str, ...],
                                                 chosen: str) -> None:
    async with relay(relay_certs, server) as listener:
        conn = await connect(relay_certs, listener, client)
        try:
            assert conn.alpn == chosen and conn.setup is not None and conn.setup.draft.alpn == chosen
        finally:
            await conn.aclose()


async def test_no_common_draft_is_a_logged_and_counted_refusal(relay_certs: TestPki,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    before = AUDIT.snapshot()[1].get(("client", "no_application_protocol"), 0)
    async with relay(relay_certs, ("moqt-18",)) as listener:
        with caplog.at_level(logging.INFO, logger="kvsp.moqt"), pytest.raises(MoqtConnectError):
            await connect(relay_certs, listener, ("moq-00",))
    assert AUDIT.snapshot()[1][("client", "no_application_protocol")] == before + 1
    lines = [r.getMessage() for r in caplog.records if "handshake refused" in r.getMessage()]
    assert len(lines) == 1 and f"127.0.0.1:{listener.port}" in lines[0] and "no_application_protocol" in lines[0]


# -- 2. draft 14: SUBSCRIBE_NAMESPACE with an empty prefix ----------------------------------------------------


def test_draft14_empty_prefix_is_accepted_not_a_close() -> None:
    pair = SessionPair(Draft.D14)
    pair.handshake()
    # what moq-rs sends right after setup, whatever the draft: SUBSCRIBE_NAMESPACE () (request id 0, no params)
    raw = encode_message(m14.SubscribeNamespace(0, ()), Draft.D14)
    assert raw == bytes([0x11, 0x00, 0x03, 0x00, 0x00, 0x00])
    events = pair.server.receive_stream_data(0, raw, False)
    assert len(events) == 1 and isinstance(events[0], ev.SubscribeNamespaceRequested) and events[0].prefix == ()
    pair.server.accept_subscribe_namespace(0)
    announced = pair.server.publish_namespace((b"a", b"b"))
    assert not pair.server.closed and not any(isinstance(a, CloseSession) for a in pair.server.take_actions())
    assert announced % 2 == 1
    # UNSUBSCRIBE_NAMESPACE () ends it
    events = pair.server.receive_stream_data(0, encode_message(m14.UnsubscribeNamespace(()), Draft.D14), False)
    assert events == [ev.SubscribeNamespaceEnded(0, ())]
    # More than 32 fields is still a PROTOCOL_VIOLATION; so is an empty namespace anywhere else in draft 14,
    # with the draft's bound in the reason.
    too_long = bytes([0x11, 0x00, 0x03, 0x02, 33, 0x00])
    for raw, reason in ((too_long, "at most 32"), (bytes([0x06, 0x00, 0x03, 0x02, 0x00, 0x00]), "1-32 fields, not 0")):
        p = SessionPair(Draft.D14)
        p.handshake()
        events = p.server.receive_stream_data(0, raw, False)
        closed = [e for e in events if isinstance(e, ev.SessionClosed)]
        assert closed and closed[0].error_code == SessionErrorCode.PROTOCOL_VIOLATION and reason in closed[0].reason


class Recorder(MoqtApp):
    def __init__(self) -> None:
        self.announced: list[tuple[bytes, ...]] = []

    def request(self, conn: MoqtConnection, request: ev.Event) -> None:
        if isinstance(request, ev.PublishNamespaceRequested):  # draft 14: matches arrive as PUBLISH_NAMESPACE
            self.announced.append(request.namespace)
            conn.session.accept_publish_namespace(request.request_id)
            conn.flush()
        else:
            super().request(conn, request)

    def event(self, conn: MoqtConnection, event: ev.Event) -> None:
        if isinstance(event, ev.NamespaceReceived) and event.active:  # draft 18
            self.announced.append(event.namespace)


@pytest.mark.parametrize("alpn", ["moq-00", "moqt-18"])
async def test_the_relay_serves_an_empty_prefix_on_both_drafts(relay_certs: TestPki, alpn: str) -> None:
    async with relay(relay_certs) as listener:
        app = Recorder()
        sub = await connect(relay_certs, listener, alpn, app=app)
        pub = await connect(relay_certs, listener, alpn, who="holder")
        try:
            # send it as moq-rs does: our API keeps to draft 14's 1-32 fields, so bypass its check
            sub.session._check_track = lambda namespace, track_name: None  # type: ignore[method-assign]
            await sub.subscribe_namespace((), timeout=5)
            ns = track_namespace(bytes(32), SCOPE, HOLDER_URI, 1)
            await pub.publish_namespace(ns, timeout=5)
            await pub.publish_namespace((b"moq-test", b"x"), timeout=5)
            async with asyncio.timeout(5):
                while len(app.announced) < 2:
                    await asyncio.sleep(0.01)
            assert sorted(app.announced) == sorted([ns, (b"moq-test", b"x")])  # everything alice may read
            assert sub.closed is None
        finally:
            await sub.aclose()
            await pub.aclose()


# -- 3. why a session ended -----------------------------------------------------------------------------------


@pytest.mark.parametrize("alpn", ["moq-00", "moqt-18"])
async def test_a_protocol_violation_leaves_a_line_and_a_count(relay_certs: TestPki, alpn: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    key = ("us", alpn, "protocol_violation")
    before = AUDIT.snapshot()[0].get(key, 0)
    async with relay(relay_certs) as listener:
        conn = await connect(relay_certs, listener, alpn)
        with caplog.at_level(logging.INFO, logger="kvsp.moqt"):
            # A client's GOAWAY must not carry a URI (both drafts): sent raw on the client's control stream.
            if alpn == "moq-00":
                conn.quic.send_stream_data(0, encode_message(m14.Goaway(b"moqt://elsewhere/"), Draft.D14))
            else:
                conn.quic.send_stream_data(2, encode_message(m18.Goaway(b"moqt://elsewhere/"), Draft.D18))
            conn.transport.transmit_soon()
            async with asyncio.timeout(5):
                while conn.closed is None:
                    await asyncio.sleep(0.01)
        await conn.aclose()
    assert conn.closed.error_code == SessionErrorCode.PROTOCOL_VIOLATION
    assert AUDIT.snapshot()[0][key] == before + 1
    ours = [r for r in caplog.records if r.getMessage().startswith("MOQT session closed by us")]
    assert len(ours) == 1 and ours[0].levelno == logging.INFO
    line = ours[0].getMessage()
    assert "127.0.0.1:" in line and ALICE in line and f"draft {alpn}" in line and "PROTOCOL_VIOLATION" in line
    assert "GOAWAY carried a URI" in line
    theirs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MOQT session closed by peer")]
    assert len(theirs) == 1 and "PROTOCOL_VIOLATION" in theirs[0]  # our client, told by the relay
    # the relay's /metrics
    registry = Registry()
    audit_metrics(registry)
    text = registry.render()
    assert f'kvsp_moqt_sessions_closed_total{{by="us",draft="{alpn}",reason="protocol_violation"}}' in text
    assert "kvsp_moqt_handshakes_refused_total" in text


async def test_a_refused_certificate_is_counted_on_the_client(relay_certs: TestPki, tmp_path: Any,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    other = make_pki(tmp_path / "other")  # a CA the relay does not trust
    before = sum(n for (side, _), n in AUDIT.snapshot()[1].items() if side == "client")
    async with relay(relay_certs) as listener:
        with caplog.at_level(logging.INFO, logger="kvsp.moqt"), pytest.raises(MoqtConnectError):
            await connect_moqt("127.0.0.1", listener.port, other.files("alice"), timeout=3)
    after = AUDIT.snapshot()[1]
    assert sum(n for (side, _), n in after.items() if side == "client") == before + 1
    assert any("handshake refused (client side)" in r.getMessage() for r in caplog.records)
