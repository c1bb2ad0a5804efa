"""Prefetch policies: when a request with storage hits may be scheduled."""

from __future__ import annotations

import math

import pytest

from zkv.scheduler.prefetch import (
    BEST_EFFORT,
    TIMEOUT,
    WAIT_COMPLETE,
    PrefetchPolicy,
    PrefetchTracker,
)


def test_budget_grows_with_the_prompt_and_is_capped() -> None:
    p = PrefetchPolicy(TIMEOUT, base_s=0.01, per_ki_token_s=0.1, max_s=0.5)
    assert p.budget_s(0) == pytest.approx(0.01)
    assert p.budget_s(1024) == pytest.approx(0.11)
    assert p.budget_s(4096) == pytest.approx(0.41)
    assert p.budget_s(1 << 20) == 0.5
    assert PrefetchPolicy(BEST_EFFORT).budget_s(10**6) == 0.0
    assert PrefetchPolicy(WAIT_COMPLETE).budget_s(1) == math.inf


def test_best_effort_never_waits() -> None:
    t = PrefetchTracker(PrefetchPolicy(BEST_EFFORT))
    t.start("a", 5000, now=10.0)
    assert t.ready("a", loads_done=False, now=10.0)
    assert (t.num_timed_out, len(t)) == (1, 0)


def test_wait_complete_waits_for_the_loads_only() -> None:
    t = PrefetchTracker(PrefetchPolicy(WAIT_COMPLETE))
    t.start("a", 16, now=0.0)
    assert not t.ready("a", loads_done=False, now=1e9)
    assert t.next_deadline() is None
    assert t.ready("a", loads_done=True, now=1e9)
    assert (t.num_completed, t.num_timed_out, t.waiting("a")) == (1, 0, False)


def test_timeout_goes_at_the_deadline_or_earlier_when_loaded() -> None:
    t = PrefetchTracker(PrefetchPolicy(TIMEOUT, base_s=1.0, per_ki_token_s=1.0, max_s=10.0))
    t.start("short", 1024, now=100.0)   # budget 2 s
    t.start("long", 4096, now=100.0)    # budget 5 s
    t.start("loaded", 4096, now=100.0)
    assert t.next_deadline() == pytest.approx(102.0)
    assert not t.ready("short", loads_done=False, now=101.9)
    assert t.ready("loaded", loads_done=True, now=100.1)
    assert t.ready("short", loads_done=False, now=102.0)
    assert not t.ready("long", loads_done=False, now=104.0)
    assert t.next_deadline() == pytest.approx(105.0)
    assert t.ready("long", loads_done=False, now=105.0)
    assert (t.num_completed, t.num_timed_out, len(t)) == (1, 2, 0)
    assert t.ready("never-started", loads_done=False, now=0.0)


def test_forget_and_bad_policies() -> None:
    t = PrefetchTracker(PrefetchPolicy(TIMEOUT))
    t.start("a", 10, now=0.0)
    t.forget("a")
    assert len(t) == 0 and t.ready("a", loads_done=False, now=0.0)
    with pytest.raises(ValueError, match="one of"):
        PrefetchPolicy("eager")
    with pytest.raises(ValueError, match=">= 0"):
        PrefetchPolicy(TIMEOUT, base_s=-1.0)
    # a NaN budget was taken: the request was never ready, its deadline NaN
    for field in ("base_s", "per_ki_token_s", "max_s"):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match="finite"):
                PrefetchPolicy(TIMEOUT, **{field: bad})
