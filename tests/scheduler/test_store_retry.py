"""Failed storage writes are written again: a store that was down (or full) gets the host
tier's blocks once it takes writes, after a backoff, and nothing waits for a block the
host tier let go meanwhile. Exact ops, a fake clock, invariants after every step."""

from __future__ import annotations

import pytest

from tests.scheduler.test_manager import BS, H, ack, fail, finish, run, shape, take
from zkv.protocol import D2H, H2S, Op
from zkv.scheduler.manager import CacheConfig, CacheManager
from zkv.scheduler.radix import DEVICE, HOST


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


_CLOCK = Clock()


@pytest.fixture
def clock() -> Clock:
    """The clock of every cache manager ``make`` builds (the cores' ``monotonic``)."""
    _CLOCK.now = 1000.0
    return _CLOCK


def make(num_device: int, num_host: int, retry_s: float = 1.0, max_s: float = 10.0
         ) -> CacheManager:
    cm = CacheManager(CacheConfig(num_device, num_host, BS, "write_back", storage_write=True,
                                  store_retry_s=retry_s, store_retry_max_s=max_s))
    cm.core.monotonic = _CLOCK.monotonic
    cm.check_invariants()
    return cm


def push(cm: CacheManager, rid: str, hashes: list[bytes]) -> list[Op]:
    """Run ``rid`` to its end (older blocks it evicts go to host: d2h, acked); the ops
    that follow (the storage writes of what reached host)."""
    assert run(cm, rid, hashes) is not None
    ops = take(cm)
    assert all(op.kind == D2H for op in ops)
    if ops:
        ack(cm, *ops)
    finish(cm, rid)
    return take(cm)


def test_a_failed_write_is_written_again_after_the_backoff(clock: Clock) -> None:
    cm = make(2, 4)
    a = H(1, 2)
    assert push(cm, "r1", a) == []
    (h2s,) = push(cm, "r2", H(3, 4))
    assert shape(h2s) == (H2S, [0, 1], [], tuple(a))
    fail(cm, h2s)
    n = cm.tree.index[a[0]]
    assert (n.status, n.in_store, n.busy) == (HOST, False, 0)
    assert cm.num_unstored_blocks == 2 and not cm.store_retry_due()
    clock.now += 0.99
    assert take(cm) == []
    clock.now += 0.01
    assert cm.store_retry_due()
    (again,) = take(cm)
    assert shape(again) == (H2S, [0, 1], [], tuple(a))
    assert n.busy == 1 and cm.stats.store_retried == 2
    ack(cm, again)
    assert n.in_store and cm.num_unstored_blocks == 0 and cm.stats.stored == 2
    clock.now += 100
    assert take(cm) == []


def test_a_retry_that_succeeds_ends_the_failing_state(clock: Clock) -> None:
    """The failed write's own retry succeeds (its round took it off the waiting list): the
    store takes writes again, so a P/D producer promises again. (It stayed failing for the
    process's life: only a success while something still waited cleared it.)"""
    cm = make(2, 4)
    push(cm, "r1", H(1, 2))
    (h2s,) = push(cm, "r2", H(3, 4))
    fail(cm, h2s)
    assert cm.store_writes_failing
    clock.now += 1.0
    (again,) = take(cm)  # the retry round: nothing waits any more
    assert cm.num_unstored_blocks == 0 and cm.store_writes_failing
    ack(cm, again)
    assert cm.stats.stored == 2 and not cm.store_writes_failing


def test_the_backoff_doubles_per_failed_round_up_to_its_cap(clock: Clock) -> None:
    cm = make(1, 4, retry_s=1.0, max_s=4.0)
    push(cm, "r1", H(1))
    (h2s,) = push(cm, "r2", H(2))
    fail(cm, h2s)
    waits = []
    for _ in range(4):
        waited = 0.0
        while not cm.store_retry_due():
            clock.now += 0.25
            waited += 0.25
        waits.append(waited)
        (again,) = take(cm)
        fail(cm, again)
    assert waits == [1.0, 2.0, 4.0, 4.0]
    assert cm.stats.store_retried == 4 and cm.num_unstored_blocks == 1


def test_many_failures_in_one_round_double_the_backoff_once(clock: Clock) -> None:
    cm = make(1, 8)
    push(cm, "r1", H(1))
    (first,) = push(cm, "r2", H(2))
    fail(cm, first)
    (second,) = push(cm, "r3", H(3))  # H(2)'s write fails too, in the same round
    assert second.keys == (H(2)[0],)
    fail(cm, second)
    clock.now += 0.99
    assert not cm.store_retry_due()
    clock.now += 0.01
    (again,) = take(cm)
    assert set(again.keys) == {H(1)[0], H(2)[0]}
    fail(cm, again)
    clock.now += 1.99
    assert not cm.store_retry_due()
    clock.now += 0.01
    assert cm.store_retry_due()


