"""The cupy surface of the fake GPU: ``cupy`` / ``cupyx`` modules over a
:class:`~tests.kernels.fake_cuda.FakeCuda` (see that module for the model).

Every object is bound to one fake: ``make_cupy`` subclasses these with ``fake`` set::

    cupy.cuda.Device(i)        as cupy's: enter sets i if not current, exit always sets the
                               previous device back; .use(): the thread's current device
    cupy.cuda.Stream()         a stream of the current device; ``with s:`` makes it current
    cupy.cuda.Event()          .done (query, runs nothing), .synchronize() (runs what it needs)
    cupy.RawModule(code)       .compile() logs ("compile", device); get_function compiles
                               lazily as cupy does; its kernels are FakeKernel
    cupy.empty(shape, dtype)   FakeArray: device memory, uploads with .set(arr, stream)
    cupy.cuda.runtime          eventRecord, streamWaitEvent, hostRegister, getDevice,
                               setDevice, ... -> FakeCuda (driver: ctxGetCurrent)
    cupyx.empty_pinned         PinnedArray, tracked weakly in ``fake.pinned``

Every call that needs a context in CUDA goes through ``fake.touch()`` first.
"""

from __future__ import annotations

import ctypes
import re
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from cupy_backends.cuda.api.driver import CUDADriverError  # not constructible without libcuda

from tests.kernels.fake_cuda import (
    ILLEGAL_ADDRESS,
    INVALID_HANDLE,
    LEGACY,
    CUDARuntimeError,
    FakeCuda,
    KernelFault,
)


class PinnedArray(np.ndarray):
    """Host memory from ``cupyx.empty_pinned``: a block of cupy's pinned pool."""


class FakeArray:
    """Device memory from ``cupy.empty``: a numpy array tagged with its device."""

    def __init__(self, fake: FakeCuda, shape: tuple[int, ...], dtype: Any) -> None:
        fake.touch()
        self.fake, self.device = fake, fake.device
        self.data = np.zeros(shape, dtype=dtype)
        fake.log.append(("alloc", self.device, self.data.nbytes))

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """Async upload: the bytes are read when the item runs. A pinned source is held
        weakly: the caller must keep it until then (reading a freed one fails)."""
        fake = self.fake
        fake.touch()
        src: Callable[[], Any] = weakref.ref(arr) if isinstance(arr, PinnedArray) else lambda: arr
        label = f"upload {self.data.nbytes} B"
        with fake.cond:
            fake.check_alive()
            ptr = stream.ptr if stream is not None else fake.current_stream_ptr()
            s = fake.resolve(ptr)
            if s.device != self.device:
                raise CUDARuntimeError(INVALID_HANDLE)

            def run() -> None:
                source = src()
                if source is None:
                    raise AssertionError(f"fake CUDA: {label} read pinned staging freed "
                                         "before the upload ran (cupy may have reused it)")
                self.data[...] = source

            fake._push(s, "upload", label, fn=run)


class _Bound:
    fake: FakeCuda  # set by make_cupy on a subclass


