"""CacheManager scenarios with exact block ids and statuses, driven like an engine.

Each test walks one story: ``match_prefix`` → ``allocate`` → ``take_ops`` → (worker) →
``on_ops_done`` → ``finish``, and checks every invariant after every step. Block ids follow
from the pools handing out low ids first and reusing the most recently freed id first.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from structlog.testing import capture_logs

from zkv.protocol import BACKUP, D2H, H2D, H2S, S2H, Op, OpResult
from zkv.scheduler.core import NegativeCache
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import (
    WRITE_BACK,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    CacheConfig,
    CacheManager,
    Match,
)
from zkv.scheduler.radix import (
    DEVICE,
    HOST,
    LOADING_FROM_STORAGE,
    SWAP_TO_DEVICE,
    SWAP_TO_HOST,
    BlockView,
    Node,
)

BS = 4


class Store:
    """An L3 store as a Python set, with the manager's batched existence callback."""

    def __init__(self, *hashes: bytes) -> None:
        self.keys: set[bytes] = set(hashes)
        self.queries: list[list[bytes]] = []

    def exists(self, hashes: Sequence[bytes]) -> int:
        self.queries.append(list(hashes))
        k = 0
        while k < len(hashes) and hashes[k] in self.keys:
            k += 1
        return k


def make(
    num_device: int,
    num_host: int = 0,
    policy: str = WRITE_BACK,
    threshold: int = 2,
    *,
    store: Store | None = None,
    storage_write: bool = False,
    negative_cache_s: float = 5.0,
) -> CacheManager:
    cfg = CacheConfig(num_device, num_host, BS, policy, threshold, storage_write, negative_cache_s)
    cm = CacheManager(cfg, storage_exists=store.exists if store is not None else None)
    cm.check_invariants()
    return cm


def H(*ids: int) -> list[bytes]:  # noqa: N802 - reads like the paths it hashes
    return hash_ids_chain(ids)


def node(cm: CacheManager, h: bytes) -> BlockView:
    return cm.tree.block(h)


def status(cm: CacheManager, h: bytes) -> object:
    n = cm.tree.index.get(h)
    return None if n is None else n.status


def match(cm: CacheManager, rid: str, hashes: Sequence[bytes]) -> Match:
    m = cm.match_prefix(rid, hashes)
    cm.check_invariants()
    return m


def alloc(cm: CacheManager, rid: str, num_tokens: int) -> list[int] | None:
    table = cm.allocate(rid, num_tokens)
    cm.check_invariants()
    return table


def run(
    cm: CacheManager, rid: str, hashes: Sequence[bytes], num_tokens: int | None = None,
) -> list[int] | None:
    """match + allocate the whole prompt (one scheduling step, ops not taken)."""
    match(cm, rid, hashes)
    return alloc(cm, rid, len(hashes) * BS if num_tokens is None else num_tokens)


def finish(cm: CacheManager, rid: str, num_computed_tokens: int | None = None) -> None:
    cm.finish(rid, num_computed_tokens)
    cm.check_invariants()


def take(cm: CacheManager) -> list[Op]:
    ops = cm.take_ops()
    cm.check_invariants()
    return ops


def ack(cm: CacheManager, *ops: Op) -> list[int]:
    unknown = cm.on_ops_done([OpResult(op.id, True, op.num_blocks) for op in ops])
    cm.check_invariants()
    return unknown


def fail(cm: CacheManager, op: Op, done: int = 0) -> list[int]:
    unknown = cm.on_ops_done([OpResult(op.id, False, done, "injected")])
    cm.check_invariants()
    return unknown


def shape(op: Op) -> tuple[str, list[int], list[int], tuple[bytes, ...]]:
    return op.kind, [int(x) for x in op.src], [int(x) for x in op.dst], op.keys


def cached(
    cm: CacheManager, rid: str, hashes: Sequence[bytes], num_tokens: int | None = None,
) -> list[int]:
    """One request end to end with every op acked ok; returns its block table."""
    table = run(cm, rid, hashes, num_tokens)
    assert table is not None
    ops = take(cm)
    if ops:
        ack(cm, *ops)
    finish(cm, rid)
    ops = take(cm)  # backups of the write policy, h2s of the acks above
    if ops:
        ack(cm, *ops)
    return table


# ================================================================ matching and allocation


def test_device_hit_after_finish() -> None:
    cm = make(8)
    a = H(1, 2, 3)
    assert match(cm, "r1", a) == Match(0, 0, 0, BS)
    assert alloc(cm, "r1", 12) == [0, 1, 2]
    assert take(cm) == []
    finish(cm, "r1")
    assert [status(cm, h) for h in a] == [DEVICE] * 3
    assert [node(cm, h).dev for h in a] == [0, 1, 2]
    assert node(cm, a[1]).parent == node(cm, a[0])
    assert node(cm, a[0]).parent is None
    (run_,) = cm.tree.root.children.values()  # one node holds the run of three blocks
    assert run_.hashes == a and run_.dev == [0, 1, 2] and cm.tree.index[a[1]] is run_
    m = match(cm, "r2", a)
    assert m == Match(3, 0, 0, BS)
    assert m.num_cached_tokens == 12
    assert alloc(cm, "r2", 14) == [0, 1, 2, 3]  # decode tail: one fresh block
    assert cm.block_table("r2") == [0, 1, 2, 3]
    finish(cm, "r2", num_computed_tokens=14)  # only three hashes: block 3 is freed
    assert cm.device.num_used == 3
    assert len(cm.tree.index) == 3
    assert take(cm) == []


def test_partial_prefix_hit_extends_the_tree() -> None:
    cm = make(8)
    a = H(1, 2, 3)
    cached(cm, "r1", a)
    b = H(1, 2, 7, 8)
    assert b[:2] == a[:2] and b[2] != a[2]
    assert match(cm, "r2", b) == Match(2, 0, 0, BS)
    assert alloc(cm, "r2", 16) == [0, 1, 3, 4]
    finish(cm, "r2")
    assert [node(cm, h).dev for h in b] == [0, 1, 3, 4]
    assert set(node(cm, a[1]).children) == {a[2], b[2]}
    assert node(cm, a[2]).dev == 2
    assert match(cm, "r3", H(1, 9)) == Match(1, 0, 0, BS)
    assert match(cm, "r4", H(9)) == Match(0, 0, 0, BS)
    assert match(cm, "r5", []) == Match(0, 0, 0, BS)


def test_rematch_before_allocate_releases_the_first_match() -> None:
    cm = make(4)
    a = H(1, 2)
    cached(cm, "r1", a)
    match(cm, "r2", a)
    assert node(cm, a[0]).ref == 1
    assert match(cm, "r2", H(1)) == Match(1, 0, 0, BS)
    assert (node(cm, a[0]).ref, node(cm, a[1]).ref) == (1, 0)
    alloc(cm, "r2", 4)
    with pytest.raises(ValueError):
        cm.match_prefix("r2", a)  # already allocated
    cm.check_invariants()


def test_match_counts_per_tier() -> None:
    h = H(1, 2, 3, 4, 5)
    store = Store(h[2], h[3])
    cm = make(2, 4, store=store)
    cached(cm, "r1", h[:2])                 # device 0, 1
    assert cached(cm, "r2", H(9)) == [1]    # evicts h[1] to host 0
    assert status(cm, h[1]) is HOST
    m = match(cm, "r3", h)
    assert m == Match(1, 1, 2, BS)
    assert m.num_cached_tokens == 8         # storage blocks are not cached yet
    assert store.queries[-1] == h[2:]       # one batched query for what L1/L2 missed


def test_allocate_returns_none_when_the_device_cannot_make_room() -> None:
    cm = make(4)
    a = H(1, 2)
    cached(cm, "r1", a)                     # nodes on 0, 1
    assert run(cm, "c", H(7, 8)) == [2, 3]  # running: device full
    assert match(cm, "r2", H(1, 2, 3, 4, 5)) == Match(2, 0, 0, BS)
    free_before = list(cm.device._free)
    assert cm.num_blocks_needed("r2", 20) == 3
    assert not cm.can_allocate("r2", 20)
    assert alloc(cm, "r2", 20) is None
    assert cm.block_table("r2") == []
    assert list(cm.device._free) == free_before
    assert (node(cm, a[0]).ref, node(cm, a[1]).ref) == (1, 1)  # the match still holds
    assert take(cm) == []
    finish(cm, "c")                         # two evictable blocks: still one short
    assert alloc(cm, "r2", 20) is None
    assert cm.block_table("r2") == []
    assert [status(cm, h) for h in H(7, 8)] == [DEVICE, DEVICE]
    assert cm.can_allocate("r2", 16)
    assert alloc(cm, "r2", 16) == [0, 1, 2, 3]
    # No host tier: the evicted blocks are dropped, no d2h op.
    assert [status(cm, h) for h in H(7, 8)] == [None, None]
    assert take(cm) == []
    assert cm.stats.evicted_device == 2 and cm.stats.dropped == 2


def test_grow_allocated_table_for_decode() -> None:
    cm = make(4)
    assert run(cm, "r1", H(1), 3) == [0]
    assert cm.num_blocks_needed("r1", 9) == 2
    assert alloc(cm, "r1", 9) == [0, 1, 2]
    assert alloc(cm, "r1", 8) == [0, 1, 2]  # never shrinks
    assert alloc(cm, "r1", 20) is None
    assert cm.block_table("r1") == [0, 1, 2]


def test_unknown_request_is_caller_misuse() -> None:
    cm = make(2)
    with pytest.raises(ValueError):
        cm.allocate("nope", 4)
    with pytest.raises(ValueError):
        cm.finish("nope")
    cached(cm, "r1", H(1))
    with pytest.raises(ValueError):
        cm.finish("r1")  # finished twice
    cm.check_invariants()


# ================================================================ write_back


