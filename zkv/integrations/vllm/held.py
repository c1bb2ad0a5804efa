"""Finished requests whose blocks vLLM keeps for zkv until their last save ran.

A request's final save stops at a block whose save is still in flight: another request's
of the same prefix that finished in the same step. (Its own previous chunk's save in
flight does not stop it: the final save chains past it, ``cache_computed(chain=True)``;
the workers run batches in order, and the chained blocks go with that save if it fails.
Before, that case was held too, the most common one: vLLM kept the blocks a step or two,
and a cache reset then failed, as vLLM's does with any finished request still holding
blocks.) What follows that block cannot be saved before that op settles, and vLLM frees a
finished request's blocks at once unless the connector says otherwise. So such a request
answers ``request_finished`` with ``delay_free_blocks=True``; every later step saves on
from where it stopped, and once nothing on its path is in flight (or the rest is saved,
or zkv went off) it is let go: the step's metadata names it with the seq of the batch that
carried its last save, and each worker half reports it finished (vLLM's
``finished_sending``) once that batch ran on its rank, so vLLM frees the blocks after the
save read them. Other finishes keep ``False`` (a fence orders their save before the next
forward; and so do those that stopped at a load from L3, which brings the blocks itself
and takes a store read): holding the blocks of every finishing request left a tight vLLM
cache spinning on empty steps (a 6-document warm-up took 31 s instead of 15)::

    request_finished ── final save complete, or stopped for good (no host block) ──► False
        │ stopped at a save in flight on its path
        ▼
    held (True) ── each step: save on ── nothing in flight on its path / all saved /
                                          zkv off ──► meta.finish_after (rid, seq)
                                                          │ each worker half: batch seq
                                                          │ ran here (or its rank is gone,
                                                          │ or the wait timed out: saves
                                                          ▼ abandoned)
                                                      get_finished: sending {rid}
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from zkv.integrations.vllm.records import RequestState


class HeldFinishes:
    """The scheduler half's held requests (request id → state), oldest first."""

    def __init__(self) -> None:
        self._reqs: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._reqs.values()))

    def get(self, rid: str) -> RequestState | None:
        return self._reqs.get(rid)

    def hold(self, r: RequestState) -> None:
        self._reqs[r.request.request_id] = r

    def release(self, waits: Callable[[RequestState], bool],
                finish: Callable[[str], None]) -> list[tuple[str, int]]:
        """Let go of every held request that ``waits`` no more (``finish`` it); for each,
        (request id, the seq of the batch with its last save, -1: none)."""
        out = []
        for r in self:
            if waits(r):
                continue
            rid = r.request.request_id
            del self._reqs[rid]
            finish(rid)
            out.append((rid, -1 if r.last_save_seq is None else r.last_save_seq))
        return out


class SaveReports:
    """A worker half's held requests to report finished once their last save ran here."""

    def __init__(self) -> None:
        self._waiting: list[tuple[str, int, float]] = []  # (rid, seq, since)

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, items: Iterable[tuple[str, int]], now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        self._waiting += [(rid, seq, t) for rid, seq in items]

    def take(self, ran: Callable[[int], bool], timeout_s: float,
             give_up: Callable[[int], None], now: float | None = None) -> set[str] | None:
        """The ids whose batch ``ran`` here (seq -1: none); one that waited ``timeout_s``
        is reported too, after ``give_up(seq)`` (its saves abandoned: vLLM may reuse the
        blocks). None when none is due (vLLM's "nothing finished")."""
        if not self._waiting:
            return None
        t = time.monotonic() if now is None else now
        done: set[str] = set()
        left = []
        for rid, seq, since in self._waiting:
            if seq < 0 or ran(seq):
                done.add(rid)
            elif t - since >= timeout_s:
                give_up(seq)
                done.add(rid)
            else:
                left.append((rid, seq, since))
        self._waiting = left
        return done or None
