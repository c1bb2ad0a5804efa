"""A faithful driver of the vLLM connector, run as a child process (it imports vLLM)::

    python -m tests.integrations.driven '{"runs": [{"name": "w", "scenario": "workload",
                                                    "args": {"seed": 1, "tp": 1}}]}'

prints one JSON line, ``{name: result}`` (a run that raised: ``{"error": traceback}``).

What runs is what a synchronous vLLM engine runs, less the model: vLLM's own ``Scheduler``
creates zkv's ``ZkvConnector`` (scheduler role) from a ``KVTransferConfig``; a zkv
``WorkerHalf`` per rank runs in this process over CPU KV tensors of vLLM's CPU layout,
ungated (as a synchronous engine's: ``gate: auto``); each step binds the step's metadata on
every rank, runs a fake forward, and hands vLLM a ``ModelRunnerOutput`` whose connector
output is what vLLM's ``KVOutputAggregator`` makes of the ranks' ``get_finished`` (a request
is sent once every rank said so) and load errors (their union). The fake forward, per rank
and layer, after ``wait_for_layer_load``::

    write   every token the step computes: its slot (see HEAD_SIZE) gets KV(prefix, rank, layer)
    check   every slot the step reads (each request's tokens before the step's): it holds
            KV(that token's prefix, rank, layer), so a block zkv loaded holds exactly
            the KV its own prefix computed on that rank, in that layer

KV(prefix) comes from a digest chained over the prefix's tokens; a sampled token is one
too, so requests of one prompt generate one text. A slot in a block the step reported as a
failed load is no mismatch (vLLM recomputes it); the workloads inject no failure, and the
tests assert none came.

``saves_stalled(rank)`` holds that rank's device-to-host copies (saves) while it lasts: a
save in flight, for as long as the driver wants, where a real one takes a few ms; one let
go may take ``lag_s`` more (a slow copy: a forward that did not wait for it runs first).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tests.waiting import holds_within, idle_for

BS = 16  # tokens per block
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEAD_SIZE = 2  # one KV head: a layer's tensor is [blocks, 1, BS, 2 * HEAD_SIZE] (vLLM's CPU
# shape), and the fake forward gives each token its 4 floats: every byte of a block is a token's
_VALUE_BITS = 20  # a slot's 4 floats are value * 4 + j: exact in float32
STALL_MAX_S = 20.0  # a stalled save goes on after this, whatever the driver does
IDLE_DEADLINE_S = 30.0  # run_until_idle gives up after this (a request never let go)
LAG_S = 0.5  # chained: the stalled saves, let go just before a step, take this long more


class StalledSaves:
    """A copy backend whose d2h waits while :attr:`go` is clear (at most ``STALL_MAX_S``),
    then :attr:`lag_s` more; everything else is the wrapped backend's."""

    def __init__(self, backend: Any) -> None:
        self._b = backend
        self.go = threading.Event()
        self.go.set()
        self.num_stalled = 0
        self.lag_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._b, name)

    def copy_d2h(self, *args: Any, **kwargs: Any) -> None:
        if not self.go.is_set():
            self.num_stalled += 1
            self.go.wait(STALL_MAX_S)
            idle_for(self.lag_s)  # (a copy that takes this long: the time is the point)
        self._b.copy_d2h(*args, **kwargs)

    def wait_stalled(self, n: int, timeout: float = 10.0) -> bool:
        """Whether ``n`` copies came to the stall within ``timeout`` (a batch published
        reaches its rank's thread some time later: a stall lifted before missed it)."""
        return holds_within(lambda: self.num_stalled >= n, timeout, interval=0.001)


