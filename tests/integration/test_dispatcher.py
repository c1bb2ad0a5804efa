"""The Dispatcher against hand-driven fake ranks over real ipc:// sockets."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

from tests.waiting import holds_within, idle_for, wait_until
from tests.worker.helpers import (
    FakeRank,
    endpoints,
    events_named,
    joined_fakes,
    poll_until_done,
    short_ipc_dir,
)
from zkv import protocol as P
from zkv.errors import ConfigError, RankLost
from zkv.log import RANK_REFUSED
from zkv.scheduler.dispatcher import Dispatcher

FP = "layout-fp"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def eps() -> Iterator[tuple[str, str]]:
    with short_ipc_dir() as d:
        yield endpoints(d)


@pytest.fixture
def group(ctx: zmq.Context[Any],
          eps: tuple[str, str]) -> Iterator[tuple[Dispatcher, list[FakeRank]]]:
    """A dispatcher with 3 joined fake ranks."""
    with joined_fakes(ctx, eps, 3, FP) as group:
        yield group


def _op(i: int, n: int = 2) -> P.Op:
    """A d2h of ``n`` blocks; ops of other ids use other blocks (one batch's ops never
    write one block: the receiver refuses such a batch)."""
    return P.Op(i, P.D2H, P.as_ids(range(8 * i, 8 * i + n)),
                P.as_ids(range(8 * i + 100, 8 * i + 100 + n)))


def test_scheduler_side_imports_no_tensor_libraries() -> None:
    code = ("import sys, zkv.scheduler.dispatcher; "
            "bad = [m for m in ('torch', 'cupy', 'zkv.worker', 'zkv.kernels') "
            "if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_join_publish_and_ack(group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    assert d.publish([_op(0), _op(1, 3)], step=5) == 0
    assert d.publish([], step=6) == 1
    assert d.in_flight == 2
    for r in ranks:
        b0, b1 = r.recv_batch(), r.recv_batch()
        assert (b0.seq, b0.step, [op.id for op in b0.ops]) == (0, 5, [0, 1])
        assert (b1.seq, b1.step, b1.ops) == (1, 6, ())
        r.ack(b0)
        r.ack(b1)
    done = poll_until_done(d, {0, 1})
    assert done[0].ok and done[0].lost_ranks == frozenset()
    assert done[0].results == {0: P.OpResult(0, True, 2), 1: P.OpResult(1, True, 3)}
    assert done[1].ok and done[1].results == {}
    assert d.in_flight == 0


def test_ack_aggregation_is_minimum_over_ranks(group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    d.publish([_op(0, 4), _op(7, 4)], step=0)
    batches = [r.recv_batch() for r in ranks]
    ranks[0].ack(batches[0], {0: P.OpResult(0, True, 4), 7: P.OpResult(7, False, 3, "disk full")})
    ranks[1].ack(batches[1], {0: P.OpResult(0, True, 4), 7: P.OpResult(7, False, 1, "timeout")})
    # two of three acks: not complete, whatever we wait
    assert d.poll(0.2) == []
    assert d.in_flight == 1
    ranks[2].send(P.BlocksCopied(0, 2, False, (P.OpResult(0, False, 2, "bad block"),)))  # no op 7
    (done,) = poll_until_done(d, 0).values()
    assert not done.ok
    assert done.results[0] == P.OpResult(0, False, 2, "rank 2: bad block")
    # the error of the rank that holds the op back the most (rank 2 named no op 7)
    assert done.results[7] == P.OpResult(7, False, 0, "rank 2: no result")


def test_the_merged_error_is_the_rank_with_the_fewest_blocks_done(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    """Rank 0 fails at block 3, rank 1 at block 1: the merged result says done 1 and names
    rank 1's block 1, whichever ack comes first (it named rank 0's block 3)."""
    d, ranks = group
    for order in ((0, 1, 2), (1, 0, 2)):
        seq = d.publish([_op(0, 4)], step=0)
        batches = {r.rank: r.recv_batch() for r in ranks}
        errors = {0: P.OpResult(0, False, 3, "s2h: block 3 corrupt"),
                  1: P.OpResult(0, False, 1, "s2h: block 1 is not in the store"),
                  2: P.OpResult(0, True, 4)}
        for rank in order[:-1]:  # one ack at a time, in this order
            n = d.num_received
            ranks[rank].ack(batches[rank], {0: errors[rank]})
            wait_until(lambda n=n: d.poll(0.01) == [] and d.num_received > n,
                       what=f"rank {rank}'s ack")
        ranks[order[-1]].ack(batches[order[-1]], {0: errors[order[-1]]})
        (done,) = poll_until_done(d, seq).values()
        assert done.results[0] == P.OpResult(0, False, 1,
                                             "rank 1: s2h: block 1 is not in the store"), order


def test_an_op_one_rank_failed_fails_even_with_every_block_done(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    """A rank may fail an op after all its blocks were done (``ok`` false, ``done`` =
    the op's blocks): the merged result is failed, whichever rank acked first."""
    d, ranks = group
    failed = P.OpResult(0, False, 2, "h2s: written, not confirmed")
    for order in ((0, 1, 2), (2, 1, 0)):
        seq = d.publish([_op(0)], step=0)
        batches = {r.rank: r.recv_batch() for r in ranks}
        for rank in order[:-1]:  # one ack at a time, in this order
            n = d.num_received
            ranks[rank].ack(batches[rank], {0: failed} if rank == 2 else None)
            wait_until(lambda n=n: d.poll(0.01) == [] and d.num_received > n,
                       what=f"rank {rank}'s ack")
        last = order[-1]
        ranks[last].ack(batches[last], {0: failed} if last == 2 else None)
        (done,) = poll_until_done(d, seq).values()
        assert not done.ok, order
        assert done.results[0] == P.OpResult(0, False, 2, f"rank 2: {failed.error}"), order


def test_batches_complete_in_seq_order_only_when_all_acked(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    seqs = [d.publish([_op(0)], step=s) for s in range(5)]
    got = {r.rank: [r.recv_batch() for _ in seqs] for r in ranks}
    for r in ranks[:2]:
        for b in got[r.rank]:
            r.ack(b)
    for b in got[2][:3]:
        ranks[2].ack(b)
    done = poll_until_done(d, {0, 1, 2})
    assert sorted(done) == [0, 1, 2]
    assert d.in_flight == 2
    for b in got[2][3:]:
        ranks[2].ack(b)
    assert sorted(poll_until_done(d, {3, 4})) == [3, 4]


def test_a_batch_stuck_on_pending_io_keeps_one_entry_and_later_ones_settle(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    """A batch whose storage op never finishes (a hung file system under a file://
    store) stays in flight, alone: the batches after it settle, and nothing is kept per
    settled batch (the vLLM half kept every later seq in a set while one was stuck)."""
    d, ranks = group
    stuck = d.publish([P.Op(0, P.H2S, src=P.as_ids([1]), keys=(b"k" * 16,))], step=0)
    for r in ranks:  # its first ack names the op pending: its result never comes
        b = r.recv_batch()
        r.send(P.BlocksCopied(b.seq, r.rank, True, (), time.time(), time.time(), (0,)))
    later = [d.publish([_op(1)], step=s) for s in range(1, 200)]
    for r in ranks:
        for _ in later:
            r.ack(r.recv_batch())
    poll_until_done(d, set(later))
    assert d.in_flight == 1 and not d.settled(stuck)
    assert all(d.settled(s) for s in later) and not d.settled(later[-1] + 1)


def test_bad_acks_are_refused_and_ignored(group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    d.publish([_op(0)], step=0)
    batches = [r.recv_batch() for r in ranks]
    before = d.refusals()
    with capture_logs() as logs:
        ranks[0].ack(batches[0])
        ranks[0].ack(batches[0])  # duplicate
        ranks[1].send(P.BlocksCopied(99, 1, True, ()))  # unknown seq
        ranks[1].send(P.BlocksCopied(0, 1, True, (P.OpResult(5, True, 1),)))  # unknown op
        ranks[1].send_raw([P.T_ACK, b"{not json"])  # malformed
        ranks[1].send_raw([P.T_ACK, b'{"v": 1, "seq": true}'])
        ranks[1].send(P.BlocksCopied(0, 9, True, ()))  # rank out of range
        ranks[1].send(P.Shutdown("nonsense on the ack channel"))
        assert d.poll(0.2) == []
        ranks[1].ack(batches[1])
        ranks[2].ack(batches[2])
        (done,) = poll_until_done(d, 0).values()
    assert done.ok and done.results == {0: P.OpResult(0, True, 2)}
    refused = events_named(logs, "dispatcher.ack_refused")
    assert len(refused) == 7, refused
    counted = {k: n - before[k] for k, n in d.refusals().items() if n != before[k]}
    assert counted == {"duplicate": 1, "unknown_seq": 1, "malformed": 4,
                       "unknown_rank": 1}, counted  # each under its own reason
    assert d.lost_ranks == frozenset()



def _refused_types(logs: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events_named(logs, "dispatcher.ack_refused")]


def test_a_scheduler_message_on_the_ack_channel_is_refused_and_counted(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    """Only acks, hellos, heartbeats and byes come from a rank. A ``Refused`` names a rank
    as they do: it was dropped without a count or a line; now, as a ``Shutdown`` or a
    batch, it is refused as malformed."""
    d, ranks = group
    before = d.refusals()["malformed"]
    with capture_logs() as logs:
        ranks[1].send(P.Refused(1, ranks[1].pid, "not the scheduler's"))
        ranks[1].send(P.Shutdown("nor this"))  # (after it on one connection: read after it)
        wait_until(lambda: "Shutdown" in _refused_types(logs), 5, "the Shutdown's refusal",
                   step=lambda: d.poll(0.01))
    assert _refused_types(logs) == ["Refused", "Shutdown"]
    assert d.refusals()["malformed"] == before + 2
    assert d.lost_ranks == frozenset()


def test_an_ack_claiming_more_than_its_op_holds_is_refused(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    """A rank's result for a 2-block op that claims 7 blocks done, or ok with 1 done, is a
    broken (or forged) ack: refused, so the scheduler never commits on it (the cache
    manager clamped such a ``done`` and counted a failed copy as a success). The batch
    completes on the right acks."""
    d, ranks = group
    d.publish([_op(0)], step=0)
    batches = [r.recv_batch() for r in ranks]
    before = d.refusals().get("malformed", 0)
    with capture_logs() as logs:
        ranks[0].ack(batches[0], {0: P.OpResult(0, False, 7, "x")})
        ranks[1].ack(batches[1], {0: P.OpResult(0, True, 1)})
        assert d.poll(0.2) == []
    refused = events_named(logs, "dispatcher.ack_refused")
    assert [e["error"] for e in refused] == [
        "ack reports op 0: done 7 is outside [0, 2] (the op's blocks)",
        "ack reports op 0: ok with 1 of 2 blocks done"], refused
    assert d.refusals()["malformed"] == before + 2 and d.in_flight == 1
    for r, b in zip(ranks, batches):
        r.ack(b)
    (done,) = poll_until_done(d, 0).values()
    assert done.ok and done.results == {0: P.OpResult(0, True, 2)}

def test_publish_misuse(ctx: zmq.Context[Any], eps: tuple[str, str]) -> None:
    d = Dispatcher(*eps, 1, FP, context=ctx)
    r = FakeRank(ctx, *eps, 0, FP)
    try:
        with pytest.raises(RuntimeError, match="wait_for_ranks"):
            d.publish([], step=0)
        r.join()
        d.wait_for_ranks(5)
        with pytest.raises(ValueError, match="duplicate op ids"):
            d.publish([_op(1), _op(1)], step=0)
        assert d.publish([], step=0) == 0  # the refused batch took no seq
    finally:
        d.close(shutdown=False)
        r.close()


def test_hello_before_subscription_does_not_count(ctx: zmq.Context[Any],
                                                  eps: tuple[str, str]) -> None:
    """The slow-joiner case: a hello over PUSH that outruns the SUB's subscription."""
    d = Dispatcher(*eps, 2, FP, context=ctx)
    r0 = FakeRank(ctx, *eps, 0, FP).join()
    r1 = FakeRank(ctx, *eps, 1, FP)
    try:
        r1.hello()
        with pytest.raises(TimeoutError) as err:
            d.wait_for_ranks(0.3)
        msg = str(err.value)
        assert "ranks [1] of 2" in msg and "subscription never arrived" in msg
        r1.subscribe()
        d.wait_for_ranks(5)
        d.publish([_op(0)], step=0)
        assert r1.recv_batch().seq == 0  # not dropped
        assert r0.recv_batch().seq == 0
    finally:
        d.close(shutdown=False)
        r0.close()
        r1.close()


def test_a_process_replacing_a_joined_one_joins_with_its_own_subscription(
        ctx: zmq.Context[Any], eps: tuple[str, str]) -> None:
    """Before the start, a new process of a rank that had joined says hello: the old one is
    told to stop, and the rank is joined again only once the new one's subscription came
    (had the old one kept the place, the group would start on a process going away, and
    the new one's batches could be dropped)."""
    d = Dispatcher(*eps, 1, FP, context=ctx)
    old = FakeRank(ctx, *eps, 0, FP, pid=111).join()
    new = FakeRank(ctx, *eps, 0, FP, pid=222)
    try:
        wait_until(lambda: d._ranks[0].joined_pid == 111, what="the old process to join",
                   step=lambda: d.poll(0.02))
        new.hello()
        wait_until(lambda: d._ranks[0].hello_pid == 222, what="the new process's hello",
                   step=lambda: d.poll(0.02))
        with pytest.raises(TimeoutError, match=r"said hello \(pid 222\) but its subscription"):
            d.wait_for_ranks(0.3)
        told = old.recv()
        assert isinstance(told, P.Refused) and (told.rank, told.pid) == (0, 111), told
        new.subscribe()
        d.wait_for_ranks(5)
        d.publish([_op(0)], step=0)
        assert new.recv_batch().seq == 0
    finally:
        d.close(shutdown=False)
        old.close()
        new.close()


def test_layout_mismatch_is_refused(ctx: zmq.Context[Any], eps: tuple[str, str]) -> None:
    d = Dispatcher(*eps, 2, FP, context=ctx)
    r0 = FakeRank(ctx, *eps, 0, FP).join()
    r1 = FakeRank(ctx, *eps, 1, "other-layout").join()
    try:
        with capture_logs() as logs, pytest.raises(ConfigError) as err:
            d.wait_for_ranks(5)  # refused at the hello, not at the timeout
        assert "rank 1 (pid 100001) refused" in str(err.value)
        assert "other-layout" in str(err.value)
        (refused,) = events_named(logs, RANK_REFUSED)
        assert refused["rank"] == 1 and "other-layout" in refused["error"]
        told = r1.recv()  # the process hears it, with the same reason
        assert told == P.Refused(1, 100001, str(err.value)), told
        assert r0.recv() == told  # every rank reads it (the actor reads past another's)
        r1.hello(FP)  # the same rank, now with the right layout
        d.wait_for_ranks(5)
    finally:
        d.close(shutdown=False)
        r0.close()
        r1.close()


@pytest.mark.parametrize("first", ["marker", "hello"])
def test_a_refused_process_is_told_whether_its_marker_or_hello_came_first(
        ctx: zmq.Context[Any], eps: tuple[str, str], first: str) -> None:
    """Refused is published at the hello, which reaches a SUB whose marker came before;
    a SUB that subscribes after its hello is told when its marker arrives."""
    d = Dispatcher(*eps, 2, FP, context=ctx)
    r0 = FakeRank(ctx, *eps, 0, FP).join()
    r1 = FakeRank(ctx, *eps, 1, "other-layout")
    try:
        if first == "marker":
            r1.subscribe()
            with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2"):
                d.wait_for_ranks(0.5)  # the marker is read, no hello yet
        r1.hello()
        with pytest.raises(ConfigError, match="other-layout"):
            d.wait_for_ranks(5)
        if first == "hello":
            assert not r1.sub.poll(100)  # not subscribed: nothing reached it
            r1.subscribe()
            with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2"):
                d.wait_for_ranks(1)  # reads the marker
        msg = r1.recv()
        assert isinstance(msg, P.Refused) and (msg.rank, msg.pid) == (1, 100001)
        assert "other-layout" in msg.reason
        assert not r1.sub.poll(100)  # told once
    finally:
        d.close(shutdown=False)
        r0.close()
        r1.close()


@pytest.mark.parametrize("rank", [1, 5])  # (1: the first rank past a world of 1)
def test_a_hello_from_outside_the_world_is_told(ctx: zmq.Context[Any], eps: tuple[str, str],
                                                 rank: int) -> None:
    d = Dispatcher(*eps, 1, FP, context=ctx)
    outside = FakeRank(ctx, *eps, rank, FP).join()
    pid = outside.pid
    try:
        with pytest.raises(TimeoutError):
            d.wait_for_ranks(0.5)
        assert outside.recv() == P.Refused(rank, pid, f"rank {rank} (pid {pid}) refused: rank "
                                           f"{rank} is not below world size 1")
        assert d.refusals()["unknown_rank"] == 1
    finally:
        d.close(shutdown=False)
        outside.close()


def test_a_new_process_of_a_running_rank_is_told_and_the_group_goes_on(
        ctx: zmq.Context[Any], eps: tuple[str, str],
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    late = FakeRank(ctx, *eps, 0, FP, pid=4242).join()
    try:
        with capture_logs() as logs:
            assert holds_within(lambda: bool(late.sub.poll(0)), 5, lambda: d.poll(0.01))
        msg = late.recv()
        assert msg == P.Refused(0, 4242, "rank 0 (pid 4242) refused: hello after the group "
                                "started (ranks cannot rejoin)"), msg
        (line,) = events_named(logs, RANK_REFUSED)
        assert line["worker_pid"] == 4242
        seq = d.publish([_op(0)], step=0)  # the running rank 0 (another pid) reads past it
        for r in ranks:
            r.ack(r.recv_batch())
        done = poll_until_done(d, seq)[seq]
        assert done.ok and not done.lost_ranks and not d.lost_ranks
    finally:
        late.close()


def test_no_hello_names_missing_ranks(ctx: zmq.Context[Any], eps: tuple[str, str]) -> None:
    d = Dispatcher(*eps, 4, FP, context=ctx)
    r2 = FakeRank(ctx, *eps, 2, FP).join()
    try:
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1, 3\] of 4.*rank 0: no hello"):
            d.wait_for_ranks(0.3)
    finally:
        d.close(shutdown=False)
        r2.close()


def test_close_publishes_shutdown(ctx: zmq.Context[Any], eps: tuple[str, str]) -> None:
    with joined_fakes(ctx, eps, 2, FP) as (d, ranks):
        for r in ranks:
            r.send(P.Bye(r.rank, r.pid, "shutdown"))  # early byes: close must not wait long
        d.close(shutdown=True)
        for r in ranks:
            assert r.recv() == P.Shutdown("scheduler closed")
        with pytest.raises(RuntimeError):
            d.publish([], step=0)
        d.close()  # idempotent


def test_close_waits_for_the_joined_process_bye_not_an_old_ones(
        ctx: zmq.Context[Any], eps: tuple[str, str]) -> None:
    """A bye with another pid than the joined process's (an old process of that rank, still
    connected) does not end close's wait for byes: the joined process may not have read the
    Shutdown yet, and closing with linger 0 could drop it. Before, the old process's bye
    ended the wait at once."""
    import threading

    with joined_fakes(ctx, eps, 1, FP) as (d, (r,)):
        old = FakeRank(ctx, *eps, 0, FP, pid=4242)
        try:
            old.send(P.Bye(0, 4242, "sigterm"))
            closer = threading.Thread(target=d.close, kwargs={"timeout_s": 20})
            closer.start()
            assert r.recv() == P.Shutdown("scheduler closed")
            assert not holds_within(lambda: not closer.is_alive(), 1.0), "did not wait"
            r.send(P.Bye(0, r.pid, "shutdown"))
            closer.join(10)
            assert not closer.is_alive()
        finally:
            old.close()


def test_from_env_names_a_missing_endpoint() -> None:
    with pytest.raises(ConfigError, match="ZKV_PULL_ENDPOINT is not set .zkvrun sets it"):
        Dispatcher.from_env(1, FP, env={"ZKV_PUB_ENDPOINT": "ipc:///nowhere"})


def test_after_close_nothing_is_in_flight_and_nothing_waits(
        ctx: zmq.Context[Any], eps: tuple[str, str]) -> None:
    """A batch in flight at close is counted in ``dispatcher.stopped`` and forgotten: no
    ack can complete it, so ``drain`` returns at once (it spun a core for its whole
    timeout) and ``poll`` says nothing (a closed socket's zmq error before). A group
    that never joined is told ``wait_for_ranks`` comes after close (a zmq error too)."""
    with joined_fakes(ctx, eps, 2, FP) as (d, _ranks):
        d.publish([_op(0)], step=0)
        with capture_logs() as logs:
            d.close(shutdown=False)
        (stopped,) = [e for e in logs if e["event"] == "dispatcher.stopped"]
        assert stopped["num_in_flight"] == 1
        assert d.in_flight == 0 and d.closed
        assert d.drain(2.0) == [] and d.poll(0.5) == []  # (drain: nothing left to wait on)
    never = Dispatcher(*eps, 1, FP, context=ctx)
    never.close(shutdown=False)
    with pytest.raises(RuntimeError, match=r"wait_for_ranks\(\) after close"):
        never.wait_for_ranks(1)


def test_rank_loss_fails_in_flight_and_later_publish(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    d.publish([_op(0), _op(1)], step=0)
    d.publish([], step=1)
    batches = [r.recv_batch() for r in ranks]
    ranks[0].ack(batches[0])
    r2 = ranks[2]
    with capture_logs() as logs:
        r2.send(P.Bye(2, r2.pid, "seq gap: expected 0 got 1"))
        done = poll_until_done(d, {0, 1}, timeout=5)
    (lost,) = events_named(logs, "dispatcher.rank_lost")
    assert lost["rank"] == 2 and "seq gap: expected 0 got 1" in lost["reason"]
    assert d.lost_ranks == frozenset({2}) and d.in_flight == 0
    for b in done.values():
        assert not b.ok and b.lost_ranks == frozenset({2})
        for op_id, res in b.results.items():
            assert res == P.OpResult(op_id, False, 0, res.error)
            assert res.error is not None and res.error.startswith("rank 2 lost: ")
    assert set(done[0].results) == {0, 1}
    with pytest.raises(RankLost) as err:
        d.publish([], step=2)
    assert err.value.rank == 2
    # late acks of the failed batches are ignored quietly: not refused, not counted
    before, n, got = d.refusals(), d.num_received, []
    ranks[1].ack(batches[1])
    wait_until(lambda: d.num_received > n, what="the late ack",
               step=lambda: got.extend(d.poll(0.01)))
    assert got == [] and d.refusals() == before


def test_a_rank_whose_subscriber_goes_away_is_lost_at_once(ctx: zmq.Context[Any],
                                                           eps: tuple[str, str]) -> None:
    """A killed process's SUB disconnects: the XPUB reports its ready marker's
    unsubscription, and the rank is lost after the short grace a Bye gets, failing its
    batches then, not at a heartbeat or ack timeout (here a minute)."""
    with joined_fakes(ctx, eps, 2, FP, heartbeat_timeout_s=60.0,
                      ack_timeout_s=60.0) as (d, ranks):
        seq = d.publish([_op(0)], step=0)
        ranks[0].ack(ranks[0].recv_batch())
        ranks[1].sub.close(0)  # (its PUSH stays: no heartbeat is missed yet either)
        done = poll_until_done(d, seq, timeout=10)[seq]
        assert not done.ok and done.lost_ranks == frozenset({1})
        assert done.results[0].error == "rank 1 lost: its subscriber disconnected"
        assert d.lost_ranks == frozenset({1})


def _idle_gap(ranks: list[FakeRank], seconds: float) -> None:
    """Time passes without a poll (an idle engine schedules nothing); ``ranks`` keep
    beating the way a worker's heartbeat thread does."""
    idle_for(seconds, beat=lambda: [r.heartbeat() for r in ranks], every=0.05)


def test_an_idle_gap_without_polls_loses_no_rank(ctx: zmq.Context[Any],
                                                  eps: tuple[str, str]) -> None:
    with joined_fakes(ctx, eps, 2, FP, heartbeat_timeout_s=0.3) as (d, ranks):
        _idle_gap(ranks, 0.9)  # 3 timeouts; every heartbeat of it still queued
        with capture_logs() as logs:
            assert d.poll(0) == []
            assert d.lost_ranks == frozenset()
            seq = d.publish([_op(0)], step=0)
            for r in ranks:
                r.ack(r.recv_batch())
            done = poll_until_done(d, seq)[seq]
        assert done.ok and done.lost_ranks == frozenset()
        assert events_named(logs, "dispatcher.rank_lost") == []
        # The backlog is read before judging, not instead of it: a rank that said
        # nothing during the gap is lost at the first poll after it.
        _idle_gap(ranks[:1], 0.9)
        with capture_logs() as logs:
            d.poll(0)
        assert d.lost_ranks == frozenset({1})
        (lost,) = events_named(logs, "dispatcher.rank_lost")
        assert lost["rank"] == 1 and "no heartbeat" in lost["reason"]


@pytest.mark.parametrize("max_sockets", [1, 3, 4])
def test_a_socket_that_cannot_be_made_leaves_nothing_open(eps: tuple[str, str],
                                                          max_sockets: int) -> None:
    """The context's (or the process's) socket limit reached while the dispatcher opens its
    sockets (the ZAP handler takes 3: at 1 it fails, at 3 the XPUB, at 4 the PULL): the error, and
    nothing left behind, neither a socket, the ZAP domain and its thread, nor a context
    that cannot end. (Before, a failed XPUB or PULL left the ZAP thread, its domain and the
    XPUB open: unregistering failed too, for want of a socket.)"""
    import threading

    from zkv.security import ZapHandler

    def zap_threads() -> int:
        return sum(t.name == "zkv-zap" and t.is_alive() for t in threading.enumerate())

    before = zap_threads()
    c: zmq.Context[Any] = zmq.Context()
    c.set(zmq.MAX_SOCKETS, max_sockets)
    try:
        with pytest.raises(zmq.ZMQError, match="Too many open files"):
            Dispatcher(*eps, 1, FP, context=c)
        assert id(c) not in ZapHandler._by_context and zap_threads() == before
    finally:
        ender = threading.Thread(target=c.term, daemon=True)
        ender.start()
        ender.join(5.0)
    assert not ender.is_alive(), "a socket left open keeps the context from ending"


def test_an_endpoint_it_cannot_listen_on_is_one_line_and_leaves_nothing_open(
        eps: tuple[str, str]) -> None:
    """A port another process holds, an address not this machine's (zkvrun's
    ``--master-addr`` / ``--master-port``): one ConfigError naming the endpoint, not a zmq
    traceback; the XPUB, bound already when the PULL fails, is closed again, and so is the
    ZAP domain: the context ends."""
    import socket
    import threading

    from zkv.security import ZapHandler

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    c: zmq.Context[Any] = zmq.Context()
    try:
        for pub, pull, why in [
                (f"tcp://127.0.0.1:{port}", eps[1], "Address already in use"),
                ("tcp://bad host:29511", eps[1], "No such device"),
                (eps[0], f"tcp://127.0.0.1:{port}", "Address already in use")]:  # XPUB bound
            with pytest.raises(ConfigError) as err:
                Dispatcher(pub, pull, 1, FP, insecure=True, allow_remote=True, context=c)
            bad = pull if pub == eps[0] else pub
            assert str(err.value) == f"the scheduler cannot listen on {bad}: {why}"
            assert id(c) not in ZapHandler._by_context
    finally:
        taken.close()
        ender = threading.Thread(target=c.term, daemon=True)
        ender.start()
        ender.join(5.0)
    assert not ender.is_alive(), "a socket left open keeps the context from ending"


def test_a_context_ended_under_a_registered_domain_ends_the_zap_thread_quietly() -> None:
    """Its owner stopped before it closed (SIGTERM while a dispatcher was being made, in
    zkv soak): the ZAP thread ends with the context, which ends, and a late unregister is
    a no-op. (Before, the thread died with a ContextTerminated traceback on stderr.)"""
    import threading

    from zkv.security import ZapHandler

    c: zmq.Context[Any] = zmq.Context()
    handler = ZapHandler.register(c, "zkv-orphan", None)
    ender = threading.Thread(target=c.term, daemon=True)
    ender.start()
    ender.join(5.0)
    assert not ender.is_alive(), "a socket of the ZAP handler kept the context from ending"
    handler._thread.join(5.0)
    assert not handler._thread.is_alive() and id(c) not in ZapHandler._by_context
    handler.unregister("zkv-orphan")


def test_a_context_destroyed_under_a_registered_domain_ends_the_zap_thread_quietly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """... and so when the context is destroyed (``ctx.destroy``: zkv soak's close after a
    Ctrl-C while a dispatcher was being made), which closes the handler's sockets under
    its thread first. (Before, the thread died with ``ZMQError('Socket operation on
    non-socket')``: "Exception in thread zkv-zap" and a traceback on the soak's stderr.
    And a poll already waiting on the sockets destroy closed could wait for good, one
    time in several: the thread stayed, its handler registered under the dead context's
    id, which a new context may get.)"""
    import threading

    from zkv.security import ZapHandler

    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    for i in range(50):  # (the thread may be anywhere in its poll when the sockets go)
        c: zmq.Context[Any] = zmq.Context()
        handler = ZapHandler.register(c, f"zkv-destroyed-{i}", None)
        c.destroy(linger=0)
        handler._thread.join(5.0)
        assert not handler._thread.is_alive() and id(c) not in ZapHandler._by_context
        handler.unregister(f"zkv-destroyed-{i}")
    assert died == []


def test_polls_without_a_wait_check_the_deadlines_on_the_clock(
        group: tuple[Dispatcher, list[FakeRank]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM half polls with no wait at every call vLLM makes; a deadline check scans the
    batches still in flight (those waiting on storage I/O: O(batches) each). Polls within
    the check interval check once, not each (it was every poll(0): 211 us a poll with
    10,000 batches waiting)."""
    from zkv.scheduler import dispatcher as module

    d, ranks = group
    for i in range(50):  # acked by no rank: in flight
        d.publish([_op(i)], step=i)
    frozen = time.monotonic()
    monkeypatch.setattr(module, "time", SimpleNamespace(
        monotonic=lambda: frozen, perf_counter=time.perf_counter))
    checks = []
    real = d._check_deadlines
    monkeypatch.setattr(d, "_check_deadlines", lambda now: (checks.append(now), real(now)))
    for _ in range(100):
        assert d.poll(0) == []
    assert len(checks) <= 1, len(checks)
    monkeypatch.setattr(module, "time", time)
    before = len(checks)
    idle_for(0.01)
    d.poll(0)  # the interval passed: checked again
    assert len(checks) == before + 1 and d.num_lost == 0


@pytest.mark.parametrize("kw", [{"heartbeat_timeout_s": float("nan")},
                                {"ack_timeout_s": float("nan")},
                                {"ack_timeout_s": float("inf")},
                                {"heartbeat_timeout_s": 0},
                                {"send_timeout_s": -1.0},
                                {"heartbeat_timeout_s": 2 * 86400.0}])
def test_timeouts_that_are_no_bound_are_refused(ctx: zmq.Context[Any], eps: tuple[str, str],
                                               kw: dict[str, float]) -> None:
    """NaN passed every check as false: a frozen rank was never lost, its batch never
    completed, and ``drain`` waited for good; inf made the sends' wait endless."""
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name} must be in"):
        Dispatcher(*eps, 1, FP, context=ctx, **kw)  # type: ignore[arg-type]


def test_an_endless_poll_and_close_wait_are_taken(group: tuple[Dispatcher, list[FakeRank]]
                                                  ) -> None:
    """``poll(inf)`` waits until the batch completes and ``close(timeout_s=inf)`` closes
    (both raised OverflowError converting the wait to milliseconds)."""
    d, ranks = group
    seq = d.publish([_op(0)], step=0)
    for r in ranks:
        r.ack(r.recv_batch())
    assert [b.seq for b in d.poll(float("inf"))] == [seq]
    closing = threading.Thread(target=d.close, kwargs={"timeout_s": float("inf")})
    closing.start()  # (it waits for the ranks' byes: as long as asked)
    for r in ranks:
        assert isinstance(r.recv(5), P.Shutdown)
        r.send(P.Bye(r.rank, r.pid, "shutdown"))
    closing.join(10)
    assert not closing.is_alive() and d.closed