class Device(_Bound):
    def __init__(self, device: int = 0) -> None:
        self.id = device
        self._old: list[int] = []

    def __enter__(self) -> Device:
        prev = self.fake.device
        self._old.append(prev)
        if self.id != prev:
            self.fake.set_device(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        self.fake.set_device(self._old.pop())  # as cupy: always, even if unchanged

    def use(self) -> None:
        self.fake.set_device(self.id)
        self.fake.log.append(("cupy.use", self.id))


class Stream(_Bound):
    def __init__(self, null: bool = False, non_blocking: bool = False) -> None:
        self.fake.touch()
        self.ptr = LEGACY if null else self.fake.new_stream(non_blocking)
        self.device = self.fake.device
        self._ctx: list[Any] = []

    def __enter__(self) -> Stream:
        ctx = self.fake.using_stream(self.ptr)
        ctx.__enter__()
        self._ctx.append(ctx)
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.pop().__exit__(None, None, None)

    def synchronize(self) -> None:
        fake = self.fake
        fake.touch()
        fake.sync_stream(self.ptr, self.device)  # handle 0: this device's legacy stream
        hook, fake.after_stream_sync = fake.after_stream_sync, None
        if hook is not None:
            hook()


class Event(_Bound):
    def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
        self.fake.touch()
        self._ev = self.fake.new_event()
        self.ptr = self._ev.ptr

    @property
    def done(self) -> bool:
        self.fake.touch()
        return self.fake.query(self._ev)

    def synchronize(self) -> None:
        self.fake.touch()
        self.fake.sync_event(self._ev)


#: What cupy passes a RawKernel argument as: the numpy scalar type of each C scalar type
#: (the driver reads each at the size the kernel declares: a narrower one is garbage).
_ABI = {"int": np.int32, "long long": np.int64, "unsigned long long": np.uint64}


def kernel_signature(code: str) -> list[tuple[str, bool]]:
    """(C type, is a pointer) of each parameter of the copy kernel in ``code`` (the real
    CUDA source: the fake checks every launch against it, as the driver would read it)."""
    body = code.split("#define ZKV_COPY_KERNEL", 1)[1].split("{", 1)[0]
    params = re.findall(r"const\s+([a-z ]+?)\s*(\*?)\s*(?:__restrict__\s+)?\w+\s*[,)]", body)
    assert len(params) == 11, params
    return [(t.strip(), star == "*") for t, star in params]


class RawModule(_Bound):
    def __init__(self, code: str, options: tuple[str, ...] = ()) -> None:
        assert "ZKV_COPY_KERNEL(16, uint4)" in code
        self.device = self.fake.device
        self.compiled = False
        self.signature = kernel_signature(code)

    def compile(self, log_stream: Any = None) -> None:
        self.fake.touch()
        self.fake.log.append(("compile", self.fake.device))
        self.compiled = True

    def get_function(self, name: str) -> FakeKernel:
        if not self.compiled:  # cupy compiles on first use
            self.compile()
        return FakeKernel(self.fake, int(name.rsplit("_", 1)[1]), self.signature)


def make_cupy(fake: FakeCuda) -> tuple[types.ModuleType, types.ModuleType]:
    """``cupy`` and ``cupyx`` modules backed by ``fake``."""

    def bind(cls: type) -> type:
        return type(cls.__name__, (cls,), {"fake": fake})

    def ctx(fn: Callable[..., Any]) -> Callable[..., Any]:
        """A runtime call that needs a context."""

        def call(*args: Any) -> Any:
            fake.touch()
            return fn(*args)

        return call

    def empty_pinned(shape: Any, dtype: Any) -> PinnedArray:
        arr = np.zeros(shape, dtype=dtype).view(PinnedArray)
        fake.pinned.append(weakref.ref(arr))
        return arr

    runtime = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError,
        eventRecord=ctx(fake.record),
        streamWaitEvent=ctx(lambda stream, ev, flags=0: fake.stream_wait(stream, ev)),
        pointerGetAttributes=ctx(fake.pointer_attributes),
        hostRegister=ctx(fake.host_register),
        hostUnregister=ctx(fake.host_unregister),
        getDevice=lambda: fake.device,
        setDevice=fake.set_device,
        getDeviceCount=lambda: fake.num_devices,
        deviceGetAttribute=lambda attr, dev: {16: fake.sm_count,
                                              91: int(fake.can_use_host_pointer)}[attr],
    )
    cuda = types.SimpleNamespace(
        is_available=lambda: True, Device=bind(Device), Stream=bind(Stream),
        Event=bind(Event), runtime=runtime,
        driver=types.SimpleNamespace(CUDADriverError=CUDADriverError,
                                     ctxGetCurrent=fake.ctx_current),
    )
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda  # type: ignore[attr-defined]
    cupy.RawModule = bind(RawModule)  # type: ignore[attr-defined]
    cupy.empty = lambda shape, dtype: FakeArray(fake, shape, dtype)  # type: ignore[attr-defined]
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = empty_pinned  # type: ignore[attr-defined]
    return cupy, cupyx


