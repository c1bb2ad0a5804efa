"""Scheduler hot path: CacheManager per request, hashing included, vs a simple prefix cache.

    .venv/bin/python bench/scheduler_ops.py [--quick] [--repeat N] [--trace PATH]

Requests arrive as Python lists of ints, as an engine has them:

- ``chat``: 2,000 multi-turn chat requests (deterministic seed): every conversation starts
  with the same 1,000-token system prompt, each turn appends a user message and the request
  is the whole history (~2,440 tokens on average), then the answer is appended; 40
  conversations are open at a time and the next turn comes from a random one. 16-token
  blocks, hashed with ``hash_tokens``.
- ``trace``: the bundled Mooncake trace (``../shared/traces/mooncake_synthetic_trace.jsonl``,
  one id per 512-token block), hashed with ``hash_ids_chain``.

Timed step per request (thread CPU time; the machine is shared): hash the list, then
``match_prefix``, ``allocate`` (``abort`` when it does not fit), ``take_ops`` /
``on_ops_done`` (every op acked ok), ``finish``, ``take_ops`` / ``on_ops_done``. Each
config is replayed ``--repeat`` times, the configs of one workload and capacity taking
turns (so a change in the shared machine's load falls on all alike); the median is printed.

The scheduler's core runs compiled (mypyc, built at install from its typed source) unless
``ZKV_PURE_PYTHON=1``; the header says which ran.

Configs: device-only and device + host 4x under write_back (wb), write_through (wt) and
write_through_selective (wts), and wb with L3 writes (wb+L3: every block that reaches host
is also written to storage). chat at 20,000 device blocks; trace at 1,000 and 10,000.

Columns: us per request and per block, ``vs base`` = the baseline's time / zkv's (same
requests, same process: ``_sched_baseline.SimplePrefixCache``, a per-block dict + LRU with
block-by-block Python hashing, device only), ``vs dev`` = this row / zkv's device-only row
(the cost of the host tier), hit ratios per tier.

Checks (exit 1 when one fails): every device-only LRU hit ratio (the timed rows and the
policy table) equals the independent reference LRU exactly; the baseline's hashes and hit
ratio equal zkv's; ``check_invariants()`` holds after every replay. The policy table puts
the SLRU policy's device hit ratio beside LRU's at 1k / 10k / 30k device blocks.

Targets (2-core machine): chat <= 150 us/request including hashing; a host tier (any write
policy, with or without L3 writes) <= 1.5x the device-only cost.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _args import DEFAULT_TRACE, existing_file, positive_int  # noqa: E402
from _sched_baseline import (  # noqa: E402
    chain_hashes_ids,
    chain_hashes_tokens,
    reference_lru_hits,
    run_simple,
)

from zkv import log as zlog  # noqa: E402
from zkv.protocol import OpResult  # noqa: E402
from zkv.scheduler import hashing, native_core  # noqa: E402
from zkv.scheduler.eviction import POLICIES  # noqa: E402
from zkv.scheduler.manager import CacheConfig, CacheManager  # noqa: E402

HOST_FACTOR = 4
POLICY_CAPACITIES = (1_000, 10_000, 30_000)
TARGET_CHAT_US = 150.0
TARGET_HOST_RATIO = 1.5
WRITES = (("wb", "write_back", False), ("wt", "write_through", False),
          ("wts", "write_through_selective", False), ("wb+L3", "write_back", True))

# chat workload
CHAT_SEED = 20240611
CHAT_REQUESTS = 2_000
CHAT_BLOCK = 16
CHAT_DEVICE = 20_000
CHAT_SYSTEM = 1_000          # tokens of the shared system prompt
CHAT_CONVERSATIONS = 340
CHAT_ACTIVE = 40             # conversations open at any time
CHAT_TURNS = (2, 10)         # turns per conversation, uniform in [lo, hi]
CHAT_USER = (40, 300)        # tokens per user message, uniform in [lo, hi)
CHAT_ASSISTANT = (60, 440)   # tokens per assistant answer, uniform in [lo, hi)
CHAT_VOCAB = 32_000
TRACE_BLOCK = 512
TRACE_DEVICE = (1_000, 10_000)


@dataclass
class Workload:
    name: str
    block_size: int
    requests: list[list[int]]            # token ids (chat) or block ids (trace)
    hash_fn: Callable[[list[int]], list[bytes]]
    base_hash_fn: Callable[[list[int]], list[bytes]]
    device: tuple[int, ...]              # device capacities of the timed rows
    hashes: list[list[bytes]] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return sum(len(h) for h in self.hashes)


@dataclass
class Result:
    label: str
    cpu_us: float                        # median thread CPU per request
    hit_dev: int
    hit_host: int
    blocks: int
    work: Work


class Work(NamedTuple):
    """What a replay did, in whole runs (the same in every replay of a config)."""

    dev_victims: int    # device policy entries taken (one look each: policy probes)
    host_victims: int   # host policy entries taken
    ops: int            # ops taken (one per kind per step, one s2h per request)
    moved: int          # blocks in committed d2h, h2d, backup and h2s


def make_chat(n: int) -> Workload:
    rng = np.random.default_rng(CHAT_SEED)

    def tokens(lo_hi: tuple[int, int]) -> list[int]:
        return rng.integers(0, CHAT_VOCAB, int(rng.integers(*lo_hi))).tolist()

    system = tokens((CHAT_SYSTEM, CHAT_SYSTEM + 1))
    prompts: list[list[int]] = []
    active: list[tuple[list[int], list[int]]] = []  # (history, [turns left])
    started = 0
    while len(prompts) < n and (active or started < CHAT_CONVERSATIONS):
        while len(active) < CHAT_ACTIVE and started < CHAT_CONVERSATIONS:
            active.append((list(system), [int(rng.integers(CHAT_TURNS[0], CHAT_TURNS[1] + 1))]))
            started += 1
        j = int(rng.integers(len(active)))
        history, left = active[j]
        history += tokens(CHAT_USER)
        prompts.append(list(history))
        history += tokens(CHAT_ASSISTANT)
        left[0] -= 1
        if left[0] == 0:
            active.pop(j)
    bs = CHAT_BLOCK
    return Workload("chat", bs, prompts, lambda p: hashing.hash_tokens(p, bs),
                    lambda p: chain_hashes_tokens(p, bs), (CHAT_DEVICE,))


def make_trace(path: str, n: int | None) -> Workload:
    ids: list[list[int]] = []
    with open(path) as f:
        for line in f:
            if line.strip():
                ids.append(json.loads(line)["hash_ids"])
            if n is not None and len(ids) >= n:
                break
    return Workload("trace", TRACE_BLOCK, ids, hashing.hash_ids_chain, chain_hashes_ids,
                    TRACE_DEVICE)


# ---------------------------------------------------------------------------- replays


def replay(w: Workload, dev: int, host: int = 0, policy: str = "write_back",
           store: bool = False, eviction: str = "lru") -> tuple[float, int, int, Work]:
    """One replay; (thread CPU us per request, device hits, host hits, work done)."""
    cm = CacheManager(CacheConfig(dev, host, w.block_size, policy, storage_write=store,
                                  eviction_policy=eviction))
    bs = w.block_size
    hash_fn = w.hash_fn
    match_prefix, allocate, finish, abort = cm.match_prefix, cm.allocate, cm.finish, cm.abort
    take_ops, on_ops_done = cm.take_ops, cm.on_ops_done
    hit_dev = hit_host = num_ops = 0
    rids = [f"r{i}" for i in range(len(w.requests))]
    gc.collect()
    c0 = time.thread_time_ns()
    for rid, req in zip(rids, w.requests):
        hashes = hash_fn(req)
        m = match_prefix(rid, hashes)
        table = allocate(rid, len(hashes) * bs)
        ops = take_ops()
        if ops:
            num_ops += len(ops)
            on_ops_done([OpResult(op.id, True, op.num_blocks) for op in ops])
        if table is None:
            abort(rid)
        else:
            finish(rid)
        ops = take_ops()
        if ops:
            num_ops += len(ops)
            on_ops_done([OpResult(op.id, True, op.num_blocks) for op in ops])
        hit_dev += m.num_device
        hit_host += m.num_host
    cpu = time.thread_time_ns() - c0
    cm.check_invariants()
    assert cm.num_running() == 0 and cm.num_pending_ops == 0
    s = cm.stats
    work = Work(cm.tree.dpol.probes, cm.tree.hpol.probes, num_ops,
                s.swapped_out + s.swapped_in + s.backed_up + s.stored)
    return cpu / 1e3 / len(w.requests), hit_dev, hit_host, work


def timed(w: Workload, repeat: int, configs: dict[str, dict[str, object]]) -> dict[str, Result]:
    """Replay every config ``repeat`` times, in rounds (one replay of each config per
    round), so a change in the shared machine's load falls on all of them alike."""
    runs: dict[str, list[tuple[float, int, int, Work]]] = {k: [] for k in configs}
    for _ in range(repeat):
        for label, kw in configs.items():
            runs[label].append(replay(w, **kw))  # type: ignore[arg-type]
    out = {}
    for label, rs in runs.items():
        assert len({r[1:] for r in rs}) == 1, "replays disagree"
        out[label] = Result(label, statistics.median(r[0] for r in rs), rs[0][1], rs[0][2],
                            w.num_blocks, rs[0][3])
    return out


