"""vLLM's own Scheduler drives zkv's connector, as a synchronous engine does, with the worker
halves in the same child process over CPU KV tensors and a fake forward that checks every KV
slot it reads holds the KV of its own token's prefix, on its rank, in its layer
(``tests/integrations/driven.py``). What the unit tests of the halves take on trust is
checked end to end here: the calls come in vLLM's order with vLLM's arguments, vLLM's block
pool and prefix cache decide what is computed, loaded, preempted and freed, and a byte zkv
moves to the wrong place, at the wrong time or from the wrong block is a mismatch.

All runs share one child process (vLLM's import is most of its ~10 s); seeds are fixed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.integrations.child import ROOT
from tests.integrations.driven import BS, LAG_S  # (it imports vLLM only in the child)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM's CPU build: pip install -e '.[vllm]'")

CHILD_TIMEOUT_S = 180
RUNS: list[dict[str, Any]] = [
    {"name": "workload", "scenario": "workload", "args": {"seed": 1}},
    {"name": "workload_aborts", "scenario": "workload", "args": {"seed": 2, "abort_p": 0.1}},
    {"name": "workload_tp2", "scenario": "workload", "args": {"seed": 3, "tp": 2}},
    {"name": "chained", "scenario": "chained", "args": {"tp": 1}},
    {"name": "chained_tp2", "scenario": "chained", "args": {"tp": 2}},
    {"name": "held_by_another", "scenario": "held_by_another", "args": {"tp": 1}},
    {"name": "held_by_another_tp2", "scenario": "held_by_another", "args": {"tp": 2}},
    {"name": "reset_reuse_same_id", "scenario": "reset_reuse", "args": {"new_id": "X"}},
    {"name": "reset_reuse_other_id", "scenario": "reset_reuse", "args": {"new_id": "Y"}},
]
NOTHING_IN_FLIGHT = {"requests": 0, "held": 0, "cache_requests": 0, "ops": 0, "batches": 0,
                     "steps": 0, "store_retry": 0}


@pytest.fixture(scope="module")
def driven() -> dict[str, Any]:
    """Every run's result (``{name: result}``), from one child process."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.driven", json.dumps({"runs": RUNS})],
        cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _result(driven: dict[str, Any], name: str) -> dict[str, Any]:
    res: dict[str, Any] = driven[name]
    assert "error" not in res, res["error"]
    return res


def _assert_clean_end(res: dict[str, Any]) -> None:
    """Every request ran out; vLLM got every block back; zkv has nothing in flight and its
    pools and tree agree; no slot read held another prefix's KV; no load failed."""
    assert res["idle"] and res["settled"], res
    assert res["num_mismatched_slots"] == 0, res["mismatches"]
    assert res["load_error_blocks"] == []
    assert res["free_blocks"] == res["usable_blocks"], "vLLM blocks leaked"
    assert res["in_flight"] == NOTHING_IN_FLIGHT
    assert res["invariants"] == "ok"


@pytest.mark.parametrize("name", ["workload", "workload_aborts", "workload_tp2"])
def test_a_shared_prefix_workload_on_a_tight_cache_reads_only_its_own_kv(
        driven: dict[str, Any], name: str) -> None:
    """40 requests over 4 documents that share a system prompt, on 12 vLLM blocks and 24
    host blocks per rank: vLLM evicts and preempts, zkv saves, evicts host blocks and loads
    back into vLLM's blocks, and every slot any forward reads holds its own prefix's KV.
    Later requests of a document got external hits (zkv's loads), and at the end nothing
    leaked on either side."""
    res = _result(driven, name)
    _assert_clean_end(res)
    c = res["counters"]
    assert c["saved_blocks"] > 0 and c["cm_evicted_host"] > 0, c
    assert c["loaded_blocks"] > 0 and c["zkv_host_tokens"] > 0, c
    assert sum(n > 0 for n in res["repeat_ext"]) > 0, res["repeat_ext"]
    assert c["failed_load_blocks"] == 0 and c["cm_failed_ops"] == 0, c


