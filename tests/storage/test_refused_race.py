"""A refused block is deleted as it was read, not whatever its key holds by the delete: a
good copy another engine saved between the read and the delete stays (every backend). The
race is made deterministic: the other engine's save runs inside the store's delete step,
just before the store looks at what to delete."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.storage.conftest import Backend
from tests.storage.test_backends import BLOCK, blocks, keys
from zkv.storage import HEADER_SIZE, Store
from zkv.storage.local import LocalDirStore


def _saver(backend: Backend, store: Store, key: bytes, src: np.ndarray, good: bytes
           ) -> Callable[[], None]:
    """How another engine saves a good copy of ``key`` over the refused one."""
    if backend.kind == "file":  # another writer: its put renames a new file into place
        other = LocalDirStore(os.path.dirname(store._base), store.namespace)  # type: ignore[attr-defined]
        backend.stores.append(other)
        return lambda: other.put(key, src)
    # redis: SET; Mooncake: remove and put (a put keeps an object that is there)
    return lambda: backend.raw_set(store, key, good)


@pytest.mark.parametrize("damage", ["payload", "truncated"])
def test_a_good_copy_saved_after_the_read_survives_the_refusal(
        backend: Backend, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Before, the key was deleted by name: the good copy went with the refused block,
    and every engine missed it until one saved it again.)"""
    store = backend.open()
    (k,) = keys(1, f"race-{damage}")  # (Mooncake's tests share a namespace: salted keys)
    src = blocks(1, 11)[0]
    store.put(k, src)
    good = backend.raw_get(store, k)
    assert good is not None
    bad = (good[:-1] + bytes([good[-1] ^ 0x01]) if damage == "payload"
           else good[: HEADER_SIZE + BLOCK // 2])
    backend.raw_set(store, k, bad)
    save = _saver(backend, store, k, src, good)
    real = store._delete_refused
    saved: list[bool] = []

    def racing(*args: Any) -> None:
        save()  # between this reader's read (refused) and its delete
        saved.append(True)
        real(*args)

    monkeypatch.setattr(store, "_delete_refused", racing)
    out = np.zeros(BLOCK, np.uint8)
    assert store.get_many_into([k], [out]) == [False]  # what was read is refused
    assert saved == [True]
    assert backend.raw_get(store, k) == good  # the good copy stays
    monkeypatch.undo()
    assert store.get_into(k, out) and out.tobytes() == src.tobytes()
    s = store.stats
    assert (s.corrupt + s.truncated, s.hits, s.errors) == (1, 1, 0)
    if backend.kind == "file":  # nothing left aside
        folder = os.path.dirname(store.path(k))  # type: ignore[attr-defined]
        assert sorted(os.listdir(folder)) == [os.path.basename(store.path(k))]  # type: ignore[attr-defined]


def test_a_refused_block_nobody_replaced_is_deleted(backend: Backend) -> None:
    """The compare before the delete does not keep the refused block itself."""
    store = backend.open()
    (k,) = keys(1, "refused-alone")
    store.put(k, blocks(1, 12)[0])
    good = backend.raw_get(store, k)
    assert good is not None
    backend.raw_set(store, k, good[:-1] + bytes([good[-1] ^ 0x01]))
    out = np.zeros(BLOCK, np.uint8)
    assert store.get_many_into([k], [out]) == [False]
    assert backend.raw_get(store, k) is None and store.exists([k]) == [False]
    if backend.kind == "file":
        assert os.listdir(os.path.dirname(store.path(k))) == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("damage", ["payload", "truncated"])
def test_a_good_file_under_the_refused_files_inode_survives_the_refusal(
        tmp_path: Any, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system reuses a removed file's inode number: a good copy written since under
    the refused file's (device, inode) is not the file read. The reuse is made
    deterministic by writing the good copy into the refused file itself (one inode).
    (Before, the inode alone named the file: the good copy was removed.)"""
    store = LocalDirStore(str(tmp_path), "ns")
    (k,) = keys(1, f"reuse-{damage}")
    src = blocks(1, 13)[0]
    store.put(k, src)
    path = store.path(k)
    with open(path, "rb") as f:
        good = f.read()
    bad = (good[:-1] + bytes([good[-1] ^ 0x01]) if damage == "payload"
           else good[: HEADER_SIZE + BLOCK // 2])
    with open(path, "wb") as f:
        f.write(bad)
    ino = os.stat(path).st_ino
    real = store._delete_refused

    def racing(*args: Any) -> None:
        with open(path, "r+b") as f:  # the good copy, same inode
            f.write(good)
        assert os.stat(path).st_ino == ino
        real(*args)

    monkeypatch.setattr(store, "_delete_refused", racing)
    out = np.zeros(BLOCK, np.uint8)
    assert store.get_many_into([k], [out]) == [False]  # what was read is refused
    monkeypatch.undo()
    with open(path, "rb") as f:
        assert f.read() == good  # the good copy stays
    assert store.get_into(k, out) and out.tobytes() == src.tobytes()
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]
    store.close()
