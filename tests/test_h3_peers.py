"""Our HTTP/3 server with mutual TLS against independent HTTP/3 clients: ngtcp2's gtlsclient and niquests (qh3).

The peers are installed by .ci/run (Debian's ngtcp2-client; niquests in its own virtual environment,
.venv-peers, because it replaces the urllib3 module). Where one is missing, its tests are skipped and say why.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from http3.h3_server import h3_handler
from quic.listener import QuicListener
from quic.tls import TlsFiles, scope_identity
from tests.peers import needs_peer
from tests.pki import TestPki

ROOT = Path(__file__).resolve().parent.parent
GTLSCLIENT = shutil.which("gtlsclient")
NIQUESTS_PYTHON = Path(os.environ.get("KVSP_PEERS_PYTHON", ROOT / ".venv-peers" / "bin" / "python"))
needs_gtls = needs_peer("ngtcp2's gtlsclient is not installed (apt-get install ngtcp2-client; .ci/run does)"
                        if GTLSCLIENT is None else None)
needs_niquests = needs_peer(None if NIQUESTS_PYTHON.exists() else f"no niquests environment at {NIQUESTS_PYTHON} "
                            "(.ci/run creates it; or set KVSP_PEERS_PYTHON)")

NIQUESTS_SCRIPT = """
import sys, niquests
port, ca, cert, key, path = sys.argv[1:6]
s = niquests.Session(disable_http1=True, disable_http2=True)
s.quic_cache_layer.add_domain("127.0.0.1", int(port))
kw = {"verify": ca, "timeout": 10}
if cert != "-":
    kw["cert"] = (cert, key)
try:
    r = s.get(f"https://127.0.0.1:{port}{path}", **kw)
except Exception as exc:
    print("ERROR", exc)
    sys.exit(3)
print(r.status_code, r.http_version)
sys.stdout.flush()
sys.stdout.buffer.write(r.content)
"""


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    if scope["path"].startswith("/bytes/"):
        body = hashlib.sha256(b"seed").digest() * (int(scope["path"].rsplit("/", 1)[1]) // 32)
    else:
        body = f"identity={scope_identity(scope)}".encode()
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def serve(files: TlsFiles) -> QuicListener:
    listener = QuicListener(files, {"h3": h3_handler(app)})
    await listener.start("127.0.0.1", 0)
    return listener


async def run(*argv: str, timeout: float = 30) -> tuple[int, bytes]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out


async def gtlsclient(listener: QuicListener, certs: TestPki, who: str | None, path: str,
                     download: Path) -> bytes:
    assert GTLSCLIENT is not None
    args = [GTLSCLIENT, "--no-quic-dump", "--no-http-dump", "--exit-on-all-streams-close", "--timeout=5s",
            f"--download={download}"]
    if who is not None:
        files = certs.foreign if who == "foreign" else certs.files(who)
        args += [f"--key={files.key}", f"--cert={files.cert}"]
    port = str(listener.port)
    _, out = await run(*args, "127.0.0.1", port, f"https://127.0.0.1:{port}{path}")
    return out


@needs_gtls
async def test_gtlsclient_with_a_valid_certificate(fresh_certs: TestPki, tmp_path: Path) -> None:
    listener = await serve(fresh_certs.files("server"))
    try:
        await gtlsclient(listener, fresh_certs, "alice", "/who", tmp_path)
        assert (tmp_path / "who").read_bytes() == b"identity=urn:kvsp:client:alice"
        await gtlsclient(listener, fresh_certs, "alice", "/bytes/4194304", tmp_path)  # 4 MiB
        assert (tmp_path / "4194304").read_bytes() == hashlib.sha256(b"seed").digest() * (4194304 // 32)
    finally:
        await listener.close()


@needs_gtls
@pytest.mark.parametrize(("who", "alert"), [(None, "client certificate is required"),
                                            ("expired", "no longer valid"), ("notyet", "not valid yet"),
                                            ("foreign", "unable to get local issuer")])
async def test_gtlsclient_refused(fresh_certs: TestPki, tmp_path: Path, who: str | None, alert: str) -> None:
    listener = await serve(fresh_certs.files("server"))
    try:
        out = await gtlsclient(listener, fresh_certs, who, "/who", tmp_path)
    finally:
        await listener.close()
    assert not (tmp_path / "who").exists() or (tmp_path / "who").read_bytes() == b""  # no response body
    assert "CRYPTO_ERROR" in out.decode() and alert in out.decode()


async def niquests(listener: QuicListener, certs: TestPki, who: str | None, path: str) -> tuple[int, bytes]:
    files = certs.foreign if who == "foreign" else certs.files(who or "alice")
    cert, key = (str(files.cert), str(files.key)) if who else ("-", "-")
    return await run(str(NIQUESTS_PYTHON), "-c", NIQUESTS_SCRIPT, str(listener.port), str(certs.ca), cert, key, path)


# niquests 3.21 cannot parse a URI in the *server's* subjectAltName (it takes every non-DNS name for an IP
# address and fails in bytes.fromhex), so these tests serve with the "plain" certificate: IP and DNS names only.


@needs_niquests
async def test_niquests_with_a_valid_certificate(fresh_certs: TestPki) -> None:
    listener = await serve(fresh_certs.files("plain"))
    try:
        code, out = await niquests(listener, fresh_certs, "alice", "/who")
        assert code == 0, out
        assert out == b"200 30\nidentity=urn:kvsp:client:alice"
        code, out = await niquests(listener, fresh_certs, "alice", "/bytes/1048576")
        assert code == 0 and out.split(b"\n", 1)[1] == hashlib.sha256(b"seed").digest() * (1048576 // 32)
    finally:
        await listener.close()


@needs_niquests
@pytest.mark.parametrize(("who", "alert"), [(None, "TLS_CERTIFICATE_REQUIRED"), ("expired", "EXPIRED"),
                                            ("foreign", "unable to get local issuer")])
async def test_niquests_refused(fresh_certs: TestPki, who: str | None, alert: str) -> None:
    listener = await serve(fresh_certs.files("plain"))
    try:
        code, out = await niquests(listener, fresh_certs, who, "/who")
    finally:
        await listener.close()
    assert code == 3 and alert in out.decode(), out
