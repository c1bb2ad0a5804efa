"""From a review of the worker side: a rejoin drops the old scheduler's queued batches; a
store call hung across a rejoin is said, and a stop still stops the rank; a store that
answers for fewer keys than it was given fails the op; a socket that cannot be made stops
the actor with an exit code, its waiters told."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import zmq

import zkv.kernels as kernels
from tests.waiting import holds_within, idle_for, wait_until
from tests.worker.helpers import FakeScheduler, digest, endpoints, poll_until_done
from tests.worker.test_actor import LAYOUT, GatedBackend, Rig, _ids
from zkv import protocol as P
from zkv.errors import TransferError
from zkv.kernels import TorchCpuBackend
from zkv.scheduler.dispatcher import Dispatcher
from zkv.storage import LocalDirStore, Store, pack_key
from zkv.worker import Sidecar, storage_io
from zkv.worker.actor import WorkerActor
from zkv.worker.storage_io import StorageIO


def _wait_connected(monitor: Any, timeout: float = 10.0) -> None:
    """Until the worker's SUB (re)connected to the new XPUB (its handshake, seen by libzmq:
    the actor thread, busy, has not looked)."""
    from zmq.utils.monitor import recv_monitor_message

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, "the worker never connected to the new scheduler"
        if monitor.poll(int(left * 1000) + 1):
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return


def test_a_batch_of_the_old_scheduler_queued_at_a_restart_does_not_kill_the_rank(
        stack: ExitStack, folder: str) -> None:
    """A batch the old scheduler published, still queued on the SUB socket when the actor
    notices the restart, is taken for the new scheduler's: the actor resets its seq to 0, then
    reads the stale batch (seq 1) as a gap and stops -- a rank lost at every restart that lands
    while the actor is busy with a batch (a long copy, a gated wait).

    The two waits below are for deliveries over ipc (ms) that the test cannot observe; if
    one were too short the test would pass without proving anything, never fail."""
    ctx: zmq.Context[Any] = zmq.Context()
    stack.callback(ctx.term)
    pub, pull = endpoints(folder)
    old = FakeScheduler(ctx, pub, pull)
    be = GatedBackend(kernels.get_backend("cpu"), gate_d2h=True)
    stack.callback(be.gate.set)
    kv = kernels.get_backend("cpu").allocate_device_cache(LAYOUT)
    sc = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull, backend=be,
                 heartbeat_interval_s=0.05)
    stack.callback(sc.close)
    old.wait_ready({0})
    old.send(P.encode(P.CopyBlocks(0, 0, (P.Op(0, P.D2H, _ids(0), _ids(0)),))))
    assert be.entered.wait(5)  # the actor is busy with seq 0 (a long copy)
    old.send(P.encode(P.CopyBlocks(1, 1, ())))  # queued behind it
    idle_for(0.3)  # (delivery into the worker's SUB queue over ipc: ms)
    old.close()  # the scheduler dies
    new = FakeScheduler(ctx, pub, pull)
    stack.callback(new.close)
    mon = new.xpub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    stack.callback(lambda: mon.close(0))
    _wait_connected(mon)  # the worker reconnected (libzmq), the actor has not looked yet
    idle_for(0.2)  # (the worker side's own handshake event reaches its monitor: ms;
    #                  without it the stale batch may run first: a false pass)
    be.gate.set()  # seq 0 finishes; the actor sees the restart, then reads the queue
    new.wait_ready({0})  # the rank's hello to the new scheduler
    new.send(P.encode(P.CopyBlocks(0, 0, ())))  # the new scheduler's first batch
    deadline = time.monotonic() + 5
    while True:
        msg = new.recv(max(0.01, deadline - time.monotonic()))
        assert not isinstance(msg, P.Bye), f"the rank stopped: {msg.reason}"
        if isinstance(msg, P.BlocksCopied) and msg.seq == 0 and msg.t_recv > 0 and not msg.results:
            break
    assert sc.alive and sc.actor.exit_code is None


class ReadEntered(LocalDirStore):
    """A real ``file://`` store that says when a batched read began (so a test knows the
    call is running, not queued)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        self.entered.set()
        return super().get_many_into(keys, outs)


