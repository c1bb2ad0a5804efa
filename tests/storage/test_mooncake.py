"""Mooncake: its two ways of carrying the header store the same object (each reads the
other), and a call whose blocks failed asks the master for their sizes once."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.servers import MooncakeServer
from tests.storage.conftest import master_replica_queries
from zkv.errors import ConfigError
from zkv.storage import StoreStats, open_store, pack_key
from zkv.storage.mooncake_store import INLINE_MAX, TOO_SMALL, MooncakeStore

BLOCK = 4096


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


@pytest.mark.parametrize("header", ["inline", "split"])
def test_failed_blocks_cost_one_size_query_not_one_each(mooncake_server: MooncakeServer,
                                                        header: str) -> None:
    """Objects shorter and longer than the block (a get fails: -800 / -600, or the short
    size) are refused by their stored size, which costs the call one batched query to the
    master, however many blocks failed, and one batched read again before the refused ones
    are removed. (Before, one ``get_size`` RPC per failed block: a dead holder's blocks cost
    a round trip each.) The sizes are the ones ``get_size`` says."""
    store = open_store(f"{mooncake_server.url}?header={header}", f"sizes-{header}")
    try:
        assert isinstance(store, MooncakeStore)
        client = store._client
        rpcs = {}
        for n in (1, 8):
            keys = [pack_key(bytes([n, i]) * 8, 0) for i in range(3 * n)]
            names = [store.name(k) for k in keys]
            good = [np.full(BLOCK, i, np.uint8) for i in range(n)]
            assert store.put_many(keys[2 * n :], good) == [True] * n
            for i in range(n):  # n shorter objects, then n longer ones
                assert client.put(names[i], b"s" * (100 + i)) == 0
                assert client.put(names[n + i], b"l" * (64 + BLOCK + 1 + i)) == 0
            gone = store.name(pack_key(bytes([n, 255]) * 8, 0))
            by_get_size = {m: client.get_size(m) for m in [*names, gone]}
            assert store._stored_sizes([*names, gone], [TOO_SMALL] * (3 * n + 1)) == {
                m: size for m, size in by_get_size.items() if size >= 0}
            assert by_get_size[gone] < 0 and len(by_get_size) == 3 * n + 1

            store.stats = StoreStats()
            outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
            before = master_replica_queries(mooncake_server)
            assert store.get_many_into(keys, outs) == [False] * (2 * n) + [True] * n
            rpcs[n] = master_replica_queries(mooncake_server) - before
            assert all(o.tobytes() == g.tobytes() for o, g in zip(outs[2 * n :], good))
            s = store.stats
            assert (s.truncated, s.corrupt, s.hits, s.misses, s.errors) == (n, n, n, 2 * n, 0)
            assert store.exists(keys) == [False] * (2 * n) + [True] * n  # refused: removed
            for k in keys[2 * n :]:
                store.remove(k)
        # the get's own lookup, one for the sizes, one batched read of the refused objects
        # again before they are removed (a good copy saved meanwhile stays: test_refused_race)
        assert rpcs[1] == rpcs[8] == 3, rpcs
    finally:
        store.close()


def test_io_threads_that_come_again_register_no_more_memory(
        mooncake_server: MooncakeServer) -> None:
    """A worker's I/O pool is made anew each time the scheduler restarts: the new threads
    take the buffers the old ones left, and the host pool is registered once. (Each pool
    registered ~32 MiB more, kept for the process's life.)"""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    store = open_store(mooncake_server.url, "pools")
    assert isinstance(store, MooncakeStore)
    try:
        host = np.zeros((8, 4096), np.uint8)
        rng = np.random.default_rng(5)
        keys = [pack_key(bytes([9, i]) * 8, 0) for i in range(8)]
        src = rng.integers(0, 256, (8, 4096), dtype=np.uint8)
        assert store.put_many(keys, list(src)) == [True] * 8

        def round_of_io() -> int:
            """A pool of 4 threads, each reading 2 blocks (all 4 at once: a barrier)."""
            store.register_buffer(int(host.ctypes.data), host.nbytes)  # as each pool does
            together = threading.Barrier(4, timeout=10)

            def read(i: int) -> list[bool]:
                together.wait()
                return store.get_many_into(keys[i:i + 2], list(host[i:i + 2]))

            with ThreadPoolExecutor(4) as pool:  # (its threads joined at the end)
                outs = list(pool.map(read, range(0, 8, 2)))
            assert outs == [[True, True]] * 4 and host.tobytes() == src.tobytes()
            host[:] = 0
            return store.registered_bytes

        first = round_of_io()
        assert [round_of_io() for _ in range(3)] == [first] * 3
    finally:
        store.close()


def test_a_closed_store_used_by_a_living_thread_is_freed(mooncake_server: MooncakeServer) -> None:
    """The buffers a thread took go back when it ends, but their bookkeeping must not keep
    the store alive while the thread lives (here: this one, as an engine's thread)."""
    import gc
    import weakref

    store = open_store(mooncake_server.url + "?header=inline", "freed")
    keys = [pack_key(bytes([7, 1]) * 8, 0)]
    src = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].reshape(1, 4096)
    assert store.put_many(keys, list(src)) == [True]
    out = np.zeros_like(src)
    assert store.get_many_into(keys, list(out)) == [True]  # this thread's stage buffer
    ref = weakref.ref(store)
    store.close()
    del store
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())


