"""External-L1 mode (the engine owns device blocks; zkv is L2/L3) and incremental caching.

Exact scenarios: which ops with which ids, what is matchable when, what a failure undoes.
Invariants are checked after every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from zkv.protocol import BACKUP, H2D, H2S, S2H, OpResult
from zkv.scheduler.eviction import SLRU
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import CacheConfig, CacheManager, Match
from zkv.scheduler.radix import HOST, LOADING_FROM_STORAGE, SWAP_TO_HOST

BS = 4


def H(*ids: int) -> list[bytes]:
    return hash_ids_chain(list(ids))


def make(num_host: int, *, storage: set[bytes] | None = None, **kw: object) -> CacheManager:
    def exists(hashes):  # noqa: ANN001, ANN202
        k = 0
        while storage is not None and k < len(hashes) and hashes[k] in storage:
            k += 1
        return k

    cm = CacheManager(CacheConfig(0, num_host, BS, **kw),  # type: ignore[arg-type]
                      storage_exists=exists if storage is not None else None)
    cm.check_invariants()
    return cm


def ack(cm: CacheManager, ops, done: dict[int, int] | None = None) -> None:  # noqa: ANN001
    """Every op succeeds unless ``done`` names its leading count (by position in ``ops``)."""
    results = []
    for i, op in enumerate(ops):
        d = (done or {}).get(i, op.num_blocks)
        results.append(OpResult(op.id, d == op.num_blocks, d, None if d == op.num_blocks else "x"))
    assert cm.on_ops_done(results) == []
    cm.check_invariants()


def save(cm: CacheManager, rid: str, hashes: list[bytes], dev: list[int]) -> int:
    cm.match_prefix(rid, hashes)
    n = cm.cache_computed(rid, len(hashes) * BS, device_ids=dev)
    cm.check_invariants()
    return n


def test_saved_blocks_become_matchable_on_ack_not_before() -> None:
    cm = make(8)
    a = H(1, 2, 3)
    assert save(cm, "r1", a, [10, 11, 12]) == 3
    ops = cm.take_ops()
    assert [(o.kind, o.src.tolist(), o.dst.tolist()) for o in ops] == [
        (BACKUP, [10, 11, 12], [0, 1, 2])]
    assert [n.status for n in cm.held_blocks("r1")] == [SWAP_TO_HOST] * 3
    assert cm.match_prefix("r2", a) == Match(0, 0, 0, BS)  # in flight: not a hit
    cm.abort("r2")
    ack(cm, ops)
    assert cm.match_prefix("r2", a) == Match(0, 3, 0, BS)  # while r1 still runs
    cm.finish("r1")
    cm.check_invariants()
    assert cm.stats.saved_external == 3 and cm.tree.num_hlru == 0  # r2 holds them
    cm.finish("r2")
    assert cm.tree.num_hlru == 3


def test_load_into_engine_blocks_and_count_hits_once() -> None:
    cm = make(8)
    a = H(1, 2, 3, 4)
    save(cm, "r1", a, [0, 1, 2, 3])
    ack(cm, cm.take_ops())
    cm.finish("r1")
    for _ in range(3):  # a waiting request is re-matched every step: no extra hits
        assert cm.match_prefix("r2", a) == Match(0, 4, 0, BS)
    assert cm.stats.hit_host == 0
    # the engine had blocks 0-1 itself (local hit); zkv loads blocks 2-3 into 40, 41
    assert cm.load_external("r2", 2, [40, 41]) == 2
    ops = cm.take_ops()
    assert [(o.kind, o.src.tolist(), o.dst.tolist(), o.layerwise) for o in ops] == [
        (H2D, [2, 3], [40, 41], True)]
    assert (cm.stats.hit_host, cm.stats.hit_requests) == (4, 2)  # r1 ran too (no hits)
    cm.check_invariants()
    ack(cm, ops)
    assert cm.stats.loaded_external == 2 and cm.take_load_failures() == {}
    with pytest.raises(ValueError, match="already allocated"):
        cm.match_prefix("r2", a)
    cm.finish("r2")
    cm.check_invariants()
    assert cm.stats.hit_host == 4  # finish adds nothing


def test_a_running_requests_saves_each_step_count_its_hits_once() -> None:
    """The engine calls cache_computed at every step of a running request: its hits (the
    stats, each held node's ``hits``) were counted when it first went external, and no
    step counts them again (else a block hit once looks hot to SLRU and the threshold)."""
    cm = make(8)
    a = H(1, 2, 3, 4)
    assert save(cm, "r1", a[:2], [0, 1]) == 2
    ack(cm, cm.take_ops())
    cm.finish("r1")
    assert cm.match_prefix("r2", a) == Match(0, 2, 0, BS)
    assert cm.load_external("r2", 0, [5, 6]) == 2
    ack(cm, cm.take_ops())
    for n in (3, 4):  # two decode steps, one new block each
        assert cm.cache_computed("r2", n * BS, device_ids=[5, 6, 7, 8][:n]) == 1
        ack(cm, cm.take_ops())
    assert (cm.stats.hit_requests, cm.stats.hit_host) == (2, 2)
    cm.finish("r2")
    cm.check_invariants()
    assert [cm.tree.block(h).hits for h in a] == [2, 2, 1, 1]


def test_failed_load_is_reported_for_recompute_and_cache_stays() -> None:
    cm = make(8)
    a = H(1, 2, 3)
    save(cm, "r1", a, [0, 1, 2])
    ack(cm, cm.take_ops())
    cm.finish("r1")
    cm.match_prefix("r2", a)
    cm.load_external("r2", 0, [7, 8, 9])
    ack(cm, cm.take_ops(), done={0: 1})  # block 0 arrived on every rank, 1 and 2 did not
    assert cm.take_load_failures() == {"r2": [8, 9]}
    assert cm.take_load_failures() == {}
    cm.finish("r2")
    assert cm.match_prefix("r3", a) == Match(0, 3, 0, BS)  # host copies are intact


def test_a_failed_load_of_a_request_gone_before_the_engine_asks_is_not_reported() -> None:
    """The load failed while the request ran; it finished (and its id came back as a new
    request) before the engine asked: neither the gone request's failures nor any under
    its id are reported (the new one's blocks are other blocks)."""
    cm = make(8)
    a = H(1, 2)
    save(cm, "r1", a, [0, 1])
    ack(cm, cm.take_ops())
    cm.finish("r1")
    cm.match_prefix("r2", a)
    assert cm.load_external("r2", 0, [7, 8]) == 2
    ack(cm, cm.take_ops(), done={0: 0})
    cm.finish("r2")
    assert cm.match_prefix("r2", a) == Match(0, 2, 0, BS)  # the id, matched again
    assert cm.take_load_failures() == {}
    cm.finish("r2")
    cm.check_invariants()


def test_a_partial_load_over_host_blocks_loaded_twice_settles_both() -> None:
    """Two requests of one step load overlapping host blocks (one load op holds a node
    twice) and the op fails inside the second one's run: the node split at the boundary
    settles for both entries (no busy count left without an op), exactly the second
    request's later block is reported, and every host block is evictable again."""
    cm = make(8)
    h = H(1, 2, 3, 4)
    save(cm, "w", h, [100, 101, 102, 103])
    ack(cm, cm.take_ops())
    cm.finish("w")
    cm.match_prefix("a", h)
    assert cm.load_external("a", 1, [11, 12, 13]) == 3  # the engine had block 0 itself
    cm.match_prefix("b", h[:3])
    assert cm.load_external("b", 1, [21, 22]) == 2
    ops = cm.take_ops()
    assert [(o.kind, o.src.tolist(), o.dst.tolist()) for o in ops] == [
        (H2D, [1, 2, 3, 1, 2], [11, 12, 13, 21, 22])]
    ack(cm, ops, done={0: 4})  # engine block 22 failed on some rank
    assert cm.take_load_failures() == {"b": [22]}
    cm.finish("a")
    cm.finish("b")
    cm.check_invariants()
    assert cm.num_pending_ops == 0 and cm.tree.num_hlru == 4


def test_a_failed_load_of_a_preempted_request_is_not_its_next_incarnations() -> None:
    """vLLM preempts a request whose load is in flight (the connector cancels its saves
    and finishes it) and schedules it again under the same id, into other engine blocks:
    the old load's failure names blocks the new incarnation does not use."""
    cm = make(8)
    h = H(1, 2)
    save(cm, "w", h, [100, 101])
    ack(cm, cm.take_ops())
    cm.finish("w")
    cm.match_prefix("r", h)
    cm.load_external("r", 0, [10, 11])
    old = cm.take_ops()
    assert cm.cancel_saves("r") == 0
    cm.finish("r")  # the engine freed 10, 11
    cm.match_prefix("r", h)
    cm.load_external("r", 0, [20, 21])
    new = cm.take_ops()
    ack(cm, old + new, done={0: 0})
    assert cm.take_load_failures() == {}
    assert cm.stats.loaded_external == 2  # the new load
    cm.finish("r")
    cm.check_invariants()
    assert cm.tree.num_hlru == 2


def test_failed_save_drops_the_tail_and_frees_its_host_blocks() -> None:
    cm = make(8)
    a = H(1, 2, 3, 4)
    save(cm, "r1", a, [5, 6, 7, 8])
    ack(cm, cm.take_ops(), done={0: 2})
    assert [n.status for n in cm.held_blocks("r1")] == [HOST, HOST]
    assert cm.host.num_used == 2 and cm.stats.dropped == 2
    # the request saves the rest again later (same engine blocks, new host blocks)
    assert cm.cache_computed("r1", 16, device_ids=[5, 6, 7, 8]) == 2
    ops = cm.take_ops()
    assert [(o.src.tolist(), o.dst.tolist()) for o in ops] == [([7, 8], [2, 3])]
    ack(cm, ops)
    cm.finish("r1")
    assert cm.match_prefix("r2", a).num_host == 4


def test_failed_save_after_the_request_finished() -> None:
    cm = make(8)
    save(cm, "r1", H(1, 2), [5, 6])
    ops = cm.take_ops()
    cm.finish("r1")  # the engine freed its blocks only after the save; zkv lets go at once
    cm.check_invariants()
    ack(cm, ops, done={0: 0})
    assert cm.host.num_used == 0 and len(cm.tree.index) == 0


@pytest.mark.parametrize("done", [0, 1])
def test_a_finished_requests_save_and_its_ids_next_request_get_an_op_each(done: int) -> None:
    """A request finishes with its save planned (not yet taken) and a new request under
    its id saves in the same step: both saves went into one op (keyed by the id), and a
    failed ack of it asserted inside ``on_ops_done`` (the commit takes an op for one
    request's chain), with the op already popped. ``cancel_saves`` of the id cancels the
    running request's save alone. A fuzzer of the API found it."""
    cm = make(4)
    a, b = H(1), H(2)
    save(cm, "r", a, [10])
    cm.finish("r")
    save(cm, "r", b, [11])
    old, new = cm.take_ops()
    assert (old.src.tolist(), new.src.tolist()) == ([10], [11])
    ack(cm, [old, new], done={0: done, 1: done})
    assert [cm.match_prefix("x", h).num_host for h in (a, b)] == [done, done]
    cm.finish("x")
    cm.finish("r")
    assert cm.host.num_used == 2 * done
    cm.check_invariants()
    # cancel_saves: the running request's alone
    save(cm, "q", H(3), [12])
    cm.finish("q")
    save(cm, "q", H(4), [13])
    assert cm.cancel_saves("q") == 1
    (kept,) = cm.take_ops()
    assert kept.src.tolist() == [12]
    ack(cm, [kept])


def test_a_save_waits_for_a_save_in_flight_on_its_path_only() -> None:
    """``save_waits``: the request's own save in flight, or another's of its next block:
    yes; nothing in flight, or only a load from L3 on the path: no."""
    cm = make(8, storage=set(H(1, 2, 3)))
    a = H(1, 2, 3, 4)
    assert save(cm, "r1", a[:2], [0, 1]) == 2
    assert cm.save_waits("r1")  # its own save of blocks 0-1 is in flight
    cm.match_prefix("r2", a)  # ... and r2's next block is in that save
    assert cm.cache_computed("r2", 4 * BS, device_ids=[10, 11, 12, 13]) == 0
    assert cm.save_waits("r2")
    ack(cm, cm.take_ops())
    assert not cm.save_waits("r1")
    cm.finish("r1")
    cm.finish("r2")
    cm.match_prefix("r3", a)  # blocks 0-1 in host, 2 in L3: a prefetch of block 2
    assert cm.prefetch("r3") == 1 and not cm.save_waits("r3")
    cm.finish("r3")
    cm.check_invariants()


def test_a_second_save_waits_for_the_first() -> None:
    cm = make(8)
    a = H(1, 2, 3, 4)
    cm.match_prefix("r1", a)
    assert cm.cache_computed("r1", 8, device_ids=[0, 1, 2, 3]) == 2
    first = cm.take_ops()
    assert cm.cache_computed("r1", 16, device_ids=[0, 1, 2, 3]) == 0  # blocks 0-1 in flight
    ack(cm, first)
    assert cm.cache_computed("r1", 16, device_ids=[0, 1, 2, 3]) == 2
    assert [o.src.tolist() for o in cm.take_ops()] == [[2, 3]]
    cm.check_invariants()


def _chained(cm: CacheManager) -> tuple[list[Any], list[Any]]:
    """r1 saves blocks 0-1 (taken: in flight), then its final save of 2-3 chains under
    them; r1 finishes (the engine frees its blocks). (first op, chained op)."""
    a = H(1, 2, 3, 4)
    cm.match_prefix("r1", a)
    assert cm.cache_computed("r1", 8, device_ids=[0, 1, 2, 3]) == 2
    first = cm.take_ops()
    assert cm.cache_computed("r1", 16, device_ids=[0, 1, 2, 3], chain=True) == 2
    assert not cm.save_waits("r1", chain=True)
    chained = cm.take_ops()
    assert [(o.src.tolist(), o.dst.tolist()) for o in chained] == [([2, 3], [2, 3])]
    cm.finish("r1")
    cm.check_invariants()
    return first, chained


@pytest.mark.parametrize("order", ["in_order", "chained_first"])
def test_a_final_save_chains_past_its_own_save_in_flight(order: str) -> None:
    """Both acked (in the workers' order, or the chained one first): all four blocks are
    matchable. Before: the final save stopped at its own save in flight, and vLLM had to
    keep the request's blocks until a later step saved the rest (a cache reset in
    between failed)."""
    cm = make(8)
    first, chained = _chained(cm)
    for ops in ([first, chained] if order == "in_order" else [chained, first]):
        ack(cm, ops)
    m = cm.match_prefix("r2", H(1, 2, 3, 4))
    assert (m.num_host, cm.host.num_used) == (4, 4)
    cm.finish("r2")
    cm.check_invariants()


@pytest.mark.parametrize("order", ["in_order", "chained_first"])
def test_a_failed_save_drops_the_save_chained_under_it(order: str) -> None:
    """The first save fails: the chained one's blocks go with it, whether its op is still
    in flight (freed when it acks) or acked already; nothing is matchable, no host block
    leaks. (Before chaining, a failed save's node could have no child.)"""
    cm = make(8)
    first, chained = _chained(cm)
    if order == "in_order":
        ack(cm, first, {0: 0})
        assert cm.host.num_used == 2  # the chained op's blocks: freed when it acks
        ack(cm, chained)
    else:
        ack(cm, chained)
        ack(cm, first, {0: 1})  # block 0 saved, block 1 failed: 1-3 go
        assert cm.match_prefix("r2", H(1, 2, 3, 4)).num_host == 1
        cm.finish("r2")
    assert cm.host.num_used == (0 if order == "in_order" else 1)
    assert cm.match_prefix("r3", H(1, 2, 3, 4)).num_host == (0 if order == "in_order" else 1)
    cm.finish("r3")
    cm.check_invariants()


def test_a_save_without_chain_still_waits_for_its_own_in_flight() -> None:
    """A running request's per-step saves do not chain (one in flight per request)."""
    cm = make(8)
    cm.match_prefix("r1", H(1, 2, 3, 4))
    assert cm.cache_computed("r1", 8, device_ids=[0, 1, 2, 3]) == 2
    cm.take_ops()
    assert cm.cache_computed("r1", 16, device_ids=[0, 1, 2, 3]) == 0
    assert cm.save_waits("r1")


def test_shared_prefix_saved_once_and_another_save_stops_at_a_block_in_flight() -> None:
    cm = make(8)
    a, b = H(1, 2, 3), H(1, 2, 9)
    save(cm, "r1", a, [0, 1, 2])
    assert save(cm, "r2", b, [3, 4, 5]) == 0  # block 0 is being saved by r1
    ack(cm, cm.take_ops())
    assert cm.cache_computed("r2", 12, device_ids=[3, 4, 5]) == 3  # 2 shared + 1 new
    assert [(o.src.tolist(), o.dst.tolist()) for o in cm.take_ops()] == [([5], [3])]
    assert cm.host.num_used == 4


def test_host_pool_full_evicts_unheld_leaves_then_stops() -> None:
    cm = make(3)
    save(cm, "r1", H(1, 2), [0, 1])
    ack(cm, cm.take_ops())
    cm.finish("r1")  # 2 host blocks evictable
    assert save(cm, "r2", H(5, 6, 7, 8), [2, 3, 4, 5]) == 3  # 1 free + 2 evicted, then none
    assert cm.stats.evicted_host == 2 and cm.match_prefix("r3", H(1)).num_host == 0
    cm.abort("r3")
    ack(cm, cm.take_ops())
    assert cm.cache_computed("r2", 16, device_ids=[2, 3, 4, 5]) == 0  # all 3 held by r2


def test_storage_prefetch_then_load_counts_storage_hits() -> None:
    store = set(H(1, 2, 3))
    cm = make(8, storage=store)
    a = H(1, 2, 3)
    assert cm.match_prefix("r1", a) == Match(0, 0, 3, BS)
    assert cm.prefetch("r1") == 3
    ops = cm.take_ops()
    assert [o.kind for o in ops] == [S2H]
    assert [n.status for n in cm.loading_blocks("r1")] == [LOADING_FROM_STORAGE] * 3
    ack(cm, ops, done={0: 2})  # the third block did not arrive on some rank
    assert cm.prefetch_done("r1") and cm.num_held_blocks("r1") == 2
    assert cm.load_external("r1", 0, [4, 5, 6]) == 2
    ack(cm, cm.take_ops())
    assert (cm.stats.hit_host, cm.stats.hit_storage) == (0, 2)
    # save writes to L3 when configured; the loaded blocks are already there
    cm.finish("r1")


def test_a_request_gone_while_its_prefetch_runs_leaves_the_blocks_cached() -> None:
    """vLLM aborts a request still waiting on its prefetch (a client gone): its match is
    released at once; the s2h in flight lands, and what arrived is matchable host blocks."""
    cm = make(8, storage=set(H(1, 2, 3)))
    cm.match_prefix("r1", H(1, 2, 3))
    assert cm.prefetch("r1") == 3
    ops = cm.take_ops()
    cm.finish("r1")  # aborted before the ack
    assert cm.num_running() == 0
    ack(cm, ops, done={0: 2})
    assert cm.match_prefix("r2", H(1, 2, 3)).num_host == 2
    cm.finish("r2")
    cm.check_invariants()


def test_a_request_matched_again_after_its_prefetch_uses_its_blocks_once() -> None:
    """The connector's flow: prefetch, the loads land (one use: the request holds them),
    vLLM asks again: still one use, so SLRU keeps the blocks on probation."""
    a = H(1, 2)
    cm = make(8, storage=set(a), eviction_policy="slru")
    assert cm.match_prefix("r1", a) == Match(0, 0, 2, BS)
    assert cm.prefetch("r1") == 2
    ack(cm, cm.take_ops())
    assert cm.match_prefix("r1", a) == Match(0, 2, 0, BS)
    assert cm.load_external("r1", 0, [10, 11]) == 2
    ack(cm, cm.take_ops())
    cm.finish("r1")
    cm.check_invariants()
    assert [cm.tree.block(h).hits for h in a] == [1, 1]
    pol = cm.tree.hpol
    assert isinstance(pol, SLRU)
    probation, protected = pol.queues()
    assert (len(probation), len(protected)) == (1, 0)


def test_loads_that_land_after_the_request_was_counted_count_as_its_use() -> None:
    """The request was counted (it went external) before its storage load was acked: the
    blocks that land join its path and count its use, so a second request's use makes
    them protected in SLRU (with no hit of their own, they stayed on probation)."""
    a = H(1, 2)
    cm = make(8, storage=set(a), eviction_policy="slru")
    assert cm.match_prefix("r1", a) == Match(0, 0, 2, BS)
    assert cm.prefetch("r1") == 2
    ops = cm.take_ops()
    assert cm.cache_computed("r1", 0, device_ids=[]) == 0  # counted now, loads in flight
    cm.check_invariants()
    ack(cm, ops)
    assert cm.num_held_blocks("r1") == 2
    assert [cm.tree.block(h).hits for h in a] == [1, 1]
    cm.finish("r1")
    assert cm.match_prefix("r2", a) == Match(0, 2, 0, BS)
    assert cm.load_external("r2", 0, [10, 11]) == 2
    ack(cm, cm.take_ops())
    cm.finish("r2")
    cm.check_invariants()
    assert [cm.tree.block(h).hits for h in a] == [2, 2]
    pol = cm.tree.hpol
    assert isinstance(pol, SLRU)
    probation, protected = pol.queues()
    assert (len(probation), len(protected)) == (0, 1)


def test_storage_write_after_save() -> None:
    cm = make(8, storage_write=True)
    save(cm, "r1", H(1, 2), [0, 1])
    ack(cm, cm.take_ops())
    ops = cm.take_ops()
    assert [(o.kind, o.src.tolist(), o.keys) for o in ops] == [(H2S, [0, 1], tuple(H(1, 2)))]
    ack(cm, ops)
    assert cm.stats.stored == 2


def test_external_calls_refused_with_a_device_pool() -> None:
    cm = CacheManager(CacheConfig(4, 4, BS))
    cm.match_prefix("r1", H(1))
    with pytest.raises(ValueError, match="num_device_blocks=0"):
        cm.load_external("r1", 0, [0])


def test_a_load_of_nothing_inside_a_held_node_plans_nothing() -> None:
    """The engine has the first block of a 2-block host node itself and gives no ids for
    the rest (nothing to load): 0, no op. (Before: the node was split at block 1, then
    again at 0: an AssertionError out of the tree, or under ``python -O`` a node of no
    block and an h2d of 0 blocks.)"""
    cm = make(4)
    a = H(1, 2)
    save(cm, "w", a, [10, 11])
    ack(cm, cm.take_ops())
    cm.finish("w")
    assert cm.match_prefix("r", a) == Match(0, 2, 0, BS)
    assert cm.load_external("r", 1, []) == 0
    assert cm.take_ops() == []
    cm.check_invariants()
    cm.finish("r")
    cm.check_invariants()


@pytest.mark.parametrize("call", ["save", "load"])
def test_an_engine_id_past_int32_is_refused_before_anything_changes(call: str) -> None:
    """Engine block ids go on the wire as int32. One of 2**31 is refused at the call, as a
    negative one is. (Before: taken, then ``take_ops`` raised OverflowError with the op
    already pending: never handed out, its node busy and its host block held for good.)"""
    cm = make(4)
    a = H(1)
    if call == "load":
        save(cm, "w", a, [0])
        ack(cm, cm.take_ops())
        cm.finish("w")
    cm.match_prefix("r", a)
    with pytest.raises(ValueError, match=r"ids < 2\*\*31 \(int32 on the wire\), got 2147483648"):
        if call == "save":
            cm.cache_computed("r", BS, device_ids=[2**31])
        else:
            cm.load_external("r", 0, [2**31])
    assert cm.take_ops() == [] and cm.host.num_used == (1 if call == "load" else 0)
    cm.check_invariants()
    cm.finish("r")
    cm.check_invariants()


def test_block_hashes_must_extend_the_held_prefix() -> None:
    cm = make(8)
    save(cm, "r1", H(1, 2), [0, 1])
    with pytest.raises(ValueError, match="disagree"):
        cm.cache_computed("r1", 12, block_hashes=H(9, 2, 3), device_ids=[0, 1, 2])
    assert cm.cache_computed("r1", 12, block_hashes=H(1, 2, 3), device_ids=[0, 1, 2]) == 0



class _Reads(Sequence[Any]):
    """A hash list or block table that counts the elements read from it (what a step's
    compare or check costs)."""

    def __init__(self, items: list[Any]) -> None:
        self.items, self.reads = items, 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: Any) -> Any:
        got = self.items[i]
        self.reads += len(got) if isinstance(i, slice) else 1
        return got


def test_a_steps_hashes_cost_the_new_blocks_not_the_context() -> None:
    """The engine passes a running request's whole hash list every step: its held prefix
    is proved unchanged with one compare (hashes are chained) and only the new hashes are
    taken. (Before, the held prefix was copied and compared, and the list copied, every
    step: O(context) per request per step, 12 ms a step at 100 requests of 128k tokens.)"""
    cm = make(512)
    hashes = H(*range(1, 301))
    cm.match_prefix("r", [])
    for step in range(1, 31):  # ten blocks a step
        seq = _Reads(hashes[: 10 * step])
        cm.cache_computed("r", 10 * step * BS, block_hashes=seq,
                          device_ids=list(range(10 * step)))
        assert seq.reads <= 10 + 3, (step, seq.reads)
        ack(cm, cm.take_ops())
    assert cm.core.requests["r"].hashes == hashes[:300]
    with pytest.raises(ValueError, match="disagree"):  # a held block changed
        cm.cache_computed("r", 300 * BS, block_hashes=H(*range(2, 302)), device_ids=[0] * 300)
    with pytest.raises(ValueError, match="disagree"):  # fewer than it holds
        cm.cache_computed("r", 300 * BS, block_hashes=hashes[:5], device_ids=[0] * 300)
    cm.finish("r")
    cm.check_invariants()



def test_a_step_reads_its_new_engine_ids_once_also_when_the_host_pool_is_full() -> None:
    """Once the host pool is full (every block held), a running request's unsaved tail
    grows a block a step: its engine ids are checked once each, not the whole tail every
    step (it cost 255 us per request per step at 8,000 blocks, from a review of the
    checks' first version)."""
    import numpy as np

    cm = make(4)  # room for 4 of the request's 40 blocks: the rest never fits
    h = H(*range(1, 41))
    cm.match_prefix("r", [])
    ids = list(np.arange(100, 140))  # (numpy ints, as a numpy block table gives)
    for k in range(1, 41):
        table = _Reads(ids[:k])
        cm.cache_computed("r", k * BS, block_hashes=h[:k], device_ids=table)
        assert table.reads <= 2, (k, table.reads)
        ack(cm, cm.take_ops())
    assert cm.num_held_blocks("r") == 4 and cm.tree.num_hlru == 0  # held, not evictable
    cm.finish("r")
    cm.check_invariants()

def test_failed_loads_are_found_without_walking_the_running_requests() -> None:
    """The connector asks for load failures at every call vLLM makes: the answer costs
    the requests with failures, not every running one (it was a walk of all of them:
    11 us at 1,000 requests, per call)."""

    class Walks(dict[str, Any]):
        walks = 0

        def values(self) -> Any:
            Walks.walks += 1
            return super().values()

        def items(self) -> Any:
            Walks.walks += 1
            return super().items()

        def __iter__(self) -> Any:
            Walks.walks += 1
            return super().__iter__()

    cm = make(8)
    cm.core.requests = Walks()
    h = H(1, 2)
    save(cm, "w", h, [100, 101])
    ack(cm, cm.take_ops())
    for i in range(50):
        cm.match_prefix(f"idle{i}", [])
    cm.match_prefix("r", h)
    cm.load_external("r", 0, [10, 11])
    ack(cm, cm.take_ops(), done={0: 1})
    Walks.walks = 0
    assert cm.take_load_failures() == {"r": [11]}
    assert cm.take_load_failures() == {}
    assert Walks.walks == 0


# ================================================================ owned-device mode


def test_incremental_cache_makes_running_blocks_matchable() -> None:
    cm = CacheManager(CacheConfig(8, 0, BS))
    a = H(1, 2, 3)
    cm.match_prefix("r1", a)
    assert cm.allocate("r1", 12) == [0, 1, 2]
    assert cm.cache_computed("r1", 8) == 2  # two blocks computed so far
    cm.check_invariants()
    assert cm.match_prefix("r2", a) == Match(2, 0, 0, BS)  # r1 still running
    assert cm.allocate("r2", 12) == [0, 1, 3]
    cm.check_invariants()
    cm.finish("r1")
    cm.check_invariants()
    cm.finish("r2")  # block 3 duplicates r1's block 2: freed
    cm.check_invariants()
    assert cm.device.num_used == 3 and cm.match_prefix("r3", a).num_device == 3


def test_cancelled_save_rolls_back_like_a_failed_one() -> None:
    cm = make(8)
    save(cm, "r1", H(1, 2, 3), [5, 6, 7])
    assert cm.cancel_saves("r1") == 3  # the engine freed the blocks before the batch left
    cm.check_invariants()
    assert cm.take_ops() == [] and cm.host.num_used == 0 and cm.num_held_blocks("r1") == 0
    assert cm.cancel_saves("r1") == 0
    assert cm.cache_computed("r1", 12, device_ids=[1, 2, 3]) == 3  # saved anew later
    assert [o.src.tolist() for o in cm.take_ops()] == [[1, 2, 3]]


def test_a_flush_mid_step_keeps_the_steps_loads_open() -> None:
    """The connector publishes a prefetch (s2h) as soon as it is planned, in the middle of
    a step whose earlier requests already planned loads into engine blocks: those loads
    must stay for the step's own batch (the one whose seq the forward waits on)."""
    cm = make(8, storage={*H(5, 6)})
    a = H(1, 2)
    save(cm, "r1", a, [0, 1])
    ack(cm, cm.take_ops())
    cm.finish("r1")
    cm.match_prefix("r2", a)
    assert cm.load_external("r2", 0, [20, 21]) == 2  # r2's load, planned first
    assert cm.match_prefix("r3", H(5, 6)).num_storage == 2
    assert cm.prefetch("r3") == 2
    early = cm.take_ops(keep=("load",))  # the prefetch goes now
    assert [o.kind for o in early] == [S2H]
    assert cm.take_ops(keep=("load",)) == []  # nothing but the load is open
    late = cm.take_ops()  # the step's batch
    assert [(o.kind, o.dst.tolist()) for o in late] == [(H2D, [20, 21])]
    ack(cm, early)
    ack(cm, late)
    assert cm.stats.loaded_external == 2 and cm.stats.loaded == 2
    cm.finish("r2")
    cm.finish("r3")
    cm.check_invariants()


@pytest.mark.parametrize("new", [H(1, 2, 9, 9), H(1, 2)], ids=["other_tail", "shorter"])
def test_new_hashes_past_the_held_prefix_let_the_storage_load_go(new: list[bytes]) -> None:
    """A request whose hashes change past what it holds while its storage load is in
    flight lets the load go: the blocks that arrive are another prefix's (or past its
    hashes), so they land unheld for later requests and never join its path. (They
    joined it when acked: the request held blocks 2-3 of H(1, 2, 3, 4) under hashes
    H(1, 2, 9, 9), and load_external copied that KV into its engine blocks.)"""
    a = H(1, 2, 3, 4)
    cm = make(8, storage=set(a))
    assert cm.match_prefix("r1", a) == Match(0, 0, 4, BS)
    assert cm.prefetch("r1") == 4
    (s2h,) = cm.take_ops()
    assert s2h.kind == S2H
    assert cm.cache_computed("r1", 4 * BS, block_hashes=new, device_ids=[0, 1, 2, 3]) == 0
    cm.check_invariants()
    ack(cm, [s2h])  # (checks the invariants)
    assert cm.prefetch_done("r1") and cm.num_held_blocks("r1") == 0
    assert cm.load_external("r1", 0, [0, 1, 2, 3]) == 0
    assert cm.match_prefix("r2", a) == Match(0, 4, 0, BS)  # landed, for later requests
    cm.finish("r1")
    cm.finish("r2")
    cm.check_invariants()
    assert cm.tree.num_hlru == 4


def _stored_prompt(cm: CacheManager, rid: str, hashes: list[bytes]) -> None:
    """``rid`` saves ``hashes`` and finishes; the saves and their L3 writes are acked."""
    save(cm, rid, hashes, list(range(100, 100 + len(hashes))))
    ack(cm, cm.take_ops())  # the save
    cm.finish(rid)
    (h2s,) = cm.take_ops()
    assert h2s.kind == H2S
    ack(cm, [h2s])


def test_store_again_writes_what_the_store_lost_from_the_host_copies() -> None:
    """A P/D producer about to promise a prompt's blocks: the store holds only the first
    (an existence query says so; it evicted the rest since their write). Those past it
    are written again from the host copies (the node cut there), and all are promised."""
    cm = make(8, storage_write=True)
    a = H(1, 2, 3, 4)
    _stored_prompt(cm, "r1", a)
    assert cm.match_prefix("r2", a) == Match(0, 4, 0, BS)
    assert cm.store_again("r2", 4) == 4 and cm.take_ops() == []  # all there: nothing
    assert cm.store_again("r2", 1) == 4
    (again,) = cm.take_ops()
    assert (again.kind, again.keys) == (H2S, tuple(a[1:]))
    assert [v.in_store for v in cm.held_blocks("r2")] == [True, False, False, False]
    cm.check_invariants()
    ack(cm, [again])
    assert [v.in_store for v in cm.held_blocks("r2")] == [True] * 4
    cm.finish("r2")
    cm.check_invariants()


def test_store_again_counts_blocks_on_their_way_and_writes_nothing_without_l3_writes(
        ) -> None:
    """Blocks whose save (or write) is in flight are on their way: promised, not written
    twice. Without storage writes nothing is written and only what the store has is."""
    cm = make(8, storage_write=True)
    a = H(1, 2, 3, 4)
    _stored_prompt(cm, "r1", a[:2])
    cm.match_prefix("r2", a)
    assert cm.cache_computed("r2", 4 * BS, device_ids=[7, 8, 9, 10]) == 2  # blocks 2-3
    (saving,) = cm.take_ops()  # in flight
    assert cm.store_again("r2", 0) == 4
    (again,) = cm.take_ops()
    assert again.keys == tuple(a[:2])  # the two stored ones; the saving ones follow it
    ack(cm, [saving, again])
    cm.finish("r2")
    (h2s,) = cm.take_ops()
    assert h2s.keys == tuple(a[2:])
    ack(cm, [h2s])
    plain = make(8)
    assert save(plain, "p1", a, [1, 2, 3, 4]) == 4
    ack(plain, plain.take_ops())
    assert plain.store_again("p1", 2) == 2 and plain.take_ops() == []
    plain.finish("p1")
    plain.check_invariants()
