"""A request aborted before any step that scheduled it came back saves the blocks of
vLLM's own prefix hit, which another request's forward may still be writing.

vLLM caches a request's blocks when it *allocates* them (``allocate_slots`` ->
``cache_blocks(num_computed + num_new)``), so a second request scheduled in the same
step (or, under async scheduling, in the next one, while the first forward still runs)
gets a prefix hit on blocks whose KV is not written yet. zkv's ``_after_alloc`` sets
``confirmed = local + ext`` at once, and ``request_finished`` of an aborted request
saves up to ``confirmed``: a d2h of those blocks is published at once, and saves are not
gated on the worker (they run as they arrive). The save reads KV no forward wrote yet
and zkv keeps it under the prefix's hashes (then L3): later requests load wrong KV.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integrations.test_vllm_rank_loss import BS, Group


@pytest.mark.parametrize("status", ["FINISHED_ABORTED", "FINISHED_ERROR"])
def test_finish_before_first_output_saves_no_unwritten_block(group: Group, status: str) -> None:
    """FINISHED_ABORTED: a client disconnect while forward N runs (async scheduling).
    FINISHED_ERROR: kv_load_failure_policy=fail; A's load failed in step N, so A's blocks
    4.. were computed over garbage; vLLM finishes both A and B (which shares them) before
    update_connector_output(N), also under synchronous scheduling."""
    h = group.half
    a, b = group.request(), group.request()
    # step N: A computes DOC (8 blocks); vLLM caches A's blocks at allocation, so B,
    # scheduled in the same step, gets a local hit on them (not written yet)
    assert h.get_num_new_matched_tokens(a, 0) == (0, False)
    blocks_a = list(range(9))
    h.update_state_after_alloc(a, blocks_a, 0)
    assert h.get_num_new_matched_tokens(b, 8 * BS) == (0, False)
    blocks_b = blocks_a[:8] + [20]
    h.update_state_after_alloc(b, blocks_b, 0)
    h.build_connector_meta(Group.output(new=[(a, blocks_a, 0, a.num_tokens),
                                             (b, blocks_b, 8 * BS, 1)]))
    # forward N still runs (async scheduling); the client of B disconnects
    seq_before = h.dp.next_seq
    b.status = SimpleNamespace(name=status)
    h.request_finished(b)
    assert h.wait_idle(10.0)
    assert h.dp.next_seq == seq_before and h.snapshot()["saved_blocks"] == 0, (
        "a request finished before its first output saved blocks no output confirmed")
    # once forward N is done, A's blocks are saved as usual
    h.update_connector_output((), step=1)
    h.build_connector_meta(Group.empty_step())
    assert h.wait_idle(10.0)
    assert h.snapshot()["saved_blocks"] == 8
