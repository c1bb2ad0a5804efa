"""A real small file system for disk-full tests: a tmpfs of a given size, mounted in a
private mount namespace of one child process (``unshare``), so that nothing outside sees
it and it goes away with the child. As root: ``unshare --mount``; otherwise a user
namespace where the child is root (``unshare --user --map-root-user --mount``)::

    proc = run_on_small_fs(mount_at, "512k", [sys.executable, "-c", code], timeout_s=60)

``mount_at`` must be an existing empty directory; the child's command runs with the
tmpfs mounted there and sees ENOSPC once it is full, as on a real full disk. A machine
where neither way can mount fails the test (it is not skipped: CI must prove the case).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import cache

_SCRIPT = 'mount -t tmpfs -o size="$1" zkv-small-fs "$2" && shift 2 && exec "$@"'
_WAYS = (("--mount", "--propagation", "private"),
         ("--user", "--map-root-user", "--mount", "--propagation", "private"))


@cache
def _unshare_args(probe_dir: str) -> tuple[str, ...]:
    unshare = shutil.which("unshare")
    if unshare is None:
        raise AssertionError("disk-full tests need util-linux's unshare")
    errors = []
    ways = _WAYS if os.geteuid() == 0 else _WAYS[1:]
    for way in ways:
        proc = subprocess.run([unshare, *way, "sh", "-c", _SCRIPT, "sh", "64k", probe_dir,
                               "true"], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0:
            return (unshare, *way)
        errors.append(f"unshare {' '.join(way)}: {proc.stderr.strip()}")
    raise AssertionError("cannot mount a tmpfs in a private namespace here: "
                         + "; ".join(errors))


def run_on_small_fs(mount_at: str, size: str, argv: Sequence[str], *, timeout_s: float,
                    env: dict[str, str] | None = None, cwd: str | None = None,
                    read_only: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with a ``size`` tmpfs (``"512k"``, ``"8m"``) mounted at ``mount_at``
    (``read_only``: mounted read-only, which no one writes in, root included)."""
    if read_only:
        size += ",ro"  # (the script's -o size="$1")
    probe = os.path.join(tempfile.gettempdir(), f".smallfs-probe-{os.getuid()}")
    os.makedirs(probe, exist_ok=True)
    args = _unshare_args(probe)
    return subprocess.run([*args, "sh", "-c", _SCRIPT, "sh", size, mount_at, *argv],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd,
                          stdin=subprocess.DEVNULL)
