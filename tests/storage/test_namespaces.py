"""A ``file://`` root's namespaces that no engine uses any more are removed when a store
opens (``zkv/storage/namespaces.py``): their files took the live store's room for good."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from zkv.errors import ConfigError
from zkv.storage import HEADER_SIZE, LocalDirStore, namespaces, open_store, pack_key

DAY = 86400.0
ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4096


def _key(i: int) -> bytes:
    return pack_key(i.to_bytes(16, "big"), 0)


def _fill(root: Path, ns: str, n: int, idle_days: float) -> None:
    """A namespace of ``n`` blocks, last used ``idle_days`` ago."""
    s = LocalDirStore(root, ns, max_bytes=1 << 30, rank=0, keep_days=0)
    for i in range(n):
        s.put(_key(i), np.full(BLOCK, i, np.uint8))
    s.close()
    t = time.time() - idle_days * DAY
    os.utime(root / ns / namespaces.MARK, (t, t))


def test_namespaces_unused_for_keep_days_are_removed_at_open(tmp_path: Path) -> None:
    """Of four folders under the root: the one unused for 8 days goes; the one used a day
    ago, a folder without zkv's mark (not zkv's: left alone) and the store's own stay. The
    store's budget is taken after the removal: the room it freed counts."""
    root = tmp_path / "l3"
    _fill(root, "old-model", 20, idle_days=8)
    _fill(root, "recent-model", 5, idle_days=1)
    (root / "photos").mkdir()
    (root / "photos" / "cat.jpg").write_bytes(b"x" * 100)
    os.utime(root / "photos", (0, 0))
    _fill(root, "live", 3, idle_days=30)  # its own: however old, never
    free = shutil.disk_usage(root).free
    with capture_logs() as logs:
        s = LocalDirStore(root, "live", rank=0)
    assert sorted(os.listdir(root)) == ["live", "photos", "recent-model"]
    # its budget, half the free space (held files too), counts the room the removal made
    assert s.max_bytes >= (free + 20 * BLOCK + 3 * (BLOCK + HEADER_SIZE)) // 2 - (1 << 20)
    [line] = [e for e in logs if e["event"] == "storage.namespace_pruned"]
    assert line["pruned"] == "old-model" and line["keep_days"] == 7.0
    assert 7.9 < line["idle_days"] < 8.1 and line["log_level"] == "info"
    buf = np.zeros(BLOCK, np.uint8)
    assert all(s.get_into(_key(i), buf) and (buf == i).all() for i in range(3))
    # its mark says it is in use from now on
    assert time.time() - os.stat(root / "live" / namespaces.MARK).st_mtime < 60


