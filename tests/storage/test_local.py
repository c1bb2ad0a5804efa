"""LocalDirStore: the byte budget (LRU, O(1) per put; an eviction racing a put of the same
key), the index rebuilt at open, a root directory removed and made again, leftovers of a
writer that died."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import structlog
from structlog.testing import capture_logs

from zkv import log as zlog
from zkv.errors import ConfigError, StorageError
from zkv.storage import HEADER_SIZE, LocalDirStore, file_url, namespaces, open_store, pack_key
from zkv.storage.localfs import check_root

BLOCK = 4096
FILE = HEADER_SIZE + BLOCK


def key(i: int, rank: int = 0) -> bytes:
    return pack_key(i.to_bytes(16, "big"), rank)


def data(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, dtype=np.uint8)


def get(store: LocalDirStore, i: int) -> bool:
    out = np.zeros(BLOCK, np.uint8)
    ok = store.get_into(key(i), out)
    assert not ok or out.tobytes() == data(i).tobytes()
    return ok


def test_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "ns", max_bytes=3 * FILE)
    for i in range(3):
        s.put(key(i), data(i))
    assert (s.num_blocks, s.num_bytes) == (3, 3 * FILE)
    assert get(s, 0)  # 0 is now the most recently used
    s.put(key(3), data(3))  # over budget: the oldest, 1, goes
    assert s.exists([key(i) for i in range(4)]) == [True, False, True, True]
    assert not get(s, 1)
    s.put(key(4), data(4))
    assert s.exists([key(i) for i in range(5)]) == [True, False, False, True, True]
    assert (s.num_blocks, s.num_bytes, s.stats.evicted) == (3, 3 * FILE, 2)
    on_disk = sum(len(files) for _, _, files in os.walk(tmp_path / "ns"))
    assert on_disk == 3 + 1  # and the namespace's mark (zkv/storage/namespaces.py)


def test_a_block_put_again_replaces_its_file_and_evicts_nothing(tmp_path: Path) -> None:
    """The scheduler writes a block again after an h2s that failed part-way, or a chain
    recomputed past an evicted block: the put replaces the file and adds no byte. It
    counted the whole block as new before, and a store at its budget evicted its least
    recently used block for nothing (a miss, if read before the next new put)."""
    s = LocalDirStore(tmp_path, "ns", max_bytes=4 * FILE)
    for i in range(4):
        s.put(key(i), data(i))
    for i in (1, 2, 3, 2):  # put again: the same bytes, refreshed as recent
        s.put(key(i), data(i))
    assert s.exists([key(i) for i in range(4)]) == [True] * 4 and s.stats.evicted == 0
    assert (s.num_blocks, s.num_bytes) == (4, 4 * FILE) and all(get(s, i) for i in range(4))
    s.put(key(0), data(0))  # 0 the most recent now: a new block evicts 1, the oldest
    s.put(key(4), data(4))
    assert s.exists([key(i) for i in range(5)]) == [True, False, True, True, True]
    assert (s.num_blocks, s.num_bytes, s.stats.evicted) == (4, 4 * FILE, 1)


def test_a_put_keeps_its_block_while_another_puts_reservation_is_pending(
        tmp_path: Path) -> None:
    """A budget of one file and two puts at once: the first to land keeps its block until
    the other lands (the index keeps the newest file whatever the other put reserved).
    Kept nothing (``keep=0``, mutant S12 of the last review, which no test caught), it
    evicted its own new file at once: a put that said yes, and a miss right after it."""
    s = LocalDirStore(tmp_path, "ns", max_bytes=FILE)
    write = s._write_file  # the slow put waits, its bytes reserved, until released
    reserved, release = threading.Event(), threading.Event()

    def held_write(tmp: str, bufs: list[Any]) -> None:
        if threading.current_thread() is slow:
            reserved.set()
            assert release.wait(10), "never released"
        write(tmp, bufs)

    s._write_file = held_write  # type: ignore[method-assign]
    slow = threading.Thread(target=s.put, args=(key(1), data(1)))
    slow.start()
    try:
        assert reserved.wait(10), "the slow put never reserved"
        s.put(key(0), data(0))
        assert get(s, 0), "the put evicted its own block"
    finally:
        release.set()
        slow.join(10)
    assert not slow.is_alive()
    assert s.exists([key(0), key(1)]) == [False, True] and get(s, 1)
    assert (s.num_blocks, s.num_bytes) == (1, FILE)


@pytest.mark.parametrize("rank", [0, None])
def test_puts_never_scan_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       rank: int | None) -> None:
    """A rank's store scans at open, one without a rank at the first use of its index (here
    ``num_blocks``; else its first put); never after."""
    s = LocalDirStore(tmp_path, "ns", max_bytes=4 * FILE, rank=rank)
    assert s.num_blocks == 0

    def no_scan(*_: object) -> None:
        raise AssertionError("a directory scan after open")

    monkeypatch.setattr(os, "scandir", no_scan)
    monkeypatch.setattr(os, "listdir", no_scan)
    monkeypatch.setattr(os, "walk", no_scan)
    for i in range(40):  # 36 evictions
        s.put(key(i), data(i))
        assert get(s, i)
    assert s.num_blocks == 4 and s.stats.evicted == 36


@pytest.mark.parametrize("fault", [OSError(5, "Input/output error"), RuntimeError("cut")],
                         ids=["io_error", "other"])
def test_a_failed_put_gives_back_its_reserved_bytes(tmp_path: Path, fault: BaseException,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A put counts its bytes before it writes; one that fails, by an I/O error or
    anything else, gives them back and leaves no temp file: the budget holds as many
    blocks after it as before."""
    s = LocalDirStore(tmp_path, "ns", max_bytes=3 * FILE)
    s.put(key(0), data(0))
    writev = os.writev

    def fail_once(fd: int, bufs: object) -> int:
        monkeypatch.setattr(os, "writev", writev)
        raise fault

    monkeypatch.setattr(os, "writev", fail_once)
    with pytest.raises(StorageError if isinstance(fault, OSError) else RuntimeError):
        s.put(key(1), data(1))
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")] == []
    for i in (2, 3):
        s.put(key(i), data(i))
    assert s.exists([key(i) for i in range(4)]) == [True, False, True, True]
    assert (s.num_blocks, s.num_bytes, s.stats.evicted) == (3, 3 * FILE, 0)


