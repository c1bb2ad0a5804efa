"""``zkv soak``: replay for minutes with faults injected at random; invariants checked all along.

::

    zkv soak --seconds 300 [--ranks 2] [--seed 0] [--fault-every 1.0] [--faults junk,kill,...]

One process runs the scheduler (CacheManager + Dispatcher, CURVE over ipc:// with a
per-run keyring) and drives the chat workload one step at a time (``Replayer.run_step``:
every reused block is checked byte for byte on every rank); the ranks are real
``python -m zkv.worker`` processes with an L3 directory. Every ``--fault-every`` seconds
one fault (the first round in order, then at random)::

    fault      what                                        survived when
    junk       500 malformed messages from a rank's key    counted; steps go on
    forged     ack / heartbeat / bye as another rank       counted; no rank lost
    rogue      a client with its own CURVE key             ZAP refuses it; nothing counted
    duplicate  the next batch sent twice                   executed once; steps go on
    truncate   the next batch loses a frame                its ops fail, rolled back
    store      the L3 directory vanishes for a while       its ops fail, host copies kept
    kill       SIGKILL a rank                              lost; rolled back; group restarted
    restart    the scheduler restarts, ranks stay          ranks rejoin the new scheduler

Each epoch (between restarts) ends with a leak count (:func:`leaked_blocks`); the soak
checks ``check_invariants`` every ``--check-every`` steps. A batch that no fault touched
must verify; one that a fault touched may fail. Exit status 0 when every fault was
survived, nothing leaked and every untouched check verified; 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from zkv import protocol as P
from zkv import stopsignals, streams
from zkv.argtypes import integer, nonempty, nonneg_int, positive_float, positive_int
from zkv.config import CacheLayout, pools_shortfall, scheduler_shortfall
from zkv.errors import ConfigError, RankLost
from zkv.exit_codes import EXIT_CONFIG
from zkv.log import check_level, check_log_dir
from zkv.replay import chat_max_prompt_blocks
from zkv.scheduler.manager import CacheConfig, CacheManager

BLOCK_SIZE = 16
MIN_DEVICE_BLOCKS = chat_max_prompt_blocks(BLOCK_SIZE)  # the longest chat prompt alone
FAULTS = ("junk", "forged", "rogue", "duplicate", "truncate", "store", "kill", "restart")


def leaked_blocks(cm: CacheManager) -> int:
    """Blocks that nothing owns: abort every running request, drop every cached block
    (``reset``); whatever is still allocated then leaked. Call with no op in flight."""
    for rid in list(cm.core.requests):  # (the manager lists them nowhere else)
        cm.abort(rid)
    cm.check_invariants()
    cm.reset()
    return cm.device.num_used + cm.host.num_used


class Tamper:
    """Stands in for a dispatcher's PUB socket (fault injection only): ``mutate(frames)``
    returns the messages actually sent for one publish (none: dropped; two: duplicated)."""

    def __init__(self, sock: Any, mutate: Callable[[list[bytes]], list[list[bytes]]]) -> None:
        self.sock = sock
        self.mutate = mutate
        self._parts: list[bytes] = []

    def send_multipart(self, frames: list[Any], *args: Any, **kwargs: Any) -> None:
        for msg in self.mutate([bytes(f) for f in frames]):
            self.sock.send_multipart(msg, *args, **kwargs)

    def send(self, frame: Any, flags: int = 0, copy: bool = True, **_: Any) -> None:
        """Frame by frame (zkv.zmqio.send_frames): the message goes out, mutated, with its
        last frame."""
        self._parts.append(bytes(frame))
        if not flags & zmq.SNDMORE:
            parts, self._parts = self._parts, []
            self.send_multipart(parts, flags, copy=copy)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)

    @staticmethod
    def install(dispatcher: Any, mutate: Callable[[list[bytes]], list[list[bytes]]] | None) -> None:
        """Route ``dispatcher``'s publishes through ``mutate`` (None: the real socket)."""
        pub = dispatcher._pub
        real = pub.sock if isinstance(pub, Tamper) else pub
        dispatcher._pub = real if mutate is None else Tamper(real, mutate)


