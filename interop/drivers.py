"""HTTP client implementations of the interop matrix, behind one interface.

A driver sends one request over exactly one transport (h1, h2 or h3; no silent fallback) with a given client
certificate, and returns what came back: a :class:`Reply`, or :class:`Refused` when no HTTP exchange happened
(TLS refusal, connection failure). A driver that cannot express a request (gtlsclient sets no header) raises
:class:`Unsupported`, which makes the cell "unsupported", not a failure.

    ours-h1/h2/h3   http3.client.KvspClient, transport forced
    curl-h1/h2      Debian's curl (OpenSSL, nghttp2)
    niquests-h3     niquests on qh3, in its own environment (.venv-peers)
    gtlsclient-h3   ngtcp2's example client (GnuTLS), Debian package ngtcp2-client
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from http3.client import KvspClient, TransportError
from quic.tls import TlsFiles

ROOT = Path(__file__).resolve().parent.parent
PEERS_PYTHON = Path(os.environ.get("KVSP_PEERS_PYTHON", ROOT / ".venv-peers" / "bin" / "python"))
TIMEOUT = 30.0


class Unsupported(Exception):
    """The implementation cannot play this case (a missing feature, or a peer that is not installed)."""


class PeerMissing(Unsupported):
    """The implementation is an independent peer that is not installed here: its cells are unsupported, and a cell
    expected to pass is a regression only where peers are required (``--require-peers``, ``KVSP_REQUIRE_PEERS=1``:
    .ci/run installs them all)."""


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    http_version: str = ""

    def json(self) -> object:
        return json.loads(self.body)


@dataclass
class Refused:
    """No HTTP exchange: the connection or the TLS handshake failed."""

    reason: str


@dataclass(frozen=True)
class Request:
    method: str
    url: str
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


NO_HEADERS = "gtlsclient cannot set request header fields"


class Driver:
    name = ""
    transport = ""
    sets_headers = True  # False: a request with header fields raises Unsupported(NO_HEADERS)

    def available(self) -> str | None:
        """None when the driver can run here, else why not."""
        return None

    async def send(self, request: Request, tls: TlsFiles, log: list[str]) -> Reply | Refused:
        raise NotImplementedError


class OursDriver(Driver):
    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.name = f"kvsp-quic-{transport}"

    async def send(self, request: Request, tls: TlsFiles, log: list[str]) -> Reply | Refused:
        if self.transport == "h3":
            client = KvspClient(tls, retries=0, fallback=False, timeout=TIMEOUT, connect_timeout=5)
        else:
            client = KvspClient(tls, retries=0, h3=False, fallback_http2=self.transport == "h2", timeout=TIMEOUT)
        async with client:
            try:
                r = await client.request(request.method, request.url, content=request.body or None,
                                         headers=dict(request.headers))
            except TransportError as exc:
                log.append(f"refused: {exc}")
                return Refused(str(exc))
        version = {"HTTP/3": "h3", "HTTP/2": "h2", "HTTP/1.1": "h1"}.get(r.http_version, r.http_version)
        if version != self.transport:
            raise AssertionError(f"asked for {self.transport}, spoke {r.http_version}")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in r.headers.raw}
        return Reply(r.status, headers, r.content or b"", version)


async def _run(argv: list[str], log: list[str], timeout: float = TIMEOUT) -> tuple[int, bytes, bytes]:
    log.append("$ " + " ".join(argv))
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, b"", b"timed out"
    log.append(err.decode("utf-8", "replace")[-4000:])
    return proc.returncode or 0, out, err


class CurlDriver(Driver):
    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.name = f"curl-{transport}"

    def available(self) -> str | None:
        return None if shutil.which("curl") else "curl is not installed"

    async def send(self, request: Request, tls: TlsFiles, log: list[str]) -> Reply | Refused:
        with tempfile.TemporaryDirectory() as tmp:
            body_file, head_file, data_file = Path(tmp, "body"), Path(tmp, "head"), Path(tmp, "data")
            argv = ["curl", "-sS", "--http1.1" if self.transport == "h1" else "--http2", "--cacert", str(tls.ca),
                    "--cert", str(tls.cert), "--key", str(tls.key), "-X", request.method, "-o", str(body_file),
                    "-D", str(head_file), "-w", "%{http_code} %{http_version}", "--max-time", str(int(TIMEOUT))]
            for name, value in request.headers.items():
                argv += ["-H", f"{name}: {value}"]
            if request.body:
                data_file.write_bytes(request.body)
                argv += ["--data-binary", f"@{data_file}"]
            code, out, err = await _run([*argv, request.url], log)
            if code != 0:
                return Refused(f"curl exit {code}: {err.decode(errors='replace').strip()}")
            status, version = out.decode().split()
            headers = _parse_head(head_file.read_text("latin-1"))
            got = {"1.1": "h1", "2": "h2"}.get(version, version)
            if got != self.transport:
                raise AssertionError(f"asked for {self.transport}, curl spoke HTTP/{version}")
            return Reply(int(status), headers, body_file.read_bytes() if body_file.exists() else b"", got)


def _parse_head(text: str) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in text.splitlines()[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return headers


_NIQUESTS = """
import base64, json, sys, niquests

