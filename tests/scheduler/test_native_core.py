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

import numpy as np
import pytest

import zkv.scheduler as sched
from zkv.protocol import OpResult
from zkv.scheduler.eviction import LRU
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import CacheConfig, CacheManager

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
    if os.environ.get("ZKV_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("ZKV_PURE_PYTHON is set: the source runs, as asked (never in CI)")
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


# ---------------------------------------------------------------- what callers pass
# (a review compared every public call compiled and from source: the compiled core checks
# exact types deep inside, where the source took any int, any sequence, any truthy value)


def _replay(cm: CacheManager, n: int = 30) -> None:
    for i in range(n):
        rid = f"r{i}"
        cm.match_prefix(rid, hash_ids_chain([i % 3, 9, i % 5]))
        table = cm.allocate(rid, 3 * 4)
        ack_all(cm)
        if table is None:
            cm.abort(rid)
        else:
            cm.finish(rid)
        ack_all(cm)
        cm.check_invariants()


def ack_all(cm: CacheManager) -> None:
    cm.on_ops_done([OpResult(o.id, True, o.num_blocks) for o in cm.take_ops()],
                   seq=np.int64(1))  # (any integer type)


def test_a_config_of_numpy_numbers_is_plain_and_serves() -> None:
    """numpy ints and bools (an engine's config often has them) become plain ints, floats
    and a bool at construction; a float count is refused there, with its name."""
    cfg = CacheConfig(np.int64(8), np.int32(16), np.int64(4), "write_through_selective",
                      write_through_threshold=np.int64(2), storage_write=np.bool_(True),
                      negative_cache_s=np.float32(2.0))
    assert [type(getattr(cfg, f)) for f in ("num_device_blocks", "num_host_blocks",
                                             "block_size", "write_through_threshold",
                                             "storage_write", "negative_cache_s")] == \
        [int, int, int, int, bool, float]
    cm = CacheManager(cfg, storage_exists=lambda hs: 0)
    _replay(cm)
    assert cm.stats.backed_up and cm.stats.stored  # (hit twice: backed up, then written)
    with pytest.raises(TypeError, match="num_host_blocks must be an int, got float"):
        CacheConfig(4, 16.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="store_retry_s must be a number"):
        CacheConfig(4, store_retry_s="1")  # type: ignore[arg-type]


def test_keep_and_chain_take_what_the_source_took() -> None:
    """``keep`` as a list, ``chain`` as any truthy value: taken as the tuple and bool the
    core declares."""
    cm = CacheManager(CacheConfig(0, 16, 4))
    cm.match_prefix("a", hash_ids_chain([1, 2]))
    assert cm.cache_computed("a", 8, device_ids=[5, 6], chain=1) == 2  # type: ignore[arg-type]
    assert cm.take_ops(keep=["save"]) == []  # type: ignore[arg-type]
    assert cm.save_waits("a", 1) is cm.save_waits("a", True) is False  # type: ignore[arg-type]
    ack_all(cm)
    cm.finish("a")
    cm.check_invariants()


class _Noting(LRU):
    """An interpreted policy over the compiled LRU, remembering what left the tier."""

    remembers = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.noted = 0

    def note_evicted(self, hashes: list[bytes]) -> None:
        self.noted += len(hashes)


def test_a_policy_of_ones_own_plugs_into_the_compiled_core() -> None:
    """A subclass of a compiled policy, with a class-level ``remembers``: the core sees
    its own overrides (``note_evicted``) and its class-level settings; counts shadowed at
    class level or by a property would not be seen (every eviction found 0 evictable
    blocks): such a class is refused when it is made."""
    dpol = _Noting(4)
    cm = CacheManager(CacheConfig(4, 0, 4, "write_back"), device_policy=dpol)
    _replay(cm)
    assert dpol.remembers and dpol.noted == cm.stats.evicted_device > 0
    for shadow in ({"num_blocks": 0}, {"probes": property(lambda self: 0)},
                   {"remembers": property(lambda self: True)}):
        with pytest.raises(TypeError, match="instance attribute"):
            type("Bad", (LRU,), shadow)
