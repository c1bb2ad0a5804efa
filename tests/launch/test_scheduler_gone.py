"""A rank's exit 5 (no scheduler reachable) is final for zkvrun, and the timeout is kept, not
overshot (from a mutation review: neither was checked)."""
from __future__ import annotations

import re
from pathlib import Path

from tests.launch.test_zkvrun import events, run_zkvrun
from zkv import log as zlog
from zkv.config import CacheLayout


def test_a_zkv_worker_rank_that_reached_no_scheduler_is_not_restarted(tmp_path: Path) -> None:
    layout = CacheLayout(2, 2, 16, 32, "float16", 8, 8)
    logs = tmp_path / "logs"
    r = run_zkvrun(tmp_path, "--max-restarts", "2", "--log-dir", str(logs),
                   "--config", layout.to_json(), "-m", "zkv.worker",
                   ZKV_SCHEDULER_TIMEOUT_S="0.5", ZKV_BACKEND="cpu")
    assert r.returncode == 1, r.stderr
    started = [e for e in events(logs) if e["event"] == zlog.RANK_STARTED]
    assert len(started) == 1, r.stderr
    (failed,) = [e for e in events(logs) if e["event"] == zlog.GROUP_FAILED]
    assert (failed["code"], failed["final"]) == (5, True)
    with open(logs / "worker-0.jsonl") as f:
        reason = [line for line in f if "no scheduler reached for" in line][-1]
    waited = float(re.search(r"no scheduler reached for ([0-9.]+) s", reason).group(1))
    assert waited < 0.5 + 0.5, f"waited {waited} s past a 0.5 s scheduler timeout"
