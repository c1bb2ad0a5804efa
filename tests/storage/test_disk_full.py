"""The local L3 store on a real full disk (a small tmpfs in a private mount namespace,
``tests/smallfs.py``): a file system smaller than the byte budget lowers the budget and
keeps the store working as an LRU, bytes intact; a disk that others filled fails the put
with the system's error and leaves nothing behind. End to end, ``zkv replay`` with its L3
on such a disk serves every reused block exactly, with a few log lines, not one a step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.replay_run import events as replay_events
from tests.replay_run import metrics as replay_metrics
from tests.replay_run import summary
from tests.smallfs import run_on_small_fs

ROOT = Path(__file__).resolve().parents[2]
H2S_FAILED = 'zkv:failed_blocks_total{direction="h2s"}'

# Run in the child, on the small file system at argv[1]. Blocks of 32 KiB (+ the 64-byte
# header), as the replay's layout makes them; prints one JSON line of what it saw.
_CHILD = r"""
import json, os, sys
import numpy as np
from structlog.testing import capture_logs
from zkv.errors import ConfigError, StorageError
from zkv.storage import LocalDirStore, pack_key

root, case = sys.argv[1], sys.argv[2]
BLOCK = 32 << 10
key = lambda i: pack_key(i.to_bytes(16, "big"), 0)
data = lambda i: np.full(BLOCK, i % 251, np.uint8)
out = {}

def read(s, i):
    buf = np.zeros(BLOCK, np.uint8)
    ok = s.get_into(key(i), buf)
    assert not ok or buf.tobytes() == data(i).tobytes(), f"block {i} differs"
    return ok

def tmp_files():
    return [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]

