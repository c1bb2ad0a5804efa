"""The embedded L3 store: one file per block under a directory (``file:///path``).

::

    {root}/{namespace}/{hex[:2]}/{hex}.{rank}      = 64-byte header ‖ payload (see base.py)
    {root}/{namespace}/{hex[:2]}/{hex}.{rank}.{pid}.{thread}.tmp   a put in progress

The store is private to its user: the directories it makes are 0700 and its block files
0600 (KV tells what the prompts were); engines share one directory by running as one user.
A put writes the temp file (header and payload in one ``writev``, straight from the host
block) and ``os.replace``-s it in, so a reader sees a whole block or none, also across
processes. A read checks the header, the file size and the payload checksum: a torn,
truncated, damaged or foreign file is refused, removed (that file, by its inode: a good
one another writer put there since stays) and counted. The root is made at open. One
that cannot be (a file is in the way, not writable) is logged at open
(``storage.store_unreachable``) and the store goes on as a server down would: puts fail,
reads miss (an engine serves on; ``zkv replay`` refuses the flag first, with
:func:`check_root`). Without a budget on a file system with no free space, open raises
``ConfigError``. A root deleted later is made again by the next put (folders are
re-created).

The namespaces under the root that no store has open and none used for ``keep_days`` (a
model revision, dtype or TP size no engine serves now) are removed when a store opens,
before it measures the free space (zkv/storage/namespaces.py); a store holds its own
namespace (a shared ``flock`` on its mark) until :meth:`close`.

Byte budget. The store keeps an LRU index ``path -> size`` of the files it knows: all
files of its namespace at open (one scan, oldest mtime first; stale temp files removed),
then every block it writes or serves. The scan reads names first: only the files the
store indexes (and temp files) cost a ``stat``. A put that takes the indexed total past
``max_bytes`` removes the least recently used files until it fits: O(1) per file, no
directory scan. A block whose file alone is larger than the budget is refused
(``StorageError``) and evicts nothing (before, it evicted every file and was stored over
the budget). A hit refreshes the file's mtime, so the order survives a restart.
Several processes writing one directory each keep their own index: the bound holds per
writer, so give each of ``W`` writers ``max_bytes / W`` (:func:`~zkv.storage.open_store`'s
``writers``), and each its ``rank`` (the rank its keys carry): a rank's store indexes, and
so evicts, the files of that rank alone, at open too. (A store without a rank indexes
every file of the namespace: one writer, or one that only reads. Ranks that indexed each
other's files at a restart each evicted everyone's blocks down to their own share at
their first put: a group of ``W`` kept ~1/W of its store across a restart.) A store
without a rank builds its index when it is first needed, not at open: at its first put,
or when asked its ``num_blocks``, ``num_bytes`` or ``max_bytes`` (a budget taken from the
free space measures it then, with the files held then). A reader, such as the
scheduler's store, which only asks what exists (one ``stat`` a key, no index) and reads,
never builds it: its open costs one pass over the names (stale temp files removed) and no
memory per file. (Before, it indexed every rank's files at open: 1.7 s and 119 MiB for
400k files, unused. Its hits refresh the file's mtime, which the scan orders by, so an
index built later still finds them recent.) Without free space at open (the budget would
rest on the files held alone) it indexes at open, as a rank's store does.

A put reserves its bytes in the index before it writes (the temp file counts): the files a
writer holds, finished or in progress, stay within its budget. A store without a given
budget also keeps a quarter of the free space it found at open free on the file system
(one ``statvfs`` a put): engines that open stores on one disk at once each take half of
its free space, and filled it to the last block between them (``ENOSPC`` for everyone
else on the disk) before this. An evicted file leaves the
index first and is unlinked after, unless a put of the same key has renamed its new file
into place since (that rename with its indexing, and the eviction's last check with its
unlink, hold one lock): the new block stays. (Within one process: another process's
store evicts by its own index.)

A full disk (``ENOSPC`` / ``EDQUOT``: the file system is smaller than the budget, or
something else filled it) makes room from the store's own least recently used files until
the file system has room for the block again (``statvfs``; at least one file for a quota),
lowers the budget to what the store then holds plus the block, and tries the put again:
other writers on the disk (another rank, this one's other I/O threads) may take the room
first. One thread makes room at a time; a thread whose put failed before another made room
just tries again. A store with none of its own files left
removes the namespace's oldest files on the disk, whoever wrote them (one directory scan,
only then): a writer that starts on a disk the others filled still gets room. From then on
the store keeps working as an LRU within the space it has (one ``storage.disk_full``
warning per lowering). A lowered budget grows back once the disk has room again: a put,
at most once every ``_REGROW_S``, takes what the store holds plus half its writer's share
of the free space, up to the budget it had before (``storage.budget_regrown``; before, a
filler that came and went shrank the store for good). With no
file of the namespace to remove, the put fails with the system's error
(``StorageError``)::

    reserve ─► write ─ENOSPC─► (another thread made room since?) ── yes ──► write again
                                   │ no                                        ▲
                                   ▼                                           │
        remove own LRU files until the disk has room ─► budget := held + block ┤
                                   │ own ones ran out, still no room           │
                                   ▼                                           │
        remove the namespace's oldest files on the disk ───────────────────────┘
                                   │ none: StorageError (the system's error)
    (room made at most _PUT_TRIES - 1 times a put; retries after another thread's are free)
"""

