"""A stream-faithful fake of cupy (and of torch.cuda's device and stream calls), for CI.

The CuPy backend runs against it unchanged; "device memory" is host memory, so every
launch moves real bytes at the addresses the CUDA kernel would use. What it models::

    device d        legacy stream L_d (handle 0 while d is current) + streams made on d
    contexts        CUDA 12: ``cudaSetDevice(d)`` creates d's primary context at once (and
                    makes it the thread's current context); a runtime call in a thread
                    with no context creates one on its current device (0 in a fresh
                    thread). ``contexts`` lists each device's first, with the thread
    pinned staging  ``cupyx.empty_pinned`` arrays; an async upload holds its source only
                    weakly (as CUDA does: cupy's pinned pool reuses a freed block at once),
                    and reading one freed before the upload ran fails the sync that ran it
    stream          FIFO of items: kernel | upload | record(ev, g) | wait(ev, g) | hold | host
    event           its g-th record is a marker item; the event is done when the marker of
                    its latest record has run (never recorded: done); a stream wait
                    captures the latest record at the time of the call (as CUDA does)
    legacy stream   an item on L_d waits for earlier items of every *blocking* stream of d,
                    and an item on a blocking stream waits for earlier items of L_d;
                    non-blocking streams do not sync with L_d
    progress        nothing runs by itself. A host sync (stream / event synchronize) runs
                    only what its target needs -- the items ahead of it and, transitively,
                    what they wait for -- never unrelated work. Tests run streams with
                    ``drain(...)`` in the order they choose, and ``hold(stream)`` parks a
                    stream until ``gate.open()`` (a long kernel)
    errors          a launch may fail synchronously (``fail_next_launch``); a kernel may
                    fault when it runs (``fault_next_kernel``): a sticky status makes every
                    later call on that device raise, and the device runs nothing again

So a kernel on the wrong stream, a missing wait on the compute stream's start event or a
missing drain before an ack shows up as wrong or missing bytes, or as work still queued,
in a test without a GPU. Every public method takes one lock; host syncs from other
threads wait on its condition (a sync blocked past ``sync_timeout_s`` raises).

This module is the model; ``fake_cupy`` is the cupy surface over it, and :func:`install`
puts both in place (and points torch.cuda's device and stream calls here).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest
import torch
from cupy.cuda.runtime import CUDARuntimeError

if TYPE_CHECKING:
    from tests.kernels.fake_cupy import FakeArray

ILLEGAL_ADDRESS = 700  # sticky
LAUNCH_OUT_OF_RESOURCES = 701  # not sticky
INVALID_HANDLE = 400
INVALID_DEVICE = 101
LEGACY = 0
#: Errors CUDA's runtime API documents as leaving the context unusable ("the process must
#: be terminated and relaunched"): cudaErrorECCUncorrectable 214, IllegalAddress 700,
#: LaunchTimeout 702, ContextIsDestroyed 709, Assert 710, HardwareStackError 714,
#: IllegalInstruction 715, MisalignedAddress 716, InvalidAddressSpace 717, InvalidPc 718,
#: LaunchFailure 719, ExternalDevice 911, Unknown 999. From the docs, not from zkv's list.
_STICKY = {214, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719, 911, 999}


class Item:
    """One piece of work on a stream."""

    __slots__ = ("seq", "stream", "kind", "label", "fn", "event", "gen", "gate", "done")

    def __init__(self, seq: int, stream: FStream, kind: str, label: str, fn: Any = None,
                 event: FEvent | None = None, gen: int = 0, gate: Gate | None = None) -> None:
        self.seq, self.stream, self.kind, self.label = seq, stream, kind, label
        self.fn, self.event, self.gen, self.gate = fn, event, gen, gate
        self.done = False


class FStream:
    def __init__(self, fake: FakeCuda, ptr: int, device: int, blocking: bool,
                 legacy: bool = False) -> None:
        self.fake, self.ptr, self.device = fake, ptr, device
        self.blocking, self.legacy = blocking, legacy
        self.queue: deque[Item] = deque()

    def __repr__(self) -> str:
        kind = "legacy" if self.legacy else ("blocking" if self.blocking else "non-blocking")
        return f"<stream {self.ptr:#x} dev {self.device} {kind}, {len(self.queue)} queued>"


class FEvent:
    def __init__(self, ptr: int, device: int) -> None:
        self.ptr, self.device = ptr, device
        self.recorded = 0
        self.done_gens: set[int] = set()
        self.markers: dict[int, Item] = {}


class Gate:
    """Holds a stream (a long kernel) until the test opens it."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.opened = False

    def open(self) -> None:
        with self.fake.cond:
            self.opened = True
            self.fake.cond.notify_all()


