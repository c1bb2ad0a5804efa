"""CupyBackend's host-side logic on a machine without a GPU, against a fake ``cupy``.

The fake runs each kernel launch on the CPU exactly as the CUDA source does (one
``memmove`` per (block, K|V, slice) at the computed addresses), so the pointer
arithmetic, strides, vector widths, grid shape, id upload cache and event bookkeeping
are checked on every CI run. The real kernel is covered by ``test_cupy_backend.py``
(``gpu`` marker) wherever CUDA exists.
"""

from __future__ import annotations

import ctypes
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from typing_extensions import Self

from tests.kernels.helpers import as_bytes, clone, ids, layout, random_caches, same_caches
from zkv.kernels import DONE, TorchCpuBackend
from zkv.kernels.reference import ref_copy_d2h, ref_copy_h2d


class _Ctx:
    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class FakeStream(_Ctx):
    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = 0xABC0 + id(self) % 1000
        self.non_blocking = non_blocking

    def synchronize(self) -> None:
        return None


class FakeEvent:
    def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
        self.ptr = id(self)
        self.done = True

    def synchronize(self) -> None:
        return None


class FakeArray:
    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.data = np.zeros(shape, dtype=dtype)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        self.data[...] = arr


class FakeKernel:
    def __init__(self, width: int, log: list[tuple[Any, ...]]) -> None:
        self.width = width
        self.log = log

    def __call__(
        self, grid: tuple[int, int, int], block: tuple[int], args: tuple[Any, ...]
    ) -> None:
        ids_arr, n, src0, src1, ss, dst0, dst1, ds, chunk_elems, piece = args
        self.log.append(("launch", self.width, grid, block))
        assert grid[0] == int(n) and grid[1] == 2 and 1 <= grid[2] <= 65535
        w, n = self.width, int(n)
        flat = ids_arr.data.reshape(-1)
        for j in range(n):
            s, d = int(flat[j]), int(flat[n + j])
            for kv, (sb, db) in enumerate(((src0, dst0), (src1, dst1))):
                for z in range(grid[2]):
                    begin = z * int(piece)
                    end = min(begin + int(piece), int(chunk_elems))
                    if end <= begin:
                        continue
                    src = int(sb) + s * int(ss) + begin * w
                    dst = int(db) + d * int(ds) + begin * w
                    assert src % w == 0 and dst % w == 0, "misaligned vector access"
                    ctypes.memmove(dst, src, (end - begin) * w)


class FakeModule:
    def __init__(
        self, code: str, options: tuple[str, ...] = (), log: list[Any] | None = None
    ) -> None:
        assert "ZKV_COPY_KERNEL(16, uint4)" in code
        self.log = log if log is not None else []

    def get_function(self, name: str) -> FakeKernel:
        return FakeKernel(int(name.rsplit("_", 1)[1]), self.log)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    log: list[tuple[Any, ...]] = []
    runtime = types.SimpleNamespace(
        eventRecord=lambda ev, stream: log.append(("record", ev, stream)),
        streamWaitEvent=lambda stream, ev, flags=0: log.append(("wait", stream, ev)),
        pointerGetAttributes=lambda ptr: types.SimpleNamespace(
            type=1 if ptr in pinned else 0, devicePointer=ptr if ptr in pinned else 0
        ),
    )
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        Device=lambda i=0: _Ctx(),
        Stream=FakeStream,
        Event=FakeEvent,
        runtime=runtime,
    )
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda  # type: ignore[attr-defined]
    cupy.RawModule = lambda code, options=(): FakeModule(code, options, log)  # type: ignore
    cupy.empty = lambda shape, dtype: FakeArray(shape, dtype)  # type: ignore[attr-defined]
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype: np.empty(shape, dtype=dtype)  # type: ignore
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0)
    )
    pinned: set[int] = set()

    from zkv.kernels.cupy_backend import CupyBackend

    backend = CupyBackend(num_events=4)
    backend.device = torch.device("cpu")  # "device" memory is host memory here

    def host_pool(lay: Any) -> torch.Tensor:
        pool = TorchCpuBackend().allocate_host_pool(lay)
        pinned.add(pool.data_ptr())
        return pool

    yield {"backend": backend, "log": log, "host_pool": host_pool}


def _caches(fake: dict[str, Any], lay: Any, seed: int) -> tuple[list[Any], torch.Tensor]:
    kv, _ = random_caches(TorchCpuBackend(), lay, seed=seed)
    host = fake["host_pool"](lay)
    host.view(torch.uint8).copy_(
        torch.randint(0, 256, host.view(torch.uint8).shape, dtype=torch.uint8)
    )
    return kv, host


