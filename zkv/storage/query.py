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
"""

from __future__ import annotations

from collections.abc import Sequence

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

    def __call__(self, hashes: Sequence[bytes]) -> int:
        return leading_present(self.store, hashes, self.world_size, self.failed)

    def store_reached(self) -> None:
        """A rank's write reached the store (``CacheManager.on_ops_done``): a query link
        that is down tries again at the next query, not at the end of its backoff (up to
        ``max_backoff_s`` of misses after the store came back)."""
        self.store.retry_now()

    def flush_logs(self) -> None:
        """Write how many failed queries were only counted (``CacheManager.flush_logs``)."""
        self.failed.flush()
