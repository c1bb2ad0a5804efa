"""Independent models for bench/scheduler_ops.py (no zkv imports on purpose).

- ``reference_lru_hits``: the hit-ratio oracle. A trie of block-hash paths holding at most
  ``capacity`` blocks, LRU over leaves. For request t: hit = longest cached prefix (counted
  before anything is inserted), then every block of the path is inserted / touched with
  ``last_access = t``, then while the trie holds more than ``capacity`` blocks the leaf with
  the least ``(last_access, -depth)`` is evicted (a heap with lazy deletion). Slow and simple.

- ``ListLRUCache``: the speed baseline, the simplest correct prefix cache: a dict of prefix
  hashes (hash -> [parent, number of children]) and a Python list as the LRU
  (``list.remove`` / ``append``), evicting only leaves. Same request steps as the
  CacheManager (match pins the matched prefix, allocate evicts to make room, finish inserts
  and unpins), device tier only.

Both take each request as a list of chained block hashes (any hashable, equal prefixes
give equal items); because hashes are chained, a block's hash names its whole prefix.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence


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


class ListLRUCache:
    """Naive device-only prefix cache: dict of prefix hashes + list LRU (oldest first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[Hashable, list] = {}  # hash -> [parent hash or None, children]
        self.lru: list[Hashable] = []            # unpinned cached blocks, oldest first
        self.running: dict[str, tuple[Sequence[Hashable], int]] = {}

    def match(self, req_id: str, hashes: Sequence[Hashable]) -> int:
        entries = self.entries
        lru = self.lru
        k = 0
        for h in hashes:
            if h not in entries:
                break
            lru.remove(h)  # pinned while the request runs
            k += 1
        self.running[req_id] = (hashes, k)
        return k

    def allocate(self, req_id: str) -> bool:
        hashes, k = self.running[req_id]
        need = len(hashes) - k
        free = self.capacity - len(self.entries)
        if need > free + len(self.lru):
            return False
        entries = self.entries
        lru = self.lru
        for _ in range(need - free):
            i = next((j for j, x in enumerate(lru) if entries[x][1] == 0), -1)  # oldest leaf
            if i < 0:
                return False
            h = lru.pop(i)
            p = entries.pop(h)[0]
            if p is not None:
                entries[p][1] -= 1
        return True

    def finish(self, req_id: str, cache: bool = True) -> None:
        hashes, k = self.running.pop(req_id)
        entries = self.entries
        if cache:
            parent = hashes[k - 1] if k else None
            for h in hashes[k:]:
                entries[h] = [parent, 0]
                if parent is not None:
                    entries[parent][1] += 1
                parent = h
            n = len(hashes)
        else:
            n = k
        # leaf first, so every block is older than its ancestors
        self.lru.extend(reversed(hashes[:n]))


def run_list_lru(requests: Sequence[Sequence[Hashable]], capacity: int, clock, cpu_clock,
                 budget_ns: int | None = None) -> tuple[int, int, int, list[int], list[int]]:
    """Replay through ListLRUCache; returns (hits, total, fails, per-request wall ns, CPU
    stamps: one before each request and one at the end). With ``budget_ns``, stops once the
    timed steps add up to more than that (a prefix of the replay)."""
    c = ListLRUCache(capacity)
    hits = total = fails = 0
    times: list[int] = []
    cpu: list[int] = []
    spent = 0
    for i, hashes in enumerate(requests):
        if budget_ns is not None and spent > budget_ns:
            break
        rid = str(i)
        cpu.append(cpu_clock())
        t0 = clock()
        k = c.match(rid, hashes)
        ok = c.allocate(rid)
        c.finish(rid, cache=ok)
        dt = clock() - t0
        times.append(dt)
        spent += dt
        hits += k
        total += len(hashes)
        fails += not ok
    cpu.append(cpu_clock())
    return hits, total, fails, times, cpu
