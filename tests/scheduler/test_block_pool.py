"""BlockPool: exact ids, all-or-nothing frees, resize, and a stateful model check."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zkv.scheduler.block_pool import BlockPool, PoolStats


def snapshot(pool: BlockPool) -> tuple[list[int], bytes]:
    """Everything that decides future allocations (free order included)."""
    return list(pool._free), bytes(pool._used)


# ---------------------------------------------------------------- allocate / free


def test_allocate_hands_out_low_ids_first() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate_one() == 5
    assert pool.allocate_one() is None
    assert (pool.num_free, pool.num_used, pool.num_blocks) == (0, 6, 6)
    pool.check()


def test_allocate_zero_is_empty_list_and_takes_nothing() -> None:
    pool = BlockPool(3)
    before = snapshot(pool)
    assert pool.allocate(0) == []
    assert snapshot(pool) == before
    empty = BlockPool(0)
    assert empty.allocate(0) == []
    assert empty.allocate(1) is None
    empty.check()


def test_allocate_negative_is_caller_misuse() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.num_free == 3


def test_shortage_returns_none_and_takes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    before = snapshot(pool)
    assert pool.allocate(2) is None
    assert snapshot(pool) == before
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]
    pool.check()


def test_free_then_allocate_reuses_exact_ids() -> None:
    pool = BlockPool(5)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    pool.free([3, 1])
    assert not pool.is_allocated(1) and not pool.is_allocated(3)
    assert pool.is_allocated(0)
    assert sorted(pool.allocate(2)) == [1, 3]  # type: ignore[arg-type]
    assert pool.allocate(1) is None
    pool.free_one(4)
    assert pool.allocate_one() == 4
    pool.check()


def test_free_accepts_any_iterable() -> None:
    pool = BlockPool(4)
    pool.allocate(4)
    pool.free(iter([0, 2]))
    pool.free(b for b in (1,))
    assert pool.num_free == 3
    pool.check()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([2], id="double-free"),
        pytest.param([-1], id="negative"),
        pytest.param([4], id="equal-to-size"),
        pytest.param([100], id="past-size"),
        pytest.param([1.0], id="float"),
        pytest.param(["1"], id="str"),
        pytest.param([None], id="none"),
        pytest.param([True], id="bool"),
        pytest.param([np.int32(1)], id="numpy-int"),
        pytest.param([1, 1], id="duplicate-in-one-call"),
        pytest.param([0, 1, 0], id="duplicate-later"),
    ],
)
def test_free_rejects_foreign_ids_all_or_nothing(bad: list[object]) -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    before = snapshot(pool)
    # A good id first, so a partial free would be visible.
    with pytest.raises(ValueError):
        pool.free([0, *bad])  # type: ignore[list-item]
    assert snapshot(pool) == before
    with pytest.raises(ValueError):
        pool.free(bad)  # type: ignore[arg-type]
    assert snapshot(pool) == before
    assert pool.is_allocated(0) and pool.is_allocated(1)
    pool.check()


def test_free_one_rejects_double_free_and_foreign_ids() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    before = snapshot(pool)
    for bad in (1, -1, 3):
        with pytest.raises(ValueError):
            pool.free_one(bad)
        assert snapshot(pool) == before
    pool.free_one(0)
    with pytest.raises(ValueError):
        pool.free_one(0)
    assert pool.num_free == 3
    pool.check()


def test_is_allocated_out_of_range_is_false() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    assert not pool.is_allocated(-1)
    assert not pool.is_allocated(2)


def test_negative_size_rejected() -> None:
    with pytest.raises(ValueError):
        BlockPool(-1)
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.resize(-1)
    assert pool.num_blocks == 2


# ---------------------------------------------------------------- resize


def test_resize_grow_hands_new_ids_out_last() -> None:
    pool = BlockPool(3)
    assert pool.allocate(1) == [0]
    assert pool.resize(6) is True
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (6, 5, 1)
    pool.check()
    assert pool.allocate(5) == [1, 2, 3, 4, 5]
    assert pool.allocate(1) is None
    pool.free([4, 0])
    pool.check()


def test_resize_shrink_when_high_blocks_are_free() -> None:
    pool = BlockPool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([3, 2])
    assert pool.resize(2) is True
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (2, 0, 2)
    pool.check()
    assert pool.allocate(1) is None
    with pytest.raises(ValueError):
        pool.free([2])  # no longer in the pool
    pool.free([1])
    assert pool.allocate(1) == [1]
    pool.check()


def test_resize_refuses_shrink_when_a_high_block_is_used() -> None:
    pool = BlockPool(6)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    pool.free([0, 1, 2, 3])
    before = snapshot(pool)
    assert pool.resize(4) is False  # block 4 still in use
    assert snapshot(pool) == before
    assert pool.num_blocks == 6
    assert pool.resize(5) is True  # only block 5 (free) goes
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (5, 4, 1)
    pool.check()


def test_resize_to_same_size_and_to_zero() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    assert pool.resize(3) is True
    assert (pool.num_blocks, pool.num_free) == (3, 2)
    assert pool.resize(0) is False
    pool.free([0])
    assert pool.resize(0) is True
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (0, 0, 0)
    assert pool.allocate(1) is None
    pool.check()


def test_stats() -> None:
    pool = BlockPool(5, name="host")
    assert pool.stats() == PoolStats("host", 5, 5, 0)
    pool.allocate(3)
    assert pool.stats() == PoolStats("host", 5, 2, 3)
    pool.free([1])
    assert pool.stats() == PoolStats("host", 5, 3, 2)
    pool.resize(7)
    assert pool.stats() == PoolStats("host", 7, 5, 2)
    assert BlockPool(1).stats().name == "device"


def test_error_message_names_the_pool() -> None:
    pool = BlockPool(2, name="host")
    with pytest.raises(ValueError, match="host"):
        pool.free([0])


# ---------------------------------------------------------------- stateful model


class PoolMachine(RuleBasedStateMachine):
    """The pool against a set model: allocate, free (valid and invalid), resize."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8)
        self.size = 8
        self.used: set[int] = set()

    @rule(n=st.integers(0, 10))
    def allocate(self, n: int) -> None:
        ids = self.pool.allocate(n)
        if n > self.size - len(self.used):
            assert ids is None
            return
        assert ids is not None and len(ids) == n == len(set(ids))
        assert all(0 <= b < self.size for b in ids)
        assert not self.used & set(ids), "handed out an id that is in use"
        self.used |= set(ids)

    @rule()
    def allocate_one(self) -> None:
        b = self.pool.allocate_one()
        if len(self.used) == self.size:
            assert b is None
            return
        assert b is not None and b not in self.used and 0 <= b < self.size
        self.used.add(b)

    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.used)), min_size=1, unique=True))
        self.pool.free(ids)
        self.used -= set(ids)

    @rule(data=st.data())
    def free_invalid(self, data: st.DataObject) -> None:
        """A list with at least one bad id: nothing is freed."""
        good: list[int] = []
        if self.used:
            good = data.draw(st.lists(st.sampled_from(sorted(self.used)), unique=True))
        free_ids = sorted(set(range(self.size)) - self.used)
        bad_choices = [st.integers(-5, -1), st.integers(self.size, self.size + 5)]
        if free_ids:
            bad_choices.append(st.sampled_from(free_ids))
        if good:
            bad_choices.append(st.sampled_from(good))  # duplicate in one call
        bad = data.draw(st.one_of(*bad_choices))
        ids = data.draw(st.permutations([*good, bad]))
        before = snapshot(self.pool)
        with pytest.raises(ValueError):
            self.pool.free(ids)
        assert snapshot(self.pool) == before

    @rule(n=st.integers(0, 16))
    def resize(self, n: int) -> None:
        ok = self.pool.resize(n)
        expect = n >= self.size or not any(b >= n for b in self.used)
        assert ok == expect
        if ok:
            self.size = n

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        pool.check()
        assert pool.num_blocks == self.size
        assert pool.num_used == len(self.used)
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert {b for b in range(self.size) if pool.is_allocated(b)} == self.used
        assert sorted(pool._free) == sorted(set(range(self.size)) - self.used)


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestBlockPoolStateMachine = PoolMachine.TestCase