with capture_logs() as logs:
    if case == "smaller_than_budget":
        s = LocalDirStore(os.path.join(root, "l3"), "ns", max_bytes=1 << 30)
        for i in range(60):  # ~2 MiB into a 512 KiB file system
            s.put(key(i), data(i))
        out["errors"] = s.stats.errors
        out["evicted"] = s.stats.evicted
        out["max_bytes"] = s.max_bytes
        out["num_bytes"] = s.num_bytes
        out["readable"] = [i for i in range(60) if read(s, i)]
    elif case == "full_of_others":  # the store holds nothing it could remove
        filler = os.path.join(root, "filler")
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        for chunk in (64 << 10, 4 << 10):  # then to the last page
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
        os.close(fd)
        try:  # no budget given: half the free space would be none
            LocalDirStore(os.path.join(root, "l3"), "ns")
            out["open_without_budget"] = "ok"
        except ConfigError as e:
            out["open_without_budget"] = str(e)
        s = LocalDirStore(os.path.join(root, "l3"), "ns", max_bytes=1 << 30)
        try:
            s.put(key(1), data(1))
            out["put"] = "ok"
        except StorageError as e:
            out["put"] = str(e)
        out["after"] = (s.num_blocks, s.num_bytes, s.max_bytes, s.stats.errors, tmp_files())
        os.remove(filler)
        s.put(key(2), data(2))  # room again: it works
        out["again"] = read(s, 2)
    elif case == "room_back":
        # a file fills most of the disk; the store's puts lower its budget to what fits;
        # the file goes: a minute on (here: at once), a put takes the budget back
        import zkv.storage.local as local
        filler = os.path.join(root, "filler")
        with open(filler, "wb") as f:
            f.write(b"\0" * (400 << 10))
        s = LocalDirStore(os.path.join(root, "l3"), "ns", max_bytes=256 << 10)
        for i in range(10):
            s.put(key(i), data(i))
        out["lowered"] = (s.max_bytes, s.num_blocks)
        os.remove(filler)
        s.put(key(10), data(10))  # within the minute: as it was
        out["within"] = s.max_bytes
        local._REGROW_S = 0.0
        for i in range(11, 20):
            s.put(key(i), data(i))
        out["after"] = (s.max_bytes, s.num_blocks, s.stats.errors)
        out["readable"] = [i for i in range(20) if read(s, i)]
        out["regrown"] = [{k: e[k] for k in ("max_bytes_was", "max_bytes", "log_level")}
                          for e in logs if e["event"] == "storage.budget_regrown"]
    elif case == "room_taken_between_checks":
        # rank 1 fills the disk with its blocks (and a filler the last pages); rank 0, with
        # nothing of its own, sees room once after its write failed, as when another writer
        # frees some and a third takes it before rank 0 looks again
        other = LocalDirStore(os.path.join(root, "l3"), "ns", max_bytes=1 << 30, rank=1)
        key1 = lambda i: pack_key(i.to_bytes(16, "big"), 1)
        for i in range(100, 130):
            other.put(key1(i), data(i))
        fd = os.open(os.path.join(root, "filler"), os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        os.close(fd)
        import zkv.storage.local as local
        real, seen = local.has_room, []
        def has_room_once(path, size):
            seen.append(size)
            return len(seen) == 1 or real(path, size)
        local.has_room = has_room_once
        s = LocalDirStore(os.path.join(root, "l3"), "ns", max_bytes=1 << 30, rank=0)
        try:
            s.put(key(1), data(1))
            out["put"] = "ok"
        except StorageError as e:
            out["put"] = str(e)
        out["checks"] = len(seen)
        out["readable"] = read(s, 1)
        buf = np.zeros(BLOCK, np.uint8)
        out["others_left"] = sum(other.get_into(key1(i), buf)
                                 and buf.tobytes() == data(i).tobytes() for i in range(100, 130))
out["disk_full"] = [{k: e[k] for k in ("max_bytes_was", "max_bytes", "num_evicted", "error")}
                    for e in logs if e["event"] == "storage.disk_full"]
print(json.dumps(out))
"""


# Run in the child, on a 1 MiB file system at argv[1]: writers 0 and 1 (two processes, four
# threads each, as two replay ranks) put ~13 MB of 32 KiB blocks at once; writer 2, opened
# before them with nothing of its own, puts after they are done and a filler file took the
# room they left. Prints one JSON line.
_WRITERS = r"""
import json, os, sys, threading
import multiprocessing as mp
import numpy as np
from structlog.testing import capture_logs
from zkv.errors import StorageError
from zkv.storage import LocalDirStore, pack_key

root = sys.argv[1]
BLOCK, THREADS, PER_THREAD = 32 << 10, 4, 100
key = lambda w, i: pack_key(i.to_bytes(16, "big"), w)
data = lambda w, i: np.full(BLOCK, (w * 7 + i) % 251, np.uint8)

def writer(w, start, done, out):
    # each its rank, as replay ranks: a store without one (a reader, or the one writer)
    # would index at its first put every file there then, the others' too
    s = LocalDirStore(os.path.join(root, "l3"), "ns", max_bytes=1 << 30, rank=w)  # indexes none
    wrote, errors = [], []
    def run(t):
        for i in range(t * 1000, t * 1000 + (PER_THREAD if w < 2 else 5)):
            try:
                s.put(key(w, i), data(w, i))
                wrote.append(i)
            except StorageError as e:
                errors.append(str(e))
    with capture_logs() as logs:
        start.wait(60)  # all three opened
        if w == 2:
            done.wait(60)
        threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS if w < 2 else 1)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    exact = bad = 0
    for i in wrote:
        buf = np.zeros(BLOCK, np.uint8)
        if s.get_into(key(w, i), buf):
            exact += 1
            bad += buf.tobytes() != data(w, i).tobytes()
    full = [{k: e.get(k, 0) for k in ("num_evicted", "num_removed_others")}
            for e in logs if e["event"] == "storage.disk_full"]
    out.put({"w": w, "errors": errors[:3], "num_errors": len(errors), "wrote": len(wrote),
             "readable": exact, "bad": bad, "held": s.num_bytes, "max_bytes": s.max_bytes,
             "disk_full": full})

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    start, done, out = ctx.Barrier(4), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=writer, args=(w, start, done, out)) for w in range(3)]
    [p.start() for p in procs]
    start.wait(60)
    res = [out.get(timeout=50) for _ in range(2)]
    fd = os.open(os.path.join(root, "filler"), os.O_WRONLY | os.O_CREAT)
    try:  # what room they left, taken
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    os.close(fd)
    done.set()
    res.append(out.get(timeout=50))
    [p.join(30) for p in procs]
    tmps = [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]
    print(json.dumps({"writers": sorted(res, key=lambda r: r["w"]), "tmp_files": tmps,
                      "exit": [p.exitcode for p in procs]}))
"""


# Run in the child, on a 4 MiB file system at argv[1]: two engines' stores (two models'
# namespaces) with no budget given open at once, each taking half the free space, then
# write 4 MiB each, in turn. Prints one JSON line.
_ENGINES = r"""
import json, os, sys
import numpy as np
from structlog.testing import capture_logs
from zkv.storage import LocalDirStore, pack_key

