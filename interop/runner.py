"""The interop matrix: every test case x every client implementation x transport, against our servers.

    python -m interop [--case NAME ...] [--impl NAME ...] [--quick] [--out DIR] [--expected FILE]
    kvsp-quic interop ...                    (the same)

Each cell is pass, fail or unsupported (the implementation cannot play the case, a peer is not installed, or no
server implements the resource yet), with a log. The matrix is written as Markdown, JSON and a self-contained
HTML page; the exit status is 1 when a cell that ``interop/expected.json`` expects to pass does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from http3.client import KvspClient
from interop import report
from interop.cases import CaseInfo, Env, Inference
from interop.drivers import Driver, PeerMissing, Unsupported, all_drivers
from interop.moqrs_drivers import moqrs_drivers
from interop.moqt_drivers import MoqtDriver, moqt_drivers
from interop.moqt_peer_cases import ALL_CASES as CASES
from interop.servers import INSTANCE_URI, INSTANCES, SCOPE_KEY, principal_of, start
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.keys import BlockKeyer, scope_id
from kvsp_quic.samples import example_descriptor
from quic.tls import TlsFiles

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected.json"
# the HTTP cases, and one KVSP-over-MOQT case every MOQT client plays (moq-rs too: ~2 s a column)
QUICK_CASES = ("mtls-refused", "block-get-layers", "lease-quota", "lookup-with-estimates", "moqt-kvsp-announced")
SERVER = "kvsp-quic"


@dataclass
class Cell:
    case: str
    client: str
    server: str
    transport: str
    result: str  # pass | fail | unsupported
    detail: str
    seconds: float
    log: str  # path of the cell's log, relative to the output directory
    peer_missing: bool = False  # unsupported because the implementation (an independent peer) is not installed

    @property
    def key(self) -> str:
        return f"{self.case}|{self.client}|{self.server}"


async def run_cell(case: CaseInfo, driver: Driver, env: Env | None, logs: Path) -> Cell:
    log_name = f"logs/{case.name}--{driver.name}.log"
    lines: list[str] = []
    started = time.perf_counter()
    result, detail, peer_missing = "pass", "", False
    try:
        missing = driver.available()
        if missing is not None:
            raise PeerMissing(missing)
        if case.run is None or env is None:
            raise Unsupported(case.why_not)
        if isinstance(driver, MoqtDriver):  # it logs into the cell itself
            driver.lines = lines
            await asyncio.wait_for(case.run(env, driver), 120)
        else:
            await asyncio.wait_for(case.run(env, _Logged(driver, lines)), 120)
    except Unsupported as exc:
        result, detail, peer_missing = "unsupported", str(exc), isinstance(exc, PeerMissing)
    except AssertionError as exc:
        result, detail = "fail", str(exc) or "assertion failed"
        lines.append(traceback.format_exc())
    except Exception as exc:  # a crash is a failure of the cell, never of the run
        result, detail = "fail", f"{type(exc).__name__}: {exc}"
        lines.append(traceback.format_exc())
    (logs / Path(log_name).name).write_text("\n".join([f"{case.name} / {driver.name}: {result} {detail}", *lines]))
    return Cell(case.name, driver.name, SERVER, driver.transport, result, detail,
                round(time.perf_counter() - started, 2), log_name, peer_missing)


class _Logged(Driver):
    """A driver whose requests also land in the cell's log."""

    def __init__(self, inner: Driver, lines: list[str]) -> None:
        self.inner, self.lines = inner, lines
        self.name, self.transport, self.sets_headers = inner.name, inner.transport, inner.sets_headers

    async def send(self, request, tls, log):  # type: ignore[no-untyped-def]
        reply = await self.inner.send(request, tls, self.lines)
        self.lines.append(f"{request.method} {request.url} -> {reply}"[:2000])
        return reply


def _inference(name: str, ready: dict[str, Any]) -> Inference:
    descriptor = CompatDescriptor.from_json(ready["descriptor"])
    assert ready["scope_ids"] == [scope_id(SCOPE_KEY).hex()], f"the {name} instance serves {ready['scope_ids']}"
    return Inference(ready["base_uri"], ready["instance_id"], descriptor,
                     BlockKeyer(SCOPE_KEY, descriptor.compat_id, descriptor.block_tokens), name=name,
                     principal=principal_of(name), moqt=ready.get("moqt") or "")


