"""A rank's storage I/O (s2h / h2s) off the actor thread.

::

    actor thread                          I/O threads (io_threads)             actor thread
    ────────────                          ────────────────────────             ────────────
    batch seq: copies, ack copies ──┐
      + pending=[s2h, h2s op ids]   └─► start(seq, ops): one task per chunk of
                                        ``chunk_blocks`` blocks of an op
                                        store.get_many_into / put_many
                                        (one batched call per chunk)
                                        last chunk of an op ─► done queue + wake fd ─► take_done()
    next batch's copies run meanwhile                                            ack(seq, results,
                                                                                     pending=rest)

An op's result is the prefix of its blocks that succeeded (``done``) and the first
failure's reason. The actor never waits on a store: a slow or dead store delays only the
ack of its own ops, never a later batch's copies or the heartbeats. The host blocks of an
op in flight are not touched by later batches (the scheduler pins them until the op is
acked), so the copies and the I/O never race on a block.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zkv import protocol as P
from zkv.errors import StorageError
from zkv.storage import Store, pack_key

IO_KINDS = (P.S2H, P.H2S)


@dataclass(slots=True)
class _Job:
    """One s2h / h2s op of one batch: per-block outcomes, filled chunk by chunk."""

    seq: int
    op: P.Op
    outcome: list[str | None]
    left: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    def result(self) -> P.OpResult:
        done = 0
        for why in self.outcome:
            if why is not None:
                return P.OpResult(self.op.id, False, done, why)
            done += 1
        return P.OpResult(self.op.id, True, done)


class StorageIO:
    """Runs s2h / h2s ops of one rank on a thread pool and hands their results back to
    the actor thread through :meth:`take_done`, waking it through :attr:`wake_fd`.

    Invariants: every started op is reported exactly once; results of one seq come in
    the order their ops finished. ``start`` is O(chunks); ``take_done`` O(results).
    """

    def __init__(self, store: Store, rank: int, backend: Any, host_pool: Any, *,
                 io_threads: int = 4, chunk_blocks: int = 32) -> None:
        self.store = store
        self.rank = rank
        self.backend = backend
        self.host_pool = host_pool
        self.chunk_blocks = chunk_blocks
        self._pool = cf.ThreadPoolExecutor(io_threads, thread_name_prefix=f"zkv-io-{rank}")
        self._done: collections.deque[tuple[int, P.OpResult]] = collections.deque()
        self._pending: dict[int, set[int]] = {}
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        ptr, nbytes = getattr(host_pool, "data_ptr", None), getattr(host_pool, "nbytes", None)
        if ptr is not None and nbytes:
            store.register_buffer(int(ptr()), int(nbytes))

    @property
    def num_pending(self) -> int:
        """Ops started and not yet taken back."""
        return sum(len(ids) for ids in self._pending.values())

    def start(self, seq: int, ops: Sequence[P.Op]) -> tuple[list[P.OpResult], tuple[int, ...]]:
        """Start ``ops`` (all s2h / h2s) of batch ``seq``; returns results known at once
        (empty ops) and the ids of the ops whose results :meth:`take_done` gives later."""
        now: list[P.OpResult] = []
        started: list[int] = []
        for op in ops:
            n = op.num_blocks
            if n == 0:
                now.append(P.OpResult(op.id, True, 0))
                continue
            step = self.chunk_blocks
            job = _Job(seq, op, [None] * n, -(-n // step))
            started.append(op.id)
            for lo in range(0, n, step):
                self._pool.submit(self._run_chunk, job, lo, min(n, lo + step))
        if started:
            self._pending[seq] = set(started)
        return now, tuple(started)

    def take_done(self) -> list[tuple[int, list[P.OpResult], tuple[int, ...]]]:
        """Finished ops grouped by seq: ``(seq, results, ids still pending for seq)``."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        by_seq: dict[int, list[P.OpResult]] = {}
        while self._done:
            seq, res = self._done.popleft()
            by_seq.setdefault(seq, []).append(res)
        out = []
        for seq, results in by_seq.items():
            left = self._pending.get(seq, set())
            left.difference_update(r.id for r in results)
            if not left:
                self._pending.pop(seq, None)
            out.append((seq, results, tuple(sorted(left))))
        return out

    def close(self) -> None:
        """Cancel chunks not started, wait for running ones (bounded by the store's own
        timeouts), close the wake pipe. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        os.close(self.wake_fd)
        os.close(self._wake_w)

    # ---------------------------------------------------------------- I/O threads

    def _run_chunk(self, job: _Job, lo: int, hi: int) -> None:
        try:
            job.outcome[lo:hi] = self._move(job.op, lo, hi)
        except BaseException as e:  # never lose a chunk: its blocks fail with the reason
            job.outcome[lo:hi] = [f"{job.op.kind}: block {lo}: {e!r}"] * (hi - lo)
        with job.lock:
            job.left -= 1
            last = job.left == 0
        if last:
            self._done.append((job.seq, job.result()))
            try:
                os.write(self._wake_w, b"\0")
            except OSError:  # pipe full (the actor wakes anyway) or closed at shutdown
                pass

    def _move(self, op: P.Op, lo: int, hi: int) -> list[str | None]:
        """Blocks ``lo..hi`` of ``op`` in one batched store call; None where it worked."""
        keys = [pack_key(op.keys[i], self.rank) for i in range(lo, hi)]
        put = op.kind == P.H2S
        ids = op.src if put else op.dst
        views = [self.backend.host_block(self.host_pool, int(ids[i])) for i in range(lo, hi)]
        refused = _num_refused(self.store)
        try:
            ok = self.store.put_many(keys, views) if put else self.store.get_many_into(keys, views)
        except StorageError as e:
            return [f"{op.kind}: block {lo}: {e}"] * (hi - lo)
        why = "declined by the store" if put else "is not in the store"
        if not put and _num_refused(self.store) > refused:  # (the store logged which, why)
            why = "is not in the store or was refused (damaged or foreign: storage.block_refused)"
        return [None if good else f"{op.kind}: block {i} ({op.keys[i].hex()}) {why}"
                for i, good in zip(range(lo, hi), ok)]


def _num_refused(store: Store) -> int:
    """Blocks the store refused on read so far (corrupt, truncated, foreign): a read that
    raised it refused some of its misses (or a concurrent read did: the error says "or")."""
    st = store.stats
    return st.corrupt + st.truncated + st.foreign