def _hung_read_at_a_restart(stack: ExitStack, folder: str, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> tuple[Sidecar, Any, list, str]:
    """A rank whose s2h read hangs (:func:`_hung_read`) when its scheduler restarts.
    Returns once the rank noticed the restart and the hung call was said; (sidecar, new
    scheduler, logs, the FIFO: opening it for writing ends the read)."""
    monkeypatch.setattr(storage_io, "IO_STUCK_S", 3600.0)  # nothing said before the restart
    sc, old, logs, fifo = _hung_read(stack, folder, tmp_path)
    old.close()  # the scheduler dies with the read hung ...
    new = FakeScheduler(old.xpub.context, *endpoints(folder))  # ... and comes back
    stack.callback(new.close)
    wait_until(lambda: any(e["event"] == "worker.scheduler_rejoined" for e in logs), 10,
               "the rank to notice the restart")
    monkeypatch.setattr(storage_io, "IO_STUCK_S", 0.2)
    wait_until(lambda: any(e["event"] == "worker.io_stuck" for e in logs), 10,
               "the call hung across the restart said (the rank waits on it in silence)")
    return sc, new, logs, fifo


def _end_read(fifo: str, timeout: float = 10.0) -> bool:
    """Open the FIFO for writing and close it: the read blocked in ``open`` returns (and
    fails: a FIFO is no block file). False if no read was waiting within ``timeout``."""
    def opened() -> bool:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as e:
            assert e.errno == errno.ENXIO, e  # (no reader in open() yet)
            return False
        return True

    return holds_within(opened, timeout)


def test_a_store_call_hung_at_a_restart_is_said_and_the_rank_rejoins_once_it_returns(
        stack: ExitStack, folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At a rejoin the old scheduler's I/O is waited for before the hello (an old s2h would
    write host blocks the new scheduler hands out). That wait ran outside the loop, so a call
    hung on a ``file://`` store was never said (``worker.io_stuck``) and the rank just never
    said hello to the new scheduler. Now it is said while the rank waits, and the rank joins
    the new scheduler once the call returns."""
    sc, new, logs, fifo = _hung_read_at_a_restart(stack, folder, tmp_path, monkeypatch)
    [stuck] = [e for e in logs if e["event"] == "worker.io_stuck"]
    assert (stuck["seq"], stuck["op_id"], stuck["kind"]) == (0, 0, P.S2H), stuck
    assert _end_read(fifo), "the read was not waiting in open()"
    new.wait_ready({0})  # the rank's hello to the new scheduler
    events = [e["event"] for e in logs]
    assert "worker.io_unstuck" in events and "worker.io_dropped" in events, events
    assert events.index("worker.io_unstuck") < events.index("worker.io_dropped")
    new.send(P.encode(P.CopyBlocks(0, 0, ())))  # the new scheduler's seq 0 is served
    msg = new.recv(5)
    assert isinstance(msg, P.BlocksCopied) and msg.seq == 0 and not msg.results, msg
    assert sc.alive


def test_a_rank_waiting_on_a_hung_store_call_at_a_restart_still_stops(
        stack: ExitStack, folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and a stop (the engine shutting down) while the rank waits on that call stops it:
    the call is left to its thread, the actor ends with exit 0 and its Bye, and the
    store's close that follows does not wait for the call a second time (before: the
    drain left the call, the fresh I/O's close had none, and the store's close waited
    its whole ``close_wait_s`` again)."""
    sc, new, logs, _ = _hung_read_at_a_restart(stack, folder, tmp_path, monkeypatch)
    assert sc.close(), "the rank did not stop while it waited on the hung call"
    assert sc.actor.exit_code == 0
    closing = threading.Thread(target=sc.actor.store.close, daemon=True)
    closing.start()
    closing.join(1.0)
    assert not closing.is_alive(), "the store's close waited again for the call left"
    # The old scheduler's first ack (op 0 pending) may still sit in the rank's PUSH queue:
    # it reaches the new scheduler first (whose dispatcher refuses it as an unknown seq).
    msg = new.recv(5)
    if isinstance(msg, P.BlocksCopied):
        assert (msg.seq, msg.pending, msg.results) == (0, (0,), ()), msg
        msg = new.recv(5)
    assert isinstance(msg, P.Bye), msg


def _hung_read(stack: ExitStack, folder: str, tmp_path: Path
               ) -> tuple[Sidecar, FakeScheduler, list, str]:
    """A sidecar rank whose s2h read hangs on a real ``file://`` store (the block file is
    a FIFO: ``open`` waits for a writer, as on a hung file system; nothing times it out).
    Returns once the read runs; (sidecar, scheduler, logs, the FIFO)."""
    from structlog.testing import capture_logs

    store = ReadEntered(tmp_path, "ns", rank=0)
    key = b"\1" * 16
    fifo = store.path(pack_key(key, 0))
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    os.mkfifo(fifo)
    logs = stack.enter_context(capture_logs())
    ctx: zmq.Context[Any] = zmq.Context()
    stack.callback(ctx.term)
    pub, pull = endpoints(folder)
    sched = FakeScheduler(ctx, pub, pull)
    stack.callback(sched.close)
    kv = kernels.get_backend("cpu").allocate_device_cache(LAYOUT)
    sc = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                 backend="cpu", store=store, heartbeat_interval_s=0.05)
    stack.callback(sc.close)
    stack.callback(_end_read, fifo, 0.5)  # (before sc.close: last first)
    sched.wait_ready({0})
    sched.send(P.encode(P.CopyBlocks(0, 0, (P.Op(0, P.S2H, dst=_ids(0), keys=(key,)),))))
    assert store.entered.wait(10), "the s2h read never began"
    return sc, sched, logs, fifo


