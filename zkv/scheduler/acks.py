"""An ack's op results, from the dispatcher's side: checked against the batch's ops, then
merged over the ranks into the one result per op the scheduler commits on.

A rank's result claims ``done`` blocks of an op: more than the op has, or ``ok`` with
fewer (``protocol.result_claim_error``, the rule the cache manager's ``on_ops_done``
applies to an engine's results too), is a broken rank's (or a forged) ack, refused like
any malformed message, so the cache manager never commits on it (it clamped ``done`` to
the op and counted a failed copy as a success). Costs: O(results) per ack.
"""

from __future__ import annotations

from collections.abc import Iterable

from zkv import protocol as P


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