def test_keep_days_0_removes_nothing_and_a_short_one_removes_more(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    _fill(root, "a", 2, idle_days=2)
    _fill(root, "b", 2, idle_days=0.5)
    open_store(f"file://{root}?keep_days=0", "live").close()
    assert sorted(os.listdir(root)) == ["a", "b", "live"]
    open_store(f"file://{root}?keep_days=1", "live").close()
    assert sorted(os.listdir(root)) == ["b", "live"]
    with pytest.raises(ConfigError, match="keep_days must be >= 0"):
        open_store(f"file://{root}?keep_days=-1", "live")


def test_a_store_in_use_marks_its_namespace_again(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A put or a hit, at most once every MARK_EVERY_S, touches the mark: an engine that runs
    for weeks keeps its namespace, a writer's and a reader's alike."""
    root = tmp_path / "l3"
    writer = LocalDirStore(root, "live", max_bytes=1 << 20, rank=0)
    reader = LocalDirStore(root, "live", max_bytes=1 << 20)
    mark = root / "live" / namespaces.MARK
    old = time.time() - 3 * DAY
    os.utime(mark, (old, old))
    writer.put(_key(1), np.ones(BLOCK, np.uint8))  # within the hour: not touched again
    assert os.stat(mark).st_mtime == pytest.approx(old)
    monkeypatch.setattr(namespaces, "MARK_EVERY_S", 0.0)
    writer.put(_key(2), np.ones(BLOCK, np.uint8))
    assert time.time() - os.stat(mark).st_mtime < 60
    os.utime(mark, (old, old))
    assert reader.get_into(_key(2), np.zeros(BLOCK, np.uint8))
    assert time.time() - os.stat(mark).st_mtime < 60


def test_a_store_marks_its_namespace_used_at_close(tmp_path: Path) -> None:
    """Closing is the last use: the mark says so. (Before, a store marked at most once an
    hour: a namespace used a moment ago looked idle up to an hour, another opener with a
    short ``keep_days`` removed it as idle, ``idle_days`` 0.0.)"""
    root = tmp_path / "l3"
    s = LocalDirStore(root, "model-a", max_bytes=1 << 20, rank=0)
    mark = root / "model-a" / namespaces.MARK
    s.put(_key(1), np.ones(BLOCK, np.uint8))
    old = time.time() - 3000  # marked 50 minutes ago: within the hour, not touched again
    os.utime(mark, (old, old))
    s.put(_key(2), np.ones(BLOCK, np.uint8))
    assert os.stat(mark).st_mtime == pytest.approx(old)
    s.close()
    assert time.time() - os.stat(mark).st_mtime < 60
    LocalDirStore(root, "model-b", rank=0, keep_days=0.03).close()  # 43 minutes
    assert sorted(os.listdir(root)) == ["model-a", "model-b"]


def test_a_namespace_renamed_aside_while_its_store_opens_is_made_again_and_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another opener renames the namespace aside (unused past its ``keep_days``) between
    this store's open of the mark and its lock: the store makes the namespace again and
    holds the new mark. (Before, it held the renamed one's: its namespace was removed
    under it, made again by its next put without a mark, and never pruned.) The race is
    made deterministic: the rename runs inside the store's lock call."""
    root = tmp_path / "l3"
    _fill(root, "old", 3, idle_days=30)
    real = namespaces.fcntl.flock
    raced: list[bool] = []

    def flock(fd: int, op: int) -> None:
        if op == namespaces.fcntl.LOCK_SH and not raced:
            raced.append(True)  # the other opener: the namespace aside, as prune does
            os.rename(root / "old", root / f".old.999{namespaces._ASIDE}")
        real(fd, op)

    monkeypatch.setattr(namespaces.fcntl, "flock", flock)
    s = LocalDirStore(root, "old", max_bytes=1 << 20, rank=0)
    monkeypatch.undo()
    try:
        assert raced == [True]
        mark = root / "old" / namespaces.MARK
        assert s._held is not None and mark.is_file()  # type: ignore[attr-defined]
        held = os.fstat(s._held)  # type: ignore[attr-defined]
        assert (held.st_dev, held.st_ino) == (os.stat(mark).st_dev, os.stat(mark).st_ino)
        LocalDirStore(root, "other", rank=0, keep_days=1e-9).close()  # its open prunes
        assert sorted(os.listdir(root)) == ["old", "other"]  # held: stays; aside: gone
    finally:
        s.close()


def test_a_pruner_whose_mark_was_put_aside_spares_the_namespace_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruner A opens an old namespace's mark; before its lock, pruner C puts that folder
    aside and a store B makes the namespace again under the same name, holds its new mark
    and puts a block. A's exclusive lock on the old mark (no one holds it) succeeds and
    its mtime is old: A must not rename the folder, which is B's now. Before: it did, and
    the second loop removed B's folder with B's blocks under B. The race is made
    deterministic: C and B run inside A's lock call."""
    root = tmp_path / "l3"
    _fill(root, "old", 3, idle_days=30)
    real = namespaces.fcntl.flock
    stores: list[LocalDirStore] = []

    def flock(fd: int, op: int) -> None:
        if op == namespaces.fcntl.LOCK_EX | namespaces.fcntl.LOCK_NB and not stores:
            monkeypatch.setattr(namespaces.fcntl, "flock", real)
            assert namespaces._rename_if_unused(str(root), "old", str(root / "old"),
                                                7 * DAY) is not None  # C
            # B (its open removes the folder C put aside: A's rename, in the same process,
            # is to the same name, which must be free as another process's would be)
            b = LocalDirStore(root, "old", max_bytes=1 << 20, rank=0, keep_days=7)
            stores.append(b)
            b.put(_key(9), np.full(BLOCK, 9, np.uint8))
            monkeypatch.setattr(namespaces.fcntl, "flock", flock)
        real(fd, op)

    monkeypatch.setattr(namespaces.fcntl, "flock", flock)
    pruned = namespaces.prune(str(root), "a", 7 * DAY)  # A: a store of namespace "a" opens
    monkeypatch.undo()
    [b] = stores
    try:
        assert pruned == []
        out = np.zeros(BLOCK, np.uint8)
        assert b.get_many_into([_key(9)], [out]) == [True] and (out == 9).all()
        assert (root / "old" / namespaces.MARK).is_file()
    finally:
        b.close()


def test_a_namespace_pruned_before_its_store_marks_it_is_made_again_and_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race one step earlier: another opener prunes the namespace (renamed aside,
    removed) after this store found its folder there and before its mark. The store makes
    it again and holds the new mark; a later prune leaves it, idle as it may be. (Before,
    its lock found no mark and it held nothing: its puts made the folder again, unmarked,
    and once their hourly mark aged past ``keep_days`` another opener removed its blocks
    while it was open.) Deterministic: the prune runs inside the store's mark call."""
    root = tmp_path / "l3"
    _fill(root, "old", 3, idle_days=30)
    real = namespaces.mark
    raced: list[bool] = []

    def mark(base: str) -> bool:
        if not raced:
            raced.append(True)  # the other opener (namespace "new"): "old" is 30 days idle
            assert [n for n, _ in namespaces.prune(str(root), "new", 7 * DAY)] == ["old"]
        return real(base)

    monkeypatch.setattr(namespaces, "mark", mark)
    s = LocalDirStore(root, "old", max_bytes=1 << 20, rank=0)
    monkeypatch.undo()
    try:
        assert raced == [True]
        mark_path = root / "old" / namespaces.MARK
        assert s._held is not None and mark_path.is_file()  # type: ignore[attr-defined]
        s.put(_key(1), np.full(64, 7, np.uint8))
        t = time.time() - 30 * DAY  # the engine then idles past keep_days
        os.utime(mark_path, (t, t))
        LocalDirStore(root, "other", rank=0).close()  # another engine opens: prunes
        out = np.zeros(64, np.uint8)
        assert s.get_into(_key(1), out) and (out == 7).all(), "removed while open"
    finally:
        s.close()


def test_a_removal_cut_short_is_finished_by_the_next_open(tmp_path: Path) -> None:
    """A namespace renamed aside whose removal died midway (its mark is removed last, so
    it is still inside) goes at the next open."""
    root = tmp_path / "l3"
    _fill(root, "old", 4, idle_days=30)
    os.rename(root / "old", root / ".old.123.pruned")
    LocalDirStore(root, "live", rank=0).close()
    assert sorted(os.listdir(root)) == ["live"]


def test_a_namespace_a_store_holds_open_is_never_removed(tmp_path: Path) -> None:
    """An engine that has had no L3 put or hit for longer than ``keep_days`` (its mark as
    old), or an opener with a tiny ``keep_days``: the namespace stays while a store has it
    open (a shared flock on its mark; before, it went from under the engine, whose index
    still counted the files), in another process too; once closed, it goes."""
    root = tmp_path / "l3"
    idle = LocalDirStore(root, "idle", rank=0)
    idle.put(_key(1), np.full(BLOCK, 1, np.uint8))
    t = time.time() - 30 * DAY
    os.utime(root / "idle" / namespaces.MARK, (t, t))
    held = subprocess.Popen([sys.executable, "-c", _HOLD, str(root)], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert held.stdout is not None and held.stdout.readline() == "held\n"
        os.utime(root / "other" / namespaces.MARK, (t, t))
        open_store(f"file://{root}?keep_days=0.0001", "live").close()
        assert sorted(os.listdir(root)) == ["idle", "live", "other"]
        buf = np.zeros(BLOCK, np.uint8)
        assert idle.get_into(_key(1), buf) and (buf == 1).all()
    finally:
        held.communicate("", timeout=30)  # it closes its store and exits
    idle.close()
    for ns in ("idle", "other"):  # (closing marked them used)
        os.utime(root / ns / namespaces.MARK, (t, t))
    open_store(f"file://{root}?keep_days=0.0001", "live").close()
    assert sorted(os.listdir(root)) == ["live"]


_HOLD = r"""
import sys
from zkv.storage import LocalDirStore
s = LocalDirStore(sys.argv[1], "other", rank=0)
print("held", flush=True)
sys.stdin.read()
s.close()
"""


def _marks_open(root: Path) -> list[str]:
    """The namespace marks under ``root`` that this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (the listing's own fd, closed by now)
            continue
        if target.startswith(f"{root}/") and target.endswith(namespaces.MARK):
            found.append(target)
    return found


def test_a_store_refused_at_open_holds_no_namespace(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An open refused after the namespace was held (a budget of 0, a file system with no
    free space and no budget) kept its mark open and share-locked for the life of the
    process: an fd leaked per try, and no store could prune that namespace any more."""
    from zkv.storage import local

    assert _marks_open(tmp_path) == []
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        LocalDirStore(tmp_path, "zero", max_bytes=0)
    monkeypatch.setattr(local, "free_bytes", lambda _: 0)  # a file system with no room
    with pytest.raises(ConfigError, match="its file system has no free space"):
        LocalDirStore(tmp_path, "full", rank=0)
    monkeypatch.undo()
    assert _marks_open(tmp_path) == []
    t = time.time() - 8 * DAY  # both unused for 8 days: a store opening now removes them
    for ns in os.listdir(tmp_path):
        os.utime(tmp_path / ns / namespaces.MARK, (t, t))
    s = LocalDirStore(tmp_path, "live", max_bytes=1 << 20, rank=0, keep_days=7)
    try:
        assert sorted(os.listdir(tmp_path)) == ["live"]
    finally:
        s.close()
    assert _marks_open(tmp_path) == []