class FakeCuda:
    """The fake's state: devices, streams, events, registered host ranges, a call log."""

    def __init__(self, num_devices: int = 2, sm_count: int = 8,
                 can_use_host_pointer: bool = True, sync_timeout_s: float = 10.0) -> None:
        self.num_devices, self.sm_count = num_devices, sm_count
        self.can_use_host_pointer = can_use_host_pointer
        self.sync_timeout_s = sync_timeout_s
        self.cond = threading.Condition(threading.RLock())
        self._seq = itertools.count()
        self._ptrs = itertools.count(0x1000, 0x10)
        self._tls = threading.local()
        self.legacy = {d: FStream(self, LEGACY, d, True, legacy=True) for d in range(num_devices)}
        self.streams: dict[int, FStream] = {}
        self.events: dict[int, FEvent] = {}
        self.registered: dict[int, tuple[int, int]] = {}  # start -> (size, device)
        self.faulted: dict[int, int] = {}
        self.log: list[tuple[Any, ...]] = []
        self.executed: list[str] = []
        self.fail_launches: deque[int] = deque()
        self.fault_kernels: deque[int] = deque()
        self.fail_calls: dict[str, list[int]] = {}  # call -> [status, calls to let pass]
        self.contexts: list[tuple[int, str]] = []  # (device, thread) as first created
        self.pinned: list[weakref.ref[Any]] = []  # every cupyx.empty_pinned array
        #: called once, with no lock held, after the next host sync of a cupy Stream
        self.after_stream_sync: Callable[[], None] | None = None

    # ------------------------------------------------------------ thread state

    @property
    def device(self) -> int:
        return getattr(self._tls, "device", 0)

    def set_device(self, device: int) -> None:
        """cudaSetDevice (CUDA 12): the device's primary context exists afterwards."""
        if not 0 <= device < self.num_devices:
            raise CUDARuntimeError(INVALID_DEVICE)
        self._tls.device = device
        self._make_current(device)

    def touch(self) -> None:
        """A runtime call that needs a context: the current device's, made on first use."""
        if getattr(self._tls, "ctx", None) is None:
            self._make_current(self.device)

    def ctx_current(self) -> int:
        """cuCtxGetCurrent: 0 while the thread has no context."""
        ctx = getattr(self._tls, "ctx", None)
        return 0 if ctx is None else 0xC0 + ctx

    def _make_current(self, device: int) -> None:
        with self.cond:
            if all(d != device for d, _ in self.contexts):
                name = threading.current_thread().name
                self.contexts.append((device, name))
                self.log.append(("context", device, name))
        self._tls.ctx = device

    def context_devices(self) -> set[int]:
        return {d for d, _ in self.contexts}

    def _current(self, api: str) -> dict[int, int]:
        """The calling thread's current stream per device, of ``api``: torch and cupy each
        keep their own (``torch.cuda.stream`` does not change where a cupy launch goes, nor
        ``with cupy_stream`` torch's: a cupy launch under a torch stream context alone runs
        on cupy's current stream, the legacy one in a thread that never entered one)."""
        if not hasattr(self._tls, "current"):
            self._tls.current = {"torch": {}, "cupy": {}}
        return self._tls.current[api]  # type: ignore[no-any-return]

    def current_stream_ptr(self, device: int | None = None, api: str = "cupy") -> int:
        return self._current(api).get(self.device if device is None else device, LEGACY)

    def set_current_stream(self, ptr: int, api: str = "torch") -> None:
        """torch.cuda.set_stream (the model thread's stream): per thread, per device."""
        s = self.resolve(ptr)
        self._current(api)[s.device] = ptr

    @contextmanager
    def using_stream(self, ptr: int, api: str = "cupy") -> Iterator[None]:
        """``with cupy_stream`` (or ``torch.cuda.stream(s)`` with ``api="torch"``)."""
        s = self.resolve(ptr)
        cur = self._current(api)
        old = cur.get(s.device, LEGACY)
        cur[s.device] = ptr
        try:
            yield
        finally:
            cur[s.device] = old

    # ------------------------------------------------------------ objects

    def resolve(self, ptr: int, device: int | None = None) -> FStream:
        """The stream of a handle; 0 is the legacy stream of ``device`` (None: current)."""
        if ptr == LEGACY:
            return self.legacy[self.device if device is None else device]
        s = self.streams.get(ptr)
        if s is None:
            raise CUDARuntimeError(INVALID_HANDLE)
        return s

    def new_stream(self, non_blocking: bool = True, device: int | None = None) -> int:
        with self.cond:
            dev = self.device if device is None else device
            s = FStream(self, next(self._ptrs), dev, blocking=not non_blocking)
            self.streams[s.ptr] = s
            self.log.append(("stream", dev, s.ptr))
            return s.ptr

    def new_event(self) -> FEvent:
        with self.cond:
            ev = FEvent(next(self._ptrs), self.device)
            self.events[ev.ptr] = ev
            self.log.append(("event", self.device, ev.ptr))
            return ev

    def check_alive(self, device: int | None = None, call: str | None = None) -> None:
        status = self.faulted.get(self.device if device is None else device)
        if status is not None:
            raise CUDARuntimeError(status)
        if call is not None and call in self.fail_calls:
            plan = self.fail_calls[call]
            if plan[1] == 0:
                del self.fail_calls[call]
                raise CUDARuntimeError(plan[0])
            plan[1] -= 1

    def fail_next(self, call: str, status: int, after: int = 0) -> None:
        """Runtime call ``call`` ("eventRecord", "streamWaitEvent", ...) fails once, after
        ``after`` more successful calls (a sticky status is not modelled here)."""
        self.fail_calls[call] = [status, after]

    # ------------------------------------------------------------ enqueue

    def _push(self, stream: FStream, kind: str, label: str, **kw: Any) -> Item:
        item = Item(next(self._seq), stream, kind, label, **kw)
        stream.queue.append(item)
        return item

    def record(self, ev_ptr: int, stream_ptr: int) -> None:
        with self.cond:
            self.check_alive(call="eventRecord")
            s, ev = self.resolve(stream_ptr), self.events[ev_ptr]
            if ev.device != s.device:
                raise CUDARuntimeError(INVALID_HANDLE)  # an event records on its own device
            ev.recorded += 1
            ev.markers[ev.recorded] = self._push(s, "record", f"record {ev_ptr:#x}", event=ev,
                                                 gen=ev.recorded)
            self.log.append(("record", ev_ptr, s.ptr, s.device))

    def stream_wait(self, stream_ptr: int, ev_ptr: int) -> None:
        with self.cond:
            self.check_alive(call="streamWaitEvent")
            s, ev = self.resolve(stream_ptr), self.events[ev_ptr]
            self.log.append(("wait", s.ptr, ev_ptr, s.device))
            if ev.recorded and ev.recorded not in ev.done_gens:
                self._push(s, "wait", f"wait {ev_ptr:#x}", event=ev, gen=ev.recorded)

    def enqueue(self, stream_ptr: int, fn: Callable[[], None], label: str = "host") -> None:
        """The test's own work on a stream (a model kernel: write, or snapshot, bytes)."""
        with self.cond:
            self._push(self.resolve(stream_ptr), "host", label, fn=fn)

    def hold(self, stream_ptr: int, label: str = "hold") -> Gate:
        with self.cond:
            gate = Gate(self)
            self._push(self.resolve(stream_ptr), "hold", label, gate=gate)
            return gate

    def launch(self, fn: Callable[[], None], label: str, arrays: list[FakeArray],
               grid: tuple[int, ...] = ()) -> None:
        """A kernel launch on the current stream of the current device."""
        with self.cond:
            self.check_alive()
            if self.fail_launches:
                status = self.fail_launches.popleft()
                if status in _STICKY:
                    self.faulted[self.device] = status
                raise CUDARuntimeError(status)
            s = self.resolve(self.current_stream_ptr())
            if s.device != self.device or any(a.device != self.device for a in arrays):
                raise CUDARuntimeError(INVALID_HANDLE)
            self.log.append(("launch", self.device, s.ptr, label, grid))
            fault = self.fault_kernels.popleft() if self.fault_kernels else None
            self._push(s, "kernel", label, fn=fn if fault is None else _faulting(fault))

    def fail_next_launch(self, status: int) -> None:
        self.fail_launches.append(status)

    def fault_next_kernel(self, status: int = ILLEGAL_ADDRESS) -> None:
        """The next kernel launched faults when it runs (an asynchronous error)."""
        self.fault_kernels.append(status)

    # ------------------------------------------------------------ running

    def _blocker(self, item: Item) -> Item | Gate | None:
        """What must happen before ``item`` can run (None: it can run now)."""
        s = item.stream
        if s.queue[0] is not item:
            return s.queue[0]
        if item.kind == "wait" and item.event is not None and item.gen not in item.event.done_gens:
            return item.event.markers[item.gen]
        if item.kind == "hold" and item.gate is not None and not item.gate.opened:
            return item.gate
        if s.legacy:
            for b in self.streams.values():
                if b.device == s.device and b.blocking and b.queue and b.queue[0].seq < item.seq:
                    return b.queue[0]
        elif s.blocking:
            lq = self.legacy[s.device].queue
            if lq and lq[0].seq < item.seq:
                return lq[0]
        return None

    def _run(self, item: Item) -> None:
        s = item.stream
        assert s.queue[0] is item
        s.queue.popleft()
        item.done = True
        self.executed.append(item.label)
        if item.kind == "record" and item.event is not None:
            item.event.done_gens.add(item.gen)
        elif item.fn is not None:
            try:
                item.fn()
            except KernelFault as f:
                self.faulted[s.device] = f.status
                for other in [self.legacy[s.device], *self.streams.values()]:
                    if other.device == s.device:
                        other.queue.clear()  # a dead context runs nothing again
        self.cond.notify_all()

    def _step_towards(self, target: Item) -> bool:
        """Run one item on the way to ``target``; False if a closed gate blocks it."""
        path: list[Item] = []
        cur = target
        while True:
            b = self._blocker(cur)
            if b is None:
                self._run(cur)
                return True
            if isinstance(b, Gate):
                return False
            if b in path:
                raise AssertionError(f"fake CUDA: dependency cycle through {b.label}")
            path.append(cur)
            cur = b

    def _advance(self, target: Item, device: int) -> None:
        deadline = time.monotonic() + self.sync_timeout_s
        while not target.done and device not in self.faulted:
            if not self._step_towards(target):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"fake CUDA: host sync on {target.label} blocked "
                                         f"for {self.sync_timeout_s} s by a held stream")
                self.cond.wait(min(left, 0.05))
        self.check_alive(device)

    def sync_stream(self, ptr: int, device: int | None = None) -> None:
        with self.cond:
            s = self.resolve(ptr, device)
            self.check_alive(s.device, call="streamSynchronize")
            self.log.append(("sync_stream", s.ptr))
            if s.queue:
                self._advance(s.queue[-1], s.device)

    def sync_event(self, ev: FEvent) -> None:
        with self.cond:
            self.check_alive(ev.device, call="eventSynchronize")
            self.log.append(("sync_event", ev.ptr))
            if ev.recorded and ev.recorded not in ev.done_gens:
                self._advance(ev.markers[ev.recorded], ev.device)

    def query(self, ev: FEvent) -> bool:
        with self.cond:
            self.check_alive(ev.device)
            return ev.recorded == 0 or ev.recorded in ev.done_gens

    def drain(self, *ptrs: int) -> int:
        """Run items of the given streams, first runnable by priority, until none can run
        (items these need on other streams do not run). Returns how many ran."""
        ran = 0
        with self.cond:
            order = [self.resolve(p) for p in ptrs]
            while True:
                for s in order:
                    if s.queue and self._blocker(s.queue[0]) is None:
                        self._run(s.queue[0])
                        ran += 1
                        break
                else:
                    return ran

    def drain_all(self) -> int:
        with self.cond:
            ptrs = [LEGACY] if self.device in self.legacy else []
            return self.drain(*ptrs, *self.streams)

    def pending(self, ptr: int) -> int:
        with self.cond:
            return len(self.resolve(ptr).queue)

    def pending_total(self, device: int | None = None) -> int:
        with self.cond:
            streams = [*self.legacy.values(), *self.streams.values()]
            return sum(len(s.queue) for s in streams if device is None or s.device == device)

    # ------------------------------------------------------------ host memory

    def host_register(self, ptr: int, size: int, flags: int) -> None:
        with self.cond:
            self.check_alive()
            for start, (sz, _) in self.registered.items():
                if start < ptr + size and ptr < start + sz:
                    raise CUDARuntimeError(712)  # cudaErrorHostMemoryAlreadyRegistered
            self.registered[ptr] = (size, self.device)
            self.log.append(("hostRegister", self.device, ptr, size, flags))

    def host_unregister(self, ptr: int) -> None:
        with self.cond:
            if self.registered.pop(ptr, None) is None:
                raise CUDARuntimeError(713)  # cudaErrorHostMemoryNotRegistered
            self.log.append(("hostUnregister", self.device, ptr))

    def registered_at(self, ptr: int, size: int = 1) -> bool:
        return any(s <= ptr and ptr + size <= s + sz for s, (sz, _) in self.registered.items())

    def pointer_attributes(self, ptr: int) -> Any:
        with self.cond:
            pinned = self.registered_at(ptr)  # mapped at its host address (UVA)
            return types.SimpleNamespace(type=1 if pinned else 0, devicePointer=ptr * pinned)