class Prefixes:
    """Per request, a 64-bit digest of each token's prefix, chained: ``d_p = H(d_{p-1},
    token_p)``; the KV a slot should hold derives from it, the rank and the layer."""

    def __init__(self) -> None:
        self._d: dict[str, list[int]] = {}

    def digests(self, rid: str, tokens: list[int]) -> list[int]:
        d = self._d.setdefault(rid, [])
        prev = d[-1] if d else 0
        for tok in tokens[len(d):]:
            prev = int.from_bytes(hashlib.blake2b(
                prev.to_bytes(8, "little") + tok.to_bytes(4, "little"), digest_size=8
            ).digest(), "little")
            d.append(prev)
        return d

    @staticmethod
    def values(digests: list[int], rank: int, layer: int) -> torch.Tensor:
        """The slots' expected contents, ``[len(digests), 4]`` float32."""
        mix = rank * 0x9E3779B97F4A7C15 + layer * 0xC2B2AE3D27D4EB4F
        base = torch.tensor([((d ^ mix) * 0xFF51AFD7ED558CCD >> 40) % (1 << _VALUE_BITS)
                             for d in digests], dtype=torch.float32)
        return base[:, None] * 4 + torch.arange(4, dtype=torch.float32)

    @staticmethod
    def token(digest: int) -> int:
        """The token the fake model samples after a prefix."""
        return 10 + digest % 3000