def process_stats(pid: int | str = "self") -> tuple[int, int]:
    """(open fds, RSS bytes) of a process, from /proc (0, 0 where there is none)."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
        return fds, rss
    except (OSError, StopIteration, ValueError):
        return 0, 0


@dataclass
class Report:
    requests: int = 0
    steps: int = 0
    epochs: int = 1
    injected: Counter[str] = field(default_factory=Counter)
    survived: Counter[str] = field(default_factory=Counter)
    leaked: int = 0
    leak_checked: int = 0  # epochs whose leaks were counted (not one a signal cut short)
    checked_blocks: int = 0
    unexpected: list[str] = field(default_factory=list)
    refusals: Counter[str] = field(default_factory=Counter)
    start: dict[str, int] = field(default_factory=dict)
    end: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return (not self.unexpected and self.leaked == 0 and self.injected == self.survived)

    def lines(self, block_bytes: int, ranks: int) -> list[str]:
        kinds = sorted(self.injected)
        mb = self.checked_blocks * block_bytes * ranks / 1e6
        return [
            f"zkv soak: {self.wall_s:.1f} s, {ranks} ranks, {self.epochs} scheduler epochs",
            f"  requests     {self.requests} in {self.steps} steps = "
            f"{self.requests / max(self.wall_s, 1e-9):.1f} requests/s held",
            "  faults       " + "  ".join(f"{k} {self.survived[k]}/{self.injected[k]}"
                                          for k in kinds)
            + f"   (survived/injected; {sum(self.injected.values())} in all)",
            f"  leaked       {self.leaked} blocks ({self.leak_checked} of {self.epochs} "
            "epochs checked" + ("" if self.leak_checked == self.epochs else
                                 "; the last, cut short, was not") + ")",
            f"  verified     {self.checked_blocks} reused blocks on every rank = {mb:.1f} MB "
            "compared byte for byte",
            "  refused      " + "  ".join(f"{k} {v}" for k, v in sorted(self.refusals.items())),
            f"  scheduler    fds {self.start.get('fds')} -> {self.end.get('fds')}   RSS "
            f"{self.start.get('rss', 0) / 2**20:.0f} -> {self.end.get('rss', 0) / 2**20:.0f} MiB",
            f"  ranks        fds {self.start.get('rank_fds')} -> {self.end.get('rank_fds')}   RSS "
            f"{self.start.get('rank_rss', 0) / 2**20:.0f} -> "
            f"{self.end.get('rank_rss', 0) / 2**20:.0f} MiB (sum)",
            "  unexpected   " + ("none" if not self.unexpected else "; ".join(self.unexpected[:5])),
        ]


class Soak:
    """One soak run; :meth:`run` returns its :class:`Report`. See the module docstring."""

    def __init__(self, args: argparse.Namespace, run_dir: str) -> None:
        from zkv import security
        from zkv.storage import LocalDirStore, file_url

        self.args = args
        self.rng = random.Random(args.seed)
        self.layout = soak_layout(args)
        self.run_dir = run_dir
        self.store_dir = os.path.join(run_dir, "l3")
        os.mkdir(self.store_dir, 0o700)
        self.keys_dir = security.Keyring.generate(args.ranks).save(os.path.join(run_dir, "keys"))
        self.keyring = security.Keyring.load(self.keys_dir)
        # A byte budget keeps the store (and each writer's in-memory index of its files,
        # ~250 bytes a file) bounded however long the soak runs.
        budget = args.store_mb << 20
        self.store_url = f"{file_url(self.store_dir)}?max_bytes={budget}"
        self.store = LocalDirStore(self.store_dir, self.layout.fingerprint(), max_bytes=budget)
        self.pub, self.pull = f"ipc://{run_dir}/pub", f"ipc://{run_dir}/pull"
        self.log_dir = args.log_dir or os.path.join(run_dir, "logs")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.report = Report()
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.dp: Any = None
        self.rp: Any = None
        self.tampered = False  # the next step's batch is tampered with
        self.pending: Callable[[], None] | None = None  # undo for a fault that lasts
        self.confirm: list[tuple[str, int]] = []  # (fault, epoch): survived once a step works

    # ------------------------------------------------------------ group

    def _spawn(self) -> None:
        from launch.env import Endpoints, LaunchConfig, rank_env
        from launch.zkvrun import pdeathsig_preexec

        # The ranks die with the soak however it dies (they also watch their parent, but
        # only from their first line on).
        preexec = pdeathsig_preexec()

        cfg = LaunchConfig(nproc_per_node=self.args.ranks, config=self.layout.to_json(),
                           log_dir=self.log_dir)
        ep = Endpoints(self.pub, self.pull, self.run_dir, self.keys_dir)
        for r in range(self.args.ranks):
            env = rank_env(cfg, r, ep)
            env.pop("ZKV_STORE_DIR", None)
            env.update(ZKV_BACKEND="cpu", ZKV_STORE_URL=self.store_url, ZKV_HEARTBEAT_S="0.1",
                       ZKV_LOG_LEVEL="warning")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "zkv.worker"], env=env,
                                               stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL,
                                               preexec_fn=preexec))
            stopsignals.check()  # (a signal during the fork: its exception was dropped)

    def _new_scheduler(self) -> None:
        from zkv.replay import Replayer
        from zkv.scheduler.dispatcher import Dispatcher
        from zkv.storage import StorageQuery

        cm = CacheManager(CacheConfig(self.layout.num_device_blocks, self.layout.num_host_blocks,
                                      self.layout.block_size, "write_through_selective", 2,
                                      storage_write=True),
                          storage_exists=StorageQuery(self.store, self.args.ranks))
        self.dp = Dispatcher(self.pub, self.pull, self.args.ranks, self.layout, context=self.ctx,
                             keys=self.keyring, heartbeat_timeout_s=2.0, ack_timeout_s=20.0)
        self.dp.wait_for_ranks(120.0)
        self.rp = Replayer(cm, self.dp, self.layout, 2, progress=False)

    def _end_epoch(self, shutdown: bool) -> None:
        """Count leaks of the current scheduler, close it (telling the ranks or not). Ops
        it took but never sent (backups, storage writes of the last step) die with it."""
        if self.rp is not None:
            rp, cm = self.rp, self.rp.cm
            if rp.outstanding and not self.dp.lost_ranks:
                try:
                    rp.settle()  # storage writes still in flight
                except RankLost:
                    pass
            undone = [o for ops, _ in rp.outstanding.values() for o in ops] + rp.carry
            cm.on_ops_done([P.OpResult(o.id, False, 0, "scheduler stopped") for o in undone])
            cm.flush_logs()  # what the rate-limited op_failed lines held back, counted
            rp.outstanding.clear()
            rp.carry = []
            self.report.leaked += leaked_blocks(cm)
            self.report.leak_checked += 1
            self._add_stats()
            self.rp = None  # (counted: close() after a signal from here on counts it not again)
        if self.dp is not None:
            dp, self.dp = self.dp, None
            self.report.refusals.update(dp.refusals())
            dp.close(shutdown=shutdown)

    def _add_stats(self) -> None:
        s = self.rp.s
        self.report.requests += s.requests
        self.report.checked_blocks += s.checked - s.mismatched

    def _stop_ranks(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.procs = []

    def _restart_group(self) -> None:
        self._end_epoch(shutdown=True)
        self._stop_ranks()
        self._spawn()
        self._new_scheduler()
        self.report.epochs += 1

    def close(self) -> None:
        """Undo a lasting fault, reap the ranks, close the scheduler's sockets."""
        if self.pending is not None:
            self.pending()
            self.pending = None
        self._stop_ranks()
        if self.rp is not None:  # stopped mid-epoch: the report so far counts it (no leak check)
            self._add_stats()
            self.rp = None
        if self.dp is not None:
            self.report.refusals.update(self.dp.refusals())
            self.dp.close(shutdown=False)
            self.dp = None
        # (every socket of the context, with no linger: a signal could come while a
        # Dispatcher was being made, its sockets open and no one's, and term() waited on them)
        self.ctx.destroy(linger=0)

    def _rank_stats(self) -> tuple[int, int]:
        stats = [process_stats(p.pid) for p in self.procs]
        return sum(f for f, _ in stats), sum(r for _, r in stats)

    # ------------------------------------------------------------ loop

    def run(self) -> Report:
        from zkv.replay import chat_workload

        self._spawn()
        self._new_scheduler()
        self.report.start = self._stats()  # the ranks have joined: their caches exist
        plan = list(self.args.faults)
        t0 = time.monotonic()
        next_fault = t0 + self.args.fault_every
        seed = self.args.seed
        def over() -> bool:  # time is up, every kind was injected, every fault settled
            spent = time.monotonic() - t0  # (a fault that never settles: not survived)
            return spent >= self.args.seconds and (not plan and not self.confirm
                                                   or spent >= self.args.seconds + 120)

        try:
            while not over():
                stopsignals.check()
                workload = list(chat_workload(60, self.layout.block_size, seed))
                seed += 1
                for i in range(0, len(workload), 2):
                    now = time.monotonic()
                    if now >= next_fault and (plan or now - t0 < self.args.seconds):
                        kind = plan.pop(0) if plan else self.rng.choice(self.args.faults)
                        self._inject(kind)
                        next_fault = time.monotonic() + self.args.fault_every
                    self._one_step(workload[i:i + 2])
                    if over():
                        break
        finally:  # (also when a rank never came back: main reports it)
            self.report.wall_s = time.monotonic() - t0
            self.report.end = self._stats()
        return self.report

    def _stats(self) -> dict[str, int]:
        fds, rss = process_stats()
        rank_fds, rank_rss = self._rank_stats()
        return {"fds": fds, "rss": rss, "rank_fds": rank_fds, "rank_rss": rank_rss}

    @property
    def touched(self) -> bool:
        """A fault may make the current step fail (tampered batch, store away, dead rank)."""
        return self.tampered or self.pending is not None or bool(self.confirm)

    def _one_step(self, reqs: Sequence[tuple[str, Sequence[bytes]]]) -> None:
        rp = self.rp
        before = (rp.s.mismatched, rp.s.failed_ops)
        touched = self.touched
        try:
            rp.run_step(reqs)
        except RankLost as e:
            if not touched:
                self.report.unexpected.append(f"step {self.report.steps}: {e}")
            for rid in rp.running:
                rp.cm.abort(rid)
            rp.running = []
            self._restart_group()
            self._settle(ok=False)
            return
        self.report.steps += 1
        failed = (rp.s.mismatched, rp.s.failed_ops) != before
        if failed and not touched:
            self.report.unexpected.append(f"step {self.report.steps}: an untouched batch "
                                          f"failed ({rp.s.mismatched} mismatched)")
        if self.report.steps % self.args.check_every == 0:
            rp.cm.check_invariants()
        self._settle(ok=not failed)

    def _settle(self, ok: bool) -> None:
        """After a step: a one-shot tamper is over; a lasting fault may be undone; faults
        injected before a step that worked (in a later epoch, for a kill) were survived."""
        Tamper.install(self.dp, None)
        was_tampered, self.tampered = self.tampered, False
        if self.pending is not None and self.rng.random() < 0.3:
            self.pending()
            self.pending = None
            return
        if not ok or was_tampered or self.pending is not None:
            return
        for kind, epoch in self.confirm:
            if kind != "kill" or self.report.epochs > epoch:
                self.report.survived[kind] += 1
        self.confirm = [(k, e) for k, e in self.confirm if k == "kill" and
                        self.report.epochs <= e]

    # ------------------------------------------------------------ faults

    def _inject(self, kind: str) -> None:
        self.report.injected[kind] += 1
        getattr(self, f"_fault_{kind}")()

    def _push(self, keys: Any) -> zmq.Socket[Any]:
        from zkv import security

        s = security.new_socket(self.ctx, zmq.PUSH)
        s.linger = 0
        s.sndhwm = 10_000
        security.setup_client(s, keys, self.pull)
        s.connect(self.pull)
        return s

    def _wait_counted(self, what: str, target: int) -> bool:
        """Until the dispatcher counted ``target`` refusals of a kind (completions that come
        meanwhile, storage writes, are committed by the replayer, never dropped)."""
        deadline = time.monotonic() + 10
        while self.dp.refusals()[what] < target:
            if time.monotonic() > deadline:
                return False
            self.rp.pump(0.01)
        return True

    def _fault_junk(self) -> None:
        base = self.dp.refusals()["malformed"]
        push = self._push(self.keyring.for_rank(0))
        for _ in range(500):
            push.send_multipart([os.urandom(self.rng.randint(0, 40))
                                 for _ in range(self.rng.randint(1, 4))])
        if self._wait_counted("malformed", base + 500):
            self.report.survived["junk"] += 1
        push.close()

    def _fault_forged(self) -> None:
        """The last rank's key, speaking as rank 0 (with rank 0's real pid)."""
        base = self.dp.refusals()["forged"]
        push = self._push(self.keyring.for_rank(self.args.ranks - 1))
        seq, pid = self.dp.next_seq, self.procs[0].pid
        for msg in (P.BlocksCopied(seq, 0, False, ()), P.Heartbeat(0, pid, seq),
                    P.Bye(0, pid, "forged")):
            push.send_multipart(P.encode(msg))
        if self._wait_counted("forged", base + 3) and not self.dp.lost_ranks:
            self.report.survived["forged"] += 1
        push.close()

    def _fault_rogue(self) -> None:
        from zkv.security import ClientKeys

        base = self.dp.refusals()["unauthenticated"]
        public, secret = zmq.curve_keypair()
        push = self._push(ClientKeys(0, self.keyring.server_public, public, secret))
        if self._wait_counted("unauthenticated", base + 1):
            self.report.survived["rogue"] += 1
        push.close()

    def _fault_duplicate(self) -> None:
        self.tampered = True
        Tamper.install(self.dp, lambda frames: [frames, frames])
        self.confirm.append(("duplicate", self.report.epochs))

    def _fault_truncate(self) -> None:
        self.tampered = True
        Tamper.install(self.dp, lambda frames: [frames[:-1]])
        self.confirm.append(("truncate", self.report.epochs))

    def _fault_store(self) -> None:
        if self.pending is not None:
            self.pending()
        away = self.store_dir + ".away"
        os.rename(self.store_dir, away)
        with open(self.store_dir, "wb"):
            pass  # a file where the directory was: every put fails, every get misses

        def undo() -> None:
            os.unlink(self.store_dir)
            os.rename(away, self.store_dir)

        self.pending = undo
        self.confirm.append(("store", self.report.epochs))

    def _fault_kill(self) -> None:
        """SIGKILL a rank: the next step loses it, rolls back and restarts the group."""
        self.procs[self.rng.randrange(len(self.procs))].send_signal(signal.SIGKILL)
        self.confirm.append(("kill", self.report.epochs))

    def _fault_restart(self) -> None:
        """The scheduler goes away without a word (as if killed) and a new one binds the
        same endpoints: the ranks must rejoin it."""
        self._end_epoch(shutdown=False)
        self._new_scheduler()
        self.report.epochs += 1
        self.confirm.append(("restart", self.report.epochs - 1))


