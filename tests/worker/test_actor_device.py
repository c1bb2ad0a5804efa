"""The worker actor on a (fake) GPU: devices, streams, CUDA errors, heartbeats, failed loads.

Real Dispatcher, real Sidecar threads and zmq sockets; the CuPy backend runs against the
stream-faithful fake of ``tests/kernels/fake_cuda.py``, where nothing on a stream runs
unless a host sync needs it or the test drains it. So an ack sent before its stream work
finished, or a d2h that does not wait for the model's stream, is visible here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from tests.kernels import fake_cuda
from tests.waiting import holds_within
from tests.worker.helpers import (
    endpoints,
    events_named,
    poll_for,
    poll_until_done,
    short_ipc_dir,
)
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.errors import ConfigError, TransferError
from zkv.kernels import TorchCpuBackend
from zkv.scheduler.dispatcher import BatchDone, Dispatcher
from zkv.worker import Sidecar
from zkv.worker.actor import EXIT_FATAL
from zkv.worker.sidecar import device_from_env

LAYOUT = CacheLayout(num_layers=4, kv_heads=2, block_size=4, head_dim=8, dtype="float32",
                     num_device_blocks=16, num_host_blocks=16)
CUDA_ERROR_INVALID_VALUE = 1


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s, short_ipc_dir() as folder:
        s.enter_context(pytest.MonkeyPatch.context())
        s.folder = folder  # type: ignore[attr-defined]
        yield s


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> fake_cuda.FakeCuda:
    f = fake_cuda.FakeCuda(num_devices=2, sm_count=4, sync_timeout_s=10)
    fake_cuda.install(monkeypatch, f)
    return f


def _ids(*xs: int) -> np.ndarray:
    return P.as_ids(list(xs))


def _caches(seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    kv = TorchCpuBackend().allocate_device_cache(LAYOUT)
    gen = torch.Generator().manual_seed(seed)
    for pair in kv:
        for t in pair:
            t.copy_(torch.randn(t.shape, generator=gen))
    return kv


def _rig(stack: ExitStack, backend: Any, kv: Any = None, rank: int = 0,
         **dispatcher_kw: Any) -> tuple[Dispatcher, Sidecar]:
    pub, pull = endpoints(stack.folder)  # type: ignore[attr-defined]
    d = Dispatcher(pub, pull, 1 if rank == 0 else rank + 1, LAYOUT.fingerprint(), **dispatcher_kw)
    stack.callback(d.close)
    sc = Sidecar(_caches() if kv is None else kv, layout=LAYOUT, rank=rank, pub_endpoint=pub,
                 pull_endpoint=pull, backend=backend, heartbeat_interval_s=0.05)
    stack.callback(sc.close)
    return d, sc


def _run(d: Dispatcher, ops: list[P.Op], timeout: float = 10.0) -> BatchDone:
    seq = d.publish(ops, 0)
    return poll_until_done(d, seq, timeout)[seq]


# ------------------------------------------------------------------ devices


def test_local_rank_picks_the_device(fake: Any) -> None:
    assert device_from_env({"LOCAL_RANK": "1"}) == 1
    assert device_from_env({}) == 0  # torch's current device
    with pytest.raises(ConfigError, match="LOCAL_RANK=2 names no CUDA device"):
        device_from_env({"LOCAL_RANK": "2"})
    with pytest.raises(ConfigError, match="non-negative integer"):
        device_from_env({"LOCAL_RANK": "-1"})


def test_each_rank_copies_on_its_own_device(stack: ExitStack, fake: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    kv = _caches(1)
    d, sc = _rig(stack, "cupy", kv=kv, rank=0)
    d.wait_for_ranks(10)
    assert sc.backend.startup_info()["device"] == "cuda:1"
    done = _run(d, [P.Op(0, P.D2H, _ids(3, 9), _ids(0, 5))])
    assert done.ok, done
    assert sc.host_pool[5, 2, 1].tolist() == kv[2][1][9].tolist()  # synchronized before ack
    made = [e for e in fake.log if e[0] in ("stream", "event", "alloc", "compile", "launch",
                                            "hostRegister")]
    assert made and {e[1] for e in made} == {1}, "a CUDA object or launch on another device"
    assert ("torch.set_device", 1) in fake.log  # the actor thread bound to the rank's device
    # and stays bound: no thread (main, pinning, actor) ever set device 0, which creates a
    # context on GPU 0 with CUDA 12 (restoring a fresh thread's default included)
    assert fake.context_devices() == {1}, fake.contexts


# ------------------------------------------------------------------ streams


def test_d2h_waits_for_the_stream_of_the_thread_that_built_the_sidecar(
        stack: ExitStack, fake: Any) -> None:
    """The model computes on its own (non-default) stream and passes none: the start event
    must go to that stream, not to the actor thread's default stream."""
    model_stream = fake.new_stream()
    fake.set_current_stream(model_stream)  # torch.cuda.set_stream in the model thread
    kv = _caches(2)
    d, sc = _rig(stack, fake_cuda.cupy_backend(), kv=kv)
    d.wait_for_ranks(10)
    fake.enqueue(model_stream, lambda: kv[1][0][3].fill_(7.0), "forward writes K1[3]")
    done = _run(d, [P.Op(0, P.D2H, _ids(3), _ids(5))])
    assert done.ok, done
    assert bool((sc.host_pool[5, 1, 0] == 7.0).all()), "the d2h ran before the forward's write"


