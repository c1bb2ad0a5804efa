"""What the CacheManager keeps while it runs: a running request (``RequestState``), an op
in flight (``PendingOp``) and its counters (``CacheStats``). Compiled with the core
(``zkv.scheduler.NATIVE``); no behaviour here but a request's hash bookkeeping."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from zkv.scheduler import checks
from zkv.scheduler.radix import Node
from zkv.scheduler.records import Match


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