def soak_layout(args: argparse.Namespace) -> CacheLayout:
    return CacheLayout(2, 2, BLOCK_SIZE, 32, "float16", args.device_blocks, args.host_blocks,
                       world_size=args.ranks)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zkv soak", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--seconds", type=positive_float, default=120.0,
                   help="how long to replay (default: %(default)s)")
    p.add_argument("--ranks", type=positive_int, default=2,
                   help="worker processes (default: %(default)s)")
    p.add_argument("--seed", type=nonneg_int, default=0,
                   help="seed of the workload and of the faults' order (default: %(default)s)")
    p.add_argument("--fault-every", type=positive_float, default=1.0,
                   help="seconds between faults (default: %(default)s)")
    p.add_argument("--faults", default=None,
                   help=f"comma-separated subset of {','.join(FAULTS)} (default: all; "
                        "all but forged at --ranks 1)")
    p.add_argument("--check-every", type=positive_int, default=10,
                   help="steps between invariant checks (default: %(default)s)")
    p.add_argument("--device-blocks", type=integer, default=512,
                   help=f"device blocks per rank, >= {MIN_DEVICE_BLOCKS} (default: %(default)s)")
    p.add_argument("--host-blocks", type=nonneg_int, default=256,
                   help="host blocks per rank (default: %(default)s)")
    p.add_argument("--store-mb", type=positive_int, default=256,
                   help="L3 byte budget, all ranks together (default: %(default)s)")
    p.add_argument("--log-dir", type=nonempty, default=None,
                   help="where the JSON logs go (default: in the soak's run directory, "
                        "removed at the end)")
    p.add_argument("--force", action="store_true",
                   help="more ranks than 4 per core, or pools past the memory there is")
    args = p.parse_args(argv)
    if args.faults is None:  # forged needs another rank's key to speak with
        args.faults = [f for f in FAULTS if args.ranks > 1 or f != "forged"]
    else:
        args.faults = [f for f in args.faults.split(",") if f]
    bad = set(args.faults) - set(FAULTS)
    if bad or not args.faults:
        p.error(f"unknown faults {sorted(bad)}; choose from {','.join(FAULTS)}" if bad else
                f"--faults names none; choose from {','.join(FAULTS)}")
    if args.ranks == 1 and "forged" in args.faults:  # it would forge with rank 0's own key
        p.error("--faults forged needs --ranks 2 or more (it speaks with another rank's key)")
    # Every listed fault is injected once in order, --fault-every apart, before the soak ends.
    needed = len(args.faults) * args.fault_every
    if args.seconds < needed:
        p.error(f"--seconds {args.seconds:g} is too short to inject {len(args.faults)} faults "
                f"--fault-every {args.fault_every:g} s apart; give --seconds >= {needed:g} "
                "or fewer --faults")
    if args.device_blocks < MIN_DEVICE_BLOCKS:  # else every request is dropped: no batch is
        # sent, and a fault that only traffic shows (a killed rank) goes unseen
        p.error(f"--device-blocks must be >= {MIN_DEVICE_BLOCKS} (the longest chat prompt "
                f"alone), got {args.device_blocks}")
    try:
        short = scheduler_shortfall(soak_layout(args))
    except ConfigError as e:  # (a pool past what a block id holds)
        p.error(f"--device-blocks / --host-blocks: {e}")
    if short:  # (--force passes the pools' check, not this one: a MemoryError, the OOM killer)
        p.error(f"{short}; lower --device-blocks / --host-blocks")
    if not args.force:  # as zkv replay and zkvrun bound them
        from launch.env import max_local_ranks

        if args.ranks > max_local_ranks():
            p.error(f"--ranks {args.ranks} is more than 4 per core ({max_local_ranks()} "
                    "here); pass --force if you mean it")
        short = pools_shortfall(soak_layout(args))
        if short:
            p.error(f"{short}; lower them or pass --force")
    try:
        if args.log_dir:
            check_log_dir(args.log_dir)
        check_level()  # ZKV_LOG_LEVEL, which every process of the soak reads
    except ConfigError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 / 1 (see the module docstring), 2 a bad flag, 130 interrupted (SIGINT),
    143 terminated (SIGTERM); interrupted or terminated, the report so far is printed and
    the run directory removed."""
    from zkv import log as zlog
    from zkv import security

    args = _parse(argv)
    stopsignals.exit_on_stop_signals()  # so the cleanup runs: ranks reaped, run dir removed
    # (a /dev/shm that cannot take it, full in a container: the disk)
    bases = ["/dev/shm", "/tmp"] if os.path.isdir("/dev/shm") else ["/tmp"]
    try:
        for base in bases:
            security.clean_stale_runs(base)
        run_dir = security.make_run_dir_in(bases, prefix="soak-")
    except ConfigError as e:
        print(f"zkv soak: error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    soak: Soak | None = None
    stopped = 0  # the exit status of the signal that stopped the soak, if one did
    try:
        soak = Soak(args, run_dir)
        zlog.configure("soak", log_dir=soak.log_dir, level="warning")
        try:
            soak.run()
        except (TimeoutError, RankLost) as e:  # a rank that never came back: in the report
            soak.report.unexpected.append(f"{type(e).__name__}: {e}")
        soak._end_epoch(shutdown=True)
    except KeyboardInterrupt:
        stopped = 128 + signal.SIGINT
    except SystemExit as e:  # SIGTERM, SIGHUP (zkv/stopsignals.py)
        stopped = e.code if isinstance(e.code, int) else 1
    finally:
        if soak is not None:
            soak.close()
        security.remove_run_dir(run_dir)
    if soak is not None:  # (the report so far, when a signal stopped it)
        streams.say("\n".join(soak.report.lines(soak.layout.block_bytes, args.ranks)),
                    sys.stdout)
    if stopped:
        what = "interrupted" if stopped == 128 + signal.SIGINT else "terminated"
        print(f"zkv soak: {what}", file=sys.stderr, flush=True)
        return stopped
    assert soak is not None
    return 0 if soak.report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