def baseline(w: Workload, dev: int, repeat: int) -> tuple[float, int]:
    times = []
    hits = -1
    for _ in range(repeat):
        gc.collect()
        hits, _total, cpu = run_simple(w.requests, dev, w.base_hash_fn, time.thread_time_ns)
        times.append((cpu[-1] - cpu[0]) / 1e3 / len(w.requests))
    return statistics.median(times), hits


# ---------------------------------------------------------------------------- output

HEADER = (f"{'work':<6} {'device':>6} {'host':>7} {'write':>5}  {'us/req':>7} {'us/blk':>6}"
          f"  {'vs base':>7} {'vs dev':>6}  {'hit dev':>7} {'host':>5}")


def row(w: Workload, dev: int, host: int, write: str, r: Result, base_us: float,
        dev_us: float) -> str:
    hs = f"{host:,}" if host else "-"
    vs_dev = "" if not host else f"{r.cpu_us / dev_us:5.2f}x"
    return (f"{w.name:<6} {dev:>6,} {hs:>7} {write:>5}  {r.cpu_us:>7.1f}"
            f" {r.cpu_us / (r.blocks / len(w.requests)):>6.3f}  {base_us / r.cpu_us:>6.2f}x"
            f" {vs_dev:>6}  {r.hit_dev / r.blocks:>7.3f} {r.hit_host / r.blocks:>5.3f}")


