"""What a ``zkv replay`` run said, for tests that run the main job: its summary's counts
and its JSON log events."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any, NamedTuple


class Summary(NamedTuple):
    verified: int      # reused blocks checked byte for byte on every rank
    mismatched: int
    failed_ops: int
    stored: int        # blocks written to L3
    store_dropped: int  # blocks whose L3 write failed


def summary(proc: subprocess.CompletedProcess[str]) -> Summary:
    """The run's summary; the run must have exited 0."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    verified = re.search(r"verified\s+(\d+) reused blocks .*?, (\d+) mismatched; (\d+) failed",
                         proc.stdout)
    stored = re.search(r"stored (\d+) \((\d+) dropped\)", proc.stdout)
    assert verified and stored, proc.stdout
    return Summary(*(int(x) for x in (*verified.groups(), *stored.groups())))


def events(log_dir: Path) -> list[dict[str, Any]]:
    """Every JSON line of every log file of the run."""
    return [json.loads(line) for f in sorted(log_dir.glob("*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]


def metrics(path: Path) -> dict[str, float]:
    """The samples of a ``--metrics-file`` (Prometheus text), by name with labels."""
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
