"""The worker's storage I/O with real stores: device -> host -> store -> host -> device bit
for bit on every backend, and a slow or hung store never delays a later batch's copies."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

import zkv.kernels as kernels
import zkv.kernels.reference as reference
from tests.servers import RedisServer, wait_for
from tests.worker.helpers import digest, endpoints, poll_for
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.scheduler.dispatcher import BatchDone, Dispatcher
from zkv.storage import HEADER_SIZE, LocalDirStore, Store, file_url, open_store, pack_key
from zkv.worker import Sidecar

N = 16
LAYOUT = CacheLayout(num_layers=4, kv_heads=2, block_size=4, head_dim=8, dtype="float16",
                     num_device_blocks=N, num_host_blocks=N, world_size=2)


class Rig:
    """A Dispatcher and one Sidecar per rank, each rank with its own store client."""

    def __init__(self, stack: ExitStack, folder: str, stores: Sequence[Store],
                 **dispatcher_kw: Any) -> None:
        pub, pull = endpoints(folder)
        self.d = Dispatcher(pub, pull, len(stores), LAYOUT.fingerprint(), **dispatcher_kw)
        stack.callback(self.d.close)
        cpu = kernels.get_backend("cpu")
        self.cpu = cpu
        self.sidecars = []
        for rank, store in enumerate(stores):
            sc = Sidecar(cpu.allocate_device_cache(LAYOUT), layout=LAYOUT, rank=rank,
                         pub_endpoint=pub, pull_endpoint=pull, backend=cpu, store=store,
                         heartbeat_interval_s=0.05)
            stack.callback(sc.close)
            self.sidecars.append(sc)
        self.d.wait_for_ranks(10)
        self.completed: list[int] = []

    def poll(self, seqs: set[int], timeout: float = 10.0) -> dict[int, BatchDone]:
        got: dict[int, BatchDone] = {}
        deadline = time.monotonic() + timeout
        while not seqs <= got.keys():
            assert time.monotonic() < deadline, f"seqs {seqs - got.keys()} not done"
            for b in self.d.poll(0.05):
                got[b.seq] = b
                self.completed.append(b.seq)
        return got

    def run(self, ops: list[P.Op]) -> BatchDone:
        seq = self.d.publish(ops, 0)
        return self.poll({seq})[seq]


def ids(xs: Sequence[int] | range) -> np.ndarray:
    return P.as_ids(list(xs))


def _fill_and_store(rig: Rig, keys: tuple[bytes, ...]) -> None:
    """Device 0..n-1 get (rank, key) patterns, go to host 0..n-1 and on to the store."""
    n = len(keys)
    assert rig.run([P.Op(0, P.FILL, dst=ids(range(n)), keys=keys)]).ok
    done = rig.run([P.Op(0, P.D2H, ids(range(n)), ids(range(n))),
                    P.Op(1, P.H2S, src=ids(range(n)), keys=keys)])
    assert done.results == {0: P.OpResult(0, True, n), 1: P.OpResult(1, True, n)}, done


@pytest.fixture(params=["file", "redis", "mooncake"])
def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "file":
        return file_url(tmp_path / "l3")
    return str(request.getfixturevalue(f"{request.param}_server").url)


def test_device_host_store_host_device_is_bit_identical(stack: ExitStack, folder: str,
                                                         store_url: str) -> None:
    stores = [open_store(store_url, LAYOUT.fingerprint(), writers=2) for _ in range(2)]
    for s in stores:
        stack.callback(s.close)
    rig = Rig(stack, folder, stores)
    keys = tuple(digest(11, i, store_url) for i in range(6))
    _fill_and_store(rig, keys)
    for rank, s in enumerate(stores):  # what the store holds is the rank's exact bytes
        out = np.zeros(LAYOUT.block_bytes, np.uint8)
        assert s.get_into(pack_key(keys[0], rank), out)
        assert out.tobytes() == reference.expected_block_bytes(LAYOUT, keys[0], rank)
    host, dev = ids(range(8, 14)), ids(range(8, 14))
    assert rig.run([P.Op(0, P.S2H, dst=host, keys=keys)]).results == {0: P.OpResult(0, True, 6)}
    for sc in rig.sidecars:
        for h, key in zip(host.tolist(), keys):
            got = bytes(rig.cpu.host_block(sc.host_pool, h))
            assert got == reference.expected_block_bytes(LAYOUT, key, sc.rank)
    done = rig.run([P.Op(0, P.H2D, host, dev, layerwise=True),
                    P.Op(1, P.CHECK, src=dev, keys=keys)])
    assert done.ok and done.results[1] == P.OpResult(1, True, 6), done
    # a key one rank lacks: the batch's done is the prefix present on every rank
    stores[1].remove(pack_key(keys[3], 1))
    res = rig.run([P.Op(0, P.S2H, dst=ids(range(10, 16)), keys=keys)]).results[0]
    assert (res.ok, res.done) == (False, 3) and "rank 1: s2h: block 3" in str(res.error)
    assert str(res.error).endswith("is not in the store"), res


def test_a_refused_block_is_not_called_missing(stack: ExitStack, folder: str,
                                               tmp_path: Any) -> None:
    """A damaged block fails the load naming the refusal as a possible cause (it said "is
    not in the store"; only the rank's log said why)."""
    stores = [LocalDirStore(tmp_path, LAYOUT.fingerprint()) for _ in range(2)]
    rig = Rig(stack, folder, stores)
    keys = tuple(digest(16, i) for i in range(3))
    _fill_and_store(rig, keys)
    path = stores[0].path(pack_key(keys[1], 0))
    with open(path, "r+b") as f:  # one payload byte flipped: its checksum no longer holds
        f.seek(HEADER_SIZE + 5)
        b = f.read(1)
        f.seek(HEADER_SIZE + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    res = rig.run([P.Op(0, P.S2H, dst=ids(range(8, 11)), keys=keys)]).results[0]
    assert (res.ok, res.done) == (False, 1), res
    assert "rank 0: s2h: block 1" in str(res.error) and "refused" in str(res.error), res
    assert stores[0].stats.corrupt == 1


class GatedStore(Store):
    """A real local store whose reads and writes wait for ``gate`` (a store that hangs)."""

    def __init__(self, inner: LocalDirStore, gate: threading.Event) -> None:
        super().__init__(inner.namespace)
        self.inner = inner
        self.gate = gate
        self.entered = threading.Event()

    def _wait(self) -> None:
        self.entered.set()
        assert self.gate.wait(20), "gate never opened"

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.exists(keys)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        self._wait()
        return self.inner.get_many_into(keys, outs)

    def put_many(self, keys: Sequence[bytes], datas: Sequence[Any]) -> list[bool]:
        self._wait()
        return self.inner.put_many(keys, datas)

    def remove(self, key: bytes) -> None:
        self.inner.remove(key)


def test_a_hung_store_never_delays_the_next_batch(stack: ExitStack, folder: str,
                                                  tmp_path: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """... and each rank says so once it has hung ``IO_STUCK_S`` (``worker.io_stuck``, one
    line), and again when the call returns (``worker.io_unstuck``)."""
    from zkv.worker import storage_io

    monkeypatch.setattr(storage_io, "IO_STUCK_S", 0.3)
    logs = stack.enter_context(capture_logs())
    gate = threading.Event()
    gate.set()
    stores = [GatedStore(LocalDirStore(tmp_path, LAYOUT.fingerprint()), gate) for _ in range(2)]
    rig = Rig(stack, folder, stores, heartbeat_timeout_s=0.5)
    stack.callback(gate.set)  # runs first: never leave an I/O thread waiting at close
    keys = tuple(digest(12, i) for i in range(4))
    _fill_and_store(rig, keys)
    gate.clear()
    for s in stores:
        s.entered.clear()
    loading = rig.d.publish([P.Op(0, P.S2H, dst=ids(range(8, 12)), keys=keys)], 1)
    wait_for(lambda: all(s.entered.is_set() for s in stores), "I/O inside the store")
    # while both ranks' loads hang: copies of later batches are acked, heartbeats flow
    new = tuple(digest(13, i) for i in range(2))
    copies = [rig.d.publish([P.Op(0, P.FILL, dst=ids([4, 5]), keys=new)], 2),
              rig.d.publish([P.Op(0, P.D2H, ids([4, 5]), ids([4, 5]))], 3)]
    rig.poll(set(copies))
    rig.completed += [b.seq for b in poll_for(rig.d, 1.0)]  # twice the heartbeat timeout
    assert rig.d.lost_ranks == frozenset() and rig.completed[-2:] == copies
    assert loading not in rig.completed and rig.d.in_flight == 1
    wait_for(lambda: sum(e["event"] == "worker.io_stuck" for e in logs) >= 2,
             "both ranks say the hung call")  # (each on its actor's 0.1 s clock)
    stuck = [e for e in logs if e["event"] == "worker.io_stuck"]
    assert sorted(e["rank"] for e in stuck) == [0, 1], stuck  # once a rank, not each check
    assert all((e["seq"], e["op_id"], e["kind"], e["blocks"], e["num_stuck"], e["num_queued"])
               == (loading, 0, P.S2H, [0, 4], 1, 0) and e["running_s"] >= 0.3
               and e["log_level"] == "warning" and "host blocks stay pinned" in e["error"]
               for e in stuck), stuck
    gate.set()
    done = rig.poll({loading})[loading]
    assert done.results == {0: P.OpResult(0, True, 4)}
    unstuck = [e for e in logs if e["event"] == "worker.io_unstuck"]
    assert sorted(e["rank"] for e in unstuck) == [0, 1], unstuck
    assert rig.completed[-3:] == [*copies, loading]  # out of seq order, each exactly once
    done = rig.run([P.Op(0, P.H2D, ids(range(8, 12)), ids(range(12, 16))),
                    P.Op(1, P.CHECK, src=ids(range(12, 16)), keys=keys)])
    assert done.ok, done


def test_a_paused_redis_fails_its_load_after_later_batches(stack: ExitStack, folder: str,
                                                          tmp_path: Any) -> None:
    srv = stack.enter_context(RedisServer(str(tmp_path)))
    stores = [open_store(srv.url + "?timeout_s=1", LAYOUT.fingerprint()) for _ in range(2)]
    for s in stores:
        stack.callback(s.close)
    rig = Rig(stack, folder, stores, heartbeat_timeout_s=0.5)
    keys = tuple(digest(14, i) for i in range(3))
    _fill_and_store(rig, keys)
    srv.pause()  # SIGSTOP: connections stay open, nothing answers
    loading = rig.d.publish([P.Op(0, P.S2H, dst=ids(range(8, 11)), keys=keys)], 1)
    copy = rig.d.publish([P.Op(0, P.BACKUP, ids([0]), ids([5]))], 2)
    got = rig.poll({copy, loading})
    assert rig.completed[-2:] == [copy, loading] and got[copy].ok
    res = got[loading].results[0]
    assert (res.ok, res.done) == (False, 0) and "Timeout reading from" in str(res.error)
    assert rig.d.lost_ranks == frozenset()
    srv.resume()
    for s in stores:  # the client comes back by itself after its backoff
        wait_for(lambda s=s: s.link.up or _probe(s), "reconnect")  # type: ignore[attr-defined]
    done = rig.run([P.Op(0, P.S2H, dst=ids(range(8, 11)), keys=keys)])
    assert done.results == {0: P.OpResult(0, True, 3)}


def _probe(store: Store) -> bool:
    try:
        store.exists([pack_key(bytes(16), 0)])
        return True
    except Exception:
        return False


def test_a_worker_closed_under_a_hung_store_write_waits_for_it_and_stops(
        stack: ExitStack, folder: str, tmp_path: Any) -> None:
    """vLLM's shutdown closes a worker while an L3 write hangs on a paused redis whose
    timeout (3 s) is past the sidecar's 2 s: close waits for the call (the actor's exit
    waits for its I/O threads) and returns with the thread stopped. Before, it raised
    RuntimeError at 2 s: vLLM's worker teardown stopped there and the store stayed open."""
    srv = stack.enter_context(RedisServer(str(tmp_path)))
    store = open_store(srv.url + "?timeout_s=3", LAYOUT.fingerprint())
    stack.callback(store.close)
    rig = Rig(stack, folder, [store])
    keys = tuple(digest(16, i) for i in range(4))
    assert rig.run([P.Op(0, P.FILL, dst=ids(range(4)), keys=keys)]).ok
    assert rig.run([P.Op(0, P.D2H, ids(range(4)), ids(range(4)))]).ok
    srv.pause()
    stack.callback(srv.resume)  # (runs before the store's close)
    rig.d.publish([P.Op(0, P.H2S, src=ids(range(4)), keys=keys)], 1)
    wait_for(lambda: store.num_calls == 1, "the write inside the store")
    sc = rig.sidecars[0]
    with capture_logs() as logs:
        assert sc.close() is True
    assert not sc.alive and store.num_calls == 0
    assert not [e for e in logs if e["event"] == "worker.stop_timeout"]


def test_a_restarted_scheduler_never_gets_the_old_ones_io_results(
        stack: ExitStack, folder: str, tmp_path: Any) -> None:
    """The scheduler dies while a rank's h2s hangs in the store, and a new one starts. The
    rank rejoins only once that write ended (dropped: ``worker.io_dropped``), so the new
    scheduler's batch 0, op 0 (an s2h of a block the store lacks) gets its own result: a
    miss. (Before, the rank joined at once, and the old write's result, ok, went out as
    the new batch's: an s2h that never ran committed as loaded; the real result was never
    sent and the rank's thread spun on its wake-up pipe.)"""
    from structlog.testing import capture_logs

    from tests.waiting import holds_within, wait_until
    from zkv.log import IO_DROPPED, SCHEDULER_REJOINED

    gate = threading.Event()
    gate.set()
    stores = [GatedStore(LocalDirStore(tmp_path, LAYOUT.fingerprint()), gate) for _ in range(2)]
    rig = Rig(stack, folder, stores)
    stack.callback(gate.set)  # runs first: never leave an I/O thread waiting at close
    old, new = digest(16, 0), digest(16, 1)
    assert rig.run([P.Op(0, P.FILL, dst=ids([0]), keys=(old,))]).ok
    gate.clear()
    rig.d.publish([P.Op(0, P.H2S, src=ids([0]), keys=(old,))], 1)  # seq 1, op 0: hangs
    wait_until(lambda: all(s.entered.is_set() for s in stores), 10.0, "I/O inside the store")
    rig.d.close(shutdown=False)  # the scheduler dies
    with capture_logs() as logs:
        d2 = Dispatcher(*endpoints(folder), 2, LAYOUT.fingerprint())
        stack.callback(d2.close)
        wait_until(lambda: sum(e["event"] == SCHEDULER_REJOINED for e in logs) == 2, 10.0,
                   "both ranks see the new scheduler")
        joined = threading.Event()
        joiner = threading.Thread(target=lambda: (d2.wait_for_ranks(20), joined.set()))
        joiner.start()
        try:
            assert not holds_within(joined.is_set, 0.5), "joined with the old write running"
        finally:
            gate.set()
            joiner.join(25)
        assert joined.is_set()
        dropped = [e for e in logs if e["event"] == IO_DROPPED]
        assert [e["num_ops"] for e in dropped] == [1, 1], dropped
    rig.d = d2
    rig.completed.clear()
    seq = d2.publish([P.Op(0, P.S2H, dst=ids([1]), keys=(new,))], 0)  # seq 0, op 0 again
    res = rig.poll({seq})[seq].results[0]
    assert (seq, res.ok, res.done) == (0, False, 0) and "is not in the store" in str(res.error)
    assert poll_for(d2, 0.3) == []  # nothing else comes: no old result, no second one
    cpu = time.process_time()
    assert poll_for(d2, 0.5) == []
    assert time.process_time() - cpu < 0.25, "a thread spins while the ranks are idle"


def test_stored_files_carry_the_header(stack: ExitStack, folder: str, tmp_path: Any) -> None:
    stores = [LocalDirStore(tmp_path, LAYOUT.fingerprint()) for _ in range(2)]
    rig = Rig(stack, folder, stores)
    keys = (digest(15, 0),)
    _fill_and_store(rig, keys)
    for rank, s in enumerate(stores):
        with open(s.path(pack_key(keys[0], rank)), "rb") as f:
            raw = f.read()
        assert raw[HEADER_SIZE:] == reference.expected_block_bytes(LAYOUT, keys[0], rank)
        assert raw[24:42] == pack_key(keys[0], rank)


def test_worker_store_from_environment(tmp_path: Any) -> None:
    from zkv.errors import ConfigError
    from zkv.worker.__main__ import store_from_env

    assert store_from_env(LAYOUT, 0, {}) is None
    s = store_from_env(LAYOUT, 0, {"ZKV_STORE_DIR": str(tmp_path)})
    assert isinstance(s, LocalDirStore) and s.root == str(tmp_path)
    s = store_from_env(LAYOUT, 1, {"ZKV_STORE_URL": file_url(tmp_path) + "?max_bytes=10000",
                                   "ZKV_STORE_DIR": "/ignored"})
    assert isinstance(s, LocalDirStore) and s.max_bytes == 5000  # two ranks share the budget
    assert s.rank == 1  # it indexes rank 1's files alone
    assert s.namespace == LAYOUT.fingerprint()
    with pytest.raises(ConfigError, match="a budget of 500 bytes per writer .2 writers. holds "
                                          "no block of 1088 bytes"):  # it would store nothing
        store_from_env(LAYOUT, 0, {"ZKV_STORE_URL": file_url(tmp_path) + "?max_bytes=1000"})
    with pytest.raises(ConfigError, match="bad store URL 'redis://nohost'"):
        store_from_env(LAYOUT, 0, {"ZKV_STORE_URL": "redis://nohost"})
