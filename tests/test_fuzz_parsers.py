"""Fuzzing every parser that reads peer input (issue 13, point 4): only typed errors, and round-trip equality where
an encoder exists. tests/fuzz_targets.py holds the table of targets, tests/fuzz_mutate.py the mutation generator.

Three runs:

- ``test_hypothesis``: per target, a bounded property-based run (CI): inputs hypothesis draws -- arbitrary octets or
  text, and valid encodings mutated by a seed it chooses (and shrinks).
- ``test_mutations``: per target, the structure-aware mutation generator; 400 inputs per target in CI.
- ``test_million``: slow-marked; in CI 300 inputs per target (the runner and its table). ``KVSP_SLOW=1`` runs
  ``KVSP_FUZZ_INPUTS`` (default 1,000,000) inputs per target, stopping a target early only when
  ``KVSP_FUZZ_SECONDS`` (per target; default: none) runs out, and prints per target the inputs, the distinct typed
  errors (or outcomes) seen and the seconds (the table in docs/security.md).
  ``KVSP_FUZZ_TARGETS`` (comma-separated names, or prefixes ending in ``*``: ``json:*``) selects targets;
  ``KVSP_FUZZ_SEED`` the seed (2026 by default).

Below them, the regression tests of what the fuzzing found, each with its minimized input.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass, field

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp_frontend.params import completion_params
from kvsp_quic import fields as f
from kvsp_quic import records as r
from kvsp_quic.roles import controller_records as cr
from tests.fuzz_mutate import Mutator
from tests.fuzz_targets import (
    BY_NAME,
    LIMITS,
    REPLICA,
    SAMPLER,
    SESSION_REQUEST,
    TARGETS,
    ByteTokens,
    FuzzFailure,
    Target,
    check,
)

FULL = os.environ.get("KVSP_SLOW") == "1"
IDS = [t.name for t in TARGETS]


# -- Bounded runs (CI) -------------------------------------------------------------------------------------------


def _drawn(target: Target) -> st.SearchStrategy[object]:
    if target.kind == "toml":
        raw: st.SearchStrategy[object] = st.text(max_size=200)
    else:
        raw = st.binary(max_size=200)
    mutated = st.integers(0, 2**32 - 1).map(lambda seed: Mutator(target.seeds, seed, kind=target.kind).next())
    return st.one_of(st.sampled_from(target.seeds), raw, mutated)


@pytest.mark.parametrize("name", IDS)
def test_hypothesis(name: str) -> None:
    target = BY_NAME[name]

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_drawn(target))
    def run(data: object) -> None:
        check(target, data)

    run()


@pytest.mark.parametrize("name", IDS)
def test_seeds_are_valid(name: str) -> None:
    """Every seed parses (a seed that is refused would make the mutations explore only the error paths)."""
    target = BY_NAME[name]
    outcomes = [check(target, s) for s in target.seeds]
    if target.label is not None:  # parsers that never raise: a named outcome, but not a closed connection
        assert not [o for o in outcomes if o is not None and o.startswith("close:")]
    else:
        assert outcomes == [None] * len(target.seeds)


@dataclass
class Run:
    target: str
    inputs: int = 0
    seconds: float = 0.0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)

    def row(self) -> str:
        kinds = ", ".join(sorted(self.errors)) or "-"
        result = "ok" if not self.failures else f"{len(self.failures)} FAILED"
        return f"| {self.target} | {self.inputs:,} | {kinds} | {self.seconds:.0f} | {result} |"


def run_mutations(target: Target, count: int, *, seed: int = 0, seconds: float | None = None) -> Run:
    """*count* mutated inputs (fewer if *seconds* run out first); failures are collected, at most 5 kept."""
    mutator = Mutator(target.seeds, seed, kind=target.kind)
    run = Run(target.name)
    errors: dict[str | None, int] = collections.defaultdict(int)
    start = time.perf_counter()
    deadline = start + seconds if seconds is not None else None
    done = 0
    while done < count:
        for _ in range(min(1000, count - done)):
            data = mutator.next()
            try:
                errors[check(target, data)] += 1
            except FuzzFailure as exc:
                if len(run.failures) < 5:
                    run.failures.append(str(exc))
                errors["FAILED"] += 1
            done += 1
        if deadline is not None and time.perf_counter() > deadline:
            break
    run.inputs = done
    run.seconds = time.perf_counter() - start
    run.errors.update({k: v for k, v in errors.items() if k is not None and k != "FAILED"})
    return run


@pytest.mark.parametrize("name", IDS)
def test_mutations(name: str) -> None:
    run = run_mutations(BY_NAME[name], 400, seed=1)
    assert run.failures == [], "\n".join(run.failures)
    assert run.errors, "no mutated input was refused (or, for parsers that never raise, ended the connection or " \
                       "changed the problem type): the mutations do not reach the parser's checks"


@pytest.mark.slow
def test_million(capsys: pytest.CaptureFixture[str]) -> None:
    count = int(os.environ.get("KVSP_FUZZ_INPUTS", "1000000" if FULL else "300"))
    budget = os.environ.get("KVSP_FUZZ_SECONDS")
    wanted = [w for w in os.environ.get("KVSP_FUZZ_TARGETS", "").split(",") if w]
    seed = int(os.environ.get("KVSP_FUZZ_SEED", "2026"))
    targets = [t for t in TARGETS
               if not wanted or any(t.name == w or (w.endswith("*") and t.name.startswith(w[:-1])) for w in wanted)]
    runs = []
    for target in targets:
        run = run_mutations(target, count, seed=seed, seconds=float(budget) if budget else None)
        runs.append(run)
        with capsys.disabled():
            print(run.row(), flush=True)
    failures = [msg for run in runs for msg in run.failures]
    assert failures == [], "\n".join(failures)


# -- What the fuzzing found --------------------------------------------------------------------------------------


def test_integers_beyond_64_bits_are_refused() -> None:
    """Python's parser reads any integer; a replica record with one was accepted and then failed to be written back
    (orjson: "Integer exceeds 64-bit range"): the Index Service answered 500 to every lookup that matched it."""
    body = orjson.dumps({**REPLICA, "size": 1}).replace(b'"size":1', b'"size":18446744073709551616')
    with pytest.raises(f.RecordError, match="out of range"):
        r.ReplicaRecord.loads(body)
    ok = r.ReplicaRecord.loads(orjson.dumps({**REPLICA, "size": 2**64 - 1}))
    assert r.ReplicaRecord.loads(ok.to_json_bytes()) == ok
    with pytest.raises(f.RecordError, match="out of range"):
        f.loads_json(b"-9223372036854775809")
    with pytest.raises(f.RecordError, match="out of range"):
        f.loads_json(b"[" + b"9" * 5000 + b"]")


def test_numbers_beyond_float_range_are_refused() -> None:
    """``1e400`` parsed as infinity: a sampler's params kept it, and it was written back as null. A front-end
    body with ``"repetition_penalty": 1e400`` written as an integer raised OverflowError (a 500)."""
    body = orjson.dumps({**SESSION_REQUEST, "sampler": {**SAMPLER, "params": {"p": 0.5}}})
    with pytest.raises(f.RecordError, match="out of range"):
        cr.SessionRequest.loads(body.replace(b'"p":0.5', b'"p":1e400'))
    big = b'{"model":"tiny","prompt":"hi","repetition_penalty":1' + b"0" * 400 + b"}"
    with pytest.raises(f.RecordError, match="out of range"):
        completion_params(f.loads_json(big), ByteTokens(), LIMITS)


@pytest.mark.parametrize("body", [b'{"epoch":3,"reason":"\\ud800"}', b'{"epoch":3,"reason":"\\udc00\\ud800"}',
                                  b'{"epoch":3,"reason":"\xed\xa0\x80"}', b'{"epoch":3,"reason":"\\\\\\ud800"}'])
def test_lone_surrogates_are_refused(body: bytes) -> None:
    """A string with a lone surrogate (escaped, or as raw octets, which Python's parser decodes with
    ``surrogatepass``) was accepted; no UTF-8 encoder writes it back, so the record could not be sent on."""
    with pytest.raises(f.RecordError, match=r"surrogate|not UTF-8"):
        cr.SuspectReport.loads(body)


@pytest.mark.parametrize(("body", "reason"), [(b'{"epoch":3,"reason":"\\ud83d\\ude00"}', "\U0001f600"),
                                              (b'{"epoch":3,"reason":"\\\\ud800"}', "\\ud800"),
                                              (b'\xef\xbb\xbf{"epoch":3,"reason":"\xc3\xa9"}', "é")])
def test_valid_unicode_still_parses(body: bytes, reason: str) -> None:
    report = cr.SuspectReport.loads(body)
    assert report.reason == reason
    assert cr.SuspectReport.loads(orjson.dumps(report.to_json())) == report
