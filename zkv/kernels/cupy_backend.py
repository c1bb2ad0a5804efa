"""CuPy copy backend: one RawKernel launch per layer and direction on a private stream.

The model's caches are torch CUDA tensors; we only take addresses and strides from their
:class:`~zkv.kernels.layout.KVSpec`. The host pool is pinned and mapped, so the kernel
reaches it through its device address (zero-copy over PCIe, no staging buffer)::

    params[layer, part, 8] int64 (device, uploaded once per spec):
        dev base | block stride | run bytes | n1 | n2 | s0 | s1 | s2     (bytes)
    run r of a block at  i0*s0 + i1*s1 + i2*s2,  (i0, i1, i2) = unravel(r, (., n1, n2))

    work items w = (j, p, z) of n x parts x pieces   j: block pair   p: part (K, V / latent)
                                                     z: slice of a chunk
    grid = (ctas,): thread block b takes items b, b + ctas, b + 2*ctas, ...
    item (j, p, z):            host = host + host_id * block_bytes + (layer*parts + p) * chunk
                               dev  = params[layer,p].base + dev_id * params[layer,p].stride
                               vectors [z*piece, (z+1)*piece) of the chunk, in logical order;
                               vector v lies in run v / run_vecs (one run: a straight copy)

Each part carries its own strides (V is never copied with K's), and every address, stride
and run is a multiple of the vector width (16, 8, 4, 2 or 1 bytes) the launch uses.
``pieces`` is chosen from the SM count: a small copy is cut into more slices so that it
still spreads over the thread blocks it may use. ``ctas`` is capped (``copy_ctas``, by
default a quarter of the SMs): the copies reach pinned host memory over PCIe, which a few
SMs with loads in flight already saturate, and a grid over every SM would hold the SMs
the model's next layer runs on (the layer-wise overlap is only as good as what the copy
leaves free).

Start-up: the kernels are compiled (or loaded from cupy's on-disk cache) in the
constructor, timed (``startup_info()["kernel_compile_ms"]``), never inside a batch.

Streams and events (every call names its stream; nothing goes to the legacy stream):

- copies and id/param uploads go to ``self._stream`` (non-blocking: no implicit sync with
  the legacy stream); every call runs with ``device`` current (see Devices below);
- ``begin_batch`` records a start event on the compute stream it is given and makes the
  transfer stream wait on it; ``wait_event_on_compute`` is the reverse, a stream wait, so
  the host never blocks;
- every event is preallocated at construction: one start event, and a ring of
  ``num_events`` recorded only on the transfer stream. Handles carry a generation; a
  stale handle (its slot re-recorded since) is answered by the newer record, which
  completes no earlier because the ring only ever records on that one stream.

Errors: a sticky CUDA error (illegal address, launch failure, ECC, ...) leaves the context
unusable. The first one seen becomes :class:`~zkv.errors.DeviceFault` and every later call
raises it at once (no call reaches the dead context again). Other CUDA errors propagate
unchanged (one op fails).

Devices: ``bind_thread`` makes ``device`` the calling thread's device for good (the worker
thread calls it first); after that no call in that thread switches devices. Every call goes
through :func:`~zkv.kernels.pinned.on_device`, never ``with cupy.cuda.Device``, whose exit
always calls ``cudaSetDevice(previous)``: with the CUDA 12 runtime that creates a context
on the previous device (GPU 0 in a fresh thread), ~0.3-0.5 GiB of another rank's GPU.

Compute streams are raw ``cudaStream_t`` handles (torch's ``cuda_stream``); we call the
runtime directly instead of wrapping them. cupy is imported lazily: importing this module
never touches CUDA.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from zkv.config import CacheLayout
from zkv.errors import ConfigError, DeviceFault
from zkv.kernels.base import CopyBackend, EventHandle, Ids, KVCaches, layer_list
from zkv.kernels.layout import KVSpec, host_pool_shape, torch_dtype
from zkv.kernels.pinned import DEFAULT_CHUNK_BYTES, PinnedInfo, on_device, pinned_empty

_SOURCE = r"""
__device__ __forceinline__ long long zkv_run_offset(unsigned int r, const long long* q) {
  const unsigned int n1 = (unsigned int)q[3], n2 = (unsigned int)q[4];
  const unsigned int i2 = r % n2;
  r /= n2;
  const unsigned int i1 = r % n1, i0 = r / n1;
  return (long long)i0 * q[5] + (long long)i1 * q[6] + (long long)i2 * q[7];
}

