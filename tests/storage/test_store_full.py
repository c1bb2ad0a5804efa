"""Shared L3 stores that are full, real servers: a redis-server with ``noeviction`` at its
``maxmemory`` (it answers OOM), a Mooncake Store whose one segment is full (-200). Puts
are declined, not raised: ``put_many`` says which (``stats.put_failures`` counts them),
a few ``storage.write_failed`` lines are logged, not one per call, and what was stored
reads back exactly. End to end, ``zkv replay`` against such a store verifies every reused
block and logs a few lines per process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.replay_run import events as replay_events
from tests.replay_run import metrics as replay_metrics
from tests.replay_run import summary
from tests.servers import MooncakeServer, RedisServer
from zkv.storage import open_store, pack_key

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32 << 10


def _full_server(kind: str, folder: str, redis_mb: int = 2) -> Any:
    if kind == "redis":
        return RedisServer(folder, maxmemory=f"{redis_mb}mb", policy="noeviction")
    return MooncakeServer(folder, segment_mb=16)


#: redis-server counts its clients' query buffers in ``used_memory``: ``zkv replay``'s 2
#: ranks x 4 I/O threads each pipeline 32 blocks (16 KiB a rank) at once, up to ~4 MiB
#: in flight, so at 2 MiB a burst of them alone put the server past ``maxmemory`` and every
#: SET answered OOM (stored 0 in 1 of 3 runs on a fast day). 16 MiB holds the burst and
#: is still a small part of the ~100 MiB the replay writes.
REPLAY_REDIS_MB = 16


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_a_full_store_declines_puts_and_says_so_a_few_times(tmp_path: Path, kind: str) -> None:
    n = 160 if kind == "redis" else 800  # 5 MiB into 2 MiB, 25 MiB into 16 MiB
    keys = [pack_key(i.to_bytes(16, "big"), 0) for i in range(n)]
    datas = [np.full(BLOCK, i % 251, np.uint8) for i in range(n)]
    with _full_server(kind, str(tmp_path)) as srv:
        store = open_store(srv.url, "ns")
        try:
            with capture_logs() as logs:
                ok: list[bool] = []
                for i in range(0, n, 4):
                    ok += store.put_many(keys[i : i + 4], datas[i : i + 4])
            assert ok.count(True) > 0 and ok.count(False) > n // 4
            assert store.stats.put_failures == ok.count(False)
            assert store.stats.puts == ok.count(True) and store.stats.errors == 0
            lines = [e for e in logs if e["event"] == "storage.write_failed"]
            assert len(lines) == 3, lines  # the rest counted (next line: num_suppressed)
            want = "maxmemory" if kind == "redis" else "-200 (no space"
            assert all(want in e["error"] for e in lines)
            read = 0
            for i in (i for i, good in enumerate(ok) if good):
                out = np.zeros(BLOCK, np.uint8)
                if store.get_into(keys[i], out):  # (Mooncake may have evicted it since)
                    assert out.tobytes() == datas[i].tobytes()
                    read += 1
            assert read > 0
        finally:
            store.close()


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_replay_against_a_full_store_is_exact_and_quiet(tmp_path: Path, kind: str) -> None:
    logs = tmp_path / "logs"
    with _full_server(kind, str(tmp_path / "srv"), REPLAY_REDIS_MB) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--requests", "200",
             "--storage", srv.url, "--log-dir", str(logs), "--metrics-file",
             str(tmp_path / "metrics.txt")],
            capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    s = summary(proc)
    assert s.verified > 1000 and (s.mismatched, s.failed_ops) == (0, 0)
    assert s.stored > 0 and s.store_dropped > 100  # some stored, the rest declined
    failed = replay_metrics(tmp_path / "metrics.txt")['zkv:failed_blocks_total{direction="h2s"}']
    assert failed == s.store_dropped  # every declined block counted where alerts look
    events = replay_events(logs)
    loud = [e for e in events if e["event"] in ("storage.write_failed", "worker.copy_failed",
                                                "scheduler.op_failed")]
    # at most 3 lines per event and process (the scheduler's op_failed; each rank's
    # copy_failed and write_failed), then one summary of what was held back (the store's
    # at its close)
    per: dict[tuple[int, str, bool], int] = {}
    for e in loud:
        k = (e["pid"], e["event"], bool(e.get("summary")))
        per[k] = per.get(k, 0) + 1
    assert len({k[:2] for k in per}) == 5, per
    assert all(n <= (1 if summary else 3) for (_, _, summary), n in per.items()), per
