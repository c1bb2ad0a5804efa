"""torch-CPU copy backend: the synchronous twin of the CuPy backend, used by CI.

Each (layer, K|V) of a call is a gather and a scatter of whole chunks through a small
per-thread staging buffer::

    src rows                      staging (reused, in cache)        dst rows
    (K_l, or host[:, l, kv])                                        (host[:, l, kv], or K_l)
    ┌────┐  index_select          ┌────┐  index_copy_ / index_put_  ┌────┐
    │ s0 │ ─────────────────────► │ s0 │ ─────────────────────────► │ d0 │
    │ s1 │  (memcpy per row)      │ s1 │  (one element at a time)   │ d1 │
    └────┘                        └────┘                            └────┘

Why this shape (measured on the 2-core EPYC CI machine; bench/transfer.py):

- ``index_select`` along dim 0 of row-contiguous tensors memcpys each row, close to a
  contiguous copy. ``index_copy_`` / ``index_put_`` move one *element* per iteration,
  so every row is viewed as the widest element dividing it: ``complex128`` (16 bytes)
  is ~20x faster than ``uint8`` and ~3x faster than ``int64``. A copy does no
  arithmetic on elements, so every bit pattern (NaN payloads, -0.0) survives; the
  tests check byte equality on random bytes.
- torch has no one-pass gather+scatter; the staging buffer keeps the intermediate in
  cache so DRAM sees roughly one copy's traffic.
- A Python loop runs per (layer, K|V, chunk of rows), never per block. torch ops
  release the GIL, so a worker thread copies while the model thread runs.

Threads. By default every op stays below torch's parallel grain (32768 elements), so
it runs inline in the calling thread: one core, no OpenMP region. With more busy
threads than cores (a model, several rank processes, CI), each OpenMP region can wait
a scheduler time slice for a descheduled team member; ``index_put_`` opens one even
for two rows. Measured, 256 random blocks of 2 MiB, ratio to one contiguous ``copy_``
at the same torch thread count:

    machine            inline (default)         parallel=True
    idle, 1 thread     0.59x                    0.69x
    idle, 2 threads    0.38x (one core)         0.72x
    load 9, 2 threads  0.4-0.6x                 0.12-0.18x (regions stall)

``torch.set_num_threads`` stays the process's choice, never ours.

Thread safety: calls from different threads are safe (staging is thread-local);
concurrent calls that write the same blocks are the caller's bug, as on GPU.
"""

from __future__ import annotations

import platform
import threading

import torch

from zkv.config import CacheLayout
from zkv.kernels.base import (
    DONE,
    CopyBackend,
    EventHandle,
    Geometry,
    Ids,
    KVCaches,
    check_ids,
    host_pool_shape,
    layer_list,
    torch_dtype,
)

# Widest element first. complex128 only where loads/stores of doubles are plain bit
# moves (x86-64 SSE, AArch64); elsewhere int64 is the widest safe element.
_WIDTHS: tuple[tuple[int, torch.dtype], ...] = (
    ((16, torch.complex128),)
    if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")
    else ()
) + ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

DEFAULT_STAGING_BYTES = 4 << 20  # parallel mode: 2-8 MiB measure alike
# at::internal::GRAIN_SIZE: an op over fewer elements runs inline in the calling thread.
_GRAIN_ELEMS = 32768


