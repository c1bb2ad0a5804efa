"""Incremental caching while a request runs, and the external-L1 mode.

External L1: the engine owns device memory and its own prefix cache (e.g. vLLM's); zkv is
L2 / L3 behind it, with no device pool of its own (``num_device_blocks=0``)::

    match_prefix ─► held HOST nodes ─► load_external(first, engine ids) ─► load op (h2d)
        └─► prefetch (s2h) ─► acked: its blocks join the held HOST nodes
                 └─► drop_prefetch (the engine goes on without it, e.g. best_effort):
                     the s2h still lands, unheld, for later requests
    cache_computed(device_ids=...) ─► new SWAP_TO_HOST node ─► save op (backup) ─► HOST
        └─ chain (a finishing request's last save): under its own save in flight, a
           SWAP_TO_HOST child of a SWAP_TO_HOST node; dropped with it if that one fails
    finish ─► refs dropped (the engine frees its own blocks)

Functions over a ``Core``; O(nodes touched) Python steps, per-block work in C.
"""

from __future__ import annotations

from collections.abc import Sequence

from zkv.scheduler import checks
from zkv.scheduler.core import Core
from zkv.scheduler.ledger import Ledger
from zkv.scheduler.radix import DEVICE, HOST, SWAP_TO_HOST
from zkv.scheduler.records import LOAD, SAVE
from zkv.scheduler.requests import count_hits, hold, unref
from zkv.scheduler.running import RequestState
from zkv.scheduler.tiers import maybe_store, take_host_blocks


