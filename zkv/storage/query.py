"""The scheduler's existence query: how many leading blocks every rank can load from L3.

``leading_present(store, hashes, world_size)`` returns the length of the prefix present on
every rank (``Store.count_leading``, which stops at the first block a rank lacks: one Lua
round trip on Redis; on Mooncake ``exists`` over the first 8 blocks, then over the rest if
those were there; a ``stat`` per key up to the first miss on a directory). A store error
is no exception for the scheduling loop: it returns 0 (a miss), logs
``storage.query_failed`` and counts ``stats.query_failures``. An outage fails every
request's query (vLLM asks again each step for a waiting request): the event is
rate-limited (``zkv.log.repeating``: a few lines per window, then one with
``num_suppressed``; the store's own limiter, or the :class:`StorageQuery`'s, so every
line and the summary at close or ``flush_logs`` name the store), the count is not.

A store with a ``query_timeout_s`` (a ``file://`` directory on a network or FUSE file
system, where a ``stat`` can block for good and nothing times it out) is asked on a
thread of the query's own, and the engine's step waits at most that long::

    idle ── query ──► running ── answered in time ──► idle (its answer)
                         │ query_timeout_s passed
                         ▼
                       stuck: this query and every one until it returns answer 0 (a
                       miss) at once, each a failed query (counted, storage.query_failed
                       rate-limited); storage.query_stuck once, storage.query_unstuck
                       (how long) when it returns ──► idle
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from zkv import log as ev
from zkv.storage.base import Store, check_world_size, failure_log


def leading_present(store: Store, hashes: Sequence[bytes], world_size: int,
                    failed: ev.RateLimited | None = None) -> int:
    """Leading blocks of ``hashes`` present for every rank ``0..world_size-1``. ``failed``:
    where a failed query is logged (default: the store's rate-limited logger, whose
    summary its ``close`` writes)."""
    if not hashes:
        return 0
    try:
        return store.count_leading(hashes, world_size)
    except Exception as e:  # never into the scheduling loop
        store._count(query_failures=1)
        (failed or store.query_failed_log)(num_blocks=len(hashes), error=str(e))
        return 0


class StorageQuery:
    """``leading_present`` bound to a store and a world size: the ``storage_exists``
    callable of :class:`~zkv.scheduler.manager.CacheManager`."""

    def __init__(self, store: Store, world_size: int) -> None:
        self.store = store
        self.world_size = check_world_size(world_size)
        self.failed = failure_log(store, ev.QUERY_FAILED, "exists")
        t = store.query_timeout_s
        self._bounded = None if t is None else _Bounded(t, store.url)

    def __call__(self, hashes: Sequence[bytes]) -> int:
        if self._bounded is None or not hashes:
            return leading_present(self.store, hashes, self.world_size, self.failed)
        answer = self._bounded.run(
            lambda: leading_present(self.store, hashes, self.world_size, self.failed),
            len(hashes))
        if answer is None:  # a miss for want of an answer: a query that failed
            self.store._count(query_failures=1)
            self.failed(num_blocks=len(hashes), error=STUCK)
            return 0
        return answer

    def store_reached(self) -> None:
        """A rank's write reached the store (``CacheManager.on_ops_done``): a query link
        that is down tries again at the next query, not at the end of its backoff (up to
        ``max_backoff_s`` of misses after the store came back)."""
        self.store.retry_now()

    def flush_logs(self) -> None:
        """Write how many failed queries were only counted (``CacheManager.flush_logs``)."""
        self.failed.flush()


STUCK = ("the existence query did not answer within query_timeout_s, or an earlier one "
         "still hangs (a hung file system?): answered as a miss")


class _Bounded:
    """One daemon thread that runs the queries handed to it, one at a time (see the
    module); ``run`` waits at most ``timeout_s``."""

    def __init__(self, timeout_s: float, url: str) -> None:
        self.timeout_s = timeout_s
        self.url = url
        self._cv = threading.Condition()
        self._job: Callable[[], int] | None = None
        self._answer: int | None = None
        self._since = 0.0  # when the running query began
        self._stuck = False
        self._thread: threading.Thread | None = None
        self._log = ev.get_logger("storage")

    def run(self, job: Callable[[], int], num_blocks: int) -> int | None:
        """The job's answer, or None when it did not come within ``timeout_s`` (or an
        earlier one still hangs)."""
        with self._cv:
            if self._stuck or self._job is not None:
                return None  # (the one that hangs still runs)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, daemon=True,
                                                name="zkv-store-query")
                self._thread.start()
            self._job, self._answer, self._since = job, None, time.monotonic()
            self._cv.notify_all()
            if self._cv.wait_for(lambda: self._answer is not None, self.timeout_s):
                answer, self._answer = self._answer, None
                return answer  # type: ignore[return-value]
            self._stuck = True
        self._log.warning(ev.QUERY_STUCK, store=self.url, num_blocks=num_blocks,
                          waited_s=self.timeout_s,
                          error="the store's existence query did not return (a hung file "
                                "system?): misses until it does")
        return None

    def _serve(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None)
                job = self._job
            assert job is not None
            answer = job()  # (leading_present: never raises)
            with self._cv:
                self._job = None
                if self._stuck:  # its caller answered 0 long ago
                    self._stuck = False
                    stuck_s = time.monotonic() - self._since
                else:
                    self._answer = answer
                    self._cv.notify_all()
                    continue
            self._log.warning(ev.QUERY_UNSTUCK, store=self.url, stuck_s=round(stuck_s, 1))
