"""The worker actor in-process (Sidecar threads) with real zmq sockets over ipc://."""

from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import zmq
from structlog.testing import capture_logs

import zkv.kernels as kernels
import zkv.kernels.reference as reference
from tests.waiting import wait_until
from tests.worker.helpers import (
    FakeScheduler,
    digest,
    endpoints,
    events_named,
    poll_for,
    poll_until_done,
)
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.errors import TransferError
from zkv.scheduler.dispatcher import BatchDone, Dispatcher
from zkv.storage import HEADER_SIZE, LocalDirStore
from zkv.worker import Sidecar
from zkv.worker.actor import EXIT_OK, EXIT_REFUSED, EXIT_SEQ_GAP

NUM_BLOCKS = 16
LAYOUT = CacheLayout(num_layers=4, kv_heads=2, block_size=4, head_dim=8, dtype="float16",
                     num_device_blocks=NUM_BLOCKS, num_host_blocks=NUM_BLOCKS, world_size=2)


class Rig:
    """A Dispatcher and ``world_size`` Sidecars, each with its own device cache."""

    def __init__(self, stack: ExitStack, folder: str, world_size: int = 1,
                 backend: Any = "cpu", store_dir: Path | None = None,
                 layout: CacheLayout = LAYOUT, **dispatcher_kw: Any) -> None:
        pub, pull = endpoints(folder)
        self.layout = layout
        self.d = Dispatcher(pub, pull, world_size, layout.fingerprint(), **dispatcher_kw)
        stack.callback(self.d.close)
        self.cpu = kernels.get_backend("cpu")
        self.sidecars: list[Sidecar] = []
        for rank in range(world_size):
            kv = self.cpu.allocate_device_cache(layout)
            store = LocalDirStore(store_dir, layout.fingerprint()) if store_dir else None
            sc = Sidecar(kv, layout=layout, rank=rank, pub_endpoint=pub, pull_endpoint=pull,
                         backend=backend, store=store, heartbeat_interval_s=0.05)
            stack.callback(sc.close)
            self.sidecars.append(sc)
        self.d.wait_for_ranks(10)

    def run(self, ops: list[P.Op], step: int = 0) -> BatchDone:
        seq = self.d.publish(ops, step)
        return poll_until_done(self.d, seq)[seq]


def _keys(n: int, salt: int = 0) -> tuple[bytes, ...]:
    return tuple(digest(salt, i) for i in range(n))


def _ids(*xs: int) -> np.ndarray:
    return P.as_ids(list(xs))


def test_d2h_h2d_round_trip_is_byte_identical(stack: ExitStack, folder: str) -> None:
    rig = Rig(stack, folder, world_size=2)
    keys = _keys(8)
    src, host, dst = _ids(*range(8)), _ids(*range(3, 11)), _ids(*range(8, 16))
    done = rig.run([P.Op(0, P.FILL, dst=src, keys=keys)])
    assert done.ok, done
    done = rig.run([P.Op(0, P.D2H, src, host)])
    assert done.results == {0: P.OpResult(0, True, 8)}
    for sc in rig.sidecars:  # the host pool holds exactly the rank's pattern
        for h, key in zip(host.tolist(), keys):
            got = bytes(rig.cpu.host_block(sc.host_pool, h))
            assert got == reference.expected_block_bytes(LAYOUT, key, sc.rank)
    done = rig.run([P.Op(0, P.H2D, host, dst, layerwise=True),
                    P.Op(1, P.CHECK, src=dst, keys=keys)])
    assert done.ok and done.results[1] == P.OpResult(1, True, 8), done
    for sc in rig.sidecars:
        kv = sc.actor.kv_caches
        assert reference.check_pattern(kv, dst, keys, sc.rank) == 8
        for k, v in kv:
            assert k[8:16].numpy().tobytes() == k[0:8].numpy().tobytes()
            assert v[8:16].numpy().tobytes() == v[0:8].numpy().tobytes()


