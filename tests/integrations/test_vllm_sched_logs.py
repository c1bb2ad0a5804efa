"""The connector's scheduler half keeps its repeating lines bounded: a store that is down
fails the loads of every request vLLM sends, for as long as the outage lasts."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.integrations.test_vllm_rank_loss import Group
from tests.worker.helpers import short_ipc_dir


def test_failed_loads_of_many_requests_are_three_lines_and_a_count_at_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """12 requests whose loads failed (what the manager reports after failed s2h ops): 3
    warning lines, then only counts, written at close (before: a line per request)."""
    with short_ipc_dir() as folder, capture_logs() as logs:
        g = Group(folder)
        try:
            failures: list[dict[str, list[Any]]] = [{f"r{i}": [1, 2]} for i in range(12)]
            monkeypatch.setattr(g.half.cm, "take_load_failures",
                                lambda: failures.pop() if failures else {})
            for _ in range(12):
                g.half.update_connector_output(())
            assert not failures
            lines = [e for e in logs if e["event"] == "connector.load_failed"]
            assert len(lines) == 3 and all(e["log_level"] == "warning" for e in lines)
        finally:
            g.close()
    (summary,) = [e for e in logs if e["event"] == "connector.load_failed" and e.get("summary")]
    assert (summary["num_suppressed"], summary["num_total"]) == (9, 12), summary
