"""zkv logs: merge by ts, filters, malformed lines, follow mode, the CLI."""

from __future__ import annotations

import contextlib
import io
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.waiting import wait_until
from zkv import cli, logview
from zkv.logview import Filters, Record, format_record, format_ts


def ev(ts: float, event: str, level: str = "info", **kw: object) -> bytes:
    return orjson.dumps({"ts": ts, "level": level, "event": event, **kw}) + b"\n"


def write(path: Path, *lines: bytes) -> None:
    with open(path, "ab") as f:
        f.write(b"".join(lines))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    write(tmp_path / "scheduler.jsonl",
          ev(1.0, "dispatcher.batch_published", component="scheduler", seq=1),
          ev(4.0, "dispatcher.batch_acked", component="scheduler", seq=1),
          ev(6.0, "dispatcher.rank_lost", "error", component="scheduler", rank=1))
    write(tmp_path / "worker-0.jsonl",
          ev(2.0, "worker.batch_done", component="worker", rank=0, seq=1),
          ev(4.0, "worker.tie", "debug", component="worker", rank=0))
    write(tmp_path / "worker-1.jsonl",
          ev(3.0, "worker.batch_done", component="worker", rank=1, seq=1),
          ev(5.0, "worker.copy_failed", "warning", component="worker", rank=1, seq=2))
    (tmp_path / "notes.txt").write_text("not a log\n")
    return tmp_path


def events(out: str) -> list[str]:
    return [orjson.loads(line)["event"] for line in out.splitlines()]


def test_merge_by_ts_across_files(run_dir: Path) -> None:
    out = io.StringIO()
    assert logview.view(str(run_dir), as_json=True, out=out) == 7
    # ts 4.0 appears in two files: file order (scheduler < worker-0) breaks the tie
    assert events(out.getvalue()) == [
        "dispatcher.batch_published", "worker.batch_done", "worker.batch_done",
        "dispatcher.batch_acked", "worker.tie", "worker.copy_failed", "dispatcher.rank_lost"]


@pytest.mark.parametrize(("filters", "expected"), [
    (Filters(ranks=frozenset({1})), ["worker.batch_done", "worker.copy_failed",
                                     "dispatcher.rank_lost"]),
    (Filters(ranks=frozenset({0, 1}), seq=1), ["worker.batch_done", "worker.batch_done"]),
    (Filters(seq=1), ["dispatcher.batch_published", "worker.batch_done", "worker.batch_done",
                      "dispatcher.batch_acked"]),
    (Filters(min_level="warning"), ["worker.copy_failed", "dispatcher.rank_lost"]),
    (Filters(event="BATCH_"), ["dispatcher.batch_published", "worker.batch_done",
                               "worker.batch_done", "dispatcher.batch_acked"]),
    (Filters(event="lost", min_level="error", ranks=frozenset({1})), ["dispatcher.rank_lost"]),
])
def test_filters(run_dir: Path, filters: Filters, expected: list[str]) -> None:
    out = io.StringIO()
    logview.view(str(run_dir), filters, out=out, as_json=True)
    assert events(out.getvalue()) == expected


def test_pretty_format() -> None:
    rec = logview.parse_line(
        orjson.dumps({"ts": 1.5, "level": "warning", "event": "worker.copy_failed",
                      "component": "worker", "rank": 1, "pid": 9, "seq": 2,
                      "error": "bad block", "dur_ms": 0.1234567, "ok": False,
                      "exception": "Traceback\n  boom"}), "w.jsonl", 1, 0.0)
    assert format_record(rec) == (
        f"{format_ts(1.5)}  WARN   worker[1]      worker.copy_failed  "
        'seq=2 error="bad block" dur_ms=0.123457 ok=false\n    Traceback\n      boom')
    assert format_ts(1.5).endswith(".500") and len(format_ts(1.5)) == len("HH:MM:SS.mmm")
    bare = logview.parse_line(b'{"ts":2,"event":"x.y"}', "s.jsonl", 3, 0.0)
    assert format_record(bare) == f"{format_ts(2)}  INFO   ?              x.y"


