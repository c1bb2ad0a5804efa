"""How the tests wait: never for a fixed time, always under a deadline.

- ``wait_until`` / ``holds_within``: a condition polled (or a ``step`` run between checks,
  e.g. ``dispatcher.poll``, which itself blocks on a socket) until it holds.
- ``wait_exited``: processes that end, through Linux pidfds: woken by the kernel when the
  last one exits, not by a polling interval (a zombie counts as ended: an orphan's reaper
  may take its time).
- ``idle_for``: time itself passing, where the passing is what a test checks (an idle gap
  longer than a timeout, a frozen process's silence); never a way to wait for something.

A wait that runs out raises AssertionError naming what it waited for.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Iterable
from typing import Any

#: Between two checks of a polled condition (nothing here is timed by it).
POLL_INTERVAL_S = 0.005


def holds_within(pred: Callable[[], Any], timeout: float,
                 step: Callable[[], Any] | None = None, interval: float = POLL_INTERVAL_S) -> bool:
    """Check ``pred`` until it holds or ``timeout`` passes (running ``step`` between checks,
    else waiting ``interval``); whether it held."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        if step is not None:
            step()
        else:
            time.sleep(interval)
    return True


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, what: str = "condition",
               step: Callable[[], Any] | None = None, interval: float = POLL_INTERVAL_S) -> None:
    """:func:`holds_within`, or AssertionError after ``timeout``."""
    if not holds_within(pred, timeout, step, interval):
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def idle_for(seconds: float, beat: Callable[[], Any] | None = None,
             every: float = 0.05) -> None:
    """Let ``seconds`` pass, running ``beat`` (a heartbeat, say) every ``every`` s meanwhile."""
    end = time.monotonic() + seconds
    while True:
        if beat is not None:
            beat()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(every, left) if beat is not None else left)


def exited(pid: int) -> bool:
    """Whether ``pid`` has ended (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_exited(pids: Iterable[int], timeout: float, what: str = "processes") -> None:
    """Until every process in ``pids`` has ended; AssertionError naming those still running
    after ``timeout``. Not a poll: a pidfd per process, and ``poll(2)`` on them."""
    fds: dict[int, int] = {}
    try:
        for pid in set(pids):
            try:
                fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:  # gone (and reaped) already
                continue
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        running = set(fds)
        deadline = time.monotonic() + timeout
        while running:
            left_ms = (deadline - time.monotonic()) * 1e3
            if left_ms <= 0:
                raise AssertionError(f"{what} still running after {timeout} s: "
                                     f"{sorted(fds[fd] for fd in running)}")
            for fd, _ in poller.poll(left_ms):
                poller.unregister(fd)
                running.discard(fd)
    finally:
        for fd in fds:
            os.close(fd)
