"""The README's references to tests stay true: every ``tests/FILE.py::test_name`` it cites
(and every ``::test_name`` after it, which names a test of the same file) is a test
defined in that file, and every file it cites exists. A review found five that pointed at
the wrong file or at a renamed test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_REF = re.compile(r"`(tests/[\w/]+\.py)?(?:::(\w+))?(?:\[[^\]`]*\])?`")


def _references() -> list[tuple[int, str, str | None]]:
    """(README line, file, test name or None) of each backticked reference; a bare
    ``::name`` takes the last file named on its line."""
    out = []
    for lineno, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        last: str | None = None
        for m in _REF.finditer(line):
            path, name = m.group(1), m.group(2)
            if path is None and name is None:
                continue
            if path is not None:
                last = path
            elif last is None:
                continue  # a `::name` without a file before it on its line: not a test ref
            out.append((lineno, path or last, name))  # type: ignore[arg-type]
    return out


def test_every_test_the_readme_cites_exists_where_it_says() -> None:
    refs = _references()
    assert len(refs) > 100  # the parser found the fault matrix
    bad = []
    for lineno, path, name in refs:
        file = ROOT / path
        if not file.is_file():
            bad.append(f"README.md:{lineno}: {path}: no such file")
        elif name is not None and not re.search(rf"^\s*(async )?def {name}\(",
                                                 file.read_text(), re.M):
            bad.append(f"README.md:{lineno}: {path}::{name}: no such test")
    assert not bad, "\n".join(bad)
