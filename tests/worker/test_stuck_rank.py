"""A rank that seems stuck can be looked into: ``kill -USR1`` makes ``python -m zkv.worker``
print every thread's Python stack to its stderr and go on serving, and a test whose ranks
never join says what each process was doing (exit status, or kernel state and stacks)
instead of only "no hello" (CI once timed out so, with nothing else to go on)."""

from __future__ import annotations

import re
import signal

import pytest

from tests.worker.helpers import (
    STDERR_TAILS,
    WorkerGroup,
    handles_signal,
    short_ipc_dir,
)
from zkv import protocol as P
from zkv.config import CacheLayout

LAYOUT = CacheLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16",
                     num_device_blocks=4, num_host_blocks=4, world_size=1)


def test_sigusr1_prints_the_stacks_and_the_rank_serves_on() -> None:
    with short_ipc_dir() as folder:
        group = WorkerGroup(folder, 1, LAYOUT)
        try:
            pid = group.procs[0].pid
            # One batch served first: the actor is in its loop (its hello comes before the
            # heartbeat thread starts; a signal then showed that start, not _loop)
            assert group.run([]).ok
            assert handles_signal(pid, signal.SIGUSR1)
            assert re.fullmatch(rf"rank 0 pid {pid} state [RS], waits in \S+, [\d.]+ s CPU",
                                group.describe_procs())  # sent SIGUSR1, waited for them
            stacks = group.stderr(0)
            assert "zkv/worker/actor.py" in stacks and "in _loop" in stacks, stacks
            assert "Thread 0x" in stacks  # every thread (heartbeats, parent watch), not one
            done = group.run([P.Op(1, P.D2H, src=P.as_ids([0]), dst=P.as_ids([1]))])
            assert done.ok and done.lost_ranks == frozenset()
        finally:
            codes = group.close()
    assert codes == [0]


def test_ranks_that_never_join_are_described() -> None:
    with short_ipc_dir() as folder:
        # its acks go to a socket no one reads: it runs, but its hello never arrives
        lost = {"ZKV_PULL_ENDPOINT": f"ipc://{folder}/nowhere"}
        with pytest.raises(TimeoutError) as err:
            WorkerGroup(folder, 1, LAYOUT, join_timeout_s=1.0, extra_env=lost)
    message = str(err.value)
    assert message.startswith("ranks [0] of 1 did not join within 1.0 s: rank 0: no hello; ")
    assert re.search(r"; processes: rank 0 pid \d+ (state [RSD], waits in \S+, [\d.]+ s CPU"
                     r"(, still importing \(no stacks\))?|exited with -?\d+)$", message), message
    assert [title for title, _ in STDERR_TAILS] in ([], [f"rank 0 stderr ({folder})"])
