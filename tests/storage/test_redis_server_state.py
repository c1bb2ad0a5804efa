"""What a redis server holds or allows beyond zkv's control: keys under a block's name that
hold no block (another type, another length) are not present; a server set to refuse
writes once full is said at open and in each declined put's line; where scripts are not
allowed a refused block is still deleted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.servers import RedisServer
from tests.storage.test_backends import BLOCK, blocks, digest
from tests.waiting import wait_until
from zkv.errors import ConfigError, StorageError
from zkv.storage import HEADER_SIZE, open_store, pack_key
from zkv.storage.redis_store import RedisStore


def _chain(store: Any, salt: str, n: int, ranks: int = 1) -> list[bytes]:
    hashes = [digest(salt, i) for i in range(n)]
    src = blocks(1, 13)[0]
    for h in hashes:
        for r in range(ranks):
            store.put(pack_key(h, r), src)
    return hashes


def test_a_key_that_holds_no_block_is_not_present(redis_server: RedisServer) -> None:
    """A hash under a block's key, or a string of another length, never loads: the query
    stops there. (Before, they counted as present: every request that reached them ran
    a load that failed, again each ``negative_cache_s``.)"""
    store = open_store(redis_server.url, "ns-wrongtype")
    client = redis_server.client()
    try:
        hashes = _chain(store, "wt", 6, ranks=2)
        name = {(i, r): store.name(pack_key(hashes[i], r)) for i in range(6) for r in (0, 1)}
        good = client.get(name[0, 0])
        assert store.count_leading(hashes, 2) == 6
        client.delete(name[2, 1])
        client.hset(name[2, 1], "x", "y")  # another client's hash under block 2, rank 1
        assert store.count_leading(hashes, 2) == 2
        assert store.count_leading(hashes, 1) == 6  # rank 0 has every block
        assert store.exists([pack_key(hashes[2], r) for r in (0, 1)]) == [True, False]
        client.delete(name[2, 1])
        client.set(name[2, 1], good)  # (the key's header says another key: the get refuses it)
        client.set(name[4, 0], client.get(name[4, 0])[: HEADER_SIZE + BLOCK // 2])  # short
        assert store.count_leading(hashes, 2) == 4
        client.set(name[4, 0], client.get(name[3, 0]) + b"\0")  # one byte too long
        assert store.count_leading(hashes, 2) == 4
        assert store.exists([pack_key(hashes[4], 0)]) == [False]
        client.set(name[0, 0], good[:HEADER_SIZE - 1])  # the first key: less than a header
        assert store.count_leading(hashes, 2) == 0
        client.set(name[0, 0], good[: HEADER_SIZE + 100])  # its header says more
        assert store.count_leading(hashes, 2) == 0
        client.set(name[0, 0], b"x" * len(good))  # the right length, no block's header
        assert store.count_leading(hashes, 2) == 0
        assert store.stats.errors == 0
    finally:
        client.close()
        store.close()


@pytest.mark.parametrize("reply", [[7], [b"x", b"y"], "OK"])
def test_a_get_answered_with_what_mget_never_sends_is_one_counted_error(
        redis_server: RedisServer, reply: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy or module in front of redis that answers MGET with another shape (an
    integer, more values than keys, a status) fails the get with one StorageError,
    counted, and the store stays usable. The real server cannot answer so: the client's
    reply is replaced. (Before: a TypeError or a ValueError out of ``zip``, uncounted.)"""
    store = open_store(redis_server.url, "ns-mget-shape")
    try:
        (h,) = _chain(store, "mget", 1)
        out = np.zeros(BLOCK, np.uint8)
        client = store._client  # type: ignore[attr-defined]
        monkeypatch.setattr(client, "mget", lambda names: reply)
        with pytest.raises(StorageError, match="MGET of 1 keys answered a "):
            store.get_into(pack_key(h, 0), out)
        assert store.stats.errors == 1
        monkeypatch.undo()
        assert store.get_into(pack_key(h, 0), out)
        assert out.tobytes() == blocks(1, 13)[0].tobytes()
    finally:
        store.close()


def test_without_scripts_the_query_and_the_delete_still_work(tmp_path: Path) -> None:
    """An ACL without ``@scripting``: the query's pipelines skip what holds no block as the
    script does, and a refused block is deleted with a plain DEL (said once)."""
    with RedisServer(str(tmp_path), user=("zkv", "pw")) as srv:
        admin = srv.client()
        admin.execute_command("ACL", "SETUSER", "zkv", "-@scripting")
        store = open_store(srv.url, "ns")
        try:
            hashes = _chain(store, "noscript", 12)
            names = [store.name(pack_key(h, 0)) for h in hashes]
            admin.delete(names[9])
            admin.rpush(names[9], b"not a block")
            admin.set(names[5], admin.get(names[5])[:-1])  # one byte short
            with capture_logs() as logs:
                assert store.count_leading(hashes, 1) == 5
                assert store.count_leading(hashes[6:], 1) == 3
                raw = admin.get(names[1])
                admin.set(names[1], raw[:-1] + bytes([raw[-1] ^ 1]))
                out = np.zeros(BLOCK, np.uint8)
                assert store.get_many_into([pack_key(hashes[1], 0)] * 2, [out, out]) \
                    == [False, False]
            assert admin.exists(names[1]) == 0  # deleted (DEL)
            fallbacks = [e["fallback"] for e in logs if "fallback" in e]
            assert fallbacks == ["chunked STRLEN pipelines",
                                 "DEL: a good copy saved since the read goes too"]
            assert store.stats.errors == 2  # each script's refusal, once
        finally:
            admin.close()
            store.close()


