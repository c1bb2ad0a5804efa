"""Configuration, results and records of the CacheManager (no behaviour here)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from zkv.protocol import BACKUP, H2D
from zkv.scheduler import checks
from zkv.scheduler.eviction import LRU_NAME, POLICIES
from zkv.scheduler.radix import Node

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


@dataclass(slots=True)
class RequestState:
    """A running request. It holds (one ref each) the nodes from the root down to ``tail``,
    its first ``num_held`` blocks (whole nodes; a split keeps ``tail`` the last one)."""

    req_id: str
    hashes: list[bytes]
    tail: Node | None = None        # last held node; None: nothing held
    num_held: int = 0
    loading: Node | None = None     # held LOADING_FROM_STORAGE run below ``tail`` (one s2h)
    fresh: dict[int, int] = field(default_factory=dict)  # logical index -> owned device block
    table: list[int] = field(default_factory=list)       # device block per logical block
    allocated: bool = False
    num_storage: int = 0
    valid_blocks: int | None = None  # set when a swap-in failed: recompute from here
    match: Match | None = None        # the last match_prefix result (hits count once, at use)
    counted: bool = False             # its hits are in CacheStats and its nodes' hits
    external: bool = False            # external-L1 mode: device blocks belong to the engine
    failed_loads: list[int] = field(default_factory=list)  # engine block ids, external mode
    ids_checked: int = 0              # engine block ids checked so far (checks.block_ids)

    def take_hashes(self, block_hashes: Sequence[bytes]) -> None:
        """Its hashes become ``block_hashes``; those it holds must not change (ValueError,
        nothing changed). Hashes are chained (each names its whole prefix), so one compare
        at the end of a common prefix proves all of it, and only the new hashes are checked
        and taken: O(new blocks) a step, where comparing and copying the lists was
        O(context) per request per step (12 ms a step at 100 requests of 128k tokens)."""
        held, have = self.num_held, self.hashes
        if held and (len(block_hashes) < held or block_hashes[held - 1] != have[held - 1]):
            raise ValueError(f"request {self.req_id!r}: block_hashes disagree with its prefix")
        common = min(len(have), len(block_hashes))
        if common and block_hashes[common - 1] == have[common - 1]:
            if len(block_hashes) > common:
                have += checks.hashes("block_hashes", block_hashes[common:])
            else:
                del have[len(block_hashes):]
        else:
            self.hashes = checks.hashes("block_hashes", list(block_hashes))


class PendingOp:
    """One op: entries (a node, how many blocks it had when added: a later split puts the
    first ones in new nodes above it, ``ledger.pieces``; and the request it serves, the
    object: a request finished and matched again under its id is a new one) and per-block
    src / dst / keys. A plain class: one is built per op kind every step."""

    __slots__ = ("op_id", "kind", "nodes", "counts", "reqs", "src", "dst", "keys")

    def __init__(self, op_id: int, kind: str) -> None:
        self.op_id = op_id
        self.kind = kind
        self.nodes: list[Node] = []
        self.counts: list[int] = []
        self.reqs: list[RequestState | None] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.keys: list[bytes] = []

    def __repr__(self) -> str:
        return (f"PendingOp({self.op_id}, {self.kind!r}, {len(self.nodes)} entries, "
                f"{self.num_blocks} blocks)")

    @property
    def num_blocks(self) -> int:
        return sum(self.counts)


@dataclass(slots=True)
class CacheStats:
    match_queries: int = 0
    match_blocks: int = 0        # blocks asked for in match_prefix
    hit_device: int = 0          # blocks
    hit_host: int = 0
    hit_storage: int = 0
    evicted_device: int = 0      # blocks that left L1 (d2h, metadata only, or dropped)
    evicted_host: int = 0        # host copies dropped (blocks)
    dropped: int = 0             # blocks removed from the tree (KV lost from L1/L2)
    swapped_in: int = 0          # h2d blocks committed
    swapped_out: int = 0         # d2h blocks committed
    backed_up: int = 0           # backup blocks committed
    loaded: int = 0              # s2h blocks committed
    stored: int = 0              # h2s blocks committed
    store_retried: int = 0       # blocks whose failed h2s was queued again
    failed_ops: int = 0
    failed_blocks: int = 0
    failed_by_kind: dict[str, int] = field(default_factory=dict)  # op kind -> failed blocks
    loaded_external: int = 0     # load blocks committed (host -> engine blocks)
    saved_external: int = 0      # save blocks committed (engine blocks -> host)
    hit_requests: int = 0        # requests whose hits were counted (once each)
