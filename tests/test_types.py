"""zkv and launch type-check clean under mypy (``[tool.mypy]`` in pyproject.toml). The C
extensions have stubs beside them (``_chainhash.pyi``, ``_blockcopy.pyi``), so their
callers are checked too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_nothing_in_zkv_and_launch() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "zkv", "launch"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert r.stdout.startswith("Success: no issues found"), r.stdout
