"""LayerDoneCounter: per-layer completion, failure, timeouts, bounded history."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.waiting import wait_until
from zkv.errors import TransferError
from zkv.worker.layers import SAVES, LayerDoneCounter


class RecordingBackend:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event_on_compute(self, handle: Any) -> None:
        self.waited.append(handle)


def _waiter(c: LayerDoneCounter, seq: int, layer: int, out: list[Any]) -> threading.Thread:
    def run() -> None:
        try:
            c.wait_layer(seq, layer, timeout=5)
            out.append("ok")
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_marked_layer_returns_and_waits_on_its_event() -> None:
    be = RecordingBackend()
    c = LayerDoneCounter(3, be)
    c.begin(0)
    c.mark(0, 0, "e0")
    c.wait_layer(0, 0)
    assert be.waited == ["e0"]
    assert c.is_done(0, 0) and not c.is_done(0, 1)
    c.mark(0, 1, "e1")
    c.mark(0, 2, "e2")
    c.wait_layer(0, 2, timeout=0)
    c.wait_layer(0, 1, timeout=0)
    assert be.waited == ["e0", "e2", "e1"]


def test_unmarked_layer_times_out() -> None:
    c = LayerDoneCounter(2)
    c.begin(0)
    c.mark(0, 0)
    with pytest.raises(TimeoutError, match="layer 1 of batch 0"):
        c.wait_layer(0, 1, timeout=0.01)


def test_waiter_on_future_seq_wakes_when_marked() -> None:
    c = LayerDoneCounter(2)
    out: list[Any] = []
    t = _waiter(c, 5, 1, out)
    # blocked in its wait before anything is marked: only a mark's notify can wake it (a
    # waiter that came later would see the mark at once and prove nothing)
    wait_until(lambda: c._waiting == 1, 5, "the waiter blocked")
    c.begin(5)
    c.mark(5, 0)
    assert out == []  # layer 1 not yet; the waiter cannot have returned
    c.mark(5, 1)
    t.join(2)  # well within the waiter's own 5 s timeout
    assert out == ["ok"]


def test_mark_all_marks_remaining_layers_with_one_event() -> None:
    be = RecordingBackend()
    c = LayerDoneCounter(4, be)
    c.begin(1)
    c.mark_all(1, "ev")
    for layer in range(4):
        c.wait_layer(1, layer, timeout=0)
    assert be.waited == ["ev"] * 4


@pytest.mark.parametrize("finish", ["mark_all", "begin_done", "fail"])
def test_a_blocked_waiter_wakes_when_its_batch_finishes(finish: str) -> None:
    """A batch without h2d (mark_all), without ops (begin_done) or failed wakes a forward
    that was already waiting on it (no other call wakes it here), not only one that asks
    later."""
    c = LayerDoneCounter(2)
    out: list[Any] = []
    t = _waiter(c, 0, 1, out)
    wait_until(lambda: c._waiting == 1, 5, "the waiter blocked")
    if finish == "begin_done":
        c.begin_done(0)
    elif finish == "mark_all":
        c.begin(0)
        c.mark_all(0)
    else:
        c.begin(0)
        c.fail(0, "h2d failed: boom")
    t.join(2)  # well within the waiter's own 5 s timeout
    if finish == "fail":
        assert isinstance(out[0], TransferError) and "boom" in str(out[0])
    else:
        assert out == ["ok"]


def test_failed_seq_raises_for_present_and_future_waiters() -> None:
    c = LayerDoneCounter(2)
    out: list[Any] = []
    t = _waiter(c, 3, 1, out)
    wait_until(lambda: c._waiting == 1, 5, "the waiter blocked")
    c.begin(3)
    c.mark(3, 0)
    c.fail(3, "h2d failed: boom")
    t.join(2)
    assert isinstance(out[0], TransferError) and "boom" in str(out[0])
    with pytest.raises(TransferError, match="batch 3 failed"):
        c.wait_layer(3, 0, timeout=0)  # even a layer that was marked
    c.fail(4, "refused")  # a seq that never began
    with pytest.raises(TransferError, match="refused"):
        c.wait_layer(4, 0, timeout=0)


def test_close_releases_waiters_on_unfinished_seqs() -> None:
    c = LayerDoneCounter(2)
    c.begin(0)
    c.mark_all(0)
    out: list[Any] = []
    t = _waiter(c, 1, 0, out)
    wait_until(lambda: c._waiting == 1, 5, "the waiter blocked")
    c.close("worker stopped: seq gap")
    t.join(2)
    assert isinstance(out[0], TransferError) and "seq gap" in str(out[0])
    c.wait_layer(0, 1, timeout=0)  # finished before the close: still fine


def test_misuse() -> None:
    c = LayerDoneCounter(2)
    c.begin(0)
    with pytest.raises(ValueError, match="already began"):
        c.begin(0)
    with pytest.raises(ValueError, match="out of order"):
        c.mark(0, 1)
    with pytest.raises(ValueError, match="out of range"):
        c.wait_layer(0, 2)
    with pytest.raises(ValueError):
        LayerDoneCounter(0)


def test_history_is_bounded_and_forgotten_seqs_count_as_done() -> None:
    be = RecordingBackend()
    c = LayerDoneCounter(1, be, history=4)
    for seq in range(100):
        c.begin(seq)
        c.mark(seq, 0, seq)
    assert len(c._batches) == 4
    c.wait_layer(3, 0, timeout=0)  # forgotten: returns, no event to wait on
    assert be.waited == []
    c.wait_layer(99, 0, timeout=0)
    assert be.waited == [99]
    with pytest.raises(ValueError, match="already began"):
        c.begin(10)


def test_many_waiters_many_layers() -> None:
    c = LayerDoneCounter(8)
    outs: list[list[Any]] = [[] for _ in range(8)]
    threads = [_waiter(c, 0, layer, outs[layer]) for layer in range(8)]
    wait_until(lambda: c._waiting == 8, 5, "every waiter blocked")
    c.begin(0)
    for layer in range(8):
        c.mark(0, layer)
    for t in threads:
        t.join(2)  # well within the waiters' own 5 s timeout
    assert outs == [["ok"]] * 8


def test_failed_layer_and_later_layers_raise_earlier_layers_stay_done() -> None:
    """An h2d of layer 2 failed: the forward may use layers 0 and 1, never 2 or 3."""
    be = RecordingBackend()
    c = LayerDoneCounter(4, be)
    out: list[Any] = []
    t = _waiter(c, 0, 3, out)
    wait_until(lambda: c._waiting == 1, 5, "the waiter blocked")
    c.begin(0)
    c.mark(0, 0, "e0")
    c.mark(0, 1, "e1")
    c.fail_from(0, 2, "h2d failed: block 5")
    c.mark(0, 2, "e2")  # a late mark never turns a failed layer into a done one
    t.join(2)
    assert isinstance(out[0], TransferError) and "from layer 2" in str(out[0])
    c.wait_layer(0, 1, timeout=0)
    assert be.waited == ["e1"]
    for layer in (2, 3):
        assert not c.is_done(0, layer)
        with pytest.raises(TransferError, match="block 5"):
            c.wait_layer(0, layer, timeout=0)
    assert [c.is_done(0, layer) for layer in range(4)] == [True, True, False, False]
    c.fail(0, "whole batch")  # widening the failure later reaches layer 0 too
    with pytest.raises(TransferError, match="whole batch"):
        c.wait_layer(0, 0, timeout=0)
    assert not any(c.is_done(0, layer) for layer in range(4))


def test_fail_from_an_unmarked_layer_fails_from_the_first_unmarked() -> None:
    c = LayerDoneCounter(4)
    c.begin(1)
    c.mark(1, 0)
    c.fail_from(1, 3, "boom")  # layers 1 and 2 will never be marked either
    assert [c.is_done(1, layer) for layer in range(4)] == [True, False, False, False]
    with pytest.raises(TransferError, match="from layer 1"):
        c.wait_layer(1, 1, timeout=0)
    c.begin(2)  # the failed batch finished once: history goes on
    c.mark_all(2)
    c.wait_layer(2, 3, timeout=0)


def test_abandon_waits_for_the_running_copy_and_no_later_layer_starts() -> None:
    """The engine's wait timed out while layer 1's copy ran: abandon returns once that copy
    ended, with the event recorded after it (compute must wait on it), and no layer of the
    batch starts after that. Before abandon existed, a late copy landed in blocks the
    engine was recomputing."""
    c = LayerDoneCounter(3)
    c.begin(0)
    assert c.start_layer(0, 0)
    c.end_layer(0, "e0")
    c.mark(0, 0, "e0")
    assert c.start_layer(0, 1)  # the actor copies layer 1 ...
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(c.abandon(0, 1, "timed out", timeout=10)),
                         daemon=True)
    t.start()
    wait_until(lambda: not c.is_done(0, 2) and c._batches[0].error is not None,
               what="the batch failed from layer 1")
    assert not out, "abandon returned while a copy was still running"
    c.end_layer(0, "e1")  # ... and ends it
    t.join(10)
    assert out == [(True, "e1")]
    c.mark(0, 1, "e1")  # ignored: the layer was abandoned
    assert not c.start_layer(0, 1) and not c.start_layer(0, 2)
    assert c.is_done(0, 0) and not c.is_done(0, 1)
    with pytest.raises(TransferError, match="from layer 1: timed out"):
        c.wait_layer(0, 2, timeout=0)


def test_abandon_before_the_batch_began_stops_all_its_layers() -> None:
    c = LayerDoneCounter(2)
    assert c.abandon(5, 0, "timed out", timeout=0) == (True, None)
    c.begin(5)  # the actor gets there later: not an error
    assert not c.start_layer(5, 0)
    with pytest.raises(TransferError, match="failed: timed out"):
        c.wait_layer(5, 1, timeout=0)


def test_abandon_gives_up_on_a_copy_that_never_ends() -> None:
    c = LayerDoneCounter(2)
    c.begin(0)
    assert c.start_layer(0, 0)
    assert c.abandon(0, 0, "timed out", timeout=0.01) == (False, None)


def test_abandon_stops_every_layer_not_copied_yet() -> None:
    """The engine gave up at layer 2 (a hook of its own order) while only layer 0 was
    copied: layer 1, never copied, must not start either (vLLM recomputes the block)."""
    c = LayerDoneCounter(4)
    c.begin(0)
    assert c.start_layer(0, 0)
    c.end_layer(0)
    c.mark(0, 0)
    assert c.abandon(0, 2, "timed out", timeout=0) == (True, None)
    assert not c.start_layer(0, 1)
    assert c.is_done(0, 0) and not c.is_done(0, 1)


def test_abandon_returns_the_event_of_a_layer_issued_after_the_wait_gave_up() -> None:
    """The wait for layer 1 timed out; then the actor issued and marked layer 1, and only
    then the engine abandons: the compute stream must still wait on layer 1's event (on GPU
    the copy is only queued), which no wait_layer took."""
    c = LayerDoneCounter(3)
    c.begin(0)
    for layer, event in ((0, "e0"), (1, "e1")):
        assert c.start_layer(0, layer)
        c.end_layer(0, event)
        c.mark(0, layer, event)
    assert c.abandon(0, 1, "timed out", timeout=0) == (True, "e1")
    assert not c.start_layer(0, 2)


def test_an_idle_batch_whose_seq_was_abandoned_begins_quietly() -> None:
    """(A late abandon after a scheduler restart names a seq the new scheduler gives an
    idle batch: that must not stop the actor.)"""
    c = LayerDoneCounter(2)
    assert c.abandon(3, 0, "timed out", timeout=0) == (True, None)
    c.begin_done(3, "e")
    with pytest.raises(TransferError):
        c.wait_layer(3, 0, timeout=0)


def test_an_abandon_far_ahead_never_makes_a_batch_not_run_yet_count_as_done() -> None:
    """An engine whose wait on seq 500 raised when its scheduler restarted abandons seq 500,
    as it does on any failed wait; that lands on the new counter (seqs start at 0 again),
    where it finishes seq 500 before seqs 0, 1, ... Forgotten in finish order, it counted
    every seq up to 500 as finished long ago: a wait on batch 10, not run yet, returned at
    once (the forward read KV not loaded), and the actor's begin(10) raised (it stopped)."""
    be = RecordingBackend()
    c = LayerDoneCounter(1, be, history=4)
    assert c.abandon(500, 0, "the scheduler restarted", timeout=0) == (True, None)
    for seq in range(10):
        c.begin_done(seq, seq)
    assert sorted(c._batches) == [7, 8, 9, 500]  # seq 500, not begun yet, is kept
    with pytest.raises(TimeoutError):
        c.wait_layer(10, 0, timeout=0.01)
    c.begin(10)
    c.mark(10, 0, "e10")
    c.wait_layer(10, 0, timeout=0)
    c.wait_layer(3, 0, timeout=0)  # forgotten for good: every seq up to it ran
    assert be.waited == ["e10"]
    with pytest.raises(TransferError, match="the scheduler restarted"):
        c.wait_layer(500, 0, timeout=0)


def test_a_batchs_saves_count_as_a_copy_before_layer_zero() -> None:
    """The layer waits are what kept the forward off a block the batch's d2h reads (evicted
    and reused in one step): an abandon with no layer marked stops saves not started yet,
    waits for one running, and its end says whether the abandon ran past it."""
    c = LayerDoneCounter(2)
    c.begin(0)
    assert c.start_layer(0, SAVES)
    assert c.abandon(0, 1, "timed out", timeout=0.01) == (False, None)  # the save runs on
    assert c.end_layer(0, "d") is True  # ... so it fails: it may have read the forward's KV
    assert c.abandon(0, 1, "timed out", timeout=0) == (True, "d")  # compute waits on it
    c.begin(1)
    c.mark(1, 0)  # layer 0 marked: the saves ran before it; an abandon leaves them alone
    c.abandon(1, 1, "timed out", timeout=0)
    assert c.start_layer(1, SAVES) and c.end_layer(1) is False
    assert c.abandon(7, 1, "timed out", timeout=0) == (True, None)  # before it began
    c.begin(7)
    assert not c.start_layer(7, SAVES)