@pytest.mark.parametrize("dtype", ["float16", "float32", "uint8"])
def test_kernel_addresses_match_oracle(fake: dict[str, Any], dtype: str) -> None:
    backend, log = fake["backend"], fake["log"]
    # float32 chunks are 1280 vectors: two grid slices, the second one partial.
    lay = layout(dtype, num_layers=3, kv_heads=2, block_size=16, head_dim=160)
    kv, host = _caches(fake, lay, seed=1)
    want_host, want_kv = host.clone(), clone(kv)
    src, dst = ids([5, 0, 11]), ids([8, 3, 1])

    backend.copy_d2h(kv, host, src, dst, layers=range(1, 3))
    ref_copy_d2h(kv, want_host, src, dst, layers=range(1, 3))
    assert as_bytes(host) == as_bytes(want_host)

    for layer in range(lay.num_layers):
        backend.copy_h2d(host, kv, dst, ids([2, 7, 9]), layer)
        ref_copy_h2d(want_host, want_kv, dst, ids([2, 7, 9]), layer)
    assert same_caches(kv, want_kv)

    launches = [e for e in log if e[0] == "launch"]
    assert len(launches) == 2 + 3  # one per layer and direction
    assert all(e[1] == 16 for e in launches)  # 16-byte vectors on aligned memory
    assert {e[2][2] for e in launches} == {2 if dtype == "float32" else 1}


def test_odd_geometry_falls_back_to_narrow_access(fake: dict[str, Any]) -> None:
    backend, log = fake["backend"], fake["log"]
    lay = layout("uint8", kv_heads=3, block_size=5, head_dim=7, num_layers=2)
    shape = (lay.num_device_blocks, 3, 5, 7)
    joint = torch.randint(0, 256, (shape[0], 2, *shape[1:]), dtype=torch.uint8)
    kv = [(joint[:, 0], joint[:, 1]), (joint[:, 1], joint[:, 0])]
    host = fake["host_pool"](lay)
    want = host.clone()

    backend.copy_d2h(kv, host, ids([1, 10, 4]), ids([0, 8, 3]))
    ref_copy_d2h(kv, want, ids([1, 10, 4]), ids([0, 8, 3]))

    assert as_bytes(host) == as_bytes(want)
    assert {e[1] for e in log if e[0] == "launch"} == {1}


def test_ids_uploaded_once_for_a_layerwise_h2d(fake: dict[str, Any]) -> None:
    backend, log = fake["backend"], fake["log"]
    lay = layout(num_layers=3)
    kv, host = _caches(fake, lay, seed=2)
    for layer in range(lay.num_layers):
        backend.copy_h2d(host, kv, ids([1, 2]), ids([3, 4]), layer)
    # One ring record holds the single upload's buffers; cache hits record nothing.
    assert sum(1 for e in log if e[0] == "record") == 1
    backend.copy_h2d(host, kv, ids([1, 5]), ids([3, 4]), 0)
    assert sum(1 for e in log if e[0] == "record") == 2


def test_event_ordering_calls(fake: dict[str, Any]) -> None:
    backend, log = fake["backend"], fake["log"]
    backend.begin_batch()
    record, wait = log[-2], log[-1]
    assert record[0] == "record" and record[2] == 0  # start event on the compute stream
    assert wait == ("wait", backend._stream.ptr, record[1])  # transfer waits on it

    handle = backend.record_event()
    assert log[-1] == ("record", backend._ring[handle.slot].ptr, backend._stream.ptr)
    backend.wait_event_on_compute(handle, compute_stream=77)
    assert log[-1] == ("wait", 77, backend._ring[handle.slot].ptr)
    assert backend.event_done(handle)
    with pytest.raises(ValueError, match="not an event of this backend"):
        backend.event_done(DONE)


def test_ring_wraps_with_generations(fake: dict[str, Any]) -> None:
    backend = fake["backend"]
    handles = [backend.record_event() for _ in range(9)]
    assert [h.slot for h in handles] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert handles[0].generation == 1 and handles[8].generation == 3
    assert backend.event_done(handles[0])  # stale: answered by the newer record


def test_unpinned_host_and_bad_ids_rejected(fake: dict[str, Any]) -> None:
    backend, log = fake["backend"], fake["log"]
    lay = layout()
    kv, host = _caches(fake, lay, seed=3)
    with pytest.raises(ValueError, match="pinned"):
        backend.copy_d2h(kv, host.clone(), ids([0]), ids([0]))
    with pytest.raises(ValueError, match="host block id out of range"):
        backend.copy_h2d(host, kv, ids([9]), ids([0]), 0)
    assert not [e for e in log if e[0] == "launch"]
