"""The servers of the matrix: our roles, started for real (``kvsp-quic index --dev``, ``kvsp-quic holder --dev``,
``kvsp-quic relay --dev --index ... --policy ...``) with a dev PKI that also holds the principals the cases
need."""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from http3 import pki

INSTANCE_URI = "https://127.0.0.1:1/interop-instance/"
DEV_IDENTITY = pki.CLIENT_URI_PREFIX + "dev"
# The relay runs with the dev certificates and this policy (not the dev one, under which every certificate may
# publish for any holder): "dev" may publish only KVSP namespaces naming its own holder-id, and read everything.
RELAY_POLICY = f"""
[[principal]]
identity = "{DEV_IDENTITY}"
roles = ["holder", "client"]
scopes = "*"

[[principal]]
identity = "{INSTANCE_URI}"
roles = ["instance"]
scopes = "*"
"""


@dataclass
class Servers:
    dev: Path
    index: dict[str, Any] = field(default_factory=dict)
    holder: dict[str, Any] = field(default_factory=dict)
    relay: dict[str, Any] = field(default_factory=dict)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def _start(args: list[str], logs: Path, name: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    err = (logs / f"{name}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvsp_quic", *args, "--log-level", "INFO"],
                            stdout=subprocess.PIPE, stderr=err, text=True)
    err.close()
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"{name} did not start; see {logs / f'{name}.log'}")
    return proc, json.loads(line)


def start(work: Path, logs: Path) -> Servers:
    dev = work / "dev"
    servers = Servers(dev)
    try:
        proc, servers.index = _start(["index", "--dev", str(dev)], logs, "server-index")
        servers.procs.append(proc)
        proc, servers.holder = _start(["holder", "--dev", str(dev), "--index", servers.index["base_uri"]], logs,
                                      "server-holder")
        servers.procs.append(proc)
        policy = work / "relay-policy.toml"
        policy.write_text(RELAY_POLICY)
        proc, servers.relay = _start(["relay", "--dev", str(dev), "--index", servers.index["base_uri"], "--policy",
                                      str(policy), "--open-prefix", "moq-test"], logs, "server-relay")
        servers.procs.append(proc)
    except BaseException:
        servers.stop()
        raise
    # The principals the cases need besides "dev": an instance identity, and two a server must refuse.
    pki.init(dev, [pki.role("instance", INSTANCE_URI)])
    ca_cert, ca_key = pki.load_pair(dev, "ca")
    now = dt.datetime.now(dt.UTC)
    pki.write_pair(dev, "expired", *pki.issue(ca_cert, ca_key, pki.client("expired"),
                                              not_before=now - dt.timedelta(days=3),
                                              not_after=now - dt.timedelta(days=1)))
    foreign = work / "foreign"
    pki.init(foreign, [pki.client("foreign")])
    for suffix in ("pem", "key"):
        (dev / f"foreign.{suffix}").write_bytes((foreign / f"foreign.{suffix}").read_bytes())
    return servers
