"""The one interface every block copy backend implements, plus the checks they share.

Memory layout (the host format is defined in :mod:`zkv.kernels.layout`)::

    device, per layer l:  parts P_l,p (K, V; or one MLA latent), each described by its
                          logical view [num_device_blocks, kv_heads, block_size, head_dim]
                          (any strides: HND, NHD, fused, vLLM CPU's interleaved K/V)
    host pool (page-first, contiguous):
        host_pool[num_host_blocks, num_layers, num_kv_parts, kv_heads, block_size, head_dim]
        host block h = | L0 K | L0 V | L1 K | L1 V | ... |   (``block_bytes``, one L3 value)

    copy_d2h:  P_l,p[src[j]] -> host_pool[dst[j], l, p]     for every part p
    copy_h2d:  host_pool[src[j], l, p] -> P_l,p[dst[j]]

A block's part is copied in the logical order of its ``[heads, block, dim]`` view, so the
host chunk is the same bytes whatever the device strides. Every copy moves whole
elements verbatim, so a backend may view the bytes as any same-sized type.

Caches are described once: ``register(kv_caches, host_pool)`` validates them
(:func:`~zkv.kernels.layout.describe_kv_caches`, errors name the tensor and the check)
and returns a :class:`~zkv.kernels.layout.KVSpec`; copies given a spec skip the
description. Copies given raw ``kv_caches`` describe them on every call (tests, tools).

Ordering contract (what the worker relies on):

- ``begin_batch(compute_stream)`` once per batch, before its copies: on GPU the transfer
  stream waits for everything already enqueued on the compute stream, so a d2h never
  reads a block that the previous step's forward is still writing.
- copies are enqueued on the backend's transfer stream in call order (CPU: they have
  finished when the call returns).
- ``record_event()`` after a layer's copies; the model calls ``wait_event_on_compute``
  before that layer (GPU: a stream wait, the host never blocks).
- a :class:`~zkv.errors.DeviceFault` (a sticky CUDA error) means the device context is
  lost: every later call raises it too, and no enqueued work will run.

Ids are validated (1-D, same length, inside the pool) before any byte moves; a bad
call raises ``ValueError`` and leaves both caches untouched. Destination ids must be
distinct within one call (the protocol refuses duplicates); with duplicates the
winning source is unspecified.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zkv.config import CacheLayout
from zkv.kernels.layout import (
    KVSpec,
    describe_for_host_pool,
    host_pool_shape,
    torch_dtype,
)

KVCaches = Sequence[Any]  # one entry per layer: (K, V), a fused tensor, a latent; or a KVSpec
Ids = np.ndarray | Sequence[int]

__all__ = [
    "DONE", "CopyBackend", "EventHandle", "Ids", "KVCaches", "as_index", "check_ids",
    "device_block_shape", "host_pool_shape", "layer_list", "torch_dtype",
]


def device_block_shape(layout: CacheLayout) -> tuple[int, int, int, int]:
    return (layout.num_device_blocks, layout.kv_heads, layout.block_size, layout.head_dim)


@dataclass(frozen=True, slots=True)
class EventHandle:
    """A recorded point on a backend's transfer stream.

    ``slot`` indexes the backend's preallocated event ring (-1: already complete, the CPU
    backend's only kind). ``generation`` tells a handle from a later record of the same
    slot; a stale handle is answered conservatively by the newer record, which completes
    no earlier because all records go to one stream in order.
    """

    slot: int
    generation: int


DONE = EventHandle(-1, 0)


class CopyBackend(abc.ABC):
    """Moves whole blocks between a device KV cache and a page-first host pool.

    Implementations: :class:`~zkv.kernels.cpu.TorchCpuBackend` (synchronous, CI) and
    :class:`~zkv.kernels.cupy_backend.CupyBackend` (one transfer stream, RawKernel).
    No method loops in Python over blocks; all ids of a call move in a few batched ops.
    """

    name: str
    device: torch.device

    # ---------------------------------------------------------------- set-up

    @abc.abstractmethod
    def allocate_host_pool(self, layout: CacheLayout) -> torch.Tensor:
        """Zeroed page-first host pool on CPU, exactly its size (pinned iff the backend is CUDA)."""

    def allocate_device_cache(self, layout: CacheLayout) -> list[tuple[torch.Tensor, ...]]:
        """Zeroed per-layer parts (K, V; or the MLA latent) on the backend's device
        (standalone workers, tests, bench)."""
        shape = device_block_shape(layout)
        dt = torch_dtype(layout)
        return [
            tuple(torch.zeros(shape, dtype=dt, device=self.device)
                  for _ in range(layout.num_kv_parts))
            for _ in range(layout.num_layers)
        ]

    def register(self, kv_caches: KVCaches, host_pool: torch.Tensor, *,
                 kv_order: str | None = None, names: Sequence[str] | None = None) -> KVSpec:
        """Validate the caches once (layout, strides, device) and describe them; pass the
        returned spec to the copies instead of ``kv_caches``. O(layers)."""
        spec = describe_for_host_pool(kv_caches, host_pool, kv_order=kv_order, names=names)
        self.check_devices(spec, range(spec.num_layers))
        self.prepare(spec)
        return spec

    def prepare(self, spec: KVSpec) -> None:
        """Backend hook run once per registered spec (default: nothing)."""
        return None

    def bind_thread(self) -> None:
        """Make the calling thread use the backend's device (CPU: nothing). A worker thread
        calls it first, so nothing it runs lands on another device."""
        return None

    def current_stream(self) -> int | None:
        """The calling thread's current compute stream as a raw ``cudaStream_t`` (CPU:
        None). Ask in the model's thread: another thread has another current stream."""
        return None

    def on_compute(self, compute_stream: int | None) -> Any:
        """A context in which torch ops go to the compute stream (CPU: nothing to do)."""
        return contextlib.nullcontext()

    def startup_info(self) -> dict[str, Any]:
        """What set-up cost and chose (compile time, device, pinning), for the start log."""
        return {"backend": self.name, "device": str(self.device)}

    # ---------------------------------------------------------------- copies

    @abc.abstractmethod
    def copy_d2h(
        self,
        kv_caches: KVCaches,
        host_pool: torch.Tensor,
        src_ids: Ids,
        dst_ids: Ids,
        layers: range | None = None,
    ) -> None:
        """Device blocks ``src_ids`` -> host blocks ``dst_ids`` for ``layers`` (all by default)."""

    @abc.abstractmethod
    def copy_h2d(
        self,
        host_pool: torch.Tensor,
        kv_caches: KVCaches,
        src_ids: Ids,
        dst_ids: Ids,
        layer: int,
    ) -> None:
        """Host blocks ``src_ids`` -> device blocks ``dst_ids``, one layer."""

    def host_block(self, host_pool: torch.Tensor, host_id: int) -> memoryview:
        """Writable zero-copy bytes of one host block (``block_bytes`` long), for L3 I/O.

        On GPU the caller must have waited for any copy into or out of that block.
        """
        num_host_blocks = host_pool.shape[0]
        if not 0 <= host_id < num_host_blocks:
            raise ValueError(f"host block id {host_id} out of range [0, {num_host_blocks})")
        if not host_pool.is_contiguous():
            raise ValueError("host pool must be contiguous (page-first)")
        # uint8 view first: numpy has no bfloat16 / float8.
        arr = host_pool[host_id].view(torch.uint8).numpy().reshape(-1)
        return memoryview(arr)  # type: ignore[arg-type]  # (numpy's stubs: ndarray is a buffer)

    # ---------------------------------------------------------------- ordering

    @abc.abstractmethod
    def begin_batch(self, compute_stream: int | None = None) -> None:
        """Make the transfer stream wait for work already enqueued on the compute stream.

        ``compute_stream`` is a raw ``cudaStream_t``; ``None`` means the calling thread's
        ``torch.cuda.current_stream()`` (pass the model's stream from a worker thread:
        see :meth:`current_stream`). CPU: no-op.
        """

    @abc.abstractmethod
    def record_event(self) -> EventHandle:
        """Mark the current end of the transfer stream (GPU: an event from the ring)."""

    @abc.abstractmethod
    def wait_event_on_compute(self, handle: EventHandle, compute_stream: int | None = None) -> None:
        """The compute stream waits for ``handle`` without blocking the host. CPU: no-op."""

    @abc.abstractmethod
    def event_done(self, handle: EventHandle) -> bool:
        """Whether the work before ``handle`` has finished (never blocks)."""

    @abc.abstractmethod
    def synchronize_event(self, handle: EventHandle) -> None:
        """Block the calling thread until the work before ``handle`` has finished."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until everything enqueued on the transfer stream has finished."""

    # ---------------------------------------------------------------- shared checks

    def checked(
        self,
        kv_caches: KVCaches,
        host_pool: torch.Tensor,
        src_ids: Ids,
        dst_ids: Ids,
        layers: Sequence[int],
        to_host: bool,
    ) -> tuple[KVSpec, np.ndarray, np.ndarray]:
        """Every check a copy makes before touching a byte: the caches described (a spec
        only against the host pool), layers and ids in range for the direction
        (``to_host``: device -> host), then where the caches live. The last also for a
        spec: one described without :meth:`register`, or registered with another backend,
        may hold memory this one cannot address (raw CUDA or meta addresses: a segfault)."""
        spec = describe_for_host_pool(kv_caches, host_pool)
        for layer in layers:
            if not 0 <= layer < spec.num_layers:
                raise ValueError(f"layer {layer} out of range [0, {spec.num_layers})")
        if to_host:
            bounds = (spec.num_blocks, host_pool.shape[0], "device", "host")
        else:
            bounds = (host_pool.shape[0], spec.num_blocks, "host", "device")
        src, dst = check_ids(src_ids, dst_ids, *bounds)
        self.check_devices(spec, layers)  # O(1): the spec's one device
        return spec, src, dst

    def check_devices(self, spec: KVSpec, layers: Sequence[int]) -> None:
        """The backend's own check of where ``layers`` of the cache live (default: none)."""
        return None