def test_merged_copies_of_several_ops_move_each_op_to_its_own_blocks(
        stack: ExitStack, folder: str) -> None:
    """A batch's ops of one kind go as one merged copy (their ids concatenated): each op's
    blocks must land where that op says, ops of different sizes and unsorted ids too."""
    rig = Rig(stack, folder)
    sc = rig.sidecars[0]
    keys = _keys(4, salt=3)
    assert rig.run([P.Op(0, P.FILL, dst=_ids(0, 1, 2, 3), keys=keys)]).ok
    done = rig.run([P.Op(0, P.D2H, _ids(2), _ids(9)),
                    P.Op(1, P.D2H, _ids(0, 3, 1), _ids(4, 12, 6))])
    assert done.results == {0: P.OpResult(0, True, 1), 1: P.OpResult(1, True, 3)}, done
    for h, key in ((9, keys[2]), (4, keys[0]), (12, keys[3]), (6, keys[1])):
        got = bytes(rig.cpu.host_block(sc.host_pool, h))
        assert got == reference.expected_block_bytes(LAYOUT, key, sc.rank), h
    done = rig.run([P.Op(0, P.H2D, _ids(12, 4), _ids(15, 8), layerwise=True),
                    P.Op(1, P.H2D, _ids(9), _ids(11), layerwise=True),
                    P.Op(2, P.CHECK, src=_ids(8, 11, 15), keys=(keys[0], keys[2], keys[3]))])
    assert done.ok and done.results[2] == P.OpResult(2, True, 3), done


def test_check_reports_the_first_mismatch(stack: ExitStack, folder: str) -> None:
    rig = Rig(stack, folder)
    keys = _keys(4)
    rig.run([P.Op(0, P.FILL, dst=_ids(0, 1, 2, 3), keys=keys)])
    with capture_logs() as logs:
        done = rig.run([P.Op(0, P.CHECK, src=_ids(0, 1, 9, 3), keys=keys)])
    assert not done.ok
    res = done.results[0]
    assert (res.ok, res.done) == (False, 2) and "device block 9" in str(res.error)
    assert len(events_named(logs, "worker.copy_failed")) == 1
    # a mismatch in the last block only is one too (all but one block right is not ok)
    done = rig.run([P.Op(0, P.CHECK, src=_ids(0, 1, 2, 9), keys=keys)])
    res = done.results[0]
    assert (done.ok, res.ok, res.done) == (False, False, 3) and "device block 9" in str(res.error)


def test_empty_batches_are_acked_and_mark_every_layer(stack: ExitStack, folder: str) -> None:
    rig = Rig(stack, folder, world_size=2)
    for step in range(20):
        done = rig.run([], step)
        assert done.ok and done.results == {} and done.seq == step
        for rank, sc in enumerate(rig.sidecars):
            sc.wait_layer(step, LAYOUT.num_layers - 1, timeout=1)
            ack = sc.wait_acked(step, 1)  # what the idle step kept is what it sent
            assert type(ack) is P.BlocksCopied
            assert (ack.seq, ack.rank, ack.ok, ack.results, ack.pending) == (step, rank, True,
                                                                             (), ())
            assert type(ack.t_recv) is float and ack.t_recv <= ack.t_done
            assert P.decode(P.encode(ack)) == ack
    assert [sc.last_seq for sc in rig.sidecars] == [19, 19]


class GatedBackend:
    """The CPU backend, with chosen copies held until the test opens a gate."""

    def __init__(self, inner: Any, gate_h2d_layer: int | None = None,
                 gate_d2h: bool = False) -> None:
        self._inner = inner
        self.gate_h2d_layer = gate_h2d_layer
        self.gate_d2h = gate_d2h
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _hold(self) -> None:
        self.entered.set()
        if not self.gate.wait(10):
            raise RuntimeError("gate never opened")

    def copy_h2d(self, host_pool: Any, kv: Any, src: Any, dst: Any, layer: int) -> None:
        if layer == self.gate_h2d_layer:
            self._hold()
        self._inner.copy_h2d(host_pool, kv, src, dst, layer)

    def copy_d2h(self, kv: Any, host_pool: Any, src: Any, dst: Any, layers: Any = None) -> None:
        if self.gate_d2h:
            self._hold()
        self._inner.copy_d2h(kv, host_pool, src, dst, layers)


