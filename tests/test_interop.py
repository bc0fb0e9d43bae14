"""The interop matrix: its bounded CI subset runs for real, and its report and regression logic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from interop import report
from interop.runner import EXPECTED, QUICK_CASES, Cell, regressions


def test_the_quick_subset_passes_against_expected(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "interop", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cells = json.loads((tmp_path / "matrix.json").read_text())
    assert {c["case"] for c in cells} == set(QUICK_CASES)
    passed = {(c["case"], c["client"]) for c in cells if c["result"] == "pass"}
    # our client passes every quick case on every transport, and curl over TCP
    for case in QUICK_CASES:
        for client in ("kvsp-quic-h1", "kvsp-quic-h2", "kvsp-quic-h3", "curl-h1", "curl-h2"):
            assert (case, client) in passed, (case, client)
    for name in ("matrix.md", "matrix.html"):
        assert (tmp_path / name).stat().st_size > 100
    for cell in cells:  # every cell links its log
        assert (tmp_path / cell["log"]).exists()


def test_regressions_are_cells_expected_to_pass() -> None:
    cells = [Cell("a", "x", "kvsp-quic", "h3", "fail", "boom", 0.1, "logs/a"),
             Cell("b", "x", "kvsp-quic", "h3", "unsupported", "", 0.1, "logs/b"),
             Cell("c", "x", "kvsp-quic", "h3", "pass", "", 0.1, "logs/c")]
    expected = {"a|x|kvsp-quic": "pass", "b|x|kvsp-quic": "pass", "c|x|kvsp-quic": "pass"}
    assert [c.case for c in regressions(cells, expected)] == ["a", "b"]
    assert regressions(cells, {}) == []


def test_report_formats() -> None:
    cells = [{"case": "a", "client": "x", "server": "s", "transport": "h3", "result": "pass", "detail": "",
              "seconds": 0.1, "log": "logs/a.log"},
             {"case": "a", "client": "y", "server": "s", "transport": "h1", "result": "unsupported",
              "detail": "cannot <do> it", "seconds": 0.0, "log": "logs/b.log"}]
    md = report.markdown(cells)
    assert "| a | pass | - |" in md and "cannot <do> it" in md
    page = report.page(cells)
    assert "cannot &lt;do&gt; it" in page and 'href="logs/a.log"' in page


def test_expected_file_is_well_formed() -> None:
    expected = json.loads(EXPECTED.read_text())
    assert expected and all(v in ("pass", "fail", "unsupported") for v in expected.values())
    assert all(k.count("|") == 2 for k in expected)
