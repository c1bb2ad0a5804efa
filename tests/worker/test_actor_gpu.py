"""The worker actor on a real GPU: Dispatcher, Sidecar and the CuPy backend on cuda:0, the
model on a stream of its own (GPU only; ``test_actor_device.py`` runs the same orderings
against the stream-faithful fake in CI).

Each test holds one stream behind a gate kernel that the test opens (``HostGate``): the
transfer stream (the model's reads must wait for the held copies) or the model's stream
(the batch must wait for the model's held writes and reads). Whatever ran out of order
shows while the gate holds, on any GPU, so ``bench/gpu_mutants.py``, which removes each
stream wait in turn, fails these tests every time.

On an H100 the first versions, which held a stream behind tens of milliseconds of
matmuls, were fooled: a kernel's first launch loaded it lazily (CUDA_MODULE_LOADING=LAZY),
which waits for the whole device, so the reads ran after the copies whatever the compute
stream waited for, and the test without that wait passed. Hence each test launches its
kernels once before the gate, and checks that the gate still held when it was opened.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from tests.waiting import holds_within
from tests.worker.helpers import endpoints, poll_for, poll_until_done, short_ipc_dir
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
    model = torch.cuda.Stream()
    with torch.cuda.stream(model), _rig() as (d, sc, kv):
        yield d, sc, kv, model


@contextmanager
def _rig() -> Iterator[tuple[Dispatcher, Sidecar, list[Any]]]:
    """A dispatcher and one rank, the sidecar built on the calling thread's current stream."""
    from zkv.kernels.cupy_backend import CupyBackend

    with ExitStack() as stack, short_ipc_dir() as folder:
        backend = CupyBackend()
        kv = backend.allocate_device_cache(LAYOUT)
        pub, pull = endpoints(folder)
        d = Dispatcher(pub, pull, 1, LAYOUT.fingerprint())
        stack.callback(d.close)
        sc = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                     backend=backend, heartbeat_interval_s=0.05)
        stack.callback(sc.close)
        d.wait_for_ranks(10)
        yield d, sc, kv
        torch.cuda.synchronize()


_GATE_SOURCE = r"""
extern "C" __global__ void zkv_test_gate(const volatile int* flag, unsigned long long limit_ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        if (*flag) return;
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < limit_ns);
}
"""


class HostGate:
    """One thread spinning on ``stream`` until the host opens the gate (a flag in mapped
    pinned memory) or ``limit_s`` passes: the work queued behind it cannot run before
    then, whatever the GPU's speed. Deterministic where a busy stream is only likely to
    be still busy."""

    def __init__(self, stream: Any, limit_s: float = 20.0) -> None:
        """``stream``: a cupy stream or a torch one."""
        import cupy

        from zkv.kernels.pinned import pinned_empty

        if isinstance(stream, torch.cuda.Stream):
            with warnings.catch_warnings():  # cupy 14 deprecates it; 13 lacks the successor
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = cupy.cuda.ExternalStream(stream.cuda_stream)

        # unpinned only after ``stream`` is done (the kernel reads the flag until then)
        self._flag, _ = pinned_empty(cupy, torch.cuda.current_device(), 4096, stream)
        attrs = cupy.cuda.runtime.pointerGetAttributes(self._flag.ctypes.data)
        kernel = cupy.RawKernel(_GATE_SOURCE, "zkv_test_gate")
        kernel((1,), (1,), (np.uint64(attrs.devicePointer), np.uint64(limit_s * 1e9)),
               stream=stream)
        self._after = cupy.cuda.Event(disable_timing=True)
        self._after.record(stream)

    def holding(self) -> bool:
        """The gate has not let the stream through yet (not opened, not expired)."""
        return not self._after.done

    def open(self) -> None:
        self._flag.view(np.int32)[0] = 1