def test_write_back_eviction_emits_one_d2h_and_reuses_the_block_this_step() -> None:
    cm = make(4, 4)
    a = H(1, 2, 3, 4)
    assert cached(cm, "r1", a) == [0, 1, 2, 3]
    assert run(cm, "r2", H(9)) == [3]  # the leaf's block, given up and reused in one step
    (op,) = take(cm)
    assert shape(op) == (D2H, [3], [0], ())
    assert not op.layerwise
    n = node(cm, a[3])
    assert (n.status, n.dev, n.host) == (SWAP_TO_HOST, -1, 0)
    assert [status(cm, h) for h in a[:3]] == [DEVICE] * 3
    assert match(cm, "probe", a) == Match(3, 0, 0, BS)  # in flight: not matchable
    cm.abort("probe")
    cm.check_invariants()
    assert ack(cm, op) == []
    assert (n.status, n.dev, n.host) == (HOST, -1, 0)
    assert match(cm, "probe", a) == Match(3, 1, 0, BS)
    cm.abort("probe")
    cm.check_invariants()
    assert (cm.stats.swapped_out, cm.stats.evicted_device) == (1, 1)


def test_write_back_failed_d2h_drops_the_node() -> None:
    cm = make(4, 4)
    a = H(1, 2, 3, 4)
    cached(cm, "r1", a)
    run(cm, "r2", H(9))
    (op,) = take(cm)
    assert fail(cm, op) == []
    assert status(cm, a[3]) is None
    assert cm.host.num_free == 4
    assert match(cm, "probe", a) == Match(3, 0, 0, BS)
    assert (cm.stats.failed_ops, cm.stats.failed_blocks, cm.stats.dropped) == (1, 1, 1)


def test_write_back_partial_d2h_commits_the_first_k() -> None:
    cm = make(4, 4)
    roots = [H(10 + i) for i in range(4)]
    for i, h in enumerate(roots):
        assert cached(cm, f"r{i}", h) == [i]
    assert run(cm, "x", H(20, 21)) == [1, 0]  # LRU: roots 0 and 1 go
    (op,) = take(cm)
    assert shape(op) == (D2H, [0, 1], [0, 1], ())
    fail(cm, op, done=1)
    assert (status(cm, roots[0][0]), node(cm, roots[0][0]).host) == (HOST, 0)
    assert status(cm, roots[1][0]) is None
    assert (cm.host.num_used, cm.host.is_allocated(1)) == (1, False)
    assert (cm.stats.swapped_out, cm.stats.failed_blocks) == (1, 1)


def test_write_back_partial_d2h_of_a_run_keeps_its_committed_prefix() -> None:
    """A victim's blocks travel root side first, so a partial d2h commits a prefix of the
    chain (matchable from host) and drops only the blocks after it."""
    cm = make(3, 4)
    a = H(1, 2, 3)
    cached(cm, "r1", a)
    assert run(cm, "x", H(9, 8, 7)) == [0, 1, 2]
    (op,) = take(cm)
    assert shape(op) == (D2H, [0, 1, 2], [0, 1, 2], ())
    fail(cm, op, done=2)
    assert [status(cm, h) for h in a] == [HOST, HOST, None]
    assert [node(cm, h).host for h in a[:2]] == [0, 1] and cm.host.num_used == 2
    assert (cm.stats.swapped_out, cm.stats.dropped) == (2, 1)


def test_write_back_without_free_host_evicts_the_host_lru() -> None:
    cm = make(1, 1)
    cached(cm, "r1", H(1))
    assert cached(cm, "r2", H(2)) == [0]   # H(1) -> host 0
    assert status(cm, H(1)[0]) is HOST
    assert run(cm, "r3", H(3)) == [0]      # H(2) needs host 0: H(1) is dropped
    (op,) = take(cm)
    assert shape(op) == (D2H, [0], [0], ())
    assert status(cm, H(1)[0]) is None
    assert status(cm, H(2)[0]) is SWAP_TO_HOST
    assert (cm.stats.evicted_host, cm.stats.dropped) == (1, 1)


def test_write_back_short_of_host_blocks_keeps_the_root_side_of_a_chain() -> None:
    """A chain leaves the device whole, tail first, with host blocks for half of it: they
    go to the parent (a tail kept under a dropped parent would go with it, its d2h
    wasted); the tail is dropped."""
    cm = make(4, 2)
    a = H(1, 2)
    b = H(1, 2, 3, 4)
    assert cached(cm, "r1", a) == [0, 1]
    assert cached(cm, "r2", b) == [0, 1, 2, 3]  # [a0 a1] -> [b2 b3]
    assert run(cm, "r3", H(9, 9, 9, 9)) is not None  # every device block
    (op,) = take(cm)
    assert shape(op) == (D2H, [0, 1], [0, 1], ())
    assert [status(cm, h) for h in b] == [SWAP_TO_HOST] * 2 + [None] * 2
    assert not cm.core.deleting
    ack(cm, op)
    assert [status(cm, h) for h in b] == [HOST, HOST, None, None]
    assert [node(cm, h).host for h in a] == [0, 1]
    assert (cm.stats.swapped_out, cm.stats.dropped) == (2, 2)


def test_write_back_with_one_host_block_keeps_a_chains_first_block() -> None:
    """The parent keeps its first block; the rest of it goes, and the tail with it (not
    dropped a second time)."""
    cm = make(4, 1)
    b = H(1, 2, 3, 4)
    cached(cm, "r1", b[:2])
    cached(cm, "r2", b)
    assert run(cm, "r3", H(9, 9, 9, 9)) is not None
    (op,) = take(cm)
    assert shape(op) == (D2H, [0], [0], ())
    ack(cm, op)
    assert [status(cm, h) for h in b] == [HOST, None, None, None]
    assert (cm.stats.swapped_out, cm.stats.dropped) == (1, 3)


def test_write_back_without_a_host_block_frees_the_parent_that_waited_on_its_tail() -> None:
    """A swapped-in parent (its host copy kept) and a computed child leave the device in
    one eviction: the parent becomes HOST (metadata only) and waits on the child, which
    gets no host block (the parent's is the only one) and is dropped. The parent is a
    host chain tail now: evictable (else its host block stayed pinned for good)."""
    cm = make(2, 1)
    assert (cached(cm, "r1", H(1)), cached(cm, "r2", H(2)), cached(cm, "r3", H(3))) == (
        [0], [1], [0])  # H(1) -> host 0; H(2) and H(3) are dropped for r4 below
    p = H(1, 5)
    assert match(cm, "r4", p) == Match(0, 1, 0, BS)
    assert alloc(cm, "r4", 8) == [0, 1]
    (h2d,) = take(cm)
    ack(cm, h2d)
    finish(cm, "r4")
    assert [(status(cm, h), node(cm, h).dev, node(cm, h).host) for h in p] == [
        (DEVICE, 0, 0), (DEVICE, 1, -1)]
    assert run(cm, "r5", H(6, 7)) == [0, 1]
    assert take(cm) == []  # no d2h: the only host block is p[0]'s own
    assert (status(cm, p[0]), node(cm, p[0]).host, status(cm, p[1])) == (HOST, 0, None)
    assert cm.tree.num_hlru == 1 and cm.stats.dropped == 3
    finish(cm, "r5")
    assert run(cm, "r6", H(8)) == [1]  # p[0]'s host block takes H(6, 7)[1]'s d2h
    (d2h,) = take(cm)
    assert shape(d2h) == (D2H, [1], [0], ())
    assert status(cm, p[0]) is None


def test_a_waiting_request_matched_again_is_one_use_of_its_blocks() -> None:
    """vLLM asks about a waiting request every step: hits count uses, so the threshold
    of write_through_selective (3 here) is not reached by two requests."""
    cm = make(4, 4, WRITE_THROUGH_SELECTIVE, 3)
    g = H(5)
    cached(cm, "r1", g)  # computed: one use
    for _ in range(3):  # waits, matched again each step
        assert match(cm, "r2", g) == Match(1, 0, 0, BS)
    alloc(cm, "r2", 8)
    finish(cm, "r2")
    assert node(cm, g[0]).hits == 2 and take(cm) == []  # no backup


def test_a_request_counts_once_in_its_nodes_hits_when_it_uses_them() -> None:
    """Hits are counted at use (allocate), along the held path from the root: what an
    earlier match of the request held does not count, nor a request that never ran."""
    cm = make(8)
    a, b = H(1, 2), H(1, 2, 3)
    cached(cm, "r1", a)
    cached(cm, "r2", b)
    assert [node(cm, h).hits for h in b] == [2, 2, 1]
    match(cm, "r3", b)
    cm.abort("r3")  # waited, then gone
    match(cm, "r4", b)
    match(cm, "r4", a)  # the prompt changed while it waited
    match(cm, "r4", b)
    assert [node(cm, h).hits for h in b] == [2, 2, 1]
    alloc(cm, "r4", 16)
    assert [node(cm, h).hits for h in b] == [3, 3, 2]
    finish(cm, "r4")
    assert [node(cm, h).hits for h in b] == [3, 3, 2]


# ================================================================ swap-in


def _host_hit_setup() -> tuple[CacheManager, list[bytes], Op, Op]:
    """a = [1, 2] with a[0] on device 0 and a[1] on host 0; r3 matched a and allocated:
    node H(9) (device 1) is evicted to host 1 and a[1] swapped in to device 1."""
    cm = make(2, 4)
    a = H(1, 2)
    cached(cm, "r1", a)
    assert cached(cm, "r2", H(9)) == [1]
    assert (status(cm, a[1]), node(cm, a[1]).host) == (HOST, 0)
    assert match(cm, "r3", a) == Match(1, 1, 0, BS)
    assert cm.num_blocks_needed("r3", 8) == 1
    assert alloc(cm, "r3", 8) == [0, 1]
    d2h, h2d = take(cm)
    assert shape(d2h) == (D2H, [1], [1], ())
    assert shape(h2d) == (H2D, [0], [1], ())
    assert h2d.layerwise
    return cm, a, d2h, h2d


