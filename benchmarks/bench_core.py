"""Benchmarks of the protocol core, each against a baseline measured in the same run.

    python -m benchmarks.bench_core            # all, prints a Markdown table
    python -m benchmarks.bench_core --quick    # fewer repetitions

Runs alternate subject and baseline and report medians, because the machine is noisy; the ratio is what counts.
"""

from __future__ import annotations

import _hashlib  # the C HMAC object: the fastest "bare" HMAC the standard library offers
import argparse
import hashlib
import os
import platform
import statistics
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.timing import compare, timed
from kvsp_quic import container as c
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.keys import BLOCK_LABEL, BlockKeyer

DESCRIPTOR_16MIB = CompatDescriptor(  # 32 layers x (K + V) of 16 tokens x 8 heads x 128 x bf16 = 16 MiB
    model="bench", model_digest="sha-256:" + "0" * 64, tokenizer_digest="sha-256:" + "0" * 64, layers=32,
    kv_heads=8, head_dim=128, kv_dtype="bf16", positional="rope", block_tokens=256)




def bench_block_keys(reps: int) -> list[tuple[str, str, str, float]]:
    n_tokens, block = 131072, 16
    key, compat = os.urandom(32), os.urandom(32)
    tokens = [int(x) for x in np.random.default_rng(0).integers(0, 128256, n_tokens)]
    tokens_np = np.array(tokens, dtype=np.int64)
    packed = struct.pack(f">{n_tokens}I", *tokens)
    # Baseline: the bare loop -- one pre-keyed C HMAC copied per block over messages built beforehand.
    step = 4 * block
    messages = [BLOCK_LABEL + compat + os.urandom(32) + packed[i:i + step] for i in range(0, len(packed), step)]
    base_hmac = _hashlib.hmac_new(key, digestmod="sha256")

    def baseline() -> None:
        for m in messages:
            h = base_hmac.copy()
            h.update(m)
            h.digest()

    keyer = BlockKeyer(key, compat, block)
    rows = []
    for label, toks in (("list of int", tokens), ("int64 ndarray", tokens_np)):
        s, b = compare(lambda toks=toks: keyer.keys(toks), baseline, reps)
        rows.append((f"Block Keys, B=16, 131072 tokens ({label})", f"{n_tokens / s / 1e6:.2f} M tokens/s",
                     f"{n_tokens / b / 1e6:.2f} M tokens/s (bare pre-keyed HMAC loop)", b / s))
    return rows


def bench_encode(reps: int) -> list[tuple[str, str, str, float]]:
    d = DESCRIPTOR_16MIB
    n = d.section_length(d.block_tokens)
    arena = np.random.default_rng(1).integers(0, 256, 2 * n * d.layers, dtype=np.uint8)
    sections = [(arena[(2 * i) * n:(2 * i + 1) * n], arena[(2 * i + 1) * n:(2 * i + 2) * n]) for i in range(d.layers)]
    total = arena.nbytes

    def baseline() -> None:
        hashlib.sha256(arena).digest()

    rows = []
    s, b = compare(lambda: c.encode(sections, first_layer=0, token_count=d.block_tokens, descriptor=d), baseline, reps)
    rows.append(("encode + layer digests, 32 layers, 16 MiB", f"{total / s / 1e6:.0f} MB/s",
                 f"{total / b / 1e6:.0f} MB/s (hashlib.sha256 over the same bytes)", b / s))
    with ThreadPoolExecutor(2) as pool:
        s, b = compare(lambda: c.encode(sections, first_layer=0, token_count=d.block_tokens, descriptor=d,
                                        executor=pool), baseline, reps)
    rows.append(("same, digests on a 2-thread executor", f"{total / s / 1e6:.0f} MB/s",
                 f"{total / b / 1e6:.0f} MB/s (hashlib.sha256, one thread)", b / s))
    return rows


def bench_decode(reps: int) -> list[tuple[str, str, str, float]]:
    d = DESCRIPTOR_16MIB
    n = d.section_length(d.block_tokens)
    rng = np.random.default_rng(2)
    sections = [(rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, n, dtype=np.uint8))
                for _ in range(d.layers)]
    enc = c.encode(sections, first_layer=0, token_count=d.block_tokens, descriptor=d)
    blob = enc.tobytes()
    chunk = 64 * 1024
    chunks = [blob[i:i + chunk] for i in range(0, len(blob), chunk)]  # as a transport hands them over
    expected = enc.layer_digests
    data_len = enc.header.data_length
    warm = bytearray(data_len)  # a reused receive buffer (a pool in a real server)

    def baseline() -> None:
        hashlib.sha256(blob).digest()

    def decode(**kw: object) -> None:
        dec = c.ContainerDecoder(d, expected_layer_digests=expected, **kw)  # type: ignore[arg-type]
        layers = 0
        for piece in chunks:
            layers += len(dec.feed(piece))
        dec.finish()
        assert layers == d.layers

    def receive_into() -> None:
        dec = c.ContainerDecoder(d, expected_layer_digests=expected, allocate=lambda _n: warm)
        src = memoryview(blob)
        while len(src):
            buf = dec.get_buffer()
            k = min(len(buf), chunk, len(src))
            buf[:k] = src[:k]  # stands in for sock.recv_into(buf)
            src = src[k:]
            dec.buffer_updated(k)
        dec.finish()

    rows = []
    mb = len(blob) / 1e6
    cases = [
        ("incremental decode + verify, 64 KiB chunks, zero-copy segments", lambda: decode(assemble=False)),
        ("same, assembled into a warm buffer (one copy)", lambda: decode(allocate=lambda _n: warm)),
        ("same, received straight into the warm buffer (get_buffer; the copy is the recv)", receive_into),
        ("same, assembled into a fresh bytearray (first-touch)", lambda: decode()),
    ]
    for name, fn in cases:
        s, b = compare(fn, baseline, reps)
        rows.append((name, f"{mb / s:.0f} MB/s", f"{mb / b:.0f} MB/s (hashlib.sha256 over the same bytes)", b / s))
    return rows


def bench_cut(reps: int) -> list[tuple[str, str, str, float]]:
    blobs = []
    for tokens in (16, 256, 4096):  # 2 MiB, 32 MiB, 512 MiB containers of 32 layers
        n = DESCRIPTOR_16MIB.section_length(tokens)
        blob = memoryview(bytearray(c.FIXED_HEADER.size + 16 * 32 + 2 * n * 32))
        header = c.ContainerHeader(codec=1, first_layer=0, token_count=tokens, lengths=((n, n),) * 32).pack()
        blob[:len(header)] = header
        blobs.append(blob)
    samples: list[list[float]] = [[] for _ in blobs]
    for _ in range(reps * 50):  # interleaved, so drift in the machine's speed hits every size alike
        for i, blob in enumerate(blobs):
            samples[i].append(timed(lambda blob=blob: c.cut(blob, 8, 15)))
    times = [statistics.median(x) for x in samples]
    return [(f"layer-range cut (layers 8-15) of a {len(blob) / 2**20:.0f} MiB container", f"{t * 1e6:.1f} us",
             f"{times[0] * 1e6:.1f} us (the 2 MiB container)", times[0] / t)
            for blob, t in zip(blobs, times, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    reps = 5 if args.quick else 15
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}\n")
    print("| benchmark | ours | baseline (same run) | ratio ours/baseline speed |")
    print("|---|---|---|---|")
    for bench in (bench_block_keys, bench_encode, bench_decode, bench_cut):
        for name, ours, base, ratio in bench(reps):
            print(f"| {name} | {ours} | {base} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
