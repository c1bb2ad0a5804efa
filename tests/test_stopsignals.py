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
