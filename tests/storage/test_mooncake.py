"""Mooncake's two ways of carrying the header store the same object: each reads the other."""

from __future__ import annotations

import numpy as np

from tests.servers import MooncakeServer
from zkv.storage import open_store, pack_key
from zkv.storage.mooncake_store import INLINE_MAX, MooncakeStore


def test_inline_and_split_headers_read_each_other(mooncake_server: MooncakeServer) -> None:
    inline = open_store(mooncake_server.url + "?header=inline", "interop")
    split = open_store(mooncake_server.url + "?header=split", "interop")
    try:
        rng = np.random.default_rng(3)
        for size in (4096, INLINE_MAX * 2):
            src = rng.integers(0, 256, (2, size), dtype=np.uint8)
            keys = [pack_key(bytes([size % 251, i]) * 8, 0) for i in range(2)]
            assert inline.put_many(keys[:1], [src[0]]) == [True]
            assert split.put_many(keys[1:], [src[1]]) == [True]
            for reader in (inline, split):
                dst = np.zeros_like(src)
                assert reader.get_many_into(keys, list(dst)) == [True, True]
                assert dst.tobytes() == src.tobytes()
            for k in keys:
                inline.remove(k)
        assert inline.stats.corrupt == split.stats.corrupt == 0
    finally:
        inline.close()
        split.close()


def test_auto_mode_splits_big_blocks_and_chunks_the_stage(mooncake_server: MooncakeServer) -> None:
    store = open_store(mooncake_server.url, "chunks")
    try:
        assert isinstance(store, MooncakeStore)
        assert store._inline(INLINE_MAX - 64) and not store._inline(INLINE_MAX)
        views = [memoryview(bytearray(200 << 10)) for _ in range(50)]  # 10 MiB: two stages
        runs = store._chunks(views + [memoryview(bytearray(1 << 20))])
        assert [(lo, hi, inline) for lo, hi, inline in runs] == [(0, 40, True), (40, 50, True),
                                                                  (50, 51, False)]
        keys = [pack_key(i.to_bytes(16, "big"), 1) for i in range(51)]
        data = [memoryview(np.full(v.nbytes, i % 256, np.uint8)) for i, v in
                enumerate(views + [memoryview(bytearray(1 << 20))])]
        assert store.put_many(keys, data) == [True] * 51
        outs = [np.zeros(d.nbytes, np.uint8) for d in data]
        assert store.get_many_into(keys, outs) == [True] * 51
        assert all(o.tobytes() == d.tobytes() for o, d in zip(outs, data))
        for k in keys:
            store.remove(k)
    finally:
        store.close()
