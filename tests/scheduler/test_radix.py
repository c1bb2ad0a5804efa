"""The tree of block runs: lookups, splits under requests and ops in flight, and work per
request that does not grow with its blocks."""

from __future__ import annotations

import sys
from collections.abc import Callable

from zkv.protocol import BACKUP, D2H, OpResult
from zkv.scheduler.eviction import LRU
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import WRITE_THROUGH, CacheConfig, CacheManager
from zkv.scheduler.radix import DEVICE, HOST, RadixTree

BS = 4


def H(*ids: int) -> list[bytes]:  # noqa: N802
    return hash_ids_chain(list(ids))


def cached(cm: CacheManager, rid: str, hashes: list[bytes]) -> None:
    cm.match_prefix(rid, hashes)
    assert cm.allocate(rid, len(hashes) * BS) is not None
    for _ in range(2):
        ops = cm.take_ops()
        if ops:
            cm.on_ops_done([OpResult(o.id, True, o.num_blocks) for o in ops])
        if _ == 0:
            cm.finish(rid)
    cm.check_invariants()


def test_num_present_and_common_run_search_a_chain() -> None:
    tree = RadixTree(LRU(8), LRU(8))
    a = H(*range(10))
    n = tree.add(tree.root, a[:7], DEVICE, list(range(7)))
    assert [tree.num_present(a[:k]) for k in (0, 1, 7, 10)] == [0, 1, 7, 7]
    assert tree.num_present(H(5, 6)) == 0
    other = a[:4] + H(99, 98)[1:]  # shares 4 blocks, then differs
    assert tree.common_run(n, other, 0, len(other)) == 4
    assert tree.common_run(n, a, 0, 10) == 7 and tree.common_run(n, a, 0, 3) == 3
    assert tree.locate(a[5]) == (n, 5) and tree.locate(a[8]) is None


def test_one_node_per_run_and_a_split_where_requests_diverge() -> None:
    cm = CacheManager(CacheConfig(64, block_size=BS))
    a = H(*range(20))
    cached(cm, "r1", a)
    (run,) = cm.tree.root.children.values()
    assert run.hashes == a and run.dev == list(range(20)) and len(cm.tree.index) == 20
    b = a[:12] + H(*range(12), 77)[12:]
    cached(cm, "r2", b)
    head = cm.tree.index[a[0]]
    assert head.hashes == a[:12] and set(head.children) == {a[12], b[12]}
    assert cm.tree.index[a[19]] is run and run.hashes == a[12:] and run.depth == 12
    assert [cm.tree.block(h).dev for h in (a[11], a[12], b[12])] == [11, 12, 20]


def test_a_split_while_a_backup_is_in_flight_commits_both_pieces() -> None:
    """A request matches part of a run whose backup is in flight: the run splits, and the
    op (an entry over the whole run) commits the head and the rest."""
    cm = CacheManager(CacheConfig(16, 16, BS, WRITE_THROUGH))
    a = H(*range(6))
    cm.match_prefix("r1", a)
    cm.allocate("r1", 24)
    cm.finish("r1")
    (backup,) = cm.take_ops()
    assert backup.kind == BACKUP and backup.num_blocks == 6
    cm.match_prefix("r2", a[:2])  # holds the first two blocks: a split
    cm.check_invariants()
    assert cm.tree.index[a[0]].hashes == a[:2] and cm.tree.index[a[5]].hashes == a[2:]
    assert cm.tree.index[a[0]].busy == cm.tree.index[a[5]].busy == 1
    cm.on_ops_done([OpResult(backup.id, True, 6)])
    cm.check_invariants()
    assert all(cm.tree.block(h).host_ok for h in a)
    assert [cm.tree.block(h).host for h in a] == list(range(6))


def test_a_partial_ack_splits_the_run_at_the_boundary() -> None:
    cm = CacheManager(CacheConfig(4, 8, BS, "write_back"))
    a = H(1, 2, 3, 4)
    cached(cm, "r1", a)
    cm.match_prefix("x", H(9, 8, 7, 6))
    assert cm.allocate("x", 16) == [0, 1, 2, 3]
    (d2h,) = cm.take_ops()
    assert d2h.kind == D2H and d2h.src.tolist() == [0, 1, 2, 3]
    cm.on_ops_done([OpResult(d2h.id, False, 3, "x")])
    cm.check_invariants()
    assert [cm.tree.block(h).status for h in a[:3]] == [HOST] * 3 and a[3] not in cm.tree.index
    assert cm.tree.index[a[0]].hashes == a[:3]


def _calls(fn: Callable[[], None]) -> int:
    """Python and C function calls made by ``fn`` (sys.setprofile events)."""
    n = 0

    def prof(frame: object, event: str, arg: object) -> None:
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def test_work_per_request_does_not_grow_with_its_blocks() -> None:
    """The same request shape, 10 to 10,000 blocks: a full device hit plus one new block,
    matched, allocated and finished (evicting a 1-block victim). Function calls grow only
    with log(blocks), by the binary searches for the matched prefix (per-block work runs
    inside C calls: slices, dict updates, maps)."""

    def shape(num_blocks: int) -> int:
        cm = CacheManager(CacheConfig(num_blocks + 1, block_size=BS))
        prompt = H(*range(num_blocks))
        cached(cm, "warm", prompt)
        cached(cm, "other", H(10**6))  # the one free block is taken: the next must evict
        req = prompt + H(*range(num_blocks), 10**7)[num_blocks:]

        def step() -> None:
            cm.match_prefix("r", req)
            assert cm.allocate("r", len(req) * BS) is not None
            cm.finish("r")

        n = _calls(step)
        cm.check_invariants()
        assert cm.stats.evicted_device == 1 and cm.tree.num_blocks() == num_blocks + 1
        return n

    calls = {n: shape(n) for n in (10, 100, 1_000, 10_000)}
    for n in (100, 1_000, 10_000):  # ~3 more lookups for each 10x (log2 10 = 3.3)
        assert calls[n] - calls[n // 10] <= 8, calls
