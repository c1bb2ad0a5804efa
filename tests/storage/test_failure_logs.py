"""Failure lines of several stores at once: every rate-limited line, the summary of what
the limit held back too, names the store (its URL, never a password) and the call, so an
operator with two stores, or reads and writes failing together, tells which one fails."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from structlog.testing import capture_logs

from tests.servers import RedisServer, free_port
from zkv.storage import StorageQuery, leading_present, open_store, pack_key

SECRET = "s3cret-pw"
BLOCK = 32 << 10


def test_failure_summaries_name_the_store_and_the_call(tmp_path: Path) -> None:
    """A full redis-server declines puts (``storage.write_failed``) while two others are
    down (``storage.query_failed``, from each store's own limiter and from a
    StorageQuery's). (Before, the summaries carried neither store nor call, and the
    queries of every store shared one limiter, whose summary nobody wrote.)"""
    with RedisServer(str(tmp_path), maxmemory="2mb", policy="noeviction",
                     user=("zkv", SECRET)) as srv:
        full = open_store(srv.url, "ns")
        down = [open_store(f"redis://zkv:{SECRET}@127.0.0.1:{free_port()}/0?timeout_s=0.2",
                           "ns") for _ in range(2)]
        query = StorageQuery(down[0], 1)
        stores = [full, *down]
        try:
            digest = bytes(16)
            with capture_logs() as logs:
                ok: list[bool] = []
                for i in range(0, 160, 4):  # 5 MiB into 2 MiB
                    ok += full.put_many([pack_key(j.to_bytes(16, "big"), 0) for j in
                                         range(i, i + 4)], [np.full(BLOCK, i, np.uint8)] * 4)
                for _ in range(20):
                    for s in down:
                        assert leading_present(s, [digest], 1) == 0
                    assert query([digest]) == 0
                query.flush_logs()
                for s in stores:
                    s.close()
            assert ok.count(False) > 80
            lines = [e for e in logs
                     if e["event"] in ("storage.write_failed", "storage.query_failed")]
            assert all("store" in e and "call" in e for e in lines), lines
            summaries = Counter((e["event"], e["store"], e["call"], e["num_suppressed"])
                                for e in lines if e.get("summary"))
            declined = sum(not all(ok[i : i + 4]) for i in range(0, 160, 4))  # a line each
            assert summaries == Counter({
                ("storage.write_failed", full.url, "put", declined - 3): 1,
                ("storage.query_failed", down[0].url, "exists", 17): 2,  # store, query
                ("storage.query_failed", down[1].url, "exists", 17): 1,
            }), (summaries, declined)
            assert full.url != down[0].url != down[1].url
            assert SECRET not in repr(logs)
        finally:
            for s in stores:
                s.close()