REF_SAMPLE = 200  # requests the slow reference path hashes


def hashing_line(w: Workload) -> str:
    """Native hashing of every request vs the reference Python path on the first
    ``REF_SAMPLE`` requests, each per block of what it hashed (the sample's requests are
    not the average size: chat's first turns are short, a scaled time over every block
    was off by the difference)."""
    reps = 3
    best_nat = best_ref = float("inf")
    ref = hashing.hash_tokens_py if w.name == "chat" else hashing.hash_ids_chain_py
    args = (w.block_size,) if w.name == "chat" else ()
    sample = w.requests[:REF_SAMPLE]
    sample_blocks = sum(len(h) for h in w.hashes[:REF_SAMPLE])
    for _ in range(reps):
        c0 = time.thread_time_ns()
        for req in w.requests:
            w.hash_fn(req)
        best_nat = min(best_nat, time.thread_time_ns() - c0)
        c0 = time.thread_time_ns()
        for req in sample:
            ref(req, *args)  # type: ignore[operator]
        best_ref = min(best_ref, time.thread_time_ns() - c0)
    nat = best_nat / 1e3 / w.num_blocks
    return (f"  {w.name:<6} native {nat:.3f} us/block (reference Python path"
            f" {best_ref / 1e3 / sample_blocks:.3f}), {best_nat / 1e3 / len(w.requests):.1f}"
            f" us/request  [target <= 0.1 us/block: {'met' if nat <= 0.1 else 'MISSED'}]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=existing_file, default=DEFAULT_TRACE,
                    help="mooncake-style JSONL trace")
    ap.add_argument("--quick", action="store_true", help="fewer requests, one replay (smoke)")
    ap.add_argument("--repeat", type=positive_int, default=None,
                    help="replays per config (default 5, 1 with --quick)")
    args = ap.parse_args()
    repeat = args.repeat or (1 if args.quick else 5)
    zlog.configure("bench", level="warning")  # the scheduler's per-step debug lines off
    t_start = time.perf_counter()
    workloads = [make_chat(400 if args.quick else CHAT_REQUESTS),
                 make_trace(args.trace, 800 if args.quick else None)]
    why_not = native_core()
    print(f"zkv scheduler_ops bench  (python {sys.version.split()[0]}, {os.cpu_count()} cpus,"
          f" median of {repeat}, native hashing {'on' if hashing.NATIVE else 'OFF'},"
          f" compiled core {'on' if why_not is None else 'OFF: ' + why_not})")
    bad: list[str] = []
    for w in workloads:
        w.hashes = [w.hash_fn(r) for r in w.requests]
        if w.hashes != [w.base_hash_fn(r) for r in w.requests]:
            bad.append(f"{w.name}: the baseline's hashes differ from zkv's")
        n = len(w.requests)
        print(f"  {w.name:<6} {n:>5} requests, {w.num_blocks / n:.1f} blocks of {w.block_size}"
              f" per request ({w.num_blocks:,} blocks, {len({h for hs in w.hashes for h in hs}):,}"
              f" distinct)")
    print("\nhashing from Python lists (thread CPU, best of 3):")
    for w in workloads:
        print(hashing_line(w))
    print("\n" + HEADER)
    chat_us, ratios, work_lines = timed_rows(workloads, repeat, bad)
    print("""
  us/req: thread CPU per request, hashing from the Python list included (median).
  vs base: SimplePrefixCache time / zkv time (device only, same requests).
  vs dev: this row / zkv's device-only row (the cost of the host tier and its ops).
  write: wb write_back, wt write_through, wts write_through_selective (threshold 2),
         wb+L3 write_back with storage writes (h2s) of every block that reaches host.""")
    print("\nwork per request (the same in every replay): victims taken per tier, ops, blocks in"
          "\ncommitted copies; steps = victims + ops; vs dev = (steps + 1) / device-only's (+1: the"
          "\nrequest's own match / allocate / finish), the bookkeeping beside the time ratio"
          " above:")
    print(WORK_HEADER)
    for line in work_lines:
        print(line)
    bad += policy_table(workloads)
    print("\ntargets:")
    if chat_us is not None:
        print(f"  chat, {CHAT_DEVICE:,} device blocks, hashing included: {chat_us:.1f} us/request"
              f"  [<= {TARGET_CHAT_US:.0f}: {'met' if chat_us <= TARGET_CHAT_US else 'MISSED'}]")
    worst = max(ratios, key=lambda x: x[1])
    missed = [f"{k} {v:.2f}x" for k, v in ratios if v > TARGET_HOST_RATIO]
    print(f"  host tier vs device-only: worst {worst[0]} {worst[1]:.2f}x  [<= {TARGET_HOST_RATIO}x:"
          f" {'met' if not missed else 'MISSED in ' + ', '.join(missed)}]")
    print(f"\ntotal bench time {time.perf_counter() - t_start:.1f} s")
    for b in bad:
        print(f"FAIL: {b}", file=sys.stderr)
    return 1 if bad else 0