def cache_computed(core: Core, st: RequestState, num_tokens: int,
                   block_hashes: Sequence[bytes] | None,
                   device_ids: Sequence[int] | None, chain: bool = False) -> int:
    """See ``CacheManager.cache_computed``."""
    if device_ids is None and st.external:
        raise ValueError(f"request {st.req_id!r} is external: pass device_ids")
    if device_ids is None and not st.allocated:  # (refused before its hashes are taken)
        raise ValueError(f"request {st.req_id!r} is not allocated")
    if device_ids is not None:  # checked first (nothing changed yet), each id once: the
        lo = max(st.num_held, st.ids_checked)  # engine's table only grows while it runs
        hi = min(num_tokens // core.config.block_size, len(device_ids))
        if hi > lo:
            checks.block_ids("device_ids", device_ids[lo:hi])
            st.ids_checked = hi
    if block_hashes is not None:
        st.take_hashes(block_hashes)
        if st.loading is not None and not _loading_fits(st):
            drop_prefetch(core, st)
    full = min(num_tokens // core.config.block_size, len(st.hashes))
    if device_ids is not None:
        go_external(core, st)
        return _save_external(core, st, min(full, len(device_ids)), device_ids, chain)
    full = min(full, len(st.table))
    if st.valid_blocks is not None:  # (as finish: a block past a failed swap-in the
        full = min(full, st.valid_blocks)  # engine was not told of is not the prefix's)
    start = st.num_held
    tree = core.tree
    parent = st.tail or tree.root
    # Stop at a block already in the tree (another request cached or is loading it;
    # finish sorts that out): present hashes are a prefix, so only the first can be.
    if full <= start or parent.status is not DEVICE or st.hashes[start] in tree.index:
        return 0
    ids = list(map(st.fresh.pop, range(start, full)))
    n = tree.add(parent, st.hashes[start:full], DEVICE, ids)
    n.ref = n.hits = 1
    n.last_access = core.clock
    tree.mark_reused(n, tree.dpol.note_inserted(n))
    st.tail = n
    st.num_held = full
    return full - start


def _save_external(core: Core, st: RequestState, full: int, device_ids: Sequence[int],
                   chain: bool = False) -> int:
    start = st.num_held
    tree = core.tree
    parent = st.tail or tree.root
    if full <= start or st.loading is not None:
        return 0  # (a load from L3 of this request is in flight: it brings the next blocks)
    if parent.status not in (HOST, DEVICE) and not (chain and parent.status is SWAP_TO_HOST):
        return 0  # an earlier save of this request is in flight: on after it commits
    # (chained: a SWAP_TO_HOST tail is this request's own save, never another's: a request
    # holds only HOST or DEVICE nodes of others)
    index, hashes, now = tree.index, st.hashes, core.clock
    i = start
    while i < full:
        m = index.get(hashes[i])
        if m is None:  # the rest is new: save what host blocks allow
            hb = take_host_blocks(core, full - i)
            if not hb:
                break  # every host block is held or in flight
            n = tree.add(parent, hashes[i : i + len(hb)], SWAP_TO_HOST, host=hb)
            n.ref = n.hits = 1
            n.last_access = now
            n.reused = tree.hpol.note_inserted(n) > 0  # (a node in flight is not split)
            Ledger.add(core.ledger.op(SAVE, Ledger.request_key(SAVE, st)), n, st,
                       list(map(int, device_ids[i : i + len(hb)])), hb)
            parent = n
            i += len(hb)
            break
        if m.status is not HOST:
            break  # another request is saving or loading it: take it up later
        c = tree.common_run(m, hashes, i, full)
        if c < len(m.hashes):
            m = tree.split(m, c)
        hold(tree, m, now)
        parent = m
        i += c
    st.tail = parent if parent is not tree.root else None
    st.num_held = i
    return i - start


def save_waits(core: Core, st: RequestState, chain: bool = False) -> bool:
    """See ``CacheManager.save_waits``: ``_save_external`` stopped at a save in flight (the
    request's own last one, or another's of its next block), which acks within a batch and
    lets it go on. Not at a load from L3 (the request's prefetch, another's): that brings
    the blocks itself, and takes a store read."""
    if st.loading is not None:
        return False
    if not chain and (st.tail or core.tree.root).status is SWAP_TO_HOST:
        return True
    m = core.tree.index.get(st.hashes[st.num_held]) if st.num_held < len(st.hashes) else None
    return m is not None and m.status is SWAP_TO_HOST


def _loading_fits(st: RequestState) -> bool:
    """The request's storage load still covers its next blocks: hashes past the held
    prefix may have changed, and a load of another prefix must not join its path when
    acked. Chained hashes: the last one loaded names all of them."""
    n = st.loading
    assert n is not None
    end = st.num_held + len(n.hashes)
    return end <= len(st.hashes) and st.hashes[end - 1] == n.hashes[-1]


def load_external(core: Core, st: RequestState, first_block: int,
                  device_ids: Sequence[int]) -> int:
    """See ``CacheManager.load_external``."""
    if st.loading is not None:
        raise ValueError(f"request {st.req_id!r} is still loading from storage")
    device_ids = checks.block_ids("device_ids", device_ids)  # (first_block: the manager's)
    go_external(core, st)
    end = min(first_block + len(device_ids), st.num_held)
    tree = core.tree
    planned = 0
    if end <= first_block:  # nothing to load (no ids, or none held from there)
        return 0
    for n in tree.path(st.tail):
        if n.depth + len(n.hashes) <= first_block:
            continue
        if n.depth >= end or n.status is not HOST:
            break
        if n.depth < first_block:
            tree.split(n, first_block - n.depth)  # n keeps the blocks from first_block
        if n.depth + len(n.hashes) > end:
            n = tree.split(n, end - n.depth)
        off = n.depth - first_block
        Ledger.add(core.ledger.op(LOAD), n, st, n.host,  # type: ignore[arg-type]
                   device_ids[off : off + len(n.hashes)])
        planned += len(n.hashes)
    return planned


def drop_prefetch(core: Core, st: RequestState) -> int:
    """See ``CacheManager.drop_prefetch``."""
    n = st.loading
    if n is None:
        return 0
    unref(core.tree, n)  # busy until acked; the commit relists it, unheld
    st.loading = None
    st.num_storage = 0
    return len(n.hashes)


def store_again(core: Core, st: RequestState, present: int) -> int:
    """See ``CacheManager.store_again``. Walks the request's path: O(its nodes)."""
    if core.device.num_blocks:
        raise ValueError("store_again is an external-L1 call (a CacheManager without a "
                         "device pool)")
    upto = min(present, st.num_held)
    if not core.config.storage_write:
        return upto
    tree = core.tree
    for n in tree.path(st.tail):
        end = n.depth + len(n.hashes)
        if end <= upto:
            continue
        if n.status is SWAP_TO_HOST or n.wbusy or n in core.unstored:
            upto = end  # on its way: its save's commit writes it, or its write in flight
            continue
        if n.status is not HOST or not n.host_ok:
            break  # (a load from L3 in flight: not now; copies reading it may run beside)
        if n.depth < upto:  # the store holds its first blocks: the rest again
            tree.split(n, upto - n.depth)
        tree.unlist_host_chain(n)  # (busy until its write is acked; the commit relists)
        n.in_store = False
        maybe_store(core, n)
        upto = end
    return upto


def go_external(core: Core, st: RequestState) -> None:
    if core.device.num_blocks:
        raise ValueError("external-L1 calls need a CacheManager without a device pool "
                         "(num_device_blocks=0): the engine owns device memory")
    st.external = st.allocated = True
    count_hits(core, st, st.num_held)


def take_load_failures(core: Core) -> dict[str, list[int]]:
    """O(requests with failures): the engine asks at every call."""
    if not core.load_failed:
        return {}
    out = {}
    for rid, st in core.load_failed.items():
        if st.failed_loads and core.requests.get(rid) is st:
            out[rid] = st.failed_loads
            st.failed_loads = []
    core.load_failed.clear()
    return out
