"""zkv.metrics: exposition format, validation, thread safety, the HTTP endpoint."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest

from zkv import metrics
from zkv.metrics import Registry, format_value, serve


def small_registry() -> Registry:
    reg = Registry()
    moved = reg.counter("zkv_blocks_moved_total", "Blocks copied.", ("direction",))
    moved.inc(3, direction="h2d")
    moved.inc(direction="d2h")
    moved.inc(2.5, direction="d2h")
    reg.gauge("zkv_inflight_batches", "In flight.\nSecond \\ line.").set(4)
    odd = reg.gauge("odd", "Odd labels.", ("path", "k"))
    odd.set(-1, path='C:\\dir\n"q"', k="v")
    return reg


def test_render_exact() -> None:
    assert small_registry().render() == (
        "# HELP zkv_blocks_moved_total Blocks copied.\n"
        "# TYPE zkv_blocks_moved_total counter\n"
        'zkv_blocks_moved_total{direction="d2h"} 3.5\n'
        'zkv_blocks_moved_total{direction="h2d"} 3\n'
        "# HELP zkv_inflight_batches In flight.\\nSecond \\\\ line.\n"
        "# TYPE zkv_inflight_batches gauge\n"
        "zkv_inflight_batches 4\n"
        "# HELP odd Odd labels.\n"
        "# TYPE odd gauge\n"
        'odd{path="C:\\\\dir\\n\\"q\\"",k="v"} -1\n'
    )


def test_unlabelled_metric_starts_at_zero_and_labelled_one_empty() -> None:
    reg = Registry()
    reg.counter("c_total", "C.")
    reg.gauge("g", "G.", ("pool",))
    assert reg.render() == ("# HELP c_total C.\n# TYPE c_total counter\nc_total 0\n"
                            "# HELP g G.\n# TYPE g gauge\n")


def test_format_value() -> None:
    assert [format_value(v) for v in (0, 7, 2.0, 0.25, float("inf"), float("-inf"),
                                      float("nan"), 2.0**60)] == [
        "0", "7", "2", "0.25", "+Inf", "-Inf", "NaN", "1.152921504606847e+18"]


def test_misuse_is_refused() -> None:
    reg = Registry()
    c = reg.counter("c_total", "C.", ("tier",))
    with pytest.raises(ValueError):
        c.inc(-1, tier="host")
    with pytest.raises(ValueError):
        c.inc(tier="host", extra="x")
    with pytest.raises(ValueError):
        c.inc()
    with pytest.raises(ValueError):
        reg.counter("bad name", "x")
    with pytest.raises(ValueError):
        reg.counter("x_total", "x", ("__reserved",))
    assert reg.counter("c_total", "again", ("tier",)) is c
    with pytest.raises(ValueError):
        reg.gauge("c_total", "C.", ("tier",))
    g = reg.gauge("g", "G.")
    g.inc(5)
    g.dec(2)
    assert g.get() == 3


def test_concurrent_increments_are_not_lost() -> None:
    c = Registry().counter("n_total", "N.", ("t",))

    def work() -> None:
        for _ in range(5000):
            c.inc(t="a")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert c.get(t="a") == 20000


def test_default_registry_has_zkv_metrics() -> None:
    text = metrics.REGISTRY.render()
    for tier in ("device", "host", "storage"):
        assert f'zkv_hits_blocks_total{{tier="{tier}"}}' in text
    for d in ("d2h", "h2d", "backup", "s2h", "h2s"):
        assert f'zkv_blocks_moved_total{{direction="{d}"}}' in text
        assert f'zkv_bytes_moved_total{{direction="{d}"}}' in text
    for pool in ("device", "host"):
        assert f'zkv_free_blocks{{pool="{pool}"}}' in text
    for name, kind in [("zkv_inflight_batches", "gauge"), ("zkv_lost_ranks_total", "counter"),
                       ("zkv_batches_total", "counter")]:
        assert f"# TYPE {name} {kind}\n{name} " in text
    before = metrics.BYTES_MOVED.get(direction="s2h")
    metrics.record_move("s2h", 2, 1024)
    assert metrics.BYTES_MOVED.get(direction="s2h") == before + 1024


def test_serve_on_a_free_loopback_port() -> None:
    reg = small_registry()
    server = serve(0, reg)
    try:
        assert server.server_address[0] == "127.0.0.1" and server.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == metrics.CONTENT_TYPE
            assert resp.read().decode() == reg.render()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=5)
        assert err.value.code == 404
        err.value.close()
    finally:
        server.shutdown()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)
