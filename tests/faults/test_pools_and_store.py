"""Ordinary shortage and a failing L3 with the whole pipeline in the loop: the host pool
exhausted (evictions drop blocks instead of backing them up), the local-directory store
failing in the middle of a write (the prefix that was written counts, the host copies stay).
Every reused block is checked byte for byte; nothing leaks."""

from __future__ import annotations

import os
from pathlib import Path

from tests.faults.helpers import LAYOUT, Pipeline
from zkv import protocol as P
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.radix import HOST
from zkv.storage import LocalDirStore, pack_key


def test_host_pool_exhausted_drops_evicted_blocks_and_serves_exactly(folder: str) -> None:
    import dataclasses

    layout = dataclasses.replace(LAYOUT, num_host_blocks=1)
    pipe = Pipeline.start(folder, layout)
    try:
        # a shared two-block prefix (reused from device) and two blocks of their own each
        prompts = [hash_ids_chain([0, 1, k, k + 1]) for k in range(10, 40, 3)]
        for rnd in range(2):  # the second round reuses whatever survived, checked exactly
            for i, hashes in enumerate(prompts):
                done = pipe.step(f"r{rnd}-{i}", hashes)
                assert done.ok, done.results
                pipe.flush()
                assert pipe.cm.host.num_used <= 1
        assert pipe.checked > 0  # some blocks were reused (and verified on every rank)
        assert pipe.cm.stats.dropped > 0  # evictions found no host block and dropped
        assert pipe.leaked() == 0
    finally:
        codes = pipe.close()
    assert codes == [0, 0]


def test_store_failing_mid_write_keeps_the_written_prefix_and_the_host_copies(
        folder: str, tmp_path: Path) -> None:
    store_dir = str(tmp_path / "l3")
    pipe = Pipeline.start(folder, store_dir=store_dir)
    try:
        a = hash_ids_chain([1, 2, 3, 4])
        b = hash_ids_chain([9, 8, 7, 6])
        pipe.step("a", a)
        store = LocalDirStore(store_dir, LAYOUT.fingerprint())
        # the first two blocks of `a` are evicted to host, then written to storage: the
        # directory one of them goes to is unusable (a file stands in it)
        shard = os.path.dirname(store.path(pack_key(a[3], 1)))
        assert shard != os.path.dirname(store.path(pack_key(a[2], 1)))
        os.makedirs(os.path.dirname(shard), exist_ok=True)
        Path(shard).write_bytes(b"")
        assert pipe.step("b", b).ok  # evicts a[2:] to host
        (h2s,) = [o for o in pipe.cm.take_ops() if o.kind == P.H2S]
        assert list(h2s.keys) == [a[3], a[2]] or list(h2s.keys) == [a[2], a[3]]
        first_blocked = list(h2s.keys).index(a[3])
        seq = pipe.d.publish([h2s], step=50)
        from tests.worker.helpers import poll_until_done

        res = poll_until_done(pipe.d, seq)[seq].results[h2s.id]
        # done: the prefix written on every rank (whole chunks of a batched put count)
        assert not res.ok and res.done <= first_blocked and "put" in str(res.error)
        stored_before = pipe.cm.stats.stored
        pipe.cm.on_ops_done([res])
        pipe.cm.check_invariants()
        assert pipe.cm.stats.stored - stored_before == res.done
        # the host copies stay and are served (checked byte for byte on every rank)
        assert [pipe.cm.tree.index[h].status for h in a[2:]] == [HOST, HOST]
        done = pipe.step("a2", a)
        assert done.ok and pipe.checked >= 4
        assert pipe.leaked() == 0
    finally:
        codes = pipe.close()
    assert codes == [0, 0]
