"""CacheManager: the scheduler-side cache, as the engine and the dispatcher see it.

Pure bookkeeping over block ids. Each call records the copies it needs as pending ops;
``take_ops()`` hands a step's ops out (one op per kind), ``on_ops_done(results)`` commits
or rolls them back. The tree only reaches a stable status on a successful ack::

    allocate → swap-in   HOST ──h2d──► SWAP_TO_DEVICE ──ack ok──► DEVICE (host copy kept)
                                                        └─fail──► HOST   (blocks → request)
    evict (write_back)   DEVICE ─d2h─► SWAP_TO_HOST   ──ack ok──► HOST
                                                        └─fail──► dropped
    finish (policy)      DEVICE ─backup (d2h copy)────  ──ack ok──► DEVICE + host copy
    prefetch             (new) ─s2h─► LOADING_FROM_STORAGE ─ok─► HOST  (prefix found on all ranks)
                                                        └─rest─► removed, negative-cached
    host copy committed  ─h2s─► (storage write; host block pinned until acked)

Ownership invariant (``check_invariants``): every device / host block is free XOR owned
by exactly one running request (its freshly allocated blocks) or one node (attached, or
DELETING until its last op is acked).

The parts (``core.py`` draws them): block pools, the radix tree of block runs with a
per-tier evictable set, eviction policies, the ledger of ops, and the modules that act on
them. Costs: ``match_prefix`` is O(log blocks) lookups plus O(nodes matched); ``allocate``
and ``finish`` O(nodes touched) plus C-level work per block; each eviction O(1) per victim
node (the policy hands out a chain tail; ``eviction.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zkv import log as ev
from zkv.protocol import H2S, Op, OpResult
from zkv.scheduler import checks, commit, external, invariants, requests
from zkv.scheduler.block_pool import BlockPool
from zkv.scheduler.core import Core, make_core
from zkv.scheduler.eviction import EvictionPolicy
from zkv.scheduler.ledger import KINDS, Ledger, pieces
from zkv.scheduler.radix import DELETING, BlockView, RadixTree, Status
from zkv.scheduler.records import (  # re-exported: the manager's public surface
    LOAD,
    SAVE,
    WRITE_BACK,
    WRITE_POLICIES,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    CacheConfig,
    Match,
    StorageExists,
)
from zkv.scheduler.running import CacheStats, RequestState
from zkv.scheduler.tiers import free_node_blocks, retry_due, retry_stores

_log = ev.get_logger("scheduler")
__all__ = [
    "LOAD", "SAVE", "WRITE_BACK", "WRITE_POLICIES", "WRITE_THROUGH", "WRITE_THROUGH_SELECTIVE",
    "CacheConfig", "CacheManager", "CacheStats", "Match", "StorageExists",
]


class CacheManager:
    """The scheduler-side cache: see the module docstring for the state machine."""

    def __init__(self, config: CacheConfig, storage_exists: StorageExists | None = None, *,
                 device_policy: EvictionPolicy | None = None,
                 host_policy: EvictionPolicy | None = None) -> None:
        """``device_policy`` / ``host_policy``: eviction order per tier (default: the
        config's ``eviction_policy`` sized to the tier); a fresh instance each."""
        self.core: Core = make_core(config, storage_exists, device_policy, host_policy)
        # optional: told when a storage write succeeded (the query may reconnect at once)
        self._store_reached = getattr(storage_exists, "store_reached", None)
        self.config = config
        self.block_size = config.block_size

    # ---------------------------------------------------------------- the parts

    @property
    def device(self) -> BlockPool:
        return self.core.device

    @property
    def host(self) -> BlockPool:
        return self.core.host

    @property
    def tree(self) -> RadixTree:
        return self.core.tree

    @property
    def ledger(self) -> Ledger:
        return self.core.ledger

    @property
    def stats(self) -> CacheStats:
        return self.core.stats

    @property
    def storage_exists(self) -> StorageExists | None:
        return self.core.storage_exists

    # ================================================================ matching

    def match_prefix(self, req_id: str, block_hashes: Sequence[bytes], *,
                     check: bool = True) -> Match:
        """Longest cached prefix: device, then host, then (through ``storage_exists``) L3.

        The device and host nodes found are held (ref) for the request until ``finish``.
        Calling it again before ``allocate`` re-matches from scratch. ``check=False``:
        ``block_hashes`` come from :mod:`zkv.scheduler.hashing` (16-byte, a chain never
        repeats one), not checked again (O(n): 0.28 ms at 8,000 blocks, per retry).
        """
        if type(req_id) is not str:
            raise TypeError(f"req_id must be a str, got {type(req_id).__name__} {req_id!r:.40}")
        if check:
            checks.hashes("block_hashes", block_hashes)
        return requests.match_prefix(self.core, req_id, block_hashes)

    def prefetch(self, req_id: str) -> int:
        """Start loading the request's storage hits into host blocks (one s2h op).

        Returns how many blocks are being loaded (fewer when host space runs out). They
        stay ``LOADING_FROM_STORAGE`` until acked; ``allocate`` uses what arrived.
        """
        return requests.prefetch(self.core, self._req(req_id))

    def drop_prefetch(self, req_id: str) -> int:
        """The request goes on without its storage loads in flight (``best_effort``): they
        still land in the host tier, unheld, for later requests; it keeps its host hits.
        Returns the blocks it let go."""
        return external.drop_prefetch(self.core, self._req(req_id))

    def prefetch_done(self, req_id: str) -> bool:
        """True when none of the request's storage loads is still in flight."""
        return self._req(req_id).loading is None

    # ================================================================ allocation

    def num_blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """Device blocks ``allocate(req_id, num_tokens)`` would take (swap-ins + new)."""
        return requests.plan(self.core, self._req(req_id),
                             checks.count("num_tokens", num_tokens))[0]

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        need = self.num_blocks_needed(req_id, num_tokens)
        return need <= self.core.device.num_free + self.core.tree.num_dlru

    def allocate(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Device block table covering ``num_tokens`` tokens, or ``None`` when the device
        tier cannot make room (the request is unchanged). Matched host blocks are swapped
        in (one layerwise h2d op per step); the rest are fresh blocks owned by the request.
        Called again with more tokens, it grows the table (decode)."""
        return requests.allocate(self.core, self._req(req_id),
                                 checks.count("num_tokens", num_tokens))

    def block_table(self, req_id: str) -> list[int]:
        return list(self._req(req_id).table)

    def num_reused_blocks(self, req_id: str) -> int:
        """Leading blocks of the request's table that hold cached KV (device hits and
        blocks being swapped in); the forward computes the rest."""
        return self._req(req_id).num_held

    def take_recompute(self) -> dict[str, int]:
        """Requests whose swapped-in blocks failed: req_id -> number of leading valid blocks
        (the engine recomputes the rest into the same block table)."""
        out = {}
        for st in self.core.requests.values():
            if st.valid_blocks is not None:
                out[st.req_id] = st.valid_blocks
                st.valid_blocks = None
        return out

    # ================================================================ incremental caching

    def cache_computed(self, req_id: str, num_tokens: int, *,
                       block_hashes: Sequence[bytes] | None = None,
                       device_ids: Sequence[int] | None = None, chain: bool = False) -> int:
        """Make the request's first ``num_tokens // block_size`` blocks matchable now, while
        it still runs (not only at ``finish``). Returns how many blocks were added.

        Owned-device mode: the request's fresh blocks become DEVICE nodes it holds. It stops
        at a block already in the tree (another request cached or is loading it; ``finish``
        sorts that out) and waits while the previous block is still being swapped in.

        External-L1 mode (``device_ids`` given: the engine's block per logical block): new
        blocks are saved into host blocks (one ``save`` op per request and step) and become
        HOST when every rank acked. It waits while an earlier save of the request is in
        flight, stops at a block another request is saving or loading, and stops when no
        host block can be freed. ``block_hashes`` may extend the hashes; hashes that differ
        past the held prefix from a storage load in flight let that load go
        (``drop_prefetch``): what it brings is another prefix's.

        ``chain`` (external L1, a request that finishes: the engine frees its blocks and
        nothing would save the rest later): the save goes on past the request's own save
        in flight instead of waiting for it. The workers run it after that one (batches
        run in order); if that one fails, this one's blocks go with it.
        """
        return external.cache_computed(self.core, self._req(req_id),
                                       checks.count("num_tokens", num_tokens),
                                       block_hashes, device_ids, bool(chain))

    # ================================================================ external L1

    def load_external(self, req_id: str, first_block: int, device_ids: Sequence[int]) -> int:
        """Copy the request's matched blocks ``first_block ..`` into the engine's blocks
        ``device_ids`` (one layerwise ``load`` op). External-L1 mode: the engine owns device
        memory and its own prefix cache; zkv is L2/L3 behind it. Returns the number of
        blocks planned (the matched HOST blocks there are, at most ``len(device_ids)``).

        Blocks stay held by the request until ``finish``; a failed load is reported by
        ``take_load_failures`` (the engine recomputes those blocks).
        """
        return external.load_external(self.core, self._req(req_id),
                                      checks.count("first_block", first_block), device_ids)

    def store_again(self, req_id: str, num_present: int) -> int:
        """External-L1 mode, a request about to finish: the store holds only its first
        ``num_present`` held blocks (an existence query says so), though more were written
        once (a block is not checked again after its write: the store evicted it since,
        or restarted empty). Write the held blocks past those again from their host
        copies (h2s). Returns how many leading held blocks are in the store or on their
        way (a save in flight, a write in flight or waiting for its retry, or queued
        now): up to the first that cannot be written now (a load from L3 into it)."""
        return external.store_again(self.core, self._req(req_id),
                                    checks.count("num_present", num_present))

    def cancel_saves(self, req_id: str) -> int:
        """Drop the request's save planned this step and not yet taken (the engine freed
        the blocks it would read, e.g. on preemption). Returns the blocks dropped. (Only
        the running request's: an earlier one under its id that finished this step keeps
        its save.)"""
        st = self.core.requests.get(req_id)
        p = None if st is None else self.core.ledger.open.pop(Ledger.request_key(SAVE, st),
                                                              None)
        if p is None:
            return 0
        commit.commit(self.core, p, 0)  # the same roll back as a save that failed everywhere
        return p.num_blocks

    def take_load_failures(self) -> dict[str, list[int]]:
        """External-L1 mode: req_id -> engine block ids whose load failed on some rank
        since the last call (the engine must recompute them)."""
        return external.take_load_failures(self.core)

    def has_request(self, req_id: str) -> bool:
        return req_id in self.core.requests

    def is_external(self, req_id: str) -> bool:
        st = self.core.requests.get(req_id)
        return st is not None and st.external

    def num_held_blocks(self, req_id: str) -> int:
        """Leading blocks of the request that zkv holds for it (matched, saved or in flight)."""
        return self._req(req_id).num_held

    def save_waits(self, req_id: str, chain: bool = False) -> bool:
        """External-L1 mode: whether the request's next save waits for a save in flight on
        its path (its own earlier one, or another request's of its next block), rather
        than run now, wait for a load from L3 or stop for good (no host block to take).
        ``chain``: for a save with ``cache_computed(chain=True)``, which goes on past its
        own save in flight: only another request's counts."""
        return external.save_waits(self.core, self._req(req_id), bool(chain))

    # ================================================================ finish

    def finish(self, req_id: str, num_computed_tokens: int | None = None,
               block_hashes: Sequence[bytes] | None = None) -> None:
        """Cache the request's computed full blocks, apply the write policy, drop its refs
        and free what cannot be cached. ``block_hashes`` may extend the prompt's hashes
        (decode tokens); ``num_computed_tokens`` defaults to the whole table."""
        st = self._req(req_id)  # (its arguments checked while it still runs: a refusal
        if num_computed_tokens is not None:  # changes nothing)
            checks.count("num_computed_tokens", num_computed_tokens)
        if block_hashes is not None and not st.external:  # (the engine's own, external)
            st.take_hashes(block_hashes)
        del self.core.requests[req_id]
        requests.finish(self.core, st, num_computed_tokens)

    def abort(self, req_id: str) -> None:
        """Forget a request without caching anything it computed."""
        self.finish(req_id, num_computed_tokens=0)

    # ================================================================ ops

    def take_ops(self, keep: tuple[str, ...] = ()) -> list[Op]:
        """This step's ops in the order workers run them (d2h, backup, h2d, s2h, h2s; one
        op per kind, one s2h per prefetching request). In flight until ``on_ops_done``.
        Ops of the kinds in ``keep`` (scheduler kinds: ``"load"``, ``"save"``, ``"h2d"``,
        ...) stay open for a later take. Storage writes that failed are queued again
        here when their retry is due (``store_retry_due``)."""
        if keep and (isinstance(keep, str) or not KINDS.issuperset(keep)):
            raise ValueError(f"keep must be a tuple of op kinds ({', '.join(sorted(KINDS))}), "
                             f"got {keep!r}")
        if self.core.unstored:
            retry_stores(self.core)
        out = self.core.ledger.take_ops(tuple(keep))
        if out and ev.debug_enabled():  # one summary per step, not a line per block
            st = self.core.stats
            _log.debug(ev.STEP_DONE, num_ops=len(out), num_blocks=sum(o.num_blocks for o in out),
                       evicted_device=st.evicted_device, evicted_host=st.evicted_host,
                       dropped=st.dropped, pending_ops=len(self.core.ledger.pending))
        return out

    @property
    def num_pending_ops(self) -> int:
        return len(self.core.ledger.pending)

    def on_ops_done(self, results: Iterable[OpResult], seq: int | None = None) -> list[int]:
        """Commit (or roll back) acked ops; ``done`` is the number of leading blocks that
        succeeded on every rank. Returns op ids that were not pending (ignored). A
        storage write that succeeded tells ``storage_exists.store_reached()``, if it has
        one. ``seq``: the batch that carried them, named in ``scheduler.op_failed`` (so
        ``zkv logs --seq N`` shows the scheduler's line beside the ranks')."""
        if seq is not None:
            seq = checks.integer("seq", seq)
        stats = self.core.stats
        stored = stats.stored
        results = checks.results(self.core.ledger.pending, results)  # all, before any commit
        unknown = commit.on_ops_done(self.core, results, seq)
        if stats.stored != stored and self._store_reached is not None:
            self._store_reached()
        return unknown

    def fail_pending(self) -> None:
        """Roll back every op in flight (e.g. a rank was lost and its acks never come).
        No storage write is tried again: nothing will run it."""
        self.on_ops_done([OpResult(op_id, False, 0, "aborted")
                          for op_id in list(self.core.ledger.pending)])
        self.core.unstored.clear()

    def store_retry_due(self) -> bool:
        """Failed storage writes wait and their retry is due: the next ``take_ops``
        queues them (an idle engine's pump asks this)."""
        return retry_due(self.core)

    @property
    def store_writes_failing(self) -> bool:
        """A storage write failed since the last one that fully succeeded (a store that is
        down, or full and declining): blocks saved now may not reach it."""
        return self.core.store_failing

    @property
    def num_unstored_blocks(self) -> int:
        """Blocks whose storage write failed, waiting to be written again (those the
        host tier still holds). O(nodes waiting)."""
        return sum(len(n.hashes) for n in self.core.unstored
                   if n.host_ok and not n.in_store and n.status is not DELETING)

    # ================================================================ lifecycle

    def reset(self) -> None:
        """Drop every cached block. Refused while requests run; nodes with ops in flight
        become DELETING and free their blocks when acked."""
        core = self.core
        if core.requests:
            raise ValueError(f"reset with {len(core.requests)} running requests")
        for op in core.ledger.discard_open():  # never dispatched: nothing will ack them
            for n, count in zip(op.nodes, op.counts):
                if op.kind == H2S:
                    commit.end_writes(pieces(n, count))
                commit.live(core, pieces(n, count))
        tree = core.tree
        for n in tree.subtree_postorder(tree.root)[:-1]:
            tree.detach(n)
            if n.busy:
                n.status = DELETING
                core.deleting.add(n)
            else:
                free_node_blocks(core, n)
        core.negative.clear()

    def resize(self, num_device_blocks: int | None = None,
               num_host_blocks: int | None = None) -> bool:
        """Grow or shrink the pools; shrinking succeeds only when the ids past the new size
        are free (call ``reset`` or let requests finish first)."""
        core = self.core
        plan = [(pool, checks.count(f"num_{pool.name}_blocks", size))
                for pool, size in ((core.device, num_device_blocks),
                                   (core.host, num_host_blocks)) if size is not None]
        for pool, size in plan:  # all or nothing: check every shrink before changing a pool
            if size < pool.num_blocks and any(pool.is_allocated(b)
                                              for b in range(size, pool.num_blocks)):
                return False
        for pool, size in plan:  # (checked above: each resize succeeds)
            if not pool.resize(size):
                raise RuntimeError(f"{pool.name} pool: resize to {size} refused after its check")
        core.tree.dpol.resize(core.device.num_blocks)
        core.tree.hpol.resize(core.host.num_blocks)
        return True

    # ================================================================ introspection

    def num_running(self) -> int:
        return len(self.core.requests)

    def request(self, req_id: str) -> RequestState:
        """A running request's state (read it, do not change it)."""
        return self._req(req_id)

    def held_blocks(self, req_id: str) -> list[BlockView]:
        """The request's held blocks, one view each (tests, debugging; O(blocks))."""
        st = self._req(req_id)
        return [BlockView(self.core.tree, h) for h in st.hashes[: st.num_held]]

    def loading_blocks(self, req_id: str) -> list[BlockView]:
        """The request's blocks being loaded from storage, one view each."""
        n = self._req(req_id).loading
        return [] if n is None else [BlockView(self.core.tree, h) for h in n.hashes]

    def status_counts(self) -> dict[str, int]:
        """Blocks per status."""
        counts = {s.name: 0 for s in Status}
        tree = self.core.tree
        for n in tree.subtree_postorder(tree.root)[:-1]:
            counts[n.status.name] += len(n.hashes)
        counts[DELETING.name] += sum(len(n.hashes) for n in self.core.deleting)
        return counts

    def snapshot(self) -> dict[str, object]:
        """Stats for logs and metrics."""
        s = self.core.stats
        return {
            "hit_device": s.hit_device, "hit_host": s.hit_host, "hit_storage": s.hit_storage,
            "match_blocks": s.match_blocks, "evicted_device": s.evicted_device,
            "evicted_host": s.evicted_host, "dropped": s.dropped, "swapped_in": s.swapped_in,
            "swapped_out": s.swapped_out, "backed_up": s.backed_up, "loaded": s.loaded,
            "stored": s.stored, "store_retried": s.store_retried,
            "unstored": self.num_unstored_blocks, "failed_ops": s.failed_ops,
            "failed_blocks": dict(s.failed_by_kind),
            "loaded_external": s.loaded_external, "saved_external": s.saved_external,
            "free_device": self.core.device.num_free, "free_host": self.core.host.num_free,
            "nodes": self.status_counts(), "pending_ops": len(self.core.ledger.pending),
        }

    def flush_logs(self) -> None:
        """Write what the rate-limited warnings still hold back (how many failed ops of each
        kind, and storage queries, were only counted). Call it when the manager's work
        ends."""
        for log in self.core.op_failed_logs.values():
            log.flush()
        flush = getattr(self.core.storage_exists, "flush_logs", None)
        if flush is not None:
            flush()

    def check_invariants(self) -> None:
        """Assert every invariant of the design; O(everything), for tests."""
        invariants.check(self.core)

    def _req(self, req_id: str) -> RequestState:
        st = self.core.requests.get(req_id)
        if st is None:
            raise ValueError(f"unknown request {req_id!r} (call match_prefix first)")
        return st
