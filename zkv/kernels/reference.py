"""Slow, obviously-correct oracle copies and the simulated forward pass (fill / check).

The oracle loops over blocks in Python, one ``copy_`` per chunk; tests compare every
backend against it byte for byte. It works for CPU and CUDA device caches alike, and for
any strides: pass a :class:`~zkv.kernels.layout.KVSpec` (its parts are logical
``[blocks, heads, block, dim]`` views) for engine layouts such as NHD or fused tensors.

Simulated forward pattern. Replay and tests need KV bytes that depend only on
``(rank, block digest, layer, K|V)``, so a block computed on one instance and loaded
from L2/L3 on another can be checked exactly::

    base(rank, key)   = xxh3_128(0 || rank || key) || xxh3_128(1 || rank || key)   32 bytes
    salt(layer, kv)   = xxh3_128(2 || layer || kv) || xxh3_128(3 || layer || kv)    32 bytes
    chunk(l, kv) bytes = (base XOR salt(l, kv)) tiled over chunk_bytes (cut at the end),
                         in the logical [heads, block, dim] order of the part

A wrong block changes ``base``; a swapped layer or K<->V changes ``salt``; a single
flipped byte breaks the comparison of every byte. All of it is done on ``uint8`` views,
so it works for any dtype, and vectorized over blocks: O(num_layers) torch ops per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from zkv.config import CacheLayout
from zkv.kernels.base import Ids, KVCaches, as_index

PATTERN_BYTES = 32


# -------------------------------------------------------------------- oracle copies


def ref_copy_d2h(
    kv_caches: KVCaches,
    host_pool: torch.Tensor,
    src_ids: Ids,
    dst_ids: Ids,
    layers: range | None = None,
) -> None:
    """``host_pool[dst[j], l, kv] = kv_caches[l][kv][src[j]]``, one block at a time."""
    src, dst = as_index(src_ids, "src_ids"), as_index(dst_ids, "dst_ids")
    assert len(src) == len(dst), "oracle: length mismatch"
    for layer in range(len(kv_caches)) if layers is None else layers:
        for kv in range(len(kv_caches[layer])):
            for s, d in zip(src.tolist(), dst.tolist()):
                host_pool[d, layer, kv].copy_(kv_caches[layer][kv][s])


def ref_copy_h2d(
    host_pool: torch.Tensor, kv_caches: KVCaches, src_ids: Ids, dst_ids: Ids, layer: int
) -> None:
    """``kv_caches[layer][kv][dst[j]] = host_pool[src[j], layer, kv]``, one block at a time."""
    src, dst = as_index(src_ids, "src_ids"), as_index(dst_ids, "dst_ids")
    assert len(src) == len(dst), "oracle: length mismatch"
    for kv in range(len(kv_caches[layer])):
        for s, d in zip(src.tolist(), dst.tolist()):
            kv_caches[layer][kv][d].copy_(host_pool[s, layer, kv])


# -------------------------------------------------------------------- pattern


def _digest32(tag: int, a: int, b: bytes) -> bytes:
    head = tag.to_bytes(1, "little") + a.to_bytes(4, "little", signed=True)
    return xxhash.xxh3_128_digest(head + b"\x00" + b) + xxhash.xxh3_128_digest(head + b"\x01" + b)


def _bases(keys: Sequence[bytes], rank: int) -> np.ndarray:
    """``[len(keys), 32]`` uint8: the per-block part of the pattern."""
    raw = b"".join(_digest32(0, rank, bytes(k)) for k in keys)
    return np.frombuffer(raw, dtype=np.uint8).reshape(len(keys), PATTERN_BYTES)


def _salt(layer: int, kv: int) -> np.ndarray:
    return np.frombuffer(_digest32(2, layer, bytes([kv])), dtype=np.uint8)


def _tile(rows: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """``[n, 32]`` uint8 -> ``[n, chunk_bytes]`` uint8 by repetition."""
    reps = -(-chunk_bytes // PATTERN_BYTES)
    return rows.repeat(1, reps)[:, :chunk_bytes].contiguous()


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _byte_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``[num_blocks, chunk]`` view of a part whose blocks are contiguous (None if they are
    not), as int64 where chunk, base and block stride allow it: 8x fewer elements."""
    if t.shape[0] == 0 or not t[0].is_contiguous():
        return None
    u8 = t if t.dtype == torch.uint8 else t.view(torch.uint8)
    rows = u8.view(t.shape[0], -1)
    if rows.shape[1] % 8 == 0 and rows.data_ptr() % 8 == 0 and rows.stride(0) % 8 == 0:
        return rows.view(torch.int64)
    return rows


