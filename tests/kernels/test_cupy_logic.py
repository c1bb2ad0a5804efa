"""CupyBackend's host-side logic without a GPU, against the stream-faithful fake cupy.

The fake runs each launch on the CPU exactly as the CUDA source addresses memory (param
table, runs, vector width, grid slices), when its stream runs. So pointer arithmetic,
per-part strides, engine layouts, the launch configuration, start-up compilation and the
pinned pool are checked on every CI run; stream ordering is in ``test_cupy_streams.py``.
The real kernel is covered by ``test_cupy_backend.py`` (``gpu`` marker) wherever CUDA exists.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.kernels import fake_cuda
from tests.kernels.engine_layouts import ENGINE_LAYOUTS, check_round_trip, check_v_own_strides
from tests.kernels.helpers import as_bytes, clone, ids, layout, random_caches, same_caches
from zkv.kernels import DONE, TorchCpuBackend
from zkv.kernels.cupy_backend import _SOURCE, WIDTHS, default_copy_ctas, launch_config
from zkv.kernels.pinned import HOST_REGISTER_MAPPED
from zkv.kernels.reference import ref_copy_d2h, ref_copy_h2d


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[fake_cuda.FakeCuda]:
    f = fake_cuda.FakeCuda(num_devices=2, sm_count=8)
    fake_cuda.install(monkeypatch, f)
    yield f


@pytest.fixture
def backend(fake: fake_cuda.FakeCuda) -> Any:
    return fake_cuda.cupy_backend(num_events=4)


def _caches(backend: Any, lay: Any, seed: int) -> tuple[list[Any], torch.Tensor]:
    kv, _ = random_caches(TorchCpuBackend(), lay, seed=seed)
    host = backend.allocate_host_pool(lay)
    host.view(torch.uint8).copy_(
        torch.randint(0, 256, host.view(torch.uint8).shape, dtype=torch.uint8)
    )
    return kv, host


@pytest.mark.parametrize("dtype", ["float16", "float32", "uint8"])
def test_kernel_addresses_match_oracle(fake: Any, backend: Any, dtype: str) -> None:
    # float32 chunks are 1280 vectors: two or more grid slices, the last one partial.
    lay = layout(dtype, num_layers=3, kv_heads=2, block_size=16, head_dim=160)
    kv, host = _caches(backend, lay, seed=1)
    spec = backend.register(kv, host)
    want_host, want_kv = host.clone(), clone(kv)
    src, dst = ids([5, 0, 11]), ids([8, 3, 1])

    backend.copy_d2h(spec, host, src, dst, layers=range(1, 3))
    ref_copy_d2h(kv, want_host, src, dst, layers=range(1, 3))
    backend.synchronize()
    assert as_bytes(host) == as_bytes(want_host)

    for layer in range(lay.num_layers):
        backend.copy_h2d(host, spec, dst, ids([2, 7, 9]), layer)
        ref_copy_h2d(want_host, want_kv, dst, ids([2, 7, 9]), layer)
    backend.synchronize()
    assert same_caches(kv, want_kv)

    grids = [e[4] for e in fake_cuda.launches(fake)]
    assert len(grids) == 2 + 3  # one per layer and direction, K and V in one launch
    # A quarter of the 8 SMs: 2 thread blocks, each looping over several of the 3 x 2 x
    # pieces work items (the grid-stride path runs in every launch here).
    assert all(g == (2,) for g in grids)
    assert all(e[3].startswith("zkv_copy_16 ") for e in fake_cuda.launches(fake))


def test_v_is_copied_with_its_own_strides(backend: Any) -> None:
    """K is a plain tensor, V a view into a wider one: a different block stride."""
    check_v_own_strides(backend)


@pytest.mark.parametrize("name", sorted(ENGINE_LAYOUTS))
def test_engine_layouts_round_trip_like_the_oracle(fake: Any, backend: Any, name: str) -> None:
    lay, _ = check_round_trip(backend, name, seed=5)
    assert all(e[3].endswith(f" parts {lay.num_kv_parts}") for e in fake_cuda.launches(fake))


def test_odd_geometry_falls_back_to_narrow_access(fake: Any, backend: Any) -> None:
    lay = layout("uint8", kv_heads=3, block_size=5, head_dim=7, num_layers=2)
    shape = (lay.num_device_blocks, 3, 5, 7)
    joint = torch.randint(0, 256, (shape[0], 2, *shape[1:]), dtype=torch.uint8)
    raw = torch.randint(0, 256, (shape[0] * 210 + 1,), dtype=torch.uint8)
    shifted = raw[1:].view(2, *shape)  # 1-byte-shifted base
    kv = [(joint[:, 0], joint[:, 1]), (shifted[0], shifted[1])]
    host = backend.allocate_host_pool(lay)
    want = host.clone()
    backend.copy_d2h(kv, host, ids([1, 10, 4]), ids([0, 8, 3]))
    ref_copy_d2h(kv, want, ids([1, 10, 4]), ids([0, 8, 3]))
    backend.synchronize()
    assert as_bytes(host) == as_bytes(want)
    assert {e[3].split()[0] for e in fake_cuda.launches(fake)} == {"zkv_copy_1"}


def test_ids_and_params_uploaded_once_for_a_layerwise_h2d(fake: Any, backend: Any) -> None:
    lay = layout(num_layers=3)
    kv, host = _caches(backend, lay, seed=2)
    spec = backend.register(kv, host)  # uploads the param table
    allocs = len([e for e in fake.log if e[0] == "alloc"])
    for layer in range(lay.num_layers):
        backend.copy_h2d(host, spec, ids([1, 2]), ids([3, 4]), layer)
    assert len([e for e in fake.log if e[0] == "alloc"]) == allocs + 1  # the ids, once
    backend.copy_h2d(host, spec, ids([1, 5]), ids([3, 4]), 0)
    assert len([e for e in fake.log if e[0] == "alloc"]) == allocs + 2


def test_a_launch_argument_of_another_width_is_caught_as_a_gpu_would_misread_it(
        fake: Any, backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """cupy passes each argument as a buffer of its numpy type, and the driver reads it at
    the size the kernel declares: an ``np.int32`` for a ``long long`` is read with 4
    garbage bytes on a GPU. The fake read every argument with ``int()``, so such a slip
    copied right in CI; it checks each against the CUDA source's signature now."""
    from tests.kernels.fake_cupy import kernel_signature
    from zkv.kernels.cupy_backend import CupyBackend

    sig = kernel_signature(_SOURCE)
    assert sig[7] == ("long long", False) and sig[0] == ("int", True)  # chunk_bytes, ids
    lay = layout("float32", num_layers=2)
    kv, host = _caches(backend, lay, seed=3)
    spec = backend.register(kv, host)
    backend.synchronize()
    real = CupyBackend._launch

    def narrowed(self: Any, *a: Any) -> None:  # chunk_bytes as an np.int32 (a slip)
        kernels = self._kernels
        self._kernels = {w: (lambda k: lambda grid, block, args: k(
            grid, block, (*args[:7], np.int32(args[7]), *args[8:])))(k)
            for w, k in kernels.items()}
        try:
            real(self, *a)
        finally:
            self._kernels = kernels

    monkeypatch.setattr(CupyBackend, "_launch", narrowed)
    with pytest.raises(AssertionError, match="argument 7: a long long wants int64"):
        backend.copy_d2h(spec, host, ids([3]), ids([5]))


