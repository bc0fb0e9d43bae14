"""MOQT client implementations of the interop matrix, behind one interface (the MOQT cases of interop/cases.py).

A MOQT driver speaks exactly one draft (no fallback to the other): ``setup``, ``publish_namespace`` and ``fetch``
against a ``moqt://host:port/`` with a client certificate. It sends no HTTP request: the HTTP cases are
"unsupported" for it, as the MOQT cases are for the HTTP drivers.

    kvsp-quic-moqt14/18   moqt.aio (our adapter and sans-I/O core), ALPN moq-00 / moqt-18
    aiomoqt-moqt14/18     aiomoqt 0.13.3 (picoquic) in .venv-aiomoqt, through interop/aiomoqt_peer.py; its client
                          presents our certificate via aiopquic's QuicConfiguration.load_cert_chain
    moq-rs-moqt14/18      moq-rs 0.5.1 in .venv-moqrs: interop/moqrs_drivers.py
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

from interop.drivers import Driver, Refused, Reply, Request, Unsupported
from kvsp_moqt.tracks import moqt_address
from moqt.aio import MoqtConnectError, MoqtRequestError, connect_moqt
from moqt.types import Location, Namespace
from quic.tls import TlsFiles

ROOT = Path(__file__).resolve().parent.parent
AIOMOQT_PYTHON = Path(os.environ.get("KVSP_AIOMOQT_PYTHON", ROOT / ".venv-aiomoqt" / "bin" / "python"))
PEER = Path(__file__).resolve().parent / "aiomoqt_peer.py"
ALPN = {14: "moq-00", 18: "moqt-18"}
TIMEOUT = 60.0


class MoqtDriver(Driver):
    draft = 14
    lines: list[str]
    # True: the client reaches a track only under a namespace its peer announced (moq-rs): the cases whose
    # server announces none are "unsupported" for it
    needs_announcement = False

    def __init__(self) -> None:
        self.lines = []

    async def send(self, request: Request, tls: TlsFiles, log: list[str]) -> Reply | Refused:
        raise Unsupported("a MOQT client: the case is an HTTP exchange")

    async def setup(self, uri: str, tls: TlsFiles) -> int:
        """Connect and complete SETUP; the draft negotiated."""
        raise NotImplementedError

    async def publish_namespace(self, uri: str, tls: TlsFiles, namespace: Namespace) -> int | None:
        """PUBLISH_NAMESPACE: None when accepted, else the error code."""
        raise NotImplementedError

    async def fetch(self, uri: str, tls: TlsFiles, namespace: Namespace, track: bytes, clients: int = 1,
                    expected: list[bytes] | None = None) -> list[list[bytes]]:
        """FETCH all of group 0 with *clients* sessions at once; per client, the SHA-256 of each object (computed
        on the receiving side; a driver may also check them against *expected* there)."""
        raise NotImplementedError


class OursMoqt(MoqtDriver):
    def __init__(self, draft: int) -> None:
        super().__init__()
        self.draft = draft
        self.transport = f"moqt-{draft}"
        self.name = f"kvsp-quic-moqt{draft}"

    async def setup(self, uri: str, tls: TlsFiles) -> int:
        host, port = moqt_address(uri)
        conn = await connect_moqt(host, port, tls, alpn=ALPN[self.draft], timeout=10)
        try:
            self.lines.append(f"SETUP with {uri}: {conn.alpn}, peer {conn.peer_identity}")
            return int(conn.draft.value)
        finally:
            await conn.aclose()

    async def publish_namespace(self, uri: str, tls: TlsFiles, namespace: Namespace) -> int | None:
        host, port = moqt_address(uri)
        conn = await connect_moqt(host, port, tls, alpn=ALPN[self.draft], timeout=10)
        try:
            await conn.publish_namespace(namespace)
            return None
        except MoqtRequestError as exc:
            self.lines.append(f"PUBLISH_NAMESPACE refused: {exc}")
            return exc.error_code
        finally:
            await conn.aclose()

    async def fetch(self, uri: str, tls: TlsFiles, namespace: Namespace, track: bytes, clients: int = 1,
                    expected: list[bytes] | None = None) -> list[list[bytes]]:
        host, port = moqt_address(uri)
        conns = [await connect_moqt(host, port, tls, alpn=ALPN[self.draft], timeout=10) for _ in range(clients)]

        async def one(i: int) -> list[bytes]:
            digests = []
            async with conns[i].fetch(namespace, track, Location(0, 0), Location(0, 0), stall_timeout=20) as fetch:
                async for obj in fetch.objects():
                    h = hashlib.sha256()
                    for part in obj.parts:
                        h.update(part)
                    digests.append(h.digest())
            return digests

        try:
            return list(await asyncio.gather(*(one(i) for i in range(clients))))
        finally:
            for conn in conns:
                await conn.aclose()


class AiomoqtMoqt(MoqtDriver):
    def __init__(self, draft: int) -> None:
        super().__init__()
        self.draft = draft
        self.transport = f"moqt-{draft}"
        self.name = f"aiomoqt-moqt{draft}"

    def available(self) -> str | None:
        if not AIOMOQT_PYTHON.exists():
            return (f"aiomoqt is not installed ({AIOMOQT_PYTHON}; it needs Python >= 3.12: .ci/run makes "
                    f".venv-aiomoqt from interop/requirements-aiomoqt.txt)")
        return None

    async def _peer(self, command: str, uri: str, tls: TlsFiles, *args: str) -> list[dict[str, object]]:
        argv = [str(AIOMOQT_PYTHON), str(PEER), command, "--url", uri, "--draft", str(self.draft), "--cert",
                str(tls.cert), "--key", str(tls.key), "--ca", str(tls.ca), *args]
        self.lines.append("$ " + " ".join(argv))
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"aiomoqt {command}: no answer within {TIMEOUT:.0f} s") from None
        self.lines.append(err.decode("utf-8", "replace")[-3000:])
        if proc.returncode:
            raise AssertionError(f"aiomoqt {command} exited {proc.returncode}: "
                                 f"{err.decode('utf-8', 'replace').strip().splitlines()[-1:]}")
        return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]

    async def setup(self, uri: str, tls: TlsFiles) -> int:
        return int(str((await self._peer("setup", uri, tls))[0]["draft"]))

    async def publish_namespace(self, uri: str, tls: TlsFiles, namespace: Namespace) -> int | None:
        answer = (await self._peer("announce", uri, tls, "--namespace", _fields(namespace)))[0]
        return None if answer.get("ok") else int(str(answer["error"]))

    async def fetch(self, uri: str, tls: TlsFiles, namespace: Namespace, track: bytes, clients: int = 1,
                    expected: list[bytes] | None = None) -> list[list[bytes]]:
        result = (await self._peer("fetch", uri, tls, "--namespace", _fields(namespace), "--track", track.decode(),
                                   "--clients", str(clients)))[0]
        out = []
        for one in result["results"]:  # type: ignore[attr-defined]
            if "error" in one:
                raise MoqtConnectError(str(one["error"])) if "Connect" in str(one["error"]) else \
                    AssertionError(f"aiomoqt FETCH failed: {one['error']}")
            out.append([bytes.fromhex(h) for h in one["digests"]])
        return out


def _fields(namespace: Namespace) -> str:
    return json.dumps([f.decode("utf-8") for f in namespace])


def moqt_drivers() -> list[Driver]:
    return [OursMoqt(14), OursMoqt(18), AiomoqtMoqt(14), AiomoqtMoqt(18)]


__all__ = ["AiomoqtMoqt", "MoqtDriver", "OursMoqt", "moqt_drivers"]
