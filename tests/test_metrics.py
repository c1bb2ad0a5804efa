"""zkv.metrics: the registry's families and labels, and the loopback HTTP endpoint."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zkv import metrics
from zkv.errors import ConfigError


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_replay_registry_exports_every_label_from_the_start() -> None:
    metrics.register_replay()
    metrics.register_replay()  # once
    s = _samples(metrics.render())
    for tier in metrics.TIERS:
        assert ("zkv:hit_blocks_total", (("tier", tier),)) in s
    for d in metrics.DIRECTIONS:
        assert ("zkv:moved_blocks_total", (("direction", d),)) in s
        assert ("zkv:moved_bytes_total", (("direction", d),)) in s
    for pool in metrics.POOLS:
        assert ("zkv:free_blocks", (("pool", pool),)) in s
    for name in ("zkv:inflight_batches", "zkv:lost_ranks_total", "zkv:batches_total"):
        assert (name, ()) in s
    for reason in metrics.REFUSAL_REASONS:
        assert ("zkv:refused_messages_total", (("reason", reason),)) in s


def test_record_move_counts_blocks_and_bytes() -> None:
    metrics.register_replay()
    key = ("zkv:moved_bytes_total", (("direction", "s2h"),))
    before = _samples(metrics.render())[key]
    metrics.record_move("s2h", 2, 1024)
    after = _samples(metrics.render())
    assert after[key] == before + 1024
    with pytest.raises(ValueError):  # a counter never goes down
        metrics.BLOCKS_MOVED.labels(direction="h2d").inc(-1)


def test_serve_on_a_free_loopback_port() -> None:
    server = metrics.serve(0)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics" and server.port > 0
        with urllib.request.urlopen(server.url, timeout=5) as resp:
            assert resp.status == 200
            body = resp.read().decode()
        assert ("zkv:refused_messages_total", (("reason", "forged"),)) in _samples(body)
    finally:
        server.shutdown()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)


def test_a_taken_port_is_one_config_error() -> None:
    taken = metrics.serve(0)  # a real listener on the port
    try:
        with pytest.raises(ConfigError, match=(
                rf"^metrics port {taken.port}: cannot listen on 127\.0\.0\.1:{taken.port} "
                r"\(Address already in use\)$")):
            metrics.serve(taken.port)
    finally:
        taken.shutdown()
    metrics.serve(taken.port).shutdown()  # free again: it listens


def _refused() -> dict[str, float]:
    return {labels[0][1]: v for (name, labels), v in _samples(metrics.render()).items()
            if name == "zkv:refused_messages_total"}


def test_refused_messages_are_read_from_the_dispatcher_and_kept_once_it_closed() -> None:
    """What a dispatcher refused reaches ``zkv:refused_messages_total`` at scrape time: a
    layout refused at the hello, junk, an ack of an unknown seq; the counts stay after
    ``close()`` (a run writes its metrics then) and after the dispatcher is gone: a counter
    never goes down (it did once the dispatcher was garbage-collected)."""
    import gc

    import zmq

    from tests.waiting import holds_within
    from tests.worker.helpers import FakeRank, endpoints, short_ipc_dir
    from zkv import protocol as P
    from zkv.scheduler.dispatcher import Dispatcher

    base = _refused()
    ctx: zmq.Context[object] = zmq.Context()
    with short_ipc_dir() as folder:
        eps = endpoints(folder)
        d = Dispatcher(*eps, 2, "fp", context=ctx)
        metrics.watch_refusals(d)
        metrics.watch_refusals(d)  # watched again (a half registered twice): counted once
        r0 = FakeRank(ctx, *eps, 0, "fp").join()
        # Rank 1 with another layout (rank 0's own hello would clear a refusal of rank 0's
        # record if it came second: its order against r0's is not fixed), then as it fits.
        other = FakeRank(ctx, *eps, 1, "other-fp", pid=777).join()
        r1 = None
        try:
            with pytest.raises(ConfigError):
                d.wait_for_ranks(5)
            r1 = FakeRank(ctx, *eps, 1, "fp").join()
            d.wait_for_ranks(5)  # r0 and r1 join
            r0.send_raw([b"junk", b"{"])
            r0.send(P.BlocksCopied(42, 0, True, ()))  # no batch 42 was published
            assert holds_within(lambda: d.refusals()["unknown_seq"] == 1, 5, lambda: d.poll(0.01))
            want = {"hello": 1, "malformed": 1, "unknown_seq": 1}
            got = {k: v - base[k] for k, v in _refused().items()}
            assert got == {r: want.get(r, 0) for r in metrics.REFUSAL_REASONS}, got
        finally:
            d.close(shutdown=False)
            for r in (r0, other, r1):
                if r is not None:
                    r.close()
        got = {k: v - base[k] for k, v in _refused().items()}
        assert {k: v for k, v in got.items() if v} == want  # kept once closed
        metrics.watch_refusals(d)  # watched again once closed: still counted once
        got = {k: v - base[k] for k, v in _refused().items()}
        assert {k: v for k, v in got.items() if v} == want
        d = None  # type: ignore[assignment]  # the last reference
        gc.collect()
        got = {k: v - base[k] for k, v in _refused().items()}
        assert {k: v for k, v in got.items() if v} == want  # and once it is gone
    ctx.term()


def test_an_engine_scrape_shows_no_replay_families() -> None:
    """Under vLLM only the connector's families and the refusals are there: the replay's
    (free blocks, lost ranks, hits) stayed at 0 beside the connector's real numbers, and
    an alert on them was wrong. A fresh process, as an engine's."""
    import subprocess
    import sys

    code = ("from zkv.integrations.vllm import metrics as m; import zkv.replay; "
            "print(m.render())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    names = {fam.name for fam in text_string_to_metric_families(out)}
    assert "zkv:refused_messages" in names
    assert not names & {"zkv:free_blocks", "zkv:lost_ranks", "zkv:hit_blocks", "zkv:batches",
                        "zkv:moved_blocks", "zkv:inflight_batches"}, names
