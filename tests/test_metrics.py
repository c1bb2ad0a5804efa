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


def test_default_registry_exports_every_label_from_the_start() -> None:
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


def test_record_move_counts_blocks_and_bytes() -> None:
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
        assert ("zkv:batches_total", ()) in _samples(body)
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