def _write_rows(t: torch.Tensor, idx: torch.Tensor, want: torch.Tensor) -> None:
    """Blocks ``idx`` of ``t`` = ``want`` (``[n, chunk]`` uint8) in logical order, any strides."""
    rows = _byte_rows(t)
    if rows is not None:
        rows.index_put_((idx,), want.view(rows.dtype))
        return
    as_int = _INT_OF_SIZE[t.element_size()]  # same-size integers: bits move verbatim
    vals = want.view(as_int).view(len(idx), *t.shape[1:])
    t.view(as_int).index_put_((idx,), vals)


def _read_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Blocks ``idx`` of ``t`` as ``[n, chunk]`` uint8 in logical order, any strides."""
    as_int = _INT_OF_SIZE[t.element_size()]
    return t.view(as_int).index_select(0, idx).contiguous().view(torch.uint8).view(len(idx), -1)


def _check_keys(dev: np.ndarray, keys: Sequence[bytes], num_device_blocks: int) -> None:
    if len(dev) != len(keys):
        raise ValueError(f"{len(dev)} device ids but {len(keys)} keys")
    if len(dev) and (int(dev.min()) < 0 or int(dev.max()) >= num_device_blocks):
        raise ValueError(
            f"device block id out of range [0, {num_device_blocks}): "
            f"min={int(dev.min())} max={int(dev.max())}"
        )


def fill_pattern(kv_caches: KVCaches, dev_ids: Ids, keys: Sequence[bytes], rank: int) -> None:
    """Write the pattern of ``(rank, keys[j])`` into every layer's K and V of ``dev_ids[j]``."""
    dev = as_index(dev_ids, "dev_ids")
    _check_keys(dev, keys, kv_caches[0][0].shape[0] if kv_caches else 0)
    if not len(dev) or not kv_caches:
        return
    device = kv_caches[0][0].device
    bases = torch.from_numpy(_bases(keys, rank).copy()).to(device)
    idx = torch.from_numpy(dev).to(device)
    chunk_bytes = kv_caches[0][0][0].numel() * kv_caches[0][0].element_size()
    for layer, pair in enumerate(kv_caches):
        for kv, t in enumerate(pair):
            salt = torch.from_numpy(_salt(layer, kv).copy()).to(device)
            _write_rows(t, idx, _tile(bases ^ salt, chunk_bytes))


def check_pattern(kv_caches: KVCaches, dev_ids: Ids, keys: Sequence[bytes], rank: int) -> int:
    """How many leading blocks of ``dev_ids`` hold their pattern (``len(keys)`` = all)."""
    dev = as_index(dev_ids, "dev_ids")
    _check_keys(dev, keys, kv_caches[0][0].shape[0] if kv_caches else 0)
    if not len(dev) or not kv_caches:
        return len(dev)
    device = kv_caches[0][0].device
    bases = torch.from_numpy(_bases(keys, rank).copy()).to(device)
    idx = torch.from_numpy(dev).to(device)
    ok = torch.ones(len(dev), dtype=torch.bool, device=device)
    chunk_bytes = kv_caches[0][0][0].numel() * kv_caches[0][0].element_size()
    for layer, pair in enumerate(kv_caches):
        for kv, t in enumerate(pair):
            salt = torch.from_numpy(_salt(layer, kv).copy()).to(device)
            want = _tile(bases ^ salt, chunk_bytes)
            rows = _byte_rows(t)
            if rows is None:
                got = _read_rows(t, idx)
            else:
                got, want = rows.index_select(0, idx), want.view(rows.dtype)
            ok &= (got == want).all(dim=1)
    bad = (~ok).nonzero()
    return int(bad[0, 0]) if len(bad) else len(dev)


def expected_block_bytes(layout: CacheLayout, key: bytes, rank: int) -> bytes:
    """One full page-first host block (``layout.block_bytes``) as ``fill_pattern`` writes it."""
    base = _bases([key], rank)[0]
    reps = -(-layout.chunk_bytes // PATTERN_BYTES)
    parts = [
        np.tile(base ^ _salt(layer, kv), reps)[: layout.chunk_bytes].tobytes()
        for layer in range(layout.num_layers)
        for kv in range(layout.num_kv_parts)
    ]
    return b"".join(parts)
