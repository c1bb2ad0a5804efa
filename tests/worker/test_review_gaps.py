"""From a mutation review, what no test checked: a storage op of several chunks is reported
once, after its last; a store directory with an '@'; a malformed batch past the expected
seq is a gap; a quota-full disk (EDQUOT) makes room as a full one does. And a store read
hung on the file system is said."""
from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

import orjson
import pytest

from tests.waiting import idle_for, wait_until
from tests.worker.test_actor import _batch_frames, raw  # noqa: F401 (fixture)
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.exit_codes import EXIT_SEQ_GAP
from zkv.kernels import TorchCpuBackend
from zkv.storage import LocalDirStore, pack_key
from zkv.worker.storage_io import StorageIO

LAYOUT = CacheLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float32",
                     num_device_blocks=8, num_host_blocks=8)


def test_an_op_of_several_chunks_is_reported_once_after_its_last_chunk(tmp_path: Path) -> None:
    b = TorchCpuBackend()
    pool = b.allocate_host_pool(LAYOUT)
    store = LocalDirStore(tmp_path, "ns")
    io = StorageIO(store, 0, b, pool, io_threads=2, chunk_blocks=2)
    try:
        keys = tuple(bytes([i]) * 16 for i in range(5))
        _, pending = io.start(0, [P.Op(7, P.H2S, src=P.as_ids(range(5)), keys=keys)])
        assert pending == (7,)
        got: list = []

        def last_reported() -> bool:
            got.extend(io.take_done())
            return any(not left for _, _, left in got)

        wait_until(last_reported, 10, "the op's last chunk")
        idle_for(0.2, beat=lambda: got.extend(io.take_done()))  # nothing more comes
        results = [r for _, rs, _ in got for r in rs]
        assert len(results) == 1, results
        assert results[0].ok and results[0].done == 5
        assert all(store.exists([pack_key(k, 0) for k in keys]))
    finally:
        io.close()


def test_an_op_is_not_reported_while_its_last_chunk_still_reads(tmp_path: Path) -> None:
    """An s2h of 5 blocks in chunks of 2: while the last chunk's read hangs (its block file
    is a FIFO: ``open`` waits), the op is not reported; the blocks not read yet count as
    done only once read (an early report said ``done == 5`` with block 4 never loaded).
    Then the read returns (refused: a FIFO is no block file) and the op fails at block 4."""
    b = TorchCpuBackend()
    pool = b.allocate_host_pool(LAYOUT)
    store = LocalDirStore(tmp_path, "ns", rank=0)
    keys = tuple(bytes([i + 1]) * 16 for i in range(5))
    src = b.allocate_host_pool(LAYOUT)
    assert all(store.put_many([pack_key(k, 0) for k in keys[:4]],
                              [b.host_block(src, i) for i in range(4)]))
    fifo = store.path(pack_key(keys[4], 0))
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    os.mkfifo(fifo)
    io = StorageIO(store, 0, b, pool, io_threads=1, chunk_blocks=2)
    try:
        _, pending = io.start(0, [P.Op(7, P.S2H, dst=P.as_ids(range(5)), keys=keys)])
        assert pending == (7,)
        wait_until(lambda: [(lo, hi) for _, _, lo, hi in io._running.values()] == [(4, 5)],
                   10, "the last chunk's read to hang")
        assert io.take_done() == [], "the op was reported before its last chunk ran"
        with open(fifo, "wb"):  # the read returns
            pass
        got: list = []
        wait_until(lambda: got.extend(io.take_done()) or got, 10, "the op's result")
        [(seq, [res], left)] = got
        assert (seq, res.id, res.ok, res.done, left) == (0, 7, False, 4, ())
    finally:
        with contextlib.suppress(OSError):  # never leave the I/O thread in open() at close
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        io.close()