def test_a_write_that_succeeds_brings_the_retry_forward(clock: Clock) -> None:
    cm = make(1, 4)
    a = H(1)
    push(cm, "r1", a)
    (h2s,) = push(cm, "r2", H(2))
    assert not cm.store_writes_failing
    fail(cm, h2s)
    assert cm.store_writes_failing  # (a P/D producer promises nothing meanwhile)
    (ok,) = push(cm, "r3", H(3))  # the store is back: H(2)'s write will succeed
    assert take(cm) == []
    ack(cm, ok)
    assert not cm.store_writes_failing
    (again,) = take(cm)  # no time passed
    assert shape(again) == (H2S, [0], [], (a[0],))
    ack(cm, again)
    assert cm.num_unstored_blocks == 0 and cm.stats.stored == 2


def test_a_block_the_host_tier_let_go_is_not_waited_for(clock: Clock) -> None:
    cm = make(1, 1)
    a = H(1)
    push(cm, "r1", a)
    (h2s,) = push(cm, "r2", H(2))
    fail(cm, h2s)
    (ok,) = push(cm, "r3", H(3))  # host block 0 goes to H(2): `a` is dropped
    assert a[0] not in cm.tree.index and ok.keys == (H(2)[0],)
    ack(cm, ok)
    clock.now += 10
    assert take(cm) == []
    assert cm.num_unstored_blocks == 0 and cm.stats.store_retried == 0


def test_a_waiting_block_dropped_with_its_parent_is_not_counted_as_waiting(clock: Clock
                                                                          ) -> None:
    """A waiting block goes with its parent, whose d2h failed (the parent's only copy is
    gone, and the subtree with it): no block waits for its write any more."""
    cm = make(2, 4)
    a = H(1, 2)
    assert push(cm, "r1", a) == []
    (h2s,) = push(cm, "r2", H(3))  # a[1] leaves the device: its write fails
    assert h2s.keys == (a[1],)
    fail(cm, h2s)
    assert cm.num_unstored_blocks == 1
    assert run(cm, "r3", H(4)) == [0]  # a[0] leaves the device: its d2h fails
    (d2h,) = take(cm)
    assert shape(d2h) == (D2H, [0], [1], ())
    fail(cm, d2h)
    assert [h in cm.tree.index for h in a] == [False, False]
    assert cm.num_unstored_blocks == 0 and cm.host.num_used == 0


def test_every_piece_of_a_node_split_while_it_waited_is_written(clock: Clock) -> None:
    cm = make(3, 6)
    a = H(1, 2, 3)
    push(cm, "r1", a)
    (h2s,) = push(cm, "r2", H(7, 8, 9))
    fail(cm, h2s)
    assert len(cm.tree.index[a[0]].hashes) == 3
    cm.match_prefix("r3", a[:2])  # a host hit on the first two blocks: the node is split
    cm.abort("r3")
    cm.check_invariants()
    assert cm.tree.index[a[0]] is not cm.tree.index[a[2]]
    assert not cm.tree.index[a[0]].in_store and cm.tree.index[a[0]].status is HOST
    clock.now += 1.0
    ops = take(cm)
    (again,) = [op for op in ops if op.kind == H2S]
    assert set(again.keys) == set(a)
    ack(cm, *ops)
    assert all(cm.tree.index[h].in_store for h in a)
    assert cm.num_unstored_blocks == 0


def test_fail_pending_drops_the_retries(clock: Clock) -> None:
    cm = make(1, 4)
    push(cm, "r1", H(1))
    (h2s,) = push(cm, "r2", H(2))
    fail(cm, h2s)
    assert cm.num_unstored_blocks == 1
    cm.fail_pending()
    clock.now += 10
    assert take(cm) == [] and cm.num_unstored_blocks == 0


def test_retry_intervals_are_checked() -> None:
    with pytest.raises(ValueError, match="store_retry_s"):
        CacheConfig(1, 1, store_retry_s=0)
    with pytest.raises(ValueError, match="store_retry_s"):
        CacheConfig(1, 1, store_retry_s=5, store_retry_max_s=1)
    # (an infinite interval never retries; a NaN or negative negative cache)
    with pytest.raises(ValueError, match="both finite"):
        CacheConfig(1, 1, store_retry_s=float("inf"), store_retry_max_s=float("inf"))
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="negative_cache_s"):
            CacheConfig(1, 1, negative_cache_s=bad)


class Query:
    """A ``storage_exists`` with the optional ``store_reached`` the manager calls."""

    def __init__(self) -> None:
        self.reached = 0

    def __call__(self, hashes: object) -> int:
        return 0

    def store_reached(self) -> None:
        self.reached += 1


