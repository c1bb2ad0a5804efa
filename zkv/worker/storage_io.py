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
failure's reason. A store call that has not returned after ``IO_STUCK_S`` (a hung file
system under ``file://``: nothing times it out) is said once (``worker.io_stuck``: its
batch, op, blocks, how long, how many calls are stuck and queued behind them; its op's host
blocks stay pinned meanwhile), and when it returns (``worker.io_unstuck``). (Before: the
host pool filled with pinned blocks and nothing was said.) At a scheduler restart the
actor drains the old ops (:meth:`~StorageIO.drain`) before its hello: queued chunks cancelled,
running calls waited for while they are still said when stuck, and a stop still stops.

At a stop (:meth:`~StorageIO.close`) the running calls are waited for up to the store's
``close_wait_s``; one still running then (hung for good) is left to its thread and said
(``worker.io_abandoned``). The threads are daemon threads, not a ``ThreadPoolExecutor``'s:
those are joined at the interpreter's exit, so a call that never returns kept the rank
(or the engine process holding a sidecar) from ever exiting, whatever the signal.

The actor never waits on a store: a slow or dead store delays only the ack of its own ops,
never a later batch's copies or the heartbeats. The host blocks of an op in flight are not
touched by later batches (the scheduler pins them until the op is acked), so the copies
and the I/O never race on a block.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zkv import log as ev
from zkv import protocol as P
from zkv.errors import StorageError
from zkv.storage import Store, pack_key

