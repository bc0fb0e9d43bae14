"""Independent peers and services the tests talk to (redis-server, ngtcp2's gtlsclient, curl, niquests, aiomoqt,
moq-rs): where one is absent its tests are skipped with the reason -- the README's test command passes on a fresh
clone -- unless ``KVSP_REQUIRE_PEERS=1``, which ``.ci/run`` sets after it has installed them all: there an absent
peer fails its tests, so CI can never pass by skipping them.

    pytestmark = needs_peer(None if shutil.which("curl") else "curl is not installed (apt-get install curl)")
    ...
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRED = os.environ.get("KVSP_REQUIRE_PEERS") == "1"


def missing_peer(reason: str) -> NoReturn:
    """Stop the running test: its peer is absent, as *reason* says (a skip, or a failure where peers are required)."""
    if REQUIRED:
        pytest.fail(f"{reason} -- KVSP_REQUIRE_PEERS=1 requires every independent peer", pytrace=False)
    pytest.skip(reason)


def needs_peer(missing: str | None) -> pytest.MarkDecorator:
    """A mark for tests that need a peer: *missing* says why it is absent, None where it is here (conftest.py's
    ``pytest_runtest_setup`` reads the mark)."""
    return pytest.mark.needs_peer(missing)
