"""What zkv can still load from a redis server that evicts under ``maxmemory``, as a ratio of
an exact LRU of the same number of blocks (the ``file://`` store's), on the bundled trace.

    .venv/bin/python bench/redis_eviction.py [--requests 3000] [--pace-ms 20]
                                             [--maxmemory 48mb] [--configs lru5 lru10 ttl]

Each request makes the store calls one rank's scheduler and worker make: ``count_leading``
over its chain of block hashes, a get of the blocks found, a put of the rest. Requests are
``--pace-ms`` apart: redis's LRU clock ticks once a second, so a run squeezed in time ties
every key's idle time and redis evicts at random. For each server config a fresh
redis-server is started; then, in the same process, a ``file://`` store with a budget of
the blocks that redis held at the end is fed the same requests (exact LRU: the baseline).

Configs: ``lru5`` allkeys-lru with redis's default ``maxmemory-samples 5``; ``lru10``,
``lru32``, ``lru64`` the same with 10, 32, 64 (redis's most); ``ttl`` volatile-ttl with
the store's ``ttl_s`` (a TTL that a hit does not refresh: first written, first evicted);
``lfu`` allkeys-lfu.

Then what sampling costs: puts of 32 KiB blocks, 32 a call, into one server that evicts
at every call, for 2 s at each ``maxmemory-samples`` in turn (three rounds), as GB/s and
as a ratio of the default 5's (``--no-put-cost`` skips it).

Why they differ: redis evicts single keys, the best of a few sampled, and a prompt's
blocks are touched together, so they tie; a sample that takes a chain's first block leaves
the rest stored but unreachable (a load stops at the first missing block). The file://
store's LRU is exact: a chain's first block is touched by every request that uses any of
it, so it goes last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import positive_int  # noqa: E402
from _cleanup import exit_on_sigterm, scratch_dir  # noqa: E402

from zkv import log as zlog  # noqa: E402
from zkv.storage import HEADER_SIZE, Store, open_store, pack_key  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
SAMPLES = (5, 10, 32, 64)  # the put cost table's maxmemory-samples, redis's default first
CONFIGS = {  # name: (maxmemory-policy, maxmemory-samples, store URL query)
    "lru5": ("allkeys-lru", 5, ""),
    "lru10": ("allkeys-lru", 10, ""),
    "lru32": ("allkeys-lru", 32, ""),
    "lru64": ("allkeys-lru", 64, ""),
    "ttl": ("volatile-ttl", 5, "?ttl_s=86400"),
    "lfu": ("allkeys-lfu", 5, ""),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--requests", type=positive_int, default=3000)
    p.add_argument("--pace-ms", type=float, default=20.0, help="between requests")
    p.add_argument("--payload", type=positive_int, default=4096, help="bytes per block")
    p.add_argument("--maxmemory", default="48mb", help="the redis server's maxmemory")
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS),
                   default=["lru5", "lru10", "lru32", "lru64", "ttl"])
    p.add_argument("--no-put-cost", action="store_true", help="skip the put cost table")
    return p.parse_args(argv)


def replay(store: Store, chains: list[list[bytes]], payload: int, pace_s: float) -> float:
    """The store hit ratio: blocks loaded from the start of each chain / blocks asked."""
    block = np.arange(payload, dtype=np.uint8)
    out = np.empty(payload, dtype=np.uint8)
    hits = asked = 0
    for chain in chains:
        t0 = time.monotonic()
        keys = [pack_key(d, 0) for d in chain]
        n = store.count_leading(chain, 1)
        got = store.get_many_into(keys[:n], [out] * n)
        loaded = next((i for i, ok in enumerate(got) if not ok), n)
        if loaded and not np.array_equal(out, block):
            raise AssertionError("a block came back changed")
        hits += loaded
        asked += len(chain)
        store.put_many(keys[loaded:], [block] * (len(keys) - loaded))
        left = pace_s - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)
    return hits / max(asked, 1)


def put_cost(server: Any, rounds: int = 3, seconds: float = 2.0) -> dict[int, list[float]]:
    """GB/s of puts into ``server`` (which evicts at every call) per maxmemory-samples."""
    block = np.random.default_rng(0).integers(0, 256, 32 << 10, dtype=np.uint8)
    admin = server.client()
    store = open_store(server.url, "put-cost", rank=0)
    out: dict[int, list[float]] = {n: [] for n in SAMPLES}
    i = 0
    try:
        for _ in range(rounds):
            for n in SAMPLES:
                admin.config_set("maxmemory-samples", n)
                t0, moved = time.perf_counter(), 0
                while time.perf_counter() - t0 < seconds:
                    keys = [pack_key((i + j).to_bytes(16, "big"), 0) for j in range(32)]
                    i += 32
                    moved += sum(store.put_many(keys, [block] * 32)) * block.nbytes
                out[n].append(moved / (time.perf_counter() - t0) / 1e9)
    finally:
        store.close()
        admin.close()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    zlog.configure("bench", level="error")
    from tests.servers import RedisServer

    with open(args.trace) as f:
        chains = [[int(h).to_bytes(16, "big") for h in json.loads(line)["hash_ids"]]
                  for line, _ in zip(f, range(args.requests))]
    unique = len({d for c in chains for d in c})
    print(f"{len(chains)} trace requests, {sum(map(len, chains))} blocks asked, {unique} "
          f"distinct; {args.payload} B a block; redis maxmemory {args.maxmemory}; "
          f"{args.pace_ms:g} ms between requests\n")
    print(f"  {'redis config':<40} {'blocks held':>11} {'redis hits':>10} "
          f"{'exact LRU':>9} {'ratio':>6}")
    with ExitStack() as stack:
        folder = stack.enter_context(scratch_dir("zkv-bench-redis-"))
        for i, name in enumerate(args.configs):
            policy, samples, query = CONFIGS[name]
            with RedisServer(os.path.join(folder, f"redis-{i}"), args.maxmemory,
                             policy=policy) as srv:
                admin = srv.client()
                admin.config_set("maxmemory-samples", samples)
                store = open_store(srv.url + query, f"ns{i}", rank=0)
                try:
                    redis_ratio = replay(store, chains, args.payload, args.pace_ms / 1e3)
                finally:
                    store.close()
                held = int(admin.dbsize())
                admin.close()
            budget = held * (HEADER_SIZE + args.payload)
            lru = open_store(f"file://{folder}/lru-{i}?max_bytes={budget}", f"ns{i}", rank=0)
            try:
                lru_ratio = replay(lru, chains, args.payload, 0.0)
            finally:
                lru.close()
            label = f"{policy}, maxmemory-samples {samples}{' + ttl_s' if query else ''}"
            print(f"  {label:<40} {held:>11} {redis_ratio:>10.3f} {lru_ratio:>9.3f} "
                  f"{redis_ratio / max(lru_ratio, 1e-9):>5.2f}x", flush=True)
        if not args.no_put_cost:
            with RedisServer(os.path.join(folder, "redis-put"), "64mb") as srv:
                cost = put_cost(srv)
            base = statistics.median(cost[SAMPLES[0]])
            print(f"\n  puts of 32 KiB blocks into a server evicting at every call "
                  f"(median of 3 x 2 s)\n  {'maxmemory-samples':<18} {'GB/s':>6} {'ratio':>6}")
            for n, runs in cost.items():
                print(f"  {n:<18} {statistics.median(runs):>6.3f} "
                      f"{statistics.median(runs) / base:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