def test_a_stop_while_a_store_call_hangs_leaves_the_call_and_stops(
        stack: ExitStack, folder: str, tmp_path: Path) -> None:
    """A stop (the engine shutting its sidecar down) while a store call hangs for good:
    the actor waits for it up to the store's ``close_wait_s``, then leaves it to its
    thread, says so (``worker.io_abandoned``) and ends (exit 0). That thread is a daemon
    thread: the engine's process can still exit, and the store's close that follows does
    not wait for the call a second time. Before: the actor waited on the call for
    ever (a ``ThreadPoolExecutor`` shutdown), ``Sidecar.close`` gave up after its join
    timeout, and the executor's thread, joined at the interpreter's exit, kept the engine's
    process from exiting."""
    sc, _, logs, fifo = _hung_read(stack, folder, tmp_path)
    assert sc.close(), "the sidecar did not stop while a store call hung"
    assert sc.actor.exit_code == 0
    [left] = [e for e in logs if e["event"] == "worker.io_abandoned"]
    assert (left["num_calls"], left["seq"], left["op_id"], left["kind"]) == (1, 0, 0, P.S2H)
    io = [t for t in threading.enumerate() if t.name.startswith("zkv-io-0")]
    assert io and all(t.daemon for t in io), [(t.name, t.daemon) for t in io]
    # The store's close (the engine's, the rank's) does not wait for that call again: the
    # actor already did (before, a hung store held a stop for two close_wait_s, 5 s each).
    closing = threading.Thread(target=sc.actor.store.close, daemon=True)
    closing.start()
    closing.join(1.0)
    assert not closing.is_alive(), "the store's close waited again for the call left"
    assert _end_read(fifo), "the read was not hung any more"  # (it was left, not ended)


