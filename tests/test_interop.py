"""The interop matrix: its bounded CI subset runs for real, and its report and regression logic."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from interop import report
from interop.moqrs_drivers import moqrs_missing
from interop.moqt_peer_cases import ALL_CASES as CASES
from interop.runner import EXPECTED, QUICK_CASES, Cell, regressions
from tests.peers import REQUIRED, needs_peer

INFERENCE_CASES = [c.name for c in CASES if c.needs_instance]
MOQRS = moqrs_missing() is None


def test_the_quick_subset_passes_against_expected(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "interop", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cells = json.loads((tmp_path / "matrix.json").read_text())
    assert {c["case"] for c in cells} == set(QUICK_CASES)
    passed = {(c["case"], c["client"]) for c in cells if c["result"] == "pass"}
    # our client passes every quick case on every transport, and curl over TCP; the MOQT one, our MOQT client on
    # both drafts and moq-rs on draft 18 (when its environment exists)
    for case in QUICK_CASES:
        clients: tuple[str, ...] = ("kvsp-quic-h1", "kvsp-quic-h2", "kvsp-quic-h3")
        clients += ("curl-h1", "curl-h2") if shutil.which("curl") or REQUIRED else ()
        if case.startswith("moqt-"):
            clients = ("kvsp-quic-moqt14", "kvsp-quic-moqt18") + (("moq-rs-moqt18",) if MOQRS else ())
        for client in clients:
            assert (case, client) in passed, (case, client)
    for name in ("matrix.md", "matrix.html"):
        assert (tmp_path / name).stat().st_size > 100
    for cell in cells:  # every cell links its log
        assert (tmp_path / cell["log"]).exists()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the instance needs torch (the gpu extra)")
def test_the_inference_cases_pass_against_a_real_instance(tmp_path: Path) -> None:
    """prefetch, instance-state, checkpoint-resume and reshard-commit-abort against ``kvsp-quic instance --device
    cpu`` (a tiny model) of either engine and the index's Placement Controller, and the cross-engine cases (blocks
    one engine computed, loaded by the other over HTTP/3 and over MOQT), with our client over HTTP/2 and curl over
    HTTP/1.1."""
    base = ["prefetch", "instance-state", "checkpoint-resume", "reshard-commit-abort"]
    assert [*base, *(f"{n}@transformers" for n in base), "cross-engine-http3", "cross-engine-moqt"] == INFERENCE_CASES
    argv = [sys.executable, "-m", "interop", "--out", str(tmp_path), "--impl", "kvsp-quic-h2", "--impl", "curl-h1",
            "--impl", "gtlsclient-h3", "--impl", "kvsp-quic-moqt14"]
    for name in INFERENCE_CASES:
        argv += ["--case", name]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    cells = {(c["case"], c["client"]): c for c in json.loads((tmp_path / "matrix.json").read_text())}
    transformers = importlib.util.find_spec("transformers") is not None
    for case in INFERENCE_CASES:
        cell = cells[(case, "kvsp-quic-h2")]
        if transformers or case in base:
            assert cell["result"] == "pass", cell
        else:  # the transformers engine cannot run here: said so, not failed
            assert cell["result"] == "unsupported" and "transformers" in cell["detail"], cell
            continue
        if cells[(case, "curl-h1")]["detail"] != "curl is not installed":
            assert cells[(case, "curl-h1")]["result"] == "pass", cells[(case, "curl-h1")]
        for client in ("gtlsclient-h3", "kvsp-quic-moqt14"):  # unsupported, and said why, without any setup
            cell = cells[(case, client)]
            assert cell["result"] == "unsupported" and cell["detail"] and cell["seconds"] < 1, cell


@needs_peer(moqrs_missing())
def test_the_moqrs_columns(tmp_path: Path) -> None:
    """moq-rs (issue 17 point 4) as a client on draft 18 -- through the relay: a block a holder published there
    (layers checked on moq-rs's side against the record's digests), a moq-rs publisher under the open prefix -- and
    as a server: moq.Server fetched from by our client on both drafts, and as the relay's upstream (found through the
    Index Service); what moq-rs cannot play is unsupported, saying why (never a silent skip)."""
    cases = ["moqt-kvsp-announced", "moqt-open-prefix", "moqt-moq-server", "moqt-moq-server-upstream",
             "moqt-fetch-block", "moqt-publish-namespace"]
    argv = [sys.executable, "-m", "interop", "--out", str(tmp_path), "--impl", "moq-rs-moqt18", "--impl",
            "moq-rs-moqt14", "--impl", "kvsp-quic-moqt14", "--impl", "kvsp-quic-moqt18"]
    for name in cases:
        argv += ["--case", name]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cells = {(c["case"], c["client"]): c for c in json.loads((tmp_path / "matrix.json").read_text())}
    expected = json.loads(EXPECTED.read_text())
    for (case, client), cell in cells.items():
        assert cell["result"] == expected[f"{case}|{client}|kvsp-quic"], cell
        if cell["result"] == "unsupported":
            assert cell["detail"], cell
    for case in ("moqt-kvsp-announced", "moqt-open-prefix"):  # issue 17's done-when: KVSP and open prefix, draft 18
        assert cells[(case, "moq-rs-moqt18")]["result"] == "pass"
    for client in ("kvsp-quic-moqt14", "kvsp-quic-moqt18"):
        assert cells[("moqt-moq-server", client)]["result"] == "pass"
        assert cells[("moqt-moq-server-upstream", client)]["result"] == "pass"
    assert "announced" in cells[("moqt-fetch-block", "moq-rs-moqt18")]["detail"]
    assert "moqt-18" in cells[("moqt-open-prefix", "moq-rs-moqt14")]["detail"]


def test_every_case_is_implemented() -> None:
    assert all(c.run is not None for c in CASES), [c.name for c in CASES if c.run is None]


def test_regressions_are_cells_expected_to_pass() -> None:
    cells = [Cell("a", "x", "kvsp-quic", "h3", "fail", "boom", 0.1, "logs/a"),
             Cell("b", "x", "kvsp-quic", "h3", "unsupported", "", 0.1, "logs/b"),
             Cell("c", "x", "kvsp-quic", "h3", "pass", "", 0.1, "logs/c")]
    expected = {"a|x|kvsp-quic": "pass", "b|x|kvsp-quic": "pass", "c|x|kvsp-quic": "pass"}
    assert [c.case for c in regressions(cells, expected)] == ["a", "b"]
    assert regressions(cells, {}) == []
    # a peer that is not installed: set aside unless peers are required (KVSP_REQUIRE_PEERS=1, .ci/run)
    absent = Cell("d", "x", "kvsp-quic", "h3", "unsupported", "x is not installed", 0.0, "logs/d", peer_missing=True)
    expected["d|x|kvsp-quic"] = "pass"
    assert [c.case for c in regressions([*cells, absent], expected)] == ["a", "b", "d"]
    assert [c.case for c in regressions([*cells, absent], expected, require_peers=False)] == ["a", "b"]


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
