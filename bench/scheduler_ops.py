"""Scheduler hot path: CacheManager match + allocate + finish per request, vs a naive baseline.

    .venv/bin/python bench/scheduler_ops.py [--trace PATH] [--quick] [--profile] [--repeat N]

Two workloads, replayed one request at a time:

- ``chat``: multi-turn chat (deterministic seed). Every conversation starts with the same
  1,000-token system prompt; each turn appends a user message, the request is the whole
  history, then the assistant's answer is appended for the next turn. 40 conversations are
  interleaved at a time. Real token ids, 16-token blocks, hashed with ``hash_tokens``.
- ``trace``: ``../shared/traces/mooncake_synthetic_trace.jsonl`` (one id per 512-token
  block), hashed with ``hash_ids_chain``.

For device capacities 1,000 / 10,000 / 30,000 blocks, device-only and with a host tier 4x
the device (write_back), plus one write_through_selective run per workload. All block
hashes are computed before the replays; hashing is timed separately (us per block).

Per request the timed step is ``match_prefix``, ``allocate`` (``abort`` when it does not
fit), ``take_ops``/``on_ops_done`` (every op acked ok), ``finish``, ``take_ops``/
``on_ops_done``. Printed: thread CPU us per request and per block touched (the machine is
shared; wall time includes preemption), wall us per request (mean, p50, p99) and its split
by phase, hit ratio per tier.

Checks (exit 1 when one fails):
- the device-only hit ratio equals an independent reference simulation (LRU over trie
  leaves, ``bench/_sched_baseline.py``, no zkv code) within 0.005;
- ``check_invariants()`` holds at the end of every replay.

Baseline (same process, same requests, device-only rows): a dict of prefix hashes with a
Python list as LRU (``list.remove`` / ``append``), leaves-only eviction;
``speedup = baseline cpu / zkv cpu``. Its ``list.remove`` is O(cache size), so it stops
after ``--baseline-budget`` seconds per config and the ratio uses the same leading requests.

Targets (benchmark, not tests; 2-core machine): match+allocate+finish <= 1 us per block
touched; hashing <= 0.5 us per block. ``--quick`` replays a subset (CI smoke run, ~8 s).
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
from collections.abc import Callable
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
WTS_CAPACITY = 10_000        # the one write_through_selective config per workload
TOLERANCE = 0.005
TARGET_US_PER_BLOCK = 1.0
TARGET_HASH_US_PER_BLOCK = 0.5
QUICK_CHAT, QUICK_TRACE = 400, 800  # requests replayed with --quick

# chat workload
CHAT_SEED = 20240611
CHAT_BLOCK = 16
CHAT_SYSTEM = 1_000          # tokens of the shared system prompt
CHAT_CONVERSATIONS = 300
CHAT_ACTIVE = 40             # conversations interleaved at any time
CHAT_TURNS = (2, 10)         # turns per conversation, uniform in [lo, hi]
CHAT_USER = (40, 300)        # tokens per user message, uniform in [lo, hi)
CHAT_ASSISTANT = (60, 440)   # tokens per assistant answer, uniform in [lo, hi)
CHAT_VOCAB = 32_000
TRACE_BLOCK = 512


@dataclass
class Workload:
    name: str
    block_size: int
    hashes: list[list[bytes]]
    hash_fn: str
    hash_cpu_s: float        # best thread CPU time to hash every request
    hash_wall_s: float       # best wall time
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
    ns: np.ndarray           # wall ns of each request's step
    cpu: np.ndarray          # thread CPU stamp before each request, then one at the end
    phases: dict[str, int] = field(default_factory=dict)  # wall ns per phase, summed
    hit_dev: int = 0
    hit_host: int = 0
    fails: int = 0
    stats: dict[str, object] = field(default_factory=dict)
    base_ns: np.ndarray | None = None
    base_cpu: np.ndarray | None = None
    base_hit: int = -1       # -1: the baseline did not replay every request

    def cpu_ns(self, k: int | None = None) -> int:
        """Thread CPU time of the first ``k`` requests (all by default)."""
        return int(self.cpu[len(self.ns) if k is None else k] - self.cpu[0])


# ---------------------------------------------------------------------------- workloads


def make_chat(max_requests: int | None) -> Workload:
    """Deterministic multi-turn chat prompts (token id arrays), then their block hashes."""
    rng = np.random.default_rng(CHAT_SEED)

    def tokens(lo_hi: tuple[int, int]) -> np.ndarray:
        return rng.integers(0, CHAT_VOCAB, int(rng.integers(*lo_hi)), dtype=np.int32)

    system = rng.integers(0, CHAT_VOCAB, CHAT_SYSTEM, dtype=np.int32)
    prompts: list[np.ndarray] = []
    active: list[tuple[list[np.ndarray], list[int]]] = []  # (history chunks, [turns left])
    started = 0
    while active or started < CHAT_CONVERSATIONS:
        while len(active) < CHAT_ACTIVE and started < CHAT_CONVERSATIONS:
            active.append(([system], [int(rng.integers(CHAT_TURNS[0], CHAT_TURNS[1] + 1))]))
            started += 1
        j = int(rng.integers(len(active)))
        history, left = active[j]
        history.append(tokens(CHAT_USER))
        prompts.append(np.concatenate(history))
        history.append(tokens(CHAT_ASSISTANT))
        left[0] -= 1
        if left[0] == 0:
            active.pop(j)
        if max_requests is not None and len(prompts) >= max_requests:
            break
    hashes, cpu_s, wall_s = _timed_hashing(lambda: [hash_tokens(p, CHAT_BLOCK) for p in prompts])
    return Workload("chat", CHAT_BLOCK, hashes, "hash_tokens", cpu_s, wall_s,
                    float(np.mean([len(p) for p in prompts])))


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
    hashes, cpu_s, wall_s = _timed_hashing(lambda: [hash_ids_chain(x) for x in ids])
    return Workload("trace", TRACE_BLOCK, hashes, "hash_ids_chain", cpu_s, wall_s,
                    float(np.mean(tokens)))


def _timed_hashing(fn: Callable[[], list[list[bytes]]],
                   repeat: int = 3) -> tuple[list[list[bytes]], float, float]:
    """Every request's hashes, and the best thread-CPU and wall time of ``repeat`` passes
    (whole prompts hashed from the root, as a scheduler does for a new request)."""
    best_cpu = best_wall = float("inf")
    out: list[list[bytes]] = []
    for _ in range(repeat):
        gc.collect()
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn()
        best_wall = min(best_wall, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.thread_time() - c0)
    return out, best_cpu, best_wall


# ---------------------------------------------------------------------------- replays


class GcTimer:
    """Time spent in the cyclic GC while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.ns = 0
        self.collections = 0
        self._t0 = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            self.ns += time.perf_counter_ns() - self._t0
            self.collections += 1

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run_zkv(w: Workload, dev: int, host: int, policy: str, check: bool = True) -> Result:
    cm = CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host,
                                  block_size=w.block_size, write_policy=policy))
    bs = w.block_size
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns
    n = len(w.hashes)
    ns = np.empty(n, dtype=np.int64)
    cpu = np.empty(n + 1, dtype=np.int64)
    t_match = t_alloc = t_ops = t_finish = 0
    hit_dev = hit_host = fails = 0
    rids = [f"r{i}" for i in range(n)]
    match_prefix, allocate, finish, abort = cm.match_prefix, cm.allocate, cm.finish, cm.abort
    take_ops, on_ops_done = cm.take_ops, cm.on_ops_done
    gc.collect()
    with GcTimer() as gct:
        for i, hashes in enumerate(w.hashes):
            rid = rids[i]
            cpu[i] = cpu_clock()  # outside the wall interval: it costs ~1 us (a syscall)
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
        cpu[n] = cpu_clock()
    if check:
        cm.check_invariants()
        assert cm.num_running() == 0 and cm.num_pending_ops == 0
    phases = {"match": t_match, "alloc": t_alloc, "ops": t_ops, "finish": t_finish, "gc": gct.ns}
    return Result(w.name, dev, host, policy, n, w.num_blocks, ns, cpu, phases,
                  hit_dev, hit_host, fails, cm.snapshot())