def test_host_hit_swaps_in_layerwise_and_keeps_the_host_copy() -> None:
    cm, a, d2h, h2d = _host_hit_setup()
    n = node(cm, a[1])
    assert (n.status, n.dev, n.host) == (SWAP_TO_DEVICE, 1, 0)
    assert match(cm, "probe", a) == Match(1, 0, 0, BS)
    cm.abort("probe")
    cm.check_invariants()
    ack(cm, d2h, h2d)
    assert (n.status, n.dev, n.host, n.host_ok) == (DEVICE, 1, 0, True)
    assert (status(cm, H(9)[0]), node(cm, H(9)[0]).host) == (HOST, 1)
    assert cm.take_recompute() == {}
    finish(cm, "r3")
    assert cm.stats.swapped_in == 1
    # The host copy is a backup: evicting a[1] again is metadata only.
    assert run(cm, "r5", H(5)) == [1]
    assert take(cm) == []
    assert (n.status, n.dev, n.host) == (HOST, -1, 0)
    assert cm.stats.swapped_out == 2  # a[1] once and H(9) once; none now


def test_failed_swap_in_returns_to_host_and_the_request_recomputes() -> None:
    cm, a, d2h, h2d = _host_hit_setup()
    ack(cm, d2h)
    fail(cm, h2d)
    n = node(cm, a[1])
    assert (n.status, n.dev, n.host, n.host_ok) == (HOST, -1, 0, True)
    assert cm.block_table("r3") == [0, 1]
    assert cm.device.is_allocated(1)  # owned by r3 now
    assert cm.take_recompute() == {"r3": 1}
    assert cm.take_recompute() == {}
    assert match(cm, "probe", a) == Match(1, 1, 0, BS)
    cm.abort("probe")
    cm.check_invariants()
    finish(cm, "r3")  # the recomputed block is attached again
    assert (n.status, n.dev, n.host) == (DEVICE, 1, 0)
    assert cm.device.num_used == 2
    assert (cm.stats.swapped_in, cm.stats.failed_blocks) == (0, 1)


def test_a_failed_swap_in_the_engine_was_not_told_of_is_never_cached() -> None:
    """The h2d fails and the request finishes before the engine asked ``take_recompute``
    (it ended in that very step): it never recomputed the block, which holds what it held
    before. Its finish caches nothing from there: the node stays on host, and a later
    request gets a host hit, not that block. (Before, finish attached the unwritten block
    as the node's device copy: served to the next request as the prefix's KV.)"""
    cm, a, d2h, h2d = _host_hit_setup()
    ack(cm, d2h)
    fail(cm, h2d)
    n = node(cm, a[1])
    finish(cm, "r3")  # (take_recompute not called: valid_blocks still 1)
    assert (n.status, n.dev, n.host) == (HOST, -1, 0)
    assert not cm.device.is_allocated(1)
    assert match(cm, "r4", a) == Match(1, 1, 0, BS)
    cm.abort("r4")
    cm.check_invariants()


def test_a_block_computed_on_a_failed_swap_in_is_never_cached() -> None:
    """The same through ``cache_computed``: x's swap-in of ``a`` fails; y, which computed
    ``a`` itself, puts its copy in the tree at its finish; x, not told yet, reports its
    next block computed (on top of the unwritten ``a``). Nothing of x's is cached. (Before,
    x's block 1 was cached under y's ``a``: a device hit for its prefix, with the KV of
    another.)"""
    cm = make(4, 4)
    a, ax = H(1), H(1, 5)
    cached(cm, "r0", a)
    for i in range(4):  # push a off the device (its host copy stays)
        cached(cm, f"f{i}", H(9, i))
    assert match(cm, "x", ax) == Match(0, 1, 0, BS)
    alloc(cm, "x", 2 * BS)  # a swapped in, a fresh block for ax[1]
    assert match(cm, "y", a).num_cached_tokens == 0  # (a is on its way in)
    alloc(cm, "y", BS)
    [h2d] = [o for o in take(cm) if o.kind == H2D]
    fail(cm, h2d)
    finish(cm, "y")  # y's own a is attached
    assert cm.cache_computed("x", 2 * BS) == 0
    cm.check_invariants()
    assert match(cm, "z", ax).num_device < 2
    cm.abort("z")
    assert cm.take_recompute() == {"x": 0}
    cm.check_invariants()


def test_failed_swap_in_after_the_request_finished_frees_the_block() -> None:
    cm, a, d2h, h2d = _host_hit_setup()
    ack(cm, d2h)
    finish(cm, "r3")
    n = node(cm, a[1])
    assert (n.status, n.ref, n.busy) == (SWAP_TO_DEVICE, 0, 1)
    fail(cm, h2d)
    assert (n.status, n.dev, n.host) == (HOST, -1, 0)
    assert not cm.device.is_allocated(1)
    assert cm.take_recompute() == {}


def test_host_block_of_an_in_flight_h2d_is_not_reused() -> None:
    cm = make(2, 2)
    a, b = H(1), H(2)
    cached(cm, "r1", a)
    cached(cm, "r1b", b)
    assert cached(cm, "r2", H(3, 4)) == [1, 0]   # a -> host 0, b -> host 1
    assert (node(cm, a[0]).host, node(cm, b[0]).host) == (0, 1)
    assert match(cm, "r3", a) == Match(0, 1, 0, BS)
    assert alloc(cm, "r3", 4) == [0]
    d2h, h2d = take(cm)
    # H(3,4)[1] leaves device 0 and needs a host block: b (host LRU) is dropped for it.
    assert shape(d2h) == (D2H, [0], [1], ())
    assert shape(h2d) == (H2D, [0], [0], ())
    assert status(cm, b[0]) is None
    finish(cm, "r3")  # nobody holds a now; only the in-flight h2d pins host 0
    assert (node(cm, a[0]).ref, node(cm, a[0]).busy) == (0, 1)
    # The host pool is now full: host 0 is the h2d source, host 1 the d2h target.
    assert run(cm, "r4", H(7)) == [1]  # H(3) leaves device 1, but no host block is free
    assert take(cm) == []              # ... so it is dropped rather than taking host 0
    assert status(cm, H(3)[0]) is None
    assert node(cm, a[0]).host == 0 and cm.host.is_allocated(0)
    assert cm.status_counts()["DELETING"] == 1  # H(3,4)[1], its d2h still in flight
    ack(cm, h2d)
    assert (status(cm, a[0]), node(cm, a[0]).host) == (DEVICE, 0)
    ack(cm, d2h)  # the deleted node's host block comes back now
    assert cm.host.num_used == 1 and cm.status_counts()["DELETING"] == 0


def test_matched_host_block_swapped_in_by_another_request_is_not_shared() -> None:
    """Two requests matched the same host block before either allocated: the first swaps
    it in, the second recomputes it into a block of its own (one owner if the h2d fails)."""
    cm = make(3, 4)
    a = H(1, 2)
    cached(cm, "r1", a)               # a on device 0, 1
    cached(cm, "r2", H(9))            # device 2
    assert cached(cm, "r3", H(8)) == [1]  # a[1] -> host 0
    assert match(cm, "p", a) == Match(1, 1, 0, BS)
    assert match(cm, "q", a) == Match(1, 1, 0, BS)
    assert alloc(cm, "p", 8) == [0, 2]    # H(9) evicted to host 1, a[1] swapped into 2
    assert status(cm, a[1]) is SWAP_TO_DEVICE
    assert cm.num_blocks_needed("q", 8) == 1
    assert alloc(cm, "q", 8) == [0, 1]    # H(8) evicted to host 2; block 1 is q's own
    assert node(cm, a[1]).ref == 1
    ops = take(cm)
    assert [shape(op) for op in ops] == [(D2H, [2, 1], [1, 2], ()), (H2D, [0], [2], ())]
    fail(cm, ops[1])
    assert cm.take_recompute() == {"p": 1}
    ack(cm, ops[0])
    finish(cm, "q")
    assert (status(cm, a[1]), node(cm, a[1]).dev) == (DEVICE, 1)  # q computed it
    finish(cm, "p")  # p's recomputed copy is a duplicate now: freed
    assert cm.device.num_used == 2


# ================================================================ write_through


def test_write_through_backs_up_every_new_block_at_finish() -> None:
    cm = make(4, 4, WRITE_THROUGH)
    a = H(1, 2)
    assert run(cm, "r1", a) == [0, 1]
    assert take(cm) == []
    finish(cm, "r1")
    (op,) = take(cm)
    assert shape(op) == (BACKUP, [0, 1], [0, 1], ())
    n0, n1 = node(cm, a[0]), node(cm, a[1])
    assert (n1.status, n1.host, n1.host_ok, n1.busy) == (DEVICE, 1, False, 1)
    assert cm.tree.num_dlru == 0  # in flight: not evictable
    ack(cm, op)
    assert (n0.host_ok, n1.host_ok) == (True, True)
    assert cm.stats.backed_up == 2
    # A request that reuses a and adds one block backs up only the new one.
    b = H(1, 2, 3)
    assert match(cm, "r2", b) == Match(2, 0, 0, BS)
    assert alloc(cm, "r2", 12) == [0, 1, 2]
    finish(cm, "r2")
    (op,) = take(cm)
    assert shape(op) == (BACKUP, [2], [2], ())
    ack(cm, op)
    # Eviction of a backed-up block is metadata only.
    assert run(cm, "r3", H(9, 10)) == [2, 3]
    assert take(cm) == []
    assert (status(cm, b[2]), node(cm, b[2]).host) == (HOST, 2)
    assert (cm.stats.evicted_device, cm.stats.swapped_out) == (1, 0)


def test_write_through_failed_backup_frees_the_host_block() -> None:
    cm = make(4, 4, WRITE_THROUGH)
    a = H(1, 2)
    run(cm, "r1", a)
    finish(cm, "r1")
    (op,) = take(cm)
    fail(cm, op, done=1)
    assert (node(cm, a[0]).host, node(cm, a[0]).host_ok) == (0, True)
    assert (node(cm, a[1]).host, node(cm, a[1]).host_ok) == (-1, False)
    assert cm.host.num_used == 1
    assert [status(cm, h) for h in a] == [DEVICE, DEVICE]


