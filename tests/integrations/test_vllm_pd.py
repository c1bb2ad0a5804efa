"""P/D over the store: a producer's scheduler half promises its prompt blocks in vLLM's
kv_transfer_params, and the consumer's half waits for them rather than computing what is
still being written. Two halves, two real worker processes, one real ``file://`` store.

vLLM's P/D proxies send ``kv_transfer_params: {"do_remote_decode": true}`` with the
prefill request and hand what the prefill instance answered to the decode instance.
Without a promise the decode instance asked the store the moment the request came, while
the producer's writes were still in flight, found nothing and computed the whole prompt.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integrations.conftest import two_engines_on_one_store
from tests.integrations.test_vllm_rank_loss import BS, DOC, LAYOUT, Group
from tests.waiting import wait_until
from tests.worker.helpers import short_ipc_dir
from zkv.integrations.vllm import pd
from zkv.integrations.vllm.events import AWAIT_EXPIRED
from zkv.integrations.vllm.pd import PARAM_BLOCKS, PARAM_NAMESPACE
from zkv.integrations.vllm.scheduler import EMPTY_STEP_WAIT_S
from zkv.storage import namespaces

AWAIT_MS = 300  # the consumer's longest wait (prefetch_max_ms)
ASK = {"do_remote_decode": True}  # what a P/D proxy sends the prefill instance


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Group, Group]]:
    with two_engines_on_one_store(tmp_path, {"prefetch_max_ms": AWAIT_MS}) as both:
        yield both


def test_a_producer_promises_its_prompt_blocks_when_asked(pair: tuple[Group, Group]) -> None:
    producer, other = pair
    assert other.compute_and_save() is None  # a plain request: no kv_transfer_params
    answer = producer.compute_and_save(params=ASK)
    assert answer is not None and answer[PARAM_BLOCKS] == 8, answer
    assert answer[PARAM_NAMESPACE] == producer.half._namespace


def test_a_producer_promises_only_the_blocks_it_saved(tmp_path: Path) -> None:
    """A host pool of 5 blocks for a prompt of 8: the save stops where no host block is
    free, and the answer promises the 5 blocks saved. Before, it promised what the request
    had computed (8): the consumer waited its whole budget for 3 blocks that never came."""
    with short_ipc_dir() as folder:
        producer = Group(folder, store_url=f"file://{tmp_path / 'l3'}",
                         layout=dataclasses.replace(LAYOUT, num_host_blocks=5))
        try:
            answer = producer.compute_and_save(wait=False, params=ASK)
            assert producer.half.wait_idle(10.0)
            assert producer.half.snapshot()["saved_blocks"] == 5
            assert answer == {PARAM_BLOCKS: 5, PARAM_NAMESPACE: producer.half._namespace}
        finally:
            producer.close()


def test_a_producer_whose_store_declines_writes_promises_nothing(tmp_path: Path) -> None:
    """The store takes no write (a file where its directory goes: down, or full, alike):
    once a write failed, the producer promises nothing, rather than every consumer request
    waiting its whole budget for blocks that never come."""
    blocker = tmp_path / "l3"
    blocker.write_text("a file where the store's directory goes")
    with short_ipc_dir() as folder:
        producer = Group(folder, store_url=f"file://{blocker}")
        try:
            first = producer.compute_and_save(params=ASK)  # no write was tried before it
            assert first is not None and first[PARAM_BLOCKS] == 8, first
            wait_until(lambda: producer.half.in_flight()["store_retry"] > 0, 10.0,
                       "the failed write waiting for its retry")
            producer.half.reset()  # a prompt zkv holds nothing of (a new generation)
            assert producer.compute_and_save(params=ASK) is None
        finally:
            producer.close()


def _block_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name != namespaces.MARK]


def test_a_producer_writes_again_what_its_store_lost_before_it_promises_it(
        pair: tuple[Group, Group], tmp_path: Path) -> None:
    """A prompt the producer's host pool still holds, whose files the store lost since
    (evicted under other writes, or a store restarted empty): a block is not checked
    again after its write, so the next prefill of that prompt adopted the host blocks,
    wrote nothing and promised all 8. Every consumer of the prompt waited its whole
    budget, then computed it. The producer asks the store at the finish now (one
    existence query), writes again what it lacks, and that promise is kept."""
    producer, consumer = pair
    assert producer.compute_and_save(params=ASK) is not None
    store = tmp_path / "l3"
    wait_until(lambda: len(_block_files(store)) == 8, 10.0, "the prompt's 8 blocks stored")
    for f in _block_files(store):
        f.unlink()  # the store lost them; the producer's host pool still has them
    req = producer.request()
    req.kv_transfer_params = ASK
    ext, _ = producer.ask_until_matched(req)
    assert ext == 8 * BS  # from the host pool
    blocks = list(range(9))
    producer.half.update_state_after_alloc(req, blocks, ext)
    producer.half.build_connector_meta(producer.step(req, blocks, ext))
    producer.half.update_connector_output(())
    _done(req)
    _, answer = producer.half.request_finished(req)
    assert answer is not None and answer[PARAM_BLOCKS] == 8, answer
    wait_until(lambda: len(_block_files(store)) == 8, 10.0, "the lost blocks written again")
    wanted = consumer.request()
    wanted.kv_transfer_params = answer
    ext, _ = consumer.ask_until_matched(wanted)
    assert ext == 8 * BS
    snap = consumer.half.snapshot()
    assert snap["await_expired"] == 0, snap


def _prompt(group: Group, rid: str, tokens: list[int]) -> Any:
    req = group.request()
    req.request_id = rid
    req.prompt_token_ids = req.all_token_ids = tokens
    req.num_tokens = req.num_prompt_tokens = len(tokens)
    req.kv_transfer_params = ASK
    return req


def _done(req: Any) -> None:
    """max_tokens 1: vLLM finishes the request in the step that computed its prompt, and
    calls request_finished before that step's output comes back."""
    req.num_computed_tokens = req.num_tokens
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")