async def run(cases: list[CaseInfo], drivers: list[Driver], out: Path) -> list[Cell]:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cells: list[Cell] = []
    # the instances only when a selected HTTP driver plays a case that needs them (each adds ~1.5 s to the start;
    # a transformers one, its import too)
    instances: list[str] = []
    if any(not isinstance(d, MoqtDriver) for d in drivers):
        instances = [n for n in INSTANCES if any(n in c.instances and c.run is not None for c in cases)]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        servers = start(Path(tmp), logs, instances=instances)
        print(f"interop: servers up in {time.perf_counter() - started:.1f}s"
              + (f" (with the inference instances {', '.join(servers.instances)})" if servers.instances else ""),
              file=sys.stderr, flush=True)
        try:
            dev = servers.dev

            def tls(name: str) -> TlsFiles:
                stem = servers.principals.get(name, name)
                return TlsFiles(dev / "ca.pem", dev / f"{stem}.pem", dev / f"{stem}.key")

            descriptor = example_descriptor()
            async with KvspClient(tls("dev"), retries=0) as setup, KvspClient(tls("instance"), retries=0) as inst:
                env = Env(servers.index["base_uri"], servers.holder["base_uri"], tls, INSTANCE_URI, setup, inst,
                          descriptor, BlockKeyer(SCOPE_KEY, descriptor.compat_id, descriptor.block_tokens),
                          holder_moqt=servers.holder["moqt"], relay=servers.relay["base_uri"],
                          relay_moqt=servers.relay["moqt"],
                          instances={n: _inference(n, r) for n, r in servers.instances.items()},
                          instance_missing=servers.instance_missing, instance_error=servers.instance_error)
                for case in cases:
                    for driver in drivers:
                        cell = await run_cell(case, driver, env, logs)
                        cells.append(cell)
                        mark = {"pass": "ok  ", "fail": "FAIL", "unsupported": "--  "}[cell.result]
                        print(f"{mark} {case.name:34} {driver.name:16} {cell.seconds:5.1f}s {cell.detail[:80]}",
                              file=sys.stderr, flush=True)
        finally:
            servers.stop()
    return cells


def regressions(cells: list[Cell], expected: dict[str, str], *, require_peers: bool = True) -> list[Cell]:
    """Cells expected to pass that did not; without *require_peers*, not those whose peer is not installed."""
    return [c for c in cells if expected.get(c.key) == "pass" and c.result != "pass"
            and (require_peers or not c.peer_missing)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m interop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help="run only these cases (repeatable)")
    parser.add_argument("--impl", action="append", help="run only these client implementations (repeatable)")
    parser.add_argument("--quick", action="store_true", help=f"the bounded CI subset: {', '.join(QUICK_CASES)}")
    parser.add_argument("--out", type=Path, default=Path("interop-results"), help="where the matrix goes")
    parser.add_argument("--expected", type=Path, default=EXPECTED)
    parser.add_argument("--write-expected", action="store_true", help="record this run's results as expected")
    parser.add_argument("--list", action="store_true", help="list the cases and implementations, then exit")
    parser.add_argument("--require-peers", action="store_true", default=os.environ.get("KVSP_REQUIRE_PEERS") == "1",
                        help="a cell expected to pass whose peer is not installed is a regression (the default with "
                             "KVSP_REQUIRE_PEERS=1; without it such cells are listed as set aside)")
    args = parser.parse_args(argv)
    drivers = all_drivers() + moqt_drivers() + moqrs_drivers()
    if args.list:
        for case in CASES:
            print(f"case {case.name}: {case.resource}")
        for d in drivers:
            missing = d.available()
            print(f"impl {d.name} ({d.transport})" + (f": {missing}" if missing else ""))
        return 0
    names = set(args.case or (QUICK_CASES if args.quick else [c.name for c in CASES]))
    unknown = names - {c.name for c in CASES}
    impls = set(args.impl or [d.name for d in drivers])
    unknown |= impls - {d.name for d in drivers}
    if unknown:
        print(f"interop: error: unknown case or implementation: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    cases = [c for c in CASES if c.name in names]
    drivers = [d for d in drivers if d.name in impls]
    cells = asyncio.run(run(cases, drivers, args.out))
    expected: dict[str, str] = json.loads(args.expected.read_text()) if args.expected.exists() else {}
    bad = regressions(cells, expected, require_peers=args.require_peers)
    set_aside = [c for c in regressions(cells, expected) if c not in bad]
    report.write(args.out, [asdict(c) for c in cells], bad_keys={c.key for c in bad})
    if args.write_expected:
        merged = dict(expected)
        merged.update({c.key: c.result for c in cells})
        args.expected.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
    counts = {r: sum(c.result == r for c in cells) for r in ("pass", "fail", "unsupported")}
    print(f"interop: {counts['pass']} pass, {counts['fail']} fail, {counts['unsupported']} unsupported; "
          f"matrix in {args.out}/matrix.md, .json, .html", file=sys.stderr)
    for c in bad:
        print(f"interop: REGRESSION {c.case} / {c.client}: {c.detail}", file=sys.stderr)
    if set_aside:
        peers = sorted({c.client for c in set_aside})
        print(f"interop: {len(set_aside)} cells expected to pass were not run: not installed here: {', '.join(peers)} "
              "(.ci/run installs them; --require-peers or KVSP_REQUIRE_PEERS=1 counts them as regressions)",
              file=sys.stderr)
    return 1 if bad else 0
