"""A request's life in the owned-device mode: match, prefetch, allocate, finish.

Functions over a ``Core``; each costs O(nodes it touches) Python steps plus C-level list
work per block (slices, extends, dict updates), never a Python step per block::

    match_prefix ─► holds the matched nodes (device, then host) ─► prefetch (s2h)?
    allocate     ─► evicts, swaps matched host nodes in (h2d), fresh blocks for the rest
    finish       ─► caches the computed blocks (one new node, or adopts what another
                    request cached meanwhile), backs up per the write policy, releases

A request holds whole nodes: a match that ends inside a node splits it first.
"""

from __future__ import annotations

from collections.abc import Sequence

from zkv.protocol import H2D, S2H
from zkv.scheduler.core import Core
from zkv.scheduler.ledger import Ledger
from zkv.scheduler.radix import (
    DEVICE,
    HOST,
    LOADING_FROM_STORAGE,
    SWAP_TO_DEVICE,
    Node,
    RadixTree,
)
from zkv.scheduler.records import Match
from zkv.scheduler.running import RequestState
from zkv.scheduler.tiers import backup, evict_device, take_host_blocks


def hold(tree: RadixTree, n: Node, now: int) -> None:
    """One more request holds ``n`` (it stops being evictable) and uses it: the running
    request caches into ``n`` what another one put there meanwhile (``count_hits``)."""
    tree.hold(n)
    n.hits += 1
    n.last_access = now


def unref(tree: RadixTree, n: Node) -> None:
    n.ref -= 1
    assert n.ref >= 0, f"negative ref on {n}"
    if n.ref == 0 and n.busy == n.wbusy:
        tree.relist(n)


def unref_path(tree: RadixTree, tail: Node | None) -> None:
    """Drop one ref from ``tail`` and every node above it, leaf first."""
    relist = tree.relist
    n = tail
    while n is not None and n.parent is not None:
        r = n.ref - 1
        n.ref = r
        if r == 0 and n.busy == n.wbusy:
            relist(n)
        n = n.parent


def cut_path(tree: RadixTree, st: RequestState, k: int) -> None:
    """Release the request's held blocks from ``k`` on (splitting the node across ``k``)."""
    n = st.tail
    while n is not None and n.parent is not None and n.depth + len(n.hashes) > k:
        if n.depth < k:
            head = tree.split(n, k - n.depth)  # the head stays held
            unref(tree, n)
            n = head
            break
        unref(tree, n)
        n = n.parent
    st.tail = n if n is not None and n.parent is not None else None
    st.num_held = min(st.num_held, k)


def release(core: Core, st: RequestState) -> None:
    """Drop everything the request holds or owns (refs, loads, fresh device blocks)."""
    unref_path(core.tree, st.tail)
    if st.loading is not None:
        unref(core.tree, st.loading)
    if st.fresh:
        core.device.free(list(st.fresh.values()))
    st.tail, st.num_held, st.loading, st.fresh, st.table = None, 0, None, {}, []


# ---------------------------------------------------------------------------- matching


def match_prefix(core: Core, req_id: str, block_hashes: Sequence[bytes]) -> Match:
    """See ``CacheManager.match_prefix``. O(log blocks) lookups + O(nodes matched)."""
    st = core.requests.get(req_id)
    if st is not None:
        if st.allocated:
            raise ValueError(f"request {req_id!r} is already allocated; finish it first")
        release(core, st)
    st = RequestState(req_id, list(block_hashes))
    core.requests[req_id] = st
    core.clock += 1
    now = core.clock
    tree = core.tree
    hashes = st.hashes
    k = tree.num_present(hashes)
    num_dev = num_host = 0
    if k:
        tail = None
        for n in tree.path(tree.index[hashes[k - 1]]):
            s = n.status
            if s is DEVICE:
                if num_host:  # tier order guarantees no DEVICE after HOST
                    break
            elif s is not HOST:
                break
            c = k - n.depth
            if c < len(n.hashes):
                n = tree.split(n, c)  # hold whole nodes: the matched part only
            else:
                c = len(n.hashes)
            tree.hold(n)  # (its hits count the request once it is used: count_hits)
            n.last_access = now
            if s is DEVICE:
                num_dev += c
            else:
                num_host += c
            tail = n
        st.tail = tail
        st.num_held = num_dev + num_host
    num_storage = 0
    held = st.num_held
    # A next block that is in the tree but not matchable is in flight (e.g. another
    # request is loading it): not a storage hit for this one, it would load nothing.
    if held < len(hashes) and core.storage_exists is not None and hashes[held] not in tree.index:
        num_storage = storage_lookup(core, hashes[held:])
    st.num_storage = num_storage
    stats = core.stats
    stats.match_queries += 1
    stats.match_blocks += len(hashes)
    m = st.match = Match(num_dev, num_host, num_storage, core.config.block_size)
    return m


