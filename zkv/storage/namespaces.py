"""Namespaces of a ``file://`` store that no engine uses any more, removed.

A namespace is a cache layout's fingerprint: a new model revision, dtype, TP size or salt
gives a new one, and the old one's files stay under the root. Each store's budget is half
of the free space it finds, so the dead namespaces' files took the room of the live one:
after eight restarts under new namespaces a 16 MiB disk held 15 MiB of dead blocks and the
live store none.

A store marks its namespace: ``{root}/{namespace}/.zkv-namespace``, touched at open, then
at most once every ``MARK_EVERY_S`` (or a tenth of ``keep_days`` when that is shorter) by a
put or a hit, and at close (the last use), and held with a shared ``flock`` while the store
is open (in use, however idle). (Before, not at close: a namespace used a moment ago could
look idle up to an hour, and be removed that much early.) When a store opens, it
removes each other namespace whose mark it can lock exclusively (no store has it open)
and, so locked, is older than ``keep_days``: renamed aside, then removed, the mark last. A
folder without a mark is never touched: it may not be zkv's (a ``file://`` root the user
shares with other data), or be from before marks::

    {root}/{ns}/.zkv-namespace ─ LOCK_EX|LOCK_NB ─ taken, mtime older than keep_days ─►
        rename to {root}/.{ns}.{pid}.pruned ─► remove its folders, then the mark, then it
    (a store has it open: its LOCK_SH refuses; a removal cut short leaves the renamed folder
    with its mark: the next open, or another opener meanwhile, finishes it)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time

MARK = ".zkv-namespace"
MARK_EVERY_S = 3600.0  # a store in use touches its mark at most this often
DEFAULT_KEEP_DAYS = 7.0
_ASIDE = ".pruned"


def mark(base: str) -> bool:
    """Touch the mark of the namespace folder ``base`` (the store made the folder); False
    when it cannot be (a read-only root, or the folder went)."""
    path = os.path.join(base, MARK)
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        return True
    except OSError:
        return False


STALE = -1  # hold(): the mark locked was renamed aside meanwhile (make it again, retry)


def release(base: str, held: int) -> None:
    """The store closes: mark the namespace used a last time, then let ``held`` (from
    ``hold``) go, and its lock with it."""
    mark(base)
    os.close(held)


def hold(base: str) -> int | None:
    """A descriptor of the namespace's mark with a shared lock on it: no opener removes the
    namespace while it is open (close it with the store); None when it cannot be had,
    ``STALE`` when the mark locked is no longer the one at ``base``, or is gone: another
    opener renamed the namespace aside between this open and the lock (before, the store
    held that mark: its namespace was removed under it, and made again unmarked, never
    pruned), or between the store's making of the folder and this open (before, the store
    held nothing: pruned later while open, idle past ``keep_days``)."""
    path = os.path.join(base, MARK)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return STALE
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        held, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        os.close(fd)
        return STALE
    except OSError:
        os.close(fd)
        return None
    if (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):
        os.close(fd)
        return STALE
    return fd


def prune(root: str, own: str, keep_s: float) -> list[tuple[str, float]]:
    """Remove the namespaces under ``root`` but ``own`` that no store holds and whose mark
    is older than ``keep_s`` seconds, and what an earlier removal left renamed aside; each
    one this call renamed: its name and the days since its last use."""
    pruned = []
    for name, path in _folders(root, own):
        if not _is_aside(name):
            days = _rename_if_unused(root, name, path, keep_s)
            if days is not None:
                pruned.append((name, days))
    for name, path in _folders(root, own):  # this call's, another opener's, a dead one's
        if _is_aside(name):
            _remove(path)
    return pruned


def _folders(root: str, own: str) -> list[tuple[str, str]]:
    """(name, path) of the folders under ``root`` with a mark, but ``own``."""
    try:
        with os.scandir(root) as it:
            found = [(e.name, e.path) for e in it
                     if e.name != own and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    return [(n, p) for n, p in found if os.path.isfile(os.path.join(p, MARK))]


def _is_aside(name: str) -> bool:
    return name.startswith(".") and name.endswith(_ASIDE)  # (a namespace never starts so)


def _rename_if_unused(root: str, name: str, path: str, keep_s: float) -> float | None:
    """Rename the namespace aside if no store holds it and it is older than ``keep_s``
    (both judged under its exclusive lock); the days since its last use, or None."""
    try:
        fd = os.open(os.path.join(path, MARK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a store has it open
            return None
        held = os.fstat(fd)
        try:  # the mark locked must still be the folder's: another pruner may have put the
            now = os.stat(os.path.join(path, MARK))  # old one aside meanwhile, and a store
        except OSError:  # made the namespace again under the same name, holding the new
            return None  # mark (its lock is not the one this call took)
        if (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):
            return None
        idle_s = time.time() - held.st_mtime
        if idle_s < keep_s:
            return None
        try:
            os.rename(path, os.path.join(root, f".{name}.{os.getpid()}{_ASIDE}"))
        except OSError:  # another opener took it, or it cannot be moved: left as it is
            return None
        return idle_s / 86400.0
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    """Remove a folder renamed aside: its folders, then its mark (so a removal cut short
    is still found), then itself."""
    with contextlib.suppress(OSError), os.scandir(path) as it:
        for e in list(it):
            if e.name != MARK:
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(path, MARK))
    with contextlib.suppress(OSError):
        os.rmdir(path)