def _blocked_in_open(pid: int) -> bool:
    """Whether a thread of ``pid`` is blocked opening a FIFO (no writer yet)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                if f.read().strip() == "wait_for_partner":
                    return True
        except OSError:
            continue
    return False


def test_a_rank_process_stops_on_a_signal_while_a_store_call_hangs(tmp_path: Path,
                                                                   folder: str) -> None:
    """``python -m zkv.worker`` (as zkvrun starts it) with a store call hung for good gets
    SIGTERM: it stops, exit 0, the call said as left (``worker.io_abandoned``), and the
    process ends with that thread still in the call (it ends at once, past Python's exit:
    a thread coming back from a store call in finalization is ended by a forced unwind).
    Before: the rank never exited (the I/O pool was waited on at the stop, and its threads
    again at the interpreter's exit), whatever zkvrun sent short of SIGKILL."""
    from tests.worker.test_main import LAYOUT as RANK_LAYOUT
    from tests.worker.test_main import rank_env

    store_dir = tmp_path / "store"
    probe = LocalDirStore(store_dir, RANK_LAYOUT.fingerprint(), rank=0)  # (the rank's paths)
    key = b"\3" * 16
    fifo = probe.path(pack_key(key, 0))
    probe.close()
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    os.mkfifo(fifo)
    pub, pull = endpoints(folder)
    env = rank_env(tmp_path, RANK="0", ZKV_STORE_URL=f"file://{store_dir}",
                   ZKV_PUB_ENDPOINT=pub, ZKV_PULL_ENDPOINT=pull)
    ctx: zmq.Context[Any] = zmq.Context()
    sched = FakeScheduler(ctx, pub, pull)
    proc = subprocess.Popen([sys.executable, "-m", "zkv.worker"], env=env,
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        sched.wait_ready({0}, timeout=60)
        dst = np.array([0], "<i4")
        sched.send(P.encode(P.CopyBlocks(0, 0, (P.Op(0, P.S2H, dst=dst, keys=(key,)),))))
        wait_until(lambda: _blocked_in_open(proc.pid), 30, "the rank's read to block in open")
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, f"the rank did not stop on SIGTERM with a store call hung ({code})"
        log = (tmp_path / "logs" / "worker-0.jsonl").read_text()
        [left] = [e for e in map(orjson.loads, log.splitlines())
                  if e["event"] == "worker.io_abandoned"]
        assert (left["num_calls"], left["kind"]) == (1, P.S2H), left
        assert "Traceback" not in (proc.stderr.read() if proc.stderr else ""), "stderr"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stderr:
            proc.stderr.close()
        sched.close()
        ctx.term()


class ShortAnswers(Store):
    """A real local store, but a get answers for all its keys but the last."""

    def __init__(self, inner: LocalDirStore) -> None:
        super().__init__(inner.namespace)
        self.inner = inner

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.exists(keys)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        return self.inner.get_many_into(keys, outs)[:-1]

    def put_many(self, keys: Sequence[bytes], datas: Sequence[Any]) -> list[bool]:
        return self.inner.put_many(keys, datas)

    def remove(self, key: bytes) -> None:
        self.inner.remove(key)


def test_a_short_store_answer_fails_the_unanswered_blocks(tmp_path: Path) -> None:
    """A store whose batched call answers for fewer keys than it was given (the contract says
    one result per key, in order; ``Store._count_present`` guards ``exists`` against exactly
    this: "a short answer would read as 'all there'"). ``StorageIO._move`` zips the answer with
    the block range, so its outcome list is short, and ``job.outcome[lo:hi] = ...`` shrinks the
    op's outcome list: the blocks left unanswered vanish, later chunks land on shifted indices,
    and the op's result reads ``ok`` for every block that is left -- an ``OpResult(ok=True,
    done < num_blocks)``, which the dispatcher refuses as a broken rank's ack (the batch then
    waits for the ack deadline and the rank is judged lost), or, over several chunks, a prefix
    that claims a block never read."""

    b = TorchCpuBackend()
    pool = b.allocate_host_pool(LAYOUT)
    inner = LocalDirStore(tmp_path, "ns")
    keys = tuple(bytes([i + 1]) * 16 for i in range(4))
    io = StorageIO(ShortAnswers(inner), 0, b, pool, io_threads=1, chunk_blocks=4)
    try:
        for k in keys:  # every block is in the store
            inner.put(pack_key(k, 0), bytes(LAYOUT.block_bytes))
        io.start(5, [P.Op(3, P.S2H, dst=P.as_ids(range(4)), keys=keys)])
        got: list = []
        wait_until(lambda: got.extend(io.take_done()) or got, 10, "the op's result")
        [(seq, [res], left)] = got
        # the store said nothing about block 3 (nor, in order, which ones it answered for):
        # the op fails, and its result is one the dispatcher takes
        assert P.result_claim_error(res, 4) is None, (res, P.result_claim_error(res, 4))
        assert not res.ok and res.done < 4 and "results" in str(res.error), res
    finally:
        io.close()


class NoSecondSocket:
    """A context whose second socket fails as at EMFILE (the first one is real)."""

    def __init__(self) -> None:
        self.inner: zmq.Context[Any] = zmq.Context()
        self.made: list[Any] = []

    def socket(self, kind: int) -> Any:
        if self.made:
            raise zmq.ZMQError(24, "Too many open files")
        s = self.inner.socket(kind)
        self.made.append(s)
        return s


def test_a_socket_that_cannot_be_made_stops_the_actor_cleanly(folder: str) -> None:
    """``WorkerActor.run`` makes its context and sockets before its ``try``: a failure there (a
    process out of file descriptors: EMFILE from ``ctx.socket``) leaves the thread by an
    uncaught exception -- no ``exit_code``, no ``worker.stopped`` line, the counter never
    closed, the SUB socket (and an own context) never closed. A model thread that waits
    (``wait_layer`` / ``wait_acked`` without a timeout, as the API allows) hangs for good."""
    cpu = kernels.get_backend("cpu")
    ctx = NoSecondSocket()
    actor = WorkerActor(0, LAYOUT, cpu.allocate_device_cache(LAYOUT),
                        cpu.allocate_host_pool(LAYOUT), cpu,
                        pub_endpoint=f"ipc://{folder}/pub", pull_endpoint=f"ipc://{folder}/pull",
                        context=ctx)  # type: ignore[arg-type]
    t = threading.Thread(target=actor.run, daemon=True)
    try:
        t.start()
        t.join(5)
        assert not t.is_alive()
        assert actor.exit_code is not None, "the actor thread died without an exit code"
        with pytest.raises(TransferError):  # a waiter is told, not left waiting
            actor.counter.wait_layer(0, 0, timeout=2)
        assert actor.wait_acked(0, timeout=None) is None
        assert all(s.closed for s in ctx.made), "the socket made before the failure leaked"
    finally:
        for s in ctx.made:
            s.close(0)
        ctx.inner.term()


def test_a_wait_for_an_ack_across_a_restart_never_gets_the_new_schedulers_batch(
        stack: ExitStack, folder: str) -> None:
    """An engine waits for this rank's ack of batch 1 of a scheduler that dies before it
    sends it. The rank rejoins a new scheduler (its seqs start over at 0): the wait kept on
    waiting and returned the new scheduler's batch 1 (other ops, other blocks) as the ack
    asked for; without a timeout it waited until the new one got that far. Now it returns
    at the rejoin: None (the old batch 1 will never be acked)."""
    ctx: zmq.Context[Any] = zmq.Context()
    stack.callback(ctx.term)
    pub, pull = endpoints(folder)
    old = FakeScheduler(ctx, pub, pull)
    kv = kernels.get_backend("cpu").allocate_device_cache(LAYOUT)
    sc = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                 backend="cpu", heartbeat_interval_s=0.05)
    stack.callback(sc.close)
    old.wait_ready({0})
    old.send(P.encode(P.CopyBlocks(0, 0, ())))
    assert sc.wait_acked(0, 5) is not None
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(sc.wait_acked(1, 30)), daemon=True)
    waiter.start()
    stack.callback(waiter.join, 10)  # (after sc.close: that ends the wait at the latest)
    old.close()  # the scheduler dies ...
    new = FakeScheduler(ctx, pub, pull)  # ... and comes back
    stack.callback(new.close)
    new.wait_ready({0})  # the rank rejoined (its hello)
    new.send(P.encode(P.CopyBlocks(0, 0, ())))
    new.send(P.encode(P.CopyBlocks(1, 1, (P.Op(0, P.D2H, _ids(2), _ids(3)),))))
    ack = sc.wait_acked(1, 5)
    assert ack is not None and ack.results == (P.OpResult(0, True, 1),)
    wait_until(lambda: got, 5, "the wait for the old scheduler's batch 1 to end")
    assert got == [None], got  # not the new scheduler's batch 1
    assert sc.wait_acked(0, 0) is not None  # (a wait that begins after the rejoin: its seqs)


