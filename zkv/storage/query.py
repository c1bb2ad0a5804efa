"""The scheduler's existence query: how many leading blocks every rank can load from L3.

``leading_present(store, hashes, world_size)`` asks for all ranks' keys of all hashes in
one batched ``exists`` (one round trip on Redis and Mooncake) and returns the length of
the prefix present on every rank. A store error is no exception for the scheduling loop:
it returns 0 (a miss), logs ``storage.query_failed`` and counts ``stats.query_failures``.
An outage fails every request's query (vLLM asks again each step for a waiting request):
the event is rate-limited (``zkv.log.repeating``: a few lines per window, then one with
``num_suppressed``), the count is not.
"""

from __future__ import annotations

from collections.abc import Sequence

from zkv import log as ev
from zkv.storage.base import Store, pack_key

_log = ev.get_logger("storage")
_failed = ev.repeating(_log, ev.QUERY_FAILED)


def leading_present(store: Store, hashes: Sequence[bytes], world_size: int,
                    failed: ev.RateLimited | None = None) -> int:
    """Leading blocks of ``hashes`` present for every rank ``0..world_size-1``. ``failed``:
    where a failed query is logged (default: this module's rate-limited logger)."""
    if not hashes:
        return 0
    w = world_size
    keys = [pack_key(h, r) for h in hashes for r in range(w)]
    try:
        found = store.exists(keys)
    except Exception as e:  # never into the scheduling loop
        store._count(query_failures=1)
        (failed or _failed)(store=store.url, num_blocks=len(hashes), error=str(e))
        return 0
    n = 0
    for i in range(len(hashes)):
        if not all(found[i * w : (i + 1) * w]):
            break
        n += 1
    return n


class StorageQuery:
    """``leading_present`` bound to a store and a world size: the ``storage_exists``
    callable of :class:`~zkv.scheduler.manager.CacheManager`."""

    def __init__(self, store: Store, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.store = store
        self.world_size = world_size
        self.failed = ev.repeating(_log, ev.QUERY_FAILED)

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