IO_KINDS = (P.S2H, P.H2S)
IO_STUCK_S = 30.0  # a store call running this long is said (once; and when it returns)


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
                 io_threads: int = 4, chunk_blocks: int = 32, log: Any = None) -> None:
        self.store = store
        self._log = log if log is not None else ev.get_logger("worker", rank=rank)
        # store calls running: token -> (monotonic start, job, lo, hi); the ones said stuck
        self._running: dict[int, tuple[float, _Job, int, int]] = {}
        self._stuck: set[int] = set()
        self._tokens = itertools.count()
        self._tasks: collections.deque[tuple[_Job, int, int]] = collections.deque()  # queued
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # a store call returned
        self._work = threading.Condition(self._lock)  # a chunk queued, or closed
        self.rank = rank
        self.backend = backend
        self.host_pool = host_pool
        self.chunk_blocks = chunk_blocks
        ptr, nbytes = getattr(host_pool, "data_ptr", None), getattr(host_pool, "nbytes", None)
        if ptr is not None and nbytes:  # first: a store that refuses it (Mooncake) leaks
            store.register_buffer(int(ptr()), int(nbytes))  # no pipe
        self._threads = [threading.Thread(target=self._serve, daemon=True,
                                          name=f"zkv-io-{rank}-{i}") for i in range(io_threads)]
        self._done: collections.deque[tuple[int, P.OpResult]] = collections.deque()
        self._pending: dict[int, set[int]] = {}
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        for t in self._threads:
            t.start()

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
            with self._lock:
                self._tasks.extend((job, lo, min(n, lo + step)) for lo in range(0, n, step))
                self._work.notify(job.left)
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

    def drain(self, stop: threading.Event, every_s: float) -> bool:
        """(A rejoin: the ops are no one's.) Cancel the chunks not started and wait for the
        running ones, saying the stuck ones (:meth:`check_stuck`) every ``every_s``: a call
        hung on the file system is said, not waited on in silence. False if ``stop`` was set
        first (the calls still run: :meth:`close` with ``wait=False``)."""
        with self._lock:
            self._tasks.clear()
        while True:
            with self._lock:
                if self._idle.wait_for(lambda: not self._running, every_s):
                    return True
            if stop.is_set():
                return False
            self.check_stuck(time.monotonic())

    def close(self, wait: bool = True) -> int:
        """Cancel chunks not started, wait for running ones up to the store's
        ``close_wait_s`` unless not ``wait``, close the wake pipe. Returns the store calls
        still running, left to their threads (said: ``worker.io_abandoned``). Idempotent
        (0 after the first)."""
        with self._lock:  # (a chunk that ends later writes no wake-up: the fd may be reused)
            if self._closed:
                return 0
            self._closed = True
            self._tasks.clear()
            self._work.notify_all()
            if wait:
                self._idle.wait_for(lambda: not self._running, self.store.close_wait_s)
            os.close(self.wake_fd)
            os.close(self._wake_w)
            left = sorted(self._running.values(), key=lambda r: r[0])
        if not left:  # (idle threads end at once: none is left behind the rank's exit)
            for t in self._threads:
                t.join(1.0)
        else:
            t0, job, lo, hi = left[0]
            self._log.warning(ev.IO_ABANDONED, num_calls=len(left), seq=job.seq,
                              op_id=job.op.id, kind=job.op.kind, blocks=[lo, hi],
                              running_s=round(time.monotonic() - t0, 1), store=self.store.url,
                              error="store calls still running at the stop are left to their "
                                    "threads (a hung file system or server?)")
        return len(left)

    # ---------------------------------------------------------------- I/O threads

    def check_stuck(self, now: float) -> None:
        """(The actor, on its clock.) Say the store calls running for ``IO_STUCK_S`` that
        were not said yet: one line, the oldest one's details."""
        with self._lock:
            new = [(t0, tok) for tok, (t0, *_) in self._running.items()
                   if now - t0 >= IO_STUCK_S and tok not in self._stuck]
            if not new:
                return
            self._stuck.update(tok for _, tok in new)
            t0, tok = min(new)
            _, job, lo, hi = self._running[tok]
            num_stuck, queued = len(self._stuck), len(self._tasks)
        self._log.warning(ev.IO_STUCK, seq=job.seq, op_id=job.op.id, kind=job.op.kind,
                          blocks=[lo, hi], running_s=round(now - t0, 1), num_stuck=num_stuck,
                          num_queued=queued, store=self.store.url,
                          error=f"a store call has not returned for {now - t0:.0f} s (a hung "
                                "file system or server?): its op's host blocks stay pinned, "
                                "and other calls queue behind it")

    def _serve(self) -> None:
        """An I/O thread: chunks in the order queued, until closed."""
        while True:
            with self._lock:
                self._work.wait_for(lambda: self._tasks or self._closed)
                if not self._tasks:
                    return
                job, lo, hi = self._tasks.popleft()
                tok = next(self._tokens)
                self._running[tok] = (time.monotonic(), job, lo, hi)
            self._run_chunk(tok, job, lo, hi)

    def _run_chunk(self, tok: int, job: _Job, lo: int, hi: int) -> None:
        try:
            job.outcome[lo:hi] = self._move(job.op, lo, hi)
        except BaseException as e:  # never lose a chunk: its blocks fail with the reason
            job.outcome[lo:hi] = [f"{job.op.kind}: block {lo}: {e!r}"] * (hi - lo)
        with self._lock:
            t0, *_ = self._running.pop(tok)
            said = tok in self._stuck
            self._stuck.discard(tok)
            self._idle.notify_all()
        if said:
            self._log.info(ev.IO_UNSTUCK, seq=job.seq, op_id=job.op.id, kind=job.op.kind,
                           blocks=[lo, hi], running_s=round(time.monotonic() - t0, 1),
                           store=self.store.url)
        with job.lock:
            job.left -= 1
            last = job.left == 0
        if last:
            self._done.append((job.seq, job.result()))
            with self._lock, contextlib.suppress(OSError):  # full: the actor wakes anyway
                if not self._closed:
                    os.write(self._wake_w, b"\0")

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
        if len(ok) != hi - lo:  # (a short answer would read as "the rest worked")
            return [f"{op.kind}: block {lo}: the store answered {hi - lo} keys with "
                    f"{len(ok)} results"] * (hi - lo)
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