def best_zkv(w: Workload, dev: int, host: int, policy: str, repeat: int, no_gc: bool) -> Result:
    """The fastest (thread CPU) of ``repeat`` identical replays; hits must be identical."""
    best = None
    for _ in range(repeat):
        if no_gc:
            gc.disable()
        try:
            r = run_zkv(w, dev, host, policy)
        finally:
            gc.enable()
        if best is not None:
            assert (r.hit_dev, r.hit_host, r.fails) == (best.hit_dev, best.hit_host, best.fails)
        if best is None or r.cpu_ns() < best.cpu_ns():
            best = r
    assert best is not None
    return best


def run_baseline(w: Workload, cap: int, repeat: int, budget_s: float, no_gc: bool,
                 r: Result) -> None:
    """List-LRU baseline on the same requests. The first pass stops after ``budget_s``; the
    speed ratio then compares the same leading requests (same state sequence for both)."""
    best_cpu: np.ndarray | None = None
    best_ns: np.ndarray | None = None
    limit = len(w.hashes)
    hits = -1
    for k in range(repeat):
        gc.collect()
        if no_gc:
            gc.disable()
        try:
            h, _total, _fails, ns, cpu = run_list_lru(
                w.hashes[:limit], cap, time.perf_counter_ns, time.thread_time_ns,
                budget_ns=int(budget_s * 1e9) if k == 0 else None)
        finally:
            gc.enable()
        limit = len(ns)
        c = np.asarray(cpu, dtype=np.int64)
        if best_cpu is None or c[-1] - c[0] < best_cpu[-1] - best_cpu[0]:
            best_cpu, best_ns, hits = c, np.asarray(ns, dtype=np.int64), h
    r.base_ns, r.base_cpu = best_ns, best_cpu
    r.base_hit = hits if limit == r.reqs else -1


