"""The layering contracts of pyproject.toml's ``[tool.importlinter]`` hold: ``lint-imports`` passes.

CI runs ``lint-imports`` in the README's test command; this test makes the suite fail too, with the offending
imports in its message, when a module reaches a layer it must not (or an import cycle appears). The tests have a
rule of their own: no test module imports another (what they share is in tests/support/ and tests/conftest.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _lint_imports() -> str | None:
    """The ``lint-imports`` beside this interpreter (the project's venv), else the one on PATH, else None."""
    beside = Path(sys.executable).parent / "lint-imports"
    return str(beside) if beside.exists() else shutil.which("lint-imports")


@pytest.mark.skipif(_lint_imports() is None, reason="lint-imports is not installed (pip install -e '.[test]')")
def test_layering_contracts_are_kept() -> None:
    command = _lint_imports()
    assert command is not None
    # --no-cache: the suite leaves no .import_linter_cache behind; the whole graph takes well under a second.
    done = subprocess.run([command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"lint-imports: a layering contract is broken\n{done.stdout}\n{done.stderr}"
    assert ", 0 broken." in done.stdout  # "Contracts: N kept, 0 broken."


def test_no_contract_needs_an_exception() -> None:
    """Issue 25: the composition root is on top, so no contract lists imports it lets through."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert len(contracts) >= 10
    assert [c["name"] for c in contracts if c.get("ignore_imports")] == []
    packaged = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name not in {"tests", "benchmarks"}}
    assert roots <= packaged, f"packages missing from [tool.setuptools] packages: {sorted(roots - packaged)}"


TESTS = ROOT / "tests"


def _test_modules_imported(source: str, package: str = "tests") -> list[str]:
    """The test modules (``tests.test_*``) and ``tests.conftest`` that *source*, a module of *package*, imports, as
    ``line: module``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import test_x, from .test_x import y, from .. import conftest
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *([base] if base else [])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tests" and len(parts) > 1 and (parts[1].startswith("test_") or parts[1] == "conftest"):
                found.append(f"{node.lineno}: {'.'.join(parts[:2])}")
                break
    return found


def test_the_import_check_sees_every_form() -> None:
    t, c = "test_index", "conftest"  # spelled apart, so that a grep for such imports finds none in this file
    forms = [f"from tests.{t} import C1", f"import tests.{t}", f"import tests.{t} as ti", f"from tests import {t}",
             f"from tests import {c}", f"from tests.{c} import x", f"from .{t} import C1", f"from . import {t}",
             f"def f():\n    from tests.{t} import y"]
    for form in forms:
        assert _test_modules_imported(form), form
    assert _test_modules_imported(f"from .. import {t}", "tests.support")
    fine = ["from tests.support.index import C1", "from tests import vectors", "from tests.pki import make_pki",
            "import tests.helpers", "from . import helpers", "from .support import index", "import test_x"]
    for form in fine:
        assert not _test_modules_imported(form), form


def test_no_test_module_imports_another() -> None:
    """Issue 25: what test modules share lives in support modules (tests/support/, tests/helpers.py, tests/pki.py,
    ...) and the fixtures they share in tests/conftest.py, found by name: no module under tests/ imports a test
    module (nor tests.conftest), so each test module can be read, moved or deleted on its own."""
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        package = ".".join(path.relative_to(ROOT).parent.parts)  # tests, tests.support
        if found := _test_modules_imported(path.read_text(), package):
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}, "modules under tests/ import test modules (move what they share to tests/support/):\n" + \
        "\n".join(f"  {path}: {', '.join(found)}" for path, found in offenders.items())
