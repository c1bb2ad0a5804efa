"""An ack's op results, from the dispatcher's side: checked against the batch's ops, then
merged over the ranks into the one result per op the scheduler commits on.

A rank's result claims ``done`` blocks of an op: more than the op has, or ``ok`` with
fewer (``protocol.result_claim_error``, the rule the cache manager's ``on_ops_done``
applies to an engine's results too), is a broken rank's (or a forged) ack, refused like
any malformed message, so the cache manager never commits on it (it clamped ``done`` to
the op and counted a failed copy as a success). Costs: O(results) per ack.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Set

from zkv import protocol as P

#: The op kinds whose results may follow a rank's ack (``pending``): storage I/O.
IO_KINDS = frozenset((P.S2H, P.H2S))
#: Op ids a refusal names at most (the rest counted): the line is logged.
_MAX_IDS_SHOWN = 8


def unexpected_ops(named: Set[int], expected: Set[int], pending: Set[int] = frozenset(),
                   io_ops: Set[int] = frozenset()) -> str | None:
    """Why an ack naming ops ``named`` (results and pending) is refused: some are not
    ``expected`` (the batch lacks them or they were reported), or it leaves ops pending
    that are no storage I/O (``io_ops``: a rank acks its copies at once, and no deadline
    bounds a pending op but the stores' own: a copy left pending stayed in flight for
    good). None when neither. The first few ids are named, the rest counted (every one
    was: an ack of 100,000 made-up op ids was a 700 KB log line). O(named)."""
    extra = named - expected
    if extra:
        return f"ack names ops {_ids(extra)}, which the batch does not have or already reported"
    copies = pending - io_ops
    if copies:
        return f"ack leaves ops {_ids(copies)} pending, which are no s2h / h2s"
    return None


def _ids(ids: Set[int]) -> str:
    shown = ", ".join(map(str, heapq.nsmallest(_MAX_IDS_SHOWN, ids)))
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > _MAX_IDS_SHOWN else "")


def bad_result(results: Iterable[P.OpResult], sizes: dict[int, int]) -> str | None:
    """Why a result claims what its op cannot hold (``sizes``: blocks per op id), or None."""
    for res in results:
        n = sizes.get(res.id)
        if n is not None and (why := P.result_claim_error(res, n)) is not None:
            return f"ack reports op {res.id}: {why}"
    return None


def merge(merged: dict[int, P.OpResult], results: Iterable[P.OpResult], rank: int) -> None:
    """An op's result is the minimum over ranks: all ok, min done, and the error of the
    rank with the fewest blocks done (the first such one): the one the result stands
    for. (It kept the first error seen, which could name a rank and block past the
    merged ``done``.)"""
    for res in results:
        op_id = res.id
        if res.error is not None:
            res = P.OpResult(op_id, res.ok, res.done, f"rank {rank}: {res.error}")
        cur = merged.get(op_id)
        if cur is None:
            merged[op_id] = res
        elif cur.ok > res.ok or res.done < cur.done:
            error = (res.error or cur.error) if res.done < cur.done else (cur.error
                                                                            or res.error)
            merged[op_id] = P.OpResult(op_id, cur.ok and res.ok, min(cur.done, res.done),
                                       error)
