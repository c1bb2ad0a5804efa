"""LocalDirStore: atomic puts, sized gets, batched existence, key layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zkv.errors import StorageError
from zkv.storage import LocalDirStore, Store, key_name, pack_key

D = bytes(range(16))


def test_is_a_store(tmp_path: Path) -> None:
    assert isinstance(LocalDirStore(tmp_path, "ns"), Store)


def test_key_packing_and_naming() -> None:
    key = pack_key(D, 3)
    assert key == D + b"\x00\x03"
    assert key_name("ns", key) == f"ns/{D.hex()}/3"
    with pytest.raises(ValueError):
        pack_key(b"short", 0)


def test_put_get_round_trip(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "fp123")
    data = bytes(range(256)) * 4
    s.put(pack_key(D, 1), memoryview(data))
    path = Path(s.path(pack_key(D, 1)))
    assert path == tmp_path / "fp123" / D.hex()[:2] / f"{D.hex()}.1"
    out = bytearray(len(data))
    assert s.get_into(pack_key(D, 1), memoryview(out))
    assert bytes(out) == data
    assert not s.get_into(pack_key(D, 0), memoryview(out))  # other rank: missing
    assert not s.get_into(pack_key(D, 1), memoryview(bytearray(len(data) - 1)))  # wrong size
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_put_overwrites_atomically(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "ns")
    key = pack_key(D, 0)
    s.put(key, memoryview(b"a" * 64))
    s.put(key, memoryview(b"b" * 64))
    out = bytearray(64)
    assert s.get_into(key, memoryview(out)) and bytes(out) == b"b" * 64


def test_exists_is_batched_and_remove(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "ns")
    keys = [pack_key(bytes([i]) * 16, 0) for i in range(5)]
    for k in keys[::2]:
        s.put(k, memoryview(b"x" * 8))
    assert s.exists(keys) == [True, False, True, False, True]
    s.remove(keys[0])
    s.remove(keys[1])  # missing: fine
    assert s.exists(keys) == [False, False, True, False, True]


def test_namespaces_do_not_mix(tmp_path: Path) -> None:
    a, b = LocalDirStore(tmp_path, "a"), LocalDirStore(tmp_path, "b")
    a.put(pack_key(D, 0), memoryview(b"1234"))
    assert b.exists([pack_key(D, 0)]) == [False]


def test_get_into_typed_memoryview(tmp_path: Path) -> None:
    import numpy as np

    s = LocalDirStore(tmp_path, "ns", fsync=True)
    src = np.arange(32, dtype=np.float16)
    s.put(pack_key(D, 0), memoryview(src).cast("B"))
    dst = np.zeros(32, dtype=np.float16)
    assert s.get_into(pack_key(D, 0), memoryview(dst))
    assert np.array_equal(src, dst)


def test_errors_raise_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    s = LocalDirStore(blocker, "ns")  # root is a file: nothing can be created under it
    with pytest.raises(StorageError, match=f"put ns/{D.hex()}/0"):
        s.put(pack_key(D, 0), memoryview(b"x"))
    with pytest.raises(ValueError):
        LocalDirStore(tmp_path, "a/b")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_unreadable_file_raises(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, "ns")
    s.put(pack_key(D, 0), memoryview(b"x" * 4))
    os.chmod(s.path(pack_key(D, 0)), 0)
    with pytest.raises(StorageError):
        s.get_into(pack_key(D, 0), memoryview(bytearray(4)))