def test_write_through_with_fewer_free_host_blocks_backs_up_the_first_blocks() -> None:
    """One host block for a two-block node: its first block is backed up (the node split
    there), and survives the device's eviction on host; the rest is dropped."""
    cm = make(4, 1, WRITE_THROUGH)
    a = H(1, 2)
    assert run(cm, "r1", a) == [0, 1]
    finish(cm, "r1")
    (op,) = take(cm)
    assert shape(op) == (BACKUP, [0], [0], ())
    assert node(cm, a[0]).node is not node(cm, a[1]).node
    ack(cm, op)
    assert [(node(cm, h).host, node(cm, h).host_ok) for h in a] == [(0, True), (-1, False)]
    assert cm.stats.backed_up == 1
    assert run(cm, "r2", H(3, 4, 5, 6)) == [0, 1, 2, 3]
    assert take(cm) == []  # a[0] has its copy (metadata only), a[1] is dropped
    assert (status(cm, a[0]), node(cm, a[0]).host, status(cm, a[1])) == (HOST, 0, None)


def test_write_through_selective_backs_up_on_the_second_use() -> None:
    cm = make(4, 4, WRITE_THROUGH_SELECTIVE, threshold=2)
    a = H(1, 2)
    cached(cm, "r1", a)
    assert take(cm) == []
    assert (node(cm, a[0]).hits, node(cm, a[0]).host) == (1, -1)
    b = H(1, 2, 3)
    assert match(cm, "r2", b) == Match(2, 0, 0, BS)
    assert alloc(cm, "r2", 12) == [0, 1, 2]
    finish(cm, "r2")
    (op,) = take(cm)
    assert shape(op) == (BACKUP, [0, 1], [0, 1], ())  # not b[2]: first use
    ack(cm, op)
    assert node(cm, b[2]).host == -1


def test_write_through_selective_drops_an_unbacked_block_with_its_host_subtree() -> None:
    cm = make(2, 2, WRITE_THROUGH_SELECTIVE, threshold=2)
    p, c = H(1, 2)
    cached(cm, "r1", [p, c])
    match(cm, "r2", [p, c])
    alloc(cm, "r2", 8)
    finish(cm, "r2")
    (op,) = take(cm)
    assert shape(op) == (BACKUP, [0, 1], [0, 1], ())
    ack(cm, op)
    assert run(cm, "r3", H(5)) == [1]        # c leaves device: metadata only
    assert take(cm) == []
    assert (status(cm, c), node(cm, c).host) == (HOST, 1)
    finish(cm, "r3")
    assert match(cm, "r4", H(5)) == Match(1, 0, 0, BS)
    alloc(cm, "r4", 4)
    finish(cm, "r4")                          # second use of H(5): backup, host is full
    (op,) = take(cm)
    assert shape(op) == (BACKUP, [1], [0], ())  # p's host copy (host LRU oldest) is taken
    assert (status(cm, p), node(cm, p).host, node(cm, p).host_ok) == (DEVICE, -1, False)
    ack(cm, op)
    # p has no backup now: evicting it drops p and its host-only child c.
    assert run(cm, "r5", H(7)) == [0]
    assert take(cm) == []
    assert (status(cm, p), status(cm, c)) == (None, None)
    assert (cm.host.num_used, cm.host.is_allocated(1)) == (1, False)
    assert status(cm, H(5)[0]) is DEVICE


# ================================================================ storage


def test_storage_prefetch_partial_load_and_negative_cache() -> None:
    h = H(1, 2, 3, 4)
    store = Store(h[0], h[1], h[2])
    cm = make(4, 4, store=store, storage_write=True)
    assert match(cm, "r1", h) == Match(0, 0, 3, BS)
    assert cm.prefetch("r1") == 3
    assert not cm.prefetch_done("r1")
    (op,) = take(cm)
    assert shape(op) == (S2H, [], [0, 1, 2], (h[0], h[1], h[2]))
    assert [status(cm, x) for x in h] == [LOADING_FROM_STORAGE] * 3 + [None]
    assert cm.prefetch("r1") == 0  # already loading
    fail(cm, op, done=2)           # h[2] never arrived
    assert cm.prefetch_done("r1")
    assert [status(cm, x) for x in h] == [HOST, HOST, None, None]
    assert [node(cm, x).host for x in h[:2]] == [0, 1]
    assert cm.host.num_used == 2
    assert take(cm) == []  # loaded from storage: no h2s back
    assert (cm.stats.loaded, cm.stats.failed_blocks) == (2, 1)
    # Storage said it has h[2] but failed: a new match does not count it while cached.
    queries = len(store.queries)
    assert match(cm, "r2", h) == Match(0, 2, 0, BS)
    assert len(store.queries) == queries  # nothing left to ask
    cm.abort("r2")
    # The loaded blocks are swapped in at allocate.
    assert alloc(cm, "r1", 16) == [0, 1, 2, 3]
    (op,) = take(cm)
    assert shape(op) == (H2D, [0, 1], [0, 1], ())
    assert [status(cm, x) for x in h[:2]] == [SWAP_TO_DEVICE] * 2
    ack(cm, op)
    finish(cm, "r1")
    assert [status(cm, x) for x in h] == [DEVICE] * 4
    assert [node(cm, x).dev for x in h] == [0, 1, 2, 3]


def test_negative_cache_expires() -> None:
    h = H(1, 2, 3)
    store = Store(*h)
    cm = make(4, 4, store=store, negative_cache_s=0.0)
    match(cm, "r1", h)
    assert cm.prefetch("r1") == 3
    (op,) = take(cm)
    fail(cm, op, done=1)
    assert [status(cm, x) for x in h] == [HOST, None, None]
    assert match(cm, "r2", h) == Match(0, 1, 2, BS)  # expired at once: asked again
    assert store.queries[-1] == h[1:]


def test_negative_cache_forgets_expired_hashes_while_the_store_stays_flaky() -> None:
    """A store that says it has every block and fails every read: each failed hash is
    refused for the TTL and then let go, whether or not a lookup meets it again (the
    cache holds a TTL's worth of failures, not every failure since the start)."""
    now = [1000.0]
    prompts = [H(i, 1, 2, 3) for i in range(10)]
    cm = make(0, 8, WRITE_THROUGH, store=Store(*H(99), *(h for p in prompts for h in p)),
              negative_cache_s=5.0)
    cm.core.monotonic = lambda: now[0]
    for i, p in enumerate(prompts):  # one failure a second
        now[0] = 1000.0 + i
        assert match(cm, f"r{i}", p) == Match(0, 0, 4, BS)
        assert cm.prefetch(f"r{i}") == 4
        (op,) = take(cm)
        fail(cm, op)
        finish(cm, f"r{i}")
    assert len(cm.core.negative) == 5 * 4  # failed at 1005 .. 1009: refused until 1010 ..
    assert match(cm, "a", prompts[5]) == Match(0, 0, 0, BS)
    cm.abort("a")
    now[0] = 1010.0  # the one of 1005 expired
    assert match(cm, "b", prompts[5]) == Match(0, 0, 4, BS)
    cm.abort("b")
    assert match(cm, "c", prompts[6]) == Match(0, 0, 0, BS)
    cm.abort("c")
    assert len(cm.core.negative) == 4 * 4
    now[0] = 1014.0  # every one expired: a lookup of another prompt finds it empty
    assert match(cm, "d", H(99)) == Match(0, 0, 1, BS)
    assert len(cm.core.negative) == 0


def test_negative_cache_moves_a_hash_that_failed_again_to_the_end() -> None:
    """Kept in expiry order: a hash that fails again before it expired is refused until
    its new expiry, and does not hold back the trim of those that expired before."""
    a, b, c = H(1, 2, 3)
    neg = NegativeCache()
    neg.add([a, b], 0.0, 5.0)
    neg.add([c], 1.0, 5.0)
    neg.add([a], 2.0, 5.0)
    assert neg.prefix([b, c], 5.5) == [b]  # b expired at 5, c refused until 6, a until 7
    neg.trim(6.0)
    assert len(neg) == 1 and neg.prefix([c, a], 6.0) == [c]
    assert neg.prefix([c, a], 7.0) == [c, a] and len(neg) == 0


def test_a_block_written_to_the_store_after_a_failed_load_is_found_there_again() -> None:
    """A failed load refuses its hashes for negative_cache_s; the request recomputes the
    blocks and writes them to the store, which has them now: no false miss after that."""
    h = H(1, 2)
    store = Store(*h)
    cm = make(2, 2, WRITE_THROUGH, store=store, storage_write=True)
    assert match(cm, "r1", h) == Match(0, 0, 2, BS)
    assert cm.prefetch("r1") == 2
    (op,) = take(cm)
    fail(cm, op)
    assert len(cm.core.negative) == 2
    assert alloc(cm, "r1", 8) == [0, 1]
    finish(cm, "r1")
    kinds = []
    while ops := take(cm):  # the backup to host, then the write to the store
        kinds += [o.kind for o in ops]
        ack(cm, *ops)
    assert kinds == [BACKUP, H2S] and all(node(cm, x).in_store for x in h)
    assert len(cm.core.negative) == 0
    cached(cm, "r2", H(5, 6))  # takes both tiers: h leaves the tree (it is in the store)
    assert [status(cm, x) for x in h] == [None, None]
    assert match(cm, "r3", h) == Match(0, 0, 2, BS)


def test_prefetch_is_bounded_by_host_space() -> None:
    h = H(1, 2, 3)
    cm = make(4, 2, store=Store(*h))
    assert match(cm, "r1", h) == Match(0, 0, 3, BS)
    assert cm.prefetch("r1") == 2
    (op,) = take(cm)
    assert shape(op) == (S2H, [], [0, 1], (h[0], h[1]))
    ack(cm, op)
    assert [status(cm, x) for x in h] == [HOST, HOST, None]
    assert alloc(cm, "r1", 12) == [0, 1, 2]
    (op,) = take(cm)
    assert shape(op) == (H2D, [0, 1], [0, 1], ())


