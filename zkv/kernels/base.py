"""The one interface every block copy backend implements, plus the checks they share.

Memory layout (see :class:`zkv.config.CacheLayout`)::

    device, per layer l:  K_l, V_l  [num_device_blocks, kv_heads, block_size, head_dim]
                          └ block d ┘ = one contiguous chunk of ``chunk_bytes``
    host pool (page-first, contiguous):
        host_pool[num_host_blocks, num_layers, 2, kv_heads, block_size, head_dim]
        host block h = | L0 K | L0 V | L1 K | L1 V | ... |   (``block_bytes``, one L3 value)

    copy_d2h:  K_l[src[j]] -> host_pool[dst[j], l, 0]    V_l[src[j]] -> host_pool[dst[j], l, 1]
    copy_h2d:  host_pool[src[j], l, 0] -> K_l[dst[j]]    host_pool[src[j], l, 1] -> V_l[dst[j]]

Every copy moves whole chunks, so a backend may view the bytes as any dtype it likes.

Ordering contract (what the worker relies on):

- ``begin_batch()`` once per batch, before its copies: on GPU the transfer stream waits
  for everything already enqueued on the compute stream, so a d2h never reads a block
  that the previous step's forward is still writing.
- copies are enqueued on the backend's transfer stream in call order (CPU: they have
  finished when the call returns).
- ``record_event()`` after a layer's copies; the model calls ``wait_event_on_compute``
  before that layer (GPU: a stream wait, the host never blocks).

Device blocks may be strided (e.g. vLLM's CPU attention cache: one tensor per layer
``[num_blocks, heads, 2 * block_size, head_dim]`` whose K and V views interleave by head):
a block's K (or V) is copied in the logical order of its ``[heads, block, dim]`` shape,
so the host chunk is the same bytes whatever the device strides.

Ids are validated (1-D, same length, inside the pool) before any byte moves; a bad
call raises ``ValueError`` and leaves both caches untouched. Destination ids must be
distinct within one call (the protocol refuses duplicates); with duplicates the
winning source is unspecified.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zkv.config import CacheLayout

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
Ids = np.ndarray | Sequence[int]

_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


def torch_dtype(layout: CacheLayout) -> torch.dtype:
    return _TORCH_DTYPES[layout.dtype]


def device_block_shape(layout: CacheLayout) -> tuple[int, int, int, int]:
    return (layout.num_device_blocks, layout.kv_heads, layout.block_size, layout.head_dim)


def host_pool_shape(layout: CacheLayout) -> tuple[int, ...]:
    return (
        layout.num_host_blocks,
        layout.num_layers,
        2,
        layout.kv_heads,
        layout.block_size,
        layout.head_dim,
    )


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


@dataclass(frozen=True, slots=True)
class Geometry:
    """What a copy call needs to know about the caches, checked once per call."""

    num_layers: int
    num_device_blocks: int
    num_host_blocks: int
    chunk_bytes: int


class CopyBackend(abc.ABC):
    """Moves whole blocks between a device KV cache and a page-first host pool.

    Implementations: :class:`~zkv.kernels.cpu.TorchCpuBackend` (synchronous, CI) and
    :class:`~zkv.kernels.cupy_backend.CupyBackend` (one transfer stream, RawKernel).
    No method loops in Python over blocks; all ids of a call move in a few batched ops.
    """

    name: str
    device: torch.device

    # ---------------------------------------------------------------- allocation

    @abc.abstractmethod
    def allocate_host_pool(self, layout: CacheLayout) -> torch.Tensor:
        """Zeroed page-first host pool on CPU (pinned iff the backend is CUDA)."""

    def allocate_device_cache(self, layout: CacheLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed per-layer (K, V) on the backend's device (standalone workers, tests, bench)."""
        shape = device_block_shape(layout)
        dt = torch_dtype(layout)
        return [
            (
                torch.zeros(shape, dtype=dt, device=self.device),
                torch.zeros(shape, dtype=dt, device=self.device),
            )
            for _ in range(layout.num_layers)
        ]

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
        return memoryview(arr)

    # ---------------------------------------------------------------- ordering

    @abc.abstractmethod
    def begin_batch(self, compute_stream: int | None = None) -> None:
        """Make the transfer stream wait for work already enqueued on the compute stream.

        ``compute_stream`` is a raw ``cudaStream_t``; ``None`` means the calling thread's
        ``torch.cuda.current_stream()``. CPU: no-op.
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
    ) -> tuple[Geometry, np.ndarray, np.ndarray]:
        """Every check a copy makes before touching a byte: shapes and dtypes, ids in range
        for the direction (``to_host``: device -> host), then where the caches live."""
        geo = self.check_caches(kv_caches, host_pool, layers)
        if to_host:
            bounds = (geo.num_device_blocks, geo.num_host_blocks, "device", "host")
        else:
            bounds = (geo.num_host_blocks, geo.num_device_blocks, "host", "device")
        src, dst = check_ids(src_ids, dst_ids, *bounds)
        self.check_devices(kv_caches, layers)
        return geo, src, dst

    def check_devices(self, kv_caches: KVCaches, layers: Sequence[int]) -> None:
        """The backend's own check of where ``layers`` of the cache live (default: none)."""
        return None

    @staticmethod
    def check_caches(
        kv_caches: KVCaches, host_pool: torch.Tensor, layers: Sequence[int]
    ) -> Geometry:
        """Shapes, dtypes and devices agree for ``layers``; O(len(layers)), no data touched."""
        num_layers = len(kv_caches)
        if num_layers == 0:
            raise ValueError("kv_caches is empty")
        if host_pool.dim() != 6 or host_pool.shape[1] != num_layers or host_pool.shape[2] != 2:
            raise ValueError(
                f"host pool must be [num_host_blocks, {num_layers}, 2, heads, block, dim], "
                f"got {tuple(host_pool.shape)}"
            )
        if not host_pool.is_contiguous():
            raise ValueError("host pool must be contiguous (page-first)")
        if host_pool.device.type != "cpu":
            raise ValueError(f"host pool must live on the CPU, got {host_pool.device}")
        block_shape = tuple(host_pool.shape[3:])
        num_device_blocks = kv_caches[0][0].shape[0]
        for layer in layers:
            if not 0 <= layer < num_layers:
                raise ValueError(f"layer {layer} out of range [0, {num_layers})")
            for t in kv_caches[layer]:
                if t.dim() != 4 or tuple(t.shape[1:]) != block_shape:
                    raise ValueError(
                        f"layer {layer}: device cache shape {tuple(t.shape)} does not match "
                        f"host block shape {block_shape}"
                    )
                if t.dtype != host_pool.dtype:
                    raise ValueError(
                        f"layer {layer}: dtype {t.dtype} != host pool {host_pool.dtype}"
                    )
                if t.shape[0] != num_device_blocks:
                    raise ValueError("all layers must have the same number of device blocks")
        chunk_bytes = math.prod(block_shape) * host_pool.element_size()
        return Geometry(num_layers, num_device_blocks, host_pool.shape[0], chunk_bytes)


def as_index(ids: Ids, name: str) -> np.ndarray:
    """Ids as a fresh writable int64 array (torch refuses read-only numpy views)."""
    arr = np.array(ids, dtype=np.int64, copy=True)
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
