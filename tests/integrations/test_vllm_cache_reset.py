"""The connector's cache reset (vLLM's ``reset_prefix_cache(reset_connector=True)``, what
an RL loop calls after a weight sync) against a real worker process: nothing cached before
is matched again, a waiting request is hashed anew, a running one saves nothing more; and
the running requests that ``reset_running_requests=True`` preempts start over cleanly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integrations.test_vllm_rank_loss import BS, DOC, Group


def _matched(group: Group) -> int:
    req = group.request()
    ext, _ = group.half.get_num_new_matched_tokens(req, 0)
    group.half.request_finished(req)  # (never allocated: its match is let go)
    return ext


def test_nothing_cached_before_a_reset_is_matched_after_it(group: Group) -> None:
    group.compute_and_save()
    assert _matched(group) == len(DOC)  # 8 blocks, all in the host pool
    assert group.half.reset() is True
    assert _matched(group) == 0
    group.compute_and_save()  # computed again, under the new generation: saved again
    assert _matched(group) == len(DOC)


def test_a_request_waiting_across_a_reset_is_hashed_anew(group: Group) -> None:
    group.compute_and_save()
    req = group.request()
    assert group.half.get_num_new_matched_tokens(req, 0)[0] == len(DOC)
    group.half.reset()  # vLLM has not allocated it yet: it is asked again
    assert group.half.get_num_new_matched_tokens(req, 0)[0] == 0
    group.half.request_finished(req)
    assert group.half.in_flight()["cache_requests"] == 0


def test_a_request_running_across_a_reset_saves_nothing_more(group: Group) -> None:
    half = group.half
    req = group.request()
    half.get_num_new_matched_tokens(req, 0)
    blocks = list(range(20, 29))
    half.update_state_after_alloc(req, blocks, 0)
    half.build_connector_meta(Group.step(req, blocks, 0))
    half.reset()  # its forward runs with the new weights, its KV so far is of the old
    half.update_connector_output(())
    req.num_computed_tokens = req.num_tokens
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    half.request_finished(req)
    assert half.wait_idle(10.0)
    assert half.snapshot()["saved_blocks"] == 0
    assert half.in_flight() == {"requests": 0, "held": 0, "cache_requests": 0, "ops": 0,
                                "batches": 0, "steps": 0, "store_retry": 0}
    assert _matched(group) == 0  # what it computed was not saved


@pytest.mark.parametrize("reset_connector", [False, True])
def test_requests_preempted_by_a_reset_are_asked_again_and_start_over(
        group: Group, reset_connector: bool) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` preempts every running request
    outside ``schedule()``: its blocks freed, ``num_computed_tokens`` 0, first in the
    waiting queue, its id only in the next step's ``preempted_req_ids``. That next
    ``schedule()`` asks zkv about it (and may schedule it) before ``build_connector_meta``
    says it was preempted. Before, the ask raised ValueError ("already allocated") and the
    EngineCore died; past that, the allocation would have been taken for a second one (its
    promised load dropped) and the preemption named later would have undone it."""
    half = group.half
    req = group.request()
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = list(range(9))
    half.update_state_after_alloc(req, blocks, 0)
    step = half.build_connector_meta(Group.output(new=[(req, blocks, 0, 4 * BS)])).step
    half.update_connector_output((), step=step)  # the first 4 blocks confirmed
    req.num_computed_tokens = 4 * BS
    rest = req.num_tokens - 4 * BS
    step = half.build_connector_meta(Group.output(cached=[(req, None, 4 * BS, rest)])).step
    assert half.wait_idle(10.0) and half.snapshot()["saved_blocks"] == 4  # blocks 0-3
    half.update_connector_output((), step=step)  # the rest confirmed: blocks 4-7 planned
    # the reset: vLLM preempts it (and resets zkv's cache after, with reset_connector)
    req.status, req.num_computed_tokens = SimpleNamespace(name="PREEMPTED"), 0
    if reset_connector:
        half.reset()
    ext, _ = half.get_num_new_matched_tokens(req, 0)  # the next schedule() asks first
    assert ext == (0 if reset_connector else 4 * BS)  # its own saved blocks, as any match
    again = list(range(20, 29))  # vLLM's new blocks for it
    half.update_state_after_alloc(req, again, ext)
    meta = half.build_connector_meta(Group.output(
        cached=[(req, again, ext, req.num_tokens - ext)], resumed={req.request_id},
        preempted={req.request_id}))
    assert meta.loads == again[: ext // BS] and not meta.unloaded
    assert half.snapshot()["preempted"] == 1
    half.update_connector_output((), step=meta.step)  # it ran again: every block confirmed
    req.num_computed_tokens = req.num_tokens
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    half.request_finished(req)
    assert half.wait_idle(10.0)
    snap = half.snapshot()
    # the save planned before the preemption (it read freed blocks) went nowhere; what
    # the request computed again was saved: blocks 4-7, or all 8 under the new generation
    assert snap["loaded_blocks"] == ext // BS, snap
    assert snap["saved_blocks"] == 4 + (8 if reset_connector else 4), snap
    assert _matched(group) == len(DOC)
    assert half.in_flight() == {"requests": 0, "held": 0, "cache_requests": 0, "ops": 0,
                                "batches": 0, "steps": 0, "store_retry": 0}
    half.cm.check_invariants()
