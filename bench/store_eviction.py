"""What zkv can still load from an L3 server that evicts when full (redis under ``maxmemory``,
a Mooncake master), as a ratio of an exact LRU of the same number of blocks (the
``file://`` store's), on the bundled trace.

    .venv/bin/python bench/store_eviction.py [--requests 3000] [--pace-ms 20]
        [--maxmemory 48mb] [--segment-mb 44] [--configs lru5 lru10 lru32 lru64 ttl mooncake]

Each request makes the store calls one rank's scheduler and worker make: ``count_leading``
over its chain of block hashes, a get of the blocks found, a put of the rest. Requests are
``--pace-ms`` apart: redis's LRU clock ticks once a second, so a run squeezed in time ties
every key's idle time and redis evicts at random. For each server config a fresh server
is started; then, in the same process, a ``file://`` store with a budget of the blocks the
server held is fed the same requests (exact LRU: the baseline). Redis: the keys at the
end; Mooncake, whose batch eviction makes the count swing: the mean of the master's
``master_key_count`` sampled every 10 requests once the first third had filled it.
Refused puts (the server full and not evicting in time) are counted.

Configs: ``lru5`` allkeys-lru with redis's default ``maxmemory-samples 5``; ``lru10``,
``lru32``, ``lru64`` the same with 10, 32, 64 (redis's most); ``ttl`` volatile-ttl with
the store's ``ttl_s`` (a TTL that a hit does not refresh: first written, first evicted);
``lfu`` allkeys-lfu; ``mooncake`` a master with its default eviction (lease order,
``--segment-mb`` of memory on one holder).

Then what sampling costs: puts of 32 KiB blocks, 32 a call, into one server that evicts
at every call, for 2 s at each ``maxmemory-samples`` in turn (three rounds), as GB/s and
as a ratio of the default 5's (``--no-put-cost`` skips it).

Why they differ: redis evicts single keys, the best of a few sampled, and a prompt's
blocks are touched together, so they tie; a sample that takes a chain's first block leaves
the rest stored but unreachable (a load stops at the first missing block). The file://
store's LRU is exact: a chain's first block is touched by every request that uses any of
it, so it goes last. Mooncake evicts the objects whose lease is oldest, and every
existence query and get renews it: close to the exact LRU.
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

from _args import DEFAULT_TRACE, existing_file, positive_int, redis_memory  # noqa: E402
from _cleanup import exit_on_sigterm, scratch_dir  # noqa: E402

from zkv import log as zlog  # noqa: E402
from zkv.argtypes import nonneg_float  # noqa: E402
from zkv.storage import HEADER_SIZE, Store, file_url, open_store, pack_key  # noqa: E402

SAMPLES = (5, 10, 32, 64)  # the put cost table's maxmemory-samples, redis's default first
CONFIGS = {  # name: (maxmemory-policy, maxmemory-samples, store URL query)
    "lru5": ("allkeys-lru", 5, ""),
    "lru10": ("allkeys-lru", 10, ""),
    "lru32": ("allkeys-lru", 32, ""),
    "lru64": ("allkeys-lru", 64, ""),
    "ttl": ("volatile-ttl", 5, "?ttl_s=86400"),
    "lfu": ("allkeys-lfu", 5, ""),
    "mooncake": ("", 0, ""),
}


def segment_mb(s: str) -> int:
    n = positive_int(s)
    if n < 16:  # mooncake_client aborts below ("Total size must be at least 16777216")
        raise argparse.ArgumentTypeError(f"must be >= 16 (Mooncake's least), got {s}")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=existing_file, default=DEFAULT_TRACE)
    p.add_argument("--requests", type=positive_int, default=3000)
    p.add_argument("--pace-ms", type=nonneg_float, default=20.0, help="between requests")
    p.add_argument("--payload", type=positive_int, default=4096, help="bytes per block")
    p.add_argument("--maxmemory", type=redis_memory, default="48mb",
                   help="the redis server's maxmemory (> 0)")
    p.add_argument("--segment-mb", type=segment_mb, default=44,
                   help="the Mooncake holder's memory (at least 16)")
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS),
                   default=["lru5", "lru10", "lru32", "lru64", "ttl", "mooncake"])
    p.add_argument("--no-put-cost", action="store_true", help="skip the put cost table")
    return p.parse_args(argv)


class Replay:
    """One pass of the requests through a store: hit ratio and refused puts."""

    def __init__(self, store: Store, payload: int, pace_s: float,
                 probe: Any = None) -> None:
        self.store, self.payload, self.pace_s, self.probe = store, payload, pace_s, probe
        self.hits = self.asked = self.refused = 0
        self.samples: list[int] = []  # ``probe()`` every 10 requests

    def run(self, chains: list[list[bytes]]) -> Replay:
        store, block = self.store, np.arange(self.payload, dtype=np.uint8)
        out = np.empty(self.payload, dtype=np.uint8)
        for i, chain in enumerate(chains):
            t0 = time.monotonic()
            keys = [pack_key(d, 0) for d in chain]
            n = store.count_leading(chain, 1)
            got = store.get_many_into(keys[:n], [out] * n)
            loaded = next((j for j, ok in enumerate(got) if not ok), n)
            if loaded and not np.array_equal(out, block):
                raise AssertionError("a block came back changed")
            self.hits += loaded
            self.asked += len(chain)
            self.refused += store.put_many(keys[loaded:],
                                           [block] * (len(keys) - loaded)).count(False)
            if self.probe is not None and i % 10 == 0:
                self.samples.append(self.probe())
            left = self.pace_s - (time.monotonic() - t0)
            if left > 0:
                time.sleep(left)
        return self

    @property
    def ratio(self) -> float:
        """Blocks loaded from the start of each chain / blocks asked."""
        return self.hits / max(self.asked, 1)


def mooncake_keys(server: Any) -> int:
    """The master's ``master_key_count`` (its Prometheus endpoint)."""
    import urllib.request

    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("master_key_count "):
                return int(float(line.split()[1]))
    raise AssertionError("the master reports no master_key_count")


