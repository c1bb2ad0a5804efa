"""Prefill/decode disaggregation over zkv's store: the decode instance's time to first token.

Two runs of ``vllm serve`` (vLLM's CPU build, over HTTP, each instance deployed as vLLM
deploys it), one after the other:

    alone   one instance without zkv: each document's prompt arrives at the decode
            instance, which computes it (the baseline)
    pd      a producer (``kv_role: kv_producer``) and a consumer (``kv_consumer``) on one
            ``file://`` store, run as vLLM's P/D proxies run them: the prompt goes to the
            producer with ``kv_transfer_params: {"do_remote_decode": true}`` and one token
            to generate, then to the consumer with the kv_transfer_params it answered

Printed per run: the median time to first token at the decode instance (a one-token
completion of the whole prompt), the ratio pd / alone, the producer's prefill time, where
the consumer's prompt tokens came from, and whether the generated tokens are identical.

    python bench/vllm_pd.py                       # SmolLM2-135M, 6 documents
    python bench/vllm_pd.py --model tiny --docs 4
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _args import positive_int  # noqa: E402
from _cleanup import exit_on_sigterm, scratch_dir  # noqa: E402

from tests.integration.vllm_runner import build_smollm2, build_tiny_llama, scrape  # noqa: E402
from tests.integration.vllm_server import MAX_MODEL_LEN as SERVER_MAX_MODEL_LEN  # noqa: E402
from tests.integration.vllm_server import VllmServer, vllm_sockets_here  # noqa: E402
from tests.servers import free_port  # noqa: E402
from zkv.storage import file_url  # noqa: E402

KV_BYTES = 96 << 20  # vLLM's own cache: about one document of SmolLM2's


def _kv_config(role: str, store: str, logs: str, port: int) -> dict[str, Any]:
    return {"kv_connector": "ZkvConnector",
            "kv_connector_module_path": "zkv.integrations.vllm_connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"host_bytes": "256MiB", "storage": store,
                                          "log_dir": logs, "metrics_port": port}}


def _timed(srv: VllmServer, prompt: list[int], max_tokens: int,
           params: dict[str, Any] | None = None) -> tuple[float, list[int], Any]:
    t0 = time.perf_counter()
    tokens, answer = srv.completion(prompt, max_tokens, params)
    return time.perf_counter() - t0, tokens, answer


def run_alone(tmp: Path, model: str, prompts: list[list[int]], args: list[str]
              ) -> tuple[list[float], list[list[int]]]:
    srv = VllmServer(tmp, model, None, name="alone", kv_bytes=KV_BYTES, args=tuple(args))
    try:
        srv.wait_ready(600.0)
        _timed(srv, prompts[0][:64], 1)  # warm-up: vLLM's first request is slower
        ttft, toks = [], []
        for p in prompts:
            ttft.append(_timed(srv, p, 1)[0])
            toks.append(srv.completion(p, 4)[0])
        return ttft, toks
    finally:
        srv.stop()


def run_pd(tmp: Path, model: str, prompts: list[list[int]], args: list[str]
           ) -> dict[str, Any]:
    store = file_url(tmp / "l3")
    ports = {role: free_port() for role in ("kv_producer", "kv_consumer")}
    servers = {role: VllmServer(tmp, model, _kv_config(role, store, str(tmp / f"logs-{role}"),
                                                       port),
                                name=role, kv_bytes=KV_BYTES, args=tuple(args))
               for role, port in ports.items()}
    try:
        for srv in servers.values():
            srv.wait_ready(600.0)
        prod, cons = servers["kv_producer"], servers["kv_consumer"]
        _timed(prod, prompts[0][:64], 1)
        _timed(cons, prompts[0][:64], 1)
        prefill, ttft, toks = [], [], []
        for p in prompts:
            dt, _, answer = _timed(prod, p, 1, {"do_remote_decode": True})
            prefill.append(dt)
            ttft.append(_timed(cons, p, 1, answer)[0])
            toks.append(cons.completion(p, 4)[0])  # vLLM's own cache has the prompt now
        return {"prefill": prefill, "ttft": ttft, "tokens": toks,
                "consumer": scrape(ports["kv_consumer"])}
    finally:
        for srv in servers.values():
            srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--docs", type=positive_int, default=6)
    ap.add_argument("--doc-tokens", type=positive_int, default=1900)
    ap.add_argument("--workdir", default=None, help="keep the model and logs here")
    args = ap.parse_args()
    if args.doc_tokens >= SERVER_MAX_MODEL_LEN:
        ap.error(f"--doc-tokens must be < {SERVER_MAX_MODEL_LEN} (the servers' --max-model-len, "
                 f"with one token answered), got {args.doc_tokens}")
    exit_on_sigterm()
    with scratch_dir("zkv-bench-pd-", args.workdir) as d, vllm_sockets_here():
        return _run(args, Path(d))


def _run(args: argparse.Namespace, tmp: Path) -> int:
    cache = Path(os.environ.get("ZKV_TEST_CACHE", Path.home() / ".cache" / "zkv-tests"))
    if args.model == "smollm2":
        cache.mkdir(parents=True, exist_ok=True)
        model, vocab, extra = build_smollm2(str(cache / "smollm2-f32"), str(cache)), 49000, []
    else:
        model, vocab = build_tiny_llama(str(tmp / "tiny")), 2000
        extra = ["--skip-tokenizer-init"]
    rng = random.Random(11)
    prompts = [[rng.randrange(vocab) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    alone_ttft, alone_tokens = run_alone(tmp, model, prompts, extra)
    pd = run_pd(tmp, model, prompts, extra)
    a, b = statistics.median(alone_ttft), statistics.median(pd["ttft"])
    z = pd["consumer"]
    full = sum(len(p) // 32 * 32 for p in prompts)
    print(f"P/D over zkv's file:// store, {args.model}, {args.docs} documents x "
          f"{args.doc_tokens} tokens, vLLM deployed (API server, EngineCore, worker)")
    print(f"  decode TTFT, vLLM alone (computes the prompt): median {a * 1e3:8.1f} ms  "
          f"(min {min(alone_ttft) * 1e3:.1f}, max {max(alone_ttft) * 1e3:.1f})")
    print(f"  decode TTFT, zkv P/D (loads the producer's):   median {b * 1e3:8.1f} ms  "
          f"(min {min(pd['ttft']) * 1e3:.1f}, max {max(pd['ttft']) * 1e3:.1f})")
    print(f"  ratio pd / alone: {b / a:.3f}x  (speed-up {a / b:.1f}x)")
    print(f"  producer prefill (its own TTFT): median "
          f"{statistics.median(pd['prefill']) * 1e3:.1f} ms")
    print(f"  consumer prompt tokens: {z['zkv_store_tokens']:,} from the store of "
          f"{full:,} in full blocks, {z['computed_tokens']:,} computed; waited for the "
          f"producer {z['awaited']}x, gave up {z['await_expired']}x")
    print(f"  generated tokens identical to vLLM alone: {pd['tokens'] == alone_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
