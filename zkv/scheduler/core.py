"""The state the scheduler's components share, and what each may change.

::

    CacheManager (manager.py) ── public API: argument checks, then one call below
      ├─ requests.py   match / prefetch / allocate / finish of engine requests
      ├─ external.py   incremental caching and the external-L1 (engine-owned device) mode
      ├─ tiers.py      making room: device eviction, host blocks, drops, backups, stores
      ├─ commit.py     commit or roll back acked ops
      └─ invariants.py whole-state check (tests)
    all over one Core:
      pools (block_pool.py) · tree + per-tier evictable sets (radix.py) · policies
      (eviction.py) · ledger of ops (ledger.py) · running requests, ops and stats
      (running.py); configuration and results for engines (records.py)

Arrows point down only: the modules above import ``core`` and the parts, never the
manager or each other in a circle (``tiers`` is the one they share).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import indexOf

from zkv import log as ev
from zkv.scheduler.block_pool import BlockPool
from zkv.scheduler.eviction import EvictionPolicy, make_policy
from zkv.scheduler.ledger import Ledger
from zkv.scheduler.radix import Node, RadixTree
from zkv.scheduler.records import CacheConfig, StorageExists
from zkv.scheduler.running import CacheStats, RequestState


class NegativeCache:
    """Hashes storage failed to deliver (a store that said it has them), each until it
    expires. Entries are in expiry order (one TTL, a monotonic clock, a hash added again
    moved to the end), so the expired ones are trimmed from the front: amortized O(1) per
    hash added, and a store that stays flaky does not grow it past a TTL's worth. What a
    trim leaves is unexpired, so a lookup is a C-level membership test per block (none
    at all once it is empty). The caller's clock is ``now``."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until: OrderedDict[bytes, float] = OrderedDict()  # O(1) front, unlike dict

    def __len__(self) -> int:
        return len(self._until)

    def add(self, hashes: Sequence[bytes], now: float, ttl_s: float) -> None:
        self.trim(now)
        until = self._until
        if until:  # rare: a hash failed again before it expired
            self.discard(hashes)
        until.update(dict.fromkeys(hashes, now + ttl_s))

    def prefix(self, hashes: list[bytes], now: float) -> list[bytes]:
        """``hashes`` up to the first one still negative."""
        self.trim(now)
        until = self._until
        if not until:
            return hashes
        try:
            return hashes[: indexOf(map(until.__contains__, hashes), True)]
        except ValueError:  # none of them
            return hashes

    def discard(self, hashes: Sequence[bytes]) -> None:
        """Forget ``hashes``: the store has them now (written since they failed)."""
        until = self._until
        for h in until.keys() & hashes:
            del until[h]

    def trim(self, now: float) -> None:
        until = self._until
        while until:
            h = next(iter(until))
            if until[h] > now:
                return
            del until[h]

    def clear(self) -> None:
        self._until.clear()


@dataclass(eq=False, slots=True)
class Core:
    """Shared state (no behaviour). ``device`` / ``host`` own block ids; ``tree`` the nodes
    and which are evictable; ``ledger`` the ops built this step and in flight; ``requests``
    the running requests (each holds its path's nodes), ``load_failed`` those of them with
    ``failed_loads`` to report (so the engine's asking every call is O(failures), not
    O(requests)); ``deleting`` nodes detached while
    an op was in flight (freed when it settles); ``unstored`` nodes whose storage write
    failed, written again at ``store_retry_at`` (``tiers.retry_stores``; the backoff
    doubles once per round with a failure: ``store_round_failed``; ``store_failing``: a
    write failed since the last one that fully succeeded); ``negative``
    hashes storage failed to deliver, until they expire; ``clock`` one tick per match;
    ``monotonic`` the seconds that store retries and negative entries count (a test's
    own clock replaces it);
    ``op_failed_logs`` the warning for failed ops, one rate limit per op kind (a store that
    is down fails s2h / h2s every step, a broken copy path d2h / h2d: one cause's lines do
    not hide another's); see :meth:`op_failed_log`."""

    config: CacheConfig
    device: BlockPool
    host: BlockPool
    tree: RadixTree
    storage_exists: StorageExists | None = None
    ledger: Ledger = field(default_factory=Ledger)
    stats: CacheStats = field(default_factory=CacheStats)
    requests: dict[str, RequestState] = field(default_factory=dict)
    load_failed: dict[str, RequestState] = field(default_factory=dict)  # failed_loads set
    deleting: set[Node] = field(default_factory=set)
    unstored: dict[Node, None] = field(default_factory=dict)
    store_retry_at: float = 0.0
    store_backoff_s: float = 0.0
    store_round_failed: bool = False
    store_failing: bool = False
    negative: NegativeCache = field(default_factory=NegativeCache)
    clock: int = 0
    monotonic: Callable[[], float] = time.monotonic
    op_failed_logs: dict[str, ev.RateLimited] = field(default_factory=dict)

    def op_failed_log(self, kind: str) -> ev.RateLimited:
        """The rate-limited ``scheduler.op_failed`` warning of ops of ``kind``."""
        log = self.op_failed_logs.get(kind)
        if log is None:
            log = self.op_failed_logs[kind] = ev.repeating(
                ev.get_logger("scheduler", kind=kind), ev.OP_FAILED, level="warning")
        return log

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def backup_threshold(self) -> int | None:
        return self.config.backup_threshold


def make_core(config: CacheConfig, storage_exists: StorageExists | None,
              device_policy: EvictionPolicy | None, host_policy: EvictionPolicy | None) -> Core:
    if device_policy is None:  # (an empty policy is falsy: no `or` here)
        device_policy = make_policy(config.eviction_policy, config.num_device_blocks)
    if host_policy is None:
        host_policy = make_policy(config.eviction_policy, config.num_host_blocks)
    return Core(config, BlockPool(config.num_device_blocks, "device"),
                BlockPool(config.num_host_blocks, "host"), RadixTree(device_policy, host_policy),
                storage_exists, store_backoff_s=config.store_retry_s)