class KernelFault(Exception):
    """Raised by a kernel item when it runs: the device faults with ``status``."""

    def __init__(self, status: int) -> None:
        self.status = status


def _faulting(status: int) -> Callable[[], None]:
    def run() -> None:
        raise KernelFault(status)

    return run


# -------------------------------------------------------------------- installing it


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeCuda) -> None:
    """Put the fake ``cupy`` in ``sys.modules`` and point torch.cuda's device and stream
    calls at it (torch tensors themselves stay on the CPU)."""
    from tests.kernels.fake_cupy import make_cupy

    cupy, cupyx = make_cupy(fake)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    tc = torch.cuda

    def set_device(d: Any) -> None:
        fake.set_device(int(d))
        fake.log.append(("torch.set_device", int(d)))

    def current_stream(device: Any = None) -> Any:
        dev = None if device is None else int(getattr(device, "index", device))
        return types.SimpleNamespace(cuda_stream=fake.current_stream_ptr(dev, api="torch"))

    class ExternalStream:
        def __init__(self, stream_ptr: int, device: Any = None) -> None:
            self.cuda_stream = stream_ptr

    monkeypatch.setattr(tc, "is_available", lambda: True)
    monkeypatch.setattr(tc, "device_count", lambda: fake.num_devices)
    monkeypatch.setattr(tc, "current_device", lambda: fake.device)
    monkeypatch.setattr(tc, "set_device", set_device)
    monkeypatch.setattr(tc, "current_stream", current_stream)
    monkeypatch.setattr(tc, "ExternalStream", ExternalStream)
    monkeypatch.setattr(tc, "stream", lambda s: fake.using_stream(s.cuda_stream, api="torch"))
    # The fake's device memory is host memory: CPU tensors pass the backend's device check.
    from zkv.kernels.cupy_backend import CupyBackend

    check = CupyBackend.check_devices

    def check_devices(self: Any, spec: Any, layers: Any) -> None:
        if spec.device.type != "cpu":
            check(self, spec, layers)

    monkeypatch.setattr(CupyBackend, "check_devices", check_devices)


def cupy_backend(device: int | None = None, **kw: Any) -> Any:
    """A CupyBackend on the installed fake (its caches are CPU tensors)."""
    from zkv.kernels.cupy_backend import CupyBackend

    return CupyBackend(device=device, **kw)


def launches(fake: FakeCuda) -> list[tuple[Any, ...]]:
    return [e for e in fake.log if e[0] == "launch"]