template <typename T>
__device__ __forceinline__ void zkv_copy_item(
    const int* __restrict__ ids, const int n, const long long* __restrict__ params,
    const int layer, const int parts, const unsigned long long host, const long long host_block,
    const long long chunk_bytes, const int to_host, const long long j, const int p,
    const long long begin, const long long chunk, const long long piece) {
  const long long* q = params + ((long long)layer * parts + p) * 8;
  const long long run = q[2] / (long long)sizeof(T);
  long long end = begin + piece;
  if (end > chunk) end = chunk;
  const long long dev_id = ids[to_host ? j : n + j];
  const long long host_id = ids[to_host ? n + j : j];
  char* dev = (char*)q[0] + dev_id * q[1];
  T* h = (T*)(host + host_id * host_block + ((long long)layer * parts + p) * chunk_bytes);
  const long long step = blockDim.x;
  long long i = begin + threadIdx.x;
  if (run == chunk) {  // the block is one dense run: a straight copy, four loads in flight
    T* d = (T*)dev;
    const T* s = to_host ? d : h;
    T* t = to_host ? h : d;
    for (; i + 3 * step < end; i += 4 * step) {
      const T a = s[i], b = s[i + step], c = s[i + 2 * step], e = s[i + 3 * step];
      t[i] = a; t[i + step] = b; t[i + 2 * step] = c; t[i + 3 * step] = e;
    }
    for (; i < end; i += step) t[i] = s[i];
    return;
  }
  const unsigned int run32 = (unsigned int)run;  // a chunk has < 2^32 vectors
  for (; i < end; i += step) {  // strided block: vector i lies in run i / run
    const unsigned int r = (unsigned int)i / run32;
    T* d = (T*)(dev + zkv_run_offset(r, q)) + ((unsigned int)i - r * run32);
    if (to_host) h[i] = *d; else *d = h[i];
  }
}

template <typename T>
__device__ __forceinline__ void zkv_copy(
    const int* __restrict__ ids, const int n, const long long* __restrict__ params,
    const int layer, const int parts, const unsigned long long host, const long long host_block,
    const long long chunk_bytes, const int to_host, const long long piece, const int pieces) {
  const long long items = (long long)n * parts * pieces;
  const long long chunk = chunk_bytes / (long long)sizeof(T);
  for (long long w = blockIdx.x; w < items; w += gridDim.x) {
    zkv_copy_item<T>(ids, n, params, layer, parts, host, host_block, chunk_bytes, to_host,
                     w / ((long long)parts * pieces), (int)((w / pieces) % parts),
                     (w % pieces) * piece, chunk, piece);
  }
}

#define ZKV_COPY_KERNEL(W, T)                                                              \
  extern "C" __global__ void zkv_copy_##W(                                                 \
      const int* __restrict__ ids, const int n, const long long* __restrict__ params,      \
      const int layer, const int parts, const unsigned long long host,                     \
      const long long host_block, const long long chunk_bytes, const int to_host,          \
      const long long piece, const int pieces) {                                           \
    zkv_copy<T>(ids, n, params, layer, parts, host, host_block, chunk_bytes, to_host,      \
                piece, pieces);                                                            \
  }

