"""Moving blocks between tiers to make room: device eviction (by the write policy: a host
copy kept, a d2h to host, or a drop), taking host blocks (free, else the host policy's
victim), dropping subtrees, backups and storage writes. Functions over a ``Core``.

Each victim the tree hands out is a chain tail cut to what is needed, so the cost is O(1)
per victim node plus O(blocks) in C (list slices and extends), never a scan::

    evict_device(n) ─ the policy's oldest node v (a chain tail): its last ≤ need blocks
        no host copy, no write-back, no child ─► cut out of the tree in place (no new node)
        v.host_ok ────────────────────────────► HOST (metadata only)
        write_back and host blocks ───────────► SWAP_TO_HOST + d2h entry (ack: HOST,
                                                fail: dropped)
        otherwise ────────────────────────────► dropped with its host-only subtree

A storage write (h2s) that fails leaves the host copy where it was, not stored; a store
that is down (or full) must not keep it out of L3 once it is back, so the node waits in
``core.unstored`` and is written again::

    h2s fails ──► unstored ──store_retry_at──► h2s again (and any piece a split put above;
        ▲            │                          from the host copy, on device or not; a
        │            │                          quarter of the host pool a round: the
        │            │                          rest waits in unstored)
        │            │ evicted / dropped meanwhile: forgotten (L3 is a cache)
        └─ fails ────┘ (backoff doubled once per round, up to store_retry_max_s)
    an h2s op that fully succeeds: the store takes writes, retry at the next take_ops
"""

from __future__ import annotations

from zkv.protocol import BACKUP, D2H, H2S
from zkv.scheduler.core import Core
from zkv.scheduler.ledger import Ledger
from zkv.scheduler.radix import DELETING, DEVICE, HOST, SWAP_TO_HOST, Node


def evict_device(core: Core, n_blocks: int) -> list[int] | None:
    """Evict ``n_blocks`` device blocks in the policy's order. Their ids pass to the caller
    still allocated (reusable this step: the worker runs d2h before compute). None (nothing
    done) when fewer are evictable."""
    if n_blocks <= 0:
        return []
    tree = core.tree
    dpol = tree.dpol
    if n_blocks > dpol.num_blocks:
        return None
    note_evicted = dpol.note_evicted if dpol.remembers else None
    write_back = core.config.backup_threshold is None and core.host.num_blocks > 0
    stats = core.stats
    out: list[int] = []
    moving: list[tuple[Node, list[int]]] = []  # victims without a host copy
    num_moving = 0
    need = n_blocks
    while need:
        v = dpol.oldest()
        assert v is not None and not v.dpin, f"device victim {v} is not a chain tail"
        if not (write_back or v.host_ok or v.children):  # dropped, in place: no new node
            hs, ids = tree.drop_device_victim(v, min(need, len(v.hashes)))
            if note_evicted is not None:
                note_evicted(hs)
            need -= len(ids)
            out += ids[::-1]
            stats.dropped += len(ids)
            continue
        t: Node = tree.pop_device(need, v)  # type: ignore[assignment]  # v, or its tail
        if t is not v and v in core.unstored:  # the tail waits for its L3 write too
            core.unstored[t] = None
        if note_evicted is not None:
            note_evicted(t.hashes)
        ids = t.dev  # type: ignore[assignment]
        if len(ids) > need:  # a whole victim with an L3 write in flight: free the rest
            core.device.free(ids[: len(ids) - need][::-1])
            stats.evicted_device += len(ids) - need
            ids = ids[len(ids) - need :]
        need -= len(ids)
        out += ids[::-1]  # chain tails first, as one block at a time would give them
        t.dev = None
        if t.host_ok:
            t.status = HOST  # backed up: metadata only
            tree.became_host(t)
        else:
            t.status = SWAP_TO_HOST  # off the device for the tree's counts
            moving.append((t, ids))
            num_moving += len(ids)
    stats.evicted_device += n_blocks
    if moving:
        _write_back_or_drop(core, moving, num_moving, write_back)
    return out


