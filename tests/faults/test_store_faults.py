"""The L3 server killed while a prefetch is in flight, then restarted: CacheManager +
Dispatcher + real worker processes + a real redis-server / Mooncake master.

The load fails on every rank, the manager rolls it back (no block leaks, invariants hold,
the hashes are negative-cached), the ranks stay alive, and once the server is back the
same pipeline stores and loads blocks again, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import KillableStore, wait_for
from tests.worker.helpers import WorkerGroup, poll_for, poll_until_done, short_ipc_dir
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.errors import StorageError
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import CacheConfig, CacheManager
from zkv.storage import StorageQuery, Store, open_store

BS = 4
LAYOUT = CacheLayout(num_layers=2, kv_heads=2, block_size=BS, head_dim=8, dtype="float16",
                     num_device_blocks=8, num_host_blocks=8, world_size=2)
SIM = iter(range(1 << 40, 1 << 41))
TIMEOUT = "?timeout_s=1"  # each client call to a dead server: one bounded attempt


@pytest.fixture(params=["redis", "mooncake"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KillableStore]:
    s = KillableStore(request.param, str(tmp_path / "server"))
    try:
        yield s
    finally:
        s.close()


def manager(store: Store) -> CacheManager:
    cfg = CacheConfig(8, 8, BS, "write_through", storage_write=True, negative_cache_s=60.0)
    return CacheManager(cfg, storage_exists=StorageQuery(store, LAYOUT.world_size))


def commit(group: WorkerGroup, cm: CacheManager, ops: list[P.Op], sim: list[P.Op] = ()) -> Any:  # type: ignore[assignment]
    done = group.run(ops + list(sim))
    cm.on_ops_done([done.results[o.id] for o in ops])
    cm.check_invariants()
    return done


def compute_and_store(group: WorkerGroup, cm: CacheManager, rid: str,
                      hashes: list[bytes]) -> None:
    """A request computes its blocks (fill), finishes (write_through: backup to host),
    and the host copies go to the store (h2s) - every op committed."""
    cm.match_prefix(rid, hashes)
    table = cm.allocate(rid, len(hashes) * BS)
    assert table is not None
    fill = P.Op(next(SIM), P.FILL, dst=P.as_ids(table), keys=tuple(hashes))
    assert commit(group, cm, cm.take_ops(), [fill]).ok
    cm.finish(rid)
    (backup,) = cm.take_ops()
    assert commit(group, cm, [backup]).ok
    (h2s,) = cm.take_ops()
    assert h2s.kind == P.H2S and commit(group, cm, [h2s]).ok


def load_and_check(group: WorkerGroup, cm: CacheManager, rid: str, hashes: list[bytes]) -> None:
    m = cm.match_prefix(rid, hashes)
    assert m.num_storage == len(hashes)
    assert cm.prefetch(rid) == len(hashes)
    assert commit(group, cm, cm.take_ops()).ok
    table = cm.allocate(rid, len(hashes) * BS)
    assert table is not None and cm.num_reused_blocks(rid) == len(hashes)
    check = P.Op(next(SIM), P.CHECK, src=P.as_ids(table), keys=tuple(hashes))
    done = commit(group, cm, cm.take_ops(), [check])
    assert done.results[check.id] == P.OpResult(check.id, True, len(hashes)), done
    cm.finish(rid)


def test_store_killed_mid_prefetch_and_restarted(server: KillableStore) -> None:
    sched_store = open_store(server.url + TIMEOUT, LAYOUT.fingerprint())
    with short_ipc_dir() as folder:
        group = WorkerGroup(folder, 2, LAYOUT, extra_env={"ZKV_STORE_URL": server.url + TIMEOUT})
        try:
            _kill_mid_prefetch(server, group, sched_store)
        finally:
            codes = group.close()
            sched_store.close()
    assert codes == [0, 0]


def _kill_mid_prefetch(server: KillableStore, group: WorkerGroup, sched_store: Store) -> None:
    a = hash_ids_chain([1, 2, 3, 4])
    compute_and_store(group, manager(sched_store), "a", a)
    cm = manager(sched_store)  # a new scheduler: nothing on device or host, all in L3
    assert cm.match_prefix("a2", a).num_storage == 4
    assert cm.prefetch("a2") == 4 and cm.host.num_free == 4
    (load,) = cm.take_ops()
    server.pause()  # the ranks' loads hang in the store...
    seq = group.d.publish([load], step=1)
    assert poll_for(group.d, 0.3) == []  # ...and the batch waits on them
    server.kill()  # ...until the server dies under them
    empty = group.d.publish([], step=2)  # the ranks still take batches meanwhile
    got = poll_until_done(group.d, {seq, empty})
    res = got[seq].results[load.id]
    assert (res.ok, res.done) == (False, 0) and res.error, res
    cm.on_ops_done([res])
    cm.check_invariants()
    assert cm.host.num_free == 8 and cm.prefetch_done("a2")  # nothing leaked
    assert cm.stats.failed_blocks == 4
    table = cm.allocate("a2", 4 * BS)  # the request recomputes: nothing reused
    assert table is not None and cm.num_reused_blocks("a2") == 0
    cm.abort("a2")
    assert cm.match_prefix("a3", a).num_storage == 0  # negative-cached: no query at all
    cm.abort("a3")
    with pytest.raises(StorageError):
        sched_store.exists([a[0] + b"\0\0"])
    server.restart()
    wait_for(lambda: _up(sched_store), "the scheduler's client reconnects")
    b = hash_ids_chain([5, 6, 7])
    compute_and_store(group, manager(sched_store), "b", b)  # the ranks' clients are back too
    load_and_check(group, manager(sched_store), "b2", b)


def _up(store: Store) -> bool:
    try:
        store.exists([bytes(18)])
        return True
    except StorageError:
        return False
