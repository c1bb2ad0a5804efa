"""The C extension zkv.kernels._blockcopy on its own: addresses, strides, argument checks."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from zkv.kernels import cpu

bc = pytest.importorskip(
    "zkv.kernels._blockcopy", reason="C extension not built (pip install -e . with gcc)"
)


def addr(a: np.ndarray) -> int:
    return a.ctypes.data


def test_copies_chunks_between_strided_rows() -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (10, 24), dtype=np.uint8)  # rows 24 bytes apart, chunk 16
    dst = np.zeros((6, 40), dtype=np.uint8)  # rows 40 bytes apart
    s, d = np.array([9, 0, 4, 4], dtype=np.int64), np.array([5, 1, 0, 3], dtype=np.int64)

    bc.copy_chunks(addr(src), 24, addr(dst), 40, 16, addr(s), addr(d), len(s))

    want = np.zeros_like(dst)
    for i, j in zip(s, d):
        want[j, :16] = src[i, :16]
    assert dst.tobytes() == want.tobytes()


def test_negative_stride_walks_backwards() -> None:
    src = np.arange(32, dtype=np.uint8).reshape(4, 8)
    dst = np.zeros((4, 8), dtype=np.uint8)
    rev = src[::-1]  # base = last row, stride -8
    assert rev.strides[0] == -8
    ids = np.arange(4, dtype=np.int64)

    bc.copy_chunks(addr(rev), -8, addr(dst), 8, 8, addr(ids), addr(ids), 4)

    assert dst.tobytes() == src[::-1].tobytes()


def test_zero_n_or_chunk_touches_nothing() -> None:
    # Null addresses are fine when there is nothing to copy.
    bc.copy_chunks(0, 0, 0, 0, 16, 0, 0, 0)
    bc.copy_chunks(0, 0, 0, 0, 0, 0, 0, 5)


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((1, 0, 1, 0, -1, 8, 8, 1), ValueError, "must be >= 0"),
        ((1, 0, 1, 0, 8, 8, 8, -1), ValueError, "must be >= 0"),
        ((0, 0, 1, 0, 8, 8, 8, 1), ValueError, "null address"),
        ((1, 0, 1, 0, 8, 8, 0, 1), ValueError, "null address"),
        ((1, 0, 1, 0, 8, 12, 8, 1), ValueError, "8-byte aligned"),
        ((1, 0, 1, 0, 8, 8, 8), TypeError, "copy_chunks"),
        ((1.5, 0, 1, 0, 8, 8, 8, 1), TypeError, "must be int"),
    ],
)
def test_argument_errors(args: tuple, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        bc.copy_chunks(*args)


def test_backend_wrapper_passes_ids_by_address() -> None:
    src = np.arange(5 * 12, dtype=np.uint8).reshape(5, 12)
    dst = np.zeros((5, 12), dtype=np.uint8)
    s, d = np.array([4, 2], dtype=np.int64), np.array([0, 3], dtype=np.int64)
    cpu._copy_ext(addr(src), 12, addr(dst), 12, 12, s, d)
    ref = np.zeros_like(dst)
    cpu._copy_memmove(addr(src), 12, addr(ref), 12, 12, s, d)
    assert dst.tobytes() == ref.tobytes()
    assert dst[0].tobytes() == src[4].tobytes() and dst[3].tobytes() == src[2].tobytes()


def test_copies_run_concurrently_from_threads() -> None:
    """The loop releases the GIL; several threads copying at once all land exactly."""
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, (64, 4096), dtype=np.uint8)
    dsts = [np.zeros_like(src) for _ in range(4)]
    ids = np.arange(64, dtype=np.int64)
    perm = rng.permutation(64).astype(np.int64)

    def run(dst: np.ndarray) -> None:
        for _ in range(20):
            bc.copy_chunks(addr(src), 4096, addr(dst), 4096, 4096, addr(ids), addr(perm), 64)

    threads = [threading.Thread(target=run, args=(d,)) for d in dsts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    want = np.empty_like(src)
    want[perm] = src
    assert all(d.tobytes() == want.tobytes() for d in dsts)


@pytest.mark.parametrize(("chunk", "dst_offset"), [(32768, 0), (4100, 3), (300, 8)])
def test_large_batches_take_the_streaming_path_byte_exact(chunk: int, dst_offset: int) -> None:
    """Past 1 MiB per call the copy uses non-temporal stores: unaligned destinations (a
    head before the first 16-byte boundary) and chunks that are no multiple of 64 bytes (a
    tail) must come out exactly as memcpy would write them."""
    rng = np.random.default_rng(chunk)
    n = (2 << 20) // chunk + 1  # > 1 MiB in one call
    rows = n + 5
    src = rng.integers(0, 256, rows * chunk, dtype=np.uint8)
    dst_buf = np.zeros(rows * (chunk + 16) + dst_offset, dtype=np.uint8)
    dst = dst_buf[dst_offset:]
    s = rng.permutation(rows)[:n].astype(np.int64)
    d = rng.permutation(rows)[:n].astype(np.int64)

    bc.copy_chunks(addr(src), chunk, addr(dst), chunk + 16, chunk, addr(s), addr(d), n)

    want = np.zeros_like(dst)
    for i, j in zip(s, d):
        want[j * (chunk + 16) : j * (chunk + 16) + chunk] = src[i * chunk : (i + 1) * chunk]
    assert dst.tobytes() == want.tobytes()
    assert not dst_buf[:dst_offset].any()  # nothing written before the destination