def test_d2h_waits_for_the_stream_the_model_moved_to(stack: ExitStack, fake: Any) -> None:
    """The model thread built the sidecar on the legacy stream, then moved to a stream of
    its own (vLLM makes one at its first CUDA graph capture, after registration) and said
    so (``follow_compute_stream``): the start event goes to the new stream, whose writes
    the legacy stream would not wait for (non-blocking)."""
    kv = _caches(4)
    d, sc = _rig(stack, fake_cuda.cupy_backend(), kv=kv)
    d.wait_for_ranks(10)
    model_stream = fake.new_stream()
    fake.set_current_stream(model_stream)
    with capture_logs() as logs:
        sc.follow_compute_stream()
        sc.follow_compute_stream()  # no change: no line
    assert [(e["stream"], e["was"]) for e in events_named(logs, "worker.compute_stream")] == \
        [(hex(model_stream), hex(0))]
    fake.enqueue(model_stream, lambda: kv[2][1][6].fill_(5.0), "forward writes V2[6]")
    done = _run(d, [P.Op(0, P.D2H, _ids(6), _ids(1))])
    assert done.ok, done
    assert bool((sc.host_pool[1, 2, 1] == 5.0).all()), "the d2h ran before the forward's write"


def test_failure_ack_comes_after_the_stream_work_of_the_batch(stack: ExitStack, fake: Any) -> None:
    backend = fake_cuda.cupy_backend()
    kv = _caches(3)
    d, sc = _rig(stack, backend, kv=kv)
    d.wait_for_ranks(10)
    # begin_batch's start event, the id upload's event, then the batch's own event fails.
    fake.fail_next("eventRecord", CUDA_ERROR_INVALID_VALUE, after=2)
    with capture_logs() as logs:
        done = _run(d, [P.Op(0, P.D2H, _ids(4, 6), _ids(1, 2))])
    assert fake.pending_total() == 0, "acked while the batch's copies were still queued"
    assert not done.ok and "batch failed" in str(done.results[0].error)
    assert sc.host_pool[2, 3, 1].tolist() == kv[3][1][6].tolist()  # the copy had finished
    assert events_named(logs, "worker.copy_failed")
    assert _run(d, [P.Op(0, P.D2H, _ids(7), _ids(3))]).ok  # not sticky: the rank lives on