def test_kernels_compiled_at_start_and_timed(fake: Any) -> None:
    backend = fake_cuda.cupy_backend(device=1)
    compiles = [e for e in fake.log if e[0] == "compile"]
    assert compiles == [("compile", 1)]  # in the constructor, on the backend's device
    info = backend.startup_info()
    assert info["kernel_compile_ms"] >= 0 and info["sm_count"] == 8
    lay = layout()
    kv, host = _caches(backend, lay, seed=3)
    backend.copy_d2h(kv, host, ids([0]), ids([0]))
    backend.synchronize()
    assert [e for e in fake.log if e[0] == "compile"] == compiles  # never inside a batch


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_kernel_source_compiles_with_nvrtc_cleanly(arch: str) -> None:
    """The real CUDA source, through the real compiler (no GPU needed): every width's
    kernel is in the PTX and the compiler has nothing to say."""
    from cupy_backends.cuda.libs import nvrtc

    try:
        nvrtc.getVersion()
    except Exception as e:  # CI installs it: pip install -e '.[test]'
        pytest.skip(f"NVRTC not installed (nvidia-cuda-nvrtc-cu12): {e}")
    prog = nvrtc.createProgram(_SOURCE, "zkv_copy.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-std=c++14", f"--gpu-architecture={arch}"])
    except Exception as e:
        raise AssertionError(nvrtc.getProgramLog(prog)) from e
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert [w for w in WIDTHS if f".entry zkv_copy_{w}(" in ptx] == list(WIDTHS)
    assert nvrtc.getProgramLog(prog).strip("\x00\n ") == ""
    nvrtc.destroyProgram(prog)


