"""zkvrun's pure parts (argument split, env, commands) and run() called in-process."""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path

import pytest

from launch.zkvrun import (
    Endpoints,
    LaunchConfig,
    describe_exit,
    exit_meanings,
    main,
    make_endpoints,
    parse_args,
    rank_env,
    resolve_cmd,
    run,
    scheduler_env,
)
from zkv.security import Keyring

EP = Endpoints("ipc:///x/pub", "ipc:///x/pull")


def test_command_starts_at_the_first_non_option() -> None:
    cfg, cmd, sched = parse_args(["--nproc-per-node", "3", "-c", "pass", "--nnodes", "9"])
    assert (cfg.nproc_per_node, cfg.nnodes, cmd, sched) == (3, 1, ["-c", "pass", "--nnodes", "9"],
                                                           None)
    _, cmd, _ = parse_args(["-m", "pkg.worker", "--x"])
    assert cmd == ["-m", "pkg.worker", "--x"]
    _, cmd, _ = parse_args(["--grace-s=1", "--", "--weird-binary", "a"])
    assert cmd == ["--weird-binary", "a"]
    cfg, cmd, sched = parse_args(["--scheduler", "-m zkv.sched --flag 'a b'", "--insecure-tcp",
                                  "--max_restarts", "2", "w.py"])
    assert sched == ["-m", "zkv.sched", "--flag", "a b"]
    assert (cfg.insecure_tcp, cfg.max_restarts, cmd) == (True, 2, ["w.py"])


def test_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nproc-per-node", "2"]) == 2
    assert main(["--grace-s"]) == 2
    assert main(["--nproc-per-node", "x", "w.py"]) == 2
    assert main(["--help"]) == 0
    assert "CMD [ARGS ...]" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--nnodes", "--nproc-per-node", "--node-rank",
                                  "--master-port", "--max-restarts", "--final-codes"])
