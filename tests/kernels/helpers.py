"""Shared builders for the kernel tests: random caches, snapshots, byte comparisons."""

from __future__ import annotations

import numpy as np
import torch

from zkv.config import CacheLayout
from zkv.kernels.base import CopyBackend

DTYPES = ["float16", "bfloat16", "float32", "uint8", "int8", "float8_e4m3fn"]


def layout(dtype: str = "float16", **kw: int) -> CacheLayout:
    geo = {"num_layers": 3, "kv_heads": 2, "block_size": 4, "head_dim": 8}
    geo.update(kw)
    geo.setdefault("num_device_blocks", 12)
    geo.setdefault("num_host_blocks", 9)
    return CacheLayout(dtype=dtype, **geo)  # type: ignore[arg-type]


def randomize(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes (every bit pattern, NaN payloads included), any dtype, any device."""
    u8 = t.view(torch.uint8)
    u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=gen))


def random_caches(
    backend: CopyBackend, lay: CacheLayout, seed: int = 0
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = backend.allocate_device_cache(lay)
    host = backend.allocate_host_pool(lay)
    for k, v in kv:
        randomize(k, gen)
        randomize(v, gen)
    randomize(host, gen)
    return kv, host


def clone(kv: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in parts) for parts in kv]


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def same_caches(a: list[tuple[torch.Tensor, ...]], b: list[tuple[torch.Tensor, ...]]) -> bool:
    assert len(a) == len(b) and all(len(pa) == len(pb) for pa, pb in zip(a, b))
    return all(as_bytes(x) == as_bytes(y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def ids(values: list[int] | np.ndarray) -> np.ndarray:
    """Ids the way the worker gets them: a read-only little-endian int32 view of a frame."""
    return np.frombuffer(np.asarray(values, dtype="<i4").tobytes(), dtype="<i4")


def pick(rng: np.random.Generator, bound: int, n: int) -> np.ndarray:
    return ids(rng.choice(bound, size=n, replace=False))
