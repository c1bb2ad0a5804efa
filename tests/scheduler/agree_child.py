"""A seeded scheduler workload that prints a digest of everything it saw (every op's kind,
ids and keys, every match, table and count, the final stats): run once compiled and once
with ``ZKV_PURE_PYTHON=1`` by ``test_native_core.py``, the two must print the same.

    python -m tests.scheduler.agree_child SEED

Both modes of the cache manager: owned device blocks (host tier, L3 writes and loads,
prefetch, decode growth, aborts, swap-ins) and external L1 (saves, chained saves, loads),
with acks that come a step late, out of order, some failing part-way.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import asdict

from zkv import log as zlog
from zkv.protocol import Op, OpResult
from zkv.scheduler import NATIVE, native_core
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import CacheConfig, CacheManager

BS = 4


class Digest:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.n = 0

    def add(self, *xs: object) -> None:
        self.h.update(repr(xs).encode())
        self.n += 1


def _op(op: Op) -> tuple[object, ...]:
    return (op.kind, op.src.tolist(), op.dst.tolist(), op.keys, op.layerwise)


class Acker:
    """Acks ops a step late, in a shuffled order, some failing part-way."""

    def __init__(self, cm: CacheManager, rng: random.Random, d: Digest) -> None:
        self.cm, self.rng, self.d = cm, rng, d
        self.waiting: list[Op] = []

    def step(self) -> None:
        ops = self.cm.take_ops()
        for op in ops:
            self.d.add("op", _op(op))
        due, self.waiting = self.waiting, ops
        self.rng.shuffle(due)
        results = []
        for op in due:
            n = op.num_blocks
            done = n if self.rng.random() < 0.85 else self.rng.randrange(n + 1)
            results.append(OpResult(op.id, done == n, done, None if done == n else "x"))
        self.d.add("unknown", self.cm.on_ops_done(results))
        self.d.add("recompute", self.cm.take_recompute(), self.cm.take_load_failures())

    def drain(self) -> None:
        for _ in range(3):
            self.step()


def _prompt(rng: random.Random, roots: int, ids: int, longest: int) -> list[bytes]:
    """The hashes of a prompt of 2 .. ``longest`` blocks: one of ``roots`` first blocks,
    then ids out of ``ids`` (few: prompts share prefixes)."""
    blocks = [rng.randrange(roots)] + [rng.randrange(ids) for _ in range(rng.randrange(1, longest))]
    return hash_ids_chain(blocks)


def owned(seed: int, d: Digest, policy: str, eviction: str) -> None:
    rng = random.Random(seed)
    stored: set[bytes] = set()

    def exists(hashes: list[bytes]) -> int:
        k = 0
        while k < len(hashes) and hashes[k] in stored:
            k += 1
        return k

    cm = CacheManager(CacheConfig(24, 64, BS, policy, storage_write=True,
                                  eviction_policy=eviction), storage_exists=exists)
    now = [0.0]  # a step is 50 ms: store retries and negative entries come due on steps
    cm.core.monotonic = lambda: now[0]
    acker = Acker(cm, rng, d)
    running: list[tuple[str, int]] = []
    for i in range(400):
        now[0] += 0.05
        if running and (len(running) > 4 or rng.random() < 0.4):
            rid, n = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.1:
                cm.abort(rid)
            else:
                grown = cm.allocate(rid, (n + rng.randrange(3)) * BS)  # decode
                d.add("grow", rid, grown)
                cm.finish(rid)
        else:
            rid = f"r{i}"
            hashes = _prompt(rng, 6, 4, 9)
            m = cm.match_prefix(rid, hashes)
            d.add("match", rid, m)
            if m.num_storage and rng.random() < 0.7:
                d.add("prefetch", cm.prefetch(rid))
            table = cm.allocate(rid, len(hashes) * BS)
            d.add("alloc", rid, table)
            if table is None:
                cm.abort(rid)
            else:
                running.append((rid, len(hashes)))
        acker.step()
        if rng.random() < 0.3:  # what reached host was written: L3 has it
            stored.update(h for h in list(cm.tree.index) if rng.random() < 0.5)
        cm.check_invariants()
    for rid, _ in running:
        cm.finish(rid)
    acker.drain()
    cm.check_invariants()
    d.add("stats", asdict(cm.stats), cm.status_counts())


def external(seed: int, d: Digest) -> None:
    rng = random.Random(seed)
    cm = CacheManager(CacheConfig(0, 48, BS, "write_back", eviction_policy="slru"))
    acker = Acker(cm, rng, d)
    running: list[tuple[str, list[bytes], list[int]]] = []
    next_id = 1000
    for i in range(300):
        if running and (len(running) > 3 or rng.random() < 0.4):
            rid, hashes, ids = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.15:
                d.add("cancel", cm.cancel_saves(rid))
                cm.abort(rid)
                continue
            if not cm.save_waits(rid, chain=True):
                d.add("final", cm.cache_computed(rid, len(hashes) * BS, device_ids=ids,
                                                 chain=True))
            cm.finish(rid)
        else:
            rid = f"e{i}"
            hashes = _prompt(rng, 5, 3, 8)
            m = cm.match_prefix(rid, hashes)
            ids = list(range(next_id, next_id + len(hashes)))
            next_id += len(hashes)
            hit = m.num_device + m.num_host
            if hit:
                d.add("load", cm.load_external(rid, 0, ids[:hit]))
            if not cm.save_waits(rid):
                d.add("save", cm.cache_computed(rid, len(hashes) * BS, device_ids=ids))
            running.append((rid, hashes, ids))
        acker.step()
        cm.check_invariants()
    for rid, _, _ in running:
        cm.finish(rid)
    acker.drain()
    cm.check_invariants()
    d.add("stats", asdict(cm.stats), cm.status_counts())


def main() -> None:
    zlog.configure("agree", level="error")
    seed = int(sys.argv[1])
    d = Digest()
    for policy in ("write_back", "write_through", "write_through_selective"):
        for eviction in ("lru", "slru"):
            owned(seed, d, policy, eviction)
    external(seed, d)
    mods = {n: sys.modules[f"zkv.scheduler.{n}"].__file__ or "" for n in NATIVE}
    print(json.dumps({"digest": d.h.hexdigest(), "events": d.n, "native": native_core(),
                      "compiled": sorted(n for n, f in mods.items() if not f.endswith(".py"))}))


if __name__ == "__main__":
    main()
