"""Scheduler hot path: CacheManager match + allocate + finish per request, vs a naive baseline.

    .venv/bin/python bench/scheduler_ops.py [--trace PATH] [--quick] [--profile] [--no-gc]

Two workloads, replayed one request at a time:

- ``chat``: multi-turn chat (deterministic seed). Every conversation starts with the same
  1,000-token system prompt; each turn appends a user message, the request is the whole
  history, then the assistant's answer is appended for the next turn. Real token ids,
  16-token blocks, hashed with ``hash_tokens``.
- ``trace``: ``../shared/traces/mooncake_synthetic_trace.jsonl`` (one id per 512-token
  block), hashed with ``hash_ids_chain``.

For device capacities 1,000 / 10,000 / 30,000 blocks, device-only and with a host tier 4x
the device (write_back), plus one write_through_selective run per workload. All block
hashes are computed before the replay; hashing is timed separately (us per block).

Per request the timed step is ``match_prefix``, ``allocate`` (``abort`` when it does not
fit), ``take_ops``/``on_ops_done`` (every op acked ok), ``finish``, ``take_ops``/
``on_ops_done``. Printed: us per request (mean, p50, p99), us per block touched, a split of
the mean by phase, hit ratio per tier.

Checks (exit 1 when one fails):
- the device-only hit ratio equals an independent reference simulation (LRU over trie
  leaves, ``bench/_sched_baseline.py``) within 0.005;
- ``check_invariants()`` holds at the end of every run.

Baseline (same process, same requests, device-only rows): a dict of prefix hashes with a
Python list as LRU (``list.remove`` / ``append``), leaves-only eviction;
``speedup = baseline us / zkv us``.

Targets (benchmark, not tests; 2-core machine): match+allocate+finish <= 1 us per block
touched; hashing <= 0.5 us per block. ``--quick`` replays a subset (CI smoke run, a few s).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _sched_baseline import reference_lru_hits, run_list_lru  # noqa: E402

from zkv.protocol import OpResult  # noqa: E402
from zkv.scheduler.hashing import hash_ids_chain, hash_tokens  # noqa: E402
from zkv.scheduler.manager import CacheConfig, CacheManager  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.join(REPO, "..", "shared", "traces", "mooncake_synthetic_trace.jsonl")
CAPACITIES = (1_000, 10_000, 30_000)
HOST_FACTOR = 4
TOLERANCE = 0.005
TARGET_US_PER_BLOCK = 1.0
TARGET_HASH_US_PER_BLOCK = 0.5

# chat workload
CHAT_SEED = 20240611
CHAT_BLOCK = 16
CHAT_SYSTEM = 1_000          # tokens of the shared system prompt
CHAT_CONVERSATIONS = 400
CHAT_ACTIVE = 48             # conversations interleaved at any time
CHAT_TURNS = (2, 10)         # turns per conversation, uniform in [lo, hi]
CHAT_USER = (40, 360)        # tokens per user message, uniform
CHAT_ASSISTANT = (80, 520)   # tokens per assistant answer, uniform
CHAT_VOCAB = 32_000
TRACE_BLOCK = 512


@dataclass
class Workload:
    name: str
    block_size: int
    hashes: list[list[bytes]]
    hash_s: float            # time spent hashing every request
    tokens_per_req: float

    @property
    def num_blocks(self) -> int:
        return sum(len(h) for h in self.hashes)


@dataclass
class Result:
    workload: str
    dev: int
    host: int
    policy: str
    reqs: int
    blocks: int
    ns: np.ndarray                     # per-request timed step
    phases: dict[str, int] = field(default_factory=dict)  # total ns per phase
    hit_dev: int = 0
    hit_host: int = 0
    fails: int = 0
    stats: dict[str, object] = field(default_factory=dict)
    base_ns: np.ndarray | None = None
    base_hit: int = 0


# ---------------------------------------------------------------------------- workloads


def make_chat(max_requests: int | None) -> Workload:
    """Deterministic multi-turn chat prompts (token id arrays), then their block hashes."""
    rng = np.random.default_rng(CHAT_SEED)
    system = rng.integers(0, CHAT_VOCAB, CHAT_SYSTEM, dtype=np.int32)
    prompts: list[np.ndarray] = []
    active: list[list] = []  # [history token chunks, turns left]
    started = 0
    while active or started < CHAT_CONVERSATIONS:
        while len(active) < CHAT_ACTIVE and started < CHAT_CONVERSATIONS:
            active.append([[system], int(rng.integers(CHAT_TURNS[0], CHAT_TURNS[1] + 1))])
            started += 1
        j = int(rng.integers(len(active)))
        conv = active[j]
        conv[0].append(rng.integers(0, CHAT_VOCAB, int(rng.integers(*CHAT_USER)), dtype=np.int32))
        prompts.append(np.concatenate(conv[0]))
        conv[0].append(rng.integers(0, CHAT_VOCAB, int(rng.integers(*CHAT_ASSISTANT)), dtype=np.int32))
        conv[1] -= 1
        if conv[1] == 0:
            active.pop(j)
        if max_requests is not None and len(prompts) >= max_requests:
            break
    t0 = time.perf_counter()
    hashes = [hash_tokens(p, CHAT_BLOCK) for p in prompts]
    hash_s = time.perf_counter() - t0
    return Workload("chat", CHAT_BLOCK, hashes, hash_s, float(np.mean([len(p) for p in prompts])))


def make_trace(path: str, max_requests: int | None) -> Workload:
    ids: list[list[int]] = []
    tokens = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            ids.append(rec["hash_ids"])
            tokens.append(rec["input_length"])
            if max_requests is not None and len(ids) >= max_requests:
                break
    t0 = time.perf_counter()
    hashes = [hash_ids_chain(x) for x in ids]
    hash_s = time.perf_counter() - t0
    return Workload("trace", TRACE_BLOCK, hashes, hash_s, float(np.mean(tokens)))


# ---------------------------------------------------------------------------- replays


def run_zkv(w: Workload, dev: int, host: int, policy: str) -> Result:
    cm = CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host,
                                  block_size=w.block_size, write_policy=policy))
    bs = w.block_size
    clock = time.perf_counter_ns
    n = len(w.hashes)
    ns = np.empty(n, dtype=np.int64)
    t_match = t_alloc = t_ops = t_finish = 0
    hit_dev = hit_host = fails = 0
    rids = [f"r{i}" for i in range(n)]
    match_prefix, allocate, finish, abort = cm.match_prefix, cm.allocate, cm.finish, cm.abort
    take_ops, on_ops_done = cm.take_ops, cm.on_ops_done
    for i, hashes in enumerate(w.hashes):
        rid = rids[i]
        t0 = clock()
        m = match_prefix(rid, hashes)
        t1 = clock()
        table = allocate(rid, len(hashes) * bs)
        t2 = clock()
        ops = take_ops()
        if ops:
            on_ops_done([OpResult(op.id, True, op.num_blocks) for op in ops])
        t3 = clock()
        if table is None:
            abort(rid)
        else:
            finish(rid)
        t4 = clock()
        ops = take_ops()
        if ops:
            on_ops_done([OpResult(op.id, True, op.num_blocks) for op in ops])
        t5 = clock()
        ns[i] = t5 - t0
        t_match += t1 - t0
        t_alloc += t2 - t1
        t_ops += (t3 - t2) + (t5 - t4)
        t_finish += t4 - t3
        hit_dev += m.num_device
        hit_host += m.num_host
        fails += table is None
    cm.check_invariants()
    assert cm.num_running() == 0 and cm.num_pending_ops == 0
    snap = cm.snapshot()
    return Result(w.name, dev, host, policy, n, w.num_blocks, ns,
                  {"match": t_match, "alloc": t_alloc, "ops": t_ops, "finish": t_finish},
                  hit_dev, hit_host, fails, snap)


# ---------------------------------------------------------------------------- output


def fmt_row(r: Result) -> str:
    us = r.ns / 1e3
    mean = us.mean()
    per_block = r.ns.sum() / 1e3 / r.blocks
    ph = {k: v / 1e3 / r.reqs for k, v in r.phases.items()}
    hd, hh = r.hit_dev / r.blocks, r.hit_host / r.blocks
    if r.base_ns is not None:
        base_mean = r.base_ns.mean() / 1e3
        base = f"{base_mean:>9.1f} {base_mean / mean:>7.1f}x"
    else:
        base = f"{'-':>9} {'-':>8}"
    host = f"{r.host:,}" if r.host else "-"
    pol = {"write_back": "wb", "write_through_selective": "wts", "write_through": "wt"}[r.policy]
    return (f"{r.workload:<6} {r.dev:>7,} {host:>8} {pol:>4} {mean:>8.1f} {np.percentile(us, 50):>7.1f}"
            f" {np.percentile(us, 99):>7.1f} {per_block:>6.3f}  {ph['match']:>6.1f} {ph['alloc']:>6.1f}"
            f" {ph['ops']:>6.1f} {ph['finish']:>6.1f}  {hd:>6.3f} {hh:>6.3f} {hd + hh:>6.3f} {r.fails:>5}"
            f"  {base}")


HEADER = (f"{'work':<6} {'device':>7} {'host':>8} {'pol':>4} {'us/req':>8} {'p50':>7} {'p99':>7}"
          f" {'us/blk':>6}  {'match':>6} {'alloc':>6} {'ops':>6} {'finish':>6}  {'hitD':>6} {'hitH':>6}"
          f" {'hitAll':>6} {'fails':>5}  {'base us':>9} {'speedup':>8}")


def profile_trace(w: Workload, dev: int, host: int) -> None:
    prof = cProfile.Profile()
    gc.collect()
    prof.enable()
    run_zkv(w, dev, host, "write_back")
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(22)
    label = f"device {dev:,}" + (f" + host {host:,}" if host else ", device-only")
    print(f"\n--- cProfile, trace, {label} (tottime; includes check_invariants once) ---")
    # strip the pstats preamble down to the table
    text = s.getvalue()
    start = text.find("   ncalls")
    print(text[start:].rstrip() if start >= 0 else text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="mooncake-style JSONL trace")
    ap.add_argument("--quick", action="store_true", help="subset of requests (CI smoke run)")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile the zkv replay of the trace at 10,000 device blocks")
    ap.add_argument("--no-gc", action="store_true", help="disable the cyclic GC during replays")
    ap.add_argument("--no-baseline", action="store_true", help="skip the list-LRU baseline")
    args = ap.parse_args()

    limit_trace = 800 if args.quick else None
    limit_chat = 400 if args.quick else None
    t_start = time.perf_counter()
    workloads = [make_chat(limit_chat), make_trace(args.trace, limit_trace)]

    print(f"zkv scheduler_ops bench  (python {sys.version.split()[0]}, {os.cpu_count()} cpus"
          f"{', quick' if args.quick else ''}{', gc off' if args.no_gc else ''})")
    print("\nworkloads (all hashes computed before the replays):")
    hash_fail = False
    for w in workloads:
        hus = w.hash_s * 1e6 / w.num_blocks
        fn = "hash_tokens" if w.name == "chat" else "hash_ids_chain"
        ok = hus <= TARGET_HASH_US_PER_BLOCK
        hash_fail |= not ok
        uniq = len({h for hs in w.hashes for h in hs})
        print(f"  {w.name:<6} {len(w.hashes):>5} requests, {w.num_blocks:>7,} blocks of {w.block_size:>3}"
              f" tokens ({w.num_blocks / len(w.hashes):.1f} blocks, {w.tokens_per_req:,.0f} tokens/request),"
              f" {uniq:,} distinct blocks;  hashing ({fn}): {hus:.3f} us/block"
              f" [target <= {TARGET_HASH_US_PER_BLOCK}: {'met' if ok else 'MISSED'}]")

    results: list[Result] = []
    checks: list[tuple[str, int, float, float, float | None]] = []
    print("\n" + HEADER)
    for w in workloads:
        # the reference simulation (not timed), device-only
        for cap in CAPACITIES:
            for host in (0, HOST_FACTOR * cap):
                gc.collect()
                if args.no_gc:
                    gc.disable()
                try:
                    r = run_zkv(w, cap, host, "write_back")
                    if host == 0 and not args.no_baseline:
                        gc.collect()
                        bh, _bt, _bf, bns = run_list_lru(w.hashes, cap, time.perf_counter_ns)
                        r.base_ns = np.asarray(bns, dtype=np.int64)
                        r.base_hit = bh
                finally:
                    gc.enable()
                results.append(r)
                print(fmt_row(r), flush=True)
                if host == 0:
                    ref_hit, ref_total = reference_lru_hits(w.hashes, cap)
                    checks.append((w.name, cap, r.hit_dev / r.blocks, ref_hit / ref_total,
                                   None if r.base_ns is None else r.base_hit / r.blocks))
        cap = 10_000
        gc.collect()
        if args.no_gc:
            gc.disable()
        try:
            r = run_zkv(w, cap, HOST_FACTOR * cap, "write_through_selective")
        finally:
            gc.enable()
        results.append(r)
        print(fmt_row(r), flush=True)

    print("\n  us/req = match+allocate+finish incl. take_ops/on_ops_done (mean); match/alloc/ops/finish"
          " = mean us per request by phase; hitD/hitH = blocks hit on device/host over blocks asked;"
          " pol wb = write_back, wts = write_through_selective (threshold 2); base = dict + list-LRU"
          " baseline, device-only; speedup = base us / zkv us.")

    print("\nhit ratio check, device-only vs reference LRU over trie leaves (tolerance"
          f" {TOLERANCE}):")
    print(f"  {'work':<6} {'device':>7}  {'zkv':>7} {'reference':>9} {'diff':>8}  {'baseline':>8}")
    bad = False
    for name, cap, z, ref, base in checks:
        diff = z - ref
        ok = abs(diff) <= TOLERANCE
        bad |= not ok
        b = "-" if base is None else f"{base:.4f}"
        print(f"  {name:<6} {cap:>7,}  {z:>7.4f} {ref:>9.4f} {diff:>+8.4f}  {b:>8}  {'OK' if ok else 'FAIL'}")

    print("\nspeed vs target (<= 1 us per block touched):")
    for r in results:
        per_block = r.ns.sum() / 1e3 / r.blocks
        tag = "met" if per_block <= TARGET_US_PER_BLOCK else "MISSED"
        print(f"  {r.workload:<6} device {r.dev:>6,} host {r.host:>7,} {r.policy:<24}"
              f" {per_block:.3f} us/block  [{tag}]  evicted_device={r.stats['evicted_device']}"
              f" swapped_out={r.stats['swapped_out']} swapped_in={r.stats['swapped_in']}"
              f" backed_up={r.stats['backed_up']} dropped={r.stats['dropped']}")

    if args.profile:
        trace = next(w for w in workloads if w.name == "trace")
        profile_trace(trace, 10_000, 0)
        profile_trace(trace, 10_000, HOST_FACTOR * 10_000)

    print(f"\ntotal bench time {time.perf_counter() - t_start:.1f} s")
    if bad:
        print("FAIL: device-only hit ratio differs from the reference LRU by more than"
              f" {TOLERANCE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
