"""Drop-in: a producer request running across a cache reset promises nothing."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.integrations.test_vllm_rank_loss import BS, Group
from tests.worker.helpers import short_ipc_dir


def test_a_producer_running_across_a_reset_promises_nothing(tmp_path: Path) -> None:
    with short_ipc_dir() as folder:
        g = Group(folder, store_url=f"file://{tmp_path / 'l3'}")
        try:
            half = g.half
            req = g.request()
            req.kv_transfer_params = {"do_remote_decode": True}
            assert g.ask_until_matched(req)[0] == 0
            blocks = list(range(9))
            half.update_state_after_alloc(req, blocks, 0)
            step = half.build_connector_meta(g.output(new=[(req, blocks, 0, 4 * BS)])).step
            half.update_connector_output((), step=step)  # 4 blocks confirmed, saved
            half.build_connector_meta(g.output(cached=[(req, None, 4 * BS, 1)]))
            assert half.wait_idle(10.0)
            half.reset()  # new weights: its KV so far is of the old ones
            req.num_computed_tokens = req.num_tokens
            req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
            assert half.request_finished(req) == (False, None)
        finally:
            g.close()
