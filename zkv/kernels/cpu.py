"""torch-CPU copy backend: the synchronous twin of the CuPy backend, used by CI.

Every (layer, K|V) of a call is one gather and one scatter of whole chunks, chunked
through a small per-thread staging buffer::

    src rows (device K_l or host[:, l, kv])      staging (<= staging_bytes, stays in cache)      dst rows
    ┌──────┐ index_select (memcpy per row)        ┌──────┐  index_put_ (one pass)               ┌──────┐
    │ s0   │ ───────────────────────────────────► │ s0   │ ───────────────────────────────────► │ d0   │
    │ s1   │                                      │ s1   │                                      │ d1   │
    └──────┘                                      └──────┘                                      └──────┘

Why this shape (measured on a 2-core EPYC, see bench/transfer.py):

- ``index_select`` along dim 0 of a row-contiguous tensor is a memcpy per row, near
  the speed of a contiguous copy; ``index_put_`` / ``index_copy_`` move one *element*
  per iteration, so we view every row as the widest element that divides it:
  ``complex128`` (16 bytes) is ~5x faster than ``float16`` elements. A copy never
  does arithmetic on the elements, so any bit pattern (NaN payloads included) survives;
  tests check byte equality on random bytes.
- torch has no single-pass gather+scatter; staging keeps the intermediate in cache so
  DRAM sees about the traffic of one copy.
- A Python loop runs per (layer, K|V, staging chunk), never per block. torch ops
  release the GIL, so a worker thread copies while the model thread runs.

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

DEFAULT_STAGING_BYTES = 8 << 20


class TorchCpuBackend(CopyBackend):
    """Synchronous block copies with torch CPU ops; events are always complete.

    Complexity per call: O(len(layers) * (1 + n*chunk_bytes / staging_bytes)) torch ops.
    """

    name = "cpu"

    def __init__(self, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be > 0, got {staging_bytes}")
        self.device = torch.device("cpu")
        self._staging_bytes = staging_bytes
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"TorchCpuBackend(staging_bytes={self._staging_bytes})"

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
        n = len(src_idx)
        row_bytes = src.shape[1] * src.element_size()
        per = max(1, self._staging_bytes // row_bytes)
        staging = self._staging(min(n, per), src.shape[1], src.dtype)
        for start in range(0, n, per):
            s = src_idx[start : start + per]
            buf = staging[: len(s)]
            torch.index_select(src, 0, s, out=buf)
            dst.index_put_((dst_idx[start : start + per],), buf)

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
