"""Every "not writable by this process" check of a path a user gives (``--log-dir``,
``--metrics-file``, a ``file://`` store's directory) on a file system no one may write:
a tmpfs mounted read-only in a private mount namespace, real, and unwritable for root
too. CI runs the tests as root, where a mode-0500 directory proves nothing (root writes
there), so without this, removing any of these checks failed no test."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.smallfs import run_on_small_fs

ROOT = str(Path(__file__).resolve().parents[1])

CHECKS = '''
import sys
from zkv.errors import ConfigError
from zkv.log import check_log_dir
from zkv.metrics import check_writable
from zkv.storage.localfs import check_root

mnt = sys.argv[1]
for check, *args in ((check_log_dir, mnt), (check_log_dir, mnt + "/logs/run1"),
                     (check_writable, "--metrics-file", mnt + "/m.json"),
                     (check_root, mnt), (check_root, mnt + "/l3")):
    try:
        check(*args)
    except ConfigError as e:
        print(e)
    else:
        print("taken", *args)
'''


def test_paths_on_a_read_only_file_system_are_refused_as_root_too(tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = run_on_small_fs(str(mnt), "64k", [sys.executable, "-c", CHECKS, str(mnt)],
                           timeout_s=60, read_only=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"log directory {mnt}: not writable by this process",
        f"log directory {mnt}/logs/run1: cannot make it ({mnt} is not writable by this "
        "process)",
        f"--metrics-file {mnt}/m.json: not writable by this process",
        f"store directory {mnt}: not writable by this process",
        f"store directory {mnt}/l3: cannot create it (Read-only file system)",
    ], proc.stdout
