"""Two engines in one process (two ``LLM`` objects of one model, say): each scheduler half's
``zkv:`` series show side by side on ``/metrics``, told apart by ``engine_id``, and one
engine's stop leaves the other's series and the server they share. Against real worker
processes, with the calls made the way vLLM's scheduler makes them."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integrations.test_vllm_rank_loss import BS, Group
from tests.worker.helpers import short_ipc_dir
from zkv.integrations.vllm import metrics


@pytest.fixture
def two_engines() -> Iterator[tuple[Group, Group]]:
    """Two halves of one model (``rank-loss``), engine ids ``engine-a`` and ``engine-b``."""
    with short_ipc_dir() as one, short_ipc_dir() as two:
        a = Group(one, engine_id="engine-a")
        try:
            b = Group(two, engine_id="engine-b")
            try:
                yield a, b
            finally:
                b.close()
        finally:
            a.close()


def _scrape(url: str) -> dict[tuple[str, str, str], float]:
    """(sample name, engine_id, tier/op/what) -> value of the ``zkv:`` engine series."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, s.labels["engine_id"], s.labels.get("tier") or s.labels.get("op")
             or s.labels.get("what") or ""): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if "engine_id" in s.labels}


def _load_doc(group: Group) -> None:
    """A request whose DOC is in the half's host pool: 128 tokens loaded from it."""
    half = group.half
    req = group.request()
    ext, _ = half.get_num_new_matched_tokens(req, 0)
    assert ext == 8 * BS
    blocks = list(range(20, 29))
    half.update_state_after_alloc(req, blocks, ext)
    half.update_connector_output((), step=half.build_connector_meta(
        Group.step(req, blocks, ext)).step)
    half.request_finished(req)
    assert half.wait_idle(10.0)


def test_two_engines_of_one_model_keep_their_own_series(
        two_engines: tuple[Group, Group]) -> None:
    """Engine a computes DOC (1 request, 129 tokens computed, 8 blocks saved); engine b
    computes it too, then serves it again from its host pool (2 requests, 128 tokens from
    zkv's host pool). Both are given one metrics port: one server serves both. Before,
    the second half's collector replaced the first's (a's numbers were gone from every
    scrape), and the second engine's server could not start on the port the first held."""
    a, b = two_engines
    first = metrics.serve(0)  # engine a's metrics_port (0: a free one)
    try:
        second = metrics.serve(first.port)  # engine b, given the same port
        try:
            a.compute_and_save()
            b.compute_and_save()
            _load_doc(b)
            s = _scrape(second.url)
            assert s[("zkv:requests_total", "engine-a", "")] == 1
            assert s[("zkv:requests_total", "engine-b", "")] == 2
            assert s[("zkv:prompt_tokens_total", "engine-a", "computed")] == 129
            assert s[("zkv:prompt_tokens_total", "engine-a", "zkv_host")] == 0
            assert s[("zkv:prompt_tokens_total", "engine-b", "computed")] == 129 + 1
            assert s[("zkv:prompt_tokens_total", "engine-b", "zkv_host")] == 128
            assert s[("zkv:blocks_total", "engine-a", "save")] == 8
            assert s[("zkv:blocks_total", "engine-b", "load")] == 8
            for engine in ("engine-a", "engine-b"):  # each half's own batch latencies
                assert s[("zkv:batch_seconds_count", engine, "")] >= 1
                assert s[("zkv:enabled", engine, "")] == 1
            assert _scrape(first.url) == s  # one server

            first.shutdown()  # engine a stops: its half closes, the port stays served
            a.half.close()
            after = _scrape(second.url)
            assert {k[1] for k in after} == {"engine-b"}
            assert {k: v for k, v in s.items() if k[1] == "engine-b"
                    and k[0] != "zkv:scheduler_seconds_total"} == \
                {k: v for k, v in after.items() if k[0] != "zkv:scheduler_seconds_total"}
        finally:
            second.shutdown()
    finally:
        first.shutdown()  # (again: changes nothing)


def test_a_second_half_with_the_same_engine_id_is_refused(group: Group) -> None:
    """Its series would be the first one's (in an engine, claim_engine_dir stops it
    earlier: one engine_id per machine)."""
    same = SimpleNamespace(layout=group.half.layout, engine_id=group.half.engine_id)
    with pytest.raises(ValueError, match="engine_id .* is registered already"):
        metrics.register_half(same)
    metrics.register_half(group.half)  # the same half again: nothing changes


def test_a_store_down_on_the_read_path_shows_in_the_metrics() -> None:
    """An engine that only reads from L3 (a P/D consumer writes nothing) while the store is
    down: every existence query fails, and vLLM computes every prompt. Writes' failures do
    not show it; ``zkv:store_query_failures_total`` does (no metric moved before)."""
    from tests.servers import free_port

    down = f"redis://127.0.0.1:{free_port()}/0?timeout_s=0.5"  # nothing listens there
    with short_ipc_dir() as folder:
        g = Group(folder, store_url=down, extra={"storage_write": False})
        try:
            metrics.register_half(g.half)

            def failures() -> float:
                return next(s.value for fam in text_string_to_metric_families(metrics.render())
                            for s in fam.samples
                            if s.name == "zkv:store_query_failures_total"
                            and s.labels["engine_id"] == g.half.engine_id)

            assert failures() == 0
            for _ in range(3):
                req = g.request()
                req.prompt_token_ids = req.all_token_ids = [7] * (8 * BS)
                req.num_tokens = req.num_prompt_tokens = 8 * BS
                ext, _ = g.ask_until_matched(req)
                assert ext == 0
            assert failures() >= 1
            assert g.half.snapshot()["disabled"] is None  # zkv still serves, from host
        finally:
            g.close()