# niquests 3.21 (urllib3-future 2.25) fills its ConnectionInfo after qh3 verified the server's chain and name, with
# getpeercert(), which parses every subjectAltName that is not DNS as an IP address: a URI (every KVSP role
# certificate's identity) raises ValueError. The parse sees the certificate without its URI names, which are
# added as the ssl module reports them, ("URI", value). Verification is qh3's and stays untouched.
try:
    from urllib3.contrib.hface.protocols.http3._qh3 import HTTP3ProtocolAioQuicImpl
except ImportError:  # another urllib3-future: no workaround (the URI parse fails as before: "unsupported")
    HTTP3ProtocolAioQuicImpl = None

class _WithoutUris:
    def __init__(self, cert):
        self._cert = cert
        names = [n.decode() for n in cert.get_subject_alt_names()]
        self.uris = [n[4:-1] for n in names if n.startswith("URI(") and n.endswith(")")]
    def get_subject_alt_names(self):
        return [n for n in self._cert.get_subject_alt_names() if not n.decode().startswith("URI(")]
    def __getattr__(self, name):
        return getattr(self._cert, name)

class _QuicView:
    def __init__(self, quic, cert):
        self._quic, self._cert = quic, cert
    def get_peercert(self):
        return self._cert
    def __getattr__(self, name):
        return getattr(self._quic, name)

def getpeercert(self, *, binary_form=False, _getpeercert=getattr(HTTP3ProtocolAioQuicImpl, "getpeercert", None)):
    quic = self._quic
    cert = None if binary_form else quic.get_peercert()
    if cert is None:
        return _getpeercert(self, binary_form=binary_form)
    view = _WithoutUris(cert)
    self._quic = _QuicView(quic, view)
    try:
        info = _getpeercert(self, binary_form=False)
    finally:
        self._quic = quic
    if view.uris:
        info["subjectAltName"] = (*info.get("subjectAltName", ()), *(("URI", u) for u in view.uris))
    return info

if HTTP3ProtocolAioQuicImpl is not None:
    HTTP3ProtocolAioQuicImpl.getpeercert = getpeercert

spec = json.loads(sys.stdin.read())
s = niquests.Session(disable_http1=True, disable_http2=True)
s.quic_cache_layer.add_domain(spec["host"], spec["port"])
try:
    r = s.request(spec["method"], spec["url"], data=base64.b64decode(spec["body"]) or None, headers=spec["headers"],
                  verify=spec["ca"], cert=(spec["cert"], spec["key"]), timeout=spec["timeout"])