def timed_rows(workloads: list[Workload], repeat: int, bad: list[str]
               ) -> tuple[float | None, list[tuple[str, float]], list[str]]:
    """Print the timed rows; (chat device-only us/request, host-tier ratios, the lines of
    the work-per-request table)."""
    ratios: list[tuple[str, float]] = []
    work_lines: list[str] = []
    chat_us = None
    for w in workloads:
        for dev in w.device:
            base_us, base_hits = baseline(w, dev, repeat)
            configs: dict[str, dict[str, object]] = {"-": {"dev": dev}}
            for tag, policy, store in WRITES:
                configs[tag] = {"dev": dev, "host": HOST_FACTOR * dev, "policy": policy,
                                "store": store}
            res = timed(w, repeat, configs)
            d = res["-"]
            if base_hits != d.hit_dev:
                bad.append(f"{w.name} {dev}: baseline hits {base_hits} != zkv {d.hit_dev}")
            if w.name == "chat":
                chat_us = d.cpu_us
            for tag, r in res.items():
                host = 0 if tag == "-" else HOST_FACTOR * dev
                print(row(w, dev, host, tag, r, base_us, d.cpu_us), flush=True)
                if host:
                    ratios.append((f"{w.name} {dev:,} {tag}", r.cpu_us / d.cpu_us))
                work_lines.append(work_row(w, dev, tag, r, d))
    return chat_us, ratios, work_lines


