"""moq-rs (moq-dev's Rust MOQT stack, PyPI ``moq-rs`` 0.5.1 on ``moq-ffi`` 0.4.18) as a client of the interop
matrix's MOQT cases, and as the publisher (a client publishing under the relay's open prefix; ``moq.Server``) some
cases need. It runs in ``.venv-moqrs`` (Python 3.12; ``.ci/run`` makes it from interop/requirements-moqrs.txt;
``KVSP_MOQRS_PYTHON`` names another interpreter), through interop/moqrs_peer.py (one JSON object per line).

    moq-rs-moqt18   moq-rs's client; it offers moq-00 and moqt-18, our servers choose moqt-18 (checked: the
                    draft moq-rs logs at INFO, ``connected version=moq-transport-18``)
    moq-rs-moqt14   the same client: it cannot be limited to moq-00, so against the matrix's servers (moqt-18
                    first) it never speaks draft 14 -- every case "unsupported", saying so; tests/test_moq_rs.py
                    plays its draft 14 cases against a relay offering moq-00 only

What moq-rs cannot do that the cases need is said where the case meets it (:data:`NEEDS_ANNOUNCEMENT`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from interop.drivers import Unsupported
from interop.moqt_drivers import MoqtDriver
from kvsp_moqt.tracks import moqt_address
from moqt.types import Namespace
from quic.tls import TlsFiles

ROOT = Path(__file__).resolve().parent.parent
MOQRS_PYTHON = Path(os.environ.get("KVSP_MOQRS_PYTHON", ROOT / ".venv-moqrs" / "bin" / "python"))
PEER = Path(__file__).resolve().parent / "moqrs_peer.py"
TIMEOUT = 60.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")
VERSION = re.compile(r"connected version=moq-transport-(\d+)")

DRAFT14 = ("moq-rs's client offers moq-00 and moqt-18 and has no setting to offer one only; our servers prefer "
           "moqt-18 (docs/moqt.md, Version negotiation), so with the matrix's servers it speaks draft 18 (column "
           "moq-rs-moqt18). Its draft 14 is played by tests/test_moq_rs.py against a relay offering moq-00 only")
# Diagnosed (moq-rs 0.5.1): a direct fetch from our holder failed with MoqProtocolError before any request
# reached the holder; moq-rs's consumer resolves a broadcast only through a route a peer announced.
NEEDS_ANNOUNCEMENT = (
    "moq-rs reaches a track only under a namespace its peer announced (PUBLISH_NAMESPACE, or NAMESPACE after its "
    "SUBSCRIBE_NAMESPACE): request_broadcast of an unannounced path fails inside moq-rs (MoqProtocolError) and "
    "no SUBSCRIBE or FETCH is sent, although draft 18 allows it ('A subscriber MAY send SUBSCRIBE or FETCH for "
    "tracks in a namespace without having received a PUBLISH_NAMESPACE for it'); {where} announces none")


def moqrs_missing() -> str | None:
    if not MOQRS_PYTHON.exists():
        return (f"moq-rs is not installed ({MOQRS_PYTHON}; it needs Python >= 3.12: .ci/run makes .venv-moqrs from "
                f"interop/requirements-moqrs.txt)")
    return None


def path_of(namespace: Namespace) -> str:
    """moq-rs's broadcast path of a MOQT namespace: its fields joined by '/'."""
    return "/".join(f.decode("utf-8") for f in namespace)


def tls_args(tls: TlsFiles) -> list[str]:
    return ["--cert", str(tls.cert), "--key", str(tls.key), "--ca", str(tls.ca)]


async def run_peer(argv: list[str], lines: list[str], *, log: str = "", timeout: float = TIMEOUT,
                   ) -> tuple[list[dict[str, Any]], str]:
    """Run moqrs_peer.py to its end: its JSON lines (an ``error`` one raises AssertionError) and its stderr."""
    argv = [str(MOQRS_PYTHON), str(PEER), *argv]
    lines.append("$ " + " ".join(argv))
    log = log or os.environ.get("MOQRS_LOG", "")  # MOQRS_LOG=debug: moq-rs's tracing in the cell's log
    env = dict(os.environ, MOQRS_LOG=log) if log else {k: v for k, v in os.environ.items() if k != "MOQRS_LOG"}
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"moq-rs {argv[2]}: no answer within {timeout:.0f} s") from None
    errors = ANSI.sub("", err.decode("utf-8", "replace"))
    lines.append(errors[-8000:])
    results = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    lines.append("\n".join(json.dumps(r)[:500] for r in results))
    for result in results:
        if "error" in result:
            raise AssertionError(f"moq-rs {argv[2]}: {result['error']}: {result.get('detail', '')}")
    if proc.returncode:
        raise AssertionError(f"moq-rs {argv[2]} exited {proc.returncode}: {errors.strip().splitlines()[-1:]}")
    return results, errors


