"""zkvrun with real processes: env, endpoints, failure teardown, restarts, scheduler, signals.

Children are small Python scripts that write files under ``$T_OUT`` (atomically, via
rename); the tests poll for those files with a deadline, never sleep to synchronize.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
import pytest

from tests.waiting import holds_within, wait_exited, wait_until
from zkv import log as zlog
from zkv.config import CacheLayout

TIMEOUT_S = 30

PRELUDE = r'''
import json, os, signal, sys, time
from tests.waiting import wait_until
OUT = os.environ["T_OUT"]
RANK = os.environ.get("RANK")

def put(name, text):
    tmp = os.path.join(OUT, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(OUT, name))

def wait_for(*names, timeout=20):
    try:
        wait_until(lambda: all(os.path.exists(os.path.join(OUT, n)) for n in names), timeout)
    except AssertionError:
        sys.exit(99)

def park():
    """Until a signal ends this process (zkvrun's, or the test's)."""
    while True:
        signal.pause()

def record_signal(tag):
    def handler(signum, frame):
        put(f"sig-{tag}", str(signum))
        sys.exit(0)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGHUP, handler)
'''


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(PRELUDE + body)
    return str(path)


def zkvrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.zkvrun", *args]


ROOT = str(Path(__file__).resolve().parents[2])


def env_for(out: Path, **extra: str) -> dict[str, str]:
    """zkvrun's environment; PYTHONPATH makes children that run from ``out`` import this
    checkout's zkv, not whichever one the venv's editable install points at."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZKV_", "RANK"))}
    env.update(T_OUT=str(out), PYTHONPATH=ROOT, **extra)
    return env


def run_zkvrun(tmp_path: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(zkvrun_cmd(*args), env=env_for(tmp_path, **extra_env), cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def wait_files(d: Path, *names: str, timeout: float = 20) -> None:
    wait_until(lambda: all((d / n).exists() for n in names), timeout, f"{names} in {d}")


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def events(log_dir: Path, name: str = "launcher.jsonl") -> list[dict]:
    return [orjson.loads(line) for line in (log_dir / name).read_text().splitlines()]


WRITE_ENV = r'''
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "ZKV_PUB_ENDPOINT", "ZKV_PULL_ENDPOINT", "ZKV_LOG_DIR", "ZKV_RUN_ID",
        "ZKV_ROLE", "ZKV_CONFIG"]
info = {k: os.environ.get(k) for k in keys}
pub = os.environ["ZKV_PUB_ENDPOINT"]
if pub.startswith("ipc://"):
    info["dir_mode"] = os.stat(os.path.dirname(pub[len("ipc://"):])).st_mode
info["own_group"] = os.getpgid(0) == os.getpid()
info["pid"] = os.getpid()
put(f"env-{RANK or 'sched'}.json", json.dumps(info))
'''


def test_four_ranks_get_their_env_and_a_private_ipc_dir(tmp_path: Path) -> None:
    layout = CacheLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, world_size=4)
    worker = script(tmp_path, "worker.py", WRITE_ENV)
    logs = tmp_path / "logs"
    r = run_zkvrun(tmp_path, "--nproc-per-node", "4", "--log-dir", str(logs), "--run-id", "r1",
                   "--config", layout.to_json(), worker)
    assert r.returncode == 0, r.stderr
    infos = [json.loads((tmp_path / f"env-{i}.json").read_text()) for i in range(4)]
    pub = infos[0]["ZKV_PUB_ENDPOINT"]
    ipc_dir = os.path.dirname(pub[len("ipc://"):])
    for i, info in enumerate(infos):
        assert info["RANK"] == info["LOCAL_RANK"] == str(i)
        assert (info["WORLD_SIZE"], info["LOCAL_WORLD_SIZE"], info["NODE_RANK"]) == ("4", "4", "0")
        assert (info["MASTER_ADDR"], info["MASTER_PORT"]) == ("127.0.0.1", "29511")
        assert info["ZKV_PUB_ENDPOINT"] == f"ipc://{ipc_dir}/pub"
        assert info["ZKV_PULL_ENDPOINT"] == f"ipc://{ipc_dir}/pull"
        assert stat.S_IMODE(info["dir_mode"]) == 0o700
        assert (info["ZKV_ROLE"], info["ZKV_RUN_ID"]) == ("worker", "r1")
        assert info["ZKV_LOG_DIR"] == str(logs)
        assert CacheLayout.from_json(info["ZKV_CONFIG"]) == layout
        assert info["own_group"] is True
    assert not os.path.exists(ipc_dir)  # removed at exit
    evs = events(logs)
    started = [e for e in evs if e["event"] == zlog.RANK_STARTED]
    exited = [e for e in evs if e["event"] == zlog.RANK_EXITED]
    assert sorted(e["rank"] for e in started) == [0, 1, 2, 3]
    assert {e["child_pid"] for e in started} == {info["pid"] for info in infos}
    assert sorted((e["rank"], e["code"]) for e in exited) == [(i, 0) for i in range(4)]
    assert all(e["component"] == "launcher" and e["run_id"] == "r1" for e in evs)
    assert evs[-1]["event"] == zlog.GROUP_STOPPED


def test_failing_rank_tears_the_group_down(tmp_path: Path) -> None:
    worker = script(tmp_path, "worker.py", r'''
put(f"pid-{RANK}", str(os.getpid()))
if RANK == "1":
    wait_for("pid-0", "pid-2")
    sys.exit(3)
if RANK == "2":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # needs the SIGKILL after grace
park()
''')
    logs = tmp_path / "logs"
    r = run_zkvrun(tmp_path, "--nproc-per-node", "3", "--grace-s", "0.5", "--log-dir", str(logs),
                   worker)
    assert r.returncode == 1
    pids = [int((tmp_path / f"pid-{i}").read_text()) for i in range(3)]
    assert (f"zkvrun: rank 1 (pid {pids[1]}) exited with code 3; no restarts left; "
            "tearing down 2 processes") in r.stderr
    assert pid_gone(pids[0]) and pid_gone(pids[2])
    evs = events(logs)
    failed = [e for e in evs if e["event"] == zlog.GROUP_FAILED]
    assert len(failed) == 1 and (failed[0]["rank"], failed[0]["code"]) == (1, 3)
    codes = {e["rank"]: e["code"] for e in evs if e["event"] == zlog.RANK_EXITED}
    assert codes == {0: -signal.SIGTERM, 1: 3, 2: -signal.SIGKILL}


def test_rank_killed_by_a_signal_is_reported_by_name(tmp_path: Path) -> None:
    worker = script(tmp_path, "worker.py", "os.kill(os.getpid(), signal.SIGKILL)\n")
    r = run_zkvrun(tmp_path, "--log-dir", str(tmp_path / "logs"), worker)
    assert r.returncode == 1
    assert "exited with code -9 (SIGKILL); no restarts left; tearing down 0 processes" in r.stderr


def test_max_restarts_restarts_the_whole_group(tmp_path: Path) -> None:
    """A failed rank takes the whole group down (its scheduler cannot take a rank back);
    --max-restarts starts scheduler and ranks again, in a fresh run directory."""
    worker = script(tmp_path, "worker.py", r'''
first = not os.path.exists(os.path.join(OUT, f"attempt-{RANK}"))
with open(os.path.join(OUT, f"attempt-{RANK}"), "a") as f:
    f.write(os.environ["ZKV_PUB_ENDPOINT"] + "\n")
if RANK == "1" and first:
    # fail once the others of this group are up: one torn down before it wrote its line
    # would start only once
    wait_for("attempt-0", "attempt-sched")
    sys.exit(5)
park()
''')
    sched = script(tmp_path, "sched.py", r'''
with open(os.path.join(OUT, "attempt-sched"), "a") as f:
    f.write(os.environ["ZKV_PUB_ENDPOINT"] + "\n")
def lines(name):
    path = os.path.join(OUT, name)
    return len(open(path).read().split()) if os.path.exists(path) else 0
if lines("attempt-sched") == 2:
    try:  # the restarted ranks are up
        wait_until(lambda: lines("attempt-0") >= 2 and lines("attempt-1") >= 2, 20)
    except AssertionError:
        sys.exit(99)
    sys.exit(0)
park()
''')
    logs = tmp_path / "logs"
    r = run_zkvrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "--grace-s", "2",
                   "--log-dir", str(logs), "--scheduler", sched, worker)
    assert r.returncode == 0, r.stderr
    eps = {n: (tmp_path / f"attempt-{n}").read_text().split() for n in ("0", "1", "sched")}
    assert all(len(v) == 2 for v in eps.values()), eps  # every child started twice
    assert eps["0"] == eps["1"] == eps["sched"] and eps["0"][0] != eps["0"][1]
    assert "exited with code 5; tearing down 2 processes, then restarting the group (1/1)" \
        in r.stderr
    evs = events(logs)
    assert [(e["restart"], e["code"]) for e in evs if e["event"] == zlog.GROUP_RESTARTED] == \
        [(1, 1)]
    exits = [(e.get("rank", "sched"), e["code"]) for e in evs
             if e["event"] in (zlog.RANK_EXITED, zlog.SCHEDULER_EXITED)]
    assert exits[0] == (1, 5)  # then the others of the first group were torn down
    assert set(exits[1:3]) == {(0, -signal.SIGTERM), ("sched", -signal.SIGTERM)}


