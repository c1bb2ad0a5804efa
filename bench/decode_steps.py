"""Per-step cost of the scheduler for running requests, by context length (external-L1 mode,
as the vLLM connector drives it).

vLLM's connector calls ``CacheManager.cache_computed`` for every running request at every
step, with the request's whole hash list and block table: a decode step adds a block every
16 tokens, but the list grows with the context. Timed per step: that call for each of
``--requests`` requests, then ``take_ops`` (their saves as one batch). The baseline in the
same run is the floor of any prefix cache that keeps decoded blocks: hashing each
request's new block. Printed: us per request per step at each context, the ratio to the
baseline, and to the shortest context (1.00x: the cost does not grow with the context).

    .venv/bin/python bench/decode_steps.py [--requests 100] [--contexts 128,1024,8000]

The cyclic garbage collector is off while a step is timed: the tree's nodes make a large
heap, and one full collection (0.1-0.7 s) landing in a few timed steps would be the whole
measurement (an engine pays it once per many thousands of steps, whatever zkv does).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _args import positive_int, positive_ints  # noqa: E402

from zkv import log as zlog  # noqa: E402
from zkv.protocol import OpResult  # noqa: E402
from zkv.scheduler.hashing import hash_ids_chain, hash_tokens  # noqa: E402
from zkv.scheduler.manager import CacheConfig, CacheManager  # noqa: E402

BS = 16
STEPS = 10


def _ack(cm: CacheManager, ops: list) -> None:  # type: ignore[type-arg]
    cm.on_ops_done([OpResult(o.id, True, o.num_blocks) for o in ops])


def zkv_step_us(num_requests: int, blocks: int) -> float:
    """us per request per decode step at ``blocks`` blocks of context."""
    cm = CacheManager(CacheConfig(0, num_requests * blocks + 16, BS))
    hashes = {f"r{i}": hash_ids_chain([i * 10**7 + j for j in range(blocks)])
              for i in range(num_requests)}
    ids = list(range(blocks))  # (the engine's block table: passed whole, as vLLM's is)
    for rid, h in hashes.items():  # prefilled: all but the last STEPS blocks saved
        cm.match_prefix(rid, [])
        cm.cache_computed(rid, (blocks - STEPS) * BS, block_hashes=h, device_ids=ids)
    _ack(cm, cm.take_ops())
    spent = 0.0
    for k in range(blocks - STEPS + 1, blocks + 1):  # a block more per request a step
        gc.disable()
        t0 = time.perf_counter()
        for rid, h in hashes.items():
            cm.cache_computed(rid, k * BS, block_hashes=h, device_ids=ids)
        ops = cm.take_ops()
        spent += time.perf_counter() - t0
        gc.enable()
        assert sum(o.num_blocks for o in ops) == num_requests, "one block saved a request"
        _ack(cm, ops)
    for rid in hashes:
        cm.finish(rid)
    cm.check_invariants()
    return spent / STEPS / num_requests * 1e6


def baseline_step_us(num_requests: int) -> float:
    """The floor of any prefix cache that keeps decoded blocks: hash each request's new
    block (16 tokens, chained to the last hash), per step."""
    last = {f"r{i}": hash_ids_chain([i])[0] for i in range(num_requests)}
    tokens = list(range(BS))
    spent = 0.0
    for _ in range(STEPS * 10):
        gc.disable()
        t0 = time.perf_counter()
        for rid, parent in last.items():
            last[rid] = hash_tokens(tokens, BS, parent=parent)[0]
        spent += time.perf_counter() - t0
        gc.enable()
    return spent / (STEPS * 10) / num_requests * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=positive_int, default=100, help="running requests")
    p.add_argument("--contexts", type=positive_ints, default=[128, 1024, 8000],
                   help="context lengths in blocks of 16 tokens (comma-separated)")
    args = p.parse_args()
    if min(args.contexts) <= STEPS:
        p.error(f"--contexts must be > {STEPS} blocks (the timed steps)")
    zlog.configure("bench", level="warning")
    base = baseline_step_us(args.requests)
    print(f"zkv decode_steps bench  ({args.requests} running requests, {STEPS} steps each)")
    print(f"  baseline (hash each request's new block): {base:.3f} us/request/step")
    # the shortest context measured first (the column's base), the others in the order given
    contexts = sorted(set(args.contexts), key=lambda b: (b != min(args.contexts),
                                                        args.contexts.index(b)))
    shortest = None
    for blocks in contexts:
        us = zkv_step_us(args.requests, blocks)
        shortest = shortest or us
        print(f"  context {blocks:>6} blocks ({blocks * BS:>7} tokens): {us:7.2f} us/request/"
              f"step  {us / base:6.1f}x baseline  {us / shortest:5.2f}x the shortest context")
    return 0


if __name__ == "__main__":
    sys.exit(main())