def _write_back_or_drop(core: Core, moving: list[tuple[Node, list[int]]], num: int,
                        write_back: bool) -> None:
    """Victims without a host copy (``num`` blocks): d2h into host blocks under write_back
    (as far as host blocks go: a victim keeps its first blocks), dropped otherwise.

    ``moving`` lists chain tails first. When host blocks run short they go root side
    first instead: a victim kept under a parent that gets none would be dropped with it
    (its d2h wasted), and victims below a dropped one are gone already."""
    hb = take_host_blocks(core, num) if write_back else []
    tree = core.tree
    if 0 < len(hb) < num:
        moving.sort(key=_depth_of_victim)  # stable: eviction order among equals
    d2h = core.ledger.op(D2H) if hb else None
    add = Ledger.add
    pos = 0
    for v, ids in moving:
        k = len(ids)
        m = min(k, len(hb) - pos)
        if m < k:  # keep what host blocks allow (the first blocks), drop the rest
            if tree.index.get(v.hashes[0]) is not v:
                continue  # dropped with a victim above it (root side first)
            keep = tree.split(v, m) if m else None
            v.status = HOST
            if v.children:
                drop_subtree(core, v)
            else:  # the common drop: a bare chain tail without blocks
                tree.detach(v)
                core.stats.dropped += k - m
                tree.relist(v.parent)  # type: ignore[arg-type]  # (a HOST parent may wait on it)
            if keep is None:
                continue
            v = keep
            ids = ids[:m]
        v.host = host = hb[pos : pos + m]
        pos += m
        add(d2h, v, None, ids, host)  # type: ignore[arg-type]


def _depth_of_victim(victim: tuple[Node, list[int]]) -> int:
    return victim[0].depth


def take_host_blocks(core: Core, k: int) -> list[int]:
    """Up to ``k`` host blocks: free ones, then the host policy's victims (a host-only chain
    tail is dropped; a device node's backup is forgotten, all of it, the spare ids going
    back to the pool). Fewer when every host block is held or in flight."""
    host = core.host
    nfree = host.num_free
    out = host.allocate(k if k <= nfree else nfree) or []
    if len(out) == k:
        return out
    tree = core.tree
    hpol = tree.hpol
    note_evicted = hpol.note_evicted if hpol.remembers else None
    stats = core.stats
    while len(out) < k:
        v = hpol.oldest()
        if v is None:
            break
        want = k - len(out)
        if v.status is HOST:
            if len(v.hashes) > want:  # its tail is enough: trimmed in place
                hs, _, ids = tree.trim_tail(v, want)
            else:  # the whole chain tail goes
                hs, ids = tree.drop_host_victim(v)
            if note_evicted is not None:
                note_evicted(hs)
            stats.evicted_host += len(ids)  # type: ignore[arg-type]
            stats.dropped += len(ids)  # type: ignore[arg-type]
            out += ids  # type: ignore[arg-type]
            continue
        tree.pop_host()  # a DEVICE node's backup: forgotten, all of it
        if note_evicted is not None:
            note_evicted(v.hashes)
        backup: list[int] = v.host  # type: ignore[assignment]
        v.host = None
        v.host_ok = False
        stats.evicted_host += len(backup)
        out += backup
    if len(out) > k:
        host.free(out[k:])
        del out[k:]
    return out


def drop_subtree(core: Core, n: Node) -> None:
    """Remove a node without device blocks, and its host-only subtree. Nodes with an op in
    flight become DELETING and free their blocks when acked. The parent may become
    evictable once the subtree is gone."""
    parent = n.parent
    tree = core.tree
    for d in tree.subtree_postorder(n):
        assert d.ref == 0, f"dropping {d} held by a request"
        assert d.dev is None or d.status is DELETING or d is n, f"dropping {d} still on device"
        tree.detach(d)
        core.stats.dropped += len(d.hashes)
        if d.busy:
            d.status = DELETING
            core.deleting.add(d)
        else:
            free_node_blocks(core, d)
    tree.relist(parent)  # type: ignore[arg-type]


def free_node_blocks(core: Core, n: Node) -> None:
    # Tail blocks first, as freeing one block at a time from the chain's end would: the
    # pool hands the most recently freed id out first.
    if n.dev is not None:
        core.device.free(n.dev[::-1])
        n.dev = None
    if n.host is not None:
        core.host.free(n.host[::-1])
        n.host = None
    n.host_ok = False


