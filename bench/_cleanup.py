"""What a bench leaves behind. ``exit_on_sigterm``: a SIGTERM (a timeout's) exits through
the ``finally`` blocks and context managers, so servers, worker groups and scratch
directories are stopped and removed (Python's default dies at once; the servers also die
with the bench, by ``PR_SET_PDEATHSIG``, for a SIGKILL). ``scratch_dir``: removed after a
run that ended well, kept (and named on stderr) after one that failed, for the logs in it;
a ``--workdir`` is the caller's and stays. (vLLM's ipc sockets: ``vllm_sockets_here`` in
tests/integration/vllm_server.py, shared with the tests.)"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from zkv import stopsignals


def exit_on_sigterm() -> None:
    """SIGTERM exits (143) and SIGINT raises ``KeyboardInterrupt``, through the cleanup;
    a bench calls ``stopsignals.check()`` after it spawns (zkv/stopsignals.py: a signal
    during a fork was lost, and the bench ran on)."""
    stopsignals.exit_on_stop_signals()


@contextmanager
def scratch_dir(prefix: str, workdir: str | None = None) -> Iterator[str]:
    if workdir:
        os.makedirs(workdir, exist_ok=True)
        yield workdir
        return
    d = tempfile.mkdtemp(prefix=prefix)
    try:
        yield d
    except BaseException:
        print(f"{os.path.basename(sys.argv[0])}: the run failed; its files are in {d}",
              file=sys.stderr)
        raise
    shutil.rmtree(d, ignore_errors=True)
