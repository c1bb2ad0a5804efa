"""Test helpers shared by tests/worker, tests/integration and tests/faults.

No sleeps as synchronization: everything waits on a socket poll or a condition with a
deadline.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq

from launch.zkvrun import pdeathsig_preexec
from tests.waiting import wait_until
from zkv import protocol as P
from zkv.scheduler.dispatcher import BatchDone, Dispatcher

DIGEST = 16


@contextmanager
def short_ipc_dir() -> Iterator[str]:
    """A 0700 directory with a short path (ipc:// paths are limited to ~100 bytes)."""
    path = tempfile.mkdtemp(prefix="zkv-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def endpoints(folder: str) -> tuple[str, str]:
    return f"ipc://{folder}/pub", f"ipc://{folder}/pull"


def digest(*parts: int) -> bytes:
    """A deterministic 16-byte block digest."""
    import xxhash

    return xxhash.xxh3_128_digest(repr(parts).encode())


def poll_until_done(d: Dispatcher, seqs: set[int] | int,
                    timeout: float = 10.0) -> dict[int, BatchDone]:
    """Poll the dispatcher until every seq in ``seqs`` completed; return them by seq."""
    want = {seqs} if isinstance(seqs, int) else set(seqs)
    got: dict[int, BatchDone] = {}
    deadline = time.monotonic() + timeout
    while not want <= got.keys():
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"seqs {sorted(want - got.keys())} not done within {timeout} s "
                                 f"(in flight {d.in_flight}, lost {sorted(d.lost_ranks)})")
        for b in d.poll(min(left, 0.1)):
            got[b.seq] = b
    return got


def poll_for(d: Dispatcher, seconds: float) -> list[BatchDone]:
    """Every batch the dispatcher completes within ``seconds``, polled the whole time (a
    poll reads the acks and heartbeats, and judges silent ranks): what an engine's steps
    do while a batch is held or the group idles."""
    out: list[BatchDone] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        out += d.poll(min(left, 0.05))
    return out


class FakeRank:
    """A worker's two sockets driven by hand, to test the dispatcher alone."""

    def __init__(self, ctx: zmq.Context[Any], pub_ep: str, pull_ep: str, rank: int,
                 fingerprint: str, pid: int | None = None, keys: Any = None) -> None:
        """``keys``: :class:`zkv.security.ClientKeys` to connect with (CURVE)."""
        from zkv import security

        self.rank = rank
        self.pid = pid if pid is not None else 100000 + rank
        self.fingerprint = fingerprint
        self.sub = ctx.socket(zmq.SUB)
        self.push = ctx.socket(zmq.PUSH)
        for s in (self.sub, self.push):
            s.setsockopt(zmq.LINGER, 0)
            security.setup_client(s, keys, pull_ep if s is self.push else pub_ep)
        self.sub.connect(pub_ep)
        self.push.connect(pull_ep)

    def subscribe(self) -> None:
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.SUBSCRIBE, P.ready_topic(self.rank, self.pid))

    def hello(self, fingerprint: str | None = None) -> None:
        self.send(P.Hello(self.rank, self.pid, fingerprint or self.fingerprint))

    def join(self) -> FakeRank:
        self.subscribe()
        self.hello()
        return self

    def send(self, msg: P.Message) -> None:
        self.push.send_multipart(P.encode(msg))

    def send_raw(self, frames: list[bytes]) -> None:
        self.push.send_multipart(frames)

    def recv(self, timeout: float = 5.0) -> P.Message:
        if not self.sub.poll(int(timeout * 1000)):
            raise AssertionError(f"rank {self.rank}: nothing received within {timeout} s")
        return P.decode(self.sub.recv_multipart())

    def recv_batch(self, timeout: float = 5.0) -> P.CopyBlocks:
        """The next batch, reading past ``Refused`` for other processes (as an actor does)."""
        msg = self.recv(timeout)
        while isinstance(msg, P.Refused) and (msg.rank, msg.pid) != (self.rank, self.pid):
            msg = self.recv(timeout)
        assert isinstance(msg, P.CopyBlocks), msg
        return msg

    def ack(self, batch: P.CopyBlocks, results: dict[int, P.OpResult] | None = None) -> None:
        res = tuple((results or {}).get(op.id) or P.OpResult(op.id, True, op.num_blocks)
                    for op in batch.ops)
        self.send(P.BlocksCopied(batch.seq, self.rank, all(r.ok for r in res), res,
                                 time.time(), time.time()))

    def heartbeat(self, last_seq: int = -1) -> None:
        self.send(P.Heartbeat(self.rank, self.pid, last_seq))

    def close(self) -> None:
        self.sub.close(0)
        self.push.close(0)


