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


_LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}


def test_every_event_is_named_by_a_constant() -> None:
    """A log call in zkv or launch names its event with a constant of ``zkv.log`` (or
    ``zkv.integrations.vllm.events``), never a string: one spelling for the code, its
    tests and ``zkv logs --event`` (a review found 20 names written out in place, one of
    them used by two components at two levels). And every declared name is used."""
    import ast

    from zkv import log
    from zkv.integrations.vllm import events

    literal = []
    used: set[str] = set()
    for path in sorted([*ROOT.glob("zkv/**/*.py"), *ROOT.glob("launch/**/*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Name):
                used.add(node.id)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _LOG_METHODS and node.args):
                continue
            first = node.args[0]
            if (isinstance(first, ast.Constant) and isinstance(first.value, str)
                    and "." in first.value and " " not in first.value):
                literal.append(f"{path.relative_to(ROOT)}:{node.lineno}: {first.value}")
    assert not literal, "\n".join(literal)
    names = {k for m in (log, events) for k, v in vars(m).items()
             if k.isupper() and isinstance(v, str) and "." in v and " " not in v}
    assert names - used == set(), sorted(names - used)