def test_a_write_that_succeeds_tells_the_storage_query(clock: Clock) -> None:
    q = Query()
    cm = CacheManager(CacheConfig(1, 4, BS, "write_back", storage_write=True), storage_exists=q)
    cm.core.monotonic = clock.monotonic
    push(cm, "r1", H(1))
    (h2s,) = push(cm, "r2", H(2))
    fail(cm, h2s)
    assert q.reached == 0  # nothing reached the store
    (h2s,) = push(cm, "r3", H(3))
    ack(cm, h2s)
    assert q.reached == 1
    (again,) = take(cm)
    fail(cm, again, done=0)
    assert q.reached == 1


def test_a_round_writes_a_quarter_of_the_host_pool_and_the_rest_follows(clock: Clock) -> None:
    cm = make(1, 8)  # two blocks a round
    push(cm, "r1", H(1))
    for rid, h in (("r2", H(2)), ("r3", H(3)), ("r4", H(4))):
        (h2s,) = push(cm, rid, h)
        fail(cm, h2s)
    assert cm.num_unstored_blocks == 3
    clock.now += 1.0
    (first,) = take(cm)
    assert first.keys == (H(1)[0], H(2)[0])
    assert cm.num_unstored_blocks == 1 and take(cm) == []
    ack(cm, first)  # the store took them: the rest at once
    (rest,) = take(cm)
    assert rest.keys == (H(3)[0],)
    ack(cm, rest)
    assert cm.num_unstored_blocks == 0 and cm.stats.store_retried == 3


def test_a_parent_written_with_its_waiting_child_is_done_waiting(clock: Clock) -> None:
    """A round's limit is reached by a waiting child and the parent its retry walked up
    to: the parent, later on the list, stays listed while its write runs; once that write
    succeeds nothing waits, and no retry is due (an idle engine's pump is not woken for
    one every backoff, for good)."""
    cm = make(2, 4)  # a round: one block (then the walk up to the parent)
    a = H(1, 2)
    assert push(cm, "r1", a) == []
    (h2s,) = push(cm, "r2", H(3))  # a[1] leaves the device first
    assert h2s.keys == (a[1],)
    fail(cm, h2s)
    (h2s,) = push(cm, "r3", H(4))  # then a[0]
    assert h2s.keys == (a[0],)
    fail(cm, h2s)
    assert cm.num_unstored_blocks == 2
    clock.now += 1.0
    (again,) = take(cm)
    assert shape(again) == (H2S, [0, 1], [], (a[1], a[0]))
    ack(cm, again)
    assert [cm.tree.index[h].in_store for h in a] == [True, True]
    assert cm.num_unstored_blocks == 0 and not cm.store_retry_due()
    clock.now += 100.0
    assert take(cm) == [] and not cm.store_retry_due()
    assert cm.stats.store_retried == 2


def test_a_device_nodes_backup_is_written_again_while_on_device(clock: Clock) -> None:
    """A hot block (on device, backed up) whose write failed in a store outage is written
    again when the retry comes, from its host copy, and its device copy stays evictable
    meanwhile. Before: it waited until the device let it go, so the blocks in use kept
    out of L3 (and off other engines) for as long as they stayed hot."""
    cm = CacheManager(CacheConfig(2, 8, BS, "write_through", storage_write=True))
    cm.core.monotonic = _CLOCK.monotonic
    a = H(1, 2)
    assert run(cm, "r1", a) is not None
    assert take(cm) == []
    finish(cm, "r1")
    (backup,) = take(cm)
    ack(cm, backup)
    (h2s,) = take(cm)
    fail(cm, h2s)
    n = cm.tree.index[a[0]]
    clock.now += 0.99
    assert take(cm) == [] and cm.num_unstored_blocks == 2
    clock.now += 0.01
    (again,) = take(cm)  # on device: written from its host copy
    assert shape(again) == (H2S, list(n.host), [], tuple(a))  # type: ignore[arg-type]
    assert (n.status, n.dlisted, n.hlisted, n.wbusy) == (DEVICE, True, False, 1)
    cm.check_invariants()
    assert run(cm, "r2", H(3, 4)) is not None  # `a` leaves the device meanwhile
    assert n.status is HOST and not n.in_store
    ack(cm, again)
    assert n.in_store and cm.num_unstored_blocks == 0 and cm.stats.store_retried == 2
    cm.check_invariants()


def _stored(cm: CacheManager, hashes: list[bytes]) -> list[bool | None]:
    """Per block: in L3 (True), waiting (False), let go of (None)."""
    return [None if (n := cm.tree.index.get(h)) is None else n.in_store for h in hashes]


def _rounds(cm: CacheManager, clock: Clock, n: int = 3) -> None:
    for _ in range(n):
        clock.now += 20
        ops = take(cm)
        if ops:
            ack(cm, *ops)
        cm.check_invariants()


