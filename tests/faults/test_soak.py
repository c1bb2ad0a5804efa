"""``zkv soak`` for a few seconds: every kind of fault once (in order), then at random;
every one survived, nothing leaked, every untouched batch verified. The full soak is the
command itself (minutes); this keeps CI short."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from zkv.soak import FAULTS

ROOT = str(Path(__file__).resolve().parents[2])


def test_short_soak_survives_every_fault() -> None:
    r = subprocess.run([sys.executable, "-m", "zkv.cli", "soak", "--seconds", "2",
                        "--fault-every", "0.2", "--seed", "3"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for kind in FAULTS:
        m = re.search(rf"\b{kind} (\d+)/(\d+)", out)
        assert m and m.group(1) == m.group(2) and int(m.group(2)) >= 1, (kind, out)
    assert re.search(r"leaked\s+0 blocks \((\d+) of \1 epochs checked\)", out), out  # every one
    assert re.search(r"unexpected\s+none", out)
    m = re.search(r"verified\s+(\d+) reused blocks", out)
    assert m and int(m.group(1)) > 0
    m = re.search(r"requests\s+(\d+) in (\d+) steps = ([\d.]+) requests/s held", out)
    assert m and int(m.group(1)) > 0
    assert re.search(r"scheduler\s+fds \d+ -> \d+\s+RSS \d+ -> \d+ MiB", out)


def test_a_negative_seed_is_a_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from zkv.soak import _parse

    with pytest.raises(SystemExit) as e:  # was: a traceback from numpy at the first batch
        _parse(["--seed", "-1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zkv soak: error: argument --seed: must be >= 0, got -1")


@pytest.mark.parametrize("args, message", [
    (["--seconds", "nan"], "argument --seconds: must be a finite number > 0, got nan"),
    (["--seconds", "0"], "argument --seconds: must be a finite number > 0, got 0"),
    (["--fault-every", "inf"], "argument --fault-every: must be a finite number > 0, got inf"),
    (["--ranks", "0"], "argument --ranks: must be > 0, got 0"),
    (["--check-every", "-3"], "argument --check-every: must be > 0, got -3"),
    # pools no chat prompt fits: no batch would be sent, and a killed rank never noticed
    # (before: a scheduler restart then waited 120 s for it and died with a traceback)
    (["--device-blocks", "20"], "--device-blocks must be >= 390 (the longest chat prompt "
                                "alone), got 20"),
    (["--host-blocks", "-1"], "argument --host-blocks: must be >= 0, got -1"),
    (["--store-mb", "0"], "argument --store-mb: must be > 0, got 0"),
    # Python's int() reads 1_0 as 10; an empty log dir (a variable unset) was taken as not
    # given: the logs went into the run directory, removed at the end
    (["--device-blocks", "5_12"], "argument --device-blocks: not an int: '5_12'"),
    (["--log-dir", ""], "argument --log-dir: empty value '' (leave the option out for its "
                        "default)"),
])
def test_bad_flags_are_one_line_and_start_nothing(args: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from zkv.soak import _parse

    with pytest.raises(SystemExit) as e:
        _parse(args)  # the check runs before any process or directory is made
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"zkv soak: error: {message}"


def test_ranks_and_pools_past_the_machine_are_refused_unless_forced(
        capsys: pytest.CaptureFixture[str]) -> None:
    """As zkv replay and zkvrun bound them: before, ``--ranks 99`` started 99 workers on
    this 2-core VM and ran far past its --seconds."""
    from launch.env import max_local_ranks
    from zkv.soak import _parse

    too_many = max_local_ranks() + 1
    with pytest.raises(SystemExit) as e:
        _parse(["--ranks", str(too_many)])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"zkv soak: error: --ranks {too_many} is more than 4 per core ({max_local_ranks()} "
        "here); pass --force if you mean it")
    with pytest.raises(SystemExit) as e:
        _parse(["--device-blocks", str(2 * 10**7)])
    assert e.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert re.fullmatch(r"zkv soak: error: the pools need [\d.]+ GiB \(2 ranks x "
                        r"20000000\+256 blocks x \d+ KiB\) and [\d.]+ GiB is available "
                        r"\(pools may take 80% of it\); lower them or pass --force", last), last
    assert _parse(["--ranks", str(too_many), "--device-blocks", str(2 * 10**7), "--force"]).force
    # what --force does not pass: a pool past what a block id holds (was a traceback from
    # the layout), and pools the scheduler cannot even count (its MemoryError, or the OOM
    # killer, after the ranks started)
    for flags, want in (
            (["--device-blocks", str(10**12)], "zkv soak: error: --device-blocks / "
             "--host-blocks: num_device_blocks must be <= 2**31 - 1, got 1000000000000"),
            (["--device-blocks", str(2**31 - 1), "--host-blocks", str(2**31 - 1)],
             "zkv soak: error: the scheduler's pools of 4294967294 blocks need about 192.0 "
             "GiB of its memory")):
        with pytest.raises(SystemExit) as e:
            _parse([*flags, "--force"])
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith(want)


def test_no_faults_named_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from zkv.soak import FAULTS, _parse

    with pytest.raises(SystemExit):
        _parse(["--faults", ","])
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"zkv soak: error: --faults names none; choose from {','.join(FAULTS)}")


def test_a_log_dir_that_cannot_be_one_is_refused(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from zkv.soak import _parse

    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(SystemExit) as e:  # was: every process logged to stderr instead
        _parse(["--log-dir", str(tmp_path / "file")])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"zkv soak: error: log directory {tmp_path / 'file'}: not a directory")


def test_a_rank_that_never_comes_back_is_in_the_report_not_a_traceback() -> None:
    # In its own process: zkv soak configures the process's logging (its log directory).
    # The restart fault raises what the dispatcher's wait_for_ranks raises then.
    code = (
        "import sys\n"
        "from zkv import soak\n"
        "def restart_lost(self):\n"
        "    raise TimeoutError('ranks [1] of 2 did not join within 120.0 s: rank 1: no hello')\n"
        "soak.Soak._fault_restart = restart_lost\n"
        "sys.exit(soak.main(['--seconds', '0.5', '--fault-every', '0.2', '--faults', "
        "'restart']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "  unexpected   TimeoutError: ranks [1] of 2 did not join within 120.0 s" in r.stdout
    assert re.search(r"ranks +fds \d+ -> \d+", r.stdout) and "restart 0/1" in r.stdout


@pytest.mark.parametrize("args, message", [
    # was: ran 40 s, every listed fault waited for (--seconds 3 not honoured)
    (["--seconds", "3", "--fault-every", "20", "--faults", "junk,forged"],
     "--seconds 3 is too short to inject 2 faults --fault-every 20 s apart; give --seconds "
     ">= 40 or fewer --faults"),
    # was: always failed, forging with rank 0's own key (a genuine Bye)
    (["--ranks", "1", "--faults", "junk,forged"],
     "--faults forged needs --ranks 2 or more (it speaks with another rank's key)"),
    # was: --stora abbreviated --store-mb silently
    (["--stor", "64"], "unrecognized arguments: --stor 64"),
])
def test_runs_it_could_not_honour_are_refused(args: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from zkv.soak import _parse

    with pytest.raises(SystemExit) as e:
        _parse(args)  # before any process or directory is made
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"zkv soak: error: {message}"


def test_the_defaults_fit_and_one_rank_leaves_forged_out() -> None:
    from zkv.soak import _parse

    assert _parse([]).faults == list(FAULTS)
    assert _parse(["--ranks", "1"]).faults == [f for f in FAULTS if f != "forged"]


def _soak_run_dirs(pid: int) -> list[Path]:
    import os

    root = Path("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp") / f"zkv-{os.geteuid()}"
    return list(root.glob(f"soak-{pid}-*")) if root.is_dir() else []


def _signalled_soak(tmp_path: Path, fault_every: str, ready: Callable[[int, Path], bool],
                    sig: int) -> tuple[int, str, str, int]:
    """``zkv soak`` with junk faults every ``fault_every`` s, sent ``sig`` once both ranks
    run and ``ready(its pid, its log dir)``; (status, stdout, stderr, pid), ranks reaped."""
    from tests.waiting import wait_exited, wait_until

    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, "-m", "zkv.cli", "soak", "--seconds", "600",
                             "--fault-every", fault_every, "--faults", "junk",
                             "--log-dir", str(logs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    ranks: list[int] = []

    def running() -> bool:  # both ranks started: the soak is in its run loop
        assert proc.poll() is None
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text()
        ranks[:] = [int(c) for c in children.split()]
        return len(ranks) == 2 and ready(proc.pid, logs)

    try:
        wait_until(running, 120, "the soak's ranks")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    wait_exited(ranks, 30, "the soak's ranks")
    return proc.returncode, out, err, proc.pid


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, pidfds")
@pytest.mark.parametrize("sig, status, line", [
    ("SIGINT", 130, "zkv soak: interrupted"),  # was: a traceback
    ("SIGTERM", 143, "zkv soak: terminated"),  # was: no report, 250+ MB left in /dev/shm
    ("SIGHUP", 129, "zkv soak: terminated"),  # was: the same as SIGTERM
])
def test_a_signalled_soak_reports_and_leaves_nothing(tmp_path: Path, sig: str, status: int,
                                                     line: str) -> None:
    import signal

    code, out, err, pid = _signalled_soak(tmp_path, "60",
                                          lambda pid, _: bool(_soak_run_dirs(pid)),
                                          getattr(signal, sig))
    assert code == status, out + err
    assert "Traceback" not in err and err.splitlines()[-1] == line, err
    assert re.search(r"requests\s+\d+ in \d+ steps", out), out  # the report so far
    assert _soak_run_dirs(pid) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, pidfds")
def test_the_report_of_a_stopped_soak_counts_its_epoch_so_far(tmp_path: Path) -> None:
    """Ctrl-C once steps ran: the report so far counts the requests, verified blocks and
    refusals of the epoch that was running. Before, they were added only when an epoch
    ended (a restart, the end): ``requests 0 in 102 steps = 0.0 requests/s held``,
    ``verified 0 reused blocks``, nothing refused, after 500 junk messages."""
    import signal

    def junk_refused(_: int, logs: Path) -> bool:  # the first fault came, half a second in
        soak_log = logs / "soak.jsonl"
        return soak_log.exists() and "dispatcher.ack_refused" in soak_log.read_text()

    code, out, err, _ = _signalled_soak(tmp_path, "0.5", junk_refused, signal.SIGINT)
    assert code == 130, out + err
    m = re.search(r"requests\s+(\d+) in (\d+) steps", out)
    assert m and int(m[2]) > 0 and int(m[1]) > 0, out
    verified = re.search(r"verified\s+(\d+) reused blocks", out)
    assert verified and int(verified[1]) > 0, out  # each prompt reuses the system prompt
    malformed = re.search(r"refused\s+.*malformed (\d+)", out)
    assert malformed and int(malformed[1]) > 0, out
    # the epoch a signal cut short was never leak-checked: said, not "leaked 0" alone
    assert re.search(r"leaked\s+0 blocks \(0 of 1 epochs checked; the last, cut short, was "
                     r"not\)", out), out