def through_server(name: str, folder: str, chains: list[list[bytes]],
                   args: argparse.Namespace) -> tuple[str, int, Replay]:
    """(label, blocks held, replay) of one server config."""
    from tests.servers import MooncakeServer, RedisServer

    pace = args.pace_ms / 1e3
    if name == "mooncake":
        with MooncakeServer(folder, args.segment_mb) as srv:
            store = open_store(srv.url, name, rank=0)
            try:
                run = Replay(store, args.payload, pace, lambda: mooncake_keys(srv)).run(chains)
            finally:
                store.close()
        warm = run.samples[len(run.samples) // 3:] or run.samples
        return (f"mooncake master, {args.segment_mb} MB segment", int(statistics.mean(warm)),
                run)
    policy, samples, query = CONFIGS[name]
    with RedisServer(folder, args.maxmemory, policy=policy) as srv:
        admin = srv.client()
        try:
            admin.config_set("maxmemory-samples", samples)
            store = open_store(srv.url + query, name, rank=0)
            try:
                run = Replay(store, args.payload, pace).run(chains)
            finally:
                store.close()
            held = int(admin.dbsize())
        finally:
            admin.close()
    return f"redis {policy}, maxmemory-samples {samples}{' + ttl_s' if query else ''}", held, run


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
          f"distinct; {args.payload} B a block; redis maxmemory {args.maxmemory}, Mooncake "
          f"segment {args.segment_mb} MB; {args.pace_ms:g} ms between requests\n")
    print(f"  {'server config':<46} {'held':>6} {'hits':>6} {'exact LRU':>9} {'ratio':>6} "
          f"{'refused puts':>12}")
    with ExitStack() as stack:
        folder = stack.enter_context(scratch_dir("zkv-bench-eviction-"))
        for i, name in enumerate(args.configs):
            label, held, run = through_server(name, os.path.join(folder, f"server-{i}"),
                                              chains, args)
            budget = max(1, held) * (HEADER_SIZE + args.payload)
            lru = open_store(f"{file_url(os.path.join(folder, f'lru-{i}'))}?max_bytes={budget}",
                             name, rank=0)
            try:
                base = Replay(lru, args.payload, 0.0).run(chains)
            finally:
                lru.close()
            print(f"  {label:<46} {held:>6} {run.ratio:>6.3f} {base.ratio:>9.3f} "
                  f"{run.ratio / max(base.ratio, 1e-9):>5.2f}x {run.refused:>12}", flush=True)
        if not args.no_put_cost:
            with RedisServer(os.path.join(folder, "redis-put"), "64mb") as srv:
                cost = put_cost(srv)
            base_gbs = statistics.median(cost[SAMPLES[0]])
            print(f"\n  redis puts of 32 KiB blocks into a server evicting at every call "
                  f"(median of 3 x 2 s)\n  {'maxmemory-samples':<18} {'GB/s':>6} {'ratio':>6}")
            for n, runs in cost.items():
                print(f"  {n:<18} {statistics.median(runs):>6.3f} "
                      f"{statistics.median(runs) / base_gbs:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
