"""What the connector's scheduler half says is left: the ``zkv:in_flight`` gauges while
requests run and once they ended, and the ``connector.closed`` report at shutdown, which
checks the pools and the tree (``connector.invariants_broken`` when they disagree). Against
a real worker process, with the calls made the way vLLM's scheduler makes them."""

from __future__ import annotations

import collections
import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from structlog.testing import capture_logs

from tests.integrations.child import STUB_CONNECTOR, run_child
from tests.integrations.test_vllm_rank_loss import Group
from tests.waiting import wait_until
from tests.worker.helpers import short_ipc_dir
from zkv.integrations.vllm import metrics


def _gauges() -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["what"]: s.value for fam in text_string_to_metric_families(metrics.render())
            for s in fam.samples if s.name == "zkv:in_flight"}


def test_in_flight_gauges_follow_a_request_and_settle_at_zero(group: Group) -> None:
    half = group.half
    metrics.register_half(half)
    assert _gauges() == {"requests": 0, "held": 0, "cache_requests": 0, "ops": 0,
                         "batches": 0, "steps": 0, "store_retry": 0}
    req = group.request()
    half.get_num_new_matched_tokens(req, 0)
    blocks = list(range(10, 19))
    half.update_state_after_alloc(req, blocks, 0)
    step = half.build_connector_meta(Group.step(req, blocks, 0)).step
    assert _gauges()["steps"] == 1  # its output has not come back
    half.update_connector_output((), step=step)  # the forward ran: 8 full blocks confirmed
    req.num_computed_tokens = req.num_tokens
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    g = _gauges()
    assert g["requests"] == 1 and g["cache_requests"] == 1 and g["steps"] == 0, g
    half.request_finished(req)  # the last save goes out at once
    g = _gauges()
    assert g["requests"] == g["cache_requests"] == 0 and g["batches"] >= 1, g
    assert half.wait_idle(10.0)
    assert _gauges() == {"requests": 0, "held": 0, "cache_requests": 0, "ops": 0,
                         "batches": 0, "steps": 0, "store_retry": 0}



def test_workers_stopped_first_during_a_store_outage_are_a_warning_and_a_true_report(
        tmp_path: Path) -> None:
    """vLLM stops its workers before its scheduler: their bye, read while the store is
    down (the pump polls for the retries), is a warning, not a lost rank's error line and
    ``connector.disabled`` error (false pages at every shutdown). The close report names
    the L3 writes that were waiting for the store and will never be made: it said
    ``store_retry: 0`` at info (the loss cleared them first)."""
    blocker = tmp_path / "l3"
    blocker.write_text("a file where the store's directory goes: every write fails")
    with short_ipc_dir() as folder:
        group = Group(folder, store_url=f"file://{blocker}")
        try:
            group.compute_and_save()
            half = group.half
            wait_until(lambda: half.in_flight()["store_retry"] == 8, 10.0,
                       "the failed writes waiting for their retry")
            with capture_logs() as logs:
                group.proc.send_signal(signal.SIGTERM)  # the worker closes: it says bye
                wait_until(lambda: half.update_connector_output(()) or half.disabled, 10.0,
                           "the half seeing the rank leave")
                half.close()
        finally:
            group.close()
    assert group.proc.returncode == 0
    levels = {e["event"]: e["log_level"] for e in logs}
    assert levels["dispatcher.rank_lost"] == "warning", logs
    assert levels["connector.disabled"] == "warning", logs
    (closed,) = [e for e in logs if e["event"] == "connector.closed"]
    assert closed["log_level"] == "warning" and closed["store_dropped"] == 8, closed
    assert not [e for e in logs if e["log_level"] == "error"], logs

def test_a_step_without_output_does_not_shift_later_outputs(group: Group) -> None:
    """vLLM reports no output for a step that scheduled no token (requests waiting on a
    prefetch): its connector output is empty, and vLLM drops it. The next step's output,
    which the worker halves number, confirms that step's blocks: under write_through they
    are saved while the request still runs. (Before, outputs were paired with the oldest
    step not reported yet: the empty step's, so every later step's saves lagged one step
    more, and the records piled up: 13 left after a three-phase engine run.)"""
    half = group.half
    half.build_connector_meta(Group.empty_step())  # no token scheduled: vLLM never reports it
    req = group.request()
    half.get_num_new_matched_tokens(req, 0)
    blocks = list(range(10, 19))
    half.update_state_after_alloc(req, blocks, 0)
    step = half.build_connector_meta(Group.step(req, blocks, 0)).step
    half.update_connector_output((), step=step)  # its forward ran everywhere
    half.build_connector_meta(Group.step(req, [], req.num_tokens))  # the batch goes out
    assert half.wait_idle(10.0)
    assert half.snapshot()["saved_blocks"] == 8, "the running request's blocks are saved"
    assert half.in_flight()["steps"] == 1  # the last one, its output not in yet


