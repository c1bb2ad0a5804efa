"""zkv/stopsignals.py: a stop signal whose exception Python dropped (it came while an
at-fork hook ran) is raised again by the next ``check()``, quietly; the soak and the benches
call it after each spawn. (Before: the signal was lost, and the soak ran its full time.)"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The signal arrives exactly while the parent runs Python's at-fork hooks (as a SIGTERM sent
# while the soak starts its ranks can): the handler's exception is dropped there.
_CHILD = r"""
import os, signal, subprocess, sys
from zkv import stopsignals
sig, use = int(sys.argv[1]), sys.argv[2]
if use == "zkv":
    stopsignals.exit_on_stop_signals()
else:  # what zkv soak and the benches had
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), sig))
try:
    subprocess.Popen(["true"], preexec_fn=lambda: None).wait()
    if use == "zkv":
        stopsignals.check()
    print("ran on", flush=True)
finally:
    print("cleanup ran", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_a_fork_stops_the_program_through_its_cleanup(sig: int) -> None:
    run = lambda use: subprocess.run(  # noqa: E731
        [sys.executable, "-c", _CHILD, str(int(sig)), use], capture_output=True, text=True,
        timeout=60, cwd=ROOT)
    p = run("zkv")
    assert p.returncode == (128 + sig if sig == signal.SIGTERM else -sig), p  # (as Ctrl-C)
    assert p.stdout == "cleanup ran\n", p  # stopped at check(), through the finally block
    assert "Exception ignored" not in p.stderr, p.stderr  # (the dropped one: said nothing)
    if sig == signal.SIGINT:
        assert p.stderr.rstrip().endswith("KeyboardInterrupt"), p.stderr
    else:
        assert p.stderr == "", p.stderr
        old = run("plain")  # the handler zkv soak had: the signal lost, the program ran on
        assert old.returncode == 0 and old.stdout == "ran on\ncleanup ran\n", old
        assert "Exception ignored" in old.stderr


# A stop signal lands inside ``ctx.socket()``: after libzmq made the socket, before the
# context knew it (pyzmq adds it last). The exception's traceback holds the socket, so
# neither its finalizer nor ``ctx.destroy`` closed it, and ``term()`` waited for it forever:
# a signalled ``zkv soak`` hung in its close (a few in a hundred, under load).
_SOCKET_CHILD = r"""
import os, signal, sys, tempfile, threading
import zmq
from zkv import stopsignals
from zkv.scheduler.dispatcher import Dispatcher

stopsignals.exit_on_stop_signals()
made = [0]
nth = 0

class Signalled(zmq.Socket):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        made[0] += 1
        if made[0] == nth:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before ctx.socket returns

zmq.Context._socket_class = Signalled
d = tempfile.mkdtemp(dir="/tmp")
held = []  # the exceptions, as an except block (or pytest.raises) keeps them
for own in (False, True):
    for nth in range(1, 6):  # the ZAP handler's 3 sockets, the XPUB, the PULL
        made[0] = 0
        ctx = None if own else zmq.Context()
        try:
            Dispatcher(f"ipc://{d}/pub", f"ipc://{d}/pull", 1, "fp", context=ctx)
            print("no signal", flush=True)
        except SystemExit as e:
            held.append(e)
        if ctx is not None:
            t = threading.Thread(target=ctx.destroy, kwargs={"linger": 0}, daemon=True)
            t.start()
            t.join(10)
            if t.is_alive():
                print(f"own={own} nth={nth}: destroy hung", flush=True)
                os._exit(1)
        print(f"own={own} nth={nth}: ok", flush=True)
"""


def test_a_stop_signal_while_a_dispatcher_makes_a_socket_leaves_no_socket_open() -> None:
    """... now each socket is made whole or closed before the signal is raised
    (``security.new_socket``, ``stopsignals.atomic``), at each of the dispatcher's five
    sockets, with the caller's context (destroyed after) or the dispatcher's own."""
    try:
        p = subprocess.run([sys.executable, "-c", _SOCKET_CHILD], capture_output=True,
                           text=True, timeout=90, cwd=ROOT)
    except subprocess.TimeoutExpired as e:  # (the dispatcher's own context: term() hung)
        pytest.fail(f"hung: {e.stdout!r}")
    want = [f"own={own} nth={n}: ok" for own in (False, True) for n in range(1, 6)]
    assert (p.returncode, p.stdout.splitlines()) == (0, want), p
