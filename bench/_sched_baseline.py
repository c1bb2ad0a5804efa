"""Independent models for bench/scheduler_ops.py (no zkv imports on purpose).

- ``reference_lru_hits``: the hit-ratio oracle. A trie of block-hash paths holding at most
  ``capacity`` blocks, LRU over leaves. For request t: hit = longest cached prefix (counted
  before anything is inserted), then every block of the path is inserted / touched with
  ``last_access = t``, then while the trie holds more than ``capacity`` blocks the leaf with
  the least ``(last_access, -depth)`` is evicted (a heap with lazy deletion). Slow and simple.

- ``SimplePrefixCache``: the speed baseline, the straightforward way to write a prefix
  cache in Python: chained hashes computed block by block (numpy conversion, one xxhash
  call per block: the formula zkv documents), one dict entry per cached block (its device
  block id), a free list, and an ``OrderedDict`` of unheld blocks released leaf first (so
  the oldest is a chain tail), device tier only. Same request steps as the bench's
  CacheManager replay: match holds the matched prefix, allocate evicts to make room and
  returns the block table, finish inserts and releases.

Both take each request's block hashes (any hashable; equal prefixes give equal items);
because hashes are chained, a block's hash names its whole prefix.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np
import xxhash

ROOT = b"zkv-root-v1\x00\x00\x00\x00\x00"


def chain_hashes_tokens(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """``h_i = XXH3-128(h_{i-1} ‖ tokens_i as int32 LE)`` per full block, from ``ROOT``."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    step = 4 * block_size
    out = []
    h = ROOT
    for off in range(0, len(data) - step + 1, step):
        h = xxhash.xxh3_128_digest(h + data[off : off + step])
        out.append(h)
    return out


def chain_hashes_ids(ids: Sequence[int]) -> list[bytes]:
    """One int64 LE id per block, chained the same way."""
    data = np.asarray(ids, dtype="<i8").tobytes()
    out = []
    h = ROOT
    for off in range(0, len(data), 8):
        h = xxhash.xxh3_128_digest(h + data[off : off + 8])
        out.append(h)
    return out


def reference_lru_hits(requests: Sequence[Sequence[Hashable]], capacity: int) -> tuple[int, int]:
    """(hit blocks, total blocks) of an LRU-over-trie-leaves cache of ``capacity`` blocks."""
    # node: [parent key or None, number of children, last_access, depth]
    nodes: dict[Hashable, list] = {}
    heap: list[tuple[int, int, int, Hashable]] = []  # (last_access, -depth, tiebreak, key)
    seq = 0
    hits = total = 0
    for t, path in enumerate(requests):
        total += len(path)
        k = 0
        for h in path:
            if h not in nodes:
                break
            k += 1
        hits += k
        if len(path) > capacity:
            # Cannot be cached at all (a real cache refuses it); touch the hit prefix only.
            path = path[:k]
        parent = None
        for d, h in enumerate(path):
            e = nodes.get(h)
            if e is None:
                e = [parent, 0, t, d]
                nodes[h] = e
                if parent is not None:
                    nodes[parent][1] += 1
            else:
                e[2] = t
            parent = h
        if path:
            tail = nodes[path[-1]]
            if tail[1] == 0:  # the path's tail is a leaf: (re)enter it with its new stamp
                seq += 1
                heapq.heappush(heap, (t, -tail[3], seq, path[-1]))
        while len(nodes) > capacity:
            la, _negd, _s, h = heapq.heappop(heap)
            e = nodes.get(h)
            if e is None or e[1] != 0 or e[2] != la:
                continue  # stale: evicted, no longer a leaf, or touched since
            del nodes[h]
            p = e[0]
            if p is not None:
                pe = nodes[p]
                pe[1] -= 1
                if pe[1] == 0:
                    seq += 1
                    heapq.heappush(heap, (pe[2], -pe[3], seq, p))
    return hits, total


class SimplePrefixCache:
    """Per-block dict + LRU + free list of device block ids, device tier only (see the
    module docstring). Like the CacheManager it hands out a block table per request."""

    def __init__(self, capacity: int) -> None:
        self.free = list(range(capacity - 1, -1, -1))
        self.block: dict[Hashable, int] = {}                    # cached block -> device block
        self.lru: OrderedDict[Hashable, None] = OrderedDict()   # unheld blocks, oldest first

    def match(self, hashes: Sequence[Hashable]) -> int:
        block, lru = self.block, self.lru
        k = 0
        for h in hashes:
            if h not in block:
                break
            lru.pop(h, None)  # held while the request runs
            k += 1
        return k

    def allocate(self, hashes: Sequence[Hashable], k: int) -> list[int] | None:
        """The request's block table: its matched blocks, then new ones (evicting the
        oldest unheld blocks as needed); None when they do not fit."""
        block, lru, free = self.block, self.lru, self.free
        need = len(hashes) - k
        if need > len(free) + len(lru):
            return None
        while len(free) < need:
            h, _ = lru.popitem(last=False)  # released leaf first: a chain tail
            free.append(block.pop(h))
        new = free[len(free) - need :]
        del free[len(free) - need :]
        return [block[h] for h in hashes[:k]] + new

    def finish(self, hashes: Sequence[Hashable], k: int, table: list[int] | None) -> None:
        block, lru = self.block, self.lru
        n = k
        if table is not None:
            for i in range(k, len(hashes)):
                block[hashes[i]] = table[i]
            n = len(hashes)
        for h in reversed(hashes[:n]):  # leaf first: ancestors end up younger
            lru[h] = None


def run_simple(requests: Sequence[Sequence[int]], capacity: int, hash_fn, cpu_clock
               ) -> tuple[int, int, list[int]]:
    """Replay through SimplePrefixCache, hashing each request first; returns (hit blocks,
    total blocks, CPU stamps: one before each request and one at the end)."""
    c = SimplePrefixCache(capacity)
    hits = total = 0
    cpu = []
    for req in requests:
        cpu.append(cpu_clock())
        hashes = hash_fn(req)
        k = c.match(hashes)
        c.finish(hashes, k, c.allocate(hashes, k))
        hits += k
        total += len(hashes)
    cpu.append(cpu_clock())
    return hits, total, cpu
