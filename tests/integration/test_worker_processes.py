"""Real ``python -m zkv.worker`` processes, one per rank, driven by a Dispatcher here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import zkv.kernels.reference as reference
from tests.worker.helpers import WorkerGroup, digest, short_ipc_dir
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.storage import HEADER_SIZE, LocalDirStore, pack_key

NUM_DEVICE, NUM_HOST = 32, 24
HALF = NUM_DEVICE // 2


def _layout(world_size: int) -> CacheLayout:
    return CacheLayout(num_layers=3, kv_heads=2, block_size=4, head_dim=16, dtype="bfloat16",
                       num_device_blocks=NUM_DEVICE, num_host_blocks=NUM_HOST,
                       world_size=world_size)


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)],
                ids=lambda n: f"{n}ranks")
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[WorkerGroup]:
    store_dir = tmp_path_factory.mktemp("store")
    with short_ipc_dir() as folder:
        g = WorkerGroup(folder, request.param, _layout(request.param), store_dir=str(store_dir))
        g.store_dir = store_dir  # type: ignore[attr-defined]
        try:
            yield g
        finally:
            codes = g.close()
        assert codes == [0] * request.param, [g.stderr(r) for r in range(request.param)]


def ids(xs: range | list[int]) -> np.ndarray:
    return P.as_ids(list(xs))


def test_every_block_round_trips_on_every_rank(group: WorkerGroup) -> None:
    """fill device 0..15 with (rank, key) patterns → d2h to host → h2d into device 16..31
    → check on every rank; then the other way round through other host blocks."""
    keys = tuple(digest(1, i) for i in range(HALF))
    done = group.run([P.Op(0, P.FILL, dst=ids(range(HALF)), keys=keys)], step=0)
    assert done.ok, done
    done = group.run([P.Op(0, P.D2H, ids(range(HALF)), ids(range(HALF)))], step=1)
    assert done.results == {0: P.OpResult(0, True, HALF)}
    upper = ids(range(HALF, NUM_DEVICE))
    done = group.run([P.Op(0, P.H2D, ids(range(HALF)), upper, layerwise=True),
                      P.Op(1, P.CHECK, src=upper, keys=keys)], step=2)
    assert done.ok and done.results[1] == P.OpResult(1, True, HALF), done
    # every block moved twice more, reversed, through the other host blocks
    back = list(reversed(range(HALF, NUM_DEVICE)))
    host = list(range(NUM_HOST - 8, NUM_HOST)) + list(range(8))
    done = group.run([P.Op(0, P.BACKUP, ids(back), ids(host))], step=3)
    assert done.ok, done
    done = group.run([P.Op(0, P.H2D, ids(host), ids(range(HALF))),
                      P.Op(1, P.CHECK, src=ids(range(HALF)), keys=tuple(reversed(keys)))], step=4)
    assert done.ok, done
    # and a check against the wrong pattern does fail, on every rank
    done = group.run([P.Op(0, P.CHECK, src=ids([HALF]), keys=(digest(2, 0),))], step=5)
    assert not done.ok and done.results[0].done == 0


def test_l3_round_trip_through_local_dir_store(group: WorkerGroup) -> None:
    n = 8
    keys = tuple(digest(3, i) for i in range(n))
    assert group.run([P.Op(0, P.FILL, dst=ids(range(n)), keys=keys)]).ok
    done = group.run([P.Op(0, P.D2H, ids(range(n)), ids(range(n))),
                      P.Op(1, P.H2S, src=ids(range(n)), keys=keys)])
    assert done.ok, done
    store = LocalDirStore(group.store_dir, group.layout.fingerprint())  # type: ignore[attr-defined]
    for rank in range(group.world_size):
        for key in keys:
            data = Path(store.path(pack_key(key, rank))).read_bytes()[HEADER_SIZE:]
            assert data == reference.expected_block_bytes(group.layout, key, rank)
    assert all(store.exists([pack_key(k, r) for k in keys for r in range(group.world_size)]))
    dst_host = ids(range(NUM_HOST - n, NUM_HOST))
    done = group.run([P.Op(0, P.S2H, dst=dst_host, keys=keys)])
    assert done.results == {0: P.OpResult(0, True, n)}
    dst_dev = ids(range(NUM_DEVICE - n, NUM_DEVICE))
    done = group.run([P.Op(0, P.H2D, dst_host, dst_dev, layerwise=True),
                      P.Op(1, P.CHECK, src=dst_dev, keys=keys)])
    assert done.ok, done
    # one rank misses a key: the batch result is the minimum over ranks
    store.remove(pack_key(keys[2], group.world_size - 1))
    done = group.run([P.Op(0, P.S2H, dst=ids(range(4)), keys=keys[:4])])
    res = done.results[0]
    assert (res.ok, res.done) == (False, 2)
    assert f"rank {group.world_size - 1}: s2h: block 2" in str(res.error)


def test_empty_batches_pipeline(group: WorkerGroup) -> None:
    seqs = [group.d.publish([], step) for step in range(200)]
    done = group.d.drain(30)
    assert [b.seq for b in done] == seqs
    assert all(b.ok for b in done)
