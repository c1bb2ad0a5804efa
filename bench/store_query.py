"""The scheduler's L3 existence query per backend, against querying every key at once.

    .venv/bin/python bench/store_query.py [--blocks 256] [--reps 15] [--dir DIR]

The query runs inside the engine's scheduling step, once per new prompt: how many leading
blocks of the prompt every rank can load. Measured in one process, interleaved, median
milliseconds per prompt of ``--blocks`` blocks at 1 and 8 ranks (TP), three cases:

    miss     the prompt's first block is not in the store (most new prompts)
    hit 3/4  the first three quarters are there for every rank
    hit all  every block is there

    baseline   one ``exists`` over every block's key of every rank, then the leading count
               in Python: what zkv's query did before (and the least a query that does not
               stop at the first miss costs)
    zkv        ``leading_present`` (``Store.count_leading``): a ``stat`` per key up to the
               first miss (file://), one Lua script that stops at the first miss on the
               server (redis://), ``exists`` on the first 8 blocks, then on the rest if
               those were all there (mooncake://)

``x faster`` = baseline / zkv. Both give the same count (checked). Servers are started here
(redis-server, a Mooncake master + holder on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import directory, positive_int  # noqa: E402
from _cleanup import exit_on_sigterm  # noqa: E402

from zkv.storage import Store, file_url, leading_present, open_store, pack_key  # noqa: E402


def old_query(store: Store, hashes: list[bytes], w: int) -> int:
    """Every key in one ``exists``, then the leading count (the query before this bench)."""
    found = store.exists([pack_key(h, r) for h in hashes for r in range(w)])
    n = 0
    while n < len(hashes) and all(found[n * w : (n + 1) * w]):
        n += 1
    return n


def timed(fns: list[Callable[[], int]], reps: int) -> list[tuple[float, int]]:
    """Median ms and the result of each of ``fns``, called in turns (one rep of each)."""
    times: list[list[float]] = [[] for _ in fns]
    results = [-1] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            results[i] = fn()
            times[i].append(time.perf_counter() - t0)
    return [(statistics.median(t) * 1e3, r) for t, r in zip(times, results)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=positive_int, default=256, help="blocks per prompt")
    p.add_argument("--reps", type=positive_int, default=15)
    p.add_argument("--dir", type=directory,
                   default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    args = p.parse_args(argv)
    exit_on_sigterm()
    from tests.servers import MooncakeServer, RedisServer

    n = args.blocks
    hashes = [i.to_bytes(16, "big") for i in range(1, n + 1)]
    cases = {"miss": 0, "hit 3/4": 3 * n // 4, "hit all": n}
    block = np.zeros(4096, np.uint8)
    print(f"L3 existence query, one prompt of {n} blocks, median of {args.reps} (ms)")
    print(f"{'store':<10} {'ranks':>5} {'case':<8} {'baseline':>9} {'zkv':>8} {'x faster':>8}")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder, ExitStack() as stack:
        urls = {"file://": file_url(os.path.join(folder, "l3")),
                "redis://": stack.enter_context(RedisServer(os.path.join(folder, "r"))).url,
                "mooncake://": stack.enter_context(MooncakeServer(os.path.join(folder, "m"))).url}
        for name, url in urls.items():
            for w in (1, 8):
                store = open_store(url, f"q{w}")
                stack.callback(store.close)
                for h in hashes[: 3 * n // 4]:
                    store.put_many([pack_key(h, r) for r in range(w)], [block] * w)
                for case, present in cases.items():
                    hs = hashes if present else [b"\xff" * 16] + hashes[1:]
                    if case == "hit all":
                        for h in hashes[3 * n // 4 :]:
                            store.put_many([pack_key(h, r) for r in range(w)], [block] * w)
                    (base_ms, base_n), (zkv_ms, zkv_n) = timed(
                        [lambda s=store, hs=hs, w=w: old_query(s, hs, w),
                         lambda s=store, hs=hs, w=w: leading_present(s, hs, w)], args.reps)
                    assert base_n == zkv_n == present, (name, w, case, base_n, zkv_n)
                    print(f"{name:<10} {w:>5} {case:<8} {base_ms:>9.2f} {zkv_ms:>8.2f}"
                          f" {base_ms / zkv_ms:>7.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
