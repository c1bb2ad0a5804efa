"""The connector's scheduler half when a rank is lost between vLLM's calls, against a real
worker process (``python -m zkv.worker``); the calls are made the way vLLM's scheduler
makes them, with request and scheduler-output objects shaped like vLLM's.

vLLM counts the tokens ``get_num_new_matched_tokens`` promised as loaded. Once zkv is off
(a rank lost) no batch loads them, so either nothing is promised (a loss seen during that
call) or the promised blocks are reported as load errors (``ZkvMetadata.unloaded``, which
the worker halves return from ``get_block_ids_with_load_errors``) and vLLM recomputes them:
never a forward over blocks nothing wrote.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Collection, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from tests.servers import sigstop
from tests.waiting import holds_within, idle_for
from tests.worker.helpers import endpoints, short_ipc_dir, worker_env
from zkv.config import CacheLayout
from zkv.integrations.vllm import metrics
from zkv.integrations.vllm.config import parse_extra_config
from zkv.integrations.vllm.scheduler import SchedulerHalf
from zkv.integrations.vllm.worker import WorkerHalf
from zkv.storage import StorageQuery, open_store

BS = 16
DOC = [(7 * i + 3) % 1000 for i in range(8 * BS)]  # 8 full blocks
LAYOUT = CacheLayout(2, 1, BS, 8, "float32", num_device_blocks=64, num_host_blocks=64,
                     model="rank-loss")
TIMEOUT_S = 1.0  # the heartbeat timeout the half runs with


class Group:
    """``store_url``: an L3 store, opened by the worker process and the half alike;
    ``extra``: more of the connector's configuration; ``layout``: the rank's (its host
    pool's size, say); ``engine_id``: the half's (None: one of its own)."""

    def __init__(self, folder: str, store_url: str | None = None,
                 extra: dict[str, Any] | None = None, layout: CacheLayout = LAYOUT,
                 engine_id: str | None = None) -> None:
        pub, pull = endpoints(folder)
        cfg = parse_extra_config({"host_blocks": layout.num_host_blocks,
                                  "storage": store_url or "none",
                                  "heartbeat_timeout_s": TIMEOUT_S, **(extra or {})})
        env = {"ZKV_STORE_URL": store_url} if store_url else {}
        self.proc = subprocess.Popen([sys.executable, "-m", "zkv.worker"],
                                     env=worker_env(0, layout.to_json(), pub, pull, **env),
                                     stdin=subprocess.DEVNULL)
        self.store = open_store(store_url, layout.fingerprint()) if store_url else None
        self.half = SchedulerHalf(cfg, layout, pub_endpoint=pub, pull_endpoint=pull,
                                  store=self.store, join_timeout_s=60,
                                  storage_exists=StorageQuery(self.store, 1)
                                  if self.store else None, engine_id=engine_id)
        self.n = 0

    def request(self) -> Any:
        self.n += 1
        return SimpleNamespace(
            request_id=f"r{self.n}", prompt_token_ids=DOC + [self.n], all_token_ids=DOC + [self.n],
            num_tokens=len(DOC) + 1, num_prompt_tokens=len(DOC) + 1, num_computed_tokens=0,
            status=SimpleNamespace(name="WAITING"), lora_request=None, cache_salt=None,
            mm_features=[])

    @staticmethod
    def output(new: Sequence[tuple[Any, list[int], int, int]] = (),
               cached: Sequence[tuple[Any, list[int] | None, int, int]] = (),
               resumed: Collection[str] = (), preempted: Collection[str] = ()) -> Any:
        """A step's SchedulerOutput, shaped like vLLM's. ``new``: (request, its block ids,
        tokens computed, tokens scheduled) of requests scheduled the first time;
        ``cached``: (request, block ids new this step or None, computed, scheduled) of
        the others; ``resumed``: those of them back from preemption (their block ids are
        all new); ``preempted``: vLLM's ``preempted_req_ids``."""
        scheduled = {r.request_id: n for r, _, _, n in [*new, *cached]}
        for r, _, c, n in [*new, *cached]:  # as vLLM's _update_after_schedule does
            r.num_computed_tokens = c + n
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(ids,),
                                                num_computed_tokens=c)
                                for r, ids, c, _ in new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r.request_id for r, _, _, _ in cached], resumed_req_ids=set(resumed),
                new_block_ids=[None if ids is None else (ids,) for _, ids, _, _ in cached],
                num_computed_tokens=[c for _, _, c, _ in cached]),
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            preempted_req_ids=set(preempted))

    @staticmethod
    def step(req: Any, blocks: list[int], computed: int) -> Any:
        """The step that schedules a new request's whole prompt."""
        return Group.output(new=[(req, blocks, computed, req.num_tokens - computed)])

    @staticmethod
    def empty_step() -> Any:
        """A step that scheduled no token (every request waiting, e.g. on a prefetch)."""
        return Group.output()

    def ask_until_matched(self, req: Any, deadline_s: float = 10.0) -> tuple[int, int]:
        """vLLM's scheduler asking again each step while the half answers None (a lookup
        still in flight): (tokens matched, times asked)."""
        asked: list[int | None] = []

        def matched() -> bool:
            asked.append(self.half.get_num_new_matched_tokens(req, 0)[0])
            return asked[-1] is not None

        if not holds_within(matched, deadline_s):
            raise AssertionError(f"still asked to ask again after {deadline_s} s")
        return asked[-1], len(asked)  # type: ignore[return-value]

    def compute_and_save(self, wait: bool = True, params: dict[str, Any] | None = None
                         ) -> dict[str, Any] | None:
        """One request computes DOC (nothing cached yet) and zkv saves its blocks
        (``wait``: the half commits the saves' acks before this returns, as the next
        call would). ``params``: the request's kv_transfer_params. The kv_transfer_params
        the half answers with."""
        saved = self.half.snapshot()["saved_blocks"]
        req = self.request()
        req.kv_transfer_params = params
        ext, _ = self.ask_until_matched(req)  # its store lookup may still be in flight
        assert ext == 0
        blocks = list(range(9))
        self.half.update_state_after_alloc(req, blocks, 0)
        self.half.build_connector_meta(self.step(req, blocks, 0))
        self.half.update_connector_output(())
        req.num_computed_tokens = req.num_tokens
        req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
        _, answer = self.half.request_finished(req)
        if wait:
            assert self.half.wait_idle(10.0)
            assert self.half.snapshot()["saved_blocks"] == saved + 8
        return answer

    def freeze_worker(self) -> None:
        """SIGSTOP the worker, read what it sent before, and let the timeout pass with
        nothing polled: the next call that polls finds the rank lost."""
        sigstop(self.proc.pid)  # (every thread stopped: none sends after this)
        # polls until what it sent before is read: a heartbeat read after the last poll
        # would be seen as new at the next call (3 in 600 freezes without this)
        seen = -1
        while seen != self.half.dp.num_received:
            seen = self.half.dp.num_received
            self.half.update_connector_output(())
            idle_for(0.05)
        idle_for(1.5 * TIMEOUT_S)  # the frozen rank's silence itself

    def close(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.half.close()
        finally:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def group() -> Iterator[Group]:
    with short_ipc_dir() as folder:
        g = Group(folder)
        try:
            g.compute_and_save()
            yield g
        finally:
            g.close()


def _worker_errors(meta: Any) -> set[int]:
    w = WorkerHalf(parse_extra_config({"storage": "none"}), 0)
    w.bind(meta)
    return w.load_errors()


def _enabled_gauge(half: SchedulerHalf) -> str:
    metrics.register_half(half)
    (line,) = [ln for ln in metrics.render().splitlines()
               if ln.startswith("zkv:enabled{")]
    return line.rsplit(" ", 1)[1]


def test_a_loss_seen_while_matching_promises_nothing(group: Group) -> None:
    assert _enabled_gauge(group.half) == "1.0"
    group.freeze_worker()
    req = group.request()
    ext, _ = group.half.get_num_new_matched_tokens(req, 0)
    assert group.half.disabled is not None and "lost" in group.half.disabled
    assert ext == 0  # the host pool holds DOC's 8 blocks, but no batch could load them
    assert _enabled_gauge(group.half) == "0.0"  # what an operator alerts on
    group.half.update_state_after_alloc(req, list(range(20, 29)), 0)
    meta = group.half.build_connector_meta(group.step(req, list(range(20, 29)), 0))
    assert meta.load_seq is None and meta.unloaded == []


def test_a_loss_after_the_promise_reports_the_promised_blocks_failed(group: Group) -> None:
    req = group.request()
    ext, _ = group.half.get_num_new_matched_tokens(req, 0)
    assert ext == 8 * BS  # promised: DOC's blocks from zkv's host pool
    group.freeze_worker()
    group.half.update_connector_output(())  # a poll between the calls sees the loss
    assert group.half.disabled is not None
    blocks = list(range(20, 29))
    group.half.update_state_after_alloc(req, blocks, ext)
    meta = group.half.build_connector_meta(group.step(req, blocks, ext))
    assert meta.load_seq is None and meta.unloaded == blocks[:8]
    assert _worker_errors(meta) == set(blocks[:8])  # vLLM recomputes them


def test_a_loss_when_the_loads_are_published_reports_them_failed(group: Group) -> None:
    req = group.request()
    ext, _ = group.half.get_num_new_matched_tokens(req, 0)
    blocks = list(range(30, 39))
    group.half.update_state_after_alloc(req, blocks, ext)  # the load is planned
    assert ext == 8 * BS and group.half.disabled is None
    group.freeze_worker()
    meta = group.half.build_connector_meta(group.step(req, blocks, ext))  # lost at its poll
    assert group.half.disabled is not None
    assert meta.load_seq is None and meta.loads == [] and meta.unloaded == blocks[:8]
    assert _worker_errors(meta) == set(blocks[:8])
    assert group.half.snapshot()["cm_pending_ops"] == 0  # the load was rolled back


def test_a_promised_load_that_left_in_another_batch_is_reported(group: Group) -> None:
    """The check behind the promise, with every rank alive: a load that leaves in a batch
    the step's metadata does not name (the mid-step flush that took the step's loads,
    fixed in ``_flush(keep=(LOAD,))``, re-created here by flushing everything) is not
    waited on by the forward, so its blocks are reported unloaded and vLLM recomputes
    them; the loads of the step's own batch are not."""
    a, b = group.request(), group.request()
    ext_a, _ = group.half.get_num_new_matched_tokens(a, 0)
    group.half.update_state_after_alloc(a, list(range(40, 49)), ext_a)
    group.half._flush()  # a's load leaves now, in a batch of its own
    ext_b, _ = group.half.get_num_new_matched_tokens(b, 0)
    group.half.update_state_after_alloc(b, list(range(50, 59)), ext_b)
    assert ext_a == ext_b == 8 * BS
    step = group.step(a, list(range(40, 49)), ext_a)
    step_b = group.step(b, list(range(50, 59)), ext_b)
    step.scheduled_new_reqs += step_b.scheduled_new_reqs
    step.num_scheduled_tokens.update(step_b.num_scheduled_tokens)
    meta = group.half.build_connector_meta(step)
    assert group.half.disabled is None
    assert meta.loads == list(range(50, 58)) and meta.unloaded == list(range(40, 48))
    assert group.half.wait_idle(10.0)
