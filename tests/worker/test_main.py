"""``python -m zkv.worker`` (what zkvrun starts per rank): a configuration it cannot serve is
one line on stderr and exit status 2 (before: a RANK past the world size or a heartbeat
interval of NaN or -1 started and served, the last a heartbeat flood; an unknown backend
was exit 1 with the error's repr)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.waiting import wait_exited, wait_until
from zkv.config import CacheLayout

ROOT = str(Path(__file__).resolve().parents[2])
LAYOUT = CacheLayout(2, 2, 16, 32, "float16", 16, 16, world_size=2)


def rank_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Rank 1's environment as zkvrun sets it (insecure ipc endpoints in a private folder,
    the CPU backend), ``extra`` over it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZKV_", "RANK"))}
    env.update(ZKV_CONFIG=LAYOUT.to_json(), RANK="1", ZKV_INSECURE="1", ZKV_BACKEND="cpu",
               ZKV_PUB_ENDPOINT=f"ipc://{run_dir}/pub", ZKV_PULL_ENDPOINT=f"ipc://{run_dir}/pull",
               ZKV_LOG_DIR=str(tmp_path / "logs"), PYTHONPATH=ROOT)
    env.update(extra)
    return env


@pytest.mark.parametrize("extra, message", [
    ({"ZKV_CONFIG": ""}, "zkv.worker: ZKV_CONFIG is not set: run the ranks with zkvrun --config "
                         "FILE (the cache layout as JSON), which sets it for every rank"),
    ({"RANK": "2"}, "zkv.worker: RANK 2 is not below the layout's world_size 2"),
    ({"ZKV_HEARTBEAT_S": "nan"}, "zkv.worker: ZKV_HEARTBEAT_S must be a finite number of "
                                 "seconds in [0.01, 0.5], got 'nan'"),
    ({"ZKV_HEARTBEAT_S": "-1"}, "zkv.worker: ZKV_HEARTBEAT_S must be a finite number of "
                                "seconds in [0.01, 0.5], got '-1'"),
    ({"ZKV_HEARTBEAT_S": "soon"}, "zkv.worker: ZKV_HEARTBEAT_S must be a finite number of "
                                  "seconds in [0.01, 0.5], got 'soon'"),
    ({"ZKV_HEARTBEAT_S": "1e-9"}, "zkv.worker: ZKV_HEARTBEAT_S must be a finite number of "
                                  "seconds in [0.01, 0.5], got '1e-9'"),  # (was taken: a flood)
    ({"ZKV_SCHEDULER_TIMEOUT_S": "0"}, "zkv.worker: ZKV_SCHEDULER_TIMEOUT_S must be a finite "
                                       "number of seconds > 0, or inf to wait forever, got '0'"),
    ({"ZKV_SCHEDULER_TIMEOUT_S": "5m"}, "zkv.worker: ZKV_SCHEDULER_TIMEOUT_S must be a finite "
                                        "number of seconds > 0, or inf to wait forever, got "
                                        "'5m'"),
    ({"ZKV_LOG_LEVEL": "verbose"}, "zkv.worker: ZKV_LOG_LEVEL must be one of debug, info, "
                                   "warning, error, critical, got 'verbose'"),
    ({"ZKV_BACKEND": "tpu"}, "zkv.worker: rank 1: unknown copy backend 'tpu'; one of 'auto', "
                             "'cupy', 'cpu', 'torch', 'torch-cpu'"),
    ({"ZKV_STORE_URL": "ftp://x"}, "zkv.worker: rank 1: bad store URL 'ftp://x': unknown "
                                   "scheme 'ftp' (one of file, redis, rediss, mooncake)"),
])
def test_a_configuration_it_cannot_serve_is_one_line(tmp_path: Path, extra: dict[str, str],
                                                     message: str) -> None:
    env = rank_env(tmp_path, **extra)
    r = subprocess.run([sys.executable, "-m", "zkv.worker"], env=env, capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr
    assert r.stderr == message + "\n"


def test_help_and_arguments() -> None:
    """Its environment configures it; before, ``--help`` said RANK was not set, and any
    argument was ignored."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZKV_", "RANK"))}
    r = subprocess.run([sys.executable, "-m", "zkv.worker", "--help"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Environment (zkvrun sets it): ``RANK``" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "zkv.worker", "--rank", "0"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr == ("zkv.worker: error: takes no arguments (its environment configures "
                        "it; see --help), got '--rank'\n")


def test_a_rank_whose_parent_dies_while_it_starts_stops(tmp_path: Path) -> None:
    """The launcher exits while the rank still loads torch: the rank stops by itself
    (``worker.stopped``, "parent process exited"). Before, its parent watcher read the
    parent's pid after those imports (~1 s), saw init's, and the orphan waited for a
    scheduler forever. (A parent gone before the rank's first line runs, ~30 ms, is not
    told apart from a rank that init started.)"""
    import json

    import orjson

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZKV_", "RANK"))}
    env.update(ZKV_CONFIG=LAYOUT.to_json(), RANK="0", ZKV_BACKEND="cpu",
               ZKV_PUB_ENDPOINT=f"ipc://{run_dir}/pub", ZKV_PULL_ENDPOINT=f"ipc://{run_dir}/pull",
               ZKV_LOG_DIR=str(tmp_path / "logs"), PYTHONPATH=ROOT)
    # It exits once torch is loading in the rank (its library mapped: the rank's first
    # lines, which read the parent's pid, ran), long before the rank's actor starts.
    launcher = ("import json, os, subprocess, sys\n"
                "from tests.waiting import wait_until\n"
                "p = subprocess.Popen([sys.executable, '-m', 'zkv.worker'], "
                "env=json.loads(sys.argv[1]), stdin=subprocess.DEVNULL, "
                "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                "def loading():\n"
                "    assert p.poll() is None\n"
                "    return b'libtorch' in open(f'/proc/{p.pid}/maps', 'rb').read()\n"
                "wait_until(loading, 60, 'torch loading in the rank', interval=0.002)\n"
                "print(p.pid, flush=True)\n"
                "os._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", launcher, json.dumps(env)], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    pid = int(r.stdout)
    try:
        wait_exited([pid], 60, "the orphaned rank")
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    lines = [orjson.loads(x) for x in (tmp_path / "logs" / "worker-0.jsonl").read_bytes()
             .splitlines()]
    assert any("parent process exited" in str(e.get("reason", "")) for e in lines), lines[-3:]


@pytest.mark.parametrize("value, want", [
    (None, 300.0), ("", 300.0), ("2.5", 2.5), ("inf", None), ("OFF", None), ("none", None),
])
def test_scheduler_timeout_from_env(value: str | None, want: float | None) -> None:
    from zkv.config import scheduler_timeout_from_env

    assert scheduler_timeout_from_env({} if value is None else
                                      {"ZKV_SCHEDULER_TIMEOUT_S": value}) == want


def test_a_rank_that_reaches_no_scheduler_stops_after_the_timeout(tmp_path: Path) -> None:
    """Nothing binds the endpoints (a node 0 that never came up): exit 5 and one line,
    after ZKV_SCHEDULER_TIMEOUT_S, not a wait forever."""
    env = rank_env(tmp_path, ZKV_SCHEDULER_TIMEOUT_S="0.5")
    pub = env["ZKV_PUB_ENDPOINT"]
    r = subprocess.run([sys.executable, "-m", "zkv.worker"], env=env, capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 5, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "zkv.worker: rank 1: no scheduler reached for "), r.stderr
    assert lines[0].endswith(f"s (scheduler timeout 0.5 s) at {pub}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_while_torch_imports_is_a_quiet_exit(tmp_path: Path, sig: int) -> None:
    """A Ctrl-C in a run's first seconds reaches every rank of the terminal's process group
    while torch still imports: exit 0 and nothing on stderr (before: a KeyboardInterrupt
    traceback from deep in torch's import per rank, status 1). Sent once torch's library
    is mapped (its import is under way, and takes a second more here)."""
    env = rank_env(tmp_path)
    with subprocess.Popen([sys.executable, "-m", "zkv.worker"], env=env, text=True,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as p:
        try:
            def torch_mapped() -> bool:
                try:
                    with open(f"/proc/{p.pid}/maps") as f:
                        return "libtorch" in f.read()
                except OSError:
                    return False

            wait_until(torch_mapped, timeout=60, what="torch's library mapped")
            p.send_signal(sig)
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert (p.returncode, out, err) == (0, "", ""), (p.returncode, err[-2000:])


def test_importing_the_module_leaves_the_importers_signals_alone() -> None:
    """Only the rank (``-m zkv.worker``) exits quietly on a stop signal: a process that
    imports the module (a test, a tool) keeps Ctrl-C a KeyboardInterrupt and SIGTERM fatal
    (they became a silent exit 0 for the whole process)."""
    code = ("import signal, zkv.worker.__main__\n"
            "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
            "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr


def test_a_stop_signal_while_the_store_opens_stops_the_actor_that_closes_it(
        tmp_path: Path) -> None:
    """A SIGTERM while the rank's store opens (a redis that accepts and never answers: the
    open waits its timeout) waits until the actor's handlers are in, then stops the actor,
    which closes the store: ``worker.stopped`` with reason ``sigterm``, status 0. (A
    SystemExit inside the open left the half-open store unclosed, and no line.)"""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"redis://127.0.0.1:{server.getsockname()[1]}/0?timeout_s=3"
        env = rank_env(tmp_path, ZKV_STORE_URL=url, ZKV_LOG_LEVEL="info")
        with subprocess.Popen([sys.executable, "-m", "zkv.worker"], env=env, text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) as p:
            try:
                server.settimeout(60)
                conn, _ = server.accept()  # the store's open is under way
                p.send_signal(signal.SIGTERM)
                out, err = p.communicate(timeout=60)
                conn.close()
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert p.returncode == 0, err[-2000:]
    lines = [orjson.loads(x) for x in (tmp_path / "logs" / "worker-1.jsonl").read_text()
             .splitlines()]
    stopped = [e for e in lines if e["event"] == "worker.stopped"]
    assert len(stopped) == 1 and stopped[0]["reason"] == "sigterm", stopped


def test_a_stop_signal_while_the_rank_exits_leaves_its_status(tmp_path: Path) -> None:
    """zkvrun forwards a stop signal to the ranks once the scheduler node stopped, while the
    ranks may be exiting on its Shutdown. Python's exit puts its handlers back to the
    defaults before the modules are torn down, so a SIGHUP there ended a rank that had
    stopped in order as "code -1 (SIGHUP)" (the node's SIGHUP test saw ranks -1, not 0).
    Here the rank stops on its scheduler timeout (5), and an object torn down with the
    script's globals sends it a SIGHUP: still 5."""
    code = ("import os, runpy, signal\n"
            "class SignalOnTeardown:\n"
            "    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGHUP)  # (delivered before kill returns)\n"
            "late = SignalOnTeardown()\n"
            "runpy.run_module('zkv.worker', run_name='__main__', alter_sys=True)\n")
    _exits_on_the_scheduler_timeout(tmp_path, code)


def test_the_rank_leaves_no_thread_that_frees_its_cache_during_the_exit(tmp_path: Path) -> None:
    """When ``main`` returns, no other thread is left: the parent watcher held the actor,
    and when it let go after Python's exit had begun, freeing a tensor there ended that
    thread with a forced unwind through torch's C++ frames: "terminate called without an
    active exception", status -6 (SIGABRT), about one exit in twenty here (gdb's stack:
    the watcher's argument tuple freeing the actor's tensors in ``take_gil``)."""
    code = ("import threading, zkv.worker.__main__ as m\n"
            "code = m.main()\n"
            "others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]\n"
            "assert others == [], others\n"
            "raise SystemExit(code)\n")
    _exits_on_the_scheduler_timeout(tmp_path, code)


def _exits_on_the_scheduler_timeout(tmp_path: Path, code: str) -> None:
    """Python ``code`` run as rank 1 with no scheduler and a 0.5 s timeout: status 5."""
    env = rank_env(tmp_path, ZKV_SCHEDULER_TIMEOUT_S="0.5")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 5, (r.returncode, r.stderr[-2000:])
