"""A finishing request whose final save stops at an op in flight on its path: vLLM keeps
its blocks (``request_finished`` says True) until the rest is saved, then the step's
metadata lets it go and the worker halves report it (``zkv/integrations/vllm/held.py``).
A scheduler half against a real worker process (``test_vllm_rank_loss.Group``); the
worker is SIGSTOPped while the request finishes so that the save on its path is surely in
flight. Before, the rest of its blocks was never saved (a miss for every later request
that shares them); only a P/D producer's finish waited for the acks."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from tests.integrations.test_vllm_rank_loss import BS, DOC, Group
from tests.waiting import wait_until
from zkv.integrations.vllm.held import HeldFinishes, SaveReports
from zkv.integrations.vllm.records import ZkvMetadata


def _prompt(group: Group, rid: str, tokens: list[int]) -> Any:
    req = group.request()
    req.request_id = rid
    req.prompt_token_ids = req.all_token_ids = tokens
    req.num_tokens = req.num_prompt_tokens = len(tokens)
    return req


def _done(req: Any) -> None:
    req.num_computed_tokens = req.num_tokens
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")


@contextmanager
def _worker_stopped(group: Group) -> Iterator[None]:
    os.kill(group.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(group.proc.pid, signal.SIGCONT)


def _steps_until_let_go(group: Group, rid: str) -> tuple[int, int]:
    """Empty steps (vLLM steps on while it holds a finished request's blocks) until one's
    metadata lets ``rid`` go: (the seq of its last save, steps taken)."""
    metas: list[ZkvMetadata] = []

    def let_go() -> bool:
        metas.append(group.half.build_connector_meta(group.empty_step()))
        group.half.update_connector_output(())
        return any(r == rid for r, _ in metas[-1].finish_after)

    wait_until(let_go, 10, f"{rid} let go")
    [seq] = [s for r, s in metas[-1].finish_after if r == rid]
    return seq, len(metas)


def test_two_requests_of_one_prefix_finishing_in_one_step_save_all_they_computed(
        group: Group) -> None:
    """Both are prefilled in one step and finish in it: a's save of the shared 4 blocks is
    in flight when b's final save reaches them. b is held, saved on once a's save acked,
    and let go with the seq of the batch that carried its last save."""
    half = group.half
    shared = DOC[: 4 * BS]
    a = _prompt(group, "a", [*shared, *range(1000, 1000 + 4 * BS), 7])
    b = _prompt(group, "b", [*shared, *range(2000, 2000 + 4 * BS), 7])
    for req in (a, b):
        assert group.ask_until_matched(req)[0] == 0
    half.update_state_after_alloc(a, list(range(0, 9)), 0)
    half.update_state_after_alloc(b, list(range(10, 19)), 0)
    half.build_connector_meta(group.output(new=[
        (a, list(range(0, 9)), 0, a.num_tokens), (b, list(range(10, 19)), 0, b.num_tokens)]))
    _done(a)
    _done(b)
    with _worker_stopped(group):
        assert half.request_finished(a)[0] is False  # its whole save went out
        assert half.request_finished(b)[0] is True  # stopped at a's: vLLM keeps its blocks
    assert half.in_flight()["held"] == 1
    half.update_connector_output(())
    seq, _ = _steps_until_let_go(group, "b")
    assert seq >= 0 and half.wait_idle(10.0)
    assert half.snapshot()["saved_blocks"] == 4 + 4 + 4
    assert half.in_flight()["held"] == 0 and half.in_flight()["cache_requests"] == 0


def test_a_chunked_request_saves_its_last_chunk_chained_not_held(group: Group) -> None:
    """Chunked prefill: the first chunk's save goes out with the second step's batch, and
    the request finishes in that step while that save is in flight: its final save goes
    on past it (chained: the workers run it after), vLLM frees the blocks at once, and
    the next step's forward is fenced until that save ran. (Before: held, so that vLLM
    kept the blocks for steps more, and a cache reset in between failed.)"""
    half = group.half
    req = _prompt(group, "c", [*DOC, 7])
    assert group.ask_until_matched(req)[0] == 0
    blocks = list(range(9))
    half.update_state_after_alloc(req, blocks, 0)
    half.build_connector_meta(group.output(new=[(req, blocks, 0, 4 * BS)]))
    req.num_computed_tokens = 4 * BS
    half.update_connector_output(())  # chunk 1 confirmed: its save is planned
    with _worker_stopped(group):
        half.build_connector_meta(group.output(
            cached=[(req, None, 4 * BS, req.num_tokens - 4 * BS)]))  # that save's batch
        _done(req)
        assert half.request_finished(req)[0] is False
        assert half.in_flight()["held"] == 0
        last = half.dp.next_seq - 1  # the batch of the chained save
        half.update_connector_output(())
        assert half.build_connector_meta(group.empty_step()).fence == last
    assert half.wait_idle(10.0)
    assert half.snapshot()["saved_blocks"] == 8


def test_a_finish_whose_save_stops_for_good_is_not_held(group: Group) -> None:
    """Nothing in flight on its path: its save is whole (or stops where host blocks run
    out, for good), and vLLM frees its blocks at once, as before."""
    half = group.half
    req = _prompt(group, "d", [*DOC, 7])
    assert group.ask_until_matched(req)[0] == 0
    half.update_state_after_alloc(req, list(range(9)), 0)
    half.build_connector_meta(group.output(new=[(req, list(range(9)), 0, req.num_tokens)]))
    _done(req)
    assert half.request_finished(req)[0] is False
    assert half.in_flight()["held"] == 0


def test_save_reports_come_once_the_batch_ran_or_after_the_timeout() -> None:
    """A worker half's side: an id is reported once ``ran`` says its batch ran here (seq
    -1: at once), or after ``timeout_s`` with its saves given up; each once."""
    reports = SaveReports()
    reports.add([("now", -1), ("s5", 5), ("s9", 9)], now=0.0)
    ran_upto = [4]
    given_up: list[int] = []

    def take(now: float) -> set[str] | None:
        return reports.take(lambda seq: seq <= ran_upto[0], 2.0, given_up.append, now=now)

    assert take(0.1) == {"now"}
    assert take(0.2) is None
    ran_upto[0] = 5
    assert take(0.3) == {"s5"}
    assert take(2.5) == {"s9"} and given_up == [9]
    assert take(3.0) is None and len(reports) == 0


def test_held_finishes_let_go_what_waits_no_more_in_order() -> None:
    held = HeldFinishes()
    rs = [SimpleNamespace(request=SimpleNamespace(request_id=f"r{i}"), last_save_seq=s)
          for i, s in enumerate((3, None, 7))]
    for r in rs:
        held.hold(r)  # type: ignore[arg-type]
    finished: list[str] = []
    assert held.release(lambda r: r is rs[2], finished.append) == [("r0", 3), ("r1", -1)]
    assert finished == ["r0", "r1"] and len(held) == 1 and held.get("r2") is rs[2]