class Peer:
    """A running moqrs_peer.py: its first JSON line (``ready``), and the next ones (:meth:`line`)."""

    def __init__(self, proc: asyncio.subprocess.Process, command: str, lines: list[str]) -> None:
        self.proc, self.command, self.lines = proc, command, lines
        self.ready: dict[str, Any] = {}

    async def line(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not raw:
            raise AssertionError(f"moq-rs {self.command} printed nothing: "
                                 f"{ANSI.sub('', (await self.proc.stderr.read()).decode())[-1500:]}")
        result: dict[str, Any] = json.loads(raw)
        self.lines.append(json.dumps(result)[:2000])
        if "error" in result:
            raise AssertionError(f"moq-rs {self.command}: {result['error']}: {result.get('detail', '')}")
        return result


@contextlib.asynccontextmanager
async def moqrs_process(argv: list[str], lines: list[str], *, ready_timeout: float = 30.0) -> AsyncIterator[Peer]:
    """A long-running moqrs_peer.py (``publish``, ``serve``, ``announce``), once it printed its first JSON line;
    it runs until the block ends."""
    argv = [str(MOQRS_PYTHON), str(PEER), *argv]
    lines.append("$ " + " ".join(argv))
    env = {k: v for k, v in os.environ.items() if k != "MOQRS_LOG"}
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=env)
    try:
        peer = Peer(proc, argv[2], lines)
        peer.ready = await peer.line(ready_timeout)
        yield peer
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()


class MoqrsMoqt(MoqtDriver):
    """moq-rs's client (``moq.Client``), presenting the principal's certificate, verifying ours against the CA."""

    needs_announcement = True

    def __init__(self, draft: int) -> None:
        super().__init__()
        self.draft = draft
        self.transport = f"moqt-{draft}"
        self.name = f"moq-rs-moqt{draft}"

    def available(self) -> str | None:
        return moqrs_missing() or (DRAFT14 if self.draft != 18 else None)

    @staticmethod
    def _url(uri: str) -> str:
        host, port = moqt_address(uri)
        return f"moqt://{host}:{port}/"

    async def setup(self, uri: str, tls: TlsFiles) -> int:
        _, err = await run_peer(["setup", "--url", self._url(uri), *tls_args(tls)], self.lines, log="info")
        found = VERSION.search(err)
        assert found, "moq-rs connected but logged no negotiated version"
        return int(found.group(1))

    async def publish_namespace(self, uri: str, tls: TlsFiles, namespace: Namespace) -> int | None:
        raise Unsupported("moq-rs's API does not report the answer to its PUBLISH_NAMESPACE (BroadcastProducer."
                          "announce() returns None, synchronously): the case checks the error code")

    async def fetch(self, uri: str, tls: TlsFiles, namespace: Namespace, track: bytes, clients: int = 1,
                    expected: list[bytes] | None = None) -> list[list[bytes]]:
        """FETCH group 0 with *clients* moq-rs processes at once (``fetch_group``: moq-rs SUBSCRIBEs, fills the
        group with a joining FETCH; for a KVSP track the peer holds a subscription of its own meanwhile, see
        moqrs_peer.py); with
        *expected*, each checks the objects' SHA-256 itself (``verified``)."""
        argv = ["fetch", "--url", self._url(uri), *tls_args(tls), "--path", path_of(namespace), "--track",
                track.decode(), "--group", "0", "--timeout", "30"]
        if namespace[:1] == (b"kvsp-1",):  # a block: see moqrs_peer.py fetch (on a live track, a held
            argv.append("--hold-subscription")  # subscription made fetch_group wait on it for a past group)
        if expected is not None:
            argv += ["--digests", ",".join(d.hex() for d in expected)]
        answers = await asyncio.gather(*(run_peer(argv, self.lines) for _ in range(clients)))
        out = []
        for results, _ in answers:
            result = results[-1]
            if expected is not None:
                assert result.get("verified") is True, f"moq-rs's side found layers {result.get('mismatch')} " \
                                                       f"differing from the record's digests"
            out.append([bytes.fromhex(h) for h in result["digests"]])
        return out

    async def subscribe(self, uri: str, tls: TlsFiles, namespace: Namespace, track: bytes,
                        groups: int) -> dict[int, list[bytes]]:
        """SUBSCRIBE to a live track and read *groups* whole groups as they are published: per group, the SHA-256
        of each object (computed by moq-rs's side)."""
        argv = ["subscribe", "--url", self._url(uri), *tls_args(tls), "--path", path_of(namespace), "--track",
                track.decode(), "--groups", str(groups), "--timeout", "30"]
        results, _ = await run_peer(argv, self.lines)
        got = next(r for r in results if "groups" in r)["groups"]
        return {int(g): [bytes.fromhex(h) for h in digests] for g, digests in got.items()}


def live_payload(group: int, obj: int, size: int) -> bytes:
    """interop/moqrs_peer.py's payload of object *obj* of *group* (deterministic: each side computes it)."""
    seed = hashlib.sha256(b"moq-rs interop %d/%d" % (group, obj)).digest()
    return (seed * (size // len(seed) + 1))[:size]


def moqrs_drivers() -> list[MoqtDriver]:
    return [MoqrsMoqt(14), MoqrsMoqt(18)]


__all__ = ["DRAFT14", "NEEDS_ANNOUNCEMENT", "MoqrsMoqt", "Peer", "live_payload", "moqrs_drivers", "moqrs_missing",
           "moqrs_process", "path_of", "run_peer", "tls_args"]
