"""Acks with pending storage ops: a rank acks its copies first and the I/O results later
(same seq); the Dispatcher completes a batch when every rank reported every op, so batches
may complete out of seq order. Fake ranks over real ipc:// sockets."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

from tests.waiting import wait_until
from tests.worker.helpers import (
    FakeRank,
    endpoints,
    events_named,
    joined_fakes,
    poll_for,
    poll_until_done,
    short_ipc_dir,
)
from zkv import protocol as P
from zkv.scheduler.dispatcher import Dispatcher

FP = "layout-fp"
COPY = P.Op(0, P.D2H, P.as_ids([0, 1]), P.as_ids([2, 3]))
LOAD = P.Op(1, P.S2H, dst=P.as_ids([4, 5, 6]), keys=(b"a" * 16, b"b" * 16, b"c" * 16))


@pytest.fixture
def group() -> Iterator[tuple[Dispatcher, list[FakeRank]]]:
    ctx: zmq.Context[Any] = zmq.Context()
    with short_ipc_dir() as folder:
        try:
            with joined_fakes(ctx, endpoints(folder), 2, FP, heartbeat_timeout_s=30.0,
                              ack_timeout_s=0.3) as group:
                yield group
        finally:
            ctx.term()


def ack(rank: FakeRank, seq: int, results: tuple[P.OpResult, ...],
        pending: tuple[int, ...] = ()) -> None:
    rank.send(P.BlocksCopied(seq, rank.rank, all(r.ok for r in results), results, 0.0, 0.0,
                             pending))


def test_io_results_follow_the_copy_ack(group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    seq = d.publish([COPY, LOAD], 0)
    for r in ranks:
        r.recv_batch()
        ack(r, seq, (P.OpResult(0, True, 2),), pending=(1,))
    assert poll_for(d, 0.1) == [] and d.in_flight == 1
    ack(ranks[0], seq, (P.OpResult(1, True, 3),))
    assert poll_for(d, 0.1) == []
    ack(ranks[1], seq, (P.OpResult(1, False, 2, "s2h: block 2 is not in the store"),))
    done = poll_until_done(d, seq)[seq]
    assert done.results == {0: P.OpResult(0, True, 2),
                            1: P.OpResult(1, False, 2, "rank 1: s2h: block 2 is not in the store")}
    assert not done.ok and d.in_flight == 0


def test_batches_complete_out_of_seq_order(group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    first = d.publish([LOAD], 0)
    second = d.publish([COPY], 1)
    for r in ranks:
        r.recv_batch(), r.recv_batch()
        ack(r, first, (), pending=(1,))
        ack(r, second, (P.OpResult(0, True, 2),))
    assert [b.seq for b in poll_until_done(d, second).values()] == [second]
    # polled past the ack deadline: the ranks acked (only I/O is pending), nobody is lost
    assert poll_for(d, 0.5) == [] and d.lost_ranks == frozenset()
    for r in ranks:
        ack(r, first, (P.OpResult(1, True, 3),))
    assert poll_until_done(d, first)[first].results == {1: P.OpResult(1, True, 3)}


def test_pending_io_reported_one_op_at_a_time(group: tuple[Dispatcher, list[FakeRank]]) -> None:
    """A rank may report its pending storage ops in several follow-ups: the batch waits
    for the last one's result, not only for the first follow-up."""
    d, ranks = group
    save = P.Op(2, P.H2S, src=P.as_ids([7]), keys=(b"d" * 16,))
    seq = d.publish([COPY, LOAD, save], 0)
    n, got = d.num_received, []
    for r in ranks:
        r.recv_batch()
        ack(r, seq, (P.OpResult(0, True, 2),), pending=(1, 2))
        ack(r, seq, (P.OpResult(1, True, 3),))  # op 2 still pending
    wait_until(lambda: d.num_received == n + 4, what="the acks",
               step=lambda: got.extend(d.poll(0.01)))
    assert got == [] and d.in_flight == 1
    ack(ranks[0], seq, (P.OpResult(2, False, 0, "h2s: store full"),))
    ack(ranks[1], seq, (P.OpResult(2, True, 1),))
    done = poll_until_done(d, seq)[seq]
    assert done.results == {0: P.OpResult(0, True, 2), 1: P.OpResult(1, True, 3),
                            2: P.OpResult(2, False, 0, "rank 0: h2s: store full")}