def test_close_reports_what_is_left_and_broken_invariants(group: Group) -> None:
    half = group.half
    group.compute_and_save()
    req = group.request()
    half.get_num_new_matched_tokens(req, 0)  # matched, never allocated: still tracked
    with capture_logs() as logs:
        half.close()
    (closed,) = [e for e in logs if e["event"] == "connector.closed"]
    assert closed["invariants"] == "ok" and closed["requests"] == 1, closed
    assert closed["log_level"] == "warning"  # something was left
    assert closed["cache_requests"] == 1 and closed["ops"] == closed["batches"] == 0, closed
    assert not [e for e in logs if e["event"] == "connector.invariants_broken"]


def test_close_reports_a_leaked_host_block(group: Group) -> None:
    half = group.half
    group.compute_and_save()
    assert half.cm.host.allocate(1) is not None  # taken behind the tree's back
    with capture_logs() as logs:
        half.close()
    (broken,) = [e for e in logs if e["event"] == "connector.invariants_broken"]
    assert broken["log_level"] == "error" and broken["error"]
    (closed,) = [e for e in logs if e["event"] == "connector.closed"]
    assert closed["invariants"] == "broken"


def test_calls_after_close_miss_and_a_second_close_does_nothing(group: Group) -> None:
    """vLLM's scheduler may call once more after the connector's shutdown (a request that
    arrives while the engine stops): each call is a miss, not a zmq error from a closed
    socket, and no batch goes out. The doc is cached: before the close it matches, after
    it nothing does."""
    half = group.half
    group.compute_and_save()
    before = group.request()
    assert half.get_num_new_matched_tokens(before, 0)[0] == 8 * 16
    half.request_finished(before)  # (never allocated: nothing to free)
    half.close()
    req = group.request()
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    half.update_state_after_alloc(req, list(range(9)), 0)
    meta = half.build_connector_meta(Group.step(req, list(range(9)), 0))
    assert meta.loads == [] and meta.load_seq is None
    half.update_connector_output(())
    req.status = SimpleNamespace(name="FINISHED_STOPPED")
    assert half.request_finished(req) == (False, None)
    assert half.wait_idle(1.0)
    with capture_logs() as logs:
        half.close()
    assert logs == []


def test_a_step_after_close_with_saves_planned_misses_and_two_closes_report_once(
        group: Group) -> None:
    """The close lands between a step's output (which planned the request's saves) and
    vLLM's next ``build_connector_meta``, and two threads close at once: the late step
    misses (was: ``RuntimeError: publish ... after close()``) with the saves rolled back,
    and ``connector.closed`` is written once (was: twice, each walking the tree)."""
    half = group.half
    req = group.request()
    group.ask_until_matched(req)
    half.update_state_after_alloc(req, list(range(9)), 0)
    half.build_connector_meta(Group.step(req, list(range(9)), 0))
    req.num_computed_tokens = req.num_tokens
    half.update_connector_output(())  # the saves are planned, not yet published
    with capture_logs() as logs:
        closers = [threading.Thread(target=half.close) for _ in range(2)]
        for t in closers:
            t.start()
        for t in closers:
            t.join(30)
    assert len([e for e in logs if e["event"] == "connector.closed"]) == 1
    meta = half.build_connector_meta(Group.output(cached=[(req, None, req.num_tokens, 1)]))
    assert meta.loads == [] and meta.load_seq is None
    assert half.snapshot()["cm_pending_ops"] == 0  # rolled back: nothing will run them


