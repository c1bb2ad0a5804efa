"""The main job end to end: zkvrun + scheduler node + real worker processes + L3 dir."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.replay_run import metrics as read_metrics

# The first 800 requests of ../shared/traces/mooncake_synthetic_trace.jsonl (tests/data).
TRACE = os.path.join(os.path.dirname(__file__), "..", "data", "mooncake_trace_head800.jsonl")


def _replay(tmp_path, *args: str) -> tuple[str, dict[str, float]]:
    metrics = tmp_path / "metrics.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--log-dir",
         str(tmp_path / "logs"), "--store-dir", str(tmp_path / "l3"), "--metrics-file",
         str(metrics), *args],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, read_metrics(metrics)


def _field(out: str, pattern: str) -> int:
    m = re.search(pattern, out)
    assert m, out
    return int(m.group(1))


def test_chat_replay_moves_real_bytes_through_every_tier(tmp_path) -> None:
    out, metrics = _replay(tmp_path, "--requests", "120", "--device-blocks", "800",
                           "--host-blocks", "200", "--ranks", "2")
    assert "0 mismatched; 0 failed ops" in out
    checked = _field(out, r"verified\s+(\d+) reused blocks")
    assert checked > 0
    # every tier was used and its blocks verified byte-for-byte after the round trip
    assert _field(out, r"hits\s+device (\d+)") > 0
    assert _field(out, r"host (\d+) \(") > 0
    assert _field(out, r"storage (\d+) \(") > 0
    for direction in ("d2h", "h2d", "s2h", "h2s"):
        moved = _field(out, rf"{direction} (\d+)")
        assert moved > 0
        assert metrics[f'zkv:moved_blocks_total{{direction="{direction}"}}'] == moved
        assert metrics[f'zkv:failed_blocks_total{{direction="{direction}"}}'] == 0
    assert metrics['zkv:hit_blocks_total{tier="storage"}'] == _field(out, r"storage (\d+) \(")
    for reason in ("malformed", "forged", "unknown_seq", "duplicate", "unknown_rank", "hello",
                   "unauthenticated"):  # a clean run refuses nothing, and says so
        assert metrics[f'zkv:refused_messages_total{{reason="{reason}"}}'] == 0
    assert os.listdir(tmp_path / "l3")  # blocks reached the local-directory store
    logs = os.listdir(tmp_path / "logs")
    assert {"scheduler.jsonl", "worker-0.jsonl", "worker-1.jsonl", "launcher.jsonl"} <= set(logs)


@pytest.mark.slow
def test_trace_replay_four_ranks(tmp_path) -> None:
    out, _ = _replay(tmp_path, "--workload", "trace", "--trace", TRACE, "--requests", "150",
                     "--ranks", "4", "--device-blocks", "400", "--host-blocks", "300")
    assert "0 mismatched; 0 failed ops" in out
    assert _field(out, r"requests\s+(\d+)") == 150