root = sys.argv[1]
BLOCK = 32 << 10
key = lambda i: pack_key(i.to_bytes(16, "big"), 0)
data = lambda n, i: np.full(BLOCK, (n * 7 + i) % 251, np.uint8)
free = lambda: (lambda st: st.f_bavail * st.f_frsize)(os.statvfs(root))
at_open = free()
with capture_logs() as logs:
    stores = [LocalDirStore(os.path.join(root, "l3"), f"model-{n}", rank=0) for n in range(2)]
    least = at_open
    for i in range(128):
        for n, s in enumerate(stores):
            s.put(key(i), data(n, i))
            least = min(least, free())
out = {"at_open": at_open, "least_free": least, "budgets": [s.max_bytes for s in stores],
       "errors": [s.stats.errors for s in stores], "held": [s.num_blocks for s in stores]}
buf = np.zeros(BLOCK, np.uint8)
out["readable"] = [[i for i in range(128) if s.get_into(key(i), buf)
                    and buf.tobytes() == data(n, i).tobytes()] for n, s in enumerate(stores)]
out["disk_full"] = sum(e["event"] == "storage.disk_full" for e in logs)
print(json.dumps(out))
"""


def _child(tmp_path: Path, case: str) -> dict:
    return _on_small_fs(tmp_path, "512k", _CHILD, case)


def _on_small_fs(tmp_path: Path, size: str, code: str, *args: str) -> dict:
    """Run ``code`` (argv: the file system's mount point, then ``args``) on a small tmpfs
    of ``size``; its last stdout line, as JSON."""
    fs = tmp_path / "fs"
    fs.mkdir()
    proc = run_on_small_fs(str(fs), size, [sys.executable, "-c", code, str(fs), *args],
                           timeout_s=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_disk_smaller_than_the_budget_keeps_the_store_working(tmp_path: Path) -> None:
    out = _child(tmp_path, "smaller_than_budget")
    assert out["errors"] == 0  # every put succeeded
    # the budget came down to what fits, once (one writer), and stays an LRU from there
    assert len(out["disk_full"]) == 1, out["disk_full"]
    (ev,) = out["disk_full"]
    assert ev["max_bytes_was"] == 1 << 30 and ev["max_bytes"] < 512 << 10
    assert "No space left on device" in ev["error"] and ev["num_evicted"] >= 1
    assert out["max_bytes"] == ev["max_bytes"] and out["num_bytes"] <= out["max_bytes"]
    # the newest blocks are there, byte for byte; the oldest went first
    readable = out["readable"]
    assert readable and readable == list(range(60 - len(readable), 60))
    assert out["evicted"] == 60 - len(readable)


def test_a_disk_full_of_other_files_fails_the_put_and_leaves_nothing(tmp_path: Path) -> None:
    out = _child(tmp_path, "full_of_others")
    assert out["open_without_budget"].endswith(
        "/l3: its file system has no free space; free some, or give a budget "
        "(file://...?max_gb=G)"), out["open_without_budget"]
    assert out["put"].startswith("put ") and "No space left on device" in out["put"]
    num_blocks, num_bytes, max_bytes, errors, tmp_files = out["after"]
    assert (num_blocks, num_bytes, max_bytes, errors, tmp_files) == (0, 0, 1 << 30, 1, [])
    assert out["disk_full"] == []  # nothing of its own to remove: the budget is unchanged
    assert out["again"] is True


def test_a_budget_the_disk_lowered_grows_back_once_it_has_room(tmp_path: Path) -> None:
    """Another file filled the disk for a while: the store lowered its budget to what fit.
    Once the file is gone, a put a minute on takes the budget back (up to the one it had),
    said once at info, and the store holds as many blocks as before. (Before: lowered for
    good, until the engine restarted.)"""
    out = _child(tmp_path, "room_back")
    budget = 256 << 10
    lowered, num_lowered = out["lowered"]
    assert lowered < 4 * ((32 << 10) + 64) and num_lowered < 4, out
    assert out["within"] == lowered  # looked at again a minute on, not at every put
    max_bytes, num_blocks, errors = out["after"]
    assert (max_bytes, errors) == (budget, 0) and num_blocks == budget // ((32 << 10) + 64)
    assert out["readable"] == list(range(20 - num_blocks, 20))  # the newest, exact
    assert out["regrown"] == [{"max_bytes_was": lowered, "max_bytes": budget,
                               "log_level": "info"}]


def test_room_taken_between_two_looks_still_removes_the_namespaces_oldest(
        tmp_path: Path) -> None:
    """A writer with nothing of its own on a disk another rank filled: its put fails, it
    sees room (another writer freed some), then none (a third took it). It removes the
    namespace's oldest files and puts, as when it saw no room at once (it failed the put)."""
    out = _child(tmp_path, "room_taken_between_checks")
    assert out["put"] == "ok" and out["readable"] is True, out
    assert out["checks"] >= 2  # the room seen once, then not
    assert 0 < out["others_left"] < 30
    (ev,) = [e for e in out["disk_full"] if e["max_bytes_was"] == 1 << 30
             and e["num_evicted"] == 0]  # the writer's one lowering: nothing of its own
    assert "No space left on device" in ev["error"]


def test_engines_opening_stores_on_one_disk_at_once_leave_a_quarter_free(
        tmp_path: Path) -> None:
    """Two engines' stores without a given budget open on one disk at once: each takes half
    of its free space, the whole disk between them. Each put keeps a quarter of what was
    free at open free on the disk, from the store's own oldest blocks: the disk never fills
    (other programs on it keep working), no put fails, the newest blocks read back exact.
    (Before: the disk filled to its last block, and stayed full.)"""
    out = _on_small_fs(tmp_path, "4m", _ENGINES)
    at_open, block = out["at_open"], (32 << 10) + 64
    assert all(abs(b - at_open // 2) <= 4096 for b in out["budgets"]), out  # half each
    assert out["least_free"] >= at_open // 4 - 2 * 4096, out  # (rounding to pages)
    assert out["errors"] == [0, 0] and out["disk_full"] == 0, out
    for held, readable in zip(out["held"], out["readable"]):
        assert 0 < held and readable == list(range(128 - held, 128)), out
    assert sum(out["held"]) * block <= at_open * 3 // 4


def test_writers_sharing_a_full_disk_each_get_room_and_lose_nothing(tmp_path: Path) -> None:
    """Two processes of four threads fill a 1 MiB disk 13 times over, each with a 1 GB
    budget: no put fails, though each thread's room can be taken by another writer before
    it writes; every block a writer still indexes reads back byte for byte. A third writer,
    holding nothing when the others filled the disk, gets room from the namespace's oldest
    files, whoever wrote them (and keeps about that much: the shares are what each writer
    held when the disk filled)."""
    out = _on_small_fs(tmp_path, "1m", _WRITERS)
    assert out["exit"] == [0, 0, 0] and out["tmp_files"] == []
    for w in out["writers"]:
        assert (w["num_errors"], w["errors"]) == (0, []), w
        assert w["wrote"] == (400 if w["w"] < 2 else 5) and w["bad"] == 0
        assert 0 < w["readable"] and w["held"] <= w["max_bytes"] < 1 << 20, w
        assert w["disk_full"], w  # each met the full disk and lowered its budget
    late = out["writers"][2]
    # its puts all succeeded and its newest block is there; it keeps what fits in the budget
    # it lowered to (the room it made), as the others keep what they held when it filled
    assert late["readable"] >= 1 and late["max_bytes"] < 4 * ((32 << 10) + 64)
    assert sum(e["num_removed_others"] for e in late["disk_full"]) >= 1
    assert late["disk_full"][0]["num_evicted"] == 0  # it had nothing of its own


@pytest.mark.parametrize("filled", [False, True], ids=["smaller_than_budget", "full_of_others"])
def test_replay_with_its_l3_on_a_full_disk_is_exact_and_quiet(tmp_path: Path,
                                                             filled: bool) -> None:
    """The main job, two real ranks, its L3 directory on an 8 MiB file system with a 1 GB
    budget (or one that another file filled). Every reused block verifies; the store either
    keeps accepting blocks (no write dropped) or drops them all with a few lines."""
    fs, logs = tmp_path / "fs", tmp_path / "logs"
    fs.mkdir()
    replay = [sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--requests", "200",
              "--storage", f"file://{fs}/l3?max_bytes=1000000000", "--log-dir", str(logs),
              "--metrics-file", str(tmp_path / "metrics.txt")]
    argv = (["sh", "-c", 'head -c 16m /dev/zero > "$0/filler" 2>/dev/null; exec "$@"', str(fs),
             *replay] if filled else replay)
    s = summary(run_on_small_fs(str(fs), "8m", argv, timeout_s=300, cwd=str(ROOT)))
    assert s.verified > 1000 and (s.mismatched, s.failed_ops) == (0, 0)
    events = replay_events(logs)
    full = [e for e in events if e["event"] == "storage.disk_full"]
    io_failed = [e for e in events if e["event"] in ("worker.copy_failed", "scheduler.op_failed")]
    if filled:
        assert s.stored == 0 and s.store_dropped > 1000  # every write failed, counted
        assert replay_metrics(tmp_path / "metrics.txt")[H2S_FAILED] == s.store_dropped
        assert full == []  # the store held nothing to give back
        # a few lines per process, the rest counted (the last one says how many)
        assert 0 < len(io_failed) <= 3 * 3 * 2, len(io_failed)
        assert all("No space left on device" in e.get("error", "No space left on device")
                   for e in io_failed)
        # the rest counted: the ranks and the scheduler each end with what they held back
        summaries = {e["component"] for e in io_failed if e.get("summary")}
        assert summaries == {"worker", "scheduler"}
        assert sum(e.get("num_suppressed", 0) for e in io_failed) > 0
    else:
        assert s.stored > 1000 and s.store_dropped == 0  # no write was dropped
        assert replay_metrics(tmp_path / "metrics.txt")[H2S_FAILED] == 0
        assert 0 < len(full) <= 10, len(full)  # two writers settle in a few lowerings
        assert len(io_failed) <= 6  # (a load can race the LRU's removal: recomputed)


def test_replay_on_a_full_disk_without_a_budget_is_one_line_and_starts_nothing(
        tmp_path: Path) -> None:
    """Half the free space of a full disk is no budget: `zkv replay` says so and how out,
    before anything starts; with a budget it runs (the filled case above)."""
    fs = tmp_path / "fs"
    fs.mkdir()
    argv = ["sh", "-c", 'head -c 16m /dev/zero > "$0/filler" 2>/dev/null; exec "$@"', str(fs),
            sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--store-dir",
            f"{fs}/l3", "--log-dir", str(tmp_path / "logs")]
    proc = run_on_small_fs(str(fs), "1m", argv, timeout_s=120, cwd=str(ROOT))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (f"zkv replay: error: store directory {fs}/l3: its file system has "
                           "no free space; free some, or give a budget (file://...?max_gb=G)\n")
    assert proc.stdout == "" and not (tmp_path / "logs").exists()


# Run in the child, on a 4 MiB file system at argv[1]: the default budget of a group of two
# writers, and of one writer opened again after it filled its budget. One JSON line.
_DEFAULT_BUDGET = r"""
import json, os, shutil, sys
import numpy as np
from zkv.storage import file_url, open_store, pack_key

root = sys.argv[1]
url = file_url(os.path.join(root, "l3"))
BLOCK = 32 << 10
free = lambda: shutil.disk_usage(root).free
out = {"free": free()}
group = [open_store(url, "ns", writers=2, rank=r) for r in (0, 1)]
out["group"] = [s.max_bytes for s in group]
for s in group:
    s.close()
opens = []
for run in range(4):  # one writer, opened, filled past its budget, closed: four times
    s = open_store(url, "solo", rank=0)
    opens.append((s.max_bytes, free()))
    for i in range(run * 1000, run * 1000 + s.max_bytes // BLOCK + 4):
        s.put(pack_key(i.to_bytes(16, "big"), 0), np.full(BLOCK - 64, i % 251, np.uint8))
    s.close()
out["opens"] = opens
out["free_after"] = free()
# a store without a rank takes its budget at its first use: files another writer put since
# its open count once (as held), not twice (in the free space measured at open, and held)
late = open_store(url, "late")
other = open_store(url, "late", rank=1)
for i in range(32):  # 1 MiB
    other.put(pack_key(i.to_bytes(16, "big"), 1), np.full(BLOCK - 64, 7, np.uint8))
out["late"] = (late.max_bytes, free(), other.num_bytes)
print(json.dumps(out))
"""


def test_the_default_budget_is_half_the_free_space_for_a_group_and_across_restarts(
        tmp_path: Path) -> None:
    """No ``max_gb``: a group of writers takes half the free space together, and a writer
    opened again takes the budget it had. (Before, each writer took half the free space, a
    group of two all of it, and each restart half of what was left on top of what it held:
    32, 47, 55, 59 MiB of a 64 MiB disk.)"""
    out = _on_small_fs(tmp_path, "4m", _DEFAULT_BUDGET)
    free = out["free"]
    assert sum(out["group"]) <= free // 2 and min(out["group"]) >= free // 4 - 4096, out
    (first, _), *again = out["opens"]
    assert first == free // 2, out
    for budget, _ in again:  # the same budget, up to the file system's rounding
        assert abs(budget - first) <= 64 << 10, out["opens"]
    assert out["free_after"] >= free // 2 - (64 << 10), out
    budget, free_now, held = out["late"]
    assert budget == (free_now + held) // 2, out["late"]
