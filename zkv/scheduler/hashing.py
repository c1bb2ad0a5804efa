"""Chained block hashing, deterministic across processes and machines.

``h_i = XXH3-128(h_{i-1} ‖ tokens_i as int32 LE ‖ extra_i)``, with ``h_{-1}`` a fixed 16-byte
root. ``extra_i`` is empty, or ``0xff`` followed by the 16-byte hashes of the multimodal
items that overlap block i (``item.start < end and item.end > start``: an item that ends
exactly at the block's start does not count). Only full blocks are hashed.

Never Python's ``hash()``: it is salted per process. Digests are ``bytes`` of 16.

Two paths, one result::

    hash_tokens / hash_ids_chain ──► native (_chainhash.c: converts a list of ints and
          │                          hashes in one pass, ~0.05 us/block)
          └── not built, or an input it leaves to Python (non-int element, out of range)
              ──► hash_tokens_py / hash_ids_chain_py (the reference: numpy conversion,
                  one xxhash call per block, ~0.3-0.6 us/block)

The reference functions stay public: tests check that both paths give identical digests
(multimodal extras and id chains included) and that bad inputs raise the same errors.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)
DIGEST_SIZE = 16
ROOT_HASH = BlockHash(b"zkv-root-v1\x00\x00\x00\x00\x00")
_EXTRA_TAG = b"\xff"

_xxh128 = xxhash.xxh3_128_digest

try:
    from zkv.scheduler import _chainhash as _native
except ImportError:  # built without a compiler: the pure-Python reference path only
    _native = None  # type: ignore[assignment]

#: True when the native hashing path is built and used.
NATIVE = _native is not None


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input occupying token positions ``[start, end)``; ``digest`` names its
    content."""

    start: int
    end: int
    digest: bytes

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"multimodal item needs 0 <= start < end, got "
                             f"[{self.start}, {self.end})")
        if len(self.digest) != DIGEST_SIZE:
            raise ValueError(f"multimodal item digest must be {DIGEST_SIZE} bytes")


def hash_block(parent: bytes, token_bytes: bytes, extra: bytes = b"") -> BlockHash:
    """One chain step; ``token_bytes`` are the block's int32 LE token ids."""
    return BlockHash(_xxh128(parent + token_bytes + extra))


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError("token ids must be one-dimensional")
    if arr.size and arr.dtype.kind not in "iu":  # 1.5 must not hash like 1
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4", copy=False).tobytes()