except Exception as exc:
    print(json.dumps({"refused": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
info = r.conn_info.certificate_dict if r.conn_info is not None else None
print(json.dumps({"status": r.status_code, "version": r.http_version, "headers": dict(r.headers),
                  "body": base64.b64encode(r.content or b"").decode(),
                  "san": [list(x) for x in (info or {}).get("subjectAltName", ())]}))
"""


_NIQUESTS_URI_SAN = ("niquests fails on a URI in the server certificate's subjectAltName (it parses every non-DNS "
                     "name as an IP address), every KVSP role certificate carries its base URI there, and the "
                     "driver's workaround (for urllib3-future 2.25) did not apply to this urllib3-future")


class NiquestsDriver(Driver):
    name = "niquests-h3"
    transport = "h3"

    def available(self) -> str | None:
        return None if PEERS_PYTHON.exists() else f"no niquests environment at {PEERS_PYTHON} (.ci/run creates it)"

    async def send(self, request: Request, tls: TlsFiles, log: list[str]) -> Reply | Refused:
        from urllib.parse import urlsplit

        parts = urlsplit(request.url)
        spec = {"method": request.method, "url": request.url, "host": parts.hostname, "port": parts.port,
                "body": base64.b64encode(request.body).decode(), "headers": dict(request.headers),
                "ca": str(tls.ca), "cert": str(tls.cert), "key": str(tls.key), "timeout": TIMEOUT}
        log.append(f"$ niquests {request.method} {request.url}")
        proc = await asyncio.create_subprocess_exec(str(PEERS_PYTHON), "-c", _NIQUESTS,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(spec).encode()), TIMEOUT + 5)
        log.append(err.decode(errors="replace")[-4000:])
        result = json.loads(out)
        if "refused" in result:
            if "non-hexadecimal number found in fromhex()" in result["refused"]:
                raise Unsupported(_NIQUESTS_URI_SAN)
            return Refused(result["refused"])
        if result["version"] != 30:
            raise AssertionError(f"niquests spoke HTTP version {result['version']}, not 3")
        log.append(f"server certificate subjectAltName (niquests' ConnectionInfo): {result['san']}")
        headers = {k.lower(): v for k, v in result["headers"].items()}
        return Reply(result["status"], headers, base64.b64decode(result["body"]), "h3")


_STATUS_RE = re.compile(r"\[:status: (\d+)\]")
_HEADER_RE = re.compile(r"http: stream 0x0 \[([a-z0-9-]+): (.*)\]")


class GtlsclientDriver(Driver):
    name = "gtlsclient-h3"
    transport = "h3"
    sets_headers = False

    def available(self) -> str | None:
        return None if shutil.which("gtlsclient") else "gtlsclient is not installed (apt-get install ngtcp2-client)"

    async def send(self, request: Request, tls: TlsFiles, log: list[str]) -> Reply | Refused:
        from urllib.parse import urlsplit

        if request.headers:
            raise Unsupported(NO_HEADERS)
        parts = urlsplit(request.url)
        with tempfile.TemporaryDirectory() as tmp:
            argv = ["gtlsclient", "--no-quic-dump", "--exit-on-all-streams-close", f"--timeout={int(TIMEOUT)}s",
                    f"--download={tmp}", f"--key={tls.key}", f"--cert={tls.cert}", "-m", request.method]
            if request.body:
                Path(tmp, ".body").write_bytes(request.body)
                argv.append(f"--data={tmp}/.body")
            _, out, err = await _run([*argv, parts.hostname or "", str(parts.port), request.url], log)
            text = (out + err).decode("utf-8", "replace")
            status = _STATUS_RE.search(text)
            if status is None:
                closing = re.search(r"CONNECTION_CLOSE.*?reason=\[(.*?)\]", text)
                return Refused(closing.group(1) if closing else "no response")
            headers = dict(_HEADER_RE.findall(text))
            downloads = [p for p in Path(tmp).iterdir() if p.name != ".body"]  # named after the path (and query)
            return Reply(int(status.group(1)), headers, downloads[0].read_bytes() if downloads else b"", "h3")


def all_drivers() -> list[Driver]:
    return [OursDriver("h1"), OursDriver("h2"), OursDriver("h3"), CurlDriver("h1"), CurlDriver("h2"),
            NiquestsDriver(), GtlsclientDriver()]