def _recompute(sc: Sidecar, block: int, value: float) -> None:
    """The engine's forward writes every layer of device block ``block``."""
    for layer in range(LAYOUT.num_layers):
        for t in sc.actor.kv_caches[layer]:
            t[block].fill_(value)


def test_an_abandoned_load_calls_off_the_running_save_of_a_block_its_step_reuses(
        stack: ExitStack, folder: str) -> None:
    """A step evicts device block 5 (d2h to host block 3) and loads into it (h2d): a block
    given up by an eviction may be reused in the same step, as the forward's wait on layer 0
    comes after the batch's d2h. The engine's wait ran out while that d2h still ran (held
    here); it abandoned the load and recomputes block 5. abandon_load said no copy still ran
    (it waited for layer copies only), and the d2h, reading block 5 after the recompute, was
    acked ok: the new request's KV saved as the evicted block's. Now the batch's saves are
    called off with its loads: the running one is waited for (past the timeout here: said)
    and fails."""
    be = GatedBackend(kernels.get_backend("cpu"), gate_d2h=True)
    rig = Rig(stack, folder, backend=be)
    stack.callback(be.gate.set)
    sc = rig.sidecars[0]
    assert rig.run([P.Op(0, P.FILL, dst=_ids(5), keys=(digest(5),))]).ok
    seq = rig.d.publish([P.Op(0, P.D2H, _ids(5), _ids(3)),
                         P.Op(1, P.H2D, _ids(1), _ids(5), layerwise=True)], 1)
    assert be.entered.wait(5)  # the d2h runs
    with pytest.raises(TimeoutError):
        sc.wait_layer(seq, 0, timeout=0.05)
    assert not sc.abandon_load(seq, 0, "layer 0 timed out", timeout=0.1), \
        "abandon_load said no copy of the batch still ran"
    _recompute(sc, 5, 7.0)
    be.gate.set()
    done = poll_until_done(rig.d, seq)[seq]
    assert [(r.ok, r.done) for r in (done.results[0], done.results[1])] == [(False, 0)] * 2
    assert "abandoned" in str(done.results[0].error), done.results[0]


