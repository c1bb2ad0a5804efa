"""vLLM's KV tensors as zkv sees them: per layer (K, V) views and one CacheLayout.

vLLM hands ``register_kv_caches`` one tensor per attention layer (in model order). zkv
copies per layer a K and a V view whose first dimension is the block id and whose block
slice has ``kv_heads * block_size * head_dim`` elements, in the byte order the
:class:`~zkv.config.CacheLayout` names (``kv_layout``). Accepted tensors::

    vLLM 0.32, every backend: [blocks, heads, block, 2*dim] with the strides of the layout
    the engine resolved (``KVCacheConfig.kv_cache_layout``); C = the last dimension
      CPU attention   contiguous, viewed [blocks, heads, 2*block, dim]:
                      K = [:, :, :block], V = [:, :, block:]   -> HND, a dense run per head
      GPU backends    a layer's block dense as [heads][block][C] -> HNC (LBHNC, BLHNC)
                                        or as [block][heads][C] -> NHC (LBNHC, BLNHC):
                      K = the block's first half, V = its second -> one dense run each
    vLLM before 0.32 (5-D):
      flash-attn      [2, blocks, block, heads, dim]   K = t[0], V = t[1]        -> NHD
      HND split       [2, blocks, heads, block, dim]   K = t[0], V = t[1]        -> HND
      flashinfer      [blocks, 2, block, heads, dim]   K = t[:, 0], V = t[:, 1]  -> NHD

An NHD block is contiguous, so its K view is *reinterpreted* as ``[blocks, heads, block,
dim]`` (same bytes, no transpose): host and L3 hold NHD bytes and the namespace says so.
The GPU backends of vLLM 0.32 read K and V interleaved on C (``split(dim, -1)``), so a
block's halves are not its K and V; zkv moves bytes and never reads them, and the
namespace says ``HNC`` / ``NHC``, never ``HND``: a CPU engine's blocks (K then V per
head) and a GPU engine's never meet in a store. The scheduler half, which sees no tensor,
names the same from the resolved layout (:func:`expected_kv_layout`); a layout whose
blocks are not dense per layer (LHBNC, BHLNC) is refused at registration, naming
``VLLM_KV_CACHE_LAYOUT=LBNHC``. Tensors of one of these shapes but in vLLM's kernel
blocks, smaller than its KV cache manager's (an attention backend that takes no block
of ``--block-size`` tokens: vLLM splits each into kernel blocks), are refused naming the
kernel block size and the ``--block-size`` to run with. Anything else is refused with the
layer name, shape and strides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from zkv.config import CacheLayout
from zkv.errors import ConfigError

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float8_e4m3fn: "float8_e4m3fn", torch.uint8: "uint8", torch.int8: "int8"}


@dataclass(frozen=True, slots=True)
class Geometry:
    """What both halves know without tensors (from vLLM's KV cache spec)."""

    num_layers: int
    kv_heads: int       # per rank
    block_size: int
    head_dim: int
    dtype: str
    num_blocks: int     # vLLM's device blocks per rank


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ConfigError(f"zkv: KV cache dtype {dtype} is not supported "
                          f"(one of {sorted(_DTYPE_NAMES.values())})") from None


#: vLLM 0.32's layouts (``KVCacheConfig.kv_cache_layout``) whose per-layer blocks are dense,
#: by the order inside one: heads before tokens (HNC) or after (NHC).
_DENSE_BLOCKS = {"LBHNC": "HNC", "BLHNC": "HNC", "LBNHC": "NHC", "BLNHC": "NHC"}


def expected_kv_layout(cpu: bool, vllm_layout: str | None) -> str:
    """The ``kv_layout`` the worker half finds in vLLM's tensors, from what the scheduler
    half knows: the platform and the layout the engine resolved (None: a vLLM before 0.32,
    whose GPU backends gave 5-D NHD tensors)."""
    if cpu:
        return "HND"
    if vllm_layout is None:
        return "NHD"
    return _DENSE_BLOCKS.get(vllm_layout, vllm_layout)


def split_kv(name: str, t: torch.Tensor, geo: Geometry, *, cpu: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(K, V, kv_layout) of one layer's tensor; ConfigError naming it when not understood.
    ``cpu``: vLLM's CPU attention reads the tensors (else a GPU backend's)."""
    nb, h, bs, d = geo.num_blocks, geo.kv_heads, geo.block_size, geo.head_dim
    shape = tuple(t.shape)
    if shape == (nb, h, bs, 2 * d) and cpu and t.is_contiguous():
        v = t.view(nb, h, 2 * bs, d)
        return v[:, :, :bs], v[:, :, bs:], "HND"
    if shape == (nb, h, bs, 2 * d) and not cpu:
        return _block_halves(name, t, geo)
    if shape == (2, nb, h, bs, d):
        return t[0], t[1], "HND"
    if shape in ((2, nb, bs, h, d), (nb, 2, bs, h, d)):
        k, v = (t[0], t[1]) if shape[0] == 2 and shape[1] == nb else (t[:, 0], t[:, 1])
        if not (k[0].is_contiguous() and v[0].is_contiguous()):
            raise ConfigError(f"zkv: layer {name}: blocks of shape {shape} with strides "
                              f"{tuple(t.stride())} are not contiguous")
        return _as_hnd(k, geo), _as_hnd(v, geo), "NHD"
    kernel_bs = _kernel_block_size(shape, geo)
    if kernel_bs is not None:
        raise ConfigError(
            f"zkv: layer {name}: KV tensor of shape {shape} holds {nb * (bs // kernel_bs)} "
            f"blocks of {kernel_bs} tokens, not {nb} of {bs}: vLLM's attention kernel block "
            f"size ({kernel_bs}) differs from its KV cache manager's block_size ({bs}, the one "
            f"zkv was given), which zkv does not support; run vLLM with --block-size "
            f"{kernel_bs} (or an attention backend that takes {bs}-token blocks)")
    raise ConfigError(
        f"zkv: layer {name}: KV tensor of shape {shape}, strides {tuple(t.stride())}, "
        f"dtype {t.dtype} matches no known layout for {nb} blocks x {h} heads x {bs} "
        f"tokens x {d} dims")


def _block_halves(name: str, t: torch.Tensor, geo: Geometry
                  ) -> tuple[torch.Tensor, torch.Tensor, str]:
    """vLLM 0.32 on a GPU: each block of the layer one dense run, as [heads][block][C] or
    [block][heads][C]; K and V views of its two halves (see the module docstring)."""
    h, bs, d = geo.kv_heads, geo.block_size, geo.head_dim
    c = 2 * d
    _, s_head, s_tok, s_c = t.stride()
    if s_c == 1 and (s_head, s_tok) == (bs * c, c):
        order = "HNC"
    elif s_c == 1 and (s_head, s_tok) == (c, h * c):
        order = "NHC"
    else:
        raise ConfigError(
            f"zkv: layer {name}: KV tensor of shape {tuple(t.shape)}, strides "
            f"{tuple(t.stride())}: its blocks are not dense per layer; run vLLM with "
            "VLLM_KV_CACHE_LAYOUT=LBNHC")
    half = h * bs * d
    size, stride = (geo.num_blocks, h, bs, d), (t.stride(0), bs * d, d, 1)
    k = torch.as_strided(t, size, stride, t.storage_offset())
    v = torch.as_strided(t, size, stride, t.storage_offset() + half)
    return k, v, order


def _shapes(nb: int, h: int, bs: int, d: int) -> tuple[tuple[int, ...], ...]:
    """The tensor shapes :func:`split_kv` takes for ``nb`` blocks of ``bs`` tokens."""
    return (nb, h, bs, 2 * d), (2, nb, h, bs, d), (2, nb, bs, h, d), (nb, 2, bs, h, d)


def _kernel_block_size(shape: tuple[int, ...], geo: Geometry) -> int | None:
    """The tokens per block of a tensor that has one of :func:`split_kv`'s shapes, but with
    each ``geo.block_size``-token block split into ``r`` kernel blocks (``r * num_blocks``
    blocks of ``block_size / r`` tokens); None when it has not. vLLM hands connectors such
    tensors when its attention backend takes no block as large as the KV cache manager's
    (``prepare_kernel_block_sizes`` and ``compute_layer_kv_cache_shape_bytes`` in vLLM):
    zkv's block ids and hashes would name the manager's blocks, the tensor's rows kernel
    blocks."""
    nb, h, bs, d = geo.num_blocks, geo.kv_heads, geo.block_size, geo.head_dim
    for r in range(2, bs + 1):
        if bs % r == 0 and shape in _shapes(nb * r, h, bs // r, d):
            return bs // r
    return None


def _as_hnd(t: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """A [blocks, block, heads, dim] view with contiguous blocks, reinterpreted (no copy)."""
    return torch.as_strided(t, (geo.num_blocks, geo.kv_heads, geo.block_size, geo.head_dim),
                            (t.stride(0), geo.block_size * geo.head_dim, geo.head_dim, 1))


def kv_views(kv_caches: Mapping[str, torch.Tensor], geo: Geometry, *, cpu: bool = True
             ) -> tuple[list[str], list[tuple[torch.Tensor, torch.Tensor]], str]:
    """Layer names in model order, their (K, V) views and the one kv_layout they share
    (``cpu``: as :func:`split_kv`)."""
    if len(kv_caches) != geo.num_layers:
        raise ConfigError(f"zkv: vLLM registered {len(kv_caches)} KV layers, its KV cache "
                          f"spec has {geo.num_layers}")
    names, views, layouts = [], [], set()
    for name, t in kv_caches.items():
        if dtype_name(t.dtype) != geo.dtype:
            raise ConfigError(f"zkv: layer {name}: dtype {t.dtype}, spec says {geo.dtype}")
        k, v, kind = split_kv(name, t, geo, cpu=cpu)
        names.append(name)
        views.append((k, v))
        layouts.add(kind)
    if len(layouts) != 1:
        raise ConfigError(f"zkv: layers disagree on the KV layout: {sorted(layouts)}")
    return names, views, layouts.pop()


def cache_layout(geo: Geometry, *, kv_layout: str, num_host_blocks: int, world_size: int,
                 model: str) -> CacheLayout:
    return CacheLayout(geo.num_layers, geo.kv_heads, geo.block_size, geo.head_dim, geo.dtype,
                       geo.num_blocks, num_host_blocks, world_size=world_size, model=model,
                       kv_layout=kv_layout)
