"""Lower findings of issue 13 (docs/security.md): the relay's ``GET status`` lists a published namespace only to
principals who could discover it over MOQT (a real relay and its HTTP app on 127.0.0.1), and the dev scope key
file is created 0600 in a 0700 directory, never replaced once made."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_app.serve import DEV_SCOPE_KEY, dev_scope_key
from kvsp_http.relay_app import relay_app
from moqt.relay.namespaces import render
from tests.pki import TestPki
from tests.support.moqt_relay import RELAY_POLICY, world


async def test_relay_status_lists_namespaces_only_to_who_may_see_them(relay_certs: TestPki) -> None:
    async with world(relay_certs) as w:
        await w.publisher("moqt-18")  # the holder publishes its namespace (scope SCOPE) to the relay
        server = RoleServer(relay_app(w.relay, RELAY_POLICY, base_path="/relay/"), relay_certs.files("relay"))
        await server.start("127.0.0.1", 0)
        url = server.base_uri("/relay/") + "status"
        try:
            async with KvspClient(relay_certs.files("alice")) as alice, KvspClient(relay_certs.files("bob")) as bob:
                seen = (await alice.request("GET", url)).json()  # alice reads scope SCOPE
                assert seen["namespaces"] == [render(w.namespace)]
                other = (await bob.request("GET", url)).json()  # bob is a client of another scope only
                assert other["namespaces"] == []
                assert other["connections"] == seen["connections"]  # the counters are aggregates
        finally:
            await server.close()


def test_the_dev_scope_key_is_created_private(tmp_path: Path) -> None:
    old = os.umask(0)  # the most permissive umask: the mode must come from the creation itself
    try:
        path = dev_scope_key(tmp_path / "dev")
    finally:
        os.umask(old)
    assert path.name == DEV_SCOPE_KEY
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    key = path.read_text()
    assert len(bytes.fromhex(key.strip())) == 32
    assert dev_scope_key(tmp_path / "dev").read_text() == key  # made once, then kept
    assert [p.name for p in path.parent.iterdir()] == [DEV_SCOPE_KEY]  # no temporary file left