class Rig:
    """vLLM's Scheduler with zkv's connector, ``tp`` worker halves and the fake forward."""

    def __init__(self, *, tp: int = 1, num_blocks: int = 12, host_blocks: int = 32,
                 max_num_seqs: int = 4, max_num_batched_tokens: int = 32) -> None:
        self.tp, self.num_blocks = tp, num_blocks
        self._model_dir = tempfile.mkdtemp(prefix="zkv-driven-")
        self.workers: list[Any] = []
        self.sched: Any = None
        try:
            self._build(host_blocks, max_num_seqs, max_num_batched_tokens)
        except BaseException:
            self.close()
            raise
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BS, sha256)
        self.prefixes = Prefixes()
        self.num_steps = 0
        self.mismatches: list[dict[str, Any]] = []
        self.num_mismatched_slots = 0
        self.load_error_blocks: set[int] = set()
        self.sent: dict[str, int] = {}  # request id -> step vLLM was told it was sent
        self._reports: dict[str, int] = {}  # rid -> ranks that reported it sent
        self.first: dict[str, tuple[int, int]] = {}  # rid -> (prompt, computed) at 1st step
        self.ext: dict[str, int] = {}  # rid -> external tokens vLLM allocated for it
        self.finished: dict[str, bool] = {}  # rid -> request_finished's delay_free_blocks
        self.finish_blocks: dict[str, list[int]] = {}  # rid -> its vLLM blocks at the finish
        self._watch_connector()

    def _build(self, host_blocks: int, max_num_seqs: int, max_num_batched_tokens: int
               ) -> None:
        from transformers import LlamaConfig
        from vllm.config import (
            CacheConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=len(LAYERS), num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=4096
                    ).save_pretrained(self._model_dir)
        engine_id = "dv" + uuid.uuid4().hex[:10]
        extra = {"host_blocks": host_blocks, "storage": "none", "log_level": "error"}
        vc = VllmConfig(
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=1024, enable_chunked_prefill=True, is_encoder_decoder=False,
                async_scheduling=False),
            model_config=ModelConfig(model=self._model_dir, dtype="float32", seed=0,
                                     skip_tokenizer_init=True, max_model_len=1024),
            cache_config=CacheConfig(block_size=BS, cache_dtype="auto",
                                     enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="ZkvConnector",
                kv_connector_module_path="zkv.integrations.vllm_connector",
                kv_role="kv_both", engine_id=engine_id, kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tp))
        vc.cache_config.num_gpu_blocks = self.num_blocks
        kcc = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(LAYERS, FullAttentionSpec(block_size=BS, num_kv_heads=1,
                                                       head_size=HEAD_SIZE,
                                                       dtype=torch.float32))])
        self.kv = [self._start_worker(vc, kcc, extra, engine_id, rank)
                   for rank in range(self.tp)]
        # (the scheduler half waits for every rank to join at its start)
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=kcc, block_size=BS,
                               structured_output_manager=StructuredOutputManager(vc),
                               log_stats=True)

    def _start_worker(self, vc: Any, kcc: Any, extra: dict[str, Any], engine_id: str,
                      rank: int) -> dict[str, torch.Tensor]:
        """What the worker-role connector does at ``register_kv_caches``: a WorkerHalf over
        this rank's tensors ``[blocks, heads, block, 2 * head]`` (vLLM's CPU layout)."""
        from vllm.platforms import current_platform

        from zkv.integrations.vllm.config import parse_extra_config
        from zkv.integrations.vllm.connector import geometry, open_l3
        from zkv.integrations.vllm.identity import model_identity
        from zkv.integrations.vllm.ipc import ipc_endpoints
        from zkv.integrations.vllm.layout import cache_layout, kv_views
        from zkv.integrations.vllm.worker import WorkerHalf

        cfg = parse_extra_config(extra)
        geo = geometry(vc, kcc)
        fp8 = str(current_platform.fp8_dtype()).removeprefix("torch.")
        model = model_identity(vc.model_config, vc.cache_config, fp8_e4m3=fp8)
        tensors = {n: torch.zeros(self.num_blocks, 1, BS, 2 * HEAD_SIZE) for n in LAYERS}
        names, views, kind = kv_views(tensors, geo, cpu=True)
        block_bytes = 2 * geo.num_layers * geo.kv_heads * BS * geo.head_dim * 4
        layout = cache_layout(geo, kv_layout=kind, num_host_blocks=cfg.num_host_blocks(
            block_bytes), world_size=self.tp, model=model)
        pub, pull, _ = ipc_endpoints(engine_id, create=True)
        worker = WorkerHalf(cfg, rank, engine_id)
        self.workers.append(worker)
        worker.start(names, views, layout, pub_endpoint=pub, pull_endpoint=pull,
                     store=open_l3(cfg.storage, layout, rank), gated=False)
        actor = worker.sidecar.actor
        actor.backend = StalledSaves(actor.backend)
        return tensors

    def _watch_connector(self) -> None:
        """Note what the connector told vLLM: external tokens allocated, each finish's
        ``delay_free_blocks`` (and the blocks it was asked about)."""
        conn = self.sched.connector
        after_alloc, finished = conn.update_state_after_alloc, conn.request_finished

        def update_state_after_alloc(request: Any, blocks: Any, num_external: int) -> None:
            rid = request.request_id
            self.ext[rid] = self.ext.get(rid, 0) + num_external
            after_alloc(request, blocks, num_external)

        def request_finished(request: Any, block_ids: list[int]) -> Any:
            out = finished(request, block_ids)
            self.finished[request.request_id] = bool(out[0])
            self.finish_blocks[request.request_id] = list(block_ids)
            return out

        conn.update_state_after_alloc = update_state_after_alloc
        conn.request_finished = request_finished

    # ------------------------------------------------------------ requests and steps

    @property
    def half(self) -> Any:
        """zkv's scheduler half (inside the connector vLLM made)."""
        return self.sched.connector.sched

    def add(self, rid: str, tokens: list[int], max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        self.sched.add_request(Request(request_id=rid, prompt_token_ids=list(tokens),
                                       sampling_params=params, pooling_params=None,
                                       block_hasher=self._hasher))

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @contextlib.contextmanager
    def saves_stalled(self, rank: int) -> Iterator[StalledSaves]:
        backend = self.workers[rank].sidecar.actor.backend
        backend.go.clear()
        try:
            yield backend
        finally:
            backend.go.set()

    def step(self, before_bind: Callable[[], Any] | None = None) -> Any:
        """One engine step: schedule, bind, fake forward, output back to vLLM;
        ``before_bind`` runs between the schedule and the binds."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        from zkv.integrations.vllm.connector import ZkvWorkerMetadata

        so = self.sched.schedule()
        self.num_steps += 1
        meta = so.kv_connector_metadata
        if before_bind is not None:
            before_bind()
        for w in self.workers:
            w.bind(meta)
        work = [(r.req_id, r.num_computed_tokens, so.num_scheduled_tokens[r.req_id])
                for r in so.scheduled_new_reqs]
        for r in so.scheduled_new_reqs:
            self.first.setdefault(r.req_id, (len(r.prompt_token_ids), r.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        work += [(rid, cached.num_computed_tokens[i], so.num_scheduled_tokens[rid])
                 for i, rid in enumerate(cached.req_ids)]
        errors: set[int] = set()
        for rank, w in enumerate(self.workers):
            self._forward(rank, w, work)
            errors |= set(w.load_errors())
        self.load_error_blocks |= errors
        sampled = []
        for rid, start, n in work:
            req = self.sched.requests[rid]
            end = start + n >= req.num_tokens
            digests = self.prefixes.digests(rid, list(req.all_token_ids))
            sampled.append([Prefixes.token(digests[-1])] if end else [])
        sending = self._sending()
        kvo = KVConnectorOutput(invalid_block_ids=errors, finished_sending=sending or None,
                                kv_connector_worker_meta=ZkvWorkerMetadata(meta.step))
        ids = [rid for rid, _, _ in work]
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, logprobs=None,
                                prompt_logprobs_dict={}, pooler_output=[],
                                kv_connector_output=kvo)
        self.sched.update_from_output(so, out)
        return so

    def _forward(self, rank: int, worker: Any, work: list[tuple[str, int, int]]) -> None:
        """Per layer: wait for its loads, write the step's tokens, check what it reads."""
        kv = self.kv[rank]
        where = {}
        for rid, start, n in work:
            req = self.sched.requests[rid]
            digests = self.prefixes.digests(rid, list(req.all_token_ids))
            block_ids = self.sched.kv_cache_manager.get_block_ids(rid)[0]
            pos = torch.arange(start + n)
            blocks = torch.tensor(block_ids, dtype=torch.long)[pos // BS]
            where[rid] = (digests[: start + n], blocks, pos % BS, start)
        for layer, name in enumerate(LAYERS):
            worker.wait_for_layer_load(name)
            t = kv[name]
            for digests, blocks, slots, start in where.values():
                t[blocks[start:], 0, slots[start:]] = Prefixes.values(
                    digests[start:], rank, layer)
            for rid, (digests, blocks, slots, start) in where.items():
                if not start:
                    continue
                want = Prefixes.values(digests[:start], rank, layer)
                got = t[blocks[:start], 0, slots[:start]]
                self._compare(rid, rank, layer, got, want, blocks[:start])

    def _compare(self, rid: str, rank: int, layer: int, got: torch.Tensor,
                 want: torch.Tensor, blocks: torch.Tensor) -> None:
        bad = (got != want).any(dim=1).nonzero().flatten().tolist()
        if not bad:
            return
        self.num_mismatched_slots += len(bad)
        if len(self.mismatches) < 5:
            p = bad[0]
            self.mismatches.append({"step": self.num_steps, "req": rid, "rank": rank,
                                    "layer": layer, "num_slots": len(bad), "first_pos": p,
                                    "block": int(blocks[p]), "got": got[p].tolist(),
                                    "want": want[p].tolist()})

    def _sending(self) -> set[str]:
        """vLLM's KVOutputAggregator on the ranks' ``get_finished``: sent once every rank
        reported it."""
        for w in self.workers:
            for rid in w.finished_saves() or ():
                self._reports[rid] = self._reports.get(rid, 0) + 1
        done = {rid for rid, n in self._reports.items() if n == self.tp}
        for rid in done:
            del self._reports[rid]
            self.sent[rid] = self.num_steps
        return done

    def run_until_idle(self, max_steps: int = 5000) -> bool:
        """Step until vLLM has nothing left (finished requests it keeps blocks for count);
        whether it got there within ``max_steps`` and ``IDLE_DEADLINE_S``."""
        deadline = time.monotonic() + IDLE_DEADLINE_S
        for _ in range(max_steps):
            if not self.sched.has_requests():
                return True
            if time.monotonic() > deadline:
                return False
            self.step()
        return not self.sched.has_requests()

    # ------------------------------------------------------------ the end

    def free_blocks(self) -> int:
        """vLLM's free device blocks (its null block, never free, is not counted: all are
        free at ``num_blocks - 1``)."""
        return int(self.sched.kv_cache_manager.block_pool.get_num_free_blocks())

    def end_state(self) -> dict[str, Any]:
        """Once idle: what vLLM and zkv hold, zkv's counters, the forward's findings."""
        half = self.half
        settled = half.wait_idle(10.0)
        try:
            half.cm.check_invariants()
            invariants = "ok"
        except AssertionError as e:
            invariants = str(e)[:500] or "broken"
        snap = half.snapshot()
        return {"idle": not self.sched.has_requests(), "settled": settled,
                "free_blocks": self.free_blocks(), "usable_blocks": self.num_blocks - 1,
                "in_flight": half.in_flight(), "invariants": invariants,
                "counters": {k: v for k, v in snap.items() if isinstance(v, int)},
                "mismatches": self.mismatches, "num_mismatched_slots": self.num_mismatched_slots,
                "load_error_blocks": sorted(self.load_error_blocks), "steps": self.num_steps,
                "ext": self.ext, "first": self.first, "finished": self.finished,
                "finish_blocks": self.finish_blocks, "sent": self.sent,
                "stalled_saves": sum(w.sidecar.actor.backend.num_stalled
                                     for w in self.workers if w.sidecar is not None)}

    def close(self) -> None:
        try:
            if self.sched is not None:
                self.sched.connector.shutdown()
        finally:
            for w in self.workers:
                w.close()
            shutil.rmtree(self._model_dir, ignore_errors=True)


@contextlib.contextmanager
def rig(**kwargs: Any) -> Iterator[Rig]:
    r = Rig(**kwargs)
    try:
        yield r
    finally:
        r.close()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 3005) for _ in range(n)]


