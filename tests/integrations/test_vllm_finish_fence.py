"""A finishing request's last save reads vLLM's blocks after vLLM is done with the request,
and vLLM may give them to another request at its next ``schedule()``. The save must run
before the forward that could write them: the next step's metadata fences on its batch
(ungated workers wait on the fence; gated ones run every earlier batch first anyway).
``request_finished`` holds nothing (False): held blocks starve a tight vLLM cache. Against
a real worker process, with the calls made the way vLLM's scheduler makes them
(``test_vllm_rank_loss.Group``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.integrations.test_vllm_rank_loss import BS, Group


def _request(rid: str, first: int, num_blocks: int) -> Any:
    tokens = [(first + 11 * i) % 1000 for i in range(num_blocks * BS)] + [first]
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=tokens, all_token_ids=tokens, num_tokens=len(tokens),
        num_prompt_tokens=len(tokens), num_computed_tokens=0,
        status=SimpleNamespace(name="RUNNING"), lora_request=None, cache_salt=None,
        mm_features=[])


def _scheduled(half: Any, req: Any) -> Any:
    """``req`` (no hit anywhere) allocated blocks 20.. and scheduled whole in one step."""
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = list(range(20, 21 + req.num_tokens // BS))
    half.update_state_after_alloc(req, blocks, 0)
    half.build_connector_meta(Group.step(req, blocks, 0))
    return req


@pytest.mark.parametrize("status", ["FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED"])
def test_the_last_save_fences_the_next_forward(group: Group, status: str) -> None:
    half = group.half
    req = _scheduled(half, _request("fin", 5, 6))
    half.update_connector_output(())  # the forward ran: its 6 full blocks are confirmed
    req.num_computed_tokens = req.num_tokens
    req.status = SimpleNamespace(name=status)
    seq_before = half.dp.next_seq
    assert half.request_finished(req) == (False, None)  # vLLM frees the blocks now
    seq = half.dp.next_seq - 1
    assert seq == seq_before, "the last save goes out at once, in its own batch"
    meta = half.build_connector_meta(Group.empty_step())
    assert meta.fence == seq and meta.release_upto >= seq, \
        "the next forward could write the blocks before the save read them"
    assert half.build_connector_meta(Group.empty_step()).fence == -1  # one step only
    assert half.wait_idle(10.0)
    assert half.snapshot()["saved_blocks"] == 6
    assert half.cm.num_running() == 0 and not half._reqs
    half.cm.check_invariants()


def test_nothing_to_save_fences_nothing(group: Group) -> None:
    half = group.half
    group.compute_and_save()  # DOC's 8 blocks are in zkv's host pool now
    req = group.request()     # the same document: every full block is there already
    ext, _ = half.get_num_new_matched_tokens(req, 0)
    assert ext == 8 * BS
    blocks = list(range(30, 39))
    half.update_state_after_alloc(req, blocks, ext)
    half.build_connector_meta(Group.step(req, blocks, ext))
    half.update_connector_output(())
    req.num_computed_tokens = req.num_tokens
    req.status = SimpleNamespace(name="FINISHED_STOPPED")
    seq_before = half.dp.next_seq
    assert half.request_finished(req) == (False, None)
    assert half.dp.next_seq == seq_before
    assert half.build_connector_meta(Group.empty_step()).fence == -1


@pytest.mark.parametrize("status", ["FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED",
                                    "FINISHED_REPETITION"])
def test_a_request_stopped_by_its_steps_output_saves_that_steps_blocks(
        group: Group, status: str) -> None:
    """vLLM decides these finishes on a step's sampled tokens, in ``update_from_output``, and
    calls ``request_finished`` before that step's connector output comes back: the forward is
    done, so the last save covers what it computed. ``FINISHED_REPETITION`` (vLLM's repetition
    detection, ``check_stop``) was missing from that list: such a request's last step was
    never saved (a save of 0 blocks here)."""
    half = group.half
    req = _scheduled(half, _request("stop", 9, 6))
    req.num_computed_tokens = req.num_tokens  # the step ran; its output is not in yet
    req.status = SimpleNamespace(name=status)
    half.request_finished(req)
    assert half.wait_idle(10.0)
    assert half.snapshot()["saved_blocks"] == 6
    half.update_connector_output(())  # the step's output, after the finish: nothing more
    half.cm.check_invariants()
