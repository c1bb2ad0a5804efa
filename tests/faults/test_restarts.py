"""The scheduler restarted while its workers live: the workers see a new connection, start
over at seq 0 and say hello again; the new scheduler (an empty tree) admits them and the
group goes on. And zkv replay with a rank killed mid-run: --max-restarts restarts the
whole group, which then finishes with every reused block verified."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.waiting import wait_until
from tests.worker.helpers import (
    children_of,
    cmdline,
    endpoints,
    poll_until_done,
    reap,
    worker_env,
)
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.scheduler.dispatcher import Dispatcher

LAYOUT = CacheLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=8,
                     num_device_blocks=8, num_host_blocks=8, world_size=2)
ROOT = str(Path(__file__).resolve().parents[2])

SCHEDULER = r'''
import signal, sys
from zkv import log, protocol as P
from zkv.config import CacheLayout
from zkv.scheduler.dispatcher import Dispatcher
log.configure("scheduler", level="warning", stream=sys.stderr)
layout = CacheLayout.from_json(sys.argv[3])
d = Dispatcher(sys.argv[1], sys.argv[2], layout.world_size, layout)
d.wait_for_ranks(60)
ids, keys = P.as_ids([0, 1]), (b"a" * 16, b"b" * 16)
seq = d.publish([P.Op(1, P.FILL, dst=ids, keys=keys)], step=0)
while not any(b.seq == seq and b.ok for b in d.poll(1.0)):
    pass
print("ready", flush=True)
signal.pause()  # until the test kills it
'''


def _group(pub: str, pull: str, logs: str, scheduler_timeout_s: str, stderr: int
           ) -> tuple[list[subprocess.Popen[str]], subprocess.Popen[str]]:
    """Two ``zkv.worker`` ranks and the scheduler above, which prints "ready" once both
    joined and filled a block."""
    ranks = [subprocess.Popen([sys.executable, "-m", "zkv.worker"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                              env=worker_env(r, LAYOUT.to_json(), pub, pull, ZKV_LOG_DIR=logs,
                                             ZKV_SCHEDULER_TIMEOUT_S=scheduler_timeout_s))
             for r in range(2)]
    sched = subprocess.Popen([sys.executable, "-c", SCHEDULER, pub, pull, LAYOUT.to_json()],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    return ranks, sched


def _end(sched: subprocess.Popen[str]) -> None:
    if sched.poll() is None:
        sched.kill()  # a stopped (SIGSTOP) process too
        sched.wait()
    if sched.stdout is not None:
        sched.stdout.close()


def test_scheduler_killed_and_restarted_while_workers_live(folder: str) -> None:
    pub, pull = endpoints(folder)
    # (a scheduler back within the ranks' ZKV_SCHEDULER_TIMEOUT_S: they wait for it)
    ranks, old = _group(pub, pull, os.path.join(folder, "logs"), "20", subprocess.DEVNULL)
    d = None
    try:
        assert old.stdout is not None and old.stdout.readline() == "ready\n"
        old.kill()  # no Shutdown, no close: gone
        old.wait()
        d = Dispatcher(pub, pull, 2, LAYOUT)
        d.wait_for_ranks(60)  # the ranks said hello again
        keys = (b"a" * 16, b"b" * 16)
        seq = d.publish([P.Op(1, P.CHECK, src=P.as_ids([0, 1]), keys=keys)], step=0)
        assert seq == 0
        done = poll_until_done(d, seq, 30)[seq]
        # the blocks the first scheduler had filled are still in the ranks' caches (the new
        # scheduler would not use them: its tree is empty, but the bytes are intact)
        assert done.ok and done.results[1].done == 2
        for rank in range(2):
            with open(os.path.join(folder, "logs", f"worker-{rank}.jsonl"), "rb") as f:
                events = [orjson.loads(line)["event"] for line in f]
            assert events.count("worker.scheduler_lost") == 1
            assert events.count("worker.scheduler_rejoined") == 1
    finally:
        _end(old)
        if d is not None:
            d.close(shutdown=True)
        codes = reap(ranks)
    assert codes == [0, 0]


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_ranks_whose_scheduler_is_gone_for_good_stop_after_the_timeout(folder: str,
                                                                     how: str) -> None:
    """The scheduler killed and never back (a node 0 that died), or frozen with its
    connections open (SIGSTOP: a host that stopped answering, no FIN; libzmq's pings time
    out): each rank stops after ZKV_SCHEDULER_TIMEOUT_S with exit 5 and one line naming
    it, not a wait forever."""
    pub, pull = endpoints(folder)
    logs = os.path.join(folder, "logs")
    ranks, old = _group(pub, pull, logs, "1", subprocess.PIPE)
    try:
        assert old.stdout is not None and old.stdout.readline() == "ready\n"
        if how == "killed":
            old.kill()
            old.wait()
        else:
            old.send_signal(signal.SIGSTOP)
        codes = [p.wait(timeout=30) for p in ranks]
        errors = [p.stderr.read() for p in ranks if p.stderr is not None]
    finally:
        _end(old)
        reap(ranks)
        for p in ranks:
            if p.stderr is not None:
                p.stderr.close()
    assert codes == [5, 5], errors
    for rank, err in enumerate(errors):
        assert re.fullmatch(rf"zkv\.worker: rank {rank}: the scheduler has been unreachable for "
                            rf"\d+\.\d s \(scheduler timeout 1 s\) at {re.escape(pub)}\n",
                            err), err
        with open(os.path.join(logs, f"worker-{rank}.jsonl"), "rb") as f:
            events = [orjson.loads(line) for line in f]
        lost = [e for e in events if e["event"] == "worker.scheduler_lost"]
        assert len(lost) == 1 and lost[0]["last_seq"] == 0 and lost[0]["timeout_s"] == 1.0


def _replay_killing_a_rank(tmp_path: Path, *flags: str) -> tuple[int, str, str]:
    """``zkv replay`` (80 requests), its last rank SIGKILLed once batches flow: (status,
    stdout, stderr)."""
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--requests", "80",
         "--log-dir", str(logs), "--store-dir", str(tmp_path / "l3"), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    ranks: list[int] = []

    def flowing() -> bool:  # the ranks of the first group, once batches flow
        assert proc.poll() is None
        sched = logs / "scheduler.jsonl"
        if sched.exists() and sched.read_text().count("dispatcher.batch_acked") >= 5:
            ranks[:] = [c for c in children_of(proc.pid) if "zkv.worker" in cmdline(c)]
        return bool(ranks)

    try:
        wait_until(flowing, 120, "batches acked by the first group", interval=0.02)
        os.kill(ranks[-1], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_replay_that_loses_a_rank_still_writes_its_metrics(tmp_path: Path) -> None:
    """Without restarts: zkvrun tears the group down with SIGTERM, and the scheduler node
    ends as for Ctrl-C: its metrics file, its pools' check and the dispatcher's close. (It
    died of the signal at once: the failed run, the one whose numbers matter, left none.)"""
    metrics = tmp_path / "metrics.txt"
    code, out, err = _replay_killing_a_rank(tmp_path, "--metrics-file", str(metrics))
    assert code == 1, out + err
    assert "no restarts left" in err, err
    assert metrics.exists(), err
    text = metrics.read_text()
    batches = next(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("zkv:batches_total "))
    assert batches >= 5, text
    sched = (tmp_path / "logs" / "scheduler.jsonl").read_text()
    assert '"dispatcher.stopped"' in sched


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_replay_with_a_rank_killed_restarts_the_group_and_finishes(tmp_path: Path) -> None:
    code, out, err = _replay_killing_a_rank(tmp_path, "--max-restarts", "1")
    assert code == 0, out + err
    # zkvrun sees the rank die (or the scheduler fail on the lost rank) and restarts all
    assert "then restarting the group (1/1)" in err, err
    assert re.search(r"verified\s+\d+ reused blocks checked byte-for-byte on every rank, "
                     r"0 mismatched; 0 failed ops", out), out
    assert re.search(r"requests\s+80 ", out)


# Installed in every process of the run (PYTHONPATH): rank 1's first check of reused blocks
# finds its first block zeroed, as after a faulty copy; only once (T_CORRUPTED marks it),
# so a rerun of the group would verify clean.
CORRUPT_ONCE = '''
import os
if os.environ.get("ZKV_ROLE") == "worker" and os.environ.get("RANK") == "1":
    import zkv.kernels.reference as ref
    real = ref.check_pattern
    def check_pattern(kv_caches, dev_ids, keys, rank):
        if len(keys):
            try:
                os.close(os.open(os.environ["T_CORRUPTED"], os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                first = ref.torch.as_tensor(ref.as_index(dev_ids, "dev_ids")[:1])
                for pair in kv_caches:
                    for t in pair:
                        t[first] = 0
        return real(kv_caches, dev_ids, keys, rank)
    ref.check_pattern = check_pattern
'''


def test_a_mismatch_is_not_hidden_by_a_restart(tmp_path: Path) -> None:
    """Wrong bytes are the run's result, not a fault a rerun may clear: with --max-restarts
    the group is not started again and the status is 1. Before, the node's exit 1 (mismatch)
    restarted the group, whose clean rerun ended the replay with status 0."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CORRUPT_ONCE)
    path = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")]), ROOT])
    env = {**os.environ, "PYTHONPATH": path, "T_CORRUPTED": str(tmp_path / "corrupted")}
    r = subprocess.run([sys.executable, "-m", "zkv.cli", "replay", "--no-progress",
                        "--requests", "12", "--log-dir", str(tmp_path / "logs"), "--store-dir",
                        str(tmp_path / "l3"), "--max-restarts", "1"],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert (tmp_path / "corrupted").exists(), r.stderr  # the hook ran
    assert r.returncode == 1, r.stdout + r.stderr
    assert "restarting the group" not in r.stderr, r.stderr
    assert r.stdout.count("zkv replay: workload=") == 1, r.stdout  # one summary, the failed one
    assert re.search(r"verified\s+\d+ reused blocks .*, [1-9]\d* mismatched", r.stdout), r.stdout
