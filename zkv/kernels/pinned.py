"""Pinned host memory of exactly the asked size: anonymous mmap + ``cudaHostRegister``.

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every
request up to a power of two (a 40 GiB pool pins 64 GiB) and pins page by page through
``cudaHostAlloc`` in one thread. Here::

    mmap(size, MAP_PRIVATE | MAP_ANONYMOUS)      zeroed, lazily faulted, exact size
    madvise(MADV_HUGEPAGE)                       2 MiB pages: fewer pages to fault and pin
    cudaHostRegister(chunk_k, PORTABLE | MAPPED) chunks of ``chunk_bytes`` registered by
        chunk 0 | chunk 1 | ... | chunk k-1      ``threads`` threads at once, each made to
                                                 use the backend's device for good (a bare
                                                 thread would open a context on GPU 0)

Chunks are registered separately only where the device reads registered memory at its
host address (``cudaDevAttrCanUseHostPointerForRegisteredMem``): then one device pointer
covers every chunk. Elsewhere the range is registered in one call.

The registration lives as long as the returned array: a finalizer waits for the given
stream (no copy may still read or write the range), then unregisters every chunk, on the
device too (it runs in whichever thread drops the array).

Devices: :func:`on_device`, not ``with cupy.cuda.Device(d)``. Leaving the latter always
calls ``cudaSetDevice(previous)``, and with the CUDA 12 runtime that creates the previous
device's primary context: in a fresh thread (current device 0, no context) a rank on GPU
``d != 0`` would put a context (~0.3-0.5 GiB) on GPU 0, or fail with error 46 where GPU 0
is in exclusive-process mode.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import mmap
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: every context sees it as pinned
HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: a device address for zero-copy kernels
DEV_ATTR_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem

DEFAULT_CHUNK_BYTES = 1 << 30


@contextlib.contextmanager
def on_device(cp: Any, device_id: int) -> Iterator[None]:
    """``device_id`` is the calling thread's current device inside the block.

    Holds on leaving: a thread that had ``device_id`` current keeps it (no CUDA call but
    ``cudaGetDevice``); a thread that had a context current gets its previous device
    back; a thread that had none (fresh: device 0 by default, no context) stays on
    ``device_id`` -- setting 0 back would create a context on GPU 0 only to restore a
    default nobody chose. So no call here ever creates a context on another device.
    """
    rt = cp.cuda.runtime
    prev = rt.getDevice()
    if prev == device_id:
        yield
        return
    restore = cp.cuda.driver.ctxGetCurrent() != 0
    rt.setDevice(device_id)
    try:
        yield
    finally:
        if restore:
            rt.setDevice(prev)


@dataclass(frozen=True, slots=True)
class PinnedInfo:
    """What pinning a host range cost: bytes, chunks, threads, time to ready."""

    num_bytes: int
    num_chunks: int
    num_threads: int
    ready_ms: float


def pinned_empty(cp: Any, device_id: int, num_bytes: int, stream: Any, *, threads: int = 4,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[np.ndarray, PinnedInfo]:
    """A zeroed, pinned, mapped ``uint8`` array of exactly ``num_bytes`` and its cost.

    ``cp`` is the cupy module, ``stream`` the stream whose copies may touch the range
    (waited for before the range is unregistered).
    """
    t0 = time.perf_counter()
    buf = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # transparent huge pages off: 4 KiB pages, slower to pin
            pass
    arr = np.frombuffer(buf, dtype=np.uint8, count=num_bytes)
    if num_bytes == 0:
        return arr, PinnedInfo(0, 0, 0, 0.0)
    rt = cp.cuda.runtime
    split = rt.deviceGetAttribute(DEV_ATTR_CAN_USE_HOST_POINTER, device_id) == 1
    base = arr.ctypes.data
    step = max(mmap.PAGESIZE, chunk_bytes // mmap.PAGESIZE * mmap.PAGESIZE)
    ranges = ([(a, min(step, num_bytes - (a - base))) for a in range(base, base + num_bytes, step)]
              if split else [(base, num_bytes)])
    workers = max(1, min(threads, len(ranges)))
    done = _register_all(cp, device_id, ranges, workers)
    fin = weakref.finalize(arr, _unregister, cp, device_id, done, stream)
    fin.atexit = False  # at exit the process's memory goes anyway; CUDA may be unloading
    ready_ms = (time.perf_counter() - t0) * 1e3
    return arr, PinnedInfo(num_bytes, len(ranges), workers, round(ready_ms, 3))


def _register_all(cp: Any, device_id: int, ranges: list[tuple[int, int]],
                  workers: int) -> list[tuple[int, int]]:
    """Register every range (in parallel); on any failure unregister the rest and raise.
    A pool thread is fresh: its first range makes ``device_id`` its device for good."""
    flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED

    def one(rng: tuple[int, int]) -> tuple[int, int]:
        with on_device(cp, device_id):
            cp.cuda.runtime.hostRegister(rng[0], rng[1], flags)
        return rng

    if workers == 1:
        done: list[tuple[int, int]] = []
        try:
            for rng in ranges:
                done.append(one(rng))
        except BaseException:
            _unregister(cp, device_id, done, None)
            raise
        return done
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="zkv-pin") as pool:
        futs = [pool.submit(one, rng) for rng in ranges]
        cf.wait(futs)
    ok = [f.result() for f in futs if f.exception() is None]
    errors = [f.exception() for f in futs if f.exception() is not None]
    if errors:
        _unregister(cp, device_id, ok, None)
        raise errors[0]  # type: ignore[misc]
    return ok


def _unregister(cp: Any, device_id: int, ranges: list[tuple[int, int]], stream: Any) -> None:
    """Finalizer: wait for the stream's copies, unregister. Never raises (a device that
    faulted cannot be waited for; its work will not run again anyway). Runs in the thread
    that dropped the array, on ``device_id`` (see :func:`on_device`)."""
    try:
        with on_device(cp, device_id):
            if stream is not None:
                stream.synchronize()
            for addr, _ in ranges:
                with contextlib.suppress(Exception):
                    cp.cuda.runtime.hostUnregister(addr)
    except Exception:
        pass  # the device faulted: leave the range registered rather than race nothing
