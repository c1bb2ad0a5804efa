"""Two separate scheduler + worker groups (two ``zkv replay`` runs, each its own zkvrun,
scheduler node and worker processes) share one L3 store: the second run hits what the
first one wrote, on every backend, and verifies every reused block bit for bit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from zkv.storage import file_url


def replay(tmp_path: Path, name: str, url: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--storage", url,
         "--requests", "24", "--policy", "write_through", "--seed", "7",
         "--log-dir", str(tmp_path / name)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 mismatched; 0 failed ops" in proc.stdout, proc.stdout
    return proc.stdout


def field(out: str, pattern: str) -> int:
    m = re.search(pattern, out)
    assert m, out
    return int(m.group(1))


@pytest.mark.parametrize("kind", ["file", "redis", "mooncake"])
def test_second_group_hits_what_the_first_wrote(kind: str, tmp_path: Path,
                                                request: pytest.FixtureRequest) -> None:
    if kind == "file":
        url = file_url(tmp_path / "l3")
    else:
        url = request.getfixturevalue(f"{kind}_server").url
        if kind == "redis":
            request.getfixturevalue("redis_server").client().flushdb()
    first = replay(tmp_path, "first", url)
    second = replay(tmp_path, "second", url)
    stored = field(first, r"stored (\d+) \(0 dropped\)")
    assert stored > 0
    # the first run starts cold; the second finds the first's blocks in L3 at once
    first_hits, second_hits = (field(o, r"storage (\d+) \(") for o in (first, second))
    assert second_hits > first_hits
    first_request_blocks = 512 // 16  # chat-0 starts with the 512-token system prompt
    assert field(second, r"loaded (\d+) blocks \(0 failed") >= first_request_blocks
    assert field(second, r"s2h (\d+)") == field(second, r"loaded (\d+) blocks")
