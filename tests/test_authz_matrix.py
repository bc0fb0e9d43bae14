"""The authorization matrix (issue 13 point 3, docs/security.md "Authorization matrix"): every route of every role
app x every kind of principal x HTTP/1.1, HTTP/2 and HTTP/3, and MOQT SUBSCRIBE_NAMESPACE / FETCH at the relay, the
holder and the instance, against real ``kvsp-quic`` server processes (``--dev DIR --policy FILE``). The expected
answers come from the rules (:mod:`tests.authz_matrix`); any unauthorized success fails, and so does a refusal of a
request the rules allow. ``python -m tests.authz_matrix`` prints the table."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvsp_http.holder_app import holder_routes
from kvsp_http.index_app import index_routes
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.roles.index import IndexService
from kvsp_quic.samples import example_descriptor
from kvsp_quic.storage.memory_index import MemoryIndexStore
from tests.authz_matrix import (
    APPS,
    KINDS,
    TRANSPORTS,
    Cell,
    Principals,
    app_rules,
    frontend_routes,
    make_principals,
    markdown,
    model_dir,
    probes,
    run_all,
    servers,
)
from tests.authz_matrix_moqt import DRAFTS, MOQT_KINDS, MoqtCell, moqt_markdown

pytest.importorskip("torch", reason="the instance and the front end need the gpu extra (torch)")

Matrix = tuple[Principals, list[Cell], list[MoqtCell]]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    """Every role's server started once (in parallel), every cell requested (all servers at once), the servers
    stopped; the tests below judge the cells."""
    root = tmp_path_factory.mktemp("authz-matrix")
    principals = make_principals(root / "dev")
    with servers(APPS, principals, model_dir(root)) as ready:
        cells, moqt = asyncio.run(run_all(ready, principals))
    print(markdown(cells))
    print(moqt_markdown(moqt))
    return principals, cells, moqt


@pytest.mark.parametrize("app", APPS)
def test_no_unauthorized_success(matrix: Matrix, app: str) -> None:
    principals, all_cells, _ = matrix
    cells = [c for c in all_cells if c.probe.app == app]
    assert len(cells) == len(probes(app, principals, bytes(32))) * len(KINDS) * len(TRANSPORTS)
    bad = [c.describe() for c in cells if c.unauthorized_success]
    assert not bad, f"{len(bad)} unauthorized successes:\n" + "\n".join(bad)
    wrong = [c.describe() for c in cells if c.wrongly_refused]
    assert not wrong, f"{len(wrong)} refusals of requests the rules allow:\n" + "\n".join(wrong)
    # every kind of principal and every transport took part, and the matrix saw both answers
    assert {c.kind for c in cells} == set(KINDS) and {c.transport for c in cells} == set(TRANSPORTS)
    assert any(c.expected for c in cells) and any(not c.expected for c in cells)


def test_moqt_no_unauthorized_success(matrix: Matrix) -> None:
    _, _, cells = matrix
    bad = [c.describe() for c in cells if c.unauthorized_success]
    assert not bad, f"{len(bad)} unauthorized successes:\n" + "\n".join(bad)
    wrong = [c.describe() for c in cells if not c.ok]
    assert not wrong, f"{len(wrong)} refusals of requests the rules allow:\n" + "\n".join(wrong)
    assert {c.server for c in cells} == {"relay", "holder", "instance"}
    assert {c.kind for c in cells} == set(MOQT_KINDS) and {c.alpn for c in cells} == set(DRAFTS)
    assert any(c.expected for c in cells) and any(not c.expected for c in cells)


def _covered(app: str, routes: list[tuple[str, str]]) -> list[tuple[str, str]]:
    rules = app_rules(app)
    return [(m, p) for m, p in routes if not any(r.match(m, p) is not None for r in rules)]


def test_the_rules_cover_every_route_of_the_apps(tmp_path: Path) -> None:
    """The matrix probes the rules; a route without a rule is refused by default (404), so the rules must name
    every route the apps serve, or the matrix would miss that route (and the route would be unreachable)."""

    def table(routes: Any) -> list[tuple[str, str]]:
        return [(m, r.path.removeprefix("/")) for r in routes for m in sorted(r.methods or ()) if m != "HEAD"]

    holder = Holder(HolderSettings("https://127.0.0.1:9/", (example_descriptor(),)))
    index = IndexService(MemoryIndexStore(), clock=lambda: 0.0)
    assert _covered("holder", table(holder_routes(holder).routes)) == []
    assert _covered("index", table(index_routes(index))) == []
    routes = frontend_routes(make_principals(tmp_path / "dev").files["client"])  # type: ignore[arg-type]
    assert ("POST", "v1/completions") in routes and ("GET", "health") in routes


def test_the_matrix_has_both_scope_variants_for_scope_bound_routes(tmp_path: Path) -> None:
    principals = make_principals(tmp_path / "dev")
    for app in ("holder", "index", "instance"):
        variants = {(p.rule.method, p.rule.path, p.variant) for p in probes(app, principals, b"\0" * 32)}
        scoped = {(m, path) for m, path, v in variants if "scope" in v}
        assert scoped, app
        for method, path in scoped:
            assert {v for m, p, v in variants if (m, p) == (method, path)} >= {"in scope", "out of scope"} or \
                any("own holder" in v for m, p, v in variants if (m, p) == (method, path))
