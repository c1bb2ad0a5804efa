"""The worker actor on a real GPU: Dispatcher, Sidecar and the CuPy backend on cuda:0, the
model on a stream of its own (GPU only; ``test_actor_device.py`` runs the same orderings
against the stream-faithful fake in CI).

The copies are large (192 MiB, milliseconds over PCIe) and the model's stream is kept busy
for tens of milliseconds, so a missing stream wait shows up as stale bytes every time:
``bench/gpu_mutants.py`` removes each wait in turn, and these tests fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import numpy as np
import pytest
import torch

from tests.worker.helpers import endpoints, poll_until_done, short_ipc_dir
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.kernels import cuda_available
from zkv.kernels.reference import ref_copy_h2d
from zkv.scheduler.dispatcher import Dispatcher
from zkv.worker import Sidecar

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs CUDA (torch and cupy)"),
]

# 256 KiB a block (4 layers x K, V x 32 KiB): 768 blocks are 192 MiB.
LAYOUT = CacheLayout(num_layers=4, kv_heads=8, block_size=16, head_dim=128, dtype="float16",
                     num_device_blocks=768, num_host_blocks=768)


@pytest.fixture
def rig() -> Iterator[tuple[Dispatcher, Sidecar, list[Any], Any]]:
    """A dispatcher and one rank whose model runs on ``model`` (a non-default stream that
    is current while the sidecar is built, as in a model worker)."""
    from zkv.kernels.cupy_backend import CupyBackend

    model = torch.cuda.Stream()
    with ExitStack() as stack, short_ipc_dir() as folder, torch.cuda.stream(model):
        backend = CupyBackend()
        kv = backend.allocate_device_cache(LAYOUT)
        pub, pull = endpoints(folder)
        d = Dispatcher(pub, pull, 1, LAYOUT.fingerprint())
        stack.callback(d.close)
        sc = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                     backend=backend, heartbeat_interval_s=0.05)
        stack.callback(sc.close)
        d.wait_for_ranks(10)
        yield d, sc, kv, model
        torch.cuda.synchronize()


def cupy_runtime() -> Any:
    import cupy

    return cupy.cuda.runtime


def _busy(stream: Any, n: int = 12) -> None:
    """Queue ~1.5 ms x n of matmuls on ``stream``."""
    with torch.cuda.stream(stream):
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
        for _ in range(n):
            x = (x @ x) * 1e-4


def test_wait_layer_orders_the_models_reads_after_the_h2d(rig: Any) -> None:
    d, sc, kv, model = rig
    n = LAYOUT.num_host_blocks
    gen = torch.Generator().manual_seed(1)
    sc.host_pool.view(torch.uint8).copy_(
        torch.randint(0, 256, sc.host_pool.view(torch.uint8).shape, dtype=torch.uint8,
                      generator=gen))
    rng = np.random.default_rng(1)
    src = rng.permutation(n).astype("<i4")
    dst = rng.permutation(LAYOUT.num_device_blocks)[:n].astype("<i4")
    want = [tuple(t.cpu() for t in pair) for pair in kv]  # zeros, then the oracle's copy
    for layer in range(LAYOUT.num_layers):
        ref_copy_h2d(sc.host_pool, want, src, dst, layer)

    op = P.Op(0, P.H2D, P.as_ids(src.tolist()), P.as_ids(dst.tolist()), layerwise=True)
    # Once first, then again onto zeroed caches: the second batch allocates nothing (its ids
    # and params are on the device already), so no implicit device sync in an allocation
    # holds the actor back until the copies are done.
    first = d.publish([op], 0)
    assert poll_until_done(d, first, 10)[first].ok
    index = torch.from_numpy(dst.astype(np.int64)).cuda()
    got = [[torch.empty_like(t[:n]) for t in pair] for pair in kv]  # no allocation below
    with torch.cuda.stream(model):
        for pair in kv:
            for t in pair:
                t.zero_()
    # The transfer stream is still busy (earlier work: here ~100 ms of matmuls on another
    # stream that it waits for), the model's stream is idle, and the host hears "layer
    # recorded" long before the copies run: only the stream wait keeps the reads below
    # from running before the copies.
    blocker = torch.cuda.Stream()
    _busy(blocker, 60)
    gate = torch.cuda.Event()
    gate.record(blocker)
    cupy_runtime().streamWaitEvent(sc.backend.transfer_stream.ptr, gate.cuda_event, 0)
    with torch.cuda.stream(model):
        seq = d.publish([op], 0)
        for layer in range(LAYOUT.num_layers):
            sc.wait_layer(seq, layer, timeout=10)  # the host waits for the record, not the copy
            for part, t in enumerate(kv[layer]):  # read on the model's stream
                torch.index_select(t, 0, index, out=got[layer][part])
    model.synchronize()
    assert poll_until_done(d, seq, 10)[seq].ok
    for layer in range(LAYOUT.num_layers):
        for part in range(2):
            assert torch.equal(got[layer][part].cpu().view(torch.uint8),
                               want[layer][part][dst].view(torch.uint8)), (layer, part)


def test_d2h_waits_for_the_models_pending_writes(rig: Any) -> None:
    d, sc, kv, model = rig
    _busy(model)  # the write below runs after these
    with torch.cuda.stream(model):
        kv[2][1][9].fill_(7.0)
        kv[0][0][9].fill_(-3.0)
    seq = d.publish([P.Op(0, P.D2H, P.as_ids([9]), P.as_ids([5]))], 0)
    done = poll_until_done(d, seq, 10)[seq]
    assert done.ok, done
    assert bool((sc.host_pool[5, 2, 1] == 7.0).all()), "the d2h ran before the model's write"
    assert bool((sc.host_pool[5, 0, 0] == -3.0).all())


def test_h2d_does_not_overwrite_blocks_the_model_still_reads(rig: Any) -> None:
    """A batch starts after the model's work queued before it (begin_batch's start event):
    the read the model queued first sees the old bytes."""
    d, sc, kv, model = rig
    with torch.cuda.stream(model):
        kv[1][0][4].fill_(1.0)
    sc.host_pool[0].fill_(2.0)
    _busy(model)
    with torch.cuda.stream(model):
        before = kv[1][0][4].clone()  # queued behind the matmuls
    seq = d.publish([P.Op(0, P.H2D, P.as_ids([0]), P.as_ids([4]))], 0)
    assert poll_until_done(d, seq, 10)[seq].ok
    model.synchronize()
    assert bool((before == 1.0).all()), "the h2d overwrote the block before the model read it"
    assert bool((kv[1][0][4] == 2.0).all())