def storage_lookup(core: Core, rest: list[bytes]) -> int:
    if core.negative:
        rest = core.negative.prefix(rest, core.monotonic())
    if not rest:
        return 0
    n = int(core.storage_exists(rest))  # type: ignore[misc]
    if not 0 <= n <= len(rest):
        raise RuntimeError(f"storage_exists returned {n} for {len(rest)} hashes")
    return n


def count_hits(core: Core, st: RequestState, used: int, path: list[Node] | None = None
               ) -> None:
    """Count the request's hits once, when its first ``used`` matched blocks (its held
    path) are put to use: in the stats, and in each held node's ``hits`` (the write
    policy's threshold, SLRU's protected class). Not at match: a waiting request is
    matched again every step. The whole path from the root, so a parent always has at
    least its child's hits; blocks the request holds later count as they join. ``path``:
    the held path, when the caller has it."""
    if st.counted or st.match is None:
        return
    st.counted = True
    for n in core.tree.path(st.tail) if path is None else path:
        n.hits += 1
    m = st.match
    dev = min(m.num_device, used)
    host = min(m.num_host, used - dev)
    stats = core.stats
    stats.hit_requests += 1
    stats.hit_device += dev
    stats.hit_host += host
    stats.hit_storage += used - dev - host  # arrived from L3 by prefetch


def prefetch(core: Core, st: RequestState) -> int:
    """Load the request's storage hits into host blocks: one LOADING node, one s2h op."""
    if st.allocated or st.loading is not None or not st.num_storage:
        return 0
    tree = core.tree
    start = st.num_held
    want = st.hashes[start : start + st.num_storage]
    # A hash another request inserted meanwhile: stop there (present hashes are a prefix
    # of a chain, so only the first can be).
    hb = [] if want[0] in tree.index else take_host_blocks(core, len(want))
    st.num_storage = len(hb)
    if not hb:
        return 0
    n = tree.add(st.tail or tree.root, want[: len(hb)], LOADING_FROM_STORAGE, host=hb)
    n.ref = 1
    n.in_store = True
    n.last_access = core.clock
    n.reused = tree.hpol.note_inserted(n) > 0  # (a node in flight is not split)
    Ledger.add(core.ledger.op(S2H, Ledger.request_key(S2H, st)), n, st, (), hb, n.hashes)
    st.loading = n
    return len(hb)


# ---------------------------------------------------------------------------- allocation


