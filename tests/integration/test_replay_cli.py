"""``zkv replay``'s honest command line: bad arguments are one line and status 2 (nothing
started), dropped requests are counted and make the status 4, a wrong layout is refused
at the ranks' hello with the differing field named."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from zkv import log as zlog


def _run(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--log-dir",
         str(tmp_path / "logs"), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--batch", "-1"], "argument --batch: must be > 0, got -1"),
    (["--batch", "x"], "argument --batch: not an int: 'x'"),
    (["--batch", "4097"], "argument --batch: must be <= 4088 (a step's batch carries two "
                          "ops per request), got 4097"),
    (["--ranks", "5000"], "--ranks 5000 is more than 4 per core"),
    (["--ranks", "0"], "argument --ranks: must be > 0, got 0"),
    (["--layers", "0"], "argument --layers: must be > 0, got 0"),
    (["--host-blocks", "-1"], "argument --host-blocks: must be >= 0, got -1"),
    (["--threshold", "0"], "argument --threshold: must be > 0, got 0"),
    (["--dtype", "float64"], "unsupported dtype 'float64'"),
    (["--device-blocks", "100000000"], "the pools need"),
    # the chat workload is built in the scheduler's memory (~8 KB a request): it ran out
    # after the ranks had started
    (["--requests", "100000000"], "--requests 100000000 needs about 762.9 GiB for the chat "
                                  "workload"),
    (["--workload", "trace", "--trace", "/nonexistent.jsonl"], "trace not found"),
    # was: an empty replay, status 0; and chat replayed, the trace ignored, status 0
    (["--requests", "0"], "argument --requests: must be > 0, got 0"),
    (["--trace", "{tmp}/not-json.jsonl"], "--trace is read by --workload trace only (the "
                                          "workload is chat): add --workload trace"),
    (["--metrics-port", "70000"], "argument --metrics-port: must be in [0, 65535], got 70000"),
    # the chat workload's seed (numpy's generator): was a traceback from the scheduler
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--prefetch-base-ms", "-1"],
     "argument --prefetch-base-ms: must be a finite number >= 0, got -1"),
    (["--prefetch-per-ki-token-ms", "nan"],
     "argument --prefetch-per-ki-token-ms: must be a finite number >= 0, got nan"),
    (["--metrics-file", "{tmp}/no/m.prom"], "--metrics-file {tmp}/no/m.prom: no directory "
                                             "{tmp}/no"),
    (["--metrics-file", "{tmp}"], "--metrics-file {tmp}: is a directory"),
    # (abspath drops the '/': the check passed, the write failed at the end, EISDIR)
    (["--metrics-file", "{tmp}/m.prom/"], "--metrics-file {tmp}/m.prom/: is a directory"),
    (["--log-dir", "{tmp}/file"], "log directory {tmp}/file: not a directory"),
    (["--log-dir", "{tmp}/file/logs/run"], "log directory {tmp}/file/logs/run: cannot make it "
                                           "({tmp}/file is not a directory)"),
    (["--store-dir", "{tmp}/file"], "store directory {tmp}/file: exists and is not a "
                                    "directory"),
    (["--store-dir", "{tmp}/file/l3"], "store directory {tmp}/file/l3: cannot create it (Not "
                                       "a directory)"),
    (["--storage", "file://{tmp}/l3?max_gb=nan"], "max_gb='nan' is not a finite number"),
    (["--storage", "file://{tmp}/l3?max_bytes=1"], "bad store URL 'file://{tmp}/l3?max_bytes=1': "
     "a budget of 1 bytes per writer (2 writers) holds no block of 32832 bytes; give a larger "
     "max_gb"),
    (["--workload", "trace", "--trace", "{tmp}/not-json.jsonl"],
     "trace {tmp}/not-json.jsonl, line 2: unexpected character"),
    (["--workload", "trace", "--trace", "{tmp}/no-ids.jsonl"],
     "trace {tmp}/no-ids.jsonl, line 1: no 'hash_ids'"),
    (["--workload", "trace", "--trace", "{tmp}/bad-ids.jsonl"],
     "trace {tmp}/bad-ids.jsonl, line 1: block ids must be a 1-D sequence of integers"),
    (["--workload", "trace", "--trace", "{tmp}"],
     "--trace {tmp} is not a regular file (a directory, a pipe or a device)"),
    (["--workload", "trace", "--trace", "{tmp}/file"], "--trace {tmp}/file holds no request"),
    (["--storage", "redis://127.0.0.1:1/0?ttl_s=99999999999999999999"],
     "ttl_s must be <= 1000000000000000"),
    (["--workload", "trace", "--trace", "{tmp}/bool-ids.jsonl"],
     "trace {tmp}/bool-ids.jsonl, line 1: block ids must be a 1-D sequence of integers, got a "
     "bool"),
    # an empty value ("$URL" with URL unset) was the option not given: a fresh temp-dir L3,
    # no metrics file, the default log root; status 0
    (["--storage", ""], "argument --storage: empty value '' (leave the option out for its "
                        "default)"),
    (["--store-dir", ""], "argument --store-dir: empty value ''"),
    (["--metrics-file", ""], "argument --metrics-file: empty value ''"),
    (["--log-dir", " "], "argument --log-dir: empty value ' '"),
    (["--workload", "trace", "--trace", ""], "argument --trace: empty value ''"),
    # flags the configuration does not read: they changed nothing and said nothing, status 0
    (["--threshold", "5"], "--threshold is read by --policy write_through_selective only (the "
                           "policy is write_back)"),
    (["--policy", "write_through", "--prefetch", "timeout", "--prefetch-per-ki-token-ms",
      "1", "--threshold", "1"], "--threshold is read by --policy write_through_selective"),
    (["--prefetch-base-ms", "10"], "--prefetch-base-ms is read by --prefetch timeout only (the "
                                   "prefetch policy is wait_complete)"),
    (["--prefetch", "best_effort", "--prefetch-per-ki-token-ms", "10"],
     "--prefetch-per-ki-token-ms is read by --prefetch timeout only"),
    # --force passes the pools' check against memory, not these: a pool count past 64 bits
    # was an orjson TypeError traceback, one the scheduler cannot count a MemoryError one
    (["--force", "--host-blocks", "99999999999999999999999"],
     "num_host_blocks must be <= 2**31 - 1, got 99999999999999999999999"),
    (["--force", "--device-blocks", "2147483647", "--host-blocks", "2147483647"],
     "the scheduler's pools of 4294967294 blocks need about 192.0 GiB of its memory"),
    (["--host-blocks", "0"], "--host-blocks 0 leaves the L3 store unused (blocks reach it and "
                             "come back through host memory): give host blocks, or --storage "
                             "none"),
    (["--host-blocks", "0", "--storage", "file://{tmp}/l3"], "--host-blocks 0 leaves the L3"),
    # Python's int() / float() read "1_0" as 10
    (["--ranks", "1_0"], "argument --ranks: not an int: '1_0'"),
    (["--prefetch-base-ms", "5_0"], "argument --prefetch-base-ms: not a number: '5_0'"),
])
def test_config_errors_are_one_line_and_start_nothing(tmp_path: Path, args: list[str],
                                                      message: str) -> None:
    (tmp_path / "file").write_bytes(b"")
    (tmp_path / "not-json.jsonl").write_text('{"hash_ids": [1, 2]}\n{hash_ids: [3]}\n')
    (tmp_path / "no-ids.jsonl").write_text('{"timestamp": 0, "input_length": 512}\n')
    (tmp_path / "bad-ids.jsonl").write_text('{"hash_ids": ["a", "b"]}\n')
    (tmp_path / "bool-ids.jsonl").write_text('{"hash_ids": [7, true]}\n')
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    message = message.replace("{tmp}", str(tmp_path))
    r = _run(tmp_path, *args, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("zkv replay: error: "), r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == "" and not (tmp_path / "logs").exists()  # nothing was launched


def test_a_taken_metrics_port_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    with socket.socket() as s:  # another server on the port
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run(tmp_path, "--metrics-port", str(port), timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"zkv replay: error: metrics port {port}: cannot listen on "
                        f"127.0.0.1:{port} (Address already in use)\n")
    assert r.stdout == "" and not (tmp_path / "logs").exists()


def test_metrics_that_cannot_be_written_at_the_end_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zkv.replay import _write_metrics

    assert not _write_metrics(str(tmp_path / "gone" / "m.prom"))  # its folder went away
    err = capsys.readouterr().err
    assert err == (f"zkv replay: error: cannot write the metrics to {tmp_path}/gone/m.prom: "
                   "No such file or directory\n")
    assert _write_metrics(str(tmp_path / "m.prom"))
    assert "zkv:" in (tmp_path / "m.prom").read_text()


def test_dropped_requests_are_counted_and_fail_the_status(tmp_path: Path) -> None:
    # 20 device blocks: no chat prompt (>= 34 blocks) fits, so every request is dropped
    r = _run(tmp_path, "--requests", "6", "--device-blocks", "20", "--host-blocks", "8",
             "--store-dir", "none")
    assert r.returncode == 4, r.stdout + r.stderr
    assert re.search(r"dropped\s+6 requests did not fit in the pools \(exit status 4\)", r.stdout)
    assert re.search(r"requests\s+0 ", r.stdout)
    assert "zkvrun: scheduler (pid" in r.stderr and "exited with code 4" in r.stderr


def test_dropped_requests_are_a_result_not_restarted(tmp_path: Path) -> None:
    """--max-restarts restarts after a lost rank, not after a result a rerun cannot change:
    dropped requests (4) are said once. (Before, the whole job ran again: two summaries,
    the second against the first run's L3.)"""
    r = _run(tmp_path, "--requests", "6", "--device-blocks", "20", "--host-blocks", "8",
             "--store-dir", "none", "--max-restarts", "2")
    assert r.returncode == 4, r.stdout + r.stderr
    assert len(re.findall(r"dropped\s+6 requests", r.stdout)) == 1, r.stdout
    assert "exited with code 4, one of --final-codes: not restarting" in r.stderr, r.stderr
    assert "restarting the group" not in r.stderr


@pytest.mark.parametrize("var,value,message", [
    ("ZKV_LOG_LEVEL", "verbose", "ZKV_LOG_LEVEL must be one of debug, info, warning, error, "
                                 "critical, got 'verbose'"),
    # the ranks' backend: a typo was each rank's exit 2 after the group started, then
    # zkvrun's teardown (and the scheduler's "stopped (SIGTERM)"), status 1
    ("ZKV_BACKEND", "bogus", "ZKV_BACKEND: unknown copy backend 'bogus'; one of 'auto', "
                             "'cupy', 'cpu', 'torch', 'torch-cpu'"),
    # the ranks' too: each said so after the group started (5 lines, the scheduler's
    # "stopped (SIGTERM)" among them); a heartbeat of 1e-9 s flooded the scheduler
    ("ZKV_SCHEDULER_TIMEOUT_S", "abc", "ZKV_SCHEDULER_TIMEOUT_S must be a finite number of "
                                       "seconds > 0, or inf to wait forever, got 'abc'"),
    ("ZKV_HEARTBEAT_S", "soon", "ZKV_HEARTBEAT_S must be a finite number of seconds in "
                                "[0.01, 0.5], got 'soon'"),
    ("ZKV_HEARTBEAT_S", "1e-9", "ZKV_HEARTBEAT_S must be a finite number of seconds in "
                                "[0.01, 0.5], got '1e-9'"),
])
def test_an_environment_typo_is_one_line_and_starts_nothing(tmp_path: Path, var: str,
                                                             value: str, message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "zkv.cli", "replay", "--log-dir",
                        str(tmp_path / "logs")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, var: value})
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "logs").exists()
    assert r.stderr == f"zkv replay: error: {message}\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_sigkilled_replay_leaves_an_l3_dir_the_next_replay_removes(tmp_path: Path) -> None:
    import os
    import signal

    from launch.zkvrun import run_base
    from tests.waiting import wait_until

    base = "/dev/shm" if os.path.isdir("/dev/shm") else run_base()
    root = Path(base) / f"zkv-{os.geteuid()}"
    proc = subprocess.Popen([sys.executable, "-m", "zkv.cli", "replay", "--no-progress",
                             "--requests", "2000", "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mine: list[Path] = []

    def made() -> bool:  # its default L3 directory, named after its pid
        assert proc.poll() is None
        mine[:] = root.glob(f"l3-{proc.pid}-*") if root.is_dir() else []
        return bool(mine)

    try:
        wait_until(made, 60, "the replay's L3 directory")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert mine[0].is_dir()  # left behind
    r = _run(tmp_path, "--requests", "2", "--store-dir", "none")
    assert r.returncode == 0, r.stderr
    assert not mine[0].exists()  # the next start removed it


def test_a_store_never_reached_is_one_warning_and_its_password_is_never_shown(
        tmp_path: Path) -> None:
    from tests.servers import free_port

    port = free_port()  # nothing listens there
    r = _run(tmp_path, "--requests", "40", "--storage",
             f"redis://:s3cret-pw@127.0.0.1:{port}/0?timeout_s=0.5")
    assert r.returncode == 0, r.stdout + r.stderr  # L3 is a cache: the replay goes on
    assert f"L3=redis://127.0.0.1:{port}/0 " in r.stdout
    assert re.search(r"verified\s+\d+ reused blocks .*, 0 mismatched; 0 failed ops", r.stdout)
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("zkv replay: warning")]
    assert len(warnings) == 1, r.stderr
    assert re.fullmatch(
        rf"zkv replay: warning: L3 redis://127\.0\.0\.1:{port}/0: [\d,]+ existence queries "
        rf"failed(, [\d,]+ block writes dropped)?; why: zkv logs {re.escape(str(tmp_path))}"
        r"/logs --event storage", warnings[0]), warnings[0]
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.jsonl"))
    assert "store_unreachable" in logs
    assert "s3cret-pw" not in r.stdout + r.stderr + logs


def test_a_store_that_failed_nothing_adds_no_warning(tmp_path: Path) -> None:
    r = _run(tmp_path, "--requests", "20")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "L3=file:///" in r.stdout and "warning" not in r.stderr, r.stderr


def test_progress_is_a_bar_on_a_terminal_and_nothing_when_piped(tmp_path: Path) -> None:
    """tqdm's bar on a terminal (a pty here) ends at every request; piped, no bar line."""
    import fcntl
    import os
    import pty
    import struct
    import termios
    import threading

    args = [sys.executable, "-m", "zkv.cli", "replay", "--requests", "24", "--store-dir", "none",
            "--log-dir", str(tmp_path / "logs")]
    master, slave = pty.openpty()
    # a terminal's size, as a real one has (a new pty is 0 x 0, where tqdm hides its bar)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks: list[bytes] = []

    def read() -> None:  # drain the terminal while the job runs (a full pty blocks writers)
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=slave, timeout=240)
    finally:
        os.close(slave)
        reader.join(10)
        os.close(master)
    shown = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, proc.stdout.decode() + shown
    assert re.search(r"replay: 100%\|.*\| 24/24 \[", shown), shown
    piped = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert piped.returncode == 0, piped.stdout + piped.stderr
    assert "replay:" not in piped.stderr and "\r" not in piped.stderr, piped.stderr