class TorchCpuBackend(CopyBackend):
    """Synchronous block copies with torch CPU ops; events are always complete.

    ``parallel=False`` (default): every op stays under torch's parallel grain, so a
    copy runs entirely in the calling thread and never opens an OpenMP region: one
    core, predictable next to a model or other processes. ``parallel=True``: ops of up
    to ``staging_bytes`` use torch's intra-op pool; faster on an idle machine, but
    each of its many regions may stall a scheduler slice when cores are oversubscribed.

    Complexity per call: O(len(layers) * (1 + n / rows_per_op)) torch ops, where
    rows_per_op = staging_bytes / chunk_bytes (parallel) or 32767 / chunk elements.
    """

    name = "cpu"

    def __init__(self, staging_bytes: int = DEFAULT_STAGING_BYTES, parallel: bool = False) -> None:
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be > 0, got {staging_bytes}")
        self.device = torch.device("cpu")
        self._staging_bytes = staging_bytes
        self._parallel = parallel
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"TorchCpuBackend(staging_bytes={self._staging_bytes}, parallel={self._parallel})"

    def allocate_host_pool(self, layout: CacheLayout) -> torch.Tensor:
        return torch.zeros(host_pool_shape(layout), dtype=torch_dtype(layout))

    # ---------------------------------------------------------------- copies

    def copy_d2h(
        self,
        kv_caches: KVCaches,
        host_pool: torch.Tensor,
        src_ids: Ids,
        dst_ids: Ids,
        layers: range | None = None,
    ) -> None:
        layers = layer_list(layers, len(kv_caches))
        geo = self.check_caches(kv_caches, host_pool, layers)
        src, dst = check_ids(
            src_ids, dst_ids, geo.num_device_blocks, geo.num_host_blocks, "device", "host"
        )
        if not len(src) or not len(layers):
            return
        tensors = [t for layer in layers for t in kv_caches[layer]]
        wide = _widest(geo.chunk_bytes, [host_pool, *tensors])
        host = _host_rows(host_pool, geo, wide)
        src_t, dst_t = torch.from_numpy(src), torch.from_numpy(dst)
        for layer in layers:
            for kv in (0, 1):
                dev = _device_rows(kv_caches[layer][kv], geo, wide)
                self._gather_scatter(dev, src_t, host[:, 2 * layer + kv], dst_t)

    def copy_h2d(
        self,
        host_pool: torch.Tensor,
        kv_caches: KVCaches,
        src_ids: Ids,
        dst_ids: Ids,
        layer: int,
    ) -> None:
        geo = self.check_caches(kv_caches, host_pool, (layer,))
        src, dst = check_ids(
            src_ids, dst_ids, geo.num_host_blocks, geo.num_device_blocks, "host", "device"
        )
        if not len(src):
            return
        wide = _widest(geo.chunk_bytes, [host_pool, *kv_caches[layer]])
        host = _host_rows(host_pool, geo, wide)
        src_t, dst_t = torch.from_numpy(src), torch.from_numpy(dst)
        for kv in (0, 1):
            dev = _device_rows(kv_caches[layer][kv], geo, wide)
            self._gather_scatter(host[:, 2 * layer + kv], src_t, dev, dst_t)

    def _gather_scatter(
        self, src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
    ) -> None:
        """``dst[dst_idx[j]] = src[src_idx[j]]`` for rows, through the staging buffer."""
        n, width = len(src_idx), src.shape[1]
        per = max(1, self._staging_bytes // (width * src.element_size()))
        if not self._parallel:
            per = max(1, min(per, (_GRAIN_ELEMS - 1) // width))
        staging = self._staging(min(n, per), width, src.dtype)
        for start in range(0, n, per):
            s = src_idx[start : start + per]
            d = dst_idx[start : start + per]
            buf = staging[: len(s)]
            torch.index_select(src, 0, s, out=buf)
            if self._parallel:
                dst.index_put_((d,), buf)  # ~10% faster, but always opens a parallel region
            else:
                dst.index_copy_(0, d, buf)  # inline below the grain

    def _staging(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """This thread's staging buffer, grown on demand and kept (<= staging_bytes + a row)."""
        bufs: dict[torch.dtype, torch.Tensor] | None = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        numel = rows * width
        buf = bufs.get(dtype)
        if buf is None or buf.numel() < numel:
            # One dtype at a time: a new width replaces the others, so memory stays bounded.
            bufs.clear()
            buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(rows, width)

    # ---------------------------------------------------------------- ordering (all no-ops)

    def begin_batch(self, compute_stream: int | None = None) -> None:
        return None

    def record_event(self) -> EventHandle:
        # Copies are synchronous: when the caller can record, the work is done.
        return DONE

    def wait_event_on_compute(self, handle: EventHandle, compute_stream: int | None = None) -> None:
        return None

    def event_done(self, handle: EventHandle) -> bool:
        return True

    def synchronize_event(self, handle: EventHandle) -> None:
        return None

    def synchronize(self) -> None:
        return None


# -------------------------------------------------------------------- views


def _widest(chunk_bytes: int, tensors: list[torch.Tensor]) -> torch.dtype:
    """Widest element dtype that divides a chunk, every block stride and every base address."""
    for width, dtype in _WIDTHS:
        if chunk_bytes % width:
            continue
        if all(
            t.data_ptr() % width == 0 and (t.stride(0) * t.element_size()) % width == 0
            for t in tensors
        ):
            return dtype
    return torch.uint8


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _device_rows(t: torch.Tensor, geo: Geometry, wide: torch.dtype) -> torch.Tensor:
    """``[num_device_blocks, chunk_bytes / width]`` view of one K or V tensor (no copy)."""
    return _as_bytes(t).view(geo.num_device_blocks, geo.chunk_bytes).view(wide)


def _host_rows(host_pool: torch.Tensor, geo: Geometry, wide: torch.dtype) -> torch.Tensor:
    """``[num_host_blocks, 2 * num_layers, chunk_bytes / width]``; ``[:, 2l + kv]`` is one
    layer's K (kv=0) or V (kv=1) of every host block, rows ``block_bytes`` apart."""
    rows = _as_bytes(host_pool).view(geo.num_host_blocks, 2 * geo.num_layers, geo.chunk_bytes)
    return rows.view(wide)
