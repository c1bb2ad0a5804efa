"""Rank failures with real worker processes: killed, frozen, seq gap, wrong layout, SIGTERM."""

from __future__ import annotations

import os
import signal
import time

import pytest
from structlog.testing import capture_logs

from tests.waiting import idle_for
from tests.worker.helpers import (
    WorkerGroup,
    digest,
    events_named,
    poll_until_done,
    reap,
)
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.errors import RankLost

LAYOUT = CacheLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=8,
                     num_device_blocks=8, num_host_blocks=8, world_size=2)


def _hold_batch_in_flight(g: WorkerGroup, rank: int) -> int:
    """Freeze ``rank`` and publish a batch: the others ack it, ``rank`` cannot."""
    os.kill(g.procs[rank].pid, signal.SIGSTOP)
    seq = g.d.publish([P.Op(0, P.D2H, P.as_ids([0]), P.as_ids([0]))], step=0)
    assert g.d.poll(0.2) == [] and g.d.in_flight == 1
    return seq


def test_killed_rank_is_lost_within_heartbeat_timeout(folder: str) -> None:
    g = WorkerGroup(folder, 2, LAYOUT, heartbeat_timeout_s=3.0)
    try:
        assert g.run([]).ok
        seq = _hold_batch_in_flight(g, 1)
        with capture_logs() as logs:
            g.procs[1].kill()
            t0 = time.monotonic()
            done = poll_until_done(g.d, seq, timeout=10)[seq]
            elapsed = time.monotonic() - t0
        assert elapsed < g.d.heartbeat_timeout_s, elapsed
        assert not done.ok and done.lost_ranks == frozenset({1})
        assert done.results[0].error is not None and done.results[0].error.startswith("rank 1 lost")
        (lost,) = events_named(logs, "dispatcher.rank_lost")
        assert lost["rank"] == 1
        with pytest.raises(RankLost):
            g.d.publish([], step=1)
    finally:
        codes = g.close()
    assert codes == [0, -signal.SIGKILL]


def test_frozen_rank_is_lost_by_heartbeat_timeout(folder: str) -> None:
    g = WorkerGroup(folder, 2, LAYOUT, heartbeat_timeout_s=1.0)
    try:
        seq = _hold_batch_in_flight(g, 0)
        t0 = time.monotonic()
        with capture_logs() as logs:
            done = poll_until_done(g.d, seq, timeout=10)[seq]
        elapsed = time.monotonic() - t0
        assert 0.5 < elapsed < 3.0, elapsed
        assert not done.ok and done.lost_ranks == frozenset({0})
        (lost,) = events_named(logs, "dispatcher.rank_lost")
        assert lost["rank"] == 0 and "no heartbeat" in lost["reason"]
    finally:
        codes = g.close()
    assert codes[1] == 0


def test_an_idle_gap_without_polls_loses_no_rank(folder: str) -> None:
    """An idle engine runs no step, so nothing polls the dispatcher, for longer than the
    heartbeat timeout while its workers keep beating: the next step runs on every rank
    (the heartbeats waiting in the queue are read before any rank is judged)."""
    g = WorkerGroup(folder, 2, LAYOUT, heartbeat_timeout_s=1.0)
    try:
        assert g.run([]).ok
        idle_for(2.5)  # the idle gap itself, past two heartbeat timeouts
        with capture_logs() as logs:
            done = g.run([P.Op(0, P.D2H, P.as_ids([0]), P.as_ids([0]))])
        assert done.ok and done.lost_ranks == frozenset()
        assert events_named(logs, "dispatcher.rank_lost") == []
    finally:
        codes = g.close()
    assert codes == [0, 0]


def test_missed_ack_deadline_loses_the_rank(folder: str) -> None:
    g = WorkerGroup(folder, 2, LAYOUT, heartbeat_timeout_s=60.0, ack_timeout_s=0.5)
    try:
        seq = _hold_batch_in_flight(g, 1)
        with capture_logs() as logs:
            done = poll_until_done(g.d, seq, timeout=10)[seq]
        assert done.lost_ranks == frozenset({1})
        (lost,) = events_named(logs, "dispatcher.rank_lost")
        assert "no ack for seq 0" in lost["reason"]
    finally:
        g.close()