def plan(core: Core, st: RequestState, num_tokens: int,
         path: list[Node] | None = None) -> tuple[int, int]:
    """(device blocks needed, usable held prefix) for allocating ``num_tokens``; ``path``
    is the request's held path when the caller has it."""
    total = -(-num_tokens // core.config.block_size)
    if st.allocated:
        return max(0, total - len(st.table)), st.num_held
    k = swaps = 0
    for n in core.tree.path(st.tail) if path is None else path:  # stop at a node another
        # request is swapping in
        s = n.status
        if s is HOST:
            swaps += len(n.hashes)
        elif s is not DEVICE:
            break
        k += len(n.hashes)
    return swaps + max(0, total - k), k


def allocate(core: Core, st: RequestState, num_tokens: int) -> list[int] | None:
    """See ``CacheManager.allocate``."""
    tree = core.tree
    path = None if st.allocated else tree.path(st.tail)
    need, k = plan(core, st, num_tokens, path)
    device = core.device
    free = device.num_free
    if need > free + tree.dpol.num_blocks:
        return None
    evicted = evict_device(core, need - free)
    assert evicted is not None
    table = st.table
    if not st.allocated:
        st.allocated = True
        if st.loading is not None:  # still loading: not used by this request
            unref(tree, st.loading)
            st.loading = None
        # A matched host node that another request of this step is already swapping in
        # is not shared (one owner if that h2d fails): recompute from there.
        if k < st.num_held:
            cut_path(tree, st, k)
            path = tree.path(st.tail)
        count_hits(core, st, st.num_held, path)
        for n in path:  # type: ignore[union-attr]
            if n.status is HOST:
                _swap_in(core, st, n, evicted)
            table += n.dev  # type: ignore[arg-type]
    total = -(-num_tokens // core.config.block_size)
    n_new = total - len(table)
    if n_new > 0:
        evicted.reverse()  # the order a free + allocate round trip through the pool gives
        if len(evicted) < n_new:
            more = device.allocate(n_new - len(evicted))
            assert more is not None, "eviction made too little room"
            evicted += more
        base = len(table)
        st.fresh.update(zip(range(base, base + n_new), evicted))
        table += evicted
    else:
        assert not evicted
    return list(table)


def _swap_in(core: Core, st: RequestState, n: Node, evicted: list[int]) -> None:
    """Device blocks for a held HOST node (the last evicted ids first) and its h2d."""
    c = len(n.hashes)
    t = min(c, len(evicted))
    ids = evicted[len(evicted) - t :][::-1]
    del evicted[len(evicted) - t :]
    if c > t:
        more = core.device.allocate(c - t)
        assert more is not None
        ids += more
    n.dev = ids
    n.status = SWAP_TO_DEVICE
    core.tree.dev_entered(n)
    Ledger.add(core.ledger.op(H2D), n, st, n.host, ids)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- finish


def finish(core: Core, st: RequestState, num_computed_tokens: int | None) -> None:
    """See ``CacheManager.finish`` (``st`` is already out of ``core.requests``, its
    ``block_hashes`` taken)."""
    tree = core.tree
    if st.external:  # the engine frees its own blocks; drop the request's refs
        release(core, st)
        return
    if st.loading is not None:
        unref(tree, st.loading)
        st.loading = None
    bs = core.config.block_size
    full = len(st.table) if num_computed_tokens is None else num_computed_tokens // bs
    full = min(full, len(st.hashes), len(st.table))
    if st.valid_blocks is not None:  # a swap-in failed, and the engine was not told yet:
        full = min(full, st.valid_blocks)  # it never recomputed from there (never written)
    to_free = _insert_path(core, st, full)
    thr = core.config.backup_threshold
    if thr is not None:
        for n in tree.path(st.tail):
            if n.hits >= thr and n.host is None and n.status is DEVICE and not n.busy:
                backup(core, n)
    if to_free:
        core.device.free(to_free)
    unref_path(tree, st.tail)  # leaf first: ancestors end up nearer the young end


def _insert_path(core: Core, st: RequestState, full: int) -> list[int]:
    """Make the request hold nodes for its first ``full`` blocks (as far as they can be
    cached) and return its device blocks that no node adopted (to free)."""
    tree = core.tree
    fresh = st.fresh
    table = st.table
    orig_held = st.num_held
    if full < st.num_held:
        cut_path(tree, st, full)
    num_held = st.num_held
    low_fresh = bool(fresh) and min(fresh) < orig_held
    adopted_low: set[int] = set()
    if low_fresh:  # rare: a swap-in failed and the request recomputed into its own blocks
        parent = tree.root
        for n in tree.path(st.tail):
            d, c = n.depth, len(n.hashes)
            if (n.status is HOST and not n.busy and parent.status is DEVICE
                    and all(i in fresh for i in range(d, d + c))):
                _attach_device(tree, n, [fresh[i] for i in range(d, d + c)])
                tree.relist(n)  # a held DEVICE node's backup is droppable
                adopted_low.update(range(d, d + c))
            parent = n
    stop, to_free = _insert_new(core, st, full)
    if low_fresh or stop < orig_held:
        to_free += [b for i, b in fresh.items()
                    if i >= stop or (i < num_held and i not in adopted_low)]
    else:  # common: every block from `stop` on is the request's own
        to_free += table[stop:]
    return to_free


def _insert_new(core: Core, st: RequestState, full: int) -> tuple[int, list[int]]:
    """Hold nodes for blocks ``num_held .. full`` (adopting what another request cached
    meanwhile, one new node for the rest); returns where caching stopped and the request's
    blocks that duplicate blocks cached meanwhile (to free)."""
    tree = core.tree
    parent = st.tail or tree.root
    i = st.num_held
    if parent.status is not DEVICE:
        return i, []
    index = tree.index
    hashes = st.hashes
    table = st.table
    now = core.clock
    to_free: list[int] = []
    while i < full:
        m = index.get(hashes[i])
        if m is None:  # the rest is new (present hashes are a prefix)
            n = tree.add(parent, hashes[i:full], DEVICE, table[i:full])
            n.ref = n.hits = 1
            n.last_access = now
            tree.mark_reused(n, tree.dpol.note_inserted(n))
            parent = n
            i = full
            break
        assert m.depth == i, f"{m} does not start at block {i}"
        s = m.status
        if s is not DEVICE and (s is not HOST or m.busy):
            break  # in flight: stop caching here
        c = tree.common_run(m, hashes, i, full)
        if c < len(m.hashes):
            m = tree.split(m, c)
        if s is DEVICE:
            to_free += table[i : i + c]  # cached meanwhile by another request
        else:
            _attach_device(tree, m, table[i : i + c])
        hold(tree, m, now)
        if s is not DEVICE:
            tree.relist(m)  # attached: a held DEVICE node's backup is droppable
        parent = m
        i += c
    st.tail = parent if parent is not tree.root else None
    st.num_held = i
    return i, to_free


def _attach_device(tree: RadixTree, n: Node, ids: list[int]) -> None:
    n.dev = ids
    n.status = DEVICE
    tree.dev_entered(n)
