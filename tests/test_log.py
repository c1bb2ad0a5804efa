"""zkv.log: one JSON-lines file per process, the common fields, thread-safe binding."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import structlog

from tests.waiting import idle_for
from zkv import log as zlog


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    zlog.close()
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()


def lines(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_text().splitlines()]


def test_configure_writes_one_file_per_process_with_common_fields(tmp_path: Path) -> None:
    path = zlog.configure("worker", rank=2, log_dir=str(tmp_path))
    assert path == str(tmp_path / "worker-2.jsonl")
    structlog.get_logger().info(zlog.BATCH_DONE, seq=7, num_blocks=3)
    structlog.get_logger().debug("dropped.below_level")
    [rec] = lines(tmp_path / "worker-2.jsonl")
    assert isinstance(rec.pop("ts"), float)
    assert rec == {"event": zlog.BATCH_DONE, "level": "info", "component": "worker",
                   "pid": os.getpid(), "rank": 2, "seq": 7, "num_blocks": 3}


def test_log_dir_and_level_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZKV_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("ZKV_LOG_LEVEL", "debug")
    assert zlog.configure("scheduler") == str(tmp_path / "scheduler.jsonl")
    structlog.get_logger().debug("x.seen")
    assert [r["event"] for r in lines(tmp_path / "scheduler.jsonl")] == ["x.seen"]


def test_get_logger_binds_per_logger_so_threads_have_their_fields(tmp_path: Path) -> None:
    early = zlog.get_logger("sidecar", rank=1)  # made before configure(): follows it
    zlog.configure("model", rank=1, log_dir=str(tmp_path))

    def in_thread() -> None:
        zlog.get_logger("sidecar", rank=1).info(zlog.WORKER_STARTED)
        structlog.get_logger().info("bare.logged")  # contextvars do not reach threads...
        zlog.get_logger("storage", namespace="ns").error(zlog.STORE_UNREACHABLE)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(timeout=10)
    early.info(zlog.WORKER_STOPPED, seq=3)
    recs = lines(tmp_path / "model-1.jsonl")
    # ... the process's fields do: a store's I/O thread's lines name the rank (before, they
    # had none, and `zkv logs --rank R` hid a rank's store outage)
    assert [(r["event"], r.get("component"), r.get("rank")) for r in recs] == [
        (zlog.WORKER_STARTED, "sidecar", 1), ("bare.logged", "model", 1),
        (zlog.STORE_UNREACHABLE, "storage", 1), (zlog.WORKER_STOPPED, "sidecar", 1)]
    assert all(r["pid"] == os.getpid() for r in recs)


@pytest.mark.parametrize("name, seen", [("warn", ["warning", "critical"]),
                                        ("WARNING", ["warning", "critical"]),
                                        ("fatal", ["critical"])])
def test_log_levels_by_their_usual_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          name: str, seen: list[str]) -> None:
    monkeypatch.setenv("ZKV_LOG_LEVEL", name)
    zlog.check_level()
    zlog.configure("scheduler", log_dir=str(tmp_path))
    for lv in ("info", "warning", "critical"):
        getattr(structlog.get_logger(), lv)(f"x.{lv}")
    got = [r["event"] for r in lines(tmp_path / "scheduler.jsonl")]
    assert got == [f"x.{lv}" for lv in seen]


def test_a_log_level_typo_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """It logged at info, silently (``ZKV_LOG_LEVEL=nonsense``)."""
    from zkv.errors import ConfigError

    monkeypatch.setenv("ZKV_LOG_LEVEL", "nonsense")
    with pytest.raises(ConfigError) as info:
        zlog.check_level()
    assert str(info.value) == ("ZKV_LOG_LEVEL must be one of debug, info, warning, error, "
                               "critical, got 'nonsense'")
    with pytest.raises(ConfigError, match="^log level must be one of .*, got 'loud'$"):
        zlog.check_level("loud")


def test_reconfigure_closes_the_old_file_and_bound_loggers_follow(tmp_path: Path) -> None:
    zlog.configure("a", log_dir=str(tmp_path))
    bound = structlog.get_logger().bind(seq=1)
    zlog.configure("b", log_dir=str(tmp_path))
    bound.info("after.reconfigure")
    assert (tmp_path / "a.jsonl").read_text() == ""
    assert [r["event"] for r in lines(tmp_path / "b.jsonl")] == ["after.reconfigure"]


def test_open_logger_leaves_global_config_alone(tmp_path: Path) -> None:
    before = structlog.get_config()
    with zlog.open_logger("launcher", str(tmp_path), run_id="r") as log:
        log.info(zlog.RANK_STARTED, rank=0, child_pid=5)
        log.debug("not.written")
    assert structlog.get_config() == before
    [rec] = lines(tmp_path / "launcher.jsonl")
    assert {k: rec[k] for k in ("event", "component", "run_id", "rank", "child_pid", "pid")} == {
        "event": zlog.RANK_STARTED, "component": "launcher", "run_id": "r", "rank": 0,
        "child_pid": 5, "pid": os.getpid()}
    log.info("after.close")  # closed: dropped, no error


def test_a_log_file_rotated_by_rename_is_followed(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zlog, "ROTATE_CHECK_S", 0.0)  # look at every line
    path = Path(zlog.configure("scheduler", log_dir=str(tmp_path)) or "")
    log = structlog.get_logger()
    log.info("a.before")
    path.rename(tmp_path / "scheduler.jsonl.1")  # logrotate's default: move, then create
    log.info("b.moved_not_made")  # the writer makes the file again
    path.rename(tmp_path / "scheduler.jsonl.2")
    path.write_bytes(b"")  # made by the rotator this time
    log.info("c.made_by_rotator")
    assert [r["event"] for r in lines(tmp_path / "scheduler.jsonl.1")] == ["a.before"]
    assert [r["event"] for r in lines(tmp_path / "scheduler.jsonl.2")] == ["b.moved_not_made"]
    assert [r["event"] for r in lines(path)] == ["c.made_by_rotator"]
    with open(path, "r+b") as f:  # copytruncate: appends go on at the new end
        f.truncate(0)
    log.info("d.after_truncate")
    assert path.read_bytes().startswith(b'{"') and [r["event"] for r in lines(path)] == [
        "d.after_truncate"]


def test_rate_limited_lines_say_how_many_were_held_back(tmp_path: Path) -> None:
    """At most ``burst`` lines a window; the first line of a later window carries how many
    were held back meanwhile (``num_suppressed``), and ``flush`` writes the rest as a
    summary: a flood is counted exactly, never silently lost."""
    path = tmp_path / "x.jsonl"
    with zlog.FileLogger(str(path), "scheduler") as log:
        limited = zlog.RateLimited(log, zlog.ACK_REFUSED, burst=2, window_s=0.3)
        for i in range(5):
            limited(i=i)
        idle_for(0.3)  # the window ends
        for i in range(5, 8):
            limited(i=i)
        limited.flush()
        limited.flush()  # nothing held back any more: no second summary
    got = [(r["level"], r.get("i"), r.get("num_suppressed"), r.get("num_total"))
           for r in lines(path)]
    assert got == [("error", 0, None, None), ("error", 1, None, None),
                   ("error", 5, 3, None), ("error", 6, None, None), ("error", None, 1, 8)]
    assert limited.total == 8


def test_a_log_dir_removed_under_the_writer_costs_no_line(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(zlog, "ROTATE_CHECK_S", 0.0)
    logs = tmp_path / "logs"
    logs.mkdir()
    f = zlog.LineFile(str(logs / "w.jsonl"))
    f.write('{"a":1}\n')
    moved = tmp_path / "moved"
    logs.rename(moved)  # its directory is gone: the open file keeps the lines
    f.write('{"b":2}\n')
    f.close()
    assert (moved / "w.jsonl").read_text() == '{"a":1}\n{"b":2}\n' and f.num_dropped == 0


def test_a_field_orjson_refuses_is_written_escaped_not_raised(tmp_path: Path) -> None:
    # A path decoded with surrogateescape (a non-UTF-8 directory name), another lone
    # surrogate, an int past 64 bits and a key that is no str: orjson refuses each; the
    # log call raised TypeError out of whatever store or actor call made it.
    zlog.configure("worker", rank=0, log_dir=str(tmp_path))
    path = os.fsdecode(b"/tmp/l3-\xff")
    structlog.get_logger().error(zlog.WRITE_FAILED, store=path, other="a\ud800b",
                                 big=1 << 70, counts={3: "x"}, fine=[1, "é"])
    [rec] = lines(tmp_path / "worker-0.jsonl")
    assert rec["store"] == "/tmp/l3-\\xff" and rec["other"] == "a\\ud800b"
    assert rec["big"] == str(1 << 70) and rec["counts"] == {"3": "x"}
    assert rec["fine"] == [1, "é"] and rec["event"] == zlog.WRITE_FAILED


@pytest.mark.parametrize("log_dir", [False, True])
def test_a_closed_stderr_drops_lines_without_raising(tmp_path: Path, log_dir: bool) -> None:
    # With stderr closed at start (``2>&-``) sys.stderr is None: a line meant for it, and
    # the warning about a log file that cannot be opened, raised AttributeError.
    import subprocess
    import sys
    where = str(tmp_path / "file-in-the-way" / "sub") if log_dir else None
    (tmp_path / "file-in-the-way").write_text("")
    code = ("import structlog\nfrom zkv import log\n"
            f"log.configure('scheduler', log_dir={where!r})\n"
            "structlog.get_logger().info(log.STEP_DONE, i=1)\n"
            "log.get_logger('storage').error(log.WRITE_FAILED)\n"
            "with log.FileLogger(None, 'launcher') as fl:\n"
            "    fl.info(log.RANK_STARTED, rank=0)\n"
            "print('done')\n")
    out = subprocess.run(["sh", "-c", 'exec "$0" -c "$1" 2>&-', sys.executable, code],
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "done\n")


def test_a_data_parallel_engines_files_are_its_own(tmp_path: Path) -> None:
    # (a vLLM worker half of DP engine 1, TP rank 0; DP engine 0's keeps connector-0)
    path = zlog.configure("connector", rank=0, log_dir=str(tmp_path), dp_rank=1)
    assert path == str(tmp_path / "connector-dp1-0.jsonl")
    structlog.get_logger().info(zlog.BATCH_DONE)
    [rec] = lines(tmp_path / "connector-dp1-0.jsonl")
    assert (rec["dp_rank"], rec["rank"], rec["component"]) == (1, 0, "connector")
    assert zlog.configure("scheduler", log_dir=str(tmp_path), dp_rank=2) == \
        str(tmp_path / "scheduler-dp2.jsonl")


def test_a_logger_made_before_a_fork_writes_the_childs_pid(tmp_path: Path) -> None:
    # (vLLM forks its engine core and workers after zkv's modules made their loggers)
    made_before = zlog.get_logger("scheduler")
    pid = os.fork()
    if pid == 0:  # the child: writes its lines, then leaves without pytest's cleanup
        code = 1
        try:
            zlog.configure("scheduler", log_dir=str(tmp_path))
            made_before.info(zlog.STEP_DONE)
            zlog.close()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    [rec] = lines(tmp_path / "scheduler.jsonl")
    assert (rec["pid"], rec["component"]) == (pid, "scheduler")


def test_lines_of_a_process_forked_after_configure_carry_its_pid(tmp_path: Path) -> None:
    """configure, then a fork: the child's lines (structlog's logger on its main thread,
    a lazy zkv logger, a new thread's) carry the child's pid. Before: configure bound the
    parent's in contextvars and for threads, and it stayed on every child line."""
    zlog.configure("scheduler", log_dir=str(tmp_path))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            structlog.get_logger().info(zlog.STEP_DONE)
            zlog.get_logger("storage").info(zlog.STEP_DONE)
            t = threading.Thread(target=lambda: structlog.get_logger().info(zlog.STEP_DONE))
            t.start()
            t.join()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    zlog.close()
    assert os.waitstatus_to_exitcode(status) == 0
    recs = lines(tmp_path / "scheduler.jsonl")
    assert [r["pid"] for r in recs] == [pid] * 3, recs