# ---------------------------------------------------------------- scenarios


def workload(seed: int, tp: int = 1, num_requests: int = 40, num_docs: int = 4,
             abort_p: float = 0.03, reset_p: float = 0.0, **rig_args: Any) -> dict[str, Any]:
    """Requests over a few documents that share a one-block system prompt, arriving while
    others run, on a tight vLLM cache (12 blocks: vLLM preempts and evicts all the time)
    and a small host tier (zkv evicts too): cut at any token, a suffix of their own, 1 to
    20 tokens generated, a few aborted (``abort_p`` a step); with ``reset_p`` a step,
    vLLM's cache is reset with its running requests (half of them with zkv's too; vLLM
    raises RuntimeError, the run's error, while it keeps blocks of a held finish).
    ``rig_args``: the :class:`Rig`'s, over these. ``repeat_ext``: external tokens of each
    request whose document an earlier request had (zkv's hits)."""
    rng = random.Random(seed)
    system = _tokens(rng, BS)
    docs = [system + _tokens(rng, rng.choice([1, 2, 3]) * BS + rng.choice([0, 1, 7, BS - 1]))
            for _ in range(num_docs)]
    repeats: list[str] = []
    seen: set[int] = set()
    with rig(**{"tp": tp, "num_blocks": 12, "host_blocks": 24, **rig_args}) as r:
        n = 0
        while n < num_requests or r.sched.has_requests():
            if n < num_requests and rng.random() < 0.35:
                d = rng.randrange(num_docs)
                doc = docs[d]
                cut = rng.choice([len(doc), len(doc), len(doc) - rng.randrange(1, 2 * BS)])
                rid = f"r{n}"
                r.add(rid, doc[:cut] + _tokens(rng, rng.choice([0, 1, 3, BS])),
                      rng.choice([1, 2, 5, 20]))
                if d in seen:
                    repeats.append(rid)
                seen.add(d)
                n += 1
            if r.sched.requests and rng.random() < abort_p:
                r.abort(rng.choice(sorted(r.sched.requests)))
            if reset_p and rng.random() < reset_p:
                r.sched.reset_prefix_cache(reset_running_requests=True,
                                           reset_connector=rng.random() < 0.5)
            if r.sched.has_requests():
                r.step()
            if r.num_steps > 5000:
                break
        out = r.end_state()
    out["repeat_ext"] = [out["ext"].get(rid, 0) for rid in repeats]
    return out


