"""The test servers (tests/servers.py) do not outlive the process that started them, however
it dies: a test run or a bench killed by a timeout (SIGTERM: Python's default runs no
``finally``) or SIGKILLed left its redis-server, Mooncake master and `vllm serve` running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import exited, wait_exited

ROOT = Path(__file__).resolve().parents[1]

START = """
import signal, sys
from tests.servers import MooncakeServer, RedisServer
redis = RedisServer(sys.argv[1] + "/redis")
mc = MooncakeServer(sys.argv[1] + "/mc")
print(redis.proc.pid, mc.master.pid, mc.holder.pid, flush=True)
signal.pause()  # until the test's signal
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_servers_die_with_the_process_that_started_them(tmp_path: Path, sig: int) -> None:
    p = subprocess.Popen([sys.executable, "-c", START, str(tmp_path)], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert p.stdout is not None
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 3 and not any(exited(pid) for pid in pids), pids
        p.send_signal(sig)
        p.wait(10)
        wait_exited(pids, 10, "the servers")
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
