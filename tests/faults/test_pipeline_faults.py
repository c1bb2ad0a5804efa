"""Faults with the whole pipeline in the loop: CacheManager + Dispatcher + real worker
processes. Whatever fails, the manager's pools and tree stay consistent and nothing that
the failure touched is ever matched again."""

from __future__ import annotations

import os
import signal

import pytest

from tests.worker.helpers import WorkerGroup
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.errors import RankLost
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import CacheConfig, CacheManager
from zkv.scheduler.radix import HOST

BS = 4
LAYOUT = CacheLayout(num_layers=2, kv_heads=2, block_size=BS, head_dim=8, dtype="float16",
                     num_device_blocks=6, num_host_blocks=6, world_size=2)


def _step(group: WorkerGroup, cm: CacheManager, rid: str, hashes: list[bytes],
          sim_id: int) -> P.OpResult | None:
    """match + allocate + the manager's ops + a fill of the new blocks, one batch; commits
    the acks. Returns the result of the manager's first op (None if it emitted none)."""
    m = cm.match_prefix(rid, hashes)
    table = cm.allocate(rid, len(hashes) * BS)
    assert table is not None
    ops = cm.take_ops()
    cached = m.num_device + m.num_host
    fill = P.Op(sim_id, P.FILL, dst=P.as_ids(table[cached:]), keys=tuple(hashes[cached:]))
    done = group.run(ops + [fill])
    cm.on_ops_done([done.results[o.id] for o in ops])
    cm.check_invariants()
    return done.results[ops[0].id] if ops else None


def test_frozen_rank_mid_eviction_rolls_the_d2h_back(folder: str) -> None:
    cm = CacheManager(CacheConfig(6, 6, BS, "write_back"))
    group = WorkerGroup(folder, 2, LAYOUT, heartbeat_timeout_s=1.0, ack_timeout_s=5.0)
    try:
        a = hash_ids_chain([1, 2, 3, 4])
        assert _step(group, cm, "a", a, 1 << 40) is None
        cm.finish("a")
        assert cm.take_ops() == []
        os.kill(group.procs[1].pid, signal.SIGSTOP)  # rank 1 stops answering
        b = hash_ids_chain([9, 8, 7, 6])  # needs 4 blocks: 2 free + 2 evicted (d2h)
        r = _step(group, cm, "b", b, 2 << 40)
        assert r is not None and not r.ok and "rank 1 lost" in str(r.error)
        assert group.d.lost_ranks == frozenset({1})
        # the evicted tail of `a` had its only copy in flight: it is gone, not half-there
        m = cm.match_prefix("a2", a)
        assert (m.num_device, m.num_host) == (2, 0)
        assert cm.stats.failed_ops == 1 and cm.host.num_free == 6
        cm.abort("a2")
        cm.abort("b")
        cm.check_invariants()
        with pytest.raises(RankLost):
            group.d.publish([], step=9)
    finally:
        group.close()


def test_store_outage_keeps_the_host_copy_and_the_worker_alive(folder: str, tmp_path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_bytes(b"")  # the store root is a file: every put fails
    cm = CacheManager(CacheConfig(6, 6, BS, "write_back", storage_write=True))
    group = WorkerGroup(folder, 2, LAYOUT, store_dir=str(blocked))
    try:
        a = hash_ids_chain([1, 2, 3, 4])
        _step(group, cm, "a", a, 1 << 40)
        cm.finish("a")
        b = hash_ids_chain([9, 8, 7, 6])
        r = _step(group, cm, "b", b, 2 << 40)  # evicts two blocks of `a` to host
        assert r is not None and r.ok and r.done == 2
        (h2s,) = cm.take_ops()  # host copies committed: write them to storage
        assert h2s.kind == P.H2S and len(h2s.keys) == 2
        done = group.run([h2s])
        res = done.results[h2s.id]
        assert not res.ok and res.done == 0 and "put" in str(res.error)
        cm.on_ops_done([res])
        cm.check_invariants()
        assert cm.stats.stored == 0 and cm.stats.failed_ops == 1
        # the host copies are intact and matchable; both ranks still serve batches
        m = cm.match_prefix("a2", a)
        assert (m.num_device, m.num_host) == (2, 2)
        assert [cm.tree.index[h].status for h in a[2:]] == [HOST, HOST]
        cm.abort("a2")
        cm.finish("b")
        assert group.run([]).ok
    finally:
        codes = group.close()
    assert codes == [0, 0]