def model_work_behind_held_copies(sc: Sidecar, model: Any, work: Callable[[], None],
                                  what: str) -> None:
    """Hold the transfer stream behind a gate and run ``work()`` (which publishes a batch
    and queues the model's work on its stream) with ``model`` current: the model's work
    must not run while the gate holds the batch's copies."""
    gate = HostGate(sc.backend.transfer_stream)
    try:
        with torch.cuda.stream(model):
            work()
            after = torch.cuda.Event()
            after.record(model)
        # The model's work takes microseconds once nothing holds it: 0.5 s is plenty to
        # see it run if the model's stream does not wait for the copies' events.
        ran_early = holds_within(after.query, 0.5)
        held = gate.holding()
    finally:
        gate.open()
    model.synchronize()
    # Without this the test proves nothing: on an H100 the reads' first (lazy) launch
    # waited for the device until the gate expired, and the reads then ran after the
    # copies whatever the compute stream waited for.
    assert held, ("the gate expired before the test opened it: something the test ran "
                  "waited for the held transfer stream")
    assert not ran_early, f"the model's {what} ran while the batch's copies were held"


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
        # The reads below once before the gate: a kernel's first launch may load it lazily
        # (CUDA_MODULE_LOADING=LAZY), and that waits for the whole device, the gate too.
        for layer in range(LAYOUT.num_layers):
            for part, t in enumerate(kv[layer]):
                torch.index_select(t, 0, index, out=got[layer][part])
        for pair in kv:
            for t in pair:
                t.zero_()
    model.synchronize()
    # The transfer stream is held by a gate kernel until the test opens it, the model's
    # stream is idle, and the host hears "layer recorded" while the copies cannot run:
    # only the stream wait keeps the reads below from running before the copies.
    seqs: list[int] = []

    def reads() -> None:
        seqs.append(d.publish([op], 0))
        for layer in range(LAYOUT.num_layers):
            sc.wait_layer(seqs[0], layer, timeout=10)  # the host waits for the record only
            for part, t in enumerate(kv[layer]):  # read on the model's stream
                torch.index_select(t, 0, index, out=got[layer][part])

    model_work_behind_held_copies(sc, model, reads, "reads")
    seq = seqs[0]
    assert poll_until_done(d, seq, 10)[seq].ok
    for layer in range(LAYOUT.num_layers):
        for part in range(2):
            assert torch.equal(got[layer][part].cpu().view(torch.uint8),
                               want[layer][part][dst].view(torch.uint8)), (layer, part)


def batch_behind_model(d: Dispatcher, model: Any, queue: Callable[[], Any],
                       op: P.Op) -> tuple[int, Any]:
    """Hold the model's stream behind a gate, queue ``queue()``'s work on it and publish
    ``op``: the batch must not finish while the gate holds. Returns the batch's seq and
    what ``queue`` returned."""
    gate = HostGate(model)
    try:
        with torch.cuda.stream(model):
            queued = queue()
        seq = d.publish([op], 0)
        early = {b.seq for b in poll_for(d, 0.5)}
        held = gate.holding()
    finally:
        gate.open()
    assert held, "the gate expired before the test opened it"
    assert seq not in early, (f"the {op.kind} finished while the model's work queued "
                              "before it was held")
    return seq, queued


def test_d2h_waits_for_the_models_pending_writes(rig: Any) -> None:
    d, sc, kv, model = rig
    with torch.cuda.stream(model):  # first launches (see the module docstring)
        kv[2][1][9].fill_(1.0)
    model.synchronize()

    def write() -> None:
        kv[2][1][9].fill_(7.0)
        kv[0][0][9].fill_(-3.0)

    seq, _ = batch_behind_model(d, model, write, P.Op(0, P.D2H, P.as_ids([9]), P.as_ids([5])))
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
        kv[1][0][4].clone()  # first launch, and a cached block for the clone below
    model.synchronize()
    sc.host_pool[0].fill_(2.0)
    seq, before = batch_behind_model(d, model, lambda: kv[1][0][4].clone(),
                                     P.Op(0, P.H2D, P.as_ids([0]), P.as_ids([4])))
    assert poll_until_done(d, seq, 10)[seq].ok
    model.synchronize()
    assert bool((before == 1.0).all()), "the h2d overwrote the block before the model read it"
    assert bool((kv[1][0][4] == 2.0).all())


