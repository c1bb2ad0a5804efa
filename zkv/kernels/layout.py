"""How a rank's KV cache lies in memory: the device tensors described, the host format defined.

Host format, page-first (this module is its one definition; L3 values are these bytes)::

    host_pool[num_host_blocks, num_layers, num_kv_parts, kv_heads, block_size, head_dim]
    host block h:  | L0 K | L0 V | L1 K | L1 V | ... |      num_kv_parts = 2
                   | L0 latent | L1 latent | ... |          num_kv_parts = 1 (MLA)
    chunk (l, p):  kv_heads * block_size * head_dim elements at byte offset
                   (l * num_kv_parts + p) * chunk_bytes of its host block, each element's
                   bytes as the device holds them (little-endian on CUDA and x86), in the
                   order CacheLayout.kv_layout names (the host order):
                     HND  [heads][block][dim]   an NHD engine's blocks are transposed
                     NHD  [block][heads][dim]   an NHD engine's blocks are kept as they are

A host block is one contiguous buffer (zero-copy L3 put/get). Its bytes depend on the
device layout only through ``kv_layout``, which the L3 namespace (the layout fingerprint)
carries, so blocks of different byte orders never mix.

Device layouts accepted by :func:`describe_kv_caches`, per layer::

    (K, V) pair      each [num_blocks, heads, block, dim]   HND: zkv's own, vLLM CPU (strided views)
                     each [num_blocks, block, heads, dim]   NHD: vLLM flash-attn K / V views
    fused tensor     [2, num_blocks, block, heads, dim]     flash-attn (K/V axis first)
                     [num_blocks, 2, block, heads, dim]     FlashInfer NHD
                     [num_blocks, 2, heads, block, dim]     FlashInfer HND
    latent (MLA)     [num_blocks, block, dim]               one part per layer, heads = 1

Each part becomes a *logical view* ``[num_blocks, heads, block, dim]`` of the same memory
(permuted, selected, unsqueezed or reinterpreted, never copied) whose element order is the
host order; copies move a block's elements in the view's order, honouring every stride:

    host order   device part             view
    HND          HND [n, heads, block, dim]   as given
    HND          NHD [n, block, heads, dim]   permuted (a transpose on every copy)
    NHD          NHD [n, block, heads, dim]   reinterpreted as [n, heads, block, dim]:
                                              same bytes (its blocks must be dense)
    NHD          [n, heads, block, dim]       as given: taken to be in host order
                                              already (a view the caller reinterpreted)

A block of a view is a few equal dense *runs*::

    logical block [heads, block, dim], element strides (sh, sb, sd)
    trailing dims laid out densely ─► one run of run_bytes; the dims outside it enumerate
    the runs, run (i0, i1, ..) at byte offset sum(i_k * stride_k)
        HND contiguous: 1 run of heads*block*dim     vLLM CPU: heads runs of block*dim
        NHD:            heads*block runs of dim

A part's shape is read as HND when it fits; NHD is inferred only when it cannot be HND
(pass ``kv_order="NHD"`` when heads == block_size). Validation runs once, at
registration, and names the tensor and the check that failed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zkv.config import CacheLayout
from zkv.errors import ConfigError

KV_ORDERS = ("HND", "NHD")
_PART_NAMES = {2: ("K", "V"), 1: ("latent",)}

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


# -------------------------------------------------------------------- host format


def host_pool_shape(layout: CacheLayout) -> tuple[int, ...]:
    """Shape of the page-first host pool of ``layout``."""
    return (
        layout.num_host_blocks,
        layout.num_layers,
        layout.num_kv_parts,
        layout.kv_heads,
        layout.block_size,
        layout.head_dim,
    )


def host_chunk_offset(layer: int, part: int, num_kv_parts: int, chunk_bytes: int) -> int:
    """Byte offset of chunk ``(layer, part)`` inside its host block."""
    return (layer * num_kv_parts + part) * chunk_bytes


def check_host_pool(host_pool: torch.Tensor, spec: KVSpec) -> None:
    """``host_pool`` is a page-first pool for the caches ``spec`` describes (O(1))."""
    want = (spec.num_layers, spec.num_kv_parts, *spec.block_shape)
    if host_pool.dim() != 6 or tuple(host_pool.shape[1:]) != want:
        raise ValueError(
            f"host pool must be [num_host_blocks, {', '.join(map(str, want))}] "
            f"(page-first), got {tuple(host_pool.shape)}"
        )
    if not host_pool.is_contiguous():
        raise ValueError("host pool must be contiguous (page-first)")
    if host_pool.device.type != "cpu":
        raise ValueError(f"host pool must live on the CPU, got {host_pool.device}")
    if host_pool.dtype != spec.dtype:
        raise ValueError(f"host pool dtype {host_pool.dtype} != kv cache dtype {spec.dtype}")


# -------------------------------------------------------------------- runs


@dataclass(frozen=True, slots=True)
class Runs:
    """A logical block as equal dense runs: ``run_bytes`` each, enumerated by ``outer``
    (``(count, byte stride)`` per dim, outermost first; empty: the block is one run)."""

    run_bytes: int
    outer: tuple[tuple[int, int], ...]

    @property
    def num_runs(self) -> int:
        return math.prod(n for n, _ in self.outer)

    def offsets(self) -> np.ndarray:
        """Byte offset of every run from the block start, in logical order (int64)."""
        offs = np.zeros(1, dtype=np.int64)
        for count, stride in self.outer:
            step = np.arange(count, dtype=np.int64) * stride
            offs = (offs[:, None] + step[None, :]).reshape(-1)
        return offs


def block_runs(view: torch.Tensor) -> Runs:
    """The dense runs of one block ``view[i]`` (any strides; O(dims))."""
    shape, strides = list(view.shape[1:]), list(view.stride()[1:])
    run, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    size = view.element_size()
    outer = tuple((shape[i], strides[i] * size) for i in range(k) if shape[i] > 1)
    return Runs(run * size, outer)


# -------------------------------------------------------------------- the description


@dataclass(frozen=True, slots=True)
class PartSpec:
    """One device tensor of one layer (K, V or the latent), as its logical view."""

    layer: int
    part: int
    name: str
    view: torch.Tensor
    runs: Runs

    @property
    def block_stride(self) -> int:
        """Bytes from block ``i`` to block ``i + 1``."""
        return self.view.stride(0) * self.view.element_size()


class KVSpec(Sequence[tuple[torch.Tensor, ...]]):
    """A validated description of a rank's device KV cache.

    Invariants: every part has the same number of blocks, block shape
    ``(heads, block, dim)``, dtype and device; no stride is negative or broadcast; a
    block's elements never overlap each other or the next block. Indexing gives a
    layer's tuple of logical views (``spec[l][p]`` is ``[num_blocks, heads, block, dim]``),
    so a spec stands in for the ``kv_caches`` it describes. Built in O(layers) once;
    ``memo`` holds what a backend derives from it once (e.g. its device param table).
    """

    __slots__ = ("parts", "num_blocks", "block_shape", "dtype", "device", "kind", "host_order",
                 "memo", "_views")

    def __init__(self, parts: Sequence[Sequence[PartSpec]], kind: str,
                 host_order: str = "HND") -> None:
        first = parts[0][0].view
        self.parts = tuple(tuple(p) for p in parts)
        #: the chunk order its views give the host blocks (``CacheLayout.host_order``)
        self.host_order = host_order
        self.num_blocks = int(first.shape[0])
        self.block_shape: tuple[int, int, int] = tuple(first.shape[1:])  # type: ignore[assignment]
        self.dtype = first.dtype
        self.device = first.device
        self.kind = kind
        self.memo: dict[Any, Any] = {}
        self._views = tuple(tuple(p.view for p in layer) for layer in self.parts)

    @property
    def num_layers(self) -> int:
        return len(self.parts)

    @property
    def num_kv_parts(self) -> int:
        return len(self.parts[0])

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.block_shape) * self.parts[0][0].view.element_size()

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, layer: Any) -> Any:
        return self._views[layer]

    def __repr__(self) -> str:
        return (f"KVSpec({self.kind}, host {self.host_order}, layers={self.num_layers}, "
                f"parts={self.num_kv_parts}, blocks={self.num_blocks}, block={self.block_shape}, "
                f"{self.dtype}, {self.device})")


def describe_kv_caches(
    kv_caches: Any,
    *,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    num_kv_parts: int | None = None,
    dtype: torch.dtype | None = None,
    kv_order: str | None = None,
    names: Sequence[str] | None = None,
    host_order: str | None = None,
) -> KVSpec:
    """Validate ``kv_caches`` (one entry per layer, see the module docstring) and describe
    it for a host pool whose chunks are in ``host_order`` (``CacheLayout.host_order``;
    None: HND). ``kv_order`` says how the engine's 4-D parts are laid out when their shape
    does not. Raises :class:`~zkv.errors.ConfigError` naming the layer, the tensor and the
    check. A :class:`KVSpec` is re-checked against the geometry (and ``host_order`` when
    given: its views fix the byte order of the host blocks) and returned as is."""
    if kv_order is not None and kv_order not in KV_ORDERS:
        raise ConfigError(f"kv_order must be one of {KV_ORDERS} or None, got {kv_order!r}")
    if host_order is not None and host_order not in KV_ORDERS:
        raise ConfigError(f"host order must be one of {KV_ORDERS}, got {host_order!r}")
    if isinstance(kv_caches, KVSpec):
        return _recheck(kv_caches, (kv_heads, block_size, head_dim), num_kv_parts, dtype,
                        host_order)
    host_order = host_order or "HND"
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
        raise ConfigError("kv_caches must be a sequence with one entry per layer, got "
                          f"{type(kv_caches).__name__}")
    if len(kv_caches) == 0:
        raise ConfigError("kv_caches is empty")
    if names is not None and len(names) != len(kv_caches):
        raise ConfigError(f"{len(names)} layer names for {len(kv_caches)} layers")
    d = _Describer((kv_heads, block_size, head_dim), dtype, kv_order, host_order)
    layers = [d.layer(i, entry, names[i] if names else None) for i, entry in enumerate(kv_caches)]
    parts = {len(layer) for layer in layers}
    want = num_kv_parts if num_kv_parts is not None else len(layers[0])
    if parts != {want}:
        raise ConfigError(f"every layer must have {want} part(s) "
                          f"({' and '.join(_PART_NAMES[want])}), got {sorted(parts)}")
    return KVSpec(layers, "+".join(sorted(d.kinds)), host_order)


def describe_for_layout(kv_caches: Any, layout: CacheLayout, **kw: Any) -> KVSpec:
    """:func:`describe_kv_caches` against ``layout`` (layers, heads, block, dim, dtype, parts)."""
    spec = describe_kv_caches(kv_caches, kv_heads=layout.kv_heads, block_size=layout.block_size,
                              head_dim=layout.head_dim, num_kv_parts=layout.num_kv_parts,
                              dtype=torch_dtype(layout), host_order=layout.host_order, **kw)
    if spec.num_layers != layout.num_layers:
        raise ConfigError(f"kv_caches has {spec.num_layers} layers, layout has "
                          f"{layout.num_layers}")
    return spec


def describe_for_host_pool(kv_caches: Any, host_pool: torch.Tensor, **kw: Any) -> KVSpec:
    """:func:`describe_kv_caches` with the geometry read from a page-first host pool."""
    if host_pool.dim() != 6:
        raise ValueError("host pool must be [num_host_blocks, num_layers, num_kv_parts, heads, "
                         f"block, dim] (page-first), got {tuple(host_pool.shape)}")
    _, _, parts, heads, block, dim = host_pool.shape
    spec = describe_kv_caches(kv_caches, kv_heads=heads, block_size=block, head_dim=dim,
                              num_kv_parts=parts, dtype=host_pool.dtype, **kw)
    check_host_pool(host_pool, spec)
    return spec


def _recheck(spec: KVSpec, block_shape: tuple[int, int, int], num_kv_parts: int | None,
             dtype: torch.dtype | None, host_order: str | None) -> KVSpec:
    if spec.block_shape != block_shape:
        raise ConfigError(f"kv cache blocks are {spec.block_shape} [heads, block, dim], "
                          f"expected {block_shape}")
    if num_kv_parts is not None and spec.num_kv_parts != num_kv_parts:
        raise ConfigError(f"kv cache has {spec.num_kv_parts} part(s) per layer, expected "
                          f"{num_kv_parts}")
    if dtype is not None and spec.dtype != dtype:
        raise ConfigError(f"kv cache dtype {spec.dtype} != {dtype}")
    if host_order is not None and spec.host_order != host_order:
        # Its views would write host blocks in the other order under this layout's
        # fingerprint: another instance would read them back transposed.
        raise ConfigError(f"kv cache spec was described for {spec.host_order} host blocks, "
                          f"the layout's kv_layout wants {host_order}; describe the caches "
                          "again for this layout (describe_for_layout)")
    return spec


class _Describer:
    """The checks of :func:`describe_kv_caches`; remembers the first part's facts."""

    def __init__(self, block_shape: tuple[int, int, int], dtype: torch.dtype | None,
                 kv_order: str | None, host_order: str) -> None:
        self.block_shape = block_shape
        self.dtype = dtype
        self.kv_order = kv_order
        self.host_order = host_order
        self.num_blocks: int | None = None
        self.device: torch.device | None = None
        self.kinds: set[str] = set()

    def layer(self, i: int, entry: Any, name: str | None) -> list[PartSpec]:
        label = f"layer {i}" + (f" ({name})" if name else "")
        if isinstance(entry, torch.Tensor):
            if entry.dim() == 5:
                return self._fused(i, label, entry)
            return [self._part(i, 0, f"{label} latent", entry, one=True)]
        if not isinstance(entry, (tuple, list)) or not 1 <= len(entry) <= 2:
            raise ConfigError(f"kv cache {label}: expected a (K, V) pair, a fused 5-D tensor or "
                              f"an MLA latent tensor, got {_what(entry)}")
        one = len(entry) == 1
        parts = [
            self._part(i, p, f"{label} {_PART_NAMES[len(entry)][p]}", t, one=one)
            for p, t in enumerate(entry)
        ]
        if len(parts) == 2 and _same_memory(parts[0].view, parts[1].view):
            raise ConfigError(f"kv cache {label}: K and V are the same memory")
        return parts

    def _fused(self, i: int, label: str, t: torch.Tensor) -> list[PartSpec]:
        found: list[list[PartSpec]] = []
        errors = []
        for axis in (0, 1):
            if t.shape[axis] != 2:
                continue
            try:
                found.append([self._part(i, p, f"{label} {'KV'[p]} (fused, K/V axis {axis})",
                                         t.select(axis, p), one=False) for p in (0, 1)])
            except ConfigError as e:
                errors.append(str(e))
        if len(found) == 1:
            self.kinds.add("fused")
            return found[0]
        if found:
            raise ConfigError(f"kv cache {label}: fused tensor {tuple(t.shape)} is ambiguous "
                              "(axis 0 and 1 both fit as the K/V axis); pass (K, V) views")
        detail = "; ".join(errors) or "no axis 0 or 1 of size 2"
        raise ConfigError(f"kv cache {label}: fused tensor {tuple(t.shape)} has no K/V axis: "
                          f"{detail}")

    def _part(self, i: int, p: int, name: str, t: Any, *, one: bool) -> PartSpec:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"kv cache {name}: not a tensor ({_what(t)})")
        view, kind = self._logical(name, t, one)
        self._same(name, view)
        _check_strides(name, view)
        self.kinds.add(kind)
        return PartSpec(i, p, name, view, block_runs(view))

    def _logical(self, name: str, t: torch.Tensor, one: bool) -> tuple[torch.Tensor, str]:
        """``[num_blocks, heads, block, dim]`` view of ``t`` and the layout it had."""
        heads, block, dim = self.block_shape
        shape = tuple(t.shape[1:])
        if t.dim() == 3 and one:
            if heads != 1 or shape != (block, dim):
                raise ConfigError(f"kv cache {name}: latent shape {tuple(t.shape)} is not "
                                  f"[num_blocks, {block}, {dim}] with heads=1 (heads={heads})")
            return t.unsqueeze(1), "latent"
        if t.dim() != 4:
            raise ConfigError(f"kv cache {name}: {t.dim()}-D tensor {tuple(t.shape)}; expected "
                              f"4-D [num_blocks, {heads}, {block}, {dim}] (HND) or "
                              f"[num_blocks, {block}, {heads}, {dim}] (NHD)")
        if shape == (heads, block, dim) and self.kv_order != "NHD":
            return t, "HND"
        if shape == (block, heads, dim) and self.kv_order != "HND":
            if self.host_order == "HND":
                return t.permute(0, 2, 1, 3), "NHD"
            try:  # NHD host bytes: the same block bytes, regrouped as [heads, block, dim]
                return t.view(t.shape[0], heads, block, dim), "NHD"
            except RuntimeError:
                raise ConfigError(f"kv cache {name}: NHD blocks with strides "
                                  f"{tuple(t.stride())} are not dense, so their bytes cannot "
                                  "be kept as they are (kv_layout NHD); use kv_layout HND "
                                  "(transposed on copy)") from None
        order = f" as kv_order={self.kv_order}" if self.kv_order else ""
        raise ConfigError(f"kv cache {name}: shape {tuple(t.shape)} does not fit{order} "
                          f"HND [num_blocks, {heads}, {block}, {dim}] or NHD "
                          f"[num_blocks, {block}, {heads}, {dim}] (heads, block_size, head_dim)")

    def _same(self, name: str, view: torch.Tensor) -> None:
        if self.dtype is None:
            self.dtype = view.dtype
        if view.dtype != self.dtype:
            raise ConfigError(f"kv cache {name}: dtype {view.dtype}, expected {self.dtype}")
        if self.num_blocks is None:
            self.num_blocks, self.device = int(view.shape[0]), view.device
        if view.shape[0] != self.num_blocks:
            raise ConfigError(f"kv cache {name}: {view.shape[0]} blocks, layer 0 has "
                              f"{self.num_blocks} (every layer must have the same)")
        if view.device != self.device:
            raise ConfigError(f"kv cache {name}: on {view.device}, layer 0 on {self.device}")


