"""Timing helpers every benchmark shares: subject and baseline run alternately, medians reported."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compare(subject: Callable[[], object], baseline: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median seconds of *subject* and *baseline*, run alternately after one warm-up each (the machine drifts)."""
    subject(), baseline()
    s, b = [], []
    for _ in range(reps):
        s.append(timed(subject))
        b.append(timed(baseline))
    return statistics.median(s), statistics.median(b)


async def acompare(subject: Callable[[], Awaitable[object]], baseline: Callable[[], Awaitable[object]],
                   reps: int) -> tuple[float, float]:
    """:func:`compare` for coroutines."""
    await subject()
    await baseline()
    s, b = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        await subject()
        s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await baseline()
        b.append(time.perf_counter() - t0)
    return statistics.median(s), statistics.median(b)