def test_a_non_sticky_error_of_an_idle_step_fails_that_step_and_the_rank_lives_on(
        stack: ExitStack, fake: Any) -> None:
    """A step without ops (every step of an idle cache) whose start event fails: the step
    is acked failed and the next batch runs, as for a batch with ops. It killed the rank
    (the error escaped the idle path, which had no handling)."""
    d, sc = _rig(stack, fake_cuda.cupy_backend())
    d.wait_for_ranks(10)
    fake.fail_next("eventRecord", CUDA_ERROR_INVALID_VALUE)  # begin_batch's start event
    with capture_logs() as logs:
        seq = d.publish([], 0)
        poll_until_done(d, seq, 10)  # (no op failed: the batch is done all the same)
    assert events_named(logs, "worker.copy_failed")
    with pytest.raises(TransferError):  # its layers are not done: the engine is told
        sc.wait_layer(seq, 0, timeout=1)
    assert _run(d, [P.Op(0, P.D2H, _ids(7), _ids(3))]).ok and sc.alive


@pytest.mark.parametrize("status", [fake_cuda.ILLEGAL_ADDRESS, 911])
def test_sticky_cuda_error_kills_the_rank_and_the_scheduler_is_told(
        stack: ExitStack, fake: Any, status: int) -> None:
    """911 (cudaErrorExternalDevice, "any further CUDA work will return the same error")
    was not counted sticky: the rank died of the next synchronize, with no
    worker.device_failed and a raw CUDA error in the engine's layer wait."""
    d, sc = _rig(stack, fake_cuda.cupy_backend(), ack_timeout_s=60)
    d.wait_for_ranks(10)
    fake.fault_next_kernel(status)  # seen at the batch's synchronize
    t0 = time.monotonic()
    with capture_logs() as logs:
        seq = d.publish([P.Op(0, P.D2H, _ids(1), _ids(1)),
                         P.Op(1, P.H2D, _ids(2), _ids(2), layerwise=True)], 0)
        done = poll_until_done(d, seq, 10)[seq]
    assert time.monotonic() - t0 < 10  # told at once, not at the 60 s ack deadline
    assert not done.ok and done.lost_ranks == frozenset({0})
    failed = events_named(logs, "worker.device_failed")
    assert len(failed) == 1 and failed[0]["status"] == status
    deadline = time.monotonic() + 5
    while sc.alive and time.monotonic() < deadline:
        sc._thread.join(0.05)
    assert not sc.alive and sc.actor.exit_code == EXIT_FATAL
    assert "DeviceFault" in str(sc.exit_reason)
    with pytest.raises(TransferError, match="device fault"):
        sc.wait_layer(seq, 0, timeout=1)


def test_heartbeats_continue_while_the_actor_waits_on_the_gpu(stack: ExitStack, fake: Any) -> None:
    backend = fake_cuda.cupy_backend()
    d, sc = _rig(stack, backend, heartbeat_timeout_s=0.3)
    d.wait_for_ranks(10)
    gate = fake.hold(backend.transfer_stream.ptr, "a long copy")
    stack.callback(gate.open)
    seq = d.publish([P.Op(0, P.D2H, _ids(1), _ids(1))], 0)
    assert poll_for(d, 1.2) == []  # four heartbeat timeouts while the actor waits
    assert d.lost_ranks == frozenset() and d.in_flight == 1
    gate.open()
    assert poll_until_done(d, seq, 10)[seq].ok


# ------------------------------------------------------------------ failed loads


class LayerFailingBackend:
    """The CPU backend; h2d of ``layer`` and later fails for device block ``bad``."""

    def __init__(self, bad: int, layer: int) -> None:
        self._inner = TorchCpuBackend()
        self.bad, self.layer = bad, layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def copy_h2d(self, host_pool: Any, kv: Any, src: Any, dst: Any, layer: int) -> None:
        if layer >= self.layer and self.bad in np.asarray(dst).tolist():
            raise RuntimeError(f"device block {self.bad} is on fire")
        self._inner.copy_h2d(host_pool, kv, src, dst, layer)


