"""Every backend against its real server: batched round trips bit for bit, and every kind
of bad block refused, deleted and counted, never served."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import xxhash
from structlog.testing import capture_logs

from tests.storage.conftest import Backend
from zkv.storage import HEADER_SIZE, leading_present, pack_key

BLOCK = 32 * 1024  # the replay's block: 4 layers x K,V x 2 heads x 16 tokens x 64 dims x fp16


def digest(*parts: object) -> bytes:
    return xxhash.xxh3_128_digest(repr(parts).encode())


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def keys(n: int, salt: object, rank: int = 0) -> list[bytes]:
    return [pack_key(digest(salt, i), rank) for i in range(n)]


def test_batched_round_trip_is_bit_identical(backend: Backend) -> None:
    store = backend.open()
    src = blocks(6, 1)
    ks = keys(6, "rt")
    assert store.put_many(ks, list(src)) == [True] * 6
    missing = pack_key(digest("rt", 99), 0)
    assert store.exists(ks + [missing]) == [True] * 6 + [False]
    dst = np.zeros((7, BLOCK), dtype=np.uint8)
    found = store.get_many_into(ks[::-1] + [missing], list(dst))
    assert found == [True] * 6 + [False]
    assert dst[:6].tobytes() == src[::-1].tobytes()
    assert not dst[6].any()  # a miss leaves its buffer alone
    s = store.stats
    assert (s.hits, s.misses, s.puts, s.bytes_read, s.bytes_written) == \
        (6, 1, 6, 6 * BLOCK, 6 * BLOCK)
    assert (s.corrupt, s.truncated, s.foreign, s.errors) == (0, 0, 0, 0)


def test_stored_value_is_header_then_payload(backend: Backend) -> None:
    store = backend.open()
    (k,) = keys(1, "layout")
    src = blocks(1, 2)[0]
    store.put(k, src)
    raw = backend.raw_get(store, k)
    assert raw is not None and len(raw) == HEADER_SIZE + BLOCK
    assert raw[:4] == b"ZKVB" and raw[24:42] == k and raw[HEADER_SIZE:] == src.tobytes()


def test_put_twice_keeps_one_good_block(backend: Backend) -> None:
    store = backend.open()
    (k,) = keys(1, "twice")
    src = blocks(1, 3)[0]
    assert store.put_many([k, k], [src, src]) == [True, True]
    out = np.zeros(BLOCK, np.uint8)
    assert store.get_into(k, out) and out.tobytes() == src.tobytes()


def _refused(backend: Backend, damage: str
             ) -> tuple[object, dict[str, int], list[dict[str, object]]]:
    store = backend.open()
    k, other = keys(2, damage)
    src = blocks(2, 4)
    store.put_many([k, other], list(src))
    raw = backend.raw_get(store, k)
    assert raw is not None
    if damage == "payload":
        bad = raw[:-1] + bytes([raw[-1] ^ 0x01])
    elif damage == "header":
        bad = raw[:30] + bytes([raw[30] ^ 0x80]) + raw[31:]
    elif damage in ("header-zeros", "header-checksum"):  # only the header checksum sees it
        i = 44 if damage == "header-zeros" else 60
        bad = raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:]
    elif damage == "truncated":
        bad = raw[: HEADER_SIZE + BLOCK // 2]
    elif damage == "header-only":
        bad = raw[:20]
    elif damage == "too-long":
        bad = raw + b"\0" * 64
    elif damage == "misplaced":  # another key's good block under this name
        bad = backend.raw_get(store, other)  # type: ignore[assignment]
    else:  # another namespace's good block under this name
        foreign = backend.open(namespace=f"{backend.namespace}x")
        foreign.put(k, src[0])
        bad = backend.raw_get(foreign, k)  # type: ignore[assignment]
    backend.raw_set(store, k, bad)
    out = np.zeros(BLOCK, np.uint8)
    with capture_logs() as logs:
        assert store.get_many_into([k], [out]) == [False]  # never served
    assert store.exists([k]) == [False]  # deleted
    assert backend.raw_get(store, k) is None
    assert store.get_into(other, out) and out.tobytes() == src[1].tobytes()  # the rest is fine
    return store, store.stats.snapshot(), [e for e in logs if e["event"] == "storage.block_refused"]


@pytest.mark.parametrize("damage, kind", [
    ("payload", "corrupt"), ("header", "corrupt"), ("header-zeros", "corrupt"),
    ("header-checksum", "corrupt"), ("too-long", "corrupt"),
    ("misplaced", "corrupt"), ("truncated", "truncated"), ("header-only", "truncated"),
    ("foreign", "foreign"),
])
def test_bad_block_is_refused_deleted_and_counted(backend: Backend, damage: str, kind: str) -> None:
    _, stats, events = _refused(backend, damage)
    counts = {k: stats[k] for k in ("corrupt", "truncated", "foreign")}
    assert counts == {k: int(k == kind) for k in counts}
    assert stats["hits"] == 1 and stats["misses"] == 1  # the other block; the refused one
    assert [e["kind"] for e in events] == [kind]


def test_gone_after_exists_is_an_ordinary_miss(backend: Backend) -> None:
    store = backend.open()
    (k,) = keys(1, "gone")
    store.put(k, blocks(1, 5)[0])
    assert store.exists([k]) == [True]
    backend.open().remove(k)  # another client (or the server's eviction) drops it
    out = np.zeros(BLOCK, np.uint8)
    assert store.get_many_into([k], [out]) == [False]
    s = store.stats
    assert (s.misses, s.errors, s.corrupt, s.truncated) == (1, 0, 0, 0)
    store.remove(k)  # removing what is gone is fine


def test_leading_present_needs_every_rank(backend: Backend) -> None:
    store = backend.open()
    hashes = [digest("lead", i) for i in range(6)]
    data = blocks(1, 6)[0]
    for i, h in enumerate(hashes[:4]):
        for rank in (0, 1):
            if i == 3 and rank == 1:
                continue  # rank 1 lacks block 3
            store.put(pack_key(h, rank), data)
    store.put(pack_key(hashes[5], 0), data)
    store.put(pack_key(hashes[5], 1), data)
    assert leading_present(store, hashes, world_size=2) == 3
    assert leading_present(store, hashes, world_size=1) == 4
    assert leading_present(store, hashes[4:], world_size=2) == 0
    assert leading_present(store, [], world_size=2) == 0


def test_wrong_sized_buffer_is_refused_not_overrun(backend: Backend) -> None:
    store = backend.open()
    (k,) = keys(1, "size")
    store.put(k, blocks(1, 7)[0])
    small = np.zeros(BLOCK // 2, np.uint8)
    assert store.get_many_into([k], [small]) == [False]
    assert store.stats.corrupt + store.stats.truncated == 1


def test_keys_and_buffers_of_different_counts_are_refused(backend: Backend) -> None:
    """(Mooncake's get read the keys that had a buffer and answered for those alone: a
    caller zipping the answer with its keys took the last keys' answers as missing.)"""
    store = backend.open()
    ks = keys(3, "counts")
    store.put_many(ks, list(blocks(3, 9)))
    outs = [np.zeros(BLOCK, np.uint8) for _ in range(2)]
    with pytest.raises(ValueError, match="3 keys but 2 blocks"):
        store.get_many_into(ks, outs)
    with pytest.raises(ValueError, match="3 keys but 2 blocks"):
        store.put_many(ks, list(blocks(2, 9)))
    assert store.get_many_into(ks[:2], outs) == [True, True]


def test_empty_batches_and_bad_keys(backend: Backend) -> None:
    store = backend.open()
    assert store.put_many([], []) == [] and store.get_many_into([], []) == []
    assert store.exists([]) == []
    with pytest.raises(ValueError):
        store.put(b"short", b"x")


def test_redis_gets_are_one_mget_and_a_non_string_key_is_a_miss(redis_server: Any) -> None:
    """Gets are one MGET (one command whatever the batch); a key of the store's that holds
    something else than a string (another client's list) is a miss, the rest are served."""
    from zkv.storage import open_store

    store = open_store(redis_server.url, f"t{uuid.uuid4().hex[:12]}")
    try:
        src = blocks(3, 8)
        ks = keys(3, "mget")
        assert store.put_many(ks, list(src)) == [True] * 3
        client = redis_server.client()
        client.delete(store.name(ks[1]))
        client.rpush(store.name(ks[1]), b"not a block")
        before = client.info("commandstats")
        dst = np.zeros((3, BLOCK), np.uint8)
        assert store.get_many_into(ks, list(dst)) == [True, False, True]
        after = client.info("commandstats")
        assert dst[0].tobytes() == src[0].tobytes() and dst[2].tobytes() == src[2].tobytes()
        assert not dst[1].any()
        calls = {c: after[c]["calls"] - before.get(c, {"calls": 0})["calls"]
                 for c in ("cmdstat_mget", "cmdstat_get") if c in after}
        assert (calls["cmdstat_mget"], calls.get("cmdstat_get", 0)) == (1, 0), calls
        s = store.stats
        assert (s.hits, s.misses, s.errors) == (2, 1, 0)
    finally:
        store.close()
