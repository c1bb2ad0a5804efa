"""KV caches shaped as real engines hand them, filled with random bytes (shared by the CPU,
fake-CuPy and GPU tests)."""

from __future__ import annotations

from typing import Any

import torch

from tests.kernels.helpers import layout, randomize
from zkv.config import CacheLayout

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


ENGINE_LAYOUTS = {
    "hnd_pairs": _hnd_pairs,
    "nhd_pairs": _nhd_pairs,
    "flash_attn_fused": _flash_attn_fused,
    "flashinfer_nhd": _flashinfer_nhd,
    "flashinfer_hnd": _flashinfer_hnd,
    "vllm_cpu": _vllm_cpu,
    "mla_latent": _mla_latent,
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
    return lay, caches, owners