_CONNECTOR_CHILD = '''
import json, warnings
from types import SimpleNamespace
warnings.simplefilter("ignore")
from tests.integrations.test_vllm_rank_loss import Group
from tests.worker.helpers import short_ipc_dir
from zkv.integrations.vllm.connector import ZkvConnector

with short_ipc_dir() as folder:
    group = Group(folder)
    try:
        conn = object.__new__(ZkvConnector)  # the scheduler role's (__init__ needs VllmConfig)
        conn.sched, conn.worker, conn._store, conn._ipc_dir = group.half, None, None, None
        conn._metrics_server = None
        group.compute_and_save()
        conn.shutdown()
        conn.shutdown()  # (again: nothing)
        req = group.request()
        out = {"matched": conn.get_num_new_matched_tokens(req, 0)}
        conn.update_state_after_alloc(
            req, SimpleNamespace(get_block_ids=lambda: [list(range(9))]), 0)
        meta = conn.build_connector_meta(Group.step(req, list(range(9)), 0))
        out["loads"], out["load_seq"] = meta.loads, meta.load_seq
        req.status = SimpleNamespace(name="FINISHED_STOPPED")
        out["finished"] = conn.request_finished(req, list(range(9)))
    finally:
        group.close()
print(json.dumps(out))
'''


def test_a_connector_shut_down_answers_vllm_with_misses() -> None:
    """The same through the connector vLLM holds: its shutdown kept no half, so each call
    failed ``assert self.sched is not None``; now the closed half answers. (In a child
    process: importing vLLM here would change this one, its warnings above all.)"""
    got = run_child(_CONNECTOR_CHILD)
    assert got == {"matched": [0, False], "loads": [], "load_seq": None,
                   "finished": [False, None]}, got


_FAILED_START_CHILD = STUB_CONNECTOR + '''
import socket, threading
from tests.worker.helpers import worker_env
from zkv.integrations.vllm import metrics

busy = socket.socket()
busy.bind(("127.0.0.1", 0))
busy.listen()
eid = f"failed-start-{os.getpid()}"
pub, pull, folder = ipc_endpoints(eid, create=True)
worker = subprocess.Popen([sys.executable, "-m", "zkv.worker"], stdin=subprocess.DEVNULL,
                          env=worker_env(0, LAYOUT.to_json(), pub, pull))
conn = stub_connector(eid, {"metrics_port": busy.getsockname()[1]},
                      plain_vllm_config())
error = start(conn)  # the half joins the worker, then the metrics port is taken
try:
    code = worker.wait(10)  # told Shutdown by the closed half
except subprocess.TimeoutExpired:
    worker.kill()
    code = "still running"
print(json.dumps({
    "error": error, "worker_exit": code, "dir_left": os.path.exists(folder),
    "halves": len(metrics._HALVES.halves),
    "pumps": sum(t.name == "zkv-pump" for t in threading.enumerate()),
    "enabled_series": sum(ln.startswith("zkv:enabled{") for ln in metrics.render().splitlines()),
}))
'''


def test_a_failed_start_leaves_no_half_behind() -> None:
    """The scheduler role's start fails after its half joined the ranks (a taken
    ``metrics_port``): vLLM never gets the connector, so nothing would call ``shutdown``.
    The start closes what it made before it raises: the worker is told to stop, no pump
    thread or registered half (with ``zkv:enabled 1``) is left, and the engine's ipc
    directory is removed. Before, each failed try of an in-process engine left all of
    them running."""
    got = run_child(_FAILED_START_CHILD)
    assert got.pop("error", "").startswith("zkv: metrics port"), got
    assert got == {"worker_exit": 0, "dir_left": False, "halves": 0, "pumps": 0,
                   "enabled_series": 0}, got


_TAKEN_ID_CHILD = STUB_CONNECTOR + '''
eid = f"taken-{os.getpid()}"
_, _, folder = ipc_endpoints(eid, create=True)
CLAIM = ("import sys; from zkv import security; security.claim_dir(sys.argv[1]); "
         "open(sys.argv[1] + '/pub', 'w').close(); print('claimed', flush=True); "
         "sys.stdin.read()")
owner = subprocess.Popen([sys.executable, "-c", CLAIM, folder], text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
assert owner.stdout.readline() == "claimed\\n"
# a second engine given the first one's engine_id
conn = stub_connector(eid, {}, plain_vllm_config())
error = start(conn)
conn.shutdown()  # (again: as a caller that cleans up after a failure might)
left = sorted(os.listdir(folder)) if os.path.isdir(folder) else None
owner.stdin.close()
owner.wait(10)
import shutil
shutil.rmtree(folder, ignore_errors=True)  # (the real socket root's: nothing of ours stays)
print(json.dumps({"error": error, "left": left}))
'''


