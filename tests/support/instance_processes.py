"""CPU ``kvsp-quic instance`` processes on a tiny random model, for the tests that run a PC and instances as real
processes: starting them, waiting until the PC lists them active, their keys and client files, their metrics."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

from http3.client import KvspClient
from kvsp_quic.keys import BlockKeyer
from quic.tls import TlsFiles
from tests.helpers import Process

STATUS_TTL_MS = 10_000


class Bytes:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("latin-1")


def files_of(ready: dict[str, Any]) -> TlsFiles:
    return TlsFiles(Path(ready["ca"]), Path(ready["client_cert"]), Path(ready["client_key"]))


def tiny_model(tmp_path: Path) -> Path:
    from gpu.modelfiles import ModelConfig, write_random_model

    config = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, head_dim=16)
    return Path(write_random_model(tmp_path / "tiny", config, seed=3))


async def start_instances(n: int, dev: str, model: Path, pcs: list[str], procs: list[Process]) -> list[Process]:
    links = [arg for uri in pcs for arg in ("--controller", uri, "--index", uri)]
    args = ("instance", "--dev", dev, "--device", "cpu", "--model", str(model), "--block-tokens", "4",
            "--warmup-tokens", "8", "--checkpoint-tokens", "4", "--status-ttl-ms", str(STATUS_TTL_MS), *links)
    started = await asyncio.gather(*(asyncio.to_thread(Process, *args) for _ in range(n)))
    procs.extend(started)
    return list(started)


async def active(client: KvspClient, pc: str, instances: list[Process]) -> None:
    wanted = {p.ready["base_uri"] for p in instances}
    deadline = time.monotonic() + 60
    while True:
        listed = (await client.request("GET", f"{pc}instances")).json()["instances"]
        if wanted <= {i["instance"] for i in listed if i["state"] == "active"}:
            return
        assert time.monotonic() < deadline, f"instances not active: {listed}"
        await asyncio.sleep(0.1)


def keyer_of(instance: Process) -> BlockKeyer:
    ready = instance.ready
    return BlockKeyer(bytes.fromhex(Path(ready["scope_key"]).read_text().strip()),
                      bytes.fromhex(ready["compat_id"]), ready["descriptor"]["block_tokens"])


def counter(metrics: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in metrics.splitlines():
        m = re.match(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", line)
        if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
            total += float(m.group(2))
    return total
