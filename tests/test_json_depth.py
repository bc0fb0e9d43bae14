"""Issue 13: JSON nested deeper than ``kvsp_quic.fields.MAX_JSON_DEPTH`` is a 400 problem, never a
``RecursionError`` (500). Every KVSP role app parses request bodies with ``fields.loads_object``; a real Index
Service (``index_app`` behind a RoleServer, mutual TLS, 127.0.0.1) gets the deep bodies here, over HTTP/3 and
HTTP/1.1. The front end's parse (``frontend_app.read_json_object``) is tested in tests/test_frontend_limits.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsp_quic import fields as f
from kvsp_quic.fields import MAX_JSON_DEPTH, RecordError
from tests.support.index import C1, S1, bk
from tests.support.index_app import problem, serve


def test_depth_is_checked_before_parsing() -> None:
    assert f.loads_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    for deep in ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "[" * 200_000, '{"a":' * 5000):
        with pytest.raises(RecordError, match=f"more than {MAX_JSON_DEPTH} arrays or objects deep"):
            f.loads_json(deep)
    # brackets inside strings do not count; escaped quotes do not end a string
    text = json.dumps({"s": "[" * 1000 + '\\"{' * 500, "n": [[[1]]]})
    assert f.loads_object(text)["n"] == [[[1]]]


@pytest.mark.parametrize("h3", [True, False])
async def test_a_deeply_nested_lookup_is_a_400(pki_dir: Path, h3: bool) -> None:
    async with serve(pki_dir, h3=h3) as h:
        nested = {"scope_id": S1.hex(), "compat_id": C1.hex(), "block_keys": [bk(0).hex()]}
        raw = json.dumps(nested).encode()[:-1] + b', "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
        response = await h.call("alice", "POST", "lookup", raw=raw)
        assert response.status == 400, response.content
        assert f"{MAX_JSON_DEPTH} arrays or objects deep" in problem(response).detail
        fine = await h.call("alice", "POST", "lookup", nested)
        assert fine.status == 200


def test_a_deeply_nested_problem_body_from_a_peer_is_the_generic_problem() -> None:
    from kvsp_quic.problems import problem_from_json

    problem_ = problem_from_json(503, b'{"detail": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    assert problem_.status == 503 and problem_.detail == ""
