"""Namespaces of a ``file://`` store that no engine uses any more, removed.

A namespace is a cache layout's fingerprint: a new model revision, dtype, TP size or salt
gives a new one, and the old one's files stay under the root. Each store's budget is half
of the free space it finds, so the dead namespaces' files took the room of the live one:
after eight restarts under new namespaces a 16 MiB disk held 15 MiB of dead blocks and the
live store none.

A store marks its namespace as used: ``{root}/{namespace}/.zkv-namespace``, touched at
open and then at most once every ``MARK_EVERY_S`` by a put or a hit. When a store opens,
it removes each other namespace whose mark is older than its ``keep_days`` (the folder is
renamed aside first, then removed: a store that opens it meanwhile makes a new one, as
after any removed root). A folder without a mark is never touched: it may not be zkv's
(a ``file://`` root the user shares with other data), or be from before marks::

    {root}/{ns}/.zkv-namespace   mtime: last use ─► older than keep_days ─► renamed to
                                                   {root}/.{ns}.{pid}.pruned ─► removed
    (a removal cut short leaves the renamed folder, its mark inside: the next open takes it)
"""

from __future__ import annotations

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


def prune(root: str, own: str, keep_s: float) -> list[tuple[str, float]]:
    """Remove the namespaces under ``root`` but ``own`` whose mark is older than ``keep_s``
    seconds (and what an earlier removal left renamed aside); each one's name and the days
    since its last use."""
    now = time.time()
    try:
        with os.scandir(root) as it:
            entries = [e for e in it if e.is_dir(follow_symlinks=False) and e.name != own]
    except OSError:
        return []
    pruned = []
    for e in entries:
        try:
            used = os.stat(os.path.join(e.path, MARK)).st_mtime
        except OSError:  # no mark: not a namespace this store may remove
            continue
        aside = e.name.startswith(".") and e.name.endswith(_ASIDE)
        if not aside and now - used < keep_s:
            continue
        target = e.path
        if not aside:
            target = os.path.join(root, f".{e.name}.{os.getpid()}{_ASIDE}")
            try:
                os.rename(e.path, target)
            except OSError:  # another store took it, or it cannot be moved: left as it is
                continue
            pruned.append((e.name, (now - used) / 86400))
        shutil.rmtree(target, ignore_errors=True)
    return pruned
