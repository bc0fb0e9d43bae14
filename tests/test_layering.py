"""The layering contracts of pyproject.toml's ``[tool.importlinter]`` hold: ``lint-imports`` passes.

CI runs ``lint-imports`` in the README's test command; this test makes the suite fail too, with the offending
imports in its message, when a module reaches a layer it must not (or an import cycle appears).
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