def test_a_read_hung_on_the_file_system_is_said_once_and_when_it_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ``file://`` store whose block file is a FIFO: the read hangs in ``open`` as on
    a hung file system (nothing times it out). Past ``IO_STUCK_S`` a check says it once,
    with what is queued behind it; when it returns, that is said too, and the op fails."""
    from structlog.testing import capture_logs

    from zkv.worker import storage_io

    monkeypatch.setattr(storage_io, "IO_STUCK_S", 0.2)
    b = TorchCpuBackend()
    pool = b.allocate_host_pool(LAYOUT)
    store = LocalDirStore(tmp_path, "ns", rank=0)
    keys = (b"\1" * 16, b"\2" * 16)
    fifo = store.path(pack_key(keys[0], 0))
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    os.mkfifo(fifo)
    io = StorageIO(store, 0, b, pool, io_threads=1, chunk_blocks=1)
    try:
        with capture_logs() as logs:
            _, pending = io.start(3, [P.Op(7, P.S2H, dst=P.as_ids([0, 1]), keys=keys)])
            assert pending == (7,)
            wait_until(lambda: io.check_stuck(time.monotonic()) or any(
                e["event"] == "worker.io_stuck" for e in logs), 10, "the hung read said")
            io.check_stuck(time.monotonic() + 60)  # said once, however long it hangs
            with open(fifo, "wb"):  # the read returns (an empty FIFO: refused, not a block)
                pass
            got: list = []
            wait_until(lambda: got.extend(io.take_done()) or got, 10, "the op's result")
        [(seq, [res], left)] = got
        assert (seq, res.id, res.ok, res.done, left) == (3, 7, False, 0, ())
        [stuck] = [e for e in logs if e["event"] == "worker.io_stuck"]
        assert (stuck["seq"], stuck["op_id"], stuck["blocks"], stuck["num_stuck"],
                stuck["num_queued"]) == (3, 7, [0, 1], 1, 1)  # the other chunk waits
        assert stuck["store"] == store.url and stuck["running_s"] >= 0.2
        [unstuck] = [e for e in logs if e["event"] == "worker.io_unstuck"]
        assert (unstuck["seq"], unstuck["blocks"], unstuck["log_level"]) == (3, [0, 1], "info")
    finally:
        with contextlib.suppress(OSError):  # never leave the I/O thread in open() at close
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        io.close()


def test_a_store_directory_with_an_at_sign_is_accepted() -> None:
    from zkv.security import redact_credentials
    from zkv.storage.url import parse_url

    assert parse_url("file:///srv/kv@1/l3")[1]["root"] == "/srv/kv@1/l3"
    assert redact_credentials("file:///srv/kv@1/l3") == "file:///srv/kv@1/l3"


def test_a_malformed_batch_past_the_expected_seq_is_a_gap(raw) -> None:  # noqa: F811
    fake, sc = raw
    fake.send(_batch_frames(0))
    frames = _batch_frames(2, (P.Op(4, P.D2H, P.as_ids([0]), P.as_ids([0])),))
    hdr = orjson.loads(frames[1])
    hdr["v"] = 99
    fake.send([frames[0], orjson.dumps(hdr), *frames[2:]])
    wait_until(lambda: not sc.alive, 5, "the actor to stop on the gap")
    assert sc.actor.exit_code == EXIT_SEQ_GAP


def test_a_quota_full_disk_makes_room_from_the_stores_own_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import zkv.storage.local as local

    s = LocalDirStore(tmp_path, "ns", max_bytes=1 << 20)
    key = lambda i: pack_key(i.to_bytes(16, "big"), 0)  # noqa: E731
    for i in range(3):
        s.put(key(i), bytes(1000))
    real, fails = os.writev, [1]

    def writev(fd, bufs):  # the quota is hit once
        if fails:
            fails.pop()
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return real(fd, bufs)

    monkeypatch.setattr(local.os, "writev", writev)
    s.put(key(9), bytes(1000))
    assert s.exists([key(9)]) == [True]
    assert s.exists([key(0)]) == [False]  # the least recently used one made room
    assert s.max_bytes < 1 << 20
    # a quota's budget does not grow back (statvfs cannot see the quota: it grew back into
    # it a minute on, a disk_full warning and a regrown line every minute for good)
    lowered = s.max_bytes
    monkeypatch.setattr(local, "_REGROW_S", 0.0)
    s.put(key(10), bytes(1000))
    assert s.max_bytes == lowered


def test_a_store_that_refuses_the_host_pool_leaks_no_fd(tmp_path: Path) -> None:
    """A store that refuses ``register_buffer`` (Mooncake's client answering rc != 0 raises
    this StorageError): the I/O pool's wake pipe was made first and never closed, two fds
    a refused start (the actor stops; a sidecar may be made again)."""
    from zkv.errors import StorageError

    class Refusing(LocalDirStore):
        def register_buffer(self, ptr: int, nbytes: int) -> None:
            raise StorageError(f"{self.url}: register_buffer returned -1")

    b = TorchCpuBackend()
    pool = b.allocate_host_pool(LAYOUT)
    store = Refusing(tmp_path, "ns")
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            with pytest.raises(StorageError, match="register_buffer returned -1"):
                StorageIO(store, 0, b, pool, io_threads=1)
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        store.close()