from __future__ import annotations

import errno
import math
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from zkv import log as ev
from zkv.errors import ConfigError, StorageError
from zkv.storage import namespaces
from zkv.storage.base import (
    CORRUPT,
    DIGEST_SIZE,
    HEADER_SIZE,
    KEY_SIZE,
    TRUNCATED,
    Store,
    as_bytes_view,
    check_counts,
    check_header,
    pack_header,
    payload_ok,
    store_call,
)
from zkv.storage.localfs import (
    QUERY_TIMEOUT_S,
    check_root,
    free_bytes,
    fs_type,
    fsync_dir,
    has_room,
    make_private_dirs,
    may_hang,
    remove_if_stale,
    unlink_quietly,
    write_all,
)
from zkv.storage.url import file_url

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# A put on a full disk: the first try and up to 9 after making room. (5 were too few once
# in CI: 2 cores, 3 processes of 4 threads on a 1 MiB disk, a put lost the room it made to
# the others 5 times in a row; each making asks for one block more.)
_PUT_TRIES = 10
_PUT_WRITES = _PUT_TRIES * 4  # with the retries after another thread made room
_REGROW_S = 60.0  # a lowered budget is looked at again at most this often (on a put)


class LocalDirStore(Store):
    """One file per block under ``root`` (see the module docstring).

    Invariant: ``_total == sum(_lru.values())``; ``_total + _pending <= max_bytes`` after
    a reservation (unless one block alone is larger); ``_pending`` is the bytes of the
    puts in progress. put/get/evict are O(1) in the index.
    ``max_bytes=None`` takes half the room this writer has at open: its ``1/writers``
    share of the file system's free space plus what its own files already hold. So a
    group of ``writers`` ranks takes half the free space together, and a restart takes
    the budget the last run had (before, each rank took half the free space, a group of
    two all of it, and each restart half of what was left on top of what it held).
    ``fsync=True`` makes puts durable across a crash: the file's data, then the directory
    entry the rename made (and any folder the put made).
    ``rank``: the writer's rank, whose files alone this store indexes (module docstring);
    without one the index (and a budget taken from the free space) waits for its first use:
    ``_indexed`` says whether it is built, and ``_lru`` is empty until it is.
    """

    def __init__(self, root: str | os.PathLike[str], namespace: str, *,
                 max_bytes: int | None = None, fsync: bool = False,
                 rank: int | None = None, writers: int = 1,
                 keep_days: float = namespaces.DEFAULT_KEEP_DAYS,
                 query_timeout_s: float | None = None) -> None:
        super().__init__(namespace, file_url(root))
        # (the scheduler's query: bounded where a stat can hang for good; see query.py)
        self.query_timeout_s = query_timeout_s if query_timeout_s is not None else (
            QUERY_TIMEOUT_S if may_hang(fs_type(os.fspath(root))) else None)
        if not keep_days >= 0:
            raise ValueError(f"keep_days must be >= 0, got {keep_days}")
        if rank is not None and rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if writers < 1:
            raise ValueError(f"writers must be >= 1, got {writers}")
        if max_bytes is not None and max_bytes <= 0:  # (before the namespace is held)
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.rank = rank
        self._suffix = None if rank is None else f".{rank}"
        self.root = os.fspath(root)
        self.fsync = fsync
        self._base = os.path.join(self.root, namespace)
        self._made: set[str] = set()
        self._lock = threading.Lock()
        # A put's rename into place and its indexing, and an evicted file's last check and
        # unlink, hold this lock: an eviction never unlinks a file a put just placed
        # (see _remove_files). Order: _room_lock, then _files_lock, then _lock.
        self._files_lock = threading.Lock()
        self._room_lock = threading.Lock()  # one thread makes room on a full disk at a time
        self._free_lock = threading.Lock()  # one thread keeps the disk's free share at a time
        self._room_gen = 0  # times room was made: a put that failed before retries at once
        self._ceiling = 0  # the budget before a full disk lowered it (0: not lowered)
        self._looked_at = 0.0  # (monotonic) when it was lowered, or last looked at again
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._total = 0
        self._pending = 0
        self._indexed = False  # set once, by _ensure_index
        self.keep_s = keep_days * 86400.0
        self._marked_at = -math.inf  # (monotonic) when it last marked its namespace used
        self._held: int | None = None  # the mark, share-locked while open (namespaces.py)
        try:
            check_root(self.root)
            self._open_namespace()
            free = free_bytes(self.root)  # (after: what this or another opener removed)
        except ConfigError as e:  # as a server down at start: puts fail, reads miss
            self._log.error(ev.STORE_UNREACHABLE, store=self.url, error=str(e))
            free = free_bytes(self.root)
        self._share = free // writers
        self._writers = writers
        # (no budget given) the free space a put leaves on the file system, at least: a
        # quarter of what was free at open (other engines' stores on the disk, each with
        # its half of the free space, filled it to the last block)
        self._keep_free = free // 4 if max_bytes is None else 0
        self._max_bytes = max_bytes or 0  # 0: taken when indexing, (share + held) // 2
        if rank is None and (max_bytes is not None or self._share >= 2):
            self._sweep_stale_tmp()  # the index waits for its first use (module docstring)
        else:
            self._ensure_index(at_open=True)
            if self._max_bytes <= 0:
                self.close()  # the namespace's hold (before, its fd and lock leaked)
                raise ConfigError(f"store directory {self.root}: its file system has no free "
                                  "space; free some, or give a budget (file://...?max_gb=G)")

    @property
    def max_bytes(self) -> int:
        """The byte budget (lowered on a full disk)."""
        self._ensure_index()
        return self._max_bytes

    @property
    def num_bytes(self) -> int:
        """Bytes of the blocks in the index."""
        self._ensure_index()
        return self._total

    @property
    def num_blocks(self) -> int:
        self._ensure_index()
        return len(self._lru)

    def path(self, key: bytes) -> str:
        if len(key) != KEY_SIZE:
            raise ValueError(f"store key must be {KEY_SIZE} bytes, got {len(key)}")
        digest = key[:DIGEST_SIZE].hex()
        rank = int.from_bytes(key[DIGEST_SIZE:], "big")
        return os.path.join(self._base, digest[:2], f"{digest}.{rank}")

    # ---------------------------------------------------------------- interface

    @store_call
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            return [os.path.isfile(self.path(k)) for k in keys]
        except OSError as e:
            self._count(errors=1)
            raise StorageError(f"exists: {e}") from e

    def _count_present(self, digests: Sequence[bytes], world_size: int) -> int:
        """One ``stat`` per key up to the first missing one (no round trip to save); the
        paths as :meth:`path` names them, built once per block."""
        suffixes = [f".{r}" for r in range(world_size)]
        base, stat_, is_file = self._base, os.stat, stat.S_ISREG
        for i, d in enumerate(digests):
            if len(d) != DIGEST_SIZE:
                raise ValueError(f"digest must be {DIGEST_SIZE} bytes, got {len(d)}")
            h = d.hex()
            prefix = f"{base}/{h[:2]}/{h}"
            for suffix in suffixes:
                try:
                    if not is_file(stat_(prefix + suffix).st_mode):
                        return i
                except OSError:  # missing (or unreadable): as os.path.isfile says
                    return i
        return len(digests)

    @store_call
    def put_many(self, keys: Sequence[bytes], datas: Sequence[Any]) -> list[bool]:
        check_counts(keys, datas)
        self._ensure_index()
        for key, data in zip(keys, datas, strict=True):
            self._put_one(key, as_bytes_view(data))
        return [True] * len(keys)

    @store_call
    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        check_counts(keys, outs)
        return [self._get_one(k, as_bytes_view(o)) for k, o in zip(keys, outs, strict=True)]

    @store_call
    def remove(self, key: bytes) -> None:
        path = self.path(key)
        with self._files_lock:  # the unlink and its unindexing, one step as a put sees it
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise StorageError(f"remove {self.name(key)}: {e}") from e
            self._forget(path)

    # ---------------------------------------------------------------- put

    def _put_one(self, key: bytes, view: memoryview) -> None:
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        bufs = [pack_header(self.ns_id, key, view), view]
        size = HEADER_SIZE + view.nbytes
        if size > self._max_bytes:  # it would evict every file and still not fit
            self._count(errors=1)
            raise StorageError(f"put {self.name(key)}: its file of {size:,} bytes is larger "
                               f"than the store's budget of {self._max_bytes:,} bytes; give "
                               "a larger max_gb")
        made = 0  # times this put made room; retries after another thread's do not count
        now = time.monotonic()
        if self._ceiling and now - self._looked_at >= _REGROW_S:
            self._regrow()
        self._mark(now)
        for _ in range(_PUT_WRITES):
            gen = self._room_gen
            reserved = self._reserve(size, path)
            try:
                self._write_file(tmp, bufs)
                self._place(tmp, path, size, reserved)
                break
            except BaseException as e:
                self._release(reserved)
                unlink_quietly(tmp)
                if not isinstance(e, OSError):
                    raise
                if made + 1 < _PUT_TRIES and e.errno in _NO_SPACE:
                    outcome = self._make_room(size, e, gen, made)
                    if outcome is not None:
                        made += outcome
                        continue
                self._count(errors=1)
                raise StorageError(f"put {self.name(key)}: {e}") from e
        else:
            self._count(errors=1)
            raise StorageError(f"put {self.name(key)}: no room after {_PUT_WRITES} tries")
        if self.fsync:  # the rename itself: the folder's entry
            try:
                fsync_dir(os.path.dirname(path))
            except OSError as e:  # (the block is there and indexed; its durability is not)
                self._count(errors=1)
                raise StorageError(f"put {self.name(key)}: {e}") from e
        self._count(puts=1, bytes_written=view.nbytes)

    def _write_file(self, tmp: str, bufs: list[Any]) -> None:
        try:
            fd = self._create(tmp)
        except FileNotFoundError:  # the root was removed (and maybe made again)
            with self._lock:
                self._made.clear()
            fd = self._create(tmp)
        try:
            write_all(fd, bufs)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _place(self, tmp: str, path: str, size: int, reserved: int) -> None:
        """Rename a put's finished temp file into place and index it (``reserved`` of its
        ``size`` bytes were), one step as eviction sees it (see :meth:`_remove_files`)."""
        with self._files_lock:
            os.replace(tmp, path)
            victims = self._index(path, size, reserved)
        self._remove_files(victims)

    def _make_room(self, size: int, error: OSError, gen: int, made: int) -> bool | None:
        """The disk is full (see the module docstring): remove this store's least recently
        used files, at least one, until the file system has room for ``size`` bytes, then
        the namespace's oldest files on the disk if its own ran out; lower the budget to
        what it then holds plus the block. The room asked for includes the puts of this
        store's other threads in progress, and one more block each time this put (``made``
        times before) lost the room it made to another writer. True: room made here;
        False: made by another thread since the put's try began (``gen``), or there now
        without removing anything: try again at once; None: no room and no file of the
        namespace to remove."""
        with self._room_lock:
            if self._room_gen != gen:
                return False
            quota = error.errno == errno.EDQUOT  # statvfs does not see quotas
            removed: list[tuple[str, int]] = []
            need = size * (made + 1) + self._pending
            while not removed or not (quota or has_room(self.root, need)):
                with self._lock:
                    if not self._lru:
                        break
                    victim = self._lru.popitem(last=False)
                    self._total -= victim[1]
                if self._unlink_evicted(victim[0]):
                    removed.append(victim)
            others = 0
            if not quota and not has_room(self.root, need):
                others = self._remove_oldest_on_disk(need)
            if not removed and not others:  # room came meanwhile, or came and went again
                if has_room(self.root, need):
                    return False
                # (another writer took the room seen above: the namespace's oldest files
                # are still the way; None here failed 1 run in 150 of the writers test)
                if quota or not (others := self._remove_oldest_on_disk(need)):
                    return None
            with self._lock:
                old = self._max_bytes
                new = self._max_bytes = max(size, min(old, self._total + self._pending + size))
                held = self._total
                if not quota:  # (statvfs cannot see a quota: it would grow back into it)
                    self._ceiling = self._ceiling or old
                    self._looked_at = time.monotonic()
            self._room_gen += 1
        if removed:
            self._count(evicted=len(removed))
        self._log.warning(ev.STORE_DISK_FULL, store=self.url, error=str(error),
                          max_bytes_was=old, max_bytes=new, num_bytes=held,
                          num_evicted=len(removed), num_removed_others=others)
        return True

    def _regrow(self) -> None:
        """(A budget a full disk lowered, ``_REGROW_S`` after it was last looked at.) Raise
        it to what the store holds plus half this writer's share of the free space, up to
        the budget it had before; done with it once it is back there."""
        with self._room_lock:
            if not self._ceiling or time.monotonic() - self._looked_at < _REGROW_S:
                return  # (another thread did, or the disk filled again meanwhile)
            try:
                free = free_bytes(self.root)
            except OSError:  # (the root went: the put says why)
                free = 0
            with self._lock:
                old = self._max_bytes
                new = min(self._ceiling, max(old, self._total + self._pending
                                             + free // self._writers // 2))
                self._max_bytes = new
                if new >= self._ceiling:
                    self._ceiling = 0
                self._looked_at = time.monotonic()
                held = self._total
        if new > old:
            self._log.info(ev.STORE_BUDGET_REGROWN, store=self.url, max_bytes_was=old,
                           max_bytes=new, num_bytes=held, free_bytes=free)

    def _remove_oldest_on_disk(self, size: int) -> int:
        """(Making room, with none of this store's own files left.) Remove the namespace's
        files on the disk, any writer's, oldest mtime first, until the file system has room
        for ``size`` bytes; how many. One directory scan."""
        found = sorted(self._scan(None))
        n = 0
        for _, path, _ in found:
            if n and has_room(self.root, size):
                break
            unlink_quietly(path)
            self._forget(path)
            n += 1
        return n

    def _create(self, tmp: str) -> int:
        folder = os.path.dirname(tmp)
        if folder not in self._made:
            made = make_private_dirs(folder)
            if self.fsync:  # each new folder's entry in its parent
                for d in made:
                    fsync_dir(os.path.dirname(d))
            with self._lock:
                self._made.add(folder)
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)

    # ---------------------------------------------------------------- get

    def _get_one(self, key: bytes, out: memoryview) -> bool:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._count(misses=1)
            self._forget_missing(path)
            return False
        except OSError as e:
            self._count(errors=1)
            raise StorageError(f"get {self.name(key)}: {e}") from e
        try:
            ok = self._read_verified(fd, key, out)
        except OSError as e:
            self._count(errors=1)
            raise StorageError(f"get {self.name(key)}: {e}") from e
        finally:
            os.close(fd)
        if ok:
            self._count(hits=1, bytes_read=out.nbytes)
            self._touch(path, HEADER_SIZE + out.nbytes)
        return ok

    def _read_verified(self, fd: int, key: bytes, out: memoryview) -> bool:
        want = out.nbytes
        st = os.fstat(fd)
        size = st.st_size
        kind, checksum = check_header(os.pread(fd, HEADER_SIZE, 0), self.ns_id, key, want)
        if kind is None and size != HEADER_SIZE + want:
            kind = TRUNCATED if size < HEADER_SIZE + want else CORRUPT
        if kind is None:
            got = 0
            while got < want:
                n = os.preadv(fd, [out[got:]], HEADER_SIZE + got)
                if n <= 0:
                    kind = TRUNCATED  # shortened underneath us
                    break
                got += n
        if kind is None and not payload_ok(out, checksum):
            kind = CORRUPT
        if kind is not None:
            self._refuse(key, kind, f"file size {size}, block {want} bytes",
                         seen=(st.st_dev, st.st_ino, want))
            return False
        return True

    def _delete_refused(self, key: bytes, seen: Any) -> None:
        """Remove the refused file, not a good one another writer put in its place since
        (a put renames a new file over the path; the path's inode tells which file is
        there). The file at the path is renamed aside (atomic: no put lands between the
        look and the removal), compared with the one read (``seen``: device, inode, block
        bytes) and removed if it is that one, else renamed back: a reader meanwhile sees a
        miss, no good copy is lost. (Before, the path was unlinked: a good copy that landed
        between the read and the unlink went with it.) A file system reuses the inode
        number of a file removed: a file with the refused one's inode that checks out
        whole is a good copy written since, and goes back too (before, it was removed)."""
        if seen is None:
            self.remove(key)
            return
        dev, ino, want = seen
        path = self.path(key)
        aside = f"{path}.{os.getpid()}.{threading.get_ident()}.refused.tmp"  # scans skip .tmp
        with self._files_lock:  # this process's puts and evictions wait: they hold it too
            try:
                os.rename(path, aside)
            except FileNotFoundError:  # gone already (another reader refused it too)
                self._forget(path)
                return
            except OSError as e:
                raise StorageError(f"remove {self.name(key)}: {e}") from e
            try:
                st = os.stat(aside)
                ours = ((st.st_dev, st.st_ino) == (dev, ino)
                        and not self._whole(aside, key, want))
            except OSError:  # cannot tell: back in place (a bad one is refused again)
                ours = False
            if ours:
                unlink_quietly(aside)
                self._forget(path)
                return
            try:
                os.rename(aside, path)
            except OSError as e:
                unlink_quietly(aside)
                raise StorageError(f"remove {self.name(key)}: {e}") from e

    def _whole(self, path: str, key: bytes, want: int) -> bool:
        """Whether the file at ``path`` is a good ``want``-byte block of ``key`` (read
        again, only for a refused file's inode)."""
        with open(path, "rb", buffering=0) as f:
            data = f.read(HEADER_SIZE + want + 1)
        kind, checksum = check_header(data[:HEADER_SIZE], self.ns_id, key, want)
        return (kind is None and len(data) == HEADER_SIZE + want
                and payload_ok(memoryview(data)[HEADER_SIZE:], checksum))

    # ---------------------------------------------------------------- index

    def _reserve(self, size: int, path: str) -> int:
        """Count a put's new bytes (a file it replaces counts already) before its file is
        written, removing least recently used files for them; the bytes counted."""
        with self._lock:
            grow = max(0, size - self._lru.get(path, 0))
            self._pending += grow
            victims = self._pop_lru_over(self._max_bytes - self._pending, keep=0)
        self._remove_files(victims)
        if self._keep_free:  # (the disk holds both files until the rename)
            self._keep_disk_free(size)
        return grow

    def _keep_disk_free(self, size: int) -> None:
        """(A store without a given budget, before a put of ``size`` bytes.) Remove least
        recently used files until the file system keeps ``_keep_free`` bytes free after
        the put, or none of this store's is left. One ``statvfs``."""
        if not self._free_lock.acquire(blocking=False):
            return  # another thread is at it: what it removes counts for this put too
        try:
            try:
                st = os.statvfs(self.root)
            except OSError:
                return
            short = self._keep_free + size - st.f_bavail * st.f_frsize
            if short > 0:
                with self._lock:
                    victims = self._pop_lru_over(self._total - short, keep=0)
                self._remove_files(victims)
        finally:
            self._free_lock.release()

    def _release(self, size: int) -> None:
        with self._lock:
            self._pending -= size

    def _remember(self, path: str, size: int) -> None:
        """Index a block file found on the disk."""
        self._remove_files(self._index(path, size))

    def _index(self, path: str, size: int, reserved: int = 0) -> list[tuple[str, int]]:
        """Index a file (``reserved``: the bytes its put had reserved); the files to evict
        for it."""
        with self._lock:
            self._pending -= reserved
            old = self._lru.pop(path, None)
            if old is not None:
                self._total -= old
            self._lru[path] = size
            self._total += size
            return self._pop_lru_over(self._max_bytes - self._pending, keep=1)

    def _pop_lru_over(self, limit: int, keep: int) -> list[tuple[str, int]]:
        """(Under the lock.) Take least recently used files out of the index until it holds
        at most ``limit`` bytes or ``keep`` files; their (path, size)."""
        victims = []
        while self._total > limit and len(self._lru) > keep:
            victim, vsize = self._lru.popitem(last=False)
            self._total -= vsize
            victims.append((victim, vsize))
        return victims

    def _remove_files(self, victims: list[tuple[str, int]]) -> None:
        """Unlink files taken out of the index (:meth:`_pop_lru_over`), those a put has not
        placed again since (:meth:`_unlink_evicted`)."""
        removed = [(path, size) for path, size in victims if self._unlink_evicted(path)]
        if not removed:
            return
        self._count(evicted=len(removed))
        self._log.debug(ev.STORE_EVICTED, num_blocks=len(removed),
                        num_bytes=sum(s for _, s in removed), store=self.url)

    def _unlink_evicted(self, path: str) -> bool:
        """Unlink a file that eviction took out of the index, unless it is back in the index
        (False): a put of the same key renamed its new file into place since (or a hit
        indexed it again), and that file stays. An eviction takes the path out under
        ``_lock`` and unlinks it later; a put renames and indexes under ``_files_lock``,
        held here from the check to the unlink, so the put either lands first (and is
        seen) or after the unlink (and survives). (Before, a re-put landing between the
        two lost its new file: it was indexed and gone, the block a miss.)"""
        with self._files_lock:
            with self._lock:
                if path in self._lru:
                    return False
            unlink_quietly(path)
        return True

    def _touch(self, path: str, size: int) -> None:
        with self._lock:
            if path in self._lru:
                self._lru.move_to_end(path)
                known = True
            else:
                known = False
        if not known and self._indexed and self._owns(path):  # written by another process
            # of this writer's (an earlier run): accounted for from now on, if still there; an
            # eviction that unlinked it since the read (another thread's put) holds the same
            # lock. (No index yet: the scan that builds it finds the file, recent by mtime.)
            with self._files_lock:
                victims = self._index(path, size) if os.path.exists(path) else []
            self._remove_files(victims)
        try:
            os.utime(path)
        except OSError:
            pass
        self._mark(time.monotonic())

    def _open_namespace(self) -> None:
        """(At open.) Make this namespace's folder, mark it used and hold it; remove the
        namespaces no store holds, unused for ``keep_s`` (``zkv/storage/namespaces.py``)."""
        for _ in range(3):  # again while another opener renames it aside under us
            try:
                for d in make_private_dirs(self._base):
                    if self.fsync:  # (its entry in its parent, as a put's folders)
                        fsync_dir(os.path.dirname(d))
            except OSError:
                return  # (its puts say why)
            self._marked_at = -math.inf
            self._mark(time.monotonic())
            held = namespaces.hold(self._base)
            if held != namespaces.STALE:
                self._held = held
                break
        pruned = namespaces.prune(self.root, self.namespace, self.keep_s) if self.keep_s else []
        for name, days in pruned:
            self._log.info(ev.STORE_NAMESPACE_PRUNED, store=self.url, pruned=name,
                           idle_days=round(days, 1), keep_days=self.keep_s / 86400.0)

    def close(self) -> None:
        """The last mark and release touch the file system: on a thread (a hung mount),
        within what is left of ``close_wait_s``."""
        t0 = time.monotonic()
        super().close()
        held, self._held = self._held, None
        if held is not None:
            t = threading.Thread(target=namespaces.release, args=(self._base, held), daemon=True)
            t.start()
            t.join(max(0.0, self.close_wait_s - (time.monotonic() - t0)))
            if t.is_alive():
                self._log.warning(ev.STORE_CLOSE_TIMEOUT, store=self.url,
                                  waited_s=self.close_wait_s, error="its namespace's "
                                  "last mark and release did not return (a hung mount?)")

    def _mark(self, now: float) -> None:
        """Mark the namespace used, at most once every ``MARK_EVERY_S`` or a tenth of
        ``keep_s`` (a put, a hit); the first call (at open) always."""
        every = min(namespaces.MARK_EVERY_S, self.keep_s / 10) if self.keep_s else \
            namespaces.MARK_EVERY_S
        if now - self._marked_at >= every:
            self._marked_at = now
            namespaces.mark(self._base)

    def _forget(self, path: str) -> None:
        with self._lock:
            size = self._lru.pop(path, None)
            if size is not None:
                self._total -= size

    def _forget_missing(self, path: str) -> None:
        """Unindex a file a read found missing (removed by another writer), unless a put
        renamed a new one into place since: checked under ``_files_lock``, which a put
        holds from its rename to its indexing. (Before, that put's entry went: its file
        stayed on disk out of the index, past the budget, never evicted.)"""
        with self._files_lock:
            if not os.path.lexists(path):
                self._forget(path)

    def _owns(self, path: str) -> bool:
        """Whether a block file is this writer's (its rank's; every file without a rank)."""
        return self._suffix is None or path.endswith(self._suffix)

    def _ensure_index(self, at_open: bool = False) -> None:
        """Index this writer's block files on the disk, oldest mtime first (one scan), and
        take the budget from the free space if none was given (measured at open, or now
        for an index built later: files written since count once, as held); once. At open
        stale temp files are removed too. The scan holds
        ``_files_lock``: this process's unlinks (evictions, removals, refusals) wait, so
        none is indexed again by a scan that saw the file before it went."""
        if self._indexed:
            return
        with self._files_lock:
            if self._indexed:
                return
            found = sorted(self._scan(self._suffix, remove_stale_tmp=at_open))
            share = self._share if at_open else free_bytes(self.root) // self._writers
            lru = OrderedDict((p, s) for _, p, s in found)
            del found
            with self._lock:
                self._lru = lru
                self._total = sum(lru.values())
                if not self._max_bytes:  # (a disk full just then: the share taken at open,
                    self._max_bytes = ((share + self._total) // 2  # never a budget of 0)
                                       or (self._share + self._total) // 2)
                self._indexed = True

    def _sweep_stale_tmp(self) -> None:
        """Remove stale temp files (a writer died mid-put): one pass over the names, a
        ``stat`` for the temp files alone."""
        for _ in self._scan(None, blocks=False, remove_stale_tmp=True):
            pass

    def _scan(self, suffix: str | None, *, blocks: bool = True,
              remove_stale_tmp: bool = False) -> Iterator[tuple[float, str, int]]:
        """(mtime, path, size) of the namespace's block files on the disk whose names end
        with ``suffix`` (a rank's; every one for None; none for ``blocks=False``). Names are
        read first: a file it does not yield costs no ``stat``, but a temp file when
        ``remove_stale_tmp`` (its age)."""
        now = time.time()
        try:
            with os.scandir(self._base) as top:
                folders = [e.path for e in top if e.is_dir()]
        except OSError:  # missing or unusable: puts say why (StorageError), reads miss
            return
        for folder in folders:
            try:
                with os.scandir(folder) as entries:
                    for e in entries:
                        name = e.name
                        if name.endswith(".tmp"):
                            if remove_stale_tmp:
                                remove_if_stale(e, now)
                            continue
                        if not blocks or (suffix is not None and not name.endswith(suffix)):
                            continue
                        try:
                            st = e.stat()
                        except OSError:  # gone meanwhile, or unusable (a symlink loop)
                            continue
                        yield st.st_mtime, e.path, st.st_size
            except OSError:  # the folder went, or cannot be read
                continue

    def __repr__(self) -> str:
        return f"LocalDirStore({self.root!r}, {self.namespace!r})"