ZKV_COPY_KERNEL(16, uint4)
ZKV_COPY_KERNEL(8, unsigned long long)
ZKV_COPY_KERNEL(4, unsigned int)
ZKV_COPY_KERNEL(2, unsigned short)
ZKV_COPY_KERNEL(1, unsigned char)
"""

WIDTHS = (16, 8, 4, 2, 1)
THREADS = 256
_MAX_PIECE = THREADS * 4  # vectors per thread block slice: 256 * 4 * 16 B = 16 KiB
#: Default cap on a launch's thread blocks, per SM (see :func:`default_copy_ctas`).
COPY_CTAS_PER_SM = 0.25
_MAX_PIECES = 2**31 - 1  # an int in the kernel
_PARAMS = 8
_CUDA_MEMORY_TYPE_HOST = 1
_DEV_ATTR_SM_COUNT = 16  # cudaDevAttrMultiProcessorCount
#: CUDA errors after which the context is unusable (runtime and driver share the codes).
STICKY_ERRORS = frozenset({214, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719, 911, 999})


def _cupy() -> Any:
    import cupy  # lazy: importing zkv.kernels must work without a GPU

    return cupy


def default_copy_ctas(sm_count: int) -> int:
    """Thread blocks a copy launch may use by default: ``COPY_CTAS_PER_SM`` per SM, at
    least 1."""
    return max(1, int(sm_count * COPY_CTAS_PER_SM))


def launch_config(n: int, parts: int, chunk_vecs: int, ctas: int) -> tuple[int, int, int]:
    """``(grid, pieces, piece)`` for ``n`` blocks: thread blocks launched (at most
    ``ctas``), slices per chunk and vectors per slice.

    At most ``_MAX_PIECE`` vectors a slice; fewer (down to one vector per thread) while
    the work items would not give each of the ``ctas`` thread blocks one. O(1).
    """
    pieces = -(-chunk_vecs // _MAX_PIECE)
    if n * parts * pieces < ctas:
        want = -(-ctas // (n * parts))
        pieces = max(pieces, min(want, -(-chunk_vecs // THREADS)))
    piece = -(-chunk_vecs // max(1, pieces))
    piece = max(piece, -(-chunk_vecs // _MAX_PIECES))
    pieces = -(-chunk_vecs // piece)
    return min(ctas, n * parts * pieces), pieces, piece


def spec_params(spec: KVSpec) -> np.ndarray:
    """``[num_layers, num_kv_parts, 8]`` int64: each part's base, block stride and runs."""
    out = np.zeros((spec.num_layers, spec.num_kv_parts, _PARAMS), dtype=np.int64)
    for layer in spec.parts:
        for part in layer:
            dims = [(1, 0)] * (3 - len(part.runs.outer)) + list(part.runs.outer)
            (_, s0), (n1, s1), (n2, s2) = dims
            row = (part.view.data_ptr(), part.block_stride, part.runs.run_bytes, n1, n2, s0, s1, s2)
            out[part.layer, part.part] = np.array(row, dtype=np.uint64).view(np.int64)
    return out


def vector_width(*values: Any) -> int:
    """Widest access (16, 8, 4, 2, 1 bytes) dividing every value (ints or int64 arrays of
    addresses, strides, sizes)."""
    acc = 16
    for v in values:
        low = np.asarray(v, dtype=np.int64).reshape(-1) & 15
        acc |= int(np.bitwise_or.reduce(low, initial=0))
    return acc & -acc


