"""``zkv replay``: the main job. Replays a workload through the whole pipeline.

::

    zkv replay (this process) ── launch.zkvrun.run ──┬─ scheduler node:
                                                     │    python -m zkv.cli replay --node:
                                                     │    CacheManager + Dispatcher, the steps
                                                     └─ rank r: python -m zkv.worker (CPU)

Every step publishes one batch: the CacheManager's copies (d2h, backup, h2d, s2h, h2s)
plus a simulated forward pass: ``check`` ops verify, on every rank, that each reused block
(device hit or swapped in, perhaps via L3) holds exactly the bytes derived from (rank,
block hash) when it was computed, and ``fill`` ops write those bytes into newly computed
blocks. A single flipped byte anywhere in a device → host → storage → host → device round
trip fails the job.

Exit status: 0 every request served and every reused block verified; 1 a mismatch, a
failed op or a lost rank; 2 a usage or configuration error (one line on stderr, no
traceback); 4 requests dropped because they did not fit in the pools (counted in the
summary); 130 interrupted (Ctrl-C: one line, no traceback). With ``--max-restarts`` a lost
rank restarts the whole group (zkvrun); a mismatch never does (the node exits 3 for it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from tqdm import tqdm

from zkv import metrics as M
from zkv import stopsignals, streams
from zkv.config import (
    CacheLayout,
    check_rank_env,
    pools_fit,
    pools_shortfall,
    scheduler_shortfall,
)
from zkv.errors import ConfigError, RankLost
from zkv.log import check_level, check_log_dir
from zkv.protocol import CHECK, FILL, H2S, S2H, Op, OpResult, as_ids
from zkv.replay_args import DEFAULT_TRACE, build_parser, check_flags_read
from zkv.scheduler.dispatcher import BatchDone
from zkv.scheduler.hashing import BlockHash, hash_ids_chain, hash_tokens
from zkv.scheduler.manager import CacheConfig, CacheManager
from zkv.scheduler.prefetch import PrefetchPolicy, PrefetchTracker

_SIM_OP_BASE = 1 << 40  # op ids of the simulated forward pass, apart from the manager's
EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_DROPPED = 0, 1, 2, 4
#: The scheduler node's status for wrong bytes: a rerun of the group that verifies clean must
#: not turn the run into a 0 (zkvrun restarts after 1); ``main`` says 1 for it.
EXIT_NODE_MISMATCHED = 3
#: ... and for a metrics file it could not write at the end (a rerun writes it no better:
#: before, a full disk ran the whole workload again per --max-restarts); 1 from ``main``.
EXIT_NODE_UNWRITTEN = 6
EXIT_INTERRUPTED = 128 + 2  # SIGINT, as a shell reports it


# ---------------------------------------------------------------- workloads


CHAT_HISTORY_MAX_TOKENS = 6000  # a conversation longer than this ends; a new one starts
CHAT_TURN_MAX_TOKENS = 255  # a user or assistant turn: 32 to this many tokens


def chat_max_prompt_blocks(block_size: int) -> int:
    """Full blocks of the longest prompt :func:`chat_workload` can give."""
    return (CHAT_HISTORY_MAX_TOKENS + CHAT_TURN_MAX_TOKENS) // block_size


def chat_workload(num_requests: int, block_size: int, seed: int = 0
                  ) -> Iterator[tuple[str, list[BlockHash]]]:
    """Multi-turn chat: a shared system prompt, conversations whose history grows by a
    user and an assistant turn per request. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 32000, 512, dtype=np.int32)
    num_convs = max(1, num_requests // 6)
    histories: list[np.ndarray] = [system.copy() for _ in range(num_convs)]
    for i in range(num_requests):
        c = int(rng.integers(0, num_convs))
        turn = CHAT_TURN_MAX_TOKENS + 1
        user = rng.integers(0, 32000, int(rng.integers(32, turn)), dtype=np.int32)
        prompt = np.concatenate([histories[c], user])
        answer = rng.integers(0, 32000, int(rng.integers(32, turn)), dtype=np.int32)
        histories[c] = np.concatenate([prompt, answer])
        if len(histories[c]) > CHAT_HISTORY_MAX_TOKENS:
            histories[c] = system.copy()
        yield f"chat-{i}", hash_tokens(prompt, block_size)


def trace_workload(path: str, num_requests: int) -> Iterator[tuple[str, list[BlockHash]]]:
    """The Mooncake trace: one zkv block per trace hash id (equal paths, equal hashes).
    A line that is not ``{"hash_ids": [int, ...], ...}`` is a ConfigError naming it."""
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if i >= num_requests:
                return
            try:
                rec = orjson.loads(line)
                ids = rec["hash_ids"] if isinstance(rec, dict) else None
                if not isinstance(ids, list):
                    raise ValueError('expected {"hash_ids": [int, ...], ...}')
                hashes = hash_ids_chain(ids)
            except (ValueError, TypeError, KeyError, OverflowError) as e:  # orjson's too
                why = f"no {e}" if isinstance(e, KeyError) else str(e)
                raise ConfigError(f"trace {path}, line {i + 1}: {why}") from None
            yield f"trace-{i}", hashes


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
    failed_ops: int = 0          # copies, fills and checks (storage I/O: below)
    loaded: int = 0              # s2h blocks that arrived on every rank
    load_failed: int = 0         # s2h blocks that did not (recomputed)
    stored: int = 0              # h2s blocks stored on every rank
    store_failed: int = 0        # h2s blocks dropped (the store declined or was down)
    batches: int = 0
    wall_s: float = 0.0
    dropped: int = 0             # requests that did not fit in the device pool, even evicting

    @property
    def exit_code(self) -> int:
        if self.mismatched or self.failed_ops:
            return EXIT_FAILED
        return EXIT_DROPPED if self.dropped else EXIT_OK


class Replayer:
    """Drives CacheManager + Dispatcher one step at a time (``batch`` requests per step).

    Batches complete out of seq order (storage I/O is acked after the copies), so every
    completion is committed as it comes (``_pump``), whichever batch the step waits on.
    Storage writes go in batches of their own that no step waits for; loads are waited
    for as the prefetch policy says.
    """

    def __init__(self, cm: CacheManager, dispatcher: object, layout: CacheLayout, batch: int,
                 progress: bool, prefetch: PrefetchPolicy | None = None) -> None:
        self.cm = cm
        self.dp = dispatcher
        self.layout = layout
        self.batch = batch
        self.progress = progress
        self.step = 0
        self.sim_id = _SIM_OP_BASE
        self.spans: list[tuple[float, float]] = []  # each batch's (publish, last ack), monotonic
        self.s = Summary()
        self.carry: list[Op] = []  # backups / storage writes from finish, sent with the next step
        self.moved = {k: 0 for k in M.DIRECTIONS}  # blocks every rank copied, per direction
        self.tracker = PrefetchTracker(prefetch or PrefetchPolicy())
        self.outstanding: dict[int, tuple[list[Op], list[Op]]] = {}
        self.running: list[str] = []  # requests of the step in progress (aborted on failure)
        self.failed_sim: set[int] = set()  # sim ops (fill / check) that failed on some rank
        self.lost: frozenset[int] = frozenset()  # ranks counted in zkv:lost_ranks

    @property
    def latencies(self) -> list[float]:
        """Each batch's publish -> last ack, in seconds."""
        return [b - a for a, b in self.spans]

    def run(self, workload: Sequence[tuple[str, Sequence[bytes]]]) -> Summary:
        t0 = time.perf_counter()
        # On a terminal only (tqdm's disable=None): piped, stderr stays one line per event.
        with tqdm(total=len(workload), desc="replay", unit="req", file=sys.stderr,
                  disable=None if self.progress else True, dynamic_ncols=True) as bar:
            for i in range(0, len(workload), self.batch):
                step = workload[i : i + self.batch]
                self.run_step(step)
                bar.update(len(step))
        while True:  # commits of late acks may emit ops (a d2h commit's storage write)
            ops = self.cm.take_ops() + self.carry
            self.carry = []
            if not ops and not self.outstanding:
                break
            self._publish(ops, [])
            self._wait(lambda: not self.outstanding)
        self.s.wall_s = time.perf_counter() - t0
        return self.s

    def run_step(self, reqs: Sequence[tuple[str, Sequence[bytes]]]) -> None:
        """One scheduling step: match, allocate, one batch (the manager's ops and the
        simulated forward), commit. A request whose forward failed on some rank is aborted:
        blocks that were never written are never cached. Raises RankLost (rolled back)."""
        cm = self.cm
        bs = self.layout.block_size
        matches = {}
        now = time.monotonic()
        for rid, hashes in reqs:
            matches[rid] = cm.match_prefix(rid, hashes)
            if matches[rid].num_storage and cm.prefetch(rid):
                self.tracker.start(rid, len(hashes) * bs, now)
        if len(self.tracker):
            self._publish(cm.take_ops() + self.carry, [])
            self.carry = []
            self._wait_prefetch([rid for rid, _ in reqs])
        sim: list[Op] = []
        sim_of: dict[str, list[int]] = {}
        running = self.running = []
        for rid, hashes in reqs:
            table = cm.allocate(rid, len(hashes) * bs)
            if table is None:  # did not fit even after eviction: dropped, and counted
                cm.abort(rid)
                self.s.dropped += 1
                continue
            running.append(rid)
            cached = cm.num_reused_blocks(rid)
            self._count_hits(matches[rid], cached, len(hashes))
            mine = []
            if cached:
                mine.append(self._sim(CHECK, table[:cached], hashes[:cached]))
            if len(hashes) > cached:
                mine.append(self._sim(FILL, table[cached:], hashes[cached:]))
            sim += mine
            sim_of[rid] = [o.id for o in mine]
        seq = self._publish(cm.take_ops() + self.carry, sim)
        self.carry = []
        if seq is not None:
            self._wait(lambda: seq not in self.outstanding)
        for rid in running:  # the step's forward ran: its blocks are matchable from now on
            if self.failed_sim.isdisjoint(sim_of[rid]):
                cm.cache_computed(rid, len(dict(reqs)[rid]) * bs)
                cm.finish(rid)
            else:
                cm.abort(rid)
        self.running = []
        self.failed_sim.clear()
        self.carry = cm.take_ops()

    def settle(self) -> None:
        """Wait until every published batch completed (and commit it). Raises RankLost."""
        self._wait(lambda: not self.outstanding)

    def _count_hits(self, m: object, cached: int, num_blocks: int) -> None:
        num_device, num_host = m.num_device, m.num_host  # type: ignore[attr-defined]
        self.s.requests += 1
        self.s.blocks += num_blocks
        from_storage = max(0, cached - num_device - num_host)
        hits = {"device": num_device, "host": cached - num_device - from_storage,
                "storage": from_storage}
        self.s.hit_device += hits["device"]
        self.s.hit_host += hits["host"]
        self.s.hit_storage += hits["storage"]
        for tier, n in hits.items():
            M.HITS_BLOCKS.labels(tier=tier).inc(n)

    def _wait_prefetch(self, rids: list[str]) -> None:
        """Poll until the prefetch policy lets every request of the step go."""
        tracker, cm = self.tracker, self.cm

        def ready() -> bool:
            now = time.monotonic()
            return all([tracker.ready(r, cm.prefetch_done(r), now) for r in rids])

        self._wait(ready, tracker.next_deadline)

    def _record(self, ops: list[Op], results: dict[int, OpResult]) -> None:
        """Prometheus counters: blocks and bytes that every rank moved, pools, in flight."""
        per_block = self.layout.block_bytes * self.layout.world_size
        for o in ops:
            r = results.get(o.id)
            if r is None:
                continue
            if r.done:
                self.moved[o.kind] += r.done
                M.record_move(o.kind, r.done, r.done * per_block)
            if not r.ok and o.kind in M.DIRECTIONS:
                M.FAILED_BLOCKS.labels(direction=o.kind).inc(max(0, o.num_blocks - r.done))
        M.INFLIGHT_BATCHES.set(self.dp.in_flight)  # type: ignore[attr-defined]
        M.FREE_BLOCKS.labels(pool="device").set(self.cm.device.num_free)
        M.FREE_BLOCKS.labels(pool="host").set(self.cm.host.num_free)

    def _sim(self, kind: str, ids: list[int], keys: Sequence[bytes]) -> Op:
        self.sim_id += 1
        if kind == CHECK:
            return Op(self.sim_id, CHECK, src=as_ids(ids), keys=tuple(keys))
        return Op(self.sim_id, FILL, dst=as_ids(ids), keys=tuple(keys))

    def _publish(self, ops: list[Op], sim: list[Op]) -> int | None:
        """Publish the step's copies (+ ``sim``) as one batch and its storage writes as
        another; return the first batch's seq (None if it is empty)."""
        writes = [o for o in ops if o.kind == H2S]
        main = [o for o in ops if o.kind != H2S] + sim
        seq = self._publish_one(main, ops=[o for o in ops if o.kind != H2S], sim=sim)
        self._publish_one(writes, ops=writes, sim=[])
        return seq

    def _publish_one(self, batch: list[Op], ops: list[Op], sim: list[Op]) -> int | None:
        if not batch:
            return None
        seq = self.dp.publish(batch, self.step)  # type: ignore[attr-defined]
        self.step += 1
        self.outstanding[seq] = (ops, sim)
        M.BATCHES.inc()
        M.INFLIGHT_BATCHES.set(self.dp.in_flight)  # type: ignore[attr-defined]
        return seq

    def _wait(self, done: Callable[[], bool],
              next_deadline: Callable[[], float | None] | None = None) -> None:
        deadline = time.monotonic() + 120
        while not done():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"batches {sorted(self.outstanding)} not acked within 120 s")
            wake = next_deadline() if next_deadline is not None else None
            self.pump(0.1 if wake is None else min(0.1, max(0.0, wake - now)))

    def pump(self, timeout_s: float) -> None:
        """Poll the dispatcher once and commit what completed (all of it, rolled back where
        it failed, before a RankLost is raised)."""
        lost = None
        for b in self.dp.poll(timeout_s):  # type: ignore[attr-defined]
            lost = self._commit(b) or lost
        if lost is not None:
            raise lost

    def _commit(self, done: BatchDone) -> RankLost | None:
        """Commit (or roll back) one batch; the RankLost to raise if a rank was lost."""
        ops, sim = self.outstanding.pop(done.seq)
        self.s.batches += 1
        now = time.monotonic()
        self.spans.append((now - done.latency_s, now))
        results = done.results
        mgr = [results[o.id] for o in ops if o.id in results]
        for o in ops:
            r = results.get(o.id)
            if o.kind in (S2H, H2S):  # storage may fail: a miss / a dropped write, counted
                ok_key, bad_key = (("loaded", "load_failed") if o.kind == S2H
                                   else ("stored", "store_failed"))
                done_n = r.done if r is not None else 0
                setattr(self.s, ok_key, getattr(self.s, ok_key) + done_n)
                setattr(self.s, bad_key, getattr(self.s, bad_key) + o.num_blocks - done_n)
            elif r is None or not r.ok:
                self.s.failed_ops += 1
        self.cm.on_ops_done(mgr, done.seq)
        self._record(ops, results)
        self.s.checked += sum(len(o.keys) for o in sim if o.kind == CHECK)
        for o in sim:  # a failed fill is a failed op (it was counted nowhere), and so is a
            r = results.get(o.id)  # failed check whose every block matched
            if r is None or not r.ok:
                self.failed_sim.add(o.id)
                missed = len(o.keys) - (r.done if r else 0) if o.kind == CHECK else 0
                self.s.mismatched += missed
                self.s.failed_ops += 0 if missed else 1
        if not done.ok and done.lost_ranks:  # (each failed batch names every rank lost)
            M.LOST_RANKS.inc(len(done.lost_ranks - self.lost))
            self.lost |= done.lost_ranks
            rank = min(done.lost_ranks)
            return RankLost(rank, str(results[next(iter(results))].error) if results else "")
        return None