def backup(core: Core, n: Node) -> None:
    """Copy a held DEVICE node to new host blocks (its first blocks when fewer are free)."""
    k = len(n.hashes)
    hb = take_host_blocks(core, k)
    if not hb:
        return  # host tier full of pinned blocks: no backup this time
    if len(hb) < k:
        n = core.tree.split(n, len(hb))  # held like the rest: released with the path
    n.host = hb
    Ledger.add(core.ledger.op(BACKUP), n, None, n.dev, hb)  # type: ignore[arg-type]


def maybe_store(core: Core, n: Node) -> None:
    """Write a node's committed host copy to storage (h2s), unless it is there already."""
    if not core.config.storage_write or n.in_store:
        return
    Ledger.add(core.ledger.op(H2S), n, None, n.host, (), n.hashes)  # type: ignore[arg-type]
    n.wbusy += 1  # (it reads the host copy: a DEVICE node's device copy stays evictable)


def store_failed(core: Core, nodes: list[Node]) -> None:
    """The h2s of ``nodes`` (settled, still in the tree) failed: write them again later.
    The backoff doubles once per round (from one retry to the next) with a failure,
    however many ops failed in it."""
    unstored = core.unstored
    core.store_failing = True
    for n in nodes:
        if n.host_ok and not n.in_store:
            unstored[n] = None
    if not core.store_round_failed:
        core.store_round_failed = True
        core.store_retry_at = core.monotonic() + core.store_backoff_s
        core.store_backoff_s = min(core.config.store_retry_max_s, 2 * core.store_backoff_s)


def store_succeeded(core: Core) -> None:
    """An h2s op stored every block: the store takes writes again; retry at once."""
    core.store_backoff_s = core.config.store_retry_s
    core.store_retry_at = 0.0
    core.store_round_failed = False
    core.store_failing = False


def retry_due(core: Core) -> bool:
    return bool(core.unstored) and core.monotonic() >= core.store_retry_at


def retry_stores(core: Core) -> int:
    """Queue the h2s of ``unstored`` nodes again once their time came (and of the pieces
    a split put above one: ``in_store`` is per node); returns the blocks queued. At most
    a quarter of the host pool per round (an op pins the host blocks it reads; the rest
    waits for the next round, at once when this one succeeds). HOST nodes, and DEVICE
    nodes' backups: the write reads the host copy, and the device copy stays evictable
    (``wbusy``), so the hot blocks a store outage left out reach L3 while they are hot
    (before: only once the device let them go). Busy ones (moving) wait a round. Nodes
    gone from the host tier meanwhile are forgotten. O(nodes looked at), once per retry
    period."""
    if not retry_due(core):
        return 0
    todo = list(core.unstored)
    unstored = core.unstored
    unstored.clear()
    core.store_round_failed = False
    index = core.tree.index
    limit = max(1, core.host.num_blocks // 4)
    seen: set[Node] = set()
    queued = 0
    for i, n in enumerate(todo):
        if queued >= limit:  # the rest in the next round
            unstored.update(dict.fromkeys(todo[i:]))
            break
        while n.parent is not None and n not in seen:  # up to the root or a stored piece
            seen.add(n)
            if n.in_store:
                break
            if not n.host_ok or index.get(n.hashes[0]) is not n:
                # gone from the host tier (dropped, its backup taken): forgotten, but a
                # piece a split put above it may still wait for its write
                n = n.parent  # type: ignore[assignment]  # (not None: the loop's test)
                continue
            if n.busy or (n.status is not HOST and n.status is not DEVICE):  # moving:
                unstored[n] = None  # next round
                break
            core.tree.unlist_host_chain(n)  # busy until acked (the commit relists it)
            maybe_store(core, n)
            queued += len(n.hashes)
            n = n.parent  # type: ignore[assignment]  # (not None: the loop's test)
    core.stats.store_retried += queued
    # not before the backoff again, unless an ack brings it forward (busy nodes wait)
    core.store_retry_at = core.monotonic() + core.store_backoff_s
    return queued