_POOLS_TAKEN_CHILD = STUB_CONNECTOR + '''
from tests.worker.helpers import worker_env
from zkv import config

eid = f"pools-taken-{os.getpid()}"
pub, pull, folder = ipc_endpoints(eid, create=True)
worker = subprocess.Popen([sys.executable, "-m", "zkv.worker"], stdin=subprocess.DEVNULL,
                          env=worker_env(0, LAYOUT.to_json(), pub, pull))
# the worker halves checked, allocated and filled their host pools: the memory left is less
# than the pools (here, none)
config.available_memory = lambda: 0
conn = stub_connector(eid, {}, plain_vllm_config())
error = start(conn)
conn.shutdown()
try:
    code = worker.wait(10)
except subprocess.TimeoutExpired:
    worker.kill()
    code = "still running"
print(json.dumps({"error": error, "worker_exit": code}))
'''


def test_the_scheduler_half_does_not_count_the_workers_pools_twice() -> None:
    """vLLM registers the KV caches (the worker halves check the machine's memory, then
    allocate their host pools) before it starts the scheduler: the scheduler half's start
    must not check those pools again against the memory they already took. (It did: a
    ``host_bytes`` of 45% of the memory stopped the engine with "the host pools need 9.9
    GiB ... and 11.4 GiB is available".)"""
    got = run_child(_POOLS_TAKEN_CHILD)
    assert got == {"error": None, "worker_exit": 0}, got


def test_a_start_refused_for_a_taken_engine_id_leaves_the_live_engine_its_sockets() -> None:
    """The start that fails because a live engine owns the ``engine_id``'s directory
    releases only what it made: the live engine's directory (its owner file, its
    sockets) stays, also after more shutdowns. (The release added for failed starts
    removed it at first: the directory was named the connector's before the claim.)"""
    got = run_child(_TAKEN_ID_CHILD)
    assert "another engine" in got["error"], got
    assert got["left"] is not None and "pub" in got["left"], got


def test_the_stats_vllm_reads_every_step_walk_no_tree(group: Group) -> None:
    """vLLM calls ``get_kv_connector_stats`` after every step (``update_from_output``): the
    connector reads the half's running totals (``counters``), not its snapshot, whose
    cache part walks every node (5.4 ms a step at 25,000 nodes, under the half's lock).
    (The connector module imports vLLM; the engine tests run that call every step.)"""
    half = group.half
    req = group.request()
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, list(range(10, 19)), 0)
    walked = half.cm.snapshot

    def no_walk() -> dict[str, object]:
        raise AssertionError("the cache snapshot walked the tree")

    half.cm.snapshot = no_walk  # type: ignore[method-assign]
    try:
        totals = half.counters()
    finally:
        half.cm.snapshot = walked  # type: ignore[method-assign]
    snap = half.snapshot()
    assert totals["requests"] == 1 and totals == {k: snap[k] for k in totals}
    assert {"requests", "zkv_host_tokens", "saved_blocks", "loaded_blocks"} <= totals.keys()



def test_a_selective_save_looks_up_only_the_blocks_not_yet_popular() -> None:
    """Under write_through_selective every running request's save is planned every step:
    it looks up only the blocks past those already found popular. (It scanned the whole
    hash list from block 0 each step: 76 ms a step at 100 requests of 128k tokens sharing
    a system prompt.)"""
    with short_ipc_dir() as folder:
        group = Group(folder, extra={"policy": "write_through_selective",
                                     "write_through_threshold": 2})
        try:
            half = group.half
            a, b = group.request(), group.request()  # one prompt twice: its blocks popular
            for req, ids in ((a, list(range(9))), (b, list(range(10, 19)))):
                half.get_num_new_matched_tokens(req, 0)
                half.update_state_after_alloc(req, ids, 0)

            class Lookups(collections.OrderedDict[bytes, int]):
                num = 0

                def get(self, key: bytes, default: Any = None) -> Any:
                    Lookups.num += 1
                    return super().get(key, default)

            with half._lock:
                half._seen = Lookups(half._seen)
                r = half._reqs[b.request_id]
                half._plan_save(r, False)
                first, Lookups.num = Lookups.num, 0
                half._plan_save(r, False)  # the next step: no new block
            assert first == len(r.hashes) == 8 and Lookups.num == 0, (first, Lookups.num)
            # a cache reset re-hashes a waiting request: none of its new blocks was seen
            # twice, so none is saved before it finishes (the count it had was kept: its 8
            # blocks were saved as popular)
            with half._lock:
                half._seen = collections.OrderedDict(half._seen)
                half._preempted(b.request_id)
            assert half.reset()
            half.get_num_new_matched_tokens(b, 0)
            half.update_state_after_alloc(b, list(range(20, 29)), 0)
            planned: list[int] = []
            cache_computed = half.cm.cache_computed

            def spy(rid: str, upto: int, **kw: Any) -> int:
                planned.append(upto)
                return cache_computed(rid, upto, **kw)

            with half._lock:
                half.cm.cache_computed = spy  # type: ignore[method-assign]
                r = half._reqs[b.request_id]
                r.confirmed = 8 * half.bs  # the forward computed its 8 full blocks
                half._plan_save(r, False)
            assert planned == [0] and r.popular == 0, (planned, r.popular)
        finally:
            group.close()