@pytest.mark.parametrize("bad_layer", [0, 2])
def test_failed_h2d_fails_its_layer_and_later_layers(stack: ExitStack, bad_layer: int) -> None:
    d, sc = _rig(stack, LayerFailingBackend(bad=9, layer=bad_layer))
    d.wait_for_ranks(10)
    done = _run(d, [P.Op(0, P.H2D, _ids(1, 2), _ids(3, 4), layerwise=True),
                    P.Op(1, P.H2D, _ids(5, 6), _ids(8, 9), layerwise=True)])
    assert done.results[0].ok and not done.results[1].ok
    assert "on fire" in str(done.results[1].error)
    for layer in range(bad_layer):
        sc.wait_layer(done.seq, layer, timeout=1)  # every copy of these layers succeeded
    for layer in range(bad_layer, LAYOUT.num_layers):
        with pytest.raises(TransferError, match="on fire"):
            sc.wait_layer(done.seq, layer, timeout=1)
    assert _run(d, [P.Op(0, P.H2D, _ids(1), _ids(3), layerwise=True)]).ok
    sc.wait_layer(done.seq + 1, LAYOUT.num_layers - 1, timeout=1)


def test_bad_cache_layout_is_refused_at_start_naming_the_tensor(stack: ExitStack) -> None:
    kv = _caches()
    kv[2] = (kv[2][0], kv[2][1][:, :1])  # layer 2's V lost a head
    with pytest.raises(ConfigError, match=r"kv cache layer 2 V: shape \(16, 1, 4, 8\)"):
        _rig(stack, "cpu", kv=kv)


# ------------------------------------------------------------------ abandoned waits


def _model_stream(fake: Any, sc: Sidecar) -> int:
    """A stream of the model's own, current in this (the model's) thread, followed."""
    model = fake.new_stream()
    fake.set_current_stream(model)
    sc.follow_compute_stream()
    return model


def test_an_abandoned_load_holds_the_recompute_behind_the_copies_it_issued(
        stack: ExitStack, fake: Any) -> None:
    """The engine gave up on layer 2 once the actor had issued every layer's h2d, queued
    behind a long copy (abandon's latest-issued event). vLLM then recomputes layers 2.. into
    the same block on its stream: those writes must run after the queued copies, or the
    copies land over them."""
    backend = fake_cuda.cupy_backend()
    kv = _caches(5)
    d, sc = _rig(stack, backend, kv=kv)
    d.wait_for_ranks(10)
    model = _model_stream(fake, sc)
    sc.host_pool[1].fill_(2.0)
    gate = fake.hold(backend.transfer_stream.ptr, "a long copy")
    stack.callback(gate.open)
    seq = d.publish([P.Op(0, P.H2D, _ids(1), _ids(6), layerwise=True)], 0)
    last = LAYOUT.num_layers - 1
    assert holds_within(lambda: sc.actor.counter.is_done(seq, last), 10)  # issued, not run
    assert sc.abandon_load(seq, 2, "layer 2 timed out", timeout=1)

    def recompute() -> None:
        for layer in range(2, LAYOUT.num_layers):
            for t in kv[layer]:
                t[6].fill_(3.0)

    fake.enqueue(model, recompute, "the forward recomputes layers 2.. of block 6")
    fake.drain(model)
    assert fake.pending(model), "the recompute ran before the abandoned load's queued copies"
    gate.open()
    poll_until_done(d, seq, 10)
    fake.drain_all()
    for layer in range(LAYOUT.num_layers):
        for t in kv[layer]:
            assert bool((t[6] == (2.0 if layer < 2 else 3.0)).all()), layer