def test_restarts_run_out(tmp_path: Path) -> None:
    worker = script(tmp_path, "worker.py", r'''
with open(os.path.join(OUT, "attempts"), "a") as f:
    f.write("x\n")
sys.exit(4)
''')
    r = run_zkvrun(tmp_path, "--max-restarts", "2", "--log-dir", str(tmp_path / "logs"), worker)
    assert r.returncode == 1
    assert (tmp_path / "attempts").read_text() == "x\n" * 3
    assert "exited with code 4; no restarts left; tearing down 0 processes" in r.stderr


def test_scheduler_exit_zero_ends_the_group(tmp_path: Path) -> None:
    sched = script(tmp_path, "sched.py", WRITE_ENV + r'''
assert sys.argv[1:] == ["--flag", "a b"], sys.argv
wait_for("env-0.json", "env-1.json")
''')
    worker = script(tmp_path, "worker.py", WRITE_ENV + "park()\n")
    logs = tmp_path / "logs"
    # RANK in zkvrun's own env must not leak into the scheduler's.
    r = run_zkvrun(tmp_path, "--nproc-per-node", "2", "--log-dir", str(logs),
                   "--scheduler", f"{sched} --flag 'a b'", worker, RANK="99")
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "env-sched.json").read_text())
    ranks = [json.loads((tmp_path / f"env-{i}.json").read_text()) for i in range(2)]
    assert s["ZKV_ROLE"] == "scheduler" and s["RANK"] is None and s["LOCAL_RANK"] is None
    assert s["WORLD_SIZE"] == "2" and s["ZKV_LOG_DIR"] == str(logs)
    for key in ("ZKV_PUB_ENDPOINT", "ZKV_PULL_ENDPOINT", "ZKV_RUN_ID"):
        assert s[key] == ranks[0][key] == ranks[1][key]
    assert all(pid_gone(info["pid"]) for info in ranks)
    evs = events(logs)
    assert [e["event"] for e in evs if e.get("role") == "scheduler"] == [
        zlog.SCHEDULER_STARTED, zlog.SCHEDULER_EXITED]
    assert [e["reason"] for e in evs if e["event"] == zlog.GROUP_STOPPED] == ["scheduler_done"]