def test_a_date_line_comes_before_the_first_line_of_each_day(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Lines show the time only: a run that lasts weeks has a 03:12 every day. A date line
    comes before the first line and at each change of day (local time), in a view and in
    a follow; none in --json."""
    t0 = time.mktime((2026, 11, 26, 23, 59, 0, 0, 0, -1))  # local 23:59 on the 26th
    write(tmp_path / "a.jsonl", ev(t0, "a.late"), ev(t0 + 30, "a.later"),
          ev(t0 + 120, "a.next_day"), ev(t0 + 86400 * 3 + 3600, "a.days_later"))
    assert logview.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x if x.startswith("-- ") else x.split("  ")[-1] for x in lines] == [
        "-- 2026-11-26 Thu --", "a.late", "a.later", "-- 2026-11-27 Fri --", "a.next_day",
        "-- 2026-11-30 Mon --", "a.days_later"]
    assert logview.main([str(tmp_path), "--json"]) == 0
    assert not [x for x in capsys.readouterr().out.splitlines() if x.startswith("--")]
    with following(tmp_path, poll_s=0.01, as_json=False) as (out, _):
        wait_until(lambda: out.getvalue().count("a.") == 4, 10)
        write(tmp_path / "a.jsonl", ev(t0 + 86400 * 3 + 3660, "a.same_day"),
              ev(t0 + 86400 * 4 + 3600, "a.another_day"))
        wait_until(lambda: "a.another_day" in out.getvalue(), 10)
    days = [x for x in out.getvalue().splitlines() if x.startswith("-- ")]
    assert days == ["-- 2026-11-26 Thu --", "-- 2026-11-27 Fri --", "-- 2026-11-30 Mon --",
                    "-- 2026-12-01 Tue --"]


def test_malformed_lines_are_shown_and_never_crash(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "a.jsonl", ev(1.0, "a.one"), b"garbage {\n", b"[1, 2]\n",
          b'{"ts": "soon", "event": "x"}\n', b"\xff\xfe\n", b"\n", ev(3.0, "a.two"))
    write(tmp_path / "b.jsonl", ev(2.0, "b.one"), b'{"ts": 2.5, "ev')  # writer died mid-line
    write(tmp_path / "c.jsonl", b'{"ts": 1e300, "event": "c.far", "level": "info"}\n')
    assert logview.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == logview.format_day(1.0)  # (1970: the day line before the first)
    lines = lines[1:]
    assert [x.split("  ")[-1] for x in lines] == [
        "a.one", "garbage {", "[1, 2]", '{"ts": "soon", "event": "x"}', "\ufffd\ufffd",
        "b.one", '{"ts": 2.5, "ev', "a.two", "c.far"]
    assert lines[-1].startswith("1e+300  ")  # no clock shows it (it was an OverflowError)
    assert lines[1] == "--:--:--.---  MALFORMED  a.jsonl:2  garbage {"
    assert lines[6].startswith("--:--:--.---  MALFORMED  b.jsonl:2  ")
    assert logview.main([str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    assert events(captured.out) == ["a.one", "b.one", "a.two", "c.far"]
    assert "zkv logs: malformed line a.jsonl:2: garbage {" in captured.err
    assert logview.main([str(tmp_path), "--rank", "0"]) == 0  # filters hide what they can't read
    assert capsys.readouterr().out == ""
    (tmp_path / "only-bad").mkdir()
    write(tmp_path / "only-bad" / "d.jsonl", b"garbage\n")
    assert logview.main([str(tmp_path / "only-bad"), "--json"]) == 0
    err = capsys.readouterr().err  # the malformed line was shown: something matched
    assert "malformed line d.jsonl:1" in err and "no event matched" not in err


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    import zkv

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"zkv {zkv.__version__}\n"


def test_cli_logs_subcommand(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["logs", str(run_dir), "--rank", "0", "--rank", "1", "--seq", "1",
                     "--json"]) == 0
    assert events(capsys.readouterr().out) == ["worker.batch_done", "worker.batch_done"]
    # the directory after the rank (was: taken for a second rank, "not an int")
    assert cli.main(["logs", "--rank", "0,1", str(run_dir), "--seq", "1", "--json"]) == 0
    assert events(capsys.readouterr().out) == ["worker.batch_done", "worker.batch_done"]
    assert cli.main(["logs", "--level", "WARN", str(run_dir)]) == 0  # as ZKV_LOG_LEVEL takes
    assert cli.main(["logs", str(run_dir / "missing")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
    (run_dir / "empty").mkdir()  # e.g. the run's parent directory, given by mistake
    assert cli.main(["logs", str(run_dir / "empty")]) == 1
    assert capsys.readouterr().err == f"zkv logs: {run_dir / 'empty'}: no *.jsonl log files in it\n"


def test_a_view_that_matches_nothing_says_so_and_names_the_ranks_that_logged(
        run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--rank 99`` on a two-rank run printed nothing with status 0, like a quiet run."""
    assert cli.main(["logs", str(run_dir), "--rank", "99"]) == 0
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == f"zkv logs: {run_dir}: no event matched (ranks in these logs: 0, 1)\n"
    assert cli.main(["logs", str(run_dir), "--event", "no-such-event"]) == 0
    assert capsys.readouterr().err == f"zkv logs: {run_dir}: no event matched\n"
    assert cli.main(["logs", str(run_dir), "--rank", "1"]) == 0
    out = capsys.readouterr()
    assert out.out and out.err == ""  # something matched: nothing said


@pytest.mark.parametrize("args, message", [
    (["--seq", "-1"], "argument --seq: must be >= 0, got -1"),
    (["--rank", "-2"], "argument --rank: must be >= 0, got -2"),
    (["--rank", "0,-2"], "argument --rank: must be >= 0, got -2"),
    (["--rank", "x"], "argument --rank: not an int: 'x'"),
    (["--poll-s", "0"], "argument --poll-s: must be a finite number > 0, got 0"),
])
def test_filters_that_match_nothing_are_bad_flags(run_dir: Path, args: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # was: no output and status 0 (or a busy loop)
        cli.main(["logs", str(run_dir), *args])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"zkv logs: error: {message}"


def test_cli_replay_passes_its_arguments_through(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("zkv.replay")
    fake.main = lambda argv: seen.append(argv) or 5  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "zkv.replay", fake)
    assert cli.main(["replay", "--trace", "t.json", "-h", "--x=1"]) == 5
    assert seen == [["--trace", "t.json", "-h", "--x=1"]]


class Lines(io.StringIO):
    """Collects output written from the follow thread; read under a lock."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, s: str) -> int:
        with self.lock:
            return super().write(s)

    def events(self) -> list[str]:
        with self.lock:
            return events(self.getvalue())


@contextlib.contextmanager
def following(path: Path, poll_s: float = 0.02,
              as_json: bool = True) -> Iterator[tuple[Lines, Lines]]:
    """``logview.follow(path)`` on a thread; yields its (stdout, stderr); stops and joins it."""
    out, err, stop = Lines(), Lines(), threading.Event()
    t = threading.Thread(target=logview.follow, args=(str(path), None, out, as_json, poll_s,
                                                      stop, err))
    t.start()
    try:
        yield out, err
    finally:
        stop.set()
        t.join(timeout=10)
    assert not t.is_alive()


def test_follow_picks_up_new_lines_and_new_files(tmp_path: Path) -> None:
    write(tmp_path / "a.jsonl", ev(1.0, "a.one"))
    with following(tmp_path) as (out, _):
        wait_until(lambda: out.events() == ["a.one"], 10)
        write(tmp_path / "a.jsonl", ev(2.0, "a.two")[:10])  # half a line: held back
        write(tmp_path / "b.jsonl", ev(1.5, "b.new_file"))
        wait_until(lambda: out.events() == ["a.one", "b.new_file"], 10)
        write(tmp_path / "a.jsonl", ev(2.0, "a.two")[10:])
        wait_until(lambda: out.events() == ["a.one", "b.new_file", "a.two"], 10)


def test_follow_waits_for_a_directory_that_does_not_exist_yet_and_says_so(
        tmp_path: Path) -> None:
    run = tmp_path / "run-1"
    with following(run) as (out, err):
        wait_until(lambda: "waiting" in err.getvalue(), 10)
        run.mkdir()
        write(run / "s.jsonl", ev(1.0, "scheduler.started"))
        wait_until(lambda: out.events() == ["scheduler.started"], 10)
    assert err.getvalue() == f"zkv logs: {run}: waiting for it to appear (Ctrl-C stops)\n"


def test_follow_says_once_that_a_directory_has_no_logs_yet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    polls: list[str] = []
    real = logview.log_files
    monkeypatch.setattr(logview, "log_files", lambda p: polls.append(p) or real(p))
    with following(tmp_path, poll_s=0.01) as (out, err):
        wait_until(lambda: len(polls) >= 10, 10)  # ten polls of an empty directory
        write(tmp_path / "w-0.jsonl", ev(1.0, "worker.started"))
        wait_until(lambda: out.events() == ["worker.started"], 10)
    assert err.getvalue().splitlines() == [
        f"zkv logs: {tmp_path}: waiting for *.jsonl log files in it (Ctrl-C stops)"]


def test_follow_cli_stops_on_ctrl_c(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "zkv.cli", "logs", "-f", str(tmp_path), "--poll-s", "0.02"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p, \
            selectors.DefaultSelector() as sel:
        try:
            sel.register(p.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
            write(tmp_path / "w-0.jsonl", ev(time.time(), "worker.started", component="worker",
                                             rank=0))
            assert sel.select(timeout=15), "no output from zkv logs -f"
            day = p.stdout.readline().decode()  # type: ignore[union-attr]
            assert day.startswith("-- ") and day.rstrip().endswith(" --"), day
            line = p.stdout.readline().decode()  # type: ignore[union-attr]
            assert "worker[0]" in line and "worker.started" in line
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=15)
        finally:
            p.kill()
    assert p.returncode == 0, err


def test_truncated_file_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    write(path, ev(1.0, "a.one"), ev(2.0, "a.two"))
    tail = logview.Tail(str(path))
    assert [r.data and r.data["event"] for r in tail.records(final=False)] == ["a.one", "a.two"]
    os.truncate(path, 0)
    write(path, ev(3.0, "a.three"))
    assert [r.data and r.data["event"] for r in tail.records(final=False)] == ["a.three"]
    tail.close()
    assert Record(0.0, "x", 1, "raw", None).malformed


def test_a_file_renamed_away_is_read_to_its_end_and_the_new_one_from_0(tmp_path: Path) -> None:
    """logrotate's ``create``: the file is renamed, a zkv process writes to it for up to a
    second more, then to a new file at the old name. Every line shows once, none mid-line.
    (Before: the old file's late line was lost, and a new file longer than the old offset
    was read from that offset, a malformed half line.)"""
    path = tmp_path / "w-0.jsonl"
    write(path, ev(1.0, "a.before"))
    tail = logview.Tail(str(path))
    try:
        assert [r.data and r.data["event"] for r in tail.records(final=False)] == ["a.before"]
        os.rename(path, tmp_path / "w-0.jsonl.1")
        write(tmp_path / "w-0.jsonl.1", ev(2.0, "b.late_in_the_old_file"))
        write(path, ev(3.0, "c.new_file_" + "x" * 200))  # longer than the old offset
        got = [r.data["event"] if r.data else "MALFORMED" for r in tail.records(final=False)]
        assert got == ["b.late_in_the_old_file", "c.new_file_" + "x" * 200]
        write(tmp_path / "w-0.jsonl.1", ev(4.0, "d.later_still"))  # within the grace
        write(path, ev(5.0, "e.next"))
        got = [r.data["event"] if r.data else "MALFORMED" for r in tail.records(final=False)]
        assert got == ["d.later_still", "e.next"]
    finally:
        tail.close()
    # the plain view reads what logrotate left beside the live file, in time order
    out = io.StringIO()
    logview.view(str(tmp_path), out=out, as_json=True)
    assert events(out.getvalue()) == ["a.before", "b.late_in_the_old_file",
                                      "c.new_file_" + "x" * 200, "d.later_still", "e.next"]


def _open_deleted(path: Path) -> list[str]:
    """This process's open files that are ``path``, deleted."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own, closed since)
            if os.readlink(f"/proc/self/fd/{fd}") == f"{path} (deleted)":
                found.append(fd)
    return found


def test_a_deleted_file_is_read_to_its_end_then_closed(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A followed file that is deleted (its space freed only once no one holds it open): its
    last lines show, and once the grace is over it is closed, and ``follow`` forgets it.
    (Before: held open, and its space taken, for as long as ``zkv logs -f`` ran.)"""
    path = tmp_path / "w-0.jsonl"
    write(path, ev(1.0, "a.first"))
    tail = logview.Tail(str(path))
    try:
        assert [r.data and r.data["event"] for r in tail.records(final=False)] == ["a.first"]
        with open(path, "ab") as f:
            os.remove(path)
            f.write(ev(2.0, "b.written_as_it_was_deleted"))
        assert _open_deleted(path)  # the tail's handle, the writer's closed
        monkeypatch.setattr(logview, "ROTATED_GRACE_S", 0.0)  # (5 s: a writer's last lines)
        got = [r.data and r.data["event"] for r in tail.records(final=False)]
        assert got == ["b.written_as_it_was_deleted"] and tail.idle
        assert _open_deleted(path) == []
    finally:
        tail.close()
    # follow: 20 files each deleted while followed, none held open once their grace is over
    for i in range(20):
        write(tmp_path / f"d-{i}.jsonl", ev(3.0 + i, f"c.file_{i}"))
    stop, out = threading.Event(), io.StringIO()
    t = threading.Thread(target=logview.follow, args=(str(tmp_path),),
                         kwargs={"out": out, "as_json": True, "poll_s": 0.01, "stop": stop})
    t.start()
    try:
        wait_until(lambda: out.getvalue().count("c.file_") == 20, 10, "the 20 files read")
        for i in range(20):
            os.remove(tmp_path / f"d-{i}.jsonl")
        wait_until(lambda: not any(_open_deleted(tmp_path / f"d-{i}.jsonl")
                                   for i in range(20)), 10, "the deleted files closed")
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()


def test_control_characters_are_escaped_not_sent_to_the_terminal(tmp_path: Path) -> None:
    """A field (a request id, a store's error text) or a malformed line with an escape
    sequence or a bell reached the operator's terminal as it was."""
    bad = "a\u001b[31mred\u0007"
    rec = logview.parse_line(orjson.dumps({"ts": 1.0, "event": "x.y", "req": bad,
                                           "ok": "plain"}), "f", 1, 0.0)
    text = logview.format_record(rec)
    assert "\x1b" not in text and "\x07" not in text and "ok=plain" in text
    assert 'req="a\\u001b[31mred\\u0007"' in text, text
    raw = logview.parse_line(b"\x1b]0;owned\x07 not json", "f", 2, 0.0)
    assert "\x1b" not in logview.format_record(raw) and "\x07" not in logview.format_record(raw)


def test_json_mode_escapes_a_malformed_line_too(tmp_path: Path) -> None:
    """``--json`` wrote a malformed line to stderr as it was, escape sequences included."""
    write(tmp_path / "w-0.jsonl", ev(1.0, "x.y"), b"\x1b]0;owned\x07\x1b[2J not json\n")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert logview.main([str(tmp_path), "--json"]) == 0
    assert "\x1b" not in err.getvalue() and "\x07" not in err.getvalue()
    assert "w-0.jsonl:2" in err.getvalue() and "not json" in err.getvalue()
    assert orjson.loads(out.getvalue())["event"] == "x.y"


def test_a_terminal_without_utf8_gets_escapes_not_a_traceback(tmp_path: Path) -> None:
    """Under a Latin-1 locale a garbled line's U+FFFD could not be encoded: a
    UnicodeEncodeError traceback, rc 1, and nothing after it shown."""
    write(tmp_path / "a.jsonl", ev(1.0, "x.y"), b"\xff\xfe garbled\n", ev(2.0, "x.z"))
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    p = subprocess.run([sys.executable, "-m", "zkv.cli", "logs", str(tmp_path)], env=env,
                       capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert b"\\ufffd\\ufffd garbled" in p.stdout and b"x.z" in p.stdout


def test_a_rotated_files_cut_last_line_shows_when_its_grace_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file renamed away (or deleted) whose last line was cut (its writer hit a full disk,
    then moved to the new file): ``-f`` shows that line, malformed, as ``zkv logs`` does,
    once the grace is over (was: dropped, waiting for a newline no writer would add)."""
    path = tmp_path / "w-0.jsonl"
    write(path, ev(1.0, "a.first"), ev(2.0, "b.cut")[:15])
    tail = logview.Tail(str(path))
    try:
        assert [r.data and r.data["event"] for r in tail.records(final=False)] == ["a.first"]
        os.rename(path, tmp_path / "w-0.jsonl.1")
        monkeypatch.setattr(logview, "ROTATED_GRACE_S", 0.0)
        got = list(tail.records(final=False))
        assert [(r.malformed, r.raw) for r in got] == [(True, ev(2.0, "b.cut")[:15].decode())]
        assert tail.idle
    finally:
        tail.close()
    out = io.StringIO()  # the plain view shows the same lines
    logview.view(str(tmp_path), out=out)
    assert "MALFORMED  w-0.jsonl.1:2" in out.getvalue()


def test_a_file_truncated_and_written_past_the_old_offset_is_read_again(tmp_path: Path
                                                                        ) -> None:
    """copytruncate, then more lines than before, all between two reads: the size alone
    did not show the truncation, and the new lines were read from the old offset (a half
    line, malformed, and the first ones lost)."""
    path = tmp_path / "a.jsonl"
    write(path, ev(1.0, "a.one"))
    tail = logview.Tail(str(path))
    try:
        assert [r.data and r.data["event"] for r in tail.records(final=False)] == ["a.one"]
        os.truncate(path, 0)
        write(path, ev(2.0, "b.first_after"), ev(3.0, "b.second_after"))
        got = list(tail.records(final=False))
        assert [r.data and r.data["event"] for r in got] == ["b.first_after", "b.second_after"]
        assert not any(r.malformed for r in got)
        write(path, ev(4.0, "b.third_after"))  # and on from there
        assert [r.data and r.data["event"] for r in tail.records(final=False)] == [
            "b.third_after"]
    finally:
        tail.close()