def test_the_tail_a_partial_eviction_cuts_off_a_waiting_node_is_written(clock: Clock) -> None:
    """A device node whose backup's write failed loses its last blocks to the device's
    eviction: they went to a new node the retry list did not hold, never written."""
    cm = CacheManager(CacheConfig(4, 16, BS, "write_through", storage_write=True))
    cm.core.monotonic = _CLOCK.monotonic
    a = H(1, 2, 3, 4)
    assert run(cm, "r1", a) is not None and take(cm) == []
    finish(cm, "r1")
    (backup,) = take(cm)
    ack(cm, backup)
    (h2s,) = take(cm)
    fail(cm, h2s)
    assert run(cm, "r2", H(5, 6)) is not None  # evicts a's last two blocks (backed up)
    ack(cm, *take(cm))
    finish(cm, "r2")
    ops = take(cm)
    if ops:
        ack(cm, *ops)
    _rounds(cm, clock)
    assert _stored(cm, a)[2:] == [True, True]
    assert run(cm, "r3", H(7, 8, 9, 10)) is not None  # the rest leaves the device
    ack(cm, *take(cm))
    finish(cm, "r3")
    _rounds(cm, clock)
    assert _stored(cm, a) == [True] * 4 and cm.num_unstored_blocks == 0


def test_the_piece_above_a_dropped_waiting_node_is_written(clock: Clock) -> None:
    """A match splits a waiting node (the new piece above is not on the list); host
    pressure then drops the listed piece: the retry stopped there, never reaching the
    piece above, which stayed unwritten for good."""
    cm = make(4, 4)
    a = H(1, 2, 3, 4)
    assert push(cm, "r1", a) == []
    (h2s,) = push(cm, "r2", H(5, 6, 7, 8))
    fail(cm, h2s)
    assert cm.match_prefix("r3", H(1, 2)).num_host == 2  # splits a's node at 2
    cm.abort("r3")
    assert run(cm, "r4", H(9, 10)) is not None  # its d2h takes a's last host blocks
    ops = take(cm)
    ack(cm, *ops)
    finish(cm, "r4")
    assert _stored(cm, a)[2:] == [None, None]
    _rounds(cm, clock)
    assert _stored(cm, a)[:2] == [True, True] and cm.num_unstored_blocks == 0


def test_a_waiting_node_swapped_in_when_its_retry_comes_stays_waiting(clock: Clock) -> None:
    """The retry came while the node was being copied back to the device (busy, not
    HOST): it was taken off the list and never written."""
    cm = make(4, 8)
    a = H(1, 2, 3, 4)
    assert push(cm, "r1", a) == []
    (h2s,) = push(cm, "r2", H(5, 6, 7, 8))
    fail(cm, h2s)
    assert run(cm, "r3", a) is not None  # h2d of a (and r2's blocks out: d2h)
    clock.now += 1.0  # the retry is due while the h2d runs
    ops = take(cm)
    assert cm.num_unstored_blocks == 4
    ack(cm, *ops)
    finish(cm, "r3")
    ops = take(cm)
    if ops:
        ack(cm, *ops)
    assert run(cm, "r4", H(9, 10, 11, 12)) is not None  # a leaves the device again
    ack(cm, *take(cm))
    finish(cm, "r4")
    _rounds(cm, clock, 4)
    assert _stored(cm, a) == [True] * 4 and cm.num_unstored_blocks == 0


def test_a_failed_write_of_blocks_dropped_meanwhile_is_no_success(clock: Clock) -> None:
    """The store refused a retry whose blocks were dropped while it ran: committed as a
    success, it cleared ``store_writes_failing`` and reset the backoff."""
    cm = CacheManager(CacheConfig(4, 2, BS, "write_back", storage_write=True))
    cm.core.monotonic = _CLOCK.monotonic
    a = H(1, 2, 3, 4)
    assert run(cm, "r1", a) is not None and take(cm) == []
    finish(cm, "r1")
    assert run(cm, "r2", H(5, 6)) is not None  # a's tail to host (d2h), then its h2s
    (d2h,) = take(cm)
    ack(cm, d2h)
    (h2s,) = take(cm)
    fail(cm, h2s)
    assert cm.store_writes_failing and cm.core.store_backoff_s == 2.0
    clock.now += 1.0
    (retry,) = take(cm)
    finish(cm, "r2")
    take(cm)
    assert run(cm, "r3", H(7, 8, 9, 10)) is not None  # drops a (its tail's write in flight)
    assert _stored(cm, a) == [None] * 4
    fail(cm, retry)
    assert cm.store_writes_failing and cm.core.store_backoff_s == 2.0
    assert cm.core.store_retry_at > 0
    cm.check_invariants()