@contextmanager
def joined_fakes(ctx: zmq.Context[Any], eps: tuple[str, str], world_size: int, fingerprint: str,
                 keys: Any = None, join_timeout_s: float = 5.0,
                 **dispatcher_kw: Any) -> Iterator[tuple[Dispatcher, list[FakeRank]]]:
    """A Dispatcher bound on ``eps`` with ``world_size`` joined FakeRanks (ranks 0..n-1, each
    with its own key of the ``keys`` keyring, if any); the dispatcher (without a Shutdown)
    and the ranks are closed after."""
    d = Dispatcher(*eps, world_size, fingerprint, context=ctx, keys=keys, **dispatcher_kw)
    ranks = [FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, r, fingerprint,
                      keys=keys.for_rank(r) if keys is not None else None)
             for r in range(world_size)]
    try:
        for r in ranks:
            r.join()
        d.wait_for_ranks(join_timeout_s)
        yield d, ranks
    finally:
        d.close(shutdown=False)
        for r in ranks:
            r.close()


def events_named(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e.get("event") == name]


def worker_env(rank: int, layout_json: str, pub: str, pull: str, **extra: str) -> dict[str, str]:
    """The environment zkvrun gives a rank's ``python -m zkv.worker``."""
    env = dict(os.environ)
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "ZKV_CONFIG": layout_json,
        "ZKV_PUB_ENDPOINT": pub,
        "ZKV_PULL_ENDPOINT": pull,
        "ZKV_BACKEND": "cpu",
        "ZKV_HEARTBEAT_S": "0.1",
        "ZKV_LOG_LEVEL": "warning",
    })
    env.setdefault("OMP_NUM_THREADS", "1")  # as zkvrun / torchrun set it
    env.update(extra)
    return env


class FakeScheduler:
    """A dispatcher's two sockets driven by hand, to feed a worker raw (even broken) frames."""

    def __init__(self, ctx: zmq.Context[Any], pub_ep: str, pull_ep: str) -> None:
        self.xpub = ctx.socket(zmq.XPUB)
        self.pull = ctx.socket(zmq.PULL)
        for s in (self.xpub, self.pull):
            s.setsockopt(zmq.LINGER, 0)
        self.xpub.bind(pub_ep)
        self.pull.bind(pull_ep)
        self.ready: set[int] = set()
        self.hellos: dict[int, P.Hello] = {}

    def wait_ready(self, ranks: set[int], timeout: float = 10.0) -> None:
        """Until each rank said hello and its subscription marker arrived."""
        subs: set[tuple[int, int]] = set()
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.xpub, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        while not ranks <= {r for r, h in self.hellos.items() if (r, h.pid) in subs}:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"ranks {ranks} not ready within {timeout} s")
            for sock, _ in poller.poll(int(left * 1000) + 1):
                if sock is self.xpub:
                    raw = self.xpub.recv()
                    marker = P.parse_ready_topic(raw[1:])
                    if raw[:1] == b"\x01" and marker is not None:
                        subs.add(marker)
                else:
                    msg = P.decode(self.pull.recv_multipart())
                    if isinstance(msg, P.Hello):
                        self.hellos[msg.rank] = msg

    def send(self, frames: list[bytes]) -> None:
        self.xpub.send_multipart(frames)

    def recv(self, timeout: float = 5.0, skip_heartbeats: bool = True) -> P.Message:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pull.poll(int(left * 1000) + 1):
                raise AssertionError(f"no message within {timeout} s")
            msg = P.decode(self.pull.recv_multipart())
            if not (skip_heartbeats and isinstance(msg, P.Heartbeat)):
                return msg

    def close(self) -> None:
        self.xpub.close(0)
        self.pull.close(0)