def node_main(args: argparse.Namespace) -> int:
    """The scheduler node (run by zkvrun with the endpoints in the environment). Errors are
    one line on stderr: 2 for a configuration the ranks do not share, 1 for a lost rank."""
    from zkv import log as zlog

    zlog.configure("scheduler")
    # zkvrun's teardown (a rank died) is SIGTERM, a closed terminal SIGHUP: end as for Ctrl-C,
    # so the metrics file, the pools' check and the dispatcher's close still happen.
    previous = {s: signal.signal(s, _terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _serve(args)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole group: one line, not a traceback
        print("zkv replay: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except _Terminated as e:
        print(f"zkv replay: stopped ({e.args[0].name})", file=sys.stderr, flush=True)
        return 128 + e.args[0]
    except ConfigError as e:
        print(f"zkv replay: error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except (RankLost, TimeoutError) as e:
        print(f"zkv replay: failed: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except StateCheckFailed as e:
        print(f"zkv replay: failed: the scheduler's state check at the end: {e}",
              file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Terminated(BaseException):
    """SIGTERM / SIGHUP (``args[0]``), raised where the scheduler node is (finally runs).
    A BaseException, as KeyboardInterrupt is: raised inside the dispatcher's handling of
    a message, an ``except Exception`` there took it for a malformed message and the node
    served on (the ranks, signalled half a grace period later, said bye and the run failed
    for a lost rank: a CI flake of the hangup test)."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated(signal.Signals(signum))


def _serve(args: argparse.Namespace) -> int:
    from zkv.scheduler.dispatcher import Dispatcher
    from zkv.storage import StorageQuery, open_store

    layout = CacheLayout.from_env()
    M.register_replay()
    server = M.serve(args.metrics_port) if args.metrics_port is not None else None
    url = os.environ.get("ZKV_STORE_URL")  # set by main, as for the ranks
    store = open_store(url, layout.fingerprint()) if url else None
    cm = CacheManager(
        CacheConfig(layout.num_device_blocks, layout.num_host_blocks, layout.block_size,
                    args.policy, args.threshold, storage_write=store is not None,
                    eviction_policy=args.eviction),
        storage_exists=StorageQuery(store, layout.world_size) if store else None,
    )
    for pool in M.POOLS:  # from the start, not from the first batch's commit
        M.FREE_BLOCKS.labels(pool=pool).set(getattr(cm, pool).num_free)
    prefetch = PrefetchPolicy(args.prefetch, args.prefetch_base_ms / 1e3,
                              args.prefetch_per_ki_token_ms / 1e3)
    if args.workload == "chat":
        workload = list(chat_workload(args.requests, layout.block_size, args.seed))
    else:
        workload = list(trace_workload(args.trace, args.requests))
    dp = Dispatcher.from_env(layout.world_size, layout, heartbeat_timeout_s=10.0,
                             ack_timeout_s=60.0)
    M.watch_refusals(dp)
    if server is not None:
        print(f"zkv replay: metrics at {server.url}", file=sys.stderr, flush=True)
    rp = None
    try:
        dp.wait_for_ranks(60.0)
        rp = Replayer(cm, dp, layout, args.batch, progress=not args.no_progress,
                      prefetch=prefetch)
        s = rp.run(workload)
    finally:  # (a signal now, zkvrun's teardown, is acted on once the metrics are written)
        with stopsignals.deferred():
            try:  # (a failed check still closes all, and the ranks get their Shutdown)
                _check_pools(cm, rp)
            finally:
                cm.flush_logs()
                _final_gauges(cm, dp, rp, isinstance(sys.exc_info()[1], _Terminated))
                if store is not None:
                    store.close()
                if server is not None:
                    server.shutdown()
                wrote = _write_metrics(args.metrics_file) if args.metrics_file else True
    _print_summary(s, rp.moved, layout, rp.latencies, busy_s(rp.spans), args, store)
    if s.mismatched:  # never restarted (final_codes), reported as 1 by main
        return EXIT_NODE_MISMATCHED
    return s.exit_code if wrote or s.exit_code != EXIT_OK else EXIT_NODE_UNWRITTEN


def _final_gauges(cm: CacheManager, dp: Any, rp: Replayer | None, terminated: bool) -> None:
    """Close the dispatcher with the metrics as the run ended. ``terminated``: zkvrun's
    teardown (SIGTERM), most often because a rank died: zkvrun's poll sees a dead process
    before the dispatcher's short grace declares it lost, so the dispatcher is given that
    grace first. Every rank it declared lost is counted (before: only those named by a
    failed batch, so a SIGKILLed rank left ``zkv:lost_ranks_total`` at 0); the in-flight
    gauge is what close left (none: it forgets them) and the pools are read after the
    end's aborts."""
    if terminated:
        deadline = time.monotonic() + _LOSS_GRACE_S
        while not dp.lost_ranks and (left := deadline - time.monotonic()) > 0:
            dp.poll(left)
    counted = rp.lost if rp is not None else frozenset()
    M.LOST_RANKS.inc(len(dp.lost_ranks - counted))
    dp.close()
    M.INFLIGHT_BATCHES.set(dp.in_flight)
    for pool in M.POOLS:
        M.FREE_BLOCKS.labels(pool=pool).set(getattr(cm, pool).num_free)


#: How long a terminated node polls for a dead rank to be declared lost (the dispatcher's
#: grace after a subscriber's disconnect is 50 ms).
_LOSS_GRACE_S = 0.5


def _write_metrics(path: str) -> bool:
    """The final metrics into ``path``; one line on stderr and False if it cannot be."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(M.render())
    except OSError as e:
        print(f"zkv replay: error: cannot write the metrics to {path}: {e.strerror}",
              file=sys.stderr, flush=True)
        return False
    return True


class StateCheckFailed(Exception):
    """The scheduler's state broke an invariant at the end of the run (a zkv bug)."""


def _check_pools(cm: CacheManager, rp: Replayer | None) -> None:
    """Also after a failure: whatever failed was rolled back, no block leaked."""
    if rp is not None and rp.running:
        for rid in rp.running:
            cm.abort(rid)
        rp.running = []
    try:
        cm.check_invariants()
    except AssertionError as e:
        raise StateCheckFailed(str(e) or "an invariant does not hold") from e


def busy_s(spans: list[tuple[float, float]]) -> float:
    """Seconds in which at least one batch was in flight: the union of the spans (batches
    overlap: storage writes, a step's loads beside its copies). O(n log n)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _print_summary(s: Summary, moved: dict[str, int], layout: CacheLayout, lat: list[float],
                   busy: float, args: argparse.Namespace, store: Any = None) -> None:
    per_block = layout.block_bytes * layout.world_size
    total_bytes = sum(moved.values()) * per_block
    p50, p99 = (np.percentile(np.array(lat) * 1e3, [50, 99]) if lat else (0.0, 0.0))
    blocks = max(1, s.blocks)

    def gb(n_blocks: int) -> str:
        return f"{n_blocks * per_block / 1e9:.3f} GB"

    lines = [
        f"zkv replay: workload={args.workload} ranks={layout.world_size} policy={args.policy} "
        f"eviction={args.eviction} "
        f"L3={store.url if store is not None else 'off'} "
        f"prefetch={args.prefetch}",
        f"  layout       {layout.num_layers} layers x {layout.kv_heads} kv heads x "
        f"{layout.block_size} tokens x {layout.head_dim} dim {layout.dtype} = "
        f"{layout.block_bytes / 1024:.0f} KiB/block/rank; device {layout.num_device_blocks} "
        f"host {layout.num_host_blocks} blocks per rank",
        f"  requests     {s.requests}   prompt blocks {s.blocks}   wall {s.wall_s:.2f} s "
        f"({s.requests / max(s.wall_s, 1e-9):.1f} req/s)",
        f"  hits         device {s.hit_device} ({s.hit_device / blocks:.1%})   host "
        f"{s.hit_host} ({s.hit_host / blocks:.1%})   storage "
        f"{s.hit_storage} ({s.hit_storage / blocks:.1%})",
        f"  hit bytes    device {gb(s.hit_device)}   host {gb(s.hit_host)}   storage "
        f"{gb(s.hit_storage)}   (all ranks)",
        "  moved blocks " + "   ".join(f"{k} {v}" for k, v in moved.items())
        + "   (per rank; x ranks for bytes)",
        f"  tier bytes   device<->host {gb(moved['d2h'] + moved['backup'] + moved['h2d'])}   "
        f"host<->store {gb(moved['s2h'] + moved['h2s'])}   (all ranks)",
        f"  bytes        {total_bytes / 1e9:.3f} GB over {s.batches} batches = "
        f"{total_bytes / 1e9 / max(busy, 1e-9):.2f} GB/s while any was in flight",
        f"  latency      publish->all acks p50 {p50:.2f} ms  p99 {p99:.2f} ms",
        f"  storage      loaded {s.loaded} blocks ({s.load_failed} failed: recomputed)   "
        f"stored {s.stored} ({s.store_failed} dropped)"
        + (f"   scheduler queries failed {store.stats.query_failures}"
           if store is not None else ""),
        f"  verified     {s.checked} reused blocks checked byte-for-byte on every rank, "
        f"{s.mismatched} mismatched; {s.failed_ops} failed ops",
        f"  dropped      {s.dropped} requests did not fit in the pools"
        + (" (exit status 4)" if s.dropped else ""),
    ]
    streams.say("\n".join(lines), sys.stdout)  # (a reader gone: the run's status stands)
    if store is not None:
        _warn_store_failures(s, store)


def _warn_store_failures(s: Summary, store: Any) -> None:
    """One line on stderr when L3 failed anything: the replay went on without it (L3 is a
    cache, every reused block was still verified), but a store that was never reached looks
    like one that had nothing to give in the summary alone."""
    parts = [(store.stats.query_failures, "existence queries failed"),
             (s.store_failed, "block writes dropped"),
             (s.load_failed, "block loads failed (recomputed)")]
    failed = ", ".join(f"{n:,} {what}" for n, what in parts if n)
    if not failed:
        return
    where = os.environ.get("ZKV_LOG_DIR")
    why = f"; why: zkv logs {where} --event storage" if where else ""
    print(f"zkv replay: warning: L3 {store.url}: {failed}{why}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- front end


def check_args(args: argparse.Namespace) -> CacheLayout:
    """The layout, or ConfigError naming the first argument that makes no sense."""
    from launch.env import max_local_ranks

    if args.metrics_port:  # taken now: one line before anything starts (the scheduler
        M.serve(args.metrics_port).shutdown()  # says so too if it is taken meanwhile)
    if args.metrics_file is not None:
        M.check_writable("--metrics-file", args.metrics_file)
    if args.log_dir:
        check_log_dir(args.log_dir)
    check_level()  # ZKV_LOG_LEVEL, which every process of the run reads
    check_rank_env()  # ZKV_BACKEND, ZKV_HEARTBEAT_S, ...: a typo was every rank's exit 2
    if args.trace_given and args.workload != "trace":  # (it replayed chat, status 0)
        raise ConfigError(f"--trace is read by --workload trace only (the workload is "
                          f"{args.workload}): add --workload trace")
    if args.workload == "trace":
        if not os.path.exists(args.trace):
            raise ConfigError(f"trace not found: {args.trace}")
        if not os.path.isfile(args.trace):  # read twice (checked here, then replayed)
            raise ConfigError(f"--trace {args.trace} is not a regular file (a directory, a "
                              "pipe or a device): give a JSONL file")
        n = sum(1 for _ in trace_workload(args.trace, args.requests))  # a bad line: one line
        if n == 0:
            raise ConfigError(f"--trace {args.trace} holds no request")
    layout = CacheLayout(args.layers, args.kv_heads, args.block_size, args.head_dim, args.dtype,
                         args.device_blocks, args.host_blocks, world_size=args.ranks)
    short = scheduler_shortfall(layout)
    if short:  # (--force or not: the node's MemoryError, or the OOM killer, after start)
        raise ConfigError(f"{short}: lower --device-blocks / --host-blocks (--force does not "
                          "pass this one)")
    if args.force:
        return layout
    if args.ranks > max_local_ranks():
        raise ConfigError(f"--ranks {args.ranks} is more than 4 per core ({max_local_ranks()} "
                          "here); pass --force if you mean it")
    short = pools_shortfall(layout)
    if short:
        raise ConfigError(f"{short}; lower them or pass --force")
    if args.workload == "chat":  # (a trace is as long as its file)
        need = args.requests * chat_bytes_per_request(args.block_size)
        pools = args.ranks * (args.device_blocks + args.host_blocks) * layout.block_bytes
        fits, free = pools_fit(need + pools)
        if not fits:
            assert free is not None
            raise ConfigError(
                f"--requests {args.requests} needs about {need / 2**30:.1f} GiB for the chat "
                f"workload the scheduler keeps in memory, beside {pools / 2**30:.1f} GiB of "
                f"pools, and {free / 2**30:.1f} GiB is available; lower it or pass --force")
    return layout


def chat_bytes_per_request(block_size: int) -> int:
    """What one chat request of the workload holds in the scheduler node, with room
    (7.3 KB measured at 16-token blocks: its block hashes and its conversation's history;
    hashes grow as blocks shrink)."""
    return 8192 * max(1, 16 // block_size)


def _without_storage(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--store-dir", "--storage"):
            skip = True
        elif not a.startswith(("--store-dir=", "--storage=")):
            out.append(a)
    return out


def _storage_url(args: argparse.Namespace, layout: CacheLayout, tmp: str) -> str | None:
    """The L3 URL the run uses: --storage, else --store-dir as file://, else ``tmp``."""
    from zkv.storage import HEADER_SIZE, file_url, open_store
    from zkv.storage.localfs import check_root
    from zkv.storage.url import check_budget, parse_url

    if args.storage and args.store_dir:
        raise ConfigError("give --storage or --store-dir, not both")
    if "none" in (args.storage, args.store_dir):
        return None
    url = args.storage or file_url(args.store_dir or tmp)
    # a bad URL or directory, or a budget that holds no block: one line here, not one a rank
    scheme, kw = parse_url(url, layout.world_size)
    if scheme == "file":
        check_budget(url, kw, layout.world_size, HEADER_SIZE + layout.block_bytes)
    if scheme == "file" and check_root(kw["root"]) <= 0:  # (an engine serves on without)
        # no free space: it opens only with a budget or with files of its own to reuse
        open_store(url, layout.fingerprint(), writers=layout.world_size).close()
    return url


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(__doc__.split("\n")[0]).parse_args(argv)
    args.trace_given = args.trace is not None
    if args.trace is None:
        args.trace = DEFAULT_TRACE
    try:
        check_flags_read(args)
    except ConfigError as e:
        print(f"zkv replay: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.node:
        return node_main(args)
    from launch.zkvrun import LaunchConfig, run
    from zkv import security

    # The default L3 directory lives in /dev/shm when there is one: on this class of VM a
    # file put costs ~1.5 ms on the disk-backed /tmp and ~0.06 ms on tmpfs. It is a run
    # directory: one that a SIGKILLed replay left behind is removed here, next time.
    # A /dev/shm that cannot take it (full: a container's 64 MB) falls back to the disk.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    bases = [b for b in (shm, tempfile.gettempdir()) if b]
    tmp = None
    try:  # (a Ctrl-C anywhere in here removes the directory too: zkv.cli says it in one line)
        try:
            layout = check_args(args)
            for base in bases:
                security.clean_stale_runs(base)
            if not args.storage and not args.store_dir:
                tmp = security.make_run_dir_in(bases, prefix="l3-")
            url = _storage_url(args, layout, tmp or "")
        except ConfigError as e:
            print(f"zkv replay: error: {e}", file=sys.stderr)
            return EXIT_CONFIG
        sched = ["-m", "zkv.cli", "replay", "--node",  # (zkv.cli: a Ctrl-C as it starts)
                 *_without_storage(argv if argv is not None else sys.argv[1:]),
                 # no store: said on the node's argv too (it checks the flags again, and
                 # --host-blocks 0 is refused unless the store is none)
                 *([] if url else ["--storage", "none"])]
        if url:  # to the node and the ranks by environment: argv is public (ps)
            os.environ["ZKV_STORE_URL"] = url
        else:
            os.environ.pop("ZKV_STORE_URL", None)
        os.environ.pop("ZKV_STORE_DIR", None)
        os.environ.setdefault("ZKV_BACKEND", "cpu")
        cfg = LaunchConfig(nproc_per_node=args.ranks, log_dir=args.log_dir,
                           config=layout.to_json(), max_restarts=args.max_restarts,
                           force_ranks=args.force,
                           # results a rerun cannot change: a bad flag, dropped requests,
                           # wrong bytes
                           final_codes=(EXIT_CONFIG, EXIT_DROPPED, EXIT_NODE_MISMATCHED,
                                        EXIT_NODE_UNWRITTEN))
        code = run(cfg, ["-m", "zkv.worker"], sched)
        return EXIT_FAILED if code in (EXIT_NODE_MISMATCHED, EXIT_NODE_UNWRITTEN) else code
    finally:
        if tmp is not None:
            security.remove_run_dir(tmp)


if __name__ == "__main__":
    sys.exit(main())
