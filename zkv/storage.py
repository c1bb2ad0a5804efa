"""L3 storage: the ``Store`` interface and the embedded local-directory store.

A stored value is one host block (every layer's K and V of one block of one rank), so a
put or get is one contiguous buffer, zero-copy from the page-first host pool. Keys are
packed bytes, ``digest (16 bytes) ‖ rank (2 bytes, big-endian)`` (:func:`pack_key`); a
store names them ``{namespace}/{digest.hex()}/{rank}`` where the namespace is the layout
fingerprint, so incompatible caches never mix in a shared store.

Stores are called from the worker's I/O threads concurrently: implementations must be
thread-safe. Failures raise :class:`~zkv.errors.StorageError`; a missing key is not a
failure (``get_into`` returns False).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from zkv.errors import StorageError

DIGEST_SIZE = 16


def pack_key(digest: bytes, rank: int) -> bytes:
    """The store key of one block of one rank."""
    if len(digest) != DIGEST_SIZE:
        raise ValueError(f"digest must be {DIGEST_SIZE} bytes, got {len(digest)}")
    return digest + rank.to_bytes(2, "big")


def key_name(namespace: str, key: bytes) -> str:
    """``{namespace}/{digest.hex()}/{rank}``: the key as a store (or a human) names it."""
    if len(key) != DIGEST_SIZE + 2:
        raise ValueError(f"store key must be {DIGEST_SIZE + 2} bytes, got {len(key)}")
    return f"{namespace}/{key[:DIGEST_SIZE].hex()}/{int.from_bytes(key[DIGEST_SIZE:], 'big')}"


@runtime_checkable
class Store(Protocol):
    """An L3 key/value store of host blocks (see the module docstring for keys)."""

    namespace: str

    def put(self, key: bytes, data: memoryview) -> None:
        """Store ``data`` under ``key`` atomically (readers see all of it or nothing)."""

    def get_into(self, key: bytes, out: memoryview) -> bool:
        """Fill ``out`` with the value; False if missing or not exactly ``len(out)`` bytes."""

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """One batched existence query."""

    def remove(self, key: bytes) -> None:
        """Delete ``key``; a missing key is not an error."""


class LocalDirStore:
    """One file per key under ``root``, fanned out by the digest's first byte::

        {root}/{namespace}/{hex[:2]}/{hex}.{rank}

    ``put`` writes a temporary file in the same directory and ``os.replace``\\ s it in, so
    a reader never sees a partial value, also across processes. ``fsync=True`` makes a
    put durable across a machine crash (slower; the cache does not need it).
    """

    def __init__(self, root: str | os.PathLike[str], namespace: str, *,
                 fsync: bool = False) -> None:
        if not namespace or "/" in namespace or namespace.startswith("."):
            raise ValueError(f"bad namespace {namespace!r}")
        self.root = os.fspath(root)
        self.namespace = namespace
        self.fsync = fsync
        self._base = os.path.join(self.root, namespace)
        self._made: set[str] = set()
        self._lock = threading.Lock()

    def path(self, key: bytes) -> str:
        if len(key) != DIGEST_SIZE + 2:
            raise ValueError(f"store key must be {DIGEST_SIZE + 2} bytes, got {len(key)}")
        digest = key[:DIGEST_SIZE].hex()
        rank = int.from_bytes(key[DIGEST_SIZE:], "big")
        return os.path.join(self._base, digest[:2], f"{digest}.{rank}")

    def put(self, key: bytes, data: memoryview) -> None:
        path = self.path(key)
        folder = os.path.dirname(path)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            if folder not in self._made:
                os.makedirs(folder, exist_ok=True)
                with self._lock:
                    self._made.add(folder)
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            _unlink_quietly(tmp)
            raise StorageError(f"put {key_name(self.namespace, key)}: {e}") from e

    def get_into(self, key: bytes, out: memoryview) -> bool:
        path = self.path(key)
        want = out.nbytes
        try:
            with open(path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != want:
                    return False
                view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
                got = 0
                while got < want:
                    n = f.readinto(view[got:])
                    if not n:
                        return False  # truncated underneath us
                    got += n
                return True
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StorageError(f"get {key_name(self.namespace, key)}: {e}") from e

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            return [os.path.isfile(self.path(k)) for k in keys]
        except OSError as e:
            raise StorageError(f"exists: {e}") from e

    def remove(self, key: bytes) -> None:
        try:
            os.remove(self.path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"remove {key_name(self.namespace, key)}: {e}") from e

    def __repr__(self) -> str:
        return f"LocalDirStore({self.root!r}, {self.namespace!r})"


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