@pytest.mark.parametrize("name", ["chained", "chained_tp2"])
def test_a_finish_past_its_own_save_in_flight_chains_the_rest_and_keeps_no_block(
        driven: dict[str, Any], name: str) -> None:
    """``first`` (3 blocks and 5 tokens) finishes while the save of its first chunk is in
    flight (stalled on the last rank): the save of its last block goes out at once, chained
    under that one, so ``request_finished`` keeps nothing (False) and vLLM frees all 4
    blocks. In the next step ``filler`` takes two of them, ``first``'s block 2 among them,
    and writes them: its forward waited (the fence) until the stalled save and the chained
    one had read them, so the same prompt, after vLLM's own cache was reset, loads all 3
    blocks ``first`` computed from zkv and reads its own KV in each. And vLLM's cache reset
    with zkv's right after such a finish (``second``) succeeds: it failed while zkv kept a
    finished request's blocks."""
    res = _result(driven, name)
    assert res["save_stalled"] and res["stalled_saves"] == 2, res
    assert res["finished"]["first"] is False and res["at_finish"]["held"] == 0, res
    assert res["at_finish"]["batches"] == 2, "chunk 1's save and the chained one in flight"
    assert res["free_at_finish"] == 4, "vLLM freed first's 4 blocks"
    assert res["finish_blocks"]["first"][2] in res["filler_blocks"], res
    assert res["fence_wait_s"] >= LAG_S / 2, "filler's forward did not wait for the saves"
    assert res["first_idle"] and res["first_settled"], res
    assert res["vllm_cache_reset"] and res["again_idle"], res
    assert res["first"]["again"] == [3 * BS + 5, 3 * BS], res["first"]
    assert res["again_ext"] == 3 * BS and res["counters"]["loaded_blocks"] == 3, res
    assert res["second_stalled"] and res["finished"]["second"] is False, res
    assert res["second_in_flight"] == 2 and res["reset_after_finish"], res
    assert res["second_idle"] and res["sent"] == {}, "no finish was held"
    _assert_clean_end(res)


@pytest.mark.parametrize("name", ["held_by_another", "held_by_another_tp2"])
def test_a_finish_stopped_at_another_requests_save_keeps_its_blocks_until_saved(
        driven: dict[str, Any], name: str) -> None:
    """``other`` (2 blocks and 5 tokens) and ``held`` (those 2 blocks, a third and 5
    tokens) run and finish in one step, ``held`` on ``other``'s 2 blocks (vLLM's own prefix
    hit on blocks computed in that very step); ``other``'s save of them is taken first,
    stalled on the last rank, and ``held``'s final save stops at it: ``request_finished``
    holds its 4 blocks (True; ``filler`` waits for them). It is not let go while that save
    is in flight; once that one committed, its block 2 is saved in a later batch, and
    ``get_finished`` reports it sent only once that batch ran (stalled in turn: vLLM keeps
    the blocks meanwhile). The same prompt, after vLLM's own cache was reset, loads all 3
    blocks ``held`` computed from zkv and reads its own KV in each."""
    res = _result(driven, name)
    assert res["save_stalled"] and res["stalled_saves"] == 2, res
    assert res["scheduled"] == {"other": 2 * BS + 5, "held": BS + 5}, res
    assert res["first"]["held"] == [3 * BS + 5, 2 * BS], "held's prefix hit on other's"
    assert res["finished"]["other"] is False and res["finished"]["held"] is True, res
    assert res["held_at_finish"] == 1 and res["free_at_finish"] == 1, "vLLM kept held's 4"
    assert res["let_go_while_other_in_flight"] == [], "let go before other's save ran"
    assert res["other_saved"] and res["free_while_held"] == 1, res
    assert res["let_go_seq"] is not None and res["let_go_seq"] > res["other_seq"], res
    assert not res["sent_while_stalled"], "reported sent before its own save ran"
    assert not res["filler_ran_while_stalled"] and res["free_while_stalled"] == 1, res
    assert "held" in res["sent"] and res["held_idle"] and res["held_settled"], res
    assert res["vllm_cache_reset"] and res["again_idle"], res
    assert res["first"]["again"] == [3 * BS + 5, 3 * BS], res["first"]
    assert res["again_ext"] == 3 * BS and res["counters"]["loaded_blocks"] == 3, res
    _assert_clean_end(res)


def test_a_reset_preemption_of_an_aborted_request_is_not_its_ids_next_request(
        driven: dict[str, Any]) -> None:
    """vLLM names a request a cache reset preempted in the next schedule's
    ``preempted_req_ids``; when it was aborted before that schedule and a new request came
    under its id (a client's own ids), the mention is the old request's. It ended the new
    one's tracking: none of its blocks was saved (3 under another id)."""
    same, other = _result(driven, "reset_reuse_same_id"), _result(driven, "reset_reuse_other_id")
    for res in (same, other):
        assert res["reset"] and res["new_ext"] == 3 * BS, res  # matched and loaded: 3 blocks
        assert res["tracked"] and res["preempted"] == 0, res
        _assert_clean_end(res)
    assert same["saved_by_new"] == other["saved_by_new"] == 3