class WorkerGroup:
    """A Dispatcher in this process and ``world_size`` ``python -m zkv.worker`` children,
    started with the environment zkvrun would give them. Always ``close()`` it (a finally
    or a fixture): it shuts the ranks down, then kills and reaps whatever is left."""

    def __init__(self, folder: str, world_size: int, layout: Any, *, store_dir: str | None = None,
                 heartbeat_timeout_s: float = 5.0, ack_timeout_s: float = 30.0,
                 join_timeout_s: float = 60.0, extra_env: dict[str, str] | None = None,
                 dispatcher_kw: dict[str, Any] | None = None) -> None:
        import subprocess
        import sys

        self.folder = folder
        self.world_size = world_size
        self.layout = layout
        pub, pull = endpoints(folder)
        self.d = Dispatcher(pub, pull, world_size, layout, heartbeat_timeout_s=heartbeat_timeout_s,
                            ack_timeout_s=ack_timeout_s, **(dispatcher_kw or {}))
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            extra = dict(extra_env or {})
            extra["ZKV_LOG_DIR"] = os.path.join(folder, "logs")
            if store_dir:
                extra["ZKV_STORE_DIR"] = store_dir
            for rank in range(world_size):
                err = open(os.path.join(folder, f"rank{rank}.stderr"), "wb")  # noqa: SIM115
                try:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "zkv.worker"],
                        env=worker_env(rank, layout.to_json(), pub, pull, **extra),
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                        preexec_fn=pdeathsig_preexec(signal.SIGKILL)))
                finally:
                    err.close()
            try:
                self.d.wait_for_ranks(join_timeout_s)
            except TimeoutError as e:
                raise TimeoutError(f"{e}; processes: {self.describe_procs()}") from None
        except BaseException:
            self.close(terminate=True)
            raise

    def describe_procs(self) -> str:
        """Each rank process's state, for a join that timed out: its exit status, or its
        kernel state and what it waits in (``D``: blocked on I/O). A live rank past its
        start (SIGUSR1 handled: zkv.worker's faulthandler) is asked for its Python stacks,
        which land in its stderr and so in the failed test's report."""
        import signal

        parts, asked = [], []
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                parts.append(f"rank {rank} pid {p.pid} exited with {p.returncode}")
                continue
            state = proc_state(p.pid)
            if handles_signal(p.pid, signal.SIGUSR1):
                os.kill(p.pid, signal.SIGUSR1)
                asked.append((rank, len(parts)))
            else:
                state += ", still importing (no stacks)"
            parts.append(f"rank {rank} pid {p.pid} {state}")
        for rank, i in asked:  # written before close() reads the stderr
            try:
                self.wait_for_stacks(rank)
            except AssertionError:
                parts[i] += ", no stacks within 5 s"
        return "; ".join(parts)

    def wait_for_stacks(self, rank: int, timeout: float = 5.0) -> None:
        """Until ``rank``'s stderr holds a faulthandler dump that stopped growing (the
        signal handler writes it all at once); AssertionError after ``timeout``."""
        last = [-1]

        def settled() -> bool:
            text = self.stderr(rank)
            done = "most recent call first" in text and len(text) == last[0]
            last[0] = len(text)
            return done

        wait_until(settled, timeout, f"rank {rank}'s stacks")

    def stderr(self, rank: int) -> str:
        with open(os.path.join(self.folder, f"rank{rank}.stderr"), "rb") as f:
            return f.read().decode(errors="replace")

    def run(self, ops: list[P.Op], step: int = 0, timeout: float = 30.0) -> BatchDone:
        seq = self.d.publish(ops, step)
        return poll_until_done(self.d, seq, timeout)[seq]

    def close(self, timeout: float = 10.0, terminate: bool = False) -> list[int | None]:
        """Shutdown, wait, kill what is left; return the exit codes. ``terminate``: also
        SIGTERM every rank (ranks that never joined may have missed the Shutdown)."""
        import signal
        import subprocess

        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)  # a rank a test froze takes its Shutdown too
        try:
            self.d.close(shutdown=True)
        finally:
            for p in self.procs if terminate else ():
                if p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + timeout
            for p in self.procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            self._keep_stderr()
        return [p.returncode for p in self.procs]

    def _keep_stderr(self) -> None:
        """Each rank's stderr tail, for the report of a test that fails (the folder is
        gone by then; tests/conftest.py prints them)."""
        for rank in range(len(self.procs)):
            try:
                tail = self.stderr(rank)[-STDERR_TAIL:]
            except OSError:
                continue
            if tail.strip():
                STDERR_TAILS.append((f"rank {rank} stderr ({self.folder})", tail))


#: Ranks' stderr tails kept by WorkerGroup.close during the current test (see conftest.py).
STDERR_TAILS: list[tuple[str, str]] = []
STDERR_TAIL = 4000


def reap(procs: list[Any], timeout: float = 10.0) -> list[int | None]:
    """Wait for each process (killing what outlives ``timeout``); their exit codes."""
    import subprocess

    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def proc_state(pid: int) -> str:
    """``state S, waits in do_epoll_wait, 1.2 s CPU`` from Linux /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip() or "-"
    except OSError:
        return "state unknown"
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return f"state {fields[0]}, waits in {wchan}, {cpu_s:.1f} s CPU"


def handles_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (SigCgt in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught >> (signum - 1) & 1)


def children_of(pid: int) -> list[int]:
    """Child pids of ``pid``'s main thread (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""
