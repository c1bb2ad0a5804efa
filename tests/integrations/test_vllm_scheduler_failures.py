"""Scheduler-half paths no test pinned (a mutation review: each could break with every test
green): a step whose load failed confirms nothing; a preempted request's save fences the next
forward; rejected drafts never complete a block; two steps without output do not shift
the outputs after them. Real worker process (the Group harness)."""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace
from typing import Any

from tests.integrations.test_vllm_rank_loss import BS, DOC, Group


def _req(rid: str, tokens: list[int]) -> Any:
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=list(tokens), all_token_ids=list(tokens),
        num_tokens=len(tokens), num_prompt_tokens=len(tokens), num_computed_tokens=0,
        status=SimpleNamespace(name="RUNNING"), lora_request=None, cache_salt=None,
        mm_features=[])


def _scheduled(group: Group) -> tuple[Any, list[int]]:
    """A new request, matched (nothing cached) and allocated 9 blocks."""
    req = group.request()
    assert group.ask_until_matched(req)[0] == 0
    blocks = list(range(9))
    group.half.update_state_after_alloc(req, blocks, 0)
    return req, blocks


def test_a_step_with_a_failed_load_in_the_requests_blocks_confirms_nothing(group: Group) -> None:
    half = group.half
    req, blocks = _scheduled(group)
    step = half.build_connector_meta(Group.step(req, blocks, 0)).step
    half.update_connector_output({blocks[3]}, step=step)  # vLLM: block 3's KV is not valid
    half.build_connector_meta(Group.output(cached=[(req, None, 3 * BS, 1)]))
    assert half.wait_idle(10.0)
    assert half.snapshot()["saved_blocks"] == 0, "saved blocks vLLM said were invalid"
    assert half.counters()["failed_load_blocks"] == 1


def test_a_preempted_requests_save_in_flight_fences_the_next_forward(group: Group) -> None:
    half = group.half
    req, blocks = _scheduled(group)
    with half._lock:
        step = half.build_connector_meta(Group.step(req, blocks, 0)).step
        half.update_connector_output((), step=step)  # 8 blocks confirmed: a save planned
    os.kill(group.proc.pid, signal.SIGSTOP)  # the save's batch stays in flight
    try:
        req.num_computed_tokens = req.num_tokens
        half.build_connector_meta(Group.output(cached=[(req, None, req.num_tokens, 1)]))
        save = half.dp.next_seq - 1
        assert half._reqs[req.request_id].last_save_seq == save
        # vLLM preempts it in the next schedule(): its blocks may be reused by this forward
        meta = half.build_connector_meta(Group.output(preempted={req.request_id}))
        assert meta.fence == save, "the forward may overwrite blocks the save still reads"
    finally:
        os.kill(group.proc.pid, signal.SIGCONT)
    assert half.wait_idle(10.0)


def test_rejected_drafts_never_make_a_block_full(group: Group) -> None:
    """Speculative decoding: a step computes KV for drafts; vLLM rolls rejected ones back.
    The last token (sampled) has no KV yet, so a block it completes is not saved."""
    half = group.half
    tokens = DOC[: 8 * BS - 3]  # 125 tokens: 7 full blocks and 13
    req = _req("spec", tokens)
    assert group.ask_until_matched(req)[0] == 0
    blocks = list(range(9))
    half.update_state_after_alloc(req, blocks, 0)
    step = half.build_connector_meta(Group.step(req, blocks, 0)).step
    req.all_token_ids.append(1)  # sampled
    req.num_tokens = len(req.all_token_ids)
    half.update_connector_output((), step=step)
    req.num_computed_tokens = len(tokens)
    # decode: 1 token + 4 drafts scheduled (positions 125..129)
    step = half.build_connector_meta(Group.output(cached=[(req, None, len(tokens), 5)])).step
    assert half.wait_idle(10.0)  # the first 7 blocks' save committed
    req.all_token_ids += [2, 3]  # one draft accepted, then the bonus token at 127
    req.num_tokens = len(req.all_token_ids)  # 128: token 127 has no KV of its own
    half.update_connector_output((), step=step)
    half.build_connector_meta(Group.output(cached=[(req, None, 127, 1)]))
    assert half.wait_idle(10.0)
    assert half.snapshot()["saved_blocks"] == 7, half.snapshot()["saved_blocks"]


def test_two_steps_without_output_do_not_shift_later_outputs(group: Group) -> None:
    half = group.half
    half.build_connector_meta(Group.empty_step())
    half.build_connector_meta(Group.empty_step())
    req = group.request()
    half.get_num_new_matched_tokens(req, 0)
    blocks = list(range(10, 19))
    half.update_state_after_alloc(req, blocks, 0)
    step = half.build_connector_meta(Group.step(req, blocks, 0)).step
    half.update_connector_output((), step=step)
    assert half.in_flight()["steps"] == 0
    half.build_connector_meta(Group.output(cached=[(req, None, req.num_tokens, 1)]))
    assert half.wait_idle(10.0)
    assert half.snapshot()["saved_blocks"] == 8
