"""A full /dev/shm (a container's 64 MB default, another program's leftovers), for real: a
tmpfs mounted over /dev/shm in a private mount namespace and filled. ``zkv replay``'s
default L3 directory goes to the temporary directory instead, and the run passes. Before:
an ENOSPC traceback from the run directory's owner file, status 1, and a half-made
directory left in /dev/shm."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from tests.smallfs import run_on_small_fs

ROOT = str(Path(__file__).resolve().parents[1])

FILL = 'dd if=/dev/zero of=/dev/shm/fill bs=4k count=64 2>/dev/null; '

CLAIM = '''
import os, sys
from zkv import security
from zkv.errors import ConfigError
try:
    security.make_run_dir("/dev/shm", prefix="l3-")
except ConfigError as e:
    print(e)
root = f"/dev/shm/zkv-{os.geteuid()}"
print(sorted(os.listdir(root)))
'''


def test_a_full_dev_shm_is_a_config_error_that_leaves_nothing() -> None:
    proc = run_on_small_fs("/dev/shm", "64k", ["sh", "-c", FILL + 'exec "$0" -c "$1"',
                                               sys.executable, CLAIM],
                           timeout_s=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    uid_root = f"/dev/shm/zkv-{os.geteuid()}"
    assert proc.stdout.splitlines() == [
        f"cannot make a run directory in {uid_root}: No space left on device", "[]"], proc.stdout


def test_replay_on_a_full_dev_shm_keeps_its_l3_on_disk_and_passes(tmp_path: Path) -> None:
    proc = run_on_small_fs(
        "/dev/shm", "64k",
        ["sh", "-c", FILL + 'exec "$0" -m zkv.cli replay --no-progress --requests 6 '
                            '--log-dir "$1"', sys.executable, str(tmp_path / "logs")],
        timeout_s=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    l3 = re.search(r"L3=(\S+)", proc.stdout)
    assert l3 and not l3.group(1).startswith("file:///dev/shm"), proc.stdout
    assert re.search(r"verified\s+\d+ reused blocks checked byte-for-byte on every rank, "
                     r"0 mismatched", proc.stdout), proc.stdout
