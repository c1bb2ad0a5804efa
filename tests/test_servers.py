"""The test servers (tests/servers.py) do not outlive the process that started them, however
it dies: a test run or a bench killed by a timeout (SIGTERM: Python's default runs no
``finally``) or SIGKILLed left its redis-server, Mooncake master and `vllm serve` running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

START = """
import signal, sys
from tests.servers import MooncakeServer, RedisServer
redis = RedisServer(sys.argv[1] + "/redis")
mc = MooncakeServer(sys.argv[1] + "/mc")
print(redis.proc.pid, mc.master.pid, mc.holder.pid, flush=True)
signal.pause()  # until the test's signal
"""


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: its parent died, and init reaps it when it will)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_servers_die_with_the_process_that_started_them(tmp_path: Path, sig: int) -> None:
    p = subprocess.Popen([sys.executable, "-c", START, str(tmp_path)], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert p.stdout is not None
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 3 and not any(_gone(pid) for pid in pids), pids
        p.send_signal(sig)
        p.wait(10)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, [pid for pid in pids if not _gone(pid)]
            time.sleep(0.02)
    finally:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
        for pid in pids:  # whatever a failure left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
