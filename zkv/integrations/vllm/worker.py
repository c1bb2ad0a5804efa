"""The worker half of the zkv vLLM connector (one per model worker process / rank).

A gated :class:`~zkv.worker.sidecar.Sidecar` runs over vLLM's own KV tensors. One step::

    bind_connector_metadata(meta)   take the model thread's current CUDA stream as the one
                                    batches start after (vLLM changes it after registration),
                                    release batches <= meta.release_upto, then wait until
                                    every batch before this step's load batch ran here
                                    (gated) or until batch meta.fence ran (ungated): no
                                    earlier save reads a block this forward writes
    forward: wait_for_layer_load(L) layer L of this step's loads is in (CPU: copied;
                                    GPU: the compute stream waits on its event)
    get_block_ids_with_load_errors  this rank's ack of the load batch: the blocks past
                                    ``done`` failed -> vLLM recomputes them; and
                                    meta.unloaded (promised, then no batch: zkv went off);
                                    no ack in time: every block, and the load is called off
    get_finished                    sending: the finished requests whose blocks vLLM kept
                                    for their saves (meta.finish_after) once the batch with
                                    the last one ran here (``held.py``); others' last save
                                    fences the next forward instead

``inject_load_failures`` (a test hook) wraps the copy backend so that the n-th load batch
on ``inject_rank`` scribbles random bytes over its destination blocks and fails: vLLM must
recompute them, or generated tokens change.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from zkv import log as zlog
from zkv.config import CacheLayout
from zkv.errors import TransferError
from zkv.integrations.vllm import events as E
from zkv.integrations.vllm.config import ZkvVllmConfig
from zkv.integrations.vllm.held import SaveReports
from zkv.integrations.vllm.records import ZkvMetadata


class _FaultyLoads:
    """A copy backend whose h2d of chosen load batches writes garbage, then raises."""

    def __init__(self, backend: Any, batches: tuple[int, ...]) -> None:
        self._b = backend
        self._fail = set(batches)
        self._n = -1
        self._new_batch = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._b, name)

    def begin_batch(self, compute_stream: Any = None) -> None:
        self._new_batch = True
        self._b.begin_batch(compute_stream)

    def copy_h2d(self, host_pool: Any, kv_caches: Any, src: Any, dst: Any, layer: int) -> None:
        if self._new_batch:  # counted per batch: the actor's per-op retry fails again
            self._new_batch = False
            self._n += 1
        if self._n in self._fail:
            gen = torch.Generator().manual_seed(self._n)
            for t in kv_caches[layer]:
                for d in dst:
                    blk = t[int(d)]
                    blk.copy_(torch.randn(blk.shape, generator=gen).to(blk.dtype))
            raise TransferError(f"injected load failure (load batch {self._n}, layer {layer})")
        self._b.copy_h2d(host_pool, kv_caches, src, dst, layer)


class WorkerHalf:
    """One rank's Sidecar and the per-step bookkeeping vLLM's worker calls need."""

    def __init__(self, cfg: ZkvVllmConfig, rank: int, engine_id: str | None = None) -> None:
        self.cfg = cfg
        self.rank = rank
        binds: dict[str, Any] = {"role": "worker", "rank": rank}
        if engine_id is not None:
            binds["engine_id"] = engine_id
        self.log = zlog.get_logger("connector", **binds)
        self.sidecar: Any = None
        self.layer_index: dict[str, int] = {}
        self.meta: ZkvMetadata | None = None
        self.gated = True
        self._errors: set[int] = set()
        self._checked: int | None = None
        # a load abandoned while one of its layer copies still ran: the next forward waits
        # for its batch (an ungated one would not: it waits for its fence alone)
        self._overrun: int = -1
        self.wait_s = {"bind": 0.0, "layers": 0.0, "acks": 0.0}  # the forward blocked on zkv
        # a broken copy path or a stuck rank fails every step while it lasts: rate-limited,
        # one limit per cause (a copy error's lines do not hide a first timeout), what they
        # held back written at close, each naming its cause (one event: a summary of
        # held-back lines said which of the three it counted only by that field)
        self._copy_failed_log, self._layer_late_log, self._ack_failed_log = (
            zlog.repeating(zlog.get_logger("connector", cause=cause, **binds), E.LOAD_FAILED)
            for cause in ("copy_failed", "layer_timed_out", "ack_failed"))
        self._batch_late_log = zlog.repeating(self.log, E.BATCH_LATE)
        self.num_steps = 0
        self._reports = SaveReports()  # held finished requests to report once saved here

    def start(self, names: list[str], views: list[tuple[Any, Any]], layout: CacheLayout, *,
              pub_endpoint: str, pull_endpoint: str, store: Any, gated: bool = True) -> None:
        """``gated``: batches wait for :meth:`bind` (needed when vLLM schedules a step while
        the previous forward still runs: async scheduling); without it a batch runs as it
        arrives, which with synchronous scheduling is after the previous forward ended."""
        from zkv.worker.sidecar import Sidecar, resolve_backend, select_device

        device = select_device(views)  # the engine's cache device (None: CPU caches)
        backend: Any = resolve_backend("cpu" if device is None else "auto", device)
        if self.cfg.inject_load_failures and self.rank == self.cfg.inject_rank:
            backend = _FaultyLoads(backend, self.cfg.inject_load_failures)
        self.layer_index = {n: i for i, n in enumerate(names)}
        self.gated = gated
        self.sidecar = Sidecar(views, layout=layout, rank=self.rank, pub_endpoint=pub_endpoint,
                               pull_endpoint=pull_endpoint, backend=backend, store=store,
                               gated=gated, env={})  # (the scheduler half's Dispatcher: no keys)
        self.log.info(E.WORKER_STARTED, gated=gated, backend=type(backend).__name__,
                      num_host_blocks=layout.num_host_blocks)

    # ------------------------------------------------------------ per step

    def bind(self, meta: ZkvMetadata) -> None:
        self.meta = meta
        if meta.finish_after:
            self._reports.add(meta.finish_after)
        self._errors = set(meta.unloaded)  # promised, never loaded: vLLM recomputes them
        self._checked = None
        if meta.release_upto < 0 or self.sidecar is None:
            return
        self.num_steps += 1
        # vLLM's forward may run on another stream than at registration (it makes its own
        # at the first CUDA graph capture): batches released now start after its work.
        self.sidecar.follow_compute_stream()
        self.sidecar.release(meta.release_upto)
        if self.gated:  # every earlier batch ran before this forward
            before = (meta.load_seq if meta.load_seq is not None else meta.release_upto + 1) - 1
        else:  # batches ran as they came after the previous forward: only a fence matters
            before = meta.fence
        before, self._overrun = max(before, self._overrun), -1
        if before >= 0 and self.sidecar.alive and self.sidecar.last_seq < before:
            t0 = time.perf_counter()
            if self.sidecar.wait_acked(before, self.cfg.layer_timeout_s) is None:
                # The forward goes on and writes blocks vLLM freed: a save of them that ran
                # later would store its KV under the finished request's hashes.
                self._abandon_saves(before)
            self.wait_s["bind"] += time.perf_counter() - t0

    def _abandon_saves(self, seq: int) -> None:
        """Give up on the saves of batches up to ``seq`` (vLLM reuses their blocks now) and
        say it (``batch_late``: whether a copy still ran)."""
        assert self.sidecar is not None
        quiet = self.sidecar.abandon_saves(seq, self.cfg.layer_timeout_s)
        self._batch_late_log(seq=seq, timeout_s=self.cfg.layer_timeout_s,
                             saves_abandoned=True, copy_still_running=not quiet)

    def wait_for_layer_load(self, layer_name: str) -> None:
        meta = self.meta
        if meta is None or meta.load_seq is None or self.sidecar is None:
            return
        i = self.layer_index.get(layer_name)
        if i is None:
            return
        t0 = time.perf_counter()
        try:
            self.sidecar.wait_layer(meta.load_seq, i, timeout=self.cfg.layer_timeout_s)
            self.wait_s["layers"] += time.perf_counter() - t0
        except TransferError as e:  # (another op of the batch failed: its copies too)
            self._call_off(meta.load_seq, i, str(e))
            if not self._errors:
                self._copy_failed_log(seq=meta.load_seq, layer=i, error=str(e))
            self._errors.update(meta.loads)
        except TimeoutError as e:
            quiet = self._call_off(meta.load_seq, i, str(e))
            self._layer_late_log(seq=meta.load_seq, layer=i, error=str(e), abandoned=True,
                                 copy_still_running=not quiet)
            self._errors.update(meta.loads)
            self.wait_s["layers"] += time.perf_counter() - t0

    def _call_off(self, seq: int, layer: int, reason: str) -> bool:
        """The load failed or was given up on: vLLM recomputes every block of the step's
        loads (or fails their requests and frees the blocks), so no copy of the batch may
        land later, over a recomputed block or another request's. Whether none still ran
        (one that did lands later: the next bind waits for it)."""
        assert self.sidecar is not None
        quiet = self.sidecar.abandon_load(seq, layer, reason, self.cfg.layer_timeout_s)
        if not quiet:
            self._overrun = max(self._overrun, seq)
        return quiet

    def finished_saves(self) -> set[str] | None:
        """Held finished requests whose last save ran on this rank (or never will: the
        rank is gone; or was given up on after ``layer_timeout_s``, its saves abandoned so
        that no copy reads the blocks once vLLM reuses them); None: none."""
        sc = self.sidecar
        return self._reports.take(lambda seq: sc is None or not sc.alive or sc.last_seq >= seq,
                                  self.cfg.layer_timeout_s, self._abandon_saves)

    def load_errors(self) -> set[int]:
        """Blocks of this step's loads that did not arrive on this rank."""
        meta = self.meta
        if meta is None or meta.load_seq is None or self._checked == meta.load_seq:
            return self._errors
        if self._errors.issuperset(meta.loads):  # (an abandoned load: its ack says no more)
            self._checked = meta.load_seq
            return self._errors
        self._checked = meta.load_seq
        if self.sidecar is None:  # closed (vLLM's teardown): nothing will arrive; recompute
            self._errors.update(meta.loads)
            self.log.info(E.LOAD_FAILED, seq=meta.load_seq, num_blocks=len(meta.loads),
                          error="closed")
            return self._errors
        t0 = time.perf_counter()
        ack = self.sidecar.wait_acked(meta.load_seq, self.cfg.layer_timeout_s)
        self.wait_s["acks"] += time.perf_counter() - t0
        res = None if ack is None else next((r for r in ack.results if r.id == meta.load_op), None)
        error = None if res is None else res.error
        if ack is None:  # (no layer hook waited: a full CUDA graph) vLLM recomputes every
            # block, so no copy of the batch, reached later, may land over them
            error = f"no ack within {self.cfg.layer_timeout_s} s"
            self._call_off(meta.load_seq, 0, error)
        if res is None or not res.ok:
            done = 0 if res is None else res.done
            self._errors.update(meta.loads[done:])
            self._ack_failed_log(seq=meta.load_seq, num_blocks=len(meta.loads) - done,
                                 error=error)
        return self._errors

    def close(self) -> None:
        for repeated in (self._copy_failed_log, self._layer_late_log, self._ack_failed_log,
                         self._batch_late_log):
            repeated.flush()
        self.log.info(E.WORKER_STATS, num_steps=self.num_steps,
                      **{f"wait_{k}_ms": round(v * 1e3, 3) for k, v in self.wait_s.items()})
        if self.sidecar is not None:
            self.sidecar.close()
            self.sidecar = None
