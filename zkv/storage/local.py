"""The embedded L3 store: one file per block under a directory (``file:///path``).

::

    {root}/{namespace}/{hex[:2]}/{hex}.{rank}      = 64-byte header ‖ payload (see base.py)
    {root}/{namespace}/{hex[:2]}/{hex}.{rank}.{pid}.{thread}.tmp   a put in progress

A put writes the temp file (header and payload in one ``writev``, straight from the host
block) and ``os.replace``-s it in, so a reader sees a whole block or none, also across
processes. A read checks the header, the file size and the payload checksum: a torn,
truncated, damaged or foreign file is refused, removed and counted. A root directory that
was deleted and made again is picked up by the next put (folders are re-created).

Byte budget. The store keeps an LRU index ``path -> size`` of the files it knows: all
files of its namespace at open (one scan, oldest mtime first; stale temp files removed),
then every block it writes or serves. A put that takes the indexed total past
``max_bytes`` removes the least recently used files until it fits: O(1) per file, no
directory scan. A hit refreshes the file's mtime, so the order survives a restart.
Several processes writing one directory each keep their own index: the bound holds per
writer, so give each of ``W`` writers ``max_bytes / W`` (:func:`~zkv.storage.open_store`'s
``writers``).

A full disk (``ENOSPC`` / ``EDQUOT``: the file system is smaller than the budget, or
something else filled it) lowers the budget to what this store held then, less one block,
and makes that room from its own least recently used files; the put is tried again, up to
``_PUT_TRIES`` times in all, the budget lowered anew to what it holds less a block before
each: other writers on the disk (another rank, this one's other I/O threads) may take the
room first. From then on the store keeps working as an LRU within the space it has (one
``storage.disk_full`` warning per lowering; the lower budget holds until the store is
opened again). With none of its own files to remove, the put fails with the system's error
(``StorageError``)::

    put ─ENOSPC─► budget := held − block ─► remove LRU files until held ≤ budget ─► put again
                   ▲                               (nothing to remove) ─► StorageError   │
                   └──────────── ENOSPC, fewer than _PUT_TRIES puts ◄────────────────────┘
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from zkv import log as ev
from zkv.errors import StorageError
from zkv.storage.base import (
    CORRUPT,
    DIGEST_SIZE,
    HEADER_SIZE,
    KEY_SIZE,
    TRUNCATED,
    Store,
    as_bytes_view,
    check_header,
    pack_header,
    payload_ok,
)

_STALE_TMP_S = 600.0
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_PUT_TRIES = 4  # a put on a full disk: the first try and up to 3 after making room


class LocalDirStore(Store):
    """One file per block under ``root`` (see the module docstring).

    Invariant: ``_total == sum(_lru.values())``; after a put, ``_total <= max_bytes``
    (unless one block alone is larger). put/get/evict are O(1) in the index.
    ``max_bytes=None`` takes half the free space of the file system at open (plus what
    the namespace already holds). ``fsync=True`` makes puts durable across a crash.
    """

    def __init__(self, root: str | os.PathLike[str], namespace: str, *,
                 max_bytes: int | None = None, fsync: bool = False) -> None:
        super().__init__(namespace)
        self.root = os.fspath(root)
        self.url = f"file://{os.path.abspath(self.root)}"
        self.fsync = fsync
        self._base = os.path.join(self.root, namespace)
        self._made: set[str] = set()
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._total = 0
        self._rebuild_index()
        if max_bytes is None:
            max_bytes = _free_bytes(self.root) // 2 + self._total
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes

    @property
    def num_bytes(self) -> int:
        """Bytes of the blocks in the index."""
        return self._total

    @property
    def num_blocks(self) -> int:
        return len(self._lru)

    def path(self, key: bytes) -> str:
        if len(key) != KEY_SIZE:
            raise ValueError(f"store key must be {KEY_SIZE} bytes, got {len(key)}")
        digest = key[:DIGEST_SIZE].hex()
        rank = int.from_bytes(key[DIGEST_SIZE:], "big")
        return os.path.join(self._base, digest[:2], f"{digest}.{rank}")

    # ---------------------------------------------------------------- interface

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            return [os.path.isfile(self.path(k)) for k in keys]
        except OSError as e:
            self._count(errors=1)
            raise StorageError(f"exists: {e}") from e

    def put_many(self, keys: Sequence[bytes], datas: Sequence[Any]) -> list[bool]:
        for key, data in zip(keys, datas, strict=True):
            self._put_one(key, as_bytes_view(data))
        return [True] * len(keys)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        return [self._get_one(k, as_bytes_view(o)) for k, o in zip(keys, outs, strict=True)]

    def remove(self, key: bytes) -> None:
        path = self.path(key)
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
        for attempt in range(_PUT_TRIES):
            try:
                self._write_file(tmp, path, bufs)
                break
            except OSError as e:
                _unlink_quietly(tmp)
                if (attempt + 1 < _PUT_TRIES and e.errno in _NO_SPACE
                        and self._make_room(size, e)):
                    continue
                self._count(errors=1)
                raise StorageError(f"put {self.name(key)}: {e}") from e
        self._count(puts=1, bytes_written=view.nbytes)
        self._remember(path, size)

    def _write_file(self, tmp: str, path: str, bufs: list[Any]) -> None:
        try:
            fd = self._create(tmp)
        except FileNotFoundError:  # the root was removed (and maybe made again)
            with self._lock:
                self._made.clear()
            fd = self._create(tmp)
        try:
            _write_all(fd, bufs)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _make_room(self, size: int, error: OSError) -> bool:
        """The disk is full: lower the budget to what the store holds, less one block of
        ``size`` bytes, and remove its least recently used files down to it. False (nothing
        done) when it holds no file to remove."""
        with self._lock:
            if not self._lru:
                return False
            old = self.max_bytes
            new = self.max_bytes = max(size, min(old, self._total - size))
            victims = self._pop_lru_over(new, keep=0)
            held = self._total
        self._remove_files(victims)
        self._log.warning(ev.STORE_DISK_FULL, store=self.url, error=str(error),
                          max_bytes_was=old, max_bytes=new, num_bytes=held,
                          num_evicted=len(victims))
        return True

    def _create(self, tmp: str) -> int:
        folder = os.path.dirname(tmp)
        if folder not in self._made:
            os.makedirs(folder, exist_ok=True)
            with self._lock:
                self._made.add(folder)
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    # ---------------------------------------------------------------- get

    def _get_one(self, key: bytes, out: memoryview) -> bool:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._count(misses=1)
            self._forget(path)
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
        size = os.fstat(fd).st_size
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
            self._refuse(key, kind, f"file size {size}, block {want} bytes")
            return False
        return True

    # ---------------------------------------------------------------- index

    def _remember(self, path: str, size: int) -> None:
        with self._lock:
            old = self._lru.pop(path, None)
            if old is not None:
                self._total -= old
            self._lru[path] = size
            self._total += size
            victims = self._pop_lru_over(self.max_bytes, keep=1)
        self._remove_files(victims)

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
        if not victims:
            return
        for victim, _ in victims:
            _unlink_quietly(victim)
        self._count(evicted=len(victims))
        self._log.debug(ev.STORE_EVICTED, num_blocks=len(victims),
                        num_bytes=sum(s for _, s in victims), store=self.url)

    def _touch(self, path: str, size: int) -> None:
        with self._lock:
            if path in self._lru:
                self._lru.move_to_end(path)
                known = True
            else:
                known = False
        if not known:  # written by another process: this one accounts for it from now on
            self._remember(path, size)
        try:
            os.utime(path)
        except OSError:
            pass

    def _forget(self, path: str) -> None:
        with self._lock:
            size = self._lru.pop(path, None)
            if size is not None:
                self._total -= size

    def _rebuild_index(self) -> None:
        """One scan at open: every block file of the namespace, oldest mtime first."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        try:
            folders = [e.path for e in os.scandir(self._base) if e.is_dir()]
        except OSError:  # missing or unusable: puts say why (StorageError), reads miss
            return
        for folder in folders:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if e.name.endswith(".tmp"):
                    if now - st.st_mtime > _STALE_TMP_S:  # a writer died mid-put
                        _unlink_quietly(e.path)
                    continue
                found.append((st.st_mtime, e.path, st.st_size))
        found.sort()
        self._lru = OrderedDict((p, s) for _, p, s in found)
        self._total = sum(s for _, _, s in found)

    def __repr__(self) -> str:
        return f"LocalDirStore({self.root!r}, {self.namespace!r})"


def _write_all(fd: int, bufs: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _free_bytes(path: str) -> int:
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return shutil.disk_usage(probe).free


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
