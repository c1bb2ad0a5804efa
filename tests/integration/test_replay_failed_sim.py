"""A simulated forward op (``fill`` / ``check``) that fails on a rank fails ``zkv replay``.

Before, a failed ``fill`` was counted nowhere: its request was aborted in silence, the
summary said "0 failed ops" and the status was 0; and a ``check`` that failed with every
block matched (``done == len(keys)``) added no mismatch and no failed op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.worker.helpers import endpoints, short_ipc_dir
from zkv.config import CacheLayout
from zkv.kernels import TorchCpuBackend, reference
from zkv.protocol import CHECK, Op, OpResult, as_ids
from zkv.replay import EXIT_FAILED, EXIT_OK, Replayer
from zkv.scheduler.dispatcher import BatchDone, Dispatcher
from zkv.scheduler.manager import CacheManager
from zkv.scheduler.records import CacheConfig
from zkv.worker import Sidecar

LAYOUT = CacheLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float32",
                     num_device_blocks=16, num_host_blocks=16, world_size=2)
PROMPT = [bytes([i]) * 16 for i in range(1, 4)]  # three blocks' chained hashes (any 16 B)


def _manager() -> CacheManager:
    return CacheManager(CacheConfig(LAYOUT.num_device_blocks, LAYOUT.num_host_blocks,
                                    LAYOUT.block_size, "write_back"))


@pytest.fixture
def replayer() -> Iterator[Replayer]:
    """A Replayer over real workers (Sidecar threads over zmq, the CPU backend)."""
    with ExitStack() as stack, short_ipc_dir() as folder:
        stack.enter_context(capture_logs())  # the ranks' threads log here, not to the run
        pub, pull = endpoints(folder)
        d = Dispatcher(pub, pull, LAYOUT.world_size, LAYOUT.fingerprint())
        stack.callback(d.close)
        for r in range(LAYOUT.world_size):
            sc = Sidecar(TorchCpuBackend().allocate_device_cache(LAYOUT), layout=LAYOUT,
                         rank=r, pub_endpoint=pub, pull_endpoint=pull, backend="cpu",
                         heartbeat_interval_s=0.05)
            stack.callback(sc.close)
        d.wait_for_ranks(10)
        yield Replayer(_manager(), d, LAYOUT, batch=1, progress=False)


def test_a_fill_that_fails_on_a_rank_is_a_failed_op_and_fails_the_run(
        replayer: Replayer, monkeypatch: pytest.MonkeyPatch) -> None:
    fill = reference.fill_pattern

    def flaky_fill(kv: Any, dst: Any, keys: Any, rank: int) -> None:
        if rank == 1:
            raise RuntimeError("injected copy error on rank 1")
        fill(kv, dst, keys, rank)

    monkeypatch.setattr(reference, "fill_pattern", flaky_fill)
    replayer.run_step([("r1", PROMPT)])
    replayer.settle()
    assert (replayer.s.requests, replayer.s.failed_ops, replayer.s.mismatched) == (1, 1, 0)
    assert replayer.s.exit_code == EXIT_FAILED
    m = replayer.cm.match_prefix("r2", PROMPT)  # the request was aborted: nothing cached
    assert m.num_device == 0
    replayer.cm.abort("r2")


class _Dispatcher:
    in_flight = 0


def test_a_check_that_fails_with_every_block_matched_is_a_failed_op() -> None:
    rp = Replayer(_manager(), _Dispatcher(), LAYOUT, batch=1, progress=False)
    check = Op(1 << 41, CHECK, src=as_ids([0, 1]), keys=tuple(PROMPT[:2]))
    for seq, res in enumerate([OpResult(check.id, True, 2), OpResult(check.id, False, 2, "x")]):
        rp.outstanding[seq] = ([], [check])
        assert rp._commit(BatchDone(seq, seq, res.ok, {check.id: res}, frozenset(), 0.0)) is None
        assert (rp.s.checked, rp.s.mismatched) == (2 * (seq + 1), 0)
        assert rp.s.exit_code == (EXIT_OK if res.ok else EXIT_FAILED)
    assert rp.s.failed_ops == 1 and rp.failed_sim == {check.id}
