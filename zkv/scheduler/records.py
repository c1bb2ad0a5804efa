"""The CacheManager's configuration and results, as engines see them (no behaviour here).

What it keeps while it runs (a running request, an op in flight, counters) is
``running.py``'s, compiled with the core; these stay plain Python, so a bad argument meets
the checks below, not a compiled type check."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from zkv.protocol import BACKUP, H2D
from zkv.scheduler import checks
from zkv.scheduler.eviction import LRU_NAME, POLICIES

WRITE_BACK = "write_back"
WRITE_THROUGH = "write_through"
WRITE_THROUGH_SELECTIVE = "write_through_selective"
WRITE_POLICIES = (WRITE_BACK, WRITE_THROUGH, WRITE_THROUGH_SELECTIVE)

#: Ops of the external-L1 mode (the engine owns the device blocks; see CacheManager):
#: ``load`` copies host blocks into engine blocks (wire kind h2d, layerwise), ``save``
#: copies engine blocks into new host blocks (wire kind backup). Their commit differs from
#: the owned-device h2d / backup, so they are separate kinds inside the scheduler.
LOAD = "load"
SAVE = "save"
WIRE_KIND = {LOAD: H2D, SAVE: BACKUP}

#: ``exists(hashes) -> n``: how many leading hashes the L3 store holds (one batched query).
#: Optional methods the manager calls: ``store_reached()`` (a storage write succeeded),
#: ``flush_logs()`` (its work ends); ``zkv.storage.StorageQuery`` has both.
StorageExists = Callable[[Sequence[bytes]], int]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    num_device_blocks: int
    num_host_blocks: int = 0
    block_size: int = 16
    write_policy: str = WRITE_THROUGH_SELECTIVE
    write_through_threshold: int = 2
    storage_write: bool = False  # write blocks that reach host to L3 (h2s)
    negative_cache_s: float = 5.0
    eviction_policy: str = LRU_NAME  # per tier: "lru" or "slru" (eviction.py)
    #: A failed storage write (h2s: the store down, or full) is tried again after this
    #: many seconds, doubling per failed round up to ``store_retry_max_s`` (tiers.py).
    store_retry_s: float = 1.0
    store_retry_max_s: float = 10.0
    #: Hit count at which a device block is backed up to host; None = never (write_back).
    #: Derived from the write policy (read on every eviction: computed once).
    backup_threshold: int | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # As plain ints, floats and a bool: the compiled core checks their exact types
        # (a numpy int there failed a later call half-way); a float count is refused.
        for name in _INT_FIELDS:
            object.__setattr__(self, name, checks.integer(name, getattr(self, name)))
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, (bool, str, bytes)) or not hasattr(type(v), "__float__"):
                raise TypeError(f"{name} must be a number, got {type(v).__name__} {v!r:.40}")
            object.__setattr__(self, name, float(v))
        object.__setattr__(self, "storage_write", bool(self.storage_write))
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got "
                             f"{self.write_policy!r}")
        if self.block_size <= 0 or self.num_device_blocks < 0 or self.num_host_blocks < 0:
            raise ValueError("block_size must be > 0 and block counts >= 0")
        if not (0 < self.store_retry_s <= self.store_retry_max_s
                and math.isfinite(self.store_retry_max_s)):
            raise ValueError("store_retry_s must be > 0 and <= store_retry_max_s, both "
                             "finite")
        if not (math.isfinite(self.negative_cache_s) and self.negative_cache_s >= 0):
            raise ValueError(f"negative_cache_s must be finite and >= 0, got "
                             f"{self.negative_cache_s}")
        if self.write_through_threshold < 1:
            raise ValueError("write_through_threshold must be >= 1")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {POLICIES}, got "
                             f"{self.eviction_policy!r}")
        thr = (None if self.write_policy == WRITE_BACK else
               1 if self.write_policy == WRITE_THROUGH else self.write_through_threshold)
        object.__setattr__(self, "backup_threshold", thr)


_INT_FIELDS = ("num_device_blocks", "num_host_blocks", "block_size", "write_through_threshold")
_FLOAT_FIELDS = ("negative_cache_s", "store_retry_s", "store_retry_max_s")


@dataclass(frozen=True, slots=True)
class Match:
    """Result of ``match_prefix``: cached blocks per tier, from the start of the prompt."""

    num_device: int
    num_host: int
    num_storage: int
    block_size: int

    @property
    def num_cached_tokens(self) -> int:
        """Tokens that need no recompute once host blocks are swapped in (storage excluded)."""
        return (self.num_device + self.num_host) * self.block_size