class CupyBackend(CopyBackend):
    """GPU block copies: RawKernel gather/scatter on one transfer stream, ring events.

    Invariants: every launch, upload and ring event record goes to ``self._stream`` (only
    ``begin_batch``'s start event is recorded on the compute stream); every CUDA call runs
    with ``device`` current, and none creates a context on another device (a thread is
    given back only a device it had a context on); pinned staging buffers of an upload
    stay referenced until a ring event recorded after the upload has completed, whichever
    thread synchronizes meanwhile. Device buffers come from cupy's pool, which hands memory
    back only to later work on the same stream, so stream order covers their reuse. After
    a sticky error every method raises ``DeviceFault``.

    Thread safety: copies may come from any thread (serialized by a lock); event
    methods may be called from the model thread while the worker copies.
    """

    name = "cupy"

    def __init__(self, device: int | None = None, num_events: int = 1024,
                 pin_threads: int = 4, pin_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 copy_ctas: int | None = None) -> None:
        cp = _cupy()
        if not (torch.cuda.is_available() and cp.cuda.is_available()):
            raise ConfigError("the cupy backend needs CUDA (torch and cupy both see no GPU)")
        if num_events < 2:
            raise ValueError(f"num_events must be >= 2, got {num_events}")
        if copy_ctas is not None and copy_ctas < 1:
            raise ValueError(f"copy_ctas must be >= 1, got {copy_ctas}")
        count = cp.cuda.runtime.getDeviceCount()
        self._device_id = torch.cuda.current_device() if device is None else int(device)
        if not 0 <= self._device_id < count:
            raise ConfigError(f"CUDA device {self._device_id} does not exist ({count} visible)")
        self._cp = cp
        self._errors = (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError)
        self._fault: DeviceFault | None = None
        self.device = torch.device("cuda", self._device_id)
        self.pin_threads, self.pin_chunk_bytes = pin_threads, pin_chunk_bytes
        with on_device(cp, self._device_id):
            self._stream = cp.cuda.Stream(non_blocking=True)
            # block=True: synchronize_event sleeps instead of spinning a core.
            self._ring = [cp.cuda.Event(block=True, disable_timing=True) for _ in range(num_events)]
            self._start = cp.cuda.Event(disable_timing=True)
            self.sm_count = int(cp.cuda.runtime.deviceGetAttribute(_DEV_ATTR_SM_COUNT,
                                                                   self._device_id))
            #: thread blocks a copy launch may use (the rest of the GPU stays the model's)
            self.copy_ctas = copy_ctas or default_copy_ctas(self.sm_count)
            t0 = time.perf_counter()
            self._module = cp.RawModule(code=_SOURCE, options=("-std=c++14",))
            self._module.compile()
            self._kernels = {w: self._module.get_function(f"zkv_copy_{w}") for w in WIDTHS}
            self.compile_ms = round((time.perf_counter() - t0) * 1e3, 3)
            # The staging pool of the id uploads, warmed here: on an H200 the first
            # cupyx.empty_pinned (import + pool) held the host 0.4 s, warm ones take 50 us.
            self._cp_pinned((1,), np.int32)
        self._gen = [0] * num_events
        self._next = 0
        self._lock = threading.Lock()  # event ring
        self._copy_lock = threading.Lock()  # uploads and in-flight buffers
        self._inflight: deque[tuple[EventHandle, tuple[Any, ...]]] = deque()
        self._pending: list[Any] = []
        self._ids_key: bytes | None = None
        self._ids_dev: Any = None
        self._params: dict[bytes, tuple[np.ndarray, Any]] = {}
        self.host_pool_info: PinnedInfo | None = None

    def __repr__(self) -> str:
        return f"CupyBackend(device={self._device_id}, num_events={len(self._ring)})"

    @property
    def transfer_stream(self) -> Any:
        """The cupy stream every copy goes to (bench, tests)."""
        return self._stream

    def startup_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"backend": self.name, "device": str(self.device),
                                "sm_count": self.sm_count, "copy_ctas": self.copy_ctas,
                                "kernel_compile_ms": self.compile_ms}
        if self.host_pool_info is not None:
            info["host_pool_bytes"] = self.host_pool_info.num_bytes
            info["host_pool_ready_ms"] = self.host_pool_info.ready_ms
            info["host_pool_chunks"] = self.host_pool_info.num_chunks
        return info

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Device current (:func:`~zkv.kernels.pinned.on_device`: no call in a bound
        thread); a sticky CUDA error becomes (and stays) a DeviceFault."""
        with self._faults(what), on_device(self._cp, self._device_id):
            yield

    @contextlib.contextmanager
    def _faults(self, what: str) -> Iterator[None]:
        """A sticky CUDA error becomes (and stays) a DeviceFault; the device is left as is."""
        if self._fault is not None:
            raise DeviceFault(str(self._fault), self._fault.status)
        try:
            yield
        except self._errors as e:
            status = getattr(e, "status", None)
            if status not in STICKY_ERRORS:
                raise
            self._fault = DeviceFault(f"cuda:{self._device_id}: {what}: {e} (sticky: the "
                                      "context is lost)", status)
            raise self._fault from e

    # ---------------------------------------------------------------- set-up

    def bind_thread(self) -> None:
        """The backend's device becomes the calling thread's current device, and stays:
        no ``with`` around it (leaving one would set the old device back, and with it a
        context on GPU 0). torch shares the runtime's current device; it is set too."""
        with self._faults("bind thread"):
            self._cp.cuda.runtime.setDevice(self._device_id)
            torch.cuda.set_device(self._device_id)

    def current_stream(self) -> int | None:
        return int(torch.cuda.current_stream(self._device_id).cuda_stream)

    def allocate_host_pool(self, layout: CacheLayout) -> torch.Tensor:
        """Zeroed, pinned (mmap + cudaHostRegister), exactly ``layout``'s size."""
        shape, dt = host_pool_shape(layout), torch_dtype(layout)
        num_bytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        with self._guard("pin host pool"):
            arr, info = pinned_empty(self._cp, self._device_id, num_bytes, self._stream,
                                     threads=self.pin_threads, chunk_bytes=self.pin_chunk_bytes)
        self.host_pool_info = info
        return torch.from_numpy(arr).view(dt).view(shape)

    def allocate_device_cache(self, layout: CacheLayout) -> list[tuple[torch.Tensor, ...]]:
        """Zeroed on the transfer stream (not the legacy stream), ready when it returns."""
        stream = torch.cuda.ExternalStream(self._stream.ptr, device=self.device)
        with self._guard("allocate device cache"), torch.cuda.stream(stream):
            caches = super().allocate_device_cache(layout)
        self.synchronize()
        return caches

    def prepare(self, spec: KVSpec) -> None:
        with self._copy_lock, self._guard("upload params"), self._stream:
            self._params_for(spec)
            self._retire()

    def on_compute(self, compute_stream: int | None) -> Any:
        ptr = self._compute_ptr(compute_stream)
        return torch.cuda.stream(torch.cuda.ExternalStream(ptr, device=self.device))

    # ---------------------------------------------------------------- copies

    def copy_d2h(self, kv_caches: KVCaches, host_pool: torch.Tensor, src_ids: Ids,
                 dst_ids: Ids, layers: range | None = None) -> None:
        layers = layer_list(layers, len(kv_caches))
        spec, src, dst = self.checked(kv_caches, host_pool, src_ids, dst_ids, layers, True)
        if not len(src) or not len(layers) or not spec.chunk_bytes:
            return
        with self._copy_lock, self._guard("d2h"), self._stream:
            host = self._host_device_ptr(host_pool)
            params, params_dev = self._params_for(spec)
            ids = self._upload_ids(src, dst)
            for layer in layers:
                self._launch(ids, len(src), spec, params, params_dev, layer, host, True)
            self._retire()

    def copy_h2d(self, host_pool: torch.Tensor, kv_caches: KVCaches, src_ids: Ids,
                 dst_ids: Ids, layer: int) -> None:
        spec, src, dst = self.checked(kv_caches, host_pool, src_ids, dst_ids, (layer,), False)
        if not len(src) or not spec.chunk_bytes:
            return
        with self._copy_lock, self._guard("h2d"), self._stream:
            host = self._host_device_ptr(host_pool)
            params, params_dev = self._params_for(spec)
            ids = self._upload_ids(src, dst)
            self._launch(ids, len(src), spec, params, params_dev, layer, host, False)
            self._retire()

    def _launch(self, ids: Any, n: int, spec: KVSpec, params: np.ndarray, params_dev: Any,
                layer: int, host: int, to_host: bool) -> None:
        """One launch for every part of ``layer`` of n blocks (see the module docstring)."""
        parts, chunk = spec.num_kv_parts, spec.chunk_bytes
        block_bytes = parts * spec.num_layers * chunk
        row = params[layer]
        width = vector_width(chunk, host, row[:, :3], row[:, 5:])
        grid, pieces, piece = launch_config(n, parts, chunk // width, self.copy_ctas)
        self._kernels[width](
            (grid,),
            (THREADS,),
            (
                ids, np.int32(n), params_dev, np.int32(layer), np.int32(parts),
                np.uint64(host), np.int64(block_bytes), np.int64(chunk),
                np.int32(1 if to_host else 0), np.int64(piece), np.int32(pieces),
            ),
        )  # fmt: skip

    def _params_for(self, spec: KVSpec) -> tuple[np.ndarray, Any]:
        """The spec's param table on the device: built once per spec (kept in its memo)
        and uploaded once per distinct table, the last few kept. Call with the copy lock
        held. O(1) for a registered spec."""
        hit = spec.memo.get(self)
        if hit is not None:
            return hit  # type: ignore[no-any-return]
        params = spec_params(spec)
        key = params.tobytes()
        hit = self._params.get(key)
        if hit is None:
            hit = (params, self._upload(params))
            if len(self._params) >= 4:
                self._params.pop(next(iter(self._params)))
            self._params[key] = hit
        spec.memo[self] = hit
        return hit

    def _upload_ids(self, src: np.ndarray, dst: np.ndarray) -> Any:
        """``[2, n]`` int32 ids on the device. The h2d of one batch calls once per layer
        with the same ids: the last upload is reused (the stream orders its uses)."""
        staged = np.stack([src, dst]).astype(np.int32)
        key = staged.tobytes()
        if key != self._ids_key:
            self._ids_key, self._ids_dev = key, self._upload(staged)
        return self._ids_dev

    def _upload(self, arr: np.ndarray) -> Any:
        """An async copy of ``arr`` to the device on the transfer stream, from pinned
        staging held (with the device buffer) until a later ring event completes."""
        pinned = self._cp_pinned(arr.shape, arr.dtype)
        pinned[...] = arr
        dev = self._cp.empty(arr.shape, dtype=arr.dtype)
        dev.set(pinned, stream=self._stream)
        self._pending.append((pinned, dev))
        return dev

    def _cp_pinned(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        import cupyx  # lazy, as cupy

        return cupyx.empty_pinned(shape, dtype=dtype)

    def _retire(self) -> None:
        """After a call's launches: hold its new upload buffers until the stream passes
        this point, and drop the buffers of calls that have finished. O(1) amortized."""
        if self._pending:
            self._inflight.append((self._record(self._stream.ptr), tuple(self._pending)))
            self._pending = []
        self._drop_finished()

    def _drop_finished(self) -> None:
        """Drop the buffers of calls whose ring event has completed, oldest first. Call
        with the copy lock held and the device current."""
        while self._inflight and self._event(self._inflight[0][0]).done:
            self._inflight.popleft()

    # ---------------------------------------------------------------- checks

    def check_devices(self, spec: KVSpec, layers: Any) -> None:
        if spec.device != self.device:
            raise ValueError(f"{spec.parts[0][0].name}: cache on {spec.device}, backend on "
                             f"{self.device}")

    def _host_device_ptr(self, host_pool: torch.Tensor) -> int:
        """Device address of the pinned host pool.

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
        with self._lock, self._guard("event record"):
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
        with self._lock, self._guard("begin batch"):
            runtime.eventRecord(self._start.ptr, self._compute_ptr(compute_stream))
            runtime.streamWaitEvent(self._stream.ptr, self._start.ptr, 0)

    def record_event(self) -> EventHandle:
        return self._record(self._stream.ptr)

    def wait_event_on_compute(self, handle: EventHandle, compute_stream: int | None = None) -> None:
        event = self._event(handle)
        with self._guard("wait on compute"):
            self._cp.cuda.runtime.streamWaitEvent(self._compute_ptr(compute_stream), event.ptr, 0)

    def event_done(self, handle: EventHandle) -> bool:
        event = self._event(handle)
        with self._guard("event query"):
            return bool(event.done)

    def synchronize_event(self, handle: EventHandle) -> None:
        event = self._event(handle)
        with self._guard("event synchronize"):
            event.synchronize()

    def synchronize(self) -> None:
        """Wait for the transfer stream, then drop the buffers of the calls it finished.
        A copy issued by another thread during the wait is not finished: its buffers stay
        (its upload may still be queued, and cupy's pinned pool reuses a freed block at
        once). The wait holds no lock, so such copies are not held up by it."""
        with self._guard("stream synchronize"):
            self._stream.synchronize()
            with self._copy_lock:
                self._drop_finished()

    def _event(self, handle: EventHandle) -> Any:
        if not 0 <= handle.slot < len(self._ring) or handle.generation > self._gen[handle.slot]:
            raise ValueError(f"not an event of this backend: {handle}")
        # An older generation was re-recorded later on the same stream: the newer record
        # completes no earlier, so waiting on it is safe (if longer than needed).
        return self._ring[handle.slot]
