"""vLLM's KV tensors as zkv sees them: per layer (K, V) views and one CacheLayout.

vLLM hands ``register_kv_caches`` one tensor per attention layer (in model order). zkv
copies per layer a K and a V view whose first dimension is the block id and whose block
slice has ``kv_heads * block_size * head_dim`` elements, in the byte order the
:class:`~zkv.config.CacheLayout` names (``kv_layout``). Accepted tensors::

    CPU attention   [blocks, heads, block, 2*dim]   viewed [blocks, heads, 2*block, dim]:
                    K = [:, :, :block], V = [:, :, block:]  -> HND, one dense run per head
    flash-attn      [2, blocks, block, heads, dim]   K = t[0], V = t[1]        -> NHD
    HND split       [2, blocks, heads, block, dim]   K = t[0], V = t[1]        -> HND
    flashinfer      [blocks, 2, block, heads, dim]   K = t[:, 0], V = t[:, 1]  -> NHD

An NHD block is contiguous, so its K view is *reinterpreted* as ``[blocks, heads, block,
dim]`` (same bytes, no transpose): host and L3 hold NHD bytes and the namespace says so.
Anything else is refused at registration with the layer name, shape and strides.
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


def split_kv(name: str, t: torch.Tensor, geo: Geometry) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(K, V, kv_layout) of one layer's tensor; ConfigError naming it when not understood."""
    nb, h, bs, d = geo.num_blocks, geo.kv_heads, geo.block_size, geo.head_dim
    shape = tuple(t.shape)
    if shape == (nb, h, bs, 2 * d) and t.is_contiguous():
        v = t.view(nb, h, 2 * bs, d)
        return v[:, :, :bs], v[:, :, bs:], "HND"
    if shape == (2, nb, h, bs, d):
        return t[0], t[1], "HND"
    if shape in ((2, nb, bs, h, d), (nb, 2, bs, h, d)):
        k, v = (t[0], t[1]) if shape[0] == 2 and shape[1] == nb else (t[:, 0], t[:, 1])
        if not (k[0].is_contiguous() and v[0].is_contiguous()):
            raise ConfigError(f"zkv: layer {name}: blocks of shape {shape} with strides "
                              f"{tuple(t.stride())} are not contiguous")
        return _as_hnd(k, geo), _as_hnd(v, geo), "NHD"
    raise ConfigError(
        f"zkv: layer {name}: KV tensor of shape {shape}, strides {tuple(t.stride())}, "
        f"dtype {t.dtype} matches no known layout for {nb} blocks x {h} heads x {bs} "
        f"tokens x {d} dims")


def _as_hnd(t: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """A [blocks, block, heads, dim] view with contiguous blocks, reinterpreted (no copy)."""
    return torch.as_strided(t, (geo.num_blocks, geo.kv_heads, geo.block_size, geo.head_dim),
                            (t.stride(0), geo.block_size * geo.head_dim, geo.head_dim, 1))


def kv_views(kv_caches: Mapping[str, torch.Tensor], geo: Geometry
             ) -> tuple[list[str], list[tuple[torch.Tensor, torch.Tensor]], str]:
    """Layer names in model order, their (K, V) views and the one kv_layout they share."""
    if len(kv_caches) != geo.num_layers:
        raise ConfigError(f"zkv: vLLM registered {len(kv_caches)} KV layers, its KV cache "
                          f"spec has {geo.num_layers}")
    names, views, layouts = [], [], set()
    for name, t in kv_caches.items():
        if dtype_name(t.dtype) != geo.dtype:
            raise ConfigError(f"zkv: layer {name}: dtype {t.dtype}, spec says {geo.dtype}")
        k, v, kind = split_kv(name, t, geo)
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