def test_a_rank_that_died_as_the_scheduler_finished_fails_the_group(tmp_path: Path) -> None:
    """Both exits land in one monitor interval (zkvrun is stopped while they happen): the
    rank's failure is the group's, whatever order the children are polled in. Before,
    the scheduler's success was handled first and zkvrun said 0."""
    sched = script(tmp_path, "sched.py", 'put("ready-sched", "")\nwait_for("go")\n')
    worker = script(tmp_path, "worker.py", WRITE_ENV + "park()\n")
    logs = tmp_path / "logs"
    with subprocess.Popen(zkvrun_cmd("--nproc-per-node", "2", "--log-dir", str(logs),
                                     "--scheduler", sched, worker),
                          env=env_for(tmp_path), cwd=tmp_path, stderr=subprocess.PIPE,
                          text=True) as p:
        try:
            wait_files(tmp_path, "env-0.json", "env-1.json", "ready-sched")
            sched_pid = next(e["child_pid"] for e in events(logs)
                             if e["event"] == zlog.SCHEDULER_STARTED)
            rank0 = json.loads((tmp_path / "env-0.json").read_text())["pid"]
            p.send_signal(signal.SIGSTOP)
            os.kill(rank0, signal.SIGKILL)
            (tmp_path / "go").write_text("")
            wait_exited([rank0, sched_pid], 20)  # zombies until zkvrun reaps them
            p.send_signal(signal.SIGCONT)
            _, err = p.communicate(timeout=TIMEOUT_S)
        finally:
            p.kill()
    assert p.returncode == 1, err
    assert f"zkvrun: rank 0 (pid {rank0}) exited with code -9 (SIGKILL)" in err
    evs = events(logs)
    assert [e["code"] for e in evs if e["event"] == zlog.GROUP_FAILED] == [-9]
    assert not any(e["event"] == zlog.GROUP_STOPPED for e in evs)


def test_scheduler_failure_exits_with_its_code(tmp_path: Path) -> None:
    worker = script(tmp_path, "worker.py", WRITE_ENV + "park()\n")
    code = ('import os,sys\n'
            'from tests.waiting import wait_until\n'
            'wait_until(lambda: os.path.exists(os.environ["T_OUT"]+"/env-0.json"), 20)\n'
            'sys.exit(7)')
    r = run_zkvrun(tmp_path, "--log-dir", str(tmp_path / "logs"),
                   "--scheduler", f"-c '{code}'", worker)
    assert r.returncode == 7
    assert "zkvrun: scheduler (pid" in r.stderr
    assert "exited with code 7; tearing down 1 processes" in r.stderr
    assert pid_gone(json.loads((tmp_path / "env-0.json").read_text())["pid"])


def test_a_scheduler_killed_by_a_signal_fails_the_run_with_1(tmp_path: Path) -> None:
    """Its negative code (-9) is no exit status: zkvrun exits 1 (a failure), not 247."""
    worker = script(tmp_path, "worker.py", WRITE_ENV + "park()\n")
    code = ('import os,signal\n'
            'from tests.waiting import wait_until\n'
            'wait_until(lambda: os.path.exists(os.environ["T_OUT"]+"/env-0.json"), 20)\n'
            'os.kill(os.getpid(), signal.SIGKILL)')
    r = run_zkvrun(tmp_path, "--log-dir", str(tmp_path / "logs"),
                   "--scheduler", f"-c '{code}'", worker)
    assert r.returncode == 1, r.stderr
    assert "exited with code -9 (SIGKILL); tearing down 1 processes" in r.stderr
    assert pid_gone(json.loads((tmp_path / "env-0.json").read_text())["pid"])