def test_a_pump_that_keeps_failing_is_a_few_lines_with_the_traceback(group: Group) -> None:
    """The pump retries every few milliseconds: a cause that lasts was 1,411 error lines in
    3 s, each without its traceback. A few lines, with it; the close says how many."""
    from zkv.log import REPEAT_BURST

    half = group.half

    def broken(timeout_s: float = 0.0) -> None:
        raise RuntimeError("a cause that lasts")

    with capture_logs() as logs:
        with half._lock:
            half._poll = broken  # type: ignore[method-assign]
            half._io_open = True  # something for the pump to do
            half._last_call = 0.0  # and vLLM idle
        half._kick.set()
        wait_until(lambda: half._pump_failed_log.total > 3 * REPEAT_BURST, 10.0,
                   "the pump failing again and again")
        half.close()
    lines = [e for e in logs if e["event"] == "connector.pump_failed"]
    assert len(lines) == REPEAT_BURST + 1, lines  # the burst, then the close's summary
    assert all(e["exc_info"] is True and "a cause that lasts" in e["error"]
               for e in lines[:-1]), lines
    assert lines[-1]["summary"] and lines[-1]["num_total"] == half._pump_failed_log.total


def test_an_engine_writes_no_info_line_per_batch(group: Group) -> None:
    """A serving engine at ``log_level: info`` writes what changed, not a line per step:
    the dispatcher's two lines a batch are debug there (3.9 GB a day at replay's pace; zkv
    replay, a harness, keeps them at info). Every line names its engine (none did)."""
    with capture_logs() as logs:
        group.compute_and_save()
    batch = [e for e in logs if e["event"].startswith("dispatcher.batch_")]
    assert batch and {e["log_level"] for e in batch} == {"debug"}, batch
    # and every line of the half and its dispatcher names the engine (two engines may share
    # a process or a log directory)
    ours = [e for e in logs if e.get("component") in ("connector", "dispatcher")]
    assert ours and {e.get("engine_id") for e in ours} == {group.half.engine_id}, ours

def test_a_step_of_an_aborted_request_confirms_nothing_of_a_new_one_with_its_id(
        group: Group) -> None:
    """A client's request ids can come back (vLLM keeps them with
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``): a request aborted while its step ran, then
    a new one under its id, scheduled before that step's output came. The output confirms
    the aborted request's tokens, not the new one's: nothing of the new request, which has
    computed nothing yet, is saved. (Before, every request started at epoch 0, so the old
    step's record matched the new request and its uncomputed blocks were saved under its
    hashes: garbage KV in the host tier and the store.)"""
    half = group.half
    old = group.request()
    half.get_num_new_matched_tokens(old, 0)
    half.update_state_after_alloc(old, list(range(10, 19)), 0)
    step = half.build_connector_meta(Group.step(old, list(range(10, 19)), 0)).step
    old.status = SimpleNamespace(name="FINISHED_ABORTED")
    half.request_finished(old)  # gone before its step's output
    new = group.request()
    new.request_id = old.request_id
    assert half.get_num_new_matched_tokens(new, 0) == (0, False)
    half.update_state_after_alloc(new, list(range(30, 39)), 0)
    half.update_connector_output((), step=step)  # the aborted request's step ran
    half.build_connector_meta(Group.empty_step())  # publishes whatever was planned
    assert half.wait_idle(10.0)
    assert half.snapshot()["saved_blocks"] == 0