def test_allocate_before_the_load_arrives_recomputes_and_keeps_the_load() -> None:
    """best_effort: the request allocates while s2h is in flight; the load still lands in
    the host tier, and finish attaches the recomputed device blocks to it."""
    h = H(1, 2)
    cm = make(4, 4, store=Store(*h))
    match(cm, "r1", h)
    assert cm.prefetch("r1") == 2
    (s2h,) = take(cm)
    assert alloc(cm, "r1", 8) == [0, 1]
    assert take(cm) == []
    assert cm.prefetch_done("r1")  # nothing of r1 is waiting for it any more
    assert [status(cm, x) for x in h] == [LOADING_FROM_STORAGE] * 2
    ack(cm, s2h)
    assert [status(cm, x) for x in h] == [HOST, HOST]
    finish(cm, "r1")
    assert [(status(cm, x), node(cm, x).dev, node(cm, x).host) for x in h] == [
        (DEVICE, 0, 0), (DEVICE, 1, 1)]


def test_failed_load_after_allocate_is_removed() -> None:
    h = H(1, 2)
    cm = make(4, 4, store=Store(*h))
    match(cm, "r1", h)
    cm.prefetch("r1")
    (s2h,) = take(cm)
    alloc(cm, "r1", 8)
    fail(cm, s2h)
    assert [status(cm, x) for x in h] == [None, None]
    assert cm.host.num_used == 0
    finish(cm, "r1")
    assert [status(cm, x) for x in h] == [DEVICE, DEVICE]


def test_storage_write_after_the_host_copy_commits_and_pins_the_host_block() -> None:
    cm = make(1, 1, storage_write=True)
    a = H(1)
    cached(cm, "r1", a)
    assert run(cm, "r2", H(2)) == [0]
    (d2h,) = take(cm)
    assert shape(d2h) == (D2H, [0], [0], ())
    ack(cm, d2h)
    (h2s,) = take(cm)
    assert shape(h2s) == (H2S, [0], [], (a[0],))
    n = node(cm, a[0])
    assert (n.status, n.busy, n.in_store) == (HOST, 1, False)
    finish(cm, "r2")
    assert run(cm, "r3", H(3)) == [0]  # host 0 is the h2s source: H(2) is dropped instead
    assert take(cm) == []
    assert status(cm, H(2)[0]) is None
    assert (n.status, n.host) == (HOST, 0)
    ack(cm, h2s)
    assert (n.in_store, n.busy, cm.stats.stored) == (True, 0, 1)
    finish(cm, "r3")
    assert run(cm, "r4", H(4)) == [0]  # now host 0 may go: a is dropped, H(3) written back
    (d2h,) = take(cm)
    assert shape(d2h) == (D2H, [0], [0], ())
    assert status(cm, a[0]) is None


def test_a_block_backed_up_again_is_not_written_to_the_store_again() -> None:
    """A stored block lost its host backup to host pressure and is backed up again: the
    store has it already, so the new backup brings no second storage write."""
    cm = make(2, 1, WRITE_THROUGH, storage_write=True)
    a = H(1)
    for rid, h, dev in (("r1", a, 0), ("r2", H(2), 1)):
        assert run(cm, rid, h) == [dev]
        finish(cm, rid)
        (backup,) = take(cm)
        assert shape(backup) == (BACKUP, [dev], [0], ())  # r2's takes a's host block
        ack(cm, backup)
        (h2s,) = take(cm)
        assert shape(h2s) == (H2S, [0], [], tuple(h))
        ack(cm, h2s)
    n = node(cm, a[0])
    assert (n.status, n.host, n.host_ok, n.in_store) == (DEVICE, -1, False, True)
    assert run(cm, "r3", a) == [0]
    finish(cm, "r3")
    (backup,) = take(cm)
    assert shape(backup) == (BACKUP, [0], [0], ())
    ack(cm, backup)
    assert take(cm) == []
    assert (n.host_ok, n.in_store, cm.stats.stored) == (True, True, 2)


def _written_through_pending(cm: CacheManager, rid: str, hashes: list[bytes]) -> Op:
    """``rid`` computed ``hashes`` and finished under write_through with L3 writes; its
    backup acked, its h2s taken and left in flight (a slow store): that op."""
    assert run(cm, rid, hashes) is not None
    finish(cm, rid)
    (backup,) = take(cm)
    assert backup.kind == BACKUP
    ack(cm, backup)
    (h2s,) = take(cm)
    assert shape(h2s)[0] == H2S and h2s.keys == tuple(hashes)
    return h2s


@pytest.mark.parametrize("blocks_wanted", [2, 1])  # the whole victim, or a part of it
def test_an_l3_write_in_flight_leaves_the_device_copy_evictable(blocks_wanted: int) -> None:
    """Under write_through with L3 writes, a finished request's blocks wait on device while
    their host copy is written to the store (h2s reads the host blocks only). Before, the
    op made the node busy and off the device list: with a slow store, the device filled
    with such nodes and no request fitted (``allocate`` None) until the writes came back.
    Now the device copy goes (the node is HOST, its host copy still being written); a
    victim cut to fewer blocks comes whole, as a busy node is never split at its tail,
    and the blocks it does not need go back to the pool. The write commits after."""
    cm = make(2, 4, WRITE_THROUGH, storage_write=True)
    a = H(1, 2)
    h2s = _written_through_pending(cm, "a", a)
    n = node(cm, a[1])
    assert (n.status, n.host_ok, n.in_store) == (DEVICE, True, False)
    assert run(cm, "b", H(7, 8)[:blocks_wanted]) is not None, "the L3 write pinned the device"
    assert [status(cm, h) for h in a] == [HOST, HOST]
    assert cm.device.num_free == 2 - blocks_wanted
    assert cm.stats.evicted_device == 2
    ack(cm, h2s)
    assert [node(cm, h).in_store for h in a] == [True, True]
    m = match(cm, "a2", a)  # the host copy, written and intact, is a host hit
    assert (m.num_device, m.num_host) == (0, 2)


def test_a_failed_l3_write_of_an_evicted_device_copy_is_written_again() -> None:
    """The same, and the write fails: the node (HOST now) waits for its retry as any
    host copy whose write failed."""
    cm = CacheManager(CacheConfig(2, 4, BS, WRITE_THROUGH, storage_write=True,
                                  store_retry_s=1e-9, store_retry_max_s=1e-9))
    a = H(1, 2)
    h2s = _written_through_pending(cm, "a", a)
    assert run(cm, "b", H(7, 8)) is not None
    fail(cm, h2s)
    (again,) = take(cm)
    assert shape(again)[0] == H2S and again.keys == tuple(a)
    ack(cm, again)
    assert [node(cm, h).in_store for h in a] == [True, True]


def test_a_stored_node_split_by_a_match_is_stored_in_both_pieces() -> None:
    """A match that ends inside a stored node splits it: the piece put above is as
    stored as the rest (else it is written again once it leaves the device later)."""
    cm = make(2, 4, storage_write=True)
    a = H(1, 2)
    cached(cm, "r1", a)
    assert run(cm, "r2", H(3, 4)) == [0, 1]
    (d2h,) = take(cm)
    ack(cm, d2h)
    finish(cm, "r2")
    (h2s,) = take(cm)
    assert shape(h2s) == (H2S, [0, 1], [], tuple(a))
    ack(cm, h2s)
    assert match(cm, "r3", a[:1]) == Match(0, 1, 0, BS)
    cm.abort("r3")
    cm.check_invariants()
    assert node(cm, a[0]).node is not node(cm, a[1]).node
    assert [(status(cm, h), node(cm, h).in_store) for h in a] == [(HOST, True), (HOST, True)]
    assert take(cm) == [] and cm.stats.stored == 2


# ================================================================ failures and lifecycle


def test_fail_pending_rolls_back_everything_in_flight() -> None:
    s = H(5, 6)
    store = Store(s[0])
    cm, a, *_ = _host_hit_setup_with_store(store)
    assert match(cm, "r4", s) == Match(0, 0, 1, BS)
    assert cm.prefetch("r4") == 1
    ops = take(cm)
    assert [shape(op) for op in ops] == [(S2H, [], [2], (s[0],))]
    assert cm.num_pending_ops == 3
    pending_ids = sorted(cm.ledger.pending)
    cm.fail_pending()
    cm.check_invariants()
    assert cm.num_pending_ops == 0
    assert status(cm, H(9)[0]) is None  # d2h failed: dropped
    assert (status(cm, a[1]), node(cm, a[1]).host) == (HOST, 0)  # h2d failed: back to HOST
    assert cm.take_recompute() == {"r3": 1}
    assert status(cm, s[0]) is None  # s2h failed: removed
    assert cm.prefetch_done("r4")
    assert cm.host.num_used == 1
    assert cm.stats.failed_ops == 3
    # Late acks of the aborted ops are unknown now and change nothing.
    late = [OpResult(i, True, 1) for i in pending_ids]
    assert cm.on_ops_done(late) == pending_ids
    cm.check_invariants()
    assert match(cm, "r5", s) == Match(0, 0, 0, BS)  # negative-cached


def _host_hit_setup_with_store(store: Store) -> tuple[CacheManager, list[bytes], Op, Op]:
    cm = make(2, 4, store=store)
    a = H(1, 2)
    cached(cm, "r1", a)
    cached(cm, "r2", H(9))
    match(cm, "r3", a)
    alloc(cm, "r3", 8)
    d2h, h2d = take(cm)
    assert shape(d2h) == (D2H, [1], [1], ())
    assert shape(h2d) == (H2D, [0], [1], ())
    return cm, a, d2h, h2d


