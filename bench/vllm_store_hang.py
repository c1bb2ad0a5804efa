"""A hung L3 store under a serving engine: what it costs vLLM's clients.

One ``vllm serve`` (vLLM's CPU build, the tiny random Llama) with zkv on a real
redis-server at its default ``timeout_s`` (2 s). Two streaming clients send new 200-token
prompts back to back (each is looked up in L3 by the scheduler's existence query, inside
vLLM's scheduling step) in three phases:

    up      redis-server answers (the baseline)
    hung    redis-server stopped with SIGSTOP: it still accepts connections and answers
            nothing, as a wedged or swapping server does
    back    SIGCONT: it answers again

Printed per phase: requests completed, the ratio to ``up``'s rate, time to first token
(max, and how many requests waited over 0.5 s, and for how long in all), token gaps
(p50 / p99 / max). The engine must keep serving at ``up``'s rate through ``hung`` but for
the one query that finds the store hung (it waits ``timeout_s``).

    python bench/vllm_store_hang.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _args import positive_float  # noqa: E402
from _cleanup import exit_on_sigterm  # noqa: E402

from tests.integration.vllm_runner import build_tiny_llama  # noqa: E402
from tests.integration.vllm_server import VllmServer, vllm_sockets_here  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

CLIENTS = 2
PROMPT_TOKENS = 200
MAX_TOKENS = 64
SLOW_TTFT_S = 0.5


def stream(port: int, model: str, prompt: list[int]) -> list[float]:
    """One streaming completion: the request's start, then each token's arrival."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                           "temperature": 0, "ignore_eos": True, "stream": True})
        t = [time.monotonic()]
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        for line in resp:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                t.append(time.monotonic())
        return t
    finally:
        conn.close()


def phase(port: int, model: str, seconds: float, seed: int) -> dict[str, list[float]]:
    """CLIENTS clients back to back for ``seconds``: every request's TTFT and token gaps."""
    out: dict[str, list[float]] = {"ttft": [], "gaps": []}
    end = time.monotonic() + seconds
    errors: list[BaseException] = []

    def client(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        try:
            while time.monotonic() < end:
                t = stream(port, model, [rng.randrange(2000) for _ in range(PROMPT_TOKENS)])
                out["ttft"].append(t[1] - t[0])
                out["gaps"].extend(b - a for a, b in itertools.pairwise(t[1:]))
        except BaseException as e:  # reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return out


def line(name: str, r: dict[str, list[float]], seconds: float, base_rate: float | None) -> str:
    ttft, gaps = r["ttft"], sorted(r["gaps"])
    rate = len(ttft) / seconds
    slow = [x for x in ttft if x > SLOW_TTFT_S]
    vs = f"{rate / base_rate:5.2f}x" if base_rate else "    - "
    return (f"{name:<5} {len(ttft):>5} {rate:>6.2f} {vs}  {max(ttft):>7.3f} {len(slow):>5}"
            f" {sum(slow):>7.1f}   {gaps[len(gaps) // 2] * 1e3:>6.1f}"
            f" {gaps[int(len(gaps) * .99)] * 1e3:>6.1f}"
            f" {gaps[-1] * 1e3:>6.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=positive_float, default=30.0, help="length of the hung phase")
    args = ap.parse_args()
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="zkv-hang-") as d, vllm_sockets_here():
        tmp = Path(d)
        model = build_tiny_llama(str(tmp / "model"))
        with RedisServer(str(tmp)) as srv:
            cfg = {"kv_connector": "ZkvConnector",
                   "kv_connector_module_path": "zkv.integrations.vllm_connector",
                   "kv_role": "kv_both",
                   "kv_connector_extra_config": {"host_blocks": 80, "storage": srv.url,
                                                 "log_dir": str(tmp / "logs")}}
            vs = VllmServer(tmp, model, cfg, args=("--skip-tokenizer-init",))
            try:
                vs.wait_ready(300)
                phase(vs.port, model, 3.0, 0)  # warm-up
                short = max(5.0, args.seconds / 3)
                print(f"zkv on redis-server (timeout_s 2) under vllm serve, {CLIENTS} streaming"
                      f" clients, {PROMPT_TOKENS}-token prompts, {MAX_TOKENS} tokens each")
                print(f"{'phase':<5} {'reqs':>5} {'req/s':>6} {'vs up':>5}  {'ttft max':>7}"
                      f" {'>0.5s':>5} {'their s':>7}   {'gap50':>6} {'gap99':>6} {'gapmax':>6}"
                      f"  (ttft s; gaps ms)")
                up = phase(vs.port, model, short, 1)
                base = len(up["ttft"]) / short
                print(line("up", up, short, None), flush=True)
                srv.pause()
                try:
                    hung = phase(vs.port, model, args.seconds, 2)
                finally:
                    srv.resume()
                print(line("hung", hung, args.seconds, base), flush=True)
                back = phase(vs.port, model, short, 3)
                print(line("back", back, short, base), flush=True)
            finally:
                vs.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
