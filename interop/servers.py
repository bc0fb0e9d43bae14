"""The servers of the matrix: our roles, started for real (``kvsp-quic index --dev``, ``kvsp-quic holder --dev``,
``kvsp-quic relay --dev --index ... --policy ...`` and, for the cases that need one, ``kvsp-quic instance --dev
--device cpu`` with a tiny random model made by ``kvsp-quic model init``) with a dev PKI that also holds the
principals the cases need.

The inference instances are an implementation parameter of the matrix (:data:`INSTANCES`): ``reference`` and
``transformers`` (``kvsp-quic instance --engine reference|transformers`` on the same model directory: one
descriptor, one cache), and two more that load blocks over HTTP/3 only (``--no-moqt``) for the cross-engine case
over HTTP/3. Only the instances the selected cases name are started. Each reports to the index process (Index
Service + Placement Controller) and publishes its replicas there; each serves the scope of :data:`SCOPE_KEY`
(written as the dev directory's ``scope.key`` before they start). The holder serves both the spec's example
descriptor and the instances', so blocks of their cache can be stored there and prefetched or resharded from there.
The instances start while the holder and the relay start (the descriptor is derived beforehand with ``kvsp-quic
model descriptor``, and checked against every instance's ready line)."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvsp_dev import pki
from kvsp_dev.processes import RoleDidNotStart, RoleProcess, stop_all
from kvsp_quic.samples import example_descriptor

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


@dataclass(frozen=True)
class InstanceKind:
    """One inference instance of the matrix: its engine (``--engine``) and whether it loads blocks over MOQT."""

    engine: str
    moqt: bool = True


# name -> kind; "reference" is the instance of the inference cases since the matrix began (principal "ii")
INSTANCES = {
    "reference": InstanceKind("reference"),
    "transformers": InstanceKind("transformers"),
    "reference-h3": InstanceKind("reference", moqt=False),  # --no-moqt: loads over HTTP/3 (publishes as usual)
    "transformers-h3": InstanceKind("transformers", moqt=False),
}


def instance_unavailable(name: str = "reference") -> str | None:
    """None when instance *name* (:data:`INSTANCES`) can run here, else why not."""
    if importlib.util.find_spec("torch") is None:
        return "the inference instance needs torch (pip install 'kvsp-quic[gpu]'), which is not installed here"
    if INSTANCES[name].engine == "transformers" and importlib.util.find_spec("transformers") is None:
        return "the transformers engine needs transformers (pip install 'kvsp-quic[test]'), which is not installed"
    return None


def principal_of(name: str) -> str:
    """The principal name of instance *name*'s own certificate in :attr:`Servers.principals`."""
    return "ii" if name == "reference" else f"ii-{name}"


@dataclass
class Servers:
    dev: Path
    index: dict[str, Any] = field(default_factory=dict)
    holder: dict[str, Any] = field(default_factory=dict)
    relay: dict[str, Any] = field(default_factory=dict)
    instances: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> its ready line (started ones)
    instance_missing: dict[str, str] = field(default_factory=dict)  # name -> why not here (its cases: unsupported)
    instance_error: dict[str, str] = field(default_factory=dict)  # name -> why it did not start (its cases fail)
    # principal name -> certificate file stem in dev: the roles' own certificates under the names the cases use
    principals: dict[str, str] = field(default_factory=dict)
    procs: list[RoleProcess] = field(default_factory=list)

    def stop(self) -> None:
        stop_all(reversed(self.procs), 10)


def _spawn(servers: Servers, args: list[str], logs: Path, name: str) -> RoleProcess:
    """``kvsp-quic ARGS`` started as *name* (its INFO log in ``logs/NAME.log``), stopped with *servers*."""
    process = RoleProcess(name, *args, stderr=logs / f"{name}.log", log_level="INFO")
    servers.procs.append(process)
    return process


def _tool(args: list[str], logs: Path, name: str) -> None:
    with (logs / f"{name}.log").open("w") as out:
        done = subprocess.run([sys.executable, "-m", "kvsp_app", *args], stdout=out, stderr=subprocess.STDOUT,
                              timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kvsp-quic {' '.join(args[:2])} failed; see {logs / f'{name}.log'}")


def _stem(role: str, base_uri: str) -> str:
    """The name of a --dev role's certificate in the dev directory (kvsp_app.serve.prepare: ROLE-PORT)."""
    return f"{role}-{urlsplit(base_uri).port}"


def start(work: Path, logs: Path, *, instances: Iterable[str] = ()) -> Servers:
    """Start the servers in *work* (logs in *logs*) and the inference instances named in *instances*
    (:data:`INSTANCES`; one whose engine cannot run here is left out, ``Servers.instance_missing`` says why)."""
    dev = work / "dev"
    servers = Servers(dev)
    try:
        servers.index = _spawn(servers, ["index", "--dev", str(dev)], logs, "server-index").wait_ready()
        index = servers.index["base_uri"]
        servers.principals["controller"] = _stem("index", index)  # the PC's own identity, as instances see it
        descriptors = [work / "example-descriptor.json"]
        descriptors[0].write_text(json.dumps(example_descriptor().to_json()))
        procs: dict[str, RoleProcess] = {}
        wanted = list(dict.fromkeys(instances))
        for name in wanted:
            missing = instance_unavailable(name)
            if missing is not None:
                servers.instance_missing[name] = missing
        if any(name not in servers.instance_missing for name in wanted):
            model = work / "model"
            _tool(["model", "init", str(model), *MODEL_ARGS], logs, "model-init")
            descriptors.append(work / "instance-descriptor.json")
            _tool(["model", "descriptor", str(model), "--block-tokens", str(BLOCK_TOKENS), "-o",
                   str(descriptors[1])], logs, "model-descriptor")
            (dev / "scope.key").write_text(SCOPE_KEY.hex() + "\n")
            for name in wanted:
                if name in servers.instance_missing:
                    continue
                kind = INSTANCES[name]
                args = ["instance", "--dev", str(dev), "--device", "cpu", "--model", str(model), "--engine",
                        kind.engine, "--block-tokens", str(BLOCK_TOKENS), "--warmup-tokens", "8", "--device-pages",
                        "256", "--index", index, "--controller", index]
                procs[name] = _spawn(servers, args + ([] if kind.moqt else ["--no-moqt"]), logs,
                                     f"server-instance-{name}")
        holder_args = ["holder", "--dev", str(dev), "--index", index]
        for path in descriptors:
            holder_args += ["--descriptor", str(path)]
        servers.holder = _spawn(servers, holder_args, logs, "server-holder").wait_ready()
        policy = work / "relay-policy.toml"
        policy.write_text(RELAY_POLICY)
        servers.relay = _spawn(servers, ["relay", "--dev", str(dev), "--index", index, "--policy", str(policy),
                                         "--open-prefix", "moq-test"], logs, "server-relay").wait_ready()
        for name, proc in procs.items():
            try:
                ready = proc.wait_ready()
            except RoleDidNotStart as exc:
                servers.instance_error[name] = str(exc)
                continue
            if ready["descriptor"] != json.loads(descriptors[1].read_text()):
                raise RuntimeError(f"the {name} instance's descriptor is not the one kvsp-quic model descriptor "
                                   f"derived")
            if ready.get("engine") != INSTANCES[name].engine:
                raise RuntimeError(f"the {name} instance runs engine {ready.get('engine')!r}")
            servers.instances[name] = ready
            servers.principals[principal_of(name)] = _stem("instance", ready["base_uri"])  # its own identity
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