def test_producers_of_one_prefix_finishing_in_one_step_promise_all_they_computed(
        pair: tuple[Group, Group]) -> None:
    """Two prefill requests with one system prompt (4 blocks), prefilled in one step and
    finished in it: the first's save of the shared blocks was in flight when the second's
    final save came to them, and it stopped there. The second promised nothing and its own
    4 blocks were never saved (its decode instance computed the whole prompt). It now
    waits for that save's ack (at most PRODUCER_SAVE_WAIT_S) and saves on."""
    producer, _ = pair
    shared = DOC[: 4 * BS]
    a = _prompt(producer, "a", [*shared, *range(1000, 1000 + 4 * BS), 7])
    b = _prompt(producer, "b", [*shared, *range(2000, 2000 + 4 * BS), 7])
    for req in (a, b):
        assert producer.ask_until_matched(req)[0] == 0
    producer.half.update_state_after_alloc(a, list(range(0, 9)), 0)
    producer.half.update_state_after_alloc(b, list(range(10, 19)), 0)
    producer.half.build_connector_meta(producer.output(new=[
        (a, list(range(0, 9)), 0, a.num_tokens), (b, list(range(10, 19)), 0, b.num_tokens)]))
    _done(a)
    _done(b)
    answers = [producer.half.request_finished(req)[1] for req in (a, b)]
    assert [x and x[PARAM_BLOCKS] for x in answers] == [8, 8], answers
    producer.half.update_connector_output(())
    assert producer.half.wait_idle(10.0)
    assert producer.half.snapshot()["saved_blocks"] == 4 + 4 + 4


def test_a_chunked_producer_promises_its_last_chunk_too(pair: tuple[Group, Group]) -> None:
    """Chunked prefill: the first chunk's save goes out with the second step's batch, and
    the request finishes in that step. Its final save stopped at its own first chunk, still
    in flight, and the answer promised 4 of 8 blocks (the last chunk was never saved)."""
    producer, _ = pair
    req = _prompt(producer, "c", [*DOC, 7])
    assert producer.ask_until_matched(req)[0] == 0
    blocks = list(range(9))
    producer.half.update_state_after_alloc(req, blocks, 0)
    producer.half.build_connector_meta(producer.output(new=[(req, blocks, 0, 4 * BS)]))
    req.num_computed_tokens = 4 * BS
    producer.half.update_connector_output(())  # chunk 1 confirmed: its save is planned
    producer.half.build_connector_meta(producer.output(
        cached=[(req, None, 4 * BS, req.num_tokens - 4 * BS)]))  # its batch: that save
    _done(req)
    _, answer = producer.half.request_finished(req)
    assert answer is not None and answer[PARAM_BLOCKS] == 8, answer
    producer.half.update_connector_output(())
    assert producer.half.wait_idle(10.0)
    assert producer.half.snapshot()["saved_blocks"] == 8