def _check_strides(name: str, view: torch.Tensor) -> None:
    """No negative or broadcast stride; elements of a block, and blocks, never overlap."""
    dims = [(n, s) for n, s in zip(view.shape, view.stride()) if n > 1]
    for n, s in dims:
        if s <= 0:
            raise ConfigError(f"kv cache {name}: stride {s} on a dim of size {n} (a broadcast "
                              f"or reversed view cannot hold distinct blocks); strides "
                              f"{tuple(view.stride())}")
    extent = 1
    block_dims = [(n, s) for n, s in zip(view.shape[1:], view.stride()[1:]) if n > 1]
    for n, s in sorted(block_dims, key=lambda d: d[1]):
        if s < extent:
            raise ConfigError(f"kv cache {name}: elements of a block overlap (strides "
                              f"{tuple(view.stride())}, shape {tuple(view.shape)})")
        extent = s * (n - 1) + extent
    if view.shape[0] > 1 and view.stride(0) < extent:
        raise ConfigError(f"kv cache {name}: block stride {view.stride(0)} elements is shorter "
                          f"than a block ({extent} elements): blocks overlap")
    if view.data_ptr() % view.element_size():
        raise ConfigError(f"kv cache {name}: address {view.data_ptr():#x} is not aligned to "
                          f"its {view.element_size()}-byte elements")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    # meta tensors have no address (0): nothing to compare
    return a.data_ptr() == b.data_ptr() != 0 and a.stride() == b.stride() and a.numel() > 0


def _what(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of {len(x)}"
    return type(x).__name__
