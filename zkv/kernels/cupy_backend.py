"""CuPy copy backend: one RawKernel launch per layer and direction on a private stream.

The model's caches are torch CUDA tensors; we only take their ``data_ptr()`` and
strides. The host pool is pinned, so the kernel reaches it through its UVA device
address (zero-copy over PCIe, no staging buffer)::

    grid = (n, 2, pieces)      x: block pair j   y: 0 = K, 1 = V   z: slice of the chunk
    thread block (j, kv, p):   src = src_base[kv] + ids[0, j] * src_stride
                               dst = dst_base[kv] + ids[1, j] * dst_stride
                               copies elements [p * piece, (p + 1) * piece) of the chunk,
                               as 16-byte vectors when every address allows it

    d2h layer l:  src_base = (K_l, V_l) device,  src_stride = K_l.stride(0) bytes
                  dst_base = host + (2l, 2l+1) * chunk_bytes,  dst_stride = block_bytes
    h2d layer l:  the same with src and dst swapped

Streams and events:

- copies go to ``self._stream`` (non-blocking: no implicit sync with the legacy stream);
- ``begin_batch`` records a start event on the compute stream and makes the transfer
  stream wait on it; ``wait_event_on_compute`` is the reverse, a stream wait, so the
  host never blocks;
- every event is preallocated at construction: one start event, and a ring of
  ``num_events`` recorded only on the transfer stream. Handles carry a generation; a
  stale handle (its slot re-recorded since) is answered by the newer record, which
  completes no earlier because the ring only ever records on that one stream.

Compute streams are raw ``cudaStream_t`` handles (torch's ``cuda_stream``); we call the
runtime directly instead of wrapping them (``cupy.cuda.ExternalStream`` is deprecated in
CuPy 14 and warns). cupy is imported lazily: importing this module never touches CUDA.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np
import torch

from zkv.config import CacheLayout
from zkv.errors import ConfigError
from zkv.kernels.base import (
    CopyBackend,
    EventHandle,
    Ids,
    KVCaches,
    host_pool_shape,
    layer_list,
    torch_dtype,
)

_SOURCE = r"""
template <typename T>
__device__ __forceinline__ void zkv_copy(
    const int* __restrict__ ids, const int n,
    const unsigned long long src0, const unsigned long long src1, const long long src_stride,
    const unsigned long long dst0, const unsigned long long dst1, const long long dst_stride,
    const long long chunk_elems, const long long piece_elems) {
  const long long j = blockIdx.x;
  const int kv = blockIdx.y;
  const long long begin = (long long)blockIdx.z * piece_elems;
  long long end = begin + piece_elems;
  if (end > chunk_elems) end = chunk_elems;
  const long long s = ids[j];
  const long long d = ids[n + j];
  const T* __restrict__ src = (const T*)((kv ? src1 : src0) + s * src_stride);
  T* __restrict__ dst = (T*)((kv ? dst1 : dst0) + d * dst_stride);
  // Four loads in flight before the stores: host memory over PCIe is latency-bound.
  const long long step = blockDim.x;
  long long i = begin + threadIdx.x;
  for (; i + 3 * step < end; i += 4 * step) {
    const T a = src[i], b = src[i + step], c = src[i + 2 * step], e = src[i + 3 * step];
    dst[i] = a; dst[i + step] = b; dst[i + 2 * step] = c; dst[i + 3 * step] = e;
  }
  for (; i < end; i += step) dst[i] = src[i];
}

#define ZKV_COPY_KERNEL(W, T)                                                              \
  extern "C" __global__ void zkv_copy_##W(                                                 \
      const int* __restrict__ ids, const int n,                                            \
      const unsigned long long src0, const unsigned long long src1, const long long ss,    \
      const unsigned long long dst0, const unsigned long long dst1, const long long ds,    \
      const long long chunk_elems, const long long piece_elems) {                          \
    zkv_copy<T>(ids, n, src0, src1, ss, dst0, dst1, ds, chunk_elems, piece_elems);         \
  }

