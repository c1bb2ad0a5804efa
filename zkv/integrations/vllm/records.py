"""The scheduler half's records: what it tells the worker halves each step
(:class:`ZkvMetadata`, pickled by vLLM), its state of one request (:class:`RequestState`)
and its token counts (:class:`TokenCounts`, read by the metrics). Data only: the worker
half imports this module without the scheduler half's machinery."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zkv.integrations.vllm import pd
from zkv.scheduler.hashing import BlockHash, MultiModalItem, hash_tokens


@dataclass
class ZkvMetadata:
    """What the scheduler half tells every worker half for one step (pickled by vLLM).

    ``step``: the step's number, which the worker halves report back with the step's
    output (``update_connector_output(step=)``); ``release_upto``: every batch up to this
    seq may run (a gated worker finishes all earlier ones before this step's forward);
    ``fence``: the forward must not start before batch ``fence`` ran (it saves blocks of a
    request vLLM just preempted or finished, which this forward may reuse; -1: none);
    ``load_seq`` / ``load_op`` / ``loads``: this step's batch with loads, the load op, and
    its destination blocks in op order; ``unloaded``: blocks vLLM was told zkv would load
    but no batch will (zkv turned off after the promise, a rank lost): load errors at once,
    so vLLM recomputes them; ``finish_after``: held finished requests let go now, each with
    the seq of the batch that carried its last save (-1: none): a worker half reports one
    finished once that batch ran on its rank (``held.py``).
    """

    step: int = -1
    release_upto: int = -1
    fence: int = -1
    load_seq: int | None = None
    load_op: int | None = None
    loads: list[int] = field(default_factory=list)
    unloaded: list[int] = field(default_factory=list)
    finish_after: list[tuple[str, int]] = field(default_factory=list)


@dataclass(slots=True)
class RequestState:
    """The scheduler half's state of one request it tracks."""

    request: Any
    root: bytes
    mm_items: tuple[MultiModalItem, ...]
    hashes: list[BlockHash]
    num_prompt_blocks: int
    epoch: int = 0
    local: int = 0              # vLLM's own hit (tokens) at the last match
    ext: int = 0                # tokens zkv promised to load
    host_blocks_at_match: int = 0
    block_ids: list[int] = field(default_factory=list)
    allocated: bool = False
    confirmed: int = 0          # tokens whose KV every rank computed (or loaded) for sure
    popular: int = 0            # leading blocks seen often enough to save (selective policy)
    prefetched: bool = False
    counted: bool = False
    last_save_seq: int | None = None
    generation: bytes = b""     # the cache generation its hashes were made in (reset())
    wait: pd.ProducerWait | None = None  # P/D: for its producer's blocks (first match)

    def host_tokens(self, ext: int, block_size: int) -> int:
        """Of ``ext`` tokens zkv loads past vLLM's hit, those its host tier had at the
        match (from block 0, as vLLM's own: those under vLLM's hit are vLLM's); the rest
        its prefetch brought from L3."""
        return min(ext, max(0, self.host_blocks_at_match * block_size - self.local))

    def extend_hashes(self, upto: int, block_size: int) -> None:
        """Hash the full blocks of its tokens up to token ``upto`` not hashed yet."""
        full = min(upto, len(self.request.all_token_ids)) // block_size
        have = len(self.hashes)
        if full <= have:
            return
        tokens = list(self.request.all_token_ids[have * block_size : full * block_size])
        parent = self.hashes[-1] if self.hashes else self.root
        self.hashes += hash_tokens(tokens, block_size, parent=parent,
                                   start_token=have * block_size, mm_items=self.mm_items)


@dataclass(slots=True)
class TokenCounts:
    """Prompt tokens of scheduled requests by where their KV came from (counted once)."""

    requests: int = 0
    vllm_local: int = 0
    zkv_host: int = 0
    zkv_store: int = 0
    computed: int = 0
    failed_load_blocks: int = 0
    preempted: int = 0
    aborted: int = 0
    awaited: int = 0            # P/D requests that waited for their producer's blocks
    await_expired: int = 0      # ... and gave up on some (computed them)
    sched_s: float = 0.0

    def totals(self) -> dict[str, int]:
        """The counts under the names the connector's stats and metrics give them."""
        return {"requests": self.requests, "vllm_local_tokens": self.vllm_local,
                "zkv_host_tokens": self.zkv_host, "zkv_store_tokens": self.zkv_store,
                "computed_tokens": self.computed, "failed_load_blocks": self.failed_load_blocks,
                "preempted": self.preempted, "aborted": self.aborted,
                "awaited": self.awaited, "await_expired": self.await_expired}


def record_step(reqs: dict[str, RequestState], so: Any) -> dict[str, tuple[int, int]]:
    """A step's record from its SchedulerOutput ``so``: request id -> (epoch, tokens
    computed once the step ran) of the tracked requests (``reqs``) it scheduled, whose
    block ids are noted on them (new, grown, or all new for a resumed one)."""
    rec: dict[str, tuple[int, int]] = {}
    for new in so.scheduled_new_reqs:
        r = reqs.get(new.req_id)
        if r is not None:
            r.block_ids = list(new.block_ids[0])
            rec[new.req_id] = (r.epoch, new.num_computed_tokens
                               + so.num_scheduled_tokens.get(new.req_id, 0))
    cached = so.scheduled_cached_reqs
    resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
    for i, rid in enumerate(cached.req_ids):
        r = reqs.get(rid)
        if r is None:
            continue
        ids = cached.new_block_ids[i]
        if rid in resumed:
            r.block_ids = list(ids[0]) if ids else []
        elif ids:
            r.block_ids += ids[0]
        rec[rid] = (r.epoch, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0))
    return rec