def test_an_abbreviated_flag_is_refused_and_starts_nothing(tmp_path: Path) -> None:
    """Was: ``--stora URL`` was taken for --storage and, unlike --storage, passed on to the
    scheduler node's command line, its password with it (``ps``). The refusal echoes the
    arguments: the password is written ``***@`` (it was shown)."""
    r = _run(tmp_path, "--stora", "redis://:sekrit@127.0.0.1:6399/0", timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "zkv replay: error: unrecognized arguments: --stora redis://***@127.0.0.1:6399/0"]
    assert r.stdout == "" and not (tmp_path / "logs").exists()  # nothing was launched


def _hangups_not_ignored() -> None:
    """(In the child, before exec.) A SIGHUP that pytest was started with ignored (a nohup'd
    run) stays ignored in zkv replay, as nohup means: the test's SIGHUP must not be."""
    import signal

    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _signal_a_serving_replay(tmp_path: Path, sig: int, *flags: str) -> tuple[int, str, str]:
    """``zkv replay`` in a session of its own, ``sig`` sent to its process group (as a
    terminal does) once the node published a batch: (status, stdout, stderr)."""
    return _act_on_a_serving_replay(tmp_path, lambda proc: os.killpg(proc.pid, sig), *flags)


def _act_on_a_serving_replay(tmp_path: Path, act: Callable[[subprocess.Popen[str]], object],
                             *flags: str) -> tuple[int, str, str]:
    """``zkv replay`` (logs in ``tmp_path/logs``) in a session of its own; ``act(proc)``
    once the node published a batch, then its end: (status, stdout, stderr)."""
    import signal

    from tests.waiting import wait_exited, wait_until

    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, "-m", "zkv.cli", "replay", "--no-progress",
                             "--requests", "100000", "--log-dir", str(logs), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_hangups_not_ignored)
    try:
        sched_log = logs / "scheduler.jsonl"

        def serving() -> bool:  # the node published a batch: it is in its replay loop
            assert proc.poll() is None
            return sched_log.exists() and "dispatcher.batch_published" in sched_log.read_text()

        wait_until(serving, 120, "the replay's first batch")
        act(proc)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    wait_exited([proc.pid], 10, "zkv replay")
    return proc.returncode, out, err