class FakeKernel:
    """``zkv_copy_<width>``: the CUDA kernel's addressing, run by the fake at execution."""

    def __init__(self, fake: FakeCuda, width: int,
                 signature: list[tuple[str, bool]]) -> None:
        self.fake, self.width, self.signature = fake, width, signature

    def _check_abi(self, args: tuple[Any, ...]) -> None:
        """Each argument as the kernel reads it: a device array of the pointer's type, or
        a numpy scalar of the parameter's exact type (a Python int, or an np.int32 for a
        ``long long``, is read as 8 bytes where 4 were passed on a GPU)."""
        assert len(args) == len(self.signature), (len(args), self.signature)
        for i, (arg, (ctype, pointer)) in enumerate(zip(args, self.signature)):
            want = _ABI[ctype]
            if pointer:
                assert isinstance(arg, FakeArray) and arg.data.dtype == want, \
                    f"kernel argument {i}: a {ctype}* wants a device array of {want.__name__}"
            else:
                assert type(arg) is want, \
                    f"kernel argument {i}: a {ctype} wants {want.__name__}, got {type(arg)}"

    def __call__(self, grid: tuple[int, ...], block: tuple[int], args: tuple[Any, ...]
                 ) -> None:
        self.fake.touch()
        self._check_abi(args)
        ids, n, params, layer, parts, host, host_block, chunk_bytes, to_host, piece, pieces = args
        n, layer, parts = int(n), int(layer), int(parts)
        piece, pieces = int(piece), int(pieces)
        items = n * parts * pieces
        assert len(grid) == 1 and 1 <= grid[0] <= items and 1 <= block[0] <= 1024, (grid, items)
        assert 1 <= pieces < 2**31, "pieces is an int in the kernel"
        assert pieces * piece >= int(chunk_bytes) // self.width, "slices miss part of a chunk"
        w = self.width
        geometry = (int(host), int(host_block), int(chunk_bytes), bool(to_host))

        def run() -> None:
            flat = ids.data.reshape(-1).astype(np.int64)
            table = params.data.view(np.uint64)
            for b in range(grid[0]):  # thread block b: items b, b + grid, ... (grid-stride)
                for item in range(b, items, grid[0]):
                    j, p, z = item // (parts * pieces), item // pieces % parts, item % pieces
                    q = [int(x) for x in table[layer, p]]
                    self._slice(q, flat, n, j, layer, parts, p, z * piece, piece, geometry)

        way = "d2h" if to_host else "h2d"
        self.fake.launch(run, f"zkv_copy_{w} layer {layer} {way} parts {parts}",
                         [ids, params], tuple(grid))

    def _slice(self, q: list[int], flat: np.ndarray, n: int, j: int, layer: int, parts: int,
               p: int, begin: int, piece: int, geometry: tuple[int, int, int, bool]) -> None:
        host, host_block, chunk_bytes, to_host = geometry
        w = self.width
        end = min(begin + piece, chunk_bytes // w)
        dev_id, host_id = (int(flat[j]), int(flat[n + j]))[:: 1 if to_host else -1]
        dev = q[0] + dev_id * _signed(q[1])
        h = host + host_id * host_block + (layer * parts + p) * chunk_bytes
        run = q[2] // w
        v = begin
        while v < end:
            r = v // run
            seg = min(end, (r + 1) * run)
            i2, rest = r % q[4], r // q[4]
            i1, i0 = rest % q[3], rest // q[3]
            d = (dev + i0 * _signed(q[5]) + i1 * _signed(q[6]) + i2 * _signed(q[7])
                 + (v - r * run) * w)
            hv, nbytes = h + v * w, (seg - v) * w
            assert d % w == 0 and hv % w == 0, "misaligned vector access"
            if not self.fake.registered_at(hv, nbytes):
                raise KernelFault(ILLEGAL_ADDRESS)  # the host side must be registered memory
            if to_host:
                ctypes.memmove(hv, d, nbytes)
            else:
                ctypes.memmove(d, hv, nbytes)
            v = seg


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x
