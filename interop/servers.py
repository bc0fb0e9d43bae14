"""The servers of the matrix: our roles, started for real (``kvsp-quic index --dev``, ``kvsp-quic holder --dev``,
``kvsp-quic relay --dev --index ... --policy ...`` and, for the cases that need one, ``kvsp-quic instance --dev
--device cpu`` with a tiny random model made by ``kvsp-quic model init``) with a dev PKI that also holds the
principals the cases need.

The instance reports to the index process (Index Service + Placement Controller) and publishes its replicas there;
it serves the scope of :data:`SCOPE_KEY` (written as the dev directory's ``scope.key`` before it starts). The holder
serves both the spec's example descriptor and the instance's, so blocks of the instance's cache can be stored
there and prefetched or resharded from there. The instance starts while the holder and the relay start (its
descriptor is derived beforehand with ``kvsp-quic model descriptor``, and checked against its ready line)."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvsp_quic.samples import example_descriptor
from quic import pki

INSTANCE_URI = "https://127.0.0.1:1/interop-instance/"
DEV_IDENTITY = pki.CLIENT_URI_PREFIX + "dev"
SCOPE_KEY = bytes(range(32))  # the scope of every case (the setup client's keyer and the instance's scope.key)
# The tiny model of the inference instance: 2 layers, 1 KV head of 16, vocabulary 256 (~35k parameters), blocks of
# 4 tokens (1 KiB containers). Loading and warming it up takes ~1.5 s on two cores, torch's import included.
MODEL_ARGS = ("--layers", "2", "--kv-heads", "1", "--head-dim", "16", "--vocab", "256", "--name", "interop-tiny")
BLOCK_TOKENS = 4
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


def instance_unavailable() -> str | None:
    """None when ``kvsp-quic instance`` can run here, else why not."""
    if importlib.util.find_spec("torch") is None:
        return "the inference instance needs torch (pip install 'kvsp-quic[gpu]'), which is not installed here"
    return None


@dataclass
class Servers:
    dev: Path
    index: dict[str, Any] = field(default_factory=dict)
    holder: dict[str, Any] = field(default_factory=dict)
    relay: dict[str, Any] = field(default_factory=dict)
    instance: dict[str, Any] = field(default_factory=dict)  # its ready line; empty when not started
    instance_missing: str = "the inference instance was not started for this run"  # its cases: unsupported
    instance_error: str = ""  # it was to start and did not: its cases fail with this
    # principal name -> certificate file stem in dev: the roles' own certificates under the names the cases use
    principals: dict[str, str] = field(default_factory=dict)
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


def _spawn(args: list[str], logs: Path, name: str) -> subprocess.Popen[str]:
    with (logs / f"{name}.log").open("w") as err:
        return subprocess.Popen([sys.executable, "-m", "kvsp_quic", *args, "--log-level", "INFO"],
                                stdout=subprocess.PIPE, stderr=err, text=True)


def _ready(proc: subprocess.Popen[str], logs: Path, name: str) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"{name} did not start; see {logs / f'{name}.log'}")
    ready: dict[str, Any] = json.loads(line)
    return ready


def _start(servers: Servers, args: list[str], logs: Path, name: str) -> dict[str, Any]:
    proc = _spawn(args, logs, name)
    servers.procs.append(proc)
    return _ready(proc, logs, name)


def _tool(args: list[str], logs: Path, name: str) -> None:
    with (logs / f"{name}.log").open("w") as out:
        done = subprocess.run([sys.executable, "-m", "kvsp_quic", *args], stdout=out, stderr=subprocess.STDOUT,
                              timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kvsp-quic {' '.join(args[:2])} failed; see {logs / f'{name}.log'}")


def _stem(role: str, base_uri: str) -> str:
    """The name of a --dev role's certificate in the dev directory (kvsp_quic.app.serve.prepare: ROLE-PORT)."""
    return f"{role}-{urlsplit(base_uri).port}"


def start(work: Path, logs: Path, *, instance: bool = False) -> Servers:
    """Start the servers in *work* (logs in *logs*); with *instance*, an inference instance too (when torch is
    installed; otherwise ``Servers.instance_missing`` says why not)."""
    dev = work / "dev"
    servers = Servers(dev)
    try:
        servers.index = _start(servers, ["index", "--dev", str(dev)], logs, "server-index")
        index = servers.index["base_uri"]
        servers.principals["controller"] = _stem("index", index)  # the PC's own identity, as instances see it
        descriptors = [work / "example-descriptor.json"]
        descriptors[0].write_text(json.dumps(example_descriptor().to_json()))
        proc = None
        missing = instance_unavailable() if instance else servers.instance_missing
        if missing is None:
            model = work / "model"
            _tool(["model", "init", str(model), *MODEL_ARGS], logs, "model-init")
            descriptors.append(work / "instance-descriptor.json")
            _tool(["model", "descriptor", str(model), "--block-tokens", str(BLOCK_TOKENS), "-o",
                   str(descriptors[1])], logs, "model-descriptor")
            (dev / "scope.key").write_text(SCOPE_KEY.hex() + "\n")
            proc = _spawn(["instance", "--dev", str(dev), "--device", "cpu", "--model", str(model), "--block-tokens",
                           str(BLOCK_TOKENS), "--warmup-tokens", "8", "--device-pages", "256", "--index", index,
                           "--controller", index], logs, "server-instance")
            servers.procs.append(proc)
        holder_args = ["holder", "--dev", str(dev), "--index", index]
        for path in descriptors:
            holder_args += ["--descriptor", str(path)]
        servers.holder = _start(servers, holder_args, logs, "server-holder")
        policy = work / "relay-policy.toml"
        policy.write_text(RELAY_POLICY)
        servers.relay = _start(servers, ["relay", "--dev", str(dev), "--index", index, "--policy", str(policy),
                                         "--open-prefix", "moq-test"], logs, "server-relay")
        if proc is None:
            servers.instance_missing = missing or servers.instance_missing
        else:
            try:
                ready = _ready(proc, logs, "server-instance")
            except RuntimeError as exc:
                servers.instance_error = str(exc)
            else:
                if ready["descriptor"] != json.loads(descriptors[1].read_text()):
                    raise RuntimeError("the instance's descriptor is not the one kvsp-quic model descriptor derived")
                servers.instance = ready
                servers.principals["ii"] = _stem("instance", ready["base_uri"])  # the instance's own identity
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
