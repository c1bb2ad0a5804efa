"""Static checks CI holds the tree to. mypy: zkv and launch type-check clean
(``[tool.mypy]`` in pyproject.toml; the C extensions have stubs beside them,
``_chainhash.pyi`` and ``_blockcopy.pyi``, so their callers are checked too). ruff: no
unused imports or names, no undefined names, imports in order, no line past 100 columns,
everywhere (``[tool.ruff.lint]``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_mypy_finds_nothing_in_zkv_and_launch() -> None:
    r = _run("mypy", "zkv", "launch")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert r.stdout.startswith("Success: no issues found"), r.stdout


def test_ruff_finds_nothing() -> None:
    r = _run("ruff", "check", "--no-cache", "zkv", "launch", "tests", "bench")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert r.stdout.strip() == "All checks passed!", r.stdout
