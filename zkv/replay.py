"""``zkv replay``: the main job. Replays a workload through the whole pipeline.

::

    zkv replay (this process) ── launch.zkvrun.run ──┬─ scheduler node: python -m zkv.replay --node
                                                     │    CacheManager + Dispatcher, drives the steps
                                                     └─ rank r: python -m zkv.worker (CPU backend)

Every step publishes one batch: the CacheManager's copies (d2h, backup, h2d, s2h, h2s)
plus a simulated forward pass: ``check`` ops verify, on every rank, that each reused block
(device hit or swapped in, perhaps via L3) holds exactly the bytes derived from (rank,
block hash) when it was computed, and ``fill`` ops write those bytes into newly computed
blocks. A single flipped byte anywhere in a device → host → storage → host → device round
trip fails the job.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from zkv import metrics as M
from zkv.config import CacheLayout
from zkv.protocol import CHECK, FILL, Op, OpResult, as_ids
from zkv.scheduler.hashing import hash_ids_chain, hash_tokens
from zkv.scheduler.manager import WRITE_POLICIES, CacheConfig, CacheManager

DEFAULT_TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces",
                             "mooncake_synthetic_trace.jsonl")
_SIM_OP_BASE = 1 << 40  # op ids of the simulated forward pass, apart from the manager's


# ---------------------------------------------------------------- workloads


def chat_workload(num_requests: int, block_size: int, seed: int = 0) -> Iterator[tuple[str, list[bytes]]]:
    """Multi-turn chat: a shared system prompt, conversations whose history grows by a
    user and an assistant turn per request. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 32000, 512, dtype=np.int32)
    num_convs = max(1, num_requests // 6)
    histories: list[np.ndarray] = [system.copy() for _ in range(num_convs)]
    for i in range(num_requests):
        c = int(rng.integers(0, num_convs))
        user = rng.integers(0, 32000, int(rng.integers(32, 256)), dtype=np.int32)
        prompt = np.concatenate([histories[c], user])
        answer = rng.integers(0, 32000, int(rng.integers(32, 256)), dtype=np.int32)
        histories[c] = np.concatenate([prompt, answer])
        if len(histories[c]) > 6000:  # conversation ends; a new one starts
            histories[c] = system.copy()
        yield f"chat-{i}", hash_tokens(prompt, block_size)


def trace_workload(path: str, num_requests: int) -> Iterator[tuple[str, list[bytes]]]:
    """The Mooncake trace: one zkv block per trace hash id (equal paths, equal hashes)."""
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if i >= num_requests:
                return
            yield f"trace-{i}", hash_ids_chain(orjson.loads(line)["hash_ids"])


# ---------------------------------------------------------------- scheduler node


@dataclass(slots=True)
class Summary:
    requests: int = 0
    blocks: int = 0
    hit_device: int = 0
    hit_host: int = 0
    hit_storage: int = 0
    checked: int = 0
    mismatched: int = 0
    failed_ops: int = 0
    batches: int = 0
    wall_s: float = 0.0


class Replayer:
    """Drives CacheManager + Dispatcher one step at a time (``batch`` requests per step)."""

    def __init__(self, cm: CacheManager, dispatcher: object, layout: CacheLayout, batch: int,
                 progress: bool) -> None:
        self.cm = cm
        self.dp = dispatcher
        self.layout = layout
        self.batch = batch
        self.progress = progress
        self.step = 0
        self.sim_id = _SIM_OP_BASE
        self.latencies: list[float] = []
        self.s = Summary()
        self.carry: list[Op] = []  # backups / storage writes from finish, sent with the next step
        self.moved = {k: 0 for k in M.DIRECTIONS}  # blocks every rank copied, per direction

    def run(self, workload: Sequence[tuple[str, list[bytes]]]) -> Summary:
        t0 = time.perf_counter()
        for i in range(0, len(workload), self.batch):
            self._step(workload[i : i + self.batch])
            if self.progress:
                _bar(min(i + self.batch, len(workload)), len(workload), t0)
        self._send(self.cm.take_ops() + self.carry, [])
        self.carry = []
        self.s.wall_s = time.perf_counter() - t0
        if self.progress and sys.stderr.isatty():
            print(file=sys.stderr)
        return self.s

    def _step(self, reqs: Sequence[tuple[str, list[bytes]]]) -> None:
        cm = self.cm
        bs = self.layout.block_size
        matches = {}
        for rid, hashes in reqs:
            matches[rid] = cm.match_prefix(rid, hashes)
            if matches[rid].num_storage:
                cm.prefetch(rid)
        if any(m.num_storage for m in matches.values()):  # wait_complete prefetch policy
            self._send(cm.take_ops() + self.carry, [])
            self.carry = []
        sim: list[Op] = []
        running = []
        for rid, hashes in reqs:
            table = cm.allocate(rid, len(hashes) * bs)
            if table is None:  # did not fit even after eviction: recompute-free skip
                cm.abort(rid)
                continue
            running.append(rid)
            cached = cm.num_reused_blocks(rid)
            self.s.requests += 1
            self.s.blocks += len(hashes)
            m = matches[rid]
            from_storage = max(0, cached - m.num_device - m.num_host)
            hits = {"device": m.num_device, "host": cached - m.num_device - from_storage,
                    "storage": from_storage}
            self.s.hit_device += hits["device"]
            self.s.hit_host += hits["host"]
            self.s.hit_storage += hits["storage"]
            for tier, n in hits.items():
                M.HITS_BLOCKS.labels(tier=tier).inc(n)
            if cached:
                sim.append(self._sim(CHECK, table[:cached], hashes[:cached]))
            if len(hashes) > cached:
                sim.append(self._sim(FILL, table[cached:], hashes[cached:]))
        self._send(cm.take_ops() + self.carry, sim)
        self.carry = []
        for rid in running:
            cm.finish(rid)
        self.carry = cm.take_ops()

    def _record(self, ops: list[Op], results: dict[int, OpResult]) -> None:
        """Prometheus counters: blocks and bytes that every rank moved, pools, in flight."""
        per_block = self.layout.block_bytes * self.layout.world_size
        for o in ops:
            r = results.get(o.id)
            if r is not None and r.done:
                self.moved[o.kind] += r.done
                M.record_move(o.kind, r.done, r.done * per_block)
        M.INFLIGHT_BATCHES.set(self.dp.in_flight)  # type: ignore[attr-defined]
        M.FREE_BLOCKS.labels(pool="device").set(self.cm.device.num_free)
        M.FREE_BLOCKS.labels(pool="host").set(self.cm.host.num_free)

    def _sim(self, kind: str, ids: list[int], keys: list[bytes]) -> Op:
        self.sim_id += 1
        if kind == CHECK:
            return Op(self.sim_id, CHECK, src=as_ids(ids), keys=tuple(keys))
        return Op(self.sim_id, FILL, dst=as_ids(ids), keys=tuple(keys))

    def _send(self, ops: list[Op], sim: list[Op]) -> None:
        if not ops and not sim:
            return
        seq = self.dp.publish(ops + sim, self.step)  # type: ignore[attr-defined]
        self.step += 1
        M.BATCHES.inc()
        M.INFLIGHT_BATCHES.set(self.dp.in_flight)  # type: ignore[attr-defined]
        done = None
        deadline = time.monotonic() + 120
        while done is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {seq} not acked within 120 s")
            for b in self.dp.poll(1.0):  # type: ignore[attr-defined]
                if b.seq == seq:
                    done = b
        self.s.batches += 1
        self.latencies.append(done.latency_s)
        results = done.results
        mgr = [results[o.id] for o in ops if o.id in results]
        self.s.failed_ops += sum(1 for r in mgr if not r.ok)
        self.cm.on_ops_done(mgr)
        self._record(ops, results)
        for o in sim:
            r = results.get(o.id)
            if o.kind == CHECK:
                self.s.checked += len(o.keys)
                if r is None or not r.ok or r.done != len(o.keys):
                    self.s.mismatched += len(o.keys) - (r.done if r else 0)
        if not done.ok and done.lost_ranks:
            M.LOST_RANKS.inc(len(done.lost_ranks))
            raise RuntimeError(f"lost ranks {sorted(done.lost_ranks)}")


def _bar(done: int, total: int, t0: float) -> None:
    tty = sys.stderr.isatty()
    step = max(1, total // 10)
    if not tty and done != total and done % step >= 2:  # a line per ~10% when piped
        return
    width = 30
    fill = int(width * done / max(1, total))
    rate = done / max(1e-9, time.perf_counter() - t0)
    print(f"\rreplay [{'#' * fill}{'.' * (width - fill)}] {done}/{total} req  {rate:6.1f} req/s",
          end="" if tty else "\n", file=sys.stderr, flush=True)


def _storage_exists(store: object, world_size: int):  # noqa: ANN202
    from zkv.storage import pack_key

    def exists(hashes: Sequence[bytes]) -> int:
        found = [store.exists([pack_key(h, r) for h in hashes]) for r in range(world_size)]  # type: ignore[attr-defined]
        n = 0
        while n < len(hashes) and all(f[n] for f in found):
            n += 1
        return n

    return exists


def node_main(args: argparse.Namespace) -> int:
    """The scheduler node (run by zkvrun with the endpoints in the environment)."""
    from zkv import log as zlog
    from zkv.scheduler.dispatcher import Dispatcher
    from zkv.storage import LocalDirStore

    zlog.configure("scheduler")
    layout = CacheLayout.from_env()
    store = LocalDirStore(args.store_dir, layout.fingerprint()) if args.store_dir else None
    cm = CacheManager(
        CacheConfig(layout.num_device_blocks, layout.num_host_blocks, layout.block_size,
                    args.policy, args.threshold, storage_write=store is not None),
        storage_exists=_storage_exists(store, layout.world_size) if store else None,
    )
    if args.workload == "chat":
        workload = list(chat_workload(args.requests, layout.block_size, args.seed))
    else:
        workload = list(trace_workload(args.trace, args.requests))
    dp = Dispatcher(os.environ["ZKV_PUB_ENDPOINT"], os.environ["ZKV_PULL_ENDPOINT"],
                    layout.world_size, layout.fingerprint(), heartbeat_timeout_s=10.0,
                    ack_timeout_s=60.0)
    server = M.serve(args.metrics_port) if args.metrics_port is not None else None
    if server is not None:
        print(f"zkv replay: metrics at {server.url}", file=sys.stderr, flush=True)
    try:
        dp.wait_for_ranks(60.0)
        rp = Replayer(cm, dp, layout, args.batch, progress=not args.no_progress)
        s = rp.run(workload)
        cm.check_invariants()
    finally:
        dp.close()
        if server is not None:
            server.shutdown()
        if args.metrics_file:
            with open(args.metrics_file, "w", encoding="utf-8") as f:
                f.write(M.render())
    _print_summary(s, rp.moved, layout, rp.latencies, args)
    return 0 if s.mismatched == 0 and s.failed_ops == 0 else 1


def _print_summary(s: Summary, moved: dict[str, int], layout: CacheLayout, lat: list[float],
                   args: argparse.Namespace) -> None:
    per_block = layout.block_bytes * layout.world_size
    total_bytes = sum(moved.values()) * per_block
    p50, p99 = (np.percentile(np.array(lat) * 1e3, [50, 99]) if lat else (0.0, 0.0))
    blocks = max(1, s.blocks)
    lines = [
        f"zkv replay: workload={args.workload} ranks={layout.world_size} policy={args.policy} "
        f"L3={'local-dir ' + args.store_dir if args.store_dir else 'off'}",
        f"  layout       {layout.num_layers} layers x {layout.kv_heads} kv heads x "
        f"{layout.block_size} tokens x {layout.head_dim} dim {layout.dtype} = "
        f"{layout.block_bytes / 1024:.0f} KiB/block/rank; device {layout.num_device_blocks} "
        f"host {layout.num_host_blocks} blocks per rank",
        f"  requests     {s.requests}   prompt blocks {s.blocks}   wall {s.wall_s:.2f} s "
        f"({s.requests / max(s.wall_s, 1e-9):.1f} req/s)",
        f"  hits         device {s.hit_device} ({s.hit_device / blocks:.1%})   host "
        f"{s.hit_host} ({s.hit_host / blocks:.1%})   storage "
        f"{s.hit_storage} ({s.hit_storage / blocks:.1%})",
        "  moved blocks " + "   ".join(f"{k} {v}" for k, v in moved.items())
        + "   (per rank; x ranks for bytes)",
        f"  bytes        {total_bytes / 1e9:.3f} GB over {s.batches} batches = "
        f"{total_bytes / 1e9 / max(sum(lat), 1e-9):.2f} GB/s while in flight",
        f"  latency      publish->all acks p50 {p50:.2f} ms  p99 {p99:.2f} ms",
        f"  verified     {s.checked} reused blocks checked byte-for-byte on every rank, "
        f"{s.mismatched} mismatched; {s.failed_ops} failed ops",
    ]
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------- front end


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zkv replay", description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("chat", "trace"), default="chat")
    p.add_argument("--trace", default=os.path.normpath(DEFAULT_TRACE), help="Mooncake trace JSONL")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--batch", type=int, default=2, help="requests per scheduling step")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--device-blocks", type=int, default=768)
    p.add_argument("--host-blocks", type=int, default=1024)
    p.add_argument("--policy", choices=WRITE_POLICIES, default="write_back")
    p.add_argument("--threshold", type=int, default=2, help="write_through_selective hit threshold")
    p.add_argument("--store-dir", default=None,
                   help="local-directory L3 (default: a fresh temp dir, in /dev/shm if present; "
                        "'none' disables L3)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on 127.0.0.1:PORT while running (0 = any)")
    p.add_argument("--metrics-file", default=None, help="write the final metrics here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--node", action="store_true", help=argparse.SUPPRESS)
    return p


def _without_store_dir(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--store-dir":
            skip = True
        elif not a.startswith("--store-dir="):
            out.append(a)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.node:
        return node_main(args)
    from launch.zkvrun import LaunchConfig, run

    if args.workload == "trace" and not os.path.exists(args.trace):
        print(f"zkv replay: trace not found: {args.trace}", file=sys.stderr)
        return 2
    layout = CacheLayout(args.layers, args.kv_heads, args.block_size, args.head_dim, args.dtype,
                         args.device_blocks, args.host_blocks, world_size=args.ranks)
    # The default L3 directory lives in /dev/shm when there is one: on this class of VM a
    # file put costs ~1.5 ms on the disk-backed /tmp and ~0.06 ms on tmpfs.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="zkv-l3-", dir=shm) as tmp:
        store_dir = None if args.store_dir == "none" else (args.store_dir or tmp)
        sched = ["-m", "zkv.replay", "--node", *_without_store_dir(argv if argv is not None else sys.argv[1:])]
        if store_dir:
            sched += ["--store-dir", store_dir]
            os.environ["ZKV_STORE_DIR"] = store_dir
        else:
            os.environ.pop("ZKV_STORE_DIR", None)
        os.environ.setdefault("ZKV_BACKEND", "cpu")
        cfg = LaunchConfig(nproc_per_node=args.ranks, log_dir=args.log_dir, config=layout.to_json())
        return run(cfg, ["-m", "zkv.worker"], sched)


if __name__ == "__main__":
    sys.exit(main())