def test_launch_config_spreads_small_copies_over_its_thread_blocks(fake: Any) -> None:
    # One 16 KiB chunk (1024 vectors) a part: one slice each would be 2 items for 8 CTAs.
    assert launch_config(1, 2, 1024, ctas=8) == (8, 4, 256)
    assert launch_config(1, 2, 1024, ctas=132) == (8, 4, 256)  # never below 1 vector/thread
    assert launch_config(256, 2, 2048, ctas=33) == (33, 2, 1024)  # big copies: 16 KiB slices
    assert launch_config(1, 1, 10**9, ctas=2) == (2, 976563, 1024)  # grid-stride, capped grid
    assert default_copy_ctas(132) == 33 and default_copy_ctas(8) == 2 and default_copy_ctas(1) == 1
    with pytest.raises(ValueError, match="copy_ctas must be >= 1"):
        fake_cuda.cupy_backend(copy_ctas=0)
    backend = fake_cuda.cupy_backend(copy_ctas=8)
    assert backend.startup_info()["copy_ctas"] == 8
    lay = layout("float16", kv_heads=8, block_size=16, head_dim=64)  # 16 KiB chunks
    kv, host = _caches(backend, lay, seed=6)
    backend.copy_d2h(kv, host, ids([3]), ids([1]), layers=range(1))
    backend.synchronize()
    assert fake_cuda.launches(fake)[-1][4] == (8,)
    want = host.clone()
    ref_copy_d2h(kv, want, ids([3]), ids([1]), layers=range(1))
    assert as_bytes(host) == as_bytes(want)


def test_host_pool_is_exact_size_registered_memory(fake: Any) -> None:
    backend = fake_cuda.cupy_backend(device=1, pin_threads=3, pin_chunk_bytes=1 << 18)
    lay = layout("bfloat16", num_host_blocks=1000)
    nbytes = lay.num_host_blocks * lay.block_bytes  # 750 KiB: no power of two
    host = backend.allocate_host_pool(lay)
    regs = [e for e in fake.log if e[0] == "hostRegister"]
    assert sum(e[3] for e in regs) == nbytes and len(regs) == 3
    assert {e[1] for e in regs} == {1}  # every pinning thread on the backend's device
    assert all(e[4] & HOST_REGISTER_MAPPED for e in regs)
    assert host.shape == (1000, 3, 2, 2, 4, 8) and host.is_contiguous() and not host.any()
    assert host.data_ptr() == min(e[2] for e in regs)
    info = backend.startup_info()
    assert info["host_pool_bytes"] == nbytes and info["host_pool_chunks"] == 3
    assert info["host_pool_ready_ms"] > 0
    del host
    gc.collect()
    assert sorted(e[2] for e in fake.log if e[0] == "hostUnregister") == sorted(e[2] for e in regs)


def test_one_registration_where_host_pointers_are_not_device_pointers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    f = fake_cuda.FakeCuda(can_use_host_pointer=False)
    fake_cuda.install(monkeypatch, f)
    backend = fake_cuda.cupy_backend()
    lay = layout(num_host_blocks=2000)
    host = backend.allocate_host_pool(lay)
    regs = [e for e in f.log if e[0] == "hostRegister"]
    assert [(e[2], e[3]) for e in regs] == [(host.data_ptr(),
                                             lay.num_host_blocks * lay.block_bytes)]