# ---------------------------------------------------------------------------- output

POLICY_TAG = {"write_back": "wb", "write_through_selective": "wts", "write_through": "wt"}

HEADER = (
    f"{'':<23} {'---- cpu ----':>14}  {'-------- wall -------':>22}"
    f"  {'--- wall us/req by phase ----':>32}  {'---- hit ratio -----':>20}"
    f"  {'- baseline -':>15}\n"
    f"{'work':<6} {'device':>6} {'host':>7} {'pol':>3} {'us/req':>7} {'us/blk':>6}"
    f"  {'us/req':>7} {'p50':>6} {'p99':>7}"
    f"  {'match':>6} {'alloc':>6} {'ops':>5} {'finish':>6} {'(gc)':>5}"
    f"  {'dev':>5} {'host':>5} {'all':>5} {'nf':>2}  {'us/req':>7} {'speedup':>7}"
)


def fmt_row(r: Result) -> str:
    us = r.ns / 1e3
    ph = {k: v / 1e3 / r.reqs for k, v in r.phases.items()}
    hd, hh = r.hit_dev / r.blocks, r.hit_host / r.blocks
    if r.base_cpu is not None:
        nb = len(r.base_cpu) - 1
        base_req = (r.base_cpu[-1] - r.base_cpu[0]) / 1e3 / nb
        zkv_req = r.cpu_ns(nb) / 1e3 / nb
        part = "" if nb == r.reqs else f"  (first {nb:,} requests)"
        base = f"{base_req:>7.1f} {base_req / zkv_req:>6.1f}x{part}"
    else:
        base = f"{'-':>7} {'-':>7}"
    host = f"{r.host:,}" if r.host else "-"
    return (f"{r.workload:<6} {r.dev:>6,} {host:>7} {POLICY_TAG[r.policy]:>3}"
            f" {r.cpu_ns() / 1e3 / r.reqs:>7.1f} {r.cpu_ns() / 1e3 / r.blocks:>6.3f}"
            f"  {us.mean():>7.1f} {np.percentile(us, 50):>6.1f} {np.percentile(us, 99):>7.1f}"
            f"  {ph['match']:>6.1f} {ph['alloc']:>6.1f} {ph['ops']:>5.1f} {ph['finish']:>6.1f}"
            f" {ph['gc']:>5.1f}  {hd:>5.3f} {hh:>5.3f} {hd + hh:>5.3f} {r.fails:>2}  {base}")


