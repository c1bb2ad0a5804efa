"""The scheduler's compiled core (mypyc, ``zkv.scheduler.NATIVE``): it is what runs after
the install, it does exactly what its typed source does (the reference and the fallback),
and a source changed since the build runs as written, not as it was compiled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import zkv.scheduler as sched

ROOT = Path(__file__).resolve().parents[2]


def _child(seed: int, *, pure: bool, pythonpath: Path = ROOT) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    env.pop("ZKV_PURE_PYTHON", None)
    if pure:
        env["ZKV_PURE_PYTHON"] = "1"
    r = subprocess.run([sys.executable, "-m", "tests.scheduler.agree_child", str(seed)],
                       cwd=pythonpath, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_the_compiled_core_runs_after_the_install() -> None:
    """install.sh builds it (and refuses to finish without it); the benches and every
    other test here then measure and check the compiled modules, not the source."""
    assert sched.native_core() is None, sched.native_core()
    for name in sched.NATIVE:
        mod = sys.modules.get(f"zkv.scheduler.{name}") or __import__(
            f"zkv.scheduler.{name}", fromlist=["_"])
        assert not (mod.__file__ or "").endswith(".py"), f"{name} runs from {mod.__file__}"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_compiled_and_source_do_the_same(seed: int) -> None:
    """A seeded workload over both modes of the cache manager (host tier, L3 writes and
    loads, failed and late acks, external-L1 saves and loads) gives the same ops, matches,
    tables and stats, op for op, compiled and from source."""
    compiled = _child(seed, pure=False)
    source = _child(seed, pure=True)
    assert compiled["native"] is None and sorted(sched.NATIVE) == compiled["compiled"]
    assert source["native"] == "ZKV_PURE_PYTHON is set" and source["compiled"] == []
    assert compiled["events"] == source["events"] and int(source["events"]) > 10_000  # type: ignore[call-overload]
    assert compiled["digest"] == source["digest"]


def test_a_source_changed_since_the_build_runs_as_written(tmp_path: Path) -> None:
    """An edit to a compiled module without a rebuild: every core module runs from its
    source (compiled ones call each other directly: all or none), and ``native_core()``
    says which one changed and how to rebuild."""
    shutil.copytree(ROOT / "zkv", tmp_path / "zkv",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", tmp_path / "tests",
                    ignore=shutil.ignore_patterns("__pycache__", "data"))
    radix = tmp_path / "zkv" / "scheduler" / "radix.py"
    radix.write_text(radix.read_text() + "\n# edited after the build\n")
    out = _child(1, pure=False, pythonpath=tmp_path)
    assert out["compiled"] == []
    assert "radix" in str(out["native"]) and "pip install -e ." in str(out["native"])
    assert out["digest"] == _child(1, pure=True)["digest"]
