"""Commit on ack: how each acked (or failed) op moves the tree and the pools.

``CommitMixin`` is part of :class:`~zkv.scheduler.manager.CacheManager` (split out to keep
modules small); it uses the manager's tree, pools, requests and stats. ``done`` is the
number of leading blocks of an op that succeeded on every rank; the rest roll back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from zkv import log as ev
from zkv.protocol import BACKUP, D2H, H2D, H2S, S2H, Op, OpResult
from zkv.scheduler.radix import DELETING, DEVICE, HOST, Node
from zkv.scheduler.records import LOAD, SAVE, WIRE_KIND, PendingOp

if TYPE_CHECKING:
    from zkv.scheduler.manager import CacheManager


_log = ev.get_logger("scheduler")


class CommitMixin:
    """Step ops (``take_ops``) and their commit or roll back (``on_ops_done``)."""

    def _op(self, kind: str, key: str | None = None) -> PendingOp:
        """The step's open op of ``kind`` (or under ``key``: loads get one op per request, as
        an s2h's ``done`` counts a prefix, and one request's missing key must not discard
        another request's blocks)."""
        key = key or kind
        op = self._open.get(key)
        if op is None:
            op = PendingOp(self._next_op_id, kind)
            self._next_op_id += 1
            self._open[key] = op
        return op

    def take_ops(self) -> list[Op]:
        """This step's ops in the order workers run them (d2h, backup, h2d, s2h, h2s; one
        op per kind, one s2h per prefetching request). In flight until ``on_ops_done``."""
        out = []
        for p in sorted(self._open.values(), key=_kind_rank):  # stable: s2h in request order
            self._pending[p.op_id] = p
            kind = WIRE_KIND.get(p.kind, p.kind)
            out.append(Op(
                p.op_id, kind,
                src=np.asarray(p.src, dtype="<i4"), dst=np.asarray(p.dst, dtype="<i4"),
                keys=tuple(p.keys), layerwise=kind == H2D,
            ))
        self._open.clear()
        if out:  # one summary per step, not a line per block
            st = self.stats
            _log.debug(ev.STEP_DONE, num_ops=len(out), num_blocks=sum(o.num_blocks for o in out),
                       evicted_device=st.evicted_device, evicted_host=st.evicted_host,
                       dropped=st.dropped, pending_ops=len(self._pending))
        return out

    @property
    def num_pending_ops(self) -> int:
        return len(self._pending)

    def on_ops_done(self, results: Iterable[OpResult]) -> list[int]:
        """Commit (or roll back) acked ops; ``done`` is the number of leading blocks that
        succeeded on every rank. Returns op ids that were not pending (ignored)."""
        unknown = []
        for r in results:
            p = self._pending.pop(r.id, None)
            if p is None:
                unknown.append(r.id)
                continue
            done = max(0, min(r.done, len(p.nodes)))
            if done < len(p.nodes):
                self.stats.failed_ops += 1
                self.stats.failed_blocks += len(p.nodes) - done
                req_ids = sorted({q for q in p.req_ids if q is not None})
                _log.warning(ev.OP_FAILED, op_id=p.op_id, kind=p.kind, num_blocks=len(p.nodes),
                             done=done, error=r.error, req_ids=req_ids[:16])
            commit = _COMMIT[p.kind]
            commit(self, p, done)
        return unknown

    def fail_pending(self) -> None:
        """Roll back every op in flight (e.g. a rank was lost and its acks never come)."""
        self.on_ops_done([OpResult(op_id, False, 0, "aborted") for op_id in list(self._pending)])

    def _settle(self, n: Node) -> bool:
        """Drop one in-flight op from ``n``; True when a DELETING node was finally freed."""
        n.busy -= 1
        if n.status is DELETING:
            if n.busy == 0:
                self._deleting.discard(n)
                self._free_node_blocks(n)
            return True
        return False

    def _relist(self, nodes: list[Node]) -> None:
        """Make settled nodes evictable where they qualify, leaf first (``nodes`` are in
        path order, root → leaf, and pushed reversed)."""
        relist = self.tree.relist
        for n in reversed(nodes):
            if not (n.ref or n.busy or n.status is DELETING):
                relist(n)

    def _commit_d2h(self, p: PendingOp, done: int) -> None:
        # One iteration per evicted block (hot with a host tier): the common case, a node
        # with no other op in flight that no request holds, is settled inline.
        store = self.config.storage_write
        relist = self.tree.relist
        committed = 0
        for i, n in enumerate(p.nodes):
            if n.busy != 1 or n.status is DELETING:
                if self._settle(n):
                    continue
            else:
                n.busy = 0
            if i < done:
                n.status = HOST
                n.host_ok = True
                committed += 1
                if store and not n.in_store:
                    self._maybe_store(n)
                elif not n.ref and not n.busy:  # d2h ops list chain tails first
                    relist(n)
            else:
                self._drop_subtree(n)  # its only copy is gone
        self.stats.swapped_out += committed

    def _commit_backup(self, p: PendingOp, done: int) -> None:
        settled = []
        for i, n in enumerate(p.nodes):
            if self._settle(n):
                continue
            if i < done:
                n.host_ok = True
                self.stats.backed_up += 1
                self._maybe_store(n)
            else:
                self.host.free_one(n.host)
                n.host = -1
            settled.append(n)
        self._relist(settled)

    def _commit_h2d(self, p: PendingOp, done: int) -> None:
        settled = []
        for i, n in enumerate(p.nodes):
            if self._settle(n):
                continue
            settled.append(n)
            if i < done:
                n.status = DEVICE
                self.stats.swapped_in += 1
                continue
            # Device copy is garbage: back to HOST; the block goes to the request (recompute).
            b = n.dev
            n.dev = -1
            n.status = HOST
            self.tree.dev_left(n)
            st = self._reqs.get(p.req_ids[i] or "")
            idx = _index_of(st.nodes, n) if st is not None else -1
            if st is not None and idx >= 0 and idx < len(st.table) and st.table[idx] == b:
                st.fresh[idx] = b
                st.valid_blocks = idx if st.valid_blocks is None else min(st.valid_blocks, idx)
            else:
                self.device.free_one(b)
        self._relist(settled)

    def _commit_s2h(self, p: PendingOp, done: int) -> None:
        settled = []
        failed = []
        for i, n in enumerate(p.nodes):
            if self._settle(n):
                continue
            st = self._reqs.get(p.req_ids[i] or "")
            if st is not None and n in st.loading:
                st.loading.remove(n)
                st.num_storage = 0  # what arrived is a host hit now; the rest recomputes
                if i < done and not failed:
                    st.nodes.append(n)  # the request keeps its ref; swapped in at allocate
                    n.hits += 1  # a use, like a match (a parent is hit whenever its child)
                else:
                    n.ref -= 1
            if i < done and not failed:
                n.status = HOST
                n.host_ok = True
                self.stats.loaded += 1
                settled.append(n)
            else:
                failed.append(n)
        expiry = time.monotonic() + self.config.negative_cache_s
        for n in failed:
            self._negative[n.hash] = expiry
        for n in reversed(failed):  # deepest first; a failed node's children failed too
            if n.status is not DELETING and n.hash in self.tree.index and n.ref == 0:
                self._drop_subtree(n)
        self._relist(settled)

    def _commit_h2s(self, p: PendingOp, done: int) -> None:
        settled = []
        for i, n in enumerate(p.nodes):
            if self._settle(n):
                continue
            if i < done:
                n.in_store = True
                self.stats.stored += 1
            settled.append(n)
        self._relist(settled)

    def _commit_load(self, p: PendingOp, done: int) -> None:
        """External L1: host blocks copied into engine blocks. The host copies stay as they
        were; a failure is the engine's to recompute (``take_load_failures``)."""
        settled = []
        for i, n in enumerate(p.nodes):
            if self._settle(n):
                continue
            settled.append(n)
            if i < done:
                self.stats.loaded_external += 1
                continue
            st = self._reqs.get(p.req_ids[i] or "")
            if st is not None:
                st.failed_loads.append(p.dst[i])
        self._relist(settled)

    def _commit_save(self, p: PendingOp, done: int) -> None:
        """External L1: engine blocks copied into new host blocks: HOST (matchable), or on
        failure removed with the rest of the op (the op's nodes are a chain, later blocks
        children of earlier ones) and out of the request's held path."""
        for n in p.nodes[:done]:
            if self._settle(n):
                continue
            n.status = HOST
            n.host_ok = True
            self.stats.saved_external += 1
            if self.config.storage_write:
                self._maybe_store(n)
        failed = p.nodes[done:]
        parent = None
        for n in reversed(failed):  # deepest first: each is a leaf when it is dropped
            if self._settle(n):
                continue
            st = self._reqs.get(p.req_ids[0] or "")
            if st is not None and n.ref:
                idx = _index_of(st.nodes, n)
                if idx >= 0:
                    for m in reversed(st.nodes[idx:]):
                        m.ref -= 1
                    del st.nodes[idx:]
            assert n.ref == 0 and not n.children, f"failed save of {n} is still in use"
            parent = n.parent
            self.tree.detach(n)
            self._free_node_blocks(n)
            self.stats.dropped += 1
        self._relist(p.nodes[:done])
        if failed and parent is not None and parent.status is not DELETING:
            self.tree.relist(parent)  # the first failed node's parent, now without it

    def _maybe_store(self, n: Node) -> None:
        if not self.config.storage_write or n.in_store:
            return
        n.busy += 1
        op = self._op(H2S)
        op.nodes.append(n)
        op.src.append(n.host)
        op.keys.append(n.hash)
        op.req_ids.append(None)


_KIND_ORDER = {D2H: 0, BACKUP: 1, SAVE: 1, H2D: 2, LOAD: 2, S2H: 3, H2S: 4}


def _kind_rank(p: PendingOp) -> int:
    return _KIND_ORDER[p.kind]


def _index_of(nodes: list[Node], n: Node) -> int:
    for i, m in enumerate(nodes):
        if m is n:
            return i
    return -1


_COMMIT: dict[str, Callable[[CacheManager, PendingOp, int], None]] = {
    D2H: CommitMixin._commit_d2h,
    BACKUP: CommitMixin._commit_backup,
    H2D: CommitMixin._commit_h2d,
    S2H: CommitMixin._commit_s2h,
    H2S: CommitMixin._commit_h2s,
    LOAD: CommitMixin._commit_load,
    SAVE: CommitMixin._commit_save,
}
