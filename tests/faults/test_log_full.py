"""A full log disk or a file-size limit (``ulimit -f``): logging degrades (lines dropped and
counted, one warning), the cache keeps serving and every result stays exact. ``/dev/full``
stands in for a full disk (every write fails with ENOSPC)."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from zkv import log as zlog

ROOT = str(Path(__file__).resolve().parents[2])
LIMIT = 4096  # bytes a process may write to any one file (an L3 block here is 1 KiB)


def _replay(tmp_path: Path, logs: Path, preexec: object = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ZKV_LOG_LEVEL="debug")  # many lines: one per batch per rank
    return subprocess.run(
        [sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--requests", "60",
         "--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--device-blocks", "800",
         "--host-blocks", "200", "--log-dir", str(logs),
         "--store-dir", str(tmp_path / "l3")],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
        preexec_fn=preexec)  # type: ignore[arg-type]


def _verified(out: str) -> int:
    m = re.search(r"verified\s+(\d+) reused blocks checked byte-for-byte on every rank, "
                  r"0 mismatched; 0 failed ops", out)
    assert m, out
    return int(m.group(1))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_log_disk_drops_lines_and_the_job_finishes_exactly(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("launcher", "scheduler", "worker-0", "worker-1"):
        os.symlink("/dev/full", logs / f"{name}.jsonl")  # every write: ENOSPC
    r = _replay(tmp_path, logs)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _verified(r.stdout) > 0
    for name in ("launcher", "scheduler", "worker-0", "worker-1"):
        path = logs / f"{name}.jsonl"
        assert f"zkv: cannot write log file {path} (No space left on device)" in r.stderr
        assert re.search(rf"zkv: \d+ log lines dropped \({re.escape(str(path))}\)", r.stderr)
    assert "Traceback" not in r.stderr


def test_file_size_limit_drops_lines_and_the_job_finishes_exactly(tmp_path: Path) -> None:
    def limit() -> None:  # in the child: ulimit -f for it and everything it starts
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))

    logs = tmp_path / "logs"
    r = _replay(tmp_path, logs, limit)
    assert r.returncode == 0, r.stdout + r.stderr  # no SIGXFSZ death
    assert _verified(r.stdout) > 0
    sizes = {p.name: p.stat().st_size for p in logs.iterdir()}
    assert sizes and max(sizes.values()) <= LIMIT, sizes
    full = [name for name, size in sizes.items() if size > LIMIT - 1024]
    assert full, sizes  # debug logging did run into the limit
    for name in full:
        assert re.search(rf"zkv: \d+ log lines dropped \({re.escape(str(logs / name))}\)",
                         r.stderr), r.stderr
        with open(logs / name, "rb") as f:
            lines = f.read().splitlines()
        for line in lines[:-1]:
            orjson.loads(line)  # every complete line is whole: a cut one only at the end


def test_line_file_counts_drops_and_recovers(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.jsonl"
    f = zlog.LineFile(str(path))
    f.write('{"a":1}\n')
    os.close(f._fd)  # the descriptor goes bad (as a yanked disk would)
    f._fd = os.open("/dev/full", os.O_WRONLY) if os.path.exists("/dev/full") else -1
    for _ in range(3):
        f.write('{"b":2}\n')
    assert f.num_dropped == 3
    os.close(f._fd) if f._fd >= 0 else None
    f._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    f.write('{"c":3}\n')  # the disk came back
    f.close()
    assert path.read_text() == '{"a":1}\n{"c":3}\n'
    err = capsys.readouterr().err
    assert err.count("cannot write log file") == 1 and "3 log lines dropped" in err


_WRITER = """
import sys
import structlog
from zkv import log as zlog
zlog.configure("worker", rank=0, log_dir=sys.argv[1])
for i in range(int(sys.argv[2])):
    structlog.get_logger().info(zlog.BATCH_DONE if i else zlog.WORKER_STARTED, seq=i)
"""


def test_a_restarted_writer_does_not_glue_its_first_line_to_a_cut_one(tmp_path: Path) -> None:
    """A process that hit the size limit mid-line left a cut last line; the next process
    on that file (a rank restarted once the disk freed up) starts on a line of its own
    (was: its first line, ``worker.started``, was appended to the cut one: both lost)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))

    def run(n: int, preexec: object = None) -> None:
        r = subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path), str(n)],
                           capture_output=True, text=True, timeout=60, cwd=ROOT,
                           preexec_fn=preexec)  # type: ignore[arg-type]
        assert r.returncode == 0, r.stderr

    run(100, limit)
    path = tmp_path / "worker-0.jsonl"
    assert not path.read_bytes().endswith(b"\n")  # cut mid-line at the limit
    run(1)  # restarted, the limit gone
    last = orjson.loads(path.read_bytes().splitlines()[-1])
    assert last["event"] == zlog.WORKER_STARTED


_CUT = """
import resource, sys
from zkv import log as zlog
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
f = zlog.LineFile(sys.argv[1])
for i in range(100):  # until a line is cut at the limit
    f.write('{"event":"x","i":%d,"pad":"%s"}\\n' % (i, "y" * 80))
    if f.num_dropped:
        break
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # room again
f.write('{"event":"after"}\\n')
f.close()
"""


def test_a_line_cut_at_a_size_limit_is_ended_before_the_next_one(tmp_path: Path) -> None:
    """A write cut short mid-line (the size limit hit) leaves half a line; once there is
    room again, the writer's next line starts on a line of its own instead of being glued
    to the cut one (both lost to a reader)."""
    path = tmp_path / "w.jsonl"
    r = subprocess.run([sys.executable, "-c", _CUT, str(path)], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "cannot write log file" in r.stderr
    *whole, cut, last = path.read_bytes().split(b"\n")[:-1]
    assert len(whole) >= 5 and [orjson.loads(x)["i"] for x in whole] == list(range(len(whole)))
    assert cut and cut.startswith(b'{"event":"x"') and not cut.endswith(b"}")
    assert orjson.loads(last) == {"event": "after"}