def test_reset_frees_idle_blocks_at_once() -> None:
    cm = make(4, 4)
    cached(cm, "r1", H(1, 2))
    cached(cm, "r2", H(3, 4, 5))  # H(1,2)[1] -> host 0
    assert cm.host.num_used == 1
    cm.reset()
    cm.check_invariants()
    assert (len(cm.tree.index), cm.device.num_used, cm.host.num_used) == (0, 0, 0)
    assert match(cm, "r3", H(1, 2)) == Match(0, 0, 0, BS)


def test_reset_with_ops_in_flight_frees_blocks_on_ack() -> None:
    cm = make(4, 4, WRITE_THROUGH)
    cached(cm, "r1", H(1, 2))  # its backup is taken and acked inside
    run(cm, "r2", H(7, 8))
    finish(cm, "r2")
    (backup,) = take(cm)
    assert shape(backup) == (BACKUP, [2, 3], [2, 3], ())
    cm.reset()
    cm.check_invariants()
    assert len(cm.tree.index) == 0
    assert cm.status_counts()["DELETING"] == 2
    assert (cm.device.num_used, cm.host.num_used) == (2, 2)  # still read by the backup
    assert ack(cm, backup) == []
    assert cm.status_counts()["DELETING"] == 0
    assert (cm.device.num_used, cm.host.num_used) == (0, 0)


def test_reset_of_a_node_with_two_ops_in_flight_frees_it_after_the_last() -> None:
    """A host block being written to the store (h2s) and swapped in (h2d) at once: reset
    makes it DELETING, and its blocks stay allocated until both ops are acked (freed at
    the first ack, a worker still copies through them while the pools hand them out)."""
    cm = make(1, 4, storage_write=True)
    a = H(1)
    cached(cm, "r1", a)
    assert run(cm, "r2", H(2)) == [0]
    (d2h,) = take(cm)
    ack(cm, d2h)
    finish(cm, "r2")
    (h2s,) = take(cm)
    assert shape(h2s) == (H2S, [0], [], tuple(a))
    match(cm, "r3", a)
    assert alloc(cm, "r3", 4) == [0]
    d2h, h2d = take(cm)
    assert shape(h2d) == (H2D, [0], [0], ())
    finish(cm, "r3")
    ack(cm, d2h)
    (h2s_b,) = take(cm)  # H(2)'s write
    assert (node(cm, a[0]).status, node(cm, a[0]).busy) == (SWAP_TO_DEVICE, 2)
    cm.reset()
    cm.check_invariants()
    assert (cm.device.num_used, cm.host.num_used) == (1, 2)
    ack(cm, h2s)
    assert cm.status_counts()["DELETING"] == 2
    assert (cm.device.num_used, cm.host.num_used) == (1, 2)  # the h2d still runs
    assert cm.device.is_allocated(0) and cm.host.is_allocated(0)
    ack(cm, h2d)
    assert (cm.device.num_used, cm.host.num_used) == (0, 1)
    ack(cm, h2s_b)
    assert (cm.device.num_used, cm.host.num_used) == (0, 0)
    assert cm.status_counts()["DELETING"] == 0


def test_reset_with_a_d2h_in_flight() -> None:
    cm = make(1, 2)
    cached(cm, "r1", H(1))
    run(cm, "r2", H(2))
    (d2h,) = take(cm)
    finish(cm, "r2")
    cm.reset()
    cm.check_invariants()
    assert (cm.device.num_used, cm.host.num_used) == (0, 1)
    fail(cm, d2h)  # rollback of a deleted node: nothing to drop, block freed
    assert (cm.device.num_used, cm.host.num_used) == (0, 0)
    assert cm.status_counts()["DELETING"] == 0


def test_reset_discards_ops_never_taken() -> None:
    cm = make(4, 4, WRITE_THROUGH)
    run(cm, "r1", H(1, 2))
    finish(cm, "r1")  # a backup op is open, not taken
    cm.reset()
    cm.check_invariants()
    assert take(cm) == []
    assert (cm.device.num_used, cm.host.num_used, cm.num_pending_ops) == (0, 0, 0)


def test_reset_refused_with_running_requests() -> None:
    cm = make(4)
    cached(cm, "r1", H(1))
    run(cm, "r2", H(2))
    with pytest.raises(ValueError):
        cm.reset()
    cm.check_invariants()
    assert status(cm, H(1)[0]) is DEVICE
    assert cm.block_table("r2") == [1]
    match(cm, "r3", H(3))  # matched only, not allocated: still running
    finish(cm, "r2")
    with pytest.raises(ValueError):
        cm.reset()
    cm.abort("r3")
    cm.reset()
    cm.check_invariants()


def test_resize_grow_and_refused_shrink() -> None:
    cm = make(2, 2)
    assert cm.resize(num_device_blocks=4, num_host_blocks=3) is True
    assert (cm.device.num_blocks, cm.host.num_blocks) == (4, 3)
    cm.check_invariants()
    assert run(cm, "r1", H(1, 2, 3, 4)) == [0, 1, 2, 3]
    assert cm.resize(num_device_blocks=2) is False
    assert cm.device.num_blocks == 4
    finish(cm, "r1")
    assert cm.resize(num_device_blocks=2) is False  # cached in the tree
    cm.reset()
    assert cm.resize(num_device_blocks=2, num_host_blocks=1) is True
    assert (cm.device.num_blocks, cm.host.num_blocks) == (2, 1)
    cm.check_invariants()
    assert cached(cm, "r2", H(5, 6)) == [0, 1]


def test_refused_resize_changes_nothing() -> None:
    """A False from resize means the pools are as they were (as BlockPool.resize promises),
    even when one of the two pools could have been resized."""
    cm = make(4, 4)
    cached(cm, "r1", H(1, 2, 3, 4))
    cached(cm, "r2", H(5))  # H(1,2,3,4)[3] -> host 0: host block 0 in use, ids 1..3 free
    assert cm.host.num_used == 1
    assert cm.resize(num_device_blocks=8, num_host_blocks=0) is False
    assert (cm.device.num_blocks, cm.host.num_blocks) == (4, 4)


# ================================================================ stats and acks


def test_stats_counters_in_a_small_scenario() -> None:
    cm = make(2, 2)
    a = H(1, 2)
    cached(cm, "r1", a)
    assert match(cm, "r2", a) == Match(2, 0, 0, BS)
    alloc(cm, "r2", 8)
    finish(cm, "r2")
    cached(cm, "r3", H(3))  # a[1] written back to host
    assert match(cm, "r4", a) == Match(1, 1, 0, BS)
    cm.abort("r4")
    s = cm.stats
    assert (s.match_queries, s.match_blocks) == (4, 7)
    assert (s.hit_device, s.hit_host, s.hit_storage) == (2, 0, 0)  # r4 never ran: not counted
    assert s.hit_requests == 3
    assert (s.evicted_device, s.evicted_host, s.dropped) == (1, 0, 0)
    assert (s.swapped_out, s.swapped_in, s.backed_up, s.loaded, s.stored) == (1, 0, 0, 0, 0)
    assert (s.failed_ops, s.failed_blocks) == (0, 0)
    snap = cm.snapshot()
    assert snap["hit_device"] == 2 and snap["hit_host"] == 0 and snap["evicted_device"] == 1
    assert (snap["free_device"], snap["free_host"], snap["pending_ops"]) == (0, 1, 0)
    assert snap["nodes"] == {"DEVICE": 2, "HOST": 1, "SWAP_TO_HOST": 0, "SWAP_TO_DEVICE": 0,
                             "LOADING_FROM_STORAGE": 0, "DELETING": 0}


def test_unknown_op_ids_are_returned_and_ignored() -> None:
    cm = make(1, 1)
    cached(cm, "r1", H(1))
    run(cm, "r2", H(2))
    (d2h,) = take(cm)
    assert cm.on_ops_done([OpResult(999, True, 1)]) == [999]
    cm.check_invariants()
    assert status(cm, H(1)[0]) is SWAP_TO_HOST
    assert cm.on_ops_done([OpResult(998, False, 0, "x"), OpResult(d2h.id, True, 1)]) == [998]
    cm.check_invariants()
    assert status(cm, H(1)[0]) is HOST
    assert cm.on_ops_done([OpResult(d2h.id, False, 0, "dup")]) == [d2h.id]  # acked already
    cm.check_invariants()
    assert status(cm, H(1)[0]) is HOST
    assert cm.stats.failed_ops == 0


def test_ops_come_one_per_kind_in_worker_order_with_fresh_ids() -> None:
    cm, _, d2h, h2d = _host_hit_setup()
    assert d2h.id < h2d.id
    assert take(cm) == []
    ack(cm, d2h, h2d)
    finish(cm, "r3")
    assert run(cm, "r4", H(40, 41)) == [0, 1]
    (op,) = take(cm)  # a[1] has its host copy (metadata only); a[0] is written back
    assert shape(op) == (D2H, [0], [2], ())
    assert op.id > h2d.id


def test_a_d2h_opened_after_the_steps_h2d_still_runs_first() -> None:
    """The step's first swap-in needs no eviction (its h2d op opens first); the second
    evicts device block 0 and swaps into it: the worker must copy block 0 out (d2h)
    before the h2d overwrites it, whatever order the ops were opened in."""
    cm = make(2, 4)
    assert (cached(cm, "r1", H(1)), cached(cm, "r2", H(2)), cached(cm, "r3", H(3))) == (
        [0], [1], [0])
    assert run(cm, "r4", H(4)) == [1]  # H(2) -> host 1
    ack(cm, *take(cm))
    finish(cm, "r4", 0)  # nothing computed: device block 1 is free again
    assert [(status(cm, H(i)[0]), node(cm, H(i)[0]).host) for i in (1, 2)] == [
        (HOST, 0), (HOST, 1)]
    match(cm, "p", H(1))
    match(cm, "q", H(2))
    assert alloc(cm, "p", 4) == [1]  # a free block: no eviction
    assert alloc(cm, "q", 4) == [0]  # H(3) leaves device 0 (d2h), H(2) comes into it
    ops = take(cm)
    assert [shape(op) for op in ops] == [(D2H, [0], [2], ()), (H2D, [0, 1], [1, 0], ())]
    ack(cm, *ops)
    finish(cm, "p")
    finish(cm, "q")
    assert [(status(cm, H(i)[0]), node(cm, H(i)[0]).dev) for i in (1, 2, 3)] == [
        (DEVICE, 1), (DEVICE, 0), (HOST, -1)]


