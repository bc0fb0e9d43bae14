"""benchmarks.bench_vs_mooncake without Mooncake (as in CI): the environment check says what is missing and how to
install it; the holder, both client paths and both socket ceilings move the exact block octets; a short
measurement fills every column but Mooncake's. A few seconds: 256 KiB blocks, one round."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from benchmarks import bench_vs_mooncake as bench
from benchmarks.floor import floor_ms, sha256_cpu_ms
from quic.tls import TlsFiles, ssl_client_context

NAME = "256 KiB"


def test_environment_without_a_mooncake_venv(tmp_path: Path) -> None:
    env = bench.check_environment(tmp_path / "venv", environ={})
    assert not env.mooncake
    assert any(f"python3.11 -m venv {tmp_path / 'venv'}" in m and "pip install mooncake-transfer-engine-non-cuda" in m
               for m in env.missing), env.missing
    assert any("export MC_TCP_BIND_ADDRESS=127.0.0.1" in n for n in env.notes)
    set_env = bench.check_environment(tmp_path / "venv", environ={"MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    assert not any("MC_TCP_BIND_ADDRESS" in n for n in set_env.notes)


def test_environment_with_a_venv_that_lacks_mooncake(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")  # a real interpreter, without mooncake installed
    env = bench.check_environment(venv, environ={})
    assert not env.mooncake and env.python is None
    assert any("`import mooncake.store` fails" in m and f"{venv}/bin/pip install mooncake-transfer-engine-non-cuda"
               in m for m in env.missing), env.missing


async def test_holder_clients_and_ceilings_move_the_block(tmp_path: Path) -> None:
    descriptors, bodies, files = bench.make_blocks(tmp_path, [NAME])
    body = bodies[NAME]
    assert len(body) > 256 << 10 and files[NAME].read_bytes() == body
    procs = bench.Processes()
    ours: list[bench.Ours] = []
    socks: list[bench.Sockets] = []
    try:
        ready = bench.start_holder(procs, tmp_path, [NAME])
        ports = bench.start_socket_server(procs, bench.holder_tls(tmp_path, ready), [files[NAME]])
        started = list(procs.procs)
        tls = TlsFiles.of(ready["ca"], ready["client_cert"], ready["client_key"])
        key = bytes(range(32))
        for h3 in (True, False):
            ours.append(bench.Ours(ready, descriptors, bodies, h3=h3))
        await ours[0].put(NAME, key)
        for client, version in zip(ours, ("HTTP/3", "HTTP/1.1"), strict=True):
            client.buffers[0][:] = bytes(len(client.buffers[0]))
            await client.get(NAME, key, client.buffers[0])
            assert bytes(client.buffers[0][:len(body)]) == body
            assert client.http_version == version
        socks = [bench.Sockets(ports["tcp"], None, bodies),
                 bench.Sockets(ports["tls"], ssl_client_context(tls, alpn=("kvsp-bench",)), bodies)]
        for sock in socks:
            assert sock.get(NAME, 0) == body
            assert sock.get(NAME, 1) == body  # a second connection
            sock.put(NAME, 0)
            assert sock.get(NAME, 0) == body  # the connection is still in step after a PUT
        assert socks[1].conns[0].version() == "TLSv1.3"  # type: ignore[attr-defined]

        get_keys = {NAME: [key]}
        subjects: dict[str, bench.Batch] = {
            "ours h3": lambda op, n: ours[0].batch(op, n, get_keys),
            "ours h1": lambda op, n: ours[1].batch(op, n, get_keys),
            "tcp socket": lambda op, n: socks[0].batch(op, n, get_keys),
            "mtls socket": lambda op, n: socks[1].batch(op, n, get_keys)}
        ops: list[bench.Op] = [("get", NAME, 1), ("put", NAME, 1)]
        pids = {"ours h3": [ready["pid"]], "ours h1": [ready["pid"]], "tcp socket": [ports["pid"]],
                "mtls socket": [ports["pid"]]}
        results = await bench.measure(subjects, ops, rounds=1, quick=True, pids=pids, log=lambda line: None)
        for op in ops:
            assert {s: len(v) for s, v in results.times[op].items()} == dict.fromkeys(subjects,
                                                                                      bench.batch_size(op, True))
            assert all(results.cpu[op][s] > 0 for s in subjects)
        lines = bench.table(results.times, bodies)
        sha_ms = {NAME: sha256_cpu_ms(len(body))}
        cpu_lines = bench.cpu_table(results.cpu, sha_ms)
    finally:
        for sock in socks:
            sock.close()
        for client in ours:
            await client.client.aclose()
        procs.stop_all()
    assert lines[0].startswith("| op, block, concurrency | Mooncake TCP MB/s | Mooncake + checksum | ours h3 |")
    row = lines[2].split(" | ")
    assert row[0] == "| get 256 KiB, c1 (p50)" and row[1] == row[2] == "n/a"
    assert all(cell.split(" ")[0].isdigit() for cell in row[3:7]), row  # MB/s (and the p50) of each subject
    assert row[7] == row[8] == "n/a" and float(row[9].rstrip(" |")) > 0
    cpu_row = cpu_lines[2].split(" | ")
    assert cpu_row[0] == "| get 256 KiB, c1" and cpu_row[1] == cpu_row[2] == "n/a" and cpu_row[-3] == "n/a"
    assert all(float(cell) > 0 for cell in cpu_row[3:7]) and cpu_row[-2].endswith("x")
    # the same-run floor: the mTLS socket's CPU + one SHA-256 pass (the GET's Repr-Digest; the PUT's layer digests)
    for line, op in zip(cpu_lines[2:4], ops, strict=True):
        cells = line.split(" | ")
        floor, passes = cells[7].split(" ", 1)
        assert passes == "(1 pass)" and float(floor) == pytest.approx(floor_ms(float(cells[6]), sha_ms[NAME], 1),
                                                                       abs=0.02), cells
        ours = min(float(cells[3]), float(cells[4]))
        # the cells are rounded to 0.01 ms: the ratio of the rounded figures agrees within a few per cent
        assert float(cells[-1].rstrip("x |")) == pytest.approx(ours / float(floor), rel=0.05), (op, cells)
    assert len(started) == 2 and all(proc.poll() is not None for proc in started)  # both stopped