def _events(logs: list[Any], name: str) -> list[Any]:
    return [e for e in logs if e["event"] == name]


def test_a_redis_that_refuses_writes_when_full_is_said_at_open(tmp_path: Path) -> None:
    """``noeviction``, or ``volatile-*`` while the store sets no TTL: once full, every put
    is refused (OOM); no ``maxmemory`` and no TTL: redis grows until the host's memory runs
    out. One warning at open says so and what to configure; each write-failed
    line names the policy. (Before: a bare write-failed line, and the puts sent again
    forever.)"""
    with RedisServer(str(tmp_path), maxmemory="2mb", policy="noeviction") as srv:
        admin = srv.client()
        try:
            with capture_logs() as logs:
                store = open_store(srv.url, "ns")
            try:
                [warning] = _events(logs, "storage.store_misconfigured")
                assert warning["log_level"] == "warning" and warning["policy"] == "noeviction"
                assert "refuse writes once full" in warning["error"]
                assert "allkeys-lru" in warning["error"] and "volatile-ttl" in warning["error"]
                with capture_logs() as logs:
                    ok: list[bool] = []
                    for i in range(0, 160, 8):
                        ok += store.put_many([pack_key(digest("full", j), 0)
                                              for j in range(i, i + 8)], list(blocks(8, i)))
                assert ok.count(True) > 0 and ok.count(False) > 40
                lines = _events(logs, "storage.write_failed")
                assert lines and all(
                    "maxmemory" in e["error"]  # the server's own words stay
                    and "redis is full: maxmemory-policy noeviction" in e["error"]
                    and "allkeys-lru" in e["error"] for e in lines), lines
            finally:
                store.close()
            for policy, url, said in [
                    ("volatile-lru", srv.url, True),  # no TTL: nothing it may evict
                    ("volatile-lru", srv.url + "?ttl_s=600", False),
                    ("volatile-ttl", srv.url + "?ttl_s=600", False),
                    ("allkeys-lru", srv.url, False)]:
                admin.config_set("maxmemory-policy", policy)
                with capture_logs() as logs:
                    open_store(url, "ns").close()
                assert len(_events(logs, "storage.store_misconfigured")) == int(said), policy
            # no limit: redis keeps every block until the host's memory runs out (20 KiB a
            # 16 KiB block), said at open; with the store's ttl_s the blocks expire
            admin.config_set("maxmemory", 0)
            admin.config_set("maxmemory-policy", "noeviction")
            with capture_logs() as logs:
                open_store(srv.url, "ns").close()
            [warning] = _events(logs, "storage.store_misconfigured")
            assert warning["log_level"] == "warning" and warning["maxmemory"] == 0
            assert warning["error"].startswith("redis has no maxmemory and the store sets no "
                                               "ttl_s: it keeps every block until the host's "
                                               "memory runs out; set maxmemory")
            with capture_logs() as logs:
                open_store(srv.url + "?ttl_s=600", "ns").close()
            assert not _events(logs, "storage.store_misconfigured")
        finally:
            admin.close()


def test_a_user_that_may_not_ping_is_reconnected_after_an_outage(tmp_path: Path) -> None:
    """A least-privilege ACL user (no ``@connection``: no PING) runs everything the store
    does; after an outage the link's reconnect attempt, a PING, is answered NOPERM, which
    proves the server is up. Before, it failed every attempt: the store stayed down for
    the life of the engine, every put refused at once."""
    with RedisServer(str(tmp_path), user=("zkv", "pw")) as srv:
        admin = srv.client()
        admin.execute_command("ACL", "SETUSER", "zkv", "-@connection")
        store = open_store(srv.url + "?timeout_s=0.2", "ns")
        try:
            keys = [pack_key(digest("noping", i), 0) for i in range(4)]
            assert store.put_many(keys, list(blocks(4, 3))) == [True] * 4
            srv.pause()
            try:
                with pytest.raises(StorageError):
                    store.put_many(keys, list(blocks(4, 5)))
            finally:
                srv.resume()

            def put() -> bool:
                try:
                    return store.put_many(keys[:1], list(blocks(1, 7))) == [True]
                except StorageError:
                    return False

            wait_until(put, timeout=15.0, what="a put after the outage")
            assert store.count_leading([digest("noping", i) for i in range(4)], 1) == 4
        finally:
            store.close()
            admin.close()


