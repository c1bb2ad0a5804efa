"""The connector's cache reset (vLLM's ``reset_prefix_cache(reset_connector=True)``, what
an RL loop calls after a weight sync) against a real worker process: nothing cached before
is matched again, a waiting request is hashed anew, a running one saves nothing more."""

from __future__ import annotations

from types import SimpleNamespace

from tests.integrations.test_vllm_rank_loss import DOC, Group


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
    assert half.in_flight() == {"requests": 0, "cache_requests": 0, "ops": 0, "batches": 0,
                                "steps": 0, "store_retry": 0}
    assert _matched(group) == 0  # what it computed was not saved
