"""CacheManager: prefix matching, allocation, eviction, write policies, commit on ack.

Pure bookkeeping over block ids. Each call records the copies it needs as pending ops;
``take_ops()`` hands a step's ops out (one op per kind), ``on_ops_done(results)`` commits
or rolls them back. The tree only reaches a stable status on a successful ack::

    allocate → swap-in   HOST ──h2d──► SWAP_TO_DEVICE ──ack ok──► DEVICE (host copy kept)
                                                        └─fail──► HOST   (block → request)
    evict (write_back)   DEVICE ─d2h─► SWAP_TO_HOST   ──ack ok──► HOST
                                                        └─fail──► dropped
    finish (policy)      DEVICE ─backup (d2h copy)────  ──ack ok──► DEVICE + host copy
    prefetch             (new) ─s2h─► LOADING_FROM_STORAGE ─ok─► HOST  (prefix found on all ranks)
                                                        └─rest─► removed, negative-cached
    host copy committed  ─h2s─► (storage write; host block pinned until acked)

Ownership invariant (``check_invariants``): every device / host block is free XOR owned
by exactly one running request (its freshly allocated blocks) or one node (attached, or
DELETING until its last op is acked).

Costs: ``match_prefix``, ``allocate`` and ``finish`` are O(blocks touched); each eviction
is O(1): the tier's policy (``eviction.py``, LRU by default) hands out a chain tail, never
a node it must skip or rotate; a dropped node's host-only subtree costs its size.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from zkv.protocol import BACKUP, D2H, H2D, S2H
from zkv.scheduler.block_pool import BlockPool
from zkv.scheduler.commit import CommitMixin
from zkv.scheduler.eviction import EvictionPolicy, make_policy
from zkv.scheduler.radix import (
    DELETING,
    DEVICE,
    HOST,
    LOADING_FROM_STORAGE,
    SWAP_TO_DEVICE,
    SWAP_TO_HOST,
    Node,
    RadixTree,
    Status,
)
from zkv.scheduler.records import (  # re-exported: the manager's public surface
    LOAD,
    SAVE,
    WRITE_BACK,
    WRITE_POLICIES,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    CacheConfig,
    CacheStats,
    Match,
    PendingOp,
    RequestState,
    StorageExists,
)

__all__ = [
    "WRITE_BACK", "WRITE_POLICIES", "WRITE_THROUGH", "WRITE_THROUGH_SELECTIVE", "CacheConfig",
    "CacheManager", "CacheStats", "Match", "StorageExists",
]


class CacheManager(CommitMixin):
    """The scheduler-side cache: see the module docstring for the state machine."""

    def __init__(self, config: CacheConfig, storage_exists: StorageExists | None = None, *,
                 device_policy: EvictionPolicy | None = None,
                 host_policy: EvictionPolicy | None = None) -> None:
        """``device_policy`` / ``host_policy``: eviction order per tier (default: the
        config's ``eviction_policy`` sized to the tier); a fresh instance each."""
        self.config = config
        self.block_size = config.block_size
        self.device = BlockPool(config.num_device_blocks, "device")
        self.host = BlockPool(config.num_host_blocks, "host")
        if device_policy is None:  # (an empty policy is falsy: no `or` here)
            device_policy = make_policy(config.eviction_policy, config.num_device_blocks)
        if host_policy is None:
            host_policy = make_policy(config.eviction_policy, config.num_host_blocks)
        self.tree = RadixTree(device_policy, host_policy)
        self.storage_exists = storage_exists
        self.stats = CacheStats()
        self._threshold = config.backup_threshold
        self._reqs: dict[str, RequestState] = {}
        self._deleting: set[Node] = set()
        self._open: dict[str, PendingOp] = {}     # this step's ops: by kind; s2h by request
        self._pending: dict[int, PendingOp] = {}  # taken, not yet acked
        self._next_op_id = 0
        self._negative: dict[bytes, float] = {}    # hash -> expiry (storage failed to deliver)
        self._clock = 0

    # ================================================================ matching

    def match_prefix(self, req_id: str, block_hashes: Sequence[bytes]) -> Match:
        """Longest cached prefix: device, then host, then (through ``storage_exists``) L3.

        The device and host nodes found are held (ref) for the request until ``finish``.
        Calling it again before ``allocate`` re-matches from scratch.
        """
        st = self._reqs.get(req_id)
        if st is not None:
            if st.allocated:
                raise ValueError(f"request {req_id!r} is already allocated; finish it first")
            self._release(st)
        st = RequestState(req_id, list(block_hashes))
        self._reqs[req_id] = st
        self._clock += 1
        now = self._clock
        index = self.tree.index
        tree = self.tree
        nodes = st.nodes
        num_dev = 0
        for h in st.hashes:
            n = index.get(h)
            if n is None:
                break
            s = n.status
            if s is DEVICE:
                if len(nodes) != num_dev:  # tier order guarantees no DEVICE after HOST
                    break
                num_dev += 1
            elif s is not HOST:
                break
            if n.ref == 0 and (n.dlisted or n.hlisted):
                tree.unlist(n)
            n.ref += 1
            n.hits += 1
            n.last_access = now
            nodes.append(n)
        num_host = len(nodes) - num_dev
        st.num_hit = len(nodes)
        num_storage = 0
        rest = st.hashes[len(nodes):]
        # A next block that is in the tree but not matchable is in flight (e.g. another
        # request is loading it): not a storage hit for this one, it would load nothing.
        if rest and self.storage_exists is not None and rest[0] not in index:
            num_storage = self._storage_lookup(rest)
        st.num_storage = num_storage
        stats = self.stats
        stats.match_queries += 1
        stats.match_blocks += len(st.hashes)
        m = st.match = Match(num_dev, num_host, num_storage, self.block_size)
        return m

    def _count_hits(self, st: RequestState, used: int) -> None:
        """Add the request's hits to the stats once, when its first ``used`` matched blocks
        are put to use (a request re-matched while it waits is not counted again)."""
        if st.counted or st.match is None:
            return
        st.counted = True
        m = st.match
        dev = min(m.num_device, used)
        host = min(m.num_host, used - dev)
        stats = self.stats
        stats.hit_requests += 1
        stats.hit_device += dev
        stats.hit_host += host
        stats.hit_storage += used - dev - host  # arrived from L3 by prefetch

    def _storage_lookup(self, rest: list[bytes]) -> int:
        if self._negative:
            now = time.monotonic()
            for i, h in enumerate(rest):
                exp = self._negative.get(h)
                if exp is not None:
                    if exp > now:
                        rest = rest[:i]
                        break
                    del self._negative[h]
        if not rest:
            return 0
        n = int(self.storage_exists(rest))  # type: ignore[misc]
        if not 0 <= n <= len(rest):
            raise RuntimeError(f"storage_exists returned {n} for {len(rest)} hashes")
        return n

    # ================================================================ prefetch

    def prefetch(self, req_id: str) -> int:
        """Start loading the request's storage hits into host blocks (one s2h op).

        Returns how many blocks are being loaded (fewer when host space runs out). The
        nodes stay ``LOADING_FROM_STORAGE`` until acked; ``allocate`` uses what arrived.
        """
        st = self._req(req_id)
        if st.allocated or st.loading or not st.num_storage:
            return 0
        start = len(st.nodes)
        want = st.hashes[start : start + st.num_storage]
        parent = st.nodes[-1] if st.nodes else self.tree.root
        op = None
        for h in want:
            if h in self.tree.index:  # raced with another request's insert: stop here
                break
            hb = self._take_host_block()
            if hb is None:
                break
            n = self.tree.add(parent, h, LOADING_FROM_STORAGE, host=hb)
            n.ref = 1
            n.busy = 1
            n.in_store = True
            n.last_access = self._clock
            st.loading.append(n)
            if op is None:
                op = self._op(S2H, f"{S2H}:{req_id}")
            op.nodes.append(n)
            op.dst.append(hb)
            op.keys.append(h)
            op.req_ids.append(req_id)
            parent = n
        st.num_storage = len(st.loading)
        return len(st.loading)

    def prefetch_done(self, req_id: str) -> bool:
        """True when none of the request's storage loads is still in flight."""
        return not self._req(req_id).loading

    # ================================================================ allocation

    def num_blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """Device blocks ``allocate(req_id, num_tokens)`` would take (swap-ins + new)."""
        return self._plan(self._req(req_id), num_tokens)[0]

    def _plan(self, st: RequestState, num_tokens: int) -> tuple[int, int]:
        """(device blocks needed, usable matched prefix) for allocating ``num_tokens``."""
        total = -(-num_tokens // self.block_size)
        if st.allocated:
            return max(0, total - len(st.table)), len(st.nodes)
        k = swaps = 0
        for n in st.nodes:  # stop at a node another request of this step is swapping in
            s_ = n.status
            if s_ is HOST:
                swaps += 1
            elif s_ is not DEVICE:
                break
            k += 1
        return swaps + max(0, total - k), k

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        need = self.num_blocks_needed(req_id, num_tokens)
        return need <= self.device.num_free + self.tree.num_dlru

    def allocate(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Device block table covering ``num_tokens`` tokens, or ``None`` when the device
        tier cannot make room (the request is unchanged). Matched host blocks are swapped
        in (one layerwise h2d op per step); the rest are fresh blocks owned by the request.
        Called again with more tokens, it grows the table (decode)."""
        st = self._req(req_id)
        need, k = self._plan(st, num_tokens)
        free = self.device.num_free
        if need > free + self.tree.num_dlru:
            return None
        evicted = self._evict_device(need - free)
        if evicted is None:
            return None  # evictions done so far stand; they are ordinary cache state
        total = -(-num_tokens // self.block_size)
        table = st.table
        if not st.allocated:
            st.allocated = True
            for n in st.loading:  # still loading: not used by this request
                self._unref(n)
            st.loading = []
            # A matched host block that another request of this step is already swapping
            # in is not shared (one owner if that h2d fails): recompute from there.
            if k < len(st.nodes):
                for n in reversed(st.nodes[k:]):
                    self._unref(n)
                del st.nodes[k:]
            self._count_hits(st, len(st.nodes))
            op = None
            for n in st.nodes:
                if n.status is HOST:
                    b = evicted.pop() if evicted else self.device.allocate_one()
                    assert b is not None
                    n.dev = b
                    n.status = SWAP_TO_DEVICE
                    n.busy += 1
                    self.tree.dev_entered(n)
                    if op is None:
                        op = self._op(H2D)
                    op.nodes.append(n)
                    op.src.append(n.host)
                    op.dst.append(b)
                    op.req_ids.append(req_id)
                table.append(n.dev)
        n_new = total - len(table)
        if n_new > 0:
            evicted.reverse()  # the order a free + allocate round trip through the pool gives
            if len(evicted) < n_new:
                more = self.device.allocate(n_new - len(evicted))
                assert more is not None, "eviction made too little room"
                evicted += more
            base = len(table)
            st.fresh.update(zip(range(base, base + n_new), evicted))
            table += evicted
        else:
            assert not evicted
        return list(table)

    def block_table(self, req_id: str) -> list[int]:
        return list(self._req(req_id).table)

    def num_reused_blocks(self, req_id: str) -> int:
        """Leading blocks of the request's table that hold cached KV (device hits and
        blocks being swapped in); the forward computes the rest."""
        return len(self._req(req_id).nodes)

    def take_recompute(self) -> dict[str, int]:
        """Requests whose swapped-in blocks failed: req_id -> number of leading valid blocks
        (the engine recomputes the rest into the same block table)."""
        out = {}
        for st in self._reqs.values():
            if st.valid_blocks is not None:
                out[st.req_id] = st.valid_blocks
                st.valid_blocks = None
        return out

    # ================================================================ incremental caching

    def cache_computed(self, req_id: str, num_tokens: int, *,
                       block_hashes: Sequence[bytes] | None = None,
                       device_ids: Sequence[int] | None = None) -> int:
        """Make the request's first ``num_tokens // block_size`` blocks matchable now, while
        it still runs (not only at ``finish``). Returns how many blocks were added.

        Owned-device mode: the request's fresh blocks become DEVICE nodes it holds. It stops
        at a block already in the tree (another request cached or is loading it; ``finish``
        sorts that out) and waits while the previous block is still being swapped in.

        External-L1 mode (``device_ids`` given: the engine's block per logical block): each
        new block is saved into a host block (one ``save`` op per request and step) and
        becomes a HOST node when every rank acked. It waits while an earlier save of the
        request is in flight, stops at a block another request is saving or loading, and
        stops when no host block can be freed. ``block_hashes`` may extend the hashes.
        """
        st = self._req(req_id)
        if block_hashes is not None:
            if list(block_hashes[: len(st.nodes)]) != [n.hash for n in st.nodes]:
                raise ValueError(f"request {req_id!r}: block_hashes disagree with its prefix")
            st.hashes = list(block_hashes)
        full = min(num_tokens // self.block_size, len(st.hashes))
        if device_ids is not None or st.external:
            if device_ids is None:
                raise ValueError(f"request {req_id!r} is external: pass device_ids")
            self._go_external(st)
            return self._save_external(st, min(full, len(device_ids)), device_ids)
        if not st.allocated:
            raise ValueError(f"request {req_id!r} is not allocated")
        full = min(full, len(st.table))
        start = len(st.nodes)
        parent = st.nodes[-1] if st.nodes else self.tree.root
        if full <= start or parent.status is not DEVICE:
            return 0
        index, tree, now = self.tree.index, self.tree, self._clock
        for i in range(start, full):
            h = st.hashes[i]
            if h in index:
                break
            b = st.fresh.pop(i)
            n = tree.add(parent, h, DEVICE, dev=b)
            n.ref = n.hits = 1
            n.last_access = now
            tree.dpol.note_inserted(n)
            st.nodes.append(n)
            parent = n
        return len(st.nodes) - start

    def _save_external(self, st: RequestState, full: int, device_ids: Sequence[int]) -> int:
        start = len(st.nodes)
        parent = st.nodes[-1] if st.nodes else self.tree.root
        if full <= start or parent.status not in (HOST, DEVICE) or st.loading:
            return 0  # an earlier save (or a load from L3) of this request is in flight
        tree, index, now = self.tree, self.tree.index, self._clock
        op = None
        for i in range(start, full):
            h = st.hashes[i]
            n = index.get(h)
            if n is not None:
                if n.status is not HOST:
                    break  # another request is saving or loading it: take it up later
                if n.ref == 0:
                    tree.unlist(n)
                n.ref += 1
                n.hits += 1
                n.last_access = now
            else:
                hb = self._take_host_block()
                if hb is None:
                    break  # every host block is held or in flight
                n = tree.add(parent, h, SWAP_TO_HOST, host=hb)
                n.ref = n.hits = n.busy = 1
                n.last_access = now
                tree.hpol.note_inserted(n)
                if op is None:
                    op = self._op(SAVE, f"{SAVE}:{st.req_id}")
                op.nodes.append(n)
                op.src.append(int(device_ids[i]))
                op.dst.append(hb)
                op.req_ids.append(st.req_id)
            st.nodes.append(n)
            parent = n
        return len(st.nodes) - start

    # ================================================================ external L1

    def load_external(self, req_id: str, first_block: int, device_ids: Sequence[int]) -> int:
        """Copy the request's matched blocks ``first_block ..`` into the engine's blocks
        ``device_ids`` (one layerwise ``load`` op). External-L1 mode: the engine owns device
        memory and its own prefix cache; zkv is L2/L3 behind it. Returns the number of
        blocks planned (the matched HOST blocks there are, at most ``len(device_ids)``).

        Blocks stay held by the request until ``finish``; a failed load is reported by
        ``take_load_failures`` (the engine recomputes those blocks).
        """
        st = self._req(req_id)
        if st.loading:
            raise ValueError(f"request {req_id!r} is still loading from storage")
        self._go_external(st)
        if first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {first_block}")
        nodes = st.nodes[first_block : first_block + len(device_ids)]
        n_ok = 0
        for n in nodes:
            if n.status is not HOST:
                break
            n_ok += 1
        if not n_ok:
            return 0
        op = self._op(LOAD)
        for n, b in zip(nodes[:n_ok], device_ids):
            n.busy += 1
            op.nodes.append(n)
            op.src.append(n.host)
            op.dst.append(int(b))
            op.req_ids.append(req_id)
        return n_ok

    def cancel_saves(self, req_id: str) -> int:
        """Drop the request's save planned this step and not yet taken (the engine freed
        the blocks it would read, e.g. on preemption). Returns the blocks dropped."""
        p = self._open.pop(f"{SAVE}:{req_id}", None)
        if p is None:
            return 0
        self._commit_save(p, 0)  # the same roll back as a save that failed everywhere
        return len(p.nodes)

    def _go_external(self, st: RequestState) -> None:
        if self.device.num_blocks:
            raise ValueError("external-L1 calls need a CacheManager without a device pool "
                             "(num_device_blocks=0): the engine owns device memory")
        st.external = st.allocated = True
        self._count_hits(st, len(st.nodes))

    def take_load_failures(self) -> dict[str, list[int]]:
        """External-L1 mode: req_id -> engine block ids whose load failed on some rank
        since the last call (the engine must recompute them)."""
        out = {}
        for st in self._reqs.values():
            if st.failed_loads:
                out[st.req_id] = st.failed_loads
                st.failed_loads = []
        return out

    def has_request(self, req_id: str) -> bool:
        return req_id in self._reqs

    def is_external(self, req_id: str) -> bool:
        st = self._reqs.get(req_id)
        return st is not None and st.external

    def num_held_blocks(self, req_id: str) -> int:
        """Leading blocks of the request that zkv holds for it (matched, saved or in flight)."""
        return len(self._req(req_id).nodes)

    # ================================================================ finish

    def finish(self, req_id: str, num_computed_tokens: int | None = None,
               block_hashes: Sequence[bytes] | None = None) -> None:
        """Cache the request's computed full blocks, apply the write policy, drop its refs
        and free what cannot be cached. ``block_hashes`` may extend the prompt's hashes
        (decode tokens); ``num_computed_tokens`` defaults to the whole table."""
        st = self._reqs.pop(req_id, None)
        if st is None:
            raise ValueError(f"unknown request {req_id!r}")
        if st.external:  # the engine frees its own blocks; drop the request's refs
            self._release(st)
            return
        if block_hashes is not None:
            st.hashes = list(block_hashes)
        for n in st.loading:
            self._unref(n)
        st.loading = []
        full = len(st.table) if num_computed_tokens is None else num_computed_tokens // self.block_size
        full = min(full, len(st.hashes), len(st.table))
        path, to_free = self._insert_path(st, full)
        if self._threshold is not None:
            thr = self._threshold
            for n in path:
                if n.hits >= thr and n.host < 0 and n.status is DEVICE and not n.busy:
                    self._backup(n)
        if to_free:
            self.device.free(to_free)
        relist = self.tree.relist
        for n in reversed(path):  # leaf first: ancestors end up nearer the young end
            r = n.ref - 1
            n.ref = r
            if r == 0 and not n.busy:
                relist(n)

    def _insert_path(self, st: RequestState, full: int) -> tuple[list[Node], list[int]]:
        """Nodes for the first ``full`` blocks, each holding one ref for the caller to
        release, and the request's device blocks that no node adopted (to free)."""
        nodes = st.nodes
        fresh = st.fresh
        table = st.table
        orig_matched = len(nodes)
        for n in reversed(nodes[full:]):  # leaf first, like every release
            self._unref(n)
        del nodes[full:]
        num_matched = len(nodes)
        to_free: list[int] = []
        tree = self.tree
        parent = tree.root
        low_fresh = bool(fresh) and min(fresh) < orig_matched
        adopted_low: set[int] = set()
        if low_fresh:
            # Rare: a swap-in failed and the request recomputed into its own block.
            for i, n in enumerate(nodes):
                b = fresh.get(i)
                if b is not None and n.status is HOST and not n.busy and parent.status is DEVICE:
                    self._attach_device(n, b)
                    adopted_low.add(i)
                parent = n
        elif nodes:
            parent = nodes[-1]
        path = list(nodes)  # matched nodes: the request's refs become the path's refs
        stop = num_matched
        if parent.status is DEVICE:
            index = tree.index
            hashes = st.hashes
            now = self._clock
            inserted = tree.dpol.note_inserted
            for stop in range(num_matched, full):
                h = hashes[stop]
                n = index.get(h)
                if n is None:
                    n = Node(h, parent, DEVICE, table[stop])
                    n.ref = n.hits = 1
                    n.last_access = now
                    pc = parent.children
                    if pc is None:
                        parent.children = {h: n}
                    else:
                        pc[h] = n
                    index[h] = n
                    parent.dpin += 1
                    parent.hpin += 1
                    inserted(n)
                else:
                    s_ = n.status
                    if s_ is DEVICE:
                        to_free.append(table[stop])  # cached meanwhile by another request
                    elif s_ is HOST and not n.busy:
                        self._attach_device(n, table[stop])
                    else:
                        break  # in flight: stop caching here
                    if n.ref == 0:
                        tree.unlist(n)
                    n.ref += 1
                    if stop >= st.num_hit:  # a hit this request did not count at match
                        n.hits += 1
                    n.last_access = now
                path.append(n)
                parent = n
            else:
                stop = full
        if low_fresh or stop < orig_matched:
            to_free += [b for i, b in fresh.items()
                        if i >= stop or (i < num_matched and i not in adopted_low)]
        else:  # common: every block from `stop` on is the request's own
            to_free += table[stop:]
        return path, to_free

    def _attach_device(self, n: Node, b: int) -> None:
        n.dev = b
        n.status = DEVICE
        self.tree.dev_entered(n)

    def _backup(self, n: Node) -> None:
        hb = self._take_host_block()
        if hb is None:
            return  # host tier full of pinned blocks: no backup this time
        n.host = hb
        n.busy += 1
        op = self._op(BACKUP)
        op.nodes.append(n)
        op.src.append(n.dev)
        op.dst.append(hb)
        op.req_ids.append(None)

    # ================================================================ eviction

    def _evict_device(self, n_blocks: int) -> list[int] | None:
        """Evict ``n_blocks`` chain tails in the device policy's order. Their ids pass to the
        caller still allocated (reusable this step: the worker runs d2h before compute).
        ``None`` (ids returned to the pool) when fewer are evictable. O(1) per block: every
        entry the policy hands out is a chain tail (``radix.py``: closed subtrees)."""
        out: list[int] = []
        if n_blocks <= 0:
            return out
        tree = self.tree
        if n_blocks > len(tree.dpol):
            return None
        write_back = self._threshold is None and self.host.num_blocks > 0
        index = tree.index
        note_evicted = tree.dpol.note_evicted
        op = None
        dropped = 0
        for _ in range(n_blocks):
            n = tree.pop_device()
            assert n is not None and not n.dpin, f"device victim {n} is not a chain tail"
            note_evicted(n)
            b = n.dev
            out.append(b)
            n.dev = -1
            parent: Node = n.parent  # type: ignore[assignment]
            if n.host_ok:
                n.status = HOST  # backed up: metadata only
                tree.became_host(n)
                continue
            hb = self._take_host_block() if write_back else None
            if hb is None:
                n.status = HOST  # the drops below see a node off the device
                if not n.children:  # the common drop: a bare leaf
                    del parent.children[n.hash]  # type: ignore[union-attr]
                    del index[n.hash]
                    parent.hpin -= 1
                    dropped += 1
                else:
                    self._drop_subtree(n)
                continue
            n.host = hb
            n.status = SWAP_TO_HOST
            n.busy += 1
            if op is None:
                op = self._op(D2H)
            op.nodes.append(n)
            op.src.append(b)
            op.dst.append(hb)
            op.req_ids.append(None)
        self.stats.evicted_device += n_blocks
        self.stats.dropped += dropped
        return out

    def _take_host_block(self) -> int | None:
        """A host block: a free one, else the host policy's next victim's (a host-only
        chain tail is dropped; a device node's backup is just forgotten). None when
        neither. O(1)."""
        b = self.host.allocate_one()
        if b is not None:
            return b
        tree = self.tree
        n = tree.pop_host()
        if n is None:
            return None
        tree.hpol.note_evicted(n)
        self.stats.evicted_host += 1
        b = n.host
        n.host = -1
        n.host_ok = False
        if n.status is HOST:
            assert not n.children, f"host victim {n} is not a chain tail"
            tree.detach(n)
            self.stats.dropped += 1
        return b  # handed over directly, never back on the free list

    def _drop_subtree(self, n: Node) -> None:
        """Remove a node without a device block, and its host-only subtree. Nodes with an op
        in flight become DELETING and free their blocks when acked. The parent may become
        evictable once the subtree is gone."""
        parent = n.parent
        for d in self.tree.subtree_postorder(n):
            assert d.ref == 0, f"dropping {d} held by a request"
            assert d.dev < 0 or d.status is DELETING or d is n, f"dropping {d} still on device"
            self.tree.detach(d)
            self.stats.dropped += 1
            if d.busy:
                d.status = DELETING
                self._deleting.add(d)
            else:
                self._free_node_blocks(d)
        self.tree.relist(parent)  # type: ignore[arg-type]

    def _free_node_blocks(self, n: Node) -> None:
        if n.dev >= 0:
            self.device.free_one(n.dev)
            n.dev = -1
        if n.host >= 0:
            self.host.free_one(n.host)
            n.host = -1
        n.host_ok = False

    # ================================================================ lifecycle

    def abort(self, req_id: str) -> None:
        """Forget a request without caching anything it computed."""
        self.finish(req_id, num_computed_tokens=0)

    def reset(self) -> None:
        """Drop every cached block. Refused while requests run; nodes with ops in flight
        become DELETING and free their blocks when acked."""
        if self._reqs:
            raise ValueError(f"reset with {len(self._reqs)} running requests")
        for op in self._open.values():  # never dispatched: nothing will ack them
            for n in op.nodes:
                n.busy -= 1
        self._open.clear()
        for n in self.tree.subtree_postorder(self.tree.root)[:-1]:
            self.tree.detach(n)
            if n.busy:
                n.status = DELETING
                self._deleting.add(n)
            else:
                self._free_node_blocks(n)
        self._negative.clear()

    def resize(self, num_device_blocks: int | None = None, num_host_blocks: int | None = None) -> bool:
        """Grow or shrink the pools; shrinking succeeds only when the ids past the new size
        are free (call ``reset`` or let requests finish first)."""
        plan = [(pool, size) for pool, size in ((self.device, num_device_blocks),
                                                (self.host, num_host_blocks)) if size is not None]
        for pool, size in plan:  # all or nothing: check every shrink before changing a pool
            if size < pool.num_blocks and any(pool.is_allocated(b) for b in range(size, pool.num_blocks)):
                return False
        for pool, size in plan:
            assert pool.resize(size)
        self.tree.dpol.resize(self.device.num_blocks)
        self.tree.hpol.resize(self.host.num_blocks)
        return True

    def num_running(self) -> int:
        return len(self._reqs)

    def status_counts(self) -> dict[str, int]:
        counts = {s.name: 0 for s in Status}
        for n in self.tree.index.values():
            counts[n.status.name] += 1
        counts[DELETING.name] += len(self._deleting)
        return counts

    def snapshot(self) -> dict[str, object]:
        """Stats for logs and metrics."""
        s = self.stats
        return {
            "hit_device": s.hit_device, "hit_host": s.hit_host, "hit_storage": s.hit_storage,
            "match_blocks": s.match_blocks, "evicted_device": s.evicted_device,
            "evicted_host": s.evicted_host, "dropped": s.dropped, "swapped_in": s.swapped_in,
            "swapped_out": s.swapped_out, "backed_up": s.backed_up, "loaded": s.loaded,
            "stored": s.stored, "failed_ops": s.failed_ops,
            "loaded_external": s.loaded_external, "saved_external": s.saved_external,
            "free_device": self.device.num_free, "free_host": self.host.num_free,
            "nodes": self.status_counts(), "pending_ops": len(self._pending),
        }

    # ================================================================ helpers

    def _req(self, req_id: str) -> RequestState:
        st = self._reqs.get(req_id)
        if st is None:
            raise ValueError(f"unknown request {req_id!r} (call match_prefix first)")
        return st

    def _unref(self, n: Node) -> None:
        n.ref -= 1
        assert n.ref >= 0, f"negative ref on {n}"
        if n.ref == 0 and not n.busy:
            self.tree.relist(n)

    def _release(self, st: RequestState) -> None:
        for n in reversed(st.nodes):
            self._unref(n)
        for n in st.loading:
            self._unref(n)
        for b in st.fresh.values():
            self.device.free_one(b)
        st.nodes, st.loading, st.fresh, st.table = [], [], {}, []

    # ================================================================ invariants

    def check_invariants(self) -> None:
        """Assert every invariant of the design; O(everything), for tests."""
        from zkv.scheduler.invariants import check

        check(self)