def test_config_refused_says_nothing(tmp_path: Path) -> None:
    """A user that may not run CONFIG (an ACL, a managed redis): no warning at open, and a
    declined put's line says the policy is unknown."""
    with RedisServer(str(tmp_path), maxmemory="2mb", policy="noeviction",
                     user=("zkv", "pw")) as srv:
        admin = srv.client()
        admin.execute_command("ACL", "SETUSER", "zkv", "-config")
        try:
            with capture_logs() as logs:
                store = open_store(srv.url, "ns")
                try:
                    ok: list[bool] = []
                    for i in range(0, 160, 8):
                        ok += store.put_many([pack_key(digest("acl", j), 0)
                                              for j in range(i, i + 8)], list(blocks(8, i)))
                finally:
                    store.close()
            assert ok.count(False) > 40
            assert not _events(logs, "storage.store_misconfigured")
            lines = _events(logs, "storage.write_failed")
            assert lines and all("maxmemory-policy unknown" in e["error"]
                                 for e in lines if not e.get("summary")), lines
            assert isinstance(store, RedisStore) and store.policy is None
        finally:
            admin.close()


def test_an_lru_redis_that_samples_few_keys_is_told_to_sample_more(
        redis_server: RedisServer) -> None:
    """Under ``allkeys-lru`` redis evicts the best of ``maxmemory-samples`` keys (default 5),
    and a prompt's blocks, touched together, tie: a sample that takes a chain's first block
    strands the rest. At 32 fewer chains break (bench/store_eviction.py); one info line at
    open says so. At 32, or without ``maxmemory``, or under another policy: nothing."""
    admin = redis_server.client()
    was = admin.config_get("maxmemory*")
    try:
        for samples, maxmemory, policy, said in [(5, "64mb", "allkeys-lru", True),
                                                 (10, "64mb", "volatile-lru", True),
                                                 (32, "64mb", "allkeys-lru", False),
                                                 (5, "0", "allkeys-lru", False),
                                                 (5, "64mb", "allkeys-lfu", False)]:
            admin.config_set("maxmemory-samples", samples)
            admin.config_set("maxmemory", maxmemory)
            admin.config_set("maxmemory-policy", policy)
            with capture_logs() as logs:
                open_store(redis_server.url + "?ttl_s=600", "ns-tuning").close()
            hints = _events(logs, "storage.store_tuning")
            assert len(hints) == int(said), (samples, maxmemory, policy, hints)
            if said:
                assert hints[0]["maxmemory_samples"] == samples
                assert hints[0]["policy"] == policy and hints[0]["log_level"] == "info"
                assert "set maxmemory-samples 32" in hints[0]["hint"]
    finally:
        for name in ("maxmemory-samples", "maxmemory", "maxmemory-policy"):
            admin.config_set(name, was[name])
        admin.close()


def test_a_database_the_server_lacks_is_a_bad_url(redis_server: RedisServer) -> None:
    """``redis://HOST:PORT/99`` on a server of 16 databases: one ConfigError at open, not an
    outage that fails every call for the life of the engine."""
    url = redis_server.url.rsplit("/", 1)[0]
    with pytest.raises(ConfigError) as err:
        open_store(f"{url}/99", "ns-db")
    assert str(err.value) == (f"{url}/99: the server has no database 99 (CONFIG GET "
                              "databases: it numbers them from 0)")
    open_store(f"{url}/15", "ns-db").close()  # the last one there


def test_a_database_missing_when_the_server_comes_back_is_said_once(tmp_path: Path) -> None:
    """The server was down at open, so the URL's database could not be checked; when it
    answers without it, the store stays down and says why, once. (Before: only the first
    outage's "unreachable" line, then silence for as long as it ran.)"""
    from structlog.testing import capture_logs

    from tests.servers import free_port
    from tests.waiting import wait_until

    port = free_port()
    with capture_logs() as logs:
        store = open_store(f"redis://127.0.0.1:{port}/99?timeout_s=0.5", "ns-db")
        try:
            with RedisServer(str(tmp_path), port=port):
                said = lambda: _events(logs, "storage.store_misconfigured")  # noqa: E731
                wait_until(lambda: said(), 20, "the missing database said")
                attempts = store.link.num_attempts  # type: ignore[attr-defined]
                wait_until(lambda: store.link.num_attempts > attempts + 1,  # type: ignore
                           20, "two more reconnect attempts")
                assert not store.link.up  # type: ignore[attr-defined]
        finally:
            store.close()
    [line] = said()
    assert line["log_level"] == "error" and line["error"] == (
        f"redis://127.0.0.1:{port}/99: the server has no database 99 (CONFIG GET databases: "
        "it numbers them from 0)")
