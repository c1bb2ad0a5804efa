"""vLLM (CPU build) with and without zkv: prompt processing and time to first token.

For each model, three engines over the same documents (long shared prefixes) and
questions; the measured phase asks every document a new question in an order that
defeats a small vLLM cache:

    big        vLLM, prefix caching on, its KV cache holds every document (the baseline)
    zkv        vLLM's KV cache holds one batch of documents; zkv's host tier holds them all
    recompute  vLLM's KV cache holds one batch of documents; prefix caching off

Every configuration runs the measured phase in generate calls of ``--batch`` prompts, so
they all run the same batches (the small cache can hold one).

Printed: the measured phase's wall time per engine and the ratios zkv/big (target
<= 1.1) and recompute/zkv; time to first token of a single ~2k-token prompt whose prefix
is in zkv's host tier vs recomputed; per-tier prompt tokens and the connector's
scheduler-side cost per request; and whether generated tokens are identical (float32,
greedy) to the recompute run. Each engine runs in its own process (30-70 s to start).

    python bench/vllm_e2e.py                       # tiny random Llama + SmolLM2-135M
    python bench/vllm_e2e.py --models tiny --docs 6
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _args import choices, positive_int  # noqa: E402
from _cleanup import exit_on_sigterm, scratch_dir  # noqa: E402

from tests.integration.vllm_runner import build_smollm2, build_tiny_llama  # noqa: E402
from tests.integration.vllm_server import vllm_sockets_here  # noqa: E402

BLOCK = 32
MAX_POSITIONS = 8192  # both models' max_position_embeddings


def kv_bytes_per_token(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4


def workload(vocab: int, docs: int, doc_tokens: int, seed: int = 7) -> dict[str, Any]:
    rng = random.Random(seed)
    ds = [[rng.randrange(vocab) for _ in range(doc_tokens)] for _ in range(docs)]

    def ask(d: list[int]) -> list[int]:
        return d + [rng.randrange(vocab) for _ in range(rng.randrange(48, 96))]

    return {
        "warm": [ask(d) for d in ds],
        "measured": [ask(d) for d in ds],           # same order: LRU-hostile for vLLM
        "ttft": [ask(d) for d in ds[: min(4, docs)]],
    }


def run(name: str, spec: dict[str, Any], tmp: str) -> dict[str, Any]:
    sp, out = os.path.join(tmp, f"{name}.spec.json"), os.path.join(tmp, f"{name}.out.json")
    with open(sp, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "tests.integration.vllm_runner", "--spec", sp,
                        "--out", out], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"bench: engine {name} failed:\n{p.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def bench_model(label: str, model: str, vocab: int, args: argparse.Namespace,
                tmp: str, multiprocess: bool) -> None:
    per_tok = kv_bytes_per_token(model)
    doc_tokens = args.doc_tokens
    w = workload(vocab, args.docs, doc_tokens)
    doc_blocks = -(-(doc_tokens + 128) // BLOCK)
    # vLLM's small cache runs one batch of --batch prompts, and holds nothing else: the
    # next batch's documents were evicted (every round walks the documents in order)
    small = (args.batch * doc_blocks + 8) * BLOCK * per_tok
    big = (args.docs + 2) * doc_blocks * BLOCK * per_tok + small
    phases = [{"name": "warm", "prompts": w["warm"], "max_tokens": 1}]
    for i in range(args.repeat):  # the same questions again: every round is LRU-hostile
        phases += [{"name": f"measured{i}", "prompts": w["measured"],
                    "max_tokens": args.max_tokens, "group": args.batch},
                   {"name": f"ttft{i}", "prompts": w["ttft"], "max_tokens": 1,
                    "one_by_one": True}]
    base = {"model": model, "tp": 1, "max_model_len": doc_tokens + 256, "phases": phases,
            "max_num_batched_tokens": 8192, "multiprocess": multiprocess}
    zkv_cfg = {"host_blocks": (args.docs + 2) * doc_blocks, "storage": "none"}
    res = {
        "big": run(f"{label}-{multiprocess:d}-big",
                   dict(base, kv_cache_bytes=big, prefix_caching=True), tmp),
        "zkv": run(f"{label}-{multiprocess:d}-zkv",
                   dict(base, kv_cache_bytes=small, prefix_caching=True, connector=zkv_cfg), tmp),
        "recompute": run(f"{label}-{multiprocess:d}-recompute", dict(base, kv_cache_bytes=small,
                                                    prefix_caching=False), tmp),
    }
    def measured(v: dict[str, Any]) -> list[dict[str, Any]]:
        return [p for p in v["phases"] if p["name"].startswith("measured")]

    def ttfts(v: dict[str, Any]) -> list[float]:
        return [x for p in v["phases"] if p["name"].startswith("ttft") for x in p["latencies_s"]]

    wall = {k: statistics.median(p["wall_s"] for p in measured(v)) for k, v in res.items()}
    ttft = {k: statistics.median(ttfts(v)) for k, v in res.items()}
    same = all(a["tokens"] == b["tokens"] for k in ("big", "zkv")
               for a, b in zip(res[k]["phases"], res["recompute"]["phases"]))
    z = measured(res["zkv"])[0]["zkv"]
    zt = res["zkv"]["phases"][-1]["zkv"]
    mode = ("deployed: EngineCore, worker and client in 3 processes" if multiprocess else
            "one process: EngineCore + model worker (the Sidecar a thread beside them)")
    print(f"\n== {label} [{mode}]: {args.docs} documents x {doc_tokens} tokens, "
          f"KV {per_tok} B/token; vLLM cache small {small >> 20} MiB / big {big >> 20} MiB")
    print(f"  measured phase ({args.docs} prompts in generate calls of {args.batch}, "
          f"{args.max_tokens} output tokens each; median of {args.repeat} rounds):")
    for k in ("big", "zkv", "recompute"):
        print(f"    {k:10s} {wall[k]:7.3f} s")
    print(f"  ratio zkv/big       {wall['zkv'] / wall['big']:.3f}x   (target <= 1.1)")
    print(f"  ratio recompute/zkv {wall['recompute'] / wall['zkv']:.2f}x")
    print(f"  TTFT of a ~{doc_tokens + 72}-token prompt (median of {len(ttfts(res['zkv']))}): "
          f"zkv host {ttft['zkv'] * 1e3:.1f} ms, recomputed {ttft['recompute'] * 1e3:.1f} ms, "
          f"vLLM big cache {ttft['big'] * 1e3:.1f} ms "
          f"({ttft['recompute'] / ttft['zkv']:.2f}x faster than recompute)")
    print(f"  prompt tokens after warm-up + 1 round: vLLM local {z['vllm_local_tokens']}, "
          f"zkv host {z['zkv_host_tokens']}, zkv store {z['zkv_store_tokens']}, "
          f"computed {z['computed_tokens']}")
    zw = res["zkv"]["phases"][0]["zkv"]  # after the warm-up (first calls, cold caches)

    def sched_us(snap: dict[str, Any]) -> float:
        return snap["sched_us_per_request"] * snap["requests"]

    rounds = zt["requests"] - zw["requests"]
    print(f"  after every round: zkv host {zt['zkv_host_tokens']} tokens; scheduler-side cost "
          f"{(sched_us(zt) - sched_us(zw)) / max(1, rounds):.0f} us/request over the "
          f"{rounds} requests of the rounds ({zw['sched_us_per_request']:.0f} in the warm-up; "
          f"in one process it includes waits for the GIL)")
    print(f"  tokens identical to the recompute run (float32, greedy): {same}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=choices(("tiny", "smollm2")), default=["tiny", "smollm2"],
                    help="comma-separated: tiny, smollm2 (default both)")
    ap.add_argument("--docs", type=positive_int, default=6)
    ap.add_argument("--doc-tokens", type=positive_int, default=2048)
    ap.add_argument("--max-tokens", type=positive_int, default=4)
    ap.add_argument("--repeat", type=positive_int, default=5,
                    help="measured rounds (median; with 3 the tiny model's ~0.1 s phases "
                         "stay within this VM's noise)")
    ap.add_argument("--batch", type=positive_int, default=2, help="prompts per generate call")
    ap.add_argument("--mode", choices=("both", "inprocess", "deployed"), default="both",
                    help="vLLM in one process and/or as deployed (3 processes on this VM's "
                         "2 cores: the copies then compete with the forward for a core)")
    ap.add_argument("--workdir", default=None, help="keep models and results here")
    args = ap.parse_args()
    if args.doc_tokens + 256 > MAX_POSITIONS:
        ap.error(f"--doc-tokens must be <= {MAX_POSITIONS - 256} (the models' {MAX_POSITIONS} "
                 f"positions, less the prompts' suffixes), got {args.doc_tokens}")
    exit_on_sigterm()
    with scratch_dir("zkv-bench-vllm-", args.workdir) as tmp, vllm_sockets_here():
        for label in args.models:
            if label == "tiny":
                model, vocab = build_tiny_llama(os.path.join(tmp, "tiny")), 2000
            else:
                model, vocab = build_smollm2(os.path.join(tmp, "smollm2"), tmp), 49000
            modes = {"both": (False, True), "inprocess": (False,), "deployed": (True,)}
            for mp in modes[args.mode]:
                bench_model(label, model, vocab, args, tmp, mp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
