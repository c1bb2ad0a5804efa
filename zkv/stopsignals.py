"""Stop signals (SIGINT, SIGTERM) of a long-running command (``zkv soak``, the benches):
each exits through the ``finally`` blocks and context managers (ranks reaped, servers
stopped, run directories removed), and none is lost.

Python drops an exception that a signal handler raises while the interpreter runs an
at-fork hook (each ``subprocess.Popen`` with a ``preexec_fn`` runs logging's in the parent)
or a finalizer: it prints "Exception ignored in ..." and the program runs on. A SIGTERM or
Ctrl-C that came while the soak or a bench started its ranks was lost so (under load, 6 of
30 SIGINTs and 5 of 16 SIGTERMs to the soak, which then ran its full time; 3 of 12 to
``bench/pipeline.py``). So the handler records the signal as well as raising, and the
program calls :func:`check` after each spawn and at the top of its loops, where a signal
whose exception was dropped is raised again (and ``sys.unraisablehook`` keeps the dropped
one's "Exception ignored" traceback off stderr: it is not lost)::

    signal ─► handler: record, raise ─► propagates ─► finally blocks, exit 128 + signum
                                  └─ dropped (at-fork hook) ─► next check(): raise again
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # (a closed terminal: 129)
_received: list[int] = []
T = TypeVar("T")


def exit_on_stop_signals(signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """SIGINT raises ``KeyboardInterrupt``, SIGTERM / SIGHUP ``SystemExit(128 + signum)``;
    each recorded."""
    for s in signals:
        signal.signal(s, _on_signal)
    if sys.unraisablehook is not _quiet_if_stop:
        _default_hook.append(sys.unraisablehook)
        sys.unraisablehook = _quiet_if_stop


def check() -> None:
    """Raise a stop signal whose exception Python dropped (see the module docstring)."""
    if _received:
        _raise(_received.pop(0))


@contextmanager
def deferred(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Inside, a stop signal is only recorded; on leaving, the handlers that were there are
    back and the first signal recorded is raised again: work that must end (a scheduler
    node's cleanup, its metrics file last) is not cut short, and the signal is not lost.
    (Outside the main thread, which no signal handler interrupts, it does nothing.)"""
    got: list[int] = []
    previous = _record(signals, got)
    try:
        yield
    finally:
        _restore(previous)
        if got:
            signal.raise_signal(got[0])


def atomic(make: Callable[[], T], undo: Callable[[T], object],
           signals: tuple[int, ...] = STOP_SIGNALS) -> T:
    """``make()`` that a stop signal cannot cut in half: one that comes meanwhile is raised
    when it is done, after ``undo`` of what it made. A ZeroMQ socket a signal caught inside
    ``ctx.socket()`` (made, not yet known to the context, held by the traceback) was closed
    by no one, and ``ctx.term()`` waited for it forever: a signalled ``zkv soak`` hung."""
    made: list[T] = []
    try:
        with deferred(signals):
            made.append(make())
    except BaseException:  # (the signal, raised as ``deferred`` ends)
        if made:
            undo(made[0])
        raise
    return made[0]


def _record(signals: tuple[int, ...], got: list[int]) -> dict[int, Any]:
    """Install a handler that records into ``got``; the handlers it replaced (none outside
    the main thread; a handler set from C, not Python, is left in place)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, lambda signum, _frame: got.append(signum))
            for s in signals if signal.getsignal(s) is not None}


def _restore(previous: dict[int, Any]) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    _received.append(signum)
    _raise(signum)


def _raise(signum: int) -> None:
    e: BaseException = (KeyboardInterrupt() if signum == signal.SIGINT
                        else SystemExit(128 + signum))
    e.zkv_stop_signal = signum  # type: ignore[attr-defined]
    raise e


_default_hook: list[Any] = []


def _quiet_if_stop(unraisable: Any) -> None:
    """A stop signal's exception Python dropped says nothing: :func:`check` raises it."""
    if not hasattr(unraisable.exc_value, "zkv_stop_signal"):
        _default_hook[-1](unraisable)
