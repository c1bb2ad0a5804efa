"""The scheduler's existence query through a real store: the prefix present on every rank,
work that stops at the first block a rank lacks, few round trips for a full hit, and an
error is a miss + an event."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.servers import free_port
from tests.storage.conftest import Backend
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import CacheConfig, CacheManager
from zkv.storage import StorageQuery, Store, open_store, pack_key
from zkv.storage.base import FIRST_BLOCKS


def counting(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the number of keys of every ``exists`` call on ``store``."""
    calls: list[int] = []
    real = store.exists

    def exists(keys: Sequence[bytes]) -> list[bool]:
        calls.append(len(keys))
        return real(keys)

    monkeypatch.setattr(store, "exists", exists)
    return calls


def _server_exists_calls(backend: Backend) -> int | None:
    """Keys the redis server looked at (its scripts' STRLEN, one a key); None for the
    others."""
    if not backend.kind.startswith("redis"):
        return None
    stats = backend.server.client().info("commandstats")
    return int(stats.get("cmdstat_strlen", {}).get("calls", 0))


def test_the_query_stops_at_the_first_block_a_rank_lacks(backend: Backend,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's query runs inside the engine's scheduling step: its work ends at the
    first block one rank lacks, not after every block and rank. (It was one ``exists``
    over all keys: 17-34 ms for a 256-block prompt at 8 ranks here, a miss included.)"""
    store = backend.open()
    hashes = hash_ids_chain(list(range(101, 141)))  # 40 blocks, 3 ranks
    block = np.zeros(64, np.uint8)
    for h in hashes[:3]:
        for rank in range(3):
            store.put(pack_key(h, rank), block)
    store.put(pack_key(hashes[3], 0), block)  # ranks 1 and 2 lack block 3
    calls = counting(store, monkeypatch)
    before = _server_exists_calls(backend)
    cm = CacheManager(CacheConfig(64, 64, 4, storage_write=True),
                      storage_exists=StorageQuery(store, world_size=3))
    m = cm.match_prefix("r", hashes)
    assert (m.num_device, m.num_host, m.num_storage) == (0, 0, 3)
    if backend.kind == "file":
        assert calls == []  # a stat per key, up to the first missing one
    elif backend.kind.startswith("redis"):
        assert calls == []  # one script: the server stops at block 3, rank 1
        assert _server_exists_calls(backend) - before == 3 * 3 + 2  # type: ignore[operator]
    else:
        assert calls == [FIRST_BLOCKS * 3]  # the first chunk only
    cm.check_invariants()


def test_a_full_hit_takes_few_round_trips(backend: Backend,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    store = backend.open()
    hashes = hash_ids_chain(list(range(201, 241)))  # 40 blocks, 2 ranks, all there
    block = np.zeros(64, np.uint8)
    for h in hashes:
        for rank in range(2):
            store.put(pack_key(h, rank), block)
    calls = counting(store, monkeypatch)
    before = _server_exists_calls(backend)
    assert StorageQuery(store, 2)(hashes) == 40
    assert StorageQuery(store, 2)(hashes[:39] + [b"\0" * 16]) == 39  # the last one missing
    if backend.kind == "file":
        assert calls == []
    elif backend.kind.startswith("redis"):
        assert calls == []
        # every key of the hit; then up to block 39, whose first key already misses
        assert _server_exists_calls(backend) - before == 40 * 2 + 39 * 2 + 1  # type: ignore[operator]
    else:  # the first 8 blocks, then the 32 others, twice
        assert calls == [8 * 2, 32 * 2] * 2


def test_a_store_error_is_a_miss_and_an_event_never_an_exception() -> None:
    store = open_store(f"redis://127.0.0.1:{free_port()}/0?timeout_s=0.2", "ns")
    try:
        cm = CacheManager(CacheConfig(8, 8, 4, storage_write=True),
                          storage_exists=StorageQuery(store, 2))
        with capture_logs() as logs:
            m = cm.match_prefix("r", hash_ids_chain([1, 2, 3]))
        assert m.num_storage == 0 and store.stats.query_failures == 1
        (event,) = [e for e in logs if e["event"] == "storage.query_failed"]
        assert event["num_blocks"] == 3 and "unreachable" in event["error"]
        cm.check_invariants()
    finally:
        store.close()


def test_an_exists_answer_of_the_wrong_length_is_a_miss(request: pytest.FixtureRequest,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake's query (one ``batch_is_exist`` a chunk): a reply with fewer results than
    keys read as every block there (``all([])``), loads planned of blocks nobody had."""
    server = request.getfixturevalue("mooncake_server")
    b = Backend("mooncake", server.url, server, request.getfixturevalue("mooncake_stores"))
    store = b.open()
    monkeypatch.setattr(store, "exists", lambda keys: [True] * (len(keys) // 2))
    try:
        cm = CacheManager(CacheConfig(8, 8, 4, storage_write=True),
                          storage_exists=StorageQuery(store, 2))
        with capture_logs() as logs:
            m = cm.match_prefix("r", hash_ids_chain([1, 2, 3]))
        assert m.num_storage == 0 and store.stats.query_failures == 1
        (event,) = [e for e in logs if e["event"] == "storage.query_failed"]
        assert "6 keys answered with 3 results" in event["error"]
        cm.check_invariants()
    finally:
        b.close()


def test_an_outage_is_a_few_lines_not_one_per_query() -> None:
    """vLLM asks again every step for a request waiting on L3: during an outage every query
    fails. They are all counted; a few lines a window are logged, and the rest is said in
    one line once the manager's work ends. (Before, one error line per query: 34 in half a
    second of a real engine's phase with redis-server killed.)"""
    store = open_store(f"redis://127.0.0.1:{free_port()}/0?timeout_s=0.2", "ns")
    try:
        cm = CacheManager(CacheConfig(8, 8, 4, storage_write=True),
                          storage_exists=StorageQuery(store, 2))
        with capture_logs() as logs:
            for i in range(50):
                cm.match_prefix(f"r{i}", hash_ids_chain([1, 2, 3, i]))
                cm.finish(f"r{i}")
            cm.flush_logs()
        assert store.stats.query_failures == 50
        lines = [e for e in logs if e["event"] == "storage.query_failed"]
        assert 1 < len(lines) <= 5, len(lines)
        assert lines[-1]["num_suppressed"] + len(lines) - 1 == 50
        cm.check_invariants()
    finally:
        store.close()


def test_redis_without_scripts_falls_back_to_chunks_once(tmp_path: Path) -> None:
    """An ACL that denies scripts (``-@scripting``): the query goes on with chunked STRLEN
    pipelines, said in one warning, and gives the same answers."""
    from tests.servers import RedisServer

    with RedisServer(str(tmp_path), user=("zkv", "pw")) as srv:
        srv.client().execute_command("ACL", "SETUSER", "zkv", "-@scripting")
        store = open_store(srv.url, "ns")
        try:
            hashes = hash_ids_chain(list(range(1, 21)))
            for h in hashes[:12]:
                store.put(pack_key(h, 0), np.zeros(64, np.uint8))
            with capture_logs() as logs:
                assert [StorageQuery(store, 1)(hashes) for _ in range(3)] == [12, 12, 12]
            [warning] = [e for e in logs if e["event"] == "storage.query_failed"]
            assert warning["fallback"] == "chunked STRLEN pipelines"
            assert "no permissions" in warning["error"] and store.stats.query_failures == 0
        finally:
            store.close()


def test_a_busy_redis_does_not_turn_the_script_off(tmp_path: Path) -> None:
    """``BUSY`` (another client's script ran past ``busy-reply-threshold``) passes: the
    query in its time is a miss and an event, and once the server is free the queries run
    the script again. (Before, any error that was not the link's turned the script off for
    the process's life: chunked pipelines, ~34x slower at 8 ranks, from one busy moment.)"""
    import threading

    import redis

    from tests.servers import RedisServer
    from tests.waiting import wait_until

    with RedisServer(str(tmp_path)) as srv:
        admin = srv.client()
        admin.config_set("busy-reply-threshold", 50)  # ms
        store = open_store(srv.url + "?timeout_s=2", "ns")
        try:
            hashes = hash_ids_chain(list(range(1, 21)))
            for h in hashes[:12]:
                store.put(pack_key(h, 0), np.zeros(64, np.uint8))
            def evalsha_calls() -> int:
                return int(admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

            assert StorageQuery(store, 1)(hashes) == 12  # (loads the script)
            c0 = evalsha_calls()
            assert StorageQuery(store, 1)(hashes) == 12
            per_query = evalsha_calls() - c0  # the script's chunks
            assert per_query > 0

            def spin() -> None:
                with contextlib.suppress(redis.exceptions.ResponseError):  # killed
                    srv.client().eval("while true do end", 0)

            spinner = threading.Thread(target=spin)
            spinner.start()
            try:
                def busy() -> bool:
                    try:
                        admin.ping()
                    except redis.exceptions.BusyLoadingError:
                        return True
                    except redis.exceptions.ResponseError as e:
                        return "BUSY" in str(e)
                    return False

                wait_until(busy, 10.0, "the server answers BUSY")
                with capture_logs() as logs:
                    assert StorageQuery(store, 1)(hashes) == 0  # a miss, said once
                (event,) = [e for e in logs if e["event"] == "storage.query_failed"]
                assert "BUSY" in event["error"] and "fallback" not in event, event
            finally:
                admin.script_kill()
                spinner.join(10.0)
            assert not spinner.is_alive()
            before = evalsha_calls()
            with capture_logs() as logs:
                assert StorageQuery(store, 1)(hashes) == 12
            assert not [e for e in logs if e["event"] == "storage.query_failed"]
            assert evalsha_calls() - before == per_query, "the query ran the script again"
        finally:
            store.close()