# ================================================================ tree order


def test_lru_eviction_takes_children_before_parents() -> None:
    cm = make(5, 8)
    a = H(1, 2, 3)
    b = H(1, 2, 4, 5)
    cached(cm, "r1", a)
    cached(cm, "r2", b)  # touches a[0], a[1] again after a[2]
    order = []
    for i in range(5):
        assert run(cm, f"x{i}", H(100 + i)) is not None  # running: holds its block
        (op,) = take(cm)
        assert op.kind == D2H and len(op.src) == 1
        gone = [h for h in (a[2], b[3], b[2], a[1], a[0]) if status(cm, h) is SWAP_TO_HOST]
        order.extend(gone)
        ack(cm, op)
        for path in (a, b):  # no device block under a host-only parent
            sts = [status(cm, h) for h in path]
            assert sts == sorted(sts, key=lambda s: s is HOST), sts
    assert order == [a[2], b[3], b[2], a[1], a[0]]
    assert all(status(cm, h) is HOST for h in a + b)


def test_parent_with_a_child_in_flight_is_not_evicted() -> None:
    cm, a, d2h, h2d = _host_hit_setup()
    ack(cm, d2h)
    finish(cm, "r3")  # a[0] idle on device, its child a[1] still swapping in
    assert cm.tree.num_dlru == 0  # a[0] is not evictable before its child is
    assert run(cm, "r4", H(7)) is None  # nothing evictable: refuse
    assert status(cm, a[0]) is DEVICE
    ack(cm, h2d)  # a[1] settles, then a[0] becomes evictable after it
    assert cm.tree.dlru_nodes() == [cm.tree.index[a[1]], cm.tree.index[a[0]]]
    assert alloc(cm, "r4", 4) == [1]
    assert [status(cm, h) for h in a] == [DEVICE, HOST]
    assert take(cm) == []  # a[1] had its host copy: metadata only


def test_host_lru_drops_a_child_before_its_parent() -> None:
    cm = make(2, 2)
    p, c = H(1, 2)
    cached(cm, "r1", [p, c])
    assert run(cm, "x", H(9)) == [1]  # c leaves first
    (op_c,) = take(cm)
    assert run(cm, "y", H(8)) == [0]  # then p
    (op_p,) = take(cm)
    assert shape(op_c) == (D2H, [1], [0], ())
    assert shape(op_p) == (D2H, [0], [1], ())
    ack(cm, op_p)  # acks out of order: p is host-only before its child is
    assert cm.tree.hlru_nodes() == []  # p waits for c
    ack(cm, op_c)
    assert [status(cm, h) for h in (p, c)] == [HOST, HOST]
    assert cm.tree.hlru_nodes() == [cm.tree.index[c], cm.tree.index[p]]
    finish(cm, "x")
    assert run(cm, "z", H(7)) == [1]  # H(9) needs a host block: c goes, not p
    (op,) = take(cm)
    assert shape(op) == (D2H, [1], [0], ())
    assert (status(cm, p), status(cm, c)) == (HOST, None)
    assert cm.tree.hpol.probes == cm.stats.evicted_host == 1  # one look per victim


# ================================================================ more edges


def lru_order_ok(nodes: list[Node]) -> bool:
    """Every node sits nearer the old end than each of its ancestors on the same list."""
    pos = {id(n): i for i, n in enumerate(nodes)}
    for n in nodes:
        p = n.parent
        while p is not None:
            if id(p) in pos and pos[id(p)] < pos[id(n)]:
                return False
            p = p.parent
    return True


def test_partial_swap_in_commits_the_first_k() -> None:
    cm = make(2, 4)
    a = H(1, 2)
    cached(cm, "r1", a)
    assert cached(cm, "r2", H(9, 8)) == [0, 1]  # a[0] -> host 0, a[1] -> host 1
    assert match(cm, "r3", a) == Match(0, 2, 0, BS)
    assert alloc(cm, "r3", 8) == [0, 1]
    d2h, h2d = take(cm)
    assert shape(d2h) == (D2H, [0, 1], [2, 3], ())
    assert shape(h2d) == (H2D, [0, 1], [0, 1], ())
    ack(cm, d2h)
    fail(cm, h2d, done=1)
    assert [(status(cm, h), node(cm, h).dev) for h in a] == [(DEVICE, 0), (HOST, -1)]
    assert cm.take_recompute() == {"r3": 1}
    finish(cm, "r3")
    assert [(status(cm, h), node(cm, h).dev, node(cm, h).host) for h in a] == [
        (DEVICE, 0, 0), (DEVICE, 1, 1)]


def test_failed_swap_in_of_two_nodes_recomputes_from_the_first() -> None:
    """One h2d over two held HOST nodes fails whole: the engine recomputes from the first
    failed block (the lowest depth), not from the second node's."""
    cm = make(2, 4)
    a = H(1, 2)
    cached(cm, "r1", a[:1])
    assert cached(cm, "r2", a) == [0, 1]        # a[1] a node of its own, under a[0]
    assert node(cm, a[0]).node is not node(cm, a[1]).node
    assert cached(cm, "r3", H(9, 8)) == [0, 1]  # a[1] -> host 0, a[0] -> host 1
    assert match(cm, "r4", a) == Match(0, 2, 0, BS)
    assert alloc(cm, "r4", 8) == [0, 1]
    d2h, h2d = take(cm)
    assert shape(h2d) == (H2D, [1, 0], [0, 1], ())
    ack(cm, d2h)
    fail(cm, h2d)
    assert [(status(cm, h), node(cm, h).dev) for h in a] == [(HOST, -1), (HOST, -1)]
    assert cm.take_recompute() == {"r4": 0}
    assert cm.block_table("r4") == [0, 1]
    finish(cm, "r4")  # both recomputed blocks are attached again
    assert [(status(cm, h), node(cm, h).dev, node(cm, h).host) for h in a] == [
        (DEVICE, 0, 1), (DEVICE, 1, 0)]


def test_finish_with_extended_hashes_caches_decode_blocks() -> None:
    cm = make(4)
    prompt = H(1)
    match(cm, "r1", prompt)
    assert alloc(cm, "r1", 6) == [0, 1]   # prompt of 4 tokens + decode
    assert alloc(cm, "r1", 9) == [0, 1, 2]
    full = H(1, 2, 3)
    cm.finish("r1", num_computed_tokens=9, block_hashes=full)  # blocks 0, 1 are full
    cm.check_invariants()
    assert [status(cm, h) for h in full] == [DEVICE, DEVICE, None]
    assert cm.device.num_used == 2


def test_abort_while_loading_keeps_the_load() -> None:
    h = H(1, 2)
    cm = make(4, 4, store=Store(*h))
    match(cm, "r1", h)
    cm.prefetch("r1")
    (s2h,) = take(cm)
    cm.abort("r1")
    cm.check_invariants()
    assert [node(cm, x).ref for x in h] == [0, 0]
    ack(cm, s2h)
    assert [status(cm, x) for x in h] == [HOST, HOST]
    assert match(cm, "r2", h) == Match(0, 2, 0, BS)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_device_blocks": 4, "write_policy": "write_around"},
        {"num_device_blocks": 4, "block_size": 0},
        {"num_device_blocks": -1},
        {"num_device_blocks": 4, "num_host_blocks": -1},
        {"num_device_blocks": 4, "write_through_threshold": 0},
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CacheConfig(**kwargs)  # type: ignore[arg-type]


def test_backup_threshold_per_policy() -> None:
    assert CacheConfig(1, write_policy=WRITE_BACK).backup_threshold is None
    cfg = CacheConfig(1, write_policy=WRITE_THROUGH, write_through_threshold=3)
    assert cfg.backup_threshold == 1
    cfg = CacheConfig(1, write_policy=WRITE_THROUGH_SELECTIVE, write_through_threshold=3)
    assert cfg.backup_threshold == 3


def test_prefetch_again_loads_only_what_storage_reported() -> None:
    """After the first load landed, a second prefetch (e.g. the engine polls it each step)
    must not load keys the existence query never reported (h[2], h[3] here)."""
    h = H(1, 2, 3, 4)
    store = Store(h[0], h[1])
    cm = make(4, 4, store=store)
    assert match(cm, "r1", h) == Match(0, 0, 2, BS)
    assert cm.prefetch("r1") == 2
    (s2h,) = take(cm)
    ack(cm, s2h)
    assert [status(cm, x) for x in h] == [HOST, HOST, None, None]
    assert cm.prefetch("r1") == 0
    assert take(cm) == []
    assert [status(cm, x) for x in h[2:]] == [None, None]


def test_prefetch_again_does_not_reload_a_negative_cached_key() -> None:
    h = H(1, 2, 3)
    cm = make(4, 4, store=Store(*h))
    match(cm, "r1", h)
    assert cm.prefetch("r1") == 3
    (s2h,) = take(cm)
    fail(cm, s2h, done=1)  # h[1], h[2] failed: negative-cached
    assert cm.prefetch("r1") == 0
    assert take(cm) == []


def test_finish_with_fewer_computed_tokens_releases_leaf_first() -> None:
    """Nodes released together go on the device LRU leaf first (radix invariant), so the
    oldest entry is a chain tail and eviction needs no rotation."""
    cm = make(4, 4)
    a = H(1, 2, 3)
    cached(cm, "r1", a)
    match(cm, "r2", a)
    alloc(cm, "r2", 12)
    finish(cm, "r2", num_computed_tokens=4)  # a[1], a[2] released beyond the computed prefix
    assert lru_order_ok(cm.tree.dlru_nodes())
    assert run(cm, "r3", H(9, 8, 7)) is not None  # 1 free block + 2 evictions
    (op,) = take(cm)
    assert shape(op) == (D2H, [1, 2], [0, 1], ())  # the tail run a[1], a[2]
    assert (cm.tree.dpol.probes, cm.stats.evicted_device) == (1, 2)  # one victim run


