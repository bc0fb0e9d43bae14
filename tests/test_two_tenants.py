"""Issue 13, point 2: two tenants end to end -- ``kvsp-quic demo --tenants 2``, smaller than its defaults.

Real processes on 127.0.0.1 started from configuration files and one policy: per tenant a scope key, a front end and
an inference instance; shared by both an Index Service + Placement Controller, a holder and a relay. The same
prompts go through both tenants; each gets its own cache hits, the second tenant's first request hits nothing of
what the first cached for the same text, and nothing of one tenant (lookup match, block, session, token stream,
relay namespace) is readable with the other tenant's certificates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import processes_under

pytest.importorskip("torch", reason="the demo runs inference instances: pip install 'kvsp-quic[gpu]'")


def test_two_tenants_share_the_services_and_nothing_else(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    run = subprocess.run([sys.executable, "-m", "kvsp_app", "demo", "--tenants", "2", "--json", "--requests", "2",
                          "--prefix-tokens", "256", "--layers", "2", "--hidden", "128", "--workdir", str(workdir)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["leaks"] == 0
    assert set(report["tenants"]) == {"t1", "t2"}
    for name, tenant in report["tenants"].items():
        assert tenant["leaks"] == [], (name, tenant["leaks"])
        assert tenant["leak_checks"] >= 20, tenant
        assert tenant["requests"] == 3 and tenant["fetched_tokens"] > 0, (name, tenant)  # its own cache hits
        assert tenant["first_request_fetched_tokens"] == 0, (name, tenant)  # nothing of the other tenant's
        assert tenant["relay_namespaces"] == 1, tenant  # its own namespace at the relay: the relay check is real
    sessions = [set(t["sessions"]) for t in report["tenants"].values()]
    assert not sessions[0] & sessions[1]
    assert "[6/6]" in run.stderr
    assert processes_under(workdir) == []  # every process it started is gone
