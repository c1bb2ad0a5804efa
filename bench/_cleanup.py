"""What a bench leaves behind. ``exit_on_sigterm``: a SIGTERM (a timeout's) exits through
the ``finally`` blocks and context managers, so servers, worker groups and scratch
directories are stopped and removed (Python's default dies at once; the servers also die
with the bench, by ``PR_SET_PDEATHSIG``, for a SIGKILL). ``scratch_dir``: removed after a
run that ended well, kept (and named on stderr) after one that failed, for the logs in it;
a ``--workdir`` is the caller's and stays. ``vllm_sockets_here``: the vLLM engines a bench
starts put their ipc sockets (``VLLM_RPC_BASE_PATH``, which vLLM never cleans: a dozen
``/tmp/<uuid>`` files a run) in a directory of the bench's own, removed with it."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


def exit_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


@contextmanager
def vllm_sockets_here() -> Iterator[None]:
    """Unless the caller chose a ``VLLM_RPC_BASE_PATH``; the engines' processes inherit it."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        yield
        return
    d = tempfile.mkdtemp(prefix="zkv-vllm-rpc-")
    os.environ["VLLM_RPC_BASE_PATH"] = d
    try:
        yield
    finally:
        del os.environ["VLLM_RPC_BASE_PATH"]
        shutil.rmtree(d, ignore_errors=True)


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