def test_the_consumer_waits_for_the_promised_blocks_and_loads_them(
        pair: tuple[Group, Group]) -> None:
    producer, consumer = pair
    os.kill(producer.proc.pid, signal.SIGSTOP)  # its saves cannot land yet
    try:
        answer = producer.compute_and_save(wait=False, params=ASK)
        req = consumer.request()
        req.kv_transfer_params = answer
        ext, _ = consumer.half.get_num_new_matched_tokens(req, 0)
        assert ext is None, "computed blocks its producer was still writing"
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)
    ext, _ = consumer.ask_until_matched(req)
    assert ext == 8 * BS  # every promised block, through the store and the host pool
    snap = consumer.half.snapshot()
    assert snap["awaited"] == 1 and snap["await_expired"] == 0, snap


def test_a_promise_not_kept_expires_and_the_request_computes(
        pair: tuple[Group, Group], capfd: pytest.CaptureFixture[str]) -> None:
    _, consumer = pair  # a promise the producer never kept (its write failed)
    req = consumer.request()
    req.kv_transfer_params = {PARAM_BLOCKS: 8, PARAM_NAMESPACE: consumer.half._namespace}
    t0 = time.monotonic()
    ext, asked = consumer.ask_until_matched(req)
    waited = time.monotonic() - t0
    assert ext == 0 and asked > 1
    assert AWAIT_MS / 1000 <= waited < AWAIT_MS / 1000 + 5.0
    snap = consumer.half.snapshot()
    assert snap["awaited"] == 1 and snap["await_expired"] == 1, snap
    assert AWAIT_EXPIRED in capfd.readouterr().err


def test_a_consumer_whose_own_cache_holds_the_promised_blocks_waits_for_nothing(
        pair: tuple[Group, Group]) -> None:
    """vLLM's own prefix cache already holds the promised blocks (the same prompt came
    before): nothing the producer writes would be loaded, so nothing is waited for. The
    request was asked to wait ("ask again") its whole budget for blocks it never used."""
    _, consumer = pair
    req = consumer.request()
    req.kv_transfer_params = {PARAM_BLOCKS: 8, PARAM_NAMESPACE: consumer.half._namespace}
    assert consumer.half.get_num_new_matched_tokens(req, 8 * BS) == (0, False)
    assert consumer.half.snapshot()["awaited"] == 0
    consumer.half.request_finished(req)
    other = consumer.request()  # vLLM holds only 7 of them: it waits for the 8th
    other.kv_transfer_params = req.kv_transfer_params
    assert consumer.half.get_num_new_matched_tokens(other, 7 * BS)[0] is None
    consumer.half.request_finished(other)


@pytest.mark.parametrize("params", [
    {PARAM_BLOCKS: 8, PARAM_NAMESPACE: "another-model"},  # no promise for this namespace
    {PARAM_BLOCKS: "8", PARAM_NAMESPACE: None},           # forged or garbled: refused
    {"do_remote_prefill": True},                           # another connector's params
])
def test_other_or_bad_params_wait_for_nothing(pair: tuple[Group, Group],
                                              params: dict[str, Any]) -> None:
    _, consumer = pair
    req = consumer.request()
    if params.get(PARAM_NAMESPACE, "") is None:
        params = dict(params, **{PARAM_NAMESPACE: consumer.half._namespace})
    req.kv_transfer_params = params
    ext, _ = consumer.half.get_num_new_matched_tokens(req, 0)
    assert ext == 0
    assert consumer.half.snapshot()["awaited"] == 0