def _signal_a_group(tmp_path: Path, sched: str, worker: str, sig: int, *flags: str) -> str:
    """zkvrun with a scheduler node and 2 ranks, ``sig`` sent to it once all three are
    ready; its stderr (its status in the test's ``assert``: the returned process)."""
    with subprocess.Popen(zkvrun_cmd("--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                                     *flags, "--scheduler", sched, worker),
                          env=env_for(tmp_path), cwd=tmp_path, stderr=subprocess.PIPE,
                          text=True) as p:
        try:
            wait_files(tmp_path, "ready-0", "ready-1", "ready-sched")
            p.send_signal(sig)
            _, err = p.communicate(timeout=TIMEOUT_S)
        finally:
            p.kill()
    assert p.returncode == 128 + sig, err
    return err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded_to_every_child(tmp_path: Path, sig: signal.Signals) -> None:
    body = 'record_signal(TAG)\nput("ready-" + TAG, "")\npark()\n'
    worker = script(tmp_path, "worker.py", "TAG = RANK\n" + body)
    sched = script(tmp_path, "sched.py", 'TAG = "sched"\n' + body)
    err = _signal_a_group(tmp_path, sched, worker, sig)
    assert f"zkvrun: got {sig.name}; forwarding to 3 processes" in err
    for tag in ("0", "1", "sched"):
        assert (tmp_path / f"sig-{tag}").read_text() == str(int(sig))


RECORDING_RANK = 'record_signal(RANK)\nput("ready-" + RANK, "")\npark()\n'


def test_the_scheduler_is_signalled_before_the_ranks(tmp_path: Path) -> None:
    """A forwarded signal reaches the scheduler node alone first: its stop sends the ranks
    Shutdown. Signalled with it, a rank said bye before the node, not yet run on a busy
    machine, took its own signal, and ``zkv replay`` failed for a lost rank ("rank 0 is dead:
    ... it said bye: sighup") instead of stopping (the CI failure of bd02add). Here the node
    watches for a second after its signal: no rank may have been signalled meanwhile."""
    worker = script(tmp_path, "worker.py", RECORDING_RANK)
    sched = script(tmp_path, "sched.py", r'''
from tests.waiting import holds_within
def handler(signum, frame):
    put("sig-sched", str(signum))
    early = holds_within(lambda: any(os.path.exists(os.path.join(OUT, f"sig-{r}")) for r in "01"),
                         1.0)
    put("ranks-signalled-early", str(early))
    sys.exit(0)
signal.signal(signal.SIGHUP, handler)
put("ready-sched", "")
park()
''')
    _signal_a_group(tmp_path, sched, worker, signal.SIGHUP)
    assert (tmp_path / "ranks-signalled-early").read_text() == "False"
    for tag in ("0", "1", "sched"):  # the ranks still got it, once the node had stopped
        assert (tmp_path / f"sig-{tag}").read_text() == str(int(signal.SIGHUP))


def test_a_scheduler_that_ignores_the_signal_holds_the_ranks_half_the_grace(
        tmp_path: Path) -> None:
    """A node that does not stop on the signal: the ranks get it after half the grace
    period, and the node is SIGKILLed at its end."""
    worker = script(tmp_path, "worker.py", RECORDING_RANK)
    sched = script(tmp_path, "sched.py", 'signal.signal(signal.SIGTERM, signal.SIG_IGN)\n'
                                         'put("ready-sched", "")\npark()\n')
    _signal_a_group(tmp_path, sched, worker, signal.SIGTERM, "--grace-s", "2")
    for tag in ("0", "1"):
        assert (tmp_path / f"sig-{tag}").read_text() == str(int(signal.SIGTERM))
    codes = {e.get("rank", "scheduler"): e["code"] for e in events(tmp_path / "logs")
             if e["event"] in (zlog.RANK_EXITED, zlog.SCHEDULER_EXITED)}
    assert codes == {"scheduler": -9, 0: 0, 1: 0}, codes


def test_second_signal_skips_the_grace_period(tmp_path: Path) -> None:
    worker = script(tmp_path, "worker.py", r'''
signal.signal(signal.SIGTERM, signal.SIG_IGN)
put(f"pid-{RANK}", str(os.getpid()))
park()
''')
    logs = tmp_path / "logs"
    with subprocess.Popen(zkvrun_cmd("--grace-s", "60", "--log-dir", str(logs), worker),
                          env=env_for(tmp_path), cwd=tmp_path, stderr=subprocess.PIPE) as p:
        try:
            wait_files(tmp_path, "pid-0")
            p.send_signal(signal.SIGTERM)
            wait_until(lambda: any(e["event"] == zlog.SIGNAL_FORWARDED for e in events(logs)),
                       20, "the first signal forwarded")
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=TIMEOUT_S)
        finally:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM
    assert pid_gone(int((tmp_path / "pid-0").read_text()))


def _ignore_sighup() -> None:  # (in the child, before exec: what nohup does)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_a_signal_ignored_at_start_stays_ignored(tmp_path: Path) -> None:
    """``nohup zkvrun ... &`` survives the SIGHUP a logout sends its jobs, as its children
    do (they inherit it ignored). Before, zkvrun caught it and tore the group down: 129."""
    worker = script(tmp_path, "worker.py", 'record_signal(RANK)\nput(f"ready-{RANK}", "")\n'
                                           'park()\n')
    logs = tmp_path / "logs"
    with subprocess.Popen(zkvrun_cmd("--nproc-per-node", "2", "--grace-s", "0.5", "--log-dir",
                                     str(logs), worker),
                          env=env_for(tmp_path), cwd=tmp_path, stderr=subprocess.PIPE,
                          text=True, preexec_fn=_ignore_sighup) as p:
        try:
            wait_files(tmp_path, "ready-0", "ready-1")
            p.send_signal(signal.SIGHUP)  # the logout's
            p.send_signal(signal.SIGTERM)  # what ends the job
            _, err = p.communicate(timeout=TIMEOUT_S)
        finally:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    for rank in ("0", "1"):
        assert (tmp_path / f"sig-{rank}").read_text() == str(int(signal.SIGTERM))
    assert [e["signal"] for e in events(logs) if e["event"] == zlog.SIGNAL_FORWARDED] == \
        ["SIGTERM"]


def test_multi_node_needs_insecure_tcp(tmp_path: Path) -> None:
    r = run_zkvrun(tmp_path, "--nnodes", "2", "-c", "pass")
    assert r.returncode == 2
    assert "zkvrun: error:" in r.stderr and "--insecure-tcp" in r.stderr
    assert not list(tmp_path.iterdir())  # nothing started, no log dir


def test_a_master_addr_that_does_not_resolve_is_said(tmp_path: Path) -> None:
    """Node rank 0 listens there: one line, nothing started. Another node's ranks wait for
    it (its DNS record may come later), now after one warning; before, in silence for
    ZKV_SCHEDULER_TIMEOUT_S (300 s)."""
    host = "nohost-zkv.invalid"  # RFC 6761: never resolves
    flags = ("--nnodes", "2", "--insecure-tcp", "--allow-remote", "--master-addr", host)
    r = run_zkvrun(tmp_path, *flags, "--node-rank", "0", "-c", "open('started', 'w')")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"zkvrun: error: --master-addr {host}: not an address this "
                               "machine can resolve (") and r.stderr.count("\n") == 1
    assert not (tmp_path / "started").exists()
    r = run_zkvrun(tmp_path, *flags, "--node-rank", "1", "-c", "open('started', 'w')")
    assert r.returncode == 0, r.stderr  # the ranks ran (this one needs no scheduler)
    assert r.stderr.startswith(f"zkvrun: warning: --master-addr {host} does not resolve yet (")
    assert (tmp_path / "started").exists()