def test_layer_zero_proceeds_while_last_layer_copy_is_held(stack: ExitStack, folder: str) -> None:
    last = LAYOUT.num_layers - 1
    be = GatedBackend(kernels.get_backend("cpu"), gate_h2d_layer=last)
    rig = Rig(stack, folder, backend=be)
    stack.callback(be.gate.set)  # never leave the actor stuck
    sc = rig.sidecars[0]
    seq = rig.d.publish([P.Op(0, P.H2D, _ids(0, 1), _ids(2, 3), layerwise=True)], step=0)
    sc.wait_layer(seq, 0, timeout=5)  # returns although the last layer is not copied
    assert be.entered.wait(5)  # the last layer's copy has started and is held
    counter = sc.actor.counter
    assert [counter.is_done(seq, i) for i in range(LAYOUT.num_layers)] == [True] * last + [False]
    assert rig.d.poll(0) == [] and rig.d.in_flight == 1  # no ack before the copy finished
    be.gate.set()
    sc.wait_layer(seq, last, timeout=5)
    assert poll_until_done(rig.d, seq)[seq].ok


def test_no_layer_is_done_before_the_batch_d2h(stack: ExitStack, folder: str) -> None:
    """A device block evicted in this step may be rewritten by this step's forward."""
    be = GatedBackend(kernels.get_backend("cpu"), gate_d2h=True)
    rig = Rig(stack, folder, backend=be)
    stack.callback(be.gate.set)
    sc = rig.sidecars[0]
    seq = rig.d.publish([P.Op(0, P.D2H, _ids(0), _ids(0)),
                         P.Op(1, P.H2D, _ids(1), _ids(0), layerwise=True)], step=0)
    assert be.entered.wait(5)
    assert not any(sc.actor.counter.is_done(seq, i) for i in range(LAYOUT.num_layers))
    with pytest.raises(TimeoutError):
        sc.wait_layer(seq, 0, timeout=0.05)
    be.gate.set()
    sc.wait_layer(seq, 0, timeout=5)
    assert poll_until_done(rig.d, seq)[seq].ok


def test_abandon_saves_waits_for_the_running_save_of_the_batch_it_names(
        stack: ExitStack, folder: str) -> None:
    """The engine's wait for batch ``seq`` ran out while that batch's own d2h runs:
    abandon_saves(seq) waits for it (it must not return while the save may still read
    blocks the forward is about to write), and the save, started before, commits."""
    be = GatedBackend(kernels.get_backend("cpu"), gate_d2h=True)
    rig = Rig(stack, folder, backend=be)
    stack.callback(be.gate.set)
    sc = rig.sidecars[0]
    seq = rig.d.publish([P.Op(0, P.D2H, _ids(2), _ids(7))], step=0)
    assert be.entered.wait(5)  # the save of batch seq runs
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(sc.abandon_saves(seq, timeout=5)),
                         daemon=True)
    t.start()
    wait_until(lambda: sc.actor._gate_waiting == 1, 5, "abandon_saves waiting for the save")
    assert got == []
    be.gate.set()
    t.join(5)
    assert got == [True]  # quiet: the save ended before the forward went on
    assert poll_until_done(rig.d, seq)[seq].results == {0: P.OpResult(0, True, 1)}


class FailingBackend:
    """The CPU backend, failing every copy that touches device block ``bad``."""

    def __init__(self, inner: Any, bad: int) -> None:
        self._inner = inner
        self.bad = bad

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def copy_d2h(self, kv: Any, host_pool: Any, src: Any, dst: Any, layers: Any = None) -> None:
        if self.bad in np.asarray(src).tolist():
            raise RuntimeError(f"device block {self.bad} is on fire")
        self._inner.copy_d2h(kv, host_pool, src, dst, layers)

    def copy_h2d(self, host_pool: Any, kv: Any, src: Any, dst: Any, layer: int) -> None:
        if self.bad in np.asarray(dst).tolist():
            raise RuntimeError(f"device block {self.bad} is on fire")
        self._inner.copy_h2d(host_pool, kv, src, dst, layer)