def test_event_ring_wraps_with_generations(fake: Any, backend: Any) -> None:
    handles = [backend.record_event() for _ in range(9)]
    assert [h.slot for h in handles] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert handles[0].generation == 1 and handles[8].generation == 3
    assert not backend.event_done(handles[0])  # nothing ran yet: the fake never runs alone
    backend.synchronize_event(handles[0])  # stale: answered by the newer record
    assert backend.event_done(handles[8])
    with pytest.raises(ValueError, match="not an event of this backend"):
        backend.event_done(DONE)


def test_unpinned_host_and_bad_ids_rejected(fake: Any, backend: Any) -> None:
    lay = layout()
    kv, host = _caches(backend, lay, seed=3)
    with pytest.raises(ValueError, match="pinned"):
        backend.copy_d2h(kv, host.clone(), ids([0]), ids([0]))
    with pytest.raises(ValueError, match="host block id out of range"):
        backend.copy_h2d(host, kv, ids([9]), ids([0]), 0)
    assert not fake_cuda.launches(fake)


def test_every_call_runs_on_the_backend_device(fake: Any) -> None:
    """Device 1's backend, driven from a thread that works on device 0 itself (it has a
    context there): each call runs on device 1 and gives the thread its device 0 back."""
    fake.set_device(0)
    backend = fake_cuda.cupy_backend(device=1)
    assert fake.device == 0
    lay = layout()
    kv, host = _caches(backend, lay, seed=8)
    spec = backend.register(kv, host)
    cs = fake.new_stream(device=1)
    backend.begin_batch(cs)
    backend.copy_d2h(spec, host, ids([1]), ids([2]))
    backend.wait_event_on_compute(backend.record_event(), cs)
    backend.synchronize()
    assert fake.device == 0
    made = [e for e in fake.log if e[0] in ("stream", "event", "alloc", "compile", "launch")]
    assert made and {e[1] for e in made} == {1}
    assert np.all([e[3] == 1 for e in fake.log if e[0] in ("record", "wait")])


def test_a_rank_on_device_1_opens_no_context_on_device_0(fake: Any) -> None:
    """CUDA 12's cudaSetDevice(0) creates GPU 0's context (~0.4 GiB; error 46 where GPU 0 is
    exclusive), so no thread of a rank on GPU 1 may ever set device 0, not even to restore
    a fresh thread's default. The threads as ``zkv.worker`` runs them: the main thread
    builds the backend and pins the pool (4 pinning threads), the worker thread binds and
    copies, and a third thread drops the pool (the finalizer unpins there)."""
    backend = fake_cuda.cupy_backend(device=1, pin_threads=4, pin_chunk_bytes=4096)
    lay = layout("float32")
    pool = [backend.allocate_host_pool(lay)]
    regs = [e for e in fake.log if e[0] == "hostRegister"]
    assert len(regs) >= 4 and {e[1] for e in regs} == {1}
    assert fake.context_devices() == {1}, fake.contexts  # construction and pinning
    kv, _ = random_caches(TorchCpuBackend(), lay, seed=9)
    seen: dict[str, Any] = {}

    def worker() -> None:
        try:
            backend.bind_thread()
            seen["bound"] = (fake.device, torch.cuda.current_device())
            spec = backend.register(kv, pool[0])
            backend.begin_batch()
            backend.copy_d2h(spec, pool[0], ids([1, 2]), ids([3, 4]))
            backend.copy_h2d(pool[0], spec, ids([3]), ids([5]), 0)
            backend.wait_event_on_compute(backend.record_event())
            backend.synchronize()
            seen["after"] = fake.device
        except BaseException as e:  # surfaced below
            seen["error"] = e

    for target, name in ((worker, "zkv-worker-1"), (lambda: (pool.clear(), gc.collect()),
                                                     "drops-the-pool")):
        t = threading.Thread(target=target, name=name)
        t.start()
        t.join(10)
    assert seen == {"bound": (1, 1), "after": 1}
    assert sorted(e[2] for e in fake.log if e[0] == "hostUnregister") == sorted(e[2] for e in regs)
    assert {e[1] for e in fake.log if e[0] == "hostUnregister"} == {1}
    assert fake.context_devices() == {1}, fake.contexts
