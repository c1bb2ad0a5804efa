"""Commit on ack: how each acked (or failed) op moves the tree and the pools.

``done`` is the number of leading blocks of an op that succeeded on every rank; the rest
roll back. ``ledger.outcomes`` hands out the op's nodes split at that boundary::

    d2h     SWAP_TO_HOST ──ok──► HOST (then h2s if storage writes)   fail ──► dropped
    backup  DEVICE ──ok──► DEVICE + host copy                        fail ──► host blocks freed
    h2d     SWAP_TO_DEVICE ──ok──► DEVICE       fail ──► HOST, device blocks to the request
    s2h     LOADING ──ok──► HOST (the request holds it)  fail ──► dropped, negative-cached
    h2s     host copy ──ok──► in_store, not negative   fail ──► unstored (written again)
    load    (external L1) host → engine blocks; fail ──► the engine recomputes them
    save    (external L1) SWAP_TO_HOST ──ok──► HOST      fail ──► removed, request path cut
                                                          (and a save chained under it)

Functions over a ``Core``; O(nodes of the op) plus O(blocks) in C.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from zkv.protocol import BACKUP, D2H, H2D, H2S, S2H, OpResult
from zkv.scheduler.core import Core
from zkv.scheduler.ledger import outcomes
from zkv.scheduler.radix import DELETING, DEVICE, HOST, Node
from zkv.scheduler.records import LOAD, SAVE
from zkv.scheduler.running import PendingOp, RequestState
from zkv.scheduler.tiers import (
    drop_subtree,
    free_node_blocks,
    maybe_store,
    store_failed,
    store_succeeded,
)


def on_ops_done(core: Core, results: Iterable[OpResult], seq: int | None = None) -> list[int]:
    """Commit (or roll back) acked ops (``checks.results`` passed: ``done`` within each
    op's blocks); returns op ids that were not pending (ignored)."""
    unknown = []
    pending = core.ledger.pending
    stats = core.stats
    for r in results:
        p = pending.pop(r.id, None)
        if p is None:
            unknown.append(r.id)
            continue
        total = sum(p.counts)
        done = r.done
        if done < total:
            stats.failed_ops += 1
            stats.failed_blocks += total - done
            stats.failed_by_kind[p.kind] = stats.failed_by_kind.get(p.kind, 0) + total - done
            req_ids = sorted({st.req_id for st in p.reqs if st is not None})
            fields = {"op_id": p.op_id, "kind": p.kind, "num_blocks": total, "done": done,
                      "error": r.error, "req_ids": req_ids[:16]}
            if seq is not None:
                fields["seq"] = seq
            core.op_failed_log(p.kind)(**fields)
        _COMMIT[p.kind](core, p, done)
    return unknown


def commit(core: Core, p: PendingOp, done: int) -> None:
    """Commit the first ``done`` blocks of ``p`` and roll the rest back."""
    _COMMIT[p.kind](core, p, done)


def settle(core: Core, n: Node) -> bool:
    """Drop one in-flight op from ``n``; True when it is DELETING (freed with its last op)."""
    n.busy -= 1
    if n.status is DELETING:
        settle_deleting(core, n)
        return True
    return False


def live(core: Core, nodes: list[Node]) -> list[Node]:
    """Settle ``nodes`` (one op fewer in flight each); the ones still in the tree."""
    return [n for n in nodes if not settle(core, n)]


def end_writes(nodes: list[Node]) -> None:
    """One L3 write (h2s) fewer in flight over each of ``nodes`` (before they settle)."""
    for n in nodes:
        n.wbusy -= 1


def settle_deleting(core: Core, n: Node) -> None:
    if n.busy == 0:
        core.deleting.discard(n)
        free_node_blocks(core, n)


def running(core: Core, st: RequestState | None) -> RequestState | None:
    """The request an op entry was made for, while it still runs: not when it finished,
    nor when it finished and was matched again under its id (the engine preempted it):
    the new incarnation holds other blocks and must not get the old one's outcome."""
    return st if st is not None and core.requests.get(st.req_id) is st else None


def relist_all(core: Core, nodes: list[Node]) -> None:
    """Make settled nodes evictable where they qualify, leaf first (``nodes`` in chain
    order, root side first, are pushed reversed). A node whose only ops in flight are L3
    writes may go on the device list."""
    relist = core.tree.relist
    for n in reversed(nodes):
        if n.busy == n.wbusy and n.status is not DELETING:
            relist(n)


def _commit_d2h(core: Core, p: PendingOp, done: int) -> None:
    ok, failed = outcomes(core.tree, p, done)
    store = core.config.storage_write
    relist = core.tree.relist
    committed = 0
    for n in ok:
        n.busy -= 1
        if n.status is DELETING:
            settle_deleting(core, n)
            continue
        n.status = HOST
        n.host_ok = True
        committed += len(n.hashes)
        if store and not n.in_store:
            maybe_store(core, n)
        elif not n.ref and not n.busy:  # (a parent before its child: listed with it)
            relist(n)
    for n, _e, _pos in failed:
        if not settle(core, n):
            drop_subtree(core, n)  # its only copy is gone
    core.stats.swapped_out += committed


def _commit_backup(core: Core, p: PendingOp, done: int) -> None:
    ok, failed_at = outcomes(core.tree, p, done)
    ok = live(core, ok)
    for n in ok:
        n.host_ok = True
        core.stats.backed_up += len(n.hashes)
        maybe_store(core, n)
    failed = live(core, [n for n, _e, _pos in failed_at])
    for n in failed:
        core.host.free(n.host)  # type: ignore[arg-type]
        n.host = None
    relist_all(core, ok + failed)


def _commit_h2d(core: Core, p: PendingOp, done: int) -> None:
    ok, failed = outcomes(core.tree, p, done)
    settled = live(core, ok)
    for n in settled:
        n.status = DEVICE
        core.stats.swapped_in += len(n.hashes)
    for n, e, _pos in failed:
        if settle(core, n):
            continue
        settled.append(n)
        # Device copy is garbage: back to HOST; the blocks go to the request (recompute).
        ids: list[int] = n.dev  # type: ignore[assignment]
        n.dev = None
        n.status = HOST
        core.tree.dev_left(n)
        st = running(core, p.reqs[e])
        d = n.depth
        if st is not None and st.table[d : d + len(ids)] == ids:
            st.fresh.update(zip(range(d, d + len(ids)), ids))
            st.valid_blocks = d if st.valid_blocks is None else min(st.valid_blocks, d)
        else:
            core.device.free(ids)
    relist_all(core, settled)


def _commit_s2h(core: Core, p: PendingOp, done: int) -> None:
    # One entry: a request's loads are one op (``done`` counts a prefix of its keys).
    ok, failed_at = outcomes(core.tree, p, done)
    failed = [n for n, _e, _pos in failed_at]
    st = running(core, p.reqs[0])
    adopt = st is not None and st.loading is p.nodes[0]
    settled = live(core, ok)
    for n in settled:
        if adopt:  # the request keeps its ref; swapped in at allocate
            st.tail = n  # type: ignore[union-attr]
            st.num_held += len(n.hashes)  # type: ignore[union-attr]
            if st.counted:  # type: ignore[union-attr]  # (else counted with its path at use)
                n.hits += 1
        n.status = HOST
        n.host_ok = True
        core.stats.loaded += len(n.hashes)
    failed = live(core, failed)
    if adopt:  # what arrived is a host hit now; the rest recomputes
        for n in failed:
            n.ref -= 1
        st.loading = None  # type: ignore[union-attr]
        st.num_storage = 0  # type: ignore[union-attr]
    now = core.monotonic()
    for n in failed:
        core.negative.add(n.hashes, now, core.config.negative_cache_s)
    for n in reversed(failed):  # deepest first; a failed node's children failed too
        if n.status is not DELETING and n.hashes[0] in core.tree.index and n.ref == 0:
            drop_subtree(core, n)
    relist_all(core, settled)


def _commit_h2s(core: Core, p: PendingOp, done: int) -> None:
    ok, failed_at = outcomes(core.tree, p, done)
    end_writes(ok)
    end_writes([n for n, _e, _pos in failed_at])
    ok = live(core, ok)
    unstored = core.unstored
    negative = core.negative
    for n in ok:
        n.in_store = True
        core.stats.stored += len(n.hashes)
        if unstored:
            unstored.pop(n, None)
        if negative:  # a load of these failed lately; the store has them now
            negative.discard(n.hashes)
    failed = live(core, [n for n, _e, _pos in failed_at])
    if failed:
        store_failed(core, failed)
    elif not failed_at:  # (also with nothing waiting: the retry that emptied the list
        store_succeeded(core)  # may be this one)
    else:  # the store refused blocks that were dropped meanwhile: still failing, nothing
        core.store_failing = True  # of them to write again, the backoff left as it was
    relist_all(core, ok + failed)


def _commit_load(core: Core, p: PendingOp, done: int) -> None:
    """External L1: host blocks copied into engine blocks. The host copies stay as they
    were; a failure is the engine's to recompute (``take_load_failures``)."""
    ok, failed = outcomes(core.tree, p, done)
    settled = live(core, ok)
    core.stats.loaded_external += sum(len(n.hashes) for n in settled)
    for n, e, pos in failed:
        if settle(core, n):
            continue
        settled.append(n)
        st = running(core, p.reqs[e])
        if st is not None:
            st.failed_loads += p.dst[pos : pos + len(n.hashes)]
            core.load_failed[st.req_id] = st
    relist_all(core, settled)


def _commit_save(core: Core, p: PendingOp, done: int) -> None:
    """External L1: engine blocks copied into new host blocks: HOST (matchable), or on
    failure removed with the rest of the op (its nodes are a chain, later blocks children
    of earlier ones) and cut from the request's held path."""
    ok_nodes, failed_at = outcomes(core.tree, p, done)
    ok_nodes = live(core, ok_nodes)
    for n in ok_nodes:
        n.status = HOST
        n.host_ok = True
        core.stats.saved_external += len(n.hashes)
        maybe_store(core, n)
    failed = [n for n, _e, _pos in failed_at]
    if not failed:
        relist_all(core, ok_nodes)
        return
    st = running(core, p.reqs[0])
    first = failed[0]
    if st is not None and first.ref and st.num_held > first.depth:
        m = st.tail
        while m is not first.parent:  # the request's path from its tail up to `first`
            m.ref -= 1  # type: ignore[union-attr]
            m = m.parent  # type: ignore[union-attr]
        st.tail = first.parent if first.parent is not core.tree.root else None
        st.num_held = first.depth
    parent = first.parent
    for n in reversed(failed):  # deepest first: each is a leaf when it is dropped
        if settle(core, n):
            continue
        if n.children:  # a save chained under it (a finished request's last one, still
            drop_subtree(core, n)  # in flight or done): its blocks follow these
            continue
        assert n.ref == 0, f"failed save of {n} is still in use"
        core.tree.detach(n)
        free_node_blocks(core, n)
        core.stats.dropped += len(n.hashes)
    relist_all(core, ok_nodes)
    if parent is not None and parent.status is not DELETING:
        core.tree.relist(parent)  # the first failed node's parent, now without it


_COMMIT: dict[str, Callable[[Core, PendingOp, int], None]] = {
    D2H: _commit_d2h,
    BACKUP: _commit_backup,
    H2D: _commit_h2d,
    S2H: _commit_s2h,
    H2S: _commit_h2s,
    LOAD: _commit_load,
    SAVE: _commit_save,
}