def chained(tp: int = 1) -> dict[str, Any]:
    """A finish past its own save in flight, made certain, on a vLLM cache of 4 blocks.
    ``first``: 3 blocks and 5 tokens, prefilled in two chunks of 2 blocks' worth, 1 token
    generated (4 blocks). The second step's batch carries the save of the first chunk's 2
    blocks; the last rank's saves are stalled (``saves_stalled``) through that step, in
    which ``first`` finishes: its final save (block 2) goes out at once, chained under that
    save (its own), so ``request_finished`` keeps nothing (False) and vLLM frees the 4
    blocks. ``filler`` (2 blocks) comes then, and the stall is let go before the next step
    (its forward waits for the stalled saves: it would wait out ``STALL_MAX_S``), with
    ``lag_s`` (``LAG_S``) more: in that step ``filler`` takes ``first``'s last two
    blocks (vLLM frees a request's blocks tail first) and writes them, so a forward that did
    not wait (the fence) for the chained save to read block 2 would store ``filler``'s KV
    under ``first``'s hash. Every request runs out, vLLM's own cache is reset (a hit must be
    zkv's) and ``first``'s prompt comes again (``again``). Then ``second`` (a prompt of its
    own) finishes the same way, and vLLM's cache reset with zkv's (``reset_connector``)
    right after must succeed (it failed while zkv kept a finished request's blocks)."""
    rng = random.Random(7)
    doc = _tokens(rng, 3 * BS + 5)
    out: dict[str, Any] = {}
    with rig(tp=tp, num_blocks=5, host_blocks=32, max_num_batched_tokens=2 * BS) as r:
        last = r.workers[tp - 1]
        r.add("first", doc, 1)
        r.step()  # chunk 1: blocks 0-1
        with r.saves_stalled(tp - 1) as backend:
            r.step()  # chunk 2 and the finish; this step's batch: chunk 1's save, stalled
            out["save_stalled"] = backend.wait_stalled(1)
            out["at_finish"] = r.half.in_flight()
            out["free_at_finish"] = r.free_blocks()
            r.add("filler", _tokens(rng, 2 * BS), 20)
            backend.lag_s, waited = LAG_S, last.wait_s["bind"]
            backend.go.set()
            r.step()  # filler's first: fenced until the saves that read first's blocks ran
            out["fence_wait_s"] = last.wait_s["bind"] - waited
            out["filler_blocks"] = list(r.sched.kv_cache_manager.get_block_ids("filler")[0])
            backend.lag_s = 0.0
        out["first_idle"] = r.run_until_idle()
        out["first_settled"] = r.half.wait_idle(10.0)
        out["vllm_cache_reset"] = bool(r.sched.reset_prefix_cache())
        r.add("again", doc, 1)
        out["again_idle"] = r.run_until_idle()
        r.add("second", _tokens(rng, 3 * BS + 5), 1)
        r.step()
        with r.saves_stalled(tp - 1) as backend:
            r.step()  # second finishes, its first chunk's save stalled
            out["second_stalled"] = backend.wait_stalled(2)
            out["second_in_flight"] = r.half.in_flight()["batches"]
            out["reset_after_finish"] = bool(r.sched.reset_prefix_cache(reset_connector=True))
        out["second_idle"] = r.run_until_idle()
        out.update(r.end_state())
    out["again_ext"] = out["ext"].get("again", 0)
    return out