def test_d2h_waits_for_the_stream_the_model_moved_to() -> None:
    """vLLM registers its caches on the default stream and makes a stream of its own at its
    first CUDA graph capture, after registration (``torch.cuda.set_stream`` in the model
    thread); its worker half then says so each step (``follow_compute_stream``). A d2h
    must wait for the writes queued on that stream, which the default stream does not
    (torch's streams are non-blocking)."""
    default = torch.cuda.current_stream()
    with _rig() as (d, sc, kv):
        model = torch.cuda.Stream()
        torch.cuda.set_stream(model)
        try:
            kv[3][0][11].fill_(1.0)  # first launch (see the module docstring)
            model.synchronize()
            sc.follow_compute_stream()

            def write() -> None:
                kv[3][0][11].fill_(9.0)

            seq, _ = batch_behind_model(d, model, write,
                                        P.Op(0, P.D2H, P.as_ids([11]), P.as_ids([2])))
        finally:
            torch.cuda.set_stream(default)
        done = poll_until_done(d, seq, 10)[seq]
        assert done.ok, done
        assert bool((sc.host_pool[2, 3, 0] == 9.0).all()), "the d2h ran before the model's write"


def test_an_abandoned_load_holds_the_recompute_behind_the_copies_it_issued(rig: Any) -> None:
    """The engine gave up on layer 2 once the actor had issued every layer's h2d (held on
    the transfer stream). vLLM recomputes layers 2.. into the same blocks on its stream:
    those writes must run after the copies (abandon's latest-issued event), or the copies
    land over them."""
    d, sc, kv, model = rig
    n, last = 64, LAYOUT.num_layers - 1
    dst = np.arange(100, 100 + n)
    op = P.Op(0, P.H2D, P.as_ids(list(range(n))), P.as_ids(dst.tolist()), layerwise=True)
    sc.host_pool[:n].fill_(2.0)
    first = d.publish([op], 0)  # the batch's allocations, once (see the first test)
    assert poll_until_done(d, first, 10)[first].ok
    index = torch.from_numpy(dst).cuda()

    def recompute() -> None:
        for layer in range(2, LAYOUT.num_layers):
            for t in kv[layer]:
                t.index_fill_(0, index, 3.0)

    with torch.cuda.stream(model):
        recompute()  # first launches (see the module docstring)
        for pair in kv:
            for t in pair:
                t.zero_()
    model.synchronize()
    seqs: list[int] = []

    def abandon_and_recompute() -> None:
        seqs.append(d.publish([op], 0))
        assert holds_within(lambda: sc.actor.counter.is_done(seqs[0], last), 10)
        assert sc.abandon_load(seqs[0], 2, "layer 2 timed out", timeout=1)
        recompute()

    model_work_behind_held_copies(sc, model, abandon_and_recompute, "recompute")
    poll_until_done(d, seqs[0], 10)
    torch.cuda.synchronize()
    for layer in range(LAYOUT.num_layers):
        for t in kv[layer]:
            want = 2.0 if layer < 2 else 3.0
            assert bool((t[index] == want).all()), f"layer {layer}: the copy landed last"


def test_a_forward_past_an_abandoned_save_waits_for_the_queued_d2h(rig: Any) -> None:
    """The engine's wait for a finished request's save ran out while its d2h was held on
    the transfer stream; the forward then writes the freed block for another request. The
    write must run after the d2h (abandon_saves' event), or the save stores the new
    request's KV under the finished one's hashes."""
    d, sc, kv, model = rig
    op = P.Op(0, P.D2H, P.as_ids([9]), P.as_ids([5]))
    with torch.cuda.stream(model):
        kv[1][1][9].fill_(1.0)  # first launch
    model.synchronize()
    first = d.publish([op], 0)  # the batch's allocations, once
    assert poll_until_done(d, first, 10)[first].ok
    with torch.cuda.stream(model):
        kv[1][1][9].fill_(4.0)
    model.synchronize()
    seqs: list[int] = []

    def abandon_and_write() -> None:
        seqs.append(d.publish([op], 0))
        assert holds_within(lambda: sc.actor.counter.is_done(seqs[0], 0), 10)
        assert sc.abandon_saves(seqs[0], timeout=1)
        kv[1][1][9].fill_(7.0)  # the block, freed, now another request's

    model_work_behind_held_copies(sc, model, abandon_and_write, "write")
    done = poll_until_done(d, seqs[0], 10)[seqs[0]]
    assert done.ok, done  # issued before the abandon, it read the finished request's KV
    assert bool((sc.host_pool[5, 1, 1] == 4.0).all()), "the save read the forward's write"
    assert bool((kv[1][1][9] == 7.0).all())
