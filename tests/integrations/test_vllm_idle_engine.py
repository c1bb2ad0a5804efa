"""An idle engine's last saves reach L3 without another call from vLLM (the scheduler
half's pump), against a real worker process and a real ``file://`` store.

vLLM calls nothing while its engine is idle. Before the pump, the acks of a finished
request's saves waited for the next request, and the L3 writes that follow them with
them: another engine sharing the store (a P/D decode instance, the next turn routed
elsewhere) found none of the blocks.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from tests.integrations.test_vllm_rank_loss import BS, DOC, Group
from tests.waiting import holds_within, wait_until
from tests.worker.helpers import short_ipc_dir
from zkv.scheduler.hashing import ROOT_HASH, hash_tokens
from zkv.storage import leading_present

DEADLINE_S = 10.0


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    with short_ipc_dir() as folder:
        g = Group(folder, store_url=f"file://{tmp_path / 'l3'}")
        try:
            yield g
        finally:
            g.close()


def _until(what: Callable[[], bool]) -> bool:
    return holds_within(what, DEADLINE_S, interval=0.01)  # the pump's pace is milliseconds


def test_a_finished_requests_blocks_reach_l3_with_no_further_call(group: Group) -> None:
    hashes = hash_tokens(DOC, BS, parent=ROOT_HASH)
    assert len(hashes) == 8
    group.compute_and_save(wait=False)  # then vLLM calls nothing: the engine is idle
    assert group.store is not None
    assert _until(lambda: leading_present(group.store, hashes, 1) == 8), \
        f"{leading_present(group.store, hashes, 1)} of 8 blocks in L3 while idle"
    # and nothing is left in flight: the gauges an operator reads settle too
    assert _until(lambda: group.half.in_flight()["batches"] == 0)
    assert group.half.in_flight()["ops"] == 0
    snap = group.half.snapshot()
    assert snap["saved_blocks"] == 8 and snap["cm_stored"] == 8, snap


def test_the_pump_leaves_loads_to_the_step(group: Group) -> None:
    """A load travels in its step's batch (the forward waits on that batch's seq), never
    in the pump's: while a save is in flight (the worker frozen) and vLLM has called
    nothing for a while, the load planned for the next step stays for it."""
    group.compute_and_save()  # DOC's blocks in the host pool
    other = group.request()  # another document, computed, its save in flight
    other.prompt_token_ids = other.all_token_ids = [t + 1 for t in DOC] + [0]
    ext, _ = group.half.get_num_new_matched_tokens(other, 0)
    assert ext == 0
    group.half.update_state_after_alloc(other, list(range(40, 49)), 0)
    group.half.build_connector_meta(group.step(other, list(range(40, 49)), 0))
    group.half.update_connector_output(())
    os.kill(group.proc.pid, signal.SIGSTOP)
    try:
        other.num_computed_tokens, other.status = other.num_tokens, NS(name="FINISHED_STOPPED")
        group.half.request_finished(other)
        assert group.half.in_flight()["batches"] >= 1
        req = group.request()
        ext, _ = group.half.get_num_new_matched_tokens(req, 0)
        assert ext == 8 * BS
        blocks = list(range(20, 29))
        group.half.update_state_after_alloc(req, blocks, ext)
        batches = group.half.in_flight()["batches"]  # idle, a batch in flight: the pump's
        # turn, many times over, and it publishes no batch (the load's)
        assert not holds_within(lambda: group.half.in_flight()["batches"] > batches, 0.1)
    finally:
        os.kill(group.proc.pid, signal.SIGCONT)
    meta = group.half.build_connector_meta(group.step(req, blocks, ext))
    assert meta.loads == blocks[:8] and not meta.unloaded
    assert group.half.wait_idle(10.0)


def test_l3_writes_opened_by_an_engine_call_are_published_once_it_is_idle(group: Group
                                                                          ) -> None:
    """The save's ack committed by one of vLLM's calls, not by the pump: the L3 writes it
    opens wait for no step (vLLM's last call of a request publishes nothing more)."""
    hashes = hash_tokens(DOC, BS, parent=ROOT_HASH)
    group.compute_and_save(wait=False)

    def acked() -> bool:  # vLLM calls, ~every ms
        group.half.update_connector_output(())
        return group.half.snapshot()["cm_saved_external"] >= 8

    wait_until(acked, DEADLINE_S, "the save's ack", interval=0.001)
    assert group.half.in_flight()["batches"] == 0  # committed by that call: the pump idle
    assert _until(lambda: leading_present(group.store, hashes, 1) == 8), \
        f"{leading_present(group.store, hashes, 1)} of 8 blocks in L3 while idle"


def test_a_save_notes_the_batch_that_carries_it_not_the_pumps(group: Group) -> None:
    """The pump publishes storage ops alone; a save planned meanwhile waits for the step's
    batch, and the request notes that batch as its save's: once vLLM frees its blocks the
    next forward is fenced on it. Before, any publish stamped every request with a save
    planned since the last one: the pump's h2s batch took the stamp and the save's own
    batch none, so the finished request fenced the next forward on the earlier h2s batch
    (or on nothing, once that one was acked), and an ungated worker could run that forward
    beside the save still reading the freed blocks."""
    half = group.half
    req = group.request()
    assert group.ask_until_matched(req)[0] == 0
    blocks = list(range(9))
    half.update_state_after_alloc(req, blocks, 0)
    rest = req.num_tokens - 4 * BS
    with half._lock:  # vLLM's calls back to back: the pump keeps out
        step = half.build_connector_meta(Group.output(new=[(req, blocks, 0, 4 * BS)])).step
        half.update_connector_output((), step=step)  # blocks 0-3 confirmed: a save planned
        req.num_computed_tokens = 4 * BS
        step = half.build_connector_meta(Group.output(cached=[(req, None, 4 * BS, rest)])).step
        first_save = half.dp.next_seq - 1
        assert half._reqs[req.request_id].last_save_seq == first_save
        assert half.wait_idle(DEADLINE_S)  # its ack committed: the h2s of blocks 0-3 opens
        half.update_connector_output((), step=step)  # blocks 4-7 confirmed: a save planned
        req.num_computed_tokens = req.num_tokens
        pumped = half.dp.next_seq
    # vLLM quiet: the pump publishes the h2s, and the save stays for the step's batch
    wait_until(lambda: half.dp.next_seq > pumped, DEADLINE_S, "the pump's batch")
    with half._lock:  # (the pump's publish done)
        assert half._reqs[req.request_id].last_save_seq == first_save
    os.kill(group.proc.pid, signal.SIGSTOP)  # the save's batch stays in flight
    try:
        half.build_connector_meta(Group.output(cached=[(req, None, req.num_tokens, 1)]))
        save = half.dp.next_seq - 1
        assert save == pumped + 1
        assert half._reqs[req.request_id].last_save_seq == save
        req.status = NS(name="FINISHED_LENGTH_CAPPED")
        half.request_finished(req)  # vLLM frees the blocks the save reads
        assert half.build_connector_meta(Group.empty_step()).fence == save
    finally:
        os.kill(group.proc.pid, signal.SIGCONT)
    assert half.wait_idle(DEADLINE_S)
    assert half.snapshot()["saved_blocks"] == 8
