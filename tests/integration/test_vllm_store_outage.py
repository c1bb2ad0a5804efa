"""A real ``vllm serve`` with zkv on a real redis-server (or Mooncake master) that dies
mid-run and comes back empty: vLLM keeps serving the same tokens throughout, zkv says once
that the store is unreachable, the host blocks whose writes failed wait, and once it is
back they are written to it while the engine is idle (the pump) and read from it again.

The reference is the engine's own first answer to each prompt (cold: nothing in any
cache, every token computed); the same prompts asked again must get the same tokens, from
whatever tier still holds their blocks or computed again.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: pip install -e '.[vllm]' "
                                    "(see README, 'vLLM integration')")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from tests.integration.vllm_server import VllmServer  # noqa: E402

KV_BYTES = 16 << 20   # 128 vLLM blocks of 32 tokens: ~3 documents
HOST_BLOCKS = 80      # ~2 documents: the others are in the store only
DOCS, DOC_TOKENS = 8, 1200
FLUSH_S = 60.0


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2000) for _ in range(DOC_TOKENS + rng.randrange(40, 120))]
            for _ in range(DOCS)]


def _flushed(port: int, store_up: bool = True) -> dict[str, Any]:
    """The connector's counters once nothing is in flight (the pump publishes the L3
    writes of an idle engine, and tries failed ones again); with the store down, the
    writes that failed wait (``store_retry``) and are not waited for."""
    from tests.integration.vllm_runner import scrape
    from tests.waiting import holds_within

    z: dict[str, Any] = {}

    def flushed() -> bool:
        z.update(scrape(port))
        return not any(v for k, v in z["in_flight"].items() if store_up or k != "store_retry")

    holds_within(flushed, FLUSH_S, interval=0.2)  # the caller checks what is left
    return z


def _keys(store: Any) -> int:
    """Blocks in the store, once its count held for a second."""
    from tests.waiting import holds_within

    counts: list[int] = []

    def held() -> bool:
        counts.append(store.num_keys())
        return len(counts) > 1 and counts[-1] == counts[-2]

    holds_within(held, FLUSH_S, interval=1.0)
    return counts[-1]


def _events(log_dir: Path, name: str) -> list[dict[str, Any]]:
    from tests.replay_run import events
    from tests.worker.helpers import events_named

    return events_named(events(log_dir), name)


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_store_killed_while_serving_and_back_empty(tmp_path: Path, kind: str) -> None:
    from tests.integration.vllm_runner import build_tiny_llama
    from tests.servers import KillableStore, free_port
    from zkv.log import STORE_RECONNECTED, STORE_UNREACHABLE

    model = build_tiny_llama(str(tmp_path / "model"))
    prompts = _prompts()
    full_blocks = sum(len(p) // 32 for p in prompts)
    port, logs = free_port(), tmp_path / "logs"
    store = KillableStore(kind, str(tmp_path / kind))
    try:
        srv = VllmServer(tmp_path, model, {
            "kv_connector": "ZkvConnector",
            "kv_connector_module_path": "zkv.integrations.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "host_blocks": HOST_BLOCKS, "storage": store.url + "?timeout_s=0.5",
                "log_dir": str(logs), "metrics_port": port, "prefetch_max_ms": 5_000}},
            name="vllm-outage", kv_bytes=KV_BYTES, args=("--skip-tokenizer-init",))
        try:
            srv.wait_ready(300.0)
            cold = [srv.complete(p) for p in prompts]
            z0 = _flushed(port)
            assert z0["computed_tokens"] == sum(map(len, prompts)), z0
            assert _keys(store) >= full_blocks - HOST_BLOCKS, "the documents reach the store"

            store.kill()
            # the store is gone mid-run: every answer the same, from vLLM's cache, zkv's
            # host pool, or computed again where the store held the blocks
            assert [srv.complete(p) for p in prompts] == cold
            z1 = _flushed(port, store_up=False)
            assert z1["disabled"] is None and srv.proc.poll() is None, z1
            waiting = z1["in_flight"]["store_retry"]
            assert waiting > 0, "the blocks whose writes failed wait to be written again"
            down = _events(logs, STORE_UNREACHABLE)
            assert down and all(e["store"].startswith(f"{kind}://") for e in down), down
            assert len(down) <= 4, f"one line per outage, not per op: {len(down)}"
            assert z1["zkv_store_tokens"] == z0["zkv_store_tokens"], z1

            store.restart()  # back, and empty: no request comes, the pump tries again
            z2 = _flushed(port)
            assert not any(z2["in_flight"].values()), z2["in_flight"]
            assert _events(logs, STORE_RECONNECTED), "zkv should say the store is back"
            back = _keys(store)
            assert back >= waiting, f"the waiting blocks were written: {back} of {waiting}"
            assert [srv.complete(p) for p in reversed(prompts)] == cold[::-1]
            _flushed(port)
            # the blocks written since it came back serve the prompts again
            assert [srv.complete(p) for p in prompts] == cold
            z3 = _flushed(port)
            assert z3["zkv_store_tokens"] > z1["zkv_store_tokens"], (z1, z3)
            assert z3["disabled"] is None, z3
        finally:
            code = srv.stop()
        assert code == 0, srv.tail()
    finally:
        store.close()
