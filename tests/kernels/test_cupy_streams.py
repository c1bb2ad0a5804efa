"""Stream ordering of the CuPy backend, seen through the stream-faithful fake (no GPU).

The fake runs nothing by itself: the tests run streams in the order that would expose a
missing dependency (transfer stream first, compute stream held), so a copy on the wrong
stream or a missing wait shows up as stale bytes.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.kernels import fake_cuda
from tests.kernels.helpers import as_bytes, clone, ids, layout, random_caches, same_caches
from zkv.errors import DeviceFault
from zkv.kernels import TorchCpuBackend
from zkv.kernels.reference import ref_copy_d2h, ref_copy_h2d


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[fake_cuda.FakeCuda]:
    f = fake_cuda.FakeCuda(num_devices=1, sm_count=4, sync_timeout_s=5)
    fake_cuda.install(monkeypatch, f)
    yield f


@pytest.fixture
def rig(fake: fake_cuda.FakeCuda) -> dict[str, Any]:
    backend = fake_cuda.cupy_backend(num_events=8)
    lay = layout("float32", num_layers=2)
    kv, _ = random_caches(TorchCpuBackend(), lay, seed=1)
    host = backend.allocate_host_pool(lay)
    spec = backend.register(kv, host)
    backend.synchronize()  # the param upload
    return {"backend": backend, "kv": kv, "host": host, "spec": spec,
            "transfer": backend.transfer_stream.ptr, "compute": fake.new_stream()}


def _write(t: torch.Tensor, value: float) -> Any:
    return lambda: t.fill_(value)


def test_fake_legacy_stream_syncs_with_blocking_streams_only(fake: Any) -> None:
    blocking, free = fake.new_stream(non_blocking=False), fake.new_stream(non_blocking=True)
    seen: list[str] = []
    fake.enqueue(blocking, lambda: seen.append("A blocking"))
    fake.enqueue(free, lambda: seen.append("B non-blocking"))
    fake.enqueue(fake_cuda.LEGACY, lambda: seen.append("L legacy"))
    fake.enqueue(blocking, lambda: seen.append("C blocking"))
    fake.enqueue(free, lambda: seen.append("D non-blocking"))
    assert fake.drain(fake_cuda.LEGACY) == 0  # L waits for the earlier blocking item A
    assert fake.drain(free) == 2  # non-blocking work never waits for the legacy stream
    assert fake.drain(blocking) == 1  # A runs; C may not overtake L
    assert fake.drain(fake_cuda.LEGACY, blocking) == 2
    assert seen == ["B non-blocking", "D non-blocking", "A blocking", "L legacy", "C blocking"]


def test_fake_torch_and_cupy_keep_their_own_current_streams(fake: Any, rig: dict) -> None:
    """``torch.cuda.stream(s)`` does not move cupy's launches (nor ``with cupy_stream``
    torch's): a copy that forgot to enter its transfer stream, issued under the model's
    torch stream (vLLM's non-blocking one), runs on the legacy stream on a GPU, unordered
    with the model. The fake kept one current stream for both, and such a slip ran on
    the model's stream, ordered, in CI; it keeps them apart now. (zkv enters its stream:
    its copies go to the transfer stream either way.)"""
    backend, model = rig["backend"], rig["compute"]

    class Forgotten:  # the slip: the transfer stream is never entered
        def __init__(self, s: Any) -> None:
            self.s, self.ptr = s, s.ptr

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    def queued(ptr: int) -> set[str]:
        return {i.kind for i in fake.resolve(ptr).queue}

    real = backend._stream
    with torch.cuda.stream(torch.cuda.ExternalStream(model)):
        assert fake.current_stream_ptr() == fake_cuda.LEGACY  # cupy's: untouched
        backend.copy_d2h(rig["spec"], rig["host"], ids([3]), ids([5]))
        assert "kernel" in queued(rig["transfer"]) and "kernel" not in queued(model)
        backend.synchronize()
        backend._stream = Forgotten(real)
        try:
            backend.copy_d2h(rig["spec"], rig["host"], ids([3]), ids([5]))
        finally:
            backend._stream = real
    assert "kernel" in queued(fake_cuda.LEGACY) and "kernel" not in queued(model)
    backend.synchronize()
    fake.drain(fake_cuda.LEGACY)


def test_d2h_waits_for_compute_enqueued_before_begin_batch(fake: Any, rig: dict) -> None:
    """The forward of the previous step still writes block 3 when the batch starts."""
    b, kv, host, cs = rig["backend"], rig["kv"], rig["host"], rig["compute"]
    fake.enqueue(cs, _write(kv[0][0][3], 7.0), "forward writes K0[3]")
    fake.enqueue(cs, _write(kv[0][1][3], -2.0), "forward writes V0[3]")
    b.begin_batch(cs)
    b.copy_d2h(rig["spec"], host, ids([3]), ids([5]))
    handle = b.record_event()
    fake.drain(rig["transfer"])  # the transfer stream alone, as far as it may go
    assert not b.event_done(handle)
    assert not bool((host[5, 0, 0] == 7.0).all())  # the d2h did not run ahead of compute
    b.synchronize_event(handle)  # runs exactly what the d2h needs: the forward first
    assert bool((host[5, 0, 0] == 7.0).all()) and bool((host[5, 0, 1] == -2.0).all())


def test_compute_reads_a_layer_only_after_its_h2d(fake: Any, rig: dict) -> None:
    """The model's read of layer l waits on the layer's event: on the compute stream."""
    b, kv, host, cs = rig["backend"], rig["kv"], rig["host"], rig["compute"]
    host[2].fill_(3.5)
    b.begin_batch(cs)
    handles = []
    for layer in range(2):
        b.copy_h2d(host, rig["spec"], ids([2]), ids([6]), layer)
        handles.append(b.record_event())
    seen: list[bytes] = []
    for layer, handle in enumerate(handles):
        b.wait_event_on_compute(handle, cs)  # returns at once: the host never blocks
        fake.enqueue(cs, lambda t=kv[layer][1][6]: seen.append(as_bytes(t)), f"read L{layer}")
    fake.drain(cs)  # records the start event, then parks behind the first h2d
    assert seen == [] and fake.pending(cs) == 4
    fake.sync_stream(cs)  # runs the h2d it waits for, then the reads
    assert seen == [as_bytes(torch.full_like(kv[0][1][6], 3.5))] * 2


def test_wait_event_on_compute_does_not_block_the_host(fake: Any, rig: dict) -> None:
    b, cs = rig["backend"], rig["compute"]
    gate = fake.hold(rig["transfer"], "a long copy")
    b.copy_h2d(rig["host"], rig["spec"], ids([0]), ids([1]), 0)
    handle = b.record_event()
    b.wait_event_on_compute(handle, cs)
    assert fake.pending(cs) == 1 and not b.event_done(handle)
    gate.open()
    b.synchronize_event(handle)
    fake.drain(cs)
    assert fake.pending(cs) == 0


def test_uploads_are_ordered_before_the_launch_that_reads_them(fake: Any, rig: dict) -> None:
    """Ids reach the device on the transfer stream, ahead of the kernel that reads them."""
    b, kv, host = rig["backend"], rig["kv"], rig["host"]
    want = host.clone()
    b.copy_d2h(rig["spec"], host, ids([4, 9]), ids([1, 0]))
    kinds = [item.kind for item in fake.resolve(rig["transfer"]).queue]
    assert kinds[0] == "upload" and "kernel" in kinds and fake.pending(fake_cuda.LEGACY) == 0
    b.synchronize()
    ref_copy_d2h(kv, want, ids([4, 9]), ids([1, 0]))
    assert as_bytes(host) == as_bytes(want)


def test_sticky_fault_is_a_device_fault_and_stays(fake: Any, rig: dict) -> None:
    b, host = rig["backend"], rig["host"]
    fake.fault_next_kernel()  # an illegal address, seen when the stream runs
    b.copy_d2h(rig["spec"], host, ids([1]), ids([1]))  # the launch itself succeeds
    handle = b.record_event()
    with pytest.raises(DeviceFault, match="illegal memory access") as info:
        b.synchronize_event(handle)
    assert info.value.status == fake_cuda.ILLEGAL_ADDRESS
    n_log = len(fake.log)
    for call in (lambda: b.copy_h2d(host, rig["spec"], ids([0]), ids([0]), 0),
                 b.record_event, b.synchronize, lambda: b.begin_batch(rig["compute"])):
        with pytest.raises(DeviceFault):
            call()
    assert len(fake.log) == n_log  # not one more call reached the dead context


def test_non_sticky_launch_error_fails_one_copy_only(fake: Any, rig: dict) -> None:
    b, kv, host = rig["backend"], rig["kv"], rig["host"]
    fake.fail_next_launch(fake_cuda.LAUNCH_OUT_OF_RESOURCES)
    with pytest.raises(fake_cuda.CUDARuntimeError) as info:
        b.copy_d2h(rig["spec"], host, ids([2]), ids([2]))
    assert not isinstance(info.value, DeviceFault)
    want = host.clone()
    b.copy_d2h(rig["spec"], host, ids([2]), ids([2]))
    b.synchronize()
    ref_copy_d2h(kv, want, ids([2]), ids([2]))
    assert as_bytes(host) == as_bytes(want)


def test_synchronize_keeps_the_staging_of_a_copy_issued_during_its_wait(
        fake: Any, rig: dict) -> None:
    """Copies may come from any thread. One issued while another thread's synchronize()
    waits is not covered by that wait: its id upload is still queued, so its pinned
    staging must stay referenced until its own event completes (cupy's pinned pool
    reuses a freed block at once; the fake fails an upload whose source was freed)."""
    b, kv, host, spec = rig["backend"], rig["kv"], rig["host"], rig["spec"]
    b.copy_d2h(spec, host, ids([0]), ids([1]))  # in flight when synchronize() starts
    staged: list[weakref.ref[Any]] = []
    errors: list[BaseException] = []

    def copy_h2d() -> None:
        try:
            b.copy_h2d(host, spec, ids([2, 3]), ids([4, 5]), 0)
        except BaseException as e:  # surfaced below
            errors.append(e)

    def copy_from_another_thread() -> None:  # after the stream sync, before synchronize returns
        first = len(fake.pinned)
        t = threading.Thread(target=copy_h2d, name="other-copier")
        t.start()
        t.join(10)
        assert not t.is_alive(), "the copy blocked behind synchronize()"
        staged.extend(fake.pinned[first:])

    fake.after_stream_sync = copy_from_another_thread
    b.synchronize()
    assert not errors and len(staged) == 1  # the ids of the h2d, staged once
    gc.collect()
    assert staged[0]() is not None, "synchronize() dropped the staging of a queued upload"
    assert [i.kind for i in fake.resolve(rig["transfer"]).queue][0] == "upload"
    want = clone(kv)
    ref_copy_h2d(host, want, ids([2, 3]), ids([4, 5]), 0)
    b.synchronize()  # runs the h2d: its upload reads the staging
    gc.collect()
    assert staged[0]() is None  # released once its own event completed
    assert same_caches(kv, want)
