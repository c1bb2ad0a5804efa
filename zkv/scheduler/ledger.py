"""The ledger of copy ops: this step's ops while they are built, then ops in flight until
every rank acked them (commit on ack is ``commit.py``'s; the ledger only keeps records)::

    op(kind) ──► open (one per kind; s2h / save one per request) ──take_ops──► pending
                                                                   on ack: pop ──► commit

An op entry is a node and the number of blocks it had when added; each entry holds one
``busy`` count on its node. A node split while in flight keeps its object for the last
blocks and puts the first ones in new nodes above it, so an entry's blocks are always the
node and the nearest ancestors that add up to its count (``pieces``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zkv.protocol import BACKUP, D2H, H2D, H2S, S2H, Op
from zkv.scheduler.radix import DELETING, Node, RadixTree
from zkv.scheduler.records import LOAD, SAVE, WIRE_KIND
from zkv.scheduler.running import PendingOp, RequestState

_KIND_ORDER = {D2H: 0, BACKUP: 1, SAVE: 1, H2D: 2, LOAD: 2, S2H: 3, H2S: 4}
KINDS = frozenset(_KIND_ORDER)  # the scheduler's op kinds (take_ops' ``keep`` names some)


class Ledger:
    """Open and pending ops. ``add`` is O(blocks) in C (list extends); ``take_ops`` O(ops)."""

    def __init__(self) -> None:
        self.open: dict[str, PendingOp] = {}     # this step's ops: by kind; s2h, save by request
        self.pending: dict[int, PendingOp] = {}  # taken, not yet acked
        self._next_op_id = 0

    def op(self, kind: str, key: str | None = None) -> PendingOp:
        """The step's open op of ``kind`` (or under ``key``: loads get one op per request, as
        an s2h's ``done`` counts a prefix, and one request's missing key must not discard
        another request's blocks)."""
        key = key or kind
        op = self.open.get(key)
        if op is None:
            op = PendingOp(self._next_op_id, kind)
            self._next_op_id += 1
            self.open[key] = op
        return op

    @staticmethod
    def request_key(kind: str, st: RequestState) -> str:
        """The open op of ``kind`` that is this request's own (s2h, save): one per request
        object, not per id, so a request re-matched (or finished and matched again) under
        its id before ``take_ops`` gets an op of its own (two incarnations in one op: the
        commit, which takes an op for one request's entries, left a load stranded or
        asserted on a failed save). The op holds ``st``, so its ``id`` is not reused while
        the op is open."""
        return f"{kind}:{st.req_id}:{id(st)}"

    @staticmethod
    def add(op: PendingOp, n: Node, st: RequestState | None = None, src: Sequence[int] = (),
            dst: Sequence[int] = (), keys: Sequence[bytes] = ()) -> None:
        """Put node ``n`` (all its blocks) in ``op`` for request ``st`` (None: for none);
        ``n`` is busy until the op settles."""
        n.busy += 1
        op.nodes.append(n)
        op.counts.append(len(n.hashes))
        op.reqs.append(st)
        op.src += src
        op.dst += dst
        op.keys += keys

    def take_ops(self, keep: tuple[str, ...] = ()) -> list[Op]:
        """This step's ops in the order workers run them (d2h, backup, h2d, s2h, h2s; one
        op per kind, one s2h per prefetching request). In flight until acked. Ops of the
        kinds in ``keep`` stay open (for a later take of the same step)."""
        open_ = self.open
        if not open_:
            return []
        if keep:
            keys = [k for k, p in open_.items() if p.kind not in keep]
            ops = [open_.pop(k) for k in keys]
            if not ops:
                return []
        else:
            ops = list(open_.values())
            open_.clear()
        if len(ops) > 1:
            ops.sort(key=_kind_rank)  # stable: s2h in request order
        pending = self.pending
        out = []
        for p in ops:
            pending[p.op_id] = p
            kind = WIRE_KIND.get(p.kind, p.kind)
            src, dst = p.src, p.dst
            out.append(Op(p.op_id, kind, np.array(src, _I4) if src else _NO_IDS,
                          np.array(dst, _I4) if dst else _NO_IDS, tuple(p.keys), kind == H2D))
        return out

    def discard_open(self) -> list[PendingOp]:
        """Forget this step's ops (never dispatched: nothing will ack them)."""
        out = list(self.open.values())
        self.open.clear()
        return out


def pieces(n: Node, count: int) -> list[Node]:
    """The nodes holding an entry's ``count`` blocks, root side first (see the module)."""
    out = []
    total = 0
    while total < count:
        out.append(n)
        total += len(n.hashes)
        n = n.parent  # type: ignore[assignment]
    assert total == count, f"op entry of {count} blocks ends inside {out[-1]}"
    out.reverse()
    return out


def outcomes(tree: RadixTree, p: PendingOp, done: int
             ) -> tuple[list[Node], list[tuple[Node, int, int]]]:
    """The nodes of ``p`` whose blocks are among the first ``done`` (succeeded), and the
    others as (node, entry index, position of its first block in the op), both in block
    order; a node held by two entries (two loads of one host block) is in the lists twice.
    An attached node across the boundary is split there first (a DELETING one only
    settles: its outcome does not matter)."""
    if done >= sum(p.counts):  # the common case: every block made it
        ok = []
        for node, count in zip(p.nodes, p.counts):
            if len(node.hashes) == count:
                ok.append(node)
            else:
                ok += pieces(node, count)
        return ok, []
    _split_at(tree, p, done)
    ok, failed = [], []
    pos = 0
    for e, (node, count) in enumerate(zip(p.nodes, p.counts)):
        for piece in pieces(node, count):
            if pos < done:
                ok.append(piece)
            else:
                failed.append((piece, e, pos))
            pos += len(piece.hashes)
    return ok, failed


def _split_at(tree: RadixTree, p: PendingOp, done: int) -> None:
    """Split the attached piece that block ``done`` of ``p`` falls inside, before any entry
    is cut into pieces: an earlier entry over the same node must see the new head too
    (else it settles the node's busy count but not the head's)."""
    pos = 0
    for node, count in zip(p.nodes, p.counts):
        if pos + count <= done:
            pos += count
            continue
        for piece in pieces(node, count):
            k = len(piece.hashes)
            if pos < done < pos + k and piece.status is not DELETING:
                tree.unlist_device_chain(piece)  # (listed: an L3 write's node on device)
                tree.split(piece, done - pos)
                return
            pos += k
        return


_I4 = np.dtype("<i4")
_NO_IDS = np.empty(0, _I4)
_NO_IDS.flags.writeable = False


def _kind_rank(p: PendingOp) -> int:
    return _KIND_ORDER[p.kind]
