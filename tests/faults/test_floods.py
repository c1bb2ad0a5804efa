"""Bounded inputs with real worker processes: a junk flood is refused cheaply and logged at
a bounded rate while batches keep completing; a frame over the size limit never reaches
Python; a rank that stops reading fills its queue and is lost, and no other rank ever
misses a batch."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

from tests.worker.helpers import WorkerGroup, events_named
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.errors import RankLost

LAYOUT = CacheLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=8,
                     num_device_blocks=8, num_host_blocks=8, world_size=2)


def test_junk_flood_is_counted_not_logged_per_message_and_batches_go_on(
        folder: str, ctx: zmq.Context[Any]) -> None:
    g = WorkerGroup(folder, 2, LAYOUT)
    n = 20_000
    kinds = [[b"\x00" * 17], [P.T_ACK, b"{not json"], [P.T_HEARTBEAT, b'{"v":1}'],
             [P.T_ACK, b'{"v":1,"seq":0,"rank":0,"ok":true,"ops":[7],"t_recv":0,"t_done":0}'],
             [b"x" * 40, b"y", b"z"]]

    def flood() -> None:  # its own socket, in its own thread (a PUSH blocks when full)
        junk = ctx.socket(zmq.PUSH)
        junk.connect(g.d.pull_endpoint)
        try:
            for i in range(n):
                junk.send_multipart(kinds[i % len(kinds)])
        finally:
            junk.close(linger=30_000)  # deliver what is queued (the test waits for it all)

    flooder = threading.Thread(target=flood, daemon=True)
    try:
        t0 = time.monotonic()
        with capture_logs() as logs:
            flooder.start()
            batches = 0
            while g.d.refusals()["malformed"] < n:  # batches run while the flood drains
                assert g.run([]).ok
                batches += 1
                assert time.monotonic() - t0 < 120, g.d.refusals()
            assert g.run([]).ok
        elapsed = time.monotonic() - t0
        flooder.join(10)
        assert g.d.refusals()["malformed"] == n and g.d.lost_ranks == frozenset()
        lines = events_named(logs, "dispatcher.ack_refused")
        # at most a burst of 10 lines a second; the later ones say how many they stand for
        assert 10 <= len(lines) <= 10 * (elapsed + 1), (len(lines), elapsed)
        assert len(lines) + sum(e.get("num_suppressed", 0) for e in lines) <= n
        assert batches >= 1
    finally:
        codes = g.close()
    assert codes == [0, 0]


def test_oversized_frame_never_reaches_python(folder: str, ctx: zmq.Context[Any]) -> None:
    g = WorkerGroup(folder, 1, CacheLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=8,
                                           num_device_blocks=8, num_host_blocks=8))
    big = ctx.socket(zmq.PUSH)
    big.linger = 0
    try:
        big.connect(g.d.pull_endpoint)
        before = g.d.num_received
        big.send_multipart([P.T_ACK, b"\x00" * (P.MAX_WORKER_FRAME_BYTES + 1)])
        for _ in range(5):
            assert g.run([]).ok  # the scheduler goes on; the rank's heartbeats arrive
        assert g.d.refusals()["malformed"] == 0  # it was never decoded: libzmq dropped it
        assert g.d.num_received > before  # (heartbeats and acks did arrive)
    finally:
        big.close(0)
        codes = g.close()
    assert codes == [0]


def test_rank_that_stops_reading_fills_its_queue_and_is_lost_no_one_misses_a_batch(
        folder: str) -> None:
    g = WorkerGroup(folder, 2, LAYOUT, heartbeat_timeout_s=30.0, ack_timeout_s=30.0,
                    dispatcher_kw={"send_hwm": 4, "send_timeout_s": 1.0})
    # a 20 KB batch: the kernel buffer of the frozen rank's connection fills in a few dozen
    ids = P.as_ids([0] * 1000)
    keys = tuple(bytes(16) for _ in range(1000))
    try:
        os.kill(g.procs[1].pid, signal.SIGSTOP)
        published = []
        with capture_logs() as logs, pytest.raises(RankLost) as lost:
            for step in range(10_000):
                published.append(g.d.publish([P.Op(0, P.CHECK, src=ids, keys=keys)], step))
                g.d.poll(0)
        assert lost.value.rank == 1
        assert "batch queue stayed full (4 batches) for 1.0 s" in lost.value.reason
        assert 4 < len(published) < 10_000
        (event,) = events_named(logs, "dispatcher.rank_lost")
        assert event["rank"] == 1
        os.kill(g.procs[1].pid, signal.SIGCONT)
        with pytest.raises(RankLost):
            g.d.publish([], step=len(published))
    finally:
        codes = g.close()
    # rank 0 got every batch in order (a gap would have made it exit 3) and shut down
    assert codes[0] == 0
    assert g.procs[1].returncode is not None

