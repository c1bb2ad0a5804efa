"""zkvrun whose stderr is gone: a closed terminal (writes fail with EIO) or a pipe whose
reader exited (``zkvrun ... 2>&1 | tee run.log`` and a Ctrl-C, which ends tee too: EPIPE).

Its stderr line raised out of the supervision loop: the children were SIGKILLed with no
grace (a closed terminal's SIGHUP was never forwarded), a restart was skipped, and zkvrun
exited 1. Each test failed so before ``launch.zkvrun._say``.
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import subprocess
import sys
import termios
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launch.test_zkvrun import (
    TIMEOUT_S,
    env_for,
    events,
    script,
    wait_files,
    zkvrun_cmd,
)
from zkv import log as zlog

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pty, pipes")


def _take_terminal() -> None:  # in the child, after setsid: fd 0 becomes its terminal
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # (not ignored, as under a nohup'd pytest)


def _status_after_closing(p: subprocess.Popen[bytes], fd: int, folder: Path,
                          ready: tuple[str, ...], then: Callable[[], object] | None = None
                          ) -> int:
    """Once the files ``ready`` exist, close ``fd`` (the other end of zkvrun's terminal or
    pipe), call ``then`` and return zkvrun's status; ``fd`` is closed and zkvrun killed and
    reaped whatever happens."""
    try:
        try:
            wait_files(folder, *ready)
        finally:
            os.close(fd)
        if then is not None:
            then()
        return p.wait(timeout=TIMEOUT_S)
    finally:
        p.kill()
        p.wait(timeout=TIMEOUT_S)


def test_a_closed_terminal_is_forwarded_as_sighup(tmp_path: Path) -> None:
    worker = script(tmp_path, "worker.py", r'''
def on_hup(signum, frame):
    put(f"sig-{RANK}", str(signum))
    sys.exit(0)
signal.signal(signal.SIGHUP, on_hup)
put(f"ready-{RANK}", "")
park()
''')
    logs = tmp_path / "logs"
    leader, follower = pty.openpty()
    try:
        p = subprocess.Popen(zkvrun_cmd("--nproc-per-node", "2", "--log-dir", str(logs), worker),
                             env=env_for(tmp_path), cwd=tmp_path, stdin=follower,
                             stdout=follower, stderr=follower, start_new_session=True,
                             preexec_fn=_take_terminal)
    finally:
        os.close(follower)
    # the terminal hangs up: SIGHUP to zkvrun, EIO on its stderr
    code = _status_after_closing(p, leader, tmp_path, ("ready-0", "ready-1"))
    assert code == 128 + signal.SIGHUP
    for rank in (0, 1):
        assert (tmp_path / f"sig-{rank}").read_text() == str(int(signal.SIGHUP))
    evs = events(logs)
    assert [e["signal"] for e in evs if e["event"] == zlog.SIGNAL_FORWARDED] == ["SIGHUP"]


def _zkvrun_on_a_pipe(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    """zkvrun with stdout and stderr on a pipe; the pipe's read end (the caller closes it)."""
    read_end, write_end = os.pipe()
    try:
        p = subprocess.Popen(zkvrun_cmd(*args), env=env_for(tmp_path), cwd=tmp_path,
                             stdout=write_end, stderr=write_end)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return p, read_end


def test_sigterm_with_a_gone_stderr_pipe_is_forwarded(tmp_path: Path) -> None:
    worker = script(tmp_path, "worker.py", 'record_signal(RANK)\nput(f"ready-{RANK}", "")\n'
                                           'park()\n')
    logs = tmp_path / "logs"
    p, read_end = _zkvrun_on_a_pipe(tmp_path, "--nproc-per-node", "2", "--log-dir", str(logs),
                                    worker)
    code = _status_after_closing(p, read_end, tmp_path, ("ready-0", "ready-1"),
                                 lambda: p.send_signal(signal.SIGTERM))
    assert code == 128 + signal.SIGTERM
    for rank in (0, 1):  # SIGTERM and its grace, not a SIGKILL
        assert (tmp_path / f"sig-{rank}").read_text() == str(int(signal.SIGTERM))
    codes = sorted(e["code"] for e in events(logs) if e["event"] == zlog.RANK_EXITED)
    assert codes == [0, 0]


def test_a_failure_with_a_gone_stderr_pipe_still_restarts(tmp_path: Path) -> None:
    worker = script(tmp_path, "worker.py", r'''
with open(os.path.join(OUT, "attempts"), "a") as f:
    f.write("x\n")
if open(os.path.join(OUT, "attempts")).read() == "x\n":
    wait_for("go")  # the pipe's reader is gone
    sys.exit(3)
''')
    logs = tmp_path / "logs"
    p, read_end = _zkvrun_on_a_pipe(tmp_path, "--max-restarts", "1", "--log-dir", str(logs),
                                    worker)
    code = _status_after_closing(p, read_end, tmp_path, ("attempts",),
                                 lambda: (tmp_path / "go").write_text(""))
    assert code == 0
    assert (tmp_path / "attempts").read_text() == "x\n" * 2
    evs = events(logs)
    assert [e["code"] for e in evs if e["event"] == zlog.RANK_EXITED] == [3, 0]
    assert [e["restart"] for e in evs if e["event"] == zlog.GROUP_RESTARTED] == [1]