LEGEND = """\
  step = match_prefix + allocate (abort if None) + take_ops/on_ops_done + finish +
         take_ops/on_ops_done, one request at a time, every op acked ok.
  cpu: thread CPU time of the replay loop per request and per block touched (not inflated
       by preemption on this shared machine; includes ~1-2 us/request of loop overhead).
  wall: perf_counter per step: mean, p50, p99 (p99 includes preemption, ~4 ms ticks).
  by phase: wall us per request; alloc includes eviction; ops = take_ops + on_ops_done;
       (gc) = cyclic GC pauses inside the steps (part of the other columns).
  hit ratio: blocks hit on device / host over blocks asked; nf = allocate() returned None.
  pol: wb = write_back, wts = write_through_selective (threshold 2).
  baseline: dict of prefix hashes + Python list LRU (list.remove/append), leaves-only
       eviction, device-only, same requests (a leading prefix when it ran out of its time
       budget), cpu us/req; speedup = baseline cpu / zkv cpu over the same requests."""


def _pstats_table(prof: cProfile.Profile, sort: str, *restrict: object) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(*restrict)
    text = s.getvalue()
    start = text.find("   ncalls")
    return text[start:].rstrip() if start >= 0 else text


def profile_trace(w: Workload, dev: int, host: int) -> None:
    prof = cProfile.Profile()
    gc.collect()
    prof.enable()
    r = run_zkv(w, dev, host, "write_back", check=False)
    prof.disable()
    label = f"device {dev:,}" + (f" + host {host:,}" if host else ", device-only")
    print(f"\n--- cProfile of the zkv replay: trace, {label}, write_back"
          f" ({r.stats['evicted_device']} device evictions) ---")
    print("top functions by own time:")
    print(_pstats_table(prof, "tottime", 20))
    print("entry points by cumulative time:")
    print(_pstats_table(prof, "cumtime",
                        r"manager.py.*\((match_prefix|allocate|finish|take_ops|on_ops_done|"
                        r"_evict_device|_insert_path|_drop_subtree|_take_host_block|"
                        r"num_blocks_needed)\)"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="mooncake-style JSONL trace")
    ap.add_argument("--quick", action="store_true", help="subset of requests (CI smoke run)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="replays per config, the fastest is reported (default 2; 1 with --quick)")
    ap.add_argument("--baseline-budget", type=float, default=None,
                    help="seconds the baseline may spend per config before it stops"
                         " (default 3; 0.5 with --quick)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the list-LRU baseline")
    ap.add_argument("--no-gc", action="store_true", help="disable the cyclic GC during replays")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile the zkv replay of the trace at 10,000 device blocks")
    args = ap.parse_args()
    repeat = max(1, args.repeat if args.repeat is not None else 1 if args.quick else 2)
    budget = args.baseline_budget if args.baseline_budget is not None else (
        0.5 if args.quick else 3.0)

    t_start = time.perf_counter()
    workloads = [make_chat(QUICK_CHAT if args.quick else None),
                 make_trace(args.trace, QUICK_TRACE if args.quick else None)]

    print(f"zkv scheduler_ops bench  (python {sys.version.split()[0]}, {os.cpu_count()} cpus,"
          f" best of {repeat}{', quick' if args.quick else ''}{', gc off' if args.no_gc else ''})")
    print("\nworkloads (every hash computed before the replays; hashing: best of 3 passes):")
    for w in workloads:
        n = len(w.hashes)
        hus = w.hash_cpu_s * 1e6 / w.num_blocks
        tag = "met" if hus <= TARGET_HASH_US_PER_BLOCK else "MISSED"
        uniq = len({h for hs in w.hashes for h in hs})
        print(f"  {w.name:<6} {n:>5} requests, {w.num_blocks:>7,} blocks of {w.block_size:>3}"
              f" tokens ({w.num_blocks / n:.1f} blocks, {w.tokens_per_req:,.0f} tokens"
              f" per request), {uniq:,} distinct blocks")
        print(f"         hashing ({w.hash_fn}): cpu {hus:.3f} us/block"
              f" (wall {w.hash_wall_s * 1e6 / w.num_blocks:.3f}), {w.hash_cpu_s * 1e6 / n:.1f}"
              f" us/request  [target <= {TARGET_HASH_US_PER_BLOCK} us/block: {tag}]")

    results: list[Result] = []
    checks: list[tuple[str, int, float, float, float | None]] = []
    print("\n" + HEADER)
    for w in workloads:
        configs = [(c, h, "write_back") for c in CAPACITIES for h in (0, HOST_FACTOR * c)]
        configs.append((WTS_CAPACITY, HOST_FACTOR * WTS_CAPACITY, "write_through_selective"))
        for cap, host, policy in configs:
            r = best_zkv(w, cap, host, policy, repeat, args.no_gc)
            if host == 0 and not args.no_baseline:
                run_baseline(w, cap, repeat, budget, args.no_gc, r)
            results.append(r)
            print(fmt_row(r), flush=True)
            if host == 0:
                ref_hit, ref_total = reference_lru_hits(w.hashes, cap)  # not timed
                base = r.base_hit / r.blocks if r.base_hit >= 0 else None
                checks.append((w.name, cap, r.hit_dev / r.blocks, ref_hit / ref_total, base))
    print("\n" + LEGEND)

    print(f"\nhit ratio check, device-only vs reference LRU over trie leaves"
          f" (tolerance {TOLERANCE}):")
    print(f"  {'work':<6} {'device':>7}  {'zkv':>7} {'reference':>9} {'diff':>8}  {'baseline':>8}")
    bad = False
    for name, cap, z, ref, base in checks:
        diff = z - ref
        ok = abs(diff) <= TOLERANCE
        bad |= not ok
        b = "-" if base is None else f"{base:.4f}"
        print(f"  {name:<6} {cap:>7,}  {z:>7.4f} {ref:>9.4f} {diff:>+8.4f}  {b:>8}"
              f"  {'OK' if ok else 'FAIL'}")

    print(f"\nspeed vs target (cpu <= {TARGET_US_PER_BLOCK} us per block touched):")
    for r in results:
        per_block = r.cpu_ns() / 1e3 / r.blocks
        tag = "met" if per_block <= TARGET_US_PER_BLOCK else "MISSED"
        st = r.stats
        print(f"  {r.workload:<6} {r.dev:>6,} / {r.host:>7,} {POLICY_TAG[r.policy]:>3}"
              f"  {per_block:.3f} us/block [{tag}]  evicted_device={st['evicted_device']}"
              f" swapped_out={st['swapped_out']} swapped_in={st['swapped_in']}"
              f" backed_up={st['backed_up']} dropped={st['dropped']}")

    if args.profile:
        trace = next(w for w in workloads if w.name == "trace")
        profile_trace(trace, 10_000, 0)
        profile_trace(trace, 10_000, HOST_FACTOR * 10_000)

    print(f"\ntotal bench time {time.perf_counter() - t_start:.1f} s")
    if bad:
        print(f"FAIL: device-only hit ratio differs from the reference LRU by more than"
              f" {TOLERANCE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