def test_a_forward_past_an_abandoned_save_waits_for_the_queued_d2h(
        stack: ExitStack, fake: Any) -> None:
    """The engine's wait for a finished request's save ran out while the d2h was queued
    behind a long copy; its forward then writes the freed block for another request. That
    write must run after the queued d2h (abandon_saves' event), or the save stores the new
    request's KV under the finished one's hashes."""
    backend = fake_cuda.cupy_backend()
    kv = _caches(6)
    d, sc = _rig(stack, backend, kv=kv)
    d.wait_for_ranks(10)
    model = _model_stream(fake, sc)
    kv[1][1][9].fill_(1.0)
    gate = fake.hold(backend.transfer_stream.ptr, "a long copy")
    stack.callback(gate.open)
    seq = d.publish([P.Op(0, P.D2H, _ids(9), _ids(5))], 0)
    assert holds_within(lambda: sc.actor.counter.is_done(seq, 0), 10)  # issued, not run
    assert sc.abandon_saves(seq, timeout=1)
    fake.enqueue(model, lambda: kv[1][1][9].fill_(7.0), "the forward writes block 9 anew")
    fake.drain(model)
    assert fake.pending(model), "the forward's write ran before the queued d2h"
    gate.open()
    done = poll_until_done(d, seq, 10)[seq]
    assert done.ok, done  # issued before the abandon, it read the finished request's KV
    fake.drain_all()
    assert bool((sc.host_pool[5, 1, 1] == 1.0).all()), "the save read the forward's write"
    assert bool((kv[1][1][9] == 7.0).all())


def test_a_forward_waits_on_the_queued_copies_of_the_layer_it_waited_for(
        stack: ExitStack, fake: Any) -> None:
    """The layer the forward waited for (``wait_layer``) may be issued and not have run: the
    forward's work on that layer must run after it, through the layer's event. A load's
    layer (the forward reads what the h2d brings), and any layer of a batch with saves
    alone (the forward may write a block the d2h still reads: evicted and reused in the
    same step)."""
    backend = fake_cuda.cupy_backend()
    kv = _caches(7)
    d, sc = _rig(stack, backend, kv=kv)
    d.wait_for_ranks(10)
    model = _model_stream(fake, sc)
    last = LAYOUT.num_layers - 1
    sc.host_pool[1].fill_(2.0)
    gate = fake.hold(backend.transfer_stream.ptr, "a long copy")
    stack.callback(gate.open)
    load = d.publish([P.Op(0, P.H2D, _ids(1), _ids(6), layerwise=True)], 0)
    assert holds_within(lambda: sc.actor.counter.is_done(load, last), 10)  # issued, not run
    seen: list[float] = []
    sc.wait_layer(load, 1, timeout=1)
    fake.enqueue(model, lambda: seen.append(float(kv[1][0][6].flatten()[0])),
                 "the forward reads layer 1 of block 6")
    fake.drain(model)
    assert fake.pending(model) and seen == [], "the forward read the layer before its h2d"
    gate.open()
    assert poll_until_done(d, load, 10)[load].ok
    fake.drain_all()
    assert seen == [2.0]

    kv[1][1][9].fill_(1.0)
    gate = fake.hold(backend.transfer_stream.ptr, "a long copy")
    stack.callback(gate.open)
    save = d.publish([P.Op(0, P.D2H, _ids(9), _ids(5))], 1)
    assert holds_within(lambda: sc.actor.counter.is_done(save, last), 10)  # issued, not run
    sc.wait_layer(save, 0, timeout=1)
    fake.enqueue(model, lambda: kv[1][1][9].fill_(7.0), "the forward writes block 9 anew")
    fake.drain(model)
    assert fake.pending(model), "the forward's write ran before the batch's queued d2h"
    gate.open()
    assert poll_until_done(d, save, 10)[save].ok
    fake.drain_all()
    assert bool((sc.host_pool[5, 1, 1] == 1.0).all()), "the save read the forward's write"
    assert bool((kv[1][1][9] == 7.0).all())