def test_an_abandoned_load_calls_off_the_save_of_its_batch_not_run_yet(
        stack: ExitStack, folder: str) -> None:
    """... and a save of the batch that has not run yet (a gated batch, not released when
    the engine gave up) never runs: it would read what the forward wrote since."""
    pub, pull = endpoints(folder)
    d = Dispatcher(pub, pull, 1, LAYOUT.fingerprint())
    stack.callback(d.close)
    kv = kernels.get_backend("cpu").allocate_device_cache(LAYOUT)
    sc = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                 backend="cpu", heartbeat_interval_s=0.05, gated=True)
    stack.callback(sc.close)
    d.wait_for_ranks(10)
    sc.release(0)
    assert poll_until_done(d, d.publish([P.Op(0, P.FILL, dst=_ids(5), keys=(digest(5),))],
                                        0))[0].ok
    seq = d.publish([P.Op(0, P.D2H, _ids(5), _ids(3)),
                     P.Op(1, P.H2D, _ids(1), _ids(5), layerwise=True)], 1)
    with pytest.raises(TimeoutError):
        sc.wait_layer(seq, 0, timeout=0.05)
    assert sc.abandon_load(seq, 0, "layer 0 timed out", timeout=1)
    _recompute(sc, 5, 7.0)
    sc.release(seq)  # the next step
    done = poll_until_done(d, seq)[seq]
    assert [(r.ok, r.done) for r in (done.results[0], done.results[1])] == [(False, 0)] * 2
    assert "abandoned" in str(done.results[0].error), done.results[0]


