"""torch-CPU copy backend: the synchronous twin of the CuPy backend, used by CI.

Every (block, layer, part) is ``chunk_bytes`` on the host and a few equal dense runs on
the device (:func:`zkv.kernels.layout.block_runs`), so a copy is a list of equal-sized
``memcpy``\\ s. For each (layer, part, run r) of a call::

    src rows                          dst rows
    (P_l,p run r, or host[:, l, p])   (host[:, l, p], or P_l,p run r)
    ┌────┐  memcpy(run_bytes)         ┌────┐
    │ s0 │ ─────────────────────────► │ d0 │   address = base + run offset + id * block stride
    │ s1 │ ─────────────────────────► │ d1 │   (bytes; any stride, e.g. interleaved K/V)
    └────┘                            └────┘

Two implementations of that loop (``TorchCpuBackend(impl=...)``, default the first
available):

- ``"ext"``: the C extension ``zkv.kernels._blockcopy`` (built by ``pip install -e .``
  where a C compiler exists); one call per (layer, K|V) with all the ids, the whole
  loop with the GIL released.
- ``"memmove"``: a Python loop of ``ctypes.memmove`` over addresses computed with numpy;
  each call releases the GIL. Always available; ~0.7 us of interpreter time per chunk.

Why not torch ops: ``index_select`` memcpys rows, but ``index_copy_`` / ``index_put_``
scatter one *element* at a time, which reached only 0.4-0.75x of one contiguous
``copy_`` of the same bytes (bench/transfer.py); torch has no row-wise scatter. A block
of more than ``_MAX_RUNS`` runs (NHD with many heads: one run per (token, head)) takes
a strided torch path, correct but slow. Bytes move verbatim: NaN payloads, -0.0 and every other
bit pattern survive (the tests compare bytes).

Threads: both implementations run in the calling thread (one core, no OpenMP region,
``torch.set_num_threads`` stays the process's choice) and release the GIL while bytes
move, so a worker thread copies while the model thread runs. The backend keeps no
mutable state: calls from different threads are safe; concurrent calls that write the
same blocks are the caller's bug, as on GPU.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from zkv.config import CacheLayout
from zkv.kernels.base import (
    DONE,
    CopyBackend,
    EventHandle,
    Ids,
    KVCaches,
    host_pool_shape,
    layer_list,
    torch_dtype,
)
from zkv.kernels.layout import KVSpec, block_runs, host_chunk_offset

try:
    from zkv.kernels import _blockcopy
except ImportError:  # not built (no compiler at install time): the memmove loop
    _blockcopy = None  # type: ignore[assignment]

IMPLS = ("ext", "memmove")

# copy(src_base, src_stride, dst_base, dst_stride, chunk_bytes, src_ids, dst_ids):
# memcpy chunk j from src_base + src_ids[j]*src_stride to dst_base + dst_ids[j]*dst_stride.
# Ids: contiguous int64 arrays, already checked against their bounds.
ChunkCopy = Callable[[int, int, int, int, int, np.ndarray, np.ndarray], None]


def available_impls() -> tuple[str, ...]:
    """The chunk-copy implementations usable in this process, fastest first."""
    return IMPLS if _blockcopy is not None else ("memmove",)


def _copy_ext(
    src_base: int,
    src_stride: int,
    dst_base: int,
    dst_stride: int,
    chunk: int,
    src: np.ndarray,
    dst: np.ndarray,
) -> None:
    assert _blockcopy is not None
    n, src_at, dst_at = len(src), src.ctypes.data, dst.ctypes.data
    _blockcopy.copy_chunks(src_base, src_stride, dst_base, dst_stride, chunk, src_at, dst_at, n)


_memmove = ctypes.memmove  # a CFUNCTYPE: releases the GIL per call


def _copy_memmove(
    src_base: int,
    src_stride: int,
    dst_base: int,
    dst_stride: int,
    chunk: int,
    src: np.ndarray,
    dst: np.ndarray,
) -> None:
    src_addrs = (src * src_stride + src_base).tolist()
    dst_addrs = (dst * dst_stride + dst_base).tolist()
    # map() + a zero-length deque: the loop runs in C, ~10% less interpreter time.
    collections.deque(map(_memmove, dst_addrs, src_addrs, itertools.repeat(chunk)), maxlen=0)


_IMPL_FUNCS: dict[str, ChunkCopy] = {"ext": _copy_ext, "memmove": _copy_memmove}


class TorchCpuBackend(CopyBackend):
    """Synchronous block copies on CPU memory; events are always complete.

    ``impl``: ``"ext"`` (C extension), ``"memmove"`` (ctypes loop) or ``None`` for the
    first of :func:`available_impls`. Asking for ``"ext"`` where it is not built raises
    ``ValueError``.

    Complexity per call: O(len(layers) * n) memcpys of ``chunk_bytes``, O(len(layers))
    Python-level calls with ``"ext"``, O(len(layers) * n) with ``"memmove"``.
    """

    name = "cpu"

    def __init__(self, impl: str | None = None) -> None:
        if impl is None:
            impl = available_impls()[0]
        if impl not in IMPLS:
            raise ValueError(f"unknown CPU copy impl {impl!r}; one of {IMPLS}")
        if impl not in available_impls():
            raise ValueError(
                "CPU copy impl 'ext' needs the C extension zkv.kernels._blockcopy, which is "
                "not built; reinstall with a C compiler (pip install -e .) or use 'memmove'"
            )
        self.device = torch.device("cpu")
        self.impl = impl
        self._copy = _IMPL_FUNCS[impl]

    def __repr__(self) -> str:
        return f"TorchCpuBackend(impl={self.impl!r})"

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
        spec, src, dst = self.checked(kv_caches, host_pool, src_ids, dst_ids, layers, True)
        if not len(src) or not len(layers) or not spec.chunk_bytes:
            return
        src, dst = _native_ids(src), _native_ids(dst)
        for layer in layers:
            self._copy_layer(spec, host_pool, layer, src, dst, to_host=True)

    def copy_h2d(
        self,
        host_pool: torch.Tensor,
        kv_caches: KVCaches,
        src_ids: Ids,
        dst_ids: Ids,
        layer: int,
    ) -> None:
        spec, src, dst = self.checked(kv_caches, host_pool, src_ids, dst_ids, (layer,), False)
        if not len(src) or not spec.chunk_bytes:
            return
        src, dst = _native_ids(src), _native_ids(dst)
        self._copy_layer(spec, host_pool, layer, src, dst, to_host=False)

    def check_devices(self, spec: KVSpec, layers: Sequence[int]) -> None:
        _check_on_cpu(spec, layers)

    def _copy_layer(self, spec: KVSpec, host_pool: torch.Tensor, layer: int,
                    src: np.ndarray, dst: np.ndarray, *, to_host: bool) -> None:
        """Every part of one layer: one chunk copy call per dense run (``src``/``dst``
        index the source and destination pools of the direction)."""
        chunk, parts = spec.chunk_bytes, spec.num_kv_parts
        block_bytes = parts * spec.num_layers * chunk
        for kv in range(parts):
            dev = spec[layer][kv]
            runs = _block_runs(dev)
            if runs is None:  # too many dense runs: exact but slow
                host_view = host_pool[:, layer, kv]
                if to_host:
                    _copy_strided(dev, src, host_view, dst)
                else:
                    _copy_strided(host_view, src, dev, dst)
                continue
            run_bytes, offsets = runs
            stride = _block_stride(dev)
            host_at = host_pool.data_ptr() + host_chunk_offset(layer, kv, parts, chunk)
            for r, off in enumerate(offsets):  # one call per dense run of every block
                host = (host_at + r * run_bytes, block_bytes)
                device = (dev.data_ptr() + off, stride)
                (s_at, s_stride), (d_at, d_stride) = (device, host) if to_host else (host, device)
                self._copy(s_at, s_stride, d_at, d_stride, run_bytes, src, dst)

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


# -------------------------------------------------------------------- helpers


def _native_ids(ids: np.ndarray) -> np.ndarray:
    """Contiguous native int64, what the chunk copies index with (``check_ids`` gives that)."""
    return np.ascontiguousarray(ids, dtype=np.int64)


def _check_on_cpu(spec: KVSpec, layers: Sequence[int]) -> None:
    """Raw addresses are only meaningful for CPU memory (checked before any byte moves;
    every part of a spec lives on one device)."""
    if spec.device.type != "cpu":
        raise ValueError(
            f"{spec.parts[0][0].name}: device cache on {spec.device}; the cpu backend copies "
            "CPU tensors only (use the cupy backend for CUDA)"
        )


#: Above this many dense runs per block, the per-run calls cost more than the strided path.
_MAX_RUNS = 64


def _block_runs(t: torch.Tensor) -> tuple[int, list[int]] | None:
    """A block ``t[i]`` as equal dense runs: ``(run_bytes, byte offsets in logical order)``,
    or ``None`` past ``_MAX_RUNS`` runs (e.g. NHD: one run per token and head)."""
    if t.shape[0] == 0:
        return 0, [0]  # no block can be named
    runs = block_runs(t)
    if runs.num_runs > _MAX_RUNS:
        return None
    return runs.run_bytes, runs.offsets().tolist()


def _block_stride(t: torch.Tensor) -> int:
    """Bytes from block ``i`` to block ``i + 1`` (any value for a 1-block tensor: only id 0)."""
    return t.stride(0) * t.element_size()


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_strided(
    src: torch.Tensor, src_ids: np.ndarray, dst: torch.Tensor, dst_ids: np.ndarray
) -> None:
    """``dst[dst_ids[j]] = src[src_ids[j]]`` for blocks of any strides (slow, exact).

    Elements move as same-sized integers, so float bit patterns survive verbatim.
    """
    as_int = _INT_OF_SIZE.get(src.element_size(), src.dtype)
    s = torch.from_numpy(_native_ids(src_ids))
    d = torch.from_numpy(_native_ids(dst_ids))
    dst.view(as_int).index_copy_(0, d, src.view(as_int).index_select(0, s))