def held_by_another(tp: int = 1) -> dict[str, Any]:
    """A finish held for another request's save in flight of its next block, made
    certain, on a vLLM cache of 5 blocks. ``other`` (2 blocks and 5 tokens) and ``held``
    (those 2 blocks, a third and 5 tokens) come together, 1 token each: vLLM schedules
    both in the first step, ``held`` with ``other``'s first 2 blocks as its own prefix hit
    (vLLM caches a block once allocated: they are computed in that very step), and both
    finish in it. ``other``'s final save (blocks 0-1) is taken first, stalled on the last
    rank; ``held``'s stops at it, so ``request_finished`` must keep its 4 blocks (True):
    nothing would save its block 2 once it is gone. ``filler`` (2 blocks) comes and waits
    for blocks. The next step is scheduled while ``other``'s save is stalled (it must not
    let ``held`` go), and the stall is let go before its forward, which waits for that save
    (``other``'s fence: it would wait out ``STALL_MAX_S``); then the stall is put
    back. The next steps save ``held``'s block 2 and let it go (``meta.finish_after``) with
    that batch, stalled on the last rank, which must not report it sent (vLLM would free
    its blocks, and ``filler`` write them). Then the stall ends, every request runs out,
    vLLM's own cache is reset (a hit must be zkv's) and ``held``'s prompt comes again
    (``again``)."""
    rng = random.Random(11)
    doc = _tokens(rng, 3 * BS + 5)
    out: dict[str, Any] = {}
    with rig(tp=tp, num_blocks=6, host_blocks=32, max_num_batched_tokens=4 * BS) as r:
        stalled = r.workers[tp - 1].sidecar
        r.add("other", doc[: 2 * BS + 5], 1)
        r.add("held", doc, 1)
        with r.saves_stalled(tp - 1) as backend:
            so = r.step()  # both computed and finished; other's save (blocks 0-1) stalled
            out["save_stalled"] = backend.wait_stalled(1)
            out["scheduled"] = dict(so.num_scheduled_tokens)
            out["other_seq"] = other_seq = r.half.dp.next_seq - 1
            out["held_at_finish"] = r.half.in_flight()["held"]
            out["free_at_finish"] = r.free_blocks()
            r.add("filler", _tokens(rng, 2 * BS), 4)
            # scheduled with other's save stalled; then it runs: the forward waits for it
            so = r.step(before_bind=backend.go.set)
            out["let_go_while_other_in_flight"] = so.kv_connector_metadata.finish_after
            out["other_saved"] = stalled.wait_acked(other_seq, 10.0) is not None
            backend.go.clear()  # (held's own save, yet to go out, stalls)
            out["free_while_held"] = r.free_blocks()
            out["let_go_seq"] = None
            for i in range(200):  # until a step's metadata lets it go (its last save's seq)
                if not r.half.in_flight()["held"]:
                    break  # (not held at all: a failure the test reports)
                seqs = [seq for rid, seq in r.step().kv_connector_metadata.finish_after
                        if rid == "held"]
                if seqs:
                    out["let_go_seq"], out["let_go_after_steps"] = seqs[0], i
                    break
            for _ in range(3):
                r.step()
            out["sent_while_stalled"] = "held" in r.sent
            out["filler_ran_while_stalled"] = "filler" in r.first
            out["free_while_stalled"] = r.free_blocks()
        out["held_idle"] = r.run_until_idle()
        out["held_settled"] = r.half.wait_idle(10.0)
        out["vllm_cache_reset"] = bool(r.sched.reset_prefix_cache())
        r.add("again", doc, 1)
        out["again_idle"] = r.run_until_idle()
        out.update(r.end_state())
    out["again_ext"] = out["ext"].get("again", 0)
    return out


