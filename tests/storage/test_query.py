"""The scheduler's existence query through a real store: one batched call per request
(all ranks' keys), the prefix present on every rank, and an error is a miss + an event."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.servers import free_port
from tests.storage.conftest import Backend
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import CacheConfig, CacheManager
from zkv.storage import Store, StorageQuery, open_store, pack_key


def counting(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the number of keys of every ``exists`` call on ``store``."""
    calls: list[int] = []
    real = store.exists

    def exists(keys: Sequence[bytes]) -> list[bool]:
        calls.append(len(keys))
        return real(keys)

    monkeypatch.setattr(store, "exists", exists)
    return calls


def test_one_batched_query_per_request(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    store = backend.open()
    hashes = hash_ids_chain([101, 102, 103, 104, 105])
    block = np.zeros(64, np.uint8)
    for h in hashes[:3]:
        for rank in range(3):
            store.put(pack_key(h, rank), block)
    store.put(pack_key(hashes[3], 0), block)  # ranks 1 and 2 lack block 3
    calls = counting(store, monkeypatch)
    cm = CacheManager(CacheConfig(8, 8, 4, storage_write=True),
                      storage_exists=StorageQuery(store, world_size=3))
    m = cm.match_prefix("r", hashes)
    assert (m.num_device, m.num_host, m.num_storage) == (0, 0, 3)
    assert calls == [5 * 3]  # one call (one pipeline / batch_is_exist): all ranks' keys
    cm.check_invariants()


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
