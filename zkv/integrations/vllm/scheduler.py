"""The scheduler half of the zkv vLLM connector (runs in vLLM's EngineCore process).

vLLM keeps L1 (its block pool and prefix cache); zkv's CacheManager runs in external-L1
mode behind it (host pool per rank = L2, the store = L3). Its ops travel to the worker
halves over zkv's own Dispatcher (PUB/SUB + PUSH/PULL) and commit on every rank's ack.

Per request::

    get_num_new_matched_tokens ── match (host, then one L3 existence query)
        │ L3 hits: prefetch (s2h, published at once); None ("ask again") while the
        │          prefetch policy waits (timeout / wait_complete); best_effort, or a
        │          read of nothing past vLLM's own hit, goes on with its host hits and
        │          lets the s2h land for later requests
        ▼
    update_state_after_alloc ──── load: host blocks → vLLM's new blocks (layerwise h2d,
        │                          in this step's batch; the forward waits per layer)
        ▼
    update_connector_output ───── the step's forward is done everywhere and no load it
        │ (each step)              used failed: its full blocks are "confirmed"; saves
        │                          (engine blocks → new host blocks) are planned per write
        │                          policy, sent with the next step's batch; HOST when
        │                          every rank acked
        ▼
    request_finished ──────────── save what is left (published at once); vLLM frees the
                                   blocks (False), and the next forward, which may reuse
                                   them, does not start before the save ran (fence); a
                                   save stopped at another save in flight on its path:
                                   vLLM keeps them (True) until it is done (``held.py``)

Saves confirmed at the end of a step travel in the next step's batch, together with its
loads (one batch per step); a request notes the batch that carried its last save. vLLM
may free a preempted request's blocks in that very ``schedule()``: its planned save is
cancelled before the batch is published. A finishing request's saves are published at
once and fence the next forward like a preempted one's; a gated worker half runs every
batch published before a step's metadata to completion before that step's forward
anyway, and a batch's saves (d2h) before its loads (h2d).

Preempted outside ``schedule()`` (``reset_prefix_cache(reset_running_requests=True)``:
blocks freed, ``num_computed_tokens`` 0, first in the waiting queue), a request is asked
about again (``get_num_new_matched_tokens``) before the step's ``preempted_req_ids`` name
it: its preemption is handled then (a new match follows), and the later mention is
skipped, since the request may already be allocated again, with loads, in that step.

vLLM calls nothing while its engine is idle, so a thread of the half's own, the pump,
commits acks once vLLM has been quiet for ``PUMP_IDLE_S`` and publishes the L3 ops that
follow them (h2s of saved blocks, s2h): a finished request's blocks reach the store
without a next request. Ops on vLLM's blocks (loads, saves) still travel only from
vLLM's calls. One lock orders the pump, vLLM's calls and the metrics scrapes.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import xxhash

from zkv import log as zlog
from zkv.config import CacheLayout
from zkv.errors import RankLost
from zkv.integrations.vllm import events as E
from zkv.integrations.vllm import pd
from zkv.integrations.vllm.config import ZkvVllmConfig
from zkv.integrations.vllm.held import HeldFinishes
from zkv.integrations.vllm.records import RequestState, TokenCounts, ZkvMetadata, record_step
from zkv.integrations.vllm.request_hashes import (
    request_embeds_items,
    request_mm_items,
    request_root,
    request_tokens,
)
from zkv.protocol import BACKUP, D2H, H2D
from zkv.scheduler.dispatcher import Dispatcher
from zkv.scheduler.hashing import BlockHash, MultiModalItem, hash_tokens
from zkv.scheduler.manager import (
    LOAD,
    SAVE,
    WRITE_BACK,
    WRITE_THROUGH_SELECTIVE,
    CacheConfig,
    CacheManager,
)
from zkv.scheduler.prefetch import BEST_EFFORT, PrefetchTracker

# The pump (SchedulerHalf._pump): how often it looks while batches fly; how long vLLM is idle first
PUMP_INTERVAL_S = 0.002
PUMP_IDLE_S = 0.005
EMPTY_STEP_WAIT_S = 0.005  # a step that scheduled nothing waits this long for an ack
#: A P/D producer's request that finishes while a save on its path is in flight (its own
#: earlier chunk's, or another request's of the same prefix that finished in the same
#: step) waits at most this long for those acks, so that its answer promises, and zkv
#: saves, all it computed (a d2h acks in a few ms; the wait ends with it).
PRODUCER_SAVE_WAIT_S = 0.5
# ops that read or write vLLM's blocks: they travel with a step's batch, never the pump's
_STEP_KINDS = (LOAD, SAVE, H2D, D2H, BACKUP)
# finishes vLLM decides on a step's sampled tokens (its forward is done) before that step's
# connector output comes back (update_from_output: request_finished, then the output)
_STOPPED_BY_OUTPUT = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")
_SELECTIVE_MEMORY = 200_000  # block hashes whose use count write_through_selective keeps
_HALF_IDS = itertools.count()  # engine_id of halves given none (tests, benchmarks)


class SchedulerHalf:
    """CacheManager + Dispatcher behind vLLM's scheduler; see the module docstring."""

    def __init__(self, cfg: ZkvVllmConfig, layout: CacheLayout, *, pub_endpoint: str,
                 pull_endpoint: str, store: Any = None, storage_exists: Any = None,
                 join_timeout_s: float = 120.0, loads: bool = True, saves: bool = True,
                 mm_scope: bytes = b"", engine_id: str | None = None) -> None:
        """``loads`` / ``saves``: vLLM's ``kv_role`` (``kv_consumer`` only loads,
        ``kv_producer`` only saves, ``kv_both`` both). ``mm_scope``: see
        :func:`~zkv.integrations.vllm.request_hashes.request_mm_items`. ``engine_id``:
        vLLM's, the ``engine_id`` label of the half's metrics (None: one of this process's
        own, ``half-N``)."""
        self.cfg = cfg
        self.engine_id = f"half-{next(_HALF_IDS)}" if engine_id is None else engine_id
        self._mm_scope = mm_scope
        self.loads, self.saves = loads, saves
        self._generation = b""  # see reset()
        self.layout = layout
        self.bs = layout.block_size
        self.store = store
        self.log = zlog.get_logger("connector", role="scheduler", engine_id=self.engine_id)
        # Repeating lines, rate-limited: a P/D producer that keeps no promise makes every
        # consumer request give up; clients send the transfer params; a pump's failure
        # repeats every 2 ms while its cause lasts; a store outage fails every request's loads
        self._repeating = tuple(zlog.repeating(self.log, e, level) for e, level in (
            (E.AWAIT_EXPIRED, "warning"), (E.BAD_TRANSFER_PARAMS, "warning"),
            (E.PUMP_FAILED, "error"), (E.LOAD_FAILED, "warning")))
        (self._await_expired_log, self._bad_params_log, self._pump_failed_log,
         self._load_failed_log) = self._repeating
        self.cm = CacheManager(
            CacheConfig(0, layout.num_host_blocks, layout.block_size, cfg.policy,
                        cfg.write_through_threshold,
                        storage_write=bool(store is not None and cfg.storage_write)),
            storage_exists=storage_exists,
        )
        self.prefetch = PrefetchTracker(cfg.prefetch_policy())
        self.dp = Dispatcher(pub_endpoint, pull_endpoint, layout.world_size,
                             layout.fingerprint(), heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                             ack_timeout_s=120.0, batch_log_level="debug",  # (not a line a step)
                             log_fields={"engine_id": self.engine_id})
        try:
            self.dp.wait_for_ranks(join_timeout_s)
        except BaseException:
            self.dp.close(shutdown=False)
            raise
        self.counts = TokenCounts()
        self.disabled: str | None = None
        self._store_dropped = 0  # L3 writes still to retry when zkv went off: never made
        self._namespace = xxhash.xxh3_64_hexdigest(layout.fingerprint().encode())
        policy = cfg.prefetch_policy()
        # how long a consumer request waits for blocks its producer promised (a write that
        # failed never lands): the prefetch policy's longest wait, none for best_effort
        self._await_s = 0.0 if policy.kind == BEST_EFFORT else policy.max_s
        self._reqs: dict[str, RequestState] = {}
        # (step, {req_id: (epoch, tokens computed once it ran)}) per step with no output yet
        self._steps: collections.deque[tuple[int, dict[str, tuple[int, int]]]] = collections.deque()
        # ids whose mention in this step's preempted_req_ids is not the tracked request's:
        # preempted outside schedule() (handled then), or new (an earlier one's, reset)
        self._not_preempted: set[str] = set()
        # a request's epoch, new at each start and preemption and never reused: a step's
        # output confirms only the epoch it scheduled (an id can come back: a client's
        # own ids with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)
        self._epochs = itertools.count()
        self._fence = -1
        self._held = HeldFinishes()  # finished, vLLM keeps the blocks for their saves
        self._promised: list[int] = []  # blocks whose loads vLLM was promised this step
        self._step = 0
        self._seen: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        from zkv.integrations.vllm import metrics

        self._batch_seconds = metrics.BATCH_SECONDS.labels(*metrics.half_labels(self))
        # vLLM's calls (EngineCore's thread), the pump and the metrics scrapes take turns
        self._lock = threading.RLock()
        self._last_call = time.perf_counter()
        self._stop = threading.Event()
        self._kick = threading.Event()  # set at each publish: the pump wakes
        self._io_open = False  # acks were committed: L3 ops may wait to be published
        self._pump_thread = threading.Thread(target=self._pump, name="zkv-pump", daemon=True)
        self._pump_thread.start()
        try:
            metrics.register_half(self)
        except BaseException:  # (another half has its engine_id)
            self.close()
            raise

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """One of vLLM's calls: under the lock, its time counted (``counts.sched_s``)."""
        with self._lock:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._last_call = t1 = time.perf_counter()
                self.counts.sched_s += t1 - t0

    def _pump(self) -> None:
        """vLLM calls nothing while its engine is idle, and commits and publishes nothing of
        zkv's then: acks would wait for the next request, and with them what follows an ack
        (a saved block's L3 write, the next prefetch read), so a finished request's blocks
        would reach the store only when another request came, too late for an engine that
        shares it (P/D, a router sending the next turn elsewhere). While batches are in
        flight, or acks were committed (by any call: the L3 ops they open wait for no
        step), or failed storage writes are due to be tried again, and vLLM has called
        nothing for ``PUMP_IDLE_S``, this thread commits the acks and publishes the L3 ops
        that follow them (s2h, h2s: host pool and store only); ops on vLLM's blocks wait
        for a step's batch. It takes vLLM's calls' lock: the two never interleave."""
        while not self._stop.is_set():
            if (not self.dp.in_flight and not self._io_open  # hints, read without the lock
                    and not self.cm.store_retry_due()):
                self._kick.wait(1.0)
                self._kick.clear()
                continue
            if self._stop.wait(PUMP_INTERVAL_S) or self.disabled:
                return
            if time.perf_counter() - self._last_call < PUMP_IDLE_S:
                continue
            with self._lock:
                if self._stop.is_set() or self.disabled:
                    return
                if time.perf_counter() - self._last_call < PUMP_IDLE_S:
                    continue
                try:
                    self._poll()
                    self._io_open = False
                    self._flush(keep=_STEP_KINDS)
                except Exception as e:  # noqa: BLE001 - never silently: vLLM's calls go on
                    self._pump_failed_log(error=f"{type(e).__name__}: {e}", exc_info=True)

    # ------------------------------------------------------------ vLLM calls

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        with self._call():
            return self._num_matched(request, num_computed_tokens)

    def _num_matched(self, request: Any, local: int) -> tuple[int | None, bool]:
        r = self._reqs.get(request.request_id)
        if r is not None and r.allocated:
            # Preempted outside schedule() (a cache reset, see the module docstring): its
            # blocks are freed and this schedule() may allocate it again, before
            # build_connector_meta names it preempted (that mention is then skipped).
            self._preempted(request.request_id)
            self._not_preempted.add(request.request_id)
        if self.disabled or (getattr(request, "prompt_token_ids", None) is None
                             and getattr(request, "prompt_embeds", None) is None):
            return 0, False
        self._poll()
        if self.disabled:  # a rank was lost just now: promise nothing
            return 0, False
        rid = request.request_id
        r = self._reqs.get(rid)
        if r is None:
            r = self._reqs[rid] = self._new_req(request)
            self._not_preempted.add(rid)
        elif r.generation != self._generation:  # waiting across a reset: hash it anew
            self.prefetch.forget(rid)
            r.root, r.hashes, r.num_prompt_blocks = self._hash_prompt(request, r.mm_items)
            r.generation, r.prefetched, r.popular = self._generation, False, 0
        if not self.loads or getattr(request, "skip_reading_prefix_cache", False):
            # A producer loads nothing; vLLM drops every cache hit of this request (prompt
            # logprobs, or asked by the client) and computes its whole prompt: no match to
            # hold, no prefetch, no hit; what it computes is saved like any request's.
            self.cm.match_prefix(rid, ())
            r.host_blocks_at_match = r.ext = 0
            r.local = local
            return 0, False
        if self.prefetch.waiting(rid):
            if not self.prefetch.ready(rid, self.cm.prefetch_done(rid), time.monotonic()):
                return None, False  # vLLM asks again next step
        m = self.cm.match_prefix(rid, r.hashes[: r.num_prompt_blocks], check=False)  # (ours)
        # (the blocks vLLM's own cache holds are no wait: nothing would load them)
        if not r.prefetched and self._awaits_producer(
                r, max(m.num_host + m.num_storage, local // self.bs)):
            return None, False  # its producer's blocks are on their way to L3
        if not r.prefetched:
            # Its host hits before its own prefetch (if any) runs: what that brings into the
            # host pool, and a later ask then matches there, came from the store (_count).
            r.host_blocks_at_match = m.num_host
        if m.num_storage and not r.prefetched:
            r.prefetched = True
            n = self.cm.prefetch(rid)
            if n:
                # The s2h starts now, not with the step's batch; this step's loads (vLLM
                # blocks of requests allocated before this one) stay for that batch, whose
                # seq the worker halves wait on.
                self._flush(keep=(LOAD,))
                if (self.cfg.prefetch == BEST_EFFORT  # or it reads nothing past vLLM's hit:
                        or min((m.num_host + n) * self.bs, request.num_tokens - 1) <= local):
                    # vLLM schedules it now, with the host hits it has: it lets its s2h go,
                    # which lands in the host pool for later requests (a load is never
                    # planned from blocks still arriving: load_external refuses it)
                    self.cm.drop_prefetch(rid)
                else:
                    # a P/D consumer's blocks are known to be there: its read may take
                    # as long as the wait for its producer could have
                    budget = self._await_s if r.wait is not None and r.wait.blocks else None
                    self.prefetch.start(rid, request.num_prompt_tokens, time.monotonic(),
                                        budget)
                    return None, False
        have = min(m.num_host * self.bs, request.num_tokens - 1)  # vLLM computes >= 1 token
        r.local = local
        r.ext = max(0, have - local)
        return r.ext, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        with self._call():
            self._after_alloc(request, block_ids, num_external_tokens)

    def _after_alloc(self, request: Any, block_ids: list[int], ext: int) -> None:
        r = self._reqs.get(request.request_id)
        if r is None or r.allocated:  # a second call (more blocks after an async load)
            if r is not None and not self.disabled:
                r.block_ids = list(block_ids)
            return
        r.block_ids = list(block_ids)
        r.allocated = True
        start = r.local // self.bs
        promised = r.block_ids[start : -(-(r.local + ext) // self.bs)] if ext else []
        # vLLM counts these tokens as loaded: their blocks go into this step's load batch,
        # or (zkv off, the batch not published) into the metadata's ``unloaded``.
        self._promised += promised
        if self.disabled:
            return
        rid = request.request_id
        if ext:
            n = self.cm.load_external(rid, start, promised)
            if n != len(promised):  # the match is held: this cannot happen
                raise RuntimeError(f"zkv: planned {n} loads for {rid}, promised {len(promised)}")
        else:
            self.cm.cache_computed(rid, 0, device_ids=[])  # external mode, hits counted
        # Nothing is confirmed before a step that scheduled it comes back: vLLM's own hit
        # may be blocks another request's forward (this step's, or the one in flight under
        # async scheduling) is still writing - vLLM caches blocks when it allocates them -
        # and an abort before that output would save them (saves are not gated).
        r.confirmed = 0
        self._count(r, ext)
        if self.cfg.policy == WRITE_THROUGH_SELECTIVE:
            for h in r.hashes[: r.num_prompt_blocks]:
                self._seen[h] = self._seen.pop(h, 0) + 1
            while len(self._seen) > _SELECTIVE_MEMORY:
                self._seen.popitem(last=False)

    def _count(self, r: RequestState, ext: int) -> None:
        """Count a request's prompt tokens once, by tier, in the prompt's order: vLLM's own
        hit (``local``) first, then zkv's host hits past it, then its store hits (the
        blocks its prefetch brought), then the tokens vLLM computes."""
        if r.counted:
            return
        r.counted = True
        c = self.counts
        c.requests += 1
        host_tokens = r.host_tokens(ext, self.bs)
        c.vllm_local += r.local
        c.zkv_host += host_tokens
        c.zkv_store += ext - host_tokens
        c.computed += max(0, r.request.num_prompt_tokens - r.local - ext)

    def build_connector_meta(self, so: Any) -> ZkvMetadata:
        with self._call():
            return self._build_meta(so)

    def _build_meta(self, so: Any) -> ZkvMetadata:
        self._step += 1
        if getattr(so, "total_num_scheduled_tokens", 1) == 0 and (self._reqs or self._held):
            # Nothing runs: every request waits, on zkv (a prefetch, a producer's blocks)
            # or on vLLM's memory. vLLM asks again at once, so the engine and its workers
            # would spin, taking the CPU (and a worker's GIL) the awaited reads need: wait
            # for an ack a little instead (with none to come, for the store or vLLM).
            if self.dp.in_flight:
                self._poll(EMPTY_STEP_WAIT_S)
            else:
                self._poll()
                time.sleep(EMPTY_STEP_WAIT_S)
        else:
            self._poll()
        self._steps.append((self._step, record_step(self._reqs, so)))
        for rid in getattr(so, "preempted_req_ids", None) or ():
            if rid not in self._not_preempted:
                self._preempted(rid)
        self._not_preempted.clear()
        meta = ZkvMetadata(step=self._step)
        for r in self._held:  # saved on from where they stopped (a save on the path acked)
            self._plan_save(r, final=True)
        ops = self.cm.take_ops()
        seq = self._publish(ops)
        if self._held:
            meta.finish_after = self._held.release(self._still_waits, self.cm.finish)
        loads = [op for op in ops if op.kind == H2D] if seq is not None else []
        if loads:
            meta.load_seq, meta.load_op = seq, loads[0].id
            meta.loads = [int(b) for b in loads[0].dst]
        # Every block vLLM was promised is in this batch's load or reported unloaded (vLLM
        # recomputes it): zkv went off since (a rank lost: no batch), or - a bug, said
        # loudly - a load that left in another batch, which this forward would not wait on.
        loaded = set(meta.loads)
        meta.unloaded = [b for b in self._promised if b not in loaded]
        if loads and meta.unloaded:
            self.log.error(E.PROMISE_NOT_LOADED, num_blocks=len(meta.unloaded), seq=seq)
        self._promised = []
        meta.release_upto = self.dp.next_seq - 1
        meta.fence, self._fence = self._fence, -1
        return meta

    def _still_waits(self, r: RequestState) -> bool:
        """A held request's save still waits for a save in flight on its path."""
        rid = r.request.request_id
        return (not self.disabled and self.cm.num_held_blocks(rid) < self._savable(r)
                and self.cm.save_waits(rid, chain=True))

    def _preempted(self, rid: str) -> None:
        """vLLM freed the request's blocks: its save planned for this step is dropped (the
        blocks may be reused by this very step), and it starts over (a new match) when it
        is scheduled again."""
        r = self._reqs.get(rid)
        if r is None:
            return
        self.counts.preempted += 1
        if self.cm.has_request(rid):
            self.cm.cancel_saves(rid)
            self.cm.finish(rid)
        if r.last_save_seq is not None and not self.dp.settled(r.last_save_seq):
            self._fence = max(self._fence, r.last_save_seq)  # its blocks may be reused now
        r.epoch = next(self._epochs)
        r.allocated, r.block_ids, r.confirmed = False, [], 0
        r.prefetched, r.local, r.ext = False, 0, 0
        self.prefetch.forget(rid)

    def update_connector_output(self, invalid_block_ids: Iterable[int],
                                step: int | None = None) -> None:
        """A step's output: ``step``, its number as the worker halves reported it (None: the
        oldest step whose output has not come)."""
        with self._call():
            self._confirm(set(invalid_block_ids or ()), step)

    def _confirm(self, invalid: set[int], step: int | None) -> None:
        self._poll()
        rec = self._take_step(step)
        if rec is None:
            return
        if invalid:
            self.counts.failed_load_blocks += len(invalid)
        for rid, (epoch, upto) in rec.items():
            r = self._reqs.get(rid)
            if r is None or r.epoch != epoch or not r.allocated or self.disabled:
                continue
            if invalid and not invalid.isdisjoint(r.block_ids):
                continue  # vLLM recomputes from the failed block; its KV is not trusted yet
            # Speculative decoding: the step computed KV for its draft tokens too, and vLLM
            # rolled the rejected ones back; the last token (sampled, at the first rejected
            # draft's position) has no KV of its own yet. Async scheduling: not past vLLM's
            # own safe frontier (what its prefix cache takes): a turn of a streaming-input
            # session that stopped had its stop token replaced by the next chunk, and a step
            # scheduled before the stop was seen computed KV for the stop token there.
            req = r.request
            safe = req.num_computed_tokens - getattr(req, "num_output_placeholders", 0)
            r.confirmed = max(r.confirmed, min(upto, req.num_tokens - 1, safe))
            self._plan_save(r, final=False)

    def _take_step(self, step: int | None) -> dict[str, tuple[int, int]] | None:
        """The record of the step whose output came. Outputs come in step order, but vLLM
        reports none for a step that produced nothing (no token scheduled, an empty
        connector output): matched by number, such a step's record is dropped here, where
        taking the oldest record paired every later output with an earlier step's (after
        each request waiting on a prefetch, saves lagged one more step, and the records
        piled up)."""
        steps = self._steps
        if step is None:
            return steps.popleft()[1] if steps else None
        while steps and steps[0][0] < step:
            steps.popleft()
        if steps and steps[0][0] == step:
            return steps.popleft()[1]
        return None

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: (False: vLLM frees the blocks, the last save fences
        the next forward; True: they wait for the rest of its save, ``held.py``; the
        kv_transfer_params of a P/D producer, see :meth:`_transfer_params`)."""
        with self._call():
            return self._finished(request)

    def _finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.prefetch.forget(rid)
        if request.status.name == "FINISHED_ABORTED":
            self.counts.aborted += 1
        r = self._reqs.get(rid)
        if r is None:
            return False, None
        try:
            held, delay = self._finish(r, request)
            return delay, self._transfer_params(r, request, held)
        finally:  # after the save's batch was published: it noted its seq on the request
            del self._reqs[rid]

    # ------------------------------------------------------------ P/D over the store

    def _transfer_params(self, r: RequestState, request: Any, held: int) -> dict[str, Any] | None:
        """A P/D producer's answer (:mod:`.pd`): the leading prompt blocks this request
        saved, when it asked (``do_remote_decode``) and its blocks reach the store.
        ``held``: its leading blocks in the store or on their way (``_stored_prefix``), not
        all it computed (a save stops where no host block is free). Nothing while the store
        declines writes (down, or full: every consumer would wait its budget for them)."""
        if (self.disabled or not self.saves or self.store is None or not self.cfg.storage_write
                or r.generation != self._generation or not r.allocated
                or self.cm.store_writes_failing):
            return None
        return pd.answer(getattr(request, "kv_transfer_params", None),
                         min(r.num_prompt_blocks, held), self._namespace)

    def _awaits_producer(self, r: RequestState, found: int) -> bool:
        """True while the request's producer promised more leading blocks than host and
        store (or vLLM's own cache) hold (``found``), for at most ``_await_s`` from the
        first ask (:mod:`.pd`); vLLM asks again next step."""
        w = r.wait
        if w is None:
            try:
                n = pd.promised(getattr(r.request, "kv_transfer_params", None), self._namespace)
            except ValueError as e:  # forged or garbled: no wait on it
                self._bad_params_log(req_id=r.request.request_id, error=str(e))
                n = None
            # (best_effort waits for nothing: a promise is no wait, not an expired one)
            w = r.wait = (pd.ProducerWait(min(n, r.num_prompt_blocks))
                          if n and self._await_s > 0 else pd.ProducerWait(over=True))
        first = w.until is None
        state = w.step(found, time.monotonic(), self._await_s)
        if state == pd.WAIT:
            self.counts.awaited += first
            return True
        if state == pd.EXPIRED:
            self.counts.await_expired += 1
            self._await_expired_log(req_id=r.request.request_id, num_promised=w.blocks,
                                    num_found=found, waited_s=self._await_s)
        return False

    def _finish(self, r: RequestState, request: Any) -> tuple[int, bool]:
        """Save what is left and let the request go, or hold it (True) while its save waits
        for a save in flight on its path; the leading blocks zkv held for it (saved, on
        their way, or matched; a producer's: in the store or on their way)."""
        rid = request.request_id
        self._poll()
        if not r.allocated or self.disabled:
            if self.cm.has_request(rid):
                self.cm.finish(rid)
            return 0, False
        if request.status.name in _STOPPED_BY_OUTPUT:
            # the last step's forward is done and was not hit by a failed load (vLLM would
            # not have finished it): every token but the last sampled one has its KV
            r.confirmed = max(r.confirmed, min(request.num_computed_tokens,
                                               request.num_tokens - 1))
        self._plan_save(r, final=True)
        self._flush()
        held = promise = self.cm.num_held_blocks(rid)
        if (self.store is not None and self.cfg.storage_write
                and pd.asked(getattr(request, "kv_transfer_params", None))):
            if held < self._savable(r):
                held = self._finish_producer_save(r)
            promise = self._stored_prefix(rid, held)
        if held < self._savable(r) and self.cm.save_waits(rid, chain=True):
            self._held.hold(r)  # vLLM keeps its blocks: saved on at the next steps
            return promise, True
        self.cm.finish(rid)
        seq = r.last_save_seq
        if seq is not None and not self.dp.settled(seq):
            # vLLM frees the blocks now and may reuse them at its next schedule(): that
            # step's forward must not start before the save read them (gated workers run
            # every earlier batch first anyway; ungated ones wait on the fence). Why not
            # hold every finish's blocks: held.py.
            self._fence = max(self._fence, seq)
        return promise, False

    def _stored_prefix(self, rid: str, held: int) -> int:
        """A P/D producer's promise: its held blocks in the store (one query: it may have
        evicted some since their write) or on their way, the rest written again."""
        query = self.cm.storage_exists
        if query is None or self.cm.store_writes_failing:  # (no promise: no query either)
            return held
        promise = self.cm.store_again(rid, int(query(self.cm.request(rid).hashes[:held])))
        self._flush()
        return promise

    def _savable(self, r: RequestState) -> int:
        """Leading prompt blocks whose KV the request computed for sure (saves stop there)."""
        return min(r.num_prompt_blocks, r.confirmed // self.bs) if self.saves else 0

    def _finish_producer_save(self, r: RequestState) -> int:
        """A P/D producer's final save stopped at a save in flight on its path: its own
        earlier chunk's (the save of the previous step's blocks goes out with this step's
        batch), or another request's of the same prefix that finished in the same step
        (vLLM calls ``request_finished`` for each before the step's output comes back).
        The request is going away, so nothing would take it up later: its answer would
        promise none of the rest, and the rest would never be saved. Wait for those acks,
        at most ``PRODUCER_SAVE_WAIT_S``, saving on as they commit; the blocks held."""
        rid = r.request.request_id
        want = self._savable(r)
        held = self.cm.num_held_blocks(rid)
        deadline = time.monotonic() + PRODUCER_SAVE_WAIT_S
        while held < want and self.dp.in_flight and not self.disabled:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._poll(min(left, 0.01))
            self._plan_save(r, final=True)
            self._flush()
            held = self.cm.num_held_blocks(rid)
        return held

    # ------------------------------------------------------------ saves and batches

    def _plan_save(self, r: RequestState, final: bool) -> None:
        if not self.saves or (self.cfg.policy == WRITE_BACK and not final):
            return  # a consumer saves nothing
        if r.generation != self._generation:
            return  # running across a reset: its KV may be of both weights
        upto = r.confirmed
        r.extend_hashes(upto, self.bs)
        if self.cfg.policy == WRITE_THROUGH_SELECTIVE and not final:
            k = min(r.popular, len(r.hashes))  # (once popular stays so: it scans new ones)
            thr = self.cfg.write_through_threshold
            while k < len(r.hashes) and self._seen.get(r.hashes[k], 0) >= thr:
                k += 1
            r.popular = k
            upto = min(upto, k * self.bs)
        rid = r.request.request_id
        try:  # a save planned goes with the next batch that takes ops (see _publish)
            self.cm.cache_computed(rid, upto, block_hashes=r.hashes, device_ids=r.block_ids,
                                   chain=final)  # (final: on past its own save in flight)
        except ValueError as e:  # hashes of a resumed request diverged: stop saving it
            self.log.error(E.SAVE_REFUSED, req_id=rid, error=str(e))

    def _flush(self, keep: tuple[str, ...] = ()) -> None:
        """Publish the open ops now (a finishing request's saves, a prefetch), but those
        of the kinds in ``keep``."""
        self._publish(self.cm.take_ops(keep))

    def _publish(self, ops: list[Any]) -> int | None:
        """Publish ``ops`` as one batch; its seq (None: nothing to publish, or zkv off). A
        request whose save is among them notes the seq (``last_save_seq``, its fence once
        vLLM frees its blocks): a batch without its save, such as the pump's storage ops,
        notes nothing."""
        if not ops:
            return None
        if self.dp.closed:  # a late call of vLLM's after close: nothing would run them
            self.cm.fail_pending()
            return None
        savers = self._savers(ops)
        try:
            seq = self.dp.publish(ops, self._step)
            self._kick.set()
        except RankLost as e:
            self._disable(f"rank {e.rank} lost: {e.reason}")
            return None
        for rid in savers:
            r = self._reqs.get(rid) or self._held.get(rid)
            if r is not None:
                r.last_save_seq = seq
        self.log.debug(E.BATCH_PUBLISHED, seq=seq, num_ops=len(ops))
        return seq

    def _savers(self, ops: list[Any]) -> list[str]:
        """The requests whose saves are among ``ops`` (the ledger keeps one per request)."""
        pending = [self.cm.ledger.pending[op.id] for op in ops]
        return [p.reqs[0].req_id for p in pending if p.kind == SAVE and p.reqs[0] is not None]

    def wait_idle(self, timeout_s: float) -> bool:
        """Commit acks until no batch is in flight (shutdown, tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while self.dp.in_flight and time.monotonic() < deadline:
            with self._lock:
                self._poll(min(0.1, max(0.0, deadline - time.monotonic())))
        return not self.dp.in_flight

    def _poll(self, timeout_s: float = 0.0) -> None:
        for done in self.dp.poll(timeout_s):
            self._batch_seconds.observe(done.latency_s)
            self.cm.on_ops_done(done.results.values(), done.seq)
            self._io_open = True  # the pump publishes what the commit opened
            self._kick.set()
        # A rank lost with nothing in flight completes no batch: ask the dispatcher, so
        # that no later call promises vLLM a load that no batch would run.
        if not self.disabled and self.dp.num_lost:
            self._disable(f"ranks {sorted(self.dp.lost_ranks)} lost")
        for rid, failed in self.cm.take_load_failures().items():
            self._load_failed_log(req_id=rid, num_blocks=len(failed))

    def _disable(self, reason: str) -> None:
        """A lost rank ends zkv for this engine: vLLM goes on without it (misses only).
        Ranks that all said bye closed in order (vLLM stops its workers first): a warning.
        The L3 writes waiting to be tried again are dropped (``store_dropped`` at close)."""
        self.disabled = reason
        bye = bool(self.dp.num_lost) and self.dp.lost_ranks <= self.dp.left_ranks
        (self.log.warning if bye else self.log.error)(E.DISABLED, reason=reason, said_bye=bye)
        self._store_dropped = self.cm.num_unstored_blocks
        self.cm.fail_pending()

    # ------------------------------------------------------------ helpers

    def _new_req(self, request: Any) -> RequestState:
        mm = request_mm_items(request, self._mm_scope) + request_embeds_items(request, self.bs)
        root, hashes, n = self._hash_prompt(request, mm)
        return RequestState(request, root, mm, hashes, n, epoch=next(self._epochs),
                    generation=self._generation)

    def _hash_prompt(self, request: Any, mm: tuple[MultiModalItem, ...]
                     ) -> tuple[bytes, list[BlockHash], int]:
        root = request_root(request, self._generation)
        hashes = hash_tokens(request_tokens(request), self.bs, parent=root, mm_items=mm)
        return root, hashes, len(hashes)

    def reset(self) -> bool:
        """vLLM's cache reset (an RL loop's, after new weights): a new random generation in
        every chain's root, so nothing cached before (host, L3, any engine) matches again;
        a waiting request is hashed anew, a running one saves no more (README). O(1)."""
        with self._lock:
            self._generation = os.urandom(16)
            self.log.info(E.CACHE_RESET, num_requests=len(self._reqs))
        return True

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._snapshot()

    def counters(self) -> dict[str, int]:
        """The running totals alone: O(1), for what reads them every step (vLLM's
        ``get_kv_connector_stats``). :meth:`snapshot` adds the cache's, which walk the tree
        (~5 ms at 25,000 nodes)."""
        with self._lock:
            return {**self.counts.totals(), "saved_blocks": self.cm.stats.saved_external,
                    "loaded_blocks": self.cm.stats.loaded_external}

    def _snapshot(self) -> dict[str, Any]:
        c = self.counts
        return {**self.counters(),
                "sched_us_per_request": 1e6 * c.sched_s / max(1, c.requests),
                "disabled": self.disabled, **{f"cm_{k}": v for k, v in self.cm.snapshot().items()
                                              if isinstance(v, int)}}

    def hit_tiers(self, rid: str, num_tokens: int) -> tuple[int, int]:
        """``num_tokens`` external hits of request ``rid`` (its last match's) split by the
        tier that had them: (zkv's host tier, L3)."""
        with self._lock:
            r = self._reqs.get(rid)
            host = num_tokens if r is None else r.host_tokens(num_tokens, self.bs)
        return host, num_tokens - host

    def in_flight(self) -> dict[str, int]:
        """What is not over yet: tracked requests, finishes held (``held.py``), requests
        holding zkv blocks, ops and batches not acked by every rank, steps without output
        yet (async scheduling keeps the last), blocks whose L3 write waits for a retry."""
        with self._lock:
            return {"requests": len(self._reqs), "held": len(self._held),
                    "cache_requests": self.cm.num_running(),
                    "ops": self.cm.num_pending_ops, "batches": self.dp.in_flight,
                    "steps": len(self._steps), "store_retry": self.cm.num_unstored_blocks}

    def close(self) -> None:
        """Report what is left (``connector.closed``, a warning when something was; an
        error ``connector.invariants_broken``: one O(tree) check), then close; batches in
        flight are reported, not waited for. Then vLLM's calls miss; a second close: no-op."""
        from zkv.integrations.vllm import metrics

        if self.dp.closed:
            return
        metrics.unregister_half(self)  # (the process's other engines keep theirs)
        self._stop.set()
        self._kick.set()
        self._pump_thread.join(timeout=5.0)
        with self._lock:
            if not self.dp.closed:  # (two threads closing at once: one report)
                self._close()

    def _close(self) -> None:
        try:
            self.cm.check_invariants()
            broken = None
        except AssertionError as e:
            broken = str(e) or "assertion failed"
            self.log.error(E.INVARIANTS_BROKEN, error=broken[:500])
        left = {**self.in_flight(), "store_dropped": self._store_dropped}
        # an open step is no leak: under async scheduling vLLM keeps the step it scheduled
        # before the last request finished, and a later output drops older records
        leak = any(v for k, v in left.items() if k != "steps")
        report = self.log.info if broken is None and not leak else self.log.warning
        report(E.CLOSED, invariants="ok" if broken is None else "broken",
               num_steps=self._step, disabled=self.disabled, **left)
        self.cm.flush_logs()
        for repeated in self._repeating:
            repeated.flush()
        self.disabled = self.disabled or "closed"  # a late call of vLLM's: misses, no batch
        self.dp.close()