def test_index_is_rebuilt_at_open_in_mtime_order(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "ns", max_bytes=10 * FILE)
    for i in range(4):
        s.put(key(i), data(i))
    base = time.time() - 100
    for i, age in enumerate((3, 1, 0, 2)):  # LRU order by mtime: 0, 3, 1, 2 (oldest first)
        os.utime(s.path(key(i)), (base - age, base - age))
    again = LocalDirStore(tmp_path, "ns", max_bytes=4 * FILE)
    assert (again.num_blocks, again.num_bytes) == (4, 4 * FILE)
    again.put(key(4), data(4))
    again.put(key(5), data(5))  # two over: the two oldest go
    assert again.exists([key(i) for i in range(6)]) == [False, True, True, False, True, True]
    assert all(get(again, i) for i in (1, 2, 4, 5))


def test_a_hit_survives_a_restart_as_recent(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "ns", max_bytes=10 * FILE)
    for i in range(3):
        s.put(key(i), data(i))
        t = time.time() - 100 + i
        os.utime(s.path(key(i)), (t, t))
    assert get(s, 0)  # refreshes the file's mtime
    again = LocalDirStore(tmp_path, "ns", max_bytes=3 * FILE)
    again.put(key(3), data(3))
    assert again.exists([key(i) for i in range(4)]) == [True, False, True, True]