@pytest.mark.parametrize("via_env", [False, True])
def test_a_log_dir_that_is_a_file_is_one_line_and_starts_nothing(tmp_path: Path,
                                                                 via_env: bool) -> None:
    (tmp_path / "logs").write_bytes(b"")  # was: every process said so and logged to stderr
    flags = () if via_env else ("--log-dir", str(tmp_path / "logs"))
    env = {"ZKV_LOG_DIR": str(tmp_path / "logs")} if via_env else {}
    r = run_zkvrun(tmp_path, *flags, "-c", "open('started', 'w')", **env)
    assert r.returncode == 2
    assert r.stderr == f"zkvrun: error: log directory {tmp_path / 'logs'}: not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # nothing started


def test_a_log_level_typo_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    """Every child reads ZKV_LOG_LEVEL: a typo logged at info everywhere, silently."""
    r = run_zkvrun(tmp_path, "--log-dir", str(tmp_path / "logs"), "-c",
                   "open('started', 'w')", ZKV_LOG_LEVEL="verbose")
    assert r.returncode == 2
    assert r.stderr == ("zkvrun: error: ZKV_LOG_LEVEL must be one of debug, info, warning, "
                        "error, critical, got 'verbose'\n")
    assert not (tmp_path / "started").exists()


def test_a_zkv_worker_env_typo_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    """What every ``-m zkv.worker`` rank reads (zkv.config.check_rank_env), as zkv replay
    checks it. Before, the scheduler started, every rank said the same line and exited 2."""
    layout = CacheLayout(2, 2, 16, 8, "float16", 16, 16, world_size=2)
    sched = script(tmp_path, "sched.py", 'put("started", "")\npark()\n')
    r = run_zkvrun(tmp_path, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                   "--config", layout.to_json(), "--scheduler", sched, "-m", "zkv.worker",
                   ZKV_SCHEDULER_TIMEOUT_S="abc")
    assert r.returncode == 2
    assert r.stderr == ("zkvrun: error: ZKV_SCHEDULER_TIMEOUT_S must be a finite number of "
                        "seconds > 0, or inf to wait forever, got 'abc'\n")
    assert not (tmp_path / "started").exists() and not (tmp_path / "logs").exists()


def test_second_node_ranks_and_tcp_endpoints(tmp_path: Path) -> None:
    worker = script(tmp_path, "worker.py", WRITE_ENV)
    logs = tmp_path / "logs"
    r = run_zkvrun(tmp_path, "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
                   "--insecure-tcp", "--master-port", "30011", "--log-dir", str(logs),
                   "--scheduler", "-c 'raise SystemExit(9)'", worker)
    assert r.returncode == 0, r.stderr  # no scheduler on node rank 1
    for lr in range(2):
        info = json.loads((tmp_path / f"env-{2 + lr}.json").read_text())
        assert (info["LOCAL_RANK"], info["WORLD_SIZE"], info["NODE_RANK"]) == (str(lr), "4", "1")
        assert info["ZKV_PUB_ENDPOINT"] == "tcp://127.0.0.1:30011"
        assert info["ZKV_PULL_ENDPOINT"] == "tcp://127.0.0.1:30012"
    assert not (tmp_path / "env-sched.json").exists()
    assert {e["event"] for e in events(logs, "launcher-node1.jsonl")} >= {zlog.RANK_STARTED}


def test_bad_layout_is_refused(tmp_path: Path) -> None:
    layout = CacheLayout(num_layers=1, kv_heads=1, block_size=4, head_dim=4, world_size=1)
    r = run_zkvrun(tmp_path, "--nproc-per-node", "2", "--config", layout.to_json(), "-c", "pass")
    assert r.returncode == 2 and "world_size=1" in r.stderr and "WORLD_SIZE=2" in r.stderr
    r = run_zkvrun(tmp_path, "--config", "{not json", "-c", "pass")
    assert r.returncode == 2 and "bad cache layout JSON" in r.stderr
    r = run_zkvrun(tmp_path, "--config", '{"num_layers": 2, "colour": 1}', "-c", "pass")
    assert r.returncode == 2 and ("bad cache layout JSON: unknown field(s) colour; missing "
                                  "field(s) kv_heads, block_size, head_dim") in r.stderr, r.stderr


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    """Was: a UnicodeDecodeError traceback, status 1."""
    (tmp_path / "layout.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff\xfe")
    r = run_zkvrun(tmp_path, "--config", str(tmp_path / "layout.bin"), "-c",
                   "open('started', 'w')")
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"zkvrun: error: --config {tmp_path}/layout.bin: not layout JSON (not "
                        "UTF-8 text: invalid continuation byte at byte 8)\n")
    assert not (tmp_path / "started").exists()


def test_a_config_that_is_no_regular_file_or_too_large_is_one_line(tmp_path: Path) -> None:
    """A FIFO no one writes to hung the start for good; /dev/zero grew zkvrun until memory
    ran out (a MemoryError traceback); a directory was an IsADirectoryError line."""
    fifo = tmp_path / "layout.fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2 << 20))
    for path, why in ((fifo, "not a regular file (a directory, a pipe or a device)"),
                      (Path("/dev/zero"), "not a regular file (a directory, a pipe or a "
                                          "device)"),
                      (tmp_path, "not a regular file"),
                      (big, "larger than 1024 KiB: not a layout")):
        r = run_zkvrun(tmp_path, "--config", str(path), "-c", "open('started', 'w')")
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith(f"zkvrun: error: --config {path}: {why}"), r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "started").exists()


