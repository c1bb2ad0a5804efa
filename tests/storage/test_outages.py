"""Stores whose server is down at start, killed, paused (SIGSTOP) or restarted: calls fail
with StorageError (fast after the first), the scheduler's query answers 0, nothing hangs,
and the client picks the server up again by itself."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.servers import (
    KillableStore,
    MooncakeServer,
    RedisServer,
    free_port,
    sigstop,
    wait_for,
)
from tests.waiting import holds_within, idle_for
from zkv.errors import StorageError
from zkv.storage import Store, leading_present, open_store, pack_key

BLOCK = 8192
K = [pack_key(i.to_bytes(16, "big"), 0) for i in range(4)]
DATA = [np.full(BLOCK, i + 1, np.uint8) for i in range(4)]


def works(store: Store) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            store.exists(K[:1])
            return True
        except StorageError:
            return False

    return probe


def round_trip(store: Store, i: int) -> None:
    store.put(K[i], DATA[i])
    out = np.zeros(BLOCK, np.uint8)
    assert store.get_into(K[i], out) and out.tobytes() == DATA[i].tobytes()


def fails(store: Store) -> str:
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        store.get_many_into(K[:1], [np.zeros(BLOCK, np.uint8)])
    assert time.monotonic() - t0 < 5.0, "a dead store must cost one bounded attempt"
    return str(info.value)


def test_redis_down_at_start_then_up(tmp_path: Path) -> None:
    port = free_port()
    store = open_store(f"redis://127.0.0.1:{port}/0?timeout_s=0.5", "ns")
    try:
        assert "unreachable" in fails(store)
        assert leading_present(store, [k[:16] for k in K], 1) == 0
        assert store.stats.query_failures == 1
        with RedisServer(str(tmp_path), port=port):
            wait_for(works(store), "reconnect")
            assert store.link.num_reconnects == 1  # type: ignore[attr-defined]
            round_trip(store, 0)
    finally:
        store.close()


def test_redis_killed_mid_run_and_restarted(tmp_path: Path) -> None:
    with RedisServer(str(tmp_path)) as srv, capture_logs() as logs:
        store = open_store(srv.url + "?timeout_s=0.5", "ns")
        try:
            round_trip(store, 0)
            srv.stop()
            fails(store)
            t_down = time.monotonic()
            assert "unreachable" in fails(store)  # then fast, without touching the socket
            assert not store.link.up  # type: ignore[attr-defined]
            idle_for(0.3)  # (the outage lasts at least this)
            srv.start()
            wait_for(works(store), "reconnect")
            # the line that says it is back says how long it was not (an operator's SLO)
            [back] = [e for e in logs if e["event"] == "storage.store_reconnected"]
            assert 0.3 <= back["down_s"] <= time.monotonic() - t_down + 1.0, back
            assert store.get_many_into(K[:1], [np.zeros(BLOCK, np.uint8)]) == [False]  # gone
            round_trip(store, 1)
            assert store.link.num_down == 1  # type: ignore[attr-defined]
        finally:
            store.close()


def test_redis_paused_costs_one_timeout(tmp_path: Path) -> None:
    with RedisServer(str(tmp_path)) as srv:
        store = open_store(srv.url + "?timeout_s=0.5", "ns")
        try:
            round_trip(store, 0)
            srv.pause()
            assert "Timeout reading from" in fails(store)
            assert "unreachable" in fails(store)
            srv.resume()
            wait_for(works(store), "reconnect")
            round_trip(store, 2)
        finally:
            store.close()


def test_mooncake_master_down_at_start_then_up(tmp_path: Path) -> None:
    with MooncakeServer(str(tmp_path)) as mc:
        mc.stop_master()
        store = open_store(mc.url + "?timeout_s=1", "ns")
        try:
            assert "unreachable" in fails(store)
            assert leading_present(store, [k[:16] for k in K], 1) == 0
            mc.start_master()
            mc.wait_capacity()
            wait_for(works(store), "reconnect")
            wait_for(lambda: store.put_many(K[:1], DATA[:1]) == [True], "segment remounted")
            round_trip(store, 0)
        finally:
            store.close()


def test_reads_from_a_dead_mooncake_holder_fail_in_a_few_lines(tmp_path: Path) -> None:
    """The process whose segment held the blocks dies: every read of them fails
    (``TRANSFER_FAIL``), a miss each, counted, and said in a few lines, the rest in one at
    close, naming the store and the call. (Before, one error line per block, under the
    name of a failed query; then a summary without the store; and the master was asked
    for each failed block's size, one RPC a block.)"""
    from structlog.testing import capture_logs

    from tests.storage.conftest import master_replica_queries

    with MooncakeServer(str(tmp_path)) as mc:
        store = open_store(mc.url + "?segment_mb=0&timeout_s=1", "ns")  # the holder's segment
        keys = [pack_key(i.to_bytes(16, "big"), 0) for i in range(40)]
        try:
            assert store.put_many(keys, [np.full(BLOCK, i, np.uint8) for i in range(40)]) \
                == [True] * 40
            assert mc.holder is not None
            mc.holder.kill()
            mc.holder.wait()
            with capture_logs() as logs:
                before = master_replica_queries(mc)
                assert store.get_many_into(keys, [np.zeros(BLOCK, np.uint8) for _ in keys]) \
                    == [False] * 40
                assert master_replica_queries(mc) - before == 2  # the get's, the sizes'
                lines = [e for e in logs if e["event"] == "storage.read_failed"]
                assert 1 <= len(lines) <= 3 and "get returned" in lines[0]["error"], lines
                store.close()
            assert (store.stats.errors, store.stats.misses, store.stats.hits) == (40, 40, 0)
            lines = [e for e in logs if e["event"] == "storage.read_failed"]
            assert lines[-1]["summary"] is True and lines[-1]["num_total"] == 40
            assert lines[-1]["num_suppressed"] + len(lines) - 1 == 40, lines
            assert {(e["store"], e["call"]) for e in lines} == {(store.url, "get")}
        finally:
            store.close()


def test_a_hung_mooncake_holder_costs_a_call_its_timeout_not_30_s(tmp_path: Path) -> None:
    """The process whose segment holds the blocks stops answering (SIGSTOP): a get and a
    put of its blocks fail after the store's timeout (whole seconds: Mooncake's transfer
    waits count in seconds; the process's first store set them), a miss and a failed put.
    (Before: 30 s each, Mooncake's own transfer timeout, a core busy all along.)"""
    with MooncakeServer(str(tmp_path)) as mc:
        store = open_store(mc.url + "?segment_mb=0&timeout_s=1", "ns")  # the holder's segment
        keys = [pack_key(i.to_bytes(16, "big"), 0) for i in range(4)]
        try:
            assert store.put_many(keys[:2], [np.full(BLOCK, 7, np.uint8)] * 2) == [True] * 2
            assert mc.holder is not None
            sigstop(mc.holder.pid)
            try:
                t0 = time.monotonic()
                assert store.get_many_into(keys[:1], [np.zeros(BLOCK, np.uint8)]) == [False]
                t1 = time.monotonic()
                assert store.put_many(keys[2:], [np.full(BLOCK, 8, np.uint8)] * 2) \
                    == [False] * 2
                t2 = time.monotonic()
            finally:
                os.kill(mc.holder.pid, signal.SIGCONT)
            # 30 s before; a few seconds now (the first store of the test process set the
            # waits from its timeout_s: these tests' are 1-2 s)
            assert t1 - t0 < 12 and t2 - t1 < 12, (t1 - t0, t2 - t1)
        finally:
            store.close()


def test_mooncake_master_killed_and_restarted(tmp_path: Path) -> None:
    with MooncakeServer(str(tmp_path)) as mc:
        store = open_store(mc.url + "?timeout_s=1", "ns")
        try:
            round_trip(store, 0)
            mc.stop_master()
            fails(store)
            assert not store.link.up  # type: ignore[attr-defined]
            mc.start_master()
            mc.wait_capacity()
            wait_for(works(store), "reconnect")
            assert store.exists(K[:1]) == [False]  # the new master knows nothing
            wait_for(lambda: store.put_many(K[1:2], DATA[1:2]) == [True], "segment remounted")
            round_trip(store, 1)
        finally:
            store.close()


def _fill_the_pool(store: Store, threads: int = 8) -> None:
    """Calls from many threads at once: the client's RPC pool keeps a connection each."""
    keys = [pack_key(i.to_bytes(16, "big"), 1) for i in range(64)]
    with ThreadPoolExecutor(threads) as pool:
        assert all(all(ok) for ok in pool.map(
            lambda i: store.put_many(keys[i::threads], [DATA[0]] * len(keys[i::threads])),
            range(threads)))


@pytest.mark.parametrize("saw_outage", [False, True], ids=["idle", "after_a_reconnect"])
def test_mooncake_master_restarted_fails_no_call(tmp_path: Path, saw_outage: bool) -> None:
    """The client's pooled connections to the old master are stale, and each fails once
    (RPC_FAIL): that must cost no call. ``idle``: the client saw no outage (its link stays
    up). ``after_a_reconnect``: it saw the outage (link down); the reconnect must not
    count a stale connection as the master still down."""
    with MooncakeServer(str(tmp_path)) as mc:
        store = open_store(mc.url + "?timeout_s=1", "ns")
        try:
            _fill_the_pool(store)
            mc.stop_master()
            if saw_outage:
                fails(store)
            mc.start_master()
            mc.wait_capacity()
            if saw_outage:  # the link's thread reconnects
                wait_for(lambda: store.link.up, "the link's reconnect")  # type: ignore[attr-defined]
            for i in range(4):
                round_trip(store, i)  # no StorageError
            link = store.link  # type: ignore[attr-defined]
            assert (link.num_down, link.num_reconnects) == ((1, 1) if saw_outage else (0, 0))
        finally:
            store.close()


class _CountingClient:
    """A store's Mooncake client, recording each call made on it (one RPC each)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if not callable(attr):
            return attr

        def call(*args: Any) -> Any:
            self.calls.append(name)
            return attr(*args)

        return call


def test_a_dead_mooncake_master_costs_one_call_not_probes(tmp_path: Path) -> None:
    """A killed master, with ``timeout_s`` large (the bound of the stale-connection probes):
    the call that finds it dead is its one RPC, whether that failed at once (a pooled
    connection's end of file) or slowly (a connect to the dead port, ~4 s), and no probe
    follows: the master's port, probed first, refuses. A restarted master still costs no
    call (test_mooncake_master_restarted_fails_no_call)."""
    with MooncakeServer(str(tmp_path)) as mc:
        store = open_store(mc.url + "?timeout_s=30", "ns")
        try:
            counting = _CountingClient(store._client)  # type: ignore[attr-defined]
            store._client = counting  # type: ignore[attr-defined]
            link = store.link
            assert link is not None
            for slow in (False, True):
                round_trip(store, 0)
                mc.kill_master()
                if slow:  # the pooled connection's one failure used up elsewhere
                    assert counting.client.batch_is_exist(["x"]) == [-900]
                counting.calls.clear()
                t0 = time.monotonic()
                with pytest.raises(StorageError, match="returned -900"):
                    store.get_many_into(K[:1], [np.zeros(BLOCK, np.uint8)])
                assert time.monotonic() - t0 < 15.0  # not the 30 s of timeout_s
                assert counting.calls == ["batch_get_into"] and not link.up
                mc.start_master()
                mc.wait_capacity()
                wait_for(lambda: link.up, "the link's reconnect")
                wait_for(lambda: store.put_many(K[:1], DATA[:1]) == [True], "segment remounted")
            assert (link.num_down, link.num_reconnects) == (2, 2)
        finally:
            store.close()


def test_redis_restarted_while_idle_fails_no_call(tmp_path: Path) -> None:
    """The same for redis-py's pool: it replaces a pooled connection the server closed
    before handing it out (checked here so that a client upgrade cannot change it)."""
    with RedisServer(str(tmp_path)) as srv:
        store = open_store(srv.url + "?timeout_s=0.5", "ns")
        try:
            _fill_the_pool(store)
            srv.stop()
            srv.start()
            for i in range(4):
                round_trip(store, i)
            assert store.link.num_down == 0  # type: ignore[attr-defined]
        finally:
            store.close()


def test_the_query_tries_again_at_once_when_a_rank_wrote(tmp_path: Path) -> None:
    """The scheduler's existence query after an outage: its link waits out a backoff that
    grew while the store was down (misses all along, up to ``max_backoff_s`` after the
    store came back), unless a rank's write says the store is back (``store_reached``,
    from ``CacheManager.on_ops_done``): then the next query reconnects at once."""
    from zkv.storage import StorageQuery

    with RedisServer(str(tmp_path)) as srv:
        store = open_store(srv.url + "?timeout_s=0.5", "ns")
        rank = open_store(srv.url + "?timeout_s=0.5", "ns")
        query = StorageQuery(store, 1)
        try:
            round_trip(rank, 0)
            assert query([K[0][:16]]) == 1
            srv.stop()
            link = store.link
            assert link is not None
            assert query([K[0][:16]]) == 0
            # reconnect attempts while down: the backoff doubles (0.2, 0.4, 0.8, 1.6 s)
            wait_for(lambda: link.retry_in_s > 1.0, "the link's backoff", timeout_s=10)
            assert query([K[0][:16]]) == 0
            srv.start()
            round_trip(rank, 1)  # a rank's write gets through: the store is back
            with pytest.raises(StorageError, match="next attempt in"):
                store.exists(K[:1])  # the query's own link still waits
            t0 = time.monotonic()
            query.store_reached()
            wait_for(lambda: link.up, "the query's reconnect", timeout_s=2)
            assert time.monotonic() - t0 < 1.0  # at once, not at the end of the backoff
            assert query([K[1][:16]]) == 1
            assert link.up and link.num_reconnects == 1
        finally:
            rank.close()
            store.close()


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_a_hung_store_costs_the_query_one_timeout_not_one_per_backoff(tmp_path: Path,
                                                                      kind: str) -> None:
    """A server that stops answering (SIGSTOP: the kernel still accepts connections, so
    each reconnect attempt waits out a timeout) under the scheduler's existence query,
    which runs inside the engine's scheduling step: the query that finds it so waits
    its timeout, every later one answers 0 at once while the link's own thread keeps
    trying, and once the server answers again the link is back without any query having
    waited. (Before, the first query past each backoff made the attempt itself: the
    scheduling step stalled a whole timeout every 0.2 to 5 s of the outage.)"""
    from zkv.storage import StorageQuery

    timeout_s = 0.5 if kind == "redis" else 1.0
    srv = KillableStore(kind, str(tmp_path))
    store = rank = None
    try:
        store = open_store(f"{srv.url}?timeout_s={timeout_s}", "ns")
        rank = open_store(f"{srv.url}?timeout_s={timeout_s}", "ns")
        query = StorageQuery(store, 1)
        link = store.link
        assert link is not None
        round_trip(rank, 0)
        assert query([K[0][:16]]) == 1
        srv.pause()
        t0 = time.monotonic()
        assert query([K[0][:16]]) == 0
        assert time.monotonic() - t0 < 3 * timeout_s + 1.0  # the one that found it hung
        assert not link.up
        # the scheduler asking every step (5 ms apart) until the link's thread has made
        # three attempts, each waiting out a timeout (within a deadline)
        took: list[float] = []

        def step() -> bool:
            t0 = time.monotonic()
            assert query([K[0][:16]]) == 0
            took.append(time.monotonic() - t0)
            return link.num_attempts >= 3

        holds_within(step, 6 * timeout_s + 2.0, interval=0.005)  # at a step's pace
        slowest = max(took)
        assert slowest < 0.1 * timeout_s, f"a query waited {slowest:.3f} s on a hung store"
        assert link.num_attempts >= 2, "the link's thread should have tried meanwhile"
        assert not link.up and store.stats.query_failures > 100
        srv.resume()
        wait_for(lambda: link.up, "the link's reconnect", timeout_s=10)
        assert query([K[0][:16]]) == 1 and link.num_reconnects == 1
    finally:
        for s in (store, rank):
            if s is not None:
                s.close()
        srv.close()
