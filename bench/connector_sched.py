"""CPU cost of the vLLM connector's scheduler half per request, without vLLM's noise.

The scheduler half (zkv/integrations/vllm/scheduler.py: CacheManager in external-L1 mode
+ Dispatcher) is driven the way vLLM's scheduler calls it, one request per step, with
request and scheduler-output objects shaped like vLLM's; one real worker process
(``python -m zkv.worker``, CPU backend) executes every batch. Each document (2,048
tokens) is asked twice: the first request computes it (64 blocks saved to zkv's host
pool), the second loads it back (64 blocks). Printed: process CPU time of this process
(the scheduler half, its zmq I/O thread included) per request, against a baseline in the
same run: hashing the prompt alone (what any prefix cache must do).

    python bench/connector_sched.py [--docs 200] [--doc-tokens 2048]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _args import positive_int  # noqa: E402
from _cleanup import exit_on_sigterm  # noqa: E402

from launch.zkvrun import pdeathsig_preexec  # noqa: E402
from zkv import log as zlog  # noqa: E402
from zkv import stopsignals  # noqa: E402
from zkv.config import CacheLayout  # noqa: E402
from zkv.integrations.vllm.config import parse_extra_config  # noqa: E402
from zkv.integrations.vllm.scheduler import SchedulerHalf  # noqa: E402
from zkv.scheduler.hashing import hash_tokens  # noqa: E402

BS = 32


@dataclass
class Req:  # the fields of vllm.v1.request.Request the connector reads
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    status: Any = field(default_factory=lambda: SimpleNamespace(name="WAITING"))
    lora_request: Any = None
    cache_salt: Any = None
    mm_features: list[Any] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def step_output(rid: str, blocks: list[int], computed: int, scheduled: int) -> Any:
    new = SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                             num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={rid: scheduled}, preempted_req_ids=set())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=positive_int, default=200)
    ap.add_argument("--doc-tokens", type=positive_int, default=2048)
    args = ap.parse_args()
    exit_on_sigterm()
    zlog.configure("bench", level="warning")
    blocks_per_doc = args.doc_tokens // BS + 1
    layout = CacheLayout(4, 2, BS, 64, "float16", num_device_blocks=4 * blocks_per_doc,
                         num_host_blocks=2 * args.docs * blocks_per_doc, model="bench")
    tmp = tempfile.mkdtemp(prefix="zkv-bench-")
    pub, pull = f"ipc://{tmp}/pub", f"ipc://{tmp}/pull"
    env = dict(os.environ, RANK="0", ZKV_CONFIG=layout.to_json(), ZKV_PUB_ENDPOINT=pub,
               ZKV_PULL_ENDPOINT=pull, ZKV_BACKEND="cpu", PYTHONPATH=ROOT,
               ZKV_LOG_LEVEL="warning", OMP_NUM_THREADS="1")
    worker = subprocess.Popen([sys.executable, "-m", "zkv.worker"], env=env, cwd=ROOT,
                              preexec_fn=pdeathsig_preexec())
    try:
        stopsignals.check()  # (a signal during the fork: its exception was dropped)
        cfg = parse_extra_config({"host_blocks": layout.num_host_blocks, "storage": "none"})
        half = SchedulerHalf(cfg, layout, pub_endpoint=pub, pull_endpoint=pull,
                             join_timeout_s=60)
        rng = random.Random(3)
        docs = [[rng.randrange(32000) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
        t_hash = time.process_time()
        for d in docs:
            hash_tokens(d, BS)
        t_hash = time.process_time() - t_hash
        cpu = 0.0
        loaded = 0
        for n, d in enumerate(docs + docs):
            req = Req(f"r{n}", d + [n % 1000])
            blocks = [(n * blocks_per_doc + i) % layout.num_device_blocks
                      for i in range(blocks_per_doc)]
            t0 = time.process_time()
            ext, _ = half.get_num_new_matched_tokens(req, 0)
            while ext is None:  # never here: no L3
                ext, _ = half.get_num_new_matched_tokens(req, 0)
            half.update_state_after_alloc(req, blocks, ext)
            half.build_connector_meta(step_output(req.request_id, blocks, ext,
                                                  req.num_tokens - ext))
            req.num_computed_tokens = req.num_tokens  # at schedule time, as vLLM sets it
            half.update_connector_output(())
            req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
            half.request_finished(req)
            cpu += time.process_time() - t0
            loaded += ext
            half.wait_idle(10.0)  # the worker ran the step's batch (vLLM's forward: not timed)
        snap = half.snapshot()
        half.close()
        if snap["disabled"]:
            sys.exit(f"bench: the connector disabled itself: {snap['disabled']}")
    finally:
        worker.terminate()
        worker.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    reqs = 2 * args.docs
    print(f"connector scheduler half: {reqs} requests of {args.doc_tokens} tokens "
          f"({args.docs} documents, each computed once then loaded from zkv's host pool)")
    print(f"  CPU per request      {1e6 * cpu / reqs:8.1f} us   (process CPU time: scheduler "
          "half + its zmq I/O thread)")
    print(f"  hashing the prompt   {1e6 * t_hash / args.docs:8.1f} us   (baseline: what every "
          "prefix cache does)")
    print(f"  ratio                {cpu / reqs / (t_hash / args.docs):8.1f}x")
    print(f"  saved blocks {snap['saved_blocks']}, loaded blocks {snap['loaded_blocks']}, "
          f"tokens served from zkv {loaded} of {reqs * args.doc_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