@pytest.mark.parametrize("value", ["64.5", "true"])
def test_a_layout_field_of_the_wrong_type_is_refused_at_start(tmp_path: Path,
                                                              value: str) -> None:
    """Was: accepted; every rank then died as "fatal error" (and was restarted)."""
    layout = CacheLayout(2, 2, 16, 64, num_device_blocks=64, num_host_blocks=64).to_json()
    layout = layout.replace('"num_device_blocks":64', f'"num_device_blocks":{value}')
    r = run_zkvrun(tmp_path, "--config", layout, "--max-restarts", "2", "-c",
                   "open('started', 'w')")
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("zkvrun: error: bad cache layout JSON: num_device_blocks must be an "
                        f"int, got {value.capitalize()}\n")
    assert not (tmp_path / "started").exists()


def test_missing_command_is_a_usage_error(tmp_path: Path) -> None:
    r = run_zkvrun(tmp_path, "--nproc-per-node", "2")
    assert r.returncode == 2 and "missing the per-rank command" in r.stderr
    r = run_zkvrun(tmp_path, "--log-dir", str(tmp_path / "logs"), "/nonexistent/zkv-binary")
    assert r.returncode == 1 and "cannot start rank 0" in r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_what_an_exited_rank_left_behind_is_killed(tmp_path: Path) -> None:
    worker = script(tmp_path, "worker.py", r'''
import subprocess
child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
put("grandchild", str(child.pid))
os._exit(0)
''')
    r = run_zkvrun(tmp_path, "--log-dir", str(tmp_path / "logs"), worker)
    assert r.returncode == 0, r.stderr
    grandchild = int((tmp_path / "grandchild").read_text())
    try:
        wait_exited([grandchild], 10, "the exited rank's child")
    finally:  # whatever a failure left
        with contextlib.suppress(ProcessLookupError):
            os.kill(grandchild, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_sigkilled_zkvrun_leaves_nothing_the_next_start_does_not_clean(tmp_path: Path) -> None:
    """No orphans (PDEATHSIG); its run directory (sockets, per-run keys) outlives it, and
    the next zkvrun removes it. A live run's directory is never touched."""
    base = tempfile.mkdtemp(prefix="zkv-t")  # $TMPDIR of both runs: short, ours alone
    try:
        worker = script(tmp_path, "worker.py", WRITE_ENV + "park()\n")
        with subprocess.Popen(zkvrun_cmd("--nproc-per-node", "2", "--log-dir",
                                         str(tmp_path / "logs"), worker),
                              env=env_for(tmp_path, TMPDIR=base), cwd=tmp_path) as p:
            try:
                wait_files(tmp_path, "env-0.json", "env-1.json")
            finally:
                p.kill()
        infos = [json.loads((tmp_path / f"env-{i}.json").read_text()) for i in range(2)]
        run_dir = os.path.dirname(infos[0]["ZKV_PUB_ENDPOINT"][len("ipc://"):])
        assert os.path.dirname(run_dir) == os.path.join(base, f"zkv-{os.geteuid()}")
        assert sorted(os.listdir(run_dir)) == ["keys", "owner"]  # no scheduler: no sockets
        wait_exited([info["pid"] for info in infos], 10, "the ranks of the SIGKILLed zkvrun")
        live = security_run_dir(base)  # a run whose owner (this process) is alive
        r = run_zkvrun(tmp_path, "--log-dir", str(tmp_path / "logs2"), "-c", "pass",
                       TMPDIR=base)
        assert r.returncode == 0, r.stderr
        assert "removed 1 run directories left by dead launchers" in r.stderr
        assert not os.path.exists(run_dir) and os.path.isdir(live)
        cleaned = [e for e in events(tmp_path / "logs2") if e["event"] == zlog.RUN_DIRS_CLEANED]
        assert [e["paths"] for e in cleaned] == [[run_dir]]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def security_run_dir(base: str) -> str:
    from zkv.security import make_run_dir

    return make_run_dir(base)


def test_sigterm_while_ranks_start_stops_the_starting(tmp_path: Path) -> None:
    """The handler is in place before the first rank starts, and the start loop looks at
    it before every start: a SIGTERM that arrives after the first rank started stops the
    launch, tears down what started, and exits 128+15."""
    import threading

    from launch.zkvrun import LaunchConfig, run
    from tests.worker.helpers import children_of

    me = os.getpid()
    sent = threading.Event()
    others = set(children_of(me))  # (a session's servers, say)

    def signal_after_first_child() -> None:
        if holds_within(lambda: set(children_of(me)) - others, 30, interval=0.001):
            os.kill(me, signal.SIGTERM)
            sent.set()

    before = signal.getsignal(signal.SIGTERM)
    watcher = threading.Thread(target=signal_after_first_child, daemon=True)
    watcher.start()
    cfg = LaunchConfig(nproc_per_node=64, force_ranks=True, grace_s=2.0,
                       log_dir=str(tmp_path / "logs"))
    code = run(cfg, ["sleep", "60"], None)
    watcher.join(10)
    assert sent.is_set() and code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    started = [e for e in events(tmp_path / "logs") if e["event"] == zlog.RANK_STARTED]
    assert 1 <= len(started) < 64, len(started)
    assert set(children_of(me)) <= others


def test_the_commands_it_logs_hide_url_passwords(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    r = run_zkvrun(tmp_path, "--log-dir", str(logs), "--scheduler",
                   "-c pass --storage redis://:s3cret@127.0.0.1:6379/0",
                   "-c", "pass", "redis://u:s3cret@h:1/0")
    assert r.returncode == 0, r.stderr
    started = {e["event"]: e["cmd"] for e in events(logs)
               if e["event"] in (zlog.SCHEDULER_STARTED, zlog.RANK_STARTED)}
    assert started[zlog.SCHEDULER_STARTED][-2:] == ["--storage", "redis://***@127.0.0.1:6379/0"]
    assert started[zlog.RANK_STARTED][-1] == "redis://***@h:1/0"
    assert "s3cret" not in "".join(p.read_text() for p in logs.iterdir()) + r.stderr


def _readme_block(after: str) -> str:
    """The first fenced code block of README.md after the line that starts with ``after``."""
    text = (Path(ROOT) / "README.md").read_text()
    at = text.index("\n" + after)
    start = text.index("```python\n", at) + len("```python\n")
    return text[start : text.index("```", start)]


def test_the_readme_scheduler_runs_under_zkvrun(tmp_path: Path) -> None:
    """README's "Using zkv inside an engine" scheduler, as written there, as zkvrun's
    ``--scheduler`` with two real ``zkv.worker`` ranks and zkvrun's default per-run
    keyring: the ranks join, three steps' batches are acked by both, and its exit ends the
    group with status 0. (The block built its Dispatcher without the keyring: the ranks never
    joined, ``TimeoutError`` after 60 s naming them.)"""
    code = _readme_block("Scheduler process (node rank 0")
    assert "Dispatcher.from_env" in code
    sched = tmp_path / "readme_sched.py"
    sched.write_text(code + "\nprint('readme scheduler: steps done', flush=True)\n")
    layout = CacheLayout(2, 2, 16, 32, "float16", 8, 8, world_size=2)
    r = run_zkvrun(tmp_path, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                   "--config", layout.to_json(), "--scheduler", str(sched),
                   "-m", "zkv.worker", ZKV_BACKEND="cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "readme scheduler: steps done" in r.stdout
    evs = events(tmp_path / "logs")
    acked = [e for e in events(tmp_path / "logs", "scheduler.jsonl")  # (zkv logs reads it)
             if e["event"] == zlog.BATCH_ACKED]
    assert len(acked) == 3 and all(e["ok"] for e in acked), acked
    assert "dispatcher.batch_acked" not in r.stdout  # (structlog's console: not configured)
    assert [e["reason"] for e in evs if e["event"] == zlog.GROUP_STOPPED] == ["scheduler_done"]


def test_a_refused_zkv_worker_rank_is_reported_with_what_its_code_means(tmp_path: Path) -> None:
    """A real ``-m zkv.worker`` rank whose layout the scheduler refuses exits 4 on its own;
    zkvrun says what 4 means for zkv.worker (another program's 4 stays a plain ``code 4``:
    test_restarts_run_out)."""
    sched = script(tmp_path, "sched.py", r'''
import dataclasses
from zkv import security
from zkv.config import CacheLayout
from zkv.errors import ConfigError
from zkv.scheduler.dispatcher import Dispatcher
ours = CacheLayout.from_env()
theirs = dataclasses.replace(ours, head_dim=ours.head_dim * 2)  # not what the ranks have
d = Dispatcher(os.environ["ZKV_PUB_ENDPOINT"], os.environ["ZKV_PULL_ENDPOINT"],
               ours.world_size, theirs, keys=security.keyring_from_env())
try:
    d.wait_for_ranks(20.0)
except ConfigError:
    put("refused", "")
    signal.pause()  # until zkvrun tears it down: the rank's own exit is what it reports
d.close()
''')
    layout = CacheLayout(2, 2, 16, 32, "float16", 8, 8)
    r = run_zkvrun(tmp_path, "--log-dir", str(tmp_path / "logs"), "--config", layout.to_json(),
                   "--scheduler", sched, "-m", "zkv.worker", ZKV_BACKEND="cpu")
    assert r.returncode == 1, r.stderr
    assert (tmp_path / "refused").exists(), r.stderr
    assert "zkv.worker: rank 0: refused by the scheduler: " in r.stderr
    assert ("exited with code 4 (refused by the scheduler); no restarts left; tearing down 1 "
            "processes") in r.stderr, r.stderr
    (exited,) = [e for e in events(tmp_path / "logs") if e["event"] == zlog.RANK_EXITED]
    assert exited["how"] == "code 4 (refused by the scheduler)"


@pytest.mark.parametrize(("code", "flags"), [(2, ()), (7, ("--final-codes", "1,7"))])
def test_a_final_scheduler_exit_is_not_restarted(tmp_path: Path, code: int,
                                                  flags: tuple[str, ...]) -> None:
    """A scheduler's usage / configuration error (2), or a code named by --final-codes, is
    a result no rerun changes: was, --max-restarts 2 ran the group three times."""
    worker = script(tmp_path, "worker.py", WRITE_ENV + "park()\n")
    sched = script(tmp_path, "sched.py", rf'''
with open(os.path.join(OUT, "attempts"), "a") as f:
    f.write("x\n")
wait_for("env-0.json")
sys.exit({code})
''')
    logs = tmp_path / "logs"
    r = run_zkvrun(tmp_path, "--max-restarts", "2", *flags, "--log-dir", str(logs),
                   "--scheduler", sched, worker)
    assert r.returncode == code, r.stderr
    assert (tmp_path / "attempts").read_text() == "x\n"
    pid = next(e["child_pid"] for e in events(logs) if e["event"] == zlog.SCHEDULER_STARTED)
    assert r.stderr.splitlines()[-1] == (
        f"zkvrun: scheduler (pid {pid}) exited with code {code}, one of --final-codes: not "
        "restarting; tearing down 1 processes")
    assert not [e for e in events(logs) if e["event"] == zlog.GROUP_RESTARTED]
    assert pid_gone(json.loads((tmp_path / "env-0.json").read_text())["pid"])


def test_a_zkv_worker_rank_with_a_bad_configuration_is_not_restarted(tmp_path: Path) -> None:
    """A ``-m zkv.worker`` rank's 2 (bad configuration) comes back on every rerun: was,
    ``ZKV_BACKEND=bogus`` with --max-restarts 3 ran four times (zkvrun refuses that one,
    and a bad store URL, before it starts anything now; a rank given no layout, neither
    ``--config`` nor ``ZKV_CONFIG``, is the rank's to refuse). (Another program's 2 or 4 is
    its own: test_restarts_run_out restarts it.) zkvrun exits 2, a bad configuration's
    status (it was 1, as for a rank that failed)."""
    logs = tmp_path / "logs"
    r = run_zkvrun(tmp_path, "--max-restarts", "3", "--log-dir", str(logs),
                   "-m", "zkv.worker", ZKV_BACKEND="cpu")
    assert r.returncode == 2, r.stderr
    assert "zkv.worker: ZKV_CONFIG is not set" in r.stderr
    (started,) = [e for e in events(logs) if e["event"] == zlog.RANK_STARTED]
    assert r.stderr.splitlines()[-1] == (
        f"zkvrun: rank 0 (pid {started['child_pid']}) exited with code 2 (bad configuration): "
        "not restarting; tearing down 0 processes")
    (failed,) = [e for e in events(logs) if e["event"] == zlog.GROUP_FAILED]
    assert (failed["code"], failed["final"]) == (2, True)


@pytest.mark.parametrize("extra, line", [
    ({"ZKV_STORE_URL": "bogus://x"}, "ZKV_STORE_URL: bad store URL 'bogus://x': unknown "
                                     "scheme 'bogus' (one of file, redis, rediss, mooncake)"),
    ({"ZKV_STORE_URL": "redis://:sec ret@h:99999/0"},
     "ZKV_STORE_URL: bad store URL 'redis://***@h:99999/0': the port must be a number in "
     "[1, 65535] ([USER:PASSWORD@]HOST:PORT)"),
    ({"ZKV_STORE_URL": "file:///tmp/l3?max_bytes=100"},
     "ZKV_STORE_URL: bad store URL 'file:///tmp/l3?max_bytes=100': a budget of 50 bytes per "
     "writer (2 writers) holds no block of 8256 bytes; give a larger max_gb"),
])
def test_a_bad_store_for_the_ranks_is_one_line_and_starts_nothing(
        tmp_path: Path, extra: dict[str, str], line: str) -> None:
    """Every ``-m zkv.worker`` rank opens ``ZKV_STORE_URL``: a bad one was refused by each
    rank after its torch import, one line a rank, then zkvrun's own. Now zkvrun parses it
    as a rank does (its ``file://`` budget against the layout's block), says it once
    (the password of one with a blank in it hidden) and starts nothing."""
    layout = CacheLayout(2, 2, 16, 32, "float16", 16, 16, world_size=2)
    logs = tmp_path / "logs"
    r = run_zkvrun(tmp_path, "--nproc-per-node", "2", "--log-dir", str(logs),
                   "--config", layout.to_json(), "-m", "zkv.worker", ZKV_BACKEND="cpu",
                   **extra)
    assert (r.returncode, r.stderr) == (2, f"zkvrun: error: {line}\n")
    assert not list(logs.glob("*.jsonl"))  # (no launcher's, no rank's: nothing ran)


def test_the_default_log_dir_is_per_user_and_private(tmp_path: Path) -> None:
    """Was: ``{tmp}/zkv-logs``, shared by every user and never checked."""
    root = tmp_path / f"zkv-logs-{os.geteuid()}"
    r = run_zkvrun(tmp_path, "--run-id", "r1", "-c", "pass", TMPDIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stderr == f"zkvrun: run r1, logs in {root / 'r1'}\n"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert [e["event"] for e in events(root / "r1")][-1] == zlog.GROUP_STOPPED


@pytest.mark.parametrize("kind", ["file", "open_dir"])
def test_a_default_log_dir_that_cannot_be_ours_is_one_line_and_starts_nothing(
        tmp_path: Path, kind: str) -> None:
    """Was: every process said it could not open its log file, and logged to stderr."""
    root = tmp_path / f"zkv-logs-{os.geteuid()}"
    if kind == "file":
        root.write_bytes(b"")
        why = ": not a directory"
    else:
        root.mkdir()
        root.chmod(0o755)  # others could read the logs in it
        why = " has mode 755; it must be 700 (others could read the logs in it)"
    r = run_zkvrun(tmp_path, "-c", "open('started', 'w')", TMPDIR=str(tmp_path))
    assert r.returncode == 2
    assert r.stderr == f"zkvrun: error: log directory {root}{why}\n"
    assert not (tmp_path / "started").exists()


def test_what_a_rank_started_in_another_session_is_killed_when_the_group_ends(
        tmp_path: Path) -> None:
    """A rank that starts a process in a session of its own (``setsid``, as a daemon
    does): zkvrun's group kill never reached it, and it outlived the run (with whatever it
    held: a GPU's memory, a port). Now it carries the group's token in its environment
    and is SIGKILLed, and said, when the group ends."""
    body = ("import subprocess\n"
            "p = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
            "put(f'stray-{RANK}', str(p.pid))\n")
    logs = tmp_path / "logs"
    try:
        # (before: zkvrun's stderr pipe stayed open in the strays, and the run timed out)
        r = run_zkvrun(tmp_path, "--nproc-per-node", "2", "--log-dir", str(logs),
                       script(tmp_path, "rank.py", body))
        pids = [int((tmp_path / f"stray-{rank}").read_text()) for rank in (0, 1)]
        assert r.returncode == 0, r.stderr
        wait_exited(pids, 10, "the processes the ranks started in sessions of their own")
        [line] = [x for x in r.stderr.splitlines() if "left outside" in x]
        assert line.startswith("zkvrun: killed 2 processes the group left outside its "
                               "process groups: pid "), line
        assert "(sleep 600)" in line, line
        [killed] = [e for e in events(logs) if e["event"] == zlog.STRAYS_KILLED]
        assert sorted(killed["pids"]) == sorted(pids)
    finally:  # (whatever happened: none is left to the machine)
        for stray in tmp_path.glob("stray-*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(stray.read_text()), signal.SIGKILL)