def reset_reuse(new_id: str = "X") -> dict[str, Any]:
    """A cache reset with running requests preempts ``X`` (vLLM names it in the next
    schedule's ``preempted_req_ids``), ``X`` is aborted before that schedule, and a new
    request comes under ``new_id`` (a client's own ids: ``X`` again, or ``Y``), whose
    prompt shares 3 blocks zkv saved: matched, loaded and allocated in that very
    schedule. The stale mention of ``X`` must not end the new request's tracking (its
    blocks would never be saved)."""
    rng = random.Random(9)
    doc = _tokens(rng, 3 * BS + 4)
    out: dict[str, Any] = {}
    with rig(num_blocks=24) as r:
        r.add("warm", doc, 1)  # zkv saves doc's 3 blocks
        r.run_until_idle()
        r.half.wait_idle(5.0)
        r.add("X", doc + _tokens(rng, 2), 30)
        for _ in range(3):
            r.step()
        out["reset"] = bool(r.sched.reset_prefix_cache(reset_running_requests=True))
        r.abort("X")
        r.add(new_id, doc + _tokens(rng, 5), 40)  # new; matched, loaded, allocated now
        r.step()
        out["tracked"] = r.half.cm.has_request(new_id)
        out["preempted"] = r.half.counters()["preempted"]
        saved = r.half.counters()["saved_blocks"]
        out["idle"] = r.run_until_idle()
        r.half.wait_idle(5.0)
        out["saved_by_new"] = r.half.counters()["saved_blocks"] - saved
        out.update(r.end_state())
    out["new_ext"] = out["ext"].get(new_id, 0)
    return out


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "workload": workload, "chained": chained, "held_by_another": held_by_another,
    "reset_reuse": reset_reuse}


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from zkv import log as zlog

    zlog.configure("driven", None, None, "error")  # (the worker halves' lines: errors only)
    out: dict[str, Any] = {}
    for run in json.loads(argv[1])["runs"]:
        t0 = time.monotonic()
        try:
            res = SCENARIOS[run["scenario"]](**run.get("args", {}))
        except Exception:
            res = {"error": traceback.format_exc()[-4000:]}
        res["seconds"] = round(time.monotonic() - t0, 2)
        out[run["name"]] = res
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv)