def test_a_number_written_with_an_underscore_is_refused(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Python's ``int()`` reads ``1_0`` as 10: ``--nproc-per-node 1_0`` started ten ranks."""
    assert main([flag, "1_0", "-c", "pass"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"zkvrun: error: argument {flag}")


def test_version_and_mistyped_options(capsys: pytest.CaptureFixture[str]) -> None:
    import zkv

    assert main(["--version"]) == 0  # was: `python --version` run as every rank's command
    assert capsys.readouterr().out == f"zkvrun (zkv {zkv.__version__})\n"
    # a mistyped option is not taken for the command (it was: `python --nproc_per_nod 2`)
    assert main(["--nproc_per_nod", "2", "w.py"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zkvrun: error: unknown option --nproc_per_nod (a command that starts with '--' goes "
        "after a '--' of its own)")
    assert main(["--grace-s", "1", "--bogus=3"]) == 2
    assert "unknown option --bogus" in capsys.readouterr().err
    _, cmd, _ = parse_args(["--", "--version"])  # after a '--' of its own: a command
    assert cmd == ["--version"]


@pytest.mark.parametrize("flag", ["--log-dir", "--config", "--keys", "--master-addr",
                                  "--run-id"])
def test_an_empty_value_is_a_usage_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Was: ``--log-dir ""`` (a variable unset) taken as not given: the default log root."""
    assert main([flag, "", "-c", "pass"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"zkvrun: error: argument {flag}")
    assert main([f"{flag}=", "-c", "pass"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        ": empty value '' (leave the option out for its default)")


def test_the_docstring_examples_run_modules_that_exist() -> None:
    """Was: ``-m zkv.scheduler.main`` and ``-m zkv.worker.main``, neither of which exists."""
    import importlib.util
    import shlex

    import launch.zkvrun

    doc = launch.zkvrun.__doc__ or ""
    examples = [shlex.split(ln)[1:] for ln in doc.splitlines()
                if ln.strip().startswith("zkvrun --")]
    assert len(examples) == 2
    for argv in examples:
        config, cmd, sched = parse_args(argv)
        assert config.check() is None, argv  # node rank 1 binds nothing: no --allow-remote
        for part in (cmd, sched or []):
            if part[:1] == ["-m"]:
                assert importlib.util.find_spec(part[1]) is not None, part


def test_the_signal_handler_takes_no_lock() -> None:
    """It runs between two bytecodes of the main thread, which may hold that very lock: it
    set a threading.Event, and a Ctrl-C that came while the main thread was inside that
    Event's wait (every monitor interval) deadlocked zkvrun for good."""
    from launch.zkvrun import _Signals

    sig = _Signals()
    calls: list[str] = []

    def profile(_frame: object, event: str, arg: object) -> None:
        if event == "c_call":
            calls.append(getattr(arg, "__qualname__", repr(arg)))

    sys.setprofile(profile)
    try:
        sig.on_signal(signal.SIGINT)
    finally:
        sys.setprofile(None)
    assert sig.received == [signal.SIGINT]
    assert not [c for c in calls if c.startswith(("lock.", "RLock."))], calls


def test_rank_env_multi_node() -> None:
    cfg = LaunchConfig(nnodes=2, nproc_per_node=4, node_rank=1, master_addr="10.0.0.1",
                       master_port=4000, insecure_tcp=True, log_dir="/l", run_id="r",
                       allow_remote=True)
    ep = make_endpoints(cfg)
    assert ep == Endpoints("tcp://10.0.0.1:4000", "tcp://10.0.0.1:4001")
    env = rank_env(cfg, 3, ep, base_env={"PATH": "/bin", "RANK": "77"})
    assert env == {
        "PATH": "/bin", "RANK": "7", "LOCAL_RANK": "3", "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "4000", "ZKV_PUB_ENDPOINT": "tcp://10.0.0.1:4000",
        "ZKV_PULL_ENDPOINT": "tcp://10.0.0.1:4001", "ZKV_ROLE": "worker", "ZKV_LOG_DIR": "/l",
        "ZKV_RUN_ID": "r", "OMP_NUM_THREADS": "1", "ZKV_INSECURE": "1", "ZKV_ALLOW_REMOTE": "1",
    }
    assert rank_env(cfg, 3, ep, base_env={"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"
    s = scheduler_env(cfg, ep, base_env={"RANK": "77", "LOCAL_RANK": "1"})
    assert "RANK" not in s and "LOCAL_RANK" not in s and s["ZKV_ROLE"] == "scheduler"
    assert make_endpoints(LaunchConfig(nnodes=2, master_addr="::1", insecure_tcp=True)).pub == \
        "tcp://[::1]:29511"


def test_keys_and_flags_this_run_did_not_give_are_not_inherited() -> None:
    """``ZKV_KEYS`` / ``ZKV_INSECURE`` / ``ZKV_ALLOW_REMOTE`` left in zkvrun's own
    environment (a shell that ran another group) never reach its children: only what this
    run's flags and keyring say."""
    stale = {"ZKV_KEYS": "/old/keys", "ZKV_INSECURE": "1", "ZKV_ALLOW_REMOTE": "1"}
    tcp = ("tcp://10.0.0.1:29511", "tcp://10.0.0.1:29512")
    cfg = LaunchConfig(nnodes=2, node_rank=1, master_addr="10.0.0.1", keys="/k")
    ep = Endpoints(*tcp, keys="/k")
    for env in (rank_env(cfg, 0, ep, base_env=stale), scheduler_env(cfg, ep, base_env=stale)):
        assert (env["ZKV_KEYS"], env.get("ZKV_INSECURE"), env.get("ZKV_ALLOW_REMOTE")) == \
            ("/k", None, None)
    insecure = LaunchConfig(nnodes=2, node_rank=1, master_addr="10.0.0.1", insecure_tcp=True)
    env = rank_env(insecure, 0, Endpoints(*tcp), base_env=stale)
    assert (env.get("ZKV_KEYS"), env["ZKV_INSECURE"], env.get("ZKV_ALLOW_REMOTE")) == \
        (None, "1", None)


def test_a_keyring_for_another_world_size_is_refused(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = Keyring.generate(2).save(str(tmp_path / "keys"))
    cfg = LaunchConfig(nproc_per_node=3, keys=path, log_dir=str(tmp_path / "logs"))
    assert run(cfg, ["never_started.py"], None) == 2
    assert capsys.readouterr().err == (f"zkvrun: error: --keys {path} has keys for 2 ranks, "
                                       "this job has WORLD_SIZE=3\n")


def test_config_checks() -> None:
    assert LaunchConfig().check() is None
    assert "--insecure-tcp" in (LaunchConfig(nnodes=2).check() or "")
    assert "--keys DIR" in (LaunchConfig(nnodes=2).check() or "")
    assert LaunchConfig(nnodes=2, keys="/k").check() is None  # loopback master: no flag
    assert "--node-rank" in (LaunchConfig(nnodes=2, node_rank=2, insecure_tcp=True).check() or "")
    assert LaunchConfig(nnodes=0).check() == "--nnodes must be >= 1, got 0"
    assert LaunchConfig(nproc_per_node=0).check() == "--nproc-per-node must be >= 1, got 0"
    assert LaunchConfig(max_restarts=-1).check() == "--max-restarts must be >= 0, got -1"
    assert "monitor_interval_s must be" in (LaunchConfig(monitor_interval_s=0).check() or "")
    for port, one_node, two in ((0, False, False), (65535, True, False), (65536, False, False),
                                (-1, False, False), (1, True, True), (65534, True, True)):
        assert (LaunchConfig(master_port=port).check() is None) is one_node, port
        assert (LaunchConfig(nnodes=2, keys="/k", master_port=port).check() is None) is two, port
    assert "exported as MASTER_PORT" in (LaunchConfig(master_port=70000).check() or "")
    assert LaunchConfig(grace_s=math.nan).check() == \
        "--grace-s must be a finite number >= 0, got nan"
    for bad in ("../../etc", "a/b", ".", "..", ".hidden", "", "x" * 65, "r 1"):
        assert "--run-id must be" in (LaunchConfig(run_id=bad).check() or ""), bad
    for good in ("r1", "exp-3_b.2", "0" * 64):
        assert LaunchConfig(run_id=good).check() is None, good
    remote = LaunchConfig(nnodes=2, master_addr="10.0.0.1", keys="/k")
    assert "--allow-remote" in (remote.check() or "")
    assert LaunchConfig(nnodes=2, master_addr="10.0.0.1", keys="/k", allow_remote=True).check() \
        is None
    # another node binds nothing: no --allow-remote (zkvrun's own example was refused)
    assert LaunchConfig(nnodes=2, node_rank=1, master_addr="10.0.0.1", keys="/k").check() is None


def test_ranks_are_bounded_by_the_cores_unless_forced() -> None:
    limit = 4 * (os.cpu_count() or 1)
    assert LaunchConfig(nproc_per_node=limit).check() is None
    problem = LaunchConfig(nproc_per_node=limit + 1).check() or ""
    assert f"--nproc-per-node {limit + 1} is more than 4 per core" in problem
    assert "--force-ranks" in problem
    assert LaunchConfig(nproc_per_node=limit + 1, force_ranks=True).check() is None
    assert main(["--nproc-per-node", "5000", "-c", "pass"]) == 2


def test_resolve_cmd_and_describe_exit() -> None:
    assert resolve_cmd(["-m", "a.b", "x"]) == [sys.executable, "-m", "a.b", "x"]
    assert resolve_cmd(["w.py", "1"]) == [sys.executable, "w.py", "1"]
    assert resolve_cmd(["-c", "pass"]) == [sys.executable, "-c", "pass"]
    assert resolve_cmd(["/bin/true"]) == ["/bin/true"]
    with pytest.raises(ValueError):
        resolve_cmd([])
    assert describe_exit(3) == "code 3"
    assert describe_exit(-9) == "code -9 (SIGKILL)"
    worker = exit_meanings([sys.executable, "-m", "zkv.worker"])
    assert describe_exit(3, worker) == "code 3 (missed batches)"
    assert describe_exit(4, worker) == "code 4 (refused by the scheduler)"
    assert describe_exit(7, worker) == "code 7"  # not one of zkv.worker's
    assert describe_exit(-15, worker) == "code -15 (SIGTERM)"
    assert exit_meanings([sys.executable, "-m", "my_engine.worker", "zkv.worker"]) is None
    assert exit_meanings(["/usr/bin/zkv.worker"]) is None


def test_run_in_process_restores_signal_handlers(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    code = (f"import os; open({str(out)!r} + os.environ['RANK'], 'w')"
            ".write(os.environ['ZKV_RUN_ID'])")
    cfg = LaunchConfig(nproc_per_node=2, log_dir=str(tmp_path / "logs"), run_id="inproc")
    assert run(cfg, [sys.executable, "-c", code], None) == 0
    assert [(tmp_path / f"out{i}").read_text() for i in range(2)] == ["inproc", "inproc"]
    assert signal.getsignal(signal.SIGTERM) is before
    assert cfg.run_id == "inproc" and cfg.log_dir == str(tmp_path / "logs")  # not mutated
    assert (tmp_path / "logs" / "launcher.jsonl").exists()


def test_run_defaults_log_dir_and_run_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ZKV_LOG_DIR", str(tmp_path / "envlogs"))
    code = "import os; assert os.environ['ZKV_LOG_DIR'] and len(os.environ['ZKV_RUN_ID']) == 12"
    assert run(LaunchConfig(), [sys.executable, "-c", code], None) == 0
    assert os.path.exists(tmp_path / "envlogs" / "launcher.jsonl")
    assert capsys.readouterr().err == ""  # the directory was given: nothing to announce


@pytest.mark.parametrize(("value", "message"), [
    ("-m 'unclosed", "argument --scheduler: cannot split \"-m 'unclosed\": No closing quotation"),
    ("", "argument --scheduler: an empty command (leave the option out for no scheduler)"),
    ("  ", "argument --scheduler: an empty command (leave the option out for no scheduler)"),
])
def test_a_scheduler_command_that_is_no_command_is_a_usage_error(
        value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Was: a ValueError traceback from shlex, or (empty) no scheduler at all, with the
    ranks waiting for one forever."""
    assert main(["--scheduler", value, "-c", "pass"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"zkvrun: error: {message}"


def test_final_codes_are_parsed_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["-c", "pass"])[0].final_codes == (2,)
    assert parse_args(["--final-codes", "1,4", "-c", "pass"])[0].final_codes == (1, 4)
    assert parse_args(["--final-codes=", "-c", "pass"])[0].final_codes == ()
    for bad, why in (("1,x", "comma-separated exit codes"), ("0", "exit codes in [1, 255]"),
                     ("256", "exit codes in [1, 255]")):
        assert main(["--final-codes", bad, "-c", "pass"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == \
            f"zkvrun: error: argument --final-codes: must be {why}, got {bad!r}"
    assert LaunchConfig(final_codes=(0,)).check() == \
        "--final-codes must be exit codes in [1, 255], got 0"
