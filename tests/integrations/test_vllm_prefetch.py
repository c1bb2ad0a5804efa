"""The connector's prefetch policies when a prompt's blocks are partly in zkv's host pool
and partly only in L3, against real worker processes and a real ``file://`` store: one
engine (``writer``) puts a document into the store, another reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.integrations.conftest import two_engines_on_one_store
from tests.integrations.test_vllm_rank_loss import BS, DOC, Group
from tests.waiting import wait_until
from zkv.scheduler.hashing import ROOT_HASH, hash_tokens
from zkv.storage import leading_present

DEADLINE_S = 10.0


@pytest.fixture
def writer_and_best_effort(tmp_path: Path) -> Iterator[tuple[Group, Group]]:
    with two_engines_on_one_store(tmp_path, {"prefetch": "best_effort"}) as pair:
        yield pair


def test_best_effort_loads_the_host_hits_and_lets_the_prefetch_land(
        writer_and_best_effort: tuple[Group, Group]) -> None:
    """best_effort never waits for L3: a request whose first blocks are in the host pool and
    the next ones only in the store gets the host hits at once (loaded into vLLM's blocks in
    the step's batch) and computes the rest, while its prefetch lands in the host pool for
    the next request. Before, the load was planned while the request's own prefetch was in
    flight: load_external refused it (ValueError "still loading from storage") inside
    ``update_state_after_alloc``, and the EngineCore died."""
    writer, group = writer_and_best_effort
    writer.compute_and_save()
    hashes = hash_tokens(DOC, BS, parent=ROOT_HASH)
    assert writer.store is not None
    wait_until(lambda: leading_present(writer.store, hashes, 1) == 8, DEADLINE_S,
               "the document's 8 blocks in L3")
    half = group.half
    first = group.request()  # the document's first 4 blocks: all in L3, none in host
    first.prompt_token_ids = first.all_token_ids = DOC[: 4 * BS] + [0]
    first.num_tokens = first.num_prompt_tokens = 4 * BS + 1
    assert half.get_num_new_matched_tokens(first, 0) == (0, False)  # computes: no wait
    half.request_finished(first)  # (never allocated) its prefetch goes on
    assert half.wait_idle(DEADLINE_S) and half.snapshot()["cm_loaded"] == 4

    req = group.request()  # the whole document: 4 blocks in host, the next 4 in L3
    ext, _ = half.get_num_new_matched_tokens(req, 0)
    assert ext == 4 * BS
    blocks = list(range(9))
    half.update_state_after_alloc(req, blocks, ext)
    meta = half.build_connector_meta(Group.step(req, blocks, ext))
    assert meta.loads == blocks[:4] and not meta.unloaded
    half.update_connector_output((), step=meta.step)
    req.num_computed_tokens = req.num_tokens
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    half.request_finished(req)
    assert half.wait_idle(DEADLINE_S)
    snap = half.snapshot()
    assert snap["loaded_blocks"] == 4 and snap["cm_loaded"] == 8, snap
    assert snap["zkv_host_tokens"] == 4 * BS and snap["zkv_store_tokens"] == 0, snap

    after = group.request()  # the prefetch landed: every block is a host hit now
    assert half.get_num_new_matched_tokens(after, 0) == (8 * BS, False)
    half.request_finished(after)
    assert half.in_flight() == {"requests": 0, "held": 0, "cache_requests": 0, "ops": 0,
                                "batches": 0, "steps": 0, "store_retry": 0}
    half.cm.check_invariants()


def test_best_effort_takes_a_producers_promise_as_no_wait(
        writer_and_best_effort: tuple[Group, Group]) -> None:
    """A P/D consumer under best_effort waits for nothing: a promise of blocks not there
    yet is no wait, not an expired one (each such request logged
    ``connector.producer_blocks_missing`` with ``waited_s=0`` and counted as expired
    without ever having waited)."""
    _, group = writer_and_best_effort
    half = group.half
    req = group.request()
    req.kv_transfer_params = {"zkv_blocks": 8, "zkv_namespace": half._namespace}
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    assert (half.counts.awaited, half.counts.await_expired) == (0, 0)
    half.request_finished(req)


@pytest.fixture
def writer_and_waiting(tmp_path: Path) -> Iterator[tuple[Group, Group]]:
    with two_engines_on_one_store(tmp_path, {"prefetch": "wait_complete"}) as pair:
        yield pair


@pytest.mark.parametrize("local_blocks", [8, 7])
def test_a_prompt_vllm_holds_waits_for_no_prefetch(
        writer_and_waiting: tuple[Group, Group], local_blocks: int) -> None:
    """A prompt whose blocks are only in L3 waits for its prefetch (here wait_complete)
    only when the read brings tokens past vLLM's own prefix-cache hit. vLLM's GPU cache is
    often larger than zkv's host pool: a prompt it holds whole (8 blocks of 8, plus a
    token) was asked to wait ("ask again") for L3 reads whose blocks it would never load,
    the whole read, or up to the timeout budget, per such request. It goes on at once now,
    as under best_effort: the read still lands in the host pool, for later requests."""
    writer, group = writer_and_waiting
    writer.compute_and_save()
    hashes = hash_tokens(DOC, BS, parent=ROOT_HASH)
    assert writer.store is not None
    wait_until(lambda: leading_present(writer.store, hashes, 1) == 8, DEADLINE_S,
               "the document's 8 blocks in L3")
    half = group.half
    req = group.request()  # the whole document: in L3 and, up to local_blocks, in vLLM
    ext, _ = half.get_num_new_matched_tokens(req, local_blocks * BS)
    if local_blocks == 7:  # the 8th block is worth the wait (it computed it before)
        assert ext is None
        ext, _ = group.ask_until_matched(req)
        assert ext == 8 * BS  # (ask_until_matched asks with no local hit)
        half.request_finished(req)
    else:
        assert ext == 0, "waited for L3 reads of blocks vLLM already holds"
        blocks = list(range(9))
        half.update_state_after_alloc(req, blocks, 0)
        meta = half.build_connector_meta(Group.step(req, blocks, 8 * BS))
        assert meta.loads == [] and not meta.unloaded
        half.update_connector_output((), step=meta.step)
        req.num_computed_tokens = req.num_tokens
        req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
        half.request_finished(req)
    assert half.wait_idle(DEADLINE_S)
    snap = half.snapshot()
    assert snap["cm_loaded"] == 8, snap  # the read landed in the host pool either way
    assert snap["saved_blocks"] == 0, snap  # (nothing saved twice: the host had them)
    after = group.request()
    assert half.get_num_new_matched_tokens(after, 0) == (8 * BS, False)
    half.request_finished(after)
    assert half.in_flight()["requests"] == 0
    half.cm.check_invariants()