def hash_tokens(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    parent: bytes = ROOT_HASH,
    start_token: int = 0,
    mm_items: Sequence[MultiModalItem] = (),
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, chained from ``parent``.

    ``start_token`` is the absolute position of ``token_ids[0]`` (so a caller can extend a
    request's hashes incrementally with ``parent`` = its last hash); it must be a multiple
    of ``block_size``. ``mm_items`` use absolute positions. O(n) in blocks.
    """
    _check_args(block_size, start_token, parent)
    if _native is None:
        return hash_tokens_py(token_ids, block_size, parent=parent, start_token=start_token,
                              mm_items=mm_items)
    extras = (_block_extras(mm_items, start_token, block_size, len(token_ids) // block_size)
              if mm_items else None)
    if type(token_ids) is list or type(token_ids) is tuple:
        out = _native.hash_tokens(token_ids, block_size, parent, extras)
        if out is not None:
            return out
        # an element the native path leaves to the reference (it raises or converts)
        return hash_tokens_py(token_ids, block_size, parent=parent, start_token=start_token,
                              mm_items=mm_items)
    return _native.hash_tokens(_token_bytes(token_ids), block_size, parent,  # type: ignore[return-value]
                               extras)  # (never None for bytes)


def _check_args(block_size: int, start_token: int, parent: bytes) -> None:
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    if start_token % block_size:
        raise ValueError("start_token must be a multiple of block_size")
    if len(parent) != DIGEST_SIZE:
        raise ValueError(f"parent digest must be {DIGEST_SIZE} bytes")


def _block_extras(mm_items: Sequence[MultiModalItem], start_token: int, block_size: int,
                  num_full: int) -> dict[int, bytes]:
    """{block index: 0xff + digests of the items overlapping it}, blocks counted from
    ``start_token``; digests in (start, end) order. O(items + blocks they span)."""
    per_block: dict[int, list[bytes]] = {}
    for it in sorted(mm_items, key=lambda it: (it.start, it.end)):
        lo = max(0, (it.start - start_token) // block_size)
        hi = min(num_full, -(-(it.end - start_token) // block_size))
        for b in range(lo, hi):
            per_block.setdefault(b, []).append(it.digest)
    return {b: _EXTRA_TAG + b"".join(ds) for b, ds in per_block.items()}


def hash_tokens_py(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    parent: bytes = ROOT_HASH,
    start_token: int = 0,
    mm_items: Sequence[MultiModalItem] = (),
) -> list[BlockHash]:
    """The pure-Python reference of :func:`hash_tokens` (same arguments, same digests)."""
    _check_args(block_size, start_token, parent)
    data = _token_bytes(token_ids)
    step = 4 * block_size
    num_full = len(data) // step
    out: list[BlockHash] = []
    if not mm_items:
        h = parent
        for off in range(0, num_full * step, step):
            h = _xxh128(h + data[off : off + step])
            out.append(h)  # type: ignore[arg-type]
        return out
    items = sorted(mm_items, key=lambda it: (it.start, it.end))
    h = parent
    first = 0  # items before `first` end at or before the current block's start
    for b in range(num_full):
        start = start_token + b * block_size
        end = start + block_size
        while first < len(items) and items[first].end <= start:
            first += 1
        overlapping = []
        j = first
        while j < len(items) and items[j].start < end:
            if items[j].end > start:
                overlapping.append(items[j].digest)
            j += 1
        extra = _EXTRA_TAG + b"".join(overlapping) if overlapping else b""
        h = _xxh128(h + data[b * step : (b + 1) * step] + extra)
        out.append(h)  # type: ignore[arg-type]
    return out


def _ids_bytes(ids: Sequence[int]) -> bytes:
    """int64 LE bytes of ``ids``; bool, float, str and ints past int64 raise ValueError
    (1.5 must not hash like 1)."""
    if all(type(i) is int for i in ids):  # the common case, without numpy's conversion
        try:
            return struct.pack(f"<{len(ids)}q", *ids)
        except struct.error as e:
            raise ValueError(f"block ids must fit in int64: {e}") from e
    # numpy would take [1, True] as [1, 1]; an array keeps its bools in its dtype (below),
    # and is not walked element by element here
    if not isinstance(ids, np.ndarray) and any(type(i) is bool for i in ids):
        raise ValueError("block ids must be a 1-D sequence of integers, got a bool")
    try:
        arr = np.asarray(ids)
    except OverflowError as e:
        raise ValueError(f"block ids must fit in int64: {e}") from e
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"block ids must be a 1-D sequence of integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() >= 2**63:
        raise ValueError("block ids must fit in int64")
    return arr.astype("<i8", copy=False).tobytes()


def hash_ids_chain(ids: Sequence[int], *, parent: bytes = ROOT_HASH) -> list[BlockHash]:
    """Chain-hash opaque per-block ids (trace replay: one id per block, equal paths → equal
    hashes). Each id is hashed as 8 bytes, int64 little-endian."""
    if _native is not None:
        out = _native.hash_id_list(ids, parent)
        if out is not None:
            return out
    return hash_ids_chain_py(ids, parent=parent)


def hash_ids_chain_py(ids: Sequence[int], *, parent: bytes = ROOT_HASH) -> list[BlockHash]:
    """The pure-Python reference of :func:`hash_ids_chain`."""
    if len(parent) != DIGEST_SIZE:
        raise ValueError(f"parent digest must be {DIGEST_SIZE} bytes")
    data = _ids_bytes(ids)
    out: list[BlockHash] = []
    h = parent
    for off in range(0, len(data), 8):
        h = _xxh128(h + data[off : off + 8])
        out.append(h)  # type: ignore[arg-type]
    return out