def test_seq_gap_stops_the_worker_with_status_3(folder: str) -> None:
    g = WorkerGroup(folder, 2, LAYOUT)
    try:
        assert g.run([]).ok
        g.d._next_seq += 1  # seq 1 is never published: every rank sees a gap
        with capture_logs() as logs:
            seq = g.d.publish([], step=1)
            done = poll_until_done(g.d, seq)[seq]
        assert not done.ok
        lost = events_named(logs, "dispatcher.rank_lost")
        assert lost and all("seq gap: expected 1 got 2" in e["reason"] for e in lost)
        for p in g.procs:
            assert p.wait(10) == 3
    finally:
        g.close()


def test_sigterm_stops_the_worker_cleanly(folder: str) -> None:
    g = WorkerGroup(folder, 2, LAYOUT)
    try:
        g.procs[0].terminate()
        assert g.procs[0].wait(10) == 0
        with capture_logs() as logs:
            poll_until_done_or_lost(g)
        (lost,) = events_named(logs, "dispatcher.rank_lost")
        assert lost["rank"] == 0 and "sigterm" in lost["reason"]
    finally:
        g.close()


def poll_until_done_or_lost(g: WorkerGroup, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not g.d.lost_ranks:
        assert time.monotonic() < deadline, "no rank was declared lost"
        g.d.poll(0.05)


@pytest.mark.parametrize("field,value", [("num_host_blocks", 16), ("head_dim", 16)])
def test_wrong_layout_is_refused_at_hello_naming_the_field(folder: str, field: str,
                                                            value: int) -> None:
    """A rank whose layout differs (pool sizes too) is refused as soon as its hello
    arrives, not at the join timeout, and the error names the differing field. The rank
    is told: it stops by itself (exit 4) with one stderr line naming the field, instead
    of waiting for batches that never come."""
    import dataclasses
    import os
    import subprocess
    import sys

    from tests.worker.helpers import endpoints, worker_env
    from zkv.errors import ConfigError
    from zkv.log import RANK_REFUSED
    from zkv.scheduler.dispatcher import Dispatcher
    from zkv.worker.actor import EXIT_REFUSED

    ours = dataclasses.replace(LAYOUT, world_size=1)
    theirs = dataclasses.replace(ours, **{field: value})
    pub, pull = endpoints(folder)
    d = Dispatcher(pub, pull, 1, ours)
    err_path = os.path.join(folder, "rank0.stderr")
    with open(err_path, "wb") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "zkv.worker"],
                                env=worker_env(0, theirs.to_json(), pub, pull),
                                stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        with capture_logs() as logs, pytest.raises(ConfigError) as err:
            d.wait_for_ranks(60.0)
        why = f"{field}: rank has {value}, scheduler has {getattr(ours, field)}"
        assert why in str(err.value)
        (refused,) = events_named(logs, RANK_REFUSED)
        assert refused["rank"] == 0 and field in refused["error"]
        try:
            code = proc.wait(timeout=30)  # no Shutdown sent yet: only the refusal stops it
        except subprocess.TimeoutExpired:
            raise AssertionError("the refused rank was not told: still running") from None
        with open(err_path) as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith("zkv.worker:")]
        assert code == EXIT_REFUSED, (code, lines)
        assert lines == [f"zkv.worker: rank 0: refused by the scheduler: {err.value}"], lines
    finally:
        d.close(shutdown=True)
        proc.terminate()
        reap([proc])


def test_a_lost_rank_counts_once_in_the_metrics(folder: str) -> None:
    """``zkv:lost_ranks_total`` counts ranks: a rank lost with two batches in flight (a
    step's copies and its storage writes go in two) is one. Before, it counted one per
    failed batch (2 here), and again in every batch failed after a second rank was lost."""
    from zkv import metrics as M
    from zkv.replay import Replayer
    from zkv.scheduler.manager import CacheManager
    from zkv.scheduler.records import CacheConfig

    M.register_replay()
    before = M.REGISTRY.get_sample_value("zkv:lost_ranks_total")
    g = WorkerGroup(folder, 2, LAYOUT, heartbeat_timeout_s=1.0)
    try:
        cm = CacheManager(CacheConfig(LAYOUT.num_device_blocks, LAYOUT.num_host_blocks,
                                      LAYOUT.block_size, "write_back"))
        rp = Replayer(cm, g.d, LAYOUT, batch=1, progress=False)
        os.kill(g.procs[1].pid, signal.SIGSTOP)
        for block in (0, 1):  # two batches that rank 1 cannot ack
            rp._publish([], [rp._sim(P.FILL, [block], [digest(block)])])
        with pytest.raises(RankLost):
            rp.settle()
        assert not rp.outstanding
        assert M.REGISTRY.get_sample_value("zkv:lost_ranks_total") == before + 1
    finally:
        g.procs[1].kill()
        g.close()
