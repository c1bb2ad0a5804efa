"""Eviction policies on their own and inside the CacheManager: order, classes, ghost memory,
and O(1) work per evicted block whatever the ack order (no skipped parent, no rotation)."""

from __future__ import annotations

import random

import pytest

from zkv.protocol import OpResult
from zkv.scheduler.eviction import LRU, POLICIES, SLRU, EvictionPolicy, make_policy
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import WRITE_BACK, WRITE_POLICIES, CacheConfig, CacheManager
from zkv.scheduler.radix import DEVICE, Node

BS = 4


def chain(n: int, tag: int = 0) -> list[Node]:
    """n nodes, each the child of the previous one, under a root."""
    root = Node([], None, DEVICE)
    out = []
    parent = root
    for i in range(n):
        node = Node([bytes([tag, i]) * 8], parent, DEVICE)
        out.append(node)
        parent = node
    return out


# ================================================================ policies alone


def test_lru_pops_in_push_order() -> None:
    a, b, c = chain(3)
    pol = LRU(10)
    for n in (c, b, a):  # released leaf first
        pol.push(n)
    pol.remove(b)
    pol.push(b)
    assert pol.nodes() == [c, a, b]
    assert pol.oldest() is c and pol.num_blocks == 3
    assert [pol.pop(), pol.pop(), pol.pop(), pol.pop()] == [c, a, b, None]
    assert pol.probes == 1 and pol.num_blocks == 0


def test_slru_evicts_blocks_seen_once_before_blocks_hit_again() -> None:
    hot = chain(2, tag=1)
    cold = chain(2, tag=2)
    for n in hot:
        n.hits = 2
    for n in cold:
        n.hits = 1
    pol = SLRU(10)
    for n in [*reversed(hot), *reversed(cold)]:  # hot released first (older)
        pol.push(n)
    assert pol.queues() == ([cold[1], cold[0]], [hot[1], hot[0]])
    assert [pol.class_of(n) for n in hot + cold] == [1, 1, 0, 0]
    assert [pol.pop() for _ in range(5)] == [cold[1], cold[0], hot[1], hot[0], None]


def test_slru_demotes_the_oldest_protected_entry_to_the_young_end_of_probation() -> None:
    pol = SLRU(4, protected_fraction=0.5)  # at most 2 protected
    cold = chain(1, tag=3)[0]
    cold.hits = 1
    hot = chain(3, tag=4)
    for n in hot:
        n.hits = 5
    pol.push(cold)
    for n in reversed(hot):
        pol.push(n)
    assert pol.queues() == ([cold, hot[2]], [hot[1], hot[0]])  # the tail was demoted
    assert pol.pop() is cold and pol.pop() is hot[2]


def test_slru_ghost_brings_a_recomputed_block_back_protected() -> None:
    pol = SLRU(2, ghost_factor=1.0)
    (a,) = chain(1, tag=5)
    a.hits = 1
    pol.push(a)
    assert pol.pop() is a
    pol.note_evicted(a.hashes)
    again = Node(a.hashes, a.parent, DEVICE)  # the same block, inserted again
    again.hits = 1
    assert pol.note_inserted(again) == 1
    again.reused = True  # (the tree marks them)
    pol.push(again)
    assert pol.queues() == ([], [again]) and pol.class_of(again) == 1
    # Under a parent that is not protected, the mark would break monotone classes: none.
    p, c = chain(2, tag=6)
    p.hits = c.hits = 1
    pol.note_evicted(c.hashes)
    c2 = Node(c.hashes, p, DEVICE)
    assert pol.note_inserted(c2) == 0
    # The ghost keeps the last ghost_factor x capacity evicted blocks, trimmed in bulk
    # (at twice that): the oldest are forgotten first.
    olds = chain(5, tag=7)
    for n in olds:
        pol.note_evicted(n.hashes)
    assert list(pol._ghost) == [n.hashes[0] for n in olds[1:]]  # a, c, olds[0] trimmed


def test_slru_ghost_moves_a_block_evicted_again_to_its_young_end() -> None:
    """A block evicted a second time is among the latest evictions: a bulk trim keeps it
    and forgets the blocks evicted before it (the ghost is a FIFO of evictions)."""
    pol = SLRU(2, ghost_factor=2.0)  # keeps the last 4, trimmed when past 8
    seq = [bytes([i]) * 8 for i in range(8)]
    for h in [*seq, seq[0], b"\xff" * 8]:
        pol.note_evicted([h])
    assert list(pol._ghost) == [seq[6], seq[7], seq[0], b"\xff" * 8]
    pol.note_evicted([seq[6], seq[1]])  # one batch: both at the young end, in order
    assert list(pol._ghost)[-2:] == [seq[6], seq[1]] and len(set(pol._ghost)) == 5