def test_garbled_params_from_many_clients_are_a_few_lines_and_a_count(
        pair: tuple[Group, Group]) -> None:
    """Clients send ``kv_transfer_params``: one warning per bad request would let them
    write the log at their pace (2,000 bad requests were 2,000 lines). A few lines, then
    a count, and the close writes the rest as one summary."""
    from structlog.testing import capture_logs

    from zkv.log import REPEAT_BURST

    _, consumer = pair
    with capture_logs() as logs:
        for _ in range(50):
            req = consumer.request()
            req.kv_transfer_params = {PARAM_BLOCKS: "8",
                                      PARAM_NAMESPACE: consumer.half._namespace}
            assert consumer.half.get_num_new_matched_tokens(req, 0)[0] == 0
        consumer.half.close()
    lines = [e for e in logs if e["event"] == "connector.bad_transfer_params"]
    assert len(lines) == REPEAT_BURST + 1, lines
    assert lines[-1]["summary"] and lines[-1]["num_total"] == 50

def test_a_promise_of_another_namespace_is_said(pair: tuple[Group, Group]) -> None:
    """A producer of another tensor-parallel size, model identity or namespace_salt
    promises blocks in its own namespace: the consumer computes the prompt and says why
    (``connector.bad_transfer_params``). Before: not a line, every decode prompt computed
    in full."""
    from structlog.testing import capture_logs

    _, consumer = pair
    with capture_logs() as logs:
        req = consumer.request()
        req.kv_transfer_params = {PARAM_BLOCKS: 8, PARAM_NAMESPACE: "another-namespace"}
        assert consumer.half.get_num_new_matched_tokens(req, 0)[0] == 0
    [line] = [e for e in logs if e["event"] == "connector.bad_transfer_params"]
    assert "promised in namespace 'another-namespace'" in line["error"], line


def test_a_step_that_runs_nothing_waits_instead_of_spinning(pair: tuple[Group, Group]
                                                            ) -> None:
    """While every request waits (here on its producer), vLLM schedules empty steps back
    to back; each waits EMPTY_STEP_WAIT_S in build_connector_meta, so the engine and its
    workers do not spin on the CPU the awaited reads and writes need."""
    _, consumer = pair
    req = consumer.request()
    req.kv_transfer_params = {PARAM_BLOCKS: 8, PARAM_NAMESPACE: consumer.half._namespace}
    assert consumer.half.get_num_new_matched_tokens(req, 0)[0] is None
    t0 = time.perf_counter()
    for _ in range(10):
        consumer.half.build_connector_meta(consumer.empty_step())
    assert time.perf_counter() - t0 >= 10 * EMPTY_STEP_WAIT_S


def test_the_wait_goes_waits_and_expires_once() -> None:
    """ProducerWait's states, as drawn in zkv.integrations.vllm.pd."""
    w = pd.ProducerWait(blocks=8)
    assert w.step(found=8, now=0.0, budget_s=1.0) == pd.GO  # all there: no wait begins
    assert w.until is None
    assert w.step(found=3, now=10.0, budget_s=1.0) == pd.WAIT
    assert w.step(found=5, now=10.9, budget_s=1.0) == pd.WAIT
    assert w.step(found=5, now=11.0, budget_s=1.0) == pd.EXPIRED
    assert w.step(found=5, now=12.0, budget_s=1.0) == pd.GO  # over: never again
    assert pd.ProducerWait(over=True).step(found=0, now=0.0, budget_s=1.0) == pd.GO


def test_answers_and_promises() -> None:
    assert pd.answer({"do_remote_decode": True}, 5, "ns") == {PARAM_BLOCKS: 5,
                                                              PARAM_NAMESPACE: "ns"}
    assert pd.answer({"do_remote_decode": True}, 0, "ns") is None  # nothing to promise
    assert pd.answer(None, 5, "ns") is pd.answer({"do_remote_prefill": True}, 5, "ns") is None
    assert pd.promised({PARAM_BLOCKS: 5, PARAM_NAMESPACE: "ns"}, "ns") == 5
    with pytest.raises(ValueError, match="promised in namespace 'other', this engine's is "
                                         "'ns'"):  # (was None, and no line: see below)
        pd.promised({PARAM_BLOCKS: 5, PARAM_NAMESPACE: "other"}, "ns")
    assert pd.promised({"remote_block_ids": [1]}, "ns") is None
    for bad in (-1, "5", 2.0, True, None):
        with pytest.raises(ValueError, match=PARAM_BLOCKS):
            pd.promised({PARAM_BLOCKS: bad, PARAM_NAMESPACE: "ns"}, "ns")