def test_failing_op_becomes_error_result_and_actor_keeps_running(
        stack: ExitStack, folder: str) -> None:
    rig = Rig(stack, folder, backend=FailingBackend(kernels.get_backend("cpu"), bad=5))
    keys = _keys(4)
    rig.run([P.Op(0, P.FILL, dst=_ids(0, 1, 2, 3), keys=keys)])
    with capture_logs() as logs:
        done = rig.run([
            P.Op(0, P.D2H, _ids(0, 1), _ids(0, 1)),
            P.Op(1, P.BACKUP, _ids(5), _ids(9)),  # fails
            P.Op(2, P.D2H, _ids(2, 3), _ids(2, 3)),
            P.Op(3, P.H2D, _ids(0, 1), _ids(4, 5), layerwise=True),  # fails
            P.Op(4, P.H2D, _ids(2, 3), _ids(6, 7), layerwise=True),
            P.Op(5, P.CHECK, src=_ids(6, 7), keys=keys[2:]),
        ])
    assert not done.ok
    assert [done.results[i].ok for i in range(6)] == [True, False, True, False, True, True]
    assert "on fire" in str(done.results[1].error) and "on fire" in str(done.results[3].error)
    assert done.results[3].done == 0
    failed = events_named(logs, "worker.copy_failed")
    assert {e["op_id"] for e in failed} == {1, 3}
    assert rig.run([P.Op(0, P.CHECK, src=_ids(0, 1), keys=keys[:2])]).ok  # still alive


def test_out_of_range_ids_are_refused_without_touching_the_cache(
        stack: ExitStack, folder: str) -> None:
    rig = Rig(stack, folder)
    keys = _keys(2)
    rig.run([P.Op(0, P.FILL, dst=_ids(0, 1), keys=keys)])
    with capture_logs() as logs:
        done = rig.run([P.Op(0, P.H2D, _ids(0), _ids(1)),
                        P.Op(1, P.D2H, _ids(0), _ids(NUM_BLOCKS))])
    assert not done.ok
    for i in (0, 1):
        res = done.results[i]
        assert (res.ok, res.done) == (False, 0) and "out of range" in str(res.error)
    (refused,) = events_named(logs, "worker.batch_refused")
    assert refused["seq"] == 1
    with pytest.raises(TransferError, match="refused"):
        rig.sidecars[0].wait_layer(1, 0, timeout=1)
    # the in-range h2d of the refused batch did not run: block 1 still holds its pattern
    assert rig.run([P.Op(0, P.CHECK, src=_ids(0, 1), keys=keys)]).ok


def test_l3_round_trip_in_process(stack: ExitStack, folder: str, tmp_path: Path) -> None:
    rig = Rig(stack, folder, world_size=2, store_dir=tmp_path)
    keys = _keys(6, salt=7)
    rig.run([P.Op(0, P.FILL, dst=_ids(*range(6)), keys=keys)])
    assert rig.run([P.Op(0, P.D2H, _ids(*range(6)), _ids(*range(6))),
                    P.Op(1, P.H2S, src=_ids(*range(6)), keys=keys)]).ok
    store = LocalDirStore(tmp_path, LAYOUT.fingerprint())
    for rank in (0, 1):
        for key in keys:
            path = Path(store.path(key + rank.to_bytes(2, "big")))
            want = reference.expected_block_bytes(LAYOUT, key, rank)
            assert path.read_bytes()[HEADER_SIZE:] == want
    done = rig.run([P.Op(0, P.S2H, dst=_ids(*range(10, 16)), keys=keys)])
    assert done.results[0] == P.OpResult(0, True, 6)
    done = rig.run([P.Op(0, P.H2D, _ids(*range(10, 16)), _ids(*range(10, 16))),
                    P.Op(1, P.CHECK, src=_ids(*range(10, 16)), keys=keys)])
    assert done.ok, done
    # a missing key in the middle: done is the prefix that arrived
    holey = (keys[0], keys[1], digest(99, 99), keys[3])
    done = rig.run([P.Op(0, P.S2H, dst=_ids(0, 1, 2, 3), keys=holey)])
    res = done.results[0]
    assert (res.ok, res.done) == (False, 2) and "not in the store" in str(res.error)