def test_recreated_root_is_picked_up_again(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    s = LocalDirStore(root, "ns", max_bytes=100 * FILE)
    s.put(key(1), data(1))
    shutil.rmtree(root)
    assert not get(s, 1) and s.exists([key(1)]) == [False]
    root.mkdir()
    s.put(key(1), data(1))  # the fan-out folder is made again
    s.put(key(2), data(2))
    assert get(s, 1) and get(s, 2)
    assert s.num_bytes == 2 * FILE


def test_stale_temp_files_are_removed_at_open(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "ns")
    s.put(key(1), data(1))
    old = s.path(key(2)) + ".123.456.tmp"
    new = s.path(key(3)) + ".123.789.tmp"
    for p in (old, new):
        Path(p).write_bytes(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    again = LocalDirStore(tmp_path, "ns")
    assert not os.path.exists(old) and os.path.exists(new)  # a live writer's file stays
    assert again.num_blocks == 1 and again.exists([key(2), key(3)]) == [False, False]


def test_a_block_larger_than_the_budget_is_refused_and_evicts_nothing(tmp_path: Path) -> None:
    """Before, its reservation evicted every file of the store, and the block was then
    stored over the budget. (A caller that gives ``open_store`` its ``block_bytes`` is
    refused at open already; one that does not was not.)"""
    s = LocalDirStore(tmp_path, "ns", max_bytes=3 * FILE)
    for i in range(3):
        s.put(key(i), data(i))
    big = np.zeros(4 * BLOCK, np.uint8)
    with pytest.raises(StorageError, match=rf"its file of {HEADER_SIZE + 4 * BLOCK:,} bytes "
                                           rf"is larger than the store's budget of "
                                           rf"{3 * FILE:,} bytes"):
        s.put(key(9), big)
    assert (s.num_blocks, s.num_bytes, s.stats.evicted) == (3, 3 * FILE, 0)
    assert all(get(s, i) for i in range(3)) and s.exists([key(9)]) == [False]
    assert s.stats.errors == 1
    s.put(key(3), data(3))  # the budget still works as before
    assert s.exists([key(i) for i in range(4)]) == [False, True, True, True]


def test_budget_is_shared_by_the_writers(tmp_path: Path) -> None:
    s = open_store(file_url(tmp_path) + "?max_bytes=1000", "ns", writers=4)
    assert isinstance(s, LocalDirStore) and s.max_bytes == 250
    s = open_store(file_url(tmp_path) + "?max_gb=1", "ns")
    assert s.max_bytes == 1 << 30  # type: ignore[attr-defined]
    s = open_store(file_url(tmp_path), "ns")
    assert 0 < s.max_bytes <= shutil.disk_usage(tmp_path).free  # type: ignore[attr-defined]


def test_a_store_indexed_later_on_a_full_disk_keeps_its_open_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store without a rank takes its budget at its first put, from the free space
    then: a disk full at that moment made a budget of 0 for good (each put evicted every
    other block: the store held one). It keeps the share it measured at open then."""
    from zkv.storage import local

    s = open_store(file_url(tmp_path), "ns")
    monkeypatch.setattr(local, "free_bytes", lambda path: 0)  # full just then
    for i in range(5):
        s.put(key(i, 0), data(i))
    assert s.num_blocks == 5 and s.max_bytes > 0  # type: ignore[attr-defined]


def test_a_budget_that_holds_no_block_on_each_writer_is_refused(tmp_path: Path) -> None:
    """It would store nothing, silently (under vLLM: ``max_gb=0.0001`` at TP 2)."""
    url = file_url(tmp_path) + "?max_bytes=1000"
    assert open_store(url, "ns", writers=2, block_bytes=500).max_bytes == 500  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"a budget of 333 bytes per writer \(3 writers\) "
                                          r"holds no block of 500 bytes; give a larger max_gb"):
        open_store(url, "ns", writers=3, block_bytes=500)


def test_a_restart_keeps_every_ranks_blocks(tmp_path: Path) -> None:
    """Two ranks share a directory and its budget, each ``max_bytes / 2``: after a restart
    each indexes its own files alone, so its first put evicts its own oldest block, not
    the other rank's. (Before, each indexed both ranks' files against half the budget and
    its first put removed blocks down to its share, the other rank's among them: of 20
    blocks, 11 were left and no prompt found whole on both ranks.)"""
    url = file_url(tmp_path) + f"?max_bytes={20 * FILE}"

    def ranks() -> list[LocalDirStore]:
        return [open_store(url, "ns", writers=2, rank=r) for r in (0, 1)]  # type: ignore[misc]

    first = ranks()
    base = time.time() - 100
    for i in range(10):
        for r, s in enumerate(first):
            s.put(key(i, r), data(i))
            os.utime(s.path(key(i, r)), (base + i, base + i))  # block 0 the oldest
    again = ranks()
    assert [(s.num_blocks, s.num_bytes) for s in again] == [(10, 10 * FILE)] * 2
    for r, s in enumerate(again):
        s.put(key(10, r), data(10))  # over its share by one: its own oldest goes
    for r, s in enumerate(again):
        assert s.exists([key(i, r) for i in range(11)]) == [False] + [True] * 10
        assert s.stats.evicted == 1
    assert again[0].count_leading([i.to_bytes(16, "big") for i in range(1, 11)], 2) == 10
    reader = open_store(url, "ns", writers=2)  # the scheduler's: it indexes every file
    assert reader.num_blocks == 20  # type: ignore[attr-defined]


def test_fsync_makes_the_rename_durable_too(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``fsync=1``: the block's data, then the folder that holds its new name, and the
    folders a put made in their parents (a crash after a put returned must find the file
    there, not only its data on the disk)."""
    import stat as st

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        synced.append(os.readlink(f"/proc/self/fd/{fd}") + ("/" if st.S_ISDIR(mode) else ""))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    s = LocalDirStore(tmp_path / "root", "ns", fsync=True)
    path = s.path(key(1))
    folder = os.path.dirname(path)
    ns = os.path.dirname(folder)  # the open made ns/: its parent's entry
    assert synced == [os.path.dirname(ns) + "/"], synced
    synced.clear()
    s.put(key(1), data(1))  # the put made ns/xx/: its parent's entry,
    assert synced[:1] == [ns + "/"], synced  # then the data,
    assert synced[1] == f"{path}.{os.getpid()}.{threading.get_ident()}.tmp", synced
    assert synced[2:] == [folder + "/"], synced  # then the name the rename gave it
    synced.clear()
    s.put(key(2), data(2))  # the folder is there: the data and the new name
    assert len(synced) == 2 and synced[1] == folder + "/", synced
    nosync = LocalDirStore(tmp_path / "other", "ns")
    synced.clear()
    nosync.put(key(1), data(1))
    assert synced == []


def test_a_symlink_loop_in_the_store_is_skipped_at_open(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "ns")
    s.put(key(1), data(1))
    loop = os.path.join(os.path.dirname(s.path(key(1))), "loop.0")
    os.symlink(loop, loop)  # stat: ELOOP
    again = LocalDirStore(tmp_path, "ns")
    assert again.num_blocks == 1 and get(again, 1)


def test_a_root_that_is_a_file_is_logged_at_open_fails_puts_and_misses_reads(
        tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    why = f"store directory {blocker}: exists and is not a directory"
    with pytest.raises(ConfigError, match=f"^{why}$"):
        check_root(str(blocker))  # what `zkv replay` refuses the flag with
    with pytest.raises(ConfigError, match=r"/file/l3: cannot create it \(Not a directory\)$"):
        check_root(str(blocker / "l3"))
    with capture_logs() as logs:  # an engine serves on, as with a server down at start
        s = LocalDirStore(blocker, "ns")
    assert [(e["event"], e["log_level"], e["error"]) for e in logs] == [
        ("storage.store_unreachable", "error", why)]
    with pytest.raises(StorageError, match=f"put ns/{key(1)[:16].hex()}/0"):
        s.put(key(1), data(1))
    assert s.exists([key(1)]) == [False]
    with pytest.raises(StorageError, match="Not a directory"):
        get(s, 1)
    assert s.stats.errors == 2
    with pytest.raises(ValueError):
        LocalDirStore(tmp_path, "a/b")
    nested = tmp_path / "a" / "b" / "l3"
    with capture_logs() as logs:
        LocalDirStore(nested, "ns")  # a missing root is made, quietly
    assert nested.is_dir() and logs == []


def test_unreadable_block_raises(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "ns")
    s.put(key(1), data(1))
    os.remove(s.path(key(1)))
    os.mkdir(s.path(key(1)))  # opens, but cannot be read (also for root)
    with pytest.raises(StorageError, match="Is a directory"):
        s.get_into(key(1), np.zeros(BLOCK, np.uint8))


def test_fsync_and_typed_buffers(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "ns", fsync=True)
    src = np.arange(BLOCK // 2, dtype=np.float16)
    s.put(key(7), memoryview(src))
    dst = np.zeros(BLOCK // 2, dtype=np.float16)
    assert s.get_into(key(7), memoryview(dst)) and np.array_equal(src, dst)


def test_what_the_store_makes_is_private_to_its_user(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)  # made by someone else: left as it is
    old = os.umask(0)  # not the umask's doing
    try:
        s = LocalDirStore(shared / "zkv" / "l3", "ns", max_bytes=8 * FILE)
        s.put(key(1), data(1))
    finally:
        os.umask(old)
    made = [shared / "zkv", shared / "zkv" / "l3", shared / "zkv" / "l3" / "ns"]
    mark = made[-1] / namespaces.MARK
    made += [p for p in made[-1].iterdir() if p != mark]  # the fan-out folder
    files = [p for p in made[-1].iterdir()]
    assert len(made) == 4 and len(files) == 1 and get(s, 1)
    assert {oct(p.stat().st_mode & 0o777) for p in made} == {"0o700"}
    assert {oct(p.stat().st_mode & 0o777) for p in (files[0], mark)} == {"0o600"}
    assert oct(shared.stat().st_mode & 0o777) == "0o755"


def test_a_put_landing_during_an_eviction_survives(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An eviction takes a file out of the index, then unlinks it: a put of the same key
    that lands in between keeps its new file, which reads back bit for bit, and the
    index matches the disk. (Before, the eviction unlinked the new file: indexed, gone,
    a miss.) The window is held open by an Event, not by timing."""
    s = LocalDirStore(tmp_path, "ns", max_bytes=2 * FILE)
    s.put(key(1), data(1))  # least recently used: the one the put of key 2 evicts
    s.put(key(0), data(0))
    fresh = np.random.default_rng(7).integers(0, 256, BLOCK, dtype=np.uint8)
    in_window, resume = threading.Event(), threading.Event()
    unlink = s._remove_files

    def at_the_window(victims: list[tuple[str, int]]) -> None:
        if s.path(key(1)) in [p for p, _ in victims]:  # out of the index, not yet unlinked
            in_window.set()
            assert resume.wait(10), "never resumed"
        unlink(victims)

    monkeypatch.setattr(s, "_remove_files", at_the_window)
    evicting = threading.Thread(target=s.put, args=(key(2), data(2)))
    evicting.start()
    try:
        assert in_window.wait(10), "the eviction of key 1 never started"
        s.put(key(1), fresh)  # the re-put lands (key 0 makes room for it)
    finally:
        resume.set()
        evicting.join(10)
    assert not evicting.is_alive()
    out = np.zeros(BLOCK, np.uint8)
    assert s.get_into(key(1), out) and out.tobytes() == fresh.tobytes()
    assert get(s, 2) and not get(s, 0)
    on_disk = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                     if f != namespaces.MARK)
    assert on_disk == sorted([s.path(key(1)), s.path(key(2))])
    assert (s.num_blocks, s.num_bytes, s.stats.evicted) == (2, 2 * FILE, 1)


def test_a_put_landing_during_a_missed_read_stays_indexed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read misses (no file), and a put of that key renames its file in and indexes it
    before the read unindexes the missing path: the put's entry stays, so the budget
    still covers the file. (Before, the read dropped it: the file stayed on disk out of
    the index, past the budget, never evicted.) The window is entered in the reading
    thread itself, deterministically: the put runs where the miss is counted."""
    s = LocalDirStore(tmp_path, "ns", max_bytes=2 * FILE)
    count = s._count

    def at_the_miss(**deltas: int) -> None:
        count(**deltas)
        if deltas.get("misses"):
            s.put(key(5), data(5))  # lands after the read's open failed

    monkeypatch.setattr(s, "_count", at_the_miss)
    assert not get(s, 5)
    monkeypatch.setattr(s, "_count", count)
    assert (s.num_blocks, s.num_bytes) == (1, FILE)
    s.put(key(6), data(6))
    s.put(key(7), data(7))  # over budget: key 5, the oldest, is evicted from the disk too
    on_disk = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                     if f != namespaces.MARK)
    assert on_disk == sorted([s.path(key(6)), s.path(key(7))])


def test_remove_and_a_put_of_the_same_key_leave_the_index_and_the_disk_agreeing(
        tmp_path: Path) -> None:
    """Removes and puts of one key from two threads: whatever order they land in, a file
    on disk is in the index and an indexed file is on disk."""
    s = LocalDirStore(tmp_path, "ns", max_bytes=64 * FILE)
    stop = threading.Event()

    def remover() -> None:
        while not stop.is_set():
            s.remove(key(9))

    t = threading.Thread(target=remover)
    t.start()
    try:
        for _ in range(300):
            s.put(key(9), data(9))
    finally:
        stop.set()
        t.join(10)
    on_disk = os.path.exists(s.path(key(9)))
    assert s.num_blocks == int(on_disk), (s.num_blocks, on_disk)


def test_a_hit_evicted_before_it_is_touched_is_not_indexed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read hits key 0; before it marks the file as used, another thread's put evicts
    and unlinks it. The read must not put the gone file back in the index: it counted
    against the budget, and indexing it evicted a live file (key 1)."""
    s = LocalDirStore(tmp_path, "ns", max_bytes=2 * FILE, rank=0)
    s.put(key(0), data(0))
    s.put(key(1), data(1))
    at_touch, resume = threading.Event(), threading.Event()
    touch = s._touch

    def late_touch(path: str, size: int) -> None:
        at_touch.set()
        assert resume.wait(10), "never resumed"
        touch(path, size)

    monkeypatch.setattr(s, "_touch", late_touch)
    out = np.zeros(BLOCK, np.uint8)
    hits: list[bool] = []
    reader = threading.Thread(target=lambda: hits.append(s.get_into(key(0), out)))
    reader.start()
    try:
        assert at_touch.wait(10), "the read never got to its touch"
        s.put(key(2), data(2))  # evicts key 0, the least recently used: unlinked
        assert not os.path.exists(s.path(key(0)))
    finally:
        resume.set()
        reader.join(10)
    assert hits == [True] and out.tobytes() == data(0).tobytes()
    on_disk = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                     if f != namespaces.MARK)
    assert on_disk == sorted([s.path(key(1)), s.path(key(2))])
    assert (s.num_blocks, s.num_bytes) == (2, 2 * FILE)
    assert get(s, 1) and get(s, 2)


class _StatCounting:
    """``os.scandir`` whose entries note each ``stat`` (the real entries underneath)."""

    def __init__(self, statted: list[str]) -> None:
        self.real, self.statted = os.scandir, statted

    def __call__(self, path: str) -> _StatCounting._Entries:
        return self._Entries(self.real(path), self.statted)

    class _Entries:
        def __init__(self, it: Any, statted: list[str]) -> None:
            self.it, self.statted = it, statted

        def __enter__(self) -> _StatCounting._Entries:
            return self

        def __exit__(self, *_: object) -> None:
            self.it.close()

        def __iter__(self) -> Iterator[Any]:
            return (_StatCounting._Entry(e, self.statted) for e in self.it)

    class _Entry:
        def __init__(self, entry: os.DirEntry[str], statted: list[str]) -> None:
            self.entry, self.statted = entry, statted

        def __getattr__(self, name: str) -> Any:
            return getattr(self.entry, name)

        def stat(self, **kw: Any) -> os.stat_result:
            self.statted.append(self.entry.path)
            return self.entry.stat(**kw)


def _open_counting_stats(monkeypatch: pytest.MonkeyPatch, root: Path,
                         **kw: Any) -> tuple[LocalDirStore, list[str]]:
    """Open a store; the files under its namespace it ``stat``-ed doing so (through a
    directory entry or ``os.stat``), sorted."""
    statted: list[str] = []
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        statted.append(os.fspath(path))
        return real_stat(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "scandir", _StatCounting(statted))
        m.setattr(os, "stat", stat)
        s = LocalDirStore(root, "ns", **kw)
    ns = str(root / "ns")
    return s, sorted(p for p in statted if os.path.dirname(os.path.dirname(p)) == ns)


def _stale_tmp(s: LocalDirStore, i: int) -> str:
    tmp = s.path(key(i)) + ".123.456.tmp"
    Path(tmp).write_bytes(b"partial")
    os.utime(tmp, (time.time() - 3600, time.time() - 3600))
    return tmp


def test_a_rank_stats_its_own_files_alone_at_open(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The names are read first: a rank's store ``stat``-s its own files (and temp files,
    for their age), none of another rank's, and indexes what it did before. (Before, it
    ``stat``-ed every file and filtered after: a rank owning none of 1M files took 2.9 s
    to open.)"""
    for r in (1, 2):
        other = LocalDirStore(tmp_path, "ns", max_bytes=100 * FILE, rank=r)
        for i in range(20):
            other.put(key(i, r), data(i))
    mine = LocalDirStore(tmp_path, "ns", max_bytes=100 * FILE, rank=0)
    base = time.time() - 100
    for i, age in enumerate((3, 1, 0, 2)):  # LRU order by mtime: 0, 3, 1, 2
        mine.put(key(i), data(i))
        os.utime(mine.path(key(i)), (base - age, base - age))
    stale = _stale_tmp(mine, 9)
    s, statted = _open_counting_stats(monkeypatch, tmp_path, max_bytes=4 * FILE, rank=0)
    assert statted == sorted([*(mine.path(key(i)) for i in range(4)), stale])
    assert not os.path.exists(stale)
    assert (s.num_blocks, s.num_bytes) == (4, 4 * FILE)
    s.put(key(4), data(4))  # over budget by one: its own oldest, key 0, goes
    assert s.exists([key(i) for i in range(5)]) == [False, True, True, True, True]
    assert other.exists([key(i, 2) for i in range(20)]) == [True] * 20


def test_a_store_without_a_rank_indexes_only_when_asked(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader (no rank: the scheduler's) builds no index at open: it ``stat``-s no block
    file and holds none in memory, removes stale temp files as before, and answers
    existence queries and reads without one. Asked ``num_blocks`` (or at a first put) it
    indexes every rank's files, with its hits as recent as a restart would find them.
    (Before, it indexed every file at open: 1.7 s and 119 MiB for 400k files, unused.)"""
    writers = [LocalDirStore(tmp_path, "ns", max_bytes=100 * FILE, rank=r) for r in (0, 1)]
    base = time.time() - 100
    for i in range(3):
        for r, w in enumerate(writers):
            w.put(key(i, r), data(i))
            os.utime(w.path(key(i, r)), (base + i, base + i))  # key 0 the oldest
    stale = _stale_tmp(writers[0], 9)
    s, statted = _open_counting_stats(monkeypatch, tmp_path, max_bytes=6 * FILE)
    assert statted == [stale] and not os.path.exists(stale)
    assert not s._indexed and len(s._lru) == 0
    hashes = [i.to_bytes(16, "big") for i in range(4)]
    assert s.count_leading(hashes, 2) == 3 and s.exists([key(0, 1), key(3, 1)]) == [True, False]
    assert get(s, 0) and not get(s, 3)  # the hit refreshes key 0's mtime
    assert not s._indexed and len(s._lru) == 0
    assert (s.num_blocks, s.num_bytes) == (6, 6 * FILE)
    s.put(key(5), data(5))  # over budget by one: the oldest, rank 1's key 0 (rank 0's was hit)
    assert s.exists([key(0), key(0, 1), key(1), key(1, 1)]) == [True, False, True, True]
    assert s.stats.evicted == 1 and s.num_blocks == 6


def test_a_corrupt_block_under_a_non_utf8_root_is_a_logged_miss(tmp_path: Path) -> None:
    # The store's url held the raw path (a surrogate where the byte is not UTF-8): logging
    # the refusal raised TypeError out of get_many_into and the bad file stayed.
    root = os.path.join(os.fsencode(tmp_path), b"l3-\xff")
    os.mkdir(root)
    zlog.configure("worker", rank=0, log_dir=str(tmp_path / "logs"))
    try:
        store = LocalDirStore(os.fsdecode(root), "ns", rank=0)
        store.put(key(1), data(1))
        [path] = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                  if f.endswith(b".0")]
        os.truncate(path, 10)
        assert store.get_many_into([key(1)], [np.zeros(BLOCK, np.uint8)]) == [False]
        assert not os.path.exists(path)
        store.close()
    finally:
        zlog.close()
        structlog.reset_defaults()
    records = [orjson.loads(x) for x in (tmp_path / "logs" / "worker-0.jsonl").read_bytes()
               .splitlines()]
    [refused] = [r for r in records if r["event"] == "storage.block_refused"]
    assert refused["store"] == store.url == file_url(os.fsdecode(root))
    assert refused["store"].endswith("/l3-%FF")
