"""The file-system calls of the ``file://`` store (zkv/storage/local.py): whole writes,
private folders, free space, room for a file, durable folder entries, quiet unlinks."""

from __future__ import annotations

import os
import shutil
from typing import Any

from zkv.errors import ConfigError

STALE_TMP_S = 600.0  # a temp file this old is a dead writer's (its put never finished)
ROOM_SLACK_BLOCKS = 2  # room asked for beyond a file: rounding to fs blocks, a folder


def write_all(fd: int, bufs: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def remove_if_stale(entry: os.DirEntry[str], now: float) -> None:
    """Remove a temp file left more than ``STALE_TMP_S`` ago (a writer died mid-put)."""
    try:
        if now - entry.stat().st_mtime > STALE_TMP_S:
            unlink_quietly(entry.path)
    except OSError:  # gone meanwhile
        pass


def free_bytes(path: str) -> int:
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return shutil.disk_usage(probe).free


def make_private_dirs(path: str) -> list[str]:
    """``os.makedirs(path, exist_ok=True)``, where every directory it makes is 0700
    (``makedirs``' mode reaches the last one only): blocks hold KV, which tells what the
    prompts were. Directories that exist keep their mode. ``FileExistsError`` when
    something that is not a directory is in the way. The directories it made, top first."""
    if os.path.isdir(path):
        return []
    made: list[str] = []
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.lexists(parent):
        made = make_private_dirs(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return made
    return [*made, path]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_root(root: str) -> int:
    """Free bytes under ``root``, made if missing; :class:`ConfigError` (one line) when it
    cannot be a directory this process writes blocks into."""
    try:
        make_private_dirs(root)
    except FileExistsError:  # something that is not a directory
        raise ConfigError(f"store directory {root}: exists and is not a directory") from None
    except OSError as e:
        raise ConfigError(f"store directory {root}: cannot create it ({e.strerror})") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"store directory {root}: not writable by this process")
    return shutil.disk_usage(root).free


def has_room(path: str, size: int) -> bool:
    """Whether the file system under ``path`` has room for a file of ``size`` bytes (True
    when it cannot tell: one file is removed per try then)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return True
    if st.f_files and st.f_favail < 1:
        return False
    return st.f_bavail * st.f_frsize >= size + ROOM_SLACK_BLOCKS * st.f_frsize


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


#: The existence query's bound on such a file system (a healthy one answers in ms).
QUERY_TIMEOUT_S = 1.0
#: File systems whose calls can hang for good (a server gone, a hard mount): a stat
#: there is bounded by a query timeout of its own (see zkv/storage/query.py).
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "lustre", "gpfs",
                        "glusterfs", "beegfs", "9p", "afs", "ocfs2", "gfs2", "orangefs"})


def fs_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system ``path`` is on (``fuse.*`` for FUSE ones), from the
    longest mount point above it; None when it cannot be told."""
    real = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                point = fields[4].replace("\\040", " ")
                under = real == point or real.startswith(point.rstrip("/") + "/")
                if under and len(point) >= len(best):
                    best, kind = point, line.split(" - ", 1)[1].split()[0]
    except OSError:
        return None
    return kind


def may_hang(kind: str | None) -> bool:
    """Whether calls on a file system of type ``kind`` can block without end."""
    return kind is not None and (kind in NETWORK_FS or kind.startswith("fuse"))
