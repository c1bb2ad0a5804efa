"""Run code that imports vLLM in a child process (importing vLLM in the test process would
change it: its warnings, logging and torch settings) and read what it printed last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: A child's prelude: ``stub_connector(eid, extra, vllm_config)``, the scheduler-role
#: ZkvConnector as vLLM builds it up to its start (its ``__init__`` needs a whole
#: VllmConfig; the start reads only what ``vllm_config`` gives), ``plain_vllm_config()``
#: and ``start(conn)``: its start's ConfigError text, or None.
STUB_CONNECTOR = '''
import json, os, subprocess, sys, warnings
from types import SimpleNamespace
warnings.simplefilter("ignore")
from tests.integrations.test_vllm_rank_loss import LAYOUT
from zkv.errors import ConfigError
from zkv.integrations.vllm.config import parse_extra_config
from zkv.integrations.vllm.connector import ZkvConnector
from zkv.integrations.vllm.ipc import ipc_endpoints


def stub_connector(eid, extra, vllm_config):
    conn = object.__new__(ZkvConnector)
    conn.cfg = parse_extra_config({"host_blocks": LAYOUT.num_host_blocks, "storage": "none",
                                   **extra})
    conn.engine_id, conn.world_size, conn.model = eid, 1, LAYOUT.model
    conn.sched = conn.worker = conn._ipc_dir = conn._store = conn._metrics_server = None
    conn._layout = lambda kv: LAYOUT  # (vLLM's KV cache config: not needed here)
    conn._kv_cache_config = SimpleNamespace(kv_cache_layout=None)
    conn._vllm_config = vllm_config
    return conn


def plain_vllm_config():
    """What the start reads of a plain engine's VllmConfig (no layout override, no
    multimodal model, synchronous scheduling, a kv_both role, recompute on a failed load)."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_layout=None),
        model_config=SimpleNamespace(multimodal_config=None),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=True,
                                           kv_load_failure_policy="recompute",
                                           kv_connector_extra_config={}))


def start(conn):
    try:
        conn._start_scheduler(conn._vllm_config)
    except ConfigError as e:
        return str(e)
    return None
'''


def run_child(code: str) -> Any:
    """Run ``code`` with this checkout on the path; the JSON of its last stdout line."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