def test_fail_pending_rolls_back_backups_and_storage_writes() -> None:
    cm = make(4, 4, WRITE_THROUGH, storage_write=True)
    one, two = H(1)[0], H(2)[0]
    assert run(cm, "r1", [one]) == [0]
    finish(cm, "r1")
    (backup,) = take(cm)
    assert shape(backup) == (BACKUP, [0], [0], ())
    ack(cm, backup)
    (h2s,) = take(cm)
    assert shape(h2s) == (H2S, [0], [], (one,))
    assert run(cm, "r2", [two]) == [1]
    finish(cm, "r2")
    (backup,) = take(cm)
    assert shape(backup) == (BACKUP, [1], [1], ())
    cm.fail_pending()
    cm.check_invariants()
    n1, n2 = node(cm, one), node(cm, two)
    assert (n1.host, n1.host_ok, n1.in_store, n1.busy) == (0, True, False, 0)
    assert (n2.host, n2.host_ok, n2.busy) == (-1, False, 0)
    assert (cm.host.num_used, cm.num_pending_ops, cm.stats.failed_ops) == (1, 0, 2)
    assert (cm.stats.backed_up, cm.stats.stored) == (1, 0)


def test_each_prefetching_request_gets_its_own_s2h_op() -> None:
    """An s2h result counts a prefix: one request's missing key must not discard the blocks
    another request loaded in the same step."""
    a, b = H(1, 2), H(7, 8)
    store = Store(*a, *b)
    cm = make(4, 4, store=store)
    assert match(cm, "ra", a) == Match(0, 0, 2, BS)
    assert match(cm, "rb", b) == Match(0, 0, 2, BS)
    assert cm.prefetch("ra") == 2 and cm.prefetch("rb") == 2
    op_a, op_b = take(cm)
    assert shape(op_a) == (S2H, [], [0, 1], tuple(a))
    assert shape(op_b) == (S2H, [], [2, 3], tuple(b))
    fail(cm, op_a, done=0)  # every key of `a` went missing on some rank
    ack(cm, op_b)
    assert [status(cm, h) for h in a] == [None, None]
    assert [status(cm, h) for h in b] == [HOST, HOST]
    assert cm.prefetch_done("rb") and alloc(cm, "rb", 8) is not None
    (h2d,) = take(cm)
    assert h2d.kind == H2D and list(h2d.src) == [2, 3]


@pytest.mark.parametrize("outcome", ["ok", "failed"])
def test_a_request_matched_again_before_its_load_is_taken_gets_an_op_of_its_own(
        outcome: str) -> None:
    """Matching a request again (a re-match from scratch, as the API allows before
    ``allocate``) and prefetching again in the same step: both loads went into one s2h op
    (keyed by the id), and the commit, which takes an op for one request's, left the new
    load stranded: LOADING for good after an ok ack (``prefetch_done`` never true, the
    block not held), or LOADING with no op after a failed one (its host block kept after
    ``finish``, its hash unloadable until ``reset``). A fuzzer of the API found it."""
    a, b = H(1), H(2)
    store = Store(*a, *b)
    cm = make(4, 4, store=store)
    assert match(cm, "r", a).num_storage == 1 and cm.prefetch("r") == 1
    assert match(cm, "r", b).num_storage == 1 and cm.prefetch("r") == 1
    old, new = take(cm)
    assert shape(old) == (S2H, [], [0], tuple(a)) and shape(new) == (S2H, [], [1], tuple(b))
    if outcome == "ok":
        ack(cm, old)
        ack(cm, new)
        cm.check_invariants()
        assert cm.prefetch_done("r") and cm.num_held_blocks("r") == 1
        assert status(cm, a[0]) == HOST and status(cm, b[0]) == HOST  # a: a host hit now
    else:
        fail(cm, old, done=0)
        fail(cm, new, done=0)
        cm.check_invariants()
        assert status(cm, a[0]) is None and status(cm, b[0]) is None
    cm.finish("r")
    cm.check_invariants()
    assert cm.host.num_free == (2 if outcome == "ok" else 4)
    assert cm.status_counts()["LOADING_FROM_STORAGE"] == 0


def test_blocks_being_loaded_are_no_storage_hit_for_another_request() -> None:
    a = H(1, 2, 3)
    store = Store(*a)
    cm = make(4, 4, store=store)
    assert match(cm, "r1", a).num_storage == 3
    assert cm.prefetch("r1") == 3
    queries = len(store.queries)
    # r2 asks for the same prefix while r1's load is in flight: nothing to load for r2
    assert match(cm, "r2", a) == Match(0, 0, 0, BS)
    assert cm.prefetch("r2") == 0
    assert len(store.queries) == queries  # and no storage round trip was spent on it


def test_a_prefetch_of_blocks_another_request_began_loading_since_its_match_loads_none(
) -> None:
    """Both requests matched the storage hits before either prefetched: the second's
    prefetch finds the first block in the tree (being loaded) and loads nothing; one s2h,
    and the blocks land once, for both to match."""
    a = H(1, 2)
    store = Store(*a)
    cm = make(4, 4, store=store)
    assert match(cm, "r1", a).num_storage == 2
    assert match(cm, "r2", a).num_storage == 2
    assert cm.prefetch("r1") == 2
    assert cm.prefetch("r2") == 0
    cm.check_invariants()
    assert cm.host.num_used == 2
    (s2h,) = take(cm)
    assert shape(s2h) == (S2H, [], [0, 1], tuple(a))
    ack(cm, s2h)
    assert [status(cm, h) for h in a] == [HOST, HOST]
    assert match(cm, "r2", a) == Match(0, 2, 0, BS)


# ================================================================ events


def test_failed_copy_ops_are_rate_limited_and_counted_at_the_flush() -> None:
    """A copy path that fails every step (a broken device, a rank that lost its pool) fails
    a d2h each step: 3 warning lines, then only counts, written by ``flush_logs`` (before:
    one line per op, for as long as the cause lasted). Each op kind has its own limit: an
    h2d's first failure is said."""
    cm = make(2, 4)
    cached(cm, "a", H(100, 200))  # the device full: each request below evicts the last one
    with capture_logs() as logs:
        for i in range(8):
            table = run(cm, f"r{i}", H(10 * i + 1, 10 * i + 2))
            assert table is not None
            (op,) = take(cm)
            assert op.kind == D2H
            fail(cm, op)
            finish(cm, f"r{i}")
            for later in take(cm):
                ack(cm, later)
        lines = [e for e in logs if e["event"] == "scheduler.op_failed"]
        assert len(lines) == 3 and all(e["log_level"] == "warning" for e in lines), lines
        # another kind's first failure is not held back by the d2h limit
        cached(cm, "b", H(300, 301))  # r7's blocks go to host (acked ok)
        run(cm, "c", H(71, 72))  # r7's prompt again: loaded from host
        ops = take(cm)
        (load,) = [op for op in ops if op.kind == H2D]
        fail(cm, load)
        for op in ops:
            if op is not load:
                ack(cm, op)
        h2d = [e for e in logs if e["event"] == "scheduler.op_failed" and e["kind"] == H2D]
        assert len(h2d) == 1, h2d
        cm.flush_logs()
    (summary,) = [e for e in logs if e["event"] == "scheduler.op_failed" and e.get("summary")]
    assert (summary["num_suppressed"], summary["num_total"]) == (5, 8), summary
    assert cm.stats.failed_ops == 9 and cm.stats.failed_by_kind == {D2H: 16, H2D: 2}


def test_the_flushed_summary_of_failed_ops_names_their_kind() -> None:
    """Each op kind has its own limit, so its own summary at the flush: that line names the
    kind (was: ``scheduler.op_failed num_suppressed=5 summary=true`` alone, one such line
    per failing kind, none saying which)."""
    cm = make(2, 4)
    cached(cm, "a", H(100, 200))
    with capture_logs() as logs:
        for i in range(5):
            assert run(cm, f"r{i}", H(10 * i + 1, 10 * i + 2)) is not None
            (op,) = take(cm)
            fail(cm, op)
            finish(cm, f"r{i}")
            for later in take(cm):
                ack(cm, later)
        cm.flush_logs()
    (summary,) = [e for e in logs if e["event"] == "scheduler.op_failed" and e.get("summary")]
    assert (summary["kind"], summary["num_suppressed"]) == (D2H, 2), summary


def test_step_summary_and_failed_op_events_follow_the_log_level() -> None:
    """One ``scheduler.step_done`` line per step with ops at debug (none when filtered, and
    then not even built), ``scheduler.op_failed`` at warning for a partial ack."""
    import io

    import orjson
    import structlog

    from zkv import log as zlog

    def events(level: str) -> list[dict[str, object]]:
        out = io.StringIO()
        zlog.configure("scheduler", level=level, stream=out)
        cm = make(2, 4)
        cached(cm, "r1", H(1, 2))
        assert run(cm, "r2", H(3, 4)) == [0, 1]
        (op,) = take(cm)
        cm.on_ops_done([OpResult(op.id, False, 1, "injected")], seq=7)  # batch 7 carried it
        cm.check_invariants()
        return [orjson.loads(line) for line in out.getvalue().splitlines()]

    try:
        debug = events("debug")
        assert [e["event"] for e in debug] == ["scheduler.step_done", "scheduler.op_failed"]
        assert (debug[0]["num_ops"], debug[0]["num_blocks"]) == (1, 2)
        assert (debug[1]["kind"], debug[1]["done"], debug[1]["num_blocks"]) == (D2H, 1, 2)
        assert debug[1]["seq"] == 7  # so `zkv logs --seq 7` shows it beside the ranks' lines
        assert [e["event"] for e in events("warning")] == ["scheduler.op_failed"]
    finally:
        zlog.close()
        structlog.contextvars.clear_contextvars()
        structlog.reset_defaults()