def _exit_codes(logs: Path) -> dict[object, int]:
    """Each child's exit code from zkvrun's log: ``{"scheduler": code, rank: code}``."""
    exits = [orjson.loads(line) for line in (logs / "launcher.jsonl").read_text().splitlines()]
    return {e.get("rank", "scheduler"): e["code"] for e in exits
            if e["event"] in (zlog.RANK_EXITED, zlog.SCHEDULER_EXITED)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, pidfds")
def test_ctrl_c_is_one_line_and_status_130(tmp_path: Path) -> None:
    """Ctrl-C signals the whole foreground group: zkvrun, the scheduler node, the ranks.
    Was: the node's KeyboardInterrupt traceback."""
    import signal

    code, out, err = _signal_a_serving_replay(tmp_path, signal.SIGINT, "--store-dir", "none")
    assert code == 130, out + err
    assert "Traceback" not in err, err
    assert "zkv replay: interrupted" in err.splitlines(), err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, pidfds")
def test_a_hangup_stops_the_run_as_sigterm_does(tmp_path: Path) -> None:
    """A closed terminal (SIGHUP, which zkvrun forwards to every child): the scheduler node
    writes its metrics and closes its dispatcher, the ranks stop their actors, status 129.
    Before, SIGHUP's default action killed each of them on the spot: no metrics file, no
    store closed, every child "code -1 (SIGHUP)"."""
    import signal

    logs, metrics = tmp_path / "logs", tmp_path / "metrics.txt"
    code, out, err = _signal_a_serving_replay(tmp_path, signal.SIGHUP, "--store-dir",
                                              str(tmp_path / "l3"), "--metrics-file", str(metrics))
    assert code == 129, out + err
    assert "zkv replay: stopped (SIGHUP)" in err.splitlines() and "Traceback" not in err, err
    assert "zkv:batches_total " in metrics.read_text()
    assert '"dispatcher.stopped"' in (logs / "scheduler.jsonl").read_text()
    codes = _exit_codes(logs)
    assert codes == {"scheduler": 129, 0: 0, 1: 0}, codes


def _hooked_env(tmp_path: Path, hook_code: str, **extra: str) -> dict[str, str]:
    """This environment with ``hook_code`` as a ``sitecustomize`` on PYTHONPATH (so every
    process of the run executes it as it starts), and ``extra``."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(hook_code)
    path = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


# Installed in every process of the run (PYTHONPATH): the one named by T_SIGINT_IN ("front
# end", or a child's ZKV_ROLE) sends itself SIGINT as it starts importing T_SIGINT_AT, so the
# signal lands at that point of its start, every time.
SIGINT_AT_IMPORT = '''
import os, signal, sys
if os.environ.get("ZKV_ROLE", "front end") == os.environ.get("T_SIGINT_IN"):
    def _hook(event, args, fired=[]):
        if event == "import" and args[0] == os.environ["T_SIGINT_AT"] and not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)
    sys.addaudithook(_hook)
'''


@pytest.mark.parametrize("who,module", [
    ("front end", "numpy"),  # while it imports zkv.replay (was: a traceback, or numpy's
    # ImportError "you should not try to import numpy from its source directory")
    ("front end", "launch.zkvrun"),  # after its arguments were read, before zkvrun runs
    ("scheduler", "numpy"),  # the node, while it imports zkv.replay (was: a traceback)
])
def test_ctrl_c_early_is_one_line_and_status_130(tmp_path: Path, who: str, module: str) -> None:
    """The first second of a replay, before any handler of zkv's own was installed."""
    env = _hooked_env(tmp_path, SIGINT_AT_IMPORT, T_SIGINT_IN=who, T_SIGINT_AT=module)
    r = subprocess.run([sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--ranks",
                        "1", "--requests", "20", "--log-dir", str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 130, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr
    assert "zkv replay: interrupted" in r.stderr.splitlines(), r.stderr
    if who == "front end":  # nothing started
        assert r.stderr == "zkv replay: interrupted\n" and not (tmp_path / "logs").exists()
    else:
        assert "zkvrun: scheduler (pid" in r.stderr and "exited with code 130" in r.stderr


# Installed in every process of the run (PYTHONPATH): the scheduler node gets a SIGTERM as
# it starts closing its dispatcher, as when zkvrun's teardown (a rank died) reaches a node
# already cleaning up after it saw the rank lost itself.
SIGTERM_IN_CLEANUP = '''
import os, signal
if os.environ.get("ZKV_ROLE") == "scheduler":
    from zkv.scheduler.dispatcher import Dispatcher
    real = Dispatcher.close
    def close(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)
    Dispatcher.close = close
'''


def test_a_signal_during_the_cleanup_still_writes_the_metrics(tmp_path: Path) -> None:
    """The node's cleanup (dispatcher, store, metrics server, metrics file) runs to its end
    and the signal is acted on after it (status 143). Before, the signal's exception left
    the cleanup at the dispatcher: no metrics file, the store never closed."""
    env = _hooked_env(tmp_path, SIGTERM_IN_CLEANUP)
    metrics = tmp_path / "metrics.txt"
    r = subprocess.run([sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--requests",
                        "4", "--log-dir", str(tmp_path / "logs"), "--store-dir",
                        str(tmp_path / "l3"), "--metrics-file", str(metrics)],
                       capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 128 + 15, r.stdout + r.stderr
    assert "zkv replay: stopped (SIGTERM)" in r.stderr.splitlines(), r.stderr
    assert metrics.exists(), r.stderr
    assert "zkv:batches_total " in metrics.read_text()
    assert '"dispatcher.stopped"' in (tmp_path / "logs" / "scheduler.jsonl").read_text()


# Installed in every process of the run (PYTHONPATH): the scheduler node takes a SIGTERM
# while its dispatcher handles the first ack (inside its "a message must never take the
# scheduler down" guard).
SIGTERM_IN_AN_ACK = '''
import os, signal
if os.environ.get("ZKV_ROLE") == "scheduler":
    from zkv.scheduler.dispatcher import Dispatcher
    real = Dispatcher._on_message
    def on_message(self, *args, fired=[]):
        if not fired and self.num_received > 1:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args)
    Dispatcher._on_message = on_message
'''


def test_a_signal_that_lands_while_an_ack_is_handled_stops_the_node(tmp_path: Path) -> None:
    """The node's SIGTERM (zkvrun's teardown, a closed terminal's SIGHUP) raised inside the
    dispatcher's handling of a message: the node stops as signalled (143). Before, that
    guard's ``except Exception`` took the signal for a malformed message and the node
    served on: the whole workload ran and the status was 0 (under zkvrun's teardown the
    ranks, signalled half a grace period later, said bye and the run failed for a lost
    rank, a CI flake of the hangup test)."""
    env = _hooked_env(tmp_path, SIGTERM_IN_AN_ACK)
    r = subprocess.run([sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--requests",
                        "300", "--log-dir", str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=240, env=env)
    assert "zkv replay: stopped (SIGTERM)" in r.stderr.splitlines(), r.stdout + r.stderr
    assert r.returncode == 128 + 15, r.stdout + r.stderr


# Installed in every process of the run (PYTHONPATH): the scheduler node removes the
# metrics file's folder as it closes, so the file cannot be written at the end.
METRICS_DIR_GONE = '''
import os
if os.environ.get("ZKV_ROLE") == "scheduler":
    from zkv.scheduler.dispatcher import Dispatcher
    real = Dispatcher.close
    def close(self, *args, **kwargs):
        os.rmdir(os.environ["T_METRICS_DIR"])
        return real(self, *args, **kwargs)
    Dispatcher.close = close
'''


def test_metrics_that_cannot_be_written_are_a_result_not_restarted(tmp_path: Path) -> None:
    """A rerun writes the metrics no better: one line, status 1, the workload run once.
    Before: the node's 1 was a failure to restart after, so --max-restarts 2 ran the whole
    workload three times, failing the same way each time."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    env = _hooked_env(tmp_path, METRICS_DIR_GONE, T_METRICS_DIR=str(folder))
    r = subprocess.run([sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--requests",
                        "4", "--log-dir", str(tmp_path / "logs"), "--max-restarts", "2",
                        "--metrics-file", str(folder / "m.prom")],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("zkv replay: error: cannot write the metrics to") == 1, r.stderr
    assert "restarting the group" not in r.stderr, r.stderr
    assert len(re.findall(r"verified\s+\d+ reused blocks", r.stdout)) == 1, r.stdout


# Installed in every process of the run (PYTHONPATH): the scheduler node's state check at
# the end of the run fails (what a bug in the scheduler would do).
CHECK_FAILS = '''
import os
if os.environ.get("ZKV_ROLE") == "scheduler":
    from zkv.scheduler import invariants
    def check(core):
        raise AssertionError("node n7: ref 2 but 1 requests hold it")
    invariants.check = check
'''


def test_a_failed_state_check_at_the_end_still_closes_all(tmp_path: Path) -> None:
    """The node's end-of-run check of the pools and the tree fails: one line naming it,
    status 1, and the cleanup still ran (dispatcher closed, ranks told Shutdown and exited
    0, the metrics file written). Before, the AssertionError skipped all of it: a traceback,
    no metrics file, the ranks torn down by zkvrun's SIGTERM instead of told."""
    env = _hooked_env(tmp_path, CHECK_FAILS)
    metrics, logs = tmp_path / "metrics.txt", tmp_path / "logs"
    r = subprocess.run([sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--requests",
                        "4", "--log-dir", str(logs), "--metrics-file", str(metrics)],
                       capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("zkv replay: failed: the scheduler's state check at the end: node n7: ref 2 but 1 "
            "requests hold it") in r.stderr.splitlines(), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "zkv:batches_total " in metrics.read_text()
    assert '"dispatcher.stopped"' in (logs / "scheduler.jsonl").read_text()
    codes = _exit_codes(logs)
    assert codes == {"scheduler": 1, 0: 0, 1: 0}, codes


def test_the_largest_batch_taken_fits_in_one_batch_of_ops(tmp_path: Path) -> None:
    """A step's batch carries a check and a fill per request (a reused prefix, new blocks)
    beside the cache's own ops. ``--batch 4096`` was taken, and on the chat workload the
    second step's batch had 8193 ops: a ValueError traceback from the scheduler node after
    the ranks had started (``--requests 8192 --batch 4096 --policy write_through`` on a small
    layout). Now it is one line, status 2, nothing started; the bound leaves room for them."""
    from zkv.protocol import MAX_OPS
    from zkv.replay_args import MAX_BATCH

    r = _run(tmp_path, "--batch", "4096", "--requests", "4", "--ranks", "1", "--store-dir",
             "none", timeout=60)
    assert (r.returncode, r.stdout) == (2, ""), r.stdout + r.stderr
    assert r.stderr == (f"zkv replay: error: argument --batch: must be <= {MAX_BATCH} (a step's "
                        "batch carries two ops per request), got 4096\n"), r.stderr
    assert not (tmp_path / "logs").exists()
    assert 2 * MAX_BATCH + 2 * 4 <= MAX_OPS  # two sims a request, this step's and the last's


def test_a_device_only_replay_runs(tmp_path: Path) -> None:
    """``--host-blocks 0 --storage none`` (what the refusal of ``--host-blocks 0`` alone
    says to do) runs. Before, the launcher took the store flags off the node's argv (a URL
    is no one's to see in ``ps``), and the node, checking the flags again, refused it."""
    for flags in (["--storage", "none"], ["--store-dir", "none"]):
        r = _run(tmp_path, "--requests", "6", "--host-blocks", "0", *flags)
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(r"device \d+ host 0 blocks per rank", r.stdout), r.stdout
        assert "L3=off" in r.stdout, r.stdout


def test_a_reader_of_the_summary_that_is_gone_leaves_the_status_alone(
        tmp_path: Path) -> None:
    """``zkv replay | head -0``: the summary's pipe has no reader. The run's status stands
    (0: every block verified) and there is no traceback. Before: BrokenPipeError from the
    node, status 1."""
    read, write = os.pipe()
    os.close(read)  # no reader: the summary's write gets EPIPE
    with os.fdopen(write, "w") as out:
        r = subprocess.run([sys.executable, "-m", "zkv.cli", "replay", "--no-progress",
                            "--requests", "4", "--log-dir", str(tmp_path / "logs")],
                           stdout=out, stderr=subprocess.PIPE, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def _metric(text: str, name: str) -> float:
    [value] = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f"{name} ")]
    return value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, pidfds")
def test_a_killed_rank_is_counted_lost_in_the_metrics_file(tmp_path: Path) -> None:
    """A rank SIGKILLed mid-run: zkvrun sees the dead process and stops the node (SIGTERM)
    before the dispatcher's grace after the disconnect declared the rank lost. The node
    gives it that grace: the metrics file counts the rank lost and no batch in flight.
    Before: ``zkv:lost_ranks_total 0`` (the alert meant for it silent), in-flight batches
    that close had forgotten."""
    import signal

    logs, metrics = tmp_path / "logs", tmp_path / "m.prom"

    def kill_rank_1(_proc: subprocess.Popen[str]) -> None:
        launcher = (logs / "launcher.jsonl").read_text().splitlines()
        [pid] = [e["child_pid"] for e in map(orjson.loads, launcher)
                 if e["event"] == zlog.RANK_STARTED and e["rank"] == 1]
        os.kill(pid, signal.SIGKILL)

    code, out, err = _act_on_a_serving_replay(
        tmp_path, kill_rank_1, "--ranks", "2", "--store-dir", "none", "--metrics-file",
        str(metrics))
    assert code == 1, out + err
    text = metrics.read_text()
    assert _metric(text, "zkv:lost_ranks_total") == 1, text
    assert _metric(text, "zkv:inflight_batches") == 0, text