def test_storage_ops_without_a_store_fail_cleanly(stack: ExitStack, folder: str) -> None:
    rig = Rig(stack, folder)
    done = rig.run([P.Op(0, P.H2S, src=_ids(0), keys=_keys(1))])
    assert done.results[0] == P.OpResult(0, False, 0, "rank 0: no L3 store on this worker")


def test_heartbeats_keep_an_idle_rank_alive(stack: ExitStack, folder: str) -> None:
    rig = Rig(stack, folder, world_size=2, heartbeat_timeout_s=0.3)
    assert poll_for(rig.d, 1.0) == []
    assert rig.d.lost_ranks == frozenset()
    assert rig.run([]).ok


def test_seq_gap_says_bye_and_dispatcher_loses_the_rank(stack: ExitStack, folder: str) -> None:
    rig = Rig(stack, folder, world_size=2)
    assert rig.run([]).ok
    rig.d._next_seq += 1  # a batch the ranks never see: seq 1 is skipped
    with capture_logs() as logs:
        seq = rig.d.publish([], step=2)
        done = poll_until_done(rig.d, seq)[seq]
        for sc in rig.sidecars:
            wait_until(lambda sc=sc: not sc.alive, 5, "the actor to stop")
    assert not done.ok and done.lost_ranks
    lost = events_named(logs, "dispatcher.rank_lost")
    assert lost and "seq gap: expected 1 got 2" in lost[0]["reason"]
    assert len(events_named(logs, "worker.seq_gap")) == 2
    for sc in rig.sidecars:
        assert sc.actor.exit_code == EXIT_SEQ_GAP
        assert sc.exit_reason == "seq gap: expected 1 got 2"
        with pytest.raises(TransferError, match="seq gap"):
            sc.wait_layer(2, 0, timeout=1)


def test_close_is_prompt_and_says_bye(stack: ExitStack, folder: str) -> None:
    rig = Rig(stack, folder)
    sc = rig.sidecars[0]
    t = time.monotonic()
    sc.close()
    assert time.monotonic() - t < 1.0
    assert sc.actor.exit_code == EXIT_OK and not sc.alive
    wait_until(lambda: bool(rig.d.poll(0.05) or rig.d.lost_ranks), 5, "the rank to be lost")
    assert rig.d.lost_ranks == frozenset({0})


def test_shutdown_stops_every_rank(stack: ExitStack, folder: str) -> None:
    rig = Rig(stack, folder, world_size=2)
    rig.d.close(shutdown=True)
    for sc in rig.sidecars:
        wait_until(lambda sc=sc: not sc.alive, 5, "the actor to stop")
        assert (sc.actor.exit_code, sc.exit_reason) == (EXIT_OK, "shutdown")


# ---------------------------------------------------------------- raw frames


@pytest.fixture
def raw(stack: ExitStack, folder: str) -> tuple[FakeScheduler, Sidecar]:
    ctx: zmq.Context[Any] = zmq.Context()
    stack.callback(ctx.term)
    pub, pull = endpoints(folder)
    fake = FakeScheduler(ctx, pub, pull)
    stack.callback(fake.close)
    kv = kernels.get_backend("cpu").allocate_device_cache(LAYOUT)
    sc = Sidecar(kv, layout=LAYOUT, rank=1, pub_endpoint=pub, pull_endpoint=pull, backend="cpu",
                 heartbeat_interval_s=0.05)
    stack.callback(sc.close)
    fake.wait_ready({1})
    assert fake.hellos[1].layout == LAYOUT.fingerprint()
    return fake, sc


def _batch_frames(seq: int, ops: tuple[P.Op, ...] = ()) -> list[bytes]:
    return P.encode(P.CopyBlocks(seq, seq, ops))


def _ack(fake: FakeScheduler) -> P.BlocksCopied:
    msg = fake.recv()
    assert isinstance(msg, P.BlocksCopied), msg
    return msg


