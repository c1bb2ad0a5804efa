"""vLLM's streaming-input sessions (a ``resumable`` request) under async scheduling: what
zkv saves stays within vLLM's own safe frontier (``num_computed_tokens -
num_output_placeholders``, what vLLM's prefix cache takes).

When a turn stops, vLLM (``v1/core/sched/scheduler.py``: ``_handle_stopped_request``,
``_update_request_as_session``) sets ``num_computed_tokens`` to that frontier, replaces the
stop token by the next chunk's tokens and recomputes from there; the step it scheduled
before it saw the stop computed KV for the stop token at that position, and its output
still reaches ``update_connector_output``. Confirming that step saved the stop token's KV
under the hash of the chunk's token (a block ending at that position: about one turn in
``block_size``), for any later request with that history to load."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.integrations.test_vllm_rank_loss import BS, DOC, Group


class SessionRequest:
    """The fields the scheduler half reads, with vLLM's async-scheduling counters."""

    def __init__(self, rid: str, prompt: list[int]) -> None:
        self.request_id = rid
        self.prompt_token_ids = list(prompt)
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.status = SimpleNamespace(name="RUNNING")
        self.lora_request = None
        self.cache_salt = None
        self.mm_features: list[Any] = []
        self.kv_transfer_params = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def saved(g: Group) -> int:
    assert g.half.wait_idle(10.0)
    return int(g.half.snapshot()["saved_blocks"])


def test_a_stopped_turns_leftover_step_saves_nothing_past_the_safe_frontier(group: Group) -> None:
    h = group.half
    prompt = DOC + list(range(500, 514))  # 142 tokens: 8 full blocks and 14
    assert len(prompt) + 1 == 9 * BS - 1  # the stop token comes last in block 8
    req = SessionRequest("sess", prompt)
    assert h.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = list(range(12))
    h.update_state_after_alloc(req, blocks, 0)
    h.build_connector_meta(group.output(new=[(req, blocks, 0, 142)]))  # step 1: the prompt
    req.num_output_placeholders += 1
    h.build_connector_meta(group.output(cached=[(req, None, 142, 1)]))  # step 2 (async)
    req.num_output_placeholders += 1
    req.all_token_ids.append(900)  # output 1: token 142
    req.num_output_placeholders -= 1
    h.update_connector_output((), step=1)
    h.build_connector_meta(group.output(cached=[(req, None, 143, 1)]))  # step 3: position 143
    req.num_output_placeholders += 1
    assert saved(group) == 8
    # output 2: token 143 is the stop token; the next chunk is queued, so vLLM resumes
    # the session at once: back to the safe frontier, the stop token replaced by the chunk
    req.all_token_ids.append(901)
    req.num_output_placeholders -= 1
    req.num_computed_tokens -= req.num_output_placeholders
    req.num_output_placeholders = 0
    del req.all_token_ids[143:]
    req.all_token_ids += list(range(700, 710))
    req.prompt_token_ids = list(req.all_token_ids)
    req.num_prompt_tokens = req.num_tokens
    h.update_connector_output((), step=2)
    # step 4 schedules another request alone (the session waits for budget); the output
    # of step 3 (the stop token's KV at position 143) comes
    other = SessionRequest("other", [5] * 20)
    h.get_num_new_matched_tokens(other, 0)
    h.update_state_after_alloc(other, [20, 21], 0)
    h.build_connector_meta(group.output(new=[(other, [20, 21], 0, 20)]))  # step 4
    h.update_connector_output((), step=3)
    # step 5: the session resumes and recomputes position 143; a save of block 8 in this
    # step's batch would read the stop token's KV (a gated worker runs it before forward 5)
    h.build_connector_meta(group.output(new=[(req, blocks, 143, 10)]))  # step 5
    assert saved(group) == 8  # not the session's block 8 (the other's comes at step 6)
    h.update_connector_output((), step=4)
    req.all_token_ids.append(902)  # output 5
    h.update_connector_output((), step=5)
    h.build_connector_meta(group.output())  # step 6: block 8, recomputed, is saved now,
    assert saved(group) == 8 + 1 + 1  # and the other request's block