ZKV_COPY_KERNEL(16, uint4)
ZKV_COPY_KERNEL(8, unsigned long long)
ZKV_COPY_KERNEL(4, unsigned int)
ZKV_COPY_KERNEL(2, unsigned short)
ZKV_COPY_KERNEL(1, unsigned char)
"""

_THREADS = 256
_ELEMS_PER_THREAD = 4  # per thread block slice: 256 * 4 * 16 B = 16 KiB
_MAX_GRID_YZ = 65535
_CUDA_MEMORY_TYPE_HOST = 1


def _cupy() -> Any:
    import cupy  # lazy: importing zkv.kernels must work without a GPU

    return cupy


class CupyBackend(CopyBackend):
    """GPU block copies: RawKernel gather/scatter on one transfer stream, ring events.

    Invariants: every launch and every ring event record goes to ``self._stream`` (only
    ``begin_batch``'s own start event is recorded on the compute stream); the pinned id
    buffer of an upload stays referenced until a ring event recorded after the upload
    has completed. Device id buffers come from cupy's pool, which hands memory back
    only to later work on the same stream, so stream order covers their reuse.

    Thread safety: copies may come from any thread (serialized by a lock); event
    methods may be called from the model thread while the worker copies.
    """

    name = "cupy"

    def __init__(self, device: int | None = None, num_events: int = 1024) -> None:
        cp = _cupy()
        if not (torch.cuda.is_available() and cp.cuda.is_available()):
            raise ConfigError("the cupy backend needs CUDA (torch and cupy both see no GPU)")
        if num_events < 2:
            raise ValueError(f"num_events must be >= 2, got {num_events}")
        self._cp = cp
        self._device_id = torch.cuda.current_device() if device is None else device
        self.device = torch.device("cuda", self._device_id)
        with cp.cuda.Device(self._device_id):
            self._stream = cp.cuda.Stream(non_blocking=True)
            # block=True: synchronize_event sleeps instead of spinning a core.
            self._ring = [cp.cuda.Event(block=True, disable_timing=True) for _ in range(num_events)]
            self._start = cp.cuda.Event(disable_timing=True)
            self._module = cp.RawModule(code=_SOURCE, options=("-std=c++14",))
        self._gen = [0] * num_events
        self._next = 0
        self._lock = threading.Lock()  # event ring
        self._copy_lock = threading.Lock()  # id upload cache and in-flight buffers
        self._inflight: deque[tuple[EventHandle, tuple[Any, ...]]] = deque()
        self._ids_key: bytes | None = None
        self._ids_dev: Any = None
        self._pending: tuple[Any, ...] | None = None

    def __repr__(self) -> str:
        return f"CupyBackend(device={self._device_id}, num_events={len(self._ring)})"

    # ---------------------------------------------------------------- allocation

    def allocate_host_pool(self, layout: CacheLayout) -> torch.Tensor:
        return torch.zeros(host_pool_shape(layout), dtype=torch_dtype(layout), pin_memory=True)

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
        geo, src, dst = self.checked(kv_caches, host_pool, src_ids, dst_ids, layers, True)
        if not len(src) or not len(layers):
            return
        host = self._host_device_ptr(host_pool)
        block_bytes = 2 * geo.num_layers * geo.chunk_bytes
        with self._copy_lock, self._cp.cuda.Device(self._device_id), self._stream:
            ids = self._upload_ids(src, dst)
            for layer in layers:
                k, v = kv_caches[layer]
                h_k = host + 2 * layer * geo.chunk_bytes
                self._launch(
                    ids, len(src), geo.chunk_bytes,
                    (k.data_ptr(), v.data_ptr(), k.stride(0) * k.element_size()),
                    (h_k, h_k + geo.chunk_bytes, block_bytes),
                )  # fmt: skip
            self._retire()

    def copy_h2d(
        self,
        host_pool: torch.Tensor,
        kv_caches: KVCaches,
        src_ids: Ids,
        dst_ids: Ids,
        layer: int,
    ) -> None:
        geo, src, dst = self.checked(kv_caches, host_pool, src_ids, dst_ids, (layer,), False)
        if not len(src):
            return
        host = self._host_device_ptr(host_pool)
        block_bytes = 2 * geo.num_layers * geo.chunk_bytes
        k, v = kv_caches[layer]
        h_k = host + 2 * layer * geo.chunk_bytes
        with self._copy_lock, self._cp.cuda.Device(self._device_id), self._stream:
            ids = self._upload_ids(src, dst)
            self._launch(
                ids, len(src), geo.chunk_bytes,
                (h_k, h_k + geo.chunk_bytes, block_bytes),
                (k.data_ptr(), v.data_ptr(), k.stride(0) * k.element_size()),
            )  # fmt: skip
            self._retire()

    def _launch(
        self,
        ids: Any,
        n: int,
        chunk_bytes: int,
        src: tuple[int, int, int],
        dst: tuple[int, int, int],
    ) -> None:
        """One launch for K and V of n blocks; ``src``/``dst`` are (K base, V base, stride).

        For kv in (K, V), j < n: ``dst[kv] + ids[1, j] * dst[2] <- src[kv] + ids[0, j] * src[2]``.
        """
        width = _vector_width(chunk_bytes, (*src, *dst))
        chunk_elems = chunk_bytes // width
        piece = _THREADS * _ELEMS_PER_THREAD
        pieces = -(-chunk_elems // piece)
        if pieces > _MAX_GRID_YZ:
            piece = -(-chunk_elems // _MAX_GRID_YZ)
            pieces = -(-chunk_elems // piece)
        kernel = self._module.get_function(f"zkv_copy_{width}")
        kernel(
            (n, 2, pieces),
            (_THREADS,),
            (
                ids, np.int32(n),
                np.uint64(src[0]), np.uint64(src[1]), np.int64(src[2]),
                np.uint64(dst[0]), np.uint64(dst[1]), np.int64(dst[2]),
                np.int64(chunk_elems), np.int64(piece),
            ),
        )  # fmt: skip

    def _upload_ids(self, src: np.ndarray, dst: np.ndarray) -> Any:
        """``[2, n]`` int32 ids on the device, copied asynchronously from pinned memory.

        The h2d of one batch calls once per layer with the same ids: the last upload is
        reused (read-only on the device; the stream orders its uses). A new upload's
        buffers stay referenced until an event recorded after its launches completes.
        """
        cp = self._cp
        staged = np.stack([src, dst]).astype(np.int32)
        key = staged.tobytes()
        if key == self._ids_key:
            return self._ids_dev
        pinned = _pinned_empty(staged.shape)
        pinned[...] = staged
        ids = cp.empty(staged.shape, dtype=np.int32)
        ids.set(pinned, stream=self._stream)
        self._ids_key, self._ids_dev = key, ids
        self._pending = (pinned, ids)
        return ids

    def _retire(self) -> None:
        """After a call's launches: hold its new id buffers until the stream passes this
        point, and drop the buffers of calls that have finished. O(1) amortized."""
        if self._pending is not None:
            self._inflight.append((self._record(self._stream.ptr), self._pending))
            self._pending = None
        while self._inflight and self.event_done(self._inflight[0][0]):
            self._inflight.popleft()

    # ---------------------------------------------------------------- checks

    def check_devices(self, kv_caches: KVCaches, layers: Any) -> None:
        for layer in layers:
            for t in kv_caches[layer]:
                if t.device != self.device:
                    raise ValueError(
                        f"layer {layer}: cache on {t.device}, backend on {self.device}"
                    )

    def _host_device_ptr(self, host_pool: torch.Tensor) -> int:
        """UVA device address of the pinned host pool.

        Asked every call (~1 us), not cached by address: a freed pinned pool's address
        may come back as pageable memory, and a stale device pointer would fault.
        """
        attrs = self._cp.cuda.runtime.pointerGetAttributes(host_pool.data_ptr())
        if attrs.type != _CUDA_MEMORY_TYPE_HOST or not attrs.devicePointer:
            raise ValueError("host pool must be pinned (use allocate_host_pool)")
        return int(attrs.devicePointer)

    # ---------------------------------------------------------------- ordering

    def _record(self, stream_ptr: int) -> EventHandle:
        """Record the next ring event on the transfer stream."""
        with self._lock, self._cp.cuda.Device(self._device_id):
            slot = self._next % len(self._ring)
            self._next += 1
            self._gen[slot] += 1
            gen = self._gen[slot]
            self._cp.cuda.runtime.eventRecord(self._ring[slot].ptr, stream_ptr)
        return EventHandle(slot, gen)

    def _compute_ptr(self, compute_stream: int | None) -> int:
        if compute_stream is not None:
            return compute_stream
        return int(torch.cuda.current_stream(self._device_id).cuda_stream)

    def begin_batch(self, compute_stream: int | None = None) -> None:
        # A wait captures the event's state when it is enqueued, so one start event,
        # re-recorded every batch, is enough. The device context matters when the
        # compute stream is 0: the legacy stream of the thread's current device.
        runtime = self._cp.cuda.runtime
        with self._lock, self._cp.cuda.Device(self._device_id):
            runtime.eventRecord(self._start.ptr, self._compute_ptr(compute_stream))
            runtime.streamWaitEvent(self._stream.ptr, self._start.ptr, 0)

    def record_event(self) -> EventHandle:
        return self._record(self._stream.ptr)

    def wait_event_on_compute(self, handle: EventHandle, compute_stream: int | None = None) -> None:
        event = self._event(handle)
        with self._cp.cuda.Device(self._device_id):
            self._cp.cuda.runtime.streamWaitEvent(self._compute_ptr(compute_stream), event.ptr, 0)

    def event_done(self, handle: EventHandle) -> bool:
        return bool(self._event(handle).done)

    def synchronize_event(self, handle: EventHandle) -> None:
        self._event(handle).synchronize()

    def synchronize(self) -> None:
        self._stream.synchronize()
        with self._copy_lock:
            self._inflight.clear()

    def _event(self, handle: EventHandle) -> Any:
        if not 0 <= handle.slot < len(self._ring) or handle.generation > self._gen[handle.slot]:
            raise ValueError(f"not an event of this backend: {handle}")
        # An older generation was re-recorded later on the same stream: the newer record
        # completes no earlier, so waiting on it is safe (if longer than needed).
        return self._ring[handle.slot]


def _vector_width(chunk_bytes: int, addresses: tuple[int, ...]) -> int:
    """Widest access (16, 8, 4, 2, 1 bytes) dividing the chunk, every base and every stride."""
    for width in (16, 8, 4, 2):
        if chunk_bytes % width == 0 and all(a % width == 0 for a in addresses):
            return width
    return 1


def _pinned_empty(shape: tuple[int, ...]) -> np.ndarray:
    import cupyx  # lazy, as cupy

    return cupyx.empty_pinned(shape, dtype=np.int32)
