"""KV caches shaped as real engines hand them, filled with random bytes (shared by the CPU,
fake-CuPy and GPU tests)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tests.kernels.helpers import as_bytes, clone, ids, layout, randomize, same_caches
from zkv.config import CacheLayout
from zkv.integrations.vllm.layout import Geometry, split_kv
from zkv.kernels.base import CopyBackend
from zkv.kernels.layout import KVSpec
from zkv.kernels.reference import ref_copy_d2h, ref_copy_h2d

NUM_BLOCKS, HEADS, BLOCK, DIM = 12, 2, 4, 8


def _t(shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float16)
    randomize(t, gen)
    return t.to(device)


def _hnd_pairs(gen: torch.Generator, device: str) -> tuple[list[Any], list[torch.Tensor]]:
    ts = [_t((NUM_BLOCKS, HEADS, BLOCK, DIM), gen, device) for _ in range(6)]
    return [(ts[2 * i], ts[2 * i + 1]) for i in range(3)], ts


def _nhd_pairs(gen: torch.Generator, device: str) -> tuple[list[Any], list[torch.Tensor]]:
    """vLLM flash-attn: per layer [2, num_blocks, block, heads, dim]; K and V views."""
    ts = [_t((2, NUM_BLOCKS, BLOCK, HEADS, DIM), gen, device) for _ in range(3)]
    return [(t[0], t[1]) for t in ts], ts


def _flash_attn_fused(gen: torch.Generator, device: str) -> tuple[list[Any], list[torch.Tensor]]:
    ts = [_t((2, NUM_BLOCKS, BLOCK, HEADS, DIM), gen, device) for _ in range(3)]
    return list(ts), ts


def _flashinfer_nhd(gen: torch.Generator, device: str) -> tuple[list[Any], list[torch.Tensor]]:
    ts = [_t((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), gen, device) for _ in range(3)]
    return list(ts), ts


def _flashinfer_hnd(gen: torch.Generator, device: str) -> tuple[list[Any], list[torch.Tensor]]:
    ts = [_t((NUM_BLOCKS, 2, HEADS, BLOCK, DIM), gen, device) for _ in range(3)]
    return list(ts), ts


def _vllm_cpu(gen: torch.Generator, device: str) -> tuple[list[Any], list[torch.Tensor]]:
    """vLLM CPU attention: [num_blocks, heads, block, 2*dim] viewed [.., 2*block, dim]."""
    ts = [_t((NUM_BLOCKS, HEADS, BLOCK, 2 * DIM), gen, device) for _ in range(3)]
    out = []
    for t in ts:
        v = t.view(NUM_BLOCKS, HEADS, 2 * BLOCK, DIM)
        out.append((v[:, :, :BLOCK], v[:, :, BLOCK:]))
    return out, ts


def _mla_latent(gen: torch.Generator, device: str) -> tuple[list[Any], list[torch.Tensor]]:
    """vLLM MLA: one latent cache per layer [num_blocks, block, kv_lora_rank + rope_dim]."""
    ts = [_t((NUM_BLOCKS, BLOCK, 3 * DIM), gen, device) for _ in range(3)]
    return list(ts), ts


def vllm032_views(name: str, raw: torch.Tensor, *, num_layers: int, num_blocks: int,
                  kv_heads: int, block_size: int, head_dim: int) -> list[torch.Tensor]:
    """vLLM 0.32's per-layer ``[blocks, heads, block, 2*dim]`` views of one flat buffer in a
    resolved layout (``LBNHC``: flash-attn and Triton; ``LBHNC``: FlashInfer on SM100; ``BL*``:
    block-major), with the strides vLLM's ``create_kv_cache_views`` gives them:
    ``tests/integrations/test_vllm_config_layout.py`` checks that against vLLM's own code
    where vLLM is installed, so the GPU tests can build the same tensors without it."""
    c = 2 * head_dim
    page = kv_heads * block_size * c
    layer_stride, block_stride = ((num_blocks * page, page) if name.startswith("LB")
                                  else (page, num_layers * page))
    inner = {"HNC": (block_size * c, c, 1), "NHC": (c, kv_heads * c, 1)}[name[2:]]
    return [torch.as_strided(raw, (num_blocks, kv_heads, block_size, c),
                             (block_stride, *inner), raw.storage_offset() + i * layer_stride)
            for i in range(num_layers)]


def _vllm032(name: str) -> Any:
    """vLLM 0.32 on a GPU: the worker half's (K, V) halves of each layer's dense blocks."""
    def make(gen: torch.Generator, device: str) -> tuple[list[Any], list[torch.Tensor]]:
        raw = _t((3 * NUM_BLOCKS * HEADS * BLOCK * 2 * DIM,), gen, device)
        geo = Geometry(num_layers=3, kv_heads=HEADS, block_size=BLOCK, head_dim=DIM,
                       dtype="float16", num_blocks=NUM_BLOCKS)
        views = vllm032_views(name, raw, num_layers=3, num_blocks=NUM_BLOCKS,
                              kv_heads=HEADS, block_size=BLOCK, head_dim=DIM)
        pairs = []
        for i, t in enumerate(views):
            k, v, kind = split_kv(f"l{i}", t, geo, cpu=False)
            assert kind == name[2:], (name, kind)
            pairs.append((k, v))
        return pairs, [raw]
    return make


ENGINE_LAYOUTS = {
    "hnd_pairs": _hnd_pairs,
    "nhd_pairs": _nhd_pairs,
    "flash_attn_fused": _flash_attn_fused,
    "flashinfer_nhd": _flashinfer_nhd,
    "flashinfer_hnd": _flashinfer_hnd,
    "vllm_cpu": _vllm_cpu,
    "mla_latent": _mla_latent,
    **{f"vllm032_{n.lower()}": _vllm032(n) for n in ("LBNHC", "LBHNC", "BLNHC", "BLHNC")},
}


def engine_caches(name: str, seed: int = 0, device: str = "cpu"
                  ) -> tuple[CacheLayout, list[Any], list[torch.Tensor]]:
    """``(layout, caches as the engine hands them, the tensors that own the memory)``."""
    gen = torch.Generator().manual_seed(seed)
    caches, owners = ENGINE_LAYOUTS[name](gen, device)
    if name == "mla_latent":
        lay = layout("float16", num_layers=3, kv_heads=1, block_size=BLOCK, head_dim=3 * DIM,
                     num_device_blocks=NUM_BLOCKS, num_kv_parts=1)
    else:
        lay = layout("float16", num_layers=3, kv_heads=HEADS, block_size=BLOCK, head_dim=DIM,
                     num_device_blocks=NUM_BLOCKS)
    if name.startswith("vllm032_"):
        lay = replace(lay, kv_layout=name[-3:].upper())
    return lay, caches, owners


def check_round_trip(backend: CopyBackend, name: str, seed: int = 0, device: str = "cpu"
                     ) -> tuple[CacheLayout, KVSpec]:
    """A d2h, then a layer-wise h2d, of engine layout ``name``, each compared with the
    oracle byte for byte; the engine's own tensors must have changed."""
    lay, caches, owners = engine_caches(name, seed, device)
    host = backend.allocate_host_pool(lay)
    spec = backend.register(caches, host)
    want = host.clone()
    src, dst, back = ids([3, 0, 10]), ids([2, 7, 0]), ids([5, 1, 9])
    backend.copy_d2h(spec, host, src, dst)
    ref_copy_d2h(spec, want, src, dst)
    backend.synchronize()
    assert as_bytes(host) == as_bytes(want)
    before = [as_bytes(t) for t in owners]
    want_views = clone(list(spec))
    for layer in range(lay.num_layers):
        backend.copy_h2d(host, spec, dst, back, layer)
        ref_copy_h2d(host, want_views, dst, back, layer)
    backend.synchronize()
    assert same_caches(list(spec), want_views)
    assert [as_bytes(t) for t in owners] != before
    return lay, spec


def check_v_own_strides(backend: CopyBackend, device: str = "cpu") -> None:
    """K a plain tensor, V a view into a wider one (another block stride): both directions
    match the oracle, so V was never copied with K's strides."""
    lay = layout("float16", num_layers=2)
    gen = torch.Generator().manual_seed(4)
    shape = (lay.num_device_blocks, lay.kv_heads, lay.block_size, lay.head_dim)
    kv = [(_t(shape, gen, device), _t((shape[0], 3, *shape[1:]), gen, device)[:, 1])
          for _ in range(lay.num_layers)]
    assert kv[0][0].stride(0) != kv[0][1].stride(0)
    host = backend.allocate_host_pool(lay)
    want = host.clone()
    backend.copy_d2h(kv, host, ids([7, 2]), ids([0, 4]))
    ref_copy_d2h(kv, want, ids([7, 2]), ids([0, 4]))
    backend.synchronize()
    assert as_bytes(host) == as_bytes(want)
    want_kv = clone(kv)
    backend.copy_h2d(host, kv, ids([0, 4]), ids([9, 11]), layer=1)
    ref_copy_h2d(host, want_kv, ids([0, 4]), ids([9, 11]), layer=1)
    backend.synchronize()
    assert same_caches(kv, want_kv)
