"""`kvsp-quic demo` end to end, smaller than its defaults so that CI stays quick: real processes, a real failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import processes_under

pytest.importorskip("torch", reason="the demo runs inference instances: pip install 'kvsp-quic[gpu]'")


def test_demo_reports_no_lost_or_duplicated_tokens(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    run = subprocess.run([sys.executable, "-m", "kvsp_app", "demo", "--json", "--requests", "2", "--prefix-tokens",
                          "512", "--layers", "2", "--hidden", "128", "--workdir", str(workdir)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["tokens_lost"] == 0 and report["tokens_duplicated"] == 0 and report["tokens_altered"] == 0
    assert report["killed"] in ("instance-a", "instance-b") and report["epochs_seen"] == [1, 2]
    assert report["migrations"] and report["migrations"] >= 1
    assert report["lookup_hit_ratio"] > 0 and report["fetched_tokens"] > 0
    assert "[8/8]" in run.stderr  # progress went to stderr
    assert processes_under(workdir) == []  # every process it started is gone
