from __future__ import annotations

import json

import pytest

from kvsp_quic import problems as p

SPEC_TABLE = [
    ("kvsp-not-found", 404, p.NotFound),
    ("kvsp-scope-denied", 403, p.ScopeDenied),
    ("kvsp-incompatible", 409, p.Incompatible),
    ("kvsp-lease-quota", 429, p.LeaseQuota),
    ("kvsp-stale-epoch", 409, p.StaleEpoch),
    ("kvsp-invalid-state", 409, p.InvalidState),
    ("kvsp-digest-mismatch", 422, p.DigestMismatch),
    ("kvsp-plan-conflict", 409, p.PlanConflict),
    ("kvsp-layers-unavailable", 404, p.LayersUnavailable),
]


@pytest.mark.parametrize(("suffix", "status", "cls"), SPEC_TABLE, ids=[s for s, _, _ in SPEC_TABLE])
def test_each_spec_problem_type_round_trips(suffix: str, status: int, cls: type[p.Problem]) -> None:
    exc = cls("details here")
    assert exc.status == status
    assert exc.type_uri == "https://iana.org/assignments/kvsp#" + suffix
    code, body = p.to_problem_json(exc)
    doc = json.loads(body)
    assert code == status
    assert doc == {"type": exc.type_uri, "title": exc.title, "status": status, "detail": "details here"}
    back = p.problem_from_json(code, body)
    assert type(back) is cls and back.detail == "details here" and back.status == status


def test_the_registry_is_exactly_the_spec_table() -> None:
    assert {s: c.status for s, c in p.KVSP_PROBLEMS.items()} == {s: st for s, st, _ in SPEC_TABLE}


def test_generic_problems_use_about_blank() -> None:
    exc = p.BadRequest("ttl_ms: must be >= 1")
    assert exc.to_json() == {"type": "about:blank", "title": "Bad Request", "status": 400,
                             "detail": "ttl_ms: must be >= 1"}
    assert type(p.problem_from_json(400, json.dumps(exc.to_json()))) is p.BadRequest
    assert type(p.problem_from_json(403, {"type": "about:blank"})) is p.Forbidden
    odd = p.problem_from_json(418, {"type": "about:blank", "title": "I'm a teapot"})
    assert odd.status == 418 and odd.type_uri == "about:blank"


def test_foreign_types_and_garbage_are_kept_not_lost() -> None:
    other = p.problem_from_json(409, {"type": "https://example.com/probs/out-of-credit", "detail": "x"})
    assert other.type_uri == "https://example.com/probs/out-of-credit" and other.status == 409
    assert p.problem_from_json(502, b"<html>bad gateway</html>").status == 502
    assert p.problem_from_json(500, b"[1]").type_uri == "about:blank"
    # A KVSP type sent with an unexpected status keeps the class and the status actually received.
    odd = p.problem_from_json(400, {"type": "https://iana.org/assignments/kvsp#kvsp-not-found"})
    assert isinstance(odd, p.NotFound) and odd.status == 400


def test_str_is_one_line() -> None:
    assert str(p.LeaseQuota("over 1 GiB")) == "Lease quota exceeded: over 1 GiB"
    assert str(p.NotFound()) == "Block, lease, session, or directive unknown"