def as_index(ids: Ids, name: str) -> np.ndarray:
    """Ids as a fresh writable int64 array (torch refuses read-only numpy views).

    Any integer dtype; floats, bools and strings are refused (an empty list aside), not
    cast: ``2.7`` would silently name block 2, a bool mask blocks 0 and 1."""
    given = np.asarray(ids)
    if given.dtype.kind not in "iu" and given.size:
        raise ValueError(f"{name} must be integers, got dtype {given.dtype}")
    arr = np.array(given, dtype=np.int64, copy=True)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    return arr


def check_ids(
    src_ids: Ids, dst_ids: Ids, src_bound: int, dst_bound: int, src_what: str, dst_what: str
) -> tuple[np.ndarray, np.ndarray]:
    """Validate a (src, dst) pair of id lists in O(n); return them as int64 arrays."""
    src = as_index(src_ids, "src_ids")
    dst = as_index(dst_ids, "dst_ids")
    if len(src) != len(dst):
        raise ValueError(f"src_ids and dst_ids differ in length: {len(src)} != {len(dst)}")
    for arr, bound, what in ((src, src_bound, src_what), (dst, dst_bound, dst_what)):
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= bound):
            lo, hi = int(arr.min()), int(arr.max())
            raise ValueError(f"{what} block id out of range [0, {bound}): min={lo} max={hi}")
    return src, dst


def layer_list(layers: range | None, num_layers: int) -> range:
    if layers is None:
        return range(num_layers)
    if not isinstance(layers, range):
        raise TypeError(f"layers must be a range or None, got {type(layers).__name__}")
    return layers