def test_slru_shrink_demotes_protected_entries_past_the_new_share() -> None:
    pol = SLRU(8, protected_fraction=0.5)  # up to 4 protected blocks
    hot = chain(4, tag=8)
    for n in hot:
        n.hits = 3
    for n in reversed(hot):
        pol.push(n)
    assert pol.queues() == ([], [hot[3], hot[2], hot[1], hot[0]])
    pol.resize(4)  # up to 2: the oldest two go to probation, oldest first
    assert pol.queues() == ([hot[3], hot[2]], [hot[1], hot[0]])
    assert pol._prot_blocks == 2 and pol.num_blocks == 4
    pol.resize(16)  # growing moves nothing back
    assert pol.queues() == ([hot[3], hot[2]], [hot[1], hot[0]])


def test_slru_a_protected_entry_that_gives_blocks_away_holds_fewer_of_the_share() -> None:
    """A protected run split or trimmed (``shrink``) takes less of the protected share:
    another protected run fits beside it (counted at its old size, the share looked full
    and the older run was demoted, for good: ``remove`` takes off what it holds then)."""
    pol = SLRU(8, protected_fraction=0.5)  # up to 4 protected blocks
    root = Node([], None, DEVICE)
    a = Node([bytes([9, i]) * 8 for i in range(4)], root, DEVICE)
    b = Node([bytes([10, i]) * 8 for i in range(2)], root, DEVICE)
    a.hits = b.hits = 3
    pol.push(a)
    del a.hashes[2:]  # its last two blocks left (as the tree's trim_tail does)
    pol.shrink(a, 2)
    assert pol._prot_blocks == 2 and pol.num_blocks == 2
    pol.push(b)
    assert pol.queues() == ([], [a, b]) and pol._prot_blocks == 4
    pol.remove(a)
    pol.remove(b)
    assert pol._prot_blocks == 0 and pol.num_blocks == 0


def test_a_victim_run_gives_its_last_blocks_and_keeps_its_place() -> None:
    """Evicting fewer blocks than a victim node holds takes its tail and leaves the rest
    first in line: one block at a time would go in the same order."""
    cm = CacheManager(CacheConfig(4, block_size=BS))
    a = hash_ids_chain([1, 2, 3])
    cm.match_prefix("a", a)
    assert cm.allocate("a", 12) == [0, 1, 2]
    cm.finish("a")
    b = hash_ids_chain([9])
    cm.match_prefix("b", b)
    assert cm.allocate("b", 8) == [2, 3]  # the tail of a, then the free block
    cm.check_invariants()
    assert [cm.tree.block(h).status if h in cm.tree.index else None for h in a] == [
        DEVICE, DEVICE, None]
    run_ = cm.tree.index[a[0]]
    assert cm.tree.dlru_nodes() == [run_] and run_.hashes == a[:2]
    cm.finish("b", num_computed_tokens=0)
    assert cm.tree.dlru_nodes() == [run_]  # still the oldest
    cm.check_invariants()


def test_make_policy_and_bad_arguments() -> None:
    assert [make_policy(name, 8).name for name in POLICIES] == ["lru", "slru"]
    with pytest.raises(ValueError):
        make_policy("arc", 8)
    with pytest.raises(ValueError):
        SLRU(8, protected_fraction=1.5)
    with pytest.raises(ValueError):
        CacheConfig(8, eviction_policy="fifo")


# ================================================================ inside the manager


class Counting(EvictionPolicy):
    """Wraps a policy and counts every call made to it (the work eviction costs); its
    ``probes`` and ``num_blocks`` follow the inner policy's after every call (plain
    attributes: the compiled core reads them directly)."""

    def __init__(self, inner: EvictionPolicy) -> None:
        super().__init__(inner.capacity)
        self.inner = inner
        self.name = inner.name
        self.remembers = inner.remembers
        self.calls = 0

    def _count(self) -> None:
        self.calls += 1
        self.probes = self.inner.probes
        self.num_blocks = self.inner.num_blocks

    def push(self, n: Node) -> None:
        self.inner.push(n)
        self._count()

    def remove(self, n: Node) -> None:
        self.inner.remove(n)
        self._count()

    def oldest(self) -> Node | None:
        n = self.inner.oldest()
        self._count()
        return n

    def pop(self) -> Node | None:
        n = self.inner.pop()
        self._count()
        return n

    def shrink(self, n: Node, c: int) -> None:
        self.inner.shrink(n, c)
        self._count()

    def __len__(self) -> int:
        return len(self.inner)

    def nodes(self) -> list[Node]:
        return self.inner.nodes()

    def class_of(self, n: Node) -> int:
        return self.inner.class_of(n)

    def note_evicted(self, hashes: list[bytes]) -> None:
        self.inner.note_evicted(hashes)

    def note_inserted(self, n: Node) -> int:
        return self.inner.note_inserted(n)

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        self.inner.resize(capacity)


