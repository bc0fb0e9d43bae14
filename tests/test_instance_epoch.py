"""The instance epoch is a persisted counter (issue 12, point 8; spec, "Instance Status and Lifecycle": 'The
"epoch" of an instance MUST increase every time it restarts; ... otherwise the instance persists a counter'): one
more at every start than the last one persisted, never below the start time in ms, in a file created 0600 and
replaced atomically; restarts with the wall clock set back still give increasing epochs."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from kvsp_app.config import ConfigError, InstanceFile, build
from kvsp_quic.roles.instance import InstanceOptions, next_instance_epoch
from tests.helpers import Process

T = 1_800_000_000.0  # seconds since the Unix epoch


def test_next_epoch() -> None:
    assert next_instance_epoch(None, 1000) == 1000  # the first start: the start time in ms
    assert next_instance_epoch(1000, 5000) == 5000  # the clock moved on: the start time, as before
    assert next_instance_epoch(5000, 4000) == 5001  # the clock moved back: one more
    assert next_instance_epoch(5000, 5000) == 5001  # two starts within one millisecond
    with pytest.raises(ValueError):
        next_instance_epoch(-1, 5000)


def test_restarts_with_the_clock_set_back_give_increasing_epochs(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")  # kvsp_app.instance: gpu
    from kvsp_app.instance import persisted_epoch

    path = tmp_path / "state" / "instance.epoch"
    now = [T]
    first = persisted_epoch(path, lambda: now[0])
    assert first == int(T * 1000) and path.read_text() == f"{first}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    now[0] = T - 3600  # the wall clock set back an hour between two quick restarts
    second = persisted_epoch(path, lambda: now[0])
    third = persisted_epoch(path, lambda: now[0])
    assert first < second < third and (second, third) == (first + 1, first + 2)
    now[0] = T + 60  # and forward again: the start time, above every epoch handed out
    assert persisted_epoch(path, lambda: now[0]) == int((T + 60) * 1000)
    assert sorted(p.name for p in path.parent.iterdir()) == ["instance.epoch"]  # no temporary file left
    path.chmod(0o644)  # a file someone loosened is written back 0600
    persisted_epoch(path, lambda: now[0])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_damaged_epoch_file_is_refused_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
    from kvsp_app.instance import persisted_epoch

    path = tmp_path / "instance.epoch"
    for text in ("", "12x\n", "-5\n"):
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            persisted_epoch(path, lambda: T)
        assert "not a decimal number" in str(info.value) and "\n" not in str(info.value)
        assert path.read_text() == text  # left as it was


def test_the_epoch_file_is_configured_in_instance(tmp_path: Path) -> None:
    cfg = build(InstanceFile, {"instance": {"epoch_file": "state/epoch"}}, root=tmp_path)
    assert cfg.instance.epoch_file == tmp_path / "state" / "epoch"
    assert build(InstanceFile, {}).instance.epoch_file is None
    assert InstanceOptions().epoch_file is None


async def test_a_dev_instance_persists_its_epoch_across_restarts(tmp_path: Path) -> None:
    """With ``--dev DIR`` the epoch lives in DIR/instance.epoch. Seeded far in the future -- as if the clock had
    been set back since the last start -- two restarts give the next two numbers, not the start time."""
    pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
    from gpu.modelfiles import ModelConfig, write_random_model

    config = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256, head_dim=16)
    model = write_random_model(tmp_path / "tiny", config, seed=1)
    dev = tmp_path / "dev"
    dev.mkdir(mode=0o700)
    future = 4_000_000_000_000  # ms: the year 2096
    fd = os.open(dev / "instance.epoch", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, f"{future}\n".encode())
    os.close(fd)
    epochs = []
    for _ in range(2):
        proc = await asyncio.to_thread(Process, "instance", "--dev", str(dev), "--device", "cpu", "--model",
                                       str(model), "--block-tokens", "4", "--warmup-tokens", "8")
        try:
            epochs.append(proc.ready["epoch"])
        finally:
            err = proc.stop()
        assert "Traceback" not in err, err
    assert epochs == [future + 1, future + 2]
    assert (dev / "instance.epoch").read_text() == f"{future + 2}\n"