WORK_HEADER = (f"  {'work':<6} {'device':>6} {'write':>5}  {'dev vict':>8} {'host vict':>9}"
               f" {'ops':>5} {'moved blk':>9}  {'steps':>6} {'vs dev':>6}")


def work_row(w: Workload, dev: int, tag: str, r: Result, d: Result) -> str:
    """Per request: victims taken in each tier, ops, blocks moved; ``steps`` = victims +
    ops, the bookkeeping units a host tier adds (each O(1) nodes: a few Python calls), and
    ``(steps + 1) / (device-only steps + 1)``, the 1 being the request's own match /
    allocate / finish: how much more bookkeeping the config does, beside ``vs dev``, how
    much more time it takes."""
    n = len(w.requests)
    k = r.work
    steps = (k.dev_victims + k.host_victims + k.ops) / n
    dsteps = (d.work.dev_victims + d.work.host_victims + d.work.ops) / n
    ratio = (steps + 1) / (dsteps + 1)
    return (f"  {w.name:<6} {dev:>6,} {tag:>5}  {k.dev_victims / n:>8.2f}"
            f" {k.host_victims / n:>9.2f} {k.ops / n:>5.2f} {k.moved / n:>9.1f}"
            f"  {steps:>6.2f} {ratio:>5.2f}x")


def policy_table(workloads: list[Workload]) -> list[str]:
    """Device-only hit ratios per eviction policy, LRU checked against the reference."""
    bad = []
    print("\ndevice hit ratio by eviction policy (device only; reference = independent LRU):")
    print(f"  {'work':<6} {'device':>7}  {'reference':>9}  "
          + "  ".join(f"{p:>7}" for p in POLICIES))
    for w in workloads:
        for cap in sorted({*POLICY_CAPACITIES, *w.device}):
            ref_hits, total = reference_lru_hits(w.hashes, cap)
            got = {p: replay(w, cap, eviction=p)[1] for p in POLICIES}
            ok = got["lru"] == ref_hits
            if not ok:
                bad.append(f"{w.name} {cap}: LRU hits {got['lru']} != reference {ref_hits}")
            cells = "  ".join(f"{got[p] / total:>7.4f}" for p in POLICIES)
            better = got["slru"] - got["lru"]
            print(f"  {w.name:<6} {cap:>7,}  {ref_hits / total:>9.4f}  {cells}"
                  f"   lru {'==' if ok else '!='} reference; slru {better:+,} blocks"
                  f" ({better / max(1, got['lru']):+.1%})")
    return bad


if __name__ == "__main__":
    sys.exit(main())