def _replay_with_late_acks(cm: CacheManager, paths: list[list[int]], lag: int,
                           rng: random.Random) -> None:
    """Requests one at a time; each step's ops are acked ``lag`` steps later, in a random
    order, so evictions run while children of their candidates are still in flight."""
    waiting: list[list] = []
    for i, path in enumerate(paths):
        rid = f"r{i}"
        hashes = hash_ids_chain(path)
        cm.match_prefix(rid, hashes)
        table = cm.allocate(rid, len(hashes) * BS)
        ops = cm.take_ops()
        if table is None:
            cm.abort(rid)
        else:
            cm.finish(rid)
        waiting.append(ops + cm.take_ops())
        if len(waiting) > lag:
            due = waiting.pop(0)
            rng.shuffle(due)
            for op in due:
                cm.on_ops_done([OpResult(op.id, True, op.num_blocks)])
    for due in waiting:
        cm.on_ops_done([OpResult(op.id, True, op.num_blocks) for op in reversed(due)])


def _paths(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts sharing a few long prefixes, with tails of their own."""
    prefixes = [[rng.randrange(10**6) for _ in range(rng.randrange(4, 12))] for _ in range(6)]
    return [rng.choice(prefixes)[: rng.randrange(2, 12)] + [rng.randrange(10**6)
            for _ in range(rng.randrange(1, 6))] for _ in range(n)]


@pytest.mark.parametrize("eviction", POLICIES)
@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_one_probe_per_evicted_block_with_late_out_of_order_acks(
        eviction: str, write_policy: str) -> None:
    """Under every write policy, with a host tier and storage writes, and acks arriving two
    steps late in random order (the case that rotated LRU entries before): each evicted
    block costs one look at the policy, and all policy calls stay O(blocks touched)."""
    rng = random.Random(11)
    cfg = CacheConfig(24, 48, BS, write_policy, storage_write=True, eviction_policy=eviction)
    dpol = Counting(make_policy(eviction, 24))
    hpol = Counting(make_policy(eviction, 48))
    cm = CacheManager(cfg, storage_exists=lambda hs: 0, device_policy=dpol, host_policy=hpol)
    paths = _paths(rng, 400)
    _replay_with_late_acks(cm, paths, lag=2, rng=rng)
    cm.check_invariants()
    s = cm.stats
    assert s.evicted_device > 500 and (write_policy == WRITE_BACK) <= (s.evicted_host > 100)
    # One look at the policy per victim node, never more than one per evicted block.
    assert 0 < dpol.probes <= s.evicted_device and hpol.probes <= s.evicted_host
    touched = s.match_blocks + s.evicted_device + s.evicted_host
    assert dpol.calls + hpol.calls <= 4 * touched


def test_slru_beats_lru_when_one_off_prompts_would_flush_a_hot_prefix() -> None:
    """A shared 6-block prefix is asked for every fifth request; between, four one-off
    prompts of 3 blocks each arrive, enough to flush 12 device blocks. LRU never keeps the
    prefix. SLRU misses it twice: the second miss finds it in the ghost memory, so it comes
    back protected and is hit by every later request."""
    hot = list(range(100, 106))
    paths = []
    for i in range(60):
        paths.append(hot + [1000 + i] if i % 5 == 0 else [2000 + 3 * i, 2001 + 3 * i, 2002 + 3 * i])

    def hits(eviction: str) -> int:
        cm = CacheManager(CacheConfig(12, block_size=BS, eviction_policy=eviction))
        total = 0
        for i, path in enumerate(paths):
            hashes = hash_ids_chain(path)
            total += cm.match_prefix(f"r{i}", hashes).num_device
            assert cm.allocate(f"r{i}", len(hashes) * BS) is not None
            cm.finish(f"r{i}")
            cm.check_invariants()
        return total

    assert hits("lru") == 0
    assert hits("slru") == 6 * 10  # 12 hot requests, the first two miss