def test_bad_follow_ups_are_refused(group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    seq = d.publish([COPY, LOAD], 0)
    for r in ranks:
        r.recv_batch()
    ack(ranks[0], seq, (P.OpResult(0, True, 2),), pending=(1,))
    ack(ranks[1], seq, (P.OpResult(0, True, 2), P.OpResult(1, True, 3)))
    with capture_logs() as logs:
        ack(ranks[1], seq, (P.OpResult(1, True, 3),))               # rank 1 had nothing pending
        ack(ranks[0], seq, (P.OpResult(0, False, 0, "late"),))      # op 0 was not pending
        ack(ranks[0], seq, (P.OpResult(1, True, 3),), pending=(0,))  # pending must shrink
        assert poll_for(d, 0.1) == []
    refused = events_named(logs, "dispatcher.ack_refused")
    assert sorted(e["rank"] for e in refused) == [0, 0, 1]  # ranks send on their own pipes
    ack(ranks[0], seq, (P.OpResult(1, True, 3),))
    done = poll_until_done(d, seq)[seq]
    assert done.ok and done.results[0] == P.OpResult(0, True, 2)


def test_a_copy_left_pending_is_refused_and_the_deadline_judges_the_rank(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    """Only storage ops (s2h / h2s) may be left ``pending``: a rank acks its copies at once,
    and nothing bounds a pending op but the stores' own timeouts. An ack that leaves the
    copy pending is refused, so the rank's ack deadline still judges it. (Before, it was
    taken: every rank had acked, no deadline looked at the batch any more, and the copy
    stayed in flight for good, its blocks pinned, the rank never lost.)"""
    d, ranks = group
    seq = d.publish([COPY, LOAD], 0)
    for r in ranks:
        r.recv_batch()
    ack(ranks[1], seq, (P.OpResult(0, True, 2),), pending=(1,))
    with capture_logs() as logs:
        ack(ranks[0], seq, (), pending=(0, 1))
        done = poll_until_done(d, seq)[seq]  # (ack_timeout_s=0.3)
    (refused,) = events_named(logs, "dispatcher.ack_refused")
    assert refused["rank"] == 0 and "leaves ops 0 pending" in refused["error"]
    assert not done.ok and d.lost_ranks == frozenset({0})
    assert done.results[0].error == "rank 0 lost: no ack for seq 0 within 0.3 s"


def test_a_rank_lost_while_io_is_pending_fails_the_batch(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    seq = d.publish([COPY, LOAD], 0)
    for r in ranks:
        r.recv_batch()
        ack(r, seq, (P.OpResult(0, True, 2),), pending=(1,))
    ranks[1].send(P.Bye(1, ranks[1].pid, "crashed"))
    done = poll_until_done(d, seq)[seq]
    assert not done.ok and done.lost_ranks == frozenset({1})
    assert all(not r.ok and "rank 1 lost" in str(r.error) for r in done.results.values())


def test_the_deadline_still_catches_a_silent_rank_behind_pending_io(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    first = d.publish([LOAD], 0)
    second = d.publish([COPY], 1)
    for r in ranks:
        r.recv_batch(), r.recv_batch()
        ack(r, first, (), pending=(1,))
    ack(ranks[0], second, (P.OpResult(0, True, 2),))  # rank 1 never acks the second batch
    done = poll_until_done(d, {first, second}, timeout=5)
    assert d.lost_ranks == frozenset({1}) and not done[second].ok and not done[first].ok


def test_pending_travels_in_the_ack() -> None:
    msg = P.BlocksCopied(3, 1, True, (P.OpResult(0, True, 2),), 1.0, 2.0, (5, 7))
    assert P.decode(P.encode(msg)) == msg
    plain = P.BlocksCopied(3, 1, True, ())
    assert b"pending" not in P.encode(plain)[1] and P.decode(P.encode(plain)) == plain
    frames = P.encode(P.BlocksCopied(3, 1, True, (P.OpResult(0, True, 2),), 0, 0, (0,)))
    with pytest.raises(P.ProtocolError, match="overlap"):
        P.decode(frames)
    frames = [P.T_ACK, frames[1].replace(b'"pending":[0]', b'"pending":[-1]')]
    with pytest.raises(P.ProtocolError, match="pending"):
        P.decode(frames)