def test_malformed_batch_is_acked_failed_and_actor_lives(
        raw: tuple[FakeScheduler, Sidecar]) -> None:
    fake, sc = raw
    fake.send(_batch_frames(0))
    assert _ack(fake).ok
    frames = _batch_frames(1, (P.Op(4, P.D2H, _ids(0), _ids(0)), P.Op(9, P.H2D, _ids(0), _ids(1))))
    hdr = orjson.loads(frames[1])
    hdr["v"] = 99
    with capture_logs() as logs:
        fake.send([frames[0], orjson.dumps(hdr), *frames[2:]])
        ack = _ack(fake)
    assert (ack.seq, ack.rank, ack.ok) == (1, 1, False)
    assert [(r.id, r.ok, r.done) for r in ack.results] == [(4, False, 0), (9, False, 0)]
    assert "version" in str(ack.results[0].error)
    assert events_named(logs, "worker.batch_refused")[0]["seq"] == 1
    fake.send(_batch_frames(2))
    assert _ack(fake).seq == 2  # the next batch works


def test_unreadable_messages_are_refused_without_ack(raw: tuple[FakeScheduler, Sidecar]) -> None:
    fake, sc = raw
    with capture_logs() as logs:
        fake.send([P.T_BATCH, b"\x00garbage"])  # no seq to read: refused, not acked
        fake.send([b"Teleport", b"{}"])  # unknown type
        fake.send([P.T_BATCH])  # truncated
        fake.send(P.encode(P.Hello(0, 1, "x")))  # not for a worker
        fake.send(_batch_frames(0))
        ack = _ack(fake)
    assert (ack.seq, ack.ok) == (0, True)  # the first ack is for seq 0: nothing was consumed
    assert len(events_named(logs, "worker.batch_refused")) == 4
    assert sc.alive and sc.last_seq == 0


def test_raw_seq_gap_sends_bye(raw: tuple[FakeScheduler, Sidecar]) -> None:
    fake, sc = raw
    fake.send(_batch_frames(0))
    assert _ack(fake).seq == 0
    fake.send(_batch_frames(0))  # an old seq is refused, not a gap
    fake.send(_batch_frames(3))
    bye = fake.recv()
    assert bye == P.Bye(1, bye.pid, "seq gap: expected 1 got 3")  # type: ignore[union-attr]
    wait_until(lambda: not sc.alive, 5, "the actor to stop")
    assert sc.actor.exit_code == EXIT_SEQ_GAP


def test_raw_shutdown(raw: tuple[FakeScheduler, Sidecar]) -> None:
    fake, sc = raw
    fake.send(P.encode(P.Shutdown("bye now")))
    bye = fake.recv()
    assert isinstance(bye, P.Bye) and bye.reason == "shutdown"
    wait_until(lambda: not sc.alive, 5, "the actor to stop")


def test_raw_refused_for_another_process_is_read_past(
        raw: tuple[FakeScheduler, Sidecar]) -> None:
    """Every rank reads every ``Refused``: one for another pid of this rank (a late
    joiner), or for another rank, changes nothing here, and is not counted as refused."""
    fake, sc = raw
    pid = fake.hellos[1].pid
    fake.send(P.encode(P.Refused(1, pid + 1, "rank 1 (pid ...) refused: cannot rejoin")))
    fake.send(P.encode(P.Refused(0, pid, "rank 0 refused")))
    fake.send(_batch_frames(0))
    assert _ack(fake).seq == 0  # the batch after them ran
    assert sc.alive and sc.actor.num_refused == 0


def test_raw_refused_stops_the_rank_naming_why(raw: tuple[FakeScheduler, Sidecar]) -> None:
    fake, sc = raw
    pid = fake.hellos[1].pid
    with capture_logs() as logs:
        fake.send(P.encode(P.Refused(1, pid, "rank 1 (pid 7) refused: head_dim: rank has 16")))
        bye = fake.recv()
        wait_until(lambda: not sc.alive, 5, "the actor to stop")
    assert isinstance(bye, P.Bye) and bye.pid == pid
    assert bye.reason == "refused by the scheduler: rank 1 (pid 7) refused: head_dim: rank has 16"
    assert sc.actor.exit_code == EXIT_REFUSED
    (line,) = events_named(logs, "worker.refused")
    assert "head_dim" in line["error"]
    with pytest.raises(TransferError, match="refused by the scheduler"):
        sc.wait_layer(0, 0, timeout=5)  # an engine waiting on the rank hears why it stopped