def test_a_rejoin_forgets_the_old_schedulers_release_and_abandoned_saves(
        stack: ExitStack, folder: str) -> None:
    """The engine released batches up to 5 of a scheduler that then restarted, and gave up
    on its saves up to 5. The new scheduler's seqs (and the engine's) start over at 0: its
    save 0 runs, and its load 1 waits for the engine's release of 1 (with the old release
    kept, it wrote the KV cache while an earlier forward could still read it)."""
    ctx: zmq.Context[Any] = zmq.Context()
    stack.callback(ctx.term)
    pub, pull = endpoints(folder)
    old = FakeScheduler(ctx, pub, pull)
    kv = kernels.get_backend("cpu").allocate_device_cache(LAYOUT)
    sc = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                 backend="cpu", heartbeat_interval_s=0.05, gated=True)
    stack.callback(sc.close)
    old.wait_ready({0})
    sc.release(5)
    assert sc.abandon_saves(5, timeout=1)
    old.close()  # the scheduler dies ...
    new = FakeScheduler(ctx, pub, pull)  # ... and comes back
    stack.callback(new.close)
    new.wait_ready({0})  # the rank rejoined (its hello)
    new.send(P.encode(P.CopyBlocks(0, 0, (P.Op(0, P.D2H, _ids(2), _ids(3)),))))
    ack = sc.wait_acked(0, 5)
    assert ack is not None and ack.results == (P.OpResult(0, True, 1),), ack
    new.send(P.encode(P.CopyBlocks(1, 1, (P.Op(0, P.FILL, dst=_ids(4), keys=(digest(4),)),))))
    assert sc.wait_acked(1, 0.3) is None  # held: the engine has not released the new 1
    sc.release(1)
    ack = sc.wait_acked(1, 5)
    assert ack is not None and ack.ok, ack


class _RecordFails:
    """The CPU backend whose ``fail_at``-th ``record_event`` raises (a non-sticky device
    error: the backend's contract lets those propagate unchanged)."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self._inner = inner
        self.fail_at = fail_at
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def record_event(self) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("cudaErrorInvalidResourceHandle (non-sticky)")
        return self._inner.record_event()


def test_an_event_that_fails_after_an_h2d_layer_leaves_no_copy_running(
        stack: ExitStack, folder: str) -> None:
    """The event after layer 1's h2d raises: the batch is acked failed, the layer's wait
    raises, and the engine's ``abandon_load`` that follows returns at once, quiet. Before,
    the counter kept that layer "copying" for good (only the copy itself was guarded):
    the abandon waited its whole timeout and said a copy still ran (vLLM: 2 s of a
    stopped forward, and an overrun)."""
    be = _RecordFails(kernels.get_backend("cpu"), fail_at=2)  # layer 0's event is the 1st
    rig = Rig(stack, folder, backend=be)
    sc = rig.sidecars[0]
    seq = rig.d.publish([P.Op(0, P.H2D, _ids(0, 1), _ids(2, 3), layerwise=True)], step=0)
    assert not poll_until_done(rig.d, seq)[seq].ok
    with pytest.raises(TransferError):
        sc.wait_layer(seq, 1, timeout=5)
    assert sc.abandon_load(seq, 1, "load failed", timeout=2.0)
