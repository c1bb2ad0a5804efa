"""The scheduler's existence query on a ``file://`` store whose file system hangs (an NFS
server gone, a hard mount): a ``stat`` there blocks for good, inside the engine's
scheduling step, and nothing times it out. With a ``query_timeout_s`` (the default on a
network or FUSE file system) the query runs on a thread of its own and answers misses
after that long, and at once while it stays stuck; it says so once, and when it returns.
Closing the store there returns too.

No network file system can be mounted here: the hang is a ``stat`` of the store's own
paths that blocks until the test lets it go (every other path is stat'ed as usual)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.waiting import wait_until
from zkv.storage import LocalDirStore, open_store, pack_key
from zkv.storage.localfs import QUERY_TIMEOUT_S, fs_type, may_hang
from zkv.storage.query import StorageQuery

MOUNTS = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /mnt/kv rw,relatime shared:20 - nfs4 srv:/export rw,vers=4.2
41 40 0:51 / /mnt/kv/local rw shared:21 - tmpfs tmpfs rw
42 22 0:52 / /mnt/my\\040fuse rw shared:22 - fuse.sshfs host:/ rw
"""


def test_the_file_system_type_of_a_path_is_its_longest_mount(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTS)
    kinds = {p: fs_type(p, str(info)) for p in
             ("/srv/l3", "/mnt/kv", "/mnt/kv/l3", "/mnt/kv/local/l3", "/mnt/kvx",
              "/mnt/my fuse/l3")}
    assert kinds == {"/srv/l3": "ext4", "/mnt/kv": "nfs4", "/mnt/kv/l3": "nfs4",
                     "/mnt/kv/local/l3": "tmpfs", "/mnt/kvx": "ext4",
                     "/mnt/my fuse/l3": "fuse.sshfs"}
    assert [may_hang(k) for k in kinds.values()] == [False, True, True, False, False, True]
    assert fs_type("/x", str(tmp_path / "none")) is None and not may_hang(None)


def test_the_bound_is_on_by_default_where_a_stat_can_hang_only(tmp_path: Path) -> None:
    assert not may_hang(fs_type(str(tmp_path)))  # (this machine's tmp: a local one)
    assert LocalDirStore(tmp_path / "a", "ns", rank=0).query_timeout_s is None
    s = open_store(f"file://{tmp_path / 'b'}?query_timeout_s=0.25", "ns")
    assert s.query_timeout_s == 0.25
    s.close()
    assert QUERY_TIMEOUT_S == 1.0


def test_a_query_stuck_on_a_hung_file_system_answers_misses_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "l3"
    store = LocalDirStore(root, "ns", rank=0, query_timeout_s=0.3)
    digests = [bytes([i]) * 16 for i in range(3)]
    for d in digests:
        store.put(pack_key(d, 0), np.full(64, 1, np.uint8))
    query = StorageQuery(store, 1)
    assert query(digests) == 3

    hung = threading.Event()
    real = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).startswith(str(root)):
            hung.wait(30)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    try:
        with capture_logs() as logs:
            t0 = time.monotonic()
            assert query(digests) == 0  # a miss after query_timeout_s, not a hung step
            assert 0.3 <= time.monotonic() - t0 < 5.0
            t1 = time.monotonic()
            assert query(digests) == 0  # still stuck: at once
            assert time.monotonic() - t1 < 0.2
            stuck = [e for e in logs if e["event"] == "storage.query_stuck"]
            assert len(stuck) == 1 and stuck[0]["num_blocks"] == 3, logs
            # both answered misses for want of an answer: failed queries, as the metric
            # (zkv:store_query_failures_total) and the replay's summary count them
            assert store.stats.query_failures == 2
            failed = [e for e in logs if e["event"] == "storage.query_failed"]
            assert failed and "hangs" in failed[0]["error"], logs
            hung.set()  # the file system answers again
            wait_until(lambda: any(e["event"] == "storage.query_unstuck" for e in logs),
                       10, "the stuck query to return")
    finally:
        hung.set()
        monkeypatch.undo()
    assert query(digests) == 3  # answered again
    assert store.stats.query_failures == 2
    store.close()


def test_closing_a_store_on_a_hung_file_system_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's stop leaves hung I/O calls behind after ``close_wait_s`` so that a dead
    mount cannot keep a rank alive; the store's own close then marked the namespace (a
    ``utime`` there) and let its hold go in the caller's thread, unbounded: the rank hung
    at its very last step. It waits ``close_wait_s`` for them now, says so, and the hold
    is let go once the file system answers."""
    root = tmp_path / "l3"
    store = LocalDirStore(root, "ns", rank=0)
    key = pack_key(bytes(16), 0)
    store.put(key, np.ones(64, np.uint8))
    monkeypatch.setattr(LocalDirStore, "close_wait_s", 1.0)
    hung = threading.Event()
    real_utime, real_stat = os.utime, os.stat

    def utime(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).startswith(str(root)):
            hung.wait(30)  # the mount stopped answering
        real_utime(path, *args, **kwargs)

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).startswith(str(root)):
            hung.wait(30)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "utime", utime)
    monkeypatch.setattr(os, "stat", stat)
    fds = len(os.listdir("/proc/self/fd"))
    call = threading.Thread(target=store.exists, args=([key],), daemon=True)
    call.start()  # a call of the store's, hung on the mount too
    wait_until(lambda: store.num_calls == 1, 10, "the call to start")
    try:
        with capture_logs() as logs:
            t0 = time.monotonic()
            store.close()
            took = time.monotonic() - t0
        # one close_wait_s in all, for the hung call and the last mark alike (it waited
        # for each in turn: twice as long)
        assert 1.0 <= took < 1.8, took
        (warned,) = [e for e in logs if e["event"] == "storage.close_timeout"]
        assert "hung mount" in warned["error"] and warned["waited_s"] == 1.0
    finally:
        hung.set()
        call.join(10)
    wait_until(lambda: len(os.listdir("/proc/self/fd")) < fds, 10, "the hold to be let go")