def test_sidecar_reads_its_environment(stack: ExitStack, folder: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pub, pull = endpoints(folder)
    layout = CacheLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=8,
                         num_device_blocks=4, num_host_blocks=4, world_size=1)
    d = Dispatcher(pub, pull, 1, layout.fingerprint())
    stack.callback(d.close)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("ZKV_PUB_ENDPOINT", pub)
    monkeypatch.setenv("ZKV_PULL_ENDPOINT", pull)
    monkeypatch.setenv("ZKV_CONFIG", layout.to_json())
    kv = kernels.get_backend("cpu").allocate_device_cache(layout)
    with Sidecar(kv, backend="cpu") as sc:
        d.wait_for_ranks(10)
        assert (sc.rank, sc.layout) == (0, layout)
        assert tuple(sc.host_pool.shape) == (4, 2, 2, 1, 4, 8)
        seq = d.publish([], step=0)
        sc.wait_layer(seq, 1, timeout=5)
        assert poll_until_done(d, seq)[seq].ok
        assert sc.last_seq == 0


def test_sidecar_without_environment_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from zkv.errors import ConfigError

    for name in ("RANK", "ZKV_PUB_ENDPOINT", "ZKV_PULL_ENDPOINT", "ZKV_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    kv = kernels.get_backend("cpu").allocate_device_cache(LAYOUT)
    with pytest.raises(ConfigError, match="ZKV_CONFIG"):
        Sidecar(kv, backend="cpu")
    with pytest.raises(ConfigError, match="RANK"):
        Sidecar(kv, layout=LAYOUT, backend="cpu")
    with pytest.raises(ConfigError, match="ZKV_PUB_ENDPOINT"):
        Sidecar(kv, layout=LAYOUT, rank=0, backend="cpu")


# ---------------------------------------------------------------- inside a host process


def _affinity(tid: str) -> str:
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(ln.split()[1] for ln in f if ln.startswith("Cpus_allowed_list"))


def test_zkv_threads_run_on_every_cpu_when_the_host_pinned_its_thread(
        stack: ExitStack, folder: str, tmp_path: Path) -> None:
    """vLLM's CPU worker pins the thread that builds the connector (its OpenMP thread) to
    one core; threads inherit that. The Sidecar's threads (the actor's, its heartbeats,
    zmq's, the store's I/O pool) run on every CPU instead."""
    every = os.sched_getaffinity(0)
    assert len(every) >= 2, "needs two CPUs (CI has them): nothing to pin away from"
    ctx: zmq.Context[Any] = zmq.Context()
    stack.callback(ctx.term)
    pub, pull = endpoints(folder)
    fake = FakeScheduler(ctx, pub, pull)
    stack.callback(fake.close)
    before = set(os.listdir("/proc/self/task"))
    built: list[Sidecar] = []

    def host_worker() -> None:  # what vLLM's CPU worker does before it builds the connector
        os.sched_setaffinity(0, {min(every)})
        kv = kernels.get_backend("cpu").allocate_device_cache(LAYOUT)
        built.append(Sidecar(kv, layout=LAYOUT, rank=1, pub_endpoint=pub, pull_endpoint=pull,
                             backend="cpu", heartbeat_interval_s=0.05,
                             store=LocalDirStore(tmp_path / "l3", "ns")))

    t = threading.Thread(target=host_worker)
    t.start()
    t.join()
    (sc,) = built
    stack.callback(sc.close)
    fake.wait_ready({1})
    fake.send(_batch_frames(0, (P.Op(1, P.H2S, _ids(0, 1), _ids(), _keys(2)),)))
    assert _ack(fake).ok  # the store's I/O threads exist now
    new = set(os.listdir("/proc/self/task")) - before
    assert len(new) >= 3, new
    want = _affinity(str(threading.get_native_id()))  # this thread's: every CPU
    assert {tid: _affinity(tid) for tid in new} == dict.fromkeys(new, want)
