"""What ``zkv replay`` reports when a reused block's bytes are wrong on a rank.

Every other replay test runs clean, so "0 mismatched" there could not tell a mismatch
counted from one lost: with the count, or the exit status, or the abort of the request
that read the bad block removed, every one of them still passed. Here the Replayer drives
real workers (Sidecar threads over zmq, the CPU backend) and the test scribbles over one
rank's cached device blocks between two steps, as a faulty copy would: the second step's
check must fail on that rank, be counted block by block, fail the run, and leave the
request that read them out of the cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from structlog.testing import capture_logs

from tests.worker.helpers import endpoints, short_ipc_dir
from zkv.config import CacheLayout
from zkv.kernels import TorchCpuBackend
from zkv.replay import EXIT_FAILED, EXIT_OK, Replayer
from zkv.scheduler.dispatcher import Dispatcher
from zkv.scheduler.manager import CacheManager
from zkv.scheduler.records import CacheConfig
from zkv.worker import Sidecar

LAYOUT = CacheLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float32",
                     num_device_blocks=16, num_host_blocks=16, world_size=2)
PROMPT = [bytes([i]) * 16 for i in range(1, 4)]  # three blocks' chained hashes (any 16 B)
MORE = bytes([9]) * 16


@pytest.fixture
def replayer() -> Iterator[tuple[Replayer, list[Sidecar]]]:
    with ExitStack() as stack, short_ipc_dir() as folder:
        stack.enter_context(capture_logs())  # the ranks' threads log here, not to the run
        pub, pull = endpoints(folder)
        d = Dispatcher(pub, pull, LAYOUT.world_size, LAYOUT.fingerprint())
        stack.callback(d.close)
        ranks = []
        for r in range(LAYOUT.world_size):
            sc = Sidecar(TorchCpuBackend().allocate_device_cache(LAYOUT), layout=LAYOUT,
                         rank=r, pub_endpoint=pub, pull_endpoint=pull, backend="cpu",
                         heartbeat_interval_s=0.05)
            stack.callback(sc.close)
            ranks.append(sc)
        d.wait_for_ranks(10)
        cm = CacheManager(CacheConfig(LAYOUT.num_device_blocks, LAYOUT.num_host_blocks,
                                      LAYOUT.block_size, "write_back"))
        yield Replayer(cm, d, LAYOUT, batch=1, progress=False), ranks


def test_a_bad_reused_block_is_counted_fails_the_run_and_is_not_built_on(
        replayer: tuple[Replayer, list[Sidecar]]) -> None:
    rp, ranks = replayer
    rp.run_step([("r1", PROMPT)])  # fills the three blocks on both ranks, caches them
    assert (rp.s.checked, rp.s.mismatched, rp.s.exit_code) == (0, 0, EXIT_OK)
    for pair in ranks[1].actor.kv_caches:  # rank 1's copy of every block goes bad
        for t in pair:
            t.zero_()
    rp.run_step([("r2", [*PROMPT, MORE])])  # reuses the three, computes one more
    # rank 1's check stops at the first bad block: all three reused blocks are counted
    assert (rp.s.checked, rp.s.mismatched) == (3, 3)
    assert rp.s.exit_code == EXIT_FAILED
    # r2's forward failed on a rank: aborted, so its new block was not cached
    m = rp.cm.match_prefix("r3", [*PROMPT, MORE])
    assert m.num_device == 3
    rp.cm.abort("r3")


def test_busy_time_is_the_union_of_the_batches_in_flight() -> None:
    """The summary's GB/s divides by the time any batch was in flight: batches overlap (a
    step's storage writes beside its copies), and their summed latencies overstated that
    time (0.58 GB over 1.10 s summed in a 0.72 s run)."""
    from zkv.replay import busy_s

    assert busy_s([]) == 0.0
    assert busy_s([(0.0, 1.0), (0.5, 1.5), (3.0, 4.0)]) == 2.5  # not 3.0
    assert busy_s([(0.0, 2.0), (0.5, 1.0)]) == 2.0  # one inside another
    assert busy_s([(2.0, 3.0), (0.0, 1.0)]) == 2.0  # any order