def test_a_lease_that_runs_out_during_a_read_is_a_miss_not_an_outage(tmp_path: Any) -> None:
    """A master whose objects' lease (``--default_kv_lease_ttl``) is shorter than a read: its
    gets return -707 (LEASE_EXPIRED) per object. Those blocks miss; the store stays up and
    the next call is made. (Before: -707 counted as the store not answering, so each get
    raised StorageError and the link went down.)"""
    from structlog.testing import capture_logs

    with MooncakeServer(str(tmp_path), 64, master_args=("--default_kv_lease_ttl=1",)) as srv:
        store = open_store(srv.url, "lease", rank=0)
        try:
            keys = [pack_key(bytes([7, i]) * 8, 0) for i in range(32)]
            src = np.arange(BLOCK, dtype=np.uint8)
            assert all(store.put_many(keys, [src] * len(keys)))
            out = [np.empty(BLOCK, np.uint8) for _ in keys]
            with capture_logs() as logs:
                for _ in range(200):  # until a lease ran out during a read (most reads see
                    got = store.get_many_into(keys, out)  # one; a fast one may beat it)
                    assert all(o.tobytes() == src.tobytes() for o, g in zip(out, got) if g)
                    if any(e["event"] == "storage.read_failed" for e in logs):
                        break
            assert store.link.up  # type: ignore[attr-defined]
            assert not [e for e in logs if e["event"] == "storage.store_unreachable"]
            failed = [e for e in logs if e["event"] == "storage.read_failed"]
            assert failed and "get returned -707" in failed[0]["error"], logs
        finally:
            store.close()


def test_sizes_the_client_refuses_are_one_line_at_open(mooncake_server: MooncakeServer) -> None:
    """A segment larger than any machine's memory: the client's setup refuses it
    (INVALID_PARAMS), a ConfigError at open. (Before, an outage: the link retried for the
    engine's life and every call missed, the line blaming the master.)"""
    with pytest.raises(ConfigError, match=r"refused its parameters \(setup returned -600\): "
                                          r"segment_mb=100000000"):
        open_store(mooncake_server.url + "?segment_mb=100000000", "ns-bad-size")


def test_a_buffer_this_host_cannot_allocate_is_one_line_at_open(
        mooncake_server: MooncakeServer) -> None:
    """A ``buffer_mb`` no host can allocate (256 TiB, past x86-64's user address space,
    within the URL's bound; whatever the machine's overcommit policy): the client's setup
    raises ``MemoryError`` (``std::bad_alloc``). A ConfigError at open, as for the sizes it
    refuses with a code. (Before: taken for an outage, ``storage.store_unreachable``
    blaming the master, retried for the engine's life.)"""
    mb = 1 << 28
    with pytest.raises(ConfigError, match=r"refused its parameters \(setup raised "
                                          rf"MemoryError: .*\): .*buffer_mb={mb}"):
        open_store(f"{mooncake_server.url}?buffer_mb={mb}&timeout_s=1", "ns-bad-buf")


def test_sizes_the_client_refuses_once_the_master_is_back_are_said_once(
        tmp_path: Any) -> None:
    """The master was down at open, so the client's sizes could not be checked; when it
    answers and the client's setup refuses them, the store stays down and says why, once.
    (Before: the first outage's "unreachable" line, then silence for as long as it ran,
    every call's error blaming the master.)"""
    from structlog.testing import capture_logs

    from tests.waiting import wait_until

    with MooncakeServer(str(tmp_path)) as mc, capture_logs() as logs:
        mc.stop_master()
        store = open_store(mc.url + "?segment_mb=100000000&timeout_s=1", "ns-bad-later")
        link = store.link
        assert link is not None and not link.up

        def said() -> list[dict[str, Any]]:
            store.retry_now()  # (attempts at once, not at the end of each backoff)
            return [e for e in logs if e["event"] == "storage.store_misconfigured"]

        try:
            mc.start_master()
            wait_until(said, 30, "the refused sizes said")
            attempts = link.num_attempts
            wait_until(lambda: said() and link.num_attempts > attempts + 1, 30,
                       "two more reconnect attempts")
            assert not link.up
        finally:
            store.close()
    [line] = said()
    assert line["log_level"] == "error" and "refused its parameters (setup returned -600)" \
        in line["error"] and "segment_mb=100000000" in line["error"], line
