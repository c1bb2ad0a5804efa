"""Which of vLLM's KV cache specs the connector takes, checked with vLLM's own spec classes
in a child process (importing vLLM here would change this test process: its warnings,
logging and torch settings). ``tests/integration/test_vllm_e2e.py`` checks the
sliding-window refusal with a real engine too."""

from __future__ import annotations

import pytest

from tests.integrations.child import run_child

pytest.importorskip("vllm", reason="needs vLLM's CPU build: pip install -e '.[vllm]'")

CHILD = r'''
import json, warnings
from types import SimpleNamespace
warnings.simplefilter("ignore")
import torch
from vllm.config import ParallelConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
from zkv.errors import ConfigError
from zkv.integrations.vllm.connector import geometry, world_size

KW = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16}

def config(*specs):
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}" for i in range(4)])
              for s in specs]
    return SimpleNamespace(kv_cache_groups=groups, num_blocks=100)

def outcome(f):
    try:
        got = f()
    except ConfigError as e:
        return str(e)
    return [getattr(got, k) for k in ("num_layers", "kv_heads", "block_size", "head_dim",
                                      "dtype", "num_blocks")] if hasattr(got, "dtype") else got

pp = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2,
                                                     tensor_parallel_size=1))
print(json.dumps({
    "full": outcome(lambda: geometry(None, config(FullAttentionSpec(**KW)))),
    "full_window": outcome(lambda: geometry(None, config(FullAttentionSpec(
        **KW, sliding_window=64)))),
    "sliding_window": outcome(lambda: geometry(None, config(SlidingWindowSpec(
        **KW, sliding_window=64)))),
    "mla": outcome(lambda: geometry(None, config(MLAAttentionSpec(**KW)))),
    "non_causal": outcome(lambda: geometry(None, config(FullAttentionSpec(
        **KW, non_causal=True)))),
    "head_size_v": outcome(lambda: geometry(None, config(FullAttentionSpec(
        **KW, head_size_v=32)))),
    "hybrid": outcome(lambda: geometry(None, config(FullAttentionSpec(**KW),
                                                    SlidingWindowSpec(**KW, sliding_window=64)))),
    "pipeline": outcome(lambda: [world_size(pp)]),
    "decode_cp": outcome(lambda: [world_size(SimpleNamespace(parallel_config=ParallelConfig(
        tensor_parallel_size=2, decode_context_parallel_size=2)))]),
    "prefill_cp": outcome(lambda: [world_size(SimpleNamespace(parallel_config=ParallelConfig(
        tensor_parallel_size=2, prefill_context_parallel_size=2)))]),
    "tensor": outcome(lambda: [world_size(SimpleNamespace(parallel_config=ParallelConfig(
        tensor_parallel_size=2)))]),
}))
'''


@pytest.fixture(scope="module")
def outcomes() -> dict[str, object]:
    return run_child(CHILD)  # type: ignore[no-any-return]


def test_full_attention_is_taken(outcomes: dict[str, object]) -> None:
    # (layers, heads, block, head dim, dtype, blocks)
    assert outcomes["full"] == [4, 2, 16, 64, "float16", 100]
    # a sliding window computed over every block vLLM keeps (its hybrid allocator off)
    assert outcomes["full_window"] == outcomes["full"]


@pytest.mark.parametrize("case, msg", [
    ("sliding_window", "zkv: SlidingWindowSpec KV caches are not supported"),
    ("mla", "zkv: MLAAttentionSpec KV caches are not supported"),
    ("non_causal", "zkv: non-causal attention is not supported"),
    ("head_size_v", "zkv: K and V of different head sizes are not supported"),
    ("hybrid", "zkv: models with 2 KV cache groups"),
    ("pipeline", "zkv: pipeline parallelism is not supported"),
    # a vLLM block then spans 2 x 16 tokens over 2 ranks: hash i would name other tokens
    ("decode_cp", "zkv: context parallelism is not supported (decode_context_parallel_size 2"),
    ("prefill_cp", "zkv: context parallelism is not supported (prefill_context_parallel_size"),
])
def test_other_specs_are_refused_with_one_line(outcomes: dict[str, object], case: str,
                                               msg: str) -> None:
    got = outcomes[case]
    assert isinstance(got, str) and got.startswith(msg) and "\n" not in got, got


def test_tensor_parallel_is_taken(outcomes: dict[str, object]) -> None:
    assert outcomes["tensor"] == [2]
